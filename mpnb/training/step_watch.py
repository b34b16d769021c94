"""Whether an optimizer step really updated the weights, known without reading the device.

GradScaler calls ``optimizer.step()`` only when the gradients are finite, so a step
post-hook on the optimizer says whether the step was taken or skipped for inf/NaN. The
hook goes first among the optimizer's post-hooks, so a failing hook of the user's,
registered earlier, cannot hide that the update happened. Used by :class:`~mpnb.AmpStep`
and by the hooks mpnb puts into other frameworks' training loops (``mpnb.integrations``).

Example:
    >>> import torch
    >>> weight = torch.nn.Parameter(torch.ones(1))
    >>> optimizer = torch.optim.SGD([weight], lr=0.1)
    >>> watch = OptimizerStepWatch(optimizer)
    >>> weight.grad = torch.ones(1)
    >>> optimizer.step()
    >>> watch.stepped, watch.skipped(torch.amp.GradScaler("cpu", enabled=False), torch.device("cpu"))
    (True, False)
    >>> watch.remove()
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__: list[str] = []


class OptimizerStepWatch:
    """Notes each call of ``optimizer.step()`` that went through (:attr:`stepped`, cleared by :meth:`reset`),
    and the found-inf flag GradScaler handed a fused step (:attr:`found_inf`), which the scaler's
    own record loses at its ``update()``: frameworks update before mpnb asks."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.stepped = False
        self.found_inf: torch.Tensor | None = None
        self._handle = optimizer.register_step_post_hook(_StepFlag(self))
        optimizer._optimizer_step_post_hooks.move_to_end(self._handle.id, last=False)

    def reset(self) -> None:
        """Forget earlier steps: call just before the step to watch."""
        self.stepped = False
        self.found_inf = None

    def skipped(
        self, scaler: torch.amp.GradScaler | None, device: torch.device
    ) -> torch.Tensor | bool:
        """Whether the step just taken through ``scaler`` was skipped for inf/NaN gradients.

        Read from what happened, never from the scale (which stops moving once it underflows
        to 0). An optimizer that takes the scaler's found-inf flag into its own fused step is
        always called; for it, the flag GradScaler handed over says, as a device tensor, so
        nothing is read here. Without an enabled scaler nothing is ever skipped.
        """
        if scaler is None or not scaler.is_enabled():
            return False
        if getattr(self.optimizer, "_step_supports_amp_scaling", False):
            if self.found_inf is not None:
                return self.found_inf.to(device, non_blocking=True) > 0
            state = scaler._per_optimizer_states.get(
                id(self.optimizer)
            )  # an optimizer given the scaler itself
            found = state["found_inf_per_device"].values() if state else ()
            return (
                sum(
                    (flag.to(device, non_blocking=True) for flag in found),
                    torch.zeros((), device=device),
                )
                > 0
            )
        return not self.stepped

    def remove(self) -> None:
        """Take the hook off the optimizer."""
        self._handle.remove()


def scale_in_use(scaler: torch.amp.GradScaler | None) -> torch.Tensor | float:
    """The loss scale the next optimizer step runs with, read without a device sync: a copy of the
    scaler's scale tensor (``update()`` changes it in place), its initial scale before its first
    use, 1.0 without an enabled scaler.

    >>> scale_in_use(torch.amp.GradScaler("cpu", init_scale=1024.0)), scale_in_use(None)
    (1024.0, 1.0)
    """
    if scaler is None or not scaler.is_enabled():
        return 1.0
    scale = scaler._get_scale_async()
    return (
        scale.clone() if scale is not None else scaler.get_scale()
    )  # get_scale() reads no tensor then


def initial_scale(scaler: torch.amp.GradScaler) -> float:
    """The scale ``scaler`` started from (its ``init_scale``), which GradScaler keeps but does not
    show.

    >>> initial_scale(torch.amp.GradScaler("cpu", init_scale=1024.0))
    1024.0
    """
    return float(scaler._init_scale)


def lr_in_use(optimizer: torch.optim.Optimizer) -> Any:
    """The learning rate of the optimizer's first parameter group, as the next step uses it: a copy when
    it is a tensor (a scheduler changes it in place, and the row is read at a later flush).

    >>> optimizer = torch.optim.Adam([torch.nn.Parameter(torch.ones(1))], lr=torch.tensor(0.01))
    >>> lr = lr_in_use(optimizer)
    >>> optimizer.param_groups[0]["lr"].mul_(0.5)
    tensor(0.0050)
    >>> lr
    tensor(0.0100)
    """
    lr = optimizer.param_groups[0]["lr"]
    return lr.detach().clone() if isinstance(lr, torch.Tensor) else lr


class _StepFlag:
    """The post-hook itself; holds the watch weakly so the hook never keeps it alive."""

    def __init__(self, owner: OptimizerStepWatch) -> None:
        self._owner = weakref.ref(owner)

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        owner = self._owner()
        if owner is not None:
            owner.stepped = True
            owner.found_inf = getattr(
                optimizer, "found_inf", None
            )  # set by GradScaler.step for a fused step
