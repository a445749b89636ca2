"""The code stays plain (issue 35), counted from its syntax: short signatures, no long positional calls,
no private names of the libraries it stands on, and each list of names defined once. The core files are
the template's top-level modules and configs/; tests and benchmarks may do what they need."""

import ast

import pytest
from conftest import ROOT

CORE = sorted([*ROOT.glob("*.py"), *(ROOT / "configs").glob("*.py"), *(ROOT / "machinery").glob("*.py")])
MOST_PARAMETERS, WIDE_ALLOWED = 7, 3  # a function over 7 parameters groups what travels together
PUBLIC_ENTRY = {("lr_find.py", "lr_find")}  # its options are keyword-only, each documented
ALLOWED_PRIVATE = {"_step_supports_amp_scaling",  # the flag GradScaler itself reads (schedules.py)
                   "_fields"}  # a namedtuple's fields: its documented API
OUR_OBJECTS = {"self", "cls"}


def trees():
    return [(path.relative_to(ROOT).as_posix(), ast.parse(path.read_text())) for path in CORE]


def parameters(node: ast.FunctionDef) -> int:
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    return len(names) - (names[:1] in (["self"], ["cls"])) + bool(args.vararg) + bool(args.kwarg)


def test_at_most_three_functions_take_more_than_seven_parameters():
    wide = [(file, node.name, parameters(node)) for file, tree in trees() for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and parameters(node) > MOST_PARAMETERS
            and (file, node.name) not in PUBLIC_ENTRY]
    assert len(wide) <= WIDE_ALLOWED, wide


def test_no_call_passes_eight_positional_arguments():
    long_calls = [(file, node.lineno) for file, tree in trees() for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and len(node.args) >= 8]
    assert long_calls == []


def private(name) -> bool:
    return isinstance(name, str) and name.startswith("_") and not name.startswith("__") and (
        name not in ALLOWED_PRIVATE)


def test_no_private_name_of_another_library_is_read():
    """`x._name` where x is not our own object, and getattr(x, "_name"): torch's, torchvision's or
    tensorboard's internals, which a minor release may change."""
    ours = OUR_OBJECTS | {path.stem for path in CORE} | {"configs"}
    found = []
    for file, tree in trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and private(node.attr):
                if ast.unparse(node.value).split(".")[0] not in ours:
                    found.append((file, node.lineno, ast.unparse(node)))
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr", "setattr"):
                name = node.args[1] if len(node.args) > 1 else None
                if isinstance(name, ast.Constant) and private(name.value):
                    found.append((file, node.lineno, ast.unparse(node)))
    assert found == []


def assigned(node) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    return [ast.unparse(target) for target in targets if target is not None]


@pytest.mark.parametrize("name", ["SCHEDULES", "DATASETS", "MODELS", "OPTIMIZERS", "METHODS"])
def test_each_list_of_names_is_defined_once(name):
    """The one list each registry has: assigned in one module, read (not copied) everywhere else."""
    defined = [file for file, tree in trees() for node in tree.body if name in assigned(node)]
    assert len(defined) == 1, (name, defined)


# ---------------------------------------------------------------- the layout (issue 40), read from the code

MACHINERY = {path.stem for path in (ROOT / "machinery").glob("*.py")} - {"__init__"}
SCRIPTS = {"train", "evaluate", "lr_find"}  # lr_find.py's command line builds the run's setup lazily
FRONT = {"data", "models", "task"}


def imports(path) -> set[str]:
    """The template's modules a file imports, at its top and inside functions alike: `from machinery import
    logs` is machinery.logs, `from configs.resolve import x` is configs.resolve."""
    ours = {module_name(p) for p in CORE}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return found & ours - {"machinery"}  # the package's __init__ holds its table of contents alone


def module_name(path) -> str:
    relative = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
    return relative.removesuffix(".__init__")


def graph() -> dict[str, set[str]]:
    return {module_name(path): imports(path) - {module_name(path)} for path in CORE}


def test_imports_only_go_down():
    """Scripts over the front over the machinery over configs and torch: the machinery never imports the
    front or the scripts, configs imports none of the template's modules, schedules.py and lr_find.py's
    library need torch alone (lr_find.py's command line imports inside its main())."""
    edges = graph()
    for module, targets in edges.items():
        if module.startswith("machinery"):
            assert all(t.startswith(("machinery.", "configs")) for t in targets), (module, targets)
        if module.startswith("configs"):
            assert all(t.startswith("configs") for t in targets), (module, targets)
        if module in FRONT:
            assert not targets & SCRIPTS, (module, targets)
    assert edges["schedules"] == set()
    top_level = ast.parse((ROOT / "lr_find.py").read_text()).body
    assert not [n for n in top_level if isinstance(n, ast.Import | ast.ImportFrom) and (
        module_name_of(n) in SCRIPTS | FRONT | {"configs", "schedules", "machinery"})]


def module_name_of(node) -> str:
    return (node.names[0].name if isinstance(node, ast.Import) else node.module or "").split(".")[0]


def test_no_import_cycle_lazy_imports_counted():
    edges = graph()
    state = {}

    def visit(module, path):
        state[module] = "open"
        for target in edges.get(module, ()):
            assert state.get(target) != "open", f"import cycle: {' -> '.join([*path, target])}"
            if target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in edges:
        if module not in state:
            visit(module, [module])


def function_lengths() -> list[tuple[str, str, int]]:
    return [(file, node.name, node.end_lineno - node.lineno + 1) for file, tree in trees()
            for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]


def test_train_reads_in_120_lines_and_no_function_is_over_80():
    lengths = {(file, name): n for file, name, n in function_lengths()}
    assert lengths[("train.py", "train")] <= 120
    long = [(file, name, n) for (file, name), n in lengths.items() if n > 80
            and (file, name) not in {("train.py", "train"), ("lr_find.py", "lr_find")}]
    assert long == [] and lengths[("lr_find.py", "lr_find")] <= 120


def test_the_sizes_the_layout_asks_for():
    """Issue 40 asked for files of 400 lines at most (lr_find.py 600), a front of 1,250 and a core of 3,900,
    and to keep a guarantee over a number: it closed with the core at 4,668 (its note says which guarantees
    hold the rest). Issues 41 to 43 added features on that (41's 26 fixes about 200 lines, 43's trackers
    about 150), and closed at 5,229. Issues 48 to 50 add image files decoded once and kept (image_files,
    image_cache, placement: about 350 lines net, most moved out of data.py), round five's fixes and the
    export: 6,400 is their budget, not a number to reach; a fork's reading order stays about 520. Issue 49
    gives lr_find.py 15 lines over its 600 for a bounded loss (NT-Xent): a curve that rises, never blows up,
    and falls again is read up to that rise, where it suggested nothing, and the sweep's line says so; issue
    54 gives it 3 more, to refuse a model that trains networks in turn (one optimizer is what it sweeps).
    Issue 53 (the plain path) moves what options need out of what a default run enters, which costs lines
    where it does not: a class for the common data beside the general one, the process objects (one process,
    torchrun's), resume, workers and torchrun in modules of their own, each refusal's line apart from its
    check (about +250); issue 54's fixes about +90 (the image cache's checksum and key, export's collate and
    full disk, targets that move with the image, --tta flip through the task), and its networks trained in
    turn (machinery/turns.py, train.py's optimizers and in_turn: about +90): 6,840. Issue 55 adds what runs
    only where asked, each in a module a default run never imports: seed repeats and their statistics
    (seeds, intervals, compare_seeds.py: about +300), --throughput and --profile (about +235), the K best
    checkpoints and their average (kept_best, averaging: about +250), and a review's fixes to them
    (--profile on resume and written atomically, kept files through a resume into another folder: about
    +80): 7,730."""
    lines = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines()) for path in CORE}
    assert {file: n for file, n in lines.items() if n > (618 if file == "lr_find.py" else 400)} == {}
    assert sum(lines[f"{name}.py"] for name in ("train", *FRONT)) <= 1250
    assert sum(lines.values()) <= 7730, sum(lines.values())


def test_what_was_cut_stays_out():
    """No hand-built CUDA graphs, no TensorBoard internals, no module loaded by name."""
    text = "\n".join(path.read_text() for path in CORE)
    for gone in ("make_graphed_callables", "cuda_graphs", "importlib", "__import__", "event_pb2",
                 "RecordWriter", "tensorboard.compat"):
        assert gone not in text, gone
