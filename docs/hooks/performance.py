"""MkDocs hook: the performance page's tables, written at build time from benchmarks/results/.

``docs/performance.md`` holds ``<!-- benchmark tables -->``; this hook replaces it with one
section per ``benchmarks/results/*.json`` file (what each benchmark script last wrote), so the
figures on the site are the committed results and never a copy made by hand. The headline
comparison with the peers (``peers*.json``) is drawn as the README drew it: a runner per row, a
batch size per column; every other file is shown as the tables of figures it holds, and its
ratios (speedups, costs over a baseline) drawn as bars beside a line at 1.0x.
"""

from __future__ import annotations

import json
import pathlib
from html import escape

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PLACEHOLDER = "<!-- benchmark tables -->"
#: Keys that say where a result was measured: shown once, under the section's title.
MACHINE_KEYS = ("device", "torch", "machine", "cpus", "threads", "cpu")
#: Keys that repeat what the section's title says.
TITLE_KEYS = ("benchmark",)


#: Keys whose figures are bytes: shown in KiB, MiB or GiB.
BYTE_KEYS = ("budget", "bytes", "memory", "peak")


def _bytes(value: float) -> str:
    """``1073741824`` -> ``"1.0 GiB"``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def _header(key: str) -> str:
    """A JSON key in words: ``median_step_s_cache_on`` -> ``median step, cache on``: the unit
    suffix ``_s`` goes (the cells say ms or s), underscores become spaces."""
    words = key.replace("_s_", ", ").removesuffix("_s").replace("_", " ")
    return words.replace(" over ", " / ")


def _number(key: str, value: float) -> str:
    """A figure as a reader wants it: times in ms or us, bytes in KiB to GiB, ratios as 1.023x,
    shares in percent."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    last = key.rsplit(".", 1)[-1]
    if any(last == word or last.endswith("_" + word) for word in BYTE_KEYS):
        return _bytes(value)
    if isinstance(value, int):
        return str(value)
    if last.endswith(("_s", "seconds")) or "_s_" in last:
        if abs(value) >= 1:
            return f"{value:.2f} s"
        if abs(value) >= 1e-3:
            return f"{value * 1e3:.3g} ms"
        return f"{value * 1e6:.3g} us"
    if "share" in last:
        return f"{value * 100:.2f}%"
    if "ratio" in last or "speedup" in last:
        return f"{value:.3f}x"
    return f"{value:.4g}"


def _leaves(value, path: tuple[str, ...] = ()):
    """(path, scalar) for every number, string or flag in a JSON value; lists of scalars joined."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, str(key)))
    elif isinstance(value, list):
        if all(not isinstance(item, (dict, list)) for item in value):
            yield path, ", ".join(_number(path[-1] if path else "", item) for item in value)
        else:
            for index, item in enumerate(value, 1):
                label = item.get("case") if isinstance(item, dict) else None
                yield from _leaves(item, (*path, str(label or f"#{index}")))
    else:
        yield path, value


def _tables(figures: dict) -> list[str]:
    """Rows are a leaf's path but its last key; leaves that share their columns make one table."""
    rows: dict[tuple[str, ...], dict[str, str]] = {}
    for path, value in _leaves(figures):
        if len(path) == 1 and path[0] in MACHINE_KEYS + TITLE_KEYS:
            continue
        row, column = path[:-1], path[-1]
        rows.setdefault(row, {})[column] = _number(column, value)
    groups: dict[tuple[str, ...], list[tuple[tuple[str, ...], dict[str, str]]]] = {}
    for row, cells in rows.items():
        groups.setdefault(tuple(cells), []).append((row, cells))
    lines = []
    for columns, members in groups.items():
        lines += [
            "",
            "| | " + " | ".join(_header(column) for column in columns) + " |",
            "|---|" + "---|" * len(columns),
        ]
        for row, cells in members:
            label = " / ".join(_header(part) for part in row) or "(the run)"
            lines.append(f"| {label} | " + " | ".join(cells[c] for c in columns) + " |")
    return lines


def _peers(figures: dict) -> list[str]:
    """Step time over the hand-written loop (own time a step in brackets), runner x batch size."""
    lines = []
    for mode, by_batch in figures["results"].items():
        batches = list(by_batch)
        runners = list(dict.fromkeys(r for batch in by_batch.values() for r in batch))
        lines += [
            "",
            f"{mode}: median ratio of paired blocks (mpnb's own time a step, share of the hand "
            "loop's step)",
            "",
            "| runner | " + " | ".join(f"batch {b}" for b in batches) + " |",
            "|---|" + "---|" * len(batches),
        ]
        for runner in runners:
            cells = []
            for batch in batches:
                cell = by_batch[batch].get(runner)
                if cell is None:
                    cells.append("")
                    continue
                text = f"{cell['ratio']:.3f}x"
                if "own_s_per_step" in cell:
                    own = cell["own_s_per_step"] * 1e6
                    text += f" ({own:.0f} us, {cell['own_share'] * 100:.1f}%)"
                cells.append(text)
            lines.append(f"| {runner} | " + " | ".join(cells) + " |")
        lines += ["", _peers_plot(mode, by_batch)]
    return lines


def _peers_plot(mode: str, by_batch: dict) -> str:
    """The peers' table drawn: a bar per runner and batch size, the step time over the hand
    loop's, with a line at 1.0 (the hand loop)."""
    groups = [
        (f"batch {batch}", [(runner, cell["ratio"]) for runner, cell in cells.items()])
        for batch, cells in by_batch.items()
    ]
    return _bars(
        f"{mode}: step time over the hand loop",
        groups,
        "the hand loop, 1.0x",
        f"{mode}: each runner's median step over the hand-written loop's, per batch size (the "
        "table's figures)",
        hover=lambda group, label, ratio: f"{label}, {group}: {ratio:.3f}x",
    )


def _ratios_plot(name: str, figures: dict) -> str:
    """Every ratio a results file holds (a key that says ratio or speedup), a bar each beside a
    line at 1.0x; empty when it holds none."""
    bars = [
        (" / ".join(_header(part) for part in path), value)
        for path, value in _leaves(figures)
        if path
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and ("ratio" in path[-1] or "speedup" in path[-1])
        and value > 0
    ]
    if not bars:
        return ""
    return _bars(
        f"{name}: ratios",
        [("", bars)],
        "1.0x",
        f"{name}: each ratio of the tables above (a speedup, or a cost over its baseline)",
        hover=lambda group, label, ratio: f"{label}: {ratio:.3f}x",
    )


def _bars(title: str, groups, reference: str, caption: str, hover) -> str:
    """Horizontal bars, one a (label, ratio), in groups under a bold label, with a dashed line
    at 1.0. An inline SVG: the site loads nothing more."""
    ratios = [ratio for _, bars in groups for _, ratio in bars]
    top = max(1.1, max(ratios, default=1.0) * 1.05)
    longest = max((len(label) for _, bars in groups for label, _ in bars), default=10)
    bar, gap, label_width, width = 11, 4, min(420, 12 + 6 * longest), 360
    rows, y = [], 18
    for group, bars in groups:
        if group:
            rows.append(f'<text x="0" y="{y + 9}" font-weight="bold">{escape(group)}</text>')
            y += bar + gap
        for label, ratio in bars:
            length = width * ratio / top
            rows.append(
                f'<text x="{label_width - 6}" y="{y + 9}" text-anchor="end">{escape(label)}</text>'
                f'<rect x="{label_width}" y="{y}" width="{length:.1f}" height="{bar}" '
                f'fill="#3f51b5" opacity="0.75"><title>{escape(hover(group, label, ratio))}'
                "</title></rect>"
                f'<text x="{label_width + length + 4:.1f}" y="{y + 9}">{ratio:.3f}x</text>'
            )
            y += bar + gap
        y += gap * 2
    one = label_width + width / top
    return (
        f'<figure class="mpnb-plot"><svg xmlns="http://www.w3.org/2000/svg" role="img" '
        f'width="{label_width + width + 60}" height="{y + 4}" '
        f'viewBox="0 0 {label_width + width + 60} {y + 4}" style="max-width: 100%; height: auto" '
        f'font-size="11" font-family="sans-serif"><title>{escape(title)}</title>'
        + "".join(rows)
        + f'<line x1="{one:.1f}" x2="{one:.1f}" y1="4" y2="{y}" stroke="#c62828" '
        'stroke-dasharray="3,3"/>'
        f'<text x="{one + 3:.1f}" y="12" fill="#c62828">{escape(reference)}</text></svg>'
        f"<figcaption>{escape(caption)}</figcaption></figure>"
    )


def _where(figures: dict) -> str:
    parts = [
        f"{key} {figures[key]}"
        for key in MACHINE_KEYS
        if key in figures and not isinstance(figures[key], (dict, list))
    ]
    return "Measured on: " + ", ".join(parts) + "." if parts else ""


def tables_markdown() -> str:
    """Every results file as a section of the performance page."""
    sections = []
    for path in sorted(RESULTS.glob("*.json")):
        figures = json.loads(path.read_text())
        name = path.stem
        script = name.split("-")[0]
        if script == "peers":
            body = _peers(figures)
        else:
            plot = _ratios_plot(name, figures)
            body = [*_tables(figures), *(["", plot] if plot else [])]
        sections += [
            f"### {name}",
            "",
            f"`benchmarks/results/{path.name}`, written by `python benchmarks/{script}.py`. "
            + _where(figures),
            *body,
            "",
        ]
    return "\n".join(sections)


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    if page.file.src_uri == "performance.md" and PLACEHOLDER in markdown:
        return markdown.replace(PLACEHOLDER, tables_markdown())
    return markdown
