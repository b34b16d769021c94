"""Reading checkpoint files without running code: torch.save files and torch.distributed.checkpoint's.

Unpickling calls whatever globals a file names, so a checkpoint from elsewhere could run code
while it loads. :func:`load_plain` reads a ``torch.save`` file with ``weights_only=True`` and, when
torch refuses it, names the globals it refused. A sharded checkpoint (DCP) is read by
:func:`read_dcp_metadata` and :func:`load_dcp`: torch's own reader unpickles its ``.metadata`` with
a plain ``pickle.load`` and its planner loads the shards' non-tensor entries with
``weights_only=False``; here the metadata is read by :mod:`mpnb.training.dcp_metadata` (fresh DCP
records only, every shard a regular file inside the folder, every record inside its shard), and
every entry of the shards with ``weights_only=True``.

Every file is a regular file (a device or a pipe is refused before a byte is read), and a
``torch.save`` archive's records must be stored as they are, never deflated: torch would inflate
a record whole before it compares its size with the tensor's (:func:`check_records`).

This module is an adapter around torch's private details: ``FileSystemReader``'s
``_get_metadata_path`` and ``_slice_file``, ``DefaultLoadPlanner.load_bytes``, and torch's
weights-only allow list (for the legacy file format, which torch's public check does not read).
``tests/training/test_safe_load.py`` fails when torch changes any of them.

Example:
    >>> import os, tempfile, torch
    >>> path = os.path.join(tempfile.mkdtemp(), "plain.pt")
    >>> torch.save({"step": 3, "weight": torch.ones(2)}, path)
    >>> load_plain(path)["step"]
    3
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import pickletools
import stat
import zipfile
from typing import IO, Any

import torch
import torch.distributed as dist

from mpnb._files import open_regular
from mpnb.errors import MpnbError
from mpnb.training.dcp_metadata import check_shards, read_metadata_file

__all__: list[str] = []

_PLAIN = "only tensors and plain data are read"


def load_plain(path: str | os.PathLike[str], map_location: Any = None) -> Any:
    """``torch.load(path, weights_only=True)``; a file holding code, or a damaged one, is an MpnbError.

    Raises:
        MpnbError: the file names globals that only code needs (named in the message), or it
            cannot be read as a torch.save file.
        FileNotFoundError: there is no such file.
    """
    name = os.fspath(path)
    with open_regular(name, what="a checkpoint") as file:
        check_records(file, name)
        try:
            return torch.load(file, map_location=map_location, weights_only=True)
        except Exception as error:  # torch reports a truncated or foreign file in many ways
            file.seek(0)
            raise _unreadable(name, error, file) from None


def check_records(file: IO[bytes], name: str) -> None:
    """Refuse a ``torch.save`` archive with a record that is not stored as is: torch.save never
    compresses, and torch's reader inflates a deflated record whole before it looks at its size.
    Only the archive's directory is read; ``file`` is left at its start.

    Raises:
        MpnbError: a compressed record, named with its stored and declared sizes.

    Example:
        >>> import io, zipfile
        >>> buffer = io.BytesIO()
        >>> with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        ...     archive.writestr("archive/data/0", bytes(1 << 20))
        >>> try:
        ...     check_records(buffer, "run.pt")
        ... except MpnbError as error:
        ...     print(str(error).split(" (")[0])
        'run.pt' refused: its record 'archive/data/0' is compressed
    """
    try:
        if not zipfile.is_zipfile(file):
            return  # the legacy format, or no archive at all: torch reports it
        file.seek(0)
        with zipfile.ZipFile(file) as archive:
            records = archive.infolist()
            for record in records:
                if (
                    record.compress_type != zipfile.ZIP_STORED
                    or record.compress_size != record.file_size
                ):
                    raise MpnbError(
                        f"{name!r} refused: its record {record.filename!r} is compressed "
                        f"({record.compress_size:,} bytes said to inflate to "
                        f"{record.file_size:,}); torch.save stores every record as is"
                    )
            # torch's reader never compares a record with its CRC: a flipped bit would load
            damaged = archive.testzip()
    except MpnbError:
        raise
    except Exception as error:  # zipfile reports a damaged directory in many ways
        raise _damaged(name, error) from None
    finally:
        file.seek(0)
    if damaged is not None:
        raise _damaged(name, f"its record {damaged!r} does not match its checksum")


def _damaged(name: str, cause: BaseException | str) -> MpnbError:
    """The MpnbError for a file that cannot be read as a checkpoint."""
    said = repr(cause) if isinstance(cause, BaseException) else cause
    return MpnbError(f"{name!r} cannot be read as a checkpoint (damaged or truncated?): {said}")


class _Window(io.RawIOBase):
    """``length`` bytes of ``file`` from ``offset``, read as a file of their own.

    >>> window = _Window(io.BytesIO(b"..record.."), 2, 6)
    >>> window.read(), window.seek(-2, io.SEEK_END), window.read()
    (b'record', 4, b'rd')
    """

    def __init__(self, file: IO[bytes], offset: int, length: int) -> None:
        super().__init__()
        self._file, self._offset, self._length = file, offset, length
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        if start + offset < 0:
            raise ValueError(f"a seek to {start + offset}, before the window's start")
        self._position = start + offset
        return self._position

    def readinto(self, buffer: Any) -> int:
        size = max(0, min(len(buffer), self._length - self._position))
        self._file.seek(self._offset + self._position)
        read = self._file.readinto(memoryview(buffer)[:size])  # type: ignore[attr-defined]
        self._position += read
        return read


def unsafe_globals(source: str | os.PathLike[str] | IO[bytes]) -> list[str]:
    """The globals a ``torch.save`` file names that ``torch.load(weights_only=True)`` refuses,
    found without unpickling anything; empty for a file that names none or cannot be parsed.

    Example:
        >>> import io, os, torch
        >>> class RunsCode:
        ...     def __reduce__(self):
        ...         return os.system, ("true",)
        >>> buffer = io.BytesIO()
        >>> torch.save({"weight": torch.ones(1), "hook": RunsCode()}, buffer)
        >>> unsafe_globals(io.BytesIO(buffer.getvalue())) == [f"{os.system.__module__}.system"]
        True
    """
    try:
        file = source if hasattr(source, "read") else open_regular(source)  # type: ignore[arg-type]
    except (OSError, MpnbError):
        return []
    try:
        try:
            return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(file))
        except Exception:  # the legacy format, or opcodes torch's static reader does not know
            file.seek(0)
            return sorted(_globals_in_torch_file(file) - _weights_only_allowed())
    finally:
        if file is not source:
            file.close()


def _unreadable(name: str, error: BaseException, file: str | IO[bytes]) -> MpnbError:
    """The MpnbError for a torch.save file that ``torch.load(weights_only=True)`` failed to read."""
    refused = unsafe_globals(file)
    if refused:
        return _refusal(name, refused, _PLAIN)
    return _damaged(name, error)


def _refusal(name: str, refused: list[str], what_is_read: str) -> MpnbError:
    held = ", ".join(f"`{qualified}`" for qualified in refused)
    return MpnbError(
        f"{name!r} refused: it holds {held}, which a checkpoint never needs ({what_is_read})"
    )


def _globals_in_torch_file(file: IO[bytes]) -> set[str]:
    """The globals named in a torch.save file of either format; none for a file it cannot parse."""
    try:
        if zipfile.is_zipfile(file):
            file.seek(0)
            with zipfile.ZipFile(file) as archive:
                records = [member for member in archive.namelist() if member.endswith("/data.pkl")]
                return (
                    _globals_in_pickles(io.BytesIO(archive.read(records[0]))) if records else set()
                )
        file.seek(0)
        return _globals_in_pickles(file)
    except Exception:  # a damaged archive (zipfile says so in many ways): reported as damaged
        return set()


def _globals_in_pickles(file: IO[bytes], limit: int = 5) -> set[str]:
    """Every global the first ``limit`` pickles in ``file`` name (the legacy format is magic number,
    protocol, system info, the object, storage keys), read with ``pickletools``: nothing runs."""
    found: set[str] = set()
    for _ in range(limit):
        pushed: list[
            object
        ] = []  # what each opcode put on the stack: a string, or None for anything else
        memo: dict[int, object] = {}
        try:
            for opcode, arg, _position in pickletools.genops(file):
                if opcode.name in ("GLOBAL", "INST"):
                    found.add(str(arg).replace(" ", ".", 1))
                elif opcode.name == "STACK_GLOBAL":
                    module, name = pushed[-2:] if len(pushed) >= 2 else (None, None)
                    if isinstance(module, str) and isinstance(name, str):
                        found.add(f"{module}.{name}")
                    pushed.append(None)
                elif opcode.name == "MEMOIZE":
                    memo[len(memo)] = pushed[-1] if pushed else None
                elif opcode.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                    memo[int(arg)] = pushed[-1] if pushed else None
                elif opcode.name in ("GET", "BINGET", "LONG_BINGET"):
                    pushed.append(memo.get(int(arg)))
                elif opcode.stack_after:
                    pushed.append(arg if isinstance(arg, str) else None)
        except Exception:  # past the last pickle: raw storage bytes, or the end of the file
            break
    return found


def _weights_only_allowed() -> set[str]:
    # The sets torch.serialization.get_unsafe_globals_in_checkpoint compares with, which it keeps private.
    from torch import _weights_only_unpickler as weights_only

    return set(weights_only._get_allowed_globals()) | set(weights_only._get_user_allowed_globals())


@functools.cache
def _dcp_reading() -> tuple[type, type]:
    """DCP's file reader and load planner, made to unpickle nothing unsafe; built on first use
    because importing torch.distributed.checkpoint takes about a second."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        _reading: Any = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata_file(os.fspath(self._get_metadata_path(kwargs.get("rank"))))
            check_shards(metadata, os.fspath(self.path))
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            # read_data does not say which item failed: a refusal names its file
            self._reading = sinfo
            name = os.path.join(os.fspath(self.path), sinfo.relative_path)
            found = os.fstat(file.fileno())  # the file opened: checked again, as it is now
            if not stat.S_ISREG(found.st_mode) or sinfo.offset + sinfo.length > found.st_size:
                raise MpnbError(
                    f"{name!r} changed while it was read: it no longer holds its records"
                )
            # checked through a window of its own: torch's view seeks from its end the wrong
            # way, where zipfile reads an archive's directory
            check_records(_Window(file, sinfo.offset, sinfo.length), name)
            return super()._slice_file(file, sinfo)

        def read_data(self, plan: Any, planner: Any) -> Any:
            try:
                return super().read_data(plan, planner)
            except pickle.UnpicklingError as error:  # what torch.load(weights_only=True) raises
                item = self._reading
                if item is None:
                    raise
                name = os.path.join(os.fspath(self.path), item.relative_path)
                with open_regular(name, what="a checkpoint's shard") as file:
                    file.seek(item.offset)
                    raise _unreadable(name, error, io.BytesIO(file.read(item.length))) from None

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = torch.load(
                value, weights_only=True
            )  # torch's own planner passes weights_only=False
            if self.flatten_state_dict:
                set_element(
                    self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded
                )
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeReader, SafePlanner


def read_dcp_metadata(directory: str | os.PathLike[str]) -> Any:
    """The ``.metadata`` of a DCP checkpoint ``directory``, read by
    :func:`~mpnb.training.dcp_metadata.read_metadata_file` and held to the folder's files by
    :func:`~mpnb.training.dcp_metadata.check_shards`.

    Raises:
        MpnbError: it names any other global or changes anything but a fresh record (named in
            the message), is not DCP metadata, or names a shard that is not a regular file
            inside ``directory`` or a record that does not fit its shard.
        FileNotFoundError: there is no ``.metadata`` in ``directory``.
    """
    reader, _ = _dcp_reading()
    return reader(os.fspath(directory)).read_metadata()


def load_dcp(state: dict[str, Any], directory: str | os.PathLike[str]) -> None:
    """``torch.distributed.checkpoint.load(state, ...)`` from ``directory``, unpickling nothing unsafe;
    collective, as DCP's own load is.

    Raises:
        MpnbError: a file of the checkpoint holds code (file and globals named; none of it run),
            or a shard's entry cannot be unpickled.
        torch.distributed.checkpoint.api.CheckpointException: anything else DCP refuses.
    """
    from torch.distributed import checkpoint as dcp

    reader, planner = _dcp_reading()
    # DCP folds a failed metadata read into an AssertionError of its own: a refusal is raised here
    read_dcp_metadata(directory)
    try:
        dcp.load(state, storage_reader=reader(os.fspath(directory)), planner=planner())
    # every rank's failures, gathered: this rank's own first
    except dcp.api.CheckpointException as error:
        rank = dist.get_rank() if dist.is_initialized() else 0
        failures = sorted(error.failures.items(), key=lambda failure: failure[0] != rank)
        refusal = next(
            (raised for _, (raised, _trace) in failures if isinstance(raised, MpnbError)), None
        )
        if refusal is None:
            raise
        raise refusal from None
