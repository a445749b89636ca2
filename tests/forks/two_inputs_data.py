# A fork's dataset entries whose examples have two inputs, appended to data.py as they are (they use
# data.py's names): an 8x8 uint8 image and a table of 4 numbers. The class needs both: the image says
# which half is bright, the table's first number's sign says the rest (2 x 2 = 4 classes). The same
# examples as a tuple (image, table), a dict {"image", "table"}, and a Dataset of ((image, table), label).
def image_and_table(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 4, (n,), generator=g)
    images = torch.randint(0, 80, (n, 1, 8, 8), generator=g).to(torch.uint8)
    left = (labels // 2 == 1)[:, None, None, None] & (torch.arange(8) < 4)
    images += (torch.where(left, 120, 0) + torch.where(~left & ~(labels // 2 == 1)[:, None, None, None]
                                                        & (torch.arange(8) >= 4), 120, 0)).to(torch.uint8)
    table = torch.randn(n, 4, generator=g)
    table[:, 0] = torch.where(labels % 2 == 1, 1.0, -1.0) * (0.5 + table[:, 0].abs())
    return images, table, labels


def pair_splits(cfg: Config) -> tuple:
    n = cfg.synthetic_size
    return image_and_table(n, 1), image_and_table(max(n // 4, 8), 2), image_and_table(max(n // 4, 8), 3)


def pairs(cfg: Config) -> Source:
    """The tuple form, its val split --val-fraction of the training examples held out (each input indexed
    alike), and a test split."""
    images, table, labels = image_and_table(cfg.synthetic_size * 5 // 4, 1)
    train, val = hold_out(labels, cfg.val_fraction, "pairs")
    test_images, test_table, test_labels = image_and_table(max(cfg.synthetic_size // 4, 8), 3)
    return Source(((images[train], table[train]), labels[train]), ((images[val], table[val]), labels[val]),
                  list("ABCD"), test=((test_images, test_table), test_labels), pad=1)


def pairs_dict(cfg: Config) -> Source:
    (a, b, y), (va, vb, vy), _ = pair_splits(cfg)
    return Source(({"image": a, "table": b}, y), ({"image": va, "table": vb}, vy), list("ABCD"), pad=1)


class PairDataset(torch.utils.data.Dataset):
    """((image, table), label) items, as a Dataset that reads files would give them."""

    def __init__(self, images: torch.Tensor, table: torch.Tensor, labels: torch.Tensor):
        self.images, self.table, self.labels = images, table, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return (self.images[i], self.table[i]), self.labels[i]


def pairs_dataset(cfg: Config) -> Source:
    (a, b, y), (va, vb, vy), _ = pair_splits(cfg)
    stats = (torch.tensor([0.35]), torch.tensor([0.25]))  # a Dataset's images: their mean and std given
    return Source(PairDataset(a, b, y), PairDataset(va, vb, vy), list("ABCD"), pad=1, stats=stats)


DATASETS["pairs"] = pairs
DATASETS["pairs_dict"] = pairs_dict
DATASETS["pairs_dataset"] = pairs_dataset
