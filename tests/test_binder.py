"""binder/ agrees with pyproject.toml, and its set-up steps leave an environment that runs the quickstart."""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from torch.utils import cpp_extension

tomllib = pytest.importorskip(
    "tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib"
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def binder_lines() -> list[str]:
    lines = (BINDER / "requirements.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def binder_requirements() -> dict[str, Requirement]:
    requirements = (Requirement(line) for line in binder_lines() if not line.startswith("-"))
    return {requirement.name.lower(): requirement for requirement in requirements}


#: The extras the lessons import (08: transformers, Lightning; 11-13: torchao's formats; 12-13:
#: a GPT-2 from transformers): Binder installs them too.
LESSON_EXTRAS = ("transformers", "lightning", "fp8")


def project_requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    texts = [
        *project["dependencies"],
        *(t for extra in LESSON_EXTRAS for t in project["optional-dependencies"][extra]),
    ]
    return {Requirement(text).name.lower(): Requirement(text) for text in texts}


def test_binder_installs_every_runtime_dependency_with_the_same_versions():
    binder, project = binder_requirements(), project_requirements()
    assert set(project) <= set(binder), (
        f"missing from binder/requirements.txt: {set(project) - set(binder)}"
    )
    for name, requirement in project.items():
        if name != "torch":
            assert binder[name].specifier == requirement.specifier, name
    assert {"jupyterlab", "voila"} <= set(binder)


def test_binder_torch_is_a_pinned_cpu_build_that_pyproject_accepts():
    (pin,) = binder_requirements()["torch"].specifier
    assert pin.operator == "==" and pin.version.endswith("+cpu")
    assert project_requirements()["torch"].specifier.contains(pin.version.split("+")[0])
    assert f"--extra-index-url {CPU_INDEX}" in binder_lines()


def test_postbuild_installs_mpnb_itself_and_the_readme_links_exist():
    post_build = BINDER / "postBuild"
    assert os.access(post_build, os.X_OK) and "pip install --no-deps ." in post_build.read_text()
    readme = (ROOT / "README.md").read_text()
    for target in ("notebooks/01_quickstart.ipynb", "widgets/precision_lab.ipynb"):
        assert (ROOT / target).exists() and target.replace("/", "%2F") in readme, target


def _venv_python(venv: pathlib.Path) -> pathlib.Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _files_and_times(folder: pathlib.Path) -> dict[str, int]:
    return {str(path): path.stat().st_mtime_ns for path in folder.rglob("*") if path.is_file()}


#: Where the wheels of binder/requirements.txt are kept between runs (MPNB_BINDER_WHEELS, or the
#: user's cache folder), one folder per version of the file.
WHEEL_CACHE = pathlib.Path(
    os.environ.get("MPNB_BINDER_WHEELS") or pathlib.Path.home() / ".cache" / "mpnb-binder-wheels"
)


def _wheels_of(python: pathlib.Path, env: dict[str, str]) -> pathlib.Path:
    """The wheels binder/requirements.txt resolves to, downloaded once by the fresh venv's pip
    (the first run needs the package index; later runs none)."""
    import hashlib

    digest = hashlib.sha256((BINDER / "requirements.txt").read_bytes()).hexdigest()[:16]
    folder = WHEEL_CACHE / digest
    if not (folder / "complete").exists():
        folder.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            [str(python), "-m", "pip", "download", "--quiet", "--only-binary=:all:",
             "--dest", str(folder), "-r", str(BINDER / "requirements.txt")],
            env=env, capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        (folder / "complete").touch()
    return folder


def test_binder_setup_in_a_fresh_venv_runs_the_quickstart(tmp_path):
    """What Binder does, with torch already installed: requirements, postBuild, then the quickstart."""
    repo = tmp_path / "repo"
    shutil.copytree(
        ROOT,
        repo,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "test-artifacts", "build", "*.egg-info", "__pycache__", "mpnb-*"
        ),
    )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = _venv_python(venv)
    # PIP_RETRIES=0: where an index cannot be reached (CI has no network), fail over at once instead of
    # backing off five times per package.
    env = {
        **os.environ,
        "PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}",
        "VIRTUAL_ENV": str(venv),
        "PIP_RETRIES": "0",
    }
    env.pop("PYTHONPATH", None)
    # Binder's image writes bytecode. Here pip installs without compiling (most of what it installs
    # is never imported), so let the steps write it as they import: the quickstart's kernel then
    # finds what nbconvert compiled (its run took 31 s with no bytecode written, 25 s with).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    # Binder's image starts with no build of the list kernels; and this venv's torch lives at
    # another path, so a build into the suite's own extension folder would make the suite's next
    # process that lists an op rebuild them (a minute's wait, under a lock, mid-test).
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "torch-extensions")
    shared_builds = pathlib.Path(cpp_extension.get_default_build_root())
    builds_before = _files_and_times(shared_builds)

    def step(*command: str) -> None:
        result = subprocess.run(
            command, cwd=repo, env=env, capture_output=True, text=True, timeout=900
        )
        assert result.returncode == 0, (
            f"{' '.join(command)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )

    # "torch already installed": this process's own, linked in (pip would unpack and byte-compile
    # all of it again, a third of the test's time); its dependencies come from the requirements.
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    torch_files = importlib.metadata.distribution("torch")
    for top in {path.parts[0] for path in torch_files.files} - {".."}:  # ..: its scripts
        (pathlib.Path(site) / top).symlink_to(torch_files.locate_file(top))
    # The requirements are resolved and installed by pip as Binder does, from wheels: fetched
    # from the package index once into a cache named by the requirements' contents, then
    # installed with no index (a run took 310 s resolving and downloading every time).
    wheels = _wheels_of(python, env)
    step(
        str(python),
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-compile",
        "--no-index",
        "--find-links",
        str(wheels),
        "-r",
        "binder/requirements.txt",
    )
    step("bash", "binder/postBuild")
    executed = tmp_path / "quickstart.ipynb"
    step(
        str(python),
        "-m",
        "jupyter",
        "nbconvert",
        "--to",
        "notebook",
        "--execute",
        "--ExecutePreprocessor.timeout=120",
        "--output",
        str(executed),
        "notebooks/01_quickstart.ipynb",
    )
    assert _files_and_times(shared_builds) == builds_before, "the suite's kernel builds changed"
    assert list((tmp_path / "torch-extensions").rglob("*.so")), "postBuild built no kernels"
    cells = json.loads(executed.read_text())["cells"]
    errors = [
        o for cell in cells for o in cell.get("outputs", []) if o.get("output_type") == "error"
    ]
    assert not errors, errors
    texts = (o.get("text", "") for cell in cells for o in cell.get("outputs", []))
    printed = "".join(text if isinstance(text, str) else "".join(text) for text in texts)
    assert "torch.bfloat16 torch.float32" in printed and "test accuracy after" in printed
