"""A mode added in one module with one registration call works everywhere a mode is taken:
the Trainer, ``%amp``, the control panel, compare and the CLI, with no other edit."""

from __future__ import annotations

import pytest
import torch

import mpnb
import mpnb.examples as ex
from mpnb.cli import main
from mpnb.precision.modes import mode_names, register, unregister
from mpnb.precision.policy import session
from tests.conftest import run
from tests.modes.brain16 import Brain16


@pytest.fixture
def brain16():
    register(Brain16)  # the one registration call
    yield
    unregister("brain16")


def _autocast_seen(model: torch.nn.Module) -> list[torch.dtype | None]:
    """The autocast dtype each training forward pass of ``model`` ran under."""
    seen: list[torch.dtype | None] = []

    def note(*_):
        enabled = torch.is_autocast_enabled("cpu")
        seen.append(torch.get_autocast_dtype("cpu") if enabled else None)

    model.register_forward_pre_hook(note)
    return seen


def test_the_trainer_trains_in_a_registered_mode(brain16):
    trainer, train, _ = ex.example_trainer("brainfloat", "cpu", widths=(4, 8), dashboard=None)
    seen = _autocast_seen(trainer.model)
    history = trainer.fit(train, max_steps=3)
    assert history.mode == ["brain16"] * 3 and history.meta["mode"] == "brain16"
    assert seen == [torch.bfloat16] * 3
    assert trainer.describe().startswith("DigitsCNN, brain16 on cpu")


def test_amp_switches_the_session_to_it_and_status_says_so(brain16, ip):
    run(ip, "%amp brain16")
    assert session.mode == "brain16"
    assert run(ip, "torch.nn.Linear(8, 8)(x).dtype") == torch.bfloat16
    run(ip, "%amp status")  # prints, returns nothing
    assert mpnb.status().rows()[0][1].startswith("brain16 (autocast to bfloat16 under another name")


def test_the_panel_offers_it_and_a_click_selects_it(brain16):
    from mpnb.ui.widgets.panel import ControlPanel

    panel = ControlPanel()
    try:
        assert "brain16" in panel.mode.options
        panel.mode.value = "brain16"
        assert session.mode == "brain16" and "brain16" in panel.status_view.value
    finally:
        panel.close()


def test_compare_runs_it_beside_fp32(brain16):
    def make_run(mode):
        trainer, train, _ = ex.example_trainer(mode, "cpu", widths=(4, 8), dashboard=None)
        return trainer, train

    comparison = mpnb.compare(make_run, modes=["fp32", "brain16"], steps=2, warmup=0, progress=None)
    rows = {row["mode"]: row for row in comparison.rows()}
    assert rows["brain16"]["timed_steps"] == 2 and not rows["brain16"]["skipped_reason"]


def test_the_cli_trains_in_it(brain16, tmp_path, capsys):
    status = main(["train", "--mode", "brain16", "--steps", "2", "--out", str(tmp_path / "run")])
    assert status == 0 and "brain16 on cpu" in capsys.readouterr().out


def test_unregistered_it_is_unknown_again():
    assert "brain16" not in mode_names()
    with pytest.raises(mpnb.MpnbError, match="unknown mode 'brain16'"):
        mpnb.set_mode("brain16")


def test_its_format_is_measured_advised_and_proved_by_the_whatif(brain16, ip):
    from mpnb.numerics.whatif import default_thresholds

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    loss = torch.nn.functional.cross_entropy
    result = mpnb.whatif(model, batch, loss, formats=["brain16", "bf16"])
    ours = [r for r in result.rows if r["format"] == "brain16"]
    theirs = [r for r in result.rows if r["format"] == "bf16"]
    assert (
        len(ours) == 5 and [dict(r, format="bf16") for r in ours] == theirs
    )  # 2 layers x 3, less the first input_grad
    assert default_thresholds()["brain16"] == Brain16.matmul_formats[0].threshold
    assert result.recommend("brain16") == []

    def make_run(mode):
        trainer, train, _ = ex.example_trainer(mode, "cpu", widths=(4, 8), dashboard=None)
        return trainer, train

    proof = result.prove(make_run, "brain16", steps=2)
    assert proof.mode == "brain16" and len(proof.losses) == 2
    ip.user_ns.update(model=model, batch=batch, loss=loss)
    shown = run(ip, "%whatif model batch --loss loss --formats brain16")
    assert shown.formats == ("brain16",)


def test_a_whatif_result_outlives_its_formats_mode(ip):
    register(Brain16)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
        batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
        ip.user_ns.update(model=model, batch=batch, loss=torch.nn.functional.cross_entropy)
        result = run(ip, "%whatif model batch --loss loss --formats brain16,bf16")
    finally:
        unregister("brain16")
    assert result.formats == ("brain16", "bf16")
    assert result.recommend("brain16") == [] and "brain16" in result._repr_html_()
    assert "brain16 keeps 0" in repr(result) and result.figure() is not None
