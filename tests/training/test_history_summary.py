"""``History.summary()``: a table in a notebook and aligned text in ``repr``, still a mapping."""

from __future__ import annotations

import json
import math
import re

import torch

import mpnb.examples as ex
from mpnb.training.history import History


def _history() -> History:
    trainer, train, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    return trainer.fit(train, max_steps=3)


def test_summary_shows_as_a_table_in_a_notebook(ip):
    summary = _history().summary()
    shown, _ = ip.display_formatter.format(summary)
    html = shown["text/html"]
    assert html.count("<tr>") >= 7 and "median step time" in html and " ms<" in html
    assert "{" not in shown["text/plain"]  # not a dict's repr
    assert "| median step time |" in shown["text/markdown"]


def test_summary_repr_is_aligned_text():
    lines = repr(_history().summary()).splitlines()
    rows = [re.fullmatch(r"(\S+(?: \S+)*)  +(\S.*)", line) for line in lines]
    assert all(rows) and len(rows) >= 7, lines  # a label, then its value: nothing else
    assert len({row.start(2) for row in rows}) == 1, lines  # every value starts in one column
    assert ("steps", "3 (0 skipped)") in [row.groups() for row in rows]


def test_summary_is_still_the_mapping_code_reads():
    summary = _history().summary()
    assert summary["steps"] == 3 and summary["modes"] == ["bf16"]
    assert set(summary) >= {"final_loss", "median_step_time", "peak_memory", "alarms"}
    assert isinstance(summary, dict) and dict(summary) == summary
    assert json.loads(json.dumps(summary))["steps"] == 3
    empty = History().summary()
    assert math.isnan(empty["final_loss"]) and "steps" in repr(empty)
    assert torch.tensor(summary["final_loss"]).isfinite()


def test_a_final_loss_before_skipped_last_steps_says_which_step_it_is():
    # the last line of progress showed the skipped step's loss (88.44), the summary the last
    # taken step's (4.882), both as "loss" with nothing to tell them apart
    history = History()
    history.extend(
        {
            "step": [1, 2, 3],
            "loss": [4.882, 88.4, 90.1],
            "skipped": [False, True, True],
            "loss_scale": [65536.0, 32768.0, 16384.0],
        }
    )
    summary = history.summary()
    assert summary["final_loss"] == 4.882 and summary["final_loss_step"] == 1
    assert dict(summary.rows())["final loss"] == "4.882 (step 1, the last the optimizer took)"
    history.extend({"step": [4], "loss": [3.5], "skipped": [False], "loss_scale": [16384.0]})
    assert dict(history.summary().rows())["final loss"] == "3.5"  # the last step: as it was
    assert History().summary()["final_loss_step"] is None
