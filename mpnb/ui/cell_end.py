"""A fit left open by the notebook cell that started it, when that cell raised.

``transformers.Trainer`` tells its callbacks nothing when ``train()`` raises, so mpnb's run
inside it would stay open: its dashboard looking alive, its hooks on the model, until the next
``train()``. In IPython the end of a cell is known: if the cell that showed a fit's dashboard
raised while the fit is still open, the fit is abandoned (:meth:`FitControl.abandon`), and its
owner ends it. A cell that ends well hands nothing on: a run begun in one cell and fed from
later ones (a ``LoopRecorder``) is not ended by a later cell's error.

Example (in IPython, with a callback whose dashboard was made in this cell)::

    trainer.train()   # raises: mpnb's run ends with the cell, its failure noted in the history
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpnb.training.control import FitControl

__all__: list[str] = []


def end_with_its_cell(control: FitControl) -> None:
    """Abandon ``control``'s fit if the cell running now raises and leaves it open (no-op outside IPython)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None:
        return

    def after_cell(result) -> None:
        shell.events.unregister("post_run_cell", after_cell)
        error = result.error_in_exec
        if error is not None and control.state != "idle":
            control.abandon(f"the cell that ran it raised {type(error).__name__}: {error}")

    shell.events.register("post_run_cell", after_cell)
