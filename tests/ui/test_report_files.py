"""HTML reports and a comparison's output folder: written whole, never through a planted link."""

from __future__ import annotations

import pytest

from mpnb.analysis.results import Comparison, ModeResult
from mpnb.training.history import History
from mpnb.ui.plots.compare_report import write_comparison_files, write_comparison_report
from mpnb.ui.plots.report import write_report
from tests.planted import assert_link_replaced, files_in, plant_link


def history() -> History:
    h = History()
    h.extend(
        {"step": [1, 2, 3, 4], "loss": [1.0, 0.8, 0.7, 0.6], "step_time": [0.02, 0.02, 0.021, 0.02]}
    )
    return h


def comparison() -> Comparison:
    fp32 = ModeResult("fp32", history(), blocks=[(0, 2), (2, 4)])
    return Comparison([fp32, ModeResult("fp16", skipped_reason="no fp16 here")], steps=4, warmup=0)


def test_a_comparison_folder_replaces_planted_links_and_leaves_their_targets_alone(tmp_path):
    folder = tmp_path / "shared" / "compare"
    names = ("comparison.csv", "comparison.json", "report.html")
    victims = [plant_link(folder / name) for name in names]
    write_comparison_files(folder, comparison(), "links planted")
    texts = [assert_link_replaced(folder / name, victim) for name, victim in zip(names, victims)]
    assert all("fp16" in text for text in texts) and "links planted" in texts[2]


def test_a_training_report_replaces_a_planted_link_and_leaves_its_target_alone(tmp_path):
    destination = tmp_path / "shared" / "dashboard.html"
    victim = plant_link(destination)
    write_report(destination, history(), "a planted link")
    assert "a planted link" in assert_link_replaced(destination, victim)


@pytest.mark.parametrize("write", ["training", "comparison"])
def test_a_report_that_cannot_be_written_leaves_the_old_page_whole(tmp_path, write):
    page = tmp_path / "report.html"
    page.write_text("<p>the last good report</p>")
    with pytest.raises(UnicodeEncodeError):  # a title with half a surrogate pair has no UTF-8
        if write == "training":
            write_report(page, history(), "half a surrogate \ud800")
        else:
            write_comparison_report(page, comparison(), "half a surrogate \ud800")
    assert page.read_text() == "<p>the last good report</p>" and files_in(tmp_path) == [
        "report.html"
    ]
