"""Train the real tiny model for a few real GRPO steps and check what was recorded."""

from __future__ import annotations

import math

import pytest
import torch
from rollout_lens.server import store
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.runconfig import RunConfig
from rollout_lens.server.store import arrays
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.models import RolloutRow, StepRow
from rollout_lens.trainer.worker.run import train
from sqlalchemy import func, select
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.factories import load_run
from tests.prompt_lens_support import assert_lens_matches

# Per-token logprobs are stored to 1/LOGPROB_SCALE nat (server/store/arrays.py).
LOGPROB_ERROR = 0.5 / arrays.LOGPROB_SCALE + 1e-6

pytestmark = pytest.mark.slow


def test_every_step_and_rollout_is_recorded(train_settings: Settings) -> None:
    config = RunConfig(steps=3, group_size=8, seed=1)
    run_id = train(config, settings=train_settings)
    run, rows, steps, series = load_run(train_settings.database_url, run_id)

    assert run.status == "completed" and run.current_step == 3
    assert run.device == "cpu" and run.device_seconds > 0 and run.cost > 0
    assert run.control_tokens == ["<tool>", "</tool>", "</assistant>"]
    assert [s.step for s in steps] == [1, 2, 3]
    assert len(rows) == 3 * 8
    for step in (1, 2, 3):
        group = [r for r in rows if r["step"] == step]
        assert [r["index"] for r in group] == list(range(8))
        assert len({r["prompt"] for r in group}) == 1  # one prompt per group
        assert abs(sum(r["advantage"] for r in group)) < 1e-3
        accuracy = sum(r["true_score"] for r in group) / 8
        assert steps[step - 1].true_accuracy == pytest.approx(accuracy)
        assert steps[step - 1].reward_mean == pytest.approx(
            sum(r["verifier_reward"] for r in group) / 8
        )
    for r in rows:
        n = len(r["completion_ids"])
        assert n >= 1 and len(r["token_logprobs"]) == n
        # Σ logprob is float64 from full precision; the stored per-token ones are float16
        assert r["sum_logprob"] == pytest.approx(sum(r["token_logprobs"]), rel=1e-3, abs=2e-3)
        assert all(lp <= 0 for lp in r["token_logprobs"])
        position_sums = [0.0] * n
        for probs in r["control_token_probs"].values():
            assert len(probs) == n and all(0.0 <= p <= 1.0 for p in probs)
            position_sums = [a + b for a, b in zip(position_sums, probs, strict=True)]
        assert all(total <= 1.0 + 2e-3 for total in position_sums)  # float16: ±2.5e-4 each
        assert r["true_score"] == float(r["vote"] == r["target"])
        assert r["prompt"].startswith("<user>Tools:\n- tool_") and r["prompt"].endswith(
            "<assistant>"
        )
        row = r["meta"]["row"]  # the dataset row's columns
        assert row["target_listed"] is True and r["target"] in row["tool_ids"]
    for s in steps:
        assert (
            s.loss is not None
            and s.grad_norm is not None
            and s.learning_rate == pytest.approx(3e-4)
        )
        assert 0.0 <= s.vote_agreement <= 1.0 and s.vote_entropy >= 0 and s.wall_time > 0
    assert {"ctrl/</assistant>/max", "ctrl/<tool>/mean", "retrieval_recall"} <= set(series)
    assert len(assert_lens_matches(train_settings.database_url, run_id)) >= 1


def test_recorded_logprobs_are_the_sampling_policys(
    train_settings: Settings, tiny_model_dir
) -> None:  # type: ignore[no-untyped-def]
    """Step 1 sampled from the initial weights: a plain forward pass must give the same numbers."""
    config = RunConfig(steps=1, seed=2, temperature=0.7)
    run_id = train(config, settings=train_settings)
    _, rows, _, _ = load_run(train_settings.database_url, run_id)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    control_ids = [
        tokenizer.convert_tokens_to_ids(t) for t in ("<tool>", "</tool>", "</assistant>")
    ]
    for r in rows:
        prompt_ids = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt_ids + r["completion_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt_ids) - 1 : -1] / 0.7
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        expected = logprobs.gather(1, torch.tensor(r["completion_ids"])[:, None]).squeeze(1)
        # per-token arrays are stored as float16 (display precision); Σ logprob at full precision
        assert r["token_logprobs"] == pytest.approx(expected.tolist(), rel=1e-3, abs=LOGPROB_ERROR)
        assert r["sum_logprob"] == pytest.approx(expected.sum().item(), abs=1e-4)
        eot = logprobs[:, control_ids[2]].exp().tolist()
        stored = [p if p >= arrays.CONTROL_FLOOR else 0.0 for p in eot]  # the floor: read as 0
        assert r["control_token_probs"]["</assistant>"] == pytest.approx(stored, rel=1e-3, abs=1e-4)


def test_reused_generations_point_at_their_step(train_settings: Settings) -> None:
    config = RunConfig(steps=4, num_iterations=2, seed=3)
    run_id = train(config, settings=train_settings)
    _, rows, steps, _ = load_run(train_settings.database_url, run_id)
    assert [(s.step, s.rollout_step) for s in steps] == [(1, 1), (2, 1), (3, 3), (4, 3)]
    assert sorted({r["step"] for r in rows}) == [1, 3] and len(rows) == 16


def test_a_failing_run_is_marked_failed_with_its_error(train_settings: Settings) -> None:
    config = RunConfig(steps=2, control_tokens=["<no-such-token>"])
    with pytest.raises(ValueError, match="not in the tokenizer"):
        train(config, settings=train_settings)
    factory = make_session_factory(make_engine(train_settings.database_url))
    with session_scope(factory) as session:
        run = store.list_runs(session)[0]
        assert run.status == "failed" and "<no-such-token>" in (run.error or "")
        assert session.scalar(select(func.count()).select_from(StepRow)) == 0
        assert session.scalar(select(func.count()).select_from(RolloutRow)) == 0


def test_leaky_prompts_list_every_tool(train_settings: Settings) -> None:
    run_id = train(RunConfig(variant="leaky", steps=1, seed=4), settings=train_settings)
    _, rows, steps, _ = load_run(train_settings.database_url, run_id)
    assert all(len(r["meta"]["row"]["tool_ids"]) == 64 for r in rows)
    assert math.isfinite(steps[0].loss)
