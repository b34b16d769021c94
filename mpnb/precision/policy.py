"""The session's precision policy and the context managers that apply it.

One :class:`Session` per process holds the precision mode, the device and the
fp32-math switch. Everything that changes torch's global state goes through a context
manager or the switch, both of which restore exactly what they found.

Example:
    >>> import mpnb, torch
    >>> with mpnb.autocast("bf16", device="cpu"):
    ...     torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype
    torch.bfloat16
    >>> _ = mpnb.set_mode("fp32")
    >>> mpnb.get_mode()
    Mode('fp32')
    >>> _ = mpnb.set_mode("off")
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from mpnb._render import dtype_name
from mpnb.errors import DeviceUnavailableError, InvalidChoiceError, MpnbError, quoted
from mpnb.oplists.lists import OpLists
from mpnb.oplists.session_lists import SessionOpLists
from mpnb.precision.autocast_settings import AutocastSettings, ThreadAutocast, check_autocast_dtype
from mpnb.precision.backends import Backend, backend_for, resolve_device
from mpnb.precision.fp32math import Fp32MathSwitch
from mpnb.precision.modes import Mode, parse_mode
from mpnb.precision.modes.registry import find_mode
from mpnb.precision.names import Fp32Math, parse_dtype

__all__ = ["Session", "set_mode", "get_mode", "set_oplists", "get_oplists"]


#: The mode of the run this thread is in (a fit's), where it is not the session's.
_RUNNING: contextvars.ContextVar[Mode | None] = contextvars.ContextVar("mpnb_running", default=None)


class SessionSnapshot(NamedTuple):
    """What :meth:`Session.snapshot` saves: the session's wishes and the fp32-math flags in force."""

    mode: Mode
    device: torch.device | None
    fp32_wish: tuple[Backend, Fp32Math] | None
    fp32_held: tuple[Backend, Fp32Math] | None


@dataclasses.dataclass
class HeldModel:
    """A model whose layers the session's mode converted (``%amp fp8 --model net``), held so
    until the mode changes.

    Attributes:
        model: the user's model; mode and device: what converted it, where.
        change: what the mode's ``model_scope`` says it did (its ``describe()``).
    """

    model: torch.nn.Module
    mode: Mode
    device: torch.device
    change: Any
    _scope: contextlib.AbstractContextManager[Any]

    @classmethod
    def convert(cls, model: torch.nn.Module, mode: Mode, device: torch.device) -> HeldModel:
        """Convert ``model``'s layers as ``mode`` does; undone by :meth:`release` (or, should the
        conversion fail, before the error goes on)."""
        scope = mode.model_scope(model, device)
        return cls(model, mode, device, scope.__enter__(), scope)

    def describe(self) -> str:
        """What the mode did to the model: ``"fp8 (tensorwise, ...): 1 of 3 Linear layers"``."""
        describe = getattr(self.change, "describe", None)
        return describe() if callable(describe) else self.mode.label

    def layer_lines(self) -> list[str]:
        """Which layers were converted and which kept, with the reason (empty for a change that
        does not say)."""
        lines = getattr(self.change, "layer_lines", None)
        return lines() if callable(lines) else []

    def release(self) -> None:
        """Put the model's layers back as they were."""
        self._scope.__exit__(None, None, None)


class Session:
    """The process's precision policy: mode, device, the fp32-math switch and the op lists.

    Attributes:
        mode: the current precision mode.
        device: the device named by the user, or None to auto-detect each time.
        fp32_math: the switch that owns the reduced-precision fp32 math flags.
        oplists: the op lists enforced wherever autocast is on.
        cell_hooks: True while the IPython extension applies the mode to every cell.
        reset_callbacks: undo functions of other switches (``mpnb.hmp.convert``), run by reset.

    Views (the control panel, a running fit) :meth:`subscribe` to hear of every change.

    Example (the process's session, ``session``, in bf16 for one block):
        >>> heard = []
        >>> unsubscribe = session.subscribe(heard.append)
        >>> with session.mode_scope("bf16", device="cpu") as mode:
        ...     mode, session.autocast_settings().describe()
        (Mode('bf16'), 'bf16 autocast on cpu (no cast cache)')
        >>> session.mode, heard
        (Mode('off'), ['mode', 'mode'])
        >>> unsubscribe()
    """

    def __init__(self) -> None:
        self.mode: Mode = parse_mode("off")
        self.device: torch.device | None = None
        self.fp32_math = Fp32MathSwitch()
        self._fp32_wanted: tuple[Backend, Fp32Math] | None = None
        self.oplists = SessionOpLists(
            hpu_present=lambda: backend_for("hpu").is_available(),
            on_change=lambda: self.notify("oplists"),
        )
        self.cell_hooks = False
        self._outside_cell: ThreadAutocast | None = None  # while a cell scope is open
        self._outside_changed = False
        self.reset_callbacks: list[Callable[[], None]] = []
        self.held: HeldModel | None = None  # a model the mode converted (``%amp fp8 --model``)
        self._listeners: list[Callable[[str], None]] = []

    def subscribe(self, listener: Callable[[str], None]) -> Callable[[], None]:
        """Call ``listener(what)`` after each change; ``what`` is ``"mode"``, ``"fp32_math"``,
        ``"oplists"``, ``"reset"`` or ``"unloaded"``. Returns the function that unsubscribes."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def notify(self, what: str) -> None:
        """Tell every listener that ``what`` changed. A failing listener is reported, not raised:
        the change itself has happened."""
        for listener in list(self._listeners):
            try:
                listener(what)
            except Exception as error:  # a broken view must not undo a switch
                warnings.warn(
                    f"mpnb: a listener failed on {what!r}: {error!r}", RuntimeWarning, stacklevel=2
                )

    def resolved_device(self) -> torch.device:
        """The device the session runs on now."""
        return resolve_device(self.device)

    def set_mode(
        self,
        mode: str | Mode,
        device: str | torch.device | None = None,
        *,
        model: torch.nn.Module | None = None,
        **options: Any,
    ) -> Mode:
        """Switch the session to ``mode`` with its ``options`` (fp8's ``recipe``, ``keep``), on
        ``device`` if given. With ``model``, a mode that converts layers converts that model's now,
        until the mode changes again (:attr:`held` says what it did). A model held before is put
        back first. Invalid input changes nothing: a refused switch leaves the mode, the device,
        the flags and a held model as they were.

        Raises:
            MpnbError: unknown mode, option or device; a device the mode does not run on; a
                model the mode cannot convert.
        """
        new_mode = parse_mode(mode, **options)
        new_device = self.device if device is None else resolve_device(device)
        target = resolve_device(new_device)
        backend = backend_for(target)
        new_mode.check(target)
        if model is not None and not new_mode.converts_layers:
            new_mode.check_model(model, target)  # says it takes no model
        saved, held = self.snapshot(), self.held
        self._release_held()  # a held model is plain again: checked and converted as it is
        try:
            if model is not None:
                new_mode.check_model(model, target)
            new_mode.apply_fp32_math(self, backend)
            self.mode, self.device = new_mode, new_device
            if model is not None:
                self.held = HeldModel.convert(model, new_mode, target)
        except BaseException:
            self.restore(saved)
            if held is not None:  # as it was before the refused switch
                self.held = HeldModel.convert(held.model, held.mode, held.device)
            raise
        self.notify("mode")
        return new_mode

    def _release_held(self) -> None:
        """A mode change or a reset: a model the mode held gets its layers back."""
        held, self.held = self.held, None
        if held is not None:
            held.release()

    def set_tf32(self, enabled: bool, device: str | torch.device | None = None) -> None:
        """Turn reduced-precision fp32 math on or off.

        In modes fp32 and tf32 the mode owns this switch, so this moves between those two
        modes. Otherwise ``True`` switches reduced math on and ``False`` restores every flag
        to what it was before mpnb changed it.
        """
        target = resolve_device(self.device if device is None else device)
        backend = backend_for(target)
        owner = self.mode.with_fp32_math(enabled)
        if owner is not None:
            self.set_mode(owner, device)
        else:
            self.want_fp32_math(backend, Fp32Math.REDUCED if enabled else None)
            self.notify("fp32_math")

    def want_fp32_math(self, backend: Backend | None, level: Fp32Math | None) -> None:
        """Make ``level`` on ``backend`` the session's fp32-math wish (None: the flags as found) and apply it."""
        self._fp32_wanted = (backend, level) if backend is not None and level is not None else None
        self.apply_fp32_wish()

    def apply_fp32_wish(self) -> None:
        """Put the fp32-math flags where the session wants them (after a fit borrowed the switch)."""
        self.fp32_math.hold(self._fp32_wanted)

    def autocast_settings(
        self,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        *,
        enabled: bool = True,
        cache: bool = False,
    ) -> AutocastSettings:
        """Validate an autocast request, filling what is not given from the session.

        Raises:
            MpnbError: unknown dtype or device, or a dtype the device cannot autocast to.
        """
        target = resolve_device(self.device if device is None else device)
        backend = backend_for(target)
        if dtype is not None:
            chosen = parse_dtype(dtype, _mode_hint(dtype))
        else:
            chosen = self.mode.autocast_dtype or backend.preferred_dtype()
        if enabled:
            check_autocast_dtype(backend, target, chosen)
        return AutocastSettings(target, chosen, enabled, cache)

    @contextlib.contextmanager
    def mode_scope(
        self, mode: str | Mode, device: str | torch.device | None = None
    ) -> Iterator[Mode]:
        """The session in ``mode`` for one block; mode, device and fp32-math flags restored on any exit.

        Raises:
            MpnbError: as :meth:`set_mode` (nothing changed then).
        """
        saved = self.snapshot()
        new_mode = self.set_mode(mode, device)
        try:
            yield new_mode
        finally:
            self.restore(saved)

    @contextlib.contextmanager
    def running(self, mode: Mode) -> Iterator[None]:
        """``mode`` in force for a block of this thread (a fit's, in its own mode) without changing
        the session: :attr:`mode_in_force` reads it, and ``mpnb.autocast()`` with no dtype
        follows it (off in a fit in fp32 or tf32, whatever the session's mode).

        Example:
            >>> with session.running(parse_mode("fp32")):
            ...     session.mode_in_force.name
            'fp32'
        """
        token = _RUNNING.set(mode)
        try:
            yield
        finally:
            _RUNNING.reset(token)

    @property
    def mode_in_force(self) -> Mode:
        """The mode of the run this thread is in (:meth:`running`), else the session's."""
        return _RUNNING.get() or self.mode

    def snapshot(self) -> SessionSnapshot:
        """Mode, device, fp32-math wish and the flags in force now, for :meth:`restore`."""
        return SessionSnapshot(self.mode, self.device, self._fp32_wanted, self.fp32_math.held)

    def restore(self, snapshot: SessionSnapshot) -> None:
        """Put mode, device and the fp32-math flags back exactly as a :meth:`snapshot` found them.

        The flags go back to what was in force then, which is not always the session's wish: a
        fit in mode tf32 borrows the switch, and a ``with mpnb.tf32(False):`` block inside its
        model code must hand the fit its reduced math back.
        """
        self.mode, self.device, self._fp32_wanted = (
            snapshot.mode,
            snapshot.device,
            snapshot.fp32_wish,
        )
        self.fp32_math.hold(snapshot.fp32_held)
        self.notify("mode")

    @contextlib.contextmanager
    def cell_scope(self) -> Iterator[None]:
        """Apply the session mode to one block (a notebook cell); restore on any exit.

        What the thread's autocast switches are outside the cell is kept meanwhile
        (:meth:`thread_autocast`): a change made for the rest of the thread during the cell
        (:meth:`set_thread_autocast`, ``mpnb.hmp``) is what the cell ends with, instead of being
        undone with the cell's own autocast.
        """
        self._outside_cell, self._outside_changed = ThreadAutocast.capture(), False
        try:
            dtype = self.mode.autocast_dtype
            if dtype is None:
                yield
            else:
                with AutocastSettings(self.resolved_device(), dtype).context():
                    yield
        finally:
            outside, changed = self._outside_cell, self._outside_changed
            self._outside_cell, self._outside_changed = None, False
            if changed:
                outside.restore()

    def thread_autocast(self) -> ThreadAutocast:
        """The thread's autocast switches outside any cell scope (now, when none is open)."""
        return self._outside_cell if self._outside_cell is not None else ThreadAutocast.capture()

    def set_thread_autocast(self, state: ThreadAutocast) -> None:
        """Set the thread's autocast switches now and for the rest of the thread, also past the
        end of the cell that does it."""
        state.restore()
        if self._outside_cell is not None:
            self._outside_cell, self._outside_changed = state, True

    def reset(self) -> None:
        """Mode off, device auto-detected, no op lists, every fp32-math flag as mpnb found it."""
        for undo in reversed(self.reset_callbacks[:]):
            undo()
        self._release_held()
        self.want_fp32_math(None, None)
        self.oplists.reset()
        self.mode, self.device = parse_mode("off"), None
        self.notify("reset")

    def warnings(self) -> list[str]:
        """What the user should know about the current policy on this machine."""
        notes: list[str] = []
        try:
            target = self.resolved_device()
        except (InvalidChoiceError, DeviceUnavailableError) as error:
            return [f"the session device is gone: {error}"]
        backend = backend_for(target)
        dtype = self.mode.autocast_dtype
        if dtype is not None:
            refusal = backend.autocast_probe(dtype)
            if refusal:
                notes.append(
                    f"torch would disable {dtype_name(dtype)} autocast on {target}: {refusal}"
                )
            notes.extend(backend.dtype_warnings(dtype))
            if not self.cell_hooks:
                notes.append(
                    "outside IPython the mode applies inside `with mpnb.autocast():` blocks"
                )
        notes.extend(self.mode.notes(backend))
        if self.fp32_math.level is Fp32Math.REDUCED and not backend.has_fast_fp32_math():
            notes.append(f"reduced-precision fp32 math has no effect on this {backend.label}")
        return notes


session = Session()


def _mode_hint(value: object) -> str:
    """Where ``value`` names a mode that swaps layers (fp8, mxfp8, nvfp4) rather than an
    autocast dtype: how to train in it (empty otherwise)."""
    mode = find_mode(value) if isinstance(value, str) else None
    if mode is None or not mode.converts_layers:
        return ""
    return (
        f"{mode.name} is a mode that swaps a model's layers, not an autocast dtype: "
        f"mpnb.Trainer(..., mode={mode.name!r}), or %amp {mode.name} in a notebook."
    )


def set_mode(mode: str | Mode, device: str | torch.device | None = None, **options: Any) -> Mode:
    """Set the session precision mode: ``"off"``, ``"fp32"``, ``"tf32"``, ``"fp16"``, ``"bf16"``,
    ``"fp8"`` (needs torchao: :mod:`mpnb.precision.modes.fp8`; ``recipe=``, ``keep=``), or any
    registered mode (:func:`mpnb.precision.modes.mode_names`), with the options it takes.

    In IPython (after ``%load_ext mpnb``) every following cell runs in the mode; in a
    script, ``with mpnb.autocast():`` blocks follow it. Invalid input changes nothing.

    Example:
        >>> set_mode("bf16", device="cpu")
        Mode('bf16')
        >>> set_mode("off")
        Mode('off')
    """
    return session.set_mode(mode, device, **options)


def get_mode() -> Mode:
    """The session precision mode.

    Example:
        >>> get_mode()
        Mode('off')
    """
    return session.mode


def set_oplists(lists: OpLists) -> OpLists:
    """Make ``lists`` the session's op lists, live wherever autocast is on (``%oplist`` in IPython).

    Example:
        >>> _ = set_oplists(OpLists.preset("resnet50"))
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     torch.log_softmax(torch.randn(3), 0).dtype
        torch.float32
        >>> _ = set_oplists(OpLists())

    Raises:
        MpnbError: ``lists`` is not an :class:`~mpnb.oplists.lists.OpLists`; nothing changes.
    """
    if not isinstance(lists, OpLists):  # the session's override would be half replaced
        raise MpnbError(
            f"set_oplists takes an OpLists, such as OpLists.preset('hmp') or OpLists.of(fp32=[...]), "
            f"got {quoted(lists)}; OpLists() empties the lists"
        )
    for note in session.oplists.replace(lists):
        print(f"mpnb: {note}")
    return get_oplists()


def get_oplists() -> OpLists:
    """A copy of the session's op lists.

    Example:
        >>> get_oplists()
        OpLists(lower={}, fp32={})
    """
    return session.oplists.lists.copy()
