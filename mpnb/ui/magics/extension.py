"""``%load_ext mpnb`` / ``%unload_ext mpnb``: the magics and the per-cell mode hook.

torch's autocast state is thread-local and must be entered and left around the code it
covers, so the session mode is applied per cell: entered when a cell starts and left when
it ends, however it ends. A cell that unloads the extension still has its scope closed at
its end, so nesting is never broken.

Example (in IPython)::

    %load_ext mpnb
    %amp bf16
    %unload_ext mpnb   # magics and hooks removed, mode off, fp32 flags restored
"""

from __future__ import annotations

import contextlib

from IPython.core.magic import Magics

from mpnb.precision.policy import session
from mpnb.ui.magics.compare import CompareMagics
from mpnb.ui.magics.distributed import DistributedMagics
from mpnb.ui.magics.oplist import OpListMagics
from mpnb.ui.magics.precision import PrecisionMagics
from mpnb.ui.magics.whatif import WhatIfMagics

__all__: list[str] = []


class CellModeHook:
    """Enters the session mode's scope before each cell and leaves it after.

    Only a top-level cell gets the scope. A cell that a magic runs inside another
    (``%%capture``, which calls ``shell.run_cell``) keeps what its outer cell chose, such as
    ``%%autocast --dtype fp16`` or ``--off``: re-entering the session mode there would undo it.
    """

    def __init__(self, shell) -> None:
        self.shell = shell
        self._open_scopes: list[contextlib.ExitStack] = []
        self._removing = False

    def install(self) -> None:
        """Register the pre/post cell callbacks."""
        self.shell.events.register("pre_run_cell", self.pre_run_cell)
        self.shell.events.register("post_run_cell", self.post_run_cell)

    def pre_run_cell(self, info) -> None:
        scope = contextlib.ExitStack()
        nested = bool(
            self._open_scopes
        )  # run by a magic of an outer cell (%%capture): that cell's choice holds
        self._open_scopes.append(scope)  # appended first, so post_run_cell always pairs with it
        if not nested:
            scope.enter_context(session.cell_scope())

    def post_run_cell(self, result) -> None:
        if self._open_scopes:
            self._open_scopes.pop().close()
        if self._removing and not self._open_scopes:
            self.shell.events.unregister("post_run_cell", self.post_run_cell)

    def remove(self) -> None:
        """Stop opening scopes now; close the ones still open as their cells end."""
        self._removing = True
        self.shell.events.unregister("pre_run_cell", self.pre_run_cell)
        if not self._open_scopes:
            self.shell.events.unregister("post_run_cell", self.post_run_cell)


_hooks: dict[int, tuple[CellModeHook, list[Magics]]] = {}


def load(shell) -> None:
    """Register mpnb's magics and cell hook on ``shell``."""
    if id(shell) in _hooks:
        return
    magics = [
        PrecisionMagics(shell),
        OpListMagics(shell),
        CompareMagics(shell),
        DistributedMagics(shell),
        WhatIfMagics(shell),
    ]
    for instance in magics:
        shell.register_magics(instance)
    hook = CellModeHook(shell)
    hook.install()
    _hooks[id(shell)] = (hook, magics)
    session.cell_hooks = True


def unload(shell) -> None:
    """Remove mpnb's magics and hooks from ``shell`` and restore every switch."""
    entry = _hooks.pop(id(shell), None)
    if entry is None:
        return
    hook, magics = entry
    hook.remove()
    for instance in magics:
        _unregister(shell.magics_manager, instance)
    ended = session.mode
    session.reset()
    if not ended.changes_nothing:  # %reload_ext starts again in mode off: said, not silent
        print(
            f"mpnb: unloaded; mode {ended.label} ended and torch's switches are as mpnb found "
            f"them (after a reload: %amp {ended.label} to go on in it)"
        )
    session.cell_hooks = bool(_hooks)
    session.notify("unloaded")


def _unregister(manager, magics: Magics) -> None:
    """Remove the magics of ``magics`` (only where they are still its own) from ``manager``."""
    for kind, names in magics.magics.items():
        for name in names:
            registered = manager.magics[kind].get(name)
            if getattr(registered, "__self__", None) is magics:
                del manager.magics[kind][name]
    manager.registry.pop(type(magics).__name__, None)
