"""One instrument for looking inside a model's modules during a forward and backward pass.

A :class:`ModuleProbe` puts a forward hook on each chosen module; each call hands the module's
first floating-point output (the first such tensor of a tuple, a dict, a model output) to a
callback and, through a hook on that tensor, the gradient that flows back into it. What the
callbacks do with them is theirs: the numerics watch (:mod:`mpnb.numerics.watch`)
reduces them on the device to a few numbers a module; the advisor
(:mod:`mpnb.numerics.advisor`) keeps copies to compare precisions. The hooks are on only
inside the probe's ``with`` block (or between :meth:`ModuleProbe.attach` and
:meth:`ModuleProbe.detach`).

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> seen = {}
    >>> probe = ModuleProbe(model, leaf_names(model),
    ...                     on_output=lambda name, module, inputs, out: seen.setdefault(name, out.shape),
    ...                     on_gradient=lambda name, grad: seen.setdefault(name + " grad", grad.shape))
    >>> with probe:
    ...     model(torch.ones(2, 4)).sum().backward()
    >>> sorted(seen)
    ['0', '0 grad', '1', '1 grad']
    >>> model._forward_hooks  # gone after the block
    OrderedDict()
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

__all__: list[str] = []

#: ``on_output(name, module, inputs, output)``: a watched module returned ``output``. It may
#: return a function of this call's own gradient: called with it when it arrives, or with None
#: at once where the output needs none (a frozen layer, a call under no_grad).
OnOutput = Callable[
    [str, nn.Module, Any, torch.Tensor], "Callable[[torch.Tensor | None], None] | None"
]
#: ``on_gradient(name, gradient)``: the gradient of that output arrived in the backward.
OnGradient = Callable[[str, torch.Tensor], None]


def leaf_names(model: nn.Module, *, with_root: bool = False) -> list[str]:
    """The qualified names of ``model``'s modules without children, in registration order (the
    root itself when it has none and ``with_root``).

    >>> leaf_names(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU())))
    ['0', '1.0']
    """
    return [
        name
        for name, module in model.named_modules()
        if (name or with_root) and not any(True for _ in module.children())
    ]


def first_float_tensor(output: Any) -> torch.Tensor | None:
    """The first non-empty floating-point tensor in ``output`` (a tensor, a tuple, a dict...)."""
    for leaf in pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.numel():
            return leaf
    return None


def uncompiled(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile``'d model wraps (the same weights, its layers under their
    own names, as a mode's ``keep`` takes them), or ``model`` itself.

    >>> model = torch.nn.Linear(2, 2)
    >>> uncompiled(torch.compile(model)) is model, uncompiled(model) is model
    (True, True)
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # loaded once anything compiled
    if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        return model._orig_mod
    return model


class ModuleProbe:
    """Forward hooks on ``model``'s modules ``names`` (looked up when attached, so a module
    swapped in since, such as mode fp8's float8 layer, is the one watched).

    Args:
        model: the model the names are in.
        names: qualified module names (see :func:`leaf_names`).
        on_output: called with each watched call's first floating-point output, detached; it
            may return a function that takes this call's own gradient (see ``OnOutput``).
        on_gradient: called with that output's gradient, when it requires one (unless
            on_output returned a function for the call).
    """

    def __init__(
        self,
        model: nn.Module,
        names: Sequence[str],
        on_output: OnOutput,
        on_gradient: OnGradient | None = None,
    ) -> None:
        self.model, self.names = model, list(names)
        self.on_output, self.on_gradient = on_output, on_gradient
        self._handles: list[Any] = []

    @property
    def attached(self) -> bool:
        """The hooks are on."""
        return bool(self._handles)

    def attach(self) -> None:
        """Put the hooks on (again: any left on are taken off first)."""
        self.detach()
        for name in self.names:
            module = self.model.get_submodule(name)
            self._handles.append(module.register_forward_hook(self._hook(name)))

    def detach(self) -> None:
        """Take every hook off. Safe to call twice."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> ModuleProbe:
        self.attach()
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def _hook(self, name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            tensor = first_float_tensor(output)
            if tensor is None:
                return
            this_call = self.on_output(name, module, inputs, tensor.detach())
            if callable(this_call):  # this call's own gradient, not the name's
                if tensor.requires_grad:
                    tensor.register_hook(_reading(this_call))
                else:
                    this_call(None)
            elif self.on_gradient is not None and tensor.requires_grad:
                tensor.register_hook(_reading(functools.partial(self.on_gradient, name)))

        return hook


def _reading(receive: Callable[[torch.Tensor], object]) -> Callable[[torch.Tensor], None]:
    """A tensor hook that hands the gradient to ``receive`` and returns None, whatever
    ``receive`` returns: the gradient flows on unchanged."""

    def hook(grad: torch.Tensor) -> None:
        receive(grad)

    return hook
