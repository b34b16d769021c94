"""A refused ``.metadata`` changes nothing in the process: hostile opcode sequences that name only
admitted globals, then a refused one, leave pathlib, DCP's classes, its enum's members, dtypes and
layouts as they were. And the shards a metadata names are held to the checkpoint's folder."""

from __future__ import annotations

import os
import pathlib
import pickle
import warnings

import pytest
import torch

from mpnb.errors import MpnbError
from mpnb.training.dcp_metadata import metadata_globals
from mpnb.training.safe_load import load_dcp, read_dcp_metadata

from .test_checkpoint_code import SYSTEM
from .test_safe_load import a_state, dcp_save, zeroed

METADATA = "torch.distributed.checkpoint.metadata"
EVIL = "/tmp/attacker-owns-this"


def glob(qualified: str) -> bytes:
    """pickle's GLOBAL opcode for ``module.name``."""
    module, _, name = qualified.rpartition(".")
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def value(plain) -> bytes:
    """The opcodes that push ``plain`` (protocol 2, without its header and STOP)."""
    return pickle.dumps(plain, protocol=2)[2:-1]


def then_refused(opcodes: bytes) -> bytes:
    """``opcodes``, then a global no checkpoint needs: the load is refused at the latest there."""
    return b"\x80\x02" + opcodes + b"0" + glob(SYSTEM) + b"."


BUILD, REDUCE, NEWOBJ, SETITEM, SETITEMS, APPEND, MARK = b"b", b"R", b"\x81", b"s", b"u", b"a", b"("
ENCODING = f"{METADATA}._MEM_FORMAT_ENCODING"

HOSTILE = {
    "BUILD slots on pathlib's class": glob("pathlib.PosixPath")
    + value((None, {"_str": EVIL}))
    + BUILD,
    "BUILD dict on pathlib's class": glob("pathlib.PosixPath") + value({"_str": EVIL}) + BUILD,
    "BUILD slots on a DCP class": glob(f"{METADATA}.Metadata")
    + value((None, {"planner_data": EVIL}))
    + BUILD,
    "BUILD on a DCP class named by STACK_GLOBAL": value(METADATA)
    + value("StorageMeta")
    + b"\x93"
    + value((None, {"load_id": EVIL}))
    + BUILD,
    "BUILD dict on an enum member": glob(ENCODING)
    + value((1,))
    + REDUCE
    + value({"_value_": 9})
    + BUILD,
    "BUILD slots on an enum member": glob(ENCODING)
    + value((0,))
    + REDUCE
    + value((None, {"_name_": EVIL}))
    + BUILD,
    "NEWOBJ of an enum, then BUILD": glob(ENCODING)
    + value((2,))
    + NEWOBJ
    + value({"_value_": 7})
    + BUILD,
    "BUILD on a dtype": glob("torch.float32") + value((None, {"itemsize": 1})) + BUILD,
    "BUILD on a layout": glob("torch.serialization._get_layout")
    + value(("torch.strided",))
    + REDUCE
    + value((None, {"name": EVIL}))
    + BUILD,
    "BUILD on torch.Size's class": glob("torch.Size") + value((None, {"__len__": EVIL})) + BUILD,
    "SETITEM on a class": glob(f"{METADATA}.Metadata")
    + value("planner_data")
    + value(EVIL)
    + SETITEM,
    "SETITEMS on a class": glob(f"{METADATA}.StorageMeta")
    + MARK
    + value("load_id")
    + value(EVIL)
    + SETITEMS,
    "APPEND on a class": glob("pathlib.PosixPath") + value(EVIL) + APPEND,
    "INST": MARK + b"ipathlib\nPosixPath\n",
    "OBJ": MARK + glob(f"{METADATA}.StorageMeta") + b"o",
    "EXT1": b"\x82\x01",
    "persistent id": b"P1\n",
}


def watched() -> list[object]:
    """What a hostile metadata could reach: pathlib's classes, every admitted global, the enum's
    members."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    classes = [pathlib.PurePath, pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.Path]
    return [*classes, pathlib.PosixPath, *metadata_globals().values(), *_MEM_FORMAT_ENCODING]


def state_of(thing: object) -> dict[str, object]:
    if hasattr(thing, "__dict__"):
        return dict(vars(thing))
    state = {}
    for name in dir(thing):
        try:
            state[name] = getattr(thing, name)
        except Exception as error:  # a dtype's property that its kind does not have
            state[name] = type(error)
    return state


@pytest.fixture
def saved(tmp_path) -> pathlib.Path:
    """A DCP checkpoint in ``tmp_path`` (saving caches ``__slotnames__`` on DCP's classes)."""
    dcp_save(a_state(), tmp_path)
    return tmp_path


@pytest.fixture
def process_state(saved):
    """Each watched object's attributes before the test; put back after, whatever it did."""
    before = [(thing, state_of(thing)) for thing in watched()]
    yield before
    for thing, state in before:
        if not hasattr(thing, "__dict__"):
            continue
        if isinstance(thing, type):
            for name in set(vars(thing)) - set(state):
                delattr(thing, name)
            for name, kept in state.items():
                if vars(thing).get(name) is not kept and name not in ("__dict__", "__weakref__"):
                    setattr(thing, name, kept)
        else:
            vars(thing).clear()
            vars(thing).update(state)


@pytest.mark.parametrize("opcodes", list(HOSTILE.values()), ids=list(HOSTILE))
def test_a_refused_metadata_leaves_the_process_as_it_was(saved, process_state, opcodes):
    (saved / ".metadata").write_bytes(then_refused(opcodes))
    with pytest.raises(MpnbError, match=r"\.metadata' refused: "):
        read_dcp_metadata(saved)
    changed = [repr(thing) for thing, state in process_state if state_of(thing) != state]
    assert changed == [], f"a refused metadata changed {changed}"
    assert str(pathlib.Path("mine.csv")) == "mine.csv"


def test_a_metadata_dcp_wrote_is_still_read_whole(tmp_path):
    dcp_save(a_state(), tmp_path)
    metadata = read_dcp_metadata(tmp_path)
    properties = metadata.state_dict_metadata["model.conv"].properties
    assert properties.dtype == torch.float32 and properties.layout == torch.strided


# The shards a metadata names


def rewrite_metadata(directory: pathlib.Path, change) -> None:
    """Apply ``change`` to each shard record of ``directory``'s metadata (the test's own file)."""
    path = directory / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    for record in metadata.storage_data.values():
        change(record)
    path.write_bytes(pickle.dumps(metadata))


def test_a_shard_outside_the_folder_is_refused_and_nothing_is_read(tmp_path):
    dcp_save(a_state(), tmp_path / "ckpt")
    other = a_state()
    other["model"]["weight"] += 1
    dcp_save(other, tmp_path / "outside")
    rewrite_metadata(
        tmp_path / "ckpt",
        lambda record: setattr(record, "relative_path", "../outside/" + record.relative_path),
    )
    loaded = zeroed(a_state())
    with pytest.raises(MpnbError, match=r"shard '\.\./outside/__0_0\.distcp' is not a file inside"):
        dcp_load(loaded, tmp_path / "ckpt")
    assert not loaded["model"]["weight"].any()


def dcp_load(state, directory) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        load_dcp(state, directory)


@pytest.mark.parametrize(
    ("plant", "message"),
    [
        (lambda folder: None, "shard '/dev/zero' is not a file inside"),
        (
            lambda folder: os.symlink("/dev/zero", folder / "zero.distcp"),
            "shard 'zero.distcp' is a link, not a regular file",
        ),
    ],
    ids=["an absolute path", "a link"],
)
def test_dev_zero_with_a_huge_declared_length_is_refused_before_a_byte_is_read(
    tmp_path, plant, message
):
    dcp_save(a_state(), tmp_path)
    plant(tmp_path)
    name = "/dev/zero" if "dev" in message else "zero.distcp"

    def to_zero(record) -> None:
        record.relative_path, record.length = name, 3 << 29  # 1.5 GiB

    rewrite_metadata(tmp_path, to_zero)
    with pytest.raises(MpnbError, match=message):
        read_dcp_metadata(tmp_path)


def test_a_record_longer_than_its_shard_is_refused(tmp_path):
    dcp_save(a_state(), tmp_path)
    size = (tmp_path / "__0_0.distcp").stat().st_size
    rewrite_metadata(tmp_path, lambda record: setattr(record, "offset", record.offset + size))
    with pytest.raises(MpnbError, match=rf"is {size} bytes; a record declares offset"):
        read_dcp_metadata(tmp_path)


def test_a_shard_transform_mpnb_never_writes_is_refused(tmp_path):
    dcp_save(a_state(), tmp_path)
    rewrite_metadata(tmp_path, lambda record: setattr(record, "transform_descriptors", ["zstd"]))
    with pytest.raises(MpnbError, match="declares the transforms \\['zstd'\\]"):
        read_dcp_metadata(tmp_path)
