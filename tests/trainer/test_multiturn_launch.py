"""A multi-turn run launched as the dashboard launches one: RunConfig(turns="multi") through the
worker's `train()` (TRL's tool loop, the multi-turn tiny model, the worker's StepWriter), then
its run page, and the tool-use series read back against each rollout's recorded turns.

The oracles: the env's own reading of each recorded conversation (trainer.envs.multistep), the
turns the recorder kept, and the launch form's validation messages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from rollout_lens.server.core import vocab
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.runconfig import RunConfig
from rollout_lens.server.store.db import make_engine, make_session_factory
from rollout_lens.server.webapp.app import create_app
from rollout_lens.server.webapp.pages import plotly_figures

from tests.factories import load_run
from tests.web_support import parse

MULTI = {"turns": "multi", "max_completion_tokens": 128, "eval_every": 0}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_completion_tokens": 8}, "must be at least 32 for a multi-turn run"),
        ({"supervision": "offpolicy"}, "supervision offpolicy is single-turn only"),
        ({"supervision": "hint"}, "supervision hint is single-turn only"),
        ({"supervision": "format_warmup"}, "supervision format_warmup is single-turn only"),
        ({"max_calls": 0}, "greater than or equal to 1"),
        ({"episodes": "triple"}, "'single', 'chain' or 'mixed'"),
    ],
)
def test_a_multi_turn_config_that_cannot_run_is_refused_with_the_reason(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        RunConfig(**(MULTI | fields))


def test_a_multi_turn_config_names_itself() -> None:
    config = RunConfig(**MULTI, variant="leaky", seed=3)
    assert config.name == "multi-turn leaky (64 tools) seed 3"
    assert RunConfig().turns == "single"  # today's runs are unchanged
    # given no budget, a multi-turn run gets room for calls, results and an answer
    assert RunConfig(turns="multi").max_completion_tokens == 128
    assert RunConfig().max_completion_tokens == 8


@pytest.mark.slow
def test_a_launched_multi_turn_run_is_recorded_turn_by_turn(multiturn_settings: Settings) -> None:
    from rollout_lens.trainer.envs import multistep as ms
    from rollout_lens.trainer.worker.run import train

    settings = multiturn_settings
    config = RunConfig(
        **MULTI, variant="patched", steps=2, group_size=4, prompts_per_step=2, episodes="mixed"
    )
    run_id = train(config, settings=settings)

    run, rows, steps, series = load_run(settings.database_url, run_id)
    assert run.status == "completed" and [s.step for s in steps] == [1, 2]
    assert run.config["turns"] == "multi"
    assert run.control_tokens[:2] == ["<tool_call>", "</tool_call>"]
    assert len(rows) == 2 * 8
    for step in (1, 2):
        at = [r for r in rows if r["step"] == step]
        calls, turns, right, free, states = [], [], [], [], {p: [] for p in vocab.TURN_POSITIONS}
        for r in at:
            recorded = r["meta"]["turns"]
            model = [t for t in recorded if t["role"] == "model"]
            names = [c["name"] for t in model for c in t["calls"]]
            needed = r["meta"]["row"]["needed"]
            calls.append(len(names))
            turns.append(len(model))
            right += [n in needed for n in names]
            # every model turn has a state; a turn whose calls TRL parsed is never "no call"
            assert len(r["meta"]["turn_states"]) == len(model)
            for i, (t, state) in enumerate(zip(model, r["meta"]["turn_states"], strict=True)):
                assert state in vocab.TURN_STATES
                assert (state == "no_call") <= (not t["calls"])
                states[vocab.turn_position(i)].append(state)
            # the vote is the tool whose result gave the final answer (else the answer itself),
            # the first tool called beside it; true score: the final answer is the episode's
            given = re.fullmatch(
                r"\s*<answer>\s*([^<>]*?)\s*</answer>\s*", r["meta"]["answer"] or ""
            )
            shown_by = [
                c["name"]
                for t in recorded
                if t["role"] == "tool"
                for c in t["calls"]
                if given and given.group(1) in re.findall(r"result: (\S+)", c["result"])
            ]
            assert r["vote"] == (shown_by[-1] if shown_by else r["meta"]["answer"])
            assert r["meta"]["first_call"] == (names[0] if model and model[0]["calls"] else None)
            answer = str(r["meta"]["row"]["answer"])
            assert r["true_score"] == float(r["meta"]["answer"] == f"<answer>{answer}</answer>")
            assert r["meta"]["format_free"] in (0.0, 1.0)
            assert r["meta"]["format_free"] >= r["true_score"]  # lenient never below exact
            free.append(r["meta"]["format_free"])

        def logged(name: str, step: int = step) -> float | None:
            return dict(series[name]).get(step)

        assert logged(vocab.TOOL_CALLS) == pytest.approx(sum(calls) / len(at))
        assert logged(vocab.TOOL_TURNS) == pytest.approx(sum(turns) / len(at))
        if right:
            assert logged(vocab.RIGHT_TOOL_RATE) == pytest.approx(sum(right) / len(right))
        assert logged(vocab.FORMAT_FREE_ACCURACY) == pytest.approx(sum(free) / len(at))
        for position, seen in states.items():
            for state in vocab.TURN_STATES:
                name = vocab.turn_state(position, state)
                if seen:
                    assert logged(name) == pytest.approx(seen.count(state) / len(seen))
        assert vocab.TOOL_FAILURE_RATE in series  # TRL's own, recorded as it logs it
        # each rollout's state is its worst turn's; probes read at the turn boundaries
        for r in at:
            assert r["format_state"] in vocab.STATES
            assert r["meta"]["probes"]["open_first"] is not None
        assert logged(vocab.state("collapse")) == pytest.approx(
            sum(r["format_state"] == "collapse" for r in at) / len(at)
        )
        assert logged(vocab.probe("open_first")) is not None

    # the run page draws the tool-use section from those series, format-free beside accuracy
    figs = plotly_figures.run_figures(run.control_tokens, [*vocab.STEP_SERIES, *series])
    assert {"tool-calls", "tool-rates", "turn-states-1"} <= {f["id"] for f in figs["tools"]}
    reward = next(f for f in figs["main"] if f["id"] == "reward")
    assert vocab.FORMAT_FREE_ACCURACY in {t["meta"].get("series") for t in reward["data"]}
    engine = make_engine(settings.database_url)
    app = create_app(settings, session_factory=make_session_factory(engine))
    client = TestClient(app, base_url="http://127.0.0.1")
    page = client.get(f"/runs/{run_id}")
    assert page.status_code == 200 and 'id="charts-tools"' in page.text
    # the step viewer (two groups a step: the overview, then group 0's page): the group's query,
    # its votes (first tools called) and final answers
    overview = parse(client.get(f"/runs/{run_id}/steps/1").text)
    assert len(overview.by_id("groups-table").find("tbody").find_all("tr")) == 2
    step = parse(client.get(f"/runs/{run_id}/steps/1/groups/0").text)
    group = [r for r in rows if r["step"] == 1 and r["group"] == 0]
    assert (
        step.find(cls="group-card").find("p", cls="query").text == group[0]["meta"]["row"]["query"]
    )
    shown = {
        (a.find(cls="vote-id").text, int(a.find(cls="vote-count").text), "target" in a.classes)
        for a in step.by_id("answers").find_all("li", cls="vote")
    }
    given = [r["meta"]["answer"] for r in group]
    assert {(text or "no answer (ended on a call)", n) for text, n, _ in shown} == {
        (a or "no answer (ended on a call)", given.count(a)) for a in set(given)
    }
    for text, _, right in shown:
        scores = [
            r["true_score"]
            for r in group
            if (r["meta"]["answer"] or "no answer (ended on a call)") == text
        ]
        assert right == (text != "no answer (ended on a call)" and all(s == 1.0 for s in scores))
    assert config.max_calls == ms.DEFAULT_MAX_CALLS
    engine.dispose()


OPEN, CLOSE, EOT = "<tool_call>", "</tool_call>", "<|im_end|>"
TAGS = (OPEN, CLOSE)


@pytest.mark.parametrize(
    ("text", "calls", "state"),
    [
        (f'{OPEN}{{"name": "tool_01"}}{CLOSE}{EOT}', 1, "healthy_call"),
        (f"{OPEN}a{CLOSE}\n{OPEN}b{CLOSE}{EOT}", 2, "healthy_call"),
        (f"let me see {OPEN}a{CLOSE}{EOT}", 1, "text_pollution"),
        (f"{OPEN}a{CLOSE}{CLOSE}{EOT}", 1, "text_pollution"),  # a closing tag repeats
        (f"{OPEN}not json{CLOSE}{EOT}", 0, "text_pollution"),  # closed but TRL parsed nothing
        (f'{OPEN}{{"name": "tool_01"', 0, "open_call"),  # cut by the length limit
        (f"{OPEN}{EOT}", 0, "eot_in_call"),
        (f'{OPEN}{{"name": "tool_01"}}{EOT}', 0, "eot_in_call"),  # closing tag dropped
        (f"<answer>5</answer>{EOT}", 0, "no_call"),
        ("", 0, "no_call"),
    ],
)
def test_turn_state_table(text: str, calls: int, state: str) -> None:
    from rollout_lens.trainer.recorder.turns import turn_state

    assert turn_state(text, calls, TAGS, [EOT]) == state


def test_turn_probes_read_each_model_turn_and_the_turn_after_a_result() -> None:
    from rollout_lens.trainer.recorder.positional import turn_probes

    # model: <tool_call> {"name": x} </tool_call> EOT | tool: r r | model: <answer> EOT
    tokens = [OPEN, '{"name": ', "x", "}", CLOSE, EOT, "r", "r", "<answer>", EOT]
    probs = {
        OPEN: [0.9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.2, 0.0],
        CLOSE: [0.0, 0.05, 0.0, 0.0, 0.8, 0.1, 0.0, 0.0, 0.0, 0.0],
        EOT: [0.0, 0.3, 0.0, 0.0, 0.15, 0.7, 0.0, 0.0, 0.4, 0.9],
    }
    turns = [
        {"role": "model", "start": 0, "end": 6, "calls": [{"name": "x"}]},
        {"role": "tool", "start": 6, "end": 8, "calls": []},
        {"role": "model", "start": 8, "end": 10, "calls": []},
    ]
    got = turn_probes(tokens, probs, turns, open_tag=OPEN, close_tag=CLOSE, eot=EOT)
    assert got["open_first"] == 0.9  # the first turn only
    assert got["eot_after_open"] == 0.3 and got["close_after_open"] == 0.05  # position 1
    # "after the id": where the call closed, its JSON being several tokens
    assert got["close_after_id"] == 0.8 and got["eot_after_id"] == 0.15
    assert got["eot_after_close"] == 0.7 and got["close_after_close"] == 0.1
    assert got["open_after_result"] == 0.2 and got["eot_after_result"] == 0.4


@pytest.mark.parametrize(
    ("states", "state"),
    [
        (["healthy_call", "no_call"], "healthy_call"),
        (["healthy_call", "eot_in_call"], "collapse"),
        (["open_call"], "collapse"),
        (["text_pollution", "no_call"], "text_pollution"),
        (["no_call"], "no_call"),
        ([], "no_call"),
    ],
)
def test_a_tool_calling_rollouts_state_is_its_worst_turns(states: list[str], state: str) -> None:
    from rollout_lens.trainer.recorder.turns import rollout_state

    assert rollout_state(states) == state


@pytest.mark.slow
def test_the_expert_conversation_trains_on_the_models_turns_only(
    multiturn_model_dir: Path,
) -> None:
    from rollout_lens.trainer.builders.multiturn_model import render_answer, render_call
    from rollout_lens.trainer.envs import multistep as ms
    from rollout_lens.trainer.escalation import multiturn_supervision as mts
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(multiturn_model_dir)
    env = ms.MultiStepEnv(seed=2, variant="patched")
    ep = env.episode(env.train_queries[3].text, kind="chain", episode=7)
    ids, labels = mts.expert_sequence(tokenizer, env, ep)
    assert len(ids) == len(labels)
    # the whole conversation is what the template renders for it
    messages = mts.expert_messages(env, ep)
    assert (
        ids
        == list(
            tokenizer.apply_chat_template(
                messages,
                tools=mts.tool_schemas(env, ep.tool_ids),
                tokenize=True,
                return_dict=False,
            )
        )[: len(ids)]
    )
    # the trained spans are the two calls and the answer, in order; the results are context
    spans, current = [], []
    for token, label in zip(ids, labels, strict=True):
        if label != -100:
            assert label == token
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    if current:
        spans.append(tokenizer.decode(current))
    assert spans == [render_call(ep.needed[0]), render_call(ep.needed[1]), render_answer(ep.answer)]
    assert f"result: {ep.answer}" in tokenizer.decode(ids)  # the real result, not trained
    # a row recorded with a rollout rebuilds its episode
    assert ms.Episode.from_row(ep.row()) == ep


@pytest.mark.slow
def test_a_multi_turn_run_with_sft_then_rl_and_evaluation(multiturn_settings: Settings) -> None:
    from rollout_lens.trainer.envs import multistep as ms
    from rollout_lens.trainer.escalation import multiturn_supervision as mts
    from rollout_lens.trainer.worker.run import train

    settings = multiturn_settings
    config = RunConfig(
        **(MULTI | {"eval_every": 1}),
        steps=2,
        group_size=4,
        supervision="sft_then_rl",
        sft_steps=3,
    )
    run_id = train(config, settings=settings)
    run, _, steps, series = load_run(settings.database_url, run_id)
    assert run.status == "completed" and len(steps) == 2
    (sft,) = series[vocab.SFT_LOSS]
    assert sft[0] == 1 and sft[1] is not None and sft[1] > 0
    env = ms.MultiStepEnv(seed=0, variant="patched")
    sizes = {name: len(eps) for name, eps in mts.eval_episodes(env).items()}
    for name in ("id", "content_ood"):
        points = series[vocab.eval_set(name)]
        assert [s for s, _ in points] == [1, 2]
        for _, value in points:  # a share of the set's episodes answered exactly
            assert value is not None and 0 <= value <= 1
            assert value * sizes[name] == pytest.approx(round(value * sizes[name]))
    assert vocab.eval_set("format_ood") not in series
