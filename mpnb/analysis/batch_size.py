"""The largest batch that fits, per precision mode: "double your batch size", measured.

:func:`max_batch_size` builds a fresh run per mode and per trial with the same ``make_run``
:func:`mpnb.compare` takes, repeats the first batch of its data to the size under trial
(memory depends on shapes, not values) and trains a few steps. A size fits when the trial
does not run out of memory (CUDA, HPU) and its measured peak memory stays within the
budget. Sizes double from ``start`` until one does not fit, then bisect.

On a CPU nothing runs out of memory before the machine starts swapping, so the budget
decides: by default half the memory available when the search starts. The peak is the
process's resident memory, measured per trial (freed heap handed back first, Linux's peak
counter reset). Trials that would take too long (big budgets on a CPU) end the doubling,
and the answer is extrapolated from the measured peaks, which grow linearly with the batch;
the report says so.

Example:
    >>> import mpnb.examples as ex
    >>> def make_run(mode):
    ...     trainer, train, _ = ex.example_trainer(mode, "cpu", widths=(4, 8), dashboard=None)
    ...     return trainer, train
    >>> report = max_batch_size(make_run, ["fp32"], memory_budget="64 MiB", limit=64)
    >>> report.result("fp32").batch_size, report.result("fp32").limited_by
    (64, 'limit')
"""

from __future__ import annotations

import dataclasses
import gc
import math
import re
import statistics
import time
from collections.abc import Iterable, Sequence
from typing import Any

import psutil
import torch

from mpnb._render import html_table, text_table
from mpnb.analysis.comparison import MakeRun
from mpnb.errors import MpnbError
from mpnb.precision.backends import backend_for, format_bytes
from mpnb.precision.modes import parse_mode

__all__ = ["BatchSizeReport", "max_batch_size"]

DEFAULT_BUDGET_SHARE = 0.5  # of the memory available when the search starts (CPU)
_MIN_TRIALS_FOR_A_LINE = 3
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(size: int | float | str) -> int:
    """``"2 GiB"`` / ``"500MB"`` / ``1e9`` -> bytes.

    Example:
        >>> parse_bytes("1.5 GiB"), parse_bytes(4096)
        (1610612736, 4096)

    Raises:
        ValueError: not a size, or not positive.
    """
    if isinstance(size, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", size)
        unit = match.group(2).lower() if match else None
        if unit not in _UNITS:
            raise ValueError(
                f"cannot read {size!r} as a memory size; write e.g. '4 GiB', '500 MB' or a byte count"
            )
        value = float(match.group(1)) * _UNITS[unit]
    else:
        value = float(size)
    if not value > 0:
        raise ValueError(f"a memory budget must be positive, got {size!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Trial:
    """One trial: a batch size, whether it fit, its measured peak (bytes) and how long it took."""

    batch_size: int
    fits: bool
    peak: float
    seconds: float
    out_of_memory: bool = False


@dataclasses.dataclass
class ModeBatchSize:
    """One mode's answer.

    Attributes:
        mode: the mode's name.
        batch_size: the largest batch that fits (0 if none did; None when the mode did not run).
        peak: measured (or extrapolated) peak memory at that batch size, bytes.
        limited_by: ``"out of memory"``, ``"budget"``, ``"limit"`` (the largest size asked
            about fits), ``"extrapolated"`` (trials got too slow, so the size where the measured
            peaks' line meets the budget), ``"limit (peak extrapolated)"``, or ``"trial time"``
            (trials got too slow and their peaks draw no rising line: the largest size tried).
        trials: every trial, in order.
        skipped_reason: why the mode did not run, or None.
    """

    mode: str
    batch_size: int | None = None
    peak: float = math.nan
    limited_by: str = ""
    trials: list[Trial] = dataclasses.field(default_factory=list)
    skipped_reason: str | None = None


@dataclasses.dataclass
class BatchSizeReport:
    """:func:`max_batch_size`'s answer: per mode, with the ratio to fp32."""

    results: list[ModeBatchSize]
    budget: int | None
    device: str

    def result(self, mode: str) -> ModeBatchSize:
        """The answer for one mode."""
        name = parse_mode(mode).value
        return next(r for r in self.results if r.mode == name)

    def ratio_to_fp32(self, mode: str) -> float:
        """``mode``'s largest batch over fp32's (NaN without an fp32 answer)."""
        fp32 = next((r.batch_size for r in self.results if r.mode == "fp32" and r.batch_size), None)
        size = self.result(mode).batch_size
        return size / fp32 if fp32 and size is not None else math.nan

    def _rows(self) -> list[list[str]]:
        rows = []
        for result in self.results:
            if result.skipped_reason:
                rows.append([result.mode, "-", "-", "-", f"not run: {result.skipped_reason}"])
                continue
            ratio = self.ratio_to_fp32(result.mode)
            rows.append(
                [
                    result.mode,
                    str(result.batch_size),
                    "-" if math.isnan(ratio) else f"{ratio:.2f}x",
                    format_bytes(result.peak) if math.isfinite(result.peak) else "-",
                    result.limited_by,
                ]
            )
        return rows

    _HEADERS = ("mode", "max batch size", "vs fp32", "peak memory", "limited by")

    def __str__(self) -> str:
        budget = f"budget {format_bytes(self.budget)}" if self.budget else "device memory"
        return f"{text_table(self._HEADERS, self._rows())}\n({self.device}, {budget})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        return html_table(self._HEADERS, self._rows())


def max_batch_size(
    make_run: MakeRun,
    modes: Iterable[str] = ("fp32", "bf16"),
    *,
    start: int = 16,
    limit: int = 65536,
    memory_budget: int | float | str | None = None,
    steps: int = 2,
    trial_seconds: float = 5.0,
) -> BatchSizeReport:
    """Find the largest batch size that fits, per mode.

    Args:
        make_run: as for :func:`mpnb.compare`: ``make_run(mode)`` returns ``(trainer, data, ...)``.
        modes: modes to measure; checked before anything runs.
        start: the first size tried.
        limit: the largest size considered.
        memory_budget: bytes (or ``"4 GiB"``) a trial's peak may use. Default: none on an
            accelerator (running out of memory decides), half the available memory on a CPU.
        steps: optimizer steps per trial (the optimizer's state appears at the first).
        trial_seconds: a trial slower than this ends the doubling (once three sizes are
            measured); the answer is then extrapolated from the measured peaks.

    Raises:
        InvalidChoiceError: an unknown mode.
        ValueError: bad sizes or budget.
    """
    names = [parse_mode(mode).value for mode in modes]
    if not 1 <= start <= limit:
        raise ValueError(f"need 1 <= start <= limit, got start={start}, limit={limit}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    budget = parse_bytes(memory_budget) if memory_budget is not None else None
    device = None
    results = []
    for name in names:
        try:
            searcher = _Search(make_run, name, budget, steps)
        except MpnbError as error:
            results.append(ModeBatchSize(name, skipped_reason=str(error)))
            continue
        device = device or searcher.device
        results.append(searcher.run(start, limit, trial_seconds))
        budget = budget or searcher.budget
    return BatchSizeReport(results, budget, str(device or "-"))


class _Search:
    """Doubling then bisection over trials for one mode."""

    def __init__(self, make_run: MakeRun, mode: str, budget: int | None, steps: int) -> None:
        self.make_run, self.mode, self.steps = make_run, mode, steps
        trainer, data, *_ = make_run(mode)  # also checks that the mode can run here
        self.device = trainer.device
        self.backend = backend_for(self.device)
        self.sample = _first_batch(data)
        del trainer, data
        if budget is None and self.device.type == "cpu":
            budget = int(psutil.virtual_memory().available * DEFAULT_BUDGET_SHARE)
        self.budget = budget
        self.trials: list[Trial] = []

    def run(self, start: int, limit: int, trial_seconds: float) -> ModeBatchSize:
        good, size = 0, start
        while True:
            trial = self.trial(size)
            if not trial.fits:
                break
            good = size
            if size >= limit:
                return self._answer(good, "limit")
            if trial.seconds > trial_seconds and len(self.trials) >= _MIN_TRIALS_FOR_A_LINE:
                return self._extrapolate(good, limit)
            size = min(size * 2, limit)
        low, bad = good, size
        while bad - low > max(1, low // 32):
            middle = (low + bad) // 2
            if self.trial(middle).fits:
                low = middle
            else:
                bad = middle
        reason = "out of memory" if any(t.out_of_memory for t in self.trials) else "budget"
        return self._answer(low, reason)

    def trial(self, size: int) -> Trial:
        """Train ``steps`` steps on a batch of ``size``; measure its peak memory."""
        self.backend.release_cached_memory()
        gc.collect()
        baseline = self.backend.memory(self.device.index).used or 0
        self.backend.reset_peak_memory(self.device.index)
        started = time.perf_counter()
        out_of_memory = False
        try:
            trainer, *_ = self.make_run(self.mode)
            trainer.dashboard = None
            batch = _repeat_to(self.sample, size)
            trainer.fit([batch] * self.steps, epochs=1)
            del trainer, batch
        except Exception as error:
            if not _is_out_of_memory(error):
                raise
            out_of_memory = True
        seconds = time.perf_counter() - started
        peak = (self.backend.memory(self.device.index).peak or 0) - baseline
        gc.collect()
        self.backend.release_cached_memory()
        fits = not out_of_memory and (self.budget is None or peak <= self.budget)
        trial = Trial(size, fits, float(peak), seconds, out_of_memory)
        self.trials.append(trial)
        return trial

    def _answer(self, size: int, reason: str) -> ModeBatchSize:
        peak = next((t.peak for t in self.trials if t.batch_size == size and t.fits), math.nan)
        return ModeBatchSize(self.mode, size, peak, reason, list(self.trials))

    def _extrapolate(self, good: int, limit: int) -> ModeBatchSize:
        """Peak memory grows linearly with the batch: fit a line to the larger fits, follow it to the budget."""
        fits = [t for t in self.trials if t.fits and t.batch_size * 8 >= good]
        if self.budget is None or len({t.batch_size for t in fits}) < 2:
            return self._answer(good, "trial time")
        per_sample, offset = statistics.linear_regression(
            [t.batch_size for t in fits], [t.peak for t in fits]
        )
        if per_sample <= 0:  # peaks too small to rise above the noise
            return self._answer(good, "trial time")
        size = max(good, min(limit, int((self.budget - offset) / per_sample)))
        reason = "limit (peak extrapolated)" if size == limit else "extrapolated"
        return ModeBatchSize(self.mode, size, offset + per_sample * size, reason, list(self.trials))


def _first_batch(data: Any) -> Sequence[Any]:
    for batch in data:
        return batch
    raise ValueError("the run's data yields no batch to measure with")


def _repeat_to(batch: Sequence[Any], size: int) -> tuple[Any, ...]:
    """Each tensor of ``batch`` repeated along its first dimension to ``size`` rows."""

    def grow(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        repeats = math.ceil(size / len(value))
        return value.repeat(repeats, *([1] * (value.dim() - 1)))[:size].contiguous()

    return tuple(grow(part) for part in batch)


def _is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error).lower()
    phrases = (
        "out of memory",
        "can't allocate memory",
        "allocation failed",
    )  # CUDA/HPU, CPU, Habana
    return isinstance(error, RuntimeError) and any(phrase in text for phrase in phrases)
