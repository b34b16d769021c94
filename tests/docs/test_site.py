"""The documentation site: `mkdocs build --strict` as CI runs it, into a temporary folder, then
the pages a reader lands on, checked for what they must say, and two of them in a real browser.

Needs the docs tools (in the ``test`` extra); skipped without them, except in CI.
"""

from __future__ import annotations

import functools
import html
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.test_public_surface import PUBLIC

ROOT = pathlib.Path(__file__).resolve().parents[2]
HOOKS = ROOT / "docs" / "hooks"

try:
    import mkdocs  # noqa: F401
    import mkdocs_jupyter  # noqa: F401
    import mkdocstrings  # noqa: F401
except ImportError as missing:
    if os.environ.get("CI"):
        raise RuntimeError(f"the docs site cannot be built in CI: {missing}") from None
    pytest.skip(f"needs the docs tools (pip install '.[docs]'): {missing}", allow_module_level=True)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    """The site, built strictly (a warning, a broken link or an undocumented name fails it)."""
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def _text(page: pathlib.Path) -> str:
    """A page's visible text, tags removed, entities decoded, spaces collapsed."""
    raw = re.sub(r"<(script|style)\b.*?</\1>", " ", page.read_text(), flags=re.DOTALL)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", "", raw)))


def _hook(name: str):
    """A module of docs/hooks/, imported as mkdocs imports it."""
    sys.path.insert(0, str(HOOKS))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(HOOKS))


PAGES = [
    "index.html",
    "getting-started/index.html",
    *(
        f"guide/{name}/index.html"
        for name in (
            "modes",
            "oplists",
            "training",
            "integrations",
            "distributed",
            "compare",
            "numerics",
            "fp8",
            "security",
        )
    ),
    "behaviour/index.html",
    "lessons/index.html",
    *(f"lessons/{path.stem}/index.html" for path in sorted((ROOT / "notebooks").glob("*.ipynb"))),
    "performance/index.html",
    "reference/index.html",
]


def test_the_strict_build_writes_every_page_of_the_navigation(site):
    assert [page for page in PAGES if not (site / page).is_file()] == []


def test_the_front_page_shows_the_dashboard_and_leads_to_each_part(site):
    front = (site / "index.html").read_text()
    assert 'src="images/dashboard.png"' in front and (site / "images/dashboard.png").stat().st_size
    for target in ("getting-started/", "lessons/", "guide/numerics/", "behaviour/", "reference/"):
        assert f'href="{target}' in front, target


def test_getting_started_gives_the_make_run_contract_and_the_trainer_on_your_model(site):
    text = _text(site / "getting-started/index.html")
    assert "(trainer, train_data) or (trainer, train_data, metric)" in text
    assert "mpnb.Trainer(model" in text and "def make_run(mode):" in text


def test_a_lesson_page_shows_its_code_and_its_stored_outputs(site):
    text = _text(site / "lessons/01_quickstart/index.html")
    assert "%load_ext mpnb" in text
    # A checked output of the notebook (nbval compares it), as committed.
    assert "torch.bfloat16 torch.float32" in text
    # and one it does not check, stored by notebooks/store_outputs.py: %amp's status table
    assert "mpnb status" in text and "cpu (auto-detected)" in text


def test_a_lessons_plotly_figure_is_drawn_with_the_sites_own_plotly(site):
    page = (site / "lessons/10_memory/index.html").read_text()
    assert 'class="mpnb-figure"' in page and "js/lesson-figures.js" in page
    assert (site / "js/plotly.min.js").stat().st_size > 1_000_000


@functools.cache
def _store_outputs():
    """notebooks/store_outputs.py, the script that runs the lessons and stores their outputs
    (loaded once for the twelve lessons' checks)."""
    path = ROOT / "notebooks" / "store_outputs.py"
    spec = importlib.util.spec_from_file_location("store_outputs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "lesson", sorted(p.name for p in (ROOT / "notebooks").glob("[0-9]*.ipynb"))
)
def test_each_lessons_stored_outputs_come_from_its_current_code(lesson):
    store_outputs = _store_outputs()
    notebook = json.loads((ROOT / "notebooks" / lesson).read_text())
    assert store_outputs.stored_hash(notebook) == store_outputs.code_hash(notebook), (
        f"{lesson}'s code changed since its outputs were stored: python notebooks/store_outputs.py {lesson}"
    )
    code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert sum(bool(cell["outputs"]) for cell in code) >= len(code) // 2, "too few outputs stored"
    shown = json.dumps(notebook)
    assert store_outputs.WIDGET_VIEW not in shown and "/site-packages/" not in shown


def test_what_moved_out_of_the_readme_is_in_the_guide(site):
    behaviour = _text(site / "behaviour/index.html")
    assert "No cast cache by default." in behaviour and "Precedence:" in behaviour
    security = _text(site / "guide/security/index.html")
    assert "MPNB_LAUNCH_SECRET" in security and "weights_only=True" in security


def test_the_performance_page_shows_the_committed_results(site):
    text = _text(site / "performance/index.html")
    for path in (ROOT / "benchmarks/results").glob("*.json"):
        assert f"benchmarks/results/{path.name}" in text, path.name
    peers = json.loads((ROOT / "benchmarks/results/peers.json").read_text())["results"]["bf16"]
    trainer = peers["8"]["mpnb.Trainer"]
    assert f"{trainer['ratio']:.3f}x ({trainer['own_s_per_step'] * 1e6:.0f} us" in text
    training = json.loads((ROOT / "benchmarks/results/training_overhead.json").read_text())
    assert f"{training['results'][0]['ratio_trainer_over_hand']:.3f}x" in text


def test_the_api_reference_has_an_entry_for_every_public_name(site):
    definitions = _hook("api_coverage")._definitions()
    assert set(definitions) == set(PUBLIC)
    anchors = set()
    for page in (site / "reference").rglob("*.html"):
        anchors |= set(re.findall(r'\bid="(mpnb[\w.]*)"', page.read_text()))
    assert sorted({path for path in definitions.values()} - anchors) == []
    assert "mpnb.training.trainer.Trainer.fit" in anchors  # methods too


def test_a_public_name_missing_from_the_reference_fails_the_build():
    from mkdocs.exceptions import PluginError

    coverage = _hook("api_coverage")
    documented = set(coverage._definitions().values())
    coverage._documented.clear()
    coverage._documented.update(documented - {"mpnb.training.trainer.Trainer"})
    try:
        with pytest.raises(
            PluginError, match=r"mpnb\.Trainer \(defined as mpnb\.training\.trainer"
        ):
            coverage.on_env(None, None, None)
    finally:
        coverage._documented.clear()


def test_a_reference_block_for_a_module_not_written_yet_is_left_out():
    coverage = _hook("api_coverage")
    page = type("Page", (), {"file": type("File", (), {"src_uri": "guide/fp8.md"})()})()
    markdown = (
        "before\n<!-- if mpnb.precision.not_written -->\n::: mpnb.precision.not_written\n"
        "<!-- end if -->\n<!-- if mpnb.training.trainer -->\nkept\n<!-- end if -->\nafter\n"
    )
    assert coverage.on_page_markdown(markdown, page) == "before\nkept\nafter\n"


def test_no_page_loads_anything_from_another_host(site):
    external = re.compile(r'<(?:link|script|img)\b[^>]*\b(?:href|src)="(?:https?:)?//', re.I)
    offenders = [
        str(page.relative_to(site))
        for page in site.rglob("*.html")
        if external.search(page.read_text()) or "fonts.googleapis" in page.read_text()
    ]
    assert offenders == []


@functools.cache
def _browser_helpers():
    from tests.ui import test_browser

    return test_browser


def test_the_front_page_and_a_lesson_in_a_real_browser(site, tmp_path):
    browser_tests = _browser_helpers()
    if browser_tests._reason:
        pytest.skip(browser_tests._reason)
    from playwright.sync_api import sync_playwright

    port = browser_tests.free_port()
    process, handle = browser_tests.serve(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        site,
        dict(os.environ),
        f"http://127.0.0.1:{port}/",
        tmp_path / "server.log",
    )
    browser_tests.ARTIFACTS.mkdir(exist_ok=True)
    try:
        with sync_playwright() as playwright:
            chromium = playwright.chromium.launch(
                executable_path=browser_tests.shutil.which("chromium"),
                args=browser_tests.CHROMIUM_FLAGS,
            )
            page = chromium.new_page(viewport={"width": 1280, "height": 900})
            errors = browser_tests.console_errors(page)

            page.goto(f"http://127.0.0.1:{port}/", wait_until="networkidle")
            image = page.locator("article img").first
            assert image.evaluate("img => img.complete && img.naturalWidth") > 1000
            assert "mpnb" in page.title()
            assert page.locator("nav").get_by_text("Getting started").first.is_visible()
            page.screenshot(path=str(browser_tests.ARTIFACTS / "docs-front-page.png"))

            page.goto(f"http://127.0.0.1:{port}/lessons/01_quickstart/", wait_until="networkidle")
            cells = page.locator(".jp-Cell")
            assert cells.count() > 10
            assert page.get_by_text("%load_ext mpnb").first.is_visible()
            page.screenshot(
                path=str(browser_tests.ARTIFACTS / "docs-lesson-01.png"), full_page=False
            )

            page.goto(f"http://127.0.0.1:{port}/lessons/10_memory/", wait_until="networkidle")
            page.wait_for_selector(".mpnb-figure .js-plotly-plot", timeout=30_000)  # drawn
            chromium.close()
    finally:
        browser_tests.stop(process, handle)
    assert errors == []
    for name in ("docs-front-page.png", "docs-lesson-01.png"):
        assert (browser_tests.ARTIFACTS / name).stat().st_size > 20_000, name


def test_the_front_page_counts_the_lessons_there_are(site):
    count = len(list((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")))
    number = _hook("lesson_count").NUMBERS[count]
    assert f"The {number} lessons" in _text(site / "index.html")


def test_every_in_page_link_of_a_lesson_lands_on_an_anchor(site):
    """The table of contents slugs a heading without its inline code; the page gave the heading
    an id with it (lesson 8's "Pitfall 1: `fp16=True` on a CPU"): six links landed nowhere."""
    broken = {}
    for page in sorted(site.glob("lessons/*/index.html")):
        markup = page.read_text()
        ids = set(re.findall(r'\bid="([^"]+)"', markup))
        missing = sorted({a for a in re.findall(r'href="#([^"]+)"', markup) if a not in ids})
        if missing:
            broken[page.parent.name] = missing
    assert broken == {}


def test_lesson_outputs_and_code_scroll_rather_than_wrap_or_cut(site):
    page = (site / "lessons/10_memory/index.html").read_text()
    sheet = re.search(r'href="([^"]*css/lessons\.css)"', page)
    assert sheet, "the lesson pages load the site's lesson style sheet"
    rules = (site / "css/lessons.css").read_text()
    assert "white-space: pre" in rules and "overflow-x: auto" in rules


def test_the_sites_search_finds_a_name_inside_code(site):
    """The search index splits text as its separator says: `trainer.keep_in_fp32(...)` must
    give the token `keep_in_fp32` (the default splits only at spaces and dashes, so a search
    found 3 of the pages that name it)."""
    index = json.loads((site / "search/search_index.json").read_text())
    separator = re.compile(index["config"]["separator"])
    for name in ("keep_in_fp32", "max_batch_size"):
        mentioning = [d for d in index["docs"] if name in _plain(d["text"])]
        found = [d for d in mentioning if name in separator.split(_plain(d["text"]))]
        assert len(mentioning) > 3 and len(found) == len(mentioning), (
            name,
            [d["location"] for d in mentioning if d not in found][:5],
        )


def _plain(text: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", " ", text))


def test_the_performance_page_reads_as_prose_units_not_json_keys(site):
    """Headers in words (no snake_case), bytes in KiB/MiB/GiB, no raw byte counts."""
    page = (site / "performance/index.html").read_text()
    headers = re.findall(r"<th[^>]*>(.*?)</th>", page, flags=re.DOTALL)
    assert headers and not [h for h in headers if "_" in h], [h for h in headers if "_" in h][:5]
    text = _text(site / "performance/index.html")
    assert "1.0 GiB" in text and "1073741824" not in text  # batch_size_answer's budget


def test_the_fp8_guide_gives_each_idea_a_heading_and_an_example_with_its_output(site):
    page = (site / "guide/fp8/index.html").read_text()
    headings = re.findall(r"<h2[^>]*>(.*?)</h2>", page, flags=re.DOTALL)
    assert len(headings) >= 5, headings
    text = _text(site / "guide/fp8/index.html")
    assert "converted: ['layers.3']" in text and "fp8:rowwise on cpu" in text


def test_the_performance_page_draws_the_committed_peer_results(site):
    page = (site / "performance/index.html").read_text()
    section = page[page.index('<h3 id="peers">') :]  # peers.json's; peers-cuda*.json come first
    plots = re.findall(r'<figure class="mpnb-plot"><svg.*?</svg>', section, flags=re.DOTALL)
    peers = json.loads((ROOT / "benchmarks/results/peers.json").read_text())["results"]
    assert len(plots) >= len(peers)
    bars = re.findall(r"<title>mpnb\.Trainer, batch (\d+): ([\d.]+)x</title>", plots[0])
    first_mode = next(iter(peers.values()))
    expected = [(b, f"{cells['mpnb.Trainer']['ratio']:.3f}") for b, cells in first_mode.items()]
    assert bars == expected


def test_the_lessons_page_shows_each_notebook_on_binders_machine(site):
    """Every lesson and the precision lab, measured on one core with 2 GB
    (benchmarks/binder_lessons.py): each row of the committed results, and each fits."""
    figures = json.loads((ROOT / "benchmarks/results/binder_lessons.json").read_text())
    names = [p.name for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))]
    assert set(names) | {"precision_lab.ipynb"} <= set(figures["notebooks"])
    text = _text(site / "lessons/index.html")
    for name, row in figures["notebooks"].items():
        assert f"{name} {row['seconds']:.0f} s" in text, name
    assert all(row["fits"] for row in figures["notebooks"].values()), figures["notebooks"]


def test_the_performance_page_draws_every_results_files_ratios(site):
    """Not only the peers': each committed results file that holds a ratio (a speedup, a cost
    over a baseline) has a plot of them, a bar a ratio with its value in the hover text."""
    page = (site / "performance/index.html").read_text()
    for path in sorted((ROOT / "benchmarks/results").glob("*.json")):
        if path.stem.startswith("peers"):
            continue
        text = path.read_text()
        ratios = [float(v) for v in re.findall(r'"[^"]*(?:ratio|speedup)[^"]*": ([\d.]+)', text)]
        ratios = [r for r in ratios if r > 0]  # a zero ratio (nothing measured) has no bar
        if not ratios:
            continue
        start = page.index(f'<h3 id="{path.stem}"')
        end = page.find("<h3 ", start + 1)
        section = page[start : end if end > 0 else None]
        plot = re.search(r'<figure class="mpnb-plot"><svg.*?</svg>', section, flags=re.DOTALL)
        assert plot, path.name
        drawn = re.findall(r"<title>[^<]*: ([\d.]+)x</title>", plot.group(0))
        assert sorted(round(float(v), 3) for v in drawn) == sorted(round(r, 3) for r in ratios)
