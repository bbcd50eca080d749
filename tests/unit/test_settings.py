"""Settings: one class, env prefix ROLLOUT_LENS_, every field documented (docs/deployment/)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from pydantic import ValidationError
from rollout_lens.server.core.config import Settings

# The README links to this page (docs/deployment/settings.md), the one table of every setting.
SETTINGS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "deployment" / "settings.md"


def test_every_setting_is_documented() -> None:
    table = SETTINGS_PAGE.read_text()
    documented = set(re.findall(r"^\| `(ROLLOUT_LENS_[A-Z_]+)` \|", table, re.M))
    expected = {f"ROLLOUT_LENS_{name.upper()}" for name in Settings.model_fields}
    assert expected - documented == set(), "undocumented settings"
    assert documented - expected == set(), "the docs document settings that do not exist"


def test_defaults_live_under_the_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLOUT_LENS_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("ROLLOUT_LENS_MODEL_CACHE_DIR", raising=False)  # `make test` sets it
    monkeypatch.delenv("ROLLOUT_LENS_DATABASE_URL", raising=False)
    settings = Settings()
    assert settings.database_url == f"sqlite:///{tmp_path}/rollout-lens.db"
    assert settings.models_dir == tmp_path / "models"
    assert settings.broker_url == ""


def test_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_LENS_DATABASE_URL", "postgresql+psycopg://u@h/db")
    monkeypatch.setenv("ROLLOUT_LENS_BROKER_URL", "redis://127.0.0.1:6379/0")
    settings = Settings()
    assert settings.database_url == "postgresql+psycopg://u@h/db"
    assert settings.broker_url == "redis://127.0.0.1:6379/0"


def test_bad_values_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_LENS_PRICE_PER_DEVICE_HOUR", "-1")
    with pytest.raises(ValidationError, match="price_per_device_hour"):
        Settings()


def test_the_callers_settings_never_reach_a_test() -> None:
    # tests/conftest.py removes them: run `ROLLOUT_LENS_DATABASE_URL=postgresql://… make check`
    # and this (with test_cli's and test_compose's defaults) still sees the embedded default.
    from tests.conftest import KEPT_ENVIRONMENT

    leaked = sorted(
        n for n in os.environ if n.startswith("ROLLOUT_LENS_") and n not in KEPT_ENVIRONMENT
    )
    assert leaked == []
    assert Settings().database_url.startswith("sqlite:")
