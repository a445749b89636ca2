"""A trained model as one file another runtime loads (evaluate.py --export): ONNX through torch.onnx's
dynamo exporter, or a torch.export program (.pt2). The steps the run's evaluation gave its inputs on the
device go inside the graph (images: to float32, a model's resize, normalization from 0..255), so the file
takes uint8 images [N, C, H, W] as --predict reads them from files, other inputs as the dataset gives
them, with a dynamic batch axis. The file is written beside its name, run against the PyTorch model on
the split's examples, and kept only if they agree; any failure is one line, and leaves no file."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F

from configs import UserError, first_line
from machinery.inputs import joined, members, take

FORMATS = (".onnx", ".pt2")
TOLERANCE = 1e-4  # fp32: the largest difference allowed, per unit of the outputs' largest size over 1
CHECKED = 256  # the split's first examples the check runs, in one batch; then in batches of 1 and 7
ODD_BATCH = 7


@contextlib.contextmanager
def staged(target: Path) -> Iterator[Path]:
    """A path to write the export to, in a new folder beside `target` (its files keep their names: an
    ONNX weights sidecar names its model file); moved to `target`'s folder when the block ends well, and
    removed whatever happens. Refused first: an unknown suffix, a folder that is not there or not
    writable, a package not installed."""
    if target.suffix not in FORMATS:
        raise UserError(f"--export {target}: {target.suffix or 'no suffix'} is no format here; name the "
                        "file model.onnx (ONNX, for onnxruntime) or model.pt2 (torch.export.load)")
    if target.suffix == ".onnx":
        try:  # torch.onnx's dynamo exporter needs onnx and onnxscript, the check onnxruntime
            import onnx  # noqa: F401
            import onnxruntime  # noqa: F401
            import onnxscript  # noqa: F401
        except ImportError as err:
            raise UserError(f"--export .onnx needs {err.name}, not installed here: pip install onnx "
                            "onnxscript onnxruntime") from None
    if target.is_dir():
        raise UserError(f"--export {target}: a folder; give a file name, {target / 'model'}{target.suffix}")
    try:
        folder = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    except OSError as err:
        raise UserError(f"--export {target}: cannot write in {target.parent} ({err.strerror or err}); give a "
                        "path in a folder that exists and that you may write to") from None
    try:
        yield folder / target.name
        for file in sorted(folder.iterdir(), key=lambda f: f.name == target.name):  # the model file last
            os.replace(file, target.parent / file.name)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class Deployed(torch.nn.Module):
    """The model with its inputs' steps in front, as the batches apply them, op for op: each input
    (a tensor, or each member of a tuple or dict, in order) is one argument; image inputs (uint8) go to
    float32, to the model's size (bilinear) and are normalized as x * scale - shift, the others floated
    where they are floating point."""

    def __init__(self, model: torch.nn.Module, batches, inputs):
        super().__init__()
        self.model, self.keys = model, list(members(inputs))
        self.form = "tensor" if isinstance(inputs, torch.Tensor) else "dict" if isinstance(
            inputs, Mapping) else "tuple"
        self.images, steps = {}, batches.image_steps()  # argument position: (resize, channels_last)
        for i, key in enumerate(self.keys):
            if key in steps:
                image, scale, shift = steps[key]
                self.images[i] = (image.resize, image.channels_last)
                self.register_buffer(f"scale{i}", scale.cpu())
                self.register_buffer(f"shift{i}", shift.cpu())

    def forward(self, *inputs: torch.Tensor):
        prepared = [self.prepared(i, x) for i, x in enumerate(inputs)]
        if self.form == "tensor":
            return self.model(prepared[0])
        if self.form == "dict":
            return self.model(dict(zip(self.keys, prepared, strict=True)))
        return self.model(tuple(prepared))

    def prepared(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if i not in self.images:
            return x.float() if x.is_floating_point() else x
        resize, channels_last = self.images[i]
        memory = torch.channels_last if channels_last else torch.contiguous_format
        x = x.to(dtype=torch.float32, memory_format=memory)
        if resize:
            x = F.interpolate(x, (resize,) * 2, mode="bilinear").contiguous(memory_format=memory)
        return x.mul(getattr(self, f"scale{i}")).sub(getattr(self, f"shift{i}"))


def export_model(model: torch.nn.Module, batches, path: Path, metadata: dict, *, classes: bool) -> str:
    """`model` (in eval mode, on the CPU) with `batches`' input steps inside, written to `path` (.onnx or
    .pt2) with `metadata` (a name to a JSON-able value; the inputs and outputs are added), then checked
    against the PyTorch model on the split's first CHECKED examples (`classes`: the top class must agree
    too); the line that says what was written and what the check found."""
    n = min(CHECKED, batches.num_examples)
    raw = batches.raw(n)  # the examples as the split holds them (a Dataset's by its collate), unprepared
    one_shape(raw, batches.raw(1))
    with torch.no_grad():
        reference = members(model(batches.first(n)[0]))  # as the run's evaluation computes them
    deployed = Deployed(model, batches, batches.first(2)[0]).eval()
    example = take(raw, slice(0, 2)) if n >= 2 else joined([raw, raw])  # a batch of 1 fixes the axis at 1
    arguments, names = tuple(members(example).values()), (graph_names(deployed.keys, "inputs", deployed),
                                                           graph_names(list(reference), "outputs"))
    metadata = {**metadata, "outputs": names[1],
                "inputs": {name: described(t) for name, t in zip(names[0], arguments, strict=True)}}
    started = time.perf_counter()
    with torch.no_grad(), quiet():
        written = write(deployed, arguments, path, names, metadata)
    exported = time.perf_counter() - started
    run, speed = runner(path, names[0])
    said, checked = check(run, raw, reference, classes), time.perf_counter() - started - exported
    size = sum(f.stat().st_size for f in path.parent.iterdir()) / 2**20
    ours, theirs = speed(raw, deployed), speed(raw, run)
    tool = "onnxruntime" if path.suffix == ".onnx" else "torch.export.load"
    return (f"{written}, {size:.1f} MiB, made in {exported:.1f} s; checked in {checked:.2f} s with {tool} "
            f"against PyTorch on the split's first {n} examples (batches of {n}, 1 and {ODD_BATCH}): {said}; "
            f"{theirs * 1e3:.3f} ms an example (PyTorch {ours * 1e3:.3f} ms)")


def one_shape(batch, alone) -> None:
    """Refused in one line: batches whose shapes past the batch axis change with their examples (a collate
    that pads each batch to its own longest clip), as the file would take the traced shape only."""
    changed = [(key, list(a.shape), list(b.shape)) for (key, a), b in zip(
        members(alone).items(), members(batch).values(), strict=True) if a.shape[1:] != b.shape[1:]]
    if changed:
        key, first, first_n = changed[0]
        name = graph_names([key], "inputs")[0]
        raise UserError(f"--export: the data's batches change shape with their examples ({name} {first} for "
                        f"the first example alone, {first_n} for the first {first_n[0]}), and the file would "
                        "take one shape only; pad every batch to one shape in the Source's collate "
                        "(docs/your_data.md's `padded`), or export the model in your own code")


def graph_names(keys: list, what: str, deployed: Deployed | None = None) -> list[str]:
    """The graph's input or output names (`what`): one tensor's "images" (an image) or `what`, several
    tensors' `what`_KEY (inputs_0, inputs_image)."""
    if keys == [None]:
        return ["images" if deployed is not None and deployed.images else what]
    return [f"{what}_{key}" for key in keys]


def described(t: torch.Tensor) -> dict:
    return {"shape": ["N", *t.shape[1:]], "dtype": str(t.dtype).removeprefix("torch.")}


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The exporters' progress lines, warnings and graph dumps kept off the terminal: a failure is said
    in one line of ours (exporter_error)."""
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.disable(logging.NOTSET)


def write(deployed: Deployed, example: tuple, path: Path, names: tuple, metadata: dict) -> str:
    """torch.export's program of `deployed`, its batch axis dynamic (traced on a batch of 2 or more),
    saved as .pt2 or converted to ONNX; the exporter's refusal as one line naming what it stopped at."""
    batch = torch.export.Dim("batch")
    try:
        axes = {"inputs": tuple({0: batch} for _ in example)}  # each argument's first axis: one batch
        program = torch.export.export(deployed, example, dynamic_shapes=axes)
        if path.suffix == ".pt2":  # into memory: torch's writer, its disk full, aborts the process
            saved = io.BytesIO()
            torch.export.save(program, saved, extra_files={"metadata.json": json.dumps(metadata)})
            with open(path, "wb") as f:  # here a full disk is an OSError, said in one line below
                f.write(saved.getbuffer())
            return "a torch.export program"
        onnx = torch.onnx.export(program, dynamo=True, verbose=False, input_names=names[0],
                                 output_names=names[1])
        onnx.rename_axes({onnx.model.graph.inputs[0].shape[0]: "batch"})
        onnx.model.metadata_props.update({key: value if isinstance(value, str) else json.dumps(value)
                                          for key, value in metadata.items()})
        onnx.save(path)  # the weights in the file, up to what one holds (2 GB); past it in path.data
    except Exception as err:  # torch.export's and torch.onnx's many kinds; an OSError is a write's
        if isinstance(err, OSError):
            raise UserError(f"--export: cannot write {path.name} ({err.strerror or err})") from None
        raise UserError(f"--export: the model cannot be exported: {exporter_error(err)}; change that line "
                        "of forward() (no Python branch on a tensor's values; see torch.export's docs), or "
                        "export it in your own code") from None
    return f"ONNX (opset {onnx.model.opset_imports['']})"


def exporter_error(err: BaseException) -> str:
    """What an exporter stopped at, in one line: the first line of its innermost error, and the last
    line of user code its report names (torch.export quotes it: File "...", line N, ...)."""
    inner, texts = err, [str(err)]
    while inner.__cause__ is not None:
        inner = inner.__cause__
        texts.append(str(inner))
    said = re.split(r"\.\s", first_line(inner, 200))[0]  # its first sentence
    places = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.+)', "\n".join(texts))
    if not places:
        return f"{type(inner).__name__}: {said}"
    file, line, function, code = places[-1]
    return f"{type(inner).__name__}: {said} at {Path(file).name}:{line} in {function}: `{code.strip()}`"


def runner(path: Path, inputs: list[str]) -> tuple:
    """The written file, loaded as a user would load it: a function of the input tensors that gives the
    output tensors; and a timer of such a function, seconds per example."""
    if path.suffix == ".onnx":
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3  # errors only: its warnings are no news to a user
        session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

        def run(*tensors):
            return [torch.from_numpy(out) for out in session.run(None, {
                name: t.numpy() for name, t in zip(inputs, tensors, strict=True)})]
    else:
        program = torch.export.load(path).module()

        def run(*tensors):
            with torch.no_grad():
                return list(members(program(*tensors)).values())

    def speed(raw, fn) -> float:  # the best of 3 runs after a first, which sets up kernels
        tensors, times = tuple(members(raw).values()), []
        with torch.no_grad():
            for _ in range(4):
                started = time.perf_counter()
                fn(*tensors)
                times.append(time.perf_counter() - started)
        return min(times[1:]) / len(tensors[0])

    return run, speed


def check(run, raw, reference: dict, classes: bool) -> str:
    """The export's outputs against the PyTorch model's (`reference`: each output tensor by key) on all
    the examples in one batch, on the first alone and on the first ODD_BATCH: the largest difference,
    and with `classes` the share of examples whose top class agrees; beyond TOLERANCE (per unit of the
    outputs' largest size, where it is over 1), or any class differing, a UserError."""
    expected, worst, beyond, agree = list(reference.values()), 0.0, False, []
    for size in (len(expected[0]), 1, ODD_BATCH):
        got = run(*members(take(raw, slice(0, size))).values())
        rows = len(got[0])  # `size`, or fewer in a split that small
        for out, ref in zip(got, expected, strict=True):
            difference = (out.float() - ref[:rows].float()).abs().max().item()
            worst = max(worst, difference)
            beyond |= difference > TOLERANCE * max(1.0, ref.abs().max().item())
        if classes:  # per example: its class, or each of its pixels' classes
            same = got[0].argmax(1) == expected[0][:rows].argmax(1)
            agree.append(same.reshape(rows, -1).all(1).float().mean().item())
    said = f"max abs difference {worst:.1e}" + (f", the top class agrees on {agree[0]:.2%} of them"
                                                if classes else "")
    if beyond or min(agree, default=1) < 1:
        raise UserError(f"--export: the exported model's outputs differ from the PyTorch model's ({said}; "
                        f"allowed: {TOLERANCE:g}, every class the same), so nothing was kept; export it in "
                        "your own code, or report it with the model")
    return said
