"""The `train` command: train and record one GRPO run in this process (no queue)."""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import ValidationError

from rollout_lens.cli.base import fail, migrated_factory, train_extra_missing, validation_text
from rollout_lens.cli.runconfig import add_config_options, config_values
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.runconfig import RunConfig
from rollout_lens.server.core.textsafe import printable


def add_commands(sub: Any) -> None:
    """Register `train` (an option per RunConfig field) on the CLI's subparsers."""
    train = sub.add_parser(
        "train",
        help="train and record one GRPO run",
        description="Train and record one GRPO run in this process (no queue).",
    )
    add_config_options(train, RunConfig)
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.set_defaults(handler=_train)


def _train(args: argparse.Namespace, settings: Settings) -> int:
    from rollout_lens.trainer.worker.modelref import ModelUnavailable, check_model

    problem = train_extra_missing("training")
    if problem:  # before the database is made
        return fail(problem)

    try:
        config = RunConfig(**config_values(args, RunConfig))
    except ValidationError as exc:
        return fail(f"invalid run: {validation_text(exc)}")
    try:  # this process trains: the model must be here
        config = config.model_copy(update={"model": check_model(config.model)})
    except ModelUnavailable as exc:
        return fail(f"invalid run: model: {exc}")
    engine, factory = migrated_factory(settings)
    engine.dispose()
    from rollout_lens.trainer.recorder.progress import ProgressBar
    from rollout_lens.trainer.worker.run import train

    with ProgressBar(total=config.steps, disabled=args.quiet) as bar:
        run_id = train(config, settings=settings, on_step=bar.update, log_line=bar.write)
    print(f"run {run_id} ({printable(config.name)}) recorded in {settings.database_url}")
    print(f"run_id={run_id}")
    return 0
