"""The Trainer takes the batches and models people have: Hugging Face models that compute their own
loss from dict batches, nested and dataclass batches, DataLoaders, IterableDatasets, generators."""

from __future__ import annotations

import dataclasses
import math
from collections import UserDict

import pytest
import torch
from IPython.core.error import UsageError
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import mpnb
import mpnb.examples as ex
from mpnb.errors import MpnbError
from mpnb.precision.modes import parse_mode
from mpnb.training.batches import batch_loss, samples_in, to_device
from tests.conformance.models import bert_model, gpt2_model
from tests.conftest import run_expecting

transformers = pytest.importorskip("transformers")


def gpt2():
    return gpt2_model(
        resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )  # no dropout: the first loss is reproducible


def bert():
    return bert_model(hidden_dropout_prob=0, attention_probs_dropout_prob=0)


def gpt2_batches(count=6, size=4):
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, 96, (size, 12), generator=generator)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return batches


def bert_batches(count=6, size=4):
    generator = torch.Generator().manual_seed(2)
    return [
        transformers.BatchEncoding(
            {
                "input_ids": torch.randint(0, 96, (size, 12), generator=generator),
                "labels": torch.randint(0, 3, (size,), generator=generator),
            }
        )
        for _ in range(count)
    ]


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
@pytest.mark.parametrize(
    "build, batches", [(gpt2, gpt2_batches), (bert, bert_batches)], ids=["gpt2", "bert"]
)
def test_hugging_face_models_train_on_dict_batches_with_their_own_loss(build, batches, mode):
    model = build()
    data = batches()
    # no dropout: deterministic
    with (
        torch.no_grad(),
        torch.autocast("cpu", dtype=parse_mode(mode).autocast_dtype),
    ):
        first_loss = model(**data[0]).loss.float().item()
    trainer = mpnb.Trainer(
        model, torch.optim.AdamW(model.parameters(), 1e-3), mode=mode, device="cpu", dashboard=None
    )
    history = trainer.fit(data, epochs=2)
    assert len(history) == 12 and history.mode == [mode] * 12
    assert all(
        math.isfinite(v) and v > 0 for v in history.samples_per_s[1:]
    )  # samples from the dict batch
    taken = [loss for loss, skipped in zip(history.loss, history.skipped) if not skipped]
    assert all(math.isfinite(v) for v in taken) and history.events == []
    assert history.loss[0] == pytest.approx(
        first_loss, rel=1e-6
    )  # the model's own loss, recorded as is
    assert min(taken[-3:]) < first_loss  # and it learns


def test_fp16_on_gpt2_skips_overflowing_steps_and_trains_on():
    model = gpt2()
    trainer = mpnb.Trainer(
        model,
        torch.optim.AdamW(model.parameters(), 1e-3),
        mode="fp16",
        device="cpu",
        dashboard=None,
        init_scale=2.0**24,
    )  # starts too high: the first steps overflow
    history = trainer.fit(gpt2_batches(count=12))
    assert history.skipped_steps[:1] == [1] and len(history.skipped_steps) < 12
    assert history.loss_scale[len(history.skipped_steps)] < 2.0**24
    # the first skip's origin is named; skips of a scale finding its level raise no alarm
    assert [event["kind"] for event in history.events] == ["origin"]


def test_a_model_without_a_loss_is_a_clear_error():
    model = gpt2()
    batch = {"input_ids": torch.randint(0, 96, (2, 12))}  # no labels: the model returns no loss
    trainer = mpnb.Trainer(
        model,
        torch.optim.AdamW(model.parameters(), 1e-3),
        mode="bf16",
        device="cpu",
        dashboard=None,
    )
    with pytest.raises(
        MpnbError, match="returned a CausalLMOutputWithCrossAttentions .*no loss.*loss_fn.*step_fn"
    ):
        trainer.fit([batch])
    assert trainer.amp.between_steps and len(trainer.history) == 0


def test_a_pair_batch_without_a_loss_fn_says_to_pass_one(ip):
    model = nn.Sequential(nn.Linear(4, 2))
    batch = (torch.randn(3, 4), torch.randn(3, 2))
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), 0.1), mode="bf16", device="cpu", dashboard=None
    )
    words = r"Sequential.forward cannot take a tuple of 2 as its arguments .*pass loss_fn="
    with pytest.raises(MpnbError, match=words):
        trainer.fit([batch])
    assert trainer.amp.between_steps and len(trainer.history) == 0
    with pytest.raises(MpnbError, match=words):
        mpnb.whatif(model, batch)
    ip.user_ns.update(model=model, batch=batch)
    shown = run_expecting(ip, "%whatif model batch", UsageError)
    assert "Sequential.forward cannot take a tuple of 2" in str(shown) and "--loss" in str(shown)


def test_a_pair_batch_a_transformers_model_fails_on_deep_inside_carries_mpnbs_note():
    # GPT-2 takes (input_ids, past_key_values, ...): the labels land where a cache goes
    model = gpt2()
    ids = torch.randint(0, 96, (2, 12))
    trainer = mpnb.Trainer(
        model, torch.optim.AdamW(model.parameters(), 1e-3), mode="bf16", device="cpu",
        dashboard=None,
    )  # fmt: skip
    with pytest.raises(Exception) as failed:
        trainer.fit([(ids, ids)])
    notes = getattr(failed.value, "__notes__", [])
    assert any("a tuple batch goes to the model as 2 positional arguments" in n for n in notes)
    assert trainer.amp.between_steps and len(trainer.history) == 0


def test_a_type_error_inside_the_models_forward_is_the_models_own():
    class Strict(nn.Module):
        def forward(self, x, y):
            raise TypeError("a bug of the model's own")

    with pytest.raises(TypeError, match="a bug of the model's own"):
        batch_loss(Strict(), (torch.ones(1), torch.ones(1)), None, None)


def test_a_loss_fn_with_a_dict_batch_says_what_to_pass():
    model = nn.Linear(4, 2)
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), 0.1),
        nn.functional.mse_loss,
        mode="bf16",
        device="cpu",
        dashboard=None,
    )
    with pytest.raises(
        MpnbError, match=r"\(inputs, targets\) pair, got a dict with keys \['x', 'y'\].*step_fn"
    ):
        trainer.fit([{"x": torch.randn(3, 4), "y": torch.randn(3, 2)}])


@dataclasses.dataclass
class Pair:
    features: torch.Tensor
    target: torch.Tensor
    note: str = "kept"


def test_nested_and_dataclass_batches_are_moved_whole_and_counted():
    batch = {
        "pair": Pair(torch.randn(5, 4), torch.randn(5, 2)),
        "extra": [torch.zeros(5, 1), (torch.ones(5),)],
        "mapping": UserDict({"mask": torch.ones(5, 3)}),
        "name": "x",
    }
    moved = to_device(batch, torch.device("meta"))
    assert moved["pair"].features.device.type == "meta" and moved["pair"].note == "kept"
    assert moved["extra"][1][0].device.type == "meta" and isinstance(moved["mapping"], UserDict)
    assert moved["mapping"]["mask"].device.type == "meta" and moved["name"] == "x"
    assert samples_in(batch) == 5 and samples_in({"n": 3}) is None


def test_step_fn_covers_any_other_layout():
    model = nn.Linear(4, 2)
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), 0.1),
        mode="bf16",
        device="cpu",
        dashboard=None,
        step_fn=lambda m, b: nn.functional.mse_loss(m(b.features).float(), b.target),
    )
    history = trainer.fit([Pair(torch.randn(5, 4), torch.randn(5, 2)) for _ in range(3)])
    assert len(history) == 3 and history.samples_per_s[-1] > 0


def test_dataloaders_iterable_datasets_and_generators():
    images, labels = ex.load_digits()
    dataset = TensorDataset(images[:256], labels[:256])

    def fit(data, **options):
        trainer, _, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None, **options)
        return trainer, trainer.fit(data, epochs=2)

    _, history = fit(
        DataLoader(dataset, batch_size=48, shuffle=True, drop_last=True, num_workers=2)
    )
    assert len(history) == 2 * (256 // 48) and set(history.epoch) == {0, 1}

    class Stream(IterableDataset):
        def __iter__(self):
            for start in range(0, 256, 64):
                yield images[start : start + 64], labels[start : start + 64]

    _, history = fit(DataLoader(Stream(), batch_size=None))
    assert len(history) == 8

    generator = ((images[i : i + 64], labels[i : i + 64]) for i in range(0, 256, 64))
    with pytest.warns(
        RuntimeWarning, match="no batches in epoch 1 .a generator is used up after one pass"
    ):
        _, history = fit(generator)
    assert len(history) == 4


def test_resuming_a_generator_goes_on_where_it_stopped():
    images, labels = ex.load_digits()
    batches = [(images[i : i + 64], labels[i : i + 64]) for i in range(0, 384, 64)]
    full, _, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    full.fit(iter(batches))
    trainer, _, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    stream = iter(batches)
    trainer.fit(stream, max_steps=2)
    trainer.fit(stream)
    assert trainer.history.step == full.history.step
    for mine, theirs in zip(trainer.model.parameters(), full.model.parameters()):
        assert torch.equal(mine, theirs)


def test_indexed_names_the_current_accelerator_and_leaves_others_as_they_are():
    from mpnb.training.batches import indexed

    cuda = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cuda")
    )
    assert indexed(torch.device("cuda")) == cuda  # a torch built without CUDA cannot say: unchanged
    assert indexed(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert indexed(torch.device("cpu")) == torch.device("cpu")
