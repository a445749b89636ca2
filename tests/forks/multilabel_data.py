# A multi-label fork's dataset entry, appended to data.py as it is (it uses data.py's names): the
# digits, each labelled with three yes/no facts about its number.
def digit_facts(cfg: Config) -> Source:
    source = digits(cfg)

    def facts(split):
        images, numbers = split
        prime = torch.isin(numbers, torch.tensor([2, 3, 5, 7]))
        labels = torch.stack([numbers % 2 == 0, numbers > 4, prime], 1)
        return images, labels.float()

    return Source(facts(source.train), facts(source.val), ["even", "above_4", "prime"], pad=1)


DATASETS["digit_facts"] = digit_facts
