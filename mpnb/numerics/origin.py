"""Where a non-finite value first appeared in a training step: the module, the op, forward or
backward, and the value it would have had.

A skipped fp16 step says *that* a gradient overflowed, not *where*. :func:`locate_nonfinite`
replays the step (forward under the step's autocast, backward of the loss times the scale the
step used) with every op watched in execution order: the first op whose inputs are finite and
whose output is not is the origin. The module it ran in comes from torch's own module tracker
(``torch.distributed._tools.mod_tracker.ModTracker``, which follows the module hierarchy in
backward too); for an overflow the op is run again on float32 copies of its inputs to say how
large the value would have been. Each op's check reads a flag back from the device: a replay
is slow, and runs only when asked or at a fit's first skipped step.

A replay changes nothing: the parameters' gradients are dropped afterwards, buffers (a
BatchNorm's running statistics) and the random state are put back as they were, and the random
state of the step is used when given, so dropout repeats. A replay can only find what the step
would do again: the weights must be those of the step (GradScaler skipped its update), and a
step whose weights already hold NaN has nothing left to find (the report says so).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mpnb.training.random_state import RandomState, kept_random_state
from mpnb.training.step_record import Instrument, WatchedRun

__all__ = ["Origin", "locate_nonfinite"]

#: The history event kind of a named origin.
ORIGIN_KIND = "origin"


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where the first non-finite value of a step appeared.

    Attributes:
        module: the innermost module running (its qualified name, the root's class first), or
            ``""`` when it appeared outside every module (the loss function).
        op: the ATen op that made it (``"aten.addmm"``).
        phase: ``"forward"`` or ``"backward"``.
        kind: ``"overflow"`` (an inf from finite inputs), ``"nan"`` (a NaN from finite inputs),
            or ``"input"`` (the op's inputs already held inf/NaN: the weights or the batch).
        dtype: the output's dtype (``"float16"``).
        would_be: the largest magnitude the output has when the op runs in float32 (NaN when
            not an overflow or not computable).
        limit: the largest finite value of ``dtype``.
        producer: where the op is a cast (autocast casting a module's input down), the module
            whose output the values are: they were made there, the cast only found them too
            large (``""``: not a cast, or made outside a module).
        producer_max: the largest magnitude of those values.
        scale: the loss scale the step's backward ran with (1: unscaled, or a forward).

    Example:
        >>> origin = Origin("GPT2.h.1.mlp.c_proj", "aten.mm", "backward", "overflow", "float16", 7.1e4, 65504.0)
        >>> str(origin)
        'float16 overflow first in GPT2.h.1.mlp.c_proj, backward (aten.mm): 7.1e+04 > 65504'
        >>> origin.remedy()
        'trainer.keep_in_fp32("h.1.mlp.c_proj")'
        >>> cast = Origin("Bert.layer.1.intermediate.dense", "aten._to_copy", "forward", "overflow",
        ...               "float16", 1.2e5, 65504.0, "Bert.layer.1.attention.output.LayerNorm", 1.2e5)
        >>> print(cast)
        float16 overflow first in Bert.layer.1.intermediate.dense, forward (aten._to_copy): 1.2e+05 > 65504, in values made by Bert.layer.1.attention.output.LayerNorm (largest 1.2e+05)
        >>> print(cast.remedy())
        train in bf16, or bring the output of layer.1.attention.output.LayerNorm into fp16's range (its weights, a normalization): keeping the module that casts it in fp32 only moves the cast
    """

    module: str
    op: str
    phase: str
    kind: str
    dtype: str
    would_be: float = math.nan
    limit: float = math.nan
    producer: str = ""
    producer_max: float = math.nan
    scale: float = 1.0

    @property
    def scale_alone(self) -> bool:
        """A backward overflow the loss scale alone made: unscaled, the values fit the dtype.
        GradScaler is doing its work: it halves the scale at each skipped step until they fit.

        >>> Origin("", "aten._to_copy", "backward", "overflow", "float16", 2.4e5, 65504.0, scale=2.0**24).scale_alone
        True
        """
        return (
            self.kind == "overflow"
            and self.phase == "backward"
            and self.scale > 1
            and math.isfinite(self.would_be)
            and self.would_be / self.scale <= self.limit
        )

    def __str__(self) -> str:
        where = f"in {self.module}" if self.module else "outside every module (the loss?)"
        if self.kind == "overflow":
            value = (
                f": {self.would_be:.2g} > {self.limit:.0f}" if math.isfinite(self.would_be) else ""
            )
            made = (
                f", in values made by {self.producer} (largest {self.producer_max:.2g})"
                if self.producer
                else ""
            )
            return f"{self.dtype} overflow first {where}, {self.phase} ({self.op}){value}{made}"
        if self.kind == "nan":
            return f"{self.dtype} NaN first {where}, {self.phase} ({self.op})"
        return (
            f"inf/NaN already in the inputs of {self.op} {where}, {self.phase}: "
            "the weights or the batch hold them, so the step cannot show where they began"
        )

    def remedy(self, owner: str = "trainer") -> str:
        """What to call or change, in a phrase: ``trainer.keep_in_fp32("h.1.mlp.c_proj")`` for an
        op that overflowed in a module (``owner``: the object that has ``keep_in_fp32``); for a
        cast of values a producer made, the producer's range or bf16 (fp32 for the consumer only
        moves the cast); in the model's own forward, the whole model; outside every module, the
        loss; for inputs already non-finite, the weights or the batch."""
        if self.kind == "input":
            return "find where the weights or the batch took the inf/NaN (a step before this one)"
        if self.dtype == "float32":  # fp32's own inf/NaN: no module kept in fp32 changes it
            return (
                f"fix the computation: {self.op} makes it in float32 itself (its input is out of "
                "its domain, a log or sqrt of a negative, say), which no precision mode changes"
            )
        if self.scale_alone:
            unscaled = self.would_be / self.scale
            start = 2.0 ** math.floor(math.log2(self.limit / (2 * max(unscaled, 1e-30))))
            return (
                f"none: the loss scale ({self.scale:.0f}) alone takes these gradients past "
                f"{self.dtype}'s range (unscaled they reach {unscaled:.2g}), and GradScaler "
                f"halves it at each skipped step; to skip fewer, start lower (init_scale={start:.0f})"
            )
        if self.producer:
            return (
                f"train in bf16, or bring the output of {_own_name(self.producer)} into "
                f"{'fp16' if self.dtype == 'float16' else self.dtype}'s range (its weights, a "
                "normalization): keeping the module that casts it in fp32 only moves the cast"
            )
        if not self.module:
            return "compute the loss in fp32 (cast the model's output up first), or train in bf16"
        if "." not in self.module:  # an op of the model's own forward, before any loss
            return (
                f'{owner}.keep_in_fp32("") (the whole model: the op is in its own forward), or '
                "train in bf16"
            )
        return f'{owner}.keep_in_fp32("{_own_name(self.module)}")'


def _own_name(qualified: str) -> str:
    """A module's name as its model gives it: ``h.1.mlp`` for ``GPT2.h.1.mlp``."""
    return qualified.partition(".")[2] or qualified


def locate_nonfinite(
    model: nn.Module,
    compute_loss: Callable[[], torch.Tensor],
    *,
    dtype: torch.dtype | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    device_type: str = "cpu",
    scale: float = 1.0,
    random_state: RandomState | None = None,
) -> Origin | None:
    """Replay one step of ``model`` and return where its first inf/NaN appeared (None: the
    step stays finite; its loss too).

    Args:
        model: the model the loss comes from; its modules name the origin.
        compute_loss: runs the forward and returns the loss (as the training step does).
        dtype: autocast's dtype for the forward (None: no autocast).
        autocast: instead of ``dtype``, a function that returns the forward's context (a
            trainer's, with its op lists).
        device_type: the device the step runs on.
        scale: the loss scale the step used (GradScaler's, before its update): the backward
            sees the same magnitudes.
        random_state: the :class:`~mpnb.training.random_state.RandomState` taken before the
            step, so that dropout repeats.

    Example:
        >>> class Planted(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
        ...     def forward(self, x):
        ...         return self.second(torch.log(self.first(x)))  # log of a negative: NaN
        >>> model = Planted()
        >>> with torch.no_grad():
        ...     _ = model.first.bias.fill_(-10.0)
        >>> origin = locate_nonfinite(model, lambda: model(torch.zeros(2, 4)).sum(), dtype=torch.bfloat16)
        >>> origin.module, origin.op, origin.phase, origin.kind
        ('Planted', 'aten.log', 'forward', 'nan')
    """
    if autocast is None:
        autocast = lambda: torch.autocast(device_type, dtype=dtype, enabled=dtype is not None)  # noqa: E731
    with _replay(model, device_type, random_state), _Watch(model) as watch:
        with autocast():
            loss = compute_loss()
        watch.loss_done(loss)
        if watch.origin is None and loss.requires_grad:
            (loss.float() * scale).backward()
            watch.backward_done()
            if watch.origin is not None:  # found in the scaled backward
                return dataclasses.replace(watch.origin, scale=float(scale))
    return watch.origin


@contextlib.contextmanager
def _replay(model: nn.Module, device_type: str, state: RandomState | None) -> Iterator[None]:
    """Run a step that leaves no trace: gradients dropped, buffers and random state restored."""
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    with kept_random_state(device_type):
        if state is not None:
            state.restore()
        try:
            yield
        finally:
            for parameter in model.parameters():
                parameter.grad = None
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)


#: The ops autocast casts with: an overflow there was made by whatever produced their input.
_CASTS = ("aten._to_copy", "aten.to", "aten._autocast_to_reduced_precision")
#: Ops whose output holds whatever the memory held (filled by the next op): never an origin.
_UNINITIALIZED = ("aten.empty", "aten.new_empty", "aten.resize_", "aten.set_")


class _Watch(TorchDispatchMode):
    """Follows a step in execution order and keeps where its first inf/NaN was *made*.

    Two levels. At op level (this dispatch mode): the first op of each module that made a
    non-finite value, and the module running it. At module boundaries (torch's ModTracker
    hooks), in forward: the first module whose inputs are finite and whose output is not (its
    first op names the op). Values that stay inside a module (T5 takes the log of 0 to bucket
    positions, and masks the -inf away) are no origin. In backward the boundaries cannot tell
    modules apart (a ReLU's hook sits on the very tensor the Linear before it in the graph made,
    and fires first; a parameter's gradient crosses no boundary; a parent's own matmul runs
    between its children's hooks), so there the first op that *made* an inf or NaN from finite
    inputs is the origin, in the module running it; a non-finite gradient with no such op was
    made outside every module (the loss's backward), and after the backward a parameter
    gradient gone non-finite names its module.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        from torch.distributed._tools.mod_tracker import ModTracker

        root = type(model).__name__
        self.names = {
            id(module): f"{root}.{name}" if name else root for name, module in model.named_modules()
        }
        self._own = frozenset(self.names.values())  # the tracker names the loss's modules too
        self.tracker = ModTracker()
        self.tracker.register_user_hooks(
            pre_fw_hook=self._before_forward,
            post_fw_hook=self._after_forward,
            pre_bw_hook=self._before_backward,
            post_bw_hook=self._after_backward,
        )
        #: when each module was last entered (a forward began, or its gradient arrived)
        self._entered: dict[str, int] = {}
        self._entries = itertools.count()
        #: modules that returned their input itself (a Dropout of p=0, an Identity): no op of
        #: theirs runs in backward, though the tracker holds them open there
        self._passed_through: set[str] = set()
        self._modules = {id(module): module for module in model.modules()}
        self._made_by: dict[int, tuple[str, Any]] = {}  # a module output's id: (module, ref)
        self.origin: Origin | None = None
        self._findings: list[tuple[str, str, Origin]] = []  # (module, phase, the op's own finding)

    def __enter__(self) -> _Watch:
        self.tracker.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.tracker.__exit__(*exc)

    # -- module boundaries ------------------------------------------------------------------

    def _before_forward(self, module: nn.Module, inputs: Any) -> None:
        self._entered[self.names.get(id(module), "")] = next(self._entries)

    def _after_forward(self, module: nn.Module, inputs: Any, outputs: Any) -> None:
        if self.origin is None and not _finite(outputs) and _finite(inputs):
            self._name(self.names.get(id(module), ""), "forward")
        name = self.names.get(id(module), "")
        given = {id(tensor) for tensor in _floats(inputs)}
        returned = _floats(outputs)
        if returned and all(id(output) in given for output in returned):
            self._passed_through.add(name)
        for output in returned:  # the innermost module that returned it names it
            if id(output) not in self._made_by or self._made_by[id(output)][1]() is not output:
                self._made_by[id(output)] = (name, weakref.ref(output))

    def _before_backward(self, module: nn.Module, grad_outputs: Any) -> None:
        self._entered[self.names.get(id(module), "")] = next(self._entries)
        if self.origin is None and not _finite(grad_outputs):
            self._name_made_in_backward()

    def _after_backward(self, module: nn.Module, grad_inputs: Any) -> None:
        if self.origin is None and not _finite(grad_inputs):
            self._name_made_in_backward()

    def backward_done(self) -> None:
        """The backward finished: an inf/NaN made where no hook saw it (a parameter's gradient
        only) is named by the op that made it, or else by the module whose parameters hold it."""
        if self.origin is not None:
            return
        if any(when == "backward" and f.kind != "input" for _, when, f in self._findings):
            self._name_made_in_backward()
            return
        for module_id, name in self.names.items():
            module = self._modules.get(module_id)
            grads = [p.grad for p in module.parameters(recurse=False)] if module else []
            if not _finite([g for g in grads if g is not None]):
                self.origin = Origin(name, "?", "backward", "overflow", "?")
                return

    def _name_made_in_backward(self) -> None:
        """The first op that made an inf/NaN from finite inputs in backward, in the module that
        ran it; none such: the loss's own backward made it."""
        made = [(where, f) for where, when, f in self._findings if when == "backward"]
        first = next(((where, f) for where, f in made if f.kind != "input"), None)
        if first is None:
            self._name("", "backward")
        else:
            self.origin = dataclasses.replace(first[1], module=first[0], phase="backward")

    def loss_done(self, loss: torch.Tensor) -> None:
        """The forward returned ``loss``: non-finite with every module finite, it was made
        outside every module."""
        if self.origin is None and not _finite(loss):
            self._name("", "forward")

    def _name(self, module: str, phase: str) -> None:
        """The origin is ``module`` (``""``: outside every module): its first op's finding."""
        inside = [
            finding
            for where, when, finding in self._findings
            if when == phase and (where == module or where.startswith(module + ".") or not module)
        ]
        if module == "":
            inside = [
                f for where, when, f in self._findings if when == phase and where == ""
            ] or inside
        found = inside[0] if inside else Origin(module, "?", phase, "overflow", "?")
        self.origin = dataclasses.replace(found, module=module, phase=phase)

    # -- ops --------------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.origin is None and not _op_name(func).startswith(_UNINITIALIZED):
            bad = next((t for t in _floats(out) if not bool(torch.isfinite(t).all())), None)
            if bad is not None:
                module = self._innermost()
                phase = "backward" if self.tracker.is_bw else "forward"
                if not any(where == module and when == phase for where, when, _ in self._findings):
                    self._findings.append((module, phase, self._finding(func, args, kwargs, bad)))
        return out

    def _innermost(self) -> str:
        """The module running now: the deepest of those the tracker holds open, and of two as
        deep the one entered last. In backward a module that returned its input itself (a
        Dropout of p=0 after a Linear) is entered on the very tensor the Linear made, and stays
        open while the Linear's matmul runs: it is passed over. The tracker's set alone would
        name either, by the order of string hashes."""
        # the model's own: a loss that is a module (an nn.Module loss_fn) is outside every one
        modules = [name for name in self.tracker.parents if name in self._own]
        if self.tracker.is_bw:
            modules = [name for name in modules if name not in self._passed_through] or modules
        return max(
            modules, key=lambda name: (name.count("."), self._entered.get(name, -1)), default=""
        )

    def _finding(self, func: Any, args: Any, kwargs: Any, bad: torch.Tensor) -> Origin:
        """What one op did: made an overflow or a NaN from finite inputs, or passed them on."""
        inputs_finite = _finite((args, kwargs))
        has_nan = bool(torch.isnan(bad).any())
        kind = "input" if not inputs_finite else "nan" if has_nan else "overflow"
        would_be = math.nan
        if kind == "overflow" and bad.dtype in (torch.float16, torch.bfloat16):
            would_be = _in_float32(func, args, kwargs)
        producer, producer_max = "", math.nan
        if kind == "overflow" and _op_name(func) in _CASTS and args:
            made = self._made_by.get(id(args[0]))
            if made is not None and made[1]() is args[0]:
                producer, producer_max = made[0], float(args[0].detach().abs().max())
        return Origin(
            module="",
            op=_op_name(func),
            phase="",
            kind=kind,
            dtype=str(bad.dtype).removeprefix("torch."),
            would_be=would_be,
            limit=torch.finfo(bad.dtype).max,
            producer=producer,
            producer_max=producer_max,
        )


def _finite(value: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in _floats(value))


def _floats(value: Any) -> list[torch.Tensor]:
    return [
        leaf
        for leaf in pytree.tree_leaves(value)
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.numel()
    ]


def _in_float32(func: Any, args: Any, kwargs: Any) -> float:
    """The largest magnitude of ``func``'s output computed on float32 copies of its inputs."""

    def up(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
            return value.float()
        if isinstance(value, torch.dtype) and value in (torch.float16, torch.bfloat16):
            return torch.float32
        return value

    try:
        out = func(*pytree.tree_map(up, args), **pytree.tree_map(up, kwargs))
    except Exception:  # an op with no float32 form for these arguments
        return math.nan
    magnitudes = [float(t.abs().max()) for t in _floats(out)]
    return max(magnitudes, default=math.nan)


def _op_name(func: Any) -> str:
    """``aten.addmm`` for ``aten.addmm.default``."""
    name = str(func)
    return name.rsplit(".", 1)[0] if name.count(".") >= 2 else name


class FirstSkipLocator(Instrument):
    """Names the origin of a fit's first skipped fp16 step, right after it.

    GradScaler skips the update of a step whose gradients overflowed, so the weights are still
    the step's, and the trainer still holds its batch: the step is replayed under
    :func:`locate_nonfinite`, with the random state taken before it and the scale it used, and
    the origin is noted on the history (an event of kind ``"origin"``, which dashboards mark and
    offer a remedy for). It is no alarm: a first skip is often GradScaler finding its scale; an
    alarm that follows (a collapsed scale) names it. Only the first skip of each fit is replayed;
    taking the random state costs a few microseconds a micro-batch in fp16, nothing in other modes.

    Example:
        >>> locator = FirstSkipLocator(torch.nn.Linear(2, 2))
        >>> locator.pending
        False
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.pending = False
        self._run: WatchedRun | None = None
        self._state: Any = None

    def begin(self, run: WatchedRun) -> None:
        """A fit begins: watch for its first skip when its mode scales the loss."""
        self._run, self.pending, self._state = run, run.scales_loss, None

    def next_watched_step(self, step: int) -> int | float:
        """Every step until the first skip (its random state is kept), none after."""
        return step if self.pending else math.inf

    def before_forward(self, step: int, first: bool) -> None:
        """A micro-batch is about to train: keep the random state the replay will need."""
        if self.pending and self._run is not None:
            self._state = RandomState.capture(self._run.device.type)

    def step_skipped(
        self,
        step: int,
        scale: torch.Tensor | float,
        compute_loss: Callable[[], torch.Tensor] | None,
    ) -> None:
        """The fit's first skip: replay its last micro-batch and note where it overflowed."""
        run = self._run
        if not self.pending or run is None or compute_loss is None:
            return
        self.pending = False
        try:
            origin = locate_nonfinite(
                self.model,
                compute_loss,
                autocast=run.autocast,
                device_type=run.device.type,
                scale=float(scale),
                random_state=self._state,
            )
        except Exception as error:  # a diagnostic: its failure is said, the fit goes on
            run.history.note(
                f"step {step} skipped; its replay, which names where it overflowed, failed: "
                f"{type(error).__name__}: {error}",
                kind=ORIGIN_KIND,
                step=step,
            )
            return
        if origin is None:
            run.history.note(
                f"step {step} skipped, but its replay stayed finite (a kernel that is not "
                "deterministic, or the window's earlier micro-batches)",
                kind=ORIGIN_KIND,
                step=step,
            )
            return
        note_origin(run.history, step, origin, f"step {step} skipped")
        run.tell_sinks()  # a dashboard offers the remedy before the next step


def note_origin(history: Any, step: int, origin: Origin, what: str, owner: str = "trainer") -> None:
    """Note ``origin`` on ``history`` as an ``"origin"`` event of ``step`` (``what`` happened
    there), with its fields (``kind`` as ``problem``) and its remedy (what ``owner`` is to call)
    for dashboards, text and alarms to read."""
    remedy = origin.remedy(owner)
    history.note(
        f"{what}: {origin}; remedy: {remedy}",
        kind=ORIGIN_KIND,
        step=step,
        origin=str(origin),
        remedy=remedy,
        **{
            ("problem" if name == "kind" else name): value
            for name, value in dataclasses.asdict(origin).items()
        },
    )


class NextStepsLocator(Instrument):
    """Names where trouble began when no step can be replayed (a framework's loop holds its
    batch, not mpnb; a non-finite loss is known only at a flush): the next steps are watched as
    they run.

    When a telemetry flush (this is an instrument, a telemetry sink too) shows a skipped step (with ``on_skips``)
    or a non-finite loss, the next optimizer steps (at most ``tries``) run under the same
    instrument as a replay (:func:`locate_nonfinite`'s, every op checked in execution order:
    slow, on those steps only). The first of them that makes an inf/NaN names the origin, noted
    on the history like a replay's (an ``"input"`` origin says the weights already held it). If
    they all stay finite, a note says so: after a skip, GradScaler lowered the scale and the
    scaled gradients fit again, which places the overflow in the scaled backward, not in the
    model's own values. One origin a run.

    Each :meth:`begin` starts a run afresh: the history's rows before it are not its trouble.
    A step's first micro-batch enters the instrument, the step's end takes it off and notes
    what it found; :meth:`detach` takes it off if a step never finished.

    Args:
        model: the model whose modules name the origin.
        on_skips: arm at a skipped step too (where no replay named it already).
        tries: steps watched after the trouble.
        owner: what the remedy calls ``keep_in_fp32`` on: ``"trainer"`` in mpnb's Trainer,
            ``"callback"`` (mpnb's callback or telemetry) in a framework's loop.

    Example:
        >>> locator = NextStepsLocator(torch.nn.Linear(2, 2))
        >>> locator.armed, locator.done
        (False, False)
    """

    def __init__(
        self, model: nn.Module, *, on_skips: bool = True, tries: int = 3, owner: str = "callback"
    ) -> None:
        self.model, self.owner = model, owner
        self.tries = tries
        self.on_skips = on_skips
        self.done = False
        self._left = 0
        self._rows_seen = 0
        self._trouble = ""  # what armed it: "step 3 skipped", "step 3's loss was nan"
        self._watch: _Watch | None = None
        self._history: Any = None
        self._events_before = 0
        self._reschedule: Callable[[], None] = lambda: None

    def begin(self, run: WatchedRun) -> None:
        """A run begins: one origin to find in it, from its own rows."""
        self.detach()
        self.done, self._left, self._trouble = False, 0, ""
        self._rows_seen, self._history = len(run.history), run.history
        self._events_before = len(run.history.events)
        self._reschedule = run.reschedule

    def next_watched_step(self, step: int) -> int | float:
        """Each step while armed (or watching one), none otherwise."""
        return step if self.armed or self._watch is not None else math.inf

    @property
    def armed(self) -> bool:
        """Trouble was seen: the next steps are watched."""
        return self._left > 0

    def update(self, history: Any) -> None:
        """A flush: arm at the first trouble among the rows it added (once a run)."""
        fresh, self._rows_seen = self._rows_seen, len(history)
        if self.done or self.armed:
            return
        if any(  # a replay of the first skip named it already: one origin a run
            event.get("kind") == ORIGIN_KIND and event.get("module") is not None
            for event in history.events[self._events_before :]
        ):
            self.done = True
            return
        row = history.first_trouble(fresh, skips=self.on_skips)
        if row is None:
            return
        step = history.step[row]
        self._trouble = (
            f"step {step} skipped"
            if self.on_skips and history.skipped[row]
            else f"step {step}'s loss was {history.loss[row]}"
        )
        self._left = self.tries
        self._reschedule()  # the next step is watched

    def before_forward(self, step: int, first: bool) -> None:
        """A step's first micro-batch begins: watched while armed."""
        if first and self.armed and self._watch is None:
            self._watch = _Watch(self.model).__enter__()

    def step_end(self, step: int) -> None:
        """Step ``step``'s forward and backward are done: note its origin, if it made one."""
        if self._watch is None:
            return
        history = self._history
        watch, self._watch = self._watch, None
        watch.__exit__(None, None, None)
        watch.backward_done()
        self._left -= 1
        if watch.origin is not None:
            self.done, self._left = True, 0
            note_origin(
                history,
                step,
                watch.origin,
                f"step {step} (watched after {self._trouble})",
                owner=self.owner,
            )
        elif not self._left:
            self.done = True
            cause = (
                "the overflow was in the scaled gradients, and the lowered scale fits them"
                if "skipped" in self._trouble
                else "the trouble did not come back"
            )
            history.note(
                f"{self._trouble}; the {self.tries} steps watched after it stayed finite: {cause}",
                kind=ORIGIN_KIND,
                step=step,
            )

    def close(self, history: Any = None) -> None:
        """The run ended: the instrument comes off if a step was left open."""
        self.detach()

    def detach(self) -> None:
        """The instrument comes off if a step was left open. Safe to call twice."""
        if self._watch is not None:
            watch, self._watch = self._watch, None
            watch.__exit__(None, None, None)
