"""One trainer of bench/remote.py, a process of its own (on its own machine: a network namespace):
builds seeded synthetic steps, hands them to the callback's remote writer as a trainer would,
and prints what happened as one line of JSON.

    python -m bench.remote_trainer '{"url": …, "token": …, "seed": 0, "shape": {…}, "steps": 3,
        "buffer_mb": 1024, "every": 0.05}'

Times are time.monotonic(): one clock for every process of this machine, namespaces or not.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def run(job: dict[str, Any]) -> dict[str, Any]:
    from rollout_lens.trainer.recorder.remote import RemoteStepWriter
    from rollout_lens.trainer.recorder.writer import RunSpec

    from bench.scale_data import ScaleRun, Shape

    shape = Shape(**job["shape"])
    seed, steps = int(job["seed"]), int(job["steps"])
    run = ScaleRun(shape, seed=seed)
    spec = RunSpec(
        name=job.get("name", f"bench trainer {seed}"),
        model="synthetic",
        total_steps=steps,
        group_size=shape.group_size,
        prompts_per_step=shape.groups,
        seed=seed,
        config={"bench": "remote"},
        control_tokens=list(shape.control_tokens),
        device="cpu",
    )
    handed: dict[int, float] = {}
    written: dict[int, float] = {}

    def on_written(record: Any) -> None:
        written[record.step] = time.monotonic()

    writer = RemoteStepWriter(
        url=job["url"],
        token=job["token"],
        spec=spec,
        prepare=lambda raw: raw,
        max_bytes=int(job["buffer_mb"] * 2**20),
        on_written=on_written,
    )
    records = [run.step(step) for step in range(1, steps + 1)]  # built first: not timed
    rollouts = sum(len(r.rollouts) for r in records)
    for record in records:
        handed[record.step] = time.monotonic()
        writer.put(record)
        time.sleep(job["every"])  # a training step's time
    # the bench waits for the dashboard however busy it is: a step lost here must be one the
    # recorder dropped from its budget, not one a close gave up on
    complete = writer.close(timeout=float(job.get("close_timeout", 3600)))
    return {
        "run_id": writer.run_id,
        "handed": handed,
        "written": written,  # acknowledged: written by a request, or found by its retry
        "complete": complete,
        "bytes": writer.sent_bytes,
        "dropped": [writer.dropped_steps, writer.dropped_rollouts],
        "rollouts": rollouts,
    }


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
