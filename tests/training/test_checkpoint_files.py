"""Trainer.save writes its file whole, beside the destination first, never through a planted link."""

from __future__ import annotations

import mpnb.examples as ex
from tests.planted import VICTIM_TEXT, files_in, plant_link


def test_saving_replaces_a_planted_link_and_the_file_loads_back(tmp_path):
    trainer, data, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    trainer.fit(data, max_steps=2)
    destination = tmp_path / "shared" / "run.pt"
    victim = plant_link(destination)
    trainer.save(destination)
    assert victim.read_text() == VICTIM_TEXT, "the checkpoint was written through the planted link"
    assert destination.is_file() and not destination.is_symlink()
    assert files_in(destination.parent) == ["run.pt"]  # no temporary file left
    trainer.load(destination)
    assert len(trainer.history) == 2
