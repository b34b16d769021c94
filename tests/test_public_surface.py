"""The public surface is a promise: every name a module lists in ``__all__`` is documented, each
public function and class with a runnable example in its own docstring (what ``help(name)``
shows; the module's example does not stand in for it), and the lists stay as short as what users
call.

``__all__`` holds what users call (the package exports, what the README, notebooks and widgets
use, and what users subclass or receive); helpers that other modules import stay importable by
name without being listed.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "mpnb"

#: Names in all ``__all__`` lists under mpnb/ together. Lower it when the surface shrinks; a
#: name added to the surface must be worth raising it for.
MAX_PUBLIC_NAMES = 196  # 0.4: mpnb.mx_layers; mpnb.whatif, WhatIf, Threshold, Proof

#: Integration modules import their framework (an optional extra); skipped where it is missing.
FRAMEWORKS = {
    "mpnb.integrations.transformers": "transformers",
    "mpnb.integrations.lightning": "lightning",
    "mpnb.integrations.accelerate": "accelerate",
}
#: The UI imports these (lazily or at module level); skipped where one is missing.
UI_LIBRARIES = ("IPython", "ipywidgets", "plotly")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _tree(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text())


def _assigned(node: ast.stmt) -> set[str]:
    """The names a top-level statement assigns (``x = ...`` or ``x: T = ...``)."""
    targets = (
        node.targets
        if isinstance(node, ast.Assign)
        else [node.target]
        if isinstance(node, ast.AnnAssign)
        else []
    )
    return {target.id for target in targets if isinstance(target, ast.Name)}


def _declared_all(module: str) -> list[str] | None:
    """The names ``module`` lists in ``__all__``, read from its source (None: it has no ``__all__``)."""
    for node in _tree(module).body:
        if "__all__" in _assigned(node):
            return list(ast.literal_eval(node.value))
    return None


PUBLIC = [(module, name) for module in MODULES for name in _declared_all(module) or ()]


def _import(module: str):
    if module in FRAMEWORKS:
        pytest.importorskip(FRAMEWORKS[module])
    if module == "mpnb.ui" or module.startswith("mpnb.ui."):
        for library in UI_LIBRARIES:
            if importlib.util.find_spec(library) is None:
                pytest.skip(f"{module} needs {library}")
    return importlib.import_module(module)


def _own_doc(obj: object) -> str:
    """The docstring written for ``obj`` itself: not a base class's, not a dataclass's signature."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    if not isinstance(doc, str):
        return ""
    if (
        inspect.isclass(obj)
        and dataclasses.is_dataclass(obj)
        and doc.startswith(f"{obj.__name__}(")
    ):
        return ""
    return doc.strip()


def _has_example(doc: str | None) -> bool:
    return any(line.lstrip().startswith(">>> ") for line in (doc or "").splitlines())


def _constant_documented(module: str, name: str, seen: frozenset[str] = frozenset()) -> bool:
    """``name`` is assigned at the top of its module under a ``#:`` comment or above a docstring,
    following ``from ... import name`` to where it is assigned."""
    if module in seen or module not in MODULES:
        return False
    lines = MODULES[module].read_text().splitlines()
    body = _tree(module).body
    for index, node in enumerate(body):
        if name in _assigned(node):
            comment = lines[node.lineno - 2].lstrip().startswith("#:") if node.lineno > 1 else False
            after = body[index + 1] if index + 1 < len(body) else None
            docstring = isinstance(after, ast.Expr) and isinstance(
                getattr(after, "value", None), ast.Constant
            )
            return comment or docstring
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and any(alias.name == name for alias in node.names)
        ):
            return _constant_documented(node.module, name, seen | {module})
    return False


def test_the_surface_does_not_grow_back():
    assert len(PUBLIC) <= MAX_PUBLIC_NAMES, (
        f"{len(PUBLIC)} names in __all__ lists, more than {MAX_PUBLIC_NAMES}: list only what users call"
    )


def test_every_module_declares_its_surface():
    undeclared = [
        module
        for module in MODULES
        if not module.endswith("__main__") and _declared_all(module) is None
    ]
    packages_without_code = [
        module
        for module in undeclared
        if MODULES[module].name == "__init__.py" and len(_tree(module).body) <= 1
    ]
    assert sorted(set(undeclared) - set(packages_without_code)) == []


@pytest.mark.parametrize(
    ("module", "name"), PUBLIC, ids=[f"{module}.{name}" for module, name in PUBLIC]
)
def test_public_name_is_documented_with_an_example(module, name):
    imported = _import(module)
    obj = getattr(imported, name)
    if inspect.ismodule(obj):
        assert _own_doc(obj), f"{module}.{name}: the module has no docstring"
    elif inspect.isclass(obj) or inspect.isroutine(obj):
        doc = _own_doc(obj)
        assert doc, f"{module}.{name} has no docstring"
        assert _has_example(doc), (
            f"{module}.{name}: no runnable example (>>>) in its own docstring "
            "(the module's example does not count: help(name) does not show it)"
        )
    else:
        assert _constant_documented(module, name), (
            f"{module}.{name}: a constant needs a '#:' comment above it"
        )
