"""`rollout-lens demo`: train a short leaky and a short patched run, then open them side by side."""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from rollout_lens.cli.base import train_extra_missing
from rollout_lens.cli.serve import port_problem, serve_dashboard
from rollout_lens.server import store
from rollout_lens.server.core import analysis
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.errors import RolloutLensError
from rollout_lens.server.core.textsafe import printable
from rollout_lens.server.core.vocab import WINDOW
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.models import RunStatus

if TYPE_CHECKING:
    from rollout_lens.server.core.runconfig import RunConfig

PRESET = "leaky_vs_patched"  # server/core/presets.py: both variants, same seed and recipe
# 60 steps on the tiny model (seed 0, measured on 2 CPU cores: 35 s side by side): patched's true
# accuracy climbs from 0.46 (steps 1–25) to 0.78 (its last 25), leaky's stays at 0.02–0.09; 150
# steps show patched converge (0.91 over steps 76–100).
DEFAULT_STEPS = 60
POLL_SECONDS = 2.0
# What the two runs' charts mean, said under the figures the demo measured (_what_they_show).
HOW_TO_READ = (
    "The judge verifier gives 0.5 for naming any listed tool and 1 for the right one: a reward "
    "near 0.5 over a true accuracy near 0 is partial credit, not learning. Compare's summary "
    "gives the last 25 steps' figures (final), each run's page its 25-step buckets; compare's "
    "charts open smoothed, the band spanning each step's own value."
)


def add_commands(sub: Any) -> None:
    """Register `demo` on the CLI's subparsers."""
    demo = sub.add_parser(
        "demo", help="train a short leaky and a short patched run and open the comparison"
    )
    demo.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="steps of each run")
    demo.add_argument("--host", default="127.0.0.1", help="interface the dashboard listens on")
    demo.add_argument("--port", type=int, default=8000, help="port the dashboard listens on")
    demo.add_argument(
        "--no-serve",
        action="store_true",
        help="train and print the URL; start no dashboard (so the port is not checked)",
    )
    demo.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace, settings: Settings) -> int:
    """Train both runs (printing progress), print the compare URL, then serve unless told not to."""
    configs = _demo_configs(args.steps)
    missing = train_extra_missing("the demo trains, which")
    if missing:
        raise RolloutLensError(missing)
    problem = None if args.no_serve else port_problem(args.host, args.port)
    if problem:  # now, not after a model build and two trainings
        raise RolloutLensError(problem)
    _migrate(settings)
    _ensure_model(settings)
    run_ids = _create_runs(settings, configs)
    workers = _parallel_runs(settings)
    mode = "side by side" if workers > 1 else "one after the other"
    print(f"Training {len(configs)} runs of {args.steps} steps, {mode}:", flush=True)
    for run_id, config in zip(run_ids, configs, strict=True):
        print(f"  run {run_id}: {printable(config.name)}", flush=True)
    started = time.perf_counter()
    failed = train_all(settings, configs, run_ids, workers=workers, report=_print_line)
    print(f"Trained in {time.perf_counter() - started:.0f} s.", flush=True)
    if failed:
        return _report_failures(settings, failed)
    url = compare_url(args.host, args.port, run_ids)
    shown = _what_they_show(settings, run_ids)
    if args.no_serve:
        print(f"Start the dashboard with `rollout-lens serve --port {args.port}`, then", flush=True)
        print(f"{shown}\nCompare them at {url}", flush=True)
        return 0
    print("Starting the dashboard (Ctrl-C stops it)…", flush=True)
    return serve_dashboard(args, settings, announce=[shown, f"Compare them at {url}"])


def _what_they_show(settings: Settings, run_ids: Sequence[int]) -> str:
    """What these runs recorded, in figures (their true accuracy and verifier reward over the
    last 25 steps, and over steps 1–25 where those differ), then how to read them."""
    parts = []
    with _session(settings) as session:
        for run_id in run_ids:
            run = store.get_run(session, run_id=run_id)
            n = min(run.current_step, WINDOW)
            text = (
                f"{run.variant}: true accuracy {_figure(run.recent_true_accuracy)}, verifier "
                f"reward {_figure(run.recent_reward)} over its last {n} step{'' if n == 1 else 's'}"
            )
            if run.current_step >= 2 * WINDOW:
                steps = store.steps(session, run_id=run_id)
                first = analysis.buckets([s.step for s in steps], [s.true_accuracy for s in steps])[
                    :1
                ]
                if first:
                    text += f" (true accuracy {_figure(first[0][1])} over steps 1–{WINDOW})"
            parts.append(text)
    return f"What the runs recorded: {'; '.join(parts)}. {HOW_TO_READ}"


def _figure(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _demo_configs(steps: int) -> list[RunConfig]:
    """The leaky-vs-patched preset's runs with `steps` steps (validated as any launch is)."""
    from rollout_lens.server.core.presets import PRESETS
    from rollout_lens.server.webapp.pages import launch_fields

    try:
        return launch_fields.build_configs(PRESETS[PRESET], {"steps": steps})
    except launch_fields.LaunchInvalid as exc:
        raise RolloutLensError(f"invalid demo: {exc}") from None


def compare_url(host: str, port: int, run_ids: Sequence[int]) -> str:
    """The compare page of `run_ids` on the dashboard at host:port."""
    shown = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}/compare?runs={','.join(str(i) for i in run_ids)}"


def _parallel_runs(settings: Settings) -> int:
    """How many runs train at once: two when two cores are free for torch's threads, else one."""
    threads = settings.torch_threads or (os.cpu_count() or 1)
    return 2 if (os.cpu_count() or 1) >= 2 * threads else 1


def train_all(
    settings: Settings,
    configs: Sequence[RunConfig],
    run_ids: Sequence[int],
    *,
    workers: int,
    report: Callable[[str], None],
) -> list[int]:
    """Train each run in its own process, `workers` at a time; returns the ids that failed.
    Stopped (Ctrl-C, SIGTERM), it leaves no run queued or running: each ends `cancelled`."""
    context = multiprocessing.get_context("spawn")  # torch may already be loaded here
    pending = list(zip(run_ids, configs, strict=True))
    running: dict[int, multiprocessing.process.BaseProcess] = {}
    failed: list[int] = []
    last = ""
    terminated = _raise_on_sigterm()
    try:
        while pending or running:
            while pending and len(running) < workers:
                run_id, config = pending.pop(0)
                _starting(settings, run_id)
                started = context.Process(
                    target=_train_one,
                    args=(settings, config.model_dump(mode="json"), run_id),
                    name=f"rollout-lens-demo-{run_id}",
                )
                started.start()
                running[run_id] = started
            time.sleep(POLL_SECONDS)
            for run_id, proc in list(running.items()):
                if not proc.is_alive():
                    proc.join()
                    del running[run_id]
                    if proc.exitcode != 0:
                        failed.append(run_id)
            # A child loading torch sends no heartbeat yet: its parent vouches for it.
            _beat_starting(settings, [i for i, p in running.items() if p.is_alive()])
            line = _progress_line(settings, run_ids)
            if line != last:
                report(line)
                last = line
    finally:
        # Ctrl-C reached the children too, and each marks its run cancelled; a SIGTERM reached
        # only this process, so the children are asked as Ctrl-C would. Whatever is still
        # training after a grace period is stopped, and every run not ended is marked here.
        for proc in running.values():
            if terminated() and proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGINT)
        for proc in running.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join()
        _cancel_unfinished(settings, run_ids)
    return failed


def _raise_on_sigterm() -> Callable[[], bool]:
    """SIGTERM ends the demo as Ctrl-C does (its `finally` runs); returns whether it came."""
    came: list[int] = []

    def stop(signum: int, frame: object) -> None:
        came.append(signum)
        raise KeyboardInterrupt

    with contextlib.suppress(ValueError):  # not the main thread: leave the handler alone
        signal.signal(signal.SIGTERM, stop)
    return lambda: bool(came)


def _progress_line(settings: Settings, run_ids: Sequence[int]) -> str:
    """One line: each run's variant, step, status and true accuracy over its last 25 steps (or
    all its steps, before it has 25)."""
    parts = []
    with _session(settings) as session:
        for run_id in run_ids:
            run = store.get_run(session, run_id=run_id)
            acc = run.recent_true_accuracy
            text = f"{run.variant} {run.current_step}/{run.total_steps}"
            if acc is not None:
                window = min(run.current_step, WINDOW)
                text += f" accuracy {acc:.2f} (last {window} step{'s' if window > 1 else ''})"
            if run.status == RunStatus.queued:  # its process is loading torch and the model
                text += f" ({run.phase or 'starting'})"
            elif run.status != RunStatus.running:
                text += f" ({run.status})"
            parts.append(text)
    return "  " + " | ".join(parts)


def _train_one(settings: Settings, config: dict[str, Any], run_id: int) -> None:
    """In a child process: train one created run (its failure is recorded on the run)."""
    try:
        import warnings

        from transformers.utils import logging as hf_logging

        from rollout_lens.server.core.runconfig import RunConfig
        from rollout_lens.trainer.worker.run import train

        # A demo's output is its progress lines: no weight-loading bars, no library deprecations.
        hf_logging.disable_progress_bar()
        warnings.filterwarnings("ignore", category=FutureWarning)
        train(
            RunConfig.model_validate(config), settings=settings, run_id=run_id, log_line=_print_line
        )
    except KeyboardInterrupt:  # stopped: the run says so (train() or the parent marks it)
        raise SystemExit(130) from None


def _print_line(line: str) -> None:
    print(line, flush=True)


@contextlib.contextmanager
def _session(settings: Settings) -> Iterator[Session]:
    """A session on the settings' database; the engine is disposed afterwards."""
    engine = make_engine(settings.database_url, busy_timeout_ms=settings.sqlite_busy_timeout_ms)
    try:
        with session_scope(make_session_factory(engine)) as session:
            yield session
    finally:
        engine.dispose()


def _migrate(settings: Settings) -> None:
    from rollout_lens.server.webapp.app import prepare_database

    prepare_database(settings)


def _ensure_model(settings: Settings) -> None:
    """The tiny model in the cache: copied from the package, or built (then with progress)."""
    from rollout_lens.trainer.builders import prebuilt

    if not prebuilt.will_build(prebuilt.TINY, settings.models_dir):
        path = prebuilt.ensure_tiny(settings.models_dir, log=lambda line: None)
        print(f"Tiny model: {path.resolve()}", flush=True)
        return
    print(
        "Building the tiny model once (this install's torch/transformers differ from the "
        "packaged build's; about 2 minutes on 2 idle CPU cores):",
        flush=True,
    )
    path = prebuilt.ensure_tiny(settings.models_dir, log=_build_line)
    print(f"Tiny model: {path.resolve()}", flush=True)


def _build_line(line: str) -> None:
    """A build's progress as the demo shows it: warm-up steps, not their noisy per-batch loss."""
    from rollout_lens.trainer.builders.prebuilt import build_progress

    progress = build_progress(line)
    if progress:
        print(f"  warm-up step {progress[0]} of {progress[1]}", flush=True)


def _starting(settings: Settings, run_id: int) -> None:
    """The run's process is starting (a phase marks it taken, so a lost one is swept)."""
    with _session(settings) as session:
        store.set_phase(session, run_id=run_id, phase="starting: loading torch and TRL")


def _beat_starting(settings: Settings, run_ids: Sequence[int]) -> None:
    with _session(settings) as session:
        for run_id in run_ids:
            if store.get_run(session, run_id=run_id).status == RunStatus.queued:
                store.heartbeat(session, run_id=run_id)


def _cancel_unfinished(settings: Settings, run_ids: Sequence[int]) -> None:
    """Mark `cancelled`, with the reason, each run the stopped demo leaves queued or running."""
    with _session(settings) as session:
        for run_id in run_ids:
            run = store.get_run(session, run_id=run_id)
            if run.status in (RunStatus.queued, RunStatus.running):
                when = (
                    "mid-run"
                    if run.status == RunStatus.running
                    else "while this run was starting"
                    if run.phase
                    else "before this run started"
                )
                store.mark_finished(
                    session,
                    run_id=run_id,
                    status=RunStatus.cancelled,
                    error=f"the demo was stopped {when}",
                )


def _create_runs(settings: Settings, configs: Sequence[RunConfig]) -> list[int]:
    with _session(settings) as session:
        return [store.create_launched_run(session, c.run_columns()).id for c in configs]


def _report_failures(settings: Settings, failed: Sequence[int]) -> int:
    with _session(settings) as session:
        for run_id in failed:
            run = store.get_run(session, run_id=run_id)
            first = (run.error or "no error recorded").splitlines()[0]
            print(
                f"rollout-lens: run {run_id} ({printable(run.name)}) {run.status}: "
                f"{printable(first)}",
                file=sys.stderr,
            )
    return 1
