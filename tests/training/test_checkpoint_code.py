"""A checkpoint that holds code is refused before any of it runs: one-file checkpoints in both of
torch.save's formats, and every file of a sharded (FSDP) checkpoint directory across 2 real
processes (gloo). Each planted object would create a marker file if it were ever unpickled."""

from __future__ import annotations

import os
import pathlib
import pickle

import pytest
import torch
import torch.distributed as dist

import mpnb.examples as ex
from mpnb.distributed import launch
from mpnb.errors import MpnbError
from tests.distributed.test_ddp import batches, build_trainer

#: The global a planted object names: what unpickling it would call.
SYSTEM = f"{os.system.__module__}.{os.system.__name__}"


class CreatesMarker:
    """Unpickled, it runs a shell command that creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("zipped", [True, False], ids=["zip format", "legacy format"])
def test_a_one_file_checkpoint_holding_code_is_refused_naming_the_global_and_runs_nothing(
    tmp_path, zipped
):
    trainer, _, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    trainer.save(tmp_path / "run.pt")
    state = torch.load(tmp_path / "run.pt", weights_only=True)
    state["history"] = CreatesMarker(str(tmp_path / "marker"))
    torch.save(state, tmp_path / "bad.pt", _use_new_zipfile_serialization=zipped)
    with pytest.raises(MpnbError) as refused:
        trainer.load(tmp_path / "bad.pt")
    assert not (tmp_path / "marker").exists()
    message = str(refused.value)
    assert "bad.pt" in message and f"refused: it holds `{SYSTEM}`" in message
    assert "which a checkpoint never needs" in message


def _full_state(trainer) -> list[torch.Tensor]:
    optimizer_state = [
        value for entry in trainer.optimizer.state.values() for value in entry.values()
    ]
    tensors = [
        *trainer.model.parameters(),
        *optimizer_state,
    ]  # shards (DTensors) and Adam's step counts
    return [(t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone() for t in tensors]


def _attempt_load(directory: str) -> str:
    """Load ``directory`` into a trained trainer; what was refused, and whether the trainer changed."""
    trainer = build_trainer("fsdp", "fp32", optimizer=torch.optim.Adam, lr=0.01)
    trainer.fit(batches()[::-1], max_steps=1)
    before = _full_state(trainer)
    try:
        trainer.load(directory)
    except MpnbError as error:
        message = str(error)
    except Exception as error:  # reported to the test rather than ending the launch
        message = f"not an MpnbError: {error!r}"
    else:
        message = "loaded"
    unchanged = all(torch.equal(a, b) for a, b in zip(before, _full_state(trainer), strict=True))
    return message if unchanged else f"changed the trainer: {message}"


def _plant_in_metadata(trainer, directory: str, marker: str) -> None:
    if dist.get_rank() == 0:
        path = os.path.join(directory, ".metadata")
        with open(path, "rb") as file:
            metadata = pickle.load(file)  # the test's own file, written by dcp.save just now
        metadata.storage_meta.save_id = CreatesMarker(marker)
        with open(path, "wb") as file:
            pickle.dump(metadata, file)
    dist.barrier()


def _foreign_metadata(trainer, directory: str, marker: str) -> None:
    if dist.get_rank() == 0:
        with open(os.path.join(directory, ".metadata"), "wb") as file:
            pickle.dump({"state_dict_metadata": {}}, file)
    dist.barrier()


def _build_on_pathlib(trainer, directory: str, marker: str) -> None:
    """Metadata that names only an admitted class, sets ``_str`` on it with BUILD, then is refused."""
    if dist.get_rank() == 0:
        state = pickle.dumps((None, {"_str": marker}), protocol=2)[2:-1]  # without PROTO, STOP
        module, name = SYSTEM.split(".")
        refused = f"c{module}\n{name}\n".encode()
        hostile = b"\x80\x02cpathlib\nPosixPath\n" + state + b"b0" + refused + b"."
        with open(os.path.join(directory, ".metadata"), "wb") as file:
            file.write(hostile)
    dist.barrier()


def _plant_in_shards(trainer, directory: str, marker: str) -> None:
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
    optimizer_state["param_groups"][0]["lr"] = CreatesMarker(
        marker
    )  # a non-tensor: torch.save'd into a shard
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)


def _plant_in_run_file(trainer, directory: str, marker: str) -> None:
    path = os.path.join(directory, f"run-rank{dist.get_rank()}.pt")
    state = torch.load(path, weights_only=True)
    state["history"] = CreatesMarker(marker)
    torch.save(state, path)
    dist.barrier()


def planted_checkpoints_rank(root: str) -> dict[str, str]:
    trainer = build_trainer("fsdp", "fp32", optimizer=torch.optim.Adam, lr=0.01)
    trainer.fit(batches(), max_steps=2)
    messages = {}
    for place, plant in (
        ("metadata", _plant_in_metadata),
        ("shards", _plant_in_shards),
        ("run file", _plant_in_run_file),
        ("foreign metadata", _foreign_metadata),
        ("pathlib build", _build_on_pathlib),
    ):
        directory = os.path.join(root, place.replace(" ", "-"))
        trainer.save(directory)
        plant(
            trainer,
            directory,
            os.path.join(root, f"marker-{place.replace(' ', '-')}-rank{dist.get_rank()}"),
        )
        messages[place] = _attempt_load(directory)
    messages["a path afterwards"] = str(pathlib.Path("mine.csv"))
    return messages


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> tuple[pathlib.Path, list[dict[str, str]]]:
    """Each rank's refusal of a sharded checkpoint with code planted in each of its kinds of file."""
    if 0 < torch.cuda.device_count() < 2:
        pytest.skip("launch puts each of its 2 workers on a GPU of its own; this machine has 1")
    root = tmp_path_factory.mktemp("planted")
    return root, launch(planted_checkpoints_rank, str(root), nproc=2, dashboard=None).results


def _assert_refused(planted, place: str, file_name: str) -> None:
    root, results = planted
    assert not list(root.glob("marker-*")), "unpickling a checkpoint ran its code"
    for rank, messages in enumerate(results):
        message = messages[place]
        assert file_name.format(rank=rank) in message and f"`{SYSTEM}`" in message, message
        assert "refused" in message and "which a checkpoint never needs" in message, message
        assert not message.startswith("changed the trainer"), message


def test_a_sharded_checkpoint_whose_metadata_holds_code_is_refused_and_runs_nothing(planted):
    _assert_refused(planted, "metadata", ".metadata")


def test_a_sharded_checkpoint_whose_shards_hold_code_is_refused_and_runs_nothing(planted):
    _assert_refused(planted, "shards", ".distcp")


def test_a_sharded_checkpoint_whose_run_file_holds_code_is_refused_and_runs_nothing(planted):
    _assert_refused(planted, "run file", "run-rank{rank}.pt")


def test_a_sharded_checkpoint_whose_metadata_is_no_dcp_metadata_is_an_mpnb_error_naming_it(planted):
    for messages in planted[1]:
        assert (
            ".metadata' is not a torch.distributed.checkpoint metadata file"
            in messages["foreign metadata"]
        )


@pytest.mark.parametrize(
    "where, value",
    [
        (("model",), None),
        (("amp", "scaler"), torch.ones(7, 3)),
        (("history", "meta"), torch.ones(7, 3)),
    ],
    ids=["model is None", "scaler state is a tensor", "history meta is a tensor"],
)
def test_a_checkpoint_of_plain_data_in_the_wrong_shape_is_an_mpnb_error_and_changes_nothing(
    tmp_path, where, value
):
    trainer = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)[0]
    path = tmp_path / "run.pt"
    trainer.save(path)
    state = torch.load(path, weights_only=True)
    *parents, last = where
    target = state
    for key in parents:
        target = target[key]
    target[last] = value
    torch.save(state, path)
    before = {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}
    with pytest.raises(MpnbError, match="run.pt"):
        trainer.load(path)
    assert all(
        torch.equal(before[name], tensor) for name, tensor in trainer.model.state_dict().items()
    )


def test_a_refused_metadata_leaves_every_path_of_the_process_as_it_was(planted):
    for messages in planted[1]:
        assert "refused: pickle's BUILD on type" in messages["pathlib build"], messages
        assert messages["a path afterwards"] == "mine.csv"
