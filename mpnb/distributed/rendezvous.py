"""torch's c10d rendezvous, made safe for a shared machine: no unsigned state is ever unpickled.

torch's dynamic rendezvous keeps its state in a store as a pickle and reads it back with
``pickle.loads``; whoever can write that store can run code in the launching process. A launch
therefore registers a rendezvous of its own with torch's registry, in which torch's
``DynamicRendezvousHandler`` and ``C10dRendezvousBackend`` do all the work, and changes two things:

- Every state is signed with the launch's secret (:class:`SignedBackend`); a state that fails
  the check is refused before torch unpickles it.
- On one machine (``nnodes=1``) the state lives in the launching process (a ``HashStore``: no
  socket at all), and the workers meet through a file in the launch's private folder
  (:func:`workers_store`) rather than a store server of torch's, which would listen on every
  interface. On several machines both stores face the network, as under ``torchrun``, but
  neither is served by a launching process: node 0's rendezvous store runs in a child with its
  memory capped (:mod:`mpnb.distributed.store_server`), the workers' store in their first worker.

This module imports torch's elastic launcher: :func:`mpnb.distributed.launch` imports it when called.

Example:
    >>> with rendezvous_for("mpnb-doc", b"s" * 32, local=True) as backend_name:
    ...     backend_name
    'mpnb-c10d'
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
    C10dRendezvousBackend,
    create_backend,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    Token,
    create_handler,
)

from mpnb.distributed.signing import Signer
from mpnb.errors import MpnbError

__all__: list[str] = []

#: The name mpnb's rendezvous is registered under in torch's rendezvous registry.
BACKEND_NAME = "mpnb-c10d"


class SignedBackend(RendezvousBackend):
    """Another rendezvous backend, with every state it holds signed by the launch's secret.

    Args:
        inner: the backend that stores the states (torch's ``C10dRendezvousBackend``).
        secret: the launch's secret, the same on every node.
    """

    def __init__(self, inner: RendezvousBackend, secret: bytes) -> None:
        self._inner, self._signer = inner, Signer(secret)

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        found = self._inner.get_state()
        return None if found is None else (self._open(found[0]), found[1])

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        result = self._inner.set_state(self._signer.sign(state), token)
        return None if result is None else (self._open(result[0]), result[1], result[2])

    def _open(self, state: bytes) -> bytes:
        opened = self._signer.open(state)
        if opened is None:
            raise RendezvousStateError(
                "the rendezvous state in the store is not signed with this launch's secret: refused unread "
                "(another process wrote it, or a node was given another secret)"
            )
        return opened


@dataclasses.dataclass(frozen=True)
class _Launch:
    secret: bytes
    local: bool


#: The launches under way in this process, by run id. The registry's creator finds a launch's
#: settings here, so the secret never enters torch's launch config (which torch logs).
_LAUNCHES: dict[str, _Launch] = {}


@contextlib.contextmanager
def rendezvous_for(run_id: str, secret: bytes, local: bool) -> Iterator[str]:
    """Make mpnb's rendezvous available to the launch ``run_id``; yields the backend name to launch with.

    Args:
        run_id: the launch's run id (the same on every node).
        secret: what the rendezvous states are signed with.
        local: one machine: no rendezvous socket, and no store server for the workers
            (:func:`workers_store`).
    """
    rendezvous_handler_registry.register(BACKEND_NAME, _create_handler)
    if run_id in _LAUNCHES:
        raise MpnbError(f"a launch with run id {run_id!r} is already under way in this process")
    _LAUNCHES[run_id] = _Launch(secret, local)
    try:
        with _no_workers_store_server():
            yield BACKEND_NAME
    finally:
        del _LAUNCHES[run_id]


def _create_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    launch = _LAUNCHES[params.run_id]
    if launch.local:
        store: dist.Store = dist.HashStore()
        inner: RendezvousBackend = C10dRendezvousBackend(store, params.run_id)
    else:
        inner, store = create_backend(params)
    return create_handler(store, SignedBackend(inner, launch.secret), params)


@contextlib.contextmanager
def _no_workers_store_server() -> Iterator[None]:
    """torch's own switch, set for the launch and put back after: the agent starts no store server
    for the workers (one would listen on every interface, from this process). On one machine they
    meet through a file instead; on several, the first worker serves their store itself."""
    before = os.environ.get(_SHARE_STORE_SWITCH)
    os.environ[_SHARE_STORE_SWITCH] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_SHARE_STORE_SWITCH, None)
        else:
            os.environ[_SHARE_STORE_SWITCH] = before


_SHARE_STORE_SWITCH = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def workers_store(folder: str) -> dist.FileStore:
    """The store a worker of a one-machine launch joins its process group with: a file in the
    launch's private folder (mode 0700), where no other user reaches and no socket listens."""
    return dist.FileStore(
        os.path.join(folder, "process-group-store"), int(os.environ["WORLD_SIZE"])
    )
