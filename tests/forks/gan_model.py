# A GAN fork's model entry (its task: forks/gan.py), inserted into models.py before MODELS as it is (it
# uses models.py's names): a generator and a discriminator of 8x8 images, trained in turn on each batch.
class GAN(nn.Module):
    """turns(): the discriminator's step, then the generator's, each with its own optimizer and schedule.
    In the discriminator's turn (and in eval mode) the forward gives its logits for the real images, then
    for as many generated ones, [2N, 1]; in the generator's, its logits for generated images, [N, 1]."""

    def __init__(self, channels: int, num_outputs: int, width: int = 32, dropout: float = 0.0):
        super().__init__()  # 8x8 images of `channels`; one logit, real or generated, whatever num_outputs
        self.noise, pixels = 16, channels * 64
        self.generator = nn.Sequential(nn.Linear(self.noise, 2 * width), nn.ReLU(),
                                       nn.Linear(2 * width, pixels), nn.Unflatten(1, (channels, 8, 8)))
        self.discriminator = nn.Sequential(nn.Flatten(), nn.Linear(pixels, 2 * width), nn.LeakyReLU(0.2),
                                           *head_dropout(dropout), nn.Linear(2 * width, 1))

    def turns(self) -> dict[str, nn.Module]:
        return {"discriminator": self.discriminator, "generator": self.generator}

    def forward(self, images: torch.Tensor, turn: str | None = None) -> torch.Tensor:
        fake = self.generator(torch.randn(len(images), self.noise, device=images.device))
        if turn == "generator":
            return self.discriminator(fake)
        return torch.cat([self.discriminator(images), self.discriminator(fake.detach())])
