"""What if: which number format can each layer of a model take, before a run.

:func:`whatif` runs one forward and backward pass in fp32 on a batch, through the probe's hooks
(:mod:`mpnb.numerics.probe`). For every layer that multiplies by a weight (``nn.Linear``, the
``nn.Conv*`` layers, transformers' ``Conv1D``) it takes the three matmuls of its training step:

- ``forward``: the input times the weight;
- ``input_grad``: the output's gradient times the weight (the gradient the layer hands back);
- ``weight_grad``: the output's gradient times the input (the weight's gradient),

and, for each format (:mod:`mpnb.numerics.formats`: fp16, bf16, fp8, fp8_rowwise, mxfp8,
nvfp4), casts both operands, multiplies them and measures what the format did: the relative
error of the product against fp32 (Frobenius norms), the share of the operands' elements past
the format's largest value (overflow or saturation), the share of their nonzero elements
flushed to zero, and the range of the scales. The scaled formats apply to the linear layers
only, as torchao's training layers do; a convolution is measured in fp16 and bf16.

A layer's three matmuls are measured (:mod:`mpnb.numerics.layer_matmuls`) as its output's
gradient arrives in the backward pass, with the input the pass saved anyway, and let go: beyond
the step, one layer's tensors at a time.

:meth:`WhatIf.recommend` names the layers to keep in higher precision for a format: those where
any matmul passes the format's :class:`Threshold`. The default thresholds
(:func:`default_thresholds`, each declared by the format's mode) sit a few times above what each format does to well-behaved tensors (normal values, measured):
a layer past one is a layer whose values the format cannot hold, not one that merely rounds.
fp16's and bf16's flush to zero is left out: on gradients it is loss scaling's work (see
:func:`~mpnb.numerics.advisor.advise`), not a reason to keep a layer.

Example:
    >>> import torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    >>> batch = (torch.randn(32, 64), torch.randint(0, 2, (32,)))
    >>> result = whatif(model, batch, torch.nn.functional.cross_entropy, formats=["fp16", "nvfp4"])
    >>> len(result.rows), sorted(result.rows[0])  # layer 0, fed the batch: no input_grad
    (10, ['format', 'layer', 'matmul', 'overflow', 'rel_error', 'scale_range', 'underflow'])
    >>> result.recommend("fp16")
    []
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from mpnb import views
from mpnb._render import html_table, text_table
from mpnb.errors import MAKE_RUN_USAGE, MpnbError, check_function
from mpnb.numerics import formats as fmt
from mpnb.numerics.advisor import left_as_found
from mpnb.numerics.format_proof import Proof, prove
from mpnb.numerics.layer_matmuls import LayerMatmuls, multiplies, shown_layer
from mpnb.numerics.probe import ModuleProbe, uncompiled
from mpnb.precision.backends import backend_for
from mpnb.precision.fp32math import exact_fp32_math
from mpnb.precision.modes.layer_swap import swapped_layers_of
from mpnb.precision.modes.matmul_format import Threshold
from mpnb.precision.modes.registry import find_format, format_mode, matmul_formats
from mpnb.training.batches import (
    batch_loss,
    check_loss_fn,
    check_real_batch,
    map_tensors,
    to_device,
)
from mpnb.training.gradients import check_loss

__all__ = ["WhatIf", "Threshold", "whatif"]


def default_thresholds() -> dict[str, Threshold]:
    """Each format's default threshold, as its mode declares it
    (:class:`~mpnb.precision.modes.matmul_format.MatmulFormat`: each sits a few times above
    what the format does to ordinary tensors: past one, a layer holds values the format cannot,
    not values it merely rounds).

    >>> default_thresholds()["fp16"]
    Threshold(rel_error=0.01, overflow=0.0, underflow=None)
    """
    return {name: found.threshold for name, found in matmul_formats().items()}


def whatif(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    formats: Iterable[str] | None = None,
) -> WhatIf:
    """Measure, layer by layer, what each number format would do to this model's matmuls.

    Args:
        model: left as found: weights, buffers, gradients, train/eval flags, random state.
        batch: one batch, as the Trainer takes it: ``(inputs, targets)`` with a ``loss_fn``;
            without one, what the model takes to compute its own loss (a dict of keyword
            arguments, a tuple of positional ones, or one tensor).
        loss_fn: ``loss_fn(outputs, targets) -> scalar``; None for a model that returns its loss.
        formats: names from :func:`~mpnb.numerics.formats.format_names` (default: all of them).

    Returns:
        A :class:`WhatIf`: its rows, tables, figure and advice.

    Raises:
        InvalidChoiceError: an unknown format (the valid ones are named).
        MpnbError: the model has no layer a format applies to, or the pass measured none.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        >>> batch = (torch.randn(16, 32), torch.randn(16, 4))
        >>> result = whatif(model, batch, torch.nn.functional.mse_loss, formats=["bf16", "mxfp8"])
        >>> result.layers, result.formats
        (['0', '2'], ('bf16', 'mxfp8'))
        >>> whatif(model, batch, torch.nn.functional.mse_loss, formats=["int4"])
        Traceback (most recent call last):
        ...
        mpnb.errors.InvalidChoiceError: unknown format 'int4'; valid: fp16, bf16, fp8, fp8_rowwise, mxfp8, nvfp4
    """
    if not isinstance(model, nn.Module):
        raise MpnbError(
            f"whatif takes the model (a torch.nn.Module) first, then its batch; got a "
            f"{type(model).__name__} as the model"
        )
    model = uncompiled(model)
    if callable(batch) and not isinstance(batch, (torch.Tensor, nn.Module)) and loss_fn is not None:
        raise MpnbError(
            f"whatif got a function as the batch ({getattr(batch, '__name__', type(batch).__name__)}): "
            "the arguments go whatif(model, batch, loss_fn)"
        )
    check_loss_fn(loss_fn, takes_step_fn=False)
    chosen, skipped = _castable(fmt.chosen_formats(formats), asked=formats is not None)
    layers = {name: module for name, module in model.named_modules() if multiplies(module)}
    _check_held_in_fp32(model, layers)
    # a layer with no weight element (a zero-width head) makes no product to measure
    layers = {name: module for name, module in layers.items() if _weight_elements(module)}
    if not layers:
        raise MpnbError(
            f"{type(model).__name__} has no layer a format applies to: what-if measures "
            "nn.Linear, nn.Conv1d/2d/3d and transformers' Conv1D"
        )
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    measured = LayerMatmuls(chosen)
    if not any(measured.applies(module) for module in layers.values()):
        everywhere = [name for name, found in matmul_formats().items() if found.any_operation]
        kinds = sorted({type(module).__name__ for module in layers.values()})
        raise MpnbError(
            f"{', '.join(chosen)} apply to none of {type(model).__name__}'s layers that multiply "
            f"({', '.join(kinds)}), a kind their modes' layers do not replace; measure them in "
            f"{', '.join(everywhere)}"
        )
    #: the calls whose gradient has not come yet: (layer, its input, the matmuls training runs)
    waiting: dict[int, tuple[str, torch.Tensor, tuple[str, ...]]] = {}
    unreadable: dict[str, None] = {}  # the layers called with no positional tensor input
    numbering = itertools.count()
    loss_backward = False  # the gradients measured are the loss's, arriving in its backward

    def on_output(name: str, module: nn.Module, inputs: Any, output: torch.Tensor) -> Any:
        if not inputs or not isinstance(inputs[0], torch.Tensor):
            unreadable.setdefault(name)  # its input given as a keyword: the hook sees none
            return None
        measured.called(name)
        call = next(numbering)
        waiting[call] = (name, inputs[0].detach(), _matmuls_trained(module, inputs[0]))

        def on_gradient(gradient: torch.Tensor | None) -> None:  # None: none will come
            if gradient is not None and not loss_backward:
                return  # taken inside the forward or the loss (torch.autograd.grad)
            if call not in waiting:
                return  # measured already: a second gradient within the loss's backward
            layer, x, matmuls = waiting.pop(call)
            gradient = None if gradient is None else gradient.detach()
            measured.layer(layer, layers[layer], x, gradient, matmuls)  # no gradient: forward

        return on_gradient

    # the pass needs gradients, wherever it is called from (a no_grad or inference block)
    # and the fp32 reference in exact fp32 math (not the TF32 or oneDNN bf16 a session may hold)
    with (
        left_as_found(model, device),
        exact_fp32_math(backend_for(device)),
        # compiled modules run no hooks added after they were traced: eagerly, for the pass
        _eagerly(),
        torch.inference_mode(False),
        torch.enable_grad(),
    ):
        model.zero_grad(set_to_none=True)
        # autocast off for the whole pass, the backward too (a session in %amp bf16 runs each
        # cell under autocast), where the layers' matmuls are measured
        with (
            ModuleProbe(model, list(layers), on_output),
            torch.autocast(device.type, enabled=False),
        ):
            check_real_batch(batch, loss_fn is not None, "the what-if")
            batch = _trainable(to_device(batch, device))
            loss = batch_loss(model, batch, loss_fn, None, takes_step_fn=False)
            check_loss(loss)
            if not bool(torch.isfinite(loss.detach())):
                raise MpnbError(
                    f"the loss is {float(loss.detach()):g}: the pass is not finite in fp32 itself, and the "
                    "what-if measures each format against fp32; look for NaN or inf in the batch "
                    "and the weights (torch.isfinite)"
                )
            loss_backward = True
            # as a training step runs it; a gradient it leaves outside the model (a batch that
            # needs one, a loss's own parameter) is put back as found, the model's are below
            with _grads_kept(_leaves_of(loss)):
                loss.float().backward()
            # a call whose output needed a gradient that never came (detached after it, a
            # side pass): its forward still ran in the format
            for layer, x, _ in list(waiting.values()):
                measured.layer(layer, layers[layer], x, None)
    if not measured.rows and unreadable:
        raise MpnbError(
            f"the pass called {', '.join(map(shown_layer, unreadable))} with no input tensor "
            "as the first positional argument (given as a keyword, input=x): the what-if reads "
            "a layer's input from it; call the layers as layer(x)"
        )
    if not measured.rows:
        raise MpnbError(
            "the pass reached none of the model's linear layers with a gradient: is the loss "
            "computed from the model's output, and does it need a gradient?"
        )
    rows = measured.table()
    reached = {row["layer"] for row in rows}
    unmeasured = [
        name for name, module in layers.items() if name not in reached and measured.applies(module)
    ]
    unconverted = {name: format_mode(name).converts_none_of(model) for name in chosen}
    return WhatIf(rows, chosen, unmeasured, skipped, {k: v for k, v in unconverted.items() if v})


def _leaves_of(loss: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a backward from ``loss`` accumulates a gradient into (its graph's leaves
    that need one), found by walking the graph."""
    leaves, seen = [], set()
    nodes = [loss.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        nodes.extend(following for following, _ in node.next_functions)
    return leaves


@contextlib.contextmanager
def _grads_kept(leaves: list[torch.Tensor]) -> Iterator[None]:
    """Inside, each of ``leaves`` starts with no gradient; on leaving, the gradient it had is
    put back, the same tensor, unchanged (a backward adds into an existing one in place)."""
    held = [(leaf, leaf.grad) for leaf in leaves]
    for leaf, _ in held:
        leaf.grad = None
    try:
        yield
    finally:
        for leaf, grad in held:
            leaf.grad = grad


def _castable(chosen: tuple[str, ...], asked: bool) -> tuple[tuple[str, ...], dict[str, str]]:
    """The formats of ``chosen`` whose casts run on this machine, and why each other does not.
    Formats asked for by name must all run; of the default ones, those that cannot are left
    out (and said under the tables)."""
    why = {name: find_format(name).why_unavailable() for name in fmt.format_names()}
    skipped = {name: why[name] for name in chosen if why[name]}
    kept = tuple(name for name in chosen if name not in skipped)
    if skipped and (asked or not kept):
        running = [name for name, reason in why.items() if not reason]
        raise MpnbError(
            "; ".join(f"format {name} {why}" for name, why in skipped.items())
            + f" (formats that run here: {', '.join(running) or 'none'})"
        )
    return kept, skipped


def _eagerly() -> contextlib.AbstractContextManager[Any]:
    """Compiled code run eagerly while the block runs (``torch.compiler.set_stance``, torch
    2.6 on; before it, as it is: its compiled modules run no hooks and are named unmeasured)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def _trainable(batch: Any) -> Any:
    """``batch`` with each tensor made under ``torch.inference_mode`` copied to a plain one
    (autograd cannot save an inference tensor for the backward); the others as they are."""
    return map_tensors(batch, lambda tensor: tensor.clone() if tensor.is_inference() else tensor)


def _weight_elements(module: nn.Module) -> int:
    """How many elements ``module``'s weight holds, read without computing it: a parametrized
    weight (spectral_norm, weight_norm) is computed at each read, and in train mode
    spectral_norm's power iteration moves its buffers as it is, outside the pass that puts the
    model back as found. Its originals have the elements it is made of.

    >>> normed = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(3, 2))
    >>> _weight_elements(normed), _weight_elements(torch.nn.Linear(0, 2))
    (6, 0)
    """
    if parametrize.is_parametrized(module, "weight"):
        originals = module.parametrizations.weight.named_parameters(recurse=False)
        return min((t.numel() for name, t in originals if name.startswith("original")), default=0)
    return module.weight.numel()


def _check_held_in_fp32(model: nn.Module, layers: dict[str, nn.Module]) -> None:
    """Refuse a model whose weights are held in another dtype than fp32, or whose layers are a
    format's already (swapped by a layer-swapping mode): its pass would not be the fp32
    reference the formats are measured against (its own rounding would read as theirs); and
    one whose weights autograd cannot train (not made yet, or made under inference mode)."""
    for name, module in layers.items():
        swapped = swapped_layers_of(module)
        if swapped is not None:
            raise MpnbError(
                f"layer {name!r} is {swapped.layer_class} already (mode {swapped.mode}): the "
                "what-if measures each format against the fp32 pass of the model's own layers. "
                f"Put its layers back first: `%amp off` (a model held by `%amp {swapped.mode} "
                "--model`), or call it outside the block that converted them"
            )
    for name, parameter in model.named_parameters():
        if isinstance(parameter, nn.parameter.UninitializedParameter):
            raise MpnbError(
                f"the model's weight {name!r} is not made yet (a Lazy layer): run the model once "
                "on a batch, model(inputs), then measure it"
            )
        if parameter.is_inference():
            raise MpnbError(
                f"the model's weight {name!r} was made under torch.inference_mode(), and "
                "autograd cannot train such a tensor: make the model outside that block (or "
                "under torch.no_grad()), then measure it"
            )
        if parameter.is_floating_point() and parameter.dtype != torch.float32:
            raise MpnbError(
                f"the what-if measures each format against fp32, and the model holds "
                f"{parameter.dtype} weights ({name!r}): measure a float32 copy, "
                "whatif(copy.deepcopy(model).float(), batch, ...), with a float32 batch"
            )


def _matmuls_trained(module: nn.Module, x: torch.Tensor) -> tuple[str, ...]:
    """The matmuls a training step runs for a call of ``module`` on ``x`` whose gradient comes:
    its forward; its input's gradient only where ``x`` needs one (a model's first layer, fed
    the batch, hands back nothing: autograd runs no such matmul, and an error it would make
    changes no training); its weight's only where the weight trains (a frozen layer behind a
    trainable one, a LoRA model's base layers, computes none; nor a frozen weight beside a
    trainable bias, as BitFit trains). A parametrized weight (weight_norm) trains by what it
    is made of."""
    parametrized = getattr(module, "parametrizations", {})
    made_of = parametrized["weight"].parameters() if "weight" in parametrized else [module.weight]
    weight_trains = any(parameter.requires_grad for parameter in made_of)
    return (
        "forward",
        *(("input_grad",) if x.requires_grad else ()),
        *(("weight_grad",) if weight_trains else ()),
    )


class WhatIf:
    """What each format would do to each layer's matmuls: the rows, the tables, the figure and
    the advice (:meth:`recommend`, checked by :meth:`prove`).

    Attributes:
        rows: one dict per layer x matmul x format: ``layer``, ``matmul`` (``forward``,
            ``input_grad``, ``weight_grad``), ``format``, ``rel_error``, ``overflow``,
            ``underflow`` (shares, 0 to 1) and ``scale_range`` (smallest, largest scale).
        formats: the formats measured.
        layers: the layers measured, in forward order.
        thresholds: format -> :class:`Threshold`, its own copy of :func:`default_thresholds` to change freely.
        unmeasured: layers a format applies to that the pass never called on an input: their
            weight multiplied by other code (``nn.MultiheadAttention``'s ``out_proj``), their
            input given as a keyword, or not used by this batch.
        unconverted: format -> why its mode would convert no layer of the model (its layers
            kept by the mode's own rules, or of a kind it does not swap): trained in that mode,
            the model would run in bf16 whatever the advice.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        >>> batch = (torch.randn(8, 16), torch.randint(0, 2, (8,)))
        >>> result = whatif(model, batch, torch.nn.functional.cross_entropy, formats=["fp16", "bf16"])
        >>> result.thresholds["bf16"] = Threshold(rel_error=1e-9, overflow=0.0)  # stricter: keep all
        >>> result.recommend("bf16"), result.recommend("fp16")
        (['0', '2'], [])
        >>> print(str(result).splitlines()[0].split())
        ['layer', 'matmul', 'format', 'rel_error', 'overflow', 'underflow', 'scale_range']
    """

    def __init__(
        self,
        rows: list[dict[str, Any]],
        formats: Sequence[str],
        unmeasured: Sequence[str] = (),
        skipped: dict[str, str] | None = None,
        unconverted: dict[str, str] | None = None,
    ) -> None:
        self.rows = rows
        self.formats = tuple(formats)
        self.unmeasured = list(unmeasured)
        self.skipped = dict(skipped or {})
        self.unconverted = dict(unconverted or {})
        self.layers = list(dict.fromkeys(row["layer"] for row in rows))
        self.thresholds = default_thresholds()

    @property
    def thresholds(self) -> dict[str, Threshold]:
        """Format -> :class:`Threshold`: change one (``result.thresholds["fp8"] = Threshold(...)``)
        or set a whole mapping of them."""
        return self._thresholds

    @thresholds.setter
    def thresholds(self, value: Mapping[str, Threshold]) -> None:
        if not isinstance(value, Mapping):
            raise MpnbError(
                f"thresholds takes a mapping of format -> Threshold(rel_error=..., overflow=..., "
                f"underflow=...), got {type(value).__name__}; change one with "
                "result.thresholds[format] = Threshold(...)"
            )
        self._thresholds = dict(value)

    def worst(self, layer: str, format: str) -> dict[str, Any] | None:
        """The row of ``layer``'s matmul that fares worst in ``format`` (past its threshold
        first, then by error); None where the format does not apply to the layer.

        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Conv1d(2, 2, 3))
        >>> batch = (torch.randn(4, 2, 8), torch.randn(4, 2, 6))
        >>> result = whatif(model, batch, torch.nn.functional.mse_loss)
        >>> result.worst("0", "mxfp8") is None, result.worst("0", "bf16")["format"]
        (True, 'bf16')
        """
        format = self._named(format)
        threshold = self.threshold_of(format)
        rows = [r for r in self.rows if r["layer"] == layer and r["format"] == format]
        if threshold is None:  # none set: by error alone
            return max(rows, key=lambda r: r["rel_error"], default=None)
        return max(rows, key=lambda r: (threshold.passed(r), r["rel_error"]), default=None)

    def recommend(self, format: str) -> list[str]:
        """The layers to keep in higher precision for ``format``: those with a matmul past
        ``thresholds[format]``. The list goes as it is into a mode's ``keep`` option
        (``Trainer(mode=mpnb.Mode-or-name, keep=...)``, ``%amp fp8 --keep``) or, for fp16 and
        bf16, into ``Trainer.keep_in_fp32`` one name at a time.

        Raises:
            InvalidChoiceError: an unknown format.
            MpnbError: a format this what-if did not measure.

        Example:
            >>> import torch
            >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8))
            >>> result = whatif(model, (torch.randn(4, 8), torch.randn(4, 8)), torch.nn.functional.mse_loss, ["bf16"])
            >>> result.recommend("bf16")
            []
        """
        format = self._named(format)
        self._measured(format)
        threshold = self._threshold(format)
        return [
            layer
            for layer in self.layers
            if any(
                threshold.passed(r)
                for r in self.rows
                if r["layer"] == layer and r["format"] == format
            )
        ]

    def threshold_of(self, format: str) -> Threshold | None:
        """``thresholds[format]`` where it is set to a :class:`Threshold`, else None (what the
        tables and the figure show: cells without a mark)."""
        threshold = self.thresholds.get(format)
        return threshold if isinstance(threshold, Threshold) else None

    def _threshold(self, format: str) -> Threshold:
        """``thresholds[format]``, or an error that says how to set it."""
        if format in self.thresholds:
            threshold = self.thresholds[format]
            if not isinstance(threshold, Threshold):
                raise MpnbError(
                    f"thresholds[{format!r}] takes a Threshold(rel_error=..., overflow=..., "
                    f"underflow=...), got {threshold!r}"
                )
            return threshold
        if format not in self.formats:
            fmt.check_format(format)  # an unknown format is named as such
        raise MpnbError(
            f"no threshold for format {format!r}: set result.thresholds[{format!r}] = "
            "Threshold(rel_error=..., overflow=..., underflow=...)"
        )

    def _named(self, format: str) -> str:
        """The format ``format`` names, spelt as a mode may be (:func:`~mpnb.numerics.formats.check_format`)."""
        return format if format in self.formats else fmt.check_format(format)

    def _measured(self, format: str) -> None:
        if format in self.formats:  # measured: known, even if its mode was unregistered since
            return
        fmt.check_format(format)  # an unknown format is named as such
        if format in self.skipped:
            raise MpnbError(f"format {format!r} was not measured: it {self.skipped[format]}")
        raise MpnbError(
            f"format {format!r} was not measured; this what-if measured "
            f"{', '.join(self.formats)}: run whatif(..., formats=[{format!r}, ...])"
        )

    def figure(self) -> Any:
        """A heatmap layer x format, each cell the worst matmul's error, cells past the
        format's threshold marked (the UI's ``whatif_figure`` view, plotly)."""
        return views.view("whatif_figure")(self)

    def prove(
        self, make_run: Callable[[Any], Sequence[Any]], format: str, steps: int = 20
    ) -> Proof:
        """Train the recommended configuration for ``format`` beside bf16 for ``steps`` steps
        and report the loss gap: the advice checked on a short run before it is trusted.

        Args:
            make_run: ``make_run(mode) -> (trainer, data)``, a fresh run each call, as
                :func:`mpnb.compare` takes it; called with the recommended mode first (a
                :class:`~mpnb.precision.modes.base.Mode` carrying ``keep`` where the mode has
                that option: hand it to ``Trainer(mode=...)``), then with ``"bf16"``.
            format: a format this what-if measured.
            steps: optimizer steps of each run.

        Returns:
            A :class:`~mpnb.numerics.format_proof.Proof`: both loss curves, the gap, its spread.

        Raises:
            InvalidChoiceError: an unknown format.
            MpnbError: a format not measured, or one this machine cannot train (the mode says
                why: nvfp4 trains on Blackwell GPUs only).

        Example:
            >>> import mpnb.examples as ex, torch
            >>> def make_run(mode):
            ...     trainer, train, _ = ex.example_trainer(mode, "cpu", model="mlp", widths=(16, 16), dashboard=None)
            ...     return trainer, train
            >>> trainer, train = make_run("fp32")
            >>> result = whatif(trainer.model, next(iter(train)), torch.nn.functional.cross_entropy, ["fp16"])
            >>> proof = result.prove(make_run, "fp16", steps=3)
            >>> proof.keep, len(proof.losses), "loss gap" in str(proof)
            ([], 3, True)
        """
        check_function(
            "make_run", make_run, MAKE_RUN_USAGE, "result.prove(make_run, format, steps)"
        )
        format = self._named(format)
        return prove(self.recommend(format), make_run, format, steps)

    def _cells(self, row: dict[str, Any]) -> list[str]:
        low, high = row["scale_range"]
        return [
            shown_layer(row["layer"]),
            row["matmul"],
            row["format"],
            f"{row['rel_error']:.3g}",
            f"{row['overflow']:.3g}",
            f"{row['underflow']:.3g}",
            f"{low:.3g}..{high:.3g}",
        ]

    def __str__(self) -> str:
        headers = ("layer", "matmul", "format", "rel_error", "overflow", "underflow", "scale_range")
        table = text_table(headers, [self._cells(row) for row in self.rows])
        advice = [self._advice(format) for format in self.formats]
        return "\n".join([table, "", *advice, *self._notes()])

    def _notes(self) -> list[str]:
        """What the tables leave out, and why: layers the pass never called, formats whose
        casts cannot run here; and formats whose mode would convert no layer of this model."""
        notes = []
        if self.unmeasured:
            notes.append(
                f"not measured: {', '.join(self.unmeasured)} (the pass never called them on an "
                "input: their weight used by other code, their input given as a keyword, or "
                "not used by this batch)"
            )
        reasons: dict[str, list[str]] = {}
        for name, why in self.skipped.items():
            reasons.setdefault(why, []).append(name)
        notes += [
            f"formats not measured: {', '.join(names)} ({why})" for why, names in reasons.items()
        ]
        trained: dict[str, list[str]] = {}
        for name, why in self.unconverted.items():
            trained.setdefault(why, []).append(name)
        notes += [f"{', '.join(names)}: {why}" for why, names in trained.items()]
        return notes

    def __repr__(self) -> str:
        return (
            f"<mpnb.WhatIf {len(self.layers)} layers x {len(self.formats)} formats; "
            + "; ".join(
                f"{f} keeps {len(self.recommend(f))}"
                if self.threshold_of(f)
                else f"{f} no threshold"
                for f in self.formats
            )
            + ">"
        )

    def _advice(self, format: str) -> str:
        """What the tables say for ``format``: the layers to keep, or that no threshold is set."""
        threshold = self.threshold_of(format)
        if threshold is None:
            return f"{format}: no threshold (set result.thresholds[{format!r}] = Threshold(...))"
        kept = self.recommend(format)
        # where the mode would convert no layer, the advice changes nothing: why, below
        but = "; but no layer of this model would train in it (below)"
        but = but if format in self.unconverted else ""
        if not kept:
            return f"{format}: keep none{but}"
        reasons = []
        for layer in kept:
            row = self.worst(layer, format)
            past = [
                f"{figure} {row[figure]:.3g} > {limit:g}"
                for figure, limit in dataclasses.asdict(threshold).items()
                if limit is not None and row[figure] > limit
            ]
            reasons.append(f"{shown_layer(layer)} ({row['matmul']} {', '.join(past)})")
        return f"{format}: keep {', '.join(reasons)}{but}"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        """Layer x format: the worst matmul's error, its overflow and flush shares; a cell past
        the threshold in bold, with the advice under the table."""
        body = []
        for layer in self.layers:
            cells = [shown_layer(layer)]
            for format_name in self.formats:
                row = self.worst(layer, format_name)
                if row is None:
                    cells.append("-")
                    continue
                text = (
                    f"{row['rel_error']:.2g} ({row['matmul']}; over {row['overflow']:.1%}, "
                    f"flushed {row['underflow']:.1%})"
                )
                threshold = self.threshold_of(format_name)
                cells.append(("KEEP " if threshold and threshold.passed(row) else "") + text)
            body.append(cells)
        advice = "".join(f"<li>{html.escape(self._advice(f))}</li>" for f in self.formats)
        advice += "".join(f"<li>{html.escape(note)}</li>" for note in self._notes())
        return (
            "<b>mpnb what-if: relative error of each layer's worst matmul</b>"
            f"{html_table(('layer', *self.formats), body)}<ul class='mpnb-whatif'>{advice}</ul>"
        )


def whatif_of_fit(trainer: Any, formats: Iterable[str] | None = None) -> WhatIf:
    """:func:`whatif` on a Trainer's model and the last batch its fit took, with its loss
    function: what the panel's "what if" button and ``%whatif TRAINER`` run.

    Raises:
        MpnbError: the trainer has not taken a batch yet, or computes its loss with a
            ``step_fn`` (the what-if needs the model's own forward pass).

    Example:
        >>> import mpnb.examples as ex
        >>> trainer, train, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
        >>> whatif_of_fit(trainer)
        Traceback (most recent call last):
        ...
        mpnb.errors.MpnbError: this trainer has taken no batch yet: fit it for a step first, or call mpnb.whatif(model, batch, loss_fn)
        >>> _ = trainer.fit(train, max_steps=1)
        >>> whatif_of_fit(trainer, ["bf16"]).layers[-1]
        'classifier'
    """
    if trainer.last_batch is None:
        raise MpnbError(
            "this trainer has taken no batch yet: fit it for a step first, or call "
            "mpnb.whatif(model, batch, loss_fn)"
        )
    if trainer.step_fn is not None:
        raise MpnbError(
            "this trainer computes its loss with a step_fn; call mpnb.whatif(model, batch, "
            "loss_fn) with a loss function of the model's output"
        )
    return whatif(trainer.model, trainer.last_batch, trainer.loss_fn, formats)
