"""A sharded checkpoint's ``.metadata``, read without letting it change anything, and checked
against the files beside it before any of them is read.

torch.distributed.checkpoint (DCP) pickles its metadata: a ``Metadata`` dataclass holding other
dataclasses, ``torch.Size``, dtypes, a layout, an enum and the checkpoint's path. Refusing every
other global is not enough: pickle's ``BUILD`` sets attributes on whatever object is on its stack,
a class or an enum member included, so a file naming only admitted globals could set ``_str`` on
``pathlib.PurePosixPath`` (every ``Path`` of the process would then name the attacker's file) and
be refused only afterwards. torch's own ``weights_only`` unpickler cannot stand in: it does not
read pickle protocol 4 (``FRAME``, ``MEMOIZE``, ``STACK_GLOBAL``), which DCP writes, and it lets
``BUILD`` set the state of any instance of an admitted type, an enum's members among them.

Here each opcode that builds something has its own rule (:class:`MetadataUnpickler`): ``BUILD``
sets only the declared fields of a DCP dataclass instance (these exist nowhere but in this load),
``REDUCE`` and ``NEWOBJ`` call only the admitted classes, ``SETITEM`` and ``APPEND`` fill only
dicts and lists, and every opcode that reaches anything else (``INST``, ``OBJ``, ``EXT*``,
persistent ids, buffers) is refused, named. The file is read whole first, as a regular file:
a declared length is never a read of that many bytes.

Then :func:`check_shards` holds the metadata to the folder: every shard it names must be a
regular file inside the checkpoint's folder (no ``..``, no absolute path, no link) and every
declared offset and length must fit that file, before DCP reads a byte of it.

Example:
    >>> import io, pickle
    >>> hostile = b"\\x80\\x02cpathlib\\nPosixPath\\nN}X\\x04\\x00\\x00\\x00_strX\\x02\\x00\\x00\\x00/xs\\x86b."
    >>> try:
    ...     MetadataUnpickler(io.BytesIO(hostile), "ckpt/.metadata").load()
    ... except Exception as error:
    ...     print(error)
    'ckpt/.metadata' refused: pickle's BUILD on type, which only a DCP record's fields may take; nothing of it was applied
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import pickle
import pickletools
import stat
from typing import IO, Any

import torch

from mpnb._files import file_kind, read_regular
from mpnb.errors import MpnbError

__all__: list[str] = []

#: Opcodes that only push plain values, tuples, fresh empty containers, marks and memo entries:
#: taken from pickle's own unpickler as they are.
_PLAIN_OPCODES = (
    "PROTO FRAME STOP MARK POP POP_MARK DUP NONE NEWTRUE NEWFALSE INT BININT BININT1 BININT2 LONG "
    "LONG1 LONG4 FLOAT BINFLOAT STRING BINSTRING SHORT_BINSTRING UNICODE BINUNICODE "
    "SHORT_BINUNICODE BINUNICODE8 BINBYTES SHORT_BINBYTES BINBYTES8 EMPTY_TUPLE TUPLE TUPLE1 "
    "TUPLE2 TUPLE3 EMPTY_LIST LIST EMPTY_DICT DICT EMPTY_SET FROZENSET GET BINGET LONG_BINGET PUT "
    "BINPUT LONG_BINPUT MEMOIZE GLOBAL STACK_GLOBAL"
).split()


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

    from torch.distributed.checkpoint import metadata

    admitted: dict[str, Any] = {
        f"{kind.__module__}.{kind.__qualname__}": kind
        for kind in (*_records(), metadata._MEM_FORMAT_ENCODING, torch.Size)
    }
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


@functools.cache
def _records() -> tuple[type, ...]:
    """DCP's dataclasses: the only objects whose state a metadata file sets (fresh ones)."""
    from torch.distributed.checkpoint import filesystem, metadata

    return (
        metadata.Metadata,
        metadata.StorageMeta,
        metadata.TensorStorageMetadata,
        metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata,
        metadata.TensorProperties,
        metadata.MetadataIndex,
        filesystem._StorageInfo,
    )


@functools.cache
def _callables() -> frozenset[Any]:
    """What ``REDUCE`` may call: the admitted classes and ``_get_layout`` (dtypes are values)."""
    return frozenset(value for value in metadata_globals().values() if callable(value))


class MetadataUnpickler(pickle._Unpickler):
    """pickle's own (pure-Python) unpickler with a rule for every opcode that builds or changes
    an object: what a ``.metadata`` file makes is fresh, and nothing else is touched.

    A refusal is an :class:`~mpnb.errors.MpnbError` naming the file and the opcode or global.
    """

    def __init__(self, file: IO[bytes], name: str) -> None:
        super().__init__(file)
        self._name = name

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{module}.{name}"
        if qualified not in metadata_globals():
            raise self._refused(
                f"it holds `{qualified}`, which a checkpoint never needs "
                "(only torch's checkpoint records and plain data are read)"
            )
        return metadata_globals()[qualified]

    def _refused(self, what: str) -> MpnbError:
        return MpnbError(f"{self._name!r} refused: {what}")

    def _build(self) -> None:
        state = self.stack.pop()
        target = self.stack[-1]
        if type(target) not in _records():
            raise self._refused(
                f"pickle's BUILD on {type(target).__name__}, which only a DCP record's fields "
                "may take; nothing of it was applied"
            )
        if "__setstate__" in vars(type(target)):
            target.__setstate__(state)  # TensorProperties: its five fields from a tuple
            return
        fields = {field.name for field in dataclasses.fields(target)}
        if not isinstance(state, dict) or not set(state) <= fields:
            raise self._refused(
                f"pickle's BUILD sets {type(target).__name__} to {_described(state)}; it takes "
                f"only its fields {sorted(fields)}"
            )
        vars(target).update(state)

    def _reduce(self) -> None:
        arguments = self.stack.pop()
        called = self.stack[-1]
        if called not in _callables() or type(arguments) is not tuple:
            raise self._refused(f"pickle's REDUCE calls {_described(called)}")
        self.stack[-1] = called(*arguments)

    def _newobj(self) -> None:
        arguments = self.stack.pop()
        kind = self.stack.pop()
        if kind not in _records() or arguments != ():
            raise self._refused(f"pickle's NEWOBJ makes {_described(kind)}")
        self.append(kind.__new__(kind))

    def _setitems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        if type(target) is not dict:
            raise self._refused(f"pickle's SETITEMS on {type(target).__name__}, not a dict")
        for index in range(0, len(items), 2):
            target[items[index]] = items[index + 1]

    def _setitem(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        target = self.stack[-1]
        if type(target) is not dict:
            raise self._refused(f"pickle's SETITEM on {type(target).__name__}, not a dict")
        target[key] = value

    def _appends(self) -> None:
        items = self.pop_mark()
        if type(self.stack[-1]) is not list:
            raise self._refused(f"pickle's APPENDS on {type(self.stack[-1]).__name__}, not a list")
        self.stack[-1].extend(items)

    def _append(self) -> None:
        item = self.stack.pop()
        if type(self.stack[-1]) is not list:
            raise self._refused(f"pickle's APPEND on {type(self.stack[-1]).__name__}, not a list")
        self.stack[-1].append(item)


def _described(value: Any) -> str:
    return getattr(value, "__qualname__", None) or type(value).__name__


def _opcode_table() -> dict[int, Any]:
    own = {
        "BUILD": MetadataUnpickler._build,
        "REDUCE": MetadataUnpickler._reduce,
        "NEWOBJ": MetadataUnpickler._newobj,
        "SETITEM": MetadataUnpickler._setitem,
        "SETITEMS": MetadataUnpickler._setitems,
        "APPEND": MetadataUnpickler._append,
        "APPENDS": MetadataUnpickler._appends,
    }
    table: dict[int, Any] = {}
    for code in range(256):
        opcode = pickletools.code2op.get(chr(code))
        if opcode is not None and opcode.name in own:
            table[code] = own[opcode.name]
        elif opcode is not None and opcode.name in _PLAIN_OPCODES:
            table[code] = pickle._Unpickler.dispatch[code]
        else:
            table[code] = _refusing(opcode.name if opcode is not None else f"byte {code:#04x}")
    return table


def _refusing(name: str) -> Any:
    def refuse(unpickler: MetadataUnpickler) -> None:
        raise unpickler._refused(f"it uses pickle's {name}, which DCP metadata never holds")

    return refuse


MetadataUnpickler.dispatch = _opcode_table()


def read_metadata_file(name: str) -> Any:
    """The ``Metadata`` in the file ``name``, read by :class:`MetadataUnpickler` and checked to be
    what DCP writes: a ``Metadata`` whose entries are tensors or values.

    Raises:
        MpnbError: a refused global or opcode (named), a damaged file, or not DCP metadata.
        FileNotFoundError: there is no such file.
    """
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        TensorStorageMetadata,
    )

    data = read_regular(name, what="a checkpoint's metadata")
    try:
        metadata = MetadataUnpickler(io.BytesIO(data), name).load()
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


def check_shards(metadata: Any, directory: str) -> None:
    """Hold ``metadata``'s shard records to ``directory``: each names a regular file inside it
    (not a link), at an offset and length that fit the file.

    Raises:
        MpnbError: naming the record's path and what is wrong with it; nothing has been read.

    Example:
        >>> import tempfile
        >>> from torch.distributed.checkpoint.filesystem import _StorageInfo
        >>> from torch.distributed.checkpoint.metadata import Metadata
        >>> record = _StorageInfo(relative_path="../other/__0_0.distcp", offset=0, length=8)
        >>> try:
        ...     check_shards(Metadata({}, storage_data={"w": record}), tempfile.mkdtemp())
        ... except MpnbError as error:
        ...     print(str(error).split(":")[1].strip())
        its shard '../other/__0_0.distcp' is not a file inside the checkpoint's folder
    """
    storage = getattr(metadata, "storage_data", None) or {}
    if not isinstance(storage, dict):
        raise MpnbError(f"{directory!r}: its metadata's storage_data is not a mapping")
    sizes: dict[str, int] = {}
    for record in storage.values():
        relative = getattr(record, "relative_path", None)
        offset, length = getattr(record, "offset", None), getattr(record, "length", None)
        if not isinstance(relative, str):
            raise MpnbError(f"{directory!r}: a shard record names {relative!r}, not a file name")
        if relative not in sizes:
            sizes[relative] = _shard_size(directory, relative)
        transforms = getattr(record, "transform_descriptors", None)
        if transforms:  # DCP's stream extensions (compression): a record could inflate unbounded
            raise MpnbError(
                f"{directory!r}: its shard {relative!r} declares the transforms {list(transforms)!r}; "
                "mpnb reads shards written as they are (Trainer.save writes no transform)"
            )
        if (
            not (type(offset) is int and type(length) is int and offset >= 0 and length >= 0)
            or offset + length > sizes[relative]
        ):
            raise MpnbError(
                f"{directory!r}: its shard {relative!r} is {sizes[relative]} bytes; a record "
                f"declares offset {offset!r} and length {length!r}, which must be whole numbers "
                "inside the file"
            )


def _shard_size(directory: str, relative: str) -> int:
    """The size of the shard ``relative`` names, which must be a regular file in ``directory``."""
    outside = MpnbError(
        f"{directory!r}: its shard {relative!r} is not a file inside the checkpoint's folder"
    )
    parts = relative.replace("\\", "/").split("/")
    if os.path.isabs(relative) or not relative or any(part in ("", ".", "..") for part in parts):
        raise outside
    try:
        found = os.lstat(os.path.join(directory, relative))
    except OSError:
        raise outside from None
    if not stat.S_ISREG(found.st_mode):
        raise MpnbError(
            f"{directory!r}: its shard {relative!r} is {file_kind(found.st_mode)}, not a regular file"
        )
    return found.st_size
