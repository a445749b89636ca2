"""Weights from elsewhere into a model: a checkpoint's (--init-from, evaluate.py, best.pt for the
test pass), a plain state_dict, or torchvision's pretrained ones (--pretrained), downloaded once.

A classifier head for another number of classes keeps its fresh initialization where a new run asks for
it; any other mismatch is one line that names the tensors.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from configs import UserError
from machinery.checkpoints import load_checkpoint, weights_of
from machinery.files import downloading


def load_weights(model: nn.Module, state: dict, num_outputs: int, source: str,
                 hint: str = "", new_head: bool = True) -> str:
    """Copy the weights in `state` (a checkpoint or a state_dict: weights_of) into `model`. A classifier
    head for another number of classes (tensors whose first dimension alone differs, num_outputs
    here) keeps its fresh initialization when `new_head`; any other difference is one UserError
    line. Returns what happened to the head."""
    own, weights = model.state_dict(), weights_of(state)
    head = [k for k in own.keys() & weights.keys() if isinstance(weights[k], torch.Tensor)
            and own[k].shape != weights[k].shape and own[k].shape[0] == num_outputs
            and own[k].shape[1:] == weights[k].shape[1:]]
    old = {weights[k].shape[0] for k in head}
    if not new_head or len(old) != 1:
        head = []
    problems = [f"missing {k}" for k in own.keys() - weights.keys()]
    problems += [f"unexpected {k}" for k in weights.keys() - own.keys()]
    problems += [f"{k} {_shape(weights[k])} there, {_shape(own[k])} here"
                 for k in own.keys() & weights.keys() if k not in head
                 and (not isinstance(weights[k], torch.Tensor) or weights[k].shape != own[k].shape)]
    if problems:
        more = f" and {len(problems) - 4} more" if len(problems) > 4 else ""
        raise UserError(f"{source} does not fit the model built here ({'; '.join(sorted(problems)[:4])}"
                        f"{more}){'; ' + hint if hint else ''}; build the model it was saved from "
                        "(--model, --width, --channels)")
    model.load_state_dict({k: own[k] if k in head else weights[k] for k in own})  # the head keeps its own
    if not head:
        return ""
    layers = sorted({k.rsplit(".", 1)[0] for k in head})
    return f"classifier head {', '.join(layers)} re-initialised for {num_outputs} classes (was {old.pop()})"


def _shape(value) -> str:
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def starting_weights(model: nn.Module, cfg, channels: int, num_outputs: int) -> list[str]:
    """A new run's weights from elsewhere: --pretrained (into the torchvision model inside any channel
    adapter), then --init-from; what was done, to be said at start-up."""
    said = []
    if cfg.pretrained:
        said.append(pretrained(model[-1] if channels != 3 else model, cfg.model, num_outputs))
    if cfg.init_from:
        said.append(init_from(model, cfg.init_from, num_outputs))
    return said


def init_from(model: nn.Module, path: str, num_outputs: int) -> str:
    """--init-from: a new run starts from the weights in a best.pt, last.pt or state_dict file; what was
    done, to be said at start-up."""
    if not Path(path).is_file():
        raise UserError(f"--init-from {path}: no such file (a best.pt, last.pt or state_dict)")
    state = load_checkpoint(path)
    saved = state.get("config")  # ours says what it was trained as
    hint = f"it holds {saved.get('model')} width {saved.get('width')}" if isinstance(saved, dict) else ""
    head = load_weights(model, state, num_outputs, f"--init-from {path}", hint)
    return f"weights from {path}" + (f"; {head}" if head else "")


def pretrained(model: nn.Module, name: str, num_outputs: int) -> str:
    """--pretrained: torchvision's default weights for the model `name`, from $TORCH_HOME/hub/checkpoints as
    torchvision keeps them (downloaded there first if missing), loaded with weights_only=True; what was
    done, to be said at start-up."""
    import torchvision

    weights = torchvision.models.get_model_weights(name).DEFAULT
    folder = Path(torch.hub.get_dir()) / "checkpoints"
    file = folder / weights.url.split("/")[-1]  # torchvision's URLs end in the file's name
    failed = (f"--pretrained needs {file.name} and could not download it ({{reason}}); without network, "
              f"copy it from {weights.url} into {folder} ($TORCH_HOME/hub/checkpoints)")
    with downloading(folder, failed) as allowed:
        if not file.is_file() and allowed:
            folder.mkdir(parents=True, exist_ok=True)
            digest = torch.hub.HASH_REGEX.search(file.name)  # torchvision checks it too
            torch.hub.download_url_to_file(weights.url, str(file), digest and digest.group(1), progress=False)
    described = f"{type(weights).__name__}.{weights.name}"
    head = load_weights(model, load_checkpoint(file), num_outputs, f"--pretrained {described}")
    return f"pretrained weights: torchvision's {described}" + (f"; {head}" if head else "")
