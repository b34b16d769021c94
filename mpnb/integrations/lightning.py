"""mpnb inside Lightning: a ``Callback`` for the Lightning Trainer, and telemetry for Fabric loops.

Needs ``pip install 'mpnb[lightning]'``::

    from mpnb.integrations.lightning import MpnbCallback, precision

    callback = MpnbCallback()
    trainer = L.Trainer(precision=precision("bf16"), callbacks=[callback], max_steps=100)
    trainer.fit(module, loader)
    callback.history.summary()

Each row is one optimizer step: the loss ``training_step`` returned (averaged over the
step's accumulated batches, a part-filled last window included; a step that returns no loss,
as manual optimization may, has ``loss_missing``), the loss scale and skipped flag of the
GradScaler Lightning's precision plugin really uses, the precision read from autocast and the
weights during the forward pass (``"bf16-true"`` for ``precision="bf16-true"``), and the epoch.
With manual optimization a row is a step of the first optimizer (a batch that steps it twice
makes two rows, its loss on the second); a batch whose ``training_step`` returned None under
automatic optimization, which Lightning counts as a step without calling the optimizer, makes a
row with ``loss_missing`` that is not marked skipped (skipped means gradients overflowed).
Validation during training is left out of the next step's time.

Lightning rewrites some requests before any callback runs: on a CPU, ``precision="16-mixed"``
becomes ``"bf16-mixed"`` ("AMP with fp16 is not supported on CPU"). The Trainer keeps no trace
of what was asked, so pass it to the callback (``MpnbCallback(precision="16-mixed")``) to have
the difference said; by default the callback checks against the Trainer's final setting.

fp8, as Lightning documents it with torchao: ``precision="bf16-mixed"`` and the model's Linear
layers converted in ``configure_model`` (``convert_to_float8_training``). The rows then say
``"fp8"`` (read from the model's layers when training starts). Lightning has no fp8 setting to
check against: ``MpnbCallback(precision="fp8")`` says so when no layer was converted (the run
then trains in bf16).

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
from mpnb.precision.modes import Mode, mode_names, parse_mode, registered
from mpnb.precision.policy import session
from mpnb.training.batches import samples_in
from mpnb.training.telemetry import Sink

__all__ = ["MpnbCallback", "fabric_telemetry", "precision"]

#: Lightning's precision settings, each with the precision mpnb observes it as (None: none it names).
_SETTINGS = {
    "16-mixed": "fp16",
    "bf16-mixed": "bf16",
    "16-true": "fp16-true",
    "bf16-true": "bf16-true",
    "32-true": "fp32",
    "64-true": "fp64",
    "transformer-engine": None,
    "transformer-engine-float16": None,
    "16": "fp16",  # Lightning's older spellings
    "bf16": "bf16",
    "32": "fp32",
    "64": "fp64",
}


def precision(mode: str | Mode | None = None) -> str:
    """Lightning's ``precision=`` string for a mode (default: the session's ``%amp`` mode; with the
    session's mode ``off``, Lightning's own default ``"32-true"``).
    Lightning has no TF32 switch of its own: for tf32, also run ``%tf32 on`` (or ``torch.set_float32_matmul_precision``).

    Raises:
        InvalidChoiceError: an unknown mode, or ``off`` asked for by name.

    Example:
        >>> precision("bf16"), precision("tf32"), precision()  # the session's mode is off
        ('bf16-mixed', '32-true', '32-true')
        >>> precision("off")
        Traceback (most recent call last):
        ...
        mpnb.errors.InvalidChoiceError: unknown Lightning precision for mode 'off'; valid: fp32, tf32, fp16, bf16
    """
    if mode is None and session.mode.changes_nothing:
        return "32-true"
    chosen = parse_mode(mode) if mode is not None else session.mode
    setting = chosen.lightning_precision
    if setting is None:
        valid = [m.name for m in registered() if m().lightning_precision is not None]
        hint = chosen.framework_hint
        raise InvalidChoiceError(
            "Lightning precision for mode",
            chosen.label,
            valid,
            f"Lightning has no {chosen.name} setting: {hint}." if hint else "",
        )
    return setting


def asked_precision(setting: str | int | None) -> str | None:
    """The precision a Lightning setting asks for (None for settings mpnb has no name for), or
    ``"fp8"`` (bf16-mixed with float8 layers converted in ``configure_model``).

    Raises:
        InvalidChoiceError: a setting Lightning does not have, naming those it has.
    """
    if setting is None:
        return None
    # a mode that converts layers (fp8) is asked as bf16-mixed with the layers converted in
    # configure_model: Lightning has no setting for it, so a callback is told the mode's name
    known = {**_SETTINGS, **{name: name for name in mode_names(converts_layers=True)}}
    if str(setting) not in known:
        raise InvalidChoiceError("Lightning precision", setting, list(known))
    return known[str(setting)]


class MpnbCallback(Callback, WithTelemetry):
    """mpnb's telemetry and controls for a Lightning ``Trainer``.

    Args:
        dashboard: ``"auto"``, ``"live"``, ``"text"``, a Sink, or None.
        precision: what you passed to the Trainer, if Lightning may have changed it (see above);
            ``"fp8"`` when ``configure_model`` converts layers to torchao's float8 training.
        on_nonfinite, flush_every, watch_numerics, locate_overflow: as
            :class:`~mpnb.integrations.loop_telemetry.LoopTelemetry`.

    Example (three bf16 steps of a one-layer model on CPU):
        >>> import lightning as L
        >>> class Net(L.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layer = torch.nn.Linear(4, 1)
        ...     def training_step(self, batch, index):
        ...         return self.layer(batch[0]).pow(2).mean()
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
        >>> callback = MpnbCallback(dashboard=None)
        >>> trainer = L.Trainer(accelerator="cpu", precision=precision("bf16"), max_steps=3, callbacks=[callback],
        ...                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
        ...                     enable_model_summary=False)
        >>> data = torch.utils.data.TensorDataset(torch.ones(32, 4))
        >>> trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=8))
        >>> callback.history.step, callback.history.mode
        ([1, 2, 3], ['bf16', 'bf16', 'bf16'])
    """

    def __init__(
        self,
        dashboard: str | Sink | None = "auto",
        precision: str | int | None = None,
        on_nonfinite: str = "warn",
        flush_every: int = 64,
        watch_numerics: int | bool | None = True,
        locate_overflow: bool = True,
    ) -> None:
        asked_precision(precision)  # refuse a setting Lightning does not have, now
        self.telemetry = LoopTelemetry(
            "Lightning", dashboard, on_nonfinite, flush_every, watch_numerics, locate_overflow
        )
        self.asked = precision
        self._step_pending = False

    def on_train_start(self, trainer, pl_module) -> None:
        setting = self.asked if self.asked is not None else trainer.precision
        self.telemetry.begin(
            pl_module,
            trainer.optimizers[0],
            scaler=getattr(trainer.precision_plugin, "scaler", None),
            device=pl_module.device,
            asked=asked_precision(setting),
            title=f"Lightning: {type(pl_module).__name__}",
            on_stop=lambda: setattr(trainer, "should_stop", True),
            after_step=trainer.global_step,  # a fit resumed from a ckpt_path numbers on
        )
        if len(trainer.optimizers) > 1:
            self.telemetry.notices.say(
                "optimizers",
                f"Lightning trains {type(pl_module).__name__} with {len(trainer.optimizers)} optimizers: "
                "mpnb records the steps, learning rate and skips of the first one only",
            )
        self._step_pending = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.telemetry.window_begin()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # the first optimizer's steps only (said at the start)
        if optimizer is not trainer.optimizers[0]:
            return
        # manual optimization, a second step in one batch: the first one's row now
        if self._step_pending:
            self._end_step(trainer)
        self.telemetry.before_optimizer_step()
        self._step_pending = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # counted as it ends: a batch that on_train_batch_start returning -1 cut short trained nothing
        self.telemetry.add_samples(samples_in(batch))
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            # Lightning divides by accumulate_grad_batches, the last part-filled window too: undone,
            # so the step's loss is the mean of its own batches (manual optimization divides nothing)
            scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
            self.telemetry.add_loss(
                loss.float() * scale if scale != 1 else loss
            )  # in fp32: no second rounding
        if self._step_pending:
            # automatic optimization calls no optimizer for a batch without a loss: not an overflow skip
            self._end_step(
                trainer, optimizer_called=loss is not None or not pl_module.automatic_optimization
            )

    def _end_step(self, trainer, optimizer_called: bool = True) -> None:
        self._step_pending = False
        if self.telemetry.step_end(trainer.current_epoch, optimizer_called=optimizer_called):
            trainer.should_stop = True

    def on_validation_start(self, trainer, pl_module) -> None:
        if self.telemetry.running:  # maybe between two batches of a step: their time is kept
            self.telemetry.outside_steps_start()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.telemetry.running:  # validation during training: not part of the next step's time
            self.telemetry.outside_steps()

    def on_train_end(self, trainer, pl_module) -> None:
        self.telemetry.end()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.telemetry.end()

    def __repr__(self) -> str:
        return f"<mpnb MpnbCallback for Lightning: {self.telemetry.steps} steps>"


def fabric_telemetry(
    fabric: Any,
    model: torch.nn.Module,
    optimizer: Any,
    dashboard: str | Sink | None = "auto",
    precision: str | int | None = None,
    *,
    on_nonfinite: str = "warn",
    flush_every: int = 64,
    watch_numerics: int | bool | None = True,
    locate_overflow: bool = True,
):
    """Telemetry for a Lightning Fabric loop: a started :class:`~mpnb.integrations.accelerate.LoopRecorder`
    reading Fabric's own scaler and precision setting. See :mod:`mpnb.integrations.accelerate`.
    ``precision``: what you passed to Fabric, which rewrites some settings as the Trainer does
    (``"16-mixed"`` becomes ``"bf16-mixed"`` on a CPU), to have the difference said.
    ``on_nonfinite``, ``flush_every``, ``watch_numerics``, ``locate_overflow``: see
    :class:`~mpnb.integrations.loop_telemetry.LoopTelemetry`.

    Fabric does not know where a step ends: with gradient accumulation, tell ``record`` (a row
    is recorded after every micro-batch otherwise)::

        with fabric_telemetry(fabric, model, optimizer) as recorder:
            for index, batch in enumerate(loader):
                ends_step = (index + 1) % accumulate == 0
                with fabric.no_backward_sync(model, enabled=not ends_step):
                    loss = loss_fn(model(batch[0]), batch[1])
                    fabric.backward(loss / accumulate)
                if ends_step:
                    optimizer.step()
                    optimizer.zero_grad()
                if recorder.record(loss, batch, ends_step=ends_step):  # True once Stop was pressed
                    break

    Example (three bf16 steps on CPU, one micro-batch a step):
        >>> import lightning as L
        >>> fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
        >>> model = torch.nn.Linear(4, 1)
        >>> model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> with fabric_telemetry(fabric, model, optimizer, dashboard=None) as recorder:
        ...     for _ in range(3):
        ...         loss = model(torch.ones(8, 4)).float().pow(2).mean()
        ...         fabric.backward(loss)
        ...         optimizer.step()
        ...         optimizer.zero_grad()
        ...         _ = recorder.record(loss, batch=torch.ones(8, 4))
        >>> len(recorder.history), recorder.history.mode
        (3, ['bf16', 'bf16', 'bf16'])
    """
    from mpnb.integrations.accelerate import LoopRecorder

    plugin = fabric._precision
    return LoopRecorder.start(
        "Lightning Fabric",
        model,
        getattr(optimizer, "optimizer", optimizer),
        scaler=getattr(plugin, "scaler", None),
        device=fabric.device,
        asked=asked_precision(
            precision if precision is not None else getattr(plugin, "precision", None)
        ),
        dashboard=dashboard,
        on_nonfinite=on_nonfinite,
        flush_every=flush_every,
        watch_numerics=watch_numerics,
        locate_overflow=locate_overflow,
    )
