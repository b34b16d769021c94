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

import csv
import io
import json
import math
import os
import statistics
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from mpnb import views
from mpnb._files import atomic_write
from mpnb._render import html_table, text_table
from mpnb.precision.backends.base import format_bytes

__all__ = ["History", "COLUMNS", "column_default"]

#: Event kinds that mean the run went wrong (put there by mpnb.training.health).
ALARM_KINDS = ("nonfinite", "collapse")

FORMAT = "mpnb-history"
VERSION = 1
CSV_HEADER_PREFIX = f"# {FORMAT} "

#: Every column a History keeps, with its type and meaning.
COLUMNS: dict[str, tuple[type, str]] = {
    "step": (int, "optimizer step number, counting from 1 over the trainer's life"),
    "epoch": (int, "epoch the step belongs to, counting from 0"),
    "loss": (float, "training loss of the step (mean over accumulated micro-batches)"),
    "loss_missing": (bool, "no loss could be read for the step (a framework step returned none); loss is NaN"),
    "loss_scale": (float, "GradScaler scale the step's backward used (1.0 without a scaler)"),
    "skipped": (bool, "the optimizer step was skipped because gradients overflowed"),
    "lr": (float, "learning rate of the first parameter group during the step"),
    "step_time": (float, "wall seconds from the end of the previous step to the end of this one"),
    "samples_per_s": (float, "samples in the step divided by step_time (NaN when unknown)"),
    "forward_time": (
        float,
        "seconds from each forward pass's start (autocast()) to its backward(), summed over the step: "
        "the process's own work, where no rank waits for another under DDP (NaN where unknown)",
    ),
    "memory_used": (float, "bytes in use on the device, sampled (process RSS on CPU)"),
    "memory_peak": (float, "most bytes in use so far on the device"),
    "memory_reserved": (float, "bytes held by the allocator cache (NaN where there is none)"),
    "grad_norm": (float, "total norm of the unscaled gradients (NaN unless clipping or asked for)"),
    "mode": (str, "precision mode the step ran in"),
}


def column_default(kind: type) -> Any:
    """The value a column of type ``kind`` holds where nothing was recorded (NaN for floats)."""
    return {int: 0, float: math.nan, bool: False, str: ""}[kind]


def _parse_cell(kind: type, text: str) -> Any:
    if kind is bool:
        return text.strip().lower() in ("true", "1")
    if kind is str:
        return text
    return kind(float(text)) if kind is int else float(text)


def _json_safe(value: Any) -> Any:
    """inf / -inf / NaN as the strings float() reads back; JSON itself has no such numbers."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def _from_json(kind: type, value: Any) -> Any:
    if value is None:
        return column_default(kind)
    return float(value) if kind is float else value


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
            self.columns[name].extend(values if values is not None else [column_default(kind)] * count)

    def note(self, message: str, **details: Any) -> None:
        """Record an event (interruption, alarm, switch) at the current step."""
        self.events.append({"step": self.columns["step"][-1] if len(self) else 0, "message": message, **details})

    def rows(self) -> Iterator[dict[str, Any]]:
        """The rows as dicts, oldest first."""
        names = list(COLUMNS)
        for values in zip(*(self.columns[name] for name in names)):
            yield dict(zip(names, values))

    @property
    def skipped_steps(self) -> list[int]:
        """Step numbers whose optimizer step was skipped (gradient overflow; the scale backed off)."""
        return [step for step, skipped in zip(self.columns["step"], self.columns["skipped"]) if skipped]

    def summary(self) -> dict[str, Any]:
        """The run in a few numbers: steps, skipped, final loss and scale, median step time, peak memory,
        and the run's alarms (a non-finite loss, a collapsed scale; see :mod:`mpnb.training.health`).

        The final loss is the last step the optimizer took, NaN or inf included: a diverged run
        reads as one (steps whose loss could not be read are left out)."""
        losses = [v for v, s, missing in zip(self.loss, self.skipped, self.loss_missing) if not (s or missing)]
        timed = self.step_time[1:] or self.step_time  # the first step carries warm-up
        rates = [v for v in self.samples_per_s[1:] or self.samples_per_s if math.isfinite(v)]
        peaks = [v for v in self.memory_peak if math.isfinite(v)]
        return {
            "steps": len(self),
            "skipped": len(self.skipped_steps),
            "final_loss": losses[-1] if losses else math.nan,
            "final_loss_scale": self.loss_scale[-1] if len(self) else math.nan,
            "median_step_time": statistics.median(timed) if timed else math.nan,
            "median_samples_per_s": statistics.median(rates) if rates else math.nan,
            "peak_memory": max(peaks) if peaks else math.nan,
            "modes": sorted(set(self.mode)),
            "alarms": [event["message"] for event in self.events if event.get("kind") in ALARM_KINDS],
        }

    def summary_rows(self) -> list[tuple[str, str]]:
        """:meth:`summary` as (label, formatted value) pairs, for tables."""
        s = self.summary()
        return [
            ("steps", f"{s['steps']} ({s['skipped']} skipped)"),
            ("final loss", f"{s['final_loss']:.4g}"),
            ("final loss scale", f"{s['final_loss_scale']:g}"),
            ("median step time", f"{s['median_step_time'] * 1e3:.2f} ms"),
            ("median throughput", f"{s['median_samples_per_s']:.0f} samples/s"),
            ("peak memory", format_bytes(s["peak_memory"])),
            ("modes", ", ".join(s["modes"]) or "-"),
            *(("alarm", message) for message in s["alarms"]),
        ]

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
        """Rebuild a History from :meth:`to_dict` output.

        Raises:
            ValueError: the data is not an mpnb history of a version this mpnb reads.
        """
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(
                f"not an {FORMAT} version {VERSION} record (format={data.get('format')!r}, "
                f"version={data.get('version')!r})"
            )
        history = cls(data.get("meta"))
        history.events = list(data.get("events", []))
        columns = data["columns"]
        history.extend({name: [_from_json(COLUMNS[name][0], v) for v in values] for name, values in columns.items()})
        return history

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        """Write (or, with no path, return) the history as standard JSON (inf and NaN as strings).

        The file is replaced whole, never written through a link (see :func:`mpnb._files.atomic_write`).
        """
        data = self.to_dict()
        data["columns"] = {k: [_json_safe(v) for v in vs] for k, vs in data["columns"].items()}
        text = json.dumps(data, allow_nan=False)
        if path is not None:
            with atomic_write(path) as file:
                file.write(text)
        return text

    def to_csv(self, path: str | os.PathLike[str] | None = None) -> str:
        """Write (or return) the history as CSV: a ``# mpnb-history {...}`` line with meta and
        events, then a header row and one row per step. ``pandas.read_csv(path, comment="#")``
        reads it too.

        The file is replaced whole, never written through a link (see :func:`mpnb._files.atomic_write`).
        """
        buffer = io.StringIO()
        header = {"version": VERSION, "meta": self.meta, "events": self.events}
        buffer.write(CSV_HEADER_PREFIX + json.dumps(header) + "\n")
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(COLUMNS)
        for row in self.rows():
            writer.writerow(row.values())
        text = buffer.getvalue()
        if path is not None:
            with atomic_write(path, newline="") as file:
                file.write(text)
        return text

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> History:
        """Read a history written by :meth:`to_csv` (``.csv``) or :meth:`to_json` (anything else).

        Raises:
            ValueError: the file is not an mpnb history.
        """
        with open(path, encoding="utf-8", newline="") as file:
            text = file.read()
        if os.fspath(path).endswith(".csv"):
            return cls._from_csv(text, path)
        return cls.from_dict(json.loads(text))

    @classmethod
    def _from_csv(cls, text: str, path: str | os.PathLike[str]) -> History:
        first, _, body = text.partition("\n")
        if not first.startswith(CSV_HEADER_PREFIX):
            raise ValueError(f"{os.fspath(path)!r} is not an mpnb history CSV (first line {first[:40]!r})")
        header = json.loads(first[len(CSV_HEADER_PREFIX) :])
        reader = csv.reader(io.StringIO(body))
        names = next(reader, [])
        unknown = sorted(set(names) - set(COLUMNS))
        if unknown:
            raise ValueError(f"{os.fspath(path)!r} has unknown columns {unknown}")
        values: dict[str, list[Any]] = {name: [] for name in names}
        for row in reader:
            for name, cell in zip(names, row):
                values[name].append(_parse_cell(COLUMNS[name][0], cell))
        history = cls(header.get("meta"))
        history.events = list(header.get("events", []))
        history.extend(values)
        return history

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
