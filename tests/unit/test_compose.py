"""docker-compose.yml describes the multi-machine shape and passes `docker-compose config`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml
from rollout_lens.server.core.config import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_compose_file_is_valid_and_configures_every_service_the_same_way() -> None:
    compose = shutil.which("docker-compose")
    assert compose, "Debian's docker-compose validates the file offline; .ci/run installs it"
    done = subprocess.run([compose, "config"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load(done.stdout)
    services = config["services"]
    assert set(services) == {"postgres", "redis", "migrate", "web", "worker"}
    settings = {f"ROLLOUT_LENS_{name.upper()}" for name in Settings.model_fields}
    envs = [services[name]["environment"] for name in ("migrate", "web", "worker")]
    assert envs[0] == envs[1] == envs[2]
    assert set(envs[0]) <= settings
    assert envs[0]["ROLLOUT_LENS_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert envs[0]["ROLLOUT_LENS_BROKER_URL"].startswith("redis://")
    assert services["migrate"]["command"] == ["rollout-lens", "db", "upgrade"]
    assert services["worker"]["command"] == ["rollout-lens", "worker"]
    gpu = services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    assert services["web"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
