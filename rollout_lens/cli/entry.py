"""The `rollout-lens` command: db, train, runs, export/import (ML imports only inside `train`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from pydantic import ValidationError
from sqlalchemy.exc import OperationalError

from rollout_lens.cli import (
    build_model,
    db,
    demo,
    dumps,
    exchange,
    prompts,
    rollouts,
    runs,
    serve,
    train,
    worker,
)
from rollout_lens.cli.base import fail, is_locked, locked_message, validation_text
from rollout_lens.client import ClientError
from rollout_lens.server.core.config import get_settings
from rollout_lens.server.core.errors import RolloutLensError
from rollout_lens.server.core.textsafe import printable

# The commands in the order `--help` lists them; each module registers its own.
COMMANDS = (db, train, runs, exchange, dumps, rollouts, prompts, worker, serve, build_model, demo)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = get_settings()
    except ValidationError as exc:
        return fail(f"invalid settings: {validation_text(exc)}")
    try:
        return int(args.handler(args, settings) or 0)
    except RolloutLensError as exc:
        return fail(str(exc))
    except ClientError as exc:  # a dashboard read by --url refused or could not be reached
        return fail(printable(str(exc)), status=1)
    except OperationalError as exc:
        if not is_locked(exc):
            raise
        return fail(locked_message(settings, waited=True), status=1)
    except KeyboardInterrupt:
        return fail("interrupted", status=130)


def build_parser() -> argparse.ArgumentParser:
    """The command's parser: a subcommand per command module."""
    parser = argparse.ArgumentParser(prog="rollout-lens", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_commands(sub)
    return parser
