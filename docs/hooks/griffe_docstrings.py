"""A griffe extension for the API reference: mpnb's docstrings as the reference shows them.

mpnb's docstrings are written for ``help()`` and doctest: a runnable ``Example:`` section
(Google style) and Sphinx roles such as ``:meth:`save``` here and there. Griffe reads a
singular ``Example:`` (or ``Example (a note):``) as a note rather than as code, shows roles and
reST's ``::`` as typed, and takes an ``Args:`` line that describes several parameters at once
(``fn, args: ...``) for one unknown parameter. This extension reads each ``Example`` heading as
``Examples:``, a role as inline code, ``::`` as ``:``, and such a line as one line per
parameter. The source stays as it is: nothing here changes what ``help()`` or the doctests see.
"""

from __future__ import annotations

import re

import griffe

_EXAMPLE_HEADING = re.compile(r"^([ \t]*)Example:[ \t]*$", re.MULTILINE)
#: ``Example (what it shows):``: the section, its note as the section's first line.
_EXAMPLE_WITH_NOTE = re.compile(r"^([ \t]*)Examples? \((.+)\):[ \t]*$", re.MULTILINE)
#: reST's ``Text::`` before a literal block: Markdown shows the indented block as code already.
_LITERAL_MARKER = re.compile(r"^([ \t]*\S.*?)::[ \t]*$", re.MULTILINE)
_SPHINX_ROLE = re.compile(r":(?:meth|mod|class|func|attr|data|exc|obj):`~?([^`]+)`")
_SECTION = re.compile(r"^\s*[A-Z][A-Za-z ]*:\s*$")
_SHARED_ARGS = re.compile(r"^(\s+)([a-z_]\w*(?:,\s*[a-z_]\w*)+):\s(.*)$")


def _one_line_per_parameter(text: str) -> str:
    """``a, b: text`` in an ``Args:`` section becomes ``a: text`` and ``b: text``."""
    lines, in_args = [], False
    for line in text.splitlines():
        if _SECTION.match(line):
            in_args = line.strip() in ("Args:", "Arguments:", "Parameters:")
        shared = _SHARED_ARGS.match(line) if in_args else None
        if shared:
            indent, names, description = shared.groups()
            lines += [f"{indent}{name.strip()}: {description}" for name in names.split(",")]
        else:
            lines.append(line)
    return "\n".join(lines)


class ReferenceDocstrings(griffe.Extension):
    """Rewrites each docstring as it is loaded (see the module's docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        docstring = obj.docstring
        if docstring is None:
            return
        text = _EXAMPLE_HEADING.sub(r"\1Examples:", docstring.value)
        text = _EXAMPLE_WITH_NOTE.sub(
            lambda found: (
                f"{found[1]}Examples:\n{found[1]}    {found[2][0].upper()}{found[2][1:]}.\n"
            ),
            text,
        )
        text = _LITERAL_MARKER.sub(r"\1:", text)
        text = _SPHINX_ROLE.sub(r"`\1`", text)
        docstring.value = _one_line_per_parameter(text)
