"""The core API without IPython: autocast, modes, the tf32 switch, status, devices."""

from __future__ import annotations

import json

import pytest
import torch

import mpnb
from mpnb.errors import DeviceUnavailableError, InvalidChoiceError, MpnbError
from mpnb.precision.policy import session
from tests.conftest import policy_state, torch_state


def _outputs():
    """Output dtypes of a Linear, a conv and a softmax on fp32 inputs."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    return (
        torch.nn.Linear(8, 4)(x).dtype,
        torch.nn.Conv2d(3, 4, 3)(x).dtype,
        torch.softmax(x, dim=-1).dtype,
    )


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_autocast_lowers_linear_and_conv_and_leaves_softmax(dtype):
    expected = mpnb.precision.names.parse_dtype(dtype)
    with mpnb.autocast(dtype, device="cpu") as settings:
        assert _outputs() == (expected, expected, torch.float32)
        assert settings.dtype is expected and not torch.is_autocast_cache_enabled()
    assert _outputs() == (torch.float32,) * 3


def test_autocast_restores_after_exception_and_interrupt():
    before = torch_state()
    for error in (ValueError, KeyboardInterrupt):
        with pytest.raises(error), mpnb.autocast("bf16", device="cpu", cache=True):
            assert torch.is_autocast_enabled("cpu") and torch.is_autocast_cache_enabled()
            raise error
        assert torch_state() == before


def test_nested_autocast_restores_each_level():
    with mpnb.autocast("bf16", device="cpu"):
        with mpnb.autocast("fp16", device="cpu"):
            assert torch.get_autocast_dtype("cpu") is torch.float16
            with mpnb.autocast(device="cpu", enabled=False):
                assert not torch.is_autocast_enabled("cpu")
            assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") is torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


def test_one_autocast_object_can_be_reentered():
    context = mpnb.autocast("bf16", device="cpu")
    with context, context:
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (
            {"dtype": "fp8"},
            InvalidChoiceError,
            r"'fp8'.*a mode that swaps a model's layers.*mode='fp8'",
        ),
        (
            {"dtype": "fp5"},
            InvalidChoiceError,
            r"'fp5'; valid: bf16 \(bfloat16\), fp16 \(float16, half\)$",
        ),
        ({"dtype": "float32"}, InvalidChoiceError, "turn autocast off"),
        ({"device": "tpu"}, InvalidChoiceError, "'tpu'"),
    ],
)
def test_bad_autocast_requests_fail_before_touching_anything(kwargs, error, words):
    before = torch_state()
    with pytest.raises(error, match=words):
        mpnb.autocast(**kwargs)
    assert torch_state() == before


def test_torchs_order_and_keyword_are_taken_or_named():
    # mpnb.autocast("cpu", torch.bfloat16) said "unknown device torch.bfloat16", and
    # device_type= (torch.autocast's keyword) was a bare TypeError
    before = torch_state()
    with pytest.raises(MpnbError, match=r"the dtype goes first: mpnb.autocast\(torch.bfloat16, "
                       r"device='cpu'\) \(torch.autocast takes the device first\)"):  # fmt: skip
        mpnb.autocast("cpu", torch.bfloat16)
    with pytest.raises(
        MpnbError, match=r"'cuda' is a device: mpnb.autocast\(dtype, device='cuda'\)"
    ):
        mpnb.autocast("cuda")
    assert torch_state() == before
    with mpnb.autocast(device_type="cpu", dtype=torch.bfloat16):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled(
            "cpu"
        )
    assert torch_state() == before


def test_default_cast_cache_off_keeps_a_training_loop_learning():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 8)
    y = x.sum(1, keepdim=True)
    losses = []
    with mpnb.autocast("bf16", device="cpu"):  # one block around many steps, like a notebook cell
        for _ in range(30):
            loss = (model(x).float() - y).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    assert losses[-1] < 0.05 * losses[0]


def test_autocast_follows_the_session_mode():
    mpnb.set_mode("fp16", device="cpu")
    with mpnb.autocast() as settings:
        assert settings.dtype is torch.float16 and settings.device == torch.device("cpu")
    for mode in ("fp32", "tf32"):  # modes that run without autocast: the block too
        mpnb.set_mode(mode)
        with mpnb.autocast() as settings:
            assert not settings.enabled and not torch.is_autocast_enabled("cpu")
            assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype is torch.float32
        with mpnb.autocast("bf16") as settings:  # a dtype asked for wins
            assert settings.enabled and settings.dtype is torch.bfloat16
    mpnb.set_mode("off")
    with mpnb.autocast() as settings:  # no mode chosen: the device's preferred dtype
        assert settings.enabled and settings.dtype is torch.bfloat16


class AutocastInside(torch.nn.Module):
    """A model whose forward holds ``with mpnb.autocast():``; ``seen``: the dtype autocast ran
    in there at each call (None: off)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)
        self.seen: list[torch.dtype | None] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with mpnb.autocast():
            on = torch.is_autocast_enabled("cpu")
            self.seen.append(torch.get_autocast_dtype("cpu") if on else None)
            return self.linear(x)


def _fit_one_step(model: torch.nn.Module, mode: str) -> None:
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), 0.1), torch.nn.functional.cross_entropy,
        mode=mode, device="cpu", dashboard=None,
    )  # fmt: skip
    trainer.fit([(torch.randn(4, 8), torch.randint(0, 4, (4,)))], max_steps=1)


def test_autocast_without_a_dtype_inside_an_autocast_keeps_what_runs_there():
    # a model's forward holding `with mpnb.autocast():` inside a bf16 fit of an fp32 session
    mpnb.set_mode("fp32", device="cpu")
    for mode, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        model = AutocastInside()
        _fit_one_step(model, mode)
        assert model.seen[-1] is dtype, (mode, model.seen)
    with mpnb.autocast("bf16"), mpnb.autocast() as inner:  # an outer block's, likewise
        assert inner.enabled and inner.dtype is torch.bfloat16


def test_autocast_without_a_dtype_inside_a_fit_without_autocast_runs_none():
    # session mode off (autocast would be bf16), a fit in fp32 or tf32: the fit's mode is in force
    mpnb.set_mode("off", device="cpu")
    for mode in ("fp32", "tf32"):
        model = AutocastInside()
        _fit_one_step(model, mode)
        assert model.seen[-1] is None, (mode, model.seen)
    with mpnb.autocast() as after:  # the fit's mode ended with it: the session's again
        assert after.enabled and after.dtype is torch.bfloat16


def test_modes_set_fp32_math_and_off_restores_it():
    mpnb.set_mode("tf32", device="cpu")
    assert torch.get_float32_matmul_precision() == "medium"
    mpnb.set_mode("bf16")  # autocast modes leave fp32 math as it is
    assert torch.get_float32_matmul_precision() == "medium"
    mpnb.set_mode("fp32")
    assert torch.get_float32_matmul_precision() == "highest"
    assert torch.backends.mkldnn.conv.fp32_precision == "ieee"
    mpnb.set_mode("off")
    assert torch.backends.mkldnn.conv.fp32_precision == "none"
    assert mpnb.get_mode() == "off"


@pytest.mark.parametrize("mode, device", [("fp4", None), ("bf16", "tpu"), ("", None)])
def test_bad_set_mode_changes_nothing(mode, device):
    mpnb.set_mode("tf32", device="cpu")
    before = policy_state()
    with pytest.raises(MpnbError):
        mpnb.set_mode(mode, device)
    assert policy_state() == before


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on a machine without CUDA"
)
def test_set_mode_on_missing_device_changes_nothing():
    before = policy_state()
    with pytest.raises(DeviceUnavailableError, match="cuda"):
        mpnb.set_mode("fp16", device="cuda")
    assert policy_state() == before


def test_tf32_as_switch_and_as_context_manager():
    mpnb.tf32(True, device="cpu")
    assert torch.get_float32_matmul_precision() == "medium"
    mpnb.tf32(False)
    assert torch.get_float32_matmul_precision() == "highest"
    before = torch_state()
    for error in (RuntimeError, KeyboardInterrupt):
        with pytest.raises(error), mpnb.tf32(device="cpu"):
            assert torch.get_float32_matmul_precision() == "medium"
            raise error
        assert torch_state() == before


def test_tf32_in_fp32_mode_moves_between_fp32_and_tf32():
    mpnb.set_mode("fp32", device="cpu")
    with mpnb.tf32(True):
        assert mpnb.get_mode() == "tf32"
    assert mpnb.get_mode() == "fp32"
    assert torch.get_float32_matmul_precision() == "highest"
    mpnb.tf32(True)
    mpnb.tf32(False)
    assert mpnb.get_mode() == "fp32"


def test_status_text_and_html():
    mpnb.set_mode("fp16", device="cpu")
    with mpnb.autocast("bf16", device="cpu"):
        current = mpnb.status()
    assert current.mode == "fp16" and current.active_here == "bf16 autocast on cpu"
    text = str(current)
    assert "fp16 in every cell" in text and "47x" in text and "GradScaler" in text
    assert "<table>" in current._repr_html_() and "mpnb-warnings" in current._repr_html_()
    assert repr(current) == "<mpnb.Status: mpnb status>"


def test_the_status_table_of_names_and_values_has_no_blank_header_row():
    shown = mpnb.status()._repr_html_()
    assert "<table><tbody><tr><td style='text-align:left'>mode</td>" in shown and "<th" not in shown


def test_status_outside_ipython_says_where_the_mode_applies():
    mpnb.set_mode("bf16", device="cpu")
    assert any("mpnb.autocast()" in w for w in mpnb.status().warnings)
    session.reset()
    assert mpnb.status().warnings == ()


def test_devices_report_checks_real_outputs():
    report = mpnb.devices()
    cpu = report["cpu"]
    assert cpu.available and cpu.verified == {"bf16": "bf16", "fp16": "fp16"}
    assert json.loads(json.dumps(report.to_dict()))["devices"][-1]["type"] == "cpu"
    assert "bf16 -> bf16" in str(report) and "<table>" in report._repr_html_()
    for info in report.devices:
        assert info.available or info.detail.startswith("no ")
