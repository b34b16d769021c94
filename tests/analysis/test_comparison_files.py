"""A comparison's CSV and JSON: text a spreadsheet never runs, written whole, never through a link."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from mpnb.analysis.results import Comparison, ModeResult
from mpnb.training.history import History
from tests.planted import FORMULA_STARTS, assert_link_replaced, files_in, is_number, plant_link


def comparison(
    skipped_reason: str = "no fp16 here", metric: object = 0.5, note: str = "a note"
) -> Comparison:
    history = History()
    history.extend(
        {
            "step": [1, 2, 3, 4],
            "loss": [-1.0, -2.0, -3.0, -4.5],
            "step_time": [0.02, 0.02, 0.021, 0.02],
        }
    )
    fp32 = ModeResult("fp32", history, blocks=[(0, 2), (2, 4)], metric=metric, notes=[note])
    return Comparison([fp32, ModeResult("fp16", skipped_reason=skipped_reason)], steps=4, warmup=0)


def test_a_skip_reason_or_note_that_looks_like_a_formula_opens_in_a_spreadsheet_as_text(tmp_path):
    formulas = comparison(
        skipped_reason='=HYPERLINK("http://evil.example")', note="-cmd|' /C calc'!A0"
    )
    formulas.to_csv(tmp_path / "comparison.csv")
    with open(tmp_path / "comparison.csv", newline="", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    assert rows[1]["skipped_reason"] == '\'=HYPERLINK("http://evil.example")'
    assert rows[0]["notes"] == "'-cmd|' /C calc'!A0"
    text_cells = [cell for row in rows for cell in row.values() if not is_number(cell)]
    assert not [cell for cell in text_cells if cell.startswith(FORMULA_STARTS)]
    assert rows[0]["final_loss"] == "-4.5"  # a number stays a number


@pytest.mark.parametrize("name", ["comparison.csv", "comparison.json"])
def test_writing_replaces_a_planted_link_and_leaves_its_target_alone(tmp_path, name):
    destination = tmp_path / "shared" / name
    victim = plant_link(destination)
    (comparison().to_csv if name.endswith(".csv") else comparison().to_json)(destination)
    assert "fp16" in assert_link_replaced(destination, victim)


def test_a_json_file_that_cannot_be_written_leaves_the_old_file_whole(tmp_path):
    comparison().to_json(tmp_path / "comparison.json")
    before = (tmp_path / "comparison.json").read_bytes()
    with pytest.raises(TypeError, match="Tensor is not JSON serializable"):
        comparison(metric=torch.tensor(0.5)).to_json(
            tmp_path / "comparison.json"
        )  # a metric left a tensor
    assert (tmp_path / "comparison.json").read_bytes() == before and files_in(tmp_path) == [
        "comparison.json"
    ]
    assert json.loads(before)["modes"][0]["metric"] == 0.5


def test_a_csv_file_that_cannot_be_written_leaves_the_old_file_whole(tmp_path):
    comparison().to_csv(tmp_path / "comparison.csv")
    before = (tmp_path / "comparison.csv").read_bytes()
    with pytest.raises(UnicodeEncodeError):
        comparison(skipped_reason="half a surrogate \ud800").to_csv(tmp_path / "comparison.csv")
    assert (tmp_path / "comparison.csv").read_bytes() == before and files_in(tmp_path) == [
        "comparison.csv"
    ]
