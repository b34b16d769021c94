"""Modules kept in float32 inside an autocast model: the remedy for an overflow named in one.

When a step's overflow is traced to one module (:mod:`mpnb.numerics.origin`), the
smallest change that stops it is to run that module in float32: autocast is off inside it and
its floating inputs are cast up, so its ops compute in float32 and its output leaves in float32
(the next module casts again as autocast says). The rest of the model keeps its mode.

The change is to the module object's ``forward`` (an attribute set on the instance, the class
untouched) and is undone exactly: :meth:`Fp32Modules.release` deletes it again, or puts back an
instance ``forward`` the module had. Hooks, parameters and the state dict are not touched. The
change lasts one run: :class:`Fp32Modules` is an instrument of the run, asked for while it
runs it applies at once (between two steps), asked for between runs it waits for the next
run's first step, so that no module stays changed outside a fit. A run puts its kept modules
back when it ends, and from the next step when the session is reset
(:meth:`Fp32Modules.undo_for_reset`), as every other switch is.

Example (inside a run; see :class:`Fp32Modules` for one asked between runs):
    >>> from mpnb.training.history import History
    >>> from mpnb.training.step_record import WatchedRun
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    >>> kept = Fp32Modules(model, "cpu")
    >>> history = History()
    >>> kept.begin(WatchedRun(history, torch.device("cpu")))
    >>> kept.keep("1", step=3), history.events[0]["step"]  # from step 3 on
    ('1', 3)
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     model[0](torch.ones(1, 4)).dtype, model(torch.ones(1, 4)).dtype
    (torch.bfloat16, torch.float32)
    >>> kept.release()
    >>> "forward" in vars(model[1])
    False
"""

from __future__ import annotations

import difflib
import functools
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from mpnb.errors import MpnbError, quoted
from mpnb.training.step_record import Instrument, WatchedRun

if TYPE_CHECKING:
    from mpnb.training.history import History

__all__: list[str] = []

_LOW = (torch.float16, torch.bfloat16)
_ABSENT = object()


class Fp32Modules(Instrument):
    """The modules of ``model`` kept in float32, by name, and how to put each back: an
    instrument of the run, so that a module asked for between runs is changed only from the
    next run's first step (noted on its history then) until that run ends.

    Example (asked between runs: nothing changes until the next run's first step):
        >>> from mpnb.training.history import History
        >>> from mpnb.training.step_record import WatchedRun
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        >>> kept = Fp32Modules(model, "cpu")
        >>> kept.keep("1"), kept.names, kept.waiting, "forward" in vars(model[1])
        ('1', [], ['1'], False)
        >>> history = History()
        >>> kept.begin(WatchedRun(history, torch.device("cpu")))
        >>> kept.before_forward(step=1, first=True)
        >>> kept.names, history.events[0]["message"]
        (['1'], '1 runs in fp32 (autocast off inside it)')
        >>> kept.detach()  # the run ended
        >>> kept.names, "forward" in vars(model[1])
        ([], False)
    """

    def __init__(self, model: nn.Module, device_type: str) -> None:
        self.model, self.device_type = model, device_type
        self._saved: dict[str, tuple[nn.Module, Any]] = {}
        self._waiting: list[str] = []  # asked for between runs: applied at the next run's start
        self._run: WatchedRun | None = None

    @property
    def names(self) -> list[str]:
        """The modules kept in float32 now, in the order they were asked for."""
        return list(self._saved)

    @property
    def waiting(self) -> list[str]:
        """The modules asked for between runs, kept in float32 from the next run's first step."""
        return list(self._waiting)

    @property
    def running(self) -> bool:
        """A run is on: a module asked for now is kept in float32 from its next call."""
        return self._run is not None

    def begin(self, run: WatchedRun) -> None:
        """A run begins: the modules asked for before it wait for its first step."""
        self._run = run

    def next_watched_step(self, step: int) -> int | float:
        """The run's first step when modules wait for it, else none."""
        return step if self._waiting else math.inf

    def before_forward(self, step: int, first: bool) -> None:
        """The run's steps train: the modules asked for before it are kept from this step on,
        each noted on the run's history as a switch."""
        if not self._waiting or self._run is None:
            return
        waiting, self._waiting = self._waiting, []
        for name in waiting:
            self._apply(name, step)

    def detach(self) -> None:
        """The run ended: every kept module is put back."""
        self.release()
        self._run = None

    def keep(self, name: str, step: int = 0) -> str:
        """Run module ``name`` in float32: from its next call while a run is on (noted on its
        history as a switch at ``step``, the first step it runs so), else from the next run's
        first step (:attr:`waiting` until then). Returns the name as the model knows it. A name as the
        numerics origin gives it (the root's class first) works too, and ``''`` is the model
        itself (a model that is one layer).

        Raises:
            MpnbError: no module of that name (the message lists the closest names); nothing
                changes.
        """
        found = self.resolve(name)
        if found in self._saved or found in self._waiting:
            return found
        if self._run is None:
            self._waiting.append(found)
            return found
        self._apply(found, step)
        return found

    def _apply(self, found: str, step: int) -> None:
        """Keep ``found`` in float32 from its next call, noted on the run's history."""
        assert self._run is not None
        module = self.model.get_submodule(found)
        before = vars(module).get("forward", _ABSENT)
        forward = module.forward
        device_type = self.device_type

        @functools.wraps(forward)
        def in_float32(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = pytree.tree_map(_up, (args, kwargs))
            with torch.autocast(device_type, enabled=False):
                return forward(*args, **kwargs)

        module.forward = in_float32
        self._saved[found] = (module, before)
        self._run.history.note(
            f"{found or type(module).__name__} runs in fp32 (autocast off inside it)",
            kind="switch",
            step=step,
            module=found,
        )

    def release(self, name: str | None = None) -> None:
        """Put module ``name`` (every kept module for None) back as it was."""
        for kept in [name] if name is not None else list(self._saved):
            module, before = self._saved.pop(self.resolve(kept))
            if before is _ABSENT:
                del module.forward
            else:
                module.forward = before

    def undo_for_reset(self, history: History, step: int) -> None:
        """The session was reset (every switch put back): each kept module runs under autocast
        again from its next call, noted on ``history`` as a switch at ``step`` (the first step
        it runs so)."""
        for name in self.names:
            self.release(name)
            history.note(
                f"{name or type(self.model).__name__} runs under autocast again (the session "
                "was reset)",
                kind="switch",
                step=step,
                module=name,
            )

    def resolve(self, name: str) -> str:
        """``name`` as the model knows it (a name as an origin gives it, the root's class first,
        works too; a module registered under two names is known by its first), or an error
        listing the closest names."""
        if not isinstance(name, str):
            raise MpnbError(
                "keep_in_fp32 takes a module's name, or a list of them, such as "
                f"{next((found for found, _ in self.model.named_modules() if found), '')!r}; got {quoted(name)}"
            )
        if name == "":  # the model itself (a model that is one layer, as the what-if names it)
            return name
        # every name a module is registered under leads to its first (a module shared by two
        # parents is one module, kept once)
        first = {id(module): found for found, module in self.model.named_modules()}
        canonical = {
            found: first[id(module)]
            for found, module in self.model.named_modules(remove_duplicate=False)
            if found
        }
        root = type(self.model).__name__
        if name not in canonical and name.startswith(root + "."):
            name = name[len(root) + 1 :]
        if name in canonical:
            return canonical[name]
        names = list(canonical)
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
        hint = f"; closest: {', '.join(close)}" if close else f"; it has {len(names)} modules"
        raise MpnbError(f"the model has no module named {name!r}{hint}")


def _up(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in _LOW:
        return value.float()
    return value
