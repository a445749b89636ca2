# A sequence fork's dataset entry (its task: forks/reversal.py, its model: forks/reversal_model.py),
# appended to data.py as it is (it uses data.py's names): [N, 6] token ids of 5 tokens in, the same tokens
# in reverse order out.
def reversed_tokens(cfg: Config) -> Source:
    g = torch.Generator().manual_seed(5)

    def draw(n: int):
        tokens = torch.randint(0, 5, (n, 6), generator=g)
        return tokens, tokens.flip(1)

    return Source(draw(cfg.synthetic_size), draw(max(cfg.synthetic_size // 4, 1)), list("abcde"))


DATASETS["reversed_tokens"] = reversed_tokens
