"""What RolloutLensCallback costs a user's own TRL script: the same plain GRPO script with and
without the one line, alternating in one process, paired.

Unlike bench/overhead.py (the project's own Escalation trainer), this is a script as a user writes
it: a GRPOConfig, a small dataset of chat prompts, a reward function of their own, GRPOTrainer,
train(); the callback added with nothing else (its own SQLite file). Each pair runs both arms
(plain first in even pairs, the callback first in odd ones); a pair's ratio is the callback's
median step over the plain one's, and the figure is the median of the pairs' ratios (their
spread beside it; and the same of the mean step, which holds the writer's rounds); beside it the training process's CPU a step, every thread counted (not the
writer's child process), which other load on the machine sways less than wall time, and the
training thread's alone. A step is timed from its start to the next one's: the callbacks'
on_step_end and on_log after it are the user's time too. `--thread`
adds a third arm to each pair: the callback writing from a thread of the training process
(ROLLOUT_LENS_WRITER_PROCESS=false), as it did before the writer's child process. `--profile`
runs one more pair with the training thread under cProfile (its timed steps) and prints both
arms' top entries, and the callback's writer thread under a profiler of its own, with the CPU
it spends preparing each step and handing it to the child: what the callback adds beside the
user's step in the training process.

    .venv/bin/python -m bench.overhead_script --steps 40 --pairs 4 [--thread]
    .venv/bin/python -m bench.overhead_script --steps 30 --pairs 0 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

TARGET = 1.05  # a recorded step's time over the plain step's (issue 49)
WARMUP = 5  # untimed first steps of each run (lazy initialisation in both arms)
PROMPTS = [
    "Which tool converts a currency?",
    "Name the tool that books a flight.",
    "What tool would you call to check the weather in Paris?",
    "Pick the tool that translates a sentence into German.",
    "Which tool sends an email to a colleague?",
    "What tool summarises a long document?",
    "Choose the tool that finds a restaurant nearby.",
    "Which tool sets a reminder for tomorrow?",
]


def reward_len(completions: list[Any], **_: Any) -> list[float]:
    """A user's reward: shorter completions score higher (any function would do)."""
    texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
    return [-abs(len(t) - 20) / 20 for t in texts]


def one_run(
    model_path: str,
    out: Path,
    steps: int,
    database_url: str | None,
    profiler: cProfile.Profile | None = None,
    cpu: list[float] | None = None,
    writer_process: bool = True,
    own: list[float] | None = None,
) -> list[float]:
    """Step times (seconds, after WARMUP) of one plain GRPO run; recorded when `database_url`;
    the timed steps under `profiler` when given (the thread that trains); each timed step's
    CPU seconds (the whole process's) appended to `cpu`, the training thread's to `own`;
    `writer_process` False: the writer in a thread of this process
    (ROLLOUT_LENS_WRITER_PROCESS=false)."""
    cpu = cpu if cpu is not None else []
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        PrinterCallback,
        TrainerCallback,
        set_seed,
    )
    from trl import GRPOConfig, GRPOTrainer

    from rollout_lens import RolloutLensCallback

    set_seed(0)
    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=16,
        max_steps=steps,
        learning_rate=1e-5,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    timer = _step_timer(TrainerCallback, profiler)
    callbacks: list[Any] = [timer]
    if database_url is not None:
        from rollout_lens.server.core.config import get_settings

        settings = get_settings().model_copy(update={"writer_process": writer_process})
        callbacks.append(
            RolloutLensCallback(project="bench", database_url=database_url, settings=settings)
        )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_path),
        processing_class=AutoTokenizer.from_pretrained(model_path),
        reward_funcs=[reward_len],
        args=args,
        train_dataset=Dataset.from_list(
            [{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS * 64]
        ),
        callbacks=callbacks,
    )
    trainer.remove_callback(PrinterCallback)  # the same in both arms: no log lines printed
    trainer.train()
    if profiler is not None:
        profiler.disable()
    cpu.extend(timer.cpu[WARMUP:])
    if own is not None:
        own.extend(timer.own[WARMUP:])
    return timer.times[WARMUP:]


def _step_timer(base: type, profiler: cProfile.Profile | None) -> Any:
    """A TrainerCallback (`base`) timing each step from its start to the next one's, wall, the
    process's CPU and the training thread's: everything a step costs the user, the callbacks'
    on_step_end and on_log after it included (listed first, the timer's own on_step_end would
    come before the recorder's); `profiler` enabled from the first timed step."""

    class StepTimer(base):  # type: ignore[valid-type,misc]
        def __init__(self) -> None:
            self.times: list[float] = []
            self.cpu: list[float] = []  # the process's CPU, every thread (the writer's too)
            self.own: list[float] = []  # the training thread's CPU (callbacks run on it)
            self._marks: tuple[float, float, float] | None = None

        def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            marks = (time.perf_counter(), time.process_time(), time.thread_time())
            if self._marks is not None:
                wall, cpu, own = (now - then for now, then in zip(marks, self._marks, strict=True))
                self.times.append(wall)
                self.cpu.append(cpu)
                self.own.append(own)
            if profiler is not None and state.global_step == WARMUP:
                profiler.enable()
            self._marks = marks

    return StepTimer()


class _WriterProfile:
    def __init__(self) -> None:
        self.profiler = cProfile.Profile()
        self.cpu = 0.0
        self.parts: dict[str, list[float]] = {}  # the writer's methods -> CPU seconds of each call

    def timed(self, name: str, method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.parts.setdefault(name, []).append(time.thread_time() - start)

        return call


def _profile_writer_thread() -> _WriterProfile:
    """The StepWriter's thread run under a profiler of its own, its CPU time summed."""
    from rollout_lens.trainer.recorder.sinks import SqlSink
    from rollout_lens.trainer.recorder.writer import StepWriter

    found = _WriterProfile()
    loop = StepWriter._loop

    def profiled(self: StepWriter) -> None:
        start = time.thread_time()
        found.profiler.enable()
        try:
            loop(self)
        finally:
            found.profiler.disable()
            found.cpu += time.thread_time() - start

    StepWriter._loop = profiled  # type: ignore[method-assign]
    # a step's own work: preparing it (rollouts read, judged) and writing it (the transaction,
    # its search indexing)
    StepWriter._take = found.timed("prepare", StepWriter._take)  # type: ignore[method-assign]
    SqlSink._commit = found.timed("commit", SqlSink._commit)  # type: ignore[method-assign]
    return found


def _profile_text(profiler: cProfile.Profile, top: int, order: str, only: str = "") -> str:
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).sort_stats(order)
    stats.print_stats(*([only] if only else []), top)
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    return "\n".join(f"  {line}" for line in lines[start:] if line.strip())


def _pairs(args: argparse.Namespace, model_path: str, tmp: Path) -> None:
    """`args.pairs` paired runs (plain, callback, and with --thread the callback writing from a
    thread of this process; each pair in the other order than the one before), and the
    figures: the median of the pairs' ratios, the process's CPU a step."""
    recorded = ["callback", "thread"] if args.thread else ["callback"]
    ratios: dict[str, list[float]] = {arm: [] for arm in recorded}
    medians: dict[str, list[float]] = {"plain": [], **{arm: [] for arm in recorded}}
    cpu: dict[str, list[float]] = {"plain": [], **{arm: [] for arm in recorded}}
    own: dict[str, list[float]] = {"plain": [], **{arm: [] for arm in recorded}}
    # a step's mean too: what the writer does in rounds falls on a few steps, which the median
    # leaves out and the user's wall time does not
    means: dict[str, list[float]] = {"plain": [], **{arm: [] for arm in recorded}}
    for pair in range(args.pairs):
        arms = ["plain", *recorded]
        got: dict[str, float] = {}
        for arm in arms if pair % 2 == 0 else arms[::-1]:
            times = one_run(
                model_path,
                tmp / f"{arm}-{pair}",
                args.steps,
                None if arm == "plain" else f"sqlite:///{tmp / f'{arm}-{pair}.db'}",
                cpu=cpu[arm],
                own=own[arm],
                writer_process=arm != "thread",
            )
            got[arm] = statistics.median(times)
            medians[arm].append(got[arm])
            means[arm].append(statistics.fmean(times))
        for arm in recorded:
            ratios[arm].append(got[arm] / got["plain"])
        print(
            f"pair {pair + 1}: "
            + ", ".join(f"{arm} {got[arm] * 1e3:6.1f} ms/step" for arm in arms)
            + ", ratio "
            + ", ".join(f"{arm} {ratios[arm][-1]:.3f}" for arm in recorded),
            flush=True,
        )
    if not args.pairs:
        return
    print(
        f"\n{args.pairs} pairs of {args.steps} steps ({args.steps - WARMUP} timed each): "
        + ", ".join(
            f"{arm} median {statistics.median(medians[arm]) * 1e3:.1f} ms/step"
            for arm in ["plain", *recorded]
        )
    )
    for arm in recorded:
        ratio = statistics.median(ratios[arm])
        said = "met" if ratio <= TARGET else "not met"
        print(
            f"ratio {arm}/plain: median of pairs {ratio:.3f} (min {min(ratios[arm]):.3f},"
            f" max {max(ratios[arm]):.3f})   (target ≤ {TARGET:.2f}: {said})"
        )
        of_means = [m / p for m, p in zip(means[arm], means["plain"], strict=True)]
        print(
            f"  of the mean step: median of pairs {statistics.median(of_means):.3f}"
            f" (min {min(of_means):.3f}, max {max(of_means):.3f})"
        )
    print(
        "CPU a step, the training process (its threads; not the writer's child process): "
        + ", ".join(
            f"{arm} {statistics.median(cpu[arm]) * 1e3:.1f} ms" for arm in ["plain", *recorded]
        )
    )
    print(
        "CPU a step, the training thread alone (what the callback does on it, no GIL waits): "
        + ", ".join(
            f"{arm} {statistics.median(own[arm]) * 1e3:.1f} ms" for arm in ["plain", *recorded]
        )
    )


def _profiled(args: argparse.Namespace, model_path: str, tmp: Path, url: str) -> None:
    """One more pair, the training thread under cProfile, and the writer thread's CPU."""
    writer = _profile_writer_thread()
    for arm in ("plain", "callback"):
        profiler = cProfile.Profile()  # enabled on the training thread only
        times = one_run(
            model_path, tmp / f"p-{arm}", args.steps, url if arm == "callback" else None, profiler
        )
        print(
            f"\n== {arm}: {len(times)} steps (median {statistics.median(times) * 1e3:.1f}"
            " ms) under cProfile, the training thread"
        )
        print(_profile_text(profiler, args.top, "tottime"))
        print(_profile_text(profiler, args.top, "cumulative", "rollout_lens|recorder"))
    print(
        f"\n== the callback's writer thread: {writer.cpu * 1e3 / args.steps:.1f} ms of CPU"
        f" a step ({writer.cpu:.2f} s for {args.steps} steps, creating the run included)"
    )
    for name, seconds in writer.parts.items():
        print(
            f"  {name}: {len(seconds)} calls, median {statistics.median(seconds) * 1e3:.2f}"
            f" ms of CPU, {sum(seconds) * 1e3 / len(seconds):.2f} ms mean"
        )
    print(_profile_text(writer.profiler, args.top, "tottime"))
    print(_profile_text(writer.profiler, args.top, "cumulative", "store/|recorder/"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps a run (the first 5 untimed)")
    parser.add_argument("--pairs", type=int, default=4, help="paired runs (plain, callback)")
    parser.add_argument(
        "--thread",
        action="store_true",
        help="a third arm: the callback writing from a thread of the training process",
    )
    parser.add_argument("--profile", action="store_true", help="one more pair under cProfile")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    logging.getLogger("rollout_lens").setLevel(logging.ERROR)

    import torch
    from rollout_lens.server.core.config import get_settings
    from rollout_lens.trainer.builders import prebuilt

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model_path = str(prebuilt.ensure(prebuilt.TINY, get_settings().models_dir))
        url = f"sqlite:///{tmp / 'lens.db'}"
        _pairs(args, model_path, tmp)
        if args.profile:
            _profiled(args, model_path, tmp, url)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
