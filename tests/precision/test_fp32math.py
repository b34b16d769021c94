"""The fp32-math switch restores torch's flags exactly, from any starting state."""

from __future__ import annotations

import pytest
import torch

import mpnb
from mpnb.oplists import OpListOverride, OpLists
from mpnb.precision.backends import backend_for
from mpnb.precision.fp32math import Fp32MathSnapshot, Fp32MathSwitch, probe_reduced_math, read_flags
from mpnb.precision.modes import Fp32Math

PRISTINE = Fp32MathSnapshot.capture()


def _legacy_high():
    torch.set_float32_matmul_precision("high")


def _legacy_medium():
    torch.set_float32_matmul_precision("medium")


def _cudnn_off():
    torch.backends.cudnn.allow_tf32 = False


def _fine_grained_conv():
    torch.backends.mkldnn.conv.fp32_precision = "bf16"


def _fine_grained_matmul():  # leaves the legacy getters raising: the user's own doing
    torch.backends.cuda.matmul.fp32_precision = "tf32"


START_STATES = {
    "torch defaults": lambda: None,
    "legacy high": _legacy_high,
    "legacy medium": _legacy_medium,
    "cudnn tf32 off": _cudnn_off,
    "fine-grained conv": _fine_grained_conv,
    "fine-grained matmul": _fine_grained_matmul,
}

ACTIONS = {
    "cpu reduced": [("cpu", Fp32Math.REDUCED)],
    "cpu exact": [("cpu", Fp32Math.EXACT)],
    "cuda reduced": [("cuda", Fp32Math.REDUCED)],
    "cuda exact": [("cuda", Fp32Math.EXACT)],
    "cpu reduced, then cuda exact": [("cpu", Fp32Math.REDUCED), ("cuda", Fp32Math.EXACT)],
}


@pytest.fixture
def start_state(request):
    START_STATES[request.param]()
    yield request.param
    PRISTINE.restore()


def _raising(flags):
    return {name for name, value in flags.items() if str(value).startswith("error:")}


@pytest.mark.parametrize("start_state", list(START_STATES), indirect=True)
@pytest.mark.parametrize("action", list(ACTIONS))
def test_release_restores_every_getter_exactly(start_state, action):
    before = read_flags()
    switch = Fp32MathSwitch()
    for device_type, level in ACTIONS[action]:
        switch.set(backend_for(device_type), level)
        # mpnb never makes a getter raise that did not raise before.
        assert _raising(read_flags()) <= _raising(before)
    switch.release()
    assert read_flags() == before


def test_pristine_flags_are_all_readable():
    assert _raising(read_flags()) == set()


def test_levels_set_the_documented_flags():
    switch = Fp32MathSwitch()
    switch.set(backend_for("cpu"), Fp32Math.REDUCED)
    assert torch.get_float32_matmul_precision() == "medium"
    assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
    assert torch.backends.mkldnn.conv.fp32_precision == "bf16"
    assert (switch.level, switch.backend.type) == (Fp32Math.REDUCED, "cpu")
    switch.set(backend_for("cuda"), Fp32Math.REDUCED)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.backends.mkldnn.conv.fp32_precision == "none"  # the cpu level was undone first
    switch.set(backend_for("cuda"), Fp32Math.EXACT)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    switch.release()
    assert switch.level is None and switch.backend is None


def test_release_without_set_changes_nothing():
    before = read_flags()
    Fp32MathSwitch().release()
    assert read_flags() == before


def test_failed_apply_restores_and_reraises():
    class Broken(type(backend_for("cpu"))):
        def apply_fp32_math(self, level, legacy=True):
            torch.set_float32_matmul_precision("medium")
            raise KeyboardInterrupt

    before = read_flags()
    switch = Fp32MathSwitch()
    with pytest.raises(KeyboardInterrupt):
        switch.set(Broken(), Fp32Math.REDUCED)
    assert read_flags() == before and switch.level is None


def _cpu_probe():
    return probe_reduced_math(backend_for("cpu"), torch.device("cpu"))


def _cpu_matmul_errors() -> tuple[float, float]:
    """Relative error of a 512x512 fp32 matmul against float64, with exact and with reduced math."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    reference = a.double() @ b.double()
    switch = Fp32MathSwitch()
    exact_error = ((a @ b).double() - reference).abs().max() / reference.abs().max()
    switch.set(backend_for("cpu"), Fp32Math.REDUCED)
    reduced_error = ((a @ b).double() - reference).abs().max() / reference.abs().max()
    switch.release()
    return float(exact_error), float(reduced_error)


def test_the_cpu_reduced_math_claim_is_what_this_cpu_really_does():
    """On an AMX CPU reduced math changes results (~1e-3); on AVX512-BF16 alone, or neither, it does not."""
    exact_error, reduced_error = _cpu_matmul_errors()
    changes_results = reduced_error > 10 * exact_error
    cpu = backend_for("cpu")
    assert cpu.has_fast_fp32_math() == changes_results, (exact_error, reduced_error)
    with mpnb.tf32(True, device="cpu"):
        described = cpu.describe_fp32_math()
        warnings = mpnb.status().warnings
    if changes_results:
        assert "with bf16 math" in described
        assert not any("no effect" in note for note in warnings)
    else:
        assert "no effect on this hardware" in described and "bf16 math on" not in described
        assert "reduced-precision fp32 math has no effect on this CPU" in warnings


def test_the_measurement_leaves_flags_and_random_state_as_found():
    probe_reduced_math.cache_clear()
    pristine = Fp32MathSnapshot.capture()
    torch.set_float32_matmul_precision(
        "medium"
    )  # a user's own setting, in force while mpnb measures
    try:
        flags, rng = read_flags(), torch.get_rng_state()
        probe = _cpu_probe()
        assert read_flags() == flags and torch.equal(torch.get_rng_state(), rng)
    finally:
        pristine.restore()
    assert probe.exact_error < 1e-5 and probe.has_effect == (
        probe.reduced_error > 10 * probe.exact_error
    )
    assert _cpu_probe() is probe  # measured once per process


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tf32_changes_cuda_matmul_results_on_ampere():
    if not backend_for("cuda").has_fast_fp32_math():
        pytest.skip("needs an Ampere or newer GPU (TF32 units)")
    a, b = torch.randn(1024, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda")
    reference = a.double() @ b.double()
    switch = Fp32MathSwitch()
    exact_error = ((a @ b).double() - reference).abs().max()
    switch.set(backend_for("cuda"), Fp32Math.REDUCED)
    reduced_error = ((a @ b).double() - reference).abs().max()
    switch.release()
    assert reduced_error > 10 * exact_error


def test_the_measurement_is_the_same_inside_an_autocast_cell_with_op_lists_and_a_trace():
    """A first `%tf32 status` inside a `%amp bf16` cell must not measure bf16 autocast's matmul."""
    probe_reduced_math.cache_clear()
    plain = _cpu_probe()
    probe_reduced_math.cache_clear()
    with (
        OpListOverride(OpLists.preset("hmp"), ["cpu"]),
        torch.autocast("cpu", dtype=torch.bfloat16),
        mpnb.trace() as recorded,
    ):
        inside = _cpu_probe()
    assert inside == plain and inside.exact_error < 1e-5
    assert len(recorded.rows) == 0, (
        "the measurement is not the user's work: it stays out of a trace"
    )


def test_the_measurement_is_of_fp32_whatever_the_default_dtype():
    probe_reduced_math.cache_clear()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        probe = _cpu_probe()
    finally:
        torch.set_default_dtype(previous)
        probe_reduced_math.cache_clear()
    assert probe.exact_error > 1e-9, "a float64 matmul was measured"
