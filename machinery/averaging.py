"""evaluate.py --average: the weights of the checkpoints --keep-best kept (machinery/kept_best.py), averaged
in float64, with BatchNorm's statistics recomputed on the training split: a mean of weights is not a mean
of the statistics those weights would make. Imported only for --average."""

from __future__ import annotations

import torch
from torch.optim.swa_utils import update_bn

from configs import UserError
from configs.resolve import MAY_CHANGE_ON_RESUME
from machinery.checkpoints import weights_of


def averaged_weights(states: list[dict]) -> dict:
    """Each floating-point tensor of the checkpoints' weights (weights_of: the --ema average where one was
    kept) as their mean, summed in float64, back in its own dtype; any other tensor (BatchNorm's batch
    counts) as the first checkpoint's."""
    weights = [weights_of(state) for state in states]
    first = weights[0]
    if any(w.keys() != first.keys() or any(w[k].shape != first[k].shape for k in first) for w in weights):
        raise UserError("the kept checkpoints hold different models (their weights' names or shapes "
                        "differ); average the checkpoints of one run")
    return {key: torch.stack([w[key].double() for w in weights]).mean(0).to(value.dtype)
            if value.is_floating_point() else value.clone() for key, value in first.items()}


def check_one_run(kept: list[dict], best: dict, best_path) -> None:
    """Every kept file (kept_best.read_ranking's entries) is of the run of `best` (--checkpoint), and of its
    config (what a resume may change aside); else one line naming the first that is not."""
    run_id = best.get("run", {}).get("run_id")
    same = {k: v for k, v in best["config"].items() if k not in MAY_CHANGE_ON_RESUME}
    for entry in kept:
        state = entry["state"]
        if state.get("run", {}).get("run_id") != run_id:
            raise UserError(f"{entry['file']} is of another run ({state.get('run', {}).get('run_id')}) "
                            f"than {best_path} ({run_id}): average one run's checkpoints; move it away")
        config = {k: v for k, v in state["config"].items() if k not in MAY_CHANGE_ON_RESUME}
        if config != same:
            differ = sorted(k for k in same.keys() | config.keys() if same.get(k) != config.get(k))
            raise UserError(f"{entry['file']} was trained with another config than {best_path} "
                            f"({', '.join(differ[:4])} differ): average the checkpoints of one run")


def recompute_batchnorm(model: torch.nn.Module, train_batches) -> None:
    """BatchNorm's running statistics of `model`, measured again over one pass of the training split
    (torch.optim.swa_utils.update_bn); a model without BatchNorm is left as it is."""
    update_bn(([inputs] for inputs, _ in train_batches.epoch(0)), model)  # a list: update_bn takes its [0]
