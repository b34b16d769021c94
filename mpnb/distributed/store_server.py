"""torch's rendezvous store for a several-machine launch, served from a process of its own with
its memory capped.

On several machines the c10d rendezvous needs a TCP store that every node reaches. torch's store
server keeps whatever any client sets, of any size, and under ``torchrun`` it runs inside the
launching process: a notebook on node 0 would hold what anyone who reaches the port stores. Here
node 0's launch starts this module as a child process instead: it serves torch's own
``TCPStore`` on the rendezvous port, with its data segment limited to :data:`CAP_BYTES` beyond
what it needs to start. A flood then fills the child to its cap and ends it (the launch fails,
saying why); the launching process keeps nothing of it.

The child lives as long as its standard input: the launch closes it when it ends, and the child
also ends when the launch's process dies.

Example:
    >>> with HostedStore(port=0) as hosted:
    ...     client = hosted.client()
    ...     client.set("greeting", b"hello")
    ...     client.get("greeting")
    b'hello'
"""

from __future__ import annotations

import datetime
import os
import resource
import subprocess
import sys
import threading
from types import TracebackType

import torch.distributed as dist

from mpnb.errors import MpnbError

__all__: list[str] = []

#: What the store may hold beyond its start: a rendezvous keeps a few kilobytes.
CAP_BYTES = 64 * 2**20
#: Seconds the launch waits for the child to listen.
START_S = 60.0


class HostedStore:
    """torch's ``TCPStore`` server on ``port`` (0: any free port), in a child process whose data
    segment may grow by at most ``cap_bytes``; a context manager that ends the child on exit.

    Attributes:
        port: the port it listens on (known once entered).
    """

    def __init__(self, port: int, cap_bytes: int = CAP_BYTES) -> None:
        self.port, self.cap_bytes = port, cap_bytes
        self._child: subprocess.Popen[str] | None = None

    def __enter__(self) -> HostedStore:
        self._child = subprocess.Popen(
            [sys.executable, "-m", __name__, str(self.port), str(self.cap_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # torch's notes on refused clients: why_ended says it
            text=True,
        )
        said = _first_line(self._child, START_S)
        if not said.startswith("listening "):
            self._end()
            raise MpnbError(
                f"the rendezvous store could not listen on port {self.port}: "
                f"{said.strip() or 'its process ended without a word'}"
            )
        self.port = int(said.split()[1])
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._end()

    @property
    def ended(self) -> bool:
        """The child is gone (a flood past its cap ends it)."""
        return self._child is None or self._child.poll() is not None

    def why_ended(self) -> str | None:
        """What to tell a user whose launch failed when the store's process had ended; None
        while it runs."""
        if not self.ended:
            return None
        return (
            f"the rendezvous store's process on this node ended (exit {self._exit_code()}): it "
            f"holds at most {self.cap_bytes // 2**20} MiB, and something stored more, or ended it. "
            "Run several-machine launches on a network only the nodes reach"
        )

    def client(self) -> dist.TCPStore:
        """A client of the store, from this process."""
        return dist.TCPStore(
            "127.0.0.1", self.port, is_master=False, timeout=datetime.timedelta(seconds=30)
        )

    def _exit_code(self) -> int | None:
        return None if self._child is None else self._child.returncode

    def _end(self) -> None:
        child = self._child
        if child is None or child.poll() is not None:
            return
        assert child.stdin is not None
        child.stdin.close()  # the child ends when its input does
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _first_line(child: subprocess.Popen[str], timeout: float) -> str:
    """The child's first line of output, or "" when it ends or ``timeout`` passes first."""
    found: list[str] = []
    reader = threading.Thread(
        target=lambda: found.append(child.stdout.readline() if child.stdout else ""), daemon=True
    )
    reader.start()
    reader.join(timeout)
    return found[0] if found else ""


def _data_segment_bytes() -> int:
    """This process's data segment now (``VmData``: its heap and private writable mappings)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmData in /proc/self/status")


def serve(port: int, cap_bytes: int) -> None:
    """The child: serve the store on ``port`` until standard input ends, its data segment
    capped ``cap_bytes`` above what serving needs."""
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    limit = _data_segment_bytes() + cap_bytes
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    print(f"listening {store.port}", flush=True)
    sys.stdin.read()  # until the launch closes it, or dies


if __name__ == "__main__":
    try:
        serve(int(sys.argv[1]), int(sys.argv[2]))
    except (RuntimeError, OSError) as error:  # the port is taken, say
        print(f"failed: {error}", flush=True)
        os._exit(1)
