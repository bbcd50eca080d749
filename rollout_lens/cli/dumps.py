"""The `import-trl`, `import-verl`, `import-nemo-rl` and `import-slime` commands: a run from what
those trainers already write, imported in one go or followed while they write it (`--follow`)."""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rollout_lens.cli.base import migrated_factory
from rollout_lens.cli.numbers import COUNT, POSITIVE
from rollout_lens.cli.remote import add_remote_options, remote_client
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.core.textsafe import printable
from rollout_lens.server.exchange.dump_files import SETTLE_SECONDS

INTERRUPTED = 130  # the exit status after Ctrl-C (128 + SIGINT), as a shell reports it


def add_commands(sub: Any) -> None:
    """Register the commands on the CLI's subparsers."""
    trl = sub.add_parser(
        "import-trl", help="create a run from TRL's completions/completions_NNNNN.parquet files"
    )
    trl.add_argument("output_dir", type=Path, help="the GRPOTrainer's output_dir")
    trl.add_argument("--name", help="the new run's name (default: TRL <folder name>)")
    trl.add_argument(
        "--num-generations",
        type=POSITIVE,
        dest="num_generations",
        help="completions per prompt (default: detected from runs of identical prompts)",
    )
    trl.add_argument("--model", default="unknown", help="the model that was trained")
    trl.add_argument(
        "--reward",
        action="append",
        dest="rewards",
        help="a reward column (repeat; default: every numeric column besides step and advantage)",
    )
    _follow_options(trl)
    add_remote_options(trl)
    trl.set_defaults(handler=_import_trl)

    verl = sub.add_parser(
        "import-verl",
        help="create a run from verl's rollout dumps (trainer.rollout_data_dir: {step}.jsonl)",
    )
    verl.add_argument("folder", type=Path, help="verl's trainer.rollout_data_dir")
    verl.add_argument("--name", help="the new run's name (default: verl <folder name>)")
    verl.add_argument(
        "--n",
        type=POSITIVE,
        help="responses per prompt, verl's rollout.n (default: detected from runs of identical "
        "inputs)",
    )
    verl.add_argument(
        "--true-score-key",
        dest="true_score_key",
        metavar="KEY",
        help="the reward function's extra key that holds the true score (default: acc, if there)",
    )
    verl.add_argument("--model", help="the model that was trained")
    verl.add_argument(
        "--validation",
        type=Path,
        metavar="DIR",
        help="verl's trainer.validation_data_dir: becomes the run's evaluation series",
    )
    verl.add_argument(
        "--metrics",
        type=Path,
        metavar="FILE",
        help="verl's file logger output (trainer.logger=['console','file'], the file at "
        "VERL_FILE_LOGGER_PATH): every number verl logs for a step, as verl/<key>",
    )
    _follow_options(verl)
    add_remote_options(verl)
    verl.set_defaults(handler=_import_verl)
    _two_sided_commands(sub)


def _two_sided_commands(sub: Any) -> None:
    """The trainers whose dumps hold both sides: the generator's logprobs beside the trainer's."""
    nemo = sub.add_parser(
        "import-nemo-rl",
        help="create a run from NeMo-RL's per-step training dumps (train_data_step{N}.jsonl), "
        "the generator's logprobs beside the trainer's",
    )
    nemo.add_argument("folder", type=Path, help="the folder NeMo-RL's logger writes them into")
    nemo.add_argument("--name", help="the new run's name (default: NeMo-RL <folder name>)")
    nemo.add_argument(
        "--group-size",
        type=POSITIVE,
        dest="group_size",
        metavar="N",
        help="generations per prompt (default: detected from runs of identical prompts)",
    )
    _follow_options(nemo)
    add_remote_options(nemo)
    nemo.set_defaults(handler=_import_nemo_rl)

    slime = sub.add_parser(
        "import-slime",
        help="create a run from slime's or miles' debug dumps (--save-debug-rollout-data, "
        "--dump-details: rollout_data/{id}.pt, train_data/{id}.pt)",
    )
    slime.add_argument(
        "folder", type=Path, help="the --dump-details folder, or a folder of rollout dumps"
    )
    slime.add_argument("--name", help="the new run's name (default: slime <folder name>)")
    slime.add_argument(
        "--group-size",
        type=POSITIVE,
        dest="group_size",
        metavar="N",
        help="samples per prompt, slime's --n-samples-per-prompt (default: detected)",
    )
    slime.add_argument(
        "--reward-key",
        dest="reward_key",
        metavar="KEY",
        help="where a sample's reward is a dict: the key that holds the scalar reward",
    )
    _follow_options(slime)
    add_remote_options(slime)
    slime.set_defaults(handler=_import_slime)


def _follow_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--follow",
        action="store_true",
        help="keep recording new steps as the trainer writes them; the run shows as running "
        "until --idle passes (completed) or Ctrl-C (cancelled, exit status 130); run again to "
        "resume",
    )
    parser.add_argument(
        "--idle",
        type=float,
        metavar="SECONDS",
        help="with --follow: end the run as completed after this long without a new step",
    )
    parser.add_argument(
        "--new",
        action="store_true",
        help="with --follow: start a new run even where one follows this folder (the trainer "
        "started over in it)",
    )
    parser.add_argument(
        "--total-steps",
        type=COUNT,
        dest="total_steps",
        metavar="N",
        help="the steps the trainer will run (verl: trainer.total_training_steps; TRL: "
        "max_steps), for progress and ETA while following (default: the last step recorded)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=SETTLE_SECONDS,
        metavar="SECONDS",
        help="the newest step's file is read once its size and time held this long (default "
        f"{SETTLE_SECONDS:g}); earlier ones as soon as a later step's file exists",
    )


def _import_trl(args: argparse.Namespace, settings: Settings) -> int:
    from rollout_lens.server.exchange.trl_import import TrlDump

    fmt = TrlDump(
        args.output_dir,
        name=args.name,
        num_generations=args.num_generations,
        model=args.model,
        reward_columns=args.rewards,
    )
    return _run(fmt, args, settings, what="logged steps")


def _import_verl(args: argparse.Namespace, settings: Settings) -> int:
    from rollout_lens.server.exchange.verl_import import VerlDump

    fmt = VerlDump(
        args.folder,
        validation=args.validation,
        name=args.name,
        n=args.n,
        true_score_key=args.true_score_key,
        model=args.model,
        metrics=args.metrics,
    )
    return _run(fmt, args, settings, what="steps")


def _import_nemo_rl(args: argparse.Namespace, settings: Settings) -> int:
    from rollout_lens.server.exchange.nemo_rl_import import NemoRlDump

    fmt = NemoRlDump(args.folder, name=args.name, group_size=args.group_size)
    return _run(fmt, args, settings, what="steps")


def _import_slime(args: argparse.Namespace, settings: Settings) -> int:
    from rollout_lens.server.exchange.slime_import import SlimeDump

    fmt = SlimeDump(
        args.folder, name=args.name, group_size=args.group_size, reward_key=args.reward_key
    )
    return _run(fmt, args, settings, what="steps")


def _run(fmt: Any, args: argparse.Namespace, settings: Settings, *, what: str) -> int:
    """Import the folder in one go, or follow it."""
    if (args.idle is not None or args.new) and not args.follow:
        raise InvalidInput("--idle and --new go with --follow")
    if args.settle < 0 or (args.idle is not None and args.idle <= 0):
        raise InvalidInput("--settle must be at least 0 and --idle more than 0 seconds")
    if args.total_steps is not None and args.total_steps < 1:
        raise InvalidInput(f"--total-steps must be at least 1, not {args.total_steps}")
    files = fmt.scan()  # a clear error before the database is touched (or created)
    if not files and not args.follow:
        raise InvalidInput(fmt.empty)
    lens = remote_client(args, settings)
    if lens is not None:
        if args.follow:
            raise InvalidInput(
                "--follow records into a database of this machine; with --url, import the "
                "folder in one go (or follow it where the dashboard's database is reachable)"
            )
        with lens:
            return _send(lens, fmt, args, settings, what=what)
    engine, factory = migrated_factory(settings)
    try:
        if not args.follow:
            from rollout_lens.server.exchange.dump_import import import_dumps

            done = import_dumps(factory, fmt, settle=args.settle, total_steps=args.total_steps)
            print(
                f"imported run {done.run_id} ({printable(done.name)}) from {fmt.folder}: {done.steps} "
                f"{what}, {done.rollouts} rollouts"
            )
            print(f"run_id={done.run_id}")
            return 0
        return _follow(factory, fmt, args, settings)
    finally:
        engine.dispose()


def _send(lens: Any, fmt: Any, args: argparse.Namespace, settings: Settings, *, what: str) -> int:
    """--url: the folder imported into a scratch SQLite file here (the same reader and checks),
    exported as Parquet and sent to the dashboard, which imports it (keeping its source)."""
    import tempfile

    from rollout_lens.server.exchange import export
    from rollout_lens.server.exchange.dump_import import import_dumps
    from rollout_lens.server.store.db import session_scope

    with tempfile.TemporaryDirectory(prefix="rollout-lens-send-") as folder:
        scratch = settings.model_copy(
            update={"database_url": f"sqlite:///{Path(folder) / 'scratch.db'}"}
        )
        engine, factory = migrated_factory(scratch)
        try:
            done = import_dumps(factory, fmt, settle=args.settle, total_steps=args.total_steps)
            path = Path(folder) / "run.parquet"
            with session_scope(factory) as session, path.open("wb") as f:
                for chunk in export.export_chunks(session, run_id=done.run_id, fmt="parquet"):
                    f.write(chunk)
        finally:
            engine.dispose()
        sent = lens.import_file(path, moved=True)
    print(
        f"imported run {sent['id']} ({printable(sent['name'])}) from {fmt.folder} into "
        f"{lens.base_url}: {sent['steps']} {what}, {sent['rollouts']} rollouts"
    )
    print(f"run_id={sent['id']}")
    return 0


def _follow(factory: Any, fmt: Any, args: argparse.Namespace, settings: Settings) -> int:
    from rollout_lens.server.exchange.follow import Follower

    with _stop_on_signals() as stopping:
        followed = Follower(
            factory,
            fmt,
            host=socket.gethostname(),
            idle=args.idle,
            settle=args.settle,
            total_steps=args.total_steps,
            new=args.new,
            heartbeat_seconds=settings.heartbeat_seconds,
            lost_after_seconds=settings.lost_after_seconds,
            stop=lambda: stopping() is not None,
            say=_say,
        ).run()
    if followed.run_id is None:
        _say("stopped before any step was written: nothing created")
        return INTERRUPTED
    status = {"idle": "completed", "interrupted": "cancelled", "cancelled": "cancelled"}
    why = {
        "idle": f"no new step for {args.idle:g} s" if args.idle else "",
        "interrupted": "interrupted; follow the folder again (without --new) to resume",
        "cancelled": "cancelled in the dashboard",
    }
    print(
        f"run {followed.run_id} ({printable(followed.name)}) {status[followed.ended]} "
        f"({why[followed.ended]}): {_count(followed.steps, 'step')}, "
        f"{_count(followed.rollouts, 'rollout')} recorded by this follower"
    )
    print(f"run_id={followed.run_id}")
    signum = stopping()
    return 128 + signum if followed.ended == "interrupted" and signum else 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _say(message: str) -> None:
    print(f"rollout-lens: {printable(message)}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[Callable[[], int | None]]:
    """Ctrl-C (or SIGTERM) asks the follower to stop at its next look (the step being written is
    finished first); a second Ctrl-C stops at once. Yields: the signal that asked, or None."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None  # signals reach the main thread only
        return

    def ask(signum: int, _frame: object) -> None:
        if caught:
            raise KeyboardInterrupt
        caught.append(signum)
        _say("stopping (press Ctrl-C again to quit at once)")

    previous = {s: signal.signal(s, ask) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield lambda: caught[0] if caught else None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
