"""A layer's three matmuls, measured in each number format: what :func:`~mpnb.numerics.whatif.whatif`
records as each layer's gradient arrives.

For a linear layer (``nn.Linear``, transformers' ``Conv1D``) the matmuls are ``forward`` (the
input times the weight), ``input_grad`` (the output's gradient times the weight) and
``weight_grad`` (the output's gradient times the input); each operand is cast by
:mod:`mpnb.numerics.formats` (once per format, or once per axis where the format's scales follow
the axis the matmul sums over), the two are multiplied, and the product is compared with fp32's.
A convolution's three are its output and the gradients of its input and weight, through the
module's own convolution, in fp16 and bf16 only.

Example:
    >>> import torch
    >>> layer = torch.nn.Linear(32, 8)
    >>> measured = LayerMatmuls(["bf16", "fp8"])
    >>> measured.layer("fc", layer, torch.randn(16, 32), torch.randn(16, 8))
    >>> [(row["matmul"], row["format"]) for row in measured.table()][:3]
    [('forward', 'bf16'), ('forward', 'fp8'), ('input_grad', 'bf16')]
    >>> measured.table()[0]["rel_error"] < 0.01
    True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import nn

from mpnb.errors import MpnbError
from mpnb.numerics import formats as fmt
from mpnb.precision.modes.matmul_format import MatmulFormat
from mpnb.precision.modes.registry import find_format, format_mode

__all__: list[str] = []

#: The three matmuls of a layer's training step, in the order of the tables.
MATMULS = ("forward", "input_grad", "weight_grad")
_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def multiplies(module: nn.Module) -> bool:
    """A layer with a weight it multiplies by: Linear, a convolution, transformers' ``Conv1D``
    (a Linear whose weight is stored transposed, known by its name and its ``nf`` width)."""
    if isinstance(module, nn.Linear) or isinstance(module, _CONVOLUTIONS):
        return True
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and hasattr(module, "nf")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
    )


def shown_layer(name: str) -> str:
    """A layer's name as the tables show it: the model itself (a model that is one layer,
    named ``''`` as ``named_modules`` and ``keep`` name it) reads "(the model)".

    >>> shown_layer("fc1"), shown_layer("")
    ('fc1', '(the model)')
    """
    return name or "(the model)"


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The weight of a linear layer as ``nn.Linear`` holds it: (out features, in features).

    >>> linear_weight(torch.nn.Linear(3, 2)).shape
    torch.Size([2, 3])
    """
    weight = module.weight.detach()
    return weight if isinstance(module, nn.Linear) else weight.t()


#: A linear layer's three matmuls from its input ``x`` (tokens x in features), its ``weight``
#: (out x in) and its output's ``gradient`` (tokens x out): each matmul's two operands (which
#: tensor, and its axis the matmul sums over) and how they multiply.
LINEAR_MATMULS: dict[str, tuple[tuple[str, int], tuple[str, int], Callable]] = {
    "forward": (("x", 1), ("weight", 1), lambda x, weight: x @ weight.t()),
    "input_grad": (("gradient", 1), ("weight", 0), lambda gradient, weight: gradient @ weight),
    "weight_grad": (("gradient", 0), ("x", 0), lambda gradient, x: gradient.t() @ x),
}
_ROLES = {"x": "activation", "weight": "weight", "gradient": "gradient"}


class LayerMatmuls:
    """The figures of each (layer, matmul, format), the worst kept where a layer runs twice."""

    def __init__(self, formats: Sequence[str]) -> None:
        self.formats = formats
        self._found = {name: find_format(name) for name in formats}
        self._modes = {name: format_mode(name) for name in formats}
        self.rows: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._references: dict[str, torch.Tensor] = {}
        self._called: dict[str, int] = {}
        #: each fp32 product's norm, by the product's id, for the layer call being measured
        self._norms: dict[int, float] = {}

    def applies(self, module: nn.Module) -> bool:
        """Whether one of the formats applies to ``module`` (:meth:`formats_for`).

        >>> LayerMatmuls(["mxfp8"]).applies(torch.nn.Conv2d(1, 1, 3)), LayerMatmuls(["bf16"]).applies(torch.nn.Conv2d(1, 1, 3))
        (False, True)
        """
        return bool(self.formats_for(module))

    def formats_for(self, module: nn.Module) -> list[str]:
        """The formats that apply to ``module``: a dtype format to every layer that multiplies;
        a scaled one to the linear layers its mode casts when it trains (fp8's float8 layers
        replace ``nn.Linear`` alone, not transformers' ``Conv1D``).

        >>> measured = LayerMatmuls(["bf16", "fp8", "mxfp8"])
        >>> measured.formats_for(torch.nn.Linear(4, 4)), measured.formats_for(torch.nn.Conv2d(1, 1, 3))
        (['bf16', 'fp8', 'mxfp8'], ['bf16'])
        """
        return [
            name
            for name in self.formats
            if self._found[name].any_operation
            or (not isinstance(module, _CONVOLUTIONS) and self._modes[name].casts_layer(module))
        ]

    def layer(
        self,
        name: str,
        module: nn.Module,
        x: torch.Tensor,
        gradient: torch.Tensor | None,
        matmuls: Collection[str] = MATMULS,
    ) -> None:
        """Measure a call of layer ``name`` on input ``x`` whose output's gradient is
        ``gradient``: ``matmuls``, those its training step runs (the forward only without a
        gradient: a frozen layer, a call under no_grad, whose forward autocast still runs in
        the format). Autocast is off here whatever the caller's thread holds: the products are
        fp32's and the formats' own."""
        if gradient is None:
            matmuls = ("forward",)
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            gradient = None if gradient is None else gradient.float()
            formats = self.formats_for(module)
            if isinstance(module, _CONVOLUTIONS):
                self._convolution(name, module, x.float(), gradient, (formats, matmuls))
            else:
                weight = linear_weight(module).float()
                x = x.float().reshape(-1, weight.shape[1])
                if gradient is not None:
                    gradient = gradient.reshape(-1, weight.shape[0])
                self._linear(name, (x, weight, gradient), formats, matmuls)

    def _linear(
        self,
        name: str,
        operands: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
        formats: list[str],
        chosen: Collection[str],
    ) -> None:
        x, weight, gradient = operands
        matmuls = {matmul: LINEAR_MATMULS[matmul] for matmul in MATMULS if matmul in chosen}
        given = {"x": x, "weight": weight, "gradient": gradient}
        tensors = {
            key: given[key]
            for left, right, _ in matmuls.values()
            for key, _ in (left, right)
            if given[key] is not None
        }
        zeros = {key: fmt.zeros_in(t) for key, t in tensors.items()}
        for format_name in formats:
            casts: dict[tuple[str, int | None], fmt.Operand] = {}
            for matmul, (left, right, multiply) in matmuls.items():
                a, b = (
                    _cast_once(casts, self._found[format_name], tensors[key], key, axis, zeros[key])
                    for key, axis in (left, right)
                )
                operands = ((a.values, a.factor), (b.values, b.factor))
                product = self._found[format_name].product(multiply, *operands)
                reference = self._reference(matmul, multiply, tensors[left[0]], tensors[right[0]])
                self._add(name, matmul, format_name, product, reference, (a, b))
        self._references.clear()
        self._norms.clear()

    def _norm(self, reference: torch.Tensor) -> float:
        if id(reference) not in self._norms:
            self._norms[id(reference)] = frobenius(reference)
        return self._norms[id(reference)]

    def _reference(
        self, matmul: str, multiply: Callable, a: torch.Tensor, b: torch.Tensor
    ) -> torch.Tensor:
        """The matmul in fp32, once per layer call."""
        if matmul not in self._references:
            self._references[matmul] = multiply(a, b)
        return self._references[matmul]

    def _convolution(
        self,
        name: str,
        module: nn.Module,
        x: torch.Tensor,
        gradient: torch.Tensor | None,
        measured: tuple[list[str], Collection[str]],
    ) -> None:
        """The formats of ``measured`` (those that apply) for its matmuls of a convolution."""
        formats, chosen = measured
        weight = module.weight.detach().float()
        reference = _convolution_products(module, x, weight, gradient)
        parts = [("x", x, "activation"), ("weight", weight, "weight")]
        if gradient is not None:
            parts.append(("gradient", gradient, "gradient"))
        for format_name in formats:
            cast = {
                part: fmt.cast(format_name, tensor, role, dim=1) for part, tensor, role in parts
            }
            products = _convolution_products(
                module,
                cast["x"].read_back(),
                cast["weight"].read_back(),
                cast["gradient"].read_back() if gradient is not None else None,
            )
            operands = {"forward": (cast["x"], cast["weight"])}
            if gradient is not None:
                operands["input_grad"] = (cast["gradient"], cast["weight"])
                operands["weight_grad"] = (cast["gradient"], cast["x"])
            for matmul in (m for m in operands if m in chosen):
                product = products[matmul].to(self._found[format_name].written).float()
                self._add(name, matmul, format_name, product, reference[matmul], operands[matmul])
        self._norms.clear()

    def _add(
        self,
        layer: str,
        matmul: str,
        format_name: str,
        product: torch.Tensor,
        reference: torch.Tensor,
        operands: tuple[fmt.Operand, fmt.Operand],
    ) -> None:
        norm = self._norm(reference)
        scaled = [o for o in operands if o.nonzero] or operands  # zeros have no scale
        if not math.isfinite(norm):
            raise MpnbError(
                f"layer {layer!r}: its {matmul} product is not finite in fp32 (inf or NaN in its "
                "input, weight or output's gradient): the what-if measures each format against "
                "fp32, which must be finite; find where the values first go past it with "
                "torch.isfinite on the batch and the weights"
            )
        row = {
            "layer": layer,
            "matmul": matmul,
            "format": format_name,
            "rel_error": relative_error(product, reference, norm, in_place=True),
            "overflow": sum(o.overflow for o in operands) / sum(o.elements for o in operands),
            "underflow": sum(o.flushed for o in operands)
            / max(1, sum(o.nonzero for o in operands)),
            "scale_range": (
                min(o.scales[0] for o in scaled),
                max(o.scales[1] for o in scaled),
            ),
        }
        key = (layer, matmul, format_name)
        seen = self.rows.get(key)
        if seen is not None:  # a layer called twice: its worst call
            row = {
                **row,
                **{k: max(row[k], seen[k]) for k in ("rel_error", "overflow", "underflow")},
                "scale_range": (
                    min(row["scale_range"][0], seen["scale_range"][0]),
                    max(row["scale_range"][1], seen["scale_range"][1]),
                ),
            }
        self.rows[key] = row

    def called(self, name: str) -> None:
        """Layer ``name`` ran in the forward pass: the tables list the layers in that order."""
        self._called.setdefault(name, len(self._called))

    def table(self) -> list[dict[str, Any]]:
        """The rows in forward order of the layers (as :meth:`called` saw them; else backwards
        from the order the gradients arrived)."""
        order = dict(self._called)
        for layer, _, _ in reversed(list(self.rows)):
            order.setdefault(layer, len(order))
        return sorted(
            self.rows.values(),
            key=lambda row: (
                order[row["layer"]],
                MATMULS.index(row["matmul"]),
                self.formats.index(row["format"]),
            ),
        )


def _cast_once(
    casts: dict[tuple[str, int | None], fmt.Operand],
    matmul_format: MatmulFormat,
    tensor: torch.Tensor,
    key: str,
    axis: int,
    zeros: int,
) -> fmt.Operand:
    """``tensor`` (``key``) in the format, cast once, or once per axis where the format's
    scales follow the axis the matmul sums over, its values in the dtype its products multiply
    them in (:meth:`~mpnb.precision.modes.matmul_format.MatmulFormat.multiplicand`)."""
    along = axis if matmul_format.follows_axis else None
    if (key, along) not in casts:
        operand = fmt.cast(matmul_format.name, tensor, _ROLES[key], dim=axis, zeros=zeros)
        values = matmul_format.multiplicand(operand.values, operand.factor)
        casts[key, along] = dataclasses.replace(operand, values=values)
    return casts[key, along]


def _convolution_products(
    module: nn.Module, x: torch.Tensor, weight: torch.Tensor, gradient: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """A convolution's three products: its output (no bias) and, from ``gradient``, the
    gradients of its input and weight, through the module's own convolution (its padding mode
    included); its output only without a gradient."""
    if gradient is None:
        return {"forward": module._conv_forward(x, weight, None)}
    x = x.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    with torch.enable_grad():
        out = module._conv_forward(x, weight, None)
        input_grad, weight_grad = torch.autograd.grad(out, (x, weight), gradient)
    return {"forward": out.detach(), "input_grad": input_grad, "weight_grad": weight_grad}


def relative_error(
    value: torch.Tensor,
    reference: torch.Tensor,
    reference_norm: float | None = None,
    *,
    in_place: bool = False,
) -> float:
    """``||value - reference|| / ||reference||`` (Frobenius); inf when ``value`` is not all
    finite, 0 when both are zero. ``reference_norm``: ``||reference||``, when known;
    ``in_place``: ``value`` may be overwritten with the difference (a product no one reads
    again: one tensor fewer to allocate).

    >>> round(relative_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0])), 6)
    0.707107
    """
    difference = value.sub_(reference) if in_place else value - reference
    error = frobenius(difference)
    if not math.isfinite(error):
        return math.inf
    scale = frobenius(reference) if reference_norm is None else reference_norm
    return error / scale if scale else (0.0 if error == 0 else math.inf)


#: Below this float32 norm, squares that flushed to zero may have been a part of the sum.
_SMALL_NORM = 1e-10


def frobenius(tensor: torch.Tensor) -> float:
    """``tensor``'s Frobenius norm, in float64 where float32's sum of squares cannot hold it:
    small values (squares below ~1e-38 flush, and a norm of 1e-23 read 0 or wrong) or some
    above ~1e19 (their squares overflow: inf, read as an overflow of the format).

    >>> tuple(f"{frobenius(torch.full((4,), v)):.3g}" for v in (1e-23, 1e20, 0.0))
    ('2e-23', '2e+20', '0')
    """
    norm = float(tensor.norm())
    if norm < _SMALL_NORM or (math.isinf(norm) and bool(torch.isfinite(tensor).all())):
        norm = float(torch.linalg.vector_norm(tensor, dtype=torch.float64))
    return norm
