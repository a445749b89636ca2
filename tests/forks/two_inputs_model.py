# A fork's model for examples of two inputs, inserted into models.py before MODELS as it is (it uses
# models.py's names). It gets them as one argument, (image, table) or {"image": ..., "table": ...}, and
# unpacks them itself; `channels` is the first input's (the image's), the table's 4 numbers it knows.
class TwoInputNet(nn.Module):
    """A convolution over the image, pooled to 2x2 (which half is bright), and a layer over the table,
    joined before the classifier. No BatchNorm: under torchrun it trains exactly as one process."""

    def __init__(self, channels: int, num_outputs: int, width: int = 32, dropout: float = 0.0):
        super().__init__()
        self.image = nn.Sequential(nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(),
                                   nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.table = nn.Sequential(nn.Linear(4, width), nn.ReLU())
        self.head = nn.Sequential(*head_dropout(dropout), nn.Linear(5 * width, num_outputs))

    def forward(self, inputs) -> torch.Tensor:
        image, table = (inputs["image"], inputs["table"]) if isinstance(inputs, dict) else inputs
        return self.head(torch.cat([self.image(image), self.table(table)], 1))
