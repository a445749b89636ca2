# A sequence fork's model entry, inserted into models.py before MODELS as it is (it uses models.py's names).
class Reverser(nn.Module):
    """Each position's token read from the whole sequence: logits [N, tokens, T] in training; in eval mode
    the likeliest token at each position, ids [N, T], as a greedy decode gives them."""

    def __init__(self, channels: int, num_outputs: int, width: int = 32, dropout: float = 0.0):
        super().__init__()  # channels: the sequence's length T, [N, T] ids; num_outputs: the tokens
        self.length, self.tokens = channels, num_outputs
        self.embed = nn.Embedding(num_outputs, width)
        self.mix = nn.Sequential(nn.Flatten(), *head_dropout(dropout),
                                 nn.Linear(channels * width, channels * num_outputs))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.mix(self.embed(ids)).view(-1, self.tokens, self.length)
        return logits if self.training else logits.argmax(1)
