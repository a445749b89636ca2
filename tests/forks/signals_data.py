# A 1-D fork's dataset entry, appended to data.py as it is (it uses data.py's names): float signals
# [N, 1, 256], each a noisy sine wave whose frequency (one of four) is its class.
def waves(cfg: Config) -> Source:
    g = torch.Generator().manual_seed(3)
    t = torch.linspace(0, 1, 256)

    def draw(n: int):
        labels = torch.randint(0, 4, (n,), generator=g)
        phase = torch.rand(n, 1, generator=g) * 6.28
        noise = 0.3 * torch.randn(n, 256, generator=g)
        signals = torch.sin(6.28 * (2 + 3 * labels[:, None]) * t + phase) + noise
        return signals.unsqueeze(1), labels

    names = ["2 Hz", "5 Hz", "8 Hz", "11 Hz"]
    return Source(draw(cfg.synthetic_size), draw(max(cfg.synthetic_size // 4, 1)), names)


DATASETS["waves"] = waves
