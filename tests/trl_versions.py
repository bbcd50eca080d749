"""Virtual environments with one TRL version each, for testing against the range we declare.

pyproject.toml's `train` extra admits `trl>=1.0,<2` and `transformers>=4.56.2,<6`. The newest
end is what constraints.txt pins; the oldest end needs other pins (transformers 4.x brings an
older tokenizers, huggingface_hub and datasets), listed in PINS as what differs from
constraints.txt. Each venv gets torch==2.13.0 first (a bare torch would pull a CUDA build), then
TRL with its pins, then this project in editable mode with its train extra, so the code under test is
the checkout's. Venvs are cached by version under ROLLOUT_LENS_TEST_VENVS (or the given base),
keyed by the checkout, its pyproject.toml, constraints.txt and the pins. Where the tests' own
venv already holds a version as constraints.txt pins it (make test's venv holds the newest), that
venv is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no lock; one test process at a time
    fcntl = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"
OLDEST = "1.0.0"
NEWEST = "1.16.0"
# Per TRL version, the pins that differ from constraints.txt (found by installing and training
# tests/scripts/user_grpo.py). Empty: constraints.txt as it is. trl 1.0.0 also trains with
# transformers 5.24.0, but only with `requests` installed: trl 1.0 to 1.14 import it when
# GRPOTrainer loads (generation/vllm_client.py) and declare it for their [vllm] extra only, and
# transformers 5 no longer brings it; with transformers 4.56 huggingface_hub 0.x brings it.
PINS: dict[str, dict[str, str]] = {
    OLDEST: {
        "transformers": "4.56.2",
        "tokenizers": "0.22.2",
        "huggingface-hub": "0.36.2",
        "datasets": "5.0.1",
        "fsspec": "2026.6.0",
    },
    NEWEST: {},
}
READY = "rollout-lens-venv.json"


def venvs_dir(base: Path) -> Path:
    """Where the cached venvs live: ROLLOUT_LENS_TEST_VENVS if set, else `base`."""
    configured = os.environ.get("ROLLOUT_LENS_TEST_VENVS")
    return Path(configured) if configured else Path(base)


def venv_with_trl(version: str, base: Path) -> Path:
    """A venv with torch 2.13.0, TRL `version` and its pins and this project; returns its folder."""
    if version not in PINS:
        raise ValueError(f"no pins for trl {version}; known: {', '.join(PINS)}")
    if _this_venv_has(version):
        return Path(sys.prefix)
    key = _cache_key(version)
    folder = venvs_dir(base) / f"trl-{version}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _lock(folder.parent / f".trl-{version}.lock"):
        if _ready_key(folder) == key:
            return folder
        shutil.rmtree(folder, ignore_errors=True)  # another key, or a build that was killed
        started = time.perf_counter()
        _build(folder, version)
        seconds = time.perf_counter() - started
        (folder / READY).write_text(json.dumps({"key": key, "build_seconds": round(seconds, 1)}))
    return folder


def _this_venv_has(version: str) -> bool:
    """Whether the tests' own venv is that venv already: TRL `version` under constraints.txt as it
    is (no pins of its own) and this checkout installed in it (make test builds it so, from the
    project's files). Then the newest end is tested there, not in a copy built for it (minutes)."""
    from importlib import metadata

    if PINS[version] or sys.prefix == sys.base_prefix:
        return False
    try:
        if metadata.version("trl") != version or not metadata.version("torch").startswith("2.13.0"):
            return False
    except metadata.PackageNotFoundError:
        return False
    import rollout_lens

    return Path(rollout_lens.__file__).resolve().is_relative_to(ROOT)


def python(venv: Path) -> Path:
    """The venv's interpreter."""
    return venv / "bin" / "python"


def build_seconds(venv: Path) -> float:
    """How long the venv took to build (0 for the tests' own venv, built before them)."""
    ready = venv / READY
    return float(json.loads(ready.read_text())["build_seconds"]) if ready.exists() else 0.0


def constraints(version: str) -> str:
    """constraints.txt with the version's pins in place of its own lines for those packages."""
    pins = {_norm(name): f"{name}=={v}" for name, v in PINS[version].items()}
    pins[_norm("trl")] = f"trl=={version}"
    lines = []
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name = re.split(r"[=<>!~ ;\[]", line.strip(), maxsplit=1)[0]
        if line.strip() and not line.startswith("#") and _norm(name) in pins:
            continue
        lines.append(line)
    return "\n".join([*lines, *pins.values()]) + "\n"


def clean_env() -> dict[str, str]:
    """The environment without a checkout on the path or our settings (as a user's would be)."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV")
    return {
        k: v for k, v in os.environ.items() if k not in drop and not k.startswith("ROLLOUT_LENS_")
    }


def _build(folder: Path, version: str) -> None:
    subprocess.run([sys.executable, "-m", "venv", str(folder)], env=clean_env(), check=True)
    pinned = folder / "constraints.txt"
    pinned.write_text(constraints(version))
    pip = [str(python(folder)), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, TORCH])  # first: a bare torch requirement would pull a CUDA build
    # As a user adds us to an environment that has its TRL: the train extra, under the pins.
    _run([*pip, "-c", str(pinned), f"trl=={version}", "-e", f"{ROOT}[train]"])


def _run(command: list[str]) -> None:
    done = subprocess.run(command, env=clean_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed:\n{done.stdout[-4000:]}{done.stderr[-4000:]}"
        )


def _cache_key(version: str) -> str:
    digest = hashlib.sha256(f"{version}\n{TORCH}\n{ROOT}\n{constraints(version)}".encode())
    digest.update((ROOT / "pyproject.toml").read_bytes())
    return digest.hexdigest()[:16]


def _ready_key(folder: Path) -> str | None:
    try:
        return str(json.loads((folder / READY).read_text())["key"])
    except (OSError, ValueError, KeyError):
        return None


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    if fcntl is None:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # another test process builds the same venv: wait
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
