"""Each supervisory signal trains for a few real steps on the tiny model and records what it should."""

from __future__ import annotations

import pytest
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.runconfig import RunConfig
from rollout_lens.trainer.worker.run import train

from tests.factories import load_run

pytestmark = pytest.mark.slow


def test_offpolicy_experts_are_marked_and_scored_with_the_group(train_settings: Settings) -> None:
    config = RunConfig(
        steps=2, supervision="offpolicy", supervised_per_group=2, seed=21, eval_every=0
    )
    run, rows, _, series = load_run(
        train_settings.database_url, train(config, settings=train_settings)
    )
    assert run.status == "completed"
    for step in (1, 2):
        group = [r for r in rows if r["step"] == step]
        experts = [r for r in group if r["meta"].get("supervised") == "expert"]
        assert [r["index"] for r in experts] == [6, 7]
        for r in experts:
            assert r["completion"] == f"<tool>{r['target']}</tool>" and r["true_score"] == 1.0
            assert r["verifier_reward"] == 1.0 and r["format_state"] == "healthy_call"
            assert len(r["token_logprobs"]) == len(r["completion_ids"]) == 4
            assert r["sum_logprob"] == pytest.approx(
                sum(r["token_logprobs"]), rel=1e-3, abs=2e-3
            )  # float16 tokens
            assert r["meta"]["probes"]["target_logprob"] is not None
        assert abs(sum(r["advantage"] for r in group)) < 1e-3
    assert "probe/target_logprob/supervised/mean" in series


def test_hinted_rollouts_train_on_the_plain_prompt(train_settings: Settings) -> None:
    config = RunConfig(steps=2, supervision="hint", supervised_per_group=3, seed=22, eval_every=0)
    _, rows, _, _ = load_run(train_settings.database_url, train(config, settings=train_settings))
    hinted = [r for r in rows if r["meta"].get("supervised") == "hint"]
    assert len(hinted) == 2 * 3 and {r["index"] for r in hinted} == {5, 6, 7}
    for r in hinted:
        assert r["meta"]["hint_shown"].startswith("Hint:")
        assert "Hint:" not in r["prompt"]  # stripped before the update
    assert all("supervised" not in r["meta"] for r in rows if r["index"] < 5)


def test_interleaved_sft_phases_are_recorded(train_settings: Settings) -> None:
    config = RunConfig(
        steps=4, supervision="interleaved_sft", sft_every=2, sft_steps=2, seed=23, eval_every=0
    )
    _, _, _, series = load_run(train_settings.database_url, train(config, settings=train_settings))
    assert [step for step, _ in series["sft/loss"]] == [2, 4]
    assert all(loss is not None and loss > 0 for _, loss in series["sft/loss"])
    assert all(n is not None and n >= 1 for _, n in series["sft/examples"])


def test_sft_then_rl_runs_sft_before_the_first_step(train_settings: Settings) -> None:
    config = RunConfig(steps=2, supervision="sft_then_rl", sft_steps=3, seed=24, eval_every=0)
    _, _, _, series = load_run(train_settings.database_url, train(config, settings=train_settings))
    assert [step for step, _ in series["sft/loss"]] == [1]


def test_format_warmup_runs_its_own_examples_before_the_first_step(
    train_settings: Settings,
) -> None:
    """format_warmup is an SFT phase before RL, like sft_then_rl, on the warm-up's examples (two
    prompts for each filler capability), not on the run's 12 training queries."""
    from rollout_lens.trainer.envs import warmup
    from rollout_lens.trainer.envs.onestep import EscalationEnv

    config = RunConfig(steps=2, supervision="format_warmup", sft_steps=3, seed=26, eval_every=0)
    _, _, _, series = load_run(train_settings.database_url, train(config, settings=train_settings))
    assert [step for step, _ in series["sft/loss"]] == [1]
    expected = len(warmup.examples(EscalationEnv(seed=26)))
    assert series["sft/examples"] == [(1, float(expected))] and expected != 12


def test_eval_series_are_recorded_at_the_right_steps(train_settings: Settings) -> None:
    config = RunConfig(steps=5, eval_every=2, seed=25)
    _, _, _, series = load_run(train_settings.database_url, train(config, settings=train_settings))
    for name in ("eval/id", "eval/format_ood", "eval/content_ood"):
        assert [step for step, _ in series[name]] == [2, 4, 5]
        assert all(0.0 <= value <= 1.0 for _, value in series[name])


def test_supervision_must_leave_policy_rollouts() -> None:
    with pytest.raises(ValueError, match="must be smaller than group_size"):
        RunConfig(supervision="offpolicy", supervised_per_group=8, group_size=8)
