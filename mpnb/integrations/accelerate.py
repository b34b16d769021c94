"""mpnb's telemetry for loops you write yourself with Hugging Face Accelerate (or Fabric, or plain torch.amp).

Needs ``pip install accelerate`` (in ``mpnb[transformers]``). One call after each micro-batch::

    from mpnb.integrations.accelerate import watch

    accelerator = Accelerator(mixed_precision="bf16")
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with watch(accelerator, model, optimizer) as recorder:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if recorder.record(loss, batch):  # True once Stop was pressed
                break
    recorder.history.summary()

A row is recorded when a micro-batch ends an optimizer step (``accelerator.sync_gradients``),
with the loss averaged over the step's micro-batches, the loss scale the step used and whether
the Accelerator's GradScaler skipped it (read from the optimizer, no device sync), the learning
rate, the step time, the memory and the mode read from autocast and the weights during the forward pass. Call
``record`` after your scheduler's step: the learning rate it reads is the next step's.

Example (a plain torch loop, no framework):
    >>> import torch
    >>> model = torch.nn.Linear(4, 1)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with LoopRecorder.start("my loop", model, optimizer, scaler=None, device="cpu", dashboard=None) as recorder:
    ...     for _ in range(3):
    ...         loss = model(torch.ones(8, 4)).pow(2).mean()
    ...         loss.backward()
    ...         optimizer.step()
    ...         optimizer.zero_grad()
    ...         _ = recorder.record(loss, batch=torch.ones(8, 4))
    >>> len(recorder.history), recorder.history.mode[0]
    (3, 'fp32')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mpnb.integrations.loop_telemetry import LoopTelemetry, WithTelemetry
from mpnb.precision.modes import Mode
from mpnb.training.batches import samples_in
from mpnb.training.history import History
from mpnb.training.telemetry import Sink

__all__ = ["LoopRecorder", "watch"]

_ACCELERATE_PRECISIONS = {"no": "fp32", "fp16": "fp16", "bf16": "bf16", "fp8": "fp8"}


class LoopRecorder(WithTelemetry):
    """Records a loop you write: call :meth:`record` after each micro-batch's backward and step.

    Attributes:
        telemetry: the :class:`~mpnb.integrations.loop_telemetry.LoopTelemetry` it feeds.
        step_ends: says whether the micro-batch just recorded ended an optimizer step.

    Example (a plain torch loop under bf16 autocast, two micro-batches a step):
        >>> model = torch.nn.Linear(4, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> recorder = LoopRecorder.start("my loop", model, optimizer, scaler=None, device="cpu", dashboard=None)
        >>> for index in range(4):
        ...     with torch.autocast("cpu", dtype=torch.bfloat16):
        ...         loss = model(torch.ones(8, 4)).float().pow(2).mean()
        ...     (loss / 2).backward()
        ...     ends_step = index % 2 == 1
        ...     if ends_step:
        ...         optimizer.step()
        ...         optimizer.zero_grad()
        ...     _ = recorder.record(loss, batch=torch.ones(8, 4), ends_step=ends_step)
        >>> history = recorder.close()
        >>> len(history), history.mode
        (2, ['bf16', 'bf16'])
    """

    def __init__(self, telemetry: LoopTelemetry, step_ends: Callable[[], bool]) -> None:
        self.telemetry, self.step_ends = telemetry, step_ends

    @classmethod
    def start(
        cls,
        framework: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scaler: torch.amp.GradScaler | None,
        device: torch.device | str,
        asked: str | Mode | None = None,
        dashboard: str | Sink | None = "auto",
        step_ends: Callable[[], bool] = lambda: True,
        on_nonfinite: str = "warn",
        flush_every: int = 64,
        watch_numerics: int | bool | None = True,
        locate_overflow: bool = True,
    ) -> LoopRecorder:
        """Attach to ``model`` and ``optimizer`` (the torch optimizer) and show the dashboard.

        ``asked``: the precision the loop was asked for (``"bf16"``, ``"fp16-true"``..., see
        :func:`~mpnb.integrations.observed.precisions`), to have a difference said.
        ``on_nonfinite``, ``flush_every``, ``watch_numerics``, ``locate_overflow``: see
        :class:`~mpnb.integrations.loop_telemetry.LoopTelemetry`.
        """
        telemetry = LoopTelemetry(
            framework,
            dashboard,
            on_nonfinite=on_nonfinite,
            flush_every=flush_every,
            watch_numerics=watch_numerics,
            locate_overflow=locate_overflow,
        )
        telemetry.begin(
            model,
            optimizer,
            scaler=scaler,
            device=device,
            asked=asked,
            title=f"{framework}: {type(model).__name__}",
        )
        telemetry.window_begin()
        telemetry.before_optimizer_step()
        return cls(telemetry, step_ends)

    def record(
        self,
        loss: torch.Tensor | float,
        batch: Any = None,
        epoch: int = 0,
        ends_step: bool | None = None,
    ) -> bool:
        """Note a micro-batch's loss (one number; and its example count, from ``batch``); at the
        end of an optimizer step record its row, in ``epoch``. Returns True when the loop should
        stop (Stop pressed, or a non-finite loss with ``on_nonfinite="stop"``).

        ``ends_step``: whether this micro-batch ended an optimizer step, where the loop knows it
        (Fabric's, with gradient accumulation); None asks :attr:`step_ends`.

        Raises:
            TypeError: ``ends_step`` that is not True, False or None, an epoch that is not a whole
                number, or a loss that is not a number (nothing is recorded).
        """
        if ends_step is not None and not isinstance(ends_step, bool):
            raise TypeError(f"ends_step must be True, False or None, got {ends_step!r}")
        epoch = self.telemetry.check_epoch(epoch)
        self.telemetry.add_loss(loss)
        self.telemetry.add_samples(samples_in(batch) if batch is not None else None)
        if not (self.step_ends() if ends_step is None else ends_step):
            return False
        stop = self.telemetry.step_end(epoch)
        self.telemetry.window_begin()
        self.telemetry.before_optimizer_step()  # the scale and learning rate the next step starts with
        return stop

    def close(self) -> History:
        """Flush, close the dashboard, take the hooks off; returns the history."""
        self.telemetry.end()
        return self.history

    def __enter__(self) -> LoopRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def watch(
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: Any,
    dashboard: str | Sink | None = "auto",
    *,
    on_nonfinite: str = "warn",
    flush_every: int = 64,
    watch_numerics: int | bool | None = True,
    locate_overflow: bool = True,
) -> LoopRecorder:
    """A started :class:`LoopRecorder` for an Accelerate loop: the Accelerator's scaler, device and
    ``mixed_precision`` setting; a row at each micro-batch with ``accelerator.sync_gradients``.

    Example (``watch`` reads four attributes of the Accelerator: ``scaler``, ``device``,
    ``mixed_precision`` and ``sync_gradients``; ``on_nonfinite``, ``flush_every``,
    ``watch_numerics`` and ``locate_overflow`` are
    :class:`~mpnb.integrations.loop_telemetry.LoopTelemetry`'s. Accelerate allows one ``mixed_precision`` per
    process, and a real Accelerator made here would fix it for every later one, so the example
    passes an object with those four instead):
        >>> import types
        >>> accelerator = types.SimpleNamespace(scaler=None, device=torch.device("cpu"), mixed_precision="no",
        ...                                     sync_gradients=True)
        >>> model = torch.nn.Linear(4, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with watch(accelerator, model, optimizer, dashboard=None) as recorder:
        ...     for _ in range(3):
        ...         loss = model(torch.ones(8, 4)).pow(2).mean()
        ...         loss.backward()
        ...         optimizer.step()
        ...         optimizer.zero_grad()
        ...         _ = recorder.record(loss, batch=torch.ones(8, 4))
        >>> len(recorder.history), recorder.history.mode
        (3, ['fp32', 'fp32', 'fp32'])
    """
    return LoopRecorder.start(
        "Accelerate",
        getattr(model, "module", model),
        getattr(
            optimizer, "optimizer", optimizer
        ),  # AcceleratedOptimizer wraps the torch optimizer
        scaler=accelerator.scaler,
        device=accelerator.device,
        asked=_ACCELERATE_PRECISIONS.get(str(accelerator.mixed_precision)),
        dashboard=dashboard,
        step_ends=lambda: accelerator.sync_gradients,
        on_nonfinite=on_nonfinite,
        flush_every=flush_every,
        watch_numerics=watch_numerics,
        locate_overflow=locate_overflow,
    )
