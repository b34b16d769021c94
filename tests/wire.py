"""Record what widgets would send to the browser, through comm's own extension point.

``comm.create_comm`` is documented as "intended to be replaced, so that it returns your
Comm instance"; ipykernel replaces it with a ZMQ comm, this module with one that keeps the
size of each message (JSON part plus binary buffers). Used by tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import comm
from comm import DummyComm
from comm.base_comm import CommManager


class RecordingComm(DummyComm):
    """A comm that appends the byte size of every message it would publish to ``sizes``."""

    sizes: list[int] = []

    def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
        payload = len(json.dumps(data, default=str)) + sum(
            memoryview(b).nbytes for b in buffers or []
        )
        type(self).sizes.append(payload)

    def close(self, data=None, metadata=None, buffers=None, deleting=False):
        """Closed without unregistering: the recording manager may be gone by garbage collection."""
        self._closed = True


@contextlib.contextmanager
def recording_wire() -> Iterator[list[int]]:
    """Widgets created inside the block record their message sizes into the yielded list."""
    previous = comm.create_comm, comm.get_comm_manager
    RecordingComm.sizes = []
    manager = CommManager()
    comm.create_comm, comm.get_comm_manager = RecordingComm, lambda: manager
    try:
        yield RecordingComm.sizes
    finally:
        comm.create_comm, comm.get_comm_manager = previous
