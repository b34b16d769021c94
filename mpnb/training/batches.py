"""Batches as people have them: move any nesting to the device, count its samples, get its loss.

Containers torch's pytree knows (dicts, lists, tuples, named tuples) are walked by
``torch.utils._pytree``; two more kinds are opened here: mappings that are not dicts (a
Hugging Face ``BatchEncoding`` moves itself with its own ``.to``; others are rebuilt as their
type) and dataclasses (rebuilt with ``dataclasses.replace``).

How a batch becomes a loss (:func:`batch_loss`):

- ``step_fn(model, batch)``: whatever the caller's function returns;
- ``loss_fn`` given: the batch is an ``(inputs, targets)`` pair, ``loss_fn(model(inputs), targets)``;
- neither: the model computes its own loss (Hugging Face style). A mapping is passed as
  keyword arguments, a tuple or list as positional ones, anything else as the one argument;
  the loss is ``output.loss``, ``output["loss"]``, or the output itself when it is a scalar.

Example:
    >>> batch = {"input_ids": torch.zeros(4, 7, dtype=torch.long), "labels": [torch.ones(4)]}
    >>> moved = to_device(batch, torch.device("cpu"))
    >>> sorted(moved), samples_in(moved)
    (['input_ids', 'labels'], 4)
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from mpnb.errors import MpnbError

__all__: list[str] = []

StepFn = Callable[[nn.Module, Any], torch.Tensor]
LossFn = Callable[[Any, Any], torch.Tensor]


def _opened(leaf: Any) -> Any:
    """A pytree leaf that still holds tensors, as a dict of its parts; None for a true leaf."""
    if isinstance(leaf, Mapping):
        return dict(leaf)
    if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
        return {
            field.name: getattr(leaf, field.name)
            for field in dataclasses.fields(leaf)
            if field.init
        }
    return None


def indexed(device: torch.device) -> torch.device:
    """``device`` as its tensors name it: an accelerator with its index (``cuda`` is the current
    CUDA device, ``cuda:0``), so that a batch already there is recognised by a comparison.
    Devices without a current index (``cpu``, ``meta``, ``lazy``) are returned as they are.

    >>> indexed(torch.device("cpu")), indexed(torch.device("meta"))
    (device(type='cpu'), device(type='meta'))
    """
    if device.index is not None or device.type in ("cpu", "meta"):
        return device
    try:
        return torch.device(device.type, torch.get_device_module(device.type).current_device())
    # no device module (lazy), torch built without it
    except (
        RuntimeError,
        AttributeError,
        TypeError,
        AssertionError,
    ):
        return device


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor on ``device`` (non-blocking copies), its structure unchanged.
    A batch whose tensors are all on ``device`` comes back as it is, without a call into torch per
    tensor (pass an :func:`indexed` device: ``cuda:0`` and not ``cuda``, as the tensors name it).

    >>> batch = (torch.zeros(2), torch.ones(2))
    >>> to_device(batch, torch.device("cpu")) is batch  # the usual case, already there: as it is
    True
    """
    # the usual case: every part a plain tensor already there, as it is
    if isinstance(batch, (tuple, list)):
        for part in batch:
            # subclasses (DTensor) take the full path
            if type(part) is not torch.Tensor or part.device != device:
                break
        else:
            return batch

    def moved_mapping(mapping: Mapping[Any, Any]) -> Any:
        mover = getattr(mapping, "to", None)  # a BatchEncoding moves itself
        return mover(device) if callable(mover) else None

    return map_tensors(batch, lambda tensor: tensor.to(device, non_blocking=True), moved_mapping)


def map_tensors(
    batch: Any,
    change: Callable[[torch.Tensor], torch.Tensor],
    mapping_change: Callable[[Mapping[Any, Any]], Any] | None = None,
) -> Any:
    """``batch`` with ``change(tensor)`` in place of each of its tensors, at any depth, in the
    containers described in the module's docstring; its structure and other leaves unchanged.
    ``mapping_change(mapping)`` may handle a non-dict mapping itself (None: rebuild it).

    >>> map_tensors({"ids": torch.zeros(2), "n": 3}, lambda t: t + 1)
    {'ids': tensor([1., 1.]), 'n': 3}
    """

    def changed(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return change(leaf)
        parts = _opened(leaf)
        if parts is None:
            return leaf
        if isinstance(leaf, Mapping):
            handled = mapping_change(leaf) if mapping_change is not None else None
            if handled is not None:
                return handled
            return type(leaf)(map_tensors(parts, change, mapping_change))
        return dataclasses.replace(leaf, **map_tensors(parts, change, mapping_change))

    return pytree.tree_map(changed, batch)


def with_batch_size(batch: Any, size: int) -> Any:
    """``batch`` grown (or cut) to ``size`` samples: every tensor whose first dimension is the
    batch's sample count is repeated along it (memory depends on shapes, not values); other
    tensors and leaves are kept. Any batch a :class:`~mpnb.Trainer` accepts works.

    >>> batch = {"input_ids": torch.arange(6).view(2, 3), "labels": torch.tensor([0, 1])}
    >>> grown = with_batch_size(batch, 5)
    >>> grown["input_ids"].shape, grown["labels"].tolist()
    (torch.Size([5, 3]), [0, 1, 0, 1, 0])

    Raises:
        MpnbError: the batch holds no tensor with a first dimension to grow.
    """
    samples = samples_in(batch)
    if not samples:
        raise MpnbError(
            f"cannot resize a batch without a tensor of samples: got {describe_batch(batch)}"
        )

    def grow(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0 or tensor.shape[0] != samples:
            return tensor
        repeats = -(-size // samples)
        # a copy of the slice: the slice alone would keep the whole repeated storage
        return tensor.repeat(repeats, *([1] * (tensor.dim() - 1)))[:size].clone()

    return map_tensors(batch, grow)


def tensors_in(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor of ``batch``, at any depth.

    >>> [tuple(t.shape) for t in tensors_in({"x": torch.zeros(2, 3), "y": [torch.zeros(2)]})]
    [(2, 3), (2,)]
    """
    for leaf in pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            yield leaf
        elif (parts := _opened(leaf)) is not None:
            yield from tensors_in(parts)


def samples_in(batch: Any) -> int | None:
    """The leading dimension of the batch's first tensor (None without a tensor of one).

    >>> samples_in((torch.zeros(8, 3), torch.zeros(8))), samples_in({"ids": torch.zeros(4, 5)}), samples_in([1, 2])
    (8, 4, None)
    """
    # the common shapes first, without flattening the whole batch (once per step)
    if isinstance(batch, (tuple, list)):
        first = batch[0] if batch else None
    elif isinstance(batch, dict) and batch:
        first = next(iter(batch.values()))
    else:
        first = batch
    if not isinstance(first, torch.Tensor):
        first = next(tensors_in(batch), None)
    if first is None:
        return None
    shape = first.shape
    return shape[0] if shape else None


def check_loss_fn(loss_fn: object, *, takes_step_fn: bool = True) -> None:
    """Refuse a ``loss_fn`` that is not a function of ``(outputs, targets)`` (None: the model
    returns its own loss), naming what was given; ``takes_step_fn``: whether the caller takes a
    ``step_fn`` to offer instead (as :func:`batch_loss`).

    >>> check_loss_fn(torch.nn.CrossEntropyLoss)
    Traceback (most recent call last):
    ...
    mpnb.errors.MpnbError: loss_fn got the class CrossEntropyLoss, not a loss: pass an instance, CrossEntropyLoss()
    """
    if isinstance(loss_fn, type):  # callable, but calling it makes a module, or fails inside
        raise MpnbError(
            f"loss_fn got the class {loss_fn.__name__}, not a loss: pass an instance, "
            f"{loss_fn.__name__}()"
        )
    if isinstance(loss_fn, torch.optim.Optimizer):
        raise MpnbError(
            f"loss_fn got an optimizer ({type(loss_fn).__name__}): the arguments go "
            "Trainer(model, optimizer, loss_fn)"
        )
    if loss_fn is not None and not callable(loss_fn):
        shown = " ".join(repr(loss_fn).split())  # one line: a module's repr spans many
        raise MpnbError(
            "loss_fn takes a function, loss_fn(outputs, targets) -> a scalar loss, or None for a "
            f"model that returns its own loss; got {type(loss_fn).__name__} "
            f"{shown[:60]}{'...' if len(shown) > 60 else ''}"
        )
    if loss_fn is not None:
        _check_takes_two(loss_fn, takes_step_fn)


def _check_takes_two(loss_fn: Callable[..., Any], takes_step_fn: bool) -> None:
    """Refuse a ``loss_fn`` whose signature cannot take ``(outputs, targets)`` (one argument
    only, or three required), before a step meets Python's own error; one with no signature to
    read (a builtin) is taken as it is."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None, None)
    except TypeError:
        name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
        or_step_fn = (
            ", or step_fn=f(model, batch) -> loss for another layout" if takes_step_fn else ""
        )
        raise MpnbError(
            f"loss_fn is called loss_fn(outputs, targets) -> a scalar loss, and {name}{signature} "
            f"cannot take those two: give it both (the targets are the batch's second part), or "
            f"leave loss_fn out for a model that returns its own loss{or_step_fn}"
        ) from None


def batch_loss(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None,
    step_fn: StepFn | None,
    *,
    takes_step_fn: bool = True,
) -> torch.Tensor:
    """The loss of one batch, by the rules in the module's docstring.

    Args:
        takes_step_fn: whether the caller takes a ``step_fn`` (the what-if does not): an
            error's advice offers one only where it can be given.

    Raises:
        MpnbError: a batch or an output that the chosen rule cannot use, saying what to pass.
    """
    if step_fn is not None:
        return step_fn(model, batch)
    if loss_fn is not None:
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            or_step_fn = " or step_fn=f(model, batch) -> loss" if takes_step_fn else ""
            # fit((x, y)) iterates the pair: its batches are x, then y
            one_batch = (
                "; fit takes an iterable of batches: for one batch, fit([(x, y)])"
                if takes_step_fn and isinstance(batch, torch.Tensor)
                else ""
            )
            raise MpnbError(
                f"with a loss_fn, each batch must be an (inputs, targets) pair, got {describe_batch(batch)}; "
                f"leave loss_fn out for a model that computes its own loss{or_step_fn}{one_batch}"
            )
        inputs, targets = batch
        return loss_fn(model(inputs), targets)
    or_step_fn = " or step_fn=f(model, batch) -> loss" if takes_step_fn else ""
    args, kwargs = _arguments_of(batch)
    try:
        output = model(*args, **kwargs)
    except TypeError as error:
        refusal = _unbindable(model, batch, args, kwargs, or_step_fn)
        if refusal is None:  # the forward took the batch; the error is its own
            _note_positional(error, args)
            raise
        raise MpnbError(refusal) from error
    except Exception as error:
        _note_positional(error, args)
        raise
    return _loss_of(output, or_step_fn)


def _note_positional(error: BaseException, args: Sequence[Any]) -> None:
    """Say under a forward's own error, where the batch went in as several positional
    arguments, that it did: an ``(inputs, labels)`` pair handed to a transformers model lands
    its labels in the forward's second parameter (``past_key_values``), and the error raised
    deep inside names neither."""
    if len(args) > 1 and hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(
            f"mpnb: with no loss_fn, a tuple batch goes to the model as {len(args)} positional "
            "arguments, model(*batch); give loss_fn=f(outputs, targets) for (inputs, targets) "
            "pairs, or batches as dicts of keyword arguments ({'input_ids': ..., 'labels': ...})"
        )


def _arguments_of(batch: Any) -> tuple[Sequence[Any], Mapping[str, Any]]:
    """How a batch is handed to a model that computes its own loss: a mapping as keywords, a
    tuple or list as positional arguments, anything else as the one argument (the batch's own
    containers, not copies: this runs every step)."""
    if isinstance(batch, Mapping):
        return (), batch
    if isinstance(batch, (tuple, list)):
        return batch, {}
    return (batch,), {}


def _unbindable(
    model: nn.Module, batch: Any, args: Sequence[Any], kwargs: Mapping[str, Any], or_step_fn: str
) -> str | None:
    """Why ``model``'s forward cannot take the batch's arguments, or None where it can (asked
    after a TypeError only: nothing a step); ``or_step_fn``: the advice's other way, if any."""
    try:
        inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as mismatch:
        return (
            f"{type(model).__name__}.forward cannot take {describe_batch(batch)} as its arguments "
            f"({mismatch}); for (inputs, targets) batches pass loss_fn=f(outputs, targets)"
            f"{or_step_fn}"
        )
    except ValueError:  # no signature to read (a C-level forward)
        return None
    return None


def _loss_of(output: Any, or_step_fn: str) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    if not isinstance(loss, torch.Tensor):
        raise MpnbError(
            f"the model returned {describe_batch(output)} with no loss (no .loss, no ['loss'], not a 0-dim tensor); "
            f"give the batch its labels, or pass loss_fn=f(outputs, targets){or_step_fn}"
        )
    return loss


def describe_batch(value: Any) -> str:
    """A batch in a few words, for an error: its type and size or keys.

    >>> describe_batch((torch.zeros(2), torch.zeros(2))), describe_batch({"ids": torch.zeros(2)})
    ('a tuple of 2', "a dict with keys ['ids']")
    """
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {sorted(map(str, value))[:8]}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def epochs_holding(data: Any, batches_needed: int) -> int | None:
    """Epochs of ``data`` that hold ``batches_needed`` batches (a short dataset cycled, as compare
    and a what-if's proof train it); None where its length is unknown.

    >>> epochs_holding([1, 2, 3], 7), epochs_holding(iter([1]), 7)
    (3, None)
    """
    try:
        length = len(data)
    except TypeError:  # a generator, a DataLoader over an IterableDataset
        return None
    return math.ceil(batches_needed / length) if length else None


def is_data(value: Any) -> bool:
    """Whether ``value`` is a source of batches rather than one batch: a DataLoader, a Dataset,
    an iterator, or another iterable that is no container a batch is made of (tensors, tuples,
    lists, mappings, dataclasses, strings).

    >>> is_data(torch.utils.data.DataLoader(range(4))), is_data(iter([1])), is_data((torch.zeros(2),))
    (True, True, False)
    """
    if isinstance(value, (torch.Tensor, tuple, list, Mapping, str, bytes)):
        return False
    if dataclasses.is_dataclass(value):
        return False
    return isinstance(value, (Iterator, torch.utils.data.Dataset)) or hasattr(value, "__iter__")


def check_real_batch(batch: Any, paired: bool, who: str) -> None:
    """Refuse a batch ``who``'s fp32 pass (the what-if's, the advisor's) cannot run on, saying
    why, before it is moved: a tensor with no data (on the meta device), an input of floating
    point in another dtype than float32 (the model runs in float32: torch would refuse the
    mismatch inside a layer; read where the batch is an ``(inputs, targets)`` pair, whose
    targets go to the loss alone: a float64 target from numpy is fine), or no sample (a tensor
    with no row: nothing to measure, and the message the pass meets is about its layers).

    >>> check_real_batch((torch.zeros(2, 3, device="meta"), torch.zeros(2)), True, "advise")
    Traceback (most recent call last):
    ...
    mpnb.errors.MpnbError: the batch holds a tensor on the meta device (shaped (2, 3)), which has no data: advise measures one real pass; give it a batch of real tensors
    """
    if is_data(batch):
        raise MpnbError(
            f"{who} takes one batch, not the data ({describe_batch(batch)}): "
            "batch = next(iter(data)) gives its first"
        )
    pair = paired and isinstance(batch, (tuple, list)) and len(batch) == 2
    inputs = {id(t) for t in tensors_in(batch[0])} if pair else set()
    for tensor in tensors_in(batch):
        shape = tuple(tensor.shape)
        if tensor.is_meta:
            raise MpnbError(
                f"the batch holds a tensor on the meta device (shaped {shape}), which has no "
                f"data: {who} measures one real pass; give it a batch of real tensors"
            )
        if id(tensor) in inputs and tensor.is_floating_point() and tensor.dtype != torch.float32:
            raise MpnbError(
                f"the batch's inputs hold a {str(tensor.dtype).removeprefix('torch.')} tensor (shaped "
                f"{shape}): {who} runs the model in float32, the reference it measures against; "
                "give it float32 inputs (x.float())"
            )
        if tensor.dim() and not len(tensor):
            raise MpnbError(
                f"the batch holds no sample (a tensor shaped {shape}): {who} measures one pass "
                "on at least one"
            )
