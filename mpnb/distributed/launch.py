"""Run a function in N worker processes with the process group set up, from a notebook cell.

:func:`launch` starts the workers through torch's elastic launcher (the engine behind
``torchrun``: its c10d rendezvous, its process supervision), never a launcher of mpnb's own.
Each worker joins the default process group (gloo on CPU, nccl on CUDA, hccl on Habana), calls
``fn(*args)``, and sends back its return value and the :class:`~mpnb.training.history.History`
of every ``mpnb.Trainer`` that fitted in it.

Functions and data defined in notebook cells work: the notebook's ``__main__`` cannot be
imported by a new process, so ``fn`` and ``args`` travel by value (``cloudpickle``), and the
workers start by ``fork`` (fast, nothing to import again). A process that has already used CUDA
cannot fork a worker that uses it: there mpnb starts the workers by ``spawn`` (each imports torch
again, a few seconds). As with Accelerate's notebook launcher, keep CUDA work out of the
notebook's own process before launching if you want the fast start.

Failures end the whole launch: a worker that raises stops every worker within seconds and
:func:`launch` raises :class:`LaunchError` naming the rank, with its traceback; a worker still
running ``timeout`` seconds after it started is ended (its stack goes to stderr) and named the
same way, with where each rank was. No worker outlives the call.

Several machines: call the same :func:`launch` on each with ``nnodes``, ``node_rank`` and a
shared ``rdzv_endpoint`` (``"host:port"`` of node 0's machine), passed to torch's rendezvous as
``torchrun --nnodes --node-rank --rdzv-endpoint`` passes them; each launch returns its own
node's ranks. Node 0 serves the rendezvous store there from a child process with its memory
capped (:mod:`~mpnb.distributed.store_server`), not from the launching process.

Example:
    >>> def add_ranks(offset):
    ...     import torch, torch.distributed as dist
    ...     total = torch.tensor([dist.get_rank() + offset])
    ...     dist.all_reduce(total)
    ...     return int(total)
    >>> launch(add_ranks, 10, nproc=2).results
    [21, 21]
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import gc
import json
import logging
import math
import os
import signal
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import cloudpickle
import psutil
import torch
import torch.distributed as dist

from mpnb import views
from mpnb._stderr import quiet_loggers
from mpnb.distributed.channel import LauncherChannel, RankStream, WorkerChannel
from mpnb.distributed.launch_failure import LaunchError, end_after, launch_error, stacks_on_crash
from mpnb.distributed.rank_output import rank_lines
from mpnb.distributed.rank_rows import RanksView
from mpnb.distributed.signing import SECRET_ENV, new_secret, shared_secret
from mpnb.distributed.supervise import Supervisor, torch_handled_signals
from mpnb.errors import InvalidChoiceError, MpnbError
from mpnb.training.capture import collect_histories, stream_fits
from mpnb.training.control import FitControl
from mpnb.training.history import History
from mpnb.training.telemetry import DASHBOARDS

if TYPE_CHECKING:  # imported where a launch needs it: torch's launcher pulls in its elastic agent
    from torch.distributed.launcher.api import LaunchConfig

__all__ = ["Launched", "LaunchError", "launch", "default_backend"]

#: The most workers one launch starts on a machine.
MAX_NPROC = max(64, 4 * (os.cpu_count() or 1))
#: Seconds the launcher waits for workers to end after SIGTERM before it kills them.
SHUTDOWN_S = 5
START_METHODS = ("fork", "spawn", "forkserver")


@dataclasses.dataclass
class Launched:
    """What a :func:`launch` brought back, indexed by rank.

    Attributes:
        results: each rank's return value.
        histories: each rank's list of histories, one per ``mpnb.Trainer`` that fitted there.

    Example (two ranks, as :func:`launch` builds it from what they sent back):
        >>> launched = Launched(results=[21, 21], histories=[[History()], []])
        >>> launched.results[1], [len(histories) for histories in launched.histories]
        (21, [1, 0])
    """

    results: list[Any]
    histories: list[list[History]]


@dataclasses.dataclass(frozen=True)
class _Link:
    """What a worker needs to reach the launching process: the channel's socket and secret, whether
    to stream rows, and whether the launch is on this machine alone (its sockets then stay on loopback)."""

    address: str
    secret: bytes = dataclasses.field(repr=False)
    stream: bool
    local: bool


def _ranks_view(
    dashboard: str | RanksView | None, title: str, control: FitControl
) -> RanksView | None:
    if dashboard is None or isinstance(dashboard, RanksView):
        return dashboard
    return views.view("rank_dashboard")(dashboard, title, control)


def default_backend(device_type: str) -> str:
    """The process-group backend for a device type: gloo on CPU, nccl on CUDA, hccl on Habana.

    >>> default_backend("cpu"), default_backend("cuda")
    ('gloo', 'nccl')
    """
    return {"cuda": "nccl", "hpu": "hccl"}.get(device_type, "gloo")


def default_start_method(device_type: str) -> str:
    """How workers start: forked on CPU (functions from notebook cells need no import there),
    spawned on an accelerator, as torchrun's start fresh. A forked worker cannot use CUDA once
    the launching process has asked the CUDA runtime anything: ``torch.cuda.is_available()`` is
    enough, and mpnb's device detection calls it.

    >>> default_start_method("cpu"), default_start_method("cuda")
    ('fork', 'spawn')
    """
    return "fork" if device_type == "cpu" else "spawn"


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nproc: int = 2,
    backend: str | None = None,
    timeout: float | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    start_method: str | None = None,
    dashboard: str | RanksView | None = "auto",
    control: FitControl | None = None,
    secret: str | bytes | None = None,
) -> Launched:
    """Run ``fn(*args)`` in ``nproc`` processes (per node) with ``torch.distributed`` initialised.

    Args:
        fn, args: what each worker runs; ``torch.distributed.get_rank()`` tells them apart.
        nproc: workers on this machine.
        backend: the process-group backend; default from the device (:func:`default_backend`).
        timeout: seconds a worker may run (None: no limit); also the process group's timeout.
        nnodes, node_rank, rdzv_endpoint: several machines (see the module's notes).
        start_method: ``"fork"``, ``"spawn"`` or ``"forkserver"``; default ``"fork"`` on CPU
            and ``"spawn"`` on an accelerator (see ``default_start_method``).
        dashboard: how every rank's ``mpnb.Trainer`` telemetry is shown while they train:
            ``"auto"`` (a live per-rank plot in a notebook, a text line elsewhere), ``"live"``,
            ``"text"``, a :class:`~mpnb.distributed.rank_rows.RanksView`, or None (no
            streaming). Inside the workers the trainers' own dashboards are replaced by it.
        control: a :class:`~mpnb.training.control.FitControl` whose ``stop()`` (from a view,
            another thread or a widget) stops every rank's fit after the same step; they return.
        secret: several machines: the secret every node's launch is given (at least 16 bytes;
            default: the ``MPNB_LAUNCH_SECRET`` environment variable). The rendezvous is signed
            with it; see the README's Security section. One machine needs none: each launch
            makes its own.

    Raises:
        LaunchError: a worker raised or timed out (every worker is ended first).
        KeyboardInterrupt: a kernel interrupt (Ctrl-C) ends every worker at once.
        MpnbError / InvalidChoiceError: bad arguments (nothing is started).

    Example (bad arguments are refused before any process starts; the module's example runs
    two real workers):
        >>> launch(print, nproc=2, nnodes=2)
        Traceback (most recent call last):
        ...
        mpnb.errors.MpnbError: nnodes=2 needs rdzv_endpoint='host:port' of a machine every node reaches
        >>> launch(print, nproc=2, dashboard="plot")
        Traceback (most recent call last):
        ...
        mpnb.errors.InvalidChoiceError: unknown dashboard 'plot'; valid: auto, live, text, None, a RanksView
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousStateError
    from torch.distributed.launcher.api import elastic_launch

    from mpnb.distributed.rendezvous import rendezvous_for
    from mpnb.distributed.store_server import HostedStore

    _check_arguments(fn, nproc, timeout, nnodes, node_rank, rdzv_endpoint)
    if (
        dashboard is not None
        and not isinstance(dashboard, RanksView)
        and dashboard not in DASHBOARDS
    ):
        raise InvalidChoiceError("dashboard", dashboard, [*DASHBOARDS, "None", "a RanksView"])
    device_type = _accelerator_type()
    _check_a_device_each(device_type, nproc, _device_count(device_type))
    backend = backend or default_backend(device_type)
    if backend not in dist.Backend.backend_list:
        raise InvalidChoiceError("backend", backend, dist.Backend.backend_list)
    method = start_method or default_start_method(device_type)
    if method not in START_METHODS:
        raise InvalidChoiceError("start_method", method, START_METHODS)
    rendezvous_secret = shared_secret(secret)
    if nnodes > 1 and rendezvous_secret is None:
        raise MpnbError(
            f"nnodes={nnodes} needs a secret shared by every node's launch: pass secret=... or set "
            f"{SECRET_ENV} on each node (make one with python -c 'import secrets; print(secrets.token_hex(32))')"
        )
    local = nnodes == 1
    run_id = f"mpnb-{uuid.uuid4().hex[:8]}" if local else "mpnb"
    payload = cloudpickle.dumps((fn, args))
    control = control or FitControl()
    view = _ranks_view(
        dashboard, f"{getattr(fn, '__name__', 'launch')} on {nproc * nnodes} ranks", control
    )
    channel_secret = new_secret()
    # the channel's socket, error files and stacks: a private folder (0700), removed after
    with (
        tempfile.TemporaryDirectory(prefix="mpnb-launch-") as logs,
        contextlib.closing(
            LauncherChannel(
                channel_secret,
                ranks=range(node_rank * nproc, (node_rank + 1) * nproc),
                folder=logs,
            )
        ) as channel,
    ):
        link = _Link(channel.address, channel_secret, stream=dashboard is not None, local=local)
        supervisor = Supervisor(channel, view, control)
        config = _launch_config(
            nproc=nproc,
            nnodes=nnodes,
            local=local,
            node_rank=node_rank,
            rdzv_endpoint=rdzv_endpoint,
            run_id=run_id,
            start_method=method,
            logs=logs,
        )
        # several machines: node 0 serves the rendezvous store from a child process with its memory
        # capped, never from this one (see store_server.py)
        hosted = (
            HostedStore(int(rdzv_endpoint.rpartition(":")[2]))
            if (rdzv_endpoint and not local and node_rank == 0)
            else None
        )
        gc.collect()  # this process's garbage finalized here, where it was made, not in a forked worker (see _worker)
        try:
            with (
                _agent_logs_quiet(),
                _temporary_files_in(logs),
                hosted or contextlib.nullcontext(),
                rendezvous_for(run_id, rendezvous_secret or new_secret(), local),
            ):
                by_rank = supervisor.run(
                    lambda: _unpacked(
                        elastic_launch(config, _worker)(
                            payload, backend, device_type, timeout, logs, link
                        )
                    ),
                    exact_rows=lambda by_rank: {
                        rank: histories for rank, (_, histories) in by_rank.items()
                    },
                )
        except ChildFailedError as failure:
            if supervisor.interrupted.is_set():  # the workers were ended for the interrupt
                raise KeyboardInterrupt("launch interrupted: every worker was ended") from None
            error = launch_error(failure.failures, timeout, logs, node_rank * nproc)
            lost = hosted.why_ended() if hosted is not None else None
            if lost is not None:  # what ended the workers' rendezvous, said first
                raise MpnbError(f"{lost}\n{error}") from None
            raise error from None
        # torch's launcher read an error file half-written
        except (
            json.JSONDecodeError,
            EOFError,
        ) as unread:
            raise launch_error({}, timeout, logs, node_rank * nproc) from unread
        # the launcher turns Ctrl-C / a kernel interrupt into this
        except SignalException as signalled:
            if signalled.sigval != signal.SIGINT:
                raise
            raise KeyboardInterrupt("launch interrupted: every worker was ended") from None
        # mpnb's signed rendezvous refused a state (see rendezvous.py)
        except RendezvousStateError as refused:
            raise MpnbError(f"the launch could not meet its other nodes: {refused}") from None
        # after the refusals above: the store went away under the launch
        except RendezvousError as lost:
            if local:
                raise
            said = (
                hosted.why_ended()
                if hosted is not None
                else f"node 0's store at {rdzv_endpoint} went away (its launch ended, or the store "
                "refused this node)"
            )
            if said is None:
                raise
            raise MpnbError(f"the launch lost its rendezvous: {said}") from lost
    return Launched(
        results=[result for result, _ in by_rank.values()],
        histories=[histories for _, histories in by_rank.values()],
    )


def _launch_config(
    *,
    nproc: int,
    nnodes: int,
    local: bool,
    node_rank: int,
    rdzv_endpoint: str | None,
    run_id: str,
    start_method: str,
    logs: str,
) -> LaunchConfig:
    """torch's LaunchConfig for one launch, whose workers' logs and error files go to ``logs``
    (torch's default would make a folder in /tmp that stays); ``local``: one machine only, so
    the launcher's address is loopback."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    from mpnb.distributed.rendezvous import BACKEND_NAME

    return LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        rdzv_backend=BACKEND_NAME,
        rdzv_endpoint=rdzv_endpoint or "localhost:0",
        # several machines: no node's launching process serves the store (node 0's child does)
        rdzv_configs={"rank": node_rank} if local else {"rank": node_rank, "is_host": False},
        run_id=run_id,
        local_addr="127.0.0.1" if local else None,
        max_restarts=0,
        monitor_interval=0.1,
        start_method=start_method,
        logs_specs=DefaultLogsSpecs(log_dir=logs),
        **fields_it_takes(
            LaunchConfig, shutdown_timeout=SHUTDOWN_S, signals_to_handle=torch_handled_signals()
        ),
    )


def _unpacked(returned: dict[int, bytes]) -> dict[int, tuple[Any, list[History]]]:
    """What each rank's worker sent back (its result, its histories), in rank order.
    (torch's launcher carried it through a pipe from the worker this process started.)"""
    by_rank = {}
    for rank in sorted(returned):
        result, histories = cloudpickle.loads(returned[rank])
        by_rank[rank] = (result, [History.from_dict(history) for history in histories])
    return by_rank


@contextlib.contextmanager
def _temporary_files_in(folder: str) -> Iterator[None]:
    """Python's temporary files (``tempfile``'s default folder) go to ``folder`` while the block runs.

    torch's launcher names a file ``pytorch-errorfile-*.pickle`` for each worker in the temporary
    folder, removes it, and, if the worker fails, unpickles whatever is at that path. In a shared
    /tmp another user can put a pickle there first, and it runs in this process. A launch's own
    folder (mode 0700) is out of their reach, and goes with what torch left in it. (Other threads
    of this process also make their temporary files there until the launch ends.)

    Example:
        >>> with tempfile.TemporaryDirectory() as private, _temporary_files_in(private):
        ...     tempfile.gettempdir() == private
        True
    """
    saved = tempfile.tempdir
    tempfile.tempdir = folder
    try:
        yield
    finally:
        tempfile.tempdir = saved


def _check_arguments(fn, nproc, timeout, nnodes, node_rank, rdzv_endpoint) -> None:
    if not callable(fn):
        raise MpnbError(f"fn must be callable, got {type(fn).__name__}")
    for name, value, least in (
        ("nproc", nproc, 1),
        ("nnodes", nnodes, 1),
        ("node_rank", node_rank, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise MpnbError(f"{name} must be a whole number >= {least}, got {value!r}")
    if node_rank >= nnodes:
        raise MpnbError(f"node_rank must be below nnodes={nnodes}, got {node_rank}")
    if nproc > MAX_NPROC:
        raise MpnbError(
            f"nproc must be at most {MAX_NPROC} (4 per CPU core, 64 at least), got {nproc}"
        )
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not 0 < timeout < math.inf
    ):
        raise MpnbError(
            f"timeout must be a positive, finite number of seconds or None, got {timeout!r}"
        )
    if nnodes > 1 and not rdzv_endpoint:
        raise MpnbError(
            f"nnodes={nnodes} needs rdzv_endpoint='host:port' of a machine every node reaches"
        )
    host, _, port = (rdzv_endpoint or "localhost:0").rpartition(":")
    if not host or not port.isdigit():
        raise MpnbError(f"rdzv_endpoint must be 'host:port', got {rdzv_endpoint!r}")
    if nnodes > 1 and not 1 <= int(port) <= 65535:  # port 0 would be a port no node is told
        raise MpnbError(
            f"rdzv_endpoint {rdzv_endpoint!r} needs a port from 1 to 65535 that every node reaches"
        )
    if nnodes > 1 and node_rank == 0 and not _names_this_machine(host):
        raise MpnbError(
            f"rdzv_endpoint {rdzv_endpoint!r} must name node 0's machine: node_rank=0 serves the "
            "rendezvous store there (the other nodes connect to it)"
        )
    if dist.is_available() and dist.is_initialized():
        raise MpnbError(
            "launch was called inside a process group (a worker): launch from the notebook's own process"
        )


def _names_this_machine(host: str) -> bool:
    """Whether ``host`` is this machine (its name, one of its addresses, loopback), by torch's own
    test, the one its rendezvous uses to choose the node that serves the store."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return _matches_machine_hostname(host)


def _accelerator_type() -> str:
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return accelerator.type if accelerator is not None else "cpu"


def _device_count(device_type: str) -> int:
    # torch.cuda's count asks NVML where it can, which leaves a later fork able to use CUDA
    # (%%distributed forks); torch.cuda.is_available() would not
    return torch.get_device_module(device_type).device_count() if device_type != "cpu" else 0


def _check_a_device_each(device_type: str, nproc: int, devices: int) -> None:
    """Refuse more CUDA workers than GPUs: each worker takes the GPU of its local rank, and
    NCCL will not put two ranks on one GPU. CPU workers share the cores.

    >>> _check_a_device_each("cuda", 2, devices=1)
    Traceback (most recent call last):
    ...
    mpnb.errors.MpnbError: nproc=2 puts a worker on each of 2 cuda devices, and this machine has 1: use nproc=1 or fewer, or run CPU workers by hiding the GPUs (CUDA_VISIBLE_DEVICES='' before Python starts)
    >>> _check_a_device_each("cuda", 2, devices=2), _check_a_device_each("cpu", 8, devices=0)
    (None, None)
    """
    if device_type == "cuda" and nproc > devices:
        raise MpnbError(
            f"nproc={nproc} puts a worker on each of {nproc} {device_type} devices, and this "
            f"machine has {devices}: use nproc={devices} or fewer, or run CPU workers by hiding "
            "the GPUs (CUDA_VISIBLE_DEVICES='' before Python starts)"
        )


def fields_it_takes(config_class: type, **options: Any) -> dict[str, Any]:
    """The ``options`` that torch's ``LaunchConfig`` has fields for, the rest left out: older
    torch releases (2.11 among them) lack ``shutdown_timeout`` (they wait their own fixed time)
    and ``signals_to_handle`` (they read the environment variable that
    :func:`~mpnb.distributed.supervise.interrupts_noted` sets).

    Example:
        >>> from torch.distributed.launcher.api import LaunchConfig
        >>> fields_it_takes(LaunchConfig, shutdown_timeout=5)
        {'shutdown_timeout': 5}
        >>> @dataclasses.dataclass
        ... class OlderLaunchConfig:
        ...     nproc_per_node: int = 1
        >>> fields_it_takes(OlderLaunchConfig, shutdown_timeout=5)
        {}
    """
    names = {field.name for field in dataclasses.fields(config_class)}
    return {name: value for name, value in options.items() if name in names}


#: The loggers of torch's launcher that report a failed worker (mpnb's LaunchError says it instead).
_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing.spawn")


def _agent_logs_quiet() -> contextlib.AbstractContextManager[None]:
    return quiet_loggers(_AGENT_LOGGERS, logging.CRITICAL)


def _worker(
    payload: bytes, backend: str, device_type: str, timeout: float | None, logs: str, link: _Link
) -> bytes:
    """One worker: join the process group, run the function, send back its result and histories."""
    # What a forked worker inherits from the launching process is never collected here, first thing:
    # finalizers of native objects made there (compiled code, threads, earlier process groups) are not
    # safe in a child, and workers that collected such garbage crashed (SIGSEGV in the garbage collector,
    # after the same process had run Lightning, transformers and torch.compile, or a crashed launch).
    gc.freeze()
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_run_worker)(payload, backend, device_type, timeout, logs, link)


def _run_worker(
    payload: bytes, backend: str, device_type: str, timeout: float | None, logs: str, link: _Link
) -> bytes:
    # A forked worker inherits the launcher's Python SIGTERM handler, which cannot run while the
    # worker waits in a collective: the launcher's "stop" would then wait SHUTDOWN_S for nothing.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # An interrupt is the launching process's to answer (it asks every rank to stop together):
    # a Ctrl-C sent to the whole process group must not stop one rank alone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _end_with_parent()
    stacks_on_crash(logs, os.environ["RANK"])
    if timeout is not None:
        end_after(timeout, logs, os.environ["RANK"], int(os.environ["LOCAL_WORLD_SIZE"]))
    # as torchrun does: the workers share the cores, not oversubscribe them
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    fn, args = cloudpickle.loads(payload)
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    group_timeout = datetime.timedelta(seconds=timeout) if timeout is not None else None
    if link.local:
        from mpnb.distributed.rendezvous import workers_store

        _peer_sockets_on_loopback()
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(
            backend,
            store=workers_store(logs),
            rank=rank,
            world_size=world_size,
            timeout=group_timeout,
        )
    else:
        dist.init_process_group(backend, timeout=group_timeout)
    # every rank's connections made before any runs the function: a rank that ends at once
    # (a function with no collective) and closes its group would otherwise fail a peer still
    # connecting, and the launch would name that peer's connection error, not what happened
    dist.barrier()
    channels: list[WorkerChannel] = []  # connected when a trainer first fits here

    def stream(index: int, history: History, control: Any) -> RankStream:
        if not channels:
            channels.append(WorkerChannel(link.address, link.secret, dist.get_rank()))
        return RankStream(channels[0], index, history, control, send_rows=link.stream)

    with rank_lines(dist.get_rank()), collect_histories() as histories, stream_fits(stream):
        try:
            result = fn(*args)
        except Exception:
            raise
        # the launcher writes no error file for these: say what happened
        except BaseException as stopped:
            what = {
                SystemExit: f"sys.exit({getattr(stopped, 'code', None)!r})",
                KeyboardInterrupt: "KeyboardInterrupt",
            }
            named = what.get(type(stopped), f"{type(stopped).__name__}: {stopped}")
            raise RuntimeError(
                f"the function ended its rank with {named} instead of returning"
            ) from stopped
    # Result and garbage first, the process group last. Once the group is out of torch's registry,
    # a garbage collection (pickling allocates) that frees the last DDP reducer also destroys the
    # gloo group, which joins gloo's threads with the GIL held; a thread still releasing a finished
    # collective's Python state (saved-tensor hooks) waits for the GIL: the rank hung there.
    returned = cloudpickle.dumps((result, [history.to_dict() for history in histories]))
    del result
    gc.collect()
    # Only on success: a rank that raised keeps its connections until its error file is written
    # and it exits, so its peers fail after it and the launch names it, not them.
    dist.destroy_process_group()
    return returned


#: The variables that name the interface gloo's and NCCL's connections between ranks listen on.
_SOCKET_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def _peer_sockets_on_loopback() -> None:
    """On one machine the ranks talk over loopback: gloo and NCCL listen there unless told otherwise
    (left to themselves, they listen on the address the machine's name resolves to)."""
    loopback = next(
        (
            name
            for name, addresses in psutil.net_if_addrs().items()
            if any(a.address == "127.0.0.1" for a in addresses)
        ),
        None,
    )
    for variable in _SOCKET_INTERFACE_VARIABLES:
        if loopback is not None and variable not in os.environ:
            os.environ[variable] = loopback


def _end_with_parent() -> None:
    """Have Linux end this worker if the launching process dies (nothing else would: it may be
    waiting in a collective for a peer that is gone)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass


_PR_SET_PDEATHSIG = 1
