"""Networks trained in turn on each batch (a GAN's discriminator, then its generator; an actor, then its
critic): each with its own optimizer and schedule, saved and restored as one state. train.py builds these
only where the model defines turns() (docs/own_code.md); any other model has one optimizer."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from configs import Config, UserError


class Turns:
    """Each network's (name, optimizer, scheduler), in the order they train on a batch. A checkpoint keeps
    them under "optimizer", each by name, so a resume restores every optimizer and schedule bit for bit."""

    def __init__(self, turns: list[tuple[str, torch.optim.Optimizer, object]]):
        self.turns = turns
        self.defaults = turns[0][1].defaults  # one --optimizer for every turn: its state sizes the saves

    def __iter__(self) -> Iterator[tuple[dict, torch.optim.Optimizer, object]]:
        """What train.py's loop steps: the keyword the model and loss hear, the optimizer, its schedule."""
        return iter([({"turn": name}, optimizer, scheduler) for name, optimizer, scheduler in self.turns])

    def register_step_post_hook(self, hook):
        """The last network's step ends a batch's turns: --profile counts batches by it."""
        return self.turns[-1][1].register_step_post_hook(hook)

    def state_dict(self) -> dict:
        return {name: {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
                for name, optimizer, scheduler in self.turns}

    def load_state_dict(self, state: dict) -> None:
        names = [name for name, _, _ in self.turns]
        if list(state) != names:  # resume.restore turns a ValueError into its one line
            raise ValueError(f"the checkpoint's networks in turn are {list(state)}, the model's {names}")
        for name, optimizer, scheduler in self.turns:
            optimizer.load_state_dict(state[name]["optimizer"])
            scheduler.load_state_dict(state[name]["scheduler"])


def first_group(optimizer_state: dict) -> dict:
    """A saved optimizer's first param group; networks in turn: the first network's (what a line shows)."""
    if "param_groups" not in optimizer_state:
        optimizer_state = next(iter(optimizer_state.values()))["optimizer"]
    return optimizer_state["param_groups"][0]


def networks(model: nn.Module, cfg: Config, world_size: int) -> dict[str, nn.Module]:
    """model.turns(): each network by name, in the order they train; refused in one line unless every
    trainable parameter is in exactly one of them, and under torchrun (DDP would need find_unused_parameters:
    a turn leaves the other network's parameters without gradients), --compile (its forward takes no turn)
    and --throughput (it counts one forward and backward a step)."""
    name = type(model).__name__
    if world_size > 1:
        raise UserError(f"{name} trains networks in turn (its turns()), which runs in one process here: "
                        "train it without torchrun")
    if cfg.compile != "off" or cfg.throughput:
        flag = f"--compile {cfg.compile}" if cfg.compile != "off" else "--throughput"
        raise UserError(f"{name} trains networks in turn (its turns()), which {flag} does not take: train it "
                        f"without {flag}")
    turns = dict(model.turns())
    owners = {}
    for turn, network in turns.items():
        for p in network.parameters():
            owners.setdefault(p, []).append(turn)
    trainable = [p for p in model.parameters() if p.requires_grad]
    shared = sorted({" and ".join(owner) for p, owner in owners.items() if len(owner) > 1})
    left = sum(p.numel() for p in trainable if p not in owners)
    if not turns or shared or left:
        why = (f"{', '.join(shared)} share parameters" if shared else f"{left:,} trainable parameters are in "
               "none of them" if turns else "it names no network")
        raise UserError(f"{name}.turns() must give each trainable parameter to exactly one network, and "
                        f"{why}: return {{name: module}} for the networks that train in turn")
    return turns
