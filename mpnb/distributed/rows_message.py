"""A worker's telemetry rows as they cross the channel: JSON data, signed, checked on arrival.

Nothing received is unpickled. A message is the launch's HMAC tag followed by a JSON object
``{"rank", "fit", "seq", "columns"}``; :func:`decode` takes it apart only if the tag is right,
the size is bounded, the rank belongs to this node, the sequence number is the next one, and
every column is one :data:`~mpnb.training.history.COLUMNS` knows, holding values of its type.

Example:
    >>> from mpnb.distributed.signing import Signer
    >>> signer = Signer(b"s" * 32)
    >>> data = encode(signer, RowsMessage(rank=1, fit=0, seq=0, columns={"step": [1], "loss": [0.5]}))
    >>> decode(signer, data, ranks=range(2))
    RowsMessage(rank=1, fit=0, seq=0, columns={'step': [1], 'loss': [0.5]})
    >>> decode(signer, data.replace(b'"rank": 1', b'"rank": 5'), ranks=range(2))
    Traceback (most recent call last):
    ...
    mpnb.distributed.rows_message.Refused: not signed with this launch's secret
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from mpnb.distributed.signing import TAG_BYTES, Signer
from mpnb.errors import quoted
from mpnb.training.history import COLUMNS

__all__: list[str] = []

#: The largest message read (a flush of 64 rows is a few kB); anything larger is refused unread.
MAX_MESSAGE_BYTES = 4 << 20
#: The most trainers one rank may fit in a launch (the ``fit`` index is below it).
MAX_FITS = 10_000
#: The longest text a column may hold (a mode's name).
MAX_TEXT = 64
_INT_LIMIT = 2**63


class Refused(Exception):
    """A message that was not applied; its text says why."""


@dataclasses.dataclass(frozen=True)
class RowsMessage:
    """Rows of the ``fit``-th history of ``rank``, the ``seq``-th batch that rank sent for it."""

    rank: int
    fit: int
    seq: int
    columns: dict[str, list[Any]]


def encode(signer: Signer, message: RowsMessage) -> bytes:
    """The signed wire form of ``message`` (NaN and infinities as JSON's usual extensions)."""
    return signer.sign(json.dumps(dataclasses.asdict(message)).encode("utf-8"))


def decode(signer: Signer, data: bytes, ranks: range) -> RowsMessage:
    """The message ``data`` carries, checked whole.

    Raises:
        Refused: too large, not signed with this launch's secret, not a rows message, a rank
            outside ``ranks``, or a column that is unknown, of another type or another length.
    """
    if len(data) > MAX_MESSAGE_BYTES + TAG_BYTES:
        raise Refused(f"{len(data)} bytes, more than the {MAX_MESSAGE_BYTES} a message may have")
    payload = signer.open(data)
    if payload is None:
        raise Refused("not signed with this launch's secret")
    try:
        fields = json.loads(payload.decode("utf-8"))
    except (ValueError, RecursionError) as error:
        raise Refused(f"not JSON ({error})") from None
    if not isinstance(fields, dict) or set(fields) != {"rank", "fit", "seq", "columns"}:
        raise Refused("not a rows message (it needs rank, fit, seq and columns)")
    rank, fit, seq = (_whole(fields, name) for name in ("rank", "fit", "seq"))
    if rank not in ranks:
        raise Refused(
            f"rank {rank} is not one of this node's ranks {ranks.start}..{ranks.stop - 1}"
        )
    if fit >= MAX_FITS:
        raise Refused(f"fit index {fit} is not below {MAX_FITS}")
    return RowsMessage(rank, fit, seq, _checked_columns(fields["columns"]))


def _whole(fields: dict[str, Any], name: str) -> int:
    value = fields[name]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _INT_LIMIT:
        raise Refused(f"{name} must be a whole number >= 0, got {quoted(value, 40)}")
    return value


def _checked_columns(columns: Any) -> dict[str, list[Any]]:
    if not isinstance(columns, dict) or not columns:
        raise Refused("columns must be a non-empty object of lists")
    lengths = set()
    for name, values in columns.items():
        if name not in COLUMNS:
            raise Refused(f"unknown column {quoted(name, 40)}")
        if not isinstance(values, list):
            raise Refused(f"column {name} is not a list")
        kind = COLUMNS[name][0]
        bad = next((value for value in values if not _fits(kind, value)), _NONE)
        if bad is not _NONE:
            raise Refused(f"column {name} holds {quoted(bad, 40)}; it takes {_KINDS[kind]}")
        lengths.add(len(values))
    if len(lengths) != 1:
        raise Refused(f"columns of different lengths {sorted(lengths)}")
    return columns


_NONE = object()
_KINDS = {
    int: "whole numbers",
    float: "numbers",
    bool: "True or False",
    str: f"texts of at most {MAX_TEXT} characters",
}


def _fits(kind: type, value: Any) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is int:
        return isinstance(value, int) and -_INT_LIMIT < value < _INT_LIMIT
    if kind is float:
        return isinstance(value, float) or (
            isinstance(value, int) and -_INT_LIMIT < value < _INT_LIMIT
        )
    return isinstance(value, str) and len(value) <= MAX_TEXT
