"""History files: text a spreadsheet never runs, read back exactly; hostile files refused by
line or field; written whole, never through a planted link."""

from __future__ import annotations

import csv
import io
import json
import math
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mpnb.errors import MpnbError
from mpnb.training.history import COLUMNS, History
from tests.planted import FORMULA_STARTS, assert_link_replaced, files_in, is_number, plant_link
from tests.training.test_telemetry import same

FORMULAS = [
    '=HYPERLINK("http://evil.example","click")',
    "+1+1",
    "-2+3+cmd|' /C calc'!A0",
    "@SUM(A1:A9)",
    "\t=1+1",
    "\r=1+1",
    "'already quoted",
    "''twice",
    "plain, then =1+1",
    "a,=cmd|' /C calc'!A0",
]


def formula_history() -> History:
    history = History(meta={"model": "=HYPERLINK(0), -1", "note": "a,-1"})
    count = len(FORMULAS)
    history.extend(
        {
            "step": list(range(1, count + 1)),
            "loss": [-2.5, -math.inf, *[0.5] * (count - 2)],
            "mode": FORMULAS,
        }
    )
    for message in FORMULAS:
        history.note(message, kind="switch")
    return history


def text_a_spreadsheet_sees(text: str) -> list[str]:
    """Every cell of every line that is no number, split at commas as a spreadsheet opening the
    file splits them (spaces after a comma taken off, as some spreadsheets do)."""
    cells = [cell.lstrip(" ") for row in csv.reader(io.StringIO(text, newline="")) for cell in row]
    return [cell for cell in cells if not is_number(cell)]


def test_formula_looking_text_opens_in_a_spreadsheet_as_text_and_loads_back_exactly(tmp_path):
    history = formula_history()
    history.to_csv(tmp_path / "run.csv")
    text = (tmp_path / "run.csv").read_text(encoding="utf-8")
    formulas = [cell for cell in text_a_spreadsheet_sees(text) if cell.startswith(FORMULA_STARTS)]
    assert formulas == [] and "'=HYPERLINK" in text and "'''twice" in text
    assert same(History.load(tmp_path / "run.csv"), history)


def test_numbers_stay_numbers_in_the_csv(tmp_path):
    history = formula_history()
    rows = list(csv.DictReader(io.StringIO(history.to_csv().partition("\n")[2])))
    assert [row["loss"] for row in rows[:2]] == ["-2.5", "-inf"] and rows[0]["step"] == "1"
    history.to_csv(tmp_path / "run.csv")
    assert History.load(tmp_path / "run.csv").loss[:2] == [-2.5, -math.inf]


def test_a_csv_file_is_read_as_csv_whatever_the_case_of_its_extension(tmp_path):
    # RUN.CSV was read as JSON: "is not JSON: Expecting value at line 1, column 1"
    history = formula_history()
    history.to_csv(tmp_path / "RUN.CSV")
    assert same(History.load(tmp_path / "RUN.CSV"), history)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@example(modes=["carriage\rreturn", "'=1+1"], messages=["a,=1+1"])  # a return once ended the row
@given(
    modes=st.lists(st.text(st.characters(exclude_categories=("Cs",))), min_size=1, max_size=4),
    messages=st.lists(st.text(st.characters(exclude_categories=("Cs",))), max_size=3),
)
def test_any_text_round_trips_through_a_csv_file(tmp_path, modes, messages):
    history = History(meta={"by": messages[0] if messages else ""})
    history.extend({"step": list(range(1, len(modes) + 1)), "mode": modes})
    for message in messages:
        history.note(message, kind=message)
    history.to_csv(tmp_path / "run.csv")
    assert same(History.load(tmp_path / "run.csv"), history)


HEADER = '# mpnb-history {"version": 1, "meta": {}, "events": []}\n'
NAMES = ",".join(COLUMNS) + "\n"


def row(**cells: str) -> str:
    values = {
        "step": "1",
        "epoch": "0",
        "loss": "0.5",
        "loss_missing": "False",
        "skipped": "False",
        "mode": "bf16",
    }
    return ",".join({**values, **cells}.get(name, "nan") for name in COLUMNS) + "\n"


HOSTILE_CSV = {
    "a field of 200 kB": (
        HEADER + NAMES + row() + row(mode="x" * 200_000),
        r"line 4: field larger than field limit",
    ),
    "an infinite step": (
        HEADER + NAMES + row(step="inf"),
        r"line 3, column 'step': 'inf' is not a whole number",
    ),
    "a NaN step": (
        HEADER + NAMES + row(step="nan"),
        r"line 3, column 'step': 'nan' is not a whole number",
    ),
    "a fractional epoch": (
        HEADER + NAMES + row(epoch="1.5"),
        r"line 3, column 'epoch': '1.5' is not a whole",
    ),
    "a flag that is no bool": (
        HEADER + NAMES + row(skipped="maybe"),
        r"line 3, column 'skipped': 'maybe' is not True",
    ),
    "a loss that is no number": (
        HEADER + NAMES + row(loss="=1+1"),
        r"line 3, column 'loss': '=1\+1' is not a number",
    ),
    "a short row": (
        HEADER + NAMES + row() + "1,0\n",
        rf"line 4: 2 cells where line 2 names {len(COLUMNS)} columns",
    ),
    "no header line": (NAMES + row(), r"is not an mpnb history CSV: line 1 is 'step,epoch"),
    "no column names": (HEADER, r"line 2: no column names"),
    "an unknown column": (HEADER + "step,los\n1,2\n", r"line 2: unknown columns \['los'\]"),
    "a column named twice": (
        HEADER + "step,step\n1,2\n",
        r"line 2: columns named twice: \['step'\]",
    ),
    "a header that is no JSON": (
        "# mpnb-history {version: 1\n" + NAMES,
        r"line 1: the header is not the JSON",
    ),
    "a header nested too deep": (
        "# mpnb-history " + "[" * 100_000 + "\n",
        r"line 1: the header is not the JSON",
    ),
    "a header of another version": (
        '# mpnb-history {"version": 7}\n' + NAMES,
        r"line 1: not an mpnb-history version 1",
    ),
    "an event with no step": (
        '# mpnb-history {"version": 1, "events": [{"message": "hi"}]}\n' + NAMES,
        r"line 1: field 'events\[0\].step': None is not a whole number",
    ),
}


@pytest.mark.parametrize(("text", "named"), HOSTILE_CSV.values(), ids=HOSTILE_CSV)
def test_a_hostile_csv_is_a_value_error_naming_the_line(tmp_path, text, named):
    (tmp_path / "run.csv").write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=named):
        History.load(tmp_path / "run.csv")


@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_binary_garbage_is_a_value_error_naming_the_line(tmp_path, suffix):
    (tmp_path / f"run{suffix}").write_bytes(b"# mpnb-history {}\n" + bytes(range(256)) * 4)
    with pytest.raises(
        ValueError, match=r"line 3: not UTF-8 text \(invalid start byte at byte 146\)"
    ):
        History.load(tmp_path / f"run{suffix}")


def record(**columns) -> dict:
    return {"format": "mpnb-history", "version": 1, "meta": {}, "events": [], "columns": columns}


HOSTILE_JSON = {
    "no JSON": (
        "{'format': 1}",
        r"is not JSON: Expecting property name enclosed in double quotes at line 1, column 2",
    ),
    "nested too deep": ("[" * 100_000, r"JSON nested too deep"),
    "a number of 5000 digits": ("1" * 5000, r"holds a number this mpnb does not read"),
    "a list": ("[1, 2]", r"not an mpnb-history version 1 record \(a list, not a mapping\)"),
    "an infinite step": (
        record(step=["inf"]),
        r"field 'columns.step', row 0: 'inf' is not a whole number",
    ),
    "a step of 1e400": (
        '{"format": "mpnb-history", "version": 1, "columns": {"step": [1e400]}}',
        r"row 0: inf is",
    ),
    "a step that is a bool": (
        record(step=[1, True]),
        r"field 'columns.step', row 1: True is not a whole number",
    ),
    "a loss given as text": (
        record(loss=["0.5"]),
        r"field 'columns.loss', row 0: '0.5' is text, not a number",
    ),
    "a flag given as text": (
        record(skipped=["yes"]),
        r"field 'columns.skipped', row 0: 'yes' is not True or False",
    ),
    "a flag of 2": (
        record(skipped=[False, 2]),
        r"field 'columns.skipped', row 1: 2 is not True or False",
    ),
    "a mode given as a number": (record(mode=[3]), r"field 'columns.mode', row 0: 3 is not text"),
    "a column that is no list": (record(step=5), r"field 'columns.step': 5 is not a list"),
    "an unknown column": (record(los=[1.0]), r"field 'columns': unknown columns \['los'\]"),
    "columns of two lengths": (
        record(step=[1, 2], loss=[0.5]),
        r"field 'columns.loss': 1 values where 'columns.step'",
    ),
    "meta that is a list": ({**record(), "meta": [1]}, r"field 'meta': \[1\] is not a mapping"),
    "an event with no message": (
        {**record(), "events": [{"step": 1}]},
        r"field 'events\[0\].message': None is not",
    ),
    "no columns": (
        {"format": "mpnb-history", "version": 1},
        r"field 'columns': None is not a mapping",
    ),
}


@pytest.mark.parametrize(("data", "named"), HOSTILE_JSON.values(), ids=HOSTILE_JSON)
def test_a_hostile_json_file_is_a_value_error_naming_the_field(tmp_path, data, named):
    text = data if isinstance(data, str) else json.dumps(data)
    (tmp_path / "run.json").write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=named):
        History.load(tmp_path / "run.json")


def test_from_dict_takes_what_a_recorder_or_a_checkpoint_holds():
    history = History.from_dict(
        record(
            step=[np.int64(1), 2],
            loss=[np.float32(0.5), math.nan],
            memory_used=[4096, 8192.0],
            lr=[None, 0.1],
            skipped=[np.bool_(False), 1],
        )
    )
    assert history.step == [1, 2] and type(history.step[0]) is int
    assert (
        history.loss[0] == 0.5
        and math.isnan(history.loss[1])
        and history.memory_used == [4096.0, 8192.0]
    )
    assert (
        math.isnan(history.lr[0])
        and history.skipped_steps == [2]
        and history.skipped == [False, True]
    )


def test_from_dict_refuses_a_wrong_type_naming_the_column_and_the_value():
    with pytest.raises(
        ValueError, match=r"field 'columns.epoch', row 1: 'one' is text, not a number"
    ):
        History.from_dict(record(epoch=[0, "one"]))


def plain_history() -> History:
    history = History(meta={"device": "cpu"})
    history.extend(
        {"step": [1, 2], "loss": [0.5, 0.25], "skipped": [False, True], "mode": ["bf16"] * 2}
    )
    history.note("interrupted", kind="interrupt")
    return history


@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_saving_replaces_a_planted_link_and_leaves_its_target_alone(tmp_path, suffix):
    destination = tmp_path / "runs" / f"run{suffix}"
    victim = plant_link(destination)
    history = plain_history()
    (history.to_csv if suffix == ".csv" else history.to_json)(destination)
    assert_link_replaced(destination, victim)
    assert same(History.load(destination), history)


def test_a_csv_that_cannot_be_written_leaves_the_old_file_whole(tmp_path):
    plain_history().to_csv(tmp_path / "run.csv")
    before = (tmp_path / "run.csv").read_bytes()
    broken = History()
    broken.extend({"step": [1], "mode": ["half a surrogate \ud800"]})  # no UTF-8 for it
    with pytest.raises(UnicodeEncodeError):
        broken.to_csv(tmp_path / "run.csv")
    assert (tmp_path / "run.csv").read_bytes() == before and files_in(tmp_path) == ["run.csv"]


def test_strings_in_meta_lists_and_keys_never_start_a_formula_on_line_1(tmp_path):
    """A spreadsheet splits line 1 at its commas and, trimming the space after one, reads a piece
    that starts with a quote as a quoted cell: ``, "=SUM(2;3)"`` must not become ``=SUM(2;3)``."""
    hostile = ["=SUM(2;3)", '=HYPERLINK("http://evil.example";"click")', "+1+1", "-2+3", "@A1"]
    history = History(meta={"tags": hostile, "nested": [{"=key": hostile}], "-k": "@v"})
    history.extend({"step": [1], "loss": [0.5]})
    history.note("=cmd", kind="switch")
    history.to_csv(tmp_path / "run.csv")
    first = (tmp_path / "run.csv").read_text(encoding="utf-8").splitlines()[0]
    cells = next(csv.reader([first], skipinitialspace=True))
    assert [cell for cell in cells if cell.startswith(FORMULA_STARTS)] == [], cells
    assert History.load(tmp_path / "run.csv").meta == history.meta


def test_a_header_of_many_repeated_column_names_is_refused_in_linear_time(tmp_path):
    history = History()
    history.extend({"step": [1], "loss": [0.5]})
    history.to_csv(tmp_path / "run.csv")
    first = (tmp_path / "run.csv").read_text(encoding="utf-8").splitlines()[0]
    repeated = ",".join(["step"] * 40_000)
    (tmp_path / "hostile.csv").write_text(f"{first}\n{repeated}\n{repeated}\n", encoding="utf-8")
    started = time.perf_counter()
    with pytest.raises(ValueError, match="line 2: columns named twice: \\['step'\\]"):
        History.load(tmp_path / "hostile.csv")
    assert time.perf_counter() - started < 0.5  # 10 s when each name was counted in the whole row


def _refuse_constant(name: str) -> None:
    raise ValueError(f"not standard JSON: {name}")


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_an_event_holding_a_nan_or_inf_is_written_as_standard_json(tmp_path, suffix):
    """An overflow's origin event holds ``producer_max=nan`` (no producer value) and a value that
    would be inf: both written as the strings float() reads, as the columns' are."""
    history = History()
    history.extend({"step": [1], "loss": [math.nan]})
    history.note("step 1 skipped", kind="origin", step=1, producer_max=math.nan,
                 would_be=math.inf, nested={"low": -math.inf})  # fmt: skip
    path = tmp_path / f"run{suffix}"
    history.to_json(path) if suffix == ".json" else history.to_csv(path)
    text = path.read_text(encoding="utf-8")
    header = text if suffix == ".json" else text.partition("\n")[0].removeprefix("# mpnb-history ")
    json.loads(header, parse_constant=_refuse_constant)
    (event,) = History.load(path).events
    assert event == history.events[0]  # as it was noted: the numbers as float() reads them
    assert (event["producer_max"], event["would_be"], event["nested"]) == (
        "nan",
        "inf",
        {"low": "-inf"},
    )


def test_an_event_detail_of_numpy_or_a_tensor_is_kept_as_a_plain_number(tmp_path):
    # np.float64 (what sklearn's metrics return) made Trainer.save write a file its load
    # refused, and np.float32 / a 0-d tensor made to_json and to_csv raise TypeError
    import numpy as np
    import torch

    history = History()
    history.note("validation", accuracy=np.float64(0.93), loss=np.float32(0.5), step=np.int64(3),
                 grad=torch.tensor(2.0), scores=np.array([1, 2]))  # fmt: skip
    event = history.events[0]
    assert event["accuracy"] == 0.93 and type(event["accuracy"]) is float
    assert type(event["loss"]) is float and event["step"] == 3 and type(event["step"]) is int
    assert event["grad"] == 2.0 and event["scores"] == [1, 2]
    history.to_csv(tmp_path / "run.csv")
    assert History.load(tmp_path / "run.csv").events == history.events
    with pytest.raises(MpnbError, match=r"event detail 'model' is a Linear"):
        history.note("bad", model=torch.nn.Linear(1, 1))
    assert len(history.events) == 1  # nothing noted


def test_files_saved_with_a_byte_order_mark_load(tmp_path):
    # a UTF-8 BOM (Windows' Notepad, a spreadsheet's save) read as part of the first line
    from mpnb import OpLists

    history = History()
    history.extend({"step": [1], "loss": [0.5]})
    history.to_csv(tmp_path / "run.csv")
    text = (tmp_path / "run.csv").read_text(encoding="utf-8")
    (tmp_path / "bom.csv").write_text(text, encoding="utf-8-sig")
    assert History.load(tmp_path / "bom.csv").loss == [0.5]
    (tmp_path / "ops.txt").write_text("softmax\n", encoding="utf-8-sig")
    assert "softmax" in OpLists.from_files(tmp_path / "ops.txt").lower
