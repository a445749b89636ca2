"""Stand-ins for the client code that lr_find.py and schedules.py get copied into (issue 23), so the
tests need neither transformers nor accelerate. Each copies the one behaviour that matters here:

- ``TokenClassifier`` and ``BatchEncoding``: a Hugging Face model called as ``model(**batch)`` that
  returns an output with ``.loss``, and the tokenizer's batch, a ``UserDict`` with its own ``.to``;
- ``TwoInputNet``: a model fed ``(x, y, extra)`` batches;
- ``AcceleratedOptimizer`` and ``GradientState``: accelerate's wrapper, which keeps the torch
  optimizer in ``.optimizer``, skips ``step()`` while ``gradient_state.sync_gradients`` is False,
  and reports an overflow of its own scaler as ``step_was_skipped``;
- ``NoisyImages``: a dataset whose augmentation draws from the RNG of the worker that loads it.
"""

from __future__ import annotations

from collections import UserDict
from dataclasses import dataclass

import torch
from torch import nn

F = nn.functional


@dataclass
class ModelOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class TokenClassifier(nn.Module):
    """Embeds tokens, averages them where the attention mask is 1, classifies the sequence."""

    def __init__(self, vocab: int = 50, classes: int = 3, width: int = 8):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, width), nn.Linear(width, classes)

    def forward(self, input_ids, attention_mask, labels=None) -> ModelOutput:
        mask = attention_mask.unsqueeze(-1).float()
        logits = self.head((self.embed(input_ids) * mask).sum(1) / mask.sum(1))
        return ModelOutput(None if labels is None else F.cross_entropy(logits, labels), logits)


class BatchEncoding(UserDict):
    """As transformers' BatchEncoding: a mapping whose ``.to(device)`` moves its tensors and returns
    itself. ``moved_to`` records the calls."""

    def __init__(self, data: dict):
        super().__init__(data)
        self.moved_to: list[torch.device] = []

    def to(self, device):
        self.moved_to.append(torch.device(device))
        self.data = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.data.items()}
        return self


def token_batches(n: int = 6, size: int = 16, seed: int = 0, encoding=dict) -> list:
    """Sequences of 5 tokens whose class is the most frequent token's third (a task that can be
    learnt), with a padding mask; each batch a dict (or BatchEncoding) with labels."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        ids = torch.randint(0, 45, (size, 5), generator=g)
        mask = torch.ones(size, 5, dtype=torch.long)
        mask[:, -1] = torch.randint(0, 2, (size,), generator=g)
        batches.append(encoding({"input_ids": ids, "attention_mask": mask,
                                 "labels": ids.mode(1).values // 15}))
    return batches


class TwoInputNet(nn.Module):
    """A model with a second input: ``model(x, extra)``."""

    def __init__(self):
        super().__init__()
        self.body, self.gate = nn.Linear(6, 3), nn.Linear(2, 3)

    def forward(self, x, extra):
        return self.body(x) * torch.sigmoid(self.gate(extra))


def triple_batches(n: int = 6, size: int = 16, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x, extra = torch.randn(size, 6, generator=g), torch.randn(size, 2, generator=g)
        out.append((x, (x[:, :3] * extra[:, :1]).argmax(1), extra))
    return out


class GradientState:
    sync_gradients = True


class AcceleratedOptimizer(torch.optim.Optimizer):
    """accelerate's wrapper: no Optimizer.__init__ of its own, the torch optimizer's state, groups
    and defaults seen through properties, and a step() that does nothing between gradient syncs.
    With ``scaler`` it steps through it and reports an overflow as ``step_was_skipped``."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler=None):
        self.optimizer, self.scaler, self.gradient_state = optimizer, scaler, GradientState()
        self._is_overflow = False

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def defaults(self):
        return self.optimizer.defaults

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none=True):
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        if self.gradient_state.sync_gradients:
            if self.scaler is not None:
                before = self.scaler.get_scale()
                self.scaler.step(self.optimizer, closure)
                self.scaler.update()
                self._is_overflow = self.scaler.get_scale() < before
            else:
                self.optimizer.step(closure)

    @property
    def step_was_skipped(self):
        return self._is_overflow


class NoisyImages(torch.utils.data.Dataset):
    """Fixed images plus noise drawn, as a random augmentation is, from the loading worker's RNG."""

    def __init__(self, n: int = 40, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, 3, 4, 4, generator=g), torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(3, 4, 4), self.y[i]
