# A 1-D fork's model entry, inserted into models.py before MODELS as it is (it uses models.py's names).
class Conv1dNet(nn.Sequential):
    """Two strided 1-D convolutions, then a linear classifier: for [C, L] signals."""

    def __init__(self, channels: int, num_outputs: int, width: int = 32, dropout: float = 0.0):
        stages = [nn.Conv1d(channels, width, 9, stride=4, padding=4), nn.BatchNorm1d(width), nn.ReLU(),
                  nn.Conv1d(width, width, 9, stride=4, padding=4), nn.BatchNorm1d(width), nn.ReLU()]
        head = [nn.AdaptiveAvgPool1d(1), nn.Flatten(), *head_dropout(dropout), nn.Linear(width, num_outputs)]
        super().__init__(*stages, *head)  # as models.py's own: lists, not one call of ten layers
