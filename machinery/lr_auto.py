"""--lr auto: the rate `python lr_find.py` saved in --out-dir/lr_find.json, if its sweep measured this run's
setup and task; else one line with the command that measures it."""

from __future__ import annotations

import json
import math
from pathlib import Path

from configs import Config, UserError, command_line
from configs.resolve import KEEPS_LR, differences
from machinery import processes
from machinery.checkpoints import task_identity

# lr_find.png's text chunk naming its sweep, as lr_find.json's "sweep" does: lr_find.PNG_SWEEP_KEY, copied
# so that lr_find.py stays a file of its own (tests/test_handoffs.py checks the two are one).
PNG_SWEEP_KEY = "lr_find sweep"


def resolve_lr(cfg: Config, task, optimizers: dict) -> float:
    """The rate a run trains with: a number as given; for --lr auto, lr_find.json's suggestion for this
    schedule (onecycle's peak, the others' starting rate) if it was measured on this setup and task (task:
    its module; optimizers: models.OPTIMIZERS, which says what settings each optimizer reads)."""
    if cfg.lr != "auto":
        return float(cfg.lr)
    path = Path(cfg.out_dir) / "lr_find.json"
    refind = command_line("lr_find.py", cfg, leave_out=("lr", "epochs", "log_every", "save_every"))
    others = "or pass a number such as --lr 0.1"
    if not path.is_file():
        raise UserError(f"--lr auto needs {path}, which does not exist; run `{refind}` first, {others}")
    try:
        record = json.loads(path.read_text())
        measured_on, families = dict(record["config"]), dict(record.get("suggestions") or {})
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"{path} is not a sweep lr_find.py wrote ({type(err).__name__}); run `{refind}`, "
                        f"{others}") from None
    # momentum counts only between sweeps of optimizers that read it
    read = {s for name in (measured_on.get("optimizer"), cfg.optimizer) if name in optimizers
            for s in optimizers[name].settings}
    unread = tuple(s for entry in optimizers.values() for s in entry.settings if s not in read)
    diffs = differences(measured_on, cfg, KEEPS_LR, unread)
    swept, here = measured_on.get("task"), task_identity(task)
    if swept != here:  # the loss is code, not a setting: an edited task.py needs a new sweep
        diffs.append(f"task: {swept} -> {here}")
    serving = [f for f in families.values() if isinstance(f, dict) and cfg.schedule in f.get("schedules", [])]
    if not serving:
        diffs.append(f"schedule: none of its suggestions serves {cfg.schedule!r}")
    if diffs:
        raise UserError(f"{path} was measured on another setup ({'; '.join(diffs)}): its rate does "
                        f"not carry over; measure this one's with `{refind}`, {others}")
    suggestion, rule = serving[0].get("lr"), serving[0].get("method")
    if type(suggestion) not in (int, float) or not 0 < suggestion < math.inf:
        raise UserError(f"{path} holds no usable suggestion for --schedule {cfg.schedule} ({suggestion!r}); "
                        f"run `{refind}` with a wider --find-start-lr/--find-end-lr, {others}")
    what = "its peak" if cfg.schedule == "onecycle" else "its starting rate"
    processes.say(f"lr auto: {suggestion:.4g} from {path}, the suggestion for --schedule {cfg.schedule} "
                  f"({what}, rule {rule})")
    picture = path.with_name("lr_find.png")
    if picture.is_file() and "sweep" in record and png_text(picture).get(PNG_SWEEP_KEY) != record["sweep"]:
        processes.say(f"lr auto: {picture} is not the picture of this sweep (a sweep stopped between writing "
                      f"the two, or a file was copied over); the rate above is {path}'s: run `{refind}` to "
                      "draw both again")
    return float(suggestion)


def png_text(path: Path) -> dict[str, str]:
    """A PNG file's text chunks (keyword: text); {} if it is no PNG or cannot be read."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            return dict(getattr(image, "text", {}))
    except (OSError, SyntaxError, ValueError):  # PIL's decoders raise these on a damaged file
        return {}
