"""MkDocs hook: the API reference documents every public name, or the build fails.

A public name is one a module under ``mpnb/`` lists in ``__all__`` (the rule of
``tests/test_public_surface.py``). Each is followed through its imports (with griffe, the
library mkdocstrings reads the code with) to where it is defined, and that object must have a
heading in the pages under ``reference/``. The hook also writes the table of every public name
into ``reference/index.md`` (where ``<!-- public names -->`` stands), each linked to its entry.

A part of any page that documents a module still being written is wrapped in
``<!-- if mpnb.some.module -->`` ... ``<!-- end if -->``: kept when that module exists at build
time, left out (with its links) when it does not.
"""

from __future__ import annotations

import ast
import pathlib
import re

import griffe
from mkdocs.exceptions import PluginError

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mpnb"
PLACEHOLDER = "<!-- public names -->"
_ANCHOR = re.compile(r'\bid="(mpnb(?:\.[A-Za-z_][A-Za-z0-9_]*)*)"')
_IF_MODULE = re.compile(r"<!-- if (mpnb[\w.]*) -->\n?(.*?)<!-- end if -->\n?", re.DOTALL)

_documented: set[str] = set()


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _declared_all(path: pathlib.Path) -> list[str]:
    for node in ast.parse(path.read_text()).body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        if any(isinstance(target, ast.Name) and target.id == "__all__" for target in targets):
            return list(ast.literal_eval(node.value))
    return []


def public_names() -> dict[str, list[str]]:
    """Each module's ``__all__``, read from its source, by module name."""
    modules = {_module_name(path): _declared_all(path) for path in sorted(PACKAGE.rglob("*.py"))}
    return {module: names for module, names in modules.items() if names}


def _definitions() -> dict[tuple[str, str], str]:
    """(module, name) -> the path of the object the name stands for, where it is defined."""
    package = griffe.load("mpnb", search_paths=[str(ROOT)], resolve_aliases=True)
    found = {}
    for module, names in public_names().items():
        owner = package if module == "mpnb" else package[module.removeprefix("mpnb.")]
        for name in names:
            obj = owner[name]
            found[module, name] = (obj.final_target if obj.is_alias else obj).path
    return found


def _module_exists(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    markdown = _IF_MODULE.sub(
        lambda found: found.group(2) if _module_exists(found.group(1)) else "", markdown
    )
    if page.file.src_uri != "reference/index.md" or PLACEHOLDER not in markdown:
        return markdown
    definitions = _definitions()
    rows = ["| module | its public names |", "|---|---|"]
    for module, names in public_names().items():
        links = ", ".join(f"[`{name}`][{definitions[module, name]}]" for name in names)
        rows.append(f"| `{module}` | {links} |")
    return markdown.replace(PLACEHOLDER, "\n".join(rows))


def on_page_content(html: str, page, **kwargs) -> str:
    if page.file.src_uri.startswith("reference/"):
        _documented.update(_ANCHOR.findall(html))
    return html


def on_env(env, config, files, **kwargs):
    missing = sorted(
        f"{module}.{name} (defined as {path})"
        for (module, name), path in _definitions().items()
        if path not in _documented
    )
    if missing:
        raise PluginError(
            f"{len(missing)} public names are missing from the API reference (docs/reference/): "
            + "; ".join(missing)
            + ". Add a `::: module` block for where each is defined."
        )
    return env
