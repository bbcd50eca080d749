"""Recording into a dashboard over HTTP: a real uvicorn dashboard on the test's database, the
trainer's writer (RemoteStepWriter, BufferAndDrop) sending steps in the wire format; the export
of a remote run equals a local one's; lost answers, a cut through bench/tcp_proxy.py, a
dashboard restarted mid-run, wrong and out-of-scope tokens, hostile bodies."""

from __future__ import annotations

import json
import math
import random
import struct
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import zstandard
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.records import RolloutRecord, StepRecord
from rollout_lens.server.exchange import wire
from rollout_lens.server.exchange.export import export_chunks
from rollout_lens.server.store import arrays
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.webapp.app import create_app
from rollout_lens.trainer.recorder.remote import RemoteStepWriter
from rollout_lens.trainer.recorder.writer import RunSpec, StepWriter
from sqlalchemy.orm import Session, sessionmaker

from bench.tcp_proxy import TcpProxy
from tests.factories import CONTROL_TOKENS, load_run, make_rollouts
from tests.prompt_lens_support import assert_matches_oracle
from tests.waiting import returns, until
from tests.web_support import loopback, serve_app

FULL = "full-token-0123456789abcdef"
RECORDER = "record-token-0123456789abcdef"
OTHER_RECORDER = "record-token-other-0123456789"
VOCAB = {i: piece for i, piece in enumerate(["<tool>", "</tool>", "</assistant>", "Ġthe", "Ċ"])}
VOCAB.update({10 + i: f"tool_{i:02d}" for i in range(64)})


def _spec(name: str = "remote") -> RunSpec:
    return RunSpec(
        name=name,
        model="m",
        total_steps=6,
        group_size=8,
        prompts_per_step=2,
        seed=0,
        config={"project": "p", "nested": {"a": [1, 2.5, None]}},
        control_tokens=list(CONTROL_TOKENS),
        device="cpu",
        notes=["a note"],
    )


def _step(step: int) -> StepRecord:
    """Two groups: one with token pieces (its text rebuilt from them), one without."""
    rng = random.Random(step)
    rollouts: list[RolloutRecord] = []
    for group in range(2):
        for r in make_rollouts(rng, group_size=8, listed=4):
            r.group = group
            if group == 0:
                ids = [0, 10 + rng.randrange(64), 1, 3, 4, 2]
                r.completion_ids = ids
                r.tokens = [VOCAB[i] for i in ids]
                r.completion = "".join(r.tokens)
                r.token_logprobs = [-rng.random() * 20 for _ in ids]  # below −15 too
                r.control_probs = {t: [rng.random() ** 4 for _ in ids] for t in CONTROL_TOKENS}
            if r.index % 2:  # the generator's side (NaN: none for a token); else none (null)
                lps = [-rng.random() * 20 for _ in r.completion_ids]
                r.generator_logprobs = [math.nan if k == 1 else v for k, v in enumerate(lps)]
            if r.index == 3:
                r.token_logprobs = []  # not measured: Σ logprob unknown
                r.control_probs = {}
            r.meta = r.meta | {"rewards": {"judge": r.verifier_reward}, "nan": float("nan")}
            rollouts.append(r)
    return StepRecord(
        step=step,
        rollout_step=step,
        values={"reward_mean": 0.5, "wall_time": 0.25, "loss": None},
        rollouts=rollouts,
        metrics={"trl/custom": step * 0.5, "eval/x": None},
    )


@pytest.fixture
def dashboard(session_factory: sessionmaker[Session]) -> Iterator[str]:
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    app = create_app(
        Settings(database_url=url, auth_token=FULL, record_token=f"{RECORDER},{OTHER_RECORDER}"),
        session_factory=session_factory,
    )
    with serve_app(app) as base:
        yield base


def _export(factory: sessionmaker[Session], run_id: int) -> list[dict[str, Any]]:
    """The run's export, less what differs between two recordings of the same steps."""
    with session_scope(factory) as session:
        text = b"".join(export_chunks(session, run_id=run_id)).decode()
    out = []
    for line in text.splitlines():
        record = json.loads(line)
        for key in ("id", "run_id", "name", "recorded_at", "worker_host"):
            record.pop(key, None)
        for key in list(record):
            if key.endswith("_at"):
                record.pop(key)
        out.append(record)
    return out


def _remote(base: str, token: str | None = RECORDER, **kwargs: Any) -> RemoteStepWriter:
    kwargs.setdefault("heartbeat_seconds", 0.2)
    return RemoteStepWriter(url=base, token=token, spec=_spec(), prepare=lambda raw: raw, **kwargs)


def test_a_remote_run_exports_as_the_same_run_recorded_locally(
    session_factory: sessionmaker[Session], dashboard: str
) -> None:
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    local = StepWriter.for_script(  # as the callback makes it, at the dashboard's price
        database_url=url, spec=_spec(), prepare=lambda raw: raw, price_per_device_hour=2.0
    )
    remote = _remote(dashboard)
    for step in range(1, 7):
        local.put(_step(step))
        remote.put(_step(step))
    assert local.close() and remote.close()
    assert remote.written_steps == 6 and remote.dropped_steps == 0
    assert remote.run_id is not None and local.run_id is not None
    here, there = _export(session_factory, local.run_id), _export(session_factory, remote.run_id)
    assert len(there) == len(here) == 1 + 6 * 17 + 1
    # As JSON text (NaN equals NaN there), keys sorted: a meta's NaN is null from the recorder
    # (the wire refuses NaN), so the group shares it where a local NaN, equal to nothing, is
    # each rollout's own: the same meta, its keys in another order.
    for a, b in zip(there, here, strict=True):
        assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    run, rows, _, _ = load_run(url, remote.run_id)
    assert run.status == "completed" and run.source == "callback" and run.recorded_by
    # the generator's side came over the wire: NaN kept, null where none was given
    for r in rows:
        generator = r["generator_logprobs"]
        if r["index"] % 2:
            assert len(generator) == len(r["completion_ids"]) and math.isnan(generator[1])
        else:
            assert generator is None
    # the prompt lens of the run recorded over HTTP: the oracle's, and the local run's
    lens_there = assert_matches_oracle(session_factory, remote.run_id)
    lens_here = assert_matches_oracle(session_factory, local.run_id)
    assert lens_there.keys() == lens_here.keys() and lens_there


def test_a_retry_after_a_lost_answer_writes_nothing_twice(
    session_factory: sessionmaker[Session], dashboard: str
) -> None:
    headers = {"authorization": f"Bearer {RECORDER}"}
    spec = {"key": "retry-key-0001", "name": "retry", "control_tokens": list(CONTROL_TOKENS)}
    with httpx.Client(base_url=dashboard, headers=headers) as http:
        first = http.post("/api/record/runs", json=spec)
        again = http.post("/api/record/runs", json=spec)  # the create's answer was lost
        assert first.status_code == 201 and again.status_code == 200
        run_id = first.json()["id"]
        assert again.json()["id"] == run_id
        frames = [wire.encode_step(_step(s), CONTROL_TOKENS, np.zeros(0, np.int64)) for s in (1, 2)]
        body = wire.body(f.frame for f in frames)
        path = f"/api/record/runs/{run_id}/steps"
        sent = http.post(path, content=body)
        resent = http.post(path, content=body)  # the same steps: the answer was lost
        # a retry names its steps: those the run has are answered without decoding the body
        named = http.post(path, content=b"not decoded", params={"steps": "1,2"})
        assert named.status_code == 200 and named.json()["already"] == [1, 2], named.text
        partly = http.post(path, content=b"decoded", params={"steps": "2,3"})
        assert partly.status_code == 422 and partly.json()["field"] == "body"
    assert sent.status_code == 200 and sent.json()["written"] == [1, 2]
    assert resent.status_code == 200, resent.text
    assert resent.json()["written"] == [] and resent.json()["already"] == [1, 2]
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    _, rows, steps, _ = load_run(url, run_id)
    assert [s.step for s in steps] == [1, 2] and len(rows) == 32


def _post(base: str, path: str, token: str | None, **kwargs: Any) -> httpx.Response:
    headers = kwargs.pop("headers", {})
    if token:
        headers["authorization"] = f"Bearer {token}"
    return loopback("POST", base + path, headers=headers, timeout=10, **kwargs)


def _new_run(base: str, token: str, key: str) -> int:
    spec = {"key": key, "name": key, "control_tokens": list(CONTROL_TOKENS)}
    answer = _post(base, "/api/record/runs", token, json=spec)
    assert answer.status_code == 201, answer.text
    return int(answer.json()["id"])


def _body(*steps: int) -> bytes:
    known = np.zeros(0, np.int64)
    return wire.body(wire.encode_step(_step(s), CONTROL_TOKENS, known).frame for s in steps)


def test_tokens_and_their_scopes(dashboard: str) -> None:
    spec = {"key": "scope-key-0001", "name": "s", "control_tokens": list(CONTROL_TOKENS)}
    assert _post(dashboard, "/api/record/runs", None, json=spec).status_code == 401
    wrong = _post(dashboard, "/api/record/runs", "wrong-token-0123456789", json=spec)
    assert wrong.status_code == 401
    run_id = _new_run(dashboard, RECORDER, "scope-key-0002")
    # a recording token records, and may not cancel or delete (its own run or any other)
    assert _post(dashboard, f"/api/runs/{run_id}/cancel", RECORDER).status_code == 403
    deleted = loopback(
        "DELETE", f"{dashboard}/api/runs/{run_id}", headers={"authorization": f"Bearer {RECORDER}"}
    )
    assert deleted.status_code == 403
    # another recording token cannot change a run it did not create, nor take over its key
    steps = f"/api/record/runs/{run_id}/steps"
    assert _post(dashboard, steps, OTHER_RECORDER, content=_body(1)).status_code == 403
    assert _post(dashboard, f"/api/record/runs/{run_id}/finish", OTHER_RECORDER,
                 json={"status": "failed"}).status_code == 403  # fmt: skip
    taken = {"key": "scope-key-0002", "name": "x", "control_tokens": list(CONTROL_TOKENS)}
    assert _post(dashboard, "/api/record/runs", OTHER_RECORDER, json=taken).status_code == 403
    # its own token, and a full access token, may
    assert _post(dashboard, steps, RECORDER, content=_body(1)).status_code == 200
    assert _post(dashboard, steps, FULL, content=_body(2)).status_code == 200
    # a run launched or imported is no recorder's
    assert _post(dashboard, "/api/record/runs/999999/steps", RECORDER,
                 content=_body(3)).status_code == 404  # fmt: skip


def test_wrong_tokens_on_the_recording_api_are_limited(dashboard: str) -> None:
    statuses = [
        _post(
            dashboard, "/api/record/runs/1/steps", "wrong-token-0123456789", content=b"x"
        ).status_code
        for _ in range(8)
    ]
    assert statuses[0] == 401 and 429 in statuses


def _frame(raw_parts: list[bytes]) -> bytes:
    raw = b"".join(struct.pack("<Q", len(p)) + p for p in raw_parts)
    return zstandard.ZstdCompressor().compress(raw)


def _tables(step: int) -> list[bytes]:
    """The three IPC streams of a real frame, to tamper with."""
    frame = wire.encode_step(_step(step), CONTROL_TOKENS, np.zeros(0, np.int64)).frame
    raw = zstandard.ZstdDecompressor().decompress(frame)
    parts, at = [], 0
    for _ in range(3):
        (n,) = struct.unpack_from("<Q", raw, at)
        parts.append(raw[at + 8 : at + 8 + n])
        at += 8 + n
    return parts


def _rollouts_with(step: int, **columns: Any) -> bytes:
    import pyarrow as pa

    parts = _tables(step)
    table = pa.ipc.open_stream(parts[1]).read_all()
    for name, make in columns.items():
        at = table.schema.get_field_index(name)
        table = table.set_column(at, name, make(table.column(name)))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return wire.MAGIC + _with_length(_frame([parts[0], sink.getvalue().to_pybytes(), parts[2]]))


def _step_with_time(step: int) -> bytes:
    import pyarrow as pa

    parts = _tables(step)
    table = pa.ipc.open_stream(parts[0]).read_all()
    at = table.schema.get_field_index("recorded_at")
    late = pa.array([2**62], pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    table = table.set_column(at, table.schema.field(at), late)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return wire.MAGIC + _with_length(_frame([sink.getvalue().to_pybytes(), parts[1], parts[2]]))


def _with_length(frame: bytes) -> bytes:
    return struct.pack("<I", len(frame)) + frame


def test_hostile_bodies_are_refused_naming_the_field(
    session_factory: sessionmaker[Session], dashboard: str
) -> None:
    import pyarrow as pa

    run_id = _new_run(dashboard, RECORDER, "hostile-key-0001")
    path = f"/api/record/runs/{run_id}/steps"
    good = _body(1)
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (200 * 2**20))
    other_tokens = wire.body([wire.encode_step(_step(1), ["<a>"], np.zeros(0, np.int64)).frame])

    def ids_of(n: int) -> Any:
        return lambda col: pa.array([wire_ids(n)] * len(col), pa.binary())

    cases: dict[str, tuple[bytes, str]] = {
        "not ours": (b"GIF89a....", "body"),
        "truncated": (good[: len(good) // 2], "steps[0]"),
        "a bomb": (wire.MAGIC + _with_length(bomb), "steps[0]"),
        "a frame of junk": (wire.MAGIC + _with_length(b"\x28\xb5\x2f\xfd" + b"x" * 50), "steps[0]"),
        "other control tokens": (other_tokens, "steps[0].control_tokens"),
        "ids of another length": (_rollouts_with(1, ids=ids_of(3)), "steps[0].rollouts[0].ids"),
        "a wrong type": (
            _rollouts_with(1, n_tokens=lambda col: pa.array([1.5] * len(col), pa.float64())),
            "steps[0].rollouts.n_tokens",
        ),
        "a negative group": (
            _rollouts_with(1, group=lambda col: pa.array([-1] * len(col), pa.int64())),
            "steps[0].rollouts[0].group",
        ),
        "a NaN reward": (
            _rollouts_with(
                1, verifier_reward=lambda col: pa.array([float("nan")] * len(col), pa.float64())
            ),
            "steps[0].rollouts[0].verifier_reward",
        ),
        "two rollouts #0 of a group": (
            _rollouts_with(1, index=lambda col: pa.array([0] * len(col), pa.int64())),
            "steps[0].rollouts[1].index",
        ),
        "a time past year 9999": (_step_with_time(1), "steps[0].step.recorded_at"),
        "junk in a blob": (
            _rollouts_with(1, control=lambda col: pa.array([b"junk"] * len(col), pa.binary())),
            "steps[0].rollouts[0].control",
        ),
        "generator logprobs of another length": (
            _rollouts_with(
                1,
                generator_logprobs=lambda col: pa.array(
                    [arrays.encode_logprobs([-0.5] * 3)] * len(col), pa.binary()
                ),
            ),
            "steps[0].rollouts[0].generator_logprobs",
        ),
    }
    for what, (body, field) in cases.items():
        answer = _post(dashboard, path, RECORDER, content=body)
        assert answer.status_code == 422, (what, answer.status_code, answer.text)
        assert answer.json()["field"] == field, (what, answer.json())
    # oversized: refused by its declared length, before it is read
    huge = _post(dashboard, path, RECORDER, content=b"\0" * (64 * 2**20 + 1))
    assert huge.status_code == 413 and "67,108,864" in huge.json()["detail"]
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    _, rows, steps, _ = load_run(url, run_id)
    assert steps == [] and rows == []  # nothing of any of them was written
    assert _post(dashboard, path, RECORDER, content=good).status_code == 200


def test_a_sender_from_before_generator_logprobs_is_taken(
    session_factory: sessionmaker[Session], dashboard: str
) -> None:
    """A body without the generator_logprobs column (a recorder of an earlier version) is
    written as before: every rollout without the generator's side (null)."""
    import pyarrow as pa

    run_id = _new_run(dashboard, RECORDER, "before-key-0001")
    parts = _tables(1)
    table = pa.ipc.open_stream(parts[1]).read_all().drop_columns(["generator_logprobs"])
    assert table.schema.equals(wire.ROLLOUT_SCHEMA_BEFORE_GENERATOR)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    old = wire.MAGIC + _with_length(_frame([parts[0], sink.getvalue().to_pybytes(), parts[2]]))
    answer = _post(dashboard, f"/api/record/runs/{run_id}/steps", RECORDER, content=old)
    assert answer.status_code == 200, answer.text
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    _, rows, _, _ = load_run(url, run_id)
    assert len(rows) == 16 and all(r["generator_logprobs"] is None for r in rows)


def wire_ids(n: int) -> bytes:
    from rollout_lens.server.store import arrays

    return arrays.encode_ids(list(range(n)))


def test_a_network_cut_and_a_restart_lose_nothing_and_double_nothing(
    session_factory: sessionmaker[Session],
) -> None:
    """The trainer records through a loopback proxy: the proxy is cut, then the dashboard
    itself stops and a new one starts on the same port; steps buffer and catch up in order."""
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)

    def app() -> Any:
        return create_app(
            Settings(database_url=url, record_token=RECORDER), session_factory=session_factory
        )

    first = serve_app(app())
    base = first.__enter__()
    host, port = base.removeprefix("http://").split(":")
    proxy = TcpProxy((host, int(port)))
    proxy.start()
    writer = _remote(f"http://127.0.0.1:{proxy.port}")
    try:
        writer.put(_step(1))
        until(lambda: writer.written_steps == 1, "step 1")
        proxy.stop()  # a network cut
        # put hands its step to the writer's thread and returns: it never waits for the
        # dashboard (returned while nothing could be delivered)
        returns(lambda: [writer.put(_step(step)) for step in (2, 3)], "put with the link cut")
        time.sleep(1.0)
        assert writer.written_steps == 1
        proxy.start()
        until(lambda: writer.written_steps == 3, "steps 2 and 3")
        proxy.stop()
        first.__exit__(None, None, None)  # the dashboard goes away …
        writer.put(_step(4))
        time.sleep(0.5)
        second = serve_app(app())  # … and a new one starts, elsewhere: the proxy follows it
        base2 = second.__enter__()
        proxy.target = ("127.0.0.1", int(base2.rsplit(":", 1)[1]))
        proxy.start()
        writer.put(_step(5))
        assert writer.close(timeout=30)
        second.__exit__(None, None, None)
    finally:
        proxy.close()
    assert writer.run_id is not None
    run, rows, steps, _ = load_run(url, writer.run_id)
    assert [s.step for s in steps] == [1, 2, 3, 4, 5] and len(rows) == 5 * 16
    assert run.status == "completed" and run.dropped_steps == 0


def test_a_buffer_past_its_budget_drops_and_the_run_says_so(
    session_factory: sessionmaker[Session], dashboard: str
) -> None:
    proxy = TcpProxy(("127.0.0.1", int(dashboard.rsplit(":", 1)[1])))
    writer = _remote(f"http://127.0.0.1:{proxy.port}", max_bytes=40_000)
    try:
        for step in range(1, 6):
            writer.put(_step(step))  # the dashboard is away: the buffer fills past its budget
        time.sleep(1.0)
        proxy.start()
        until(
            lambda: writer.run_id is not None and not writer.backlog.pending,
            "the run and its steps",
        )
        assert writer.close(timeout=30)
    finally:
        proxy.close()
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    assert writer.run_id is not None
    run, _, steps, _ = load_run(url, writer.run_id)
    assert writer.dropped_rollouts > 0
    assert (run.dropped_steps, run.dropped_rollouts) == (
        writer.dropped_steps,
        writer.dropped_rollouts,
    )
    assert len(steps) == 5 - writer.dropped_steps


def test_a_dashboard_without_tokens_takes_a_recorder_without_one(
    session_factory: sessionmaker[Session],
) -> None:
    """No token set anywhere (a loopback dashboard): recording is open, as every change is; the
    writer keeps no cookies, so its POSTs are not taken for a browser's (CSRF)."""
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    with serve_app(create_app(Settings(database_url=url), session_factory=session_factory)) as base:
        writer = _remote(base, token=None)
        for step in (1, 2, 3):
            writer.put(_step(step))
            time.sleep(0.2)  # across requests: the dashboard's CSRF cookie comes back each time
        assert writer.close(timeout=30)
    assert writer.run_id is not None and writer.written_steps == 3
    run, _, steps, _ = load_run(url, writer.run_id)
    assert [s.step for s in steps] == [1, 2, 3] and run.recorded_by is None


def test_a_busy_dashboard_answers_503_and_the_trainer_waits_then_catches_up(
    session_factory: sessionmaker[Session],
) -> None:
    """Every write slot of the dashboard taken (as by other trainers' bodies): steps are answered
    503 with Retry-After, the writer keeps them and sends them, in order, once a slot is free."""
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    app = create_app(Settings(database_url=url), session_factory=session_factory)
    slots = app.state.ingest.writing  # what other trainers' bodies hold while they are written
    with serve_app(app) as base:
        held = [slots.acquire(blocking=False) for _ in range(8)]
        assert any(held)
        writer = _remote(base, token=None)
        returns(lambda: [writer.put(_step(step)) for step in (1, 2, 3)], "put while busy")
        until(lambda: writer.busy_answers >= 2, "two Busy answers")
        assert writer.written_steps == 0
        for taken in held:
            if taken:
                slots.release()
        assert writer.close(timeout=60)
    assert writer.run_id is not None and writer.dropped_steps == 0
    _, rows, steps, _ = load_run(url, writer.run_id)
    assert [s.step for s in steps] == [1, 2, 3] and len(rows) == 48


def test_concurrent_creates_of_one_key_make_one_run(
    session_factory: sessionmaker[Session], dashboard: str
) -> None:
    """Six recorders' creates of one key at once (a retry racing its first try), ten times: one
    run each time, created by one of them and found by the others (each once a 500: the loser's
    UNIQUE runs.record_key)."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import Barrier

    from rollout_lens.server.store.models import RunRow
    from sqlalchemy import func, select

    for round_ in range(10):
        spec = {"key": f"race-key-{round_:04d}", "name": "race", "control_tokens": ["<tool>"]}
        start = Barrier(6)

        def create(_: int, spec: dict[str, Any] = spec, start: Barrier = start) -> httpx.Response:
            start.wait()
            return _post(dashboard, "/api/record/runs", RECORDER, json=spec)

        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(create, range(6)))
        assert sorted(a.status_code for a in answers) == [200] * 5 + [201], [
            (a.status_code, a.text[:200]) for a in answers
        ]
        assert len({a.json()["id"] for a in answers}) == 1
        assert sum(a.json()["created"] for a in answers) == 1
        with session_scope(session_factory) as session:
            count = session.scalar(
                select(func.count()).select_from(RunRow).where(RunRow.record_key == spec["key"])
            )
        assert count == 1


def test_the_recorder_sends_a_spec_the_dashboard_takes(
    session_factory: sessionmaker[Session], dashboard: str
) -> None:
    """A run's name with a lone surrogate and a config with NaN and infinity (a user's text,
    a GRPOConfig's float): the recorder sends what the dashboard takes (the text made storable,
    the numbers null), as a local recording stores them; it once sent `\\ud800` (a 422)."""
    spec = _spec("half \ud800 pair")
    spec.config = {"max_grad_norm": float("nan"), "clip": float("inf"), "tag": "x\udc00"}
    writer = RemoteStepWriter(
        url=dashboard, token=RECORDER, spec=spec, prepare=lambda raw: raw, heartbeat_seconds=0.2
    )
    writer.put(_step(1))
    assert writer.close(timeout=30) and writer.run_id is not None
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    run, _, steps, _ = load_run(url, writer.run_id)
    assert run.name == "half \ufffd pair" and [s.step for s in steps] == [1]
    assert run.config["max_grad_norm"] is None and run.config["clip"] is None
    assert run.config["tag"] == "x\ufffd"
