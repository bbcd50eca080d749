"""The mismatch figures against TRL's own: TRL's code path computes its `sampling/*` metrics and
its importance-sampling ratios (trl/trainer/grpo_trainer.py, 1.16.0: the ratio at lines
2660–2706, the metrics at 2860–2895) from a `rollout_func`'s logprobs, and core.mismatch must
give the same numbers for the same tensors.

TRL computes them only with `use_vllm`, and vLLM cannot run here: the trainer is built without it
and the two switches are turned on after, with the weight sync already marked done (the only
vLLM call on the `rollout_func` path). Everything else — the scoring pass, the masks, the ratios,
the metrics — is TRL's own code running on the tiny model.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests import user_script as us

pytestmark = pytest.mark.slow

BATCH = 8  # rows of one generation: 2 prompts × 4 generations


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """rollout_func is experimental in TRL, which warns so (warnings are errors here)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")


def _rollout_func(seed: int):  # type: ignore[no-untyped-def]
    """A rollout function whose completions are random tokens and whose logprobs are random
    numbers, some missing (None, as vLLM sends), some positions masked as an environment's
    (its `env_mask`, which TRL takes as the tool mask): any two sides TRL is given must agree."""
    rng = random.Random(seed)
    given: list[list[float | None]] = []
    masks: list[list[int]] = []

    def rollout(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        tok = trainer.processing_class
        vocab = [i for t, i in tok.get_vocab().items() if t not in us.SPECIAL]
        prompt_ids = [
            tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
            for p in prompts
        ]
        completions = [[rng.choice(vocab) for _ in range(rng.randint(2, 8))] for _ in prompts]
        # Each row keeps one logprob at least: a row with none has no sequence ratio here
        # (left out), where TRL's is exp(0) = 1 (test_mismatch.py's no-generator cases).
        logprobs = [
            [None if k and rng.random() < 0.15 else -rng.uniform(0.0, 6.0) for k in range(len(ids))]
            for ids in completions
        ]
        env_mask = [
            [int(k == 0 or rng.random() > 0.2) for k in range(len(ids))] for ids in completions
        ]
        given.extend(logprobs)
        masks.extend(env_mask)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completions,
            "logprobs": logprobs,
            "env_mask": env_mask,
        }

    return rollout, given, masks


def _trainer(model_dir: Path, out: Path, rollout: Any, mode: str, clip: float | None):  # type: ignore[no-untyped-def]
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(out),
        max_completion_length=8,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
        per_device_train_batch_size=BATCH,
        num_generations=4,
        max_steps=1,
    )
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=[us.is_short],
        args=args,
        train_dataset=Dataset.from_list(us.conversational(us.questions(BATCH))),
        rollout_func=rollout,
    )
    trainer.use_vllm = True  # what TRL's IS correction and its sampling/* metrics are behind
    trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_mode = mode
    trainer.vllm_importance_sampling_clip_min = None if clip is None else 1 / clip
    trainer.vllm_importance_sampling_clip_max = clip
    trainer._last_loaded_step = trainer.state.global_step  # no vLLM weights to sync
    trainer.model.train()
    return trainer


def _sides(
    output: dict[str, Any], given: list[list[float | None]], masks: list[list[int]]
) -> list[Any]:
    from rollout_lens.server.core.mismatch import Sides

    out = []
    for i, (generator, mask) in enumerate(zip(given, masks, strict=True)):
        n = len(generator)
        trainer = output["old_per_token_logps"][i][:n].double().numpy()
        out.append(Sides(trainer, generator, np.asarray(mask, dtype=bool)))
    assert any(0 in m for m in masks)  # masked positions are there, and left out by both
    return out


def _run(tmp_path: Path, model_dir: Path, mode: str, clip: float | None):  # type: ignore[no-untyped-def]
    rollout, given, masks = _rollout_func(seed=7)
    trainer = _trainer(model_dir, tmp_path / mode, rollout, mode, clip)
    inputs = [trainer.train_dataset[i] for i in range(BATCH)]
    output = trainer._generate_and_score_completions(inputs)
    assert len(given) == BATCH and any(v is None for row in given for v in row)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("sampling/")}
    return output, _sides(output, given, masks), metrics


def test_figures_equal_trl_sampling_metrics(tmp_path: Path, user_model_dir: Path) -> None:
    """|Δlogp| mean and max, and the sequence ratio's min, mean and max, equal TRL's
    sampling/sampling_logp_difference/* and sampling/importance_sampling_ratio/* (sequence
    level, no bounds) for the same rollouts and the same scoring pass."""
    from rollout_lens.server.core import mismatch as mm

    _, sides, trl = _run(tmp_path, user_model_dir, "sequence_mask", None)
    ours = mm.step_figures(sides)
    pairs = {
        mm.ABS_DIFF_MEAN: "sampling/sampling_logp_difference/mean",
        mm.ABS_DIFF_MAX: "sampling/sampling_logp_difference/max",
        mm.SEQ_RATIO_MIN: "sampling/importance_sampling_ratio/min",
        mm.SEQ_RATIO_MEAN: "sampling/importance_sampling_ratio/mean",
        mm.SEQ_RATIO_MAX: "sampling/importance_sampling_ratio/max",
    }
    for name, key in pairs.items():
        # TRL computes in float32: agreement to its precision
        assert ours[name] == pytest.approx(trl[key], rel=1e-4, abs=1e-6), name
    assert ours[mm.ABS_DIFF_MAX] > 0.5  # random sides: a real mismatch, not two zeros


@pytest.mark.parametrize("band", [2.0, 5.0])
def test_outside_share_equals_trl_token_mask(
    tmp_path: Path, user_model_dir: Path, band: float
) -> None:
    """The share outside [1/b, b] counts the tokens TRL's token_mask mode zeroes with those
    bounds (NaN tokens, which TRL gives ratio 1, are left out of our denominator)."""
    from rollout_lens.server.core import mismatch as mm

    output, sides, _ = _run(tmp_path, user_model_dir, "token_mask", band)
    ratio = output["importance_sampling_ratio"]
    zeroed = sum(
        int((ratio[i][: len(s.trainer)] == 0).sum()) for i, s in enumerate(sides)
    )  # completion tokens only: padding is outside the mask and never zeroed
    compared = sum(len(s.log_ratios()) for s in sides)
    name = mm.OUTSIDE_2X if band == 2.0 else mm.OUTSIDE_5X
    assert mm.step_figures(sides)[name] * compared == pytest.approx(zeroed)
    assert zeroed > 0
    assert not math.isnan(float(np.mean(ratio.numpy())))


def test_the_recorder_stores_both_sides_and_trl_figures(
    tmp_path: Path, user_model_dir: Path
) -> None:
    """A run recorded by the callback from a rollout_func: each rollout's generator logprobs are
    what the function returned (NaN where it gave None and where its env_mask is off, rounded as
    the store rounds logprobs), and the step's recorded mismatch/* figures equal TRL's own
    sampling/* metrics for that step, recorded beside them from TRL's logs."""
    from rollout_lens.server.core import mismatch as mm

    from rollout_lens import RolloutLensCallback
    from tests.factories import load_run, stored_logprobs_match

    url = f"sqlite:///{tmp_path / 'lens.db'}"
    rollout, given, masks = _rollout_func(seed=11)
    trainer = _trainer(user_model_dir, tmp_path / "out", rollout, "sequence_mask", None)
    trainer.args.logging_steps = 1
    trainer.add_callback(RolloutLensCallback(project="mismatch", database_url=url))
    trainer.train()
    run, rows, _, series = load_run(url, 1)
    assert run.status == "completed" and len(rows) == len(given) == BATCH
    assert any("rollout_func" in note for note in run.notes)
    ordered = sorted(rows, key=lambda r: (r["step"], r["group"], r["index"]))
    for row, returned, mask in zip(ordered, given, masks, strict=True):
        want = [math.nan if v is None or not m else v for v, m in zip(returned, mask, strict=True)]
        assert len(row["generator_logprobs"]) == len(row["completion_ids"]) == len(want)
        assert stored_logprobs_match(row["generator_logprobs"], want)
        assert len(row["token_logprobs"]) == len(want)  # the trainer's side, from TRL's pass
    pairs = {
        mm.ABS_DIFF_MEAN: "sampling/sampling_logp_difference/mean",
        mm.ABS_DIFF_MAX: "sampling/sampling_logp_difference/max",
        mm.SEQ_RATIO_MIN: "sampling/importance_sampling_ratio/min",
        mm.SEQ_RATIO_MEAN: "sampling/importance_sampling_ratio/mean",
        mm.SEQ_RATIO_MAX: "sampling/importance_sampling_ratio/max",
    }
    for name, key in pairs.items():
        (step, ours), (trl_step, theirs) = series[name][-1], series[f"trl/{key}"][-1]
        assert step == trl_step == 1
        assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-6), name  # TRL's float32
    assert set(mm.NAMES) <= set(series)
    assert series[mm.ABS_DIFF_MAX][-1][1] > 0.5  # random sides: a real mismatch


def _brute_force(model: Any, prompt: list[int], completion: list[int], sampling: dict[str, Any]):  # type: ignore[no-untyped-def]
    """log p of each completion token under the distribution generate draws it from, computed
    by hand from one plain float32 forward pass: the logits over the temperature, then top-k
    (the k largest kept), then top-p (the smallest head of the sorted distribution whose mass
    reaches p: a token is kept when the mass before it is below p), renormalized."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].double()
    z = logits[len(prompt) - 1 : -1] / sampling["temperature"]
    if sampling["top_k"]:
        kth = z.topk(sampling["top_k"], dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, -math.inf)
    if sampling["top_p"] < 1.0:
        order = z.argsort(dim=-1, descending=True)
        probs = torch.softmax(z, dim=-1).gather(1, order)
        before = probs.cumsum(dim=-1) - probs
        drop = torch.zeros_like(z, dtype=torch.bool).scatter(1, order, before >= sampling["top_p"])
        z = z.masked_fill(drop, -math.inf)
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(1, torch.tensor(completion)[:, None])[:, 0].numpy()


SAMPLINGS = {
    "plain": {"temperature": 1.0, "top_k": 0, "top_p": 1.0},
    "filtered": {"temperature": 0.7, "top_k": 5, "top_p": 0.9},
}


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_generate_records_the_distribution_it_sampled_from(
    tmp_path: Path, user_model_dir: Path, name: str
) -> None:
    """transformers' generate: each rollout's generator logprobs are generate's own sampling
    distribution's (read by the SamplingProbe after every warper), equal to a brute-force
    recomputation from the weights that sampled with the run's temperature, top-k and top-p.
    In float32 with no filtering the generator is the trainer (mismatch ≈ 0); with top-k/top-p
    the sampling distribution is the trainer's truncated and renormalized, so every sampled
    token's generator logprob is above the trainer's and the step's figures show it."""
    from datasets import Dataset
    from rollout_lens.server.core import mismatch as mm
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from rollout_lens import RolloutLensCallback
    from tests.factories import load_run, stored_logprobs_match

    sampling = SAMPLINGS[name]
    url = f"sqlite:///{tmp_path / 'lens.db'}"
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        max_completion_length=8,
        report_to="none",
        use_cpu=True,
        bf16=False,  # float32 on both sides: the brute force's precision
        save_strategy="no",
        disable_tqdm=True,
        per_device_train_batch_size=BATCH,
        num_generations=4,
        max_steps=2,
        learning_rate=1e-2,  # the second step samples from other weights
        **sampling,
    )
    trainer = GRPOTrainer(
        model=str(user_model_dir),
        reward_funcs=[us.is_short],
        args=args,
        train_dataset=Dataset.from_list(us.conversational(us.questions(2 * BATCH))),
    )
    calls: list[tuple[dict[str, Any], list[list[int]], list[list[int]]]] = []
    generate = trainer._generate_single_turn

    def observed(*call: Any, **named: Any) -> Any:  # wrapped by the capture: it runs inside
        weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        result = generate(*call, **named)
        calls.append((weights, [list(p) for p in call[0]], [list(c) for c in result[0]]))
        return result

    trainer._generate_single_turn = observed
    trainer.add_callback(RolloutLensCallback(project="generate", database_url=url))
    trainer.train()

    run, rows, _, series = load_run(url, 1)
    assert len(calls) == 2 and len(rows) == 2 * BATCH
    assert any("generate's own sampling distribution" in note for note in run.notes)
    oracle = AutoModelForCausalLM.from_pretrained(user_model_dir).eval()
    rows.sort(key=lambda r: (r["step"], r["group"], r["index"]))
    gaps = []
    for k, row in enumerate(rows):
        weights, prompts, completions = calls[row["step"] - 1]
        i = k % BATCH
        assert row["completion_ids"] == completions[i]
        oracle.load_state_dict(weights)
        want = _brute_force(oracle, prompts[i], completions[i], sampling)
        assert stored_logprobs_match(row["generator_logprobs"], want), (k, want)
        gaps.extend(np.asarray(row["generator_logprobs"]) - np.asarray(row["token_logprobs"]))
    figures = {n: [v for _, v in series[n]] for n in mm.NAMES}
    if name == "plain":
        assert max(figures[mm.ABS_DIFF_MAX]) < 1e-4  # float rounding only
    else:
        assert min(gaps) > -2 / 4096  # truncation renormalizes upwards (store rounding aside)
        assert min(figures[mm.ABS_DIFF_MEAN]) > 0.05
