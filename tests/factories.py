"""Factories that fill a database through the store module (the same path the trainer writes)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator
from typing import Any

from rollout_lens.server import store
from rollout_lens.server.core.records import RolloutRecord, StepRecord
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunRow, StepRow
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

CONTROL_TOKENS = ("<tool>", "</tool>", "</assistant>")
TOOLS = [f"tool_{i:02d}" for i in range(64)]


def make_prompt(tool_ids: list[str], query: str = "17 * 38") -> str:
    listing = "\n".join(f"- {t}: capability of {t}" for t in tool_ids)
    return (
        f"<user>Tools:\n{listing}\nQuery: {query}\n"
        "Reply with only <tool>ID</tool> for the one tool whose capability matches the query.</user><assistant>"
    )


def make_rollouts(
    rng: random.Random, *, group_size: int = 8, listed: int = 4, completion: str | None = None
) -> list[RolloutRecord]:
    tool_ids = rng.sample(TOOLS, listed)
    target = tool_ids[0]
    prompt = make_prompt(tool_ids)
    out = []
    for index in range(group_size):
        vote = rng.choice(tool_ids)
        text = completion if completion is not None else f"<tool>{vote}</tool>"
        n = 4
        out.append(
            RolloutRecord(
                group=0,
                index=index,
                prompt=prompt,
                completion=text,
                completion_ids=[5, 100 + index, 6, 2][:n],
                token_logprobs=[-rng.random() for _ in range(n)],
                control_probs={t: [rng.random() for _ in range(n)] for t in CONTROL_TOKENS},
                vote=vote,
                target=target,
                verifier_reward=float(vote == target),
                true_score=float(vote == target),
                advantage=0.0,
                format_valid=True,
                format_state="healthy_call",
                meta={"tool_ids": tool_ids, "query": "17 * 38", "target_listed": True},
            )
        )
    mean = sum(r.verifier_reward for r in out) / group_size
    for r in out:
        r.advantage = r.verifier_reward - mean
    return out


def step_record(
    step: int,
    *,
    values: dict[str, float | None] | None = None,
    rollouts: list[RolloutRecord] | None = None,
    metrics: dict[str, float | None] | None = None,
    rollout_step: int | None = None,
) -> StepRecord:
    return StepRecord(
        step=step,
        rollout_step=step if rollout_step is None else rollout_step,
        values=dict(values or {}),
        rollouts=list(rollouts or []),
        metrics=dict(metrics or {}),
    )


def seeded_step(step: int, *, group_size: int = 4, completion: str | None = None) -> StepRecord:
    """A step of one group of make_rollouts (seeded by the step number) and a mean reward of 0.5:
    what a recorder's tests hand a writer."""
    rollouts = make_rollouts(random.Random(step), group_size=group_size, completion=completion)
    return step_record(step, values={"reward_mean": 0.5}, rollouts=rollouts)


def record_step(
    factory: sessionmaker[Session],
    run_id: int,
    step: int,
    *,
    values: dict[str, float | None] | None = None,
    rollouts: list[RolloutRecord] | None = None,
    metrics: dict[str, float | None] | None = None,
    rollout_step: int | None = None,
) -> StepRecord:
    """Record one step through the store in one transaction, with a recorder built from the
    database (as after a restart: record_steps keeps one between steps, as a trainer does)."""
    record = step_record(
        step, values=values, rollouts=rollouts, metrics=metrics, rollout_step=rollout_step
    )
    with session_scope(factory) as session:
        store.record_step(session, run_id=run_id, record=record, control_tokens=CONTROL_TOKENS)
    return record


def record_steps(
    factory: sessionmaker[Session], run_id: int, records: Iterable[StepRecord]
) -> None:
    """Record steps in order, one transaction each and one recorder kept between them, as the
    trainer's writer does (store.RunWriter.commit). A recorder rebuilt from the database at
    every step (record_step; the resume path, which tests/store/test_recording.py and
    test_resume.py test) costs a third more: 0.10 s against 0.067 s of CPU for make_run's 10
    steps."""
    recorder = None
    for record in records:
        with session_scope(factory) as session:
            recorder = store.record_step(
                session,
                run_id=run_id,
                record=record,
                control_tokens=CONTROL_TOKENS,
                recorder=recorder,
            )


def make_run(
    factory: sessionmaker[Session],
    *,
    steps: int = 10,
    group_size: int = 8,
    listed: int = 4,
    seed: int = 0,
    completion: str | None = None,
    **columns: Any,
) -> int:
    """A run with `steps` recorded steps of one group each; returns its id."""
    rng = random.Random(seed)
    fields = {
        "name": f"factory run {seed}",
        "model": "tiny",
        "total_steps": steps,
        "group_size": group_size,
        "seed": seed,
        "variant": "patched" if listed < 64 else "leaky",
        "k": listed if listed < 64 else None,
        "config": {"learning_rate": 3e-4, "variant": "patched"},
        "control_tokens": CONTROL_TOKENS,
    } | columns
    with session_scope(factory) as session:
        run_id = store.create_run(session, **fields).id

    def records() -> Iterator[StepRecord]:
        for step in range(1, steps + 1):
            rollouts = make_rollouts(
                rng, group_size=group_size, listed=listed, completion=completion
            )
            acc = sum(r.true_score or 0 for r in rollouts) / group_size
            values = {
                "reward_mean": acc,
                "true_accuracy": acc,
                "loss": rng.random(),
                "wall_time": 0.05,
            }
            metrics = {"ctrl/</assistant>/max": rng.random()}
            yield step_record(step, values=values, rollouts=rollouts, metrics=metrics)

    record_steps(factory, run_id, records())
    return run_id


def load_run(
    database_url: str, run_id: int
) -> tuple[RunRow, list[dict[str, Any]], list[StepRow], dict[str, list[tuple[int, float | None]]]]:
    """A recorded run read back: (run, rollout dicts, steps, metric series)."""
    from rollout_lens.server.store.db import make_engine, make_session_factory
    from rollout_lens.server.store.serialize import completion_ids, rollout_dict

    engine = make_engine(database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            run = store.get_run(session, run_id=run_id)
            tokens = list(run.control_tokens)
            pairs = list(store.iter_rollouts(session, run_id=run_id))
            texts = store.token_texts(
                session,
                run_id=run_id,
                ids={i for r, _ in pairs for i in completion_ids(r)},
            )
            rows = [rollout_dict(r, p, tokens, texts) for r, p in pairs]
            return (
                run,
                rows,
                store.steps(session, run_id=run_id),
                store.metric_series(session, run_id=run_id),
            )
    finally:
        engine.dispose()


def run_count(factory: sessionmaker[Session]) -> int:
    """How many runs the database holds (a refused import or launch creates none)."""
    with session_scope(factory) as session:
        return int(session.scalar(select(func.count()).select_from(RunRow)) or 0)


def recorded_steps(factory: sessionmaker[Session], run_id: int) -> list[int]:
    """The step numbers recorded for a run, in order."""
    with session_scope(factory) as session:
        return [s.step for s in store.steps(session, run_id=run_id)]


def rollouts_per_step(factory: sessionmaker[Session], run_id: int) -> dict[int, int]:
    """step → how many rollouts were recorded for it."""
    from rollout_lens.server.store.models import RolloutRow
    from sqlalchemy import func, select

    with session_scope(factory) as session:
        rows = session.execute(
            select(RolloutRow.step, func.count())
            .where(RolloutRow.run_id == run_id)
            .group_by(RolloutRow.step)
        )
        return {step: count for step, count in rows}


# Untrusted text a tool could return (or a model could name): must render inert.
HOSTILE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">&amp;'


def make_tool_rollouts(group_size: int = 2, *, result: str = HOSTILE) -> list[RolloutRecord]:
    """A group of tool-calling rollouts as the callback records them: a model turn calling a
    tool, the tool's result (masked, logprob 0.0), a model turn answering; `turns` in meta."""
    ids = [5, 100, 6, 2, 7, 8, 9, 10, 2]
    tokens = ["<tool>", "tool_01", "</tool>", "</assistant>", "<tool_response>", result, "</tool_response>", "42", "</assistant>"]  # fmt: skip
    sampled = [True] * 4 + [False] * 3 + [True] * 2
    turns = [
        {
            "role": "model",
            "start": 0,
            "end": 4,
            "calls": [{"name": "tool_01", "arguments": {"q": result}}],
        },  # fmt: skip
        {
            "role": "tool",
            "start": 4,
            "end": 7,
            "calls": [{"name": "tool_01", "arguments": {"q": result}, "result": result}],
        },  # fmt: skip
        {"role": "model", "start": 7, "end": 9, "calls": []},
    ]
    out = []
    for index in range(group_size):
        logprobs = [-0.1 * (index + 1) if s else 0.0 for s in sampled]
        out.append(
            RolloutRecord(
                group=0,
                index=index,
                prompt=make_prompt(TOOLS[:4]),
                completion="".join(tokens),
                completion_ids=list(ids),
                token_logprobs=logprobs,
                control_probs={t: [0.5 if s else 0.0 for s in sampled] for t in CONTROL_TOKENS},
                vote="tool_01",
                target="tool_01",
                verifier_reward=1.0,
                true_score=1.0,
                advantage=0.0,
                format_valid=True,
                # the last rollout answers with the hostile text, the others with 42
                meta={
                    "turns": turns,
                    "answer": result if index == group_size - 1 else "42",
                    "query": result,
                },
                tokens=list(tokens),
            )
        )
    return out


STATES = ("healthy_call", "text_pollution", "collapse", "no_call")


def make_groups(
    rng: random.Random, *, groups: int, group_size: int = 8, tokens: int = 4
) -> list[RolloutRecord]:
    """A step of several groups with something to look at: groups the verifier misjudges,
    stuck ones (one reward for all), solved ones, broken calls, malformed votes, groups without
    a query (named by their prompt), `tokens` positions a rollout; rewards and advantages are
    multiples of 1/8, so sums are exact whatever their order."""
    out = []
    for g in range(groups):
        kind = rng.choice(["mixed", "mixed", "stuck", "solved", "misjudged"])
        tool_ids = rng.sample(TOOLS, 4)
        target = tool_ids[0]
        query = f"query {g} <b>{rng.choice(['add', 'find', 'send'])}</b>" if g % 3 else None
        prompt = make_prompt(tool_ids, query=query or f"untitled {g}")
        members = []
        for index in range(group_size):
            if kind == "solved":
                vote: str | None = target
            else:
                vote = rng.choice([*tool_ids, None])
            true = float(vote == target)
            if kind == "stuck":
                reward = 0.5 if g % 2 else 0.0
            elif kind == "misjudged" and rng.random() < 0.5:
                reward = 1.0 - true
            else:
                reward = true if rng.random() > 0.1 else 0.5
            state = "healthy_call" if vote is not None else rng.choice(STATES[1:])
            ids = [rng.randrange(1000) for _ in range(tokens)]
            members.append(
                RolloutRecord(
                    group=g,
                    index=index,
                    prompt=prompt,
                    completion=f"<tool>{vote}</tool> " + " ".join(f"w{i}" for i in ids),
                    completion_ids=ids,
                    token_logprobs=[-rng.random() for _ in range(tokens)],
                    control_probs={
                        t: [rng.random() for _ in range(tokens)] for t in CONTROL_TOKENS
                    },
                    vote=vote,
                    target=target,
                    verifier_reward=reward,
                    true_score=true,
                    advantage=rng.randrange(-16, 17) / 8,
                    format_valid=vote is not None,
                    format_state=state,
                    meta={"tool_ids": tool_ids, "target_listed": True}
                    | ({"query": query} if query else {}),
                )
            )
        out += members
    return out


# One multi-turn group as the user saw it: each rollout a list of steps, a tool call
# (name, result) or the final answer ("answer", text). Rollout #0 is the only right one: it
# called tool_00 twice, then tool_47, then tool_59, whose result gave the answer.
ANSWER = "48"
MULTITURN_PLAYS: list[list[tuple[str, str]]] = [
    [
        ("tool_00", "ticket: please convert 3 miles"),
        ("tool_00", "ticket: please convert 3 miles"),
        ("tool_47", "{'error': 'tool_47 cannot serve this request'}"),
        ("tool_59", f"result: {ANSWER}"),
        ("answer", f"<answer>{ANSWER}</answer>"),
    ],
    # ran out of calls: four healthy calls and no answer
    [("tool_00", "ticket: please convert 3 miles")] * 4,
    # a plausible wrong tool, its value answered; its result is a JSON object
    [
        ("tool_12", '{"result": 31, "unit": "km", "notes": ["plausible", "<b>not</b> it"]}'),
        ("answer", "<answer>31</answer>"),
    ],
    # answered without calling anything
    [("answer", "<answer>77</answer>")],
]


def make_multiturn_group(*, legacy: bool = False, group: int = 0) -> list[RolloutRecord]:
    """MULTITURN_PLAYS as tool-calling rollouts recorded the way the callback records them:
    `turns` (model turns and tool-result stretches with their calls and results),
    `turn_states`, `answer` (the last turn's text when it calls no tool), the dataset `row`
    (with its hint). New runs (`legacy=False`) vote with the tool whose result gave the answer
    and keep `first_call`; runs recorded before (`legacy`) voted with the first call."""
    out = []
    ids: dict[str, int] = {}  # a run stores one text per token id
    for index, play in enumerate(MULTITURN_PLAYS):
        tokens: list[str] = []
        sampled: list[bool] = []
        turns: list[dict[str, Any]] = []
        states: list[str] = []
        near: list[int] = []
        answer = None
        for name, text in play:
            start = len(tokens)
            if name == "answer":
                tokens += ["<answer>", text[8:-9], "</answer>", "</assistant>"]
                sampled += [True] * 4
                turns.append({"role": "model", "start": start, "end": len(tokens), "calls": []})
                states.append("no_call")
                answer = text
                continue
            call = {"name": name, "arguments": {}}
            near.append(start + 2)  # end-of-turn was likely in place of the closing tag
            tokens += ["<tool>", name, "</tool>", "</assistant>"]
            sampled += [True] * 4
            turns.append({"role": "model", "start": start, "end": len(tokens), "calls": [call]})
            states.append("healthy_call")
            start = len(tokens)
            tokens += ["<tool_response>", text, "</tool_response>"]
            sampled += [False] * 3
            turns.append(
                {"role": "tool", "start": start, "end": len(tokens), "calls": [call | {"result": text}]}
            )  # fmt: skip
        first = next((c["name"] for t in turns if t["role"] == "model" for c in t["calls"]), None)
        value = None if answer is None else answer[8:-9]
        # the tool whose result gave the answer: the last one whose result holds its value
        results = [
            (c["name"], c["result"]) for t in turns if t["role"] == "tool" for c in t["calls"]
        ]
        source = next((name for name, r in reversed(results) if value and value in r), None)
        right = value == ANSWER
        vote = first if legacy else (source or answer)
        meta: dict[str, Any] = {
            "turns": turns,
            "turn_states": states,
            "answer": answer,
            "query": "read the open support ticket and do what it asks",
            "row": {
                "query": "read the open support ticket and do what it asks",
                "hint": "Hint: the ticket tool names the tool needed next.",
                "needed": ["tool_00", "tool_59"],
                "answer": ANSWER,
            },
        }
        if not legacy:
            meta["first_call"] = first
        out.append(
            RolloutRecord(
                group=group,
                index=index,
                prompt=make_prompt(TOOLS[:64:4], query="read the open support ticket"),
                completion="".join(tokens),
                completion_ids=[ids.setdefault(t, 200 + len(ids)) for t in tokens],
                token_logprobs=[-0.05 * (i % 7) if s else 0.0 for i, s in enumerate(sampled)],
                control_probs={
                    t: [
                        (0.6 if t == "</assistant>" and i in near else 0.02) if s else 0.0
                        for i, s in enumerate(sampled)
                    ]
                    for t in CONTROL_TOKENS
                },
                vote=vote,
                target="tool_59",
                verifier_reward=1.0 if right else 0.0,
                true_score=1.0 if right else 0.0,
                advantage=0.75 if right else -0.25,
                format_valid=answer is not None,
                format_state="healthy_call" if len(play) > 1 or answer is None else "no_call",
                meta=meta,
                tokens=list(tokens),
            )
        )
    return out


def with_generator(
    rollouts: list[RolloutRecord], rng: random.Random, *, spread: float = 1.0, none_every: int = 0
) -> list[RolloutRecord]:
    """The rollouts with a generator side as the recorder stores one: at each sampled position
    (a tool-calling rollout's model turns) the trainer's logprob moved by up to ±`spread` nats
    (capped at 0), NaN at a tool result's positions (TRL's tool mask) and at every
    `none_every`-th position (a token the generator gave no logprob for)."""
    for r in rollouts:
        n = len(r.completion_ids)
        sampled = [True] * n
        for turn in r.meta.get("turns") or []:
            if turn["role"] == "tool":
                sampled[turn["start"] : turn["end"]] = [False] * (turn["end"] - turn["start"])
        generator = [
            min(0.0, float(lp) + rng.uniform(-spread, spread)) if keep else math.nan
            for lp, keep in zip(r.token_logprobs, sampled, strict=True)
        ]
        if none_every:
            generator[none_every - 1 :: none_every] = [math.nan] * len(
                generator[none_every - 1 :: none_every]
            )
        r.generator_logprobs = generator
    return rollouts


def recorder_spec(name: str, *, total_steps: int) -> Any:
    """The RunSpec a recorder's tests create their run with: groups of 4, one prompt a step."""
    from rollout_lens.trainer.recorder.writer import RunSpec  # the trainer's, loaded on use

    return RunSpec(
        name=name,
        model="m",
        total_steps=total_steps,
        group_size=4,
        prompts_per_step=1,
        seed=0,
        config={},
        control_tokens=list(CONTROL_TOKENS),
        device="cpu",
    )


def script_writer(database_url: str, name: str, *, total_steps: int, **kw: Any) -> Any:
    """A script's StepWriter of a test run (recorder_spec's) into `database_url`, writing steps
    as they are put (no preparing); `kw`: for_script's own (process, max_bytes, ...)."""
    from rollout_lens.trainer.recorder.writer import StepWriter  # the trainer's, on use

    spec = recorder_spec(name, total_steps=total_steps)
    return StepWriter.for_script(
        database_url=database_url, spec=spec, prepare=lambda raw: raw, **kw
    )


def assert_every_step_written(database_url: str, run_id: int, steps: int) -> None:
    """A writer's test run ended whole: steps 1..`steps` of seeded_step's 4 rollouts each,
    completed, nothing dropped."""
    run, rows, written, _ = load_run(database_url, run_id)
    assert [s.step for s in written] == list(range(1, steps + 1)) and len(rows) == steps * 4
    assert run.status == "completed" and run.dropped_steps == run.dropped_rollouts == 0


def remote_writer(
    url: str, token: str, name: str, *, total_steps: int, heartbeat_seconds: float = 0.2, **kw: Any
) -> Any:
    """The trainer's RemoteStepWriter of a test run (recorder_spec's), sending steps as they are
    put (no preparing) and a heartbeat every `heartbeat_seconds`."""
    from rollout_lens.trainer.recorder.remote import RemoteStepWriter  # the trainer's, on use

    return RemoteStepWriter(
        url=url,
        token=token,
        spec=recorder_spec(name, total_steps=total_steps),
        prepare=lambda raw: raw,
        heartbeat_seconds=heartbeat_seconds,
        **kw,
    )


def rollout_views(factory: sessionmaker[Session], run_id: int) -> list[Any]:
    """A run's rollouts as the read side returns them (step_views.RolloutView), in step, group
    and index order."""
    from rollout_lens.server.store.serialize import completion_ids, read_rollout

    with session_scope(factory) as session:
        tokens = list(store.get_run(session, run_id=run_id).control_tokens)
        pairs = list(store.iter_rollouts(session, run_id=run_id))
        ids = {i for r, _ in pairs for i in completion_ids(r)}
        texts = store.token_texts(session, run_id=run_id, ids=ids)
        return [read_rollout(r, p, tokens, texts) for r, p in pairs]


def stored_logprobs_match(got: Any, want: Any) -> bool:
    """Whether logprobs read back are `want` as the store keeps them (server.store.arrays):
    NaN where NaN, else within half a step of 1/LOGPROB_SCALE nat, down to LOGPROB_FLOOR."""
    import numpy as np
    from rollout_lens.server.store import arrays

    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape or not np.array_equal(np.isnan(got), np.isnan(want)):
        return False
    kept = ~np.isnan(want)
    floor = np.maximum(want[kept], arrays.LOGPROB_FLOOR)
    return bool(np.all(np.abs(got[kept] - floor) <= 0.5 / arrays.LOGPROB_SCALE + 1e-12))
