"""The ``mpnb`` command and the import-weight promise, as a user meets them: in a subprocess."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from mpnb.training.history import History


def mpnb(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mpnb", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def test_devices_report():
    result = mpnb("devices")
    assert result.returncode == 0, result.stderr
    assert (
        "cpu" in result.stdout and "bf16 -> bf16" in result.stdout and "fp32 math" in result.stdout
    )
    assert "cpu layer modes: fp8: emulated" in result.stdout
    assert max(map(len, result.stdout.splitlines())) <= 100  # a terminal's width, not 300+


def test_devices_json():
    result = mpnb("devices", "--json", "--no-check")
    report = json.loads(result.stdout)
    cpu = next(d for d in report["devices"] if d["type"] == "cpu")
    assert cpu["available"] and cpu["autocast_dtypes"] == ["bf16", "fp16"] and cpu["verified"] == {}


def test_version_is_printed():
    import mpnb as package

    result = mpnb("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"mpnb {package.__version__}"


def test_the_installed_distribution_has_the_package_version():
    import importlib.metadata

    import mpnb as package

    assert importlib.metadata.version("mpnb") == package.__version__


def test_bad_command_is_an_error_that_lists_the_commands():
    result = mpnb("fly")
    assert result.returncode == 2 and "'fly'" in result.stderr and "devices" in result.stderr


def test_import_mpnb_stays_light():
    code = "import sys, mpnb; print([m for m in ('IPython', 'ipywidgets', 'plotly', 'sklearn') if m in sys.modules])"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.stdout.strip() == "[]", result.stderr


def test_the_example_digits_load_without_importing_sklearn_and_equal_its_loaders():
    """A new process (a kernel, ``mpnb train``) reads the digits without paying scikit-learn's
    import; the tensors are exactly what ``sklearn.datasets.load_digits`` gives."""
    code = (
        "import sys, torch, mpnb.examples as ex\n"
        "images, labels = ex.load_digits()\n"
        "imported = 'sklearn' in sys.modules\n"
        "from sklearn.datasets import load_digits\n"
        "bunch = load_digits()\n"
        "same = torch.equal(images, torch.from_numpy(bunch.images).float().div(16).unsqueeze(1))\n"
        "print(imported, same, torch.equal(labels, torch.from_numpy(bunch.target).long()))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.stdout.strip() == "False True True", result.stderr


def test_train_prints_progress_and_summary_and_writes_history_and_dashboard(tmp_path):
    result = mpnb(
        "train",
        "--steps",
        "12",
        "--mode",
        "fp16",
        "--device",
        "cpu",
        "--batch-size",
        "128",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    notice, out = out.split(
        "\n", 1
    )  # fp16 on a CPU is announced before training, with a measured estimate
    assert (
        notice.startswith("fp16 convolutions have no fast CPU kernels: about ")
        and "12 steps take about" in notice
    )
    assert out.startswith(
        "training DigitsCNN, fp16 on cpu, 21,386 parameters\nstep 1  epoch 0  loss "
    )
    summary = re.search(
        r"test accuracy ([\d.]+)%, final loss ([\d.]+), (\d+) skipped steps, peak memory .+, median step",
        out,
    )
    assert summary, out
    history = History.load(tmp_path / "mpnb-train" / "history.csv")
    assert len(history) == 12 and set(history.mode) == {"fp16"}
    assert int(summary.group(3)) == len(history.skipped_steps)
    assert float(summary.group(2)) == round(history.summary()["final_loss"], 4)
    page = (tmp_path / "mpnb-train" / "dashboard.html").read_text()
    assert "<script src=" not in page and "Plotly.newPlot" in page and "test accuracy" in page


def test_train_rejects_bad_input_naming_the_valid_values(tmp_path):
    result = mpnb("train", "--mode", "fp5", cwd=tmp_path)
    assert (
        result.returncode == 2
        and "unknown mode 'fp5'; valid: off, fp32, tf32, fp16, bf16, fp8" in result.stderr
    )
    result = mpnb("train", "--steps", "0", cwd=tmp_path)
    assert result.returncode == 2 and "must be a positive whole number, got 0" in result.stderr
    assert not (tmp_path / "mpnb-train").exists()


def test_compare_end_to_end_writes_table_csv_json_and_a_self_contained_report(tmp_path):
    from html.parser import HTMLParser

    result = mpnb(
        "compare",
        "--modes",
        "fp32,bf16,fp16",
        "--steps",
        "4",
        "--warmup",
        "1",
        "--model",
        "mlp",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "bf16  done: 5 steps, median " in result.stdout  # a progress bar per mode, then its end
    table = result.stdout[result.stdout.index("mode  step (ms)") :].splitlines()
    assert [line.split()[0] for line in table[1:4]] == [
        "fp32",
        "bf16",
        "fp16",
    ] and "1.00x" in table[1]
    assert max(len(line) for line in table[: table.index("")]) <= 120, table
    out = tmp_path / "mpnb-compare"
    assert [m["mode"] for m in json.loads((out / "comparison.json").read_text())["modes"]] == [
        "fp32",
        "bf16",
        "fp16",
    ]
    assert (out / "comparison.csv").read_text().splitlines()[0].startswith("mode,")

    class Page(HTMLParser):
        def __init__(self):
            super().__init__()
            self.cells, self.remote_scripts, self.tag = [], [], None

        def handle_starttag(self, tag, attrs):
            self.tag = tag
            if tag == "script" and dict(attrs).get("src", "").startswith("http"):
                self.remote_scripts.append(dict(attrs)["src"])

        def handle_data(self, data):
            if self.tag in ("td", "th"):
                self.cells.append(data.strip())

    page = Page()
    page.feed((out / "report.html").read_text())
    assert {"speedup vs fp32", "test accuracy", "fp32", "bf16", "fp16"} <= set(page.cells)
    assert page.remote_scripts == [] and "Plotly.newPlot" in (out / "report.html").read_text()


def test_compare_lists_a_mode_that_cannot_train_the_model_and_runs_the_others(tmp_path):
    # fp8 converts none of the CNN's Linear layers: its row says why, fp32 still runs
    result = mpnb("compare", "--modes", "fp32,fp8", "--steps", "2", "--warmup", "0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    table = result.stdout[result.stdout.index("mode  step (ms)") :]
    assert table.splitlines()[1].split()[0] == "fp32"
    assert "fp8: not run: fp8 would convert no layer of DigitsCNN" in " ".join(table.split())


def test_compare_says_when_it_replaces_an_earlier_runs_files(tmp_path):
    # a second run replaced the first one's mpnb-compare/ without a word
    args = ("compare", "--modes", "fp32", "--steps", "1", "--warmup", "0")
    first, second = mpnb(*args, cwd=tmp_path), mpnb(*args, cwd=tmp_path)
    assert first.returncode == second.returncode == 0, second.stderr
    assert "replacing" not in first.stdout
    assert (
        "(replacing an earlier run's comparison.csv, comparison.json, report.html)" in second.stdout
    )


def test_compare_fails_when_no_mode_ran(tmp_path):
    """A script or CI job must not read a table of dashes as success."""
    result = mpnb("compare", "--modes", "fp8", "--steps", "2", "--warmup", "0", cwd=tmp_path)
    assert result.returncode == 2
    assert "not run: fp8 would convert no layer of DigitsCNN" in " ".join(result.stdout.split())
    assert "mpnb compare: no mode ran (fp8); the notes above say why" in result.stderr


def test_compare_rejects_bad_input_before_running():
    for args, bad in ((["--modes", "fp32,fp5"], "'fp5'"), (["--model", "resnet"], "'resnet'")):
        result = mpnb("compare", *args)
        assert result.returncode == 2 and bad in result.stderr and "valid:" in result.stderr


def test_every_bad_value_is_one_line_naming_it_and_its_range_with_nothing_created(tmp_path):
    cases = [
        (["train", "--seed", str(10**30)], [str(10**30), "0 to 18446744073709551615"]),
        (["train", "--seed", "-1"], ["-1", "0 to 18446744073709551615"]),
        (["compare", "--seed", str(2**64)], [str(2**64), "0 to 18446744073709551615"]),
        (["train", "--steps", "2.5"], ["'2.5'", "a positive whole number"]),
        (["train", "--lr", "inf"], ["inf", "a positive number"]),
        (["train", "--out", "a/../b", "--mode", "fp5"], ["'fp5'", "valid: off, fp32"]),
        (["compare", "--out", "c/../d", "--modes", "fp5"], ["'fp5'", "valid:"]),
        # an empty name was dropped, keeping nothing the user asked for
        (["train", "--mode", "fp8", "--model", "mlp", "--keep", ""], ["--keep", "''"]),
    ]
    for args, said in cases:
        result = mpnb(*args, cwd=tmp_path)
        errors = [line for line in result.stderr.splitlines() if not line.startswith("usage:")]
        assert result.returncode == 2 and "Traceback" not in result.stderr, (args, result.stderr)
        assert len(errors) == 1 and all(part in errors[0] for part in said), (args, result.stderr)
        assert list(tmp_path.iterdir()) == [], (args, list(tmp_path.iterdir()))


def test_an_unknown_option_of_a_command_is_said_by_that_command():
    # "mpnb: unrecognized arguments: --bogus (see mpnb --help)", whose help lists no options
    result = mpnb("devices", "--bogus")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "mpnb devices: unrecognized arguments: --bogus (see mpnb devices --help)"
    )


def test_out_with_a_parent_step_creates_only_the_folder_it_names(tmp_path):
    result = mpnb("train", "--model", "mlp", "--steps", "1", "--out", "a/../b", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (
        sorted(p.name for p in tmp_path.iterdir()) == ["b"]
        and "wrote b/history.csv" in result.stdout
    )
