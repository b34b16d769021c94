"""PrecisionObserver reads what the trained part of a model really runs in (real torch, CPU)."""

from __future__ import annotations

import torch
from torch import nn

from mpnb.integrations.observed import PrecisionObserver, precisions


class Distiller(nn.Module):
    """A frozen teacher declared first, then the student that trains (a distillation's shape)."""

    def __init__(
        self, teacher_dtype: torch.dtype = torch.float32, teacher_under_no_grad: bool = True
    ) -> None:
        super().__init__()
        self.teacher = nn.Linear(4, 4).to(teacher_dtype).requires_grad_(False)
        self.student = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        self.teacher_under_no_grad = teacher_under_no_grad

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(not self.teacher_under_no_grad):
            target = self.teacher(inputs.to(self.teacher.weight.dtype)).float()
        return (self.student(inputs).float() - target).pow(2).mean()


def observed(model: nn.Module, autocast: bool) -> str | None:
    observer = PrecisionObserver(model, "cpu", interval=0.0)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(torch.ones(2, 4)).backward()
        return observer.step_end()
    finally:
        observer.remove()


def test_a_frozen_teacher_run_without_grad_does_not_hide_the_students_precision():
    assert observed(Distiller(), autocast=True) == "bf16"


def test_a_frozen_low_precision_teacher_is_not_taken_for_the_trained_weights():
    assert (
        observed(Distiller(torch.bfloat16, teacher_under_no_grad=False), autocast=False) == "fp32"
    )


def test_float64_weights_are_read_as_fp64_which_autocast_leaves_alone():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).double()
    observer = PrecisionObserver(model, "cpu", interval=0.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = model(torch.ones(2, 4, dtype=torch.float64))
    assert (
        output.dtype == torch.float64 and observer.step_end() == "fp64" and "fp64" in precisions()
    )
    observer.remove()


def test_a_model_with_nothing_to_train_is_read_from_its_first_leaf():
    model = nn.Sequential(nn.Linear(4, 4)).requires_grad_(False)
    observer = PrecisionObserver(model, "cpu", interval=0.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.ones(2, 4))
    assert observer.step_end() == "bf16"
    observer.remove()


class UnusedHead(nn.Module):
    """A frozen first layer that runs, then a trainable module its forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.unused = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return (self.frozen(inputs) * self.scale).float().pow(2).mean()


def test_a_trainable_module_that_never_runs_does_not_leave_the_step_unread():
    assert observed(UnusedHead(), autocast=True) == "bf16"
