"""The record of a training run: one row per optimizer step, kept whole, saved and reloaded.

A :class:`History` is plain host data (numbers and strings, no tensors), so it survives a
kernel restart through CSV or JSON and travels inside a checkpoint loaded with
``torch.load(weights_only=True)``.

Example:
    >>> h = History()
    >>> h.extend({"step": [1, 2], "loss": [0.9, 0.7], "skipped": [True, False], "mode": ["fp16"] * 2})
    >>> h.skipped_steps, h.loss
    ([1], [0.9, 0.7])
    >>> History.from_dict(h.to_dict()).loss == h.loss
    True
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from mpnb import views
from mpnb._files import atomic_write, read_regular
from mpnb._render import html_table, text_table
from mpnb.errors import MpnbError
from mpnb.precision.backends.base import format_bytes
from mpnb.training.history_format import (
    COLUMNS,
    FORMAT,
    VERSION,
    checked_record,
    column_default,
    json_safe,
    parse_csv,
    parse_json,
    record_csv,
    record_json,
)

__all__ = ["History", "COLUMNS"]

#: Event kinds that mean the run went wrong (put there by mpnb.training.health).
ALARM_KINDS = ("nonfinite", "collapse", "zero_gradients")


class _Column:
    """Read-only attribute access to one column, as a list."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.__doc__ = COLUMNS[name][1]

    def __get__(self, history: History | None, owner: type) -> Any:
        if history is None:
            return self
        return history.columns[self.name]


class History:
    """Per-step telemetry of a training run.

    Columns (each a list, one entry per optimizer step) are listed in :data:`COLUMNS`;
    read them as attributes (``history.loss``, ``history.loss_scale``). ``meta`` holds
    run facts (device, mode, model size...), ``events`` notes such as interruptions.

    Example:
        >>> h = History(meta={"device": "cpu"})
        >>> h.extend({"step": [1], "loss": [2.5]})
        >>> len(h), h.columns["loss_scale"]
        (1, [nan])
    """

    step = _Column()
    epoch = _Column()
    loss = _Column()
    loss_missing = _Column()
    loss_scale = _Column()
    skipped = _Column()
    lr = _Column()
    step_time = _Column()
    forward_time = _Column()
    samples_per_s = _Column()
    memory_used = _Column()
    memory_peak = _Column()
    memory_reserved = _Column()
    grad_norm = _Column()
    mode = _Column()

    def __init__(self, meta: Mapping[str, Any] | None = None) -> None:
        self.meta: dict[str, Any] = dict(meta or {})
        self.events: list[dict[str, Any]] = []
        self.columns: dict[str, list[Any]] = {name: [] for name in COLUMNS}

    def __len__(self) -> int:
        return len(self.columns["step"])

    def extend(self, rows: Mapping[str, Sequence[Any]]) -> None:
        """Append rows given column-wise; missing columns get their empty value (NaN, 0, False, '').

        Raises:
            ValueError: an unknown column, or columns of different lengths.
        """
        unknown = sorted(set(rows) - set(COLUMNS))
        if unknown:
            raise ValueError(f"unknown History columns {unknown}; valid: {', '.join(COLUMNS)}")
        lengths = {len(values) for values in rows.values()}
        if len(lengths) > 1:
            raise ValueError(f"columns differ in length: { {k: len(v) for k, v in rows.items()} }")
        count = lengths.pop() if lengths else 0
        for name, (kind, _) in COLUMNS.items():
            values = rows.get(name)
            self.columns[name].extend(
                values if values is not None else [column_default(kind)] * count
            )

    def first_trouble(self, start: int = 0, *, skips: bool = True) -> int | None:
        """The first row from ``start`` whose loss was read and is not finite, or (with ``skips``)
        whose step was skipped for overflow; None when there is none. What the watchers of a
        flush ask of its new rows: the usual answer, none, without a Python step per row.

        Example:
            >>> h = History()
            >>> h.extend({"step": [1, 2, 3], "loss": [0.5, float("inf"), 0.5], "skipped": [False, False, True]})
            >>> h.first_trouble(), h.first_trouble(2), h.first_trouble(2, skips=False)
            (1, 2, None)
        """
        losses, skipped = self.columns["loss"][start:], self.columns["skipped"][start:]
        if all(map(math.isfinite, losses)) and not (skips and any(skipped)):
            return None
        missing = self.columns["loss_missing"][start:]  # NaN that stands for "not read"
        for offset, (loss, skip, unread) in enumerate(zip(losses, skipped, missing)):
            if (skips and skip) or not (unread or math.isfinite(loss)):
                return start + offset
        return None

    def note(self, message: str, **details: Any) -> None:
        """Record an event (interruption, alarm, switch) at the current step. A detail that is
        an inf or NaN number is kept as the string ``float()`` reads (``"nan"``), as a history
        file holds it: the event reads the same before and after a file.

        Example:
            >>> history = History()
            >>> history.note("step 1 skipped", kind="origin", producer_max=float("nan"))
            >>> history.events[0]["producer_max"]
            'nan'
        """
        details = json_safe(details)
        for key, value in details.items():
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError):
                raise MpnbError(
                    f"event detail {key!r} is a {type(value).__name__}, which a history file "
                    "cannot hold: give a number, a string, or a list or dict of them"
                ) from None
        self.events.append(
            {"step": self.columns["step"][-1] if len(self) else 0, "message": message, **details}
        )

    def rows(self) -> Iterator[dict[str, Any]]:
        """The rows as dicts, oldest first."""
        names = list(COLUMNS)
        for values in zip(*(self.columns[name] for name in names)):
            yield dict(zip(names, values))

    @property
    def skipped_steps(self) -> list[int]:
        """Step numbers whose optimizer step was skipped (gradient overflow; the scale backed off)."""
        return [
            step for step, skipped in zip(self.columns["step"], self.columns["skipped"]) if skipped
        ]

    def summary(self) -> RunSummary:
        """The run in a few numbers: steps, skipped, final loss and scale, median step time, peak memory,
        and the run's alarms (a non-finite loss, a collapsed scale, zero gradients; see :mod:`mpnb.training.health`).
        A dict that shows itself as a table (see :class:`RunSummary`).

        The final loss is the last step the optimizer took, NaN or inf included: a diverged run
        reads as one (steps whose loss could not be read are left out); ``final_loss_step`` is
        that step, ``last_step`` the run's last, and the table names the step where they differ."""
        losses = [
            (step, v)
            for step, v, s, missing in zip(self.step, self.loss, self.skipped, self.loss_missing)
            if not (s or missing)
        ]
        timed = self.step_time[1:] or self.step_time  # the first step carries warm-up
        rates = [v for v in self.samples_per_s[1:] or self.samples_per_s if math.isfinite(v)]
        peaks = [v for v in self.memory_peak if math.isfinite(v)]
        return RunSummary(
            steps=len(self),
            skipped=len(self.skipped_steps),
            final_loss=losses[-1][1] if losses else math.nan,
            final_loss_step=losses[-1][0] if losses else None,
            last_step=self.step[-1] if len(self) else None,
            final_loss_scale=self.loss_scale[-1] if len(self) else math.nan,
            median_step_time=statistics.median(timed) if timed else math.nan,
            median_samples_per_s=statistics.median(rates) if rates else math.nan,
            peak_memory=max(peaks) if peaks else math.nan,
            modes=sorted(set(self.mode)),
            alarms=[event["message"] for event in self.events if event.get("kind") in ALARM_KINDS],
        )

    def summary_rows(self) -> list[tuple[str, str]]:
        """:meth:`summary` as (label, formatted value) pairs, for tables."""
        return self.summary().rows()

    def __repr__(self) -> str:
        s = self.summary()
        return f"<mpnb.History {s['steps']} steps, {s['skipped']} skipped, final loss {s['final_loss']:.4g}>"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text("mpnb training history\n" + text_table(("", ""), self.summary_rows()))

    def _repr_html_(self) -> str:
        return "<b>mpnb training history</b>" + html_table(("", ""), self.summary_rows())

    # -- export and import ------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, numbers, strings): what JSON export and checkpoints store."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "meta": self.meta,
            "events": self.events,
            "columns": {name: list(values) for name, values in self.columns.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> History:
        """Rebuild a History from :meth:`to_dict` output, every column checked against its type.

        Raises:
            ValueError: the data is not an mpnb history of a version this mpnb reads, or a field
                holds what its column or event cannot: the message names the field and the value.
        """
        record = checked_record(data)
        history = cls(record["meta"])
        history.events = record["events"]
        history.extend(record["columns"])
        return history

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        """Write (or, with no path, return) the history as standard JSON (inf and NaN as strings).

        The file is replaced whole, never written through a link (see :func:`mpnb._files.atomic_write`).
        """
        text = record_json(self.to_dict())
        if path is not None:
            with atomic_write(path) as file:
                file.write(text)
        return text

    def to_csv(self, path: str | os.PathLike[str] | None = None) -> str:
        """Write (or return) the history as CSV: a ``# mpnb-history {...}`` line with meta and
        events, then a header row and one row per step. ``pandas.read_csv(path, skiprows=1)``
        reads the rows (``History.load(path).to_pandas()`` too, with the text cells as written);
        a spreadsheet shows every text as text, never running one as a formula.

        The file is replaced whole, never written through a link (see :func:`mpnb._files.atomic_write`).
        """
        text = record_csv(self.to_dict())
        if path is not None:
            with atomic_write(path, newline="") as file:
                file.write(text)
        return text

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> History:
        """Read a history written by :meth:`to_csv` (``.csv``) or :meth:`to_json` (anything else).

        Raises:
            ValueError: the file is not an mpnb history, or not a sound one: the message names
                the file and the line (CSV) or the field (JSON), and what is wrong there. A
                device, a pipe or a folder (a link to one too) is refused before it is read.
        """
        name = os.fspath(path)
        raw = read_regular(name, what="a history")
        try:
            text = raw.decode("utf-8-sig")  # a byte-order mark (a spreadsheet's save) read past
        except UnicodeDecodeError as error:
            line = raw.count(b"\n", 0, error.start) + 1
            raise ValueError(
                f"{name!r}, line {line}: not UTF-8 text ({error.reason} at byte {error.start})"
            ) from None
        if name.lower().endswith(".csv"):  # RUN.CSV too
            return cls.from_dict(parse_csv(text, name))
        data = parse_json(text, name)
        try:
            return cls.from_dict(data)
        except ValueError as error:
            raise ValueError(f"{name!r}: {error}") from None

    def to_pandas(self) -> Any:
        """The rows as a pandas DataFrame (needs ``pip install pandas``)."""
        try:
            import pandas
        except ImportError as error:
            raise ImportError("History.to_pandas() needs pandas: pip install pandas") from error
        return pandas.DataFrame(self.columns)

    def plot(self) -> Any:
        """A static plotly figure of the run: loss, loss scale with skipped steps, memory, throughput."""
        return views.view("history_figure")(self)


class RunSummary(dict):
    """:meth:`History.summary`: a plain dict of the run's numbers (code reads ``summary["steps"]``,
    JSON takes it whole) that a notebook shows as a table and ``repr`` as aligned text.

    Example:
        >>> h = History()
        >>> h.extend({"step": [1, 2], "loss": [0.9, 0.7], "loss_scale": [1.0, 1.0], "mode": ["bf16"] * 2})
        >>> summary = h.summary()
        >>> summary["steps"], summary["final_loss"]
        (2, 0.7)
        >>> print(repr(summary).splitlines()[1])
        final loss         0.7
    """

    def rows(self) -> list[tuple[str, str]]:
        """(label, formatted value) pairs, for tables."""
        return [
            ("steps", f"{self['steps']} ({self['skipped']} skipped)"),
            ("final loss", self._final_loss()),
            ("final loss scale", f"{self['final_loss_scale']:g}"),
            ("median step time", f"{self['median_step_time'] * 1e3:.2f} ms"),
            ("median throughput", f"{self['median_samples_per_s']:.0f} samples/s"),
            ("peak memory", format_bytes(self["peak_memory"])),
            ("modes", ", ".join(self["modes"]) or "-"),
            *(("alarm", message) for message in self["alarms"]),
        ]

    def _final_loss(self) -> str:
        """The final loss, with its step where steps after it were skipped (or unread)."""
        shown = f"{self['final_loss']:.4g}"
        step = self.get("final_loss_step")
        if step is not None and step != self.get("last_step"):
            shown += f" (step {step}, the last the optimizer took)"
        return shown

    def __repr__(self) -> str:
        # a table without its (empty) header line
        return text_table(("", ""), self.rows()).partition("\n")[2]

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def _repr_html_(self) -> str:
        return html_table(("", ""), self.rows())

    def _repr_markdown_(self) -> str:
        def cell(text: str) -> str:
            return text.replace("|", "\\|")

        lines = ["| | |", "|---|---|"] + [f"| {cell(k)} | {cell(v)} |" for k, v in self.rows()]
        return "\n".join(lines)
