"""What differs between modes lives in the mode's own module: nothing else branches on a mode's
name, and torchao's API is known in the modes that use it (and the layer swap they share) alone:
the what-if's casts of their formats included."""

from __future__ import annotations

import ast
import io
import pathlib
import sys
import tokenize

from mpnb.precision.modes import registered

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "mpnb"
MODES = PACKAGE / "precision" / "modes"
#: Words in an expression that say it holds a mode (or a precision named like one).
_MODE_WORDS = ("mode", "precision", "observed", "asked", "name")


def _mode_names() -> set[str]:
    return {name for mode in registered() for name in (mode.name, *mode.aliases)}


def _outside_the_modes() -> list[pathlib.Path]:
    return [path for path in sorted(PACKAGE.rglob("*.py")) if MODES not in path.parents]


def _branches_on_a_mode_name(tree: ast.AST, source: str) -> list[str]:
    names, found = _mode_names(), []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        constants = [
            element.value
            for side in sides
            for element in (
                side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            )
            if isinstance(element, ast.Constant) and isinstance(element.value, str)
        ]
        text = ast.get_source_segment(source, node) or ""
        if any(c in names for c in constants) and any(word in text for word in _MODE_WORDS):
            found.append(f"line {node.lineno}: {text}")
    return found


def test_no_code_outside_a_modes_module_branches_on_a_mode_name():
    found = {}
    for path in _outside_the_modes():
        source = path.read_text()
        branches = _branches_on_a_mode_name(ast.parse(source), source)
        if branches:
            found[str(path.relative_to(PACKAGE))] = branches
    assert not found, found


def test_the_check_finds_a_branch_on_a_mode_name():
    source = 'if trainer.mode.name == "fp8":\n    pass\nok = observed in ("bf16", "tf32")\n'
    assert len(_branches_on_a_mode_name(ast.parse(source), source)) == 2


def _code_words(source: str) -> str:
    """The source without its comments and strings (docstrings mention torchao freely)."""
    kept = [
        token.string
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type not in (tokenize.COMMENT, tokenize.STRING)
    ]
    return " ".join(kept).lower()


def test_torchao_code_stands_in_the_modes_that_use_it_and_what_they_share_only():
    modules = {
        pathlib.Path(sys.modules[mode.__module__].__file__).resolve() for mode in registered()
    }
    knowing = {
        path
        for path in PACKAGE.rglob("*.py")
        if any(word in _code_words(path.read_text()) for word in ("torchao", "float8"))
    }
    assert MODES / "fp8.py" in knowing
    # besides the modes' own modules: the layer swap the three torchao modes share
    others = sorted(str(path.relative_to(PACKAGE)) for path in knowing - modules)
    assert others == ["precision/modes/layer_swap.py"], others
