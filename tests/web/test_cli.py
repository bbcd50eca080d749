"""The `rollout-lens` command on a real SQLite file: through `cli.main` in this process (an
interpreter start costs seconds), and as a user runs it (a subprocess) where the entry point
itself is what is checked: its exit status and what reaches the terminal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from rollout_lens import cli


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollout_lens", *args],
        env=os.environ | env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    return {"ROLLOUT_LENS_DATA_DIR": str(tmp_path / "data")}


def _main(
    args: list[str],
    env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `rollout-lens ARGS` run in this process, as the entry
    point (rollout_lens/__main__.py) turns them: main's return value or argparse's SystemExit.
    An exception main lets through fails the test here, where a subprocess prints a traceback."""
    with monkeypatch.context() as patched:
        for name, value in env.items():
            patched.setenv(name, value)
        try:
            status = cli.main(args)
        except SystemExit as exc:
            assert isinstance(exc.code, int), exc.code
            status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--steps", "0"], "steps"),
        (["train", "--steps", "1000000"], "steps"),
        (["train", "--k", "65"], "k"),
        (["train", "--group-size", "1"], "group_size"),
        (["train", "--lr", "-0.1"], "learning_rate"),
        (["train", "--verifier", "oracle"], "unknown verifier 'oracle'"),
        (
            ["train", "--model", "/no/such/model"],
            "neither `tiny`, a hub id, nor an existing folder",
        ),
        (["train", "--variant", "medium"], "invalid choice"),
        (["train", "--supervision", "magic"], "supervision"),
        (
            ["train", "--supervision", "hint", "--supervised-per-group", "8"],
            "smaller than group_size",
        ),
        (["train", "--steps", "many"], "invalid int value"),
        (["export", "7"], "run 7 does not exist"),
    ],
)
def test_bad_arguments_fail_clearly(
    cli_env: dict[str, str],
    args: list[str],
    message: str,
    migrated_sqlite: Callable[[Path], str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    migrated_sqlite(Path(cli_env["ROLLOUT_LENS_DATA_DIR"]) / "rollout-lens.db")
    status, _, err = _main(args, cli_env, monkeypatch, capsys)
    assert status == 2
    assert message in err
    assert "Traceback" not in err


def test_the_entry_point_exits_with_the_status_of_a_bad_argument(cli_env: dict[str, str]) -> None:
    """`python -m rollout_lens` (as the console script) exits with argparse's status 2."""
    done = _cli(["train", "--steps", "many"], cli_env)
    assert done.returncode == 2 and "invalid int value" in done.stderr
    assert "Traceback" not in done.stderr


def test_runs_on_an_unmigrated_database_says_how_to_fix(
    cli_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The entry point exits with the status main returns (not only argparse's SystemExit).
    done = _cli(["runs"], cli_env)  # no database at all: said, and nothing created
    assert done.returncode == 2 and "no Rollout Lens database here" in done.stderr
    data = Path(cli_env["ROLLOUT_LENS_DATA_DIR"])
    assert not data.exists()
    data.mkdir()
    (data / "rollout-lens.db").touch()  # a database file that was never migrated
    done = _cli(["runs"], cli_env)
    assert done.returncode == 2 and "rollout-lens db upgrade" in done.stderr
    assert _main(["db", "upgrade"], cli_env, monkeypatch, capsys)[0] == 0
    status, out, _ = _main(["runs"], cli_env, monkeypatch, capsys)
    assert status == 0 and "no runs yet" in out


def test_build_model_prints_the_folder_alone(
    cli_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--model "$(rollout-lens build-model)"`: stdout is the model's folder, nothing else."""
    pytest.importorskip("transformers")
    status, out, err = _main(["build-model"], cli_env, monkeypatch, capsys)
    assert status == 0 and "tiny model" in err
    folder = Path(out.removesuffix("\n"))
    assert out.count("\n") == 1 and (folder / "config.json").is_file()


def test_bad_setting_is_reported(
    cli_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env = cli_env | {"ROLLOUT_LENS_PRICE_PER_DEVICE_HOUR": "cheap"}
    status, _, err = _main(["runs"], env, monkeypatch, capsys)
    assert status == 2 and "price_per_device_hour" in err


def test_runs_prints_no_terminal_escapes_from_a_run(
    tmp_path: Path,
    migrated_sqlite: Callable[[Path], str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A name sent through the web API with colour, title (OSC) and bidi sequences: `runs`
    prints its text and none of the control characters (a subprocess: what reaches a terminal)."""
    from rollout_lens.server.store.db import make_engine, make_session_factory

    from tests.web_support import client_for

    url = migrated_sqlite(tmp_path / "rollout-lens.db")
    engine = make_engine(url)
    client = client_for(make_session_factory(engine), data_dir=tmp_path)
    name = "\u001b[31mRED\u001b]0;pwned-title\u0007 \u009b2J\u202eevil"
    launched = client.post("/api/runs", json={"steps": 1, "name": name})
    assert launched.status_code == 201, launched.text
    engine.dispose()
    done = _cli(
        ["runs"], {"ROLLOUT_LENS_DATABASE_URL": url, "ROLLOUT_LENS_DATA_DIR": str(tmp_path)}
    )
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stdout.splitlines() if "RED" in x]
    assert line.endswith("[31mRED]0;pwned-title 2Jevil")
    for control in ("\x1b", "\x07", "\x9b", "\u202e"):
        assert control not in done.stdout
    status, listed, _ = _main(
        ["runs", "--format", "json"], {"ROLLOUT_LENS_DATABASE_URL": url}, monkeypatch, capsys
    )
    assert status == 0 and "\x1b" not in listed and json.loads(listed)[0]["name"] == name


def test_train_options_are_runconfigs_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every RunConfig field is a `train` option with its description as help; what is given
    reaches RunConfig as typed values, what is left out takes the config's defaults."""
    from rollout_lens.server.core.runconfig import RunConfig

    from rollout_lens.cli import build_parser
    from rollout_lens.cli.runconfig import config_values

    monkeypatch.setenv("COLUMNS", "10000")  # help on one line a option: no words hyphen-wrapped
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    dests = {a.dest for a in train._actions}
    assert set(RunConfig.model_fields) <= dests
    help_text = " ".join(train.format_help().split())
    for field in RunConfig.model_fields.values():
        assert " ".join((field.description or "").rstrip(".").split()) in help_text

    args = parser.parse_args(
        ["train", "--lr", "0.01", "--sft-learning-rate", "0.002", "--variant", "leaky"]
        + ["--control-token", "<a>", "--control-token", "<b>", "--keep-tokens-every", "5"]
    )
    values = config_values(args, RunConfig)
    assert values == {
        "variant": "leaky",
        "learning_rate": 0.01,
        "sft_learning_rate": 0.002,
        "control_tokens": ["<a>", "<b>"],
        "keep_tokens_every": 5,
    }
    config = RunConfig(**values)
    assert config.steps == RunConfig().steps and config.learning_rate == 0.01
    # A multi-turn run left without a budget still gets RunConfig's multi-turn default.
    multi = parser.parse_args(["train", "--turns", "multi"])
    assert RunConfig(**config_values(multi, RunConfig)).max_completion_tokens == 128


def test_a_field_without_an_option_spelling_fails_at_once() -> None:
    import argparse

    from pydantic import BaseModel

    from rollout_lens.cli.runconfig import UnsupportedField, add_config_options

    class Odd(BaseModel):
        limits: dict[str, int] = {}

    with pytest.raises(UnsupportedField, match="'limits'"):
        add_config_options(argparse.ArgumentParser(), Odd)
