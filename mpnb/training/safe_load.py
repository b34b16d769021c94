"""Reading checkpoint files without running code: torch.save files and torch.distributed.checkpoint's.

Unpickling calls whatever globals a file names, so a checkpoint from elsewhere could run code
while it loads. :func:`load_plain` reads a ``torch.save`` file with ``weights_only=True`` and, when
torch refuses it, names the globals it refused. A sharded checkpoint (DCP) is read by
:func:`read_dcp_metadata` and :func:`load_dcp`: torch's own reader unpickles its ``.metadata`` with
a plain ``pickle.load`` and its planner loads the shards' non-tensor entries with
``weights_only=False``; here the metadata is unpickled admitting only the data classes DCP writes
(:func:`metadata_globals`), and every entry of the shards with ``weights_only=True``.

This module is an adapter around torch's private details: the DCP classes its metadata pickles
(``filesystem._StorageInfo``, ``metadata._MEM_FORMAT_ENCODING``...), ``FileSystemReader``'s
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
import zipfile
from typing import IO, Any

import torch
import torch.distributed as dist

from mpnb.errors import MpnbError

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
    try:
        return torch.load(name, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:  # torch reports a truncated or foreign file in many ways
        raise _unreadable(name, error, name) from None


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
        file = source if hasattr(source, "read") else open(os.fspath(source), "rb")  # type: ignore[arg-type]
    except OSError:
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
    return MpnbError(f"{name!r} cannot be read as a checkpoint (damaged or truncated?): {error!r}")


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
    except (OSError, zipfile.BadZipFile):  # a damaged archive: it is reported as damaged
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
def metadata_globals() -> dict[str, Any]:
    """What a DCP ``.metadata`` file may name, by qualified name, and what each is read as:
    the metadata's data classes, ``torch.Size``, torch's dtypes, its layout and memory-format
    encodings, and the checkpoint's path (read as a pure path: the loading side never opens it).

    Example:
        >>> admitted = metadata_globals()
        >>> admitted["torch.distributed.checkpoint.metadata.Metadata"].__name__, "posix.system" in admitted
        ('Metadata', False)
    """
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    classes = [
        metadata.Metadata,
        metadata.StorageMeta,
        metadata.TensorStorageMetadata,
        metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata,
        metadata.TensorProperties,
        metadata.MetadataIndex,
        metadata._MEM_FORMAT_ENCODING,
        filesystem._StorageInfo,
        torch.Size,
    ]
    admitted: dict[str, Any] = {f"{kind.__module__}.{kind.__qualname__}": kind for kind in classes}
    admitted["torch.serialization._get_layout"] = (
        torch.serialization._get_layout
    )  # a torch.layout by its name
    admitted.update(
        {
            f"torch.{name}": value
            for name, value in vars(torch).items()
            if isinstance(value, torch.dtype)
        }
    )
    admitted["pathlib.PosixPath"] = pathlib.PurePosixPath
    admitted["pathlib.WindowsPath"] = pathlib.PureWindowsPath
    return admitted


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], name: str) -> None:
        super().__init__(file)
        self._name = name

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{module}.{name}"
        if qualified not in metadata_globals():
            raise _refusal(
                self._name, [qualified], "only torch's checkpoint records and plain data are read"
            )
        return metadata_globals()[qualified]


def _read_metadata_file(name: str) -> Any:
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        TensorStorageMetadata,
    )

    with open(name, "rb") as file:
        try:
            metadata = _MetadataUnpickler(file, name).load()
        except MpnbError:
            raise
        except Exception as error:  # a damaged pickle fails in many ways
            raise MpnbError(
                f"{name!r} cannot be read as a checkpoint's metadata (damaged?): {error!r}"
            ) from None
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(metadata, Metadata) or not isinstance(entries, dict):
        raise MpnbError(f"{name!r} is not a torch.distributed.checkpoint metadata file")
    for key, entry in entries.items():
        if not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)) or (
            isinstance(entry, TensorStorageMetadata)
            and not isinstance(getattr(entry, "size", None), torch.Size)
        ):
            raise MpnbError(
                f"{name!r} describes its entry {key!r} as {type(entry).__name__}, not a tensor or value"
            )
    return metadata


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
            metadata = _read_metadata_file(os.fspath(self._get_metadata_path(kwargs.get("rank"))))
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            # read_data does not say which item failed: a refusal names its file
            self._reading = sinfo
            return super()._slice_file(file, sinfo)

        def read_data(self, plan: Any, planner: Any) -> Any:
            try:
                return super().read_data(plan, planner)
            except pickle.UnpicklingError as error:  # what torch.load(weights_only=True) raises
                item = self._reading
                if item is None:
                    raise
                name = os.path.join(os.fspath(self.path), item.relative_path)
                with open(name, "rb") as file:
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
    """The ``.metadata`` of a DCP checkpoint ``directory``, unpickled admitting only :func:`metadata_globals`.

    Raises:
        MpnbError: it names any other global (named in the message), or is not DCP metadata.
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
