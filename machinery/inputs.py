"""Inputs as a model takes them: one tensor, or a tuple or dict of tensors (several inputs per example:
an image and a table, two views), each with a row per example. The model gets them as one argument,
`model(inputs)`, and unpacks them itself; everything here keeps their structure and treats each member
as it would one tensor. A member's key is its position or dict key; None where the inputs are one tensor."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from configs import UserError, first_line


def members(inputs) -> dict:
    """Each input tensor by its key ({None: inputs} for one tensor); a DataLoader's list is a tuple's, and
    any mapping (a tokenizer's BatchEncoding) a dict's."""
    if isinstance(inputs, torch.Tensor):
        return {None: inputs}
    found = dict(inputs) if isinstance(inputs, Mapping) else dict(enumerate(inputs)) if isinstance(
        inputs, (tuple, list)) else {None: inputs}
    if not found:
        raise UserError("the inputs are an empty tuple or dict: give the model at least one tensor")
    for key, t in found.items():
        if not isinstance(t, torch.Tensor):
            raise UserError(f"the {named(key)} are a {type(t).__name__}: give the model a tensor, or a tuple "
                            "or dict of tensors (one row per example in each)")
    return found


def each(fn: Callable, inputs):
    """The inputs with fn(key, tensor) in place of each member, in the same structure (a tuple for a list)."""
    done = {key: fn(key, t) for key, t in members(inputs).items()}
    if isinstance(inputs, torch.Tensor):
        return done[None]
    return done if isinstance(inputs, Mapping) else tuple(done.values())


def take(inputs, index):
    """The rows `index` (a slice, or a tensor of positions) of every member."""
    if isinstance(inputs, torch.Tensor):
        return inputs[index]
    return each(lambda _, t: t[index], inputs)


def joined(parts: list):
    """Several batches' inputs as one, row after row (torch.cat member by member)."""
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return each(lambda key, _: torch.cat([members(part)[key] for part in parts]), parts[0])


class Examples(torch.utils.data.Dataset):
    """Tensor inputs and targets (of any structure here), row by row: TensorDataset's, for workers."""

    def __init__(self, inputs, targets):
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return rows(self.targets)

    def __getitem__(self, index: int):
        return take(self.inputs, index), take(self.targets, index)


class ExamplesDiffer(UserError):
    """A batch of examples of different shapes, which torch's default_collate cannot stack. From a DataLoader
    worker it arrives with the worker's traceback as text: its last line is ours."""

    def __init__(self, message: str):
        worker = "Original Traceback" in message
        super().__init__(message.rstrip().splitlines()[-1].split(": ", 1)[-1] if worker else message)


def stacked(examples: list):
    """A Dataset's examples as one batch, as torch's default_collate makes it (the batches of a Source that
    gives no collate of its own); examples of different shapes are one line, not torch's stack error."""
    try:
        return torch.utils.data.default_collate(examples)
    except RuntimeError as err:
        if "equal size" not in str(err):
            raise
        shapes = str(err).partition("but got ")[2] or first_line(err)
        raise ExamplesDiffer(f"a batch's examples differ in shape ({shapes}): pad them to one shape in the "
                             "dataset (variable lengths: with their lengths as a second input), or give its "
                             "Source a collate=FUNCTION that batches them (docs/your_data.md)") from None


def rows(inputs) -> int:
    """The examples the inputs hold: every member's rows, which contract.check_splits makes equal."""
    return len(next(iter(members(inputs).values())))


def total_bytes(inputs) -> int:
    return sum(t.nbytes for t in members(inputs).values())


def named(key) -> str:
    """How start-up lines and refusals name a member: inputs, inputs[0], inputs['image']."""
    return "inputs" if key is None else f"inputs[{key!r}]"


def described(inputs, *, example: bool = False) -> str:
    """Each member's shape and dtype, "[2, 1, 8, 8] float32" or "[2, 3, 32, 32] float32 + [2, 12] float32"
    (`example`: shapes of one example, without the row: "1x8x8")."""
    def one(t: torch.Tensor) -> str:
        shape = "x".join(map(str, t.shape)) if example else str(list(t.shape))
        return f"{shape} {str(t.dtype).removeprefix('torch.')}"

    return " + ".join(one(t) for t in members(inputs).values())
