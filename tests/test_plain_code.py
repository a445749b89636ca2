"""The code stays plain (issue 35), counted from its syntax: short signatures, no long positional calls,
no private names of the libraries it stands on, and each list of names defined once. The core files are
the template's top-level modules and configs/; tests and benchmarks may do what they need."""

import ast

import pytest
from conftest import ROOT

CORE = sorted([*ROOT.glob("*.py"), *(ROOT / "configs").glob("*.py")])
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
