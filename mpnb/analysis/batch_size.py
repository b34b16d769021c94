"""The largest batch that fits, per precision mode: "double your batch size", measured.

:func:`max_batch_size` answers from the memory account of :mod:`mpnb.analysis.memory`, which
counts a step's tensors on a shape-only copy of the model at any batch size in a fraction of a
second, and the same run gives the same answer. What the account cannot see (kernels' own
buffers) is measured on one or two real steps at small batches and added, growing with the
batch (a step over the budget counts too: it was measured). The largest size whose account fits
the budget is then tried for real: on CUDA and HPU running out of memory is the judge, and a
size that does not fit is bisected with real steps. A size that fits draws the line again,
through the two largest real steps, and the search climbs while that line moves the answer up
(at most four more real steps): a buffer that does not grow with the batch looks, from small
batches, as if it did. A real step that would take longer than
``trial_seconds`` (5 s by default: a transformer at a few thousand samples on a CPU) is not
run, and the report says the answer is the account's. Its time is foreseen in proportion to the
largest real step's own time (as its history timed it, not the building of the run; on a CPU a
second, bare step, as the first runs under the profiler that counts its memory). A small step
can be all fixed costs (an optimizer's update over every weight), which, scaled with the batch,
overstate a large one's many times: where the answer looks too slow, up to two probes (real
steps of a power-of-two size foreseen at a quarter of ``trial_seconds``) time it again. So the
default search takes seconds:
a doubling of real steps, then a search of the accounts, as Lightning's batch-size finder
doubles and then bisects, with a real step only where it is cheap.

An answer equal to ``limit`` is a lower bound (the search looked no higher): the table
prints it ``>= limit``.

The batch of each trial is the run's first batch, grown along its first dimension (any batch a
:class:`~mpnb.Trainer` accepts: tensors, tuples, dicts, dataclasses, nested). On a CPU the
budget is compared with torch's allocator at the step's peak (the resident set adds the heap's
own overhead: :func:`mpnb.memory` shows it as a line of its own); by default half the memory
available when the search starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import re
import time
from collections.abc import Iterable, Iterator
from typing import Any

import psutil
import torch

from mpnb._render import html_table, text_table
from mpnb.analysis.memory import MemoryAccount, account_step, measure_step
from mpnb.analysis.runs import MakeRun, built_run, check_trains_in, first_batch, mode_labels
from mpnb.errors import MAKE_RUN_USAGE, MpnbError, check_count, check_function
from mpnb.precision.backends import backend_for, format_bytes
from mpnb.precision.modes import parse_mode, reference_name
from mpnb.training.batches import with_batch_size

__all__ = ["BatchSizeReport", "max_batch_size"]

DEFAULT_BUDGET_SHARE = 0.5  # of the memory available when the search starts (CPU)
_CLIMBS = 4  # real steps at most after the first two, while each fits and the line moves up
_PROBES = 2  # real steps at most that time the step better where the answer looks too slow
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
    if not 0 < value < math.inf:
        raise ValueError(f"a memory budget must be a positive, finite size, got {size!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Trial:
    """One look at a batch size.

    Attributes:
        batch_size: the size looked at.
        fits: its peak is within the budget, and it did not run out of memory.
        peak: bytes at the step's peak: the account's (with the measured extra) for an
            ``"account"`` trial, torch's allocator for a ``"step"`` (a real one).
        seconds: how long it took (a real step: building its run included).
        step_seconds: a real step's training of the batch alone, as its history timed it
            (no warm-up, no building of the run); NaN for an account.
        kind: ``"account"`` (counted, nothing computed), ``"step"`` (trained for real) or
            ``"probe"`` (trained for real to time the step better: its peak checked against
            the budget, but left out of the line of what the account misses, so that the
            sizes the answer is drawn from do not hang on the machine's speed).
        out_of_memory: a real step ran out of memory.
    """

    batch_size: int
    fits: bool
    peak: float
    seconds: float
    kind: str = "step"
    out_of_memory: bool = False
    step_seconds: float = math.nan


@dataclasses.dataclass
class ModeBatchSize:
    """One mode's answer.

    Attributes:
        mode: the mode's name.
        batch_size: the largest batch that fits (0 if none did; None when the mode did not run).
        peak: bytes at that size's peak (measured when ``checked`` is True, else the account's).
        limited_by: ``"budget"``, ``"out of memory"`` or ``"limit"`` (the largest size asked
            about fits).
        checked: the answer was trained for real; False: it is the account's (see ``note``).
        note: why the answer was not trained for real, or "".
        account: the memory account at the answer's size, by category.
        trials: every look, in order.
        skipped_reason: why the mode did not run, or None.
    """

    mode: str
    batch_size: int | None = None
    peak: float = math.nan
    limited_by: str = ""
    checked: bool = False
    note: str = ""
    account: MemoryAccount | None = None
    trials: list[Trial] = dataclasses.field(default_factory=list)
    skipped_reason: str | None = None


@dataclasses.dataclass
class BatchSizeReport:
    """:func:`max_batch_size`'s answer: per mode, with the ratio to fp32.

    Example:
        >>> report = BatchSizeReport([ModeBatchSize("fp32", 96), ModeBatchSize("bf16", 144)], None, "cpu")
        >>> report.ratio_to_fp32("bf16")
        1.5
    """

    results: list[ModeBatchSize]
    budget: int | None
    device: str

    def result(self, mode: str) -> ModeBatchSize:
        """The answer for one mode."""
        name = parse_mode(mode).label
        return next(r for r in self.results if r.mode == name)

    def ratio_to_fp32(self, mode: str) -> float:
        """``mode``'s largest batch over fp32's (NaN without an fp32 answer)."""
        fp32 = next(
            (r.batch_size for r in self.results if r.mode == reference_name() and r.batch_size),
            None,
        )
        size = self.result(mode).batch_size
        return size / fp32 if fp32 and size is not None else math.nan

    def _rows(self) -> list[list[str]]:
        rows = []
        for result in self.results:
            if result.skipped_reason:
                rows.append([result.mode, "-", "-", "-", "-", f"not run: {result.skipped_reason}"])
                continue
            rows.append(
                [
                    result.mode,
                    f">= {result.batch_size}" if _capped(result) else str(result.batch_size),
                    self._ratio_text(result),
                    format_bytes(result.peak) if math.isfinite(result.peak) else "-",
                    "the search's limit; pass limit=..." if _capped(result) else result.limited_by,
                    _checked_by(result),
                ]
            )
        return rows

    def _ratio_text(self, result: ModeBatchSize) -> str:
        """The ratio to fp32, marked as a bound where an answer is one (the search's limit)."""
        ratio = self.ratio_to_fp32(result.mode)
        if math.isnan(ratio):
            return "-"
        if result.mode == reference_name():
            return f"{ratio:.2f}x"
        fp32 = next((r for r in self.results if r.mode == reference_name()), None)
        bound = (_capped(result), fp32 is not None and _capped(fp32))
        sign = {(False, False): "", (True, False): ">= ", (False, True): "<= "}.get(bound)
        return "-" if sign is None else f"{sign}{ratio:.2f}x"

    _HEADERS = ("mode", "max batch size", "vs fp32", "peak memory", "limited by", "checked by")

    def __str__(self) -> str:
        budget = f"budget {format_bytes(self.budget)}" if self.budget else "device memory"
        return f"{text_table(self._HEADERS, self._rows())}\n({self.device}, {budget})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        return html_table(self._HEADERS, self._rows())


def _capped(result: ModeBatchSize) -> bool:
    """The answer is the largest size the search looked at, so a lower bound."""
    return result.limited_by == "limit" and bool(result.batch_size)


def max_batch_size(
    make_run: MakeRun,
    modes: Iterable[str] = ("fp32", "bf16"),
    *,
    start: int = 16,
    limit: int = 65536,
    memory_budget: int | float | str | None = None,
    trial_seconds: float = 5.0,
) -> BatchSizeReport:
    """Find the largest batch size that fits, per mode (see the module's docstring).

    Args:
        make_run: as for :func:`mpnb.compare`: ``make_run(mode)`` returns ``(trainer, data, ...)``.
        modes: modes to measure; checked before anything runs.
        start: the batch size of the first real step (the second is twice as large, or 1.5
            times when twice would take longer than ``trial_seconds``).
        limit: the largest size considered; an answer equal to it is a lower bound, printed
            ``>= limit``.
        memory_budget: bytes (or ``"4 GiB"``) a step's peak may use. Default: the device's
            memory on an accelerator (running out of memory decides), half the available memory
            on a CPU.
        trial_seconds: a real step expected to take longer than this is not run (its time
            foreseen in proportion to the largest real step's); the answer is then the
            account's, and the report says so.

    Raises:
        InvalidChoiceError: an unknown mode.
        ValueError: bad sizes or budget.
        TypeError: ``make_run`` does not return a run.

    Example:
        >>> import mpnb.examples as ex
        >>> def make_run(mode):
        ...     trainer, train, _ = ex.example_trainer(mode, "cpu", widths=(4, 8), dashboard=None)
        ...     return trainer, train
        >>> report = max_batch_size(make_run, ["fp32"], memory_budget="64 MiB", limit=64)
        >>> report.result("fp32").batch_size, report.result("fp32").limited_by
        (64, 'limit')
    """
    check_function("make_run", make_run, MAKE_RUN_USAGE, "max_batch_size(make_run, modes)")
    names = mode_labels(modes)  # "fp32,bf16" too, as compare takes them
    start = check_count("start", start, meaning="the batch size of the first real step")
    limit = check_count("limit", limit, meaning="the largest batch size considered")
    if not start <= limit:
        raise ValueError(f"need 1 <= start <= limit, got start={start}, limit={limit}")
    number = isinstance(trial_seconds, (int, float)) and not isinstance(trial_seconds, bool)
    if not number or not trial_seconds >= 0:  # NaN too
        raise ValueError(
            f"trial_seconds takes a number of seconds, 0 or more (inf: every real step), got "
            f"{trial_seconds!r}"
        )
    budget = parse_bytes(memory_budget) if memory_budget is not None else None
    device = None
    results = []
    with _collections_of_new_objects_only():
        for name in names:
            try:  # a mode this device cannot run is skipped, with the reason
                run = built_run(make_run, name)
            except MpnbError as error:
                results.append(ModeBatchSize(name, skipped_reason=str(error)))
                continue
            check_trains_in(run[0], name)
            searcher = _Search(make_run, name, run, budget, trial_seconds)
            device = device or searcher.device
            results.append(searcher.run(start, limit))
            budget = budget or searcher.budget
    return BatchSizeReport(results, budget, str(device or "-"))


@contextlib.contextmanager
def _collections_of_new_objects_only() -> Iterator[None]:
    """Inside, a garbage collection looks only at objects made since it began.

    Each real step collects garbage before it is measured and after it ran, so that the last
    trial's memory is free. A full collection walks every object of the process: about 0.2 s
    with torch imported, more in a notebook that has been working a while, and most of the time
    of a search on a small model. So the garbage there is now is collected once, everything
    still alive is frozen (``gc.freeze``: left out of later collections), and unfrozen after.
    A process that has frozen objects of its own is left as it is.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class _Search:
    """One mode's search: accounts everywhere, real steps where they decide."""

    def __init__(
        self,
        make_run: MakeRun,
        mode: str,
        run: tuple[Any, Any, Any],
        budget: int | None,
        trial_seconds: float,
    ) -> None:
        """``run``: what ``make_run(mode)`` built first (:func:`built_run`)."""
        self.make_run, self.mode, self.trial_seconds = make_run, mode, trial_seconds
        trainer, data, _ = run
        self.device = trainer.device
        self.backend = backend_for(self.device)
        self.sample = first_batch(data)
        self.counted = trainer  # accounts run on shape-only copies: one trainer serves them all
        if budget is None:
            snapshot = self.backend.memory(self.device.index)
            if self.device.type == "cpu":
                budget = int(psutil.virtual_memory().available * DEFAULT_BUDGET_SHARE)
            elif snapshot.limit:
                budget = snapshot.limit
        self.budget = budget
        self.trials: list[Trial] = []
        self._accounts: dict[int, MemoryAccount] = {}
        self.extra_at = lambda size: 0.0  # bytes beyond the account, from the real steps

    def run(self, start: int, limit: int) -> ModeBatchSize:
        first = self.step(start)
        if not first.fits:
            return self._down_from(start)
        # a second real step draws the line of what the account misses: twice the first, or,
        # when that would take longer than trial_seconds, half as large again
        second_size = min(2 * start if self._affordable(2 * start) else start + start // 2, limit)
        ceiling = limit  # the largest size the answer may be
        if second_size > start:
            second = self.step(second_size)
            if second.out_of_memory:  # nothing was measured: only real steps can narrow it down
                return self._bisect(start, second_size)
            if not second.fits:  # over the budget, but measured: it draws the line too
                ceiling = second_size - 1
        self._learn_extra()
        size = self._predicted(ceiling)
        # The real steps judge. One that fits draws the line again, from the two largest real
        # steps: the account can miss in either direction, and where a kernel's buffer does not
        # grow with the batch, a line from small batches overstates it at large ones.
        climbs = probes = 0
        while size not in self._stepped_fits():
            if climbs == _CLIMBS:  # still climbing: the largest size a real step fitted
                size = max(self._stepped_fits())
                break
            if not self._affordable(size):
                probe = self._timing_probe(size) if probes < _PROBES else None
                if probe is None:
                    break
                probes += 1
                if not self.step(probe, kind="probe").fits:
                    return self._bisect(max(self._stepped_fits()), probe)
                continue
            climbs += 1
            if not self.step(size).fits:
                return self._bisect(max(self._stepped_fits()), size)
            self._learn_extra()
            higher = self._predicted(ceiling)
            if higher - size <= max(1, size // 64):  # within the looks' own precision
                break
            size = higher
        return self._answer(size, "limit" if size >= limit else "budget")

    def _timing_probe(self, size: int) -> int | None:
        """A size between the largest real step and ``size`` whose real step, foreseen in
        proportion, takes a quarter of ``trial_seconds``: timed, it foresees ``size`` better,
        as a small step's fixed costs (an optimizer over every weight), scaled up with the
        batch, overstate a large one's (a 32-sample step of a 1M-weight MLP foresaw 40 s for
        31,441 samples, which took 1.5). None where such a size is not twice the largest real
        step (too close to tell more); a power of two, so that the step times' noise does not
        move the sizes looked at, nor the answer drawn from them."""
        timed = self._largest_timed()
        if timed is None:
            return None
        largest, seconds = timed
        probe = min(int(largest * self.trial_seconds / 4 / seconds), size - 1)
        if probe < 2 * largest:
            return None
        # a power of two: the same search looks at the same sizes on a noisy machine
        return 2 ** int(math.log2(probe))

    # -- looks at one size ----------------------------------------------------------------

    def step(self, size: int, kind: str = "step") -> Trial:
        """Train a fresh run on a batch of ``size`` (after a warm-up step on two samples); its
        peak is the allocator's (on a CPU, counted from the profiler's events)."""
        started = time.perf_counter()
        out_of_memory, peak, step_seconds = False, math.inf, math.nan
        try:
            trainer, _, _ = built_run(self.make_run, self.mode)
            batch = with_batch_size(self.sample, size)
            measured = measure_step(trainer, batch, self._counted(size))
            if self.device.type == "cpu":  # measured under torch's profiler, whose cost per
                trainer.fit([batch], epochs=1)  # op would be scaled with the batch: again, bare
            step_seconds = float(trainer.history.step_time[-1])  # the batch's step alone
            peak = float(measured.allocator)
            del trainer, batch
        except Exception as error:
            if not _is_out_of_memory(error):
                raise
            out_of_memory = True
        gc.collect()
        self.backend.release_cached_memory()
        seconds = time.perf_counter() - started
        fits = not out_of_memory and (self.budget is None or peak <= self.budget)
        trial = Trial(size, fits, peak, seconds, kind, out_of_memory, step_seconds)
        self.trials.append(trial)
        return trial

    def _counted(self, size: int) -> MemoryAccount:
        """The memory account of a batch of ``size`` (counted once per size)."""
        if size not in self._accounts:
            self._accounts[size] = account_step(self.counted, self.sample, samples=size)
        return self._accounts[size]

    def _account(self, size: int) -> Trial:
        started = time.perf_counter()
        counted = self._counted(size)
        peak = counted.tracked + self.extra_at(size)
        fits = self.budget is None or peak <= self.budget
        trial = Trial(size, fits, peak, time.perf_counter() - started, "account")
        self.trials.append(trial)
        return trial

    # -- what the real steps taught --------------------------------------------------------

    def _learn_extra(self) -> None:
        """The bytes the real steps used beyond their accounts, as a line in the batch size
        through the two largest steps (through the origin when only one step ran), never below
        zero. A step over the budget counts as well as one within it: only a step that ran out
        of memory measured nothing.

        The line is drawn through steps whose account grows with the batch at their size. On a
        small batch the account can peak where nothing grows with it (the optimizer's update);
        the real step's peak may then be elsewhere (the backward pass, with its kernels'
        buffers), and what it shows beyond the account is not the extra of the batch. Where no
        step is such, the largest gives the line through the origin."""
        points, growing = {}, {}
        for trial in self.trials:
            if trial.kind == "step" and math.isfinite(trial.peak):
                size = trial.batch_size
                points[size] = trial.peak - self._counted(size).tracked
                if self._account_grows_at(size):
                    growing[size] = points[size]
        line = sorted(growing.items())[-2:] or [max(points.items())]
        large, extra_large = line[-1]
        if len(line) == 2:
            small, extra_small = line[0]
            slope = (extra_large - extra_small) / (large - small)
        else:  # through the origin
            slope = extra_large / large
        self.extra_at = lambda size: max(0.0, extra_large + slope * (size - large))

    def _account_grows_at(self, size: int) -> bool:
        """Whether the account's peak at ``size`` is above its peak at three quarters of it."""
        smaller = size * 3 // 4
        return smaller >= 1 and self._counted(size).tracked > self._counted(smaller).tracked

    def _predicted(self, limit: int) -> int:
        """The largest size up to ``limit`` whose account (with the extra) fits the budget.

        An account's peak is piecewise linear in the batch size, so the size where the line
        through the last two looks meets the budget is nearly always the answer: a handful of
        accounts instead of a doubling and a bisection, which step in when a guess lands outside
        the bracket.
        """
        good = max(self._stepped_fits())
        if self.budget is None:
            return limit
        points = [(good, self._account(good).peak)]
        bad = None
        while bad is None or bad - good > max(1, good // 64):
            guess = self._guess(points, good, bad, limit)
            if guess is None:
                return good  # limit reached, and it fits
            look = self._account(guess)
            points.append((guess, look.peak))
            if look.fits:
                good = guess
            else:
                bad = guess
        return good

    def _guess(
        self, points: list[tuple[int, float]], good: int, bad: int | None, limit: int
    ) -> int | None:
        """The next size to look at, strictly between ``good`` and ``bad`` (or ``limit``)."""
        ceiling = limit + 1 if bad is None else bad
        if good + 1 >= ceiling:
            return None
        guess = 2 * good  # no line yet: double
        if len(points) >= 2:
            (size_a, peak_a), (size_b, peak_b) = points[-2], points[-1]
            slope = (peak_b - peak_a) / (size_b - size_a) if size_b != size_a else 0.0
            if slope > 0:
                guess = int(size_b + (self.budget - peak_b) / slope)
                # one look just past the line's answer, so that it is bracketed
                guess = guess + max(1, guess // 64) if guess <= good else guess
        if not good < guess < ceiling:
            guess = (good + ceiling) // 2 if bad is not None else min(2 * good, limit)
        return guess if good < guess < ceiling else None

    def _bisect(self, good: int, bad: int) -> ModeBatchSize:
        """Real steps between a size that fit and one that did not."""
        while bad - good > max(1, good // 32):
            middle = (good + bad) // 2
            if self.step(middle).fits:
                good = middle
            else:
                bad = middle
        return self._answer(good, self._reason())

    def _down_from(self, size: int) -> ModeBatchSize:
        """The first real step did not fit: halve until one does."""
        while size > 1:
            size //= 2
            if self.step(size).fits:
                return self._bisect(size, 2 * size)
        return self._answer(0, self._reason())

    def _reason(self) -> str:
        return "out of memory" if any(t.out_of_memory for t in self.trials) else "budget"

    def _affordable(self, size: int) -> bool:
        """A real step of ``size`` is expected within ``trial_seconds`` (always on an
        accelerator, where running out of memory is the judge)."""
        return self.device.type != "cpu" or self._seconds_for(size) <= self.trial_seconds

    def _seconds_for(self, size: int) -> float:
        """The time a real step of ``size`` would take, in proportion to the largest real
        step's own time (as its history timed it); the step's fixed costs are scaled up with
        the rest, and a large batch's allocation is not counted. A line through two small trials' whole times (building the
        run included) is no guide: their noise is larger than what grows, and such a line once
        foresaw 1 s for a 45-s step."""
        timed = self._largest_timed()
        if timed is None:
            return 0.0
        largest, seconds = timed
        return seconds * size / largest

    def _largest_timed(self) -> tuple[int, float] | None:
        """The largest real step that fitted (a probe too), with its own time."""
        timed = [
            (t.batch_size, t.step_seconds)
            for t in self.trials
            if t.kind in ("step", "probe") and t.fits and math.isfinite(t.step_seconds)
        ]
        return max(timed) if timed else None

    def _stepped(self) -> list[int]:
        return [t.batch_size for t in self.trials if t.kind == "step"]

    def _stepped_fits(self) -> list[int]:
        return [t.batch_size for t in self.trials if t.kind == "step" and t.fits]

    def _answer(self, size: int, reason: str) -> ModeBatchSize:
        real = [t for t in self.trials if t.kind == "step" and t.batch_size == size and t.fits]
        looks = [t for t in self.trials if t.batch_size == size]
        peak = real[-1].peak if real else (looks[-1].peak if looks else math.nan)
        note = ""
        if not real and size:
            seconds = self._seconds_for(size)
            note = f"a real step of {size} would take about {seconds:.0f} s here (trial_seconds={self.trial_seconds:g})"
        account = self._counted(size) if size else None
        return ModeBatchSize(
            self.mode, size, peak, reason, bool(real), note, account, list(self.trials)
        )


def _checked_by(result: ModeBatchSize) -> str:
    """How an answer was reached: a real step, or the account (and why no real step): an
    answer of 0 came from real steps at every size tried, none of which fitted."""
    if result.checked:
        return "a real step"
    if not result.batch_size:
        tried = sorted({t.batch_size for t in result.trials if t.kind == "step"})
        return f"real steps of {', '.join(map(str, tried))}: none fitted" if tried else "-"
    return f"the account: {result.note}" if result.note else "the account"


def _is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(error).lower()
    phrases = (
        "out of memory",
        "can't allocate memory",
        "allocation failed",
    )  # CUDA/HPU, CPU, Habana
    return isinstance(error, RuntimeError) and any(phrase in text for phrase in phrases)
