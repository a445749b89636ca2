# A binned regression fork's dataset entry, appended to data.py as it is (it uses data.py's names): 8x8
# uint8 images whose brightness, in [0, 1), is the one float target; ten outputs, one per bin.
def brightness(cfg: Config) -> Source:
    g = torch.Generator().manual_seed(11)

    def draw(n: int):
        level = torch.rand(n, generator=g)
        noise = torch.randint(0, 30, (n, 1, 8, 8), generator=g)
        return (level.view(n, 1, 1, 1) * 200 + noise).to(torch.uint8), level

    return Source(draw(cfg.synthetic_size), draw(max(cfg.synthetic_size // 4, 1)),
                  [f"bin {k}" for k in range(10)])


DATASETS["brightness"] = brightness
