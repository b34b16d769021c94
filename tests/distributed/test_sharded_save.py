"""A sharded checkpoint is written into a private folder and renamed into place: links planted
at its files' names in the destination are never written through (2 gloo processes)."""

from __future__ import annotations

import os
import pathlib

import torch
import torch.distributed as dist

from mpnb.distributed import launch
from mpnb.errors import MpnbError
from tests.planted import VICTIM_TEXT

from .test_ddp import batches
from .test_fsdp import full_weights, trainer_for

#: The names a 2-rank save writes, and the temporary name DCP writes its metadata under.
PLANTED = ("__0_0.distcp", "__1_0.distcp", ".metadata", ".metadata.tmp")


def plant_links(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """A victim file outside ``directory`` for each of :data:`PLANTED`, and a link to it there."""
    directory.mkdir()
    victims = {}
    for name in PLANTED:
        victim = directory.parent / f"victim{name.replace('.', '-')}"
        victim.write_text(VICTIM_TEXT)
        (directory / name).symlink_to(victim)
        victims[name] = victim
    return victims


def save_and_load_rank(directory: str) -> dict:
    trainer = trainer_for("fp32", "fsdp")
    trainer.fit(batches(), max_steps=2)
    trainer.save(directory)
    dist.barrier()
    saved = full_weights(trainer)
    resumed = trainer_for("fp32", "fsdp")
    resumed.load(directory)
    trainer.fit(batches(), max_steps=1)
    trainer.save(directory)  # over the older checkpoint
    refusals = []
    for destination in (
        os.path.join(directory, "..", "link"),
        os.path.join(directory, "..", "mine"),
    ):
        try:
            trainer.save(destination)
        except MpnbError as error:
            refusals.append(str(error))
    return {
        "loaded": all(torch.equal(a, b) for a, b in zip(saved, full_weights(resumed))),
        "refusals": refusals,
    }


def test_a_sharded_save_replaces_planted_links_and_leaves_their_targets(tmp_path):
    directory = tmp_path / "ckpt"
    victims = plant_links(directory)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("the user's own\n")
    results = launch(save_and_load_rank, str(directory), nproc=2, dashboard=None).results
    for name, victim in victims.items():
        assert victim.read_bytes() == VICTIM_TEXT.encode(), f"the save wrote through {name}"
    entries = sorted(directory.iterdir())
    assert entries and not any(entry.is_symlink() for entry in entries)
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "run-rank0.pt", "run-rank1.pt"} <= {
        entry.name for entry in entries
    }
    left = {"ckpt", "elsewhere", "link", "mine", *(victim.name for victim in victims.values())}
    assert {path.name for path in tmp_path.iterdir()} == left  # no folder of a save is left
    assert list((tmp_path / "elsewhere").iterdir()) == []
    assert (tmp_path / "mine" / "notes.txt").read_text() == "the user's own\n"
    for result in results:
        assert result["loaded"]
        link, mine = result["refusals"]
        assert "link' is a link" in link
        assert "holds 'notes.txt', which is not part of a sharded checkpoint" in mine
