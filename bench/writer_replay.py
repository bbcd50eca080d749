"""What the callback's writer spends a step, apart from the training it shares the GIL with.

One toy run of bench/overhead_script.py's user script (RolloutLensCallback, its own SQLite file)
keeps every step the writer is handed (its raw parts) and every StepRecord it commits; then the
three parts of the writer's work are replayed on this thread, nothing else running: judging
each raw step (StepPreparer.judged: the user's functions, in the training process, on the
writer's thread), reading each judged step (StepReader.complete: in the writer's own process)
and committing each record through a fresh SqlSink (the callback's database path, in that
process too). Printed for each: thread CPU a step (the median over the steps, for each of
`--rounds` replays) and Python calls a step (cProfile). Calls do not depend on the machine's
load; CPU does, so compare two versions alternating.

    .venv/bin/python -m bench.writer_replay --steps 45 --rounds 3
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import logging
import pickle
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import overhead_script

SKIP = overhead_script.WARMUP  # the first steps pay for lazy initialisation


def captured_run(
    steps: int, tmp: Path
) -> tuple[list[bytes], Callable[[Any], Any], Any, list[bytes], Any]:
    """One recorded toy run: its raw steps (pickled), the writer's `prepare` (the step judged),
    its sink's StepReader, its records (pickled) and the run's spec (to create the same run
    again)."""
    import torch
    from rollout_lens.server.core.config import get_settings
    from rollout_lens.trainer.builders import prebuilt
    from rollout_lens.trainer.recorder.sinks import SqlSink
    from rollout_lens.trainer.recorder.writer import StepWriter

    raws: list[bytes] = []
    prepares: list[Callable[[Any], Any]] = []
    readers: list[Any] = []
    records: list[bytes] = []
    specs: list[Any] = []
    take, commit = StepWriter._take, SqlSink._commit

    def taking(self: StepWriter, arrival: Any) -> None:
        raws.append(pickle.dumps(arrival.raw))
        prepares.append(self.prepare)
        readers.append(getattr(self.sink, "reader", None))
        take(self, arrival)

    def committing(self: SqlSink, batch: Any) -> None:
        records.extend(pickle.dumps(r) for r in batch)
        specs.append(self.spec)
        commit(self, batch)

    StepWriter._take = taking  # type: ignore[method-assign]
    SqlSink._commit = committing  # type: ignore[method-assign]
    try:
        torch.set_num_threads(1)  # as bench/overhead_script.py trains
        model = str(prebuilt.ensure(prebuilt.TINY, get_settings().models_dir))
        # the writer's sink in this process, where its commits can be kept
        url = f"sqlite:///{tmp / 'run.db'}"
        overhead_script.one_run(model, tmp / "run", steps, url, writer_process=False)
    finally:
        StepWriter._take, SqlSink._commit = take, commit  # type: ignore[method-assign]
    return raws, prepares[-1], readers[-1], records, specs[-1]


def timed(each: list[Any], work: Callable[[Any], Any], profiler: cProfile.Profile | None) -> float:
    """The median thread CPU seconds of `work` over `each` past SKIP (under `profiler`)."""
    cpu = []
    for i, item in enumerate(each):
        if profiler is not None and i == SKIP:
            profiler.enable()
        start = time.thread_time()
        work(item)
        cpu.append(time.thread_time() - start)
    if profiler is not None:
        profiler.disable()
    return statistics.median(cpu[SKIP:])


def commit_all(records: list[bytes], spec: Any, path: Path) -> Callable[[Any], Any]:
    """A fresh run at `path`, and the write of one record into it (the callback's SqlSink)."""
    from rollout_lens.trainer.recorder.sinks import SqlSink

    sink = SqlSink.of_url(
        f"sqlite:///{path}",
        spec=copy.deepcopy(spec),
        price_per_hour=0.0,
        busy_timeout_ms=30_000,
        resume=None,
    )
    sink.open()
    return lambda record: sink.write([record], (0, 0))


def replay(
    name: str, make: Callable[[int], tuple[list[Any], Callable[[Any], Any]]], rounds: int
) -> None:
    """`rounds` replays of one half (CPU a step), then one under cProfile (calls a step)."""
    medians = []
    for k in range(rounds):
        each, work = make(k)
        medians.append(timed(each, work, None) * 1e3)
    profiler = cProfile.Profile()
    each, work = make(rounds)
    timed(each, work, profiler)
    calls = sum(v[1] for v in pstats.Stats(profiler).stats.values()) / (len(each) - SKIP)  # type: ignore[attr-defined]
    shown = ", ".join(f"{m:.2f}" for m in medians)
    print(
        f"{name}: thread CPU a step, median of each replay: {shown} ms; {calls:,.0f} Python calls a step"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=45, help="steps of the captured run")
    parser.add_argument("--rounds", type=int, default=3, help="replays of each half")
    args = parser.parse_args(argv)
    logging.getLogger("rollout_lens").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        raws, judge, reader, records, spec = captured_run(args.steps, tmp)
        print(
            f"captured {len(raws)} steps ({len(records)} records), replayed past the first {SKIP}"
        )
        replay("judge", lambda _: ([pickle.loads(r) for r in raws], judge), args.rounds)
        judged = [pickle.dumps(judge(pickle.loads(r))) for r in raws]  # as the child gets them
        replay("read", lambda _: ([pickle.loads(j) for j in judged], reader.complete), args.rounds)
        replay(
            "commit",
            lambda k: (
                [pickle.loads(r) for r in records],
                commit_all(records, spec, tmp / f"replay-{k}.db"),
            ),
            args.rounds,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
