"""The live dashboard as a person reads it: nothing non-finite sent to the page, no label written
over another, every colour bar beside its own panel, buttons that say the whole module name, one
step numbering, a remedy after the fit that waits for the next one. Checked on the real widgets
and figures of a real fp16 fit of a TransformerEncoder with a planted overflow."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import mpnb
from mpnb.training.history import History
from mpnb.training.telemetry import Sink
from mpnb.ui.plots.figure import dashboard_figure
from mpnb.ui.views import make_dashboard
from mpnb.ui.widgets.memory_view import MemoryView
from mpnb.ui.widgets.remedy_view import RemedyView
from tests.ui.planted_encoder import encoder_batch, planted_encoder

PLANTED = "encoder.layers.1.linear2"


class _Fanout(Sink):
    """The live dashboard's sinks behind the one sink a Trainer takes."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def update(self, history: History) -> None:
        for sink in self.sinks:
            sink.update(history)

    def close(self, history: History) -> None:
        for sink in self.sinks:
            sink.close(history)


def encoder_trainer(**options) -> mpnb.Trainer:
    model = planted_encoder()
    return mpnb.Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.nn.functional.cross_entropy,
        mode="fp16", device="cpu", dashboard=None, on_nonfinite="ignore", **options,
    )  # fmt: skip


@pytest.fixture(scope="module")
def watched_fit():
    """An fp16 fit whose scale collapses (backoff 2**-4: below 1 by the fifth skip), its remedy
    asked for late at step 8, a mode switch to bf16 at step 10; the live dashboard's sinks."""
    trainer = encoder_trainer(watch_numerics=3, flush_every=1, backoff_factor=2.0**-4)
    sinks = make_dashboard("live", trainer.describe(), trainer.control)
    trainer.dashboard = _Fanout(sinks)

    def late_remedy_then_switch():
        if trainer.amp.steps == 8:
            trainer.keep_in_fp32(PLANTED)
        if trainer.amp.steps == 10:
            mpnb.set_mode("bf16", device="cpu")

    trainer.control.pollers.append(late_remedy_then_switch)
    mode_before = mpnb.get_mode()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            trainer.fit([encoder_batch()] * 14)
    finally:
        mpnb.set_mode(mode_before, device="cpu")
    return trainer, sinks


def _nonfinite(value, where="") -> list[str]:
    """Where a NaN or an infinity sits in a figure's data or layout."""
    if isinstance(value, float):
        return [] if math.isfinite(value) else [where]
    if isinstance(value, np.ndarray):
        numeric = value.dtype.kind in "fc"
        return [] if not numeric or np.isfinite(value).all() else [where]
    if isinstance(value, dict):
        return [bad for key, item in value.items() for bad in _nonfinite(item, f"{where}.{key}")]
    if isinstance(value, (list, tuple)):
        return [bad for i, item in enumerate(value) for bad in _nonfinite(item, f"{where}[{i}]")]
    return []


def test_no_nan_or_infinity_is_sent_to_the_page(watched_fit):
    trainer, sinks = watched_fit
    figures = [sink.figure for sink in sinks if getattr(sink, "figure", None) is not None]
    assert len(figures) == 2  # the four panels and the heatmaps
    assert trainer.numerics.never_ran == [
        "encoder.layers.0.self_attn.out_proj",
        "encoder.layers.1.self_attn.out_proj",
    ]
    for figure in [*figures, dashboard_figure(trainer.history), trainer.numerics.figure()]:
        assert not _nonfinite(figure.to_plotly_json()), _nonfinite(figure.to_plotly_json())


def test_modules_never_called_are_left_out_of_the_heatmaps_and_named_under_them(watched_fit):
    trainer, _ = watched_fit
    figure = trainer.numerics.figure()
    assert "encoder.layers.0.self_attn.out_proj" not in figure.data[0].y
    assert (
        figure.layout.annotations[-1]
        .text.replace("<br>", " ")
        .endswith(
            "not called as modules, so not measured: encoder.layers.0.self_attn.out_proj, "
            "encoder.layers.1.self_attn.out_proj"
        )
    )
    text = str(trainer.numerics)
    assert " 0 / inf" not in text and "infx" not in text
    row = next(line for line in text.splitlines() if line.startswith(PLANTED + " "))
    assert row.split()[1:3] == ["inf", "none"]  # it made an inf: its largest is not 0


def _axis_ranges(figure) -> dict[str, tuple[float, float]]:
    """Each x axis's data range, as plotly's autorange would draw it (from its traces)."""
    ranges: dict[str, list[float]] = {}
    for trace in figure.data:
        xs = [float(x) for x in (trace.x if trace.x is not None else ()) if x is not None]
        ranges.setdefault(trace.xaxis or "x", []).extend(xs)
    for shape in figure.layout.shapes:
        if shape.x0 is not None:
            ranges.setdefault(shape.xref or "x", []).append(float(shape.x0))
    return {axis: (min(xs), max(xs)) for axis, xs in ranges.items() if xs}


def _boxes(figure, width: float) -> list[tuple[str, float, float, float, float]]:
    """Each annotation's text box (left, right, bottom, top) in pixels, estimated from its
    length and font, for a figure ``width`` pixels wide."""
    layout = figure.layout
    height = layout.height
    margin = layout.margin
    plot_w, plot_h = width - margin.l - margin.r, height - margin.t - margin.b
    ranges = _axis_ranges(figure)
    boxes = []
    for note in layout.annotations:
        if note.visible is False or not note.text:
            continue
        size = note.font.size or 16
        lines = note.text.split("<br>")
        text_w = max(len(line) for line in lines) * size * 0.55
        text_h = len(lines) * size * 1.3
        xref, yref = note.xref or "x", note.yref or "y"
        if xref == "paper":
            x = margin.l + note.x * plot_w
        else:
            axis = layout[f"xaxis{xref[1:]}"]
            low, high = ranges.get(xref, (0.0, 1.0))
            share = (note.x - low) / ((high - low) or 1.0)
            x = margin.l + (axis.domain[0] + share * (axis.domain[1] - axis.domain[0])) * plot_w
        if yref == "paper":
            y = margin.b + note.y * plot_h
        else:
            axis = layout[f"yaxis{yref.split()[0][1:]}"]
            y = margin.b + axis.domain[1] * plot_h
        y += note.yshift or 0
        left = {"left": x, "right": x - text_w}.get(note.xanchor, x - text_w / 2)
        bottom = {"bottom": y, "top": y - text_h}.get(note.yanchor, y - text_h / 2)
        boxes.append((note.text[:30], left, left + text_w, bottom, bottom + text_h))
    return boxes


def _overlapping(boxes) -> list[tuple[str, str]]:
    return [
        (a[0], b[0])
        for i, a in enumerate(boxes)
        for b in boxes[i + 1 :]
        if a[1] < b[2] and b[1] < a[2] and a[3] < b[4] and b[3] < a[4]
    ]


@pytest.mark.parametrize("width", [500, 900])
def test_no_label_on_the_dashboard_or_the_heatmaps_overlaps_another(watched_fit, width):
    trainer, sinks = watched_fit
    events = [e for e in trainer.history.events if e["kind"] in ("switch", "origin", "scale")]
    assert len(events) >= 3  # origin, remedy, scale given back, switch: close together
    for figure in [sinks[0].figure, dashboard_figure(trainer.history), trainer.numerics.figure()]:
        boxes = _boxes(figure, width)
        assert not _overlapping(boxes), _overlapping(boxes)


def test_every_event_is_in_a_markers_hover_and_in_the_list_under_the_plots(watched_fit):
    trainer, sinks = watched_fit
    figure = sinks[0].figure
    marks = next(trace for trace in figure.data if trace.name == "events")
    listed = figure.layout.annotations[-1].text
    assert "from step 9: encoder.layers.1.linear2 runs in fp32" in listed
    assert "from step 9: loss scale back to 65536" in listed
    assert any(text.startswith("step 1 skipped: float16 overflow") for text in marks.hovertext)
    assert len(marks.x) == len([e for e in trainer.history.events if e["kind"] != "layers"])


def test_colour_bars_stand_inside_their_own_panel_width(watched_fit):
    trainer, _ = watched_fit
    figure = trainer.numerics.figure()
    layout = figure.layout
    for trace in (t for t in figure.data if t.type == "heatmap"):
        own = layout[f"xaxis{(trace.xaxis or 'x')[1:]}"].domain
        bar = trace.colorbar
        assert bar.orientation == "h" and bar.lenmode == "fraction", bar
        left, right = bar.x - bar.len / 2, bar.x + bar.len / 2
        assert own[0] <= left and right <= own[1], (trace.xaxis, (left, right), own)


def test_the_non_finite_losses_are_markers_and_the_loss_axis_reaches_every_step(watched_fit):
    trainer, sinks = watched_fit
    history = trainer.history
    bad = [s for s, loss in zip(history.step, history.loss) if not math.isfinite(loss)]
    assert bad  # the overflowing steps' losses
    figure = dashboard_figure(history)
    marks = next(trace for trace in figure.data if trace.name == "non-finite loss")
    assert list(marks.x) == bad and marks.yaxis == "y5" and marks.xaxis == "x"


def test_the_title_says_the_mode_a_switch_changed_to(watched_fit):
    trainer, sinks = watched_fit
    title = sinks[0].figure.layout.title.text
    assert title.startswith("EncoderClassifier, fp16 on cpu") and title.endswith(
        "(now bf16, from step 11)"
    )


def test_buttons_say_the_whole_module_name_and_the_note_one_step(watched_fit):
    trainer, sinks = watched_fit
    (remedy,) = [sink for sink in sinks if isinstance(sink, RemedyView)]
    assert remedy.button.description == f"Run {PLANTED} in fp32"
    assert remedy.button.layout.width == "auto"
    memory = MemoryView(trainer)
    assert memory.button.layout.width == "auto"
    origin = next(e for e in trainer.history.events if e["kind"] == "origin")
    offered = History()
    offered.events.append(origin)
    fresh = RemedyView(trainer)
    fresh.update(offered)
    assert fresh.note.value == origin["message"]  # "step 1 skipped: ...", its step said once
    offered.events.append(next(e for e in trainer.history.events if e["kind"] == "switch"))
    fresh.update(offered)  # kept in fp32 by code, not by the button: the view says so
    assert fresh.button.disabled and fresh.note.value == (
        f"from step 9: {PLANTED} runs in fp32 (autocast off inside it), until the fit ends"
    )
    assert remedy.note.value == f"the fit ended: a click runs {PLANTED} in fp32 in the next fit"


def test_a_remedy_clicked_after_the_fit_waits_for_the_next_fit(capsys):
    trainer = encoder_trainer()
    sinks = make_dashboard("live", "", trainer.control)
    (remedy,) = [sink for sink in sinks if isinstance(sink, RemedyView)]
    trainer.dashboard = _Fanout(sinks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        trainer.fit([encoder_batch()] * 2)
    assert "the fit ended" in remedy.note.value and not remedy.button.disabled
    remedy.button.click()  # after the fit, as the page delivers it to an idle kernel
    linear2 = trainer.model.encoder.layers[1].linear2
    assert "forward" not in vars(linear2)
    assert remedy.note.value.endswith("from the next fit's first step, until that fit ends")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        history = trainer.fit([encoder_batch()] * 2)
    assert history.skipped[-2:] == [False, False]
    assert "forward" not in vars(linear2)
    capsys.readouterr()
