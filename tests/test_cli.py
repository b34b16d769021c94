"""The ``mpnb`` command and the import-weight promise, as a user meets them: in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys


def mpnb(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpnb", *args], capture_output=True, text=True, timeout=120)


def test_devices_report():
    result = mpnb("devices")
    assert result.returncode == 0, result.stderr
    assert "cpu" in result.stdout and "bf16 -> bf16" in result.stdout and "fp32 math" in result.stdout


def test_devices_json():
    result = mpnb("devices", "--json", "--no-check")
    report = json.loads(result.stdout)
    cpu = next(d for d in report["devices"] if d["type"] == "cpu")
    assert cpu["available"] and cpu["autocast_dtypes"] == ["bf16", "fp16"] and cpu["verified"] == {}


def test_bad_command_is_an_error_that_lists_the_commands():
    result = mpnb("fly")
    assert result.returncode == 2 and "'fly'" in result.stderr and "devices" in result.stderr


def test_import_mpnb_stays_light():
    code = "import sys, mpnb; print([m for m in ('IPython', 'ipywidgets', 'plotly') if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "[]", result.stderr
