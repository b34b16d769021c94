"""MkDocs hook: the table of modes, written at build time from mpnb's registry of modes.

A page that holds ``<!-- modes table -->`` gets one row per registered mode (in the order the
registry lists them): its name and aliases, what it does, its autocast dtype, whether the loss
is scaled, whether it converts layers and the options it takes. A new mode module shows up
here with no edit to the docs.
"""

from __future__ import annotations

from mpnb._render import dtype_name
from mpnb.precision.modes import registered

PLACEHOLDER = "<!-- modes table -->"
HEADER = "| mode | aliases | what it does | autocast | loss scaling | converts layers | options |"


def modes_table() -> str:
    """The Markdown table of the registered modes."""
    rows = [HEADER, "|---|---|---|---|---|---|---|"]
    for mode in registered():
        options = ", ".join(f"`{field.name}`" for field in mode.option_fields()) or "-"
        aliases = ", ".join(f"`{alias}`" for alias in mode.aliases) or "-"
        autocast = dtype_name(mode.autocast_dtype) if mode.autocast_dtype is not None else "off"
        rows.append(
            f"| `{mode.name}` | {aliases} | {mode.summary} | {autocast} | "
            f"{'yes' if mode.needs_scaler else 'no'} | {'yes' if mode.converts_layers else 'no'} | {options} |"
        )
    return "\n".join(rows)


def on_page_markdown(markdown: str, **_: object) -> str:
    """Put the table where a page asks for it."""
    return markdown.replace(PLACEHOLDER, modes_table()) if PLACEHOLDER in markdown else markdown
