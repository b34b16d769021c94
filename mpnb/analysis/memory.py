"""Where a training step's memory goes, by category and per mode: counted, then cross-checked.

The account (:func:`account_step`) counts a step's tensors by their storages at the step's
highest point, with torch's own tracker (see :mod:`mpnb.analysis._torch_memory`):

- **parameters** (and buffers), **gradients**, **optimizer state**;
- **activations**: tensors the forward made that are alive at the peak, mostly those saved for
  backward; under autocast they are half the size, the main saving of mixed precision;
- **weight copies**: autocast's fp16/bf16 copies of fp32 weights, saved for backward, and the
  low-precision copies the layer-swapping modes make (fp8's and MXFP8's one-byte elements with
  their scales): what mixed precision *adds*;
- **workspace**: temporaries alive at the peak; **batch**: the batch's own tensors.

The account runs the step on a shape-only copy of the model (fake tensors: nothing computed,
so it takes a fraction of a second at any batch size, and the same run gives the same bytes);
a model that needs real values in its forward (a data-dependent branch) is counted on the
real step instead. The account sees tensors; a *measured* step (:func:`measure_step`) sees
what the account cannot, each on its own line: memory kernels take for themselves inside
torch's allocator (a CPU without bf16 units converts bf16 convolutions through such buffers),
and what the process holds beyond the allocator (the CPU's resident set, the CUDA cache).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from mpnb import views
from mpnb._render import html_list, html_table, text_notes, text_table
from mpnb.analysis._torch_memory import cpu_allocator_peak, fake_mode, storage_bytes, tracked_peak
from mpnb.analysis.runs import MakeRun, built_run, check_trains_in, first_batch, mode_labels
from mpnb.errors import MAKE_RUN_USAGE, MpnbError, check_count, check_function
from mpnb.precision.backends import backend_for, format_bytes
from mpnb.precision.modes import parse_mode
from mpnb.training.batches import (
    batch_loss,
    samples_in,
    tensors_in,
    to_device,
    with_batch_size,
)

if TYPE_CHECKING:
    from mpnb.training.trainer import Trainer

__all__ = ["MemoryAccount", "MemoryReport", "memory"]

#: The account's categories, in the order tables and stacked bars show them.
CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer state",
    "activations",
    "weight copies",
    "workspace",
    "batch",
    "other",
)

#: What each column of the memory table counts, said under it.
COLUMN_MEANINGS = {
    "parameters": "the model's weights and buffers",
    "gradients": "the parameters' gradients alive at the peak (0 B where the peak comes before "
    "backward has made them)",
    "optimizer state": "what the optimizer keeps between steps (Adam: two moments a weight)",
    "activations": "tensors the forward pass saved for backward, and outputs still alive",
    "weight copies": "autocast's low-precision copies of the weights, saved for backward",
    "workspace": "temporaries of the step alive at the peak",
    "batch": "the batch's tensors",
    "other": "tensors the tracker could not place",
    "inside kernels": "what torch's allocator held beyond the counted tensors at a measured "
    "step's peak: kernels' own buffers",
    "outside the allocator": "what the process held beyond torch's allocator: heap overhead, "
    "libraries",
    "counted": "the sum of the categories at the peak",
}
#: Said first under the memory table: when its columns are read.
READ_AT_PEAK = (
    "every column is read at the step's peak (the moment the counted tensors were largest), "
    "not at its own largest: a category made later or freed earlier reads 0 B there"
)

#: An account or a measured step runs two optimizer steps: a warm-up on two samples, where the
#: optimizer's state appears (and kernels are set up), then the step counted, on the batch. Two,
#: not one: BatchNorm refuses a single value per channel in training.
WARM_UP_SAMPLES = 2


@dataclasses.dataclass(frozen=True)
class MemoryAccount:
    """One mode's step, in bytes at its highest point.

    Attributes:
        mode: the mode's name.
        batch_size: samples in the batch counted.
        device: where it ran, as text.
        categories: bytes per category (:data:`CATEGORIES`), counted from tensor storages.
        shape_only: counted on a shape-only copy (nothing computed); False: on the real step.
        allocator: torch's allocator at the peak of a measured step (None: not measured).
        process: the process's memory at that peak: resident set on a CPU, the allocator's
            reserved bytes on an accelerator (None: not measured or not reported).

    Example:
        >>> account = MemoryAccount("bf16", 8, "cpu", {"parameters": 4096, "activations": 1024})
        >>> account.tracked, account.inside_kernels
        (5120, None)
    """

    mode: str
    batch_size: int
    device: str
    categories: dict[str, int]
    shape_only: bool = True
    allocator: int | None = None
    process: int | None = None

    @property
    def tracked(self) -> int:
        """Bytes the account counts: the sum of its categories."""
        return sum(self.categories.values())

    @property
    def inside_kernels(self) -> int | None:
        """What torch's allocator held beyond the counted tensors: kernels' own buffers."""
        return None if self.allocator is None else self.allocator - self.tracked

    @property
    def outside_allocator(self) -> int | None:
        """What the process held beyond torch's allocator (cache, libraries, heap overhead)."""
        if self.allocator is None or self.process is None:
            return None
        return self.process - self.allocator

    def lines(self) -> dict[str, int | None]:
        """Every line of the account, categories first, then the measured differences."""
        return {
            **{category: self.categories.get(category, 0) for category in CATEGORIES},
            "inside kernels": self.inside_kernels,
            "outside the allocator": self.outside_allocator,
        }


@dataclasses.dataclass
class MemoryReport:
    """:func:`memory`'s answer: an account per mode, or why a mode did not run.

    Example:
        >>> report = MemoryReport([MemoryAccount("fp32", 8, "cpu", {"activations": 2048})], {})
        >>> report.result("fp32").tracked
        2048
    """

    accounts: list[MemoryAccount]
    skipped: dict[str, str]

    def result(self, mode: str) -> MemoryAccount:
        """The account of one mode.

        Raises:
            KeyError: the mode was not counted (names why when it was skipped).
        """
        name = parse_mode(mode).label
        for account in self.accounts:
            if account.mode == name:
                return account
        raise KeyError(f"no account for {name!r}: {self.skipped.get(name, 'not asked for')}")

    def _columns(self) -> list[str]:
        return [
            line
            for line in (*CATEGORIES, "inside kernels", "outside the allocator")
            if any(account.lines()[line] for account in self.accounts)
        ]

    def table(self) -> list[list[str]]:
        """The rows of the table, formatted: a mode per row, a line of the account per column
        (lines empty in every mode are left out; see :meth:`headers`)."""
        columns = self._columns()
        rows = [
            [account.mode, str(account.batch_size)]
            + [_bytes(account.lines()[column]) for column in columns]
            + [format_bytes(account.tracked)]
            for account in self.accounts
        ]
        width = len(columns) + 1
        rows += [
            [mode, "-", f"not run: {why}", *[""] * (width - 1)]
            for mode, why in self.skipped.items()
        ]
        return rows

    def headers(self) -> list[str]:
        """The table's column names."""
        return ["mode", "batch", *self._columns(), "counted"]

    def notes(self) -> list[str]:
        """What the table's columns count, and when they are read: said under it."""
        return [
            READ_AT_PEAK,
            *(f"{column}: {COLUMN_MEANINGS[column]}" for column in self.headers()[2:]),
        ]

    def figure(self) -> Any:
        """Stacked bars: a bar per mode, a segment per line (needs the notebook extras)."""
        return views.view("memory_figure")(self)

    def __str__(self) -> str:
        notes = []
        if any(not account.shape_only for account in self.accounts):
            notes.append("counted on the real step: the model's forward needs real values")
        if all(account.allocator is None for account in self.accounts):
            notes.append("not measured: the lines beyond the counted tensors need measure=True")
        device = self.accounts[0].device if self.accounts else "-"
        return (
            text_table(self.headers(), self.table())
            + f"\n({device}; {'; '.join(notes) or 'measured'})\n"
            + text_notes(self.notes())
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        return html_table(self.headers(), self.table()) + html_list(self.notes(), "mpnb-notes")


def _bytes(value: int | None) -> str:
    return "-" if value is None else format_bytes(value)


def memory(
    make_run: MakeRun,
    modes: Iterable[str] = ("fp32", "bf16", "fp16"),
    *,
    batch_size: int | None = None,
    measure: bool = True,
) -> MemoryReport:
    """Count where one training step's memory goes, per mode, for the run ``make_run`` builds.

    Args:
        make_run: as for :func:`mpnb.compare`: ``make_run(mode)`` returns ``(trainer, data, ...)``.
        modes: the modes to count; checked before anything runs. A mode this device cannot
            run is listed with the reason.
        batch_size: the batch to count (its first batch, grown or cut to this size; default:
            the data's first batch as it is).
        measure: also run the step for real (a fresh run trains a warm-up step and the step)
            and measure what the account cannot see.

    Raises:
        InvalidChoiceError: an unknown mode.
        ValueError: a batch size below 1.
        TypeError: ``make_run`` does not return a run.

    Example:
        >>> import mpnb.examples as ex
        >>> def make_run(mode):
        ...     trainer, train, _ = ex.example_trainer(mode, "cpu", widths=(4, 8), dashboard=None)
        ...     return trainer, train
        >>> report = memory(make_run, ["fp32", "bf16"], batch_size=64, measure=False)
        >>> fp32, bf16 = report.result("fp32"), report.result("bf16")
        >>> bf16.categories["activations"] < fp32.categories["activations"]
        True
        >>> fp32.categories["weight copies"], bf16.categories["weight copies"] > 0
        (0, True)
    """
    check_function("make_run", make_run, MAKE_RUN_USAGE, "memory(make_run, modes)")
    names = mode_labels(modes)  # "fp32,bf16" too, as compare takes them
    batch_size = None if batch_size is None else check_count("batch_size", batch_size)
    accounts, skipped = [], {}
    for name in names:
        try:
            trainer, data, _ = built_run(make_run, name)
        except MpnbError as error:
            skipped[name] = str(error)
            continue
        check_trains_in(trainer, name)
        batch = first_batch(data)
        if batch_size is not None:
            batch = with_batch_size(batch, batch_size)
        account = account_step(trainer, batch)
        if measure:
            trainer, _, _ = built_run(make_run, name)
            account = measure_step(trainer, batch, account)
        accounts.append(account)
    return MemoryReport(accounts, skipped)


def account_step(trainer: Trainer, batch: Any, samples: int | None = None) -> MemoryAccount:
    """Count ``trainer``'s training step on ``batch`` by category (see the module's docstring).

    On a shape-only copy, so ``trainer`` is left as it was; a model whose forward needs real
    values is counted on the real step (a warm-up step and the step), after which ``trainer``'s
    weights, buffers, gradients and optimizer state are put back as they were.
    ``samples``: count a batch of that many samples instead, grown from ``batch``'s own inside
    the shape-only copy (:func:`~mpnb.training.batches.with_batch_size`), so that a size beyond
    memory allocates nothing.
    """
    batch = to_device(batch, trainer.device)
    size = (samples_in(batch) or 0) if samples is None else samples
    steps = [_step(trainer, batch, WARM_UP_SAMPLES), _step(trainer, batch, samples)]
    model, optimizer = trainer.model, trainer.optimizer
    try:
        counted, shape_only = tracked_peak(model, optimizer, steps, fake=True), True
    except Exception:  # a forward that reads values (.item(), a data-dependent branch)
        with _trained_back(model, optimizer):
            counted, shape_only = tracked_peak(model, optimizer, steps, fake=False), False
    counted.pop("total")
    if samples is None:
        counted["batch"] = _batch_bytes(batch)
    else:
        with fake_mode():  # the grown batch's bytes, from its shapes
            counted["batch"] = _batch_bytes(with_batch_size(batch, samples))
    return MemoryAccount(
        trainer.amp.precision.mode.label, size, str(trainer.device), counted, shape_only
    )


@contextlib.contextmanager
def _trained_back(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside, steps may train ``model`` with ``optimizer``; on leaving, the weights and
    buffers, each parameter's gradient and the optimizer's state are what they were."""
    weights = copy.deepcopy(model.state_dict())
    state = copy.deepcopy(optimizer.state_dict())
    gradients = [(parameter, parameter.grad) for parameter in model.parameters()]
    try:
        yield
    finally:
        model.load_state_dict(weights)
        optimizer.load_state_dict(state)
        for parameter, gradient in gradients:
            parameter.grad = gradient


def measure_step(trainer: Trainer, batch: Any, account: MemoryAccount) -> MemoryAccount:
    """``account`` with what a real run of the step used: ``trainer`` (a fresh run) trains a
    warm-up step and then ``batch``, and the allocator's and the process's peaks are read."""
    device = trainer.device
    backend = backend_for(device)
    batch = to_device(batch, device)
    resident = _resident_bytes(trainer, batch)
    trainer.dashboard = None
    gc.collect()
    backend.release_cached_memory()
    before = backend.memory(device.index)
    backend.reset_peak_memory(device.index)

    def train() -> None:
        trainer.fit(_with_warm_up(batch), epochs=1)

    if device.type == "cpu":
        allocator = resident + cpu_allocator_peak(train)
        after = backend.memory(device.index)
        process = _over(after.peak, before.used, resident)
    else:
        train()
        after = backend.memory(device.index)
        allocator = _over(after.peak, before.used, resident)
        process = _over(after.reserved, before.used, resident)
    return dataclasses.replace(account, allocator=allocator, process=process)


def _with_warm_up(batch: Any) -> list[Any]:
    return [with_batch_size(batch, WARM_UP_SAMPLES), batch]


def _over(peak: int | None, before: int | None, resident: int) -> int | None:
    return None if peak is None or before is None else resident + peak - before


def _step(trainer: Trainer, batch: Any, samples: int | None = None) -> Any:
    """The training step the account runs: the trainer's forward under its autocast, backward,
    the optimizer's step (the loss scaler changes no memory worth counting). ``samples``: the
    batch grown (or cut) to that many samples when the step runs, inside the account's mode."""
    precision = trainer.amp.precision

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        sized = batch if samples is None else with_batch_size(batch, samples)
        # A mode's own layers (fp8's) stay in place through the backward pass, as in a fit:
        # torch's tracker follows each module there, and warned of every one gone before.
        with precision.model_scope(model):
            with precision.autocast.context():
                loss = batch_loss(model, sized, trainer.loss_fn, trainer.step_fn)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _batch_bytes(batch: Any) -> int:
    return storage_bytes(tensors_in(batch))


def _resident_bytes(trainer: Trainer, batch: Any) -> int:
    """What a measured step finds in memory before it starts and the account counts: the
    model's parameters and buffers, the optimizer's state and the batch."""
    state = [
        value
        for per_parameter in trainer.optimizer.state.values()
        for value in per_parameter.values()
        if isinstance(value, torch.Tensor)
    ]
    model = trainer.model
    return storage_bytes([*model.parameters(), *model.buffers(), *state]) + _batch_bytes(batch)
