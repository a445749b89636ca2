# A fork's model entry, inserted into models.py as it is (it uses models.py's names): no BatchNorm, so
# that a batch split over micro-batches or processes steps exactly as the whole batch does.
class PooledMLP(nn.Sequential):
    """Average-pool images to 4x4, then two linear layers."""

    def __init__(self, channels: int, num_outputs: int, width: int = 32, dropout: float = 0.0):
        super().__init__(nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(16 * channels, width), nn.ReLU(),
                         *head_dropout(dropout), nn.Linear(width, num_outputs))
