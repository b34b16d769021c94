"""mpnb.training.safe_load against what torch really writes: it leans on torch's private details
(the classes DCP pickles, FileSystemReader and DefaultLoadPlanner internals, the weights-only
allow list), so a torch that changes any of them fails here first, naming what changed."""

from __future__ import annotations

import importlib
import os
import pickle
import warnings

import pytest
import torch

from mpnb.errors import MpnbError
from mpnb.training.dcp_metadata import metadata_globals
from mpnb.training.safe_load import load_dcp, load_plain, read_dcp_metadata, unsafe_globals

from .test_checkpoint_code import SYSTEM, CreatesMarker


def a_state() -> dict:
    """Tensors of several dtypes and layouts of use, and the plain values an optimizer keeps."""
    generator = torch.Generator().manual_seed(0)
    return {
        "model": {
            "weight": torch.randn(4, 3, generator=generator),
            "half": torch.randn(5, generator=generator).to(torch.bfloat16),
            "conv": torch.randn(2, 3, 2, 2, generator=generator).to(
                memory_format=torch.channels_last
            ),
            "count": torch.tensor(7, dtype=torch.int64),
            "mask": torch.tensor([True, False]),
        },
        "optimizer": {
            "param_groups": [
                {"lr": 0.01, "betas": (0.9, 0.999), "foreach": None, "params": ["weight"]}
            ]
        },
    }


def zeroed(state):
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {key: zeroed(value) for key, value in state.items()}
    return [zeroed(item) for item in state] if isinstance(state, list) else None


def dcp_save(state: dict, directory) -> None:
    from torch.distributed import checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "torch.distributed is disabled"
        )  # one process: what is meant
        dcp.save(state, checkpoint_id=directory, no_dist=True)


def dcp_load(state: dict, directory) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        load_dcp(state, directory)


def test_every_global_a_dcp_save_writes_is_admitted_by_the_metadata_reader(tmp_path):
    dcp_save(a_state(), tmp_path)
    metadata = read_dcp_metadata(tmp_path)  # a global torch started writing is refused here, named
    assert set(metadata.state_dict_metadata) >= {
        "model.weight",
        "model.half",
        "optimizer.param_groups.0.lr",
    }


def test_every_admitted_global_is_where_torch_keeps_it():
    for qualified, admitted in metadata_globals().items():
        module, _, name = qualified.rpartition(".")
        found = getattr(importlib.import_module(module), name)
        assert found is admitted or module == "pathlib", (
            qualified
        )  # a path is admitted as a pure path


def test_a_dcp_checkpoint_round_trips_through_the_safe_reader_and_planner(tmp_path):
    saved = a_state()
    dcp_save(saved, tmp_path)
    loaded = zeroed(saved)
    dcp_load(loaded, tmp_path)
    for key, tensor in saved["model"].items():
        assert (
            torch.equal(loaded["model"][key], tensor) and loaded["model"][key].dtype == tensor.dtype
        )
    assert loaded["optimizer"] == saved["optimizer"]


def test_a_shard_entry_holding_code_is_refused_naming_its_file(tmp_path):
    state = a_state()
    state["optimizer"]["param_groups"][0]["lr"] = CreatesMarker(str(tmp_path / "marker"))
    dcp_save(state, tmp_path / "ckpt")
    with pytest.raises(MpnbError, match=rf"__0_0\.distcp' refused: it holds `{SYSTEM}`"):
        dcp_load(zeroed(a_state()), tmp_path / "ckpt")
    assert not (tmp_path / "marker").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            b"\x80\x04garbage",
            r"\.metadata' cannot be read as a checkpoint's metadata \(damaged\?\)",
        ),
        (
            pickle.dumps({"state_dict_metadata": {}}),
            r"\.metadata' is not a torch\.distributed\.checkpoint metadata",
        ),
    ],
    ids=["damaged", "foreign"],
)
def test_a_metadata_file_that_is_not_dcp_metadata_is_an_mpnb_error_naming_it(
    tmp_path, content, message
):
    dcp_save(a_state(), tmp_path)
    (tmp_path / ".metadata").write_bytes(content)
    with pytest.raises(MpnbError, match=message):
        read_dcp_metadata(tmp_path)


@pytest.mark.parametrize("zipped", [True, False], ids=["zip format", "legacy format"])
def test_a_plain_torch_file_names_no_unsafe_global_in_either_format(tmp_path, zipped):
    torch.save(a_state(), tmp_path / "plain.pt", _use_new_zipfile_serialization=zipped)
    assert unsafe_globals(tmp_path / "plain.pt") == []
    assert load_plain(tmp_path / "plain.pt")["optimizer"] == a_state()["optimizer"]


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")
def test_a_legacy_file_names_a_global_hidden_behind_the_memo(tmp_path):
    # Protocol 4 writes a global as two strings and STACK_GLOBAL; the memo may hand them back later.
    with open(tmp_path / "legacy.pt", "wb") as file:
        for header in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001}):
            pickle.dump(header, file, protocol=2)
        pickle.dump([os.system, os.system], file, protocol=4)
    assert unsafe_globals(tmp_path / "legacy.pt") == [SYSTEM]
    with pytest.raises(MpnbError, match=rf"legacy\.pt' refused: it holds `{SYSTEM}`"):
        load_plain(tmp_path / "legacy.pt")


def _torch_file(tmp_path) -> tuple[str, bytes]:
    path = tmp_path / "run.pt"
    torch.save({"weight": torch.linspace(-1, 1, 64), "step": 3}, path)
    return str(path), path.read_bytes()


def test_a_record_damaged_after_it_was_written_is_refused_naming_it(tmp_path):
    # torch's reader does not look at a record's CRC: a flipped bit loaded as a weight of 1e36
    import zipfile

    path, raw = _torch_file(tmp_path)
    with zipfile.ZipFile(path) as archive:
        record = next(info for info in archive.infolist() if info.filename.endswith("/data/0"))
    damaged = bytearray(raw)
    name_length, extra_length = int.from_bytes(raw[record.header_offset + 26 : record.header_offset + 28], "little"), int.from_bytes(raw[record.header_offset + 28 : record.header_offset + 30], "little")  # fmt: skip
    damaged[record.header_offset + 30 + name_length + extra_length + 3] ^= 0x40
    (tmp_path / "run.pt").write_bytes(bytes(damaged))
    with pytest.raises(MpnbError, match=r"run\.pt' cannot be read .*damaged.*data/0"):
        load_plain(path)


@pytest.mark.parametrize("where", ["a name byte", "the version needed"])
def test_a_damaged_archive_directory_is_an_mpnb_error(tmp_path, where):
    path, raw = _torch_file(tmp_path)
    directory = raw.rfind(b"PK\x01\x02")  # the last record's directory entry
    offset = directory + (46 if where == "a name byte" else 6)
    damaged = bytearray(raw)
    damaged[offset] = 0xFF if where == "a name byte" else 0xAB
    (tmp_path / "run.pt").write_bytes(bytes(damaged))
    with pytest.raises(MpnbError, match=r"run\.pt' cannot be read as a checkpoint"):
        load_plain(path)


def test_a_dcp_shard_record_damaged_after_it_was_written_is_refused_naming_the_shard(tmp_path):
    state = a_state()
    dcp_save(state, tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    where = bytes(raw).find(state["model"]["weight"].numpy().tobytes())
    assert where > 0
    raw[where + 1] ^= 0x40  # one bit of a weight
    shard.write_bytes(bytes(raw))
    with pytest.raises(MpnbError, match=r"__0_0\.distcp' cannot be read .*checksum"):
        dcp_load(zeroed(a_state()), tmp_path / "ckpt")
