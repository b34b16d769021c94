"""Per-module numerics, sampled while a fit runs: how close each layer comes to its dtype's
limits, forward and backward, without a sync of its own.

On a sampled step (every ``every`` optimizer steps) forward hooks on the watched modules (the
leaves by default) reduce each output on the device to a few numbers (:class:`ModuleMeasures`,
the engine :func:`~mpnb.numerics.advisor.advise` uses on its one batch too): its largest
magnitude, its non-finite count, its fp16 underflow share (counted by
:func:`~mpnb.numerics.limits.underflow_counts`, as :func:`~mpnb.numerics.limits.underflow_share`
counts it), and, through a hook on the output, the largest
magnitude of its gradient divided by the loss scale (the unscaled gradient) and that gradient's
underflow share as the backward carries it (scaled). The numbers stay on the device, stacked one
row a module, until the telemetry flushes (the watch is an
:class:`~mpnb.training.step_record.Instrument`, so it reads them at the flush: one copy of all
pending steps, made right after the flush's own; on CUDA that copy is one more blocking call at
a moment the device has already caught up). Nothing is hooked on other steps.

:class:`NumericsLog` holds what was read: a module x sampled-step table per measure, a text form
(the modules nearest to overflow first) and a heatmap (``log.figure()``, in a notebook).

Example:
    >>> import mpnb.examples as ex
    >>> trainer, train, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None,
    ...                                        watch_numerics=2)
    >>> log = trainer.fit(train, max_steps=4) and trainer.numerics
    >>> log.steps, log.modules[:2]
    ([2, 4], ['features.0', 'features.1'])
    >>> log.activation_max["classifier"][0] > 0
    True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from mpnb import views
from mpnb.errors import MpnbError, plain_number, quoted
from mpnb.numerics.limits import (
    FP16_LARGEST_FINITE,
    FP16_SMALLEST_SUBNORMAL,  # noqa: F401  the threshold underflow_counts uses, named here too
    underflow_counts,
)
from mpnb.numerics.probe import ModuleProbe, leaf_names
from mpnb.precision.modes.layer_swap import swapped_layers_of
from mpnb.training.history import History
from mpnb.training.step_record import Instrument, WatchedRun

__all__ = ["NumericsLog"]

#: The measures kept per module and sampled step, in the order of a stacked row. The ``fp8_``
#: ones, for the layers a layer-swapping mode put in (fp8's float8, mxfp8's MX layers; NaN
#: elsewhere): the input's amax, from which the scale is made, the shares of the input's and,
#: apart, of the weight's values that saturate or flush to zero in their format (e4m3; each a
#: share of that tensor's own values), the share of the output's gradient values that flush to
#: zero in the gradient's format (e5m2 for fp8, e4m3 for MX), and for MX layers the range of the
#: input's block scales in powers of two. The last: the gradient's fp16 underflow share, as the
#: backward carries it (scaled by the loss scale).
MEASURES = (
    "activation_max",
    "nonfinite",
    "underflow_share",
    "gradient_max",
    "fp8_amax",
    "fp8_saturated",
    "fp8_flushed",
    "fp8_weight_saturated",
    "fp8_weight_flushed",
    "fp8_grad_flushed",
    "block_scale_range",
    "gradient_underflow_share",
)
#: The low-precision layers' measures, in :data:`MEASURES` order (one tensor a layer).
_LAYER_MEASURES = MEASURES[4:11]
_GRAD_FLUSHED = _LAYER_MEASURES.index("fp8_grad_flushed")
_NAN = float("nan")
#: The sampling interval of ``watch_numerics=True``, the default: a sampled step costs up to
#: 2.4 plain steps of a small model on a CPU (its tiny ops are many), so sampling every 200th
#: keeps the watch under 1% of a fit (``benchmarks/numerics_watch_cost.py``). A fit shorter
#: than that is sampled after trouble only (each step, :data:`DENSE_STEPS` of them).
DEFAULT_EVERY = 200
#: Steps sampled one after another once a flush shows a skipped step or a non-finite loss.
DENSE_STEPS = 8


@dataclasses.dataclass
class NumericsLog:
    """The sampled numerics of a run: per measure, per module, one value a sampled step.

    Attributes:
        steps: the sampled optimizer steps.
        modules: the watched modules' names.
        activation_max, nonfinite, underflow_share, gradient_max: module name -> values.
        fp8_amax, fp8_saturated, fp8_flushed, fp8_grad_flushed: the same for the layers of
            fp8 and mxfp8 (see :data:`MEASURES`), with fp8_weight_saturated,
            fp8_weight_flushed and block_scale_range.
        gradient_underflow_share: the output's gradient's fp16 underflow share, scaled as the
            backward carries it.
        limit: the largest finite value of the dtype the watch compares with.

    Example:
        >>> log = NumericsLog(["fc"], limit=65504.0)
        >>> log.add(1, [[60000.0, 0.0, 0.0, 2.0]])
        >>> print(log)
        module  largest |activation|  headroom  largest |gradient|  fp16-underflow share  non-finite
        fc      6e+04                 1.09x     2                   0%                    0
    """

    modules: list[str]
    limit: float = FP16_LARGEST_FINITE
    steps: list[int] = dataclasses.field(default_factory=list)
    activation_max: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    nonfinite: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    underflow_share: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    gradient_max: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    fp8_amax: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    fp8_saturated: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    fp8_flushed: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    fp8_weight_saturated: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    fp8_weight_flushed: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    fp8_grad_flushed: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    block_scale_range: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    gradient_underflow_share: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def add(self, step: int, rows: list[list[float]]) -> None:
        """Append one sampled step: a row of :data:`MEASURES` per module, in module order (the
        measures after ``gradient_max`` may be left off: NaN)."""
        self.steps.append(step)
        for name, row in zip(self.modules, rows, strict=True):
            row = list(row) + [_NAN] * (len(MEASURES) - len(row))
            for measure, value in zip(MEASURES, row, strict=True):
                getattr(self, measure).setdefault(name, []).append(float(value))

    def headroom(self, module: str) -> float:
        """How many times the module's largest finite activation fits under the limit (worst
        sampled step)."""
        largest = _worst(self.activation_max.get(module, []))
        return self.limit / largest if largest > 0 else float("inf")

    def __str__(self) -> str:
        from mpnb._render import text_table

        if not self.steps:  # a short, clean fit: a table of headers would say nothing
            return (
                f"no step sampled yet: the watch samples every {DEFAULT_EVERY}th optimizer step by "
                "default, and each step after a skipped step or a non-finite loss; "
                "Trainer(..., watch_numerics=1) samples every step"
            )

        def nearest_trouble(name: str) -> tuple[bool, float]:
            return (_worst(self.nonfinite.get(name, [])) == 0, self.headroom(name))

        rows = []
        for name in sorted(self.ran, key=nearest_trouble):
            rows.append(
                [
                    name,
                    _activation_cell(
                        _worst(self.activation_max.get(name, [])),
                        _worst(self.nonfinite.get(name, [])),
                    ),
                    _headroom_cell(self.headroom(name), _worst(self.nonfinite.get(name, []))),
                    f"{_worst(self.gradient_max.get(name, [])):.2g}",
                    f"{_worst(self.underflow_share.get(name, [])):.0%}",
                    f"{int(_worst(self.nonfinite.get(name, [])))}",
                    *(self._fp8_cells(name) if self.fp8_modules else []),
                    *(self._block_cells(name) if self.block_modules else []),
                ]
            )
        headers = (
            "module",
            "largest |activation|",
            "headroom",
            "largest |gradient|",
            "fp16-underflow share",
            "non-finite",
            *(
                (
                    "fp8 input amax",
                    "fp8 saturated (input / weight)",
                    "fp8 flushed (input / weight)",
                    "fp8 gradient flushed",
                )
                if self.fp8_modules
                else ()
            ),
            *(("block-scale range",) if self.block_modules else ()),
        )
        table = text_table(headers, rows)
        never = self.never_ran
        if never and self.steps:  # before the first sampled step no module has run yet
            table += (
                f"\nnot called as modules on a sampled step, so not measured: {', '.join(never)}"
            )
        return table

    @property
    def ran(self) -> list[str]:
        """The watched modules called as modules on at least one sampled step."""
        return [name for name in self.modules if _measured(self.activation_max.get(name, []))]

    @property
    def never_ran(self) -> list[str]:
        """The watched modules no sampled step called as a module: their owner uses their
        weights directly (``nn.MultiheadAttention``'s ``out_proj``), or they were not on the
        path; they have nothing to show."""
        return [name for name in self.modules if name not in self.ran]

    @property
    def fp8_modules(self) -> list[str]:
        """The watched modules that ran as low-precision layers (modes fp8 and mxfp8) on a
        sampled step."""
        return [name for name in self.modules if _measured(self.fp8_amax.get(name, []))]

    @property
    def block_modules(self) -> list[str]:
        """The watched modules that ran as block-scaled layers (mode mxfp8) on a sampled step."""
        return [name for name in self.modules if _measured(self.block_scale_range.get(name, []))]

    def _block_cells(self, name: str) -> list[str]:
        if name not in self.block_modules:
            return ["-"]
        return [f"2^{_worst(self.block_scale_range[name]):.0f}"]

    def _fp8_cells(self, name: str) -> list[str]:
        if name not in self.fp8_modules:
            return ["-", "-", "-", "-"]

        def pair(inputs: dict[str, list[float]], weights: dict[str, list[float]]) -> str:
            return f"{_worst(inputs[name]):.2%} / {_worst(weights.get(name, [])):.2%}"

        return [
            f"{_worst(self.fp8_amax[name]):.2g}",
            pair(self.fp8_saturated, self.fp8_weight_saturated),
            pair(self.fp8_flushed, self.fp8_weight_flushed),
            f"{_worst(self.fp8_grad_flushed.get(name, [])):.2%}",
        ]

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def figure(self) -> Any:
        """A heatmap: module x sampled step, the colour the headroom to the limit (needs the
        notebook extras)."""
        return views.view("numerics_figure")(self)


def _activation_cell(largest: float, nonfinite: float) -> str:
    """``"6e+04"``; ``"inf"`` for a module that made an inf; ``"nan"`` when it made only NaN."""
    return "nan" if nonfinite and largest == 0 else f"{largest:.2g}"


def _headroom_cell(headroom: float, nonfinite: float) -> str:
    """``"1.09x"``; ``"none"`` for a module that made inf/NaN (its finite values may be small)."""
    return "none" if nonfinite else f"{headroom:.3g}x"


def _measured(values: list[float]) -> bool:
    return any(value == value for value in values)


def _worst(values: list[float]) -> float:
    """The largest of the values measured (NaN: the module did not run that step)."""
    return max((value for value in values if value == value), default=0.0)


class ModuleMeasures:
    """The per-module measuring engine: hooks ``names`` of ``model`` for one pass (a forward and
    its backward) and reduces each output, and the gradient that flows back into it, on the
    device to a row of :data:`MEASURES`. The watch runs it on sampled steps of a fit,
    :func:`~mpnb.numerics.advisor.advise` on its one batch. Nothing is read to the host here.

    What a sampled step costs is the number of small device ops a module: each output is
    reduced in one pass to four numbers (its largest magnitude, its non-finite values, its
    values fp16 would lose and its nonzero ones, stacked into one vector), each gradient to
    three, and :meth:`stop` makes the rows of every module at once (the shares divided, the
    gradient unscaled, modules that did not run left NaN) in a few ops for the whole model.
    The low-precision layers' cast measures run only for the layers a mode swapped in.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> measures = ModuleMeasures(model, ["0", "1"])
        >>> measures.start()
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> rows = measures.stop()
        >>> rows.shape  # a row a module
        torch.Size([2, 12])
        >>> dict(zip(MEASURES, rows[0].tolist()))["gradient_max"]
        1.0
    """

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        self.names = list(names)
        self._index = {name: index for index, name in enumerate(self.names)}
        self._probe = ModuleProbe(model, self.names, self._measure, self._gradient)
        self._outputs: dict[str, torch.Tensor] = {}  # a module's 4 output numbers
        self._gradients: dict[str, torch.Tensor] = {}  # its output gradient's 3
        self._layers: dict[str, list[torch.Tensor]] = {}  # a low-precision layer's 7
        self._swapped: dict[str, tuple[nn.Module, Any]] = {}  # that layer, and its LayerSwap
        self._scale: torch.Tensor | float = 1.0

    @property
    def attached(self) -> bool:
        """A pass is being measured (the hooks are on)."""
        return self._probe.attached

    def start(self, scale: torch.Tensor | float = 1.0) -> None:
        """Hook the modules for a pass whose backward runs at loss scale ``scale``."""
        self._scale = scale
        self._outputs, self._gradients, self._layers, self._swapped = {}, {}, {}, {}
        self._probe.attach()  # by name: mode fp8 puts torchao's layers in their place

    def stop(self) -> torch.Tensor | None:
        """Take the hooks off; the pass's rows stacked, one a module in :attr:`names` order
        (NaN for a module that did not run), on the device; None when no module ran."""
        self._probe.detach()
        if not self._outputs:
            return None
        ran = list(self._outputs)
        device = self._outputs[ran[0]].device
        count = len(self.names)
        outputs = torch.full((count, 4), _NAN, device=device)
        outputs[[self._index[name] for name in ran]] = torch.stack(list(self._outputs.values()))
        gradients = torch.full((count, 3), _NAN, device=device)
        gradients[[self._index[name] for name in ran]] = 0.0  # ran, no gradient: nothing lost
        if self._gradients:
            at = [self._index[name] for name in self._gradients]
            gradients[at] = torch.stack(list(self._gradients.values()))
        layers = torch.full((count, len(_LAYER_MEASURES)), _NAN, device=device)
        if self._layers:
            at = [self._index[name] for name in self._layers]
            layers[at] = torch.stack([torch.stack(v).float() for v in self._layers.values()])
        return torch.cat(
            (
                outputs[:, :2],
                (outputs[:, 2] / outputs[:, 3].clamp(min=1)).unsqueeze(1),
                (gradients[:, 0] / self._scale).unsqueeze(1),
                layers,
                (gradients[:, 1] / gradients[:, 2].clamp(min=1)).unsqueeze(1),
            ),
            dim=1,
        )

    def detach(self) -> None:
        """Take every hook off, dropping the pass. Safe to call twice."""
        self._probe.detach()

    def _measure(self, name: str, module: nn.Module, inputs: Any, out: torch.Tensor) -> None:
        """A watched module's output, reduced on the device to four numbers: its largest
        magnitude (an inf is its largest, NaN left out), how many values are not finite, how
        many nonzero values fp16 loses, how many are nonzero (inf and NaN count as nonzero
        values that did not underflow)."""
        magnitude = out.abs()  # in its own dtype: fp16's threshold is exact in bf16 and fp32
        lost, nonzero = underflow_counts(magnitude)  # counts: the cheap reduction on a CPU
        measured = torch.stack(
            (
                magnitude.nan_to_num(nan=0.0, posinf=math.inf).amax().float(),
                (magnitude.numel() - torch.count_nonzero(magnitude < math.inf)).float(),  # inf, NaN
                lost.float(),
                nonzero.float(),
            )
        )
        self._outputs[name] = _with_earlier_calls(self._outputs.get(name), measured)
        layers = swapped_layers_of(module)
        if layers is not None:  # its gradient's cast is measured when the gradient comes
            self._layers[name] = _layer_measures(layers, module, inputs, out.device)
            self._swapped[name] = (module, layers)

    def _gradient(self, name: str, grad: torch.Tensor) -> None:
        """The gradient of that output, reduced to three numbers: its largest finite magnitude
        (scaled: :meth:`stop` divides by the loss scale), how many nonzero values fp16 loses as
        the backward carries them, how many are nonzero; for a low-precision layer, the share
        of its values that flush to zero in the gradient's format (a share no loss scale
        changes: the cast scales by the gradient's own amax)."""
        magnitude = grad.detach().abs()
        lost, nonzero = underflow_counts(magnitude)
        measured = torch.stack(
            (magnitude.nan_to_num(0.0, 0.0, 0.0).amax().float(), lost.float(), nonzero.float())
        )
        self._gradients[name] = _with_earlier_calls(self._gradients.get(name), measured)
        swapped = self._swapped.get(name)
        if swapped is not None:  # the layer and its format, as its output's hook found them
            module, layers = swapped
            self._layers[name][_GRAD_FLUSHED] = layers.cast_measures(module, grad, "grad_output")[2]


def _with_earlier_calls(earlier: torch.Tensor | None, measured: torch.Tensor) -> torch.Tensor:
    """A module's measures over its calls in the pass (a module called twice, as a shared
    block is): the largest magnitude of them all (the first entry), the counts summed.

    >>> _with_earlier_calls(torch.tensor([4e5, 0.0, 1.0]), torch.tensor([4e-3, 0.0, 2.0])).tolist()
    [400000.0, 0.0, 3.0]
    """
    if earlier is None:
        return measured
    return torch.cat((torch.maximum(earlier[:1], measured[:1]), earlier[1:] + measured[1:]))


class NumericsWatch(Instrument):
    """Measures ``model``'s watched modules on sampled steps (:class:`ModuleMeasures`): an
    instrument that reads what they measured when the telemetry flushes (see the module's
    docstring)."""

    def __init__(self, model: nn.Module, every: int) -> None:
        self.every = self.check_every(every)
        self.model = model
        self.log = NumericsLog(leaf_names(model))
        self._measures = ModuleMeasures(model, self.log.modules)
        self._run: WatchedRun | None = None
        self._dense_until = 0  # sample every step up to this one: a flush showed trouble
        self._rows_seen = 0  # the history's rows looked at for trouble
        self._pending: list[tuple[int, torch.Tensor]] = []

    @classmethod
    def interval(cls, watch_numerics: object) -> int | None:
        """The sampling interval a ``watch_numerics`` option asks for; None (off) for None or
        False. Raises as :meth:`check_every` does."""
        if watch_numerics is None or watch_numerics is False:
            return None
        return cls.check_every(watch_numerics)

    @staticmethod
    def check_every(every: object) -> int:
        """``every`` as a sampling interval; True: :data:`DEFAULT_EVERY`.

        Raises:
            MpnbError: it is not True or a whole number of steps >= 1.
        """
        if every is True:
            return DEFAULT_EVERY
        number = plain_number(every, whole=True)  # a numpy integer too, as every count
        if number is None or number < 1:
            raise MpnbError(
                f"watch_numerics must be True or a whole number of steps >= 1, got {quoted(every)}"
            )
        return number  # type: ignore[return-value]

    def begin(self, run: WatchedRun) -> None:
        self._run = run

    def next_watched_step(self, step: int) -> int | float:
        """The step being sampled, else the next one to sample: a multiple of ``every``, or
        each step while sampling densely."""
        if self._measures.attached or step <= self._dense_until:
            return step
        return step + (-step % self.every)

    def before_forward(self, step: int, first: bool) -> None:
        """Optimizer step ``step`` is about to train: hook the modules if it is sampled (every
        ``every`` steps, and each step for :data:`DENSE_STEPS` after a flush showed trouble)."""
        if not first:
            return
        self._measures.detach()
        if step % self.every and step > self._dense_until:
            return
        self._measures.start(self._run.loss_scale() if self._run is not None else 1.0)

    def step_end(self, step: int) -> None:
        """The sampled step ended: stack its rows (on the device) for the next flush."""
        if not self._measures.attached:
            return
        rows = self._measures.stop()
        if rows is not None:
            self._pending.append((step, rows))

    def detach(self) -> None:
        """Take every hook off (a fit's end, an error)."""
        self._measures.detach()

    def update(self, history: History) -> None:
        """The telemetry flushed: read the pending sampled steps in one copy, and sample densely
        from here when a new row shows a skipped step or a non-finite loss."""
        fresh, self._rows_seen = self._rows_seen, len(history)
        if history.first_trouble(fresh) is not None:
            self._dense_until = history.step[-1] + DENSE_STEPS
            if self._run is not None:
                self._run.reschedule()
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        values = torch.stack([rows.float() for _, rows in pending]).cpu().tolist()
        for (step, _), rows in zip(pending, values, strict=True):
            self.log.add(step, rows)

    def close(self, history: History) -> None:
        self.detach()
        self.update(history)


def _layer_measures(
    layers: Any, module: nn.Module, inputs: Any, device: torch.device
) -> list[torch.Tensor]:
    """A low-precision layer's measures (:data:`_LAYER_MEASURES`, the layer's
    :meth:`~mpnb.precision.modes.layer_swap.LayerSwap.cast_measures`): its input's amax, the
    shares of its input's and of its weight's values that saturate or flush in its format, the
    gradient's share (NaN until its hook runs), and the input's block-scale range."""
    first = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
    nan = torch.full((), _NAN, device=device)
    if first is None:
        return [nan] * len(_LAYER_MEASURES)
    amax, saturated, flushed, octaves = layers.cast_measures(module, first, "input")
    _, weight_saturated, weight_flushed, _ = layers.cast_measures(module, module.weight, "weight")
    return [
        amax,
        saturated,
        flushed,
        weight_saturated.to(device),
        weight_flushed.to(device),
        nan,  # the gradient's, set by its hook if it runs
        octaves.to(device),
    ]
