"""Tool-calling runs through RolloutLensCallback, turn by turn: a plain GRPOTrainer on the
multi-step env (trainer/multiturn.make_trainer), the callback, the tiny multi-turn model (CPU).

The oracles are TRL's own output (completion ids, masks, tool_mask), the ToolBox's record of
what each tool saw and returned, and a plain forward pass over the same context at the weights
that generated."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.runconfig import RunConfig
from rollout_lens.server.store import arrays
from rollout_lens.server.store.db import make_engine, make_session_factory
from rollout_lens.server.webapp.app import create_app
from rollout_lens.server.webapp.pages.turns import result_json
from rollout_lens.trainer.escalation import multiturn as mt
from rollout_lens.trainer.recorder import turns as tt
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import HOSTILE, load_run, make_run, make_tool_rollouts, record_step
from tests.web_support import parse

# Per-token logprobs are stored to 1/LOGPROB_SCALE nat (server/store/arrays.py).
LOGPROB_ERROR = 0.5 / arrays.LOGPROB_SCALE + 1e-6


def _stored(p: float) -> float:
    """A control-token probability as stored: below the floor it reads back as 0."""
    return p if p >= arrays.CONTROL_FLOOR else 0.0


def _observe(trainer: Any) -> list[dict[str, Any]]:
    """Keep TRL's output of each generation, the ToolBoxes' records and a reference forward pass
    (at the weights that generated: before this step's update). The callback wraps this later."""
    seen: list[dict[str, Any]] = []
    original = trainer._generate_and_score_completions
    model = trainer.model

    def observe(inputs):  # type: ignore[no-untyped-def]
        output = original(inputs)
        boxes = [SimpleNamespace(ep=b.ep, calls=list(b.calls)) for b in trainer.environments]
        rows = []
        with torch.no_grad():
            for i in range(len(inputs)):
                prompt = output["prompt_ids"][i][output["prompt_mask"][i].bool()]
                keep = output["completion_mask"][i].bool()
                ids = output["completion_ids"][i][keep]
                logits = model(torch.cat([prompt, ids])[None]).logits[0].float()
                logp = torch.log_softmax(logits / trainer.temperature, dim=-1)
                logp = logp[len(prompt) - 1 : len(prompt) - 1 + len(ids)]
                rows.append(
                    {
                        "prompt_ids": prompt.tolist(),
                        "ids": ids.tolist(),
                        "mask": output["tool_mask"][i][keep].tolist(),
                        "logprobs": logp.gather(1, ids[:, None]).squeeze(1).tolist(),
                        "eos_probs": logp[:, trainer.processing_class.eos_token_id].exp().tolist(),
                    }
                )
        seen.append({"rows": rows, "boxes": boxes})
        return output

    trainer._generate_and_score_completions = observe
    return seen


@pytest.mark.slow
def test_a_tool_calling_run_is_recorded_and_viewed_turn_by_turn(
    multiturn_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_lens import RolloutLensCallback

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(multiturn_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(multiturn_model_dir)
    url = f"sqlite:///{tmp_path / 'lens.db'}"
    callback = RolloutLensCallback(
        project="tools", database_url=url, target=lambda row: row["needed"][0]
    )
    config = RunConfig(
        turns="multi",
        variant="patched",
        episodes="mixed",
        steps=2,
        group_size=4,
        prompts_per_step=2,
    )
    trainer = mt.make_trainer(config, model, tokenizer, tmp_path / "out", callbacks=[callback])
    seen = _observe(trainer)
    trainer.train()

    engine = make_engine(url)
    run, rows, steps, series = load_run(url, 1)
    eos = tokenizer.eos_token
    assert run.status == "completed" and run.group_size == 4 and len(steps) == 2
    assert run.control_tokens == ["<tool_call>", "</tool_call>", eos]
    assert not any("not recorded per turn" in n for n in run.notes)
    assert any("turn by turn" in n for n in run.notes)
    assert run.config["rollout_lens"]["judged"]["vote"] is True
    assert len(rows) == 2 * 8
    shapes = set()
    for r in rows:
        truth = seen[r["step"] - 1]["rows"][r["group"] * 4 + r["index"]]
        box = seen[r["step"] - 1]["boxes"][r["group"] * 4 + r["index"]]
        ids, mask = truth["ids"], truth["mask"]
        assert r["completion_ids"] == ids
        assert r["completion"] == tokenizer.decode(ids)
        assert r["prompt"] == tokenizer.decode(truth["prompt_ids"])  # with its own tool listing
        turns = r["meta"]["turns"]
        model_turns = [t for t in turns if t["role"] == "model"]
        tool_turns = [t for t in turns if t["role"] == "tool"]
        # the spans are TRL's runs of tool_mask: 1 model, 0 tool, alternating from a model turn
        assert [(t["start"], t["end"]) for t in turns if t["end"] > t["start"]] == [
            (a, b) for _, a, b in tt.runs(mask)
        ]
        assert [t["role"] for t in turns] == ["model", "tool"] * len(tool_turns) + ["model"] * (
            len(model_turns) - len(tool_turns)
        )
        assert len(model_turns) == len(tool_turns) + 1  # the tiny model's turns are never cut
        # every tool result is what the ToolBox returned (or TRL's error for a tool it lacks)
        results = [c for t in tool_turns for c in t["calls"]]
        ran = [c for c in results if "not found." not in c["result"]]
        assert [c["name"] for c in ran] == [name for name, _ in box.calls]
        for call, (_, observation) in zip(ran, box.calls, strict=True):
            assert observation.removeprefix("error: ") in call["result"]
        for k, turn in enumerate(tool_turns):
            assert [c["name"] for c in turn["calls"]] == [
                c["name"] for c in model_turns[k]["calls"]
            ]
            text = tokenizer.decode(ids[turn["start"] : turn["end"]])
            assert all(c["result"] in text for c in turn["calls"])
        # the vote is the final answer (no vote function given); the first call is beside it
        assert r["vote"] == r["meta"]["answer"]
        assert r["meta"]["first_call"] == (
            model_turns[0]["calls"][0]["name"] if model_turns[0]["calls"] else None
        )
        last = model_turns[-1]
        if not last["calls"]:
            assert r["meta"]["answer"] in tokenizer.decode(ids[last["start"] : last["end"]])
        # logprobs: the probe's, per turn, equal a plain forward pass (float16 as stored);
        # tool-result tokens hold 0.0 and Σ logprob covers the model's tokens only
        sampled = [v == 1 for v in mask]
        for i, keep in enumerate(sampled):
            got = r["token_logprobs"][i]
            ctrl = r["control_token_probs"][eos][i]
            if keep:
                assert got == pytest.approx(truth["logprobs"][i], rel=1e-3, abs=LOGPROB_ERROR)
                assert ctrl == pytest.approx(_stored(truth["eos_probs"][i]), rel=1e-3, abs=1e-4)
            else:
                assert got == 0.0 and ctrl == 0.0
        model_sum = sum(lp for lp, keep in zip(truth["logprobs"], sampled, strict=True) if keep)
        assert r["sum_logprob"] == pytest.approx(model_sum, rel=1e-4, abs=1e-4)
        assert math.isclose(
            sum(r["token_logprobs"]),
            r["sum_logprob"],
            rel_tol=1e-3,
            abs_tol=LOGPROB_ERROR * len(r["token_logprobs"]),
        )
        shapes.add((len(model_turns), len(results)))
    assert any(calls >= 2 for _, calls in shapes)  # some rollouts took several tool turns
    # the control-token series count the model's positions only (tool results hold 0.0)
    for step in (1, 2):
        model_probs = [
            p
            for r in rows
            if r["step"] == step
            for p, v in zip(
                r["control_token_probs"][eos],
                seen[step - 1]["rows"][r["group"] * 4 + r["index"]]["mask"],
                strict=True,
            )  # fmt: skip
            if v == 1
        ]
        (logged,) = [v for s, v in series[f"ctrl/{eos}/mean"] if s == step]
        assert logged == pytest.approx(sum(model_probs) / len(model_probs), rel=1e-3, abs=1e-4)

    # the step viewer: each rollout a conversation, tool results marked not trained
    app = create_app(Settings(database_url=url), session_factory=make_session_factory(engine))
    client = TestClient(app, base_url="http://127.0.0.1")
    page = parse(client.get("/runs/1/steps/1/groups/0").text)
    group = [r for r in rows if r["step"] == 1 and r["group"] == 0]
    panels = page.find_all("div", cls="tab-panel")
    assert len(panels) == 4
    for panel, r in zip(panels, group, strict=True):
        turns = r["meta"]["turns"]
        shown = panel.find_all("li", cls="turn")
        assert [n.attrs["data-turn"] for n in shown] == [t["role"] for t in turns]
        for node, turn in zip(shown, turns, strict=True):
            if turn["role"] == "tool":
                assert node.find(cls="not-trained").text == "not trained"
                # a result that parses as JSON or a Python literal reads as indented JSON
                assert [n.text for n in node.find_all("pre", cls="tool-result")] == [
                    result_json(c["result"]) or c["result"] for c in turn["calls"]
                ]
                assert all("tool-tok" in n.classes for n in node.find_all("span", cls="tok"))
            else:
                cells = node.find(cls="tokens").find_all("span", cls="tok")
                assert len(cells) == turn["end"] - turn["start"]
                assert node.find("table", cls="ctrl") is not None  # the per-position table
    votes = [r["vote"] for r in group]
    assert page.find(cls="group-card") is not None and all(
        v in page.find(cls="group-card").text for v in votes if v
    )
    engine.dispose()


def _tool_run(factory: sessionmaker[Session]) -> int:
    run_id = make_run(factory, steps=0, name="hostile tools")
    record_step(factory, run_id, 1, values={"reward_mean": 1.0}, rollouts=make_tool_rollouts())
    return run_id


def test_tool_output_and_arguments_are_escaped(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    run_id = _tool_run(session_factory)
    html = client.get(f"/runs/{run_id}/steps/1").text
    page = parse(html)
    assert "<script>window.__pwned" not in html and "<img src=x" not in html
    for script in page.find_all("script"):
        assert script.attrs.get("src") or script.attrs.get("type") == "application/json"
    assert not [n for n in page.find_all("img") if n.attrs.get("src") == "x"]
    assert not [n for n in page.iter() if any(a.startswith("on") for a in n.attrs)]
    panel = page.by_id("rollout-0")
    results = panel.find_all("pre", cls="tool-result")
    assert [n.text for n in results] == [HOSTILE]  # shown as text, exactly
    assert json.loads(panel.find("code", cls="tool-args").text) == {"q": HOSTILE}
    tool = panel.find("li", cls="turn-tool")
    assert tool.find(cls="not-trained") is not None
    model = panel.find_all("li", cls="turn-model")
    assert len(model) == 2 and "Σ logprob -0.40" in model[0].text
    # the group's final answers, hostile text shown as text; every rollout here scored 1
    answers = page.by_id("answers").find_all("li", cls="vote")
    assert [a.find(cls="vote-id").text for a in answers] == ["42", HOSTILE]
    assert all("target" in a.classes for a in answers)
    # the API keeps the turns and the raw 0.0 of tool positions
    data = client.get(f"/api/runs/{run_id}/steps/1/groups/0").json()
    rollout = data["rollouts"][0]
    assert rollout["meta"]["turns"][1]["calls"][0]["result"] == HOSTILE
    assert rollout["sampled"] == [True] * 4 + [False] * 3 + [True] * 2


def test_stitching_follows_trls_call_order() -> None:
    """Call t holds, in row order, the rows with at least t tool stretches; a mismatch is None."""

    class Probe:
        used = True

        def __init__(self, rows: list[list[float]]) -> None:
            self.rows = rows

        def finish(self, ids: list[list[int]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
            # GenerationProbe's arrays: logprobs [n], control-token probabilities [n × k]
            rows = [
                np.asarray(r[: len(i)], dtype=np.float64)
                for r, i in zip(self.rows, ids, strict=True)
            ]
            return rows, [(r / 10)[:, None] for r in rows]

    ids = [[1, 2, 9, 9, 3], [4, 5], [6, 9, 7, 9, 9, 8, 8]]
    masks = [[1, 1, 0, 0, 1], [1, 1], [1, 0, 1, 0, 0, 1, 1]]
    calls = [
        (Probe([[-1, -2], [-4, -5], [-6]]), [[1, 2], [4, 5], [6]]),
        (Probe([[-3], [-7]]), [[3], [7]]),
        (Probe([[-8, -8, -5]]), [[8, 8, 5]]),  # TRL cut this turn to the budget: a prefix
    ]
    logprobs, control = tt.stitch(calls, ids, masks, 1)  # type: ignore[arg-type,misc]
    assert [row.tolist() for row in logprobs] == [
        [-1, -2, 0, 0, -3],
        [-4, -5],
        [-6, 0, -7, 0, 0, -8, -8],
    ]
    assert control[2].T.tolist() == [[-0.6, 0.0, -0.7, 0.0, 0.0, -0.8, -0.8]]
    assert tt.stitch(calls[:2], ids, masks, 1) is None  # type: ignore[arg-type]
    assert tt.stitch([calls[0], calls[2], calls[1]], ids, masks, 1) is None  # type: ignore[arg-type]
    assert tt.model_spans([1, 1, 0, 0]) == [(0, 2), (4, 4)]  # a last turn cut to nothing
    messages = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "a", "arguments": {"x": 1}}}],
        },  # fmt: skip
        {"role": "tool", "name": "a", "content": "<b>hi</b>"},
        {"role": "assistant", "content": "<answer>3</answer>"},
    ]
    turns = tt.read_turns([1, 1, 0, 0, 1], messages)
    assert turns == [
        {"role": "model", "start": 0, "end": 2, "calls": [{"name": "a", "arguments": {"x": 1}}]},
        {
            "role": "tool",
            "start": 2,
            "end": 4,
            "calls": [{"name": "a", "arguments": {"x": 1}, "result": "<b>hi</b>"}],
        },  # fmt: skip
        {"role": "model", "start": 4, "end": 5, "calls": []},
    ]
    assert tt.first_call(turns) == "a" and tt.final_answer(messages) == "<answer>3</answer>"
