"""An op whose kernel refuses the autocast dtype (oneDNN's LSTM where the CPU lacks the units
oneDNN asks for that dtype): recognised in torch's own error, and said by Trainer.fit and advise
with the op, the reason read from this CPU, and the fix."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import mpnb
from mpnb.oplists.refusals import OpRefusedError, refusal_error, refused_op
from mpnb.training.control import FitEnd
from mpnb.ui.plots.text import TextProgress

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Tagger(nn.Module):
    """A one-layer LSTM and a classifier on its last output."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def _batches(count: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(4, 5, 8, generator=generator), torch.randint(0, 3, (4,), generator=generator))
        for _ in range(count)
    ]


def _lstm_error(dtype: torch.dtype) -> RuntimeError | None:
    """What torch raises here for an LSTM forward and backward under ``dtype`` autocast."""
    model, (x, _) = Tagger(), _batches(1)[0]
    try:
        with torch.autocast("cpu", dtype=dtype):
            out = model(x)
        out.float().sum().backward()
    except RuntimeError as error:
        return error
    return None


def _refused_here(name: str) -> RuntimeError:
    error = _lstm_error(DTYPES[name])
    if error is None:
        pytest.skip(f"oneDNN runs LSTM in {name} on this CPU: nothing refuses")
    return error


@pytest.mark.parametrize("name", DTYPES)
def test_torchs_own_lstm_refusal_is_recognised(name):
    error = _refused_here(name)
    assert refused_op(error) == "lstm"
    clear = refusal_error(error, DTYPES[name])
    assert isinstance(clear, mpnb.MpnbError)
    message = str(clear)
    assert message.startswith(f"lstm cannot run in {name}")
    assert "`%oplist add fp32 lstm`" in message
    assert 'OpLists.of(fp32=["lstm"])' in message


@pytest.mark.parametrize("name", DTYPES)
def test_the_reason_is_what_this_cpu_has_and_what_runs_here(name):
    """The reason is read from this CPU's units (as torch reports them) and from an LSTM run in the
    other dtype, never assumed: an AVX512-BF16 CPU refuses fp16 for want of AVX512-FP16."""
    message = str(refusal_error(_refused_here(name), DTYPES[name]))
    units = torch.cpu.get_capabilities()
    cpu = units["cpu_name"]
    needed = "AVX512-FP16" if name == "fp16" else "AVX-512"
    assert f"{needed} or AVX2-VNNI-2" in message, message
    assert f"this CPU ({cpu}) has neither" in message, message
    if units.get("avx512_bf16") or units.get("amx_bf16"):
        assert "without bf16 units" not in message, message
    other = "bf16" if name == "fp16" else "fp16"
    runs = _lstm_error(DTYPES[other]) is None
    assert (f"{other} autocast runs it here" in message) is runs, message


def test_other_torch_errors_are_not_taken_for_a_refusal():
    try:
        nn.LSTM(8, 16)(torch.randn(5, 4, 7))  # wrong input size
    except RuntimeError as error:
        assert refused_op(error) is None
        assert refusal_error(error, torch.bfloat16) is None
    with pytest.raises(RuntimeError) as caught:
        torch.zeros(2, 3) @ torch.zeros(4, 5)
    assert refused_op(caught.value) is None


@pytest.mark.parametrize("name", DTYPES)
def test_fit_names_the_refused_op_and_the_fix(name):
    _refused_here(name)
    model, out = Tagger(), io.StringIO()
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), 0.1),
        nn.functional.cross_entropy,
        mode=name,
        device="cpu",
        dashboard=TextProgress("tagger", stream=out),
    )
    with pytest.raises(OpRefusedError, match="`%oplist add fp32 lstm`") as caught:
        trainer.fit(_batches())
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert "could not create a primitive descriptor" in str(caught.value.__cause__)
    assert len(trainer.history) == 0
    assert trainer.ended is FitEnd.FAILED
    printed = out.getvalue()
    assert "finished" not in printed and "nan" not in printed, printed


@pytest.mark.parametrize("name", DTYPES)
def test_the_fix_the_error_names_trains(name):
    _refused_here(name)
    model = Tagger()
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), 0.1),
        nn.functional.cross_entropy,
        mode=name,
        device="cpu",
        dashboard=None,
    )
    mpnb.set_oplists(mpnb.OpLists.of(fp32=["lstm"]))
    try:
        history = trainer.fit(_batches())
    finally:
        mpnb.set_oplists(mpnb.OpLists())
    assert history.step == [1, 2, 3]
    assert all(loss == loss for loss in history.loss)  # finite, not NaN


def test_advise_names_the_refused_op():
    _refused_here("fp16")  # advise tries fp16 first, then bf16
    model = Tagger()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(OpRefusedError, match="lstm cannot run in fp16") as caught:
        mpnb.advise(model, _batches(1)[0], nn.functional.cross_entropy, device="cpu")
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())


def test_compare_lists_the_refused_mode_with_the_fix_and_runs_the_others():
    _refused_here("bf16")

    def make_run(mode):
        torch.manual_seed(0)
        model = Tagger()
        trainer = mpnb.Trainer(
            model,
            torch.optim.SGD(model.parameters(), 0.1),
            nn.functional.cross_entropy,
            mode=mode,
            device="cpu",
            dashboard=None,
        )
        return trainer, _batches(4)

    comparison = mpnb.compare(make_run, ["fp32", "bf16"], steps=2, warmup=1, progress=None)
    fp32, bf16 = comparison.results
    assert len(fp32.history) == 3 and bf16.history is None
    assert bf16.skipped_reason.startswith("lstm cannot run in bf16")
    assert "`%oplist add fp32 lstm`" in bf16.skipped_reason
