"""Another user floods a launch's channel and overwrites its stop (run as a script by
test_channel_flood.py).

While the launch runs it finds every TCP port that started listening after it did
(``/proc/net/tcp``) and every listening Unix-domain socket under PREFIX (``/proc/net/unix``: any
user can read both). On each TCP port it connects as a ``TCPStore``
client, stores COUNT values of 8 MiB under keys of its own, and overwrites the stop key with junk
for as long as the launch runs. On each Unix socket it connects, if it may, and sends COUNT
messages of 8 MiB. It writes what it did to ``report.json``.

Usage: python flood_attacker.py FOLDER MARKER COUNT PREFIX
(MARKER: unused, the test's helper passes one; PREFIX: the folder the launch under test makes its
private folder in, so that no other launch on the machine is attacked)
(``FOLDER/ready`` appears once it has its baseline; it stops when ``FOLDER/stop`` appears.)
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import struct
import sys
import threading
import time

from attacker import listening_ports

VALUE = b"\x01" * (8 << 20)


def listening_unix_sockets(prefix: str) -> set[str]:
    """The paths of the listening Unix-domain sockets under ``prefix`` (the launch under test's
    temporary folder: other launches on the machine are left alone)."""
    found = set()
    try:
        with open("/proc/net/unix") as table:
            next(table)
            for line in table:
                fields = line.split()
                if (
                    len(fields) >= 8
                    and int(fields[3], 16) & 0x10000
                    and fields[7].startswith(prefix)
                ):
                    found.add(fields[7])  # flags: __SO_ACCEPTCON, a listening socket
    except OSError:
        pass
    return found


def flood_store(port: int, count: int, report: dict, stop: str) -> None:
    try:
        import torch.distributed as dist
    except ImportError:  # a Python without torch (another user's): the sockets only
        return
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=2)
        )
    except Exception:
        return
    for index in range(count):
        try:
            store.set(f"flood/{index}", VALUE)
            report["stored_bytes"] += len(VALUE)
        except Exception:
            break
    while not os.path.exists(stop):  # the stop key, overwritten for as long as the launch runs
        try:
            store.set("mpnb/stop", b"junk")
            report["stop_overwrites"] += 1
        except Exception:
            return


def flood_socket(path: str, count: int, report: dict) -> None:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(5)
            connection.connect(path)
            report["unix"][path] = "connected"
            for _ in range(count):
                connection.sendall(struct.pack(">I", len(VALUE)) + VALUE)
                report["sent_bytes"] += len(VALUE)
    except OSError as error:
        connected = report["unix"][path] == "connected"
        report["unix"][path] = f"{'connected, then cut off' if connected else 'refused'}: {error}"


def main(folder: str, count: int, prefix: str) -> None:
    baseline_ports, baseline_sockets = listening_ports(), listening_unix_sockets(prefix)
    report: dict = {
        "uid": os.getuid(),
        "ports": [],
        "unix": {},
        "stored_bytes": 0,
        "sent_bytes": 0,
        "stop_overwrites": 0,
    }
    stop = os.path.join(folder, "stop")
    open(os.path.join(folder, "ready"), "w").close()
    threads = []
    while not os.path.exists(stop):
        for _, port in listening_ports() - baseline_ports:
            if port not in report["ports"]:
                report["ports"].append(port)
                threads.append(
                    threading.Thread(target=flood_store, args=(port, count, report, stop))
                )
                threads[-1].start()
        for path in listening_unix_sockets(prefix) - baseline_sockets - set(report["unix"]):
            report["unix"][path] = "found"
            threads.append(threading.Thread(target=flood_socket, args=(path, count, report)))
            threads[-1].start()
        time.sleep(0.02)
    for thread in threads:
        thread.join(timeout=10)
    with open(os.path.join(folder, "report.json"), "w") as file:
        json.dump(report, file)
    os._exit(0)  # not torch's teardown of stores whose servers are gone


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[3]), sys.argv[4])
