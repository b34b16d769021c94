"""Op lists: presets, files, validation, and live enforcement on torch's autocast keys."""

from __future__ import annotations

import pytest
import torch

import mpnb.examples as ex
from mpnb.errors import InvalidChoiceError, MpnbError
from mpnb.oplists.lists import OpLists, aten_overloads
from mpnb.oplists.override import OpListOverride
from mpnb.precision.policy import session
from tests.conftest import run
from tests.planted import assert_link_replaced, plant_link

LISTED = ("linear", "softmax", "matmul", "addmm", "conv2d", "log_softmax", "mul")


def dispatcher_state() -> dict[str, str]:
    return {name: torch._C._dispatch_dump(f"aten::{name}") for name in LISTED}


def test_presets_hold_habanas_lists():
    hmp = OpLists.preset("hmp")
    # Habana's lower list has 22 ops; `t` (a view, which keeps its input's dtype) is left out.
    assert len(hmp.lower) == 21 and len(hmp.fp32) == 15
    assert {"linear", "conv2d", "layer_norm"} <= set(hmp.lower) and "t" not in hmp.lower
    assert {"softmax", "cross_entropy", "truediv", "topk"} <= set(hmp.fp32)
    assert set(hmp.lower.values()) == {"preset hmp"}
    resnet = OpLists.preset("resnet50")
    assert sorted(resnet.fp32) == ["cross_entropy", "log_softmax", "nll_loss", "softmax", "topk"]
    assert not OpLists.preset("torch")
    with pytest.raises(
        InvalidChoiceError, match="unknown preset 'bert'; valid: torch, hmp, resnet50"
    ):
        OpLists.preset("bert")


def test_add_moves_between_lists_and_bad_names_change_nothing():
    lists = OpLists()
    lists.add("lower", ["linear", "softmax"])
    lists.add("fp32", ["softmax"], source="cell")
    assert dict(lists.lower) == {"linear": "user"} and dict(lists.fp32) == {"softmax": "cell"}
    with pytest.raises(InvalidChoiceError, match="unknown op 'lineer'; valid: linear"):
        lists.add("fp32", ["matmul", "lineer"])
    assert "matmul" not in lists.fp32
    with pytest.raises(InvalidChoiceError, match="unknown list 'bf8'; valid: lower, fp32"):
        lists.add("bf8", ["mm"])
    with pytest.raises(
        InvalidChoiceError, match="unknown op on the fp32 list 'mm'; valid: softmax"
    ):
        lists.remove("fp32", ["mm"])
    lists.remove("fp32", ["softmax"])
    assert not lists.fp32


def test_aliases_resolve_to_the_aten_ops_they_mean():
    assert {str(op) for op in aten_overloads("cross_entropy")} == {
        "aten.cross_entropy_loss.default"
    }
    assert "aten.div.Tensor" in {str(op) for op in aten_overloads("truediv")}
    assert all("out" not in str(op) for op in aten_overloads("softmax"))


def test_files_round_trip_in_habanas_format(tmp_path):
    (tmp_path / "bf16.txt").write_text("# ops that run in bf16\nlinear\n\nconv2d  # the convs\n")
    (tmp_path / "fp32.txt").write_text("softmax\n")
    lists = OpLists.from_files(tmp_path / "bf16.txt", tmp_path / "fp32.txt")
    assert dict(lists.lower) == {"linear": "bf16.txt", "conv2d": "bf16.txt"} and list(
        lists.fp32
    ) == ["softmax"]
    lower_path, fp32_path = lists.save(tmp_path / "saved")
    again = OpLists.from_files(lower_path, fp32_path)
    assert sorted(again.lower) == ["conv2d", "linear"] and list(again.fp32) == ["softmax"]


def test_saving_replaces_planted_links_and_leaves_their_targets_alone(tmp_path):
    folder = tmp_path / "shared" / "lists"
    victims = [plant_link(folder / name) for name in ("lower_list.txt", "fp32_list.txt")]
    lists = OpLists({"linear": "test"}, {"softmax": "test"})
    lower_path, fp32_path = lists.save(folder)
    assert assert_link_replaced(folder / "lower_list.txt", victims[0]).endswith("linear\n")
    assert assert_link_replaced(folder / "fp32_list.txt", victims[1]).endswith("softmax\n")
    assert OpLists.from_files(lower_path, fp32_path).fp32 == {"softmax": "fp32_list.txt"}


def test_override_changes_dtypes_only_inside_autocast_and_undoes_exactly():
    linear, x = torch.nn.Linear(8, 8), torch.randn(4, 8)
    before = dispatcher_state()
    lists = OpLists()
    lists.add("fp32", ["linear"])
    lists.add("lower", ["softmax"])
    with OpListOverride(lists, ["cpu"]) as override:
        assert override.active
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = linear(x)
            soft = torch.softmax(x, dim=-1)
        assert linear(x).dtype == torch.float32 and torch.softmax(x, -1).dtype == torch.float32
        out.sum().backward()
    assert out.dtype == torch.float32 and soft.dtype == torch.bfloat16
    assert linear.weight.grad is not None and linear.weight.grad.dtype == torch.float32
    assert dispatcher_state() == before
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(x).dtype == torch.bfloat16 and torch.softmax(x, -1).dtype == torch.float32


def test_override_is_released_when_the_block_raises():
    before = dispatcher_state()
    with pytest.raises(ZeroDivisionError):
        with OpListOverride(OpLists.preset("hmp"), ["cpu"]):
            _ = 1 / 0
    assert dispatcher_state() == before


def test_lower_list_follows_the_current_autocast_dtype():
    lists = OpLists()
    lists.add("lower", ["softmax"])
    x = torch.randn(3, 5)
    with OpListOverride(lists, ["cpu"]):
        for dtype in (torch.bfloat16, torch.float16):
            with torch.autocast("cpu", dtype=dtype):
                assert torch.softmax(x, -1).dtype == dtype


def test_training_under_habanas_lists_learns():
    trainer, train, _ = ex.example_trainer("bf16", "cpu", widths=(8, 16), dashboard=None)
    with OpListOverride(OpLists.preset("hmp"), ["cpu"]):
        history = trainer.fit(train, max_steps=15)
    assert history.loss[-1] < history.loss[0]


@pytest.mark.parametrize("name", ["mm.0", "aten::softmax.nope"])
def test_an_unknown_overload_is_named_whole_with_the_valid_ones(name):
    with pytest.raises(InvalidChoiceError) as error:
        OpLists.of(fp32=[name])
    message = str(error.value)
    assert repr(name) in message and "valid: " in message and "Or write just" in message


def test_an_overload_of_an_op_that_cannot_be_listed_says_why():
    with pytest.raises(MpnbError, match="aten::t.0 returns a view of its input"):
        OpLists.of(lower=["t.0"])


def test_one_op_name_is_one_op_not_its_letters():
    lists = OpLists()
    lists.add("fp32", "lstm")
    assert lists.fp32 == {"lstm": "user"}
    lists.remove("fp32", "lstm")
    assert not lists
    assert OpLists.of(fp32="lstm", lower="linear") == OpLists.of(fp32=["lstm"], lower=["linear"])


def test_the_constructor_takes_the_lists_by_keyword():
    assert OpLists(fp32=["lstm"]) == OpLists.of(fp32=["lstm"])
    assert OpLists(lower=("F.linear",), fp32="softmax") == OpLists.of(["linear"], ["softmax"])
    copied = OpLists(fp32=["lstm"]).copy()
    assert copied.fp32 == {"lstm": "user"}
    with pytest.raises(InvalidChoiceError, match="unknown op 'lstmm'"):
        OpLists(fp32=["lstmm"])
    with pytest.raises(MpnbError, match="on both the lower and the fp32 list"):
        OpLists(lower=["linear"], fp32=["linear"])


@pytest.mark.parametrize(
    "written, entry",
    [
        ("LSTM", "lstm"),
        ("aten::LSTM", "lstm"),
        ("F.Softmax", "softmax"),
        ("softmax.INT", "softmax.int"),
    ],
)
def test_op_names_match_whatever_their_case(written, entry):
    lists = OpLists.of(fp32=[written])
    assert list(lists.fp32) == [entry]
    lists.remove("fp32", entry.upper())
    assert not lists


def test_names_torch_spells_with_capitals_keep_their_spelling():
    # aten has no two op names that differ only by case: a name's case folds to one spelling
    names = {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")}
    assert len({n.lower() for n in names}) == len(names)
    with pytest.raises(MpnbError, match=r"aten::mT returns a view"):
        OpLists.of(fp32=["MT"])


def test_oplist_magic_matches_op_names_whatever_their_case(ip):
    run(ip, "%oplist add fp32 LSTM")
    assert session.oplists.lists.fp32 == {"lstm": "user"}
    run(ip, "%oplist remove fp32 Lstm")
    assert not session.oplists.lists


def test_one_op_under_two_spellings_cannot_sit_on_both_lists(tmp_path):
    # softmax and softmax.int, div and truediv name the same aten overloads: the lower list won
    # in every autocast block, silently, whatever the fp32 list said
    from mpnb.errors import MpnbError
    from mpnb.oplists.lists import OpLists

    with pytest.raises(
        MpnbError, match=r"'softmax' \(lower\) and 'softmax.int' \(fp32\) name the same op"
    ):
        OpLists.of(lower=["softmax"], fp32=["softmax.int"])
    with pytest.raises(MpnbError, match="name the same op"):
        OpLists(lower={"div": "a"}, fp32={"truediv": "b"})
    (tmp_path / "lower.txt").write_text("softmax\n")
    (tmp_path / "fp32.txt").write_text("softmax\n")
    with pytest.raises(MpnbError, match="op 'softmax' is on both the lower and the fp32 list"):
        OpLists.from_files(tmp_path / "lower.txt", tmp_path / "fp32.txt")
    hmp = OpLists.preset("hmp")  # its fp32 list holds div, divide and truediv
    hmp.add("lower", ["div"])  # takes every spelling of aten.div off the fp32 list
    assert not {"div", "divide", "truediv"} & set(hmp.fp32) and "div" in hmp.lower
