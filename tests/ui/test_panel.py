"""The control panel and live control of a fit, headless: widgets drive the core and follow it."""

from __future__ import annotations

import math

import pytest
import torch

import mpnb.examples as ex
from mpnb.oplists.lists import OpLists
from mpnb.precision.modes import Fp32Math
from mpnb.precision.policy import session
from mpnb.training.control import FitControl
from mpnb.training.history import History
from mpnb.training.telemetry import Sink
from mpnb.ui.plots.figure import dashboard_figure
from mpnb.ui.plots.live import LiveDashboard
from mpnb.ui.widgets.fit_controls import FitButtons
from mpnb.ui.widgets.panel import ControlPanel
from tests.conftest import dispatcher_state, run, usage_error


@pytest.fixture
def panel():
    control_panel = ControlPanel()
    yield control_panel
    control_panel.close()


def test_panel_clicks_drive_the_session(panel):
    panel.mode.value = "bf16"
    assert session.mode == "bf16" and "bf16" in panel.status_view.value
    panel.reduced_fp32_math.value = True
    assert session.fp32_math.level is Fp32Math.REDUCED
    panel.mode.value = "fp32"
    assert session.mode == "fp32" and panel.reduced_fp32_math.value is False
    panel.reduced_fp32_math.value = True  # in fp32/tf32 the mode owns the switch: this is tf32
    assert session.mode == "tf32" and panel.mode.value == "tf32"
    panel.list_name.value, panel.op_names.value = "fp32", "linear, F.softmax"
    panel.add_button.click()
    assert (
        sorted(session.oplists.lists.fp32) == ["linear", "softmax"] and panel.op_names.value == ""
    )
    assert "linear, softmax" in panel.lists_view.value
    panel.op_names.value = "softmax"
    panel.remove_button.click()
    assert list(session.oplists.lists.fp32) == ["linear"]
    panel.preset.value = "resnet50"
    panel.preset_button.click()
    assert session.oplists.lists == OpLists.preset("resnet50")
    panel.reset_button.click()
    assert not session.oplists.lists and "none" in panel.lists_view.value


def test_the_magics_move_a_panel_already_on_screen(ip, panel):
    run(ip, "%amp bf16")
    assert panel.mode.value == "bf16"
    run(ip, "%tf32 on")
    assert panel.reduced_fp32_math.value is True
    run(ip, "%oplist add fp32 layer_norm")
    assert "layer_norm" in panel.lists_view.value
    run(ip, "%amp off")
    assert panel.mode.value == "off" and panel.reduced_fp32_math.value is False
    panel.mode.value = "fp16"
    run(ip, "cell_dtype = linear(x).dtype")
    assert ip.user_ns["cell_dtype"] == torch.float16  # the next cell runs in the panel's mode


def test_invalid_op_names_are_refused_with_a_message_and_change_nothing(panel):
    session.oplists.add("fp32", ["linear"])
    before, table = session.oplists.lists.copy(), dispatcher_state()
    panel.list_name.value, panel.op_names.value = "fp32", "softmax, lineer"
    panel.add_button.click()
    assert "unknown op &#x27;lineer&#x27;; valid: linear" in panel.message_view.value
    assert session.oplists.lists == before and dispatcher_state() == table
    assert panel.op_names.value == "softmax, lineer"  # kept, to fix the typo
    panel.op_names.value = ""
    panel.add_button.click()
    assert "type one or more op names" in panel.message_view.value
    panel.op_names.value = "softmax"
    panel.add_button.click()
    assert panel.message_view.value == "" and "softmax" in session.oplists.lists.fp32


def test_unloading_the_extension_disables_the_panel(ip, panel):
    ip.run_line_magic("unload_ext", "mpnb")
    assert (
        panel.mode.disabled and panel.add_button.disabled and "unloaded" in panel.message_view.value
    )
    assert "<code>%load_ext mpnb</code>" in panel.message_view.value
    assert panel.mode.value == "off"


@pytest.mark.parametrize(
    "name", ["<img/src=x/onerror=alert(1)>", "<code><img/src=x/onerror=alert(1)>"]
)
def test_markup_typed_as_an_op_name_is_shown_as_text_never_rendered(panel, name):
    panel.list_name.value, panel.op_names.value = "fp32", name
    panel.add_button.click()
    shown = panel.message_view.value
    assert (
        "unknown op" in shown
        and "<img" not in shown
        and "&lt;img/src=x/onerror=alert(1)&gt;" in shown
    )


def test_amp_panel_in_a_terminal_says_where_the_panel_shows_and_what_to_type(ip, capsys):
    # a terminal shell has no kernel to show widgets in: their repr is no panel
    run(ip, "%amp panel")
    shown = capsys.readouterr().out
    assert "VBox(" not in shown and "a notebook" in shown and "%amp MODE" in shown
    assert "mpnb status" in shown  # and the session as it is
    assert "mode" in shown and "off" in shown  # the status, as %amp status shows it
    assert "--device goes with a mode" in usage_error(ip, "%amp panel --device cpu")


def test_a_closed_panel_stops_listening():
    control_panel = ControlPanel()
    control_panel.close()
    session.set_mode("bf16")
    assert control_panel.mode.value == "off"


# --- live control of a running fit ----------------------------------------------------------


class AtStep(Sink):
    """Runs ``action(trainer)`` once, when the history reaches ``step``; flushes every step."""

    def __init__(self, step: int, action) -> None:
        self.step, self.action, self.done = step, action, False

    def due(self, now: float) -> bool:
        return True

    def update(self, history: History) -> None:
        if not self.done and len(history) >= self.step:
            self.done = True
            self.action()


def small_trainer(mode="bf16", **options):
    trainer, train, _ = ex.example_trainer(mode, "cpu", widths=(4, 8), batch_size=32, **options)
    return trainer, train


def test_stop_finishes_the_step_keeps_everything_and_returns_the_history():
    trainer, train = small_trainer("fp16", dashboard=None)
    trainer.amp.recorder.attach(AtStep(4, trainer.control.stop))
    history = trainer.fit(train, epochs=3)
    assert len(history) == 4 and history.step == [1, 2, 3, 4]
    assert history.events[-1]["message"] == "stopped" and trainer.control.state == "idle"
    assert all(math.isfinite(p.sum().item()) for p in trainer.model.parameters())
    assert all(p.grad is None for p in trainer.model.parameters())  # no half-finished window
    assert trainer.amp.scaler.get_scale() == history.loss_scale[-1] or history.skipped[-1]
    again = trainer.fit(train)  # finishes the planned run from where it stopped
    assert again.step == list(range(1, len(again) + 1)) and len(again) == 3 * len(train)


def test_pause_holds_between_steps_and_resume_goes_on():
    trainer, train = small_trainer(dashboard=None)
    polls = []

    def poll():  # stands in for the kernel's widget messages: resume after a few polls
        polls.append(trainer.control.state)
        if len(polls) > 8 and trainer.control.state == "paused":
            trainer.control.resume()

    trainer.control.pollers.append(poll)
    trainer.amp.recorder.attach(AtStep(3, trainer.control.pause))
    history = trainer.fit(train, max_steps=6)
    assert len(history) == 6 and polls.count("paused") >= 5
    assert max(history.step_time[3:]) < 0.2  # the pause (>= 0.25 s) is not counted as step time


def test_a_mode_switch_during_fit_takes_effect_at_the_next_step_and_is_recorded():
    trainer, train = small_trainer(dashboard=None)
    trainer.amp.recorder.attach(
        AtStep(3, lambda: session.set_mode("fp16")),
        AtStep(6, lambda: session.set_mode("bf16")),
    )
    history = trainer.fit(train, max_steps=9)
    assert history.mode == ["bf16"] * 3 + ["fp16"] * 3 + ["bf16"] * 3
    switches = [(e["step"], e["message"]) for e in history.events if e["kind"] == "switch"]
    assert switches == [(4, "mode bf16 -> fp16"), (7, "mode fp16 -> bf16")]
    assert (
        not math.isnan(history.loss_scale[3]) and history.loss_scale[3] == 2.0**16
    )  # a real scaler for fp16
    assert trainer.amp.scaler is not None and not trainer.amp.scaler.is_enabled()
    session.oplists.add("fp32", ["linear"])
    more = trainer.fit(train, max_steps=1)
    assert more.mode[-1] == "bf16"


def test_fp32_math_switched_during_an_fp32_fit_is_where_the_session_wants_it_after():
    trainer, train = small_trainer("fp32", dashboard=None)
    precision_before = torch.get_float32_matmul_precision()
    trainer.amp.recorder.attach(AtStep(2, lambda: session.set_tf32(True)))
    history = trainer.fit(train, max_steps=4)
    assert history.mode == ["fp32", "fp32", "tf32", "tf32"]
    assert (
        session.fp32_math.level is Fp32Math.REDUCED
        and torch.get_float32_matmul_precision() == "medium"
    )
    session.reset()
    assert torch.get_float32_matmul_precision() == precision_before


def test_op_list_changes_during_fit_are_noted():
    trainer, train = small_trainer(dashboard=None)
    trainer.amp.recorder.attach(AtStep(2, lambda: session.oplists.add("fp32", ["linear"])))
    history = trainer.fit(train, max_steps=3)
    assert [e["message"] for e in history.events if e["kind"] == "switch"] == [
        "op lists: lower 0, fp32 1"
    ]


def test_buttons_drive_the_control_and_show_its_state():
    control = FitControl()
    buttons = FitButtons(control)
    control.begin()
    buttons.pause_button.value = True
    assert control.state == "paused" and buttons.pause_button.description == "Resume"
    buttons.pause_button.value = False
    assert control.state == "running"
    buttons.stop_button.click()
    assert control.checkpoint().stop and buttons.stop_button.disabled
    control.end()
    buttons.close(History())
    assert buttons.pump not in control.pollers and buttons.state_label.value == "finished"


def test_buttons_of_a_fit_its_cell_abandoned_say_so_to_the_end():
    control = FitControl()
    buttons = FitButtons(control)
    control.begin()
    control.abandon("the cell that ran it raised ValueError: boom")
    assert (
        control.state == "idle" and buttons.stop_button.disabled and buttons.pause_button.disabled
    )
    buttons.close(History())
    assert buttons.state_label.value == "ended: its cell raised an error"


def test_switches_are_drawn_as_labelled_lines():
    history = History()
    history.extend({"step": [1, 2, 3, 4], "loss": [1.0, 0.9, 0.8, 0.7]})
    history.note("mode bf16 -> fp16", kind="switch", step=3)
    live = LiveDashboard("demo")
    live.close(history)
    for figure in (live.figure, dashboard_figure(history)):
        assert [shape.x0 for shape in figure.layout.shapes] == [2.5] * 4
        assert figure.layout.annotations[-1].text == "from step 3: mode bf16 -> fp16"


def test_the_fp32_math_switch_says_when_it_has_no_effect_here(panel):
    from mpnb.precision.backends import backend_for

    no_effect = not backend_for("cpu").has_fast_fp32_math()
    assert ("no effect on this hardware" in panel.reduced_fp32_math.description) == no_effect
    assert panel.reduced_fp32_math.tooltip == backend_for("cpu").describe_reduced_fp32_math()


def test_panel_as_a_cells_last_line_shows_once_without_a_text_line(ip):
    from IPython.utils.capture import capture_output

    def cell(code):  # counted like a notebook cell (the execution count moves on)
        with capture_output() as shown:
            assert ip.run_cell(code, store_history=True).success
        return shown

    # this shell has no kernel to draw widgets: each showing is one line saying where it shows
    shown = cell("import mpnb\nmpnb.panel()")
    assert not shown.outputs and shown.stdout.count("shown in a notebook") == 1
    assert "<mpnb.ControlPanel" not in shown.stdout and "VBox" not in shown.stdout
    assert cell("p = mpnb.panel()").stdout.count("shown in a notebook") == 1
    assert cell("p").stdout.count("shown in a notebook") == 1  # a later cell: shown again
    cell("p.close()")
