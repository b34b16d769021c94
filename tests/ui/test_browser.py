"""Real browser tests: JupyterLab and Voila served on loopback, driven by Debian's Chromium
through Playwright. Screenshots go to test-artifacts/ at the repository root.

Needs the ``chromium`` binary (``apt-get install chromium``) and JupyterLab, Notebook 7, Voila
and Playwright (the ``test`` extra); skipped without them, except in CI, where they must be there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.child_process import child_environment

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _missing() -> str | None:
    if shutil.which("chromium") is None:
        return "needs Debian's chromium (apt-get install chromium)"
    for module in ("playwright", "jupyterlab", "notebook", "voila"):
        if importlib.util.find_spec(module) is None:  # found, not imported: collection stays quick
            return f"needs {module} (pip install '.[test]')"
    return None


_reason = _missing()
if _reason and os.environ.get("CI"):
    raise RuntimeError(f"browser tests cannot run in CI: {_reason}")
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")


# Notebook 7's and jupytext's JupyterLab extensions (jupytext comes with the docs tooling) do not
# load inside Voila ("The getter for the shared module is not a function"): where they are
# installed, leave them out, as docs/guide/compare.md says.
VOILA_WITHOUT_LAB_ONLY_EXTENSIONS = (
    "--VoilaConfiguration.extension_denylist="
    '["@jupyter-notebook/lab-extension", "jupyterlab-jupytext"]'
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_http(url: str, process: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer in {timeout} s")


def jupyter_environment(root: pathlib.Path) -> dict[str, str]:
    """This process's environment with Jupyter's config, data and runtime dirs inside ``root``."""
    env = child_environment()
    for name in ("CONFIG", "DATA", "RUNTIME"):
        path = root / f"jupyter-{name.lower()}"
        path.mkdir()
        env[f"JUPYTER_{name}_DIR"] = str(path)
    return env


@pytest.fixture
def jupyter_env(tmp_path):
    """Jupyter's config, data and runtime dirs inside a throwaway directory."""
    return jupyter_environment(tmp_path)


@pytest.fixture(scope="module")
def jupyter_server(tmp_path_factory):
    """The module's Jupyter servers, one per app (``"lab"``, ``"notebook"``), each started on a
    free loopback port when a test first asks for it: ``jupyter_server(app)`` gives the folder
    it serves and its port. Each test writes its notebook into that folder and closes its
    sessions when it ends (:func:`close_sessions`). Notebook 7 gets a server of its own: after a
    JupyterLab page, Notebook 7's pages on the same server raise errors about Lab's commands."""
    started: dict[str, tuple[pathlib.Path, int, subprocess.Popen, object]] = {}

    def server(app: str) -> tuple[pathlib.Path, int]:
        if app not in started:
            root = tmp_path_factory.mktemp(f"jupyter-{app}")
            work = root / "work"
            work.mkdir()
            process, log, port = start_jupyter(app, work, jupyter_environment(root), root)
            started[app] = (work, port, process, log)
        return started[app][:2]

    try:
        yield server
    finally:
        for _, _, process, log in started.values():
            stop(process, log)


def close_sessions(port: int) -> None:
    """End every notebook session of the server at ``port`` (their kernels with them)."""
    base = f"http://127.0.0.1:{port}/api/sessions"
    with urllib.request.urlopen(base, timeout=10) as answer:
        sessions = json.load(answer)
    for session in sessions:
        request = urllib.request.Request(f"{base}/{session['id']}", method="DELETE")
        urllib.request.urlopen(request, timeout=30).close()


def serve(command: list[str], cwd: pathlib.Path, env: dict, url: str, log: pathlib.Path):
    handle = open(log, "w")
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT)
    try:
        wait_for_http(url, process)
    except BaseException:
        process.terminate()
        handle.close()
        raise RuntimeError(f"server failed to start; its log:\n{log.read_text()[-3000:]}") from None
    return process, handle


def stop(process: subprocess.Popen, handle) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
    handle.close()


@pytest.fixture(scope="module")
def chromium():
    """One headless Chromium for the module (each test gets its own context of it)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=shutil.which("chromium"), args=CHROMIUM_FLAGS
        )
        yield launched
        launched.close()


@pytest.fixture
def browser(chromium):
    """The module's Chromium; every page a test opens (each in a context of its own) is closed
    when the test ends."""
    yield chromium
    for context in chromium.contexts:
        context.close()


def console_errors(page) -> list[str]:
    """Console errors, page errors and failed local requests, collected as the page runs.

    This machine has no network: what a page asks of another host (Voila's template loads
    Font Awesome from a CDN) fails here and is not the app's error, so it is left out.
    """
    errors: list[str] = []

    def on_console(message) -> None:
        if message.type == "error" and "ERR_NAME_NOT_RESOLVED" not in message.text:
            errors.append(f"{message.text} (at {message.location.get('url', '?')})")

    def on_failed(request) -> None:
        if request.url.startswith("http://127.0.0.1"):
            errors.append(f"request failed: {request.url}")

    page.on("console", on_console)
    page.on("pageerror", lambda error: errors.append(f"{error} | {(error.stack or '')[:300]}"))
    page.on("requestfailed", on_failed)
    return errors


def notebook(cells: list[str]) -> str:
    return json.dumps(
        {
            "cells": [
                {
                    "cell_type": "code",
                    "execution_count": None,
                    "id": f"c{i}",
                    "metadata": {},
                    "outputs": [],
                    "source": c,
                }
                for i, c in enumerate(cells)
            ],
            "metadata": {
                "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}
            },
            "nbformat": 4,
            "nbformat_minor": 5,
        }
    )


def wait_for_idle_kernel(port: int, timeout: float = 90) -> None:
    """Until the page's notebook has a kernel that reports idle (the server's own view)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/sessions", timeout=5) as answer:
            sessions = json.load(answer)
        if any(s.get("kernel", {}).get("execution_state") == "idle" for s in sessions):
            return
        time.sleep(0.5)
    raise TimeoutError("the notebook's kernel did not become idle")


def drawn_until(page) -> float:
    """The last step the live dashboard's loss trace reaches in the browser (-1 before it has points).

    The trace's point count is no measure of growth: past ``max_points`` the dashboard merges
    neighbouring buckets, so a longer run can be drawn with fewer points.
    """
    return page.evaluate(
        "() => { const p = document.querySelector('.js-plotly-plot');"
        " const x = p && p.data && p.data[0] && p.data[0].x;"
        " return x && x.length ? Math.max(...x) : -1; }"
    )


def start_jupyter(app: str, work: pathlib.Path, env: dict, tmp_path: pathlib.Path):
    """``jupyter lab`` / ``jupyter notebook`` serving ``work`` on a free loopback port, no token."""
    port = free_port()
    command = [
        sys.executable, "-m", "jupyter", app, "--no-browser", "--allow-root", f"--port={port}", "--ip=127.0.0.1",
        "--ServerApp.token=", "--ServerApp.password=", "--ServerApp.disable_check_xsrf=True",
        "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]  # fmt: skip
    process, log = serve(
        command, work, env, f"http://127.0.0.1:{port}/api/status", tmp_path / "server.log"
    )
    return process, log, port


def run_all_cells(page, port: int, path: str) -> None:
    """Open the notebook at ``path``, wait for its kernel, and choose Run > Run All Cells."""
    page.goto(f"http://127.0.0.1:{port}{path}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    wait_for_idle_kernel(port)
    page.locator(".jp-Notebook").first.click()
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()


#: Each frontend's app and where it opens a notebook of the served folder.
FRONTENDS = {
    "jupyterlab": ("lab", "/lab/workspaces/mpnb-test/tree/{name}.ipynb?reset"),
    "notebook7": ("notebook", "/notebooks/{name}.ipynb"),
}
# Notebook 7.6 throws this from its own notebook_core bundle on opening any notebook here, a plain
# "1+1" notebook with nothing of mpnb loaded included: not ours to fix, so not counted against us.
KNOWN_FRONTEND_ERRORS = {"notebook7": ("Cannot read properties of undefined (reading 'schema')",)}


@pytest.mark.parametrize("frontend", list(FRONTENDS))
def test_panel_and_live_dashboard_control_a_running_fit(jupyter_server, browser, frontend):
    ARTIFACTS.mkdir(exist_ok=True)
    app, path = FRONTENDS[frontend]
    work, port = jupyter_server(app)
    (work / f"live-{frontend}.ipynb").write_text(
        notebook(
            [
                "%load_ext mpnb\nimport mpnb, mpnb.examples as ex\npanel = mpnb.panel()",
                "trainer, train, test = ex.example_trainer('bf16', 'cpu', widths=(8, 16))\n"
                "history = trainer.fit(train, epochs=400)",
                "print('RESULT', sorted(set(history.mode)), history.events[-1]['message'], len(history) < 400 * len(train))",
            ]
        )
    )
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors = console_errors(page)
        run_all_cells(page, port, path.format(name=f"live-{frontend}"))
        page.wait_for_selector(".widget-toggle-buttons", timeout=90_000)
        page.wait_for_selector(".js-plotly-plot", timeout=90_000)
        page.wait_for_function(
            "() => { const p = document.querySelector('.js-plotly-plot');"
            " return p && p.data && p.data[0] && p.data[0].x && p.data[0].x.length > 0; }",
            timeout=60_000,
        )
        first = drawn_until(page)
        deadline = time.monotonic() + 30
        while drawn_until(page) <= first and time.monotonic() < deadline:
            page.wait_for_timeout(150)
        grown = drawn_until(page)
        assert grown > first >= 0, (first, grown)  # the dashboard grows while the cell runs
        page.screenshot(path=str(ARTIFACTS / f"{frontend}-running-fit.png"))
        page.locator(".widget-toggle-buttons button", has_text="fp16").first.click()
        page.wait_for_timeout(1500)
        # the 400 steps may end before (or while) Stop is pressed: a disabled Stop is a fit
        # that ended by itself, which the result below reads as well
        page.evaluate(
            "() => { const b = [...document.querySelectorAll('button')]"
            ".find(b => b.textContent.includes('Stop')); if (b && !b.disabled) b.click(); }"
        )
        result = page.locator(".jp-OutputArea-output", has_text="RESULT")
        result.wait_for(timeout=90_000)
        page.screenshot(path=str(ARTIFACTS / f"{frontend}-after-stop.png"))
        assert (
            result.inner_text().strip() == "RESULT ['bf16', 'fp16'] stopped True"
        )  # seen from the kernel
        known = KNOWN_FRONTEND_ERRORS.get(frontend, ())
        assert not [e for e in errors if not e.startswith(known)], errors
    finally:
        close_sessions(port)


#: The step numbers of the live dashboard's loss trace after ``after``, and their loss range.
_LOSS_AFTER = """(after) => { const p = document.querySelector('.js-plotly-plot');
  const xs = Array.from(p.data[0].x || []), ys = Array.from(p.data[0].y || []);
  const late = ys.filter((_, i) => xs[i] > after);
  return [late.length, late.length ? Math.max(...late) - Math.min(...late) : 0]; }"""


def test_a_remedy_clicked_late_brings_the_scale_back_and_the_loss_moves(jupyter_server, browser):
    """The fp16 fit of a TransformerEncoder with a planted overflow, trained on one batch again
    and again: every step overflows and skips until the loss scale has collapsed; the remedy,
    clicked then, must bring the scale back, so that the loss, flat without training, moves."""
    ARTIFACTS.mkdir(exist_ok=True)
    work, port = jupyter_server("lab")
    model_source = (ROOT / "tests" / "ui" / "planted_encoder.py").read_text()
    (work / "late-remedy.ipynb").write_text(
        notebook(
            [
                "%load_ext mpnb\nimport torch, mpnb\n" + model_source,
                "model = planted_encoder()\n"
                "trainer = mpnb.Trainer(model, torch.optim.AdamW(model.parameters(), 1e-3),\n"
                "    torch.nn.functional.cross_entropy, mode='fp16', device='cpu',\n"
                "    watch_numerics=10, backoff_factor=2.0**-4, record_grad_norm=True,\n"
                "    on_nonfinite='ignore', flush_every=1)\n"
                "history = trainer.fit([encoder_batch()] * 400)",
                "kept = [e['step'] for e in history.events if e['kind'] == 'switch']\n"
                "back = [e['message'] for e in history.events if e['kind'] == 'scale']\n"
                "norms = history.grad_norm[kept[0] - 1:]\n"
                "print('RESULT', back[0].split(' from')[0], min(norms) > 0, len(set(history.loss[kept[0]:])) > 3)",
            ]
        )
    )
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1300})
        errors = console_errors(page)
        run_all_cells(page, port, "/lab/workspaces/mpnb-remedy/tree/late-remedy.ipynb?reset")
        remedy = page.locator("button", has_text="Run encoder.layers.1.linear2 in fp32")
        remedy.wait_for(timeout=120_000)
        page.wait_for_function(  # late: the loss scale has collapsed below 1
            "() => { const p = document.querySelector('.js-plotly-plot');"
            " return p && p.data[1].y && Array.from(p.data[1].y).some(v => v < 1); }",
            timeout=120_000,
        )
        for plot in page.locator(".js-plotly-plot").all():  # the output's width, not 700 pixels
            width, room = plot.evaluate("p => [p._fullLayout.width, p.parentElement.clientWidth]")
            assert width >= room - 2, (width, room)
        for button in page.locator(".widget-button").all():  # no label cut ("Run encoder.la...")
            fits = button.evaluate("b => b.scrollWidth <= b.clientWidth")
            assert fits, button.inner_text()
        dashboard = page.locator(".js-plotly-plot").first
        dashboard.evaluate("e => e.scrollIntoView({block: 'start'})")
        page.screenshot(path=str(ARTIFACTS / "late-remedy-before.png"))
        clicked_at = page.evaluate(
            "() => Math.max(...document.querySelector('.js-plotly-plot').data[1].x)"
        )
        remedy.click()
        page.wait_for_function(f"() => ({_LOSS_AFTER})({clicked_at + 2})[0] >= 8", timeout=120_000)
        drawn, spread = page.evaluate(f"({_LOSS_AFTER})({clicked_at + 2})")
        assert spread > 1e-3, (drawn, spread)  # one batch: a flat loss is a model not training
        dashboard.evaluate("e => e.scrollIntoView({block: 'start'})")
        page.screenshot(path=str(ARTIFACTS / "late-remedy-after.png"))
        heatmaps = page.locator(".js-plotly-plot").last
        heatmaps.evaluate("e => e.scrollIntoView({block: 'end'})")
        page.screenshot(path=str(ARTIFACTS / "late-remedy-heatmaps.png"))
        # the 400 steps may end before (or while) Stop is pressed: a disabled Stop is a fit
        # that ended by itself, which the result below reads as well
        page.evaluate(
            "() => { const b = [...document.querySelectorAll('button')]"
            ".find(b => b.textContent.includes('Stop')); if (b && !b.disabled) b.click(); }"
        )
        result = page.locator(".jp-OutputArea-output", has_text="RESULT")
        result.wait_for(timeout=90_000)
        assert result.inner_text().strip() == "RESULT loss scale back to 65536 True True"
        assert not page.locator(".jp-OutputArea-output", has_text="not JSON compliant").count()
        assert not errors, errors
    finally:
        close_sessions(port)


def _without_outputs(notebook_text: str) -> str:
    """The lesson as a reader opens it fresh: the outputs stored for the docs would otherwise
    stand on the page before its cells run again."""
    notebook = json.loads(notebook_text)
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    return json.dumps(notebook)


def test_the_quickstart_notebook_runs_in_jupyterlab_with_panel_and_growing_dashboard(
    jupyter_server, browser
):
    ARTIFACTS.mkdir(exist_ok=True)
    work, port = jupyter_server("lab")
    lesson = _without_outputs((ROOT / "notebooks" / "01_quickstart.ipynb").read_text())
    # The lesson's fit (8 epochs, 184 steps) ends in about two seconds; a browser slowed by a busy
    # machine draws the plot only after that, and could not show that it grew while training ran.
    # 64 times the epochs leaves it time to, without changing what the lesson does: the test stops
    # the fit once it has seen it drawn. (Eight times was not enough on a faster CPU: the fit of
    # 1466 steps had ended before the plot first showed.)
    assert lesson.count("epochs=8") == 1
    (work / "quickstart.ipynb").write_text(lesson.replace("epochs=8", "epochs=512"))
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors = console_errors(page)
        run_all_cells(page, port, "/lab/workspaces/mpnb-quickstart/tree/quickstart.ipynb?reset")
        page.wait_for_selector(".widget-toggle-buttons", timeout=90_000)  # the panel
        page.wait_for_selector(".js-plotly-plot", timeout=90_000)  # the live dashboard
        seen = set()
        finished = page.locator(".jp-OutputArea-output", has_text="test accuracy after")
        deadline = time.monotonic() + 120
        while not finished.count() and time.monotonic() < deadline:
            seen.add(drawn_until(page))
            if len({step for step in seen if step > 0}) >= 3:
                break  # drawn three times while it trains
            page.wait_for_timeout(150)
        if not finished.count():
            # the lesson's panel stops the fit, whose summary and accuracy then print (the rest
            # of the 512 epochs would show nothing new)
            page.locator("button", has_text="Stop").first.click()
        finished.wait_for(timeout=60_000)
        final = drawn_until(page)
        page.screenshot(path=str(ARTIFACTS / "quickstart.png"), full_page=True)
        growing = sorted(step for step in seen if 0 < step < final)
        assert growing, (seen, final)  # drawn while training ran, not only at the end
        assert (
            page.locator(".jp-OutputArea-output", has_text="torch.bfloat16 torch.float32").count()
            == 1
        )
        assert not page.locator(
            ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
            has_text="Error",
        ).count()
        assert not errors, errors
    finally:
        close_sessions(port)


def test_voila_serves_the_precision_lab_and_run_produces_the_table(tmp_path, jupyter_env, browser):
    ARTIFACTS.mkdir(exist_ok=True)
    port = free_port()
    command = [
        sys.executable, "-m", "voila", str(ROOT / "widgets" / "precision_lab.ipynb"), "--no-browser",
        f"--port={port}", "--Voila.ip=127.0.0.1", VOILA_WITHOUT_LAB_ONLY_EXTENSIONS,
    ]  # fmt: skip
    process, log = serve(
        command, ROOT, jupyter_env, f"http://127.0.0.1:{port}/", tmp_path / "voila.log"
    )
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        errors = console_errors(page)
        page.goto(f"http://127.0.0.1:{port}/", timeout=120_000)
        run = page.locator("button", has_text="Run")
        run.wait_for(timeout=120_000)
        assert "from mpnb.ui.widgets.lab import" not in page.content()  # no code shown to the user
        page.screenshot(path=str(ARTIFACTS / "voila-lab.png"))
        run.click()
        table = page.locator("table", has_text="speedup vs fp32")
        table.wait_for(timeout=180_000)
        rows = table.locator("tbody tr")
        assert rows.count() == 2 and rows.nth(0).inner_text().startswith("fp32")
        assert "1.00x" in rows.nth(0).inner_text()
        titles = page.evaluate(
            "() => [...document.querySelectorAll('.annotation-text')].map(e => e.textContent)"
        )
        assert "loss minus fp32's loss" in titles  # the live view's panels
        assert any(title.startswith("step time (ms)") for title in titles), titles
        page.screenshot(path=str(ARTIFACTS / "voila-lab-result.png"), full_page=True)
        assert not errors, errors
    finally:
        stop(process, log)


def test_the_compare_report_draws_every_panel_and_one_legend_in_the_browser(tmp_path, browser):
    import mpnb.examples as ex
    from mpnb.analysis.comparison import compare
    from mpnb.ui.plots.compare_report import _PANELS, write_comparison_files

    ARTIFACTS.mkdir(exist_ok=True)

    def make_run(mode):
        return ex.example_trainer(mode, "cpu", widths=(4, 8), dashboard=None)[:2]

    comparison = compare(make_run, ["fp32", "bf16"], steps=12, warmup=2, progress=None)
    write_comparison_files(tmp_path, comparison, "report in the browser", "cpu: test")
    page = browser.new_page(viewport={"width": 1400, "height": 1300})
    errors = console_errors(page)
    page.goto((tmp_path / "report.html").as_uri())
    page.wait_for_selector(".js-plotly-plot .legendtext", timeout=60_000)
    titles = page.evaluate(
        "() => [...document.querySelectorAll('.annotation-text')].map(e => e.textContent)"
    )
    assert set(_PANELS) <= set(titles), titles
    legends = page.evaluate(
        "() => [...document.querySelectorAll('.js-plotly-plot')].map("
        "plot => [...plot.querySelectorAll('.legendtext')].map(e => e.textContent))"
    )
    assert legends[0] == ["fp32", "bf16"]  # one entry per mode for all five panels
    # the memory of a step by category: stacked bars, bf16's weight copies among them
    assert {"activations", "weight copies", "optimizer state"} <= set(legends[1]), legends
    drawn = page.evaluate(
        "() => document.querySelector('.js-plotly-plot').data.map(t => t.x ? t.x.length : 0)"
    )
    assert (
        drawn[0] == 14 and drawn[7] == 14 and drawn[8] == 14
    )  # fp32 loss; bf16 loss and its difference
    assert (
        "IQR (ms)" in page.locator("table thead").first.inner_text()
        or "IQR (ms)" in page.locator("table tr").first.inner_text()
    )
    page.screenshot(path=str(ARTIFACTS / "compare-report.png"), full_page=True)
    assert not errors, errors
