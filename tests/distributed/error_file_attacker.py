"""A hostile process that plants pickles where torch's launcher reads a failed worker's error.

torch's ``start_processes`` names a file ``pytorch-errorfile-*.pickle`` in the temporary folder
for each worker, removes it at once, and ``pickle.load``s whatever is at that path if the worker
fails. This script (run by test_security.py, as another user where it can) watches a folder with
inotify, and each time such a name is removed, writes there a pickle that creates the marker file
if anything unpickles it. It knows no secret and needs no permission beyond writing to /tmp.

Usage: python error_file_attacker.py FOLDER MARKER WATCHED
(``FOLDER/ready`` appears once it watches; it stops when ``FOLDER/stop`` appears and writes
``FOLDER/report.json``: the paths it planted.)
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import select
import struct
import sys

from attacker import Payload

IN_DELETE = 0x200
EVENT = struct.Struct("iIII")  # wd, mask, cookie, length of the name that follows


def main(folder: str, marker: str, watched: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    watch = libc.inotify_init()
    if watch < 0 or libc.inotify_add_watch(watch, watched.encode(), IN_DELETE) < 0:
        raise OSError(ctypes.get_errno(), "inotify")
    evil = pickle.dumps(Payload(marker))
    planted: list[str] = []
    open(os.path.join(folder, "ready"), "w").close()
    while not os.path.exists(os.path.join(folder, "stop")):
        if not select.select([watch], [], [], 0.1)[0]:
            continue
        data = os.read(watch, 1 << 16)
        offset = 0
        while offset < len(data):
            _, _, _, length = EVENT.unpack_from(data, offset)
            name = data[offset + EVENT.size : offset + EVENT.size + length].rstrip(b"\0").decode()
            offset += EVENT.size + length
            if name.startswith("pytorch-errorfile-"):
                path = os.path.join(watched, name)
                try:
                    with open(path, "xb") as file:
                        file.write(evil)
                    os.chmod(path, 0o644)
                    planted.append(path)
                except OSError:
                    pass
    with open(os.path.join(folder, "report.json"), "w") as file:
        json.dump({"planted": planted}, file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
