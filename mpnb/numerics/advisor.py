"""The numerics advisor: will this model overflow or underflow in fp16, and what to do about it.

:func:`advise` runs one forward and backward pass in fp32 as the reference and again under
fp16 and bf16 autocast. The reference pass is measured by the numerics watch's own engine
(:class:`~mpnb.numerics.watch.ModuleMeasures`, through :mod:`mpnb.numerics.probe`): one batch,
looked at once, where the watch looks at sampled steps of a fit. Per module it reports the
largest |activation| and |gradient| against fp16's largest finite value, the fp16 underflow
share of its gradient without loss scaling (:func:`~mpnb.numerics.limits.underflow_share`), and
the relative error of outputs and gradients against fp32 (each pass's float32 copies). From these it writes concrete advice:
which dtype, which modules' ops to put on the FP32 list, and a GradScaler ``init_scale``
that avoids the first-step overflow. (HF transformers' DebugUnderflowOverflow watches the
forward pass only and prints text; this covers backward too and says what to change.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mpnb import views
from mpnb._render import html_list, html_table, text_table
from mpnb.errors import MpnbError
from mpnb.numerics.layer_matmuls import relative_error, shown_layer
from mpnb.numerics.limits import FP16_LARGEST_FINITE
from mpnb.numerics.probe import ModuleProbe, leaf_names, uncompiled
from mpnb.numerics.watch import MEASURES, ModuleMeasures
from mpnb.oplists.refusals import refusal_error
from mpnb.precision.backends import backend_for, resolve_device
from mpnb.training.batches import batch_loss, check_loss_fn, check_real_batch, to_device
from mpnb.training.gradients import check_loss
from mpnb.training.random_state import kept_random_state

__all__ = ["Advice", "advise"]

# share of a module's nonzero gradients lost to underflow that deserves advice
UNDERFLOW_ALARM = 0.01
METRICS = (
    "max |activation|",
    "max |gradient|",
    "fp16 underflow share",
    "fp16 output error",
    "bf16 output error",
)


@dataclasses.dataclass
class ModuleNumerics:
    """What one leaf module does to the numbers.

    Attributes:
        module: its path in the model.
        kind: its class name.
        max_activation: largest |output| in fp32.
        max_gradient: largest |gradient of the loss w.r.t. its output| in fp32 (unscaled).
        underflow_share: its gradient's fp16 underflow share, unscaled
            (:func:`~mpnb.numerics.limits.underflow_share`).
        output_error: relative error of its output per low dtype (``"fp16"``, ``"bf16"``) vs fp32.
        gradient_error: the same for the gradient w.r.t. its output.
    """

    module: str
    kind: str
    max_activation: float = 0.0
    max_gradient: float = 0.0
    underflow_share: float = 0.0
    output_error: dict[str, float] = dataclasses.field(default_factory=dict)
    gradient_error: dict[str, float] = dataclasses.field(default_factory=dict)

    def values(self) -> list[float]:
        """The metrics in the order of the table and heatmap columns."""
        return [
            self.max_activation,
            self.max_gradient,
            self.underflow_share,
            self.output_error.get("fp16", math.nan),
            self.output_error.get("bf16", math.nan),
        ]


@dataclasses.dataclass
class Advice:
    """The advisor's findings: per-module numbers and what to do.

    Attributes:
        rows: one per leaf module, in forward order.
        fp16_overflow: modules whose activations or gradients exceed fp16's range.
        underflow: modules whose gradients fp16 would flush to zero without loss scaling.
        init_scale: a GradScaler ``init_scale`` whose first step does not overflow.
        recommended_dtype: ``"bf16"`` or ``"fp16"``.
        advice: the recommendations, as sentences.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        >>> batch = (torch.ones(8, 4), torch.zeros(8, 4))
        >>> advice = advise(model, batch, torch.nn.functional.mse_loss, device="cpu")
        >>> [(row.module, row.kind) for row in advice.rows]
        [('0', 'Linear'), ('1', 'Tanh')]
        >>> advice.recommended_dtype, advice.fp16_overflow, advice.underflow
        ('bf16', [], [])
    """

    rows: list[ModuleNumerics]
    fp16_overflow: list[str]
    underflow: list[str]
    init_scale: float
    recommended_dtype: str
    advice: list[str]

    def __str__(self) -> str:
        table = text_table(("module", "kind", *METRICS), [_row_cells(r) for r in self.rows])
        return table + "\n\n" + "\n".join(f"- {line}" for line in self.advice)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        table = html_table(("module", "kind", *METRICS), [_row_cells(r) for r in self.rows])
        return f"<b>mpnb numerics advice</b>{html_list(self.advice, 'mpnb-advice')}{table}"

    def figure(self):
        """A heatmap, modules x metrics, each column scaled to its own maximum (the UI's ``advice_figure`` view)."""
        return views.view("advice_figure")(self)


def _row_cells(row: ModuleNumerics) -> list[str]:
    return [row.module, row.kind, *[f"{value:.3g}" for value in row.values()]]


class _Copies:
    """Keeps a float32 copy of each leaf module's output and of the gradient flowing back into
    it (for the errors against fp32), through the same probe as the numerics watch
    (:mod:`mpnb.numerics.probe`); on the reference pass, the watch's engine measures too."""

    def __init__(self, model: nn.Module) -> None:
        self.leaves = [
            (name, model.get_submodule(name)) for name in leaf_names(model, with_root=True)
        ]
        self.outputs: dict[str, torch.Tensor] = {}
        self.gradients: dict[str, torch.Tensor] = {}
        self.largest_parameter_gradient = 0.0
        #: each leaf module's largest gradient of its own parameters (the reference pass)
        self.parameter_gradients: dict[str, float] = {}
        names = [name for name, _ in self.leaves]
        self.probe = ModuleProbe(model, names, self._output, self._gradient)
        self.measures = ModuleMeasures(model, names)
        #: module name -> measure -> value, from the watch's engine (the reference pass only)
        self.measured: dict[str, dict[str, float]] = {}

    def _output(self, name: str, module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        self.outputs[name] = output.float().clone()

    def _gradient(self, name: str, grad: torch.Tensor) -> None:
        self.gradients[name] = grad.detach().float().clone()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN equal to NaN."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bool(((a == b) | (a.isnan() & b.isnan())).all())
    )


@contextlib.contextmanager
def left_as_found(model: nn.Module, device: torch.device) -> Iterator[Callable[[], None]]:
    """Run the passes on ``device``; yields a function that resets the model and the random state
    to how they were at the start. Afterwards model, device and random state are as found.

    Only tensors that changed are written back, so the others keep their version counters (a
    backward the caller built before still runs). Every buffer counts, non-persistent ones too.

    Raises:
        MpnbError: the model's tensors are on several devices (or on meta); nothing moved then.
    """
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    homes = {tensor.device for tensor in tensors.values()}
    if len(homes) > 1:
        raise MpnbError(
            "mpnb measures the whole model on one device; its tensors are on "
            f"{', '.join(sorted(map(str, homes)))}: move it with model.to(device)"
        )
    if any(home.type == "meta" for home in homes):
        raise MpnbError(
            "the model's tensors are on the meta device (shapes without values): load its "
            "weights before measuring it"
        )
    home = homes.pop() if homes else device
    saved = {name: tensor.detach().clone() for name, tensor in tensors.items()}
    flags = [(module, module.training) for module in model.modules()]
    grads = [(parameter, parameter.grad) for parameter in model.parameters()]
    with kept_random_state(device.type) as start:

        def start_again() -> None:
            current = dict(model.named_parameters()) | dict(model.named_buffers())
            with torch.no_grad():
                for name, tensor in current.items():
                    if not _same(tensor, saved[name].to(tensor.device)):
                        tensor.copy_(saved[name])
            for module, training in flags:
                module.training = training
            start.restore()

        try:
            if device != home:
                model.to(device)
            yield start_again
        finally:
            if device != home:
                model.to(home)
            start_again()
            for parameter, grad in grads:
                parameter.grad = grad


def _pass(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable | None,
    device: torch.device,
    dtype: torch.dtype | None,
) -> _Copies:
    """One pass; the reference's (``dtype`` None) measured by the watch's engine as well."""
    batch = to_device(batch, device)
    copies = _Copies(model)
    model.zero_grad(set_to_none=True)
    try:
        if dtype is None:
            copies.measures.start()
        # no cast cache: inside a caller's autocast (a %amp bf16 cell) the cache holds the
        # caller's casts of the weights, which an fp16 pass would take (mixed dtypes)
        with (
            copies.probe,
            torch.autocast(
                device.type,
                dtype=dtype or torch.bfloat16,
                enabled=dtype is not None,
                cache_enabled=False,
            ),
        ):
            loss = batch_loss(model, batch, loss_fn, None, takes_step_fn=False)
        check_loss(loss)  # in mpnb's words, not backward's (a frozen model, a loss per sample)
        if dtype is None and not bool(torch.isfinite(loss.detach()).all()):
            raise MpnbError(
                f"the loss is {float(loss.detach().float().flatten()[0]):g} in fp32: the "
                "reference pass is not finite itself, so nothing can be said of fp16 or bf16 on "
                "this batch; look for NaN or inf in the batch and the weights (torch.isfinite)"
            )
        # outside autocast, as a training step runs it, whatever the caller's cell holds
        with torch.autocast(device.type, enabled=False):
            loss.float().backward()
        rows = copies.measures.stop() if dtype is None else None
    finally:
        copies.measures.detach()
    if rows is not None:
        values = rows.cpu().tolist()
        copies.measured = {
            name: dict(zip(MEASURES, row, strict=True))
            for name, row in zip(copies.measures.names, values, strict=True)
        }
    copies.largest_parameter_gradient = max(
        (_largest(p.grad) for p in model.parameters()), default=0.0
    )
    copies.parameter_gradients = {
        name: max((_largest(p.grad) for p in module.parameters(recurse=False)), default=0.0)
        for name, module in copies.leaves
    }
    model.zero_grad(set_to_none=True)
    return copies


def _relative_error(value: torch.Tensor | None, reference: torch.Tensor | None) -> float:
    if value is None or reference is None:
        return math.nan
    return relative_error(value.float(), reference.float())


def _largest(tensor: torch.Tensor | None) -> float:
    return tensor.abs().max().item() if tensor is not None and tensor.numel() else 0.0


def advise(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    *,
    device: str | torch.device | None = None,
) -> Advice:
    """Find where fp16 and bf16 would hurt this model on this batch, and say what to do.

    Args:
        model: left exactly as found: weights, buffers (BatchNorm statistics), gradients,
            each module's train/eval flag and its device. Every pass starts from that state
            and from the same random state, so dropout draws the same masks in each.
        batch: one batch, as the Trainer takes it: ``(inputs, targets)`` with a ``loss_fn``;
            without one, what the model takes to compute its own loss (a dict of keyword
            arguments, as a Hugging Face model takes them).
        loss_fn: ``loss_fn(outputs, targets) -> scalar``; None for a model that returns its loss.
        device: where to run; default the model's device.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(
        ...     torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
        ... )
        >>> batch = (torch.randn(16, 8), torch.randint(0, 2, (16,)))
        >>> report = advise(model, batch, torch.nn.functional.cross_entropy, device="cpu")
        >>> [row.module for row in report.rows]
        ['0', '1', '2']
        >>> report.fp16_overflow, report.recommended_dtype
        ([], 'bf16')
    """
    check_loss_fn(loss_fn, takes_step_fn=False)
    check_real_batch(batch, loss_fn is not None, "advise")
    model = uncompiled(model)
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    target = resolve_device(device) if device is not None or first is None else first.device
    # the passes need gradients wherever advise is called from (a no_grad or inference block)
    with (
        torch.inference_mode(False),
        torch.enable_grad(),
        left_as_found(model, target) as start_again,
    ):
        reference = _pass(model, batch, loss_fn, target, None)
        low = {}
        for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            start_again()
            try:
                low[name] = _pass(model, batch, loss_fn, target, dtype)
            except RuntimeError as error:
                refused = refusal_error(error, dtype)
                if refused is not None:
                    raise refused from error
                raise
    rows = []
    for name, module in reference.leaves:
        if name not in reference.outputs:
            continue
        out, grad = reference.outputs[name], reference.gradients.get(name)
        measured = reference.measured[name]
        rows.append(
            ModuleNumerics(
                module=name,
                kind=type(module).__name__,
                # the watch's largest is of the finite values: a non-finite output is past any limit
                max_activation=math.inf if measured["nonfinite"] else measured["activation_max"],
                max_gradient=measured["gradient_max"],
                underflow_share=measured["gradient_underflow_share"],
                output_error={k: _relative_error(w.outputs.get(name), out) for k, w in low.items()},
                gradient_error={
                    k: _relative_error(w.gradients.get(name), grad) for k, w in low.items()
                },
            )
        )
    return _findings(
        rows,
        (reference.largest_parameter_gradient, reference.parameter_gradients),
        backend_for(target).label,
        target.type,
    )


def _findings(
    rows: list[ModuleNumerics],
    parameter_gradients: tuple[float, dict[str, float]],
    label: str,
    device_type: str,
) -> Advice:
    """The advice from the rows and the parameters' gradients (the largest of all, and each
    module's own: a weight gradient past fp16's range overflows fp16's backward at any loss
    scale of 1 or more, however small the module's values)."""
    parameter_gradient, own_gradients = parameter_gradients
    overflowing = [
        r
        for r in rows
        if r.max_activation > FP16_LARGEST_FINITE
        or r.max_gradient > FP16_LARGEST_FINITE
        or own_gradients.get(r.module, 0.0) > FP16_LARGEST_FINITE
        or math.isinf(r.output_error.get("fp16", 0.0))
    ]
    underflowing = [r for r in rows if r.underflow_share > UNDERFLOW_ALARM]
    overflow, underflow = [r.module for r in overflowing], [r.module for r in underflowing]
    largest_gradient = max([parameter_gradient, *(r.max_gradient for r in rows)])
    init_scale = 2.0**16
    if largest_gradient > 0:
        init_scale = min(
            2.0**16, 2.0 ** math.floor(math.log2(FP16_LARGEST_FINITE / (2 * largest_gradient)))
        )
    advice = []
    for row in overflowing:
        peak = max(row.max_activation, row.max_gradient, own_gradients.get(row.module, 0.0))
        advice.append(
            f"fp16 overflow in {shown_layer(row.module)} ({row.kind}): values reach {peak:.3g} > {FP16_LARGEST_FINITE:.0f}. Use bf16, or put "
            f"{row.kind}'s ops on the FP32 list (%oplist add fp32 ...) so that module stays in fp32."
        )
    for row in underflowing:
        advice.append(
            f"fp16 gradient underflow in {shown_layer(row.module)} ({row.kind}): {row.underflow_share:.0%} of its gradient values are "
            f"below 2^-24 and would become 0 in fp16; loss scaling (torch.amp.GradScaler) fixes it."
        )
    if largest_gradient > 0:
        advice.append(
            f"GradScaler(init_scale={init_scale:g}) keeps the first scaled step below fp16's maximum "
            f"(largest gradient {largest_gradient:.3g}); the default 65536 "
            + ("would overflow on the first step." if init_scale < 2.0**16 else "is fine here.")
        )
    fast_fp16 = device_type == "cuda"
    recommended = "fp16" if fast_fp16 and not overflow else "bf16"
    reason = (
        "fp16's range is exceeded"
        if overflow
        else "fp16 gives no speed here"
        if not fast_fp16
        else "no fp16 problem found"
    )
    advice.insert(0, f"Use {recommended} on this {label}: {reason}.")
    if not overflow and not underflow:
        advice.insert(1, "No fp16 overflow or gradient underflow found on this batch.")
    return Advice(rows, overflow, underflow, init_scale, recommended, advice)
