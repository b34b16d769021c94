"""mpnb inside Lightning: a ``Callback`` for the Lightning Trainer, and telemetry for Fabric loops.

Needs ``pip install 'mpnb[lightning]'``::

    from mpnb.integrations.lightning import MpnbCallback, precision

    callback = MpnbCallback()
    trainer = L.Trainer(precision=precision("bf16"), callbacks=[callback], max_steps=100)
    trainer.fit(module, loader)
    callback.history.summary()

Each row is one optimizer step: the loss ``training_step`` returned (averaged over the
step's accumulated batches), the loss scale and skipped flag of the GradScaler Lightning's
precision plugin really uses, and the mode read from autocast during the forward pass.

Lightning rewrites some requests before any callback runs: on a CPU, ``precision="16-mixed"``
becomes ``"bf16-mixed"`` ("AMP with fp16 is not supported on CPU"). The Trainer keeps no trace
of what was asked, so pass it to the callback (``MpnbCallback(precision="16-mixed")``) to have
the difference said; by default the callback checks against the Trainer's final setting.

Stop on the dashboard sets ``trainer.should_stop``: Lightning ends after the current step.

Example:
    >>> precision("bf16"), precision("fp16"), precision("fp32")
    ('bf16-mixed', '16-mixed', '32-true')
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback

from mpnb.errors import InvalidChoiceError
from mpnb.integrations.loop_telemetry import LoopTelemetry, WithTelemetry
from mpnb.precision.modes import Mode, parse_mode
from mpnb.precision.policy import session
from mpnb.training.batches import samples_in
from mpnb.training.telemetry import Sink

__all__ = ["MpnbCallback", "fabric_telemetry", "precision"]

_PRECISIONS = {Mode.FP32: "32-true", Mode.TF32: "32-true", Mode.FP16: "16-mixed", Mode.BF16: "bf16-mixed"}
_MODES = {"16-mixed": Mode.FP16, "bf16-mixed": Mode.BF16, "32-true": Mode.FP32, "32": Mode.FP32, "16": Mode.FP16}


def precision(mode: str | Mode | None = None) -> str:
    """Lightning's ``precision=`` string for a mode (default: the session's ``%amp`` mode).
    Lightning has no TF32 switch of its own: for tf32, also run ``%tf32 on`` (or ``torch.set_float32_matmul_precision``).

    Raises:
        InvalidChoiceError: an unknown mode, or ``off``.
    """
    chosen = parse_mode(mode) if mode is not None else session.mode
    if chosen not in _PRECISIONS:
        raise InvalidChoiceError("mode for Lightning", chosen.value, [m.value for m in _PRECISIONS])
    return _PRECISIONS[chosen]


def asked_mode(setting: str | int | None) -> Mode | None:
    """The mode a Lightning precision setting asks for (None for settings mpnb has no mode for)."""
    return _MODES.get(str(setting))


class MpnbCallback(Callback, WithTelemetry):
    """mpnb's telemetry and controls for a Lightning ``Trainer``.

    Args:
        dashboard: ``"auto"``, ``"live"``, ``"text"``, a Sink, or None.
        precision: what you passed to the Trainer, if Lightning may have changed it (see above).
        on_nonfinite, flush_every: as :class:`~mpnb.integrations.loop_telemetry.LoopTelemetry`.
    """

    def __init__(
        self,
        dashboard: str | Sink | None = "auto",
        precision: str | int | None = None,
        on_nonfinite: str = "warn",
        flush_every: int = 20,
    ) -> None:
        self.telemetry = LoopTelemetry("Lightning", dashboard, on_nonfinite, flush_every)
        self.asked = precision
        self._step_pending = False

    def on_train_start(self, trainer, pl_module) -> None:
        setting = self.asked if self.asked is not None else trainer.precision
        self.telemetry.begin(
            pl_module,
            trainer.optimizers[0],
            scaler=getattr(trainer.precision_plugin, "scaler", None),
            device=pl_module.device,
            asked=asked_mode(setting),
            title=f"Lightning: {type(pl_module).__name__}",
        )
        self._step_pending = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.telemetry.window_begin()
        self.telemetry.add_samples(samples_in(batch))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.telemetry.before_optimizer_step()
        self._step_pending = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.telemetry.add_loss(loss, normalized=True)  # Lightning divides by accumulate_grad_batches
        if not self._step_pending:
            return
        self._step_pending = False
        checkpoint = self.telemetry.step_end()
        if checkpoint.stop or self.telemetry.stop_requested:
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        self.telemetry.end()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.telemetry.end()

    def __repr__(self) -> str:
        return f"<mpnb MpnbCallback for Lightning: {self.telemetry.steps} steps>"


def fabric_telemetry(fabric: Any, model: torch.nn.Module, optimizer: Any, dashboard: str | Sink | None = "auto"):
    """Telemetry for a Lightning Fabric loop: a started :class:`~mpnb.integrations.accelerate.LoopRecorder`
    reading Fabric's own scaler and precision setting. See :mod:`mpnb.integrations.accelerate`."""
    from mpnb.integrations.accelerate import LoopRecorder

    plugin = fabric._precision
    return LoopRecorder.start(
        "Lightning Fabric",
        model,
        getattr(optimizer, "optimizer", optimizer),
        scaler=getattr(plugin, "scaler", None),
        device=fabric.device,
        asked=asked_mode(getattr(plugin, "precision", None)),
        dashboard=dashboard,
    )
