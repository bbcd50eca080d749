"""Issue 48's memory bodies against a real `rollout-lens serve` (SQLite, a 4 MiB byte cap): each
is refused with a 4xx naming what is at fault, nothing of it is written, and the server's peak
memory for it (VmHWM, reset before each body) grows by at most the body and what one request
may decode (bounds.DECODE_FACTOR × the cap). The bodies are the issue's, scaled to the cap
(bench/hostile_memory.py sends them at the issue's sizes and prints the figures)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from fastapi.testclient import TestClient
from rollout_lens.server.exchange import wire
from rollout_lens.server.exchange.bounds import DECODE_FACTOR
from rollout_lens.server.exchange.export import export_chunks
from rollout_lens.server.store.db import session_scope
from sqlalchemy.orm import Session, sessionmaker

from bench import hostile_memory as bench
from tests.factories import CONTROL_TOKENS, make_rollouts, make_run
from tests.web_support import client_for

CAP_MB = 4
CAP = CAP_MB * 2**20
# What the server spends on any request beside its body and what it decodes (the request's
# and the answer's objects, the allocator's arenas). 100,000 zero-token rollouts (a 0.4 MiB
# body whose 13.0 MiB frame is most of the 16 MiB budget) grew the server by 16.4 MiB alone
# (bench.hostile_memory --cap-mb 4) and by 16.6 MiB in a full run, against 16.4 MiB of body
# and budget.
SERVER_OWN = 2**20
SIZES = bench.Sizes(
    piece_mb=16 * CAP_MB,  # Arrow's own zstd inside the frame: 16 × the cap in one piece
    zeros_mb=12 * CAP_MB,  # a frame that says (and holds) 12 × the cap of zeros
    frames=6,
    pieces=2_000,  # × 4,096 characters: 8 MB a frame, 48 MB in all, of zero-token frames
    rollouts=100_000,
    completion_mb=16 * CAP_MB,  # a Parquet file of a few KB
)
# What each is refused with: the status and the field (a wire body's) or words of the detail
REFUSED = {
    "Arrow-compressed": (422, "steps[0].pieces"),
    "zstd frame": (422, "steps[0]"),
    "zero-token frames": (422, "steps[0].pieces"),
    "zero-token rollouts": (422, "steps[0].rollouts"),
    "Parquet": (400, "row group 1"),
}


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[bench.Dashboard]:
    folder = tmp_path_factory.mktemp("hostile-memory")
    with bench.serving(folder, cap_mb=CAP_MB) as (base, pid):
        served = bench.Dashboard(base, pid)
        served.warm()  # pyarrow loaded by a real step and a real import, before any is measured
        yield served
        served.close()


@pytest.fixture(scope="module")
def bodies() -> dict[str, bench.Hostile]:
    """Built where the tests run (about a second and 100 MB), not where they are collected."""
    return bench.hostile_bodies(SIZES)


@pytest.mark.parametrize("name", SIZES.names())
def test_a_hostile_body_is_refused_within_the_memory_bound(
    dashboard: bench.Dashboard, bodies: dict[str, bench.Hostile], name: str
) -> None:
    hostile = bodies[name]
    run_id = dashboard.new_run(f"memory-{abs(hash(name)) % 10**8:08d}")
    before = dashboard.counts()
    answer, growth = dashboard.peak_growth(run_id, hostile)
    status, fault = next(v for k, v in REFUSED.items() if k in name)
    assert answer.status_code == status, (name, answer.status_code, answer.text[:300])
    refusal = answer.json()
    assert fault == refusal["field"] if status == 422 else fault in refusal["detail"]
    assert dashboard.counts() == before  # no run imported, no step recorded
    bound = len(hostile.data) + DECODE_FACTOR * CAP + SERVER_OWN
    assert growth <= bound, f"{name}: +{growth / 2**20:.0f} MiB, over {bound / 2**20:.0f} MiB"


def test_an_import_waits_for_a_write_slot_like_steps(
    session_factory: sessionmaker[Session],
) -> None:
    """Imports take one of the slots bodies of steps take: every slot held, a 503 with
    Retry-After and nothing imported; a slot free, the same file is imported."""
    run_id = make_run(session_factory, steps=2)
    with session_scope(session_factory) as session:
        data = b"".join(export_chunks(session, run_id=run_id, fmt="parquet"))
    client: TestClient = client_for(session_factory)
    slots = client.app.state.ingest.writing  # type: ignore[attr-defined]
    held = [slots.acquire(blocking=False) for _ in range(8)]
    try:
        busy = client.post("/api/record/import", content=data)
    finally:
        for taken in held:
            if taken:
                slots.release()
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
    assert [r["id"] for r in client.get("/api/runs").json()["runs"]] == [run_id]
    done = client.post("/api/record/import", content=data)
    assert done.status_code == 201 and done.json()["steps"] == 2, done.text


def test_a_step_of_the_users_shape_decodes_within_the_default_budget() -> None:
    """Steps of 512 rollouts of 1,024 tokens with their pieces and control tokens: the recorder
    still batches several a request, and such a request decodes within Budget.of() (the
    default 64 MiB cap)."""
    import random

    from rollout_lens.server.core.records import StepRecord
    from rollout_lens.trainer.recorder.remote import DECODED_BYTES, REQUEST_BYTES

    rng = random.Random(0)
    ids_rng = np.random.default_rng(0)
    rollouts = []
    for group in range(64):
        for r in make_rollouts(rng, group_size=8, listed=4):
            ids = ids_rng.integers(0, 32_000, 1_024)
            r.group = group
            r.completion_ids = ids
            r.tokens = [f"t{t}" for t in ids.tolist()]
            r.completion = "".join(r.tokens)
            r.token_logprobs = -ids_rng.random(1_024)
            r.control_probs = {t: ids_rng.random(1_024) * 0.01 for t in CONTROL_TOKENS}
            rollouts.append(r)
    frames, sent = [], np.zeros(0, np.int64)
    size = decoded = 0
    for step in range(1, 33):
        record = StepRecord(step=step, rollout_step=step, values={}, rollouts=rollouts)
        encoded = wire.encode_step(record, CONTROL_TOKENS, sent)
        if frames and (
            size + len(encoded.frame) > REQUEST_BYTES or decoded + encoded.decoded > DECODED_BYTES
        ):
            break
        sent = np.union1d(sent, encoded.new_ids)
        frames.append(encoded.frame)
        size, decoded = size + len(encoded.frame), decoded + encoded.decoded
    assert len(frames) >= 2  # the recorder still batches steps of this shape
    budget = wire.Budget.of()
    received = wire.decode_body(wire.body(frames), control_tokens=CONTROL_TOKENS, budget=budget)
    wire.complete_tokens(received, lambda ids: {}, budget=budget)
    assert [len(r.record.rollouts) for r in received] == [512] * len(frames)
    assert budget.most - budget.left <= decoded  # the recorder never counts short
