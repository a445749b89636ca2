"""`python tests/reading.py OUT.json SCRIPT ARGS...`: SCRIPT run as tests/launch.py runs it (the kept default
task in place of task.py), traced; OUT.json gets what it entered of the template's code, counted as
../shared/tools/reading_path.py counts it (issue 53): each function called, whole, from its `def` to its last
line; of module and class bodies, the lines that ran; blank lines left out. Also: the modules it imported."""

import functools
import json
import runpy
import sys
import threading
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ("configs", "machinery")  # folders of the template's code; tests/, bench/ are not counted


@functools.cache
def ours(filename: str) -> str | None:
    path = Path(filename)
    if path.suffix != ".py" or not path.is_absolute() or not path.is_relative_to(ROOT):
        return None
    rel = path.relative_to(ROOT)
    return rel.as_posix() if len(rel.parts) == 1 or rel.parts[0] in OURS else None


def main() -> None:
    out, *command = sys.argv[1:]
    functions, ran = {}, defaultdict(set)

    def body_lines(frame, event, arg):
        if event == "line":
            ran[ours(frame.f_code.co_filename)].add(frame.f_lineno)
        return body_lines

    def tracer(frame, event, arg):
        code = frame.f_code
        rel = ours(code.co_filename)
        if event != "call" or rel is None:
            return None
        if code.co_name == "<module>" or class_body(code):
            return body_lines  # a module or class body: the lines that run
        functions.setdefault(code, rel)
        return None

    sys.argv = [str(ROOT / "tests" / "launch.py"), *command]
    threading.settrace(tracer)
    sys.settrace(tracer)
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        sys.settrace(None)
        threading.settrace(None)
    lines = defaultdict(set)
    for code, rel in functions.items():
        lines[rel] |= function_span(code, (ROOT / rel).read_text().splitlines())
    for rel, numbers in ran.items():
        if rel is not None:
            lines[rel] |= numbers
    per_file = {}
    for rel, numbers in lines.items():
        text = (ROOT / rel).read_text().splitlines()
        per_file[rel] = sum(1 for n in numbers if 1 <= n <= len(text) and text[n - 1].strip())
    modules = sorted(name for name in sys.modules if ours(getattr(sys.modules[name], "__file__", None) or ""))
    Path(out).write_text(json.dumps({"per_file": per_file, "modules": modules, "all": sorted(sys.modules)}))


def class_body(code) -> bool:
    """A class body's code: no arguments, no generator, and it sets __qualname__."""
    return code.co_argcount == 0 and not code.co_flags & 0x20 and "__qualname__" in code.co_names


def function_span(code, text: list[str]) -> set[int]:
    """A function's lines, `def` to its last, a last comment or closing bracket without bytecode included."""
    first = code.co_firstlineno
    last = max([n for _, _, n in code.co_lines() if n is not None] + [first])
    while last < len(text) and (not text[last].strip() or indent(text[last]) > indent(text[first - 1])):
        last += 1
    while last > first and not text[last - 1].strip():
        last -= 1
    return set(range(first, last + 1))


def indent(line: str) -> int:
    return len(line) - len(line.lstrip())


if __name__ == "__main__":
    main()
