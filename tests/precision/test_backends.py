"""Backends: detection, devices, memory, capabilities; HPU logic with a stand-in module."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import mpnb
from mpnb.errors import DeviceUnavailableError, InvalidChoiceError
from mpnb.precision.backends import BACKENDS, available_device_types, backend_for, resolve_device
from mpnb.precision.backends.hpu import HpuBackend, import_habana_hpu


def test_auto_detection_falls_back_to_cpu_last():
    assert available_device_types()[-1] == "cpu"
    assert resolve_device() == torch.device(available_device_types()[0])


@pytest.mark.parametrize("bad", ["tpu", "gpu0", "", "cuda:x"])
def test_unknown_device_names_the_value_and_the_valid_ones(bad):
    with pytest.raises(InvalidChoiceError) as error:
        resolve_device(bad)
    assert repr(bad) in str(error.value) and "cpu" in str(error.value)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on a machine without CUDA"
)
def test_missing_cuda_says_what_is_available():
    with pytest.raises(DeviceUnavailableError, match="available here: .*cpu"):
        resolve_device("cuda")


def test_missing_habana_is_detected_without_importing_it():
    assert "habana_frameworks" not in sys.modules
    if import_habana_hpu() is None:
        with pytest.raises(DeviceUnavailableError, match="habana_frameworks"):
            resolve_device("hpu")
    assert "habana_frameworks" not in sys.modules


def test_cpu_index_out_of_range_is_rejected():
    with pytest.raises(DeviceUnavailableError, match="1 CPU"):
        resolve_device("cpu:3")


def test_cpu_backend_reports_real_numbers():
    cpu = backend_for("cpu")
    memory = cpu.memory()
    assert memory.used > 10 * 2**20 and memory.peak >= memory.used and memory.limit > memory.used
    caps = cpu.capabilities()
    assert set(caps) >= {"name", "cores", "amx_bf16", "avx512_bf16"}
    # Measured, not read off the flags: a CPU with AVX512-BF16 but no AMX keeps exact fp32 math.
    assert not cpu.has_fast_fp32_math() or caps["amx_bf16"] or caps["avx512_bf16"]
    assert cpu.autocast_dtypes() == (torch.bfloat16, torch.float16)
    convolutions = cpu.dtype_warnings(torch.float16)[0]
    # %amp has no model in view: the note says which models it is about, claiming nothing of others
    assert "47x" in convolutions and convolutions.startswith(
        "fp16 on CPU: a model with convolutions"
    )


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="peak resident memory resets only on Linux"
)
def test_cpu_memory_follows_the_process_and_its_peak_reset():
    import psutil

    cpu = backend_for("cpu")
    cpu.release_cached_memory()
    assert abs(cpu.memory().used - psutil.Process().memory_info().rss) < 16 * 2**20
    block = torch.ones(64 * 2**20)  # 256 MiB, every page touched
    high = cpu.memory()
    assert high.peak >= high.used > 256 * 2**20
    del block
    cpu.release_cached_memory()
    assert cpu.reset_peak_memory()
    after = cpu.memory()
    assert after.peak < high.peak - 128 * 2**20  # the peak starts again from what is resident now
    assert after.peak >= after.used


def test_cpu_fp32_math_is_described_for_students():
    text = backend_for("cpu").describe_fp32_math()
    assert text.startswith("exact") and "TF32 does not exist on CPUs" in text
    with mpnb.tf32(True, device="cpu"):
        reduced = backend_for("cpu").describe_fp32_math()
    assert reduced.startswith("reduced")
    if backend_for("cpu").has_fast_fp32_math():
        assert "with bf16 math" in reduced
    else:
        assert "no effect on this hardware" in reduced


def test_autocast_probe_reports_what_torch_silently_disables():
    cpu = backend_for("cpu")
    assert cpu.autocast_probe(torch.bfloat16) is None
    assert "not supported" in cpu.autocast_probe(torch.float64)


class StandInHpu(types.SimpleNamespace):
    """Habana's documented ``habana_frameworks.torch.hpu`` functions, with fixed answers."""

    def __init__(self):
        super().__init__(
            is_available=lambda: True,
            device_count=lambda: 2,
            get_device_name=lambda: "GAUDI2",
            memory_allocated=lambda index=None: 3 * 2**30,
            max_memory_allocated=lambda index=None: 5 * 2**30,
            memory_reserved=lambda index=None: 94 * 2**30,
        )


def test_hpu_backend_logic_with_habana_api():
    hpu = HpuBackend(load_hpu=StandInHpu)
    assert hpu.is_available() and hpu.device_count() == 2
    assert hpu.capabilities() == {"name": "GAUDI2", "count": 2, "bf16": True}
    memory = hpu.memory()
    assert (memory.used, memory.peak, memory.limit, memory.reserved) == (
        3 * 2**30,
        5 * 2**30,
        94 * 2**30,
        None,
    )
    assert "Gaudi2" in hpu.dtype_warnings(torch.float16)[0]
    assert "no reduced-precision fp32 math switch" in hpu.describe_fp32_math()


def test_hpu_loads_habana_once():
    calls = []
    hpu = HpuBackend(load_hpu=lambda: calls.append(1))
    assert not hpu.is_available() and not hpu.is_available()
    assert calls == [1]


def test_hpu_is_chosen_before_cpu_and_drives_the_session(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("with a CUDA GPU present, auto-detection rightly picks cuda")
    monkeypatch.setitem(BACKENDS, "hpu", HpuBackend(load_hpu=StandInHpu))
    assert resolve_device() == torch.device("hpu")
    assert resolve_device("hpu:1") == torch.device("hpu:1")
    with pytest.raises(DeviceUnavailableError, match="2 Habana"):
        resolve_device("hpu:2")
    assert mpnb.set_mode("bf16") == "bf16"  # torch.autocast("hpu") accepts bf16 on any build
    assert "hpu" in mpnb.status().device


def test_unavailable_backends_report_nothing_rather_than_fail():
    for backend in BACKENDS.values():
        if not backend.is_available():
            assert backend.autocast_dtypes() == () and backend.capabilities() == {}
            assert "no memory statistics" in backend.memory().source


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_backend_on_a_gpu():
    cuda = backend_for("cuda")
    caps = cuda.capabilities()
    assert caps["count"] >= 1 and "." in caps["compute_capability"]
    assert torch.float16 in cuda.autocast_dtypes()
    assert cuda.memory().limit > 0


def _no_effect_here() -> bool:
    return not backend_for("cpu").has_fast_fp32_math()


def test_the_device_report_says_what_reduced_fp32_math_does_here():
    report = mpnb.devices()
    said = report["cpu"].reduced_fp32_math
    assert said == backend_for("cpu").describe_reduced_fp32_math()
    assert ("no effect on this hardware" in said) == _no_effect_here()
    assert f"cpu reduced fp32 math: {said}" in report.to_text() and said in report._repr_html_()
    assert report.to_dict()["devices"][-1]["reduced_fp32_math"] == said


def test_comparisons_tf32_row_says_when_it_has_no_effect():
    import mpnb.examples as ex

    def make_run(mode):
        trainer, train, _ = ex.example_trainer(
            mode, "cpu", widths=(4, 8), batch_size=32, dashboard=None
        )
        return trainer, train

    result = mpnb.compare(make_run, modes=["fp32", "tf32"], steps=2, warmup=1, progress=None)
    notes = str(result).partition("\nnotes:\n")[2]
    assert ("- tf32: no effect on this hardware" in notes) == _no_effect_here()
    assert (
        result.rows()[1]["speedup_verdict"] == "no effect on this hardware"
    ) == _no_effect_here()
    assert "fp32: no effect" not in notes
