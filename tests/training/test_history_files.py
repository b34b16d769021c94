"""History files: written whole, never through a planted link."""

from __future__ import annotations

import math

import pytest

from mpnb.training.history import COLUMNS, History
from tests.planted import assert_link_replaced, files_in, plant_link


def same(a: History, b: History) -> bool:
    def norm(values):
        return [("nan" if isinstance(v, float) and math.isnan(v) else v) for v in values]

    return a.meta == b.meta and a.events == b.events and all(norm(a.columns[c]) == norm(b.columns[c]) for c in COLUMNS)


def plain_history() -> History:
    history = History(meta={"device": "cpu"})
    history.extend({"step": [1, 2], "loss": [0.5, 0.25], "skipped": [False, True], "mode": ["bf16"] * 2})
    history.note("interrupted", kind="interrupt")
    return history


@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_saving_replaces_a_planted_link_and_leaves_its_target_alone(tmp_path, suffix):
    destination = tmp_path / "runs" / f"run{suffix}"
    victim = plant_link(destination)
    history = plain_history()
    (history.to_csv if suffix == ".csv" else history.to_json)(destination)
    assert_link_replaced(destination, victim)
    assert same(History.load(destination), history)


def test_a_csv_that_cannot_be_written_leaves_the_old_file_whole(tmp_path):
    plain_history().to_csv(tmp_path / "run.csv")
    before = (tmp_path / "run.csv").read_bytes()
    broken = History()
    broken.extend({"step": [1], "mode": ["half a surrogate \ud800"]})  # no UTF-8 for it
    with pytest.raises(UnicodeEncodeError):
        broken.to_csv(tmp_path / "run.csv")
    assert (tmp_path / "run.csv").read_bytes() == before and files_in(tmp_path) == ["run.csv"]
