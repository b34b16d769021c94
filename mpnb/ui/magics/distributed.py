"""``%%distributed``: run a cell in N worker processes, with torch.distributed set up.

Each worker (:func:`mpnb.distributed.launch`, forked from the kernel, so it starts with every
name the notebook has) runs the cell in the session's mode (``%amp``) with the session's op
lists in force, as the cell would run here; ``torch.distributed.get_rank()`` tells the ranks
apart. The names the cell assigns on rank 0 come back into the notebook (those that can be
pickled; the others are named; an object changed in place is not assigned, so it stays as it
was here), and the launch itself is kept in ``_distributed`` (each rank's
fit histories: ``_distributed.histories``). What the workers print shows here, each line led by ``[rank N]``. A rank
that raises ends the cell with that rank's traceback.

Example (in IPython)::

    %%distributed --nproc 2
    trainer = mpnb.Trainer(model, optimizer, loss_fn, strategy="ddp", dashboard=None)
    trainer.fit(batches, epochs=1)
    rank = torch.distributed.get_rank()
"""

from __future__ import annotations

from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
from IPython import get_ipython
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from mpnb.precision.policy import session
from mpnb.ui.magics.arguments import as_usage_error, cell_usage, parse_line
from mpnb.ui.magics.cell_runner import run_cell_body

__all__: list[str] = []

RESULT_VARIABLE = "_distributed"


#: What torch says in a forked worker that uses CUDA after the parent asked the CUDA runtime.
CUDA_AFTER_FORK = "Cannot re-initialize CUDA in forked subprocess"


def _cuda_after_fork_hint(failure: str) -> str:
    """mpnb's advice when a forked rank could not use CUDA. torch's own (use the 'spawn' start
    method) is not open to %%distributed, whose workers need the notebook's names.

    Example:
        >>> _cuda_after_fork_hint("rank 0 failed: ValueError: bad batch")
        ''
        >>> print(_cuda_after_fork_hint(f"rank 0 failed: RuntimeError: {CUDA_AFTER_FORK}."))
        <BLANKLINE>
        mpnb: %%distributed forks this kernel so that its workers have the notebook's names, ...
    """
    if CUDA_AFTER_FORK not in failure:
        return ""
    return (
        "\nmpnb: %%distributed forks this kernel so that its workers have the notebook's names, "
        "and a forked worker cannot use CUDA once the kernel has asked CUDA anything "
        "(torch.cuda.is_available() is enough, and mpnb's device detection calls it). Run the "
        "work as a function with mpnb.distributed.launch(fn, nproc=N), which spawns its workers "
        "on CUDA, or start the kernel with CUDA_VISIBLE_DEVICES='' to run %%distributed on CPU "
        "workers."
    )


def _cell_on_rank(body: str) -> dict[str, Any] | None:
    """In a worker: run the cell in the notebook's namespace (as forked); rank 0 returns what it assigned."""
    shell = get_ipython()
    before = dict(shell.user_ns)  # holds the old objects: a new one cannot take a freed one's id
    with session.cell_scope():
        run_cell_body(shell, body)
    if dist.get_rank() != 0:
        return None
    missing = object()
    assigned = {
        name: value
        for name, value in shell.user_ns.items()
        if not name.startswith("_") and before.get(name, missing) is not value
    }
    kept, left = {}, []
    for name, value in assigned.items():
        try:
            cloudpickle.dumps(value)
            kept[name] = value
        except Exception:  # any object pickle refuses: a lock, an open file, a generator...
            left.append(name)
    return {"names": kept, "left": sorted(left)}


@magics_class
class DistributedMagics(Magics):
    """The ``%%distributed`` cell magic."""

    @cell_usage
    @magic_arguments()
    @argument("--nproc", type=int, default=2, help="worker processes (default 2)")
    @argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds the workers may run (default: no limit)",
    )
    @argument(
        "--backend", default=None, help="process-group backend (default: gloo on CPU, nccl on CUDA)"
    )
    @cell_magic
    def distributed(self, line: str, cell: str) -> None:
        """Run the cell in ``--nproc`` processes with torch.distributed set up; rank 0's names come back."""
        from mpnb.distributed import LaunchError, launch

        args = parse_line(self.distributed, line)
        if torch.cuda.is_initialized():
            raise UsageError(
                "%%distributed forks the kernel so that the workers have the notebook's names, and this kernel "
                "has used CUDA already (a fork cannot); restart the kernel and run %%distributed before any CUDA "
                "work, or call mpnb.distributed.launch(fn) with a function"
            )
        with as_usage_error():  # bad arguments; a failing rank is not a usage error
            try:
                launched = launch(
                    _cell_on_rank,
                    cell,
                    nproc=args.nproc,
                    backend=args.backend,
                    timeout=args.timeout,
                    start_method="fork",
                )
            except LaunchError as failure:
                hint = _cuda_after_fork_hint(str(failure))
                raise RuntimeError(f"%%distributed: {failure}{hint}") from None
        back = launched.results[0]
        self.shell.user_ns.update(back["names"])
        self.shell.user_ns[RESULT_VARIABLE] = launched
        note = f"mpnb: the cell ran on {args.nproc} ranks; from rank 0: {', '.join(back['names']) or 'no new names'}"
        if back["left"]:
            note += f"; not brought back (cannot be pickled): {', '.join(back['left'])}"
        print(note)
