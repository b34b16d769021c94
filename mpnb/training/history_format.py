"""A :class:`~mpnb.training.history.History` as data: its columns and their types, its CSV and
JSON files, and the strict reading of both.

A record is what ``History.to_dict()`` returns: format, version, meta, events and one list per
column. Files are written for people to open: a spreadsheet shows every text cell of the CSV as
text and never runs it as a formula (see :func:`mpnb._render.csv_cell`). Files are read as
coming from anyone: whatever is wrong with one is a ``ValueError`` that names the line (CSV) or
the field (JSON) and what is wrong there.

Example:
    >>> record = {"format": FORMAT, "version": VERSION, "meta": {}, "events": [],
    ...           "columns": {"step": [1], "loss": [0.5], "mode": ["=HYPERLINK(0)"]}}
    >>> text = record_csv(record)
    >>> print(text.splitlines()[2])
    1,0.5,"'=HYPERLINK(0)"
    >>> parse_csv(text, "run.csv")["columns"]["mode"]
    ['=HYPERLINK(0)']
    >>> checked_record({**record, "columns": {"step": ["inf"]}})
    Traceback (most recent call last):
    ValueError: field 'columns.step', row 0: 'inf' is not a whole number
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import numbers
import re
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy

from mpnb._render import csv_cell, from_csv_cell

__all__: list[str] = []

FORMAT = "mpnb-history"
VERSION = 1
CSV_HEADER_PREFIX = f"# {FORMAT} "

#: Every column a History keeps, with its type and meaning.
COLUMNS: dict[str, tuple[type, str]] = {
    "step": (int, "optimizer step number, counting from 1 over the trainer's life"),
    "epoch": (int, "epoch the step belongs to, counting from 0"),
    "loss": (float, "training loss of the step (mean over accumulated micro-batches)"),
    "loss_missing": (
        bool,
        "no loss could be read for the step (a framework step returned none); loss is NaN",
    ),
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

#: A JSON string as json.dumps writes it (ASCII only, every quote inside escaped).
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BOOLS = {"true": True, "1": True, "false": False, "0": False}


def column_default(kind: type) -> Any:
    """The value a column of type ``kind`` holds where nothing was recorded (NaN for floats)."""
    return {int: 0, float: math.nan, bool: False, str: ""}[kind]


# -- writing ---------------------------------------------------------------------------------


def record_json(record: Mapping[str, Any]) -> str:
    """The record as standard JSON: inf and NaN (in the columns, the events and the meta) as the
    strings ``float()`` reads back; the columns read them back as numbers."""
    return json.dumps(json_safe(record), allow_nan=False)


def record_csv(record: Mapping[str, Any]) -> str:
    """The record as CSV: a ``# mpnb-history {...}`` line with version, meta and events, then a
    header row and one row per step. ``pandas.read_csv(path, comment="#")`` reads it too.

    A spreadsheet splits the first line at its commas too, so a comma inside its JSON strings is
    written ``\\u002c``: every piece then starts at the JSON's own ``, `` and none can be a
    formula (an event message ``"a,=cmd|..."`` would otherwise start a cell with ``=``). A piece
    may start with a JSON string (an item of a list in the meta, a key), which a spreadsheet that
    trims the space reads as a quoted cell: a string's first character that starts a formula is
    written as its ``\\u`` escape (``"=SUM(2;3)"`` as ``"\\u003dSUM(2;3)"``).
    """
    header = json.dumps(
        json_safe(
            {"version": record["version"], "meta": record["meta"], "events": record["events"]}
        ),
        allow_nan=False,
    )
    header = _JSON_STRING.sub(_inert_json_string, header)
    columns = record["columns"]
    buffer = io.StringIO()
    buffer.write(CSV_HEADER_PREFIX + header + "\n" + ",".join(columns) + "\n")
    # Text quoted whole: unquoted, a carriage return inside it would end the row (only "\n" ends one here).
    writer = csv.writer(buffer, lineterminator="\n", quoting=csv.QUOTE_NONNUMERIC)
    writer.writerows(map(csv_cell, row) for row in zip(*columns.values()))
    return buffer.getvalue()


def _inert_json_string(string: re.Match[str]) -> str:
    """A JSON string token that no spreadsheet cell made from it runs: no comma, and a first
    character that would start a formula escaped (JSON reads both back as they were)."""
    text = string[0].replace(",", "\\u002c")
    if text[1:2] in _FORMULA_CHARACTERS:
        text = f'"\\u{ord(text[1]):04x}{text[2:]}'
    return text


#: The characters that start a formula and that json.dumps writes as themselves (a tab or a
#: carriage return it already writes as an escape).
_FORMULA_CHARACTERS = frozenset("=+-@")


def json_safe(value: Any) -> Any:
    """``value`` with each inf / -inf / NaN, in its lists and mappings too, as the string float()
    reads back (JSON itself has no such numbers), and each numpy number or array and torch tensor
    as the Python numbers and lists they hold (``.tolist()``: an ``np.float64`` from a metric).

    >>> json_safe({"accuracy": numpy.float32(0.5), "loss": [float("nan")]})
    {'accuracy': 0.5, 'loss': ['nan']}
    """
    if isinstance(value, (numpy.generic, numpy.ndarray)) or _is_tensor(value):
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def _is_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor (torch is asked only where it is imported already)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


# -- reading ---------------------------------------------------------------------------------


def parse_json(text: str, name: str) -> Any:
    """The data in a history JSON file's ``text`` (checked by :func:`checked_record` next).

    Raises:
        ValueError: ``text`` is not JSON (where it goes wrong), or nests too deep to read.
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{name!r} is not JSON: {error.msg} at line {error.lineno}, column {error.colno}"
        ) from None
    except RecursionError:
        raise ValueError(f"{name!r}: JSON nested too deep to be an mpnb history") from None
    except ValueError as error:  # a number too long for int(): a hostile file, not a history
        raise ValueError(f"{name!r} holds a number this mpnb does not read: {error}") from None


def parse_csv(text: str, name: str) -> dict[str, Any]:
    """The record in a history CSV's ``text``, every cell read as its column's type.

    Raises:
        ValueError: naming the line of the first thing wrong: no ``# mpnb-history`` header, a
            header that is not JSON, unknown or repeated column names, a row of the wrong
            length, a cell that is not of its column's type, a field too large.
    """
    first, _, body = text.partition("\n")
    if not first.startswith(CSV_HEADER_PREFIX):
        raise ValueError(
            f"{name!r} is not an mpnb history CSV: line 1 is {first[:40]!r}, not {CSV_HEADER_PREFIX!r}"
        )
    try:
        header = json.loads(first[len(CSV_HEADER_PREFIX) :])
    except (ValueError, RecursionError) as error:
        raise ValueError(
            f"{name!r}, line 1: the header is not the JSON mpnb writes ({error})"
        ) from None
    if not isinstance(header, dict):
        raise ValueError(
            f"{name!r}, line 1: the header is a {type(header).__name__}, not a JSON object"
        )
    reader = csv.reader(io.StringIO(body))
    try:
        names = _column_names(next(reader, None), f"{name!r}, line 2")
        rows = [[] for _ in names]
        for row in filter(None, reader):  # blank lines (an editor's last newline) hold no step
            where = f"{name!r}, line {reader.line_num + 1}"
            if len(row) != len(names):
                raise ValueError(
                    f"{where}: {len(row)} cells where line 2 names {len(names)} columns"
                )
            for values, column, cell in zip(rows, names, row):
                values.append(_cell_value(column, cell, where))
    except csv.Error as error:  # a field over csv.field_size_limit(), a stray quote
        raise ValueError(f"{name!r}, line {reader.line_num + 1}: {error}") from None
    record = {"format": FORMAT, **header, "columns": dict(zip(names, rows))}
    try:
        return checked_record(record)
    except ValueError as error:
        raise ValueError(f"{name!r}, line 1: {error}") from None


def _column_names(row: list[str] | None, where: str) -> list[str]:
    if row is None:
        raise ValueError(f"{where}: no column names (the file ends after its header)")
    unknown = sorted(set(row) - set(COLUMNS))
    if unknown:
        raise ValueError(f"{where}: unknown columns {_shown(unknown)}; valid: {', '.join(COLUMNS)}")
    repeated = sorted(column for column, count in Counter(row).items() if count > 1)
    if repeated:
        raise ValueError(f"{where}: columns named twice: {_shown(repeated)}")
    return row


def _cell_value(column: str, cell: str, where: str) -> Any:
    """The value a CSV cell holds, as its column's type."""
    kind = COLUMNS[column][0]
    if kind is str:
        return from_csv_cell(cell)
    if kind is bool:
        if cell.strip().lower() not in _BOOLS:
            raise ValueError(f"{where}, column {column!r}: {_shown(cell)} is not True or False")
        return _BOOLS[cell.strip().lower()]
    if kind is int:
        # else read as a float: 3.0 is whole, inf and 1.5 are not
        with contextlib.suppress(ValueError):
            return int(cell)
    try:
        number = float(cell)
    except ValueError:
        raise ValueError(f"{where}, column {column!r}: {_shown(cell)} is not a number") from None
    return _whole(number, cell, f"{where}, column {column!r}") if kind is int else number


def _whole(number: float, value: Any, where: str) -> int:
    if not (math.isfinite(number) and number.is_integer()):
        raise ValueError(f"{where}: {_shown(value)} is not a whole number")
    return int(number)


def _shown(value: Any) -> str:
    """A bad value as a message shows it: repr'd, and cut short (a hostile cell may be megabytes)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:50]}... ({len(text)} characters)"


# -- checking --------------------------------------------------------------------------------


def checked_record(data: Any) -> dict[str, Any]:
    """``data`` as a record of this format and version, every column of its own type and all of
    one length, events with their step and message; ints in float columns become floats, and
    None (a value never recorded) its column's default.

    Raises:
        ValueError: naming the field and the bad value.
    """
    if not isinstance(data, Mapping):
        raise ValueError(
            f"not an {FORMAT} version {VERSION} record (a {type(data).__name__}, not a mapping)"
        )
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        found = f"format={_shown(data.get('format'))}, version={_shown(data.get('version'))}"
        raise ValueError(f"not an {FORMAT} version {VERSION} record ({found})")
    meta = data.get("meta") or {}
    if not isinstance(meta, Mapping) or not all(isinstance(key, str) for key in meta):
        raise ValueError(f"field 'meta': {_shown(meta)} is not a mapping of names to values")
    events = data.get("events", [])
    if not isinstance(events, list):
        raise ValueError(f"field 'events': {_shown(events)} is not a list")
    columns = data.get("columns")
    if not isinstance(columns, Mapping):
        raise ValueError(
            f"field 'columns': {_shown(columns)} is not a mapping of column names to lists"
        )
    unknown = sorted(map(str, set(columns) - set(COLUMNS)))
    if unknown:
        raise ValueError(
            f"field 'columns': unknown columns {_shown(unknown)}; valid: {', '.join(COLUMNS)}"
        )
    checked = {name: _checked_column(name, values) for name, values in columns.items()}
    if checked:
        first, length = next((name, len(values)) for name, values in checked.items())
        for name, values in checked.items():
            if len(values) != length:
                raise ValueError(
                    f"field 'columns.{name}': {len(values)} values where 'columns.{first}' has {length}"
                )
    return {
        "format": FORMAT,
        "version": VERSION,
        "meta": dict(meta),
        "events": [_checked_event(f"events[{index}]", event) for index, event in enumerate(events)],
        "columns": checked,
    }


def _checked_event(field: str, event: Any) -> dict[str, Any]:
    """An event as :meth:`History.note` makes it: a step, a message, perhaps a kind, and details."""
    if not isinstance(event, Mapping) or not all(isinstance(key, str) for key in event):
        raise ValueError(f"field {field!r}: {_shown(event)} is not a mapping of names to values")
    step = _checked_value(int, event.get("step"), f"field '{field}.step'")
    _checked_value(str, event.get("message"), f"field '{field}.message'")
    if "kind" in event:
        _checked_value(str, event["kind"], f"field '{field}.kind'")
    return {**event, "step": step}


def _checked_column(name: str, values: Any) -> list[Any]:
    where = f"field 'columns.{name}'"
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise ValueError(f"{where}: {_shown(values)} is not a list")
    kind = COLUMNS[name][0]
    # the usual case, a record mpnb wrote: nothing to convert
    if {type(value) for value in values} <= {kind}:
        return list(values)
    default = column_default(kind)
    return [
        default if value is None else _checked_value(kind, value, f"{where}, row {row}")
        for row, value in enumerate(values)
    ]


def _checked_value(kind: type, value: Any, where: str) -> Any:
    """``value`` as a ``kind``: only text for text; for a bool a bool (numpy's too) or the whole
    number 0 or 1, as a flag recorded from the host may be; for an int a whole number (3.0 too,
    never True); for a float any real number, or the text inf, -inf or nan (JSON has no such
    numbers)."""
    if kind is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: {_shown(value)} is not text")
        return value
    if kind is bool:
        if not (
            isinstance(value, (bool, numpy.bool_))
            or (isinstance(value, numbers.Integral) and value in (0, 1))
        ):
            raise ValueError(f"{where}: {_shown(value)} is not True or False")
        return bool(value)
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise ValueError(
            f"{where}: {_shown(value)} is not a {'whole ' if kind is int else ''}number"
        )
    if kind is int and isinstance(value, numbers.Integral):
        return int(value)
    number = _non_finite(value, where) if isinstance(value, str) else float(value)
    return _whole(number, value, where) if kind is int else number


def _non_finite(text: str, where: str) -> float:
    """The inf, -inf or nan a JSON history writes as text; any other text is no number of it."""
    try:
        number = float(text)
    except ValueError:
        number = 0.0
    if math.isfinite(number):
        raise ValueError(f"{where}: {_shown(text)} is text, not a number")
    return number
