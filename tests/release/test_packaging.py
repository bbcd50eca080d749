"""The wheel and the sdist install the dashboard alone (no torch) and serve it from anywhere."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest
from rollout_lens.server.store.migrate import head_revision

from tests import web_support

ROOT = Path(__file__).resolve().parents[2]
# What the build never needs: version control, virtual environments, caches and build outputs.
NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    ".venv*",
    ".rollout-lens",
    ".ci",
    "__pycache__",
    "*.pyc",
    "*_cache",
    "*.egg-info",
    ".mypy-tree",
    "build",
    "dist",
    "test-artifacts",
)
ML_MODULES = ("torch", "transformers", "trl", "accelerate", "datasets")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist and the wheel, built from a copy of the checkout (the build writes in-tree)."""
    source = tmp_path_factory.mktemp("source") / "rollout-lens"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    out = tmp_path_factory.mktemp("dist")
    # Without flags `build` makes the sdist, then the wheel from the unpacked sdist.
    done = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(source)],
        cwd=out,  # not the checkout, where a folder named `build` would shadow the module
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = out.glob("rollout_lens-*.whl")
    (sdist,) = out.glob("rollout_lens-*.tar.gz")
    log = out / "build.log"
    log.write_text(done.stdout + done.stderr)
    return {"wheel": wheel, "sdist": sdist, "log": log}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status, response.headers.get("content-type", ""), response.read().decode()


def _outside_env(data_dir: Path) -> dict[str, str]:
    """A user's environment: no checkout on the path, none of our settings but the data dir."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV")
    env = {
        k: v for k, v in os.environ.items() if k not in drop and not k.startswith("ROLLOUT_LENS_")
    }
    return env | {"ROLLOUT_LENS_DATA_DIR": str(data_dir)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_installed_package_serves_the_dashboard(
    kind: str, artifacts: dict[str, Path], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    env = _outside_env(data)  # also for pip: a checkout on PYTHONPATH would look installed
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], env=env, check=True, timeout=120)
    python = venv / "bin" / "python"
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt")]
        + [str(artifacts[kind])],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    present = subprocess.run(
        [
            str(python),
            "-c",
            f"import importlib.util as u; print([m for m in {ML_MODULES!r} if u.find_spec(m)])",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert present.stdout.strip() == "[]", "the dashboard install pulled the ML stack"
    demo = subprocess.run(
        [str(venv / "bin" / "rollout-lens"), "demo", "--no-serve"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert demo.returncode == 2 and "rollout-lens[train]" in demo.stderr, demo.stderr

    # A user's folder with modules named like ours: the installed package must not import them.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in ("trainer", "server", "web", "migrations"):
        (elsewhere / f"{name}.py").write_text(
            f"raise RuntimeError('imported the user\\'s {name}.py')\n"
        )
    port = _free_port()
    log = tmp_path / "serve.log"
    with (
        log.open("w") as out,
        subprocess.Popen(
            [str(venv / "bin" / "rollout-lens"), "serve", "--port", str(port)],
            cwd=elsewhere,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        ) as proc,
    ):
        try:
            base = f"http://127.0.0.1:{port}"
            page, deadline = None, time.monotonic() + 60
            while page is None and time.monotonic() < deadline:
                assert proc.poll() is None, f"serve exited: {log.read_text()}"
                try:
                    page = _get(f"{base}/")
                except OSError:
                    time.sleep(0.2)
            assert page is not None and page[0] == 200, log.read_text()
            css = re.search(r'href="(/static/app\.css\?[^"]*)"', page[2])
            assert css, page[2][:2000]
            status, content_type, body = _get(base + css.group(1))
            assert status == 200 and content_type.startswith("text/css") and body
            status, _, form = _get(f"{base}/runs/new")
            assert status == 200 and "leaky" in form.lower()
            if kind == "wheel":  # the local worker of a dashboard-only install cannot train
                web_support.launch_fails_saying_why(base, log)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    output = log.read_text()
    assert "Traceback" not in output and "imported the user" not in output, output
    db = data / "rollout-lens.db"
    assert db.is_file()
    with sqlite3.connect(db) as conn:
        (revision,) = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    assert revision == head_revision()


def test_dockerfile_copies_what_the_package_is_built_from() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", project["project"]["readme"], "constraints.txt"}
    needed |= set(project["tool"]["setuptools"]["package-dir"].values())
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = set()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            copied |= {p.removeprefix("./").rstrip("/") for p in line.split()[1:-1]}
    assert needed <= copied, f"the Dockerfile does not COPY {sorted(needed - copied)}"
    install = next(line for line in dockerfile.splitlines() if "'.[train]'" in line)
    assert "-c constraints.txt" in install and " -e " not in install


# What only the tests and the linters use: the demo's and the dashboard's install leave them out.
TEST_TOOLS = {
    "pytest",
    "playwright",
    "ruff",
    "mypy",
    "schemathesis",
    "build",
    "plotly",
    "hypothesis",
}


def _make_variable(name: str) -> str:
    for line in (ROOT / "Makefile").read_text().splitlines():
        match = re.match(rf"{name}\s*\?=\s*(.*)$", line)
        if match:
            return match.group(1).strip()
    raise AssertionError(f"the Makefile sets no {name}")


@pytest.mark.slow
def test_the_demos_install_leaves_the_test_tools_out(tmp_path: Path) -> None:
    extras = _make_variable("EXTRAS")  # what `make demo` and `make run` install into .venv
    assert "test" not in extras.split(","), extras
    # pip resolves the install as `make demo` would and reports it, installing nothing.
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q"]
        + ["--report", str(report), "-c", str(ROOT / "constraints.txt"), f".[{extras}]"],
        cwd=ROOT,
        env=_outside_env(tmp_path / "data"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert {"torch", "transformers", "trl"} <= names
    assert not names & TEST_TOOLS, f"the demo's install brings {sorted(names & TEST_TOOLS)}"


def test_the_prebuilt_models_are_packaged_for_the_current_recipes() -> None:
    from rollout_lens.trainer.builders import prebuilt

    for kind in prebuilt.KINDS:
        assert (prebuilt.packaged_dir(kind) / "model.safetensors").is_file(), kind.name
        # A recipe, an env's text or a pinned library changed without `make prebuilt`: the
        # package would still work (it builds instead), only slowly.
        assert prebuilt.packaged_hash(kind) == kind.recipe_hash, (
            f"rollout_lens/models/{kind.name} is stale: run `make prebuilt`"
        )


@pytest.mark.slow
def test_the_build_says_nothing_about_the_packages_configuration(
    artifacts: dict[str, Path],
) -> None:
    """A data folder missing from `packages` made every install (editable too) print ~90 lines."""
    log = artifacts["log"].read_text()
    assert "Successfully built" in log
    assert "absent from the `packages` configuration" not in log
    assert "BuildBackendWarning: Package" not in log


@pytest.mark.slow
def test_the_wheel_carries_the_prebuilt_models(artifacts: dict[str, Path]) -> None:
    import zipfile

    from rollout_lens.trainer.builders import prebuilt

    with zipfile.ZipFile(artifacts["wheel"]) as wheel:
        names = set(wheel.namelist())
    for kind in prebuilt.KINDS:
        for name in (
            "model.safetensors",
            "tokenizer.json",
            "config.json",
            "rollout_lens_build.json",
        ):
            assert f"rollout_lens/models/{kind.name}/{name}" in names, (kind.name, name)
