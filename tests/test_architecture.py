"""The rules of the house in ARCHITECTURE.md, checked against the code's own imports.

Each module's imports are read with ``ast`` (all of them: top-level, inside functions, under
``TYPE_CHECKING``, relative ones, and ``importlib.import_module("...")`` with a literal name), so
a lazy import that reaches the wrong way counts too.
"""

from __future__ import annotations

import ast
import pathlib
import sys
import warnings
from collections.abc import Iterator

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "mpnb"

#: The core's layers, lowest first: each may import only itself and what stands before it.
#: The package root stands above everything: no module inside may import it.
CORE_LAYERS = (
    ("mpnb.errors", "mpnb._version"),
    ("mpnb._render", "mpnb._files", "mpnb._stderr", "mpnb.views"),
    ("mpnb.oplists",),
    ("mpnb.precision",),
    # numerics stands beside training: the loops measure their steps through its instruments,
    # which build on the step's Instrument base; test_numerics_and_training_meet_at_two_doors
    # keeps the crossings to the few modules that must cross
    ("mpnb.training", "mpnb.numerics"),
    ("mpnb.analysis", "mpnb.examples"),
    ("mpnb.integrations",),
    ("mpnb.distributed",),
    ("mpnb.cli", "mpnb.__main__", "mpnb.ui"),
)
ROOT_LAYER = len(CORE_LAYERS)
#: Inside ui/, lowest first.
UI_LAYERS = (
    ("mpnb.ui.environment", "mpnb.ui.cell_end"),
    ("mpnb.ui.plots",),
    ("mpnb.ui.widgets",),
    ("mpnb.ui.views", "mpnb.ui.magics"),
)
#: The only modules outside ui/ that may import it: the package root wires the views and the
#: extension hooks; the command line writes reports.
MAY_IMPORT_UI = {"mpnb", "mpnb.cli"}
#: What the core may import besides itself: the standard library and these. Optional, imported
#: where used: scikit-learn (the embedded example data), pandas (History.to_pandas) and Habana's
#: own device library (the HPU backend, on Gaudi machines).
CORE_DEPENDENCIES = {
    "torch",
    "numpy",
    "psutil",
    "sklearn",
    "pandas",
    "habana_frameworks",
    "cloudpickle",
}
#: The frameworks mpnb plugs into (optional extras), importable only in their own modules.
INTEGRATIONS = {
    "mpnb.integrations.transformers": {"transformers"},
    "mpnb.integrations.lightning": {"lightning"},
    "mpnb.precision.modes.fp8": {"torchao"},  # mode fp8's float8 layers (the fp8 extra)
}
#: Above this many lines a module is worth a look: is it one concept? (A warning: size follows the
#: concept, and a module must never be squeezed to meet a number.)
LINES_WORTH_A_LOOK = 500
#: Formatter escapes: code is laid out by ruff, never by hand to save lines.
FORMATTER_ESCAPES = ("# fmt: skip", "# fmt: off")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _package_of(name: str, level: int) -> str:
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return package


def _imports(name: str) -> Iterator[str]:
    """Every module ``name`` imports, absolute (``from mpnb import views`` -> ``mpnb.views``)."""
    tree = ast.parse(MODULES[name].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(filter(None, (_package_of(name, node.level), base)))
            submodules = [
                f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES
            ]
            if len(submodules) < len(node.names):  # a name defined in `base` itself
                yield base
            yield from submodules
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _layer(name: str, layers: tuple[tuple[str, ...], ...]) -> int | None:
    if name == "mpnb":
        return ROOT_LAYER if layers is CORE_LAYERS else None
    for index, members in enumerate(layers):
        if any(_within(name, member) for member in members):
            return index
    return None


def _mpnb_imports(name: str) -> set[str]:
    return {target for target in _imports(name) if target in MODULES}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_only_the_package_root_and_the_cli_import_the_ui(name):
    if _within(name, "mpnb.ui") or name in MAY_IMPORT_UI:
        return
    reaching_up = sorted(target for target in _mpnb_imports(name) if _within(target, "mpnb.ui"))
    assert not reaching_up, f"{name} imports {reaching_up}: the core asks mpnb.views instead"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_the_core_imports_only_the_standard_library_torch_numpy_psutil(name):
    if _within(name, "mpnb.ui") or name in MAY_IMPORT_UI:
        return
    outside = sorted(
        target
        for target in _imports(name)
        if target.split(".")[0]
        not in CORE_DEPENDENCIES
        | INTEGRATIONS.get(name, set())
        | set(sys.stdlib_module_names)
        | {"mpnb", "__future__"}
    )
    assert not outside, (
        f"{name} imports {outside}: the core runs in a plain script (a UI library belongs in mpnb.ui)"
    )


@pytest.mark.parametrize(("layers", "scope"), [(CORE_LAYERS, "core"), (UI_LAYERS, "ui")])
def test_layers_import_only_downwards(layers, scope):
    wrong = []
    for name in MODULES:
        own = _layer(name, layers)
        if own is None:
            continue
        for target in _mpnb_imports(name):
            theirs = _layer(target, layers)
            if theirs is not None and theirs > own:
                wrong.append(f"{name} -> {target}")
    assert not wrong, f"{scope} imports that run upwards: {wrong}"


#: The only numerics module training imports: the instruments a fit asks for, built in one place.
NUMERICS_DOOR = "mpnb.numerics.instruments"
#: What numerics uses of training: the step's Instrument base, the history, the telemetry's Sink,
#: the random state a replay repeats, the Trainer's batch-to-loss rules and its loss check.
TRAINING_FOR_NUMERICS = {
    "mpnb.training",  # the package itself, loaded on the way to any of its modules
    "mpnb.training.step_record",
    "mpnb.training.history",
    "mpnb.training.telemetry",
    "mpnb.training.random_state",
    "mpnb.training.batches",  # how a batch becomes a loss: the what-if's pass is the Trainer's
    "mpnb.training.gradients",  # check_loss: the what-if refuses the losses the Trainer refuses
    "mpnb.training.own_run",  # what two runs share: a proof's runs are refused as compare's are
}


def test_numerics_and_training_meet_at_two_doors():
    crossings = []
    for name in MODULES:
        targets = _mpnb_imports(name)
        if _within(name, "mpnb.training"):
            crossings += [
                f"{name} -> {target}"
                for target in targets
                if _within(target, "mpnb.numerics") and target != NUMERICS_DOOR
            ]
        if _within(name, "mpnb.numerics"):
            crossings += [
                f"{name} -> {target}"
                for target in targets
                if _within(target, "mpnb.training") and target not in TRAINING_FOR_NUMERICS
            ]
    assert not crossings, f"numerics and training cross elsewhere than their doors: {crossings}"


@pytest.mark.parametrize("name", ["mpnb.training.trainer", "mpnb.integrations.loop_telemetry"])
def test_the_loops_name_no_instrument_only_the_builder(name):
    """The Trainer and the framework loops' telemetry reach numerics through the instruments'
    builder only: a new instrument or statistic needs no edit of theirs."""
    reached = {
        (node.module, alias.name)
        for node in ast.walk(TREES[name])
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mpnb.numerics")
        for alias in node.names
    }
    assert {module for module, _ in reached} == {NUMERICS_DOOR}, reached
    used = {node.id for node in ast.walk(TREES[name]) if isinstance(node, ast.Name)}
    used |= {node.attr for node in ast.walk(TREES[name]) if isinstance(node, ast.Attribute)}
    named = used & {"NumericsWatch", "FirstSkipLocator", "NextStepsLocator", "Fp32Modules"}
    assert not named, f"{name} names the instruments {sorted(named)} in its code"


def test_every_module_has_a_layer():
    """A new folder or top-level module must be placed in a layer above (and in ARCHITECTURE.md)."""
    placed = {name for name in MODULES if _layer(name, CORE_LAYERS) is not None}
    ui = {name for name in MODULES if _within(name, "mpnb.ui") and name != "mpnb.ui"}
    unplaced = ui - {name for name in ui if _layer(name, UI_LAYERS) is not None}
    assert placed == set(MODULES) and not unplaced


def test_no_import_circles():
    graph = {name: _mpnb_imports(name) - {name} for name in MODULES}
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph[node]):
            # A package's __init__ importing its own submodules is how packages re-export.
            if target.startswith(node + "."):
                continue
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state and (circle := visit(target)):
                return circle
        state[node] = "done"
        path.pop()
        return None

    for name in sorted(graph):
        if name not in state and (circle := visit(name)):
            pytest.fail(f"import circle: {' -> '.join(circle)}")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_long_module_is_flagged_for_a_look_not_refused(name):
    lines = len(MODULES[name].read_text().splitlines())
    if lines > LINES_WORTH_A_LOOK:
        warnings.warn(
            f"{name} has {lines} lines: does it hold one concept? Split it where the concept splits",
            stacklevel=1,
        )


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_code_is_laid_out_by_hand_against_the_formatter(name):
    escapes = [
        f"line {number}: {line.strip()}"
        for number, line in enumerate(MODULES[name].read_text().splitlines(), 1)
        if any(escape in line for escape in FORMATTER_ESCAPES)
    ]
    assert not escapes, f"{name} opts out of ruff format: {escapes}"


def _private_names_defined(tree: ast.AST) -> set[str]:
    """The ``_names`` a module defines: its functions, classes and variables, its classes' methods
    and class attributes, and the attributes its methods set on ``self``."""
    defined = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and _is_own(node.value)
        ):
            defined.add(node.attr)
    return {name for name in defined if _is_private(name)}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.endswith(
        "_"
    )  # not __dunder__ nor IPython's _repr_html_


def _is_own(value: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: an object reaching its own private attributes."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "super"
    )


TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}
PRIVATE_NAMES = {name: _private_names_defined(tree) for name, tree in TREES.items()}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_reaches_into_another_modules_private_names(name):
    """A module uses another's private attributes and functions only through a public method or
    name of its (torch's own private API, which mpnb reaches behind small adapters, is not checked)."""
    elsewhere = (
        set().union(*(names for other, names in PRIVATE_NAMES.items() if other != name))
        - PRIVATE_NAMES[name]
    )
    reached = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Attribute) and node.attr in elsewhere and not _is_own(node.value):
            reached.add(f"line {node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mpnb"):
            reached.update(
                f"line {node.lineno}: {alias.name}"
                for alias in node.names
                if _is_private(alias.name)
            )
    assert not reached, f"{name} reaches into another module's private names: {sorted(reached)}"
