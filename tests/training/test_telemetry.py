"""The recorder adds no host reads per step; History round-trips; decimation keeps spikes."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import mpnb
from mpnb.training.history import COLUMNS, History
from mpnb.training.telemetry import Recorder
from mpnb.ui.plots.decimate import MinMaxSeries

HOST_READ = "aten._local_scalar_dense.default"  # .item(), float(t), get_scale(), bool(t)


class OpCounter(TorchDispatchMode):
    """Counts every aten op torch dispatches, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] = self.counts.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))

    def host_copies(self) -> int:
        return self.counts.get("aten._to_copy.default", 0)


def problem(steps=20):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    return model, [(torch.randn(8, 6), torch.randn(8, 3)) for _ in range(steps)]


def hand_written_steps(model, data, optimizer, scaler):
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)


def amp_steps(model, data, amp):
    for x, y in data:
        with amp.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        amp.backward(loss)
        amp.step(samples=len(x))


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_recorder_adds_no_host_reads_per_step_and_copies_once_per_flush(mode):
    model, data = problem()
    # torch.amp's own recipe, counted as the baseline: GradScaler.step itself reads found_inf.
    with OpCounter() as baseline:
        scaler = torch.amp.GradScaler("cpu", enabled=mode == "fp16")
        hand_written_steps(model, data, torch.optim.SGD(model.parameters(), lr=0.01), scaler)

    model, data = problem()
    amp = mpnb.AmpStep(
        torch.optim.SGD(model.parameters(), lr=0.01), mode=mode, device="cpu", flush_every=8
    )
    with OpCounter() as ours:
        amp_steps(model, data, amp)
        mid_run_copies = amp.recorder.host_transfers
        amp.close()
    assert ours.counts.get(HOST_READ, 0) == baseline.counts.get(HOST_READ, 0)
    assert mid_run_copies == 2  # after steps 8 and 16; the last 4 rows still wait on the device
    assert amp.recorder.host_transfers == 3
    assert ours.host_copies() - baseline.host_copies() <= 3 + 2 * len(
        data
    )  # fp32 loss copies, flush copies


def test_recorder_makes_no_copy_until_a_flush_is_due():
    recorder = Recorder(flush_every=1000)
    rows = [(torch.tensor(float(step)), torch.tensor(step == 7)) for step in range(1, 51)]
    with OpCounter() as ops:
        for step, (loss, skipped) in enumerate(rows, start=1):
            recorder.record(step=step, loss=loss, skipped=skipped)
    assert ops.counts == {} and recorder.pending == 50 and len(recorder.history) == 0
    recorder.close()
    assert recorder.host_transfers == 1 and recorder.history.skipped_steps == [7]
    assert recorder.history.loss == [float(s) for s in range(1, 51)]


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: proves no sync with set_sync_debug_mode",
)
def test_no_host_device_sync_between_flushes_on_cuda():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).cuda()
    data = [
        (torch.randn(32, 64, device="cuda"), torch.randn(32, 64, device="cuda")) for _ in range(20)
    ]
    # A fused optimizer lets GradScaler skip on the device, so torch.amp itself does not sync either.
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    amp = mpnb.AmpStep(optimizer, mode="fp16", device="cuda", flush_every=1000, clip_grad_norm=1.0)
    amp_steps(model, data[:2], amp)  # lazy initialisation may sync once
    torch.cuda.set_sync_debug_mode("error")
    try:
        amp_steps(model, data[2:], amp)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(amp.close()) == 20


def full_history() -> History:
    history = History(meta={"device": "cpu", "model": "demo"})
    history.extend(
        {
            "step": [1, 2, 3],
            "epoch": [0, 0, 1],
            "loss": [2.5, math.inf, 0.125],
            "loss_scale": [65536.0, 65536.0, 32768.0],
            "skipped": [False, True, False],
            "lr": [0.1, 0.1, 0.05],
            "step_time": [0.5, 0.01, 0.02],
            "samples_per_s": [128.0, 6400.0, math.nan],
            "memory_used": [1e6, 2e6, 2e6],
            "memory_peak": [1e6, 2e6, 3e6],
            "grad_norm": [math.nan, math.nan, 1.5],
            "mode": ["fp16"] * 3,
        }
    )
    history.note("interrupted", kind="interrupt")
    return history


def same(a: History, b: History) -> bool:
    def norm(values):
        return [("nan" if isinstance(v, float) and math.isnan(v) else v) for v in values]

    return (
        a.meta == b.meta
        and a.events == b.events
        and all(norm(a.columns[c]) == norm(b.columns[c]) for c in COLUMNS)
    )


@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_history_round_trips_through_files(tmp_path, suffix):
    history = full_history()
    path = tmp_path / f"run{suffix}"
    (history.to_csv if suffix == ".csv" else history.to_json)(path)
    loaded = History.load(path)
    assert same(history, loaded)
    assert loaded.skipped_steps == [2] and loaded.events[0]["step"] == 3
    assert isinstance(loaded.skipped[1], bool) and isinstance(loaded.step[0], int)


def test_history_json_is_standard_json_and_csv_reads_in_pandas(tmp_path):
    history = full_history()
    assert json.loads(history.to_json())["columns"]["loss"] == [2.5, "inf", 0.125]
    pandas = pytest.importorskip("pandas")
    history.to_csv(tmp_path / "run.csv")
    frame = pandas.read_csv(tmp_path / "run.csv", skiprows=1)  # as the docs say
    assert list(frame.columns) == list(COLUMNS) and frame["skipped"].tolist() == [
        False,
        True,
        False,
    ]
    assert history.to_pandas()["loss_scale"].tolist() == [65536.0, 65536.0, 32768.0]


def test_history_summary_and_reprs():
    history = full_history()
    summary = history.summary()
    assert summary["steps"] == 3 and summary["skipped"] == 1 and summary["final_loss"] == 0.125
    assert summary["median_step_time"] == pytest.approx(0.015) and summary["peak_memory"] == 3e6
    assert "3 steps, 1 skipped" in repr(history)
    assert "<table" in history._repr_html_() and "3 (1 skipped)" in history._repr_html_()


def test_history_rejects_foreign_files_and_bad_rows(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="is not an mpnb history CSV"):
        History.load(tmp_path / "x.csv")
    (tmp_path / "x.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not an mpnb-history version 1 record"):
        History.load(tmp_path / "x.json")
    with pytest.raises(
        ValueError, match=r"unknown History columns \['los'\]; valid: step, epoch, loss"
    ):
        History().extend({"los": [1.0]})
    with pytest.raises(ValueError, match="columns differ in length"):
        History().extend({"step": [1, 2], "loss": [1.0]})


def test_decimation_is_bounded_keeps_extremes_and_matches_short_series_exactly():
    short = MinMaxSeries(max_points=100)
    short.extend(range(10), [float(v) for v in range(10)])
    assert short.points()[1].tolist() == [float(v) for v in range(10)]

    series = MinMaxSeries(max_points=64)
    values = [1.0] * 100_000
    values[54_321], values[77_777] = 50.0, -3.0
    values[90_000] = math.inf  # an overflowed step: counted, not drawn
    series.extend(range(100_000), values)
    xs, ys = series.points()
    assert len(xs) <= 64 and series.count == 100_000
    assert 54_321 in xs.tolist() and 77_777 in xs.tolist()
    assert float(ys.max()) == 50.0 and float(ys.min()) == -3.0
    assert list(xs) == sorted(xs)


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), max_size=300),
    max_points=st.integers(4, 40),
)
def test_decimated_points_are_real_points_in_x_order_with_every_extreme(values, max_points):
    series = MinMaxSeries(max_points=max_points)
    series.extend(range(len(values)), values)
    xs, ys = series.points()
    assert len(xs) <= max_points and xs.tolist() == sorted(set(xs.tolist()))  # in order, none twice
    assert all(
        ys[i] == values[int(x)] for i, x in enumerate(xs)
    )  # each drawn point is one of the series
    finite = [v for v in values if math.isfinite(v)]
    if finite:
        assert float(ys.min()) == min(finite) and float(ys.max()) == max(finite)
    else:
        assert len(xs) == 0


def test_a_row_with_an_fp8_value_beside_others_is_read():
    """fp8 has no type promotion with other dtypes: such a row is still packed and read."""
    recorder = Recorder(flush_every=1)
    recorder.record(
        step=1, loss=torch.tensor(0.5).to(torch.float8_e4m3fn), skipped=torch.tensor(True)
    )
    assert recorder.history.loss == [0.5] and recorder.history.skipped_steps == [1]


_TWO_DEVICES = """
import json, sys
import torch
try:
    import torch._lazy.ts_backend
    torch._lazy.ts_backend.init()
except Exception as error:  # a torch built without it
    print(json.dumps({"skip": str(error)}))
    sys.exit()
from mpnb.training.telemetry import Recorder
results = {}
for split in ("within columns", "between columns"):
    recorder = Recorder(flush_every=100)
    for step in (1, 2, 3):
        loss_device = "lazy" if split == "between columns" or step == 2 else "cpu"
        recorder.record(step=step, loss=torch.tensor(0.5 * step).to(loss_device), grad_norm=torch.tensor(2.0 * step),
                        skipped=torch.tensor(step == 3).to("lazy"))
    recorder.flush()
    history = recorder.history
    results[split] = [history.loss, history.grad_norm, history.skipped_steps, recorder.host_transfers]
print(json.dumps(results))
"""


def test_a_flush_of_values_on_two_devices_copies_once_per_device_and_keeps_each_value_in_place():
    """A model split over two devices puts the loss on one and the gradient norm on another (or
    mixes them within a column): each value lands in its own row and column, one copy per device.
    The second device is torch's lazy (TorchScript) device, real on a CPU-only machine; it runs in
    a process of its own, as starting it registers kernels for the whole process."""
    done = subprocess.run(
        [sys.executable, "-c", _TWO_DEVICES], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.splitlines()[-1])
    if "skip" in results:
        pytest.skip(f"no second device: torch's lazy device is unavailable ({results['skip']})")
    expected = [[0.5, 1.0, 1.5], [2.0, 4.0, 6.0], [3], 2]
    assert results == {"within columns": expected, "between columns": expected}


@pytest.mark.parametrize(
    "bad, named",
    [
        ({"unknwon": torch.tensor(1.0)}, "unknwon"),
        ({"loss": torch.tensor([0.5, 0.25])}, "loss"),
        ({"epoch": torch.tensor(math.nan)}, "epoch"),
    ],
    ids=["unknown column", "two values", "NaN for a whole number"],
)
def test_a_bad_row_is_named_and_every_good_pending_row_is_kept(bad, named):
    recorder = Recorder(flush_every=100)
    for step in (1, 2, 3):
        recorder.record(step=step, loss=torch.tensor(0.5))
    recorder.record(step=4, **bad)
    recorder.record(step=5, loss=torch.tensor(0.25))
    with pytest.raises(ValueError, match=rf"step 4\b.*{named}"):
        recorder.flush()
    assert recorder.history.step == [1, 2, 3, 5] and recorder.history.loss == [0.5, 0.5, 0.5, 0.25]
    assert recorder.pending == 0
    recorder.record(step=6, loss=torch.tensor(0.125))
    recorder.flush()
    assert recorder.history.step == [1, 2, 3, 5, 6]


def test_an_example_count_held_in_a_tensor_gives_a_number_of_samples_per_second():
    """A token count is often a tensor (mask.sum()): read with the other values, never kept as a tensor."""
    recorder = Recorder(flush_every=100)
    recorder.record(step=1, loss=torch.tensor(0.5), step_time=0.5, samples=torch.tensor(64))
    recorder.record(step=2, loss=torch.tensor(0.5), step_time=0.25, samples=8)
    recorder.flush()
    assert recorder.history.samples_per_s == [128.0, 32.0]
    assert all(type(value) is float for value in recorder.history.samples_per_s)
    json.dumps(recorder.history.to_dict())


class Paced(mpnb.training.telemetry.Sink):
    """Asks for a flush at every step, and counts the flushes it is told of."""

    def __init__(self) -> None:
        self.flushes = 0

    def due(self, now: float) -> bool:
        return True

    def update(self, history: History) -> None:
        self.flushes += 1


def test_a_sink_asks_for_early_flushes_from_attach_to_detach():
    recorder = Recorder(flush_every=64)
    paced = Paced()
    recorder.attach(paced)
    recorder.record(step=1, loss=0.5)
    assert recorder.pending == 0 and paced.flushes == 1
    recorder.detach(paced)
    recorder.record(step=2, loss=0.5)
    assert recorder.pending == 1 and paced.flushes == 1 and recorder.sinks == ()
    recorder.detach(paced)  # no longer attached: passed over


def test_records_make_the_same_history_column_wise_as_their_rows():
    from mpnb.training.step_record import StepAccount, StepRecord

    account = StepAccount(torch.device("cpu"))
    records = []
    for step in range(1, 4):
        account.forward_start()
        account.forward_end(torch.tensor(0.25 * step, dtype=torch.bfloat16))
        account.add_samples(8)
        records.append(
            account.close(step=step, epoch=0, loss_scale=1.0, skipped=False, lr=0.1, mode="bf16")
        )
    by_rows, by_records = Recorder(), Recorder()
    for record in records:
        by_rows.add_row(record.row())
        by_records.add_record(record)
    by_rows.flush(), by_records.flush()
    assert by_rows.history.columns == by_records.history.columns
    assert by_records.history.loss == [0.25, 0.5, 0.75] and by_records.host_transfers == 1
    assert StepRecord.columns_of(records)["forward_time"] == by_rows.history.forward_time
