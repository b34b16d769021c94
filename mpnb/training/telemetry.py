"""Per-step telemetry without per-step host-device synchronisation.

The :class:`Recorder` takes each step's values as they are: Python numbers stay on the host,
tensors (loss, loss scale, skipped flag, gradient norm) stay on the device. Pending tensors
are copied to the host together, in one transfer, every ``flush_every`` steps or when a
sink asks for fresh data (a dashboard due to redraw). On CUDA this keeps the training loop
free of ``.item()`` stalls; everything lands in one :class:`~mpnb.training.history.History`.

One recorder, many sinks: a :class:`Sink` is told when new rows arrive and when the run
ends (live plot, text progress, alarms, test callbacks).

Example:
    >>> import torch
    >>> rec = Recorder(flush_every=2)
    >>> rec.record(step=1, loss=torch.tensor(0.5), skipped=torch.tensor(False))
    >>> len(rec.history), rec.pending
    (0, 1)
    >>> rec.record(step=2, loss=torch.tensor(0.25), skipped=torch.tensor(True))
    >>> rec.history.loss, rec.history.skipped_steps, rec.host_transfers
    ([0.5, 0.25], [2], 1)
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from mpnb import views
from mpnb.errors import InvalidChoiceError, MpnbError, is_flag, warn_user
from mpnb.precision.backends import Backend
from mpnb.training.history import COLUMNS, History, column_default
from mpnb.training.step_clock import seconds

__all__ = ["Sink"]

#: The dashboards a run can ask for by name (besides a Sink of its own, or None).
DASHBOARDS = ("auto", "live", "text")


class Sink:
    """Receives telemetry from a :class:`Recorder`. Override what you need.

    Example:
        >>> class Printer(Sink):
        ...     def update(self, history):
        ...         print(len(history), "steps")
    """

    def due(self, now: float) -> bool:
        """True when this sink wants the pending rows now (the recorder then flushes early)."""
        return False

    def update(self, history: History) -> None:
        """New rows were appended to ``history``."""

    def close(self, history: History) -> None:
        """The run (or this ``fit`` call) ended; ``history`` is complete."""


class MemorySampler:
    """Device memory, re-read at most every ``interval`` seconds: as often as a live dashboard
    redraws (a CPU read costs 10-300 us inside a busy training loop, where threads compete for
    the cores). The peak is the device's own high-water mark, so nothing between reads is missed.

    Between reads the last sample is reported again: rows are per step, samples are not.
    """

    def __init__(self, backend: Backend, device: torch.device, interval: float = 0.25) -> None:
        self.backend, self.device, self.interval = backend, device, interval
        self._last_read = -math.inf
        self._sample = (math.nan, math.nan, math.nan)

    def sample(self, now: float) -> tuple[float, float, float]:
        """``(used, peak, reserved)`` in bytes; NaN for what the device cannot report."""
        if now - self._last_read >= self.interval:
            snapshot = self.backend.memory(self.device.index)
            self._sample = tuple(
                math.nan if v is None else float(v)
                for v in (snapshot.used, snapshot.peak, snapshot.reserved)
            )
            self._last_read = now
        return self._sample


class MinScaleAlarm(Sink):
    """Warns once when the loss scale falls below ``min_scale`` (fp16 gradients keep overflowing).

    A collapsing scale means the model produces inf/NaN gradients at any scale: usually an
    op that overflows fp16 in the forward pass. Checked at each flush, never per step.
    """

    def __init__(self, min_scale: float) -> None:
        self.min_scale = min_scale
        self.fired = False
        self._checked = 0

    def update(self, history: History) -> None:
        scales = history.loss_scale
        for index in range(self._checked, len(scales)):
            if not self.fired and scales[index] < self.min_scale:
                self.fired = True
                step = history.step[index]
                message = (
                    f"loss scale fell to {scales[index]:g} at step {step}, below min_scale={self.min_scale:g}: "
                    "gradients overflow fp16 at every scale; try bf16, or keep the overflowing op in fp32"
                )
                history.note(message, kind="min-scale alarm", step=step)
                warn_user(message)
        self._checked = len(scales)


class Recorder:
    """Collects telemetry rows; moves tensor values to the host in batches.

    Args:
        history: where rows go (a fresh History by default).
        flush_every: pending steps that force a flush.
        sinks: told about new rows at every flush and about the end of the run.

    Attributes:
        host_transfers: how many device-to-host copies the recorder has made (one per flush
            with tensor values); tests and benchmarks read it.
    """

    def __init__(
        self, history: History | None = None, *, flush_every: int = 64, sinks: Iterable[Sink] = ()
    ) -> None:
        if flush_every < 1:
            raise ValueError(f"flush_every must be at least 1, got {flush_every}")
        if history is not None and not isinstance(history, History):
            raise MpnbError(
                f"history takes an mpnb History (a trainer's .history, to go on with), got "
                f"{type(history).__name__}"
            )
        self.history = history if history is not None else History()
        self.flush_every = flush_every
        self.host_transfers = 0
        self._sinks: list[Sink] = []
        self._timed: list[Callable[[float], bool]] = []  # the ``due`` of sinks that have one
        self._pending: list[Any] = []  # rows, and records whose row the flush makes
        self.attach(*sinks)

    @property
    def sinks(self) -> tuple[Sink, ...]:
        """The sinks told of each flush, in order (:meth:`attach`, :meth:`detach`)."""
        return tuple(self._sinks)

    def attach(self, *sinks: Sink) -> None:
        """Tell ``sinks`` of the flushes from here on, after the sinks already attached.

        Raises:
            MpnbError: one is not a :class:`Sink` (nothing is attached then).
        """
        odd = next((sink for sink in sinks if not isinstance(sink, Sink)), None)
        if odd is not None:
            raise MpnbError(
                f"sinks take mpnb Sink objects (a subclass of mpnb.training.telemetry.Sink that "
                f"overrides update and close), got {type(odd).__name__} {odd!r:.60}"
            )
        self._sinks.extend(sinks)
        self._time_sinks()

    def detach(self, *sinks: Sink) -> None:
        """Tell ``sinks`` of no more flushes (one that is not attached is passed over)."""
        for sink in sinks:
            if sink in self._sinks:
                self._sinks.remove(sink)
        self._time_sinks()

    def _time_sinks(self) -> None:
        """Keep the sinks that can ask for an early flush: only they are asked each step."""
        self._timed = [sink.due for sink in self._sinks if type(sink).due is not Sink.due]

    @property
    def pending(self) -> int:
        """Rows recorded but not yet copied to the history."""
        return len(self._pending)

    def record(self, **row: Any) -> None:
        """Add one step's row: History column names to Python numbers or 0-dim tensors.

        ``step_time`` may be a :class:`~mpnb.training.step_clock.DeviceInterval` (read at the flush);
        with ``samples`` (the step's example count) the row's ``samples_per_s`` is derived from it.
        Never reads a tensor; flushes when ``flush_every`` rows are pending or a sink is due.
        """
        self.add_row(row)

    def add_row(self, row: dict[str, Any]) -> None:
        """:meth:`record` for a row already made, kept as it is (no copy)."""
        self.add_record(row)

    def add_record(self, record: Any) -> None:
        """:meth:`add_row` for a :class:`~mpnb.training.step_record.StepRecord`, kept as it is: the
        flush turns the pending records into columns at once (their class's ``columns_of``)."""
        self._pending.append(record)
        self.flush_if_due()

    def hold(self, record: Any) -> None:
        """:meth:`add_record` with no flush: ``record`` is pending until :meth:`flush_if_due`, the
        next flush, or a reading of :attr:`history` (a step's row kept before its instruments run,
        whose notes the flush then shows with it)."""
        self._pending.append(record)

    def flush_if_due(self) -> None:
        """Flush when ``flush_every`` rows are pending or a sink is due."""
        if len(self._pending) >= self.flush_every or (self._timed and self._sink_due()):
            self.flush()

    def _sink_due(self) -> bool:
        """Whether a sink with a ``due`` wants the pending rows now."""
        now = time.perf_counter()
        return any(due(now) for due in self._timed)

    def flush(self) -> None:
        """Copy pending rows to the history (one device-to-host transfer) and tell the sinks.

        Raises:
            ValueError: rows that cannot be recorded (a tensor of several values, an unknown column,
                NaN for a whole number), named by step and column; every other pending row is recorded.
        """
        if not self._pending:
            return
        rows, self._pending = self._pending, []
        try:
            self._append(rows)
        except Exception:  # a bad row among them: the others one by one, then name the bad ones
            refused = self._append_each(rows)
            self.tell_sinks()
            shown = "; ".join(refused[:3]) + (
                f"; and {len(refused) - 3} more" if len(refused) > 3 else ""
            )
            raise ValueError(f"mpnb telemetry could not record {shown}") from None
        except BaseException:  # an interrupt: nothing recorded yet, nothing lost
            self._pending[:0] = rows
            raise
        self.tell_sinks()

    def _append(self, rows: list[dict[str, Any]]) -> None:
        columns = _columns_of(rows)
        self._to_host(columns)
        # not a column: the step's example count, for samples_per_s (read to the host with the rest)
        samples = columns.pop("samples", None) or [None] * len(rows)
        _settle_step_times(columns, samples)
        self.history.extend(columns)

    def _append_each(self, rows: list[dict[str, Any]]) -> list[str]:
        """Append the rows one at a time; what went wrong with each row refused."""
        refused = []
        for row in rows:
            try:
                self._append([row])
            except Exception as error:
                step = row.get("step", "?") if type(row) is dict else getattr(row, "step", "?")
                refused.append(f"step {step}: {error}")
        return refused

    def tell_sinks(self) -> None:
        """Show the sinks the history as it is (after an event noted between two flushes)."""
        for sink in self._sinks:
            sink.update(self.history)

    def close(self) -> None:
        """Flush what is pending and tell every sink the run ended."""
        self.flush()
        for sink in self._sinks:
            sink.close(self.history)

    def _to_host(self, columns: dict[str, list[Any]]) -> None:
        """Replace every tensor in ``columns`` by its value, with one copy per device.

        Raises:
            ValueError: a tensor of several values, or a value its column's type cannot hold; names the column.
        """
        held = _tensors_held(columns)
        devices = set(
            map(_device_of, itertools.chain.from_iterable(tensors for _, _, tensors in held))
        )
        # every device's share is taken before any value is written back: a column taken whole is the very
        # list its values are written into
        groups = (
            [held]
            if len(devices) == 1
            else [[_on_device(device, *entry) for entry in held] for device in devices]
        )
        for group in groups:
            try:
                values = iter(
                    _read_together(
                        list(itertools.chain.from_iterable(tensors for _, _, tensors in group))
                    )
                )
            except RuntimeError as error:
                raise ValueError(_several_values(group) or str(error)) from error
            self.host_transfers += 1
            for name, places, tensors in group:
                read = list(itertools.islice(values, len(tensors)))
                kind = COLUMNS[name][0] if name in COLUMNS else float
                if kind is bool or kind is int:
                    try:
                        read = list(map(kind, read))
                    except (ValueError, OverflowError) as error:  # NaN or inf for a whole number
                        raise ValueError(f"column {name!r}: {error}") from error
                if isinstance(places, range):  # the whole column
                    columns[name] = read
                    continue
                column = columns[name]
                for place, value in zip(places, read):
                    column[place] = value


#: Each column's value where a row recorded nothing (read once per flush, for every row).
_EMPTY = {name: column_default(kind) for name, (kind, _) in COLUMNS.items()}


def add_in_fp32(
    total: torch.Tensor | float | None, value: torch.Tensor | float
) -> torch.Tensor | float:
    """``total + value`` (``value`` alone when ``total`` is None), in fp32 at least: a step's bf16 /
    fp16 losses are summed over its micro-batches without rounding to their own precision at each
    add, and a lone loss stays as it is (no cast per step; the flush reads it exactly).

    >>> add_in_fp32(None, 0.5), add_in_fp32(torch.tensor(0.5, dtype=torch.bfloat16), 0.25).dtype
    (0.5, torch.float32)
    """
    if total is None:
        return value
    return _at_least_fp32(total) + _at_least_fp32(value)


def _at_least_fp32(value: torch.Tensor | float) -> torch.Tensor | float:
    if isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16):
        return value.float()
    return value


def _read_together(tensors: list[torch.Tensor]) -> list[float]:
    """The values of one-element tensors on one device, with one copy to the host (the CPU's
    own tensors too: they stand for an accelerator's in the tests that count host reads).
    Floats and flags are read exactly: a bf16 loss beside a bool flag packs in bf16, beside an
    integer in fp32 (bf16 would round an integer above 256; fp32 rounds one above 2**24).

    >>> _read_together([torch.tensor(0.1, dtype=torch.bfloat16), torch.tensor(True)])
    [0.10009765625, 1.0]
    >>> _read_together([torch.tensor(0.5, dtype=torch.bfloat16), torch.tensor(1001)])
    [0.5, 1001.0]
    """
    dtypes = set(map(_dtype_of, tensors))
    try:
        packed_dtype = functools.reduce(torch.promote_types, dtypes)
    except RuntimeError:  # fp8 promotes with nothing: everything in fp32
        packed_dtype = None
    if packed_dtype is None or (packed_dtype.itemsize < 4 and dtypes - {packed_dtype, torch.bool}):
        tensors = [
            tensor.float() for tensor in tensors
        ]  # a low float with integers, fp8: rare, one cast each
    with torch.no_grad():
        try:  # the usual case, every value a 0-dim tensor: one stack (which converts to the common dtype)
            packed = torch.stack(tensors)
        except RuntimeError:  # some of shape [1] (or [1, 1]...): one element each all the same
            packed = torch.stack([tensor.reshape(()) for tensor in tensors])
    return packed.reshape(len(tensors)).to("cpu", torch.float64).tolist()


#: What most columns hold: values already on the host.
_HOST_KINDS = frozenset({int, float, bool, str, type(None)})


def _tensors_held(
    columns: dict[str, list[Any]],
) -> list[tuple[str, Sequence[int], list[torch.Tensor]]]:
    """``(column name, positions, tensors)`` for each column that holds tensors (most hold host numbers
    only); a column of tensors only (the loss) is taken whole, without a look at each value."""
    held = []
    for name, values in columns.items():
        kinds = set(map(type, values))
        if kinds <= _HOST_KINDS:  # most columns: numbers and strings, no tensor to look for
            continue
        tensor_kinds = [kind for kind in kinds if issubclass(kind, torch.Tensor)]
        if len(tensor_kinds) == len(kinds):
            if kinds:
                held.append((name, range(len(values)), values))
        elif tensor_kinds:
            places = [
                index for index, value in enumerate(values) if isinstance(value, torch.Tensor)
            ]
            held.append((name, places, [values[index] for index in places]))
    return held


def _on_device(
    device: torch.device, name: str, places: Sequence[int], tensors: list[torch.Tensor]
) -> tuple[str, list[int], list[torch.Tensor]]:
    """The part of a :func:`_tensors_held` entry on ``device`` (rows that recorded on several devices)."""
    kept = [(place, tensor) for place, tensor in zip(places, tensors) if tensor.device == device]
    return name, [place for place, _ in kept], [tensor for _, tensor in kept]


def _several_values(held: list[tuple[str, Sequence[int], list[torch.Tensor]]]) -> str | None:
    """What is wrong with the first column holding a tensor of other than one value (None if none does)."""
    for name, _, tensors in held:
        for tensor in tensors:
            if tensor.numel() != 1:
                return f"column {name!r} holds a tensor of {tensor.numel()} values, where a row holds one number"
    return None


_device_of = operator.attrgetter("device")
_dtype_of = operator.attrgetter("dtype")


def _columns_of(rows: list[Any]) -> dict[str, list[Any]]:
    """The rows column-wise, where a row lacks a name that others have: the column's empty value
    (None for names that are no column; History.extend refuses those, ``samples`` aside).
    Records of one class (:class:`~mpnb.training.step_record.StepRecord`) are turned by that
    class's ``columns_of``; any other row is a dict, or has a ``row()``.

    >>> _columns_of([{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}])
    {'step': [1, 2], 'loss': [0.5, 0.25]}
    >>> _columns_of([{"step": 1}, {"step": 2, "loss": 0.25}])["loss"]
    [nan, 0.25]
    """
    kind = type(rows[0])
    if kind is not dict:
        if set(map(type, rows)) == {kind}:
            return kind.columns_of(rows)
        rows = [row if type(row) is dict else row.row() for row in rows]
    names = tuple(rows[0])
    if len(names) > 1 and set(map(len, rows)) == {len(names)}:
        try:  # the usual case, every row with the same names: transposed without a Python loop per value
            return dict(zip(names, map(list, zip(*map(operator.itemgetter(*names), rows)))))
        except KeyError:
            pass
    return {name: [row.get(name, _EMPTY.get(name)) for row in rows] for name in set().union(*rows)}


def _settle_step_times(columns: dict[str, list[Any]], samples: list[int | None]) -> None:
    """Read the device's step times (the copy to the host waited for the device already) and
    derive each row's throughput where its example count is known."""
    for name in ("forward_time", "step_time"):
        # device intervals: read them now
        if name in columns and not set(map(type, columns[name])) <= {float}:
            columns[name] = [seconds(value) for value in columns[name]]
    if "step_time" not in columns:
        return
    times = columns["step_time"]
    if None not in samples and min(samples, default=1) > 0 and min(times, default=1) > 0:
        rates = list(map(operator.truediv, samples, times))  # the usual flush: no Python per row
    else:
        rates = [
            count / time if count and time > 0 else math.nan for count, time in zip(samples, times)
        ]
    given = columns.get("samples_per_s")
    if given is not None:  # a rate a row gave stands where it gave no example count
        rates = [
            rate if count is None else derived
            for rate, count, derived in zip(given, samples, rates)
        ]
    columns["samples_per_s"] = rates


def check_dashboard(dashboard: object) -> str | Sink | None:
    """The dashboard asked for (False as None: no display), or an error for one that is neither a
    name in :data:`DASHBOARDS`, a :class:`Sink`, None nor False.

    >>> check_dashboard(False) is None
    True
    >>> check_dashboard("plot")
    Traceback (most recent call last):
    ...
    mpnb.errors.InvalidChoiceError: unknown dashboard 'plot'; valid: auto, live, text, None (or False), a Sink
    """
    if dashboard is None or (is_flag(dashboard) and not dashboard):
        return None  # False, 0 and numpy's False, as a flag reads
    if not isinstance(dashboard, Sink) and dashboard not in DASHBOARDS:
        raise InvalidChoiceError("dashboard", dashboard, [*DASHBOARDS, "None (or False)", "a Sink"])
    return dashboard  # type: ignore[return-value]


def dashboard_sinks(dashboard: str | Sink | None, title: str, control: Any) -> list[Sink]:
    """The sinks that show a run: none, the given one, or those the installed ``dashboard`` view
    makes for ``"auto"`` / ``"live"`` / ``"text"`` (``control``: the run's FitControl, for its buttons);
    ``dashboard`` as :func:`check_dashboard` reads it (set on a trainer after it was built, too)."""
    dashboard = check_dashboard(dashboard)
    if dashboard is None:
        return []
    if isinstance(dashboard, Sink):
        return [dashboard]
    return views.view("dashboard")(dashboard, title, control)
