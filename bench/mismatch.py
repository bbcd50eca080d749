"""Real training–inference mismatch on the CPU: a TRL `rollout_func` that samples with a copy
of the policy `k` optimizer steps stale (what an async trainer does), optionally in bfloat16,
and returns that copy's own logprobs of what it sampled.

For each staleness it trains the Escalation task through a plain GRPOTrainer and prints, step by
step, TRL's own `sampling/*` metrics (TRL computes them, and applies its importance-sampling
correction, only with `use_vllm`: vLLM cannot run here, so the two switches are turned on after
the trainer is built and the weight sync marked done, the only vLLM call on the rollout_func
path) beside core.mismatch's figures for the same rollouts and TRL's same scoring pass. At
staleness 0 in float32 the generator is the trainer: the mismatch is ≈ 0 (a forward pass over
one unpadded sequence against TRL's padded batch differs by float rounding only).

Staleness shows only where the weights move: the real model, before its warm-up, gets no exact
reward on this task, so every group's rewards agree, GRPO's advantages are 0 and no step changes
a weight (every staleness then samples from the trainer's own weights). `--verifier noisy` flips
each reward with probability `--verifier-noise`: the groups get a spread and the policy moves.

    PYTHONPATH=. .venv/bin/python bench/mismatch.py --steps 8
    PYTHONPATH=. .venv/bin/python bench/mismatch.py --staleness 0 1 4 --bf16 --steps 8
    PYTHONPATH=. .venv/bin/python bench/mismatch.py --model real --steps 6 --verifier noisy \
        --verifier-noise 0.3   # SmolLM2-135M
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollout_lens.server.core import mismatch as mm  # noqa: E402
from rollout_lens.server.core.runconfig import RunConfig  # noqa: E402

TRL = (
    ("|Δ| mean", "sampling/sampling_logp_difference/mean"),
    ("|Δ| max", "sampling/sampling_logp_difference/max"),
    ("IS min", "sampling/importance_sampling_ratio/min"),
    ("IS mean", "sampling/importance_sampling_ratio/mean"),
    ("IS max", "sampling/importance_sampling_ratio/max"),
)
OURS = (
    ("|Δ| mean", mm.ABS_DIFF_MEAN),
    ("|Δ| max", mm.ABS_DIFF_MAX),
    ("k3 KL", mm.K3_KL),
    ("seq min", mm.SEQ_RATIO_MIN),
    ("seq max", mm.SEQ_RATIO_MAX),
    (">2×", mm.OUTSIDE_2X),
    (">5×", mm.OUTSIDE_5X),
)


class StalePolicy:
    """A rollout_func: samples with the policy's weights of `staleness` generations ago (a
    snapshot taken at every generation), in `dtype`, and returns its own logprobs at the
    trainer's temperature."""

    def __init__(self, model: str, staleness: int, dtype: Any, max_new_tokens: int) -> None:
        from transformers import AutoModelForCausalLM

        self.snapshots: deque[dict[str, Any]] = deque(maxlen=staleness + 1)
        self.dtype = dtype
        self.max_new_tokens = max_new_tokens
        # Its own copy from the folder, not a deepcopy of the trainer's model: TRL 1.16 replaces
        # that model's forward (trl/trainer/utils.py add_fused_lm_head) with a closure over the
        # original bound forward, so a deepcopy would run the trainer's current weights.
        self.model = AutoModelForCausalLM.from_pretrained(model).eval()
        self.given: list[list[float]] = []  # the logprobs returned, in row order

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        import torch

        self.snapshots.append(
            {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        )
        self.model.to(torch.float32).load_state_dict(
            self.snapshots[0]
        )  # the oldest kept: `staleness` behind
        self.model.to(self.dtype)
        tok = trainer.processing_class
        out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        with torch.no_grad():
            for prompt in prompts:
                ids = tok.apply_chat_template(
                    prompt, add_generation_prompt=True, tokenize=True, return_dict=False
                )
                completion, logprobs = self._sample(ids, trainer)
                out["prompt_ids"].append(ids)
                out["completion_ids"].append(completion)
                out["logprobs"].append(logprobs)
        self.given = out["logprobs"]
        return out

    def _sample(self, ids: list[int], trainer: Any) -> tuple[list[int], list[float]]:
        import torch

        t = trainer.temperature
        prompt = torch.tensor([ids])
        sampled = self.model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=True,
            temperature=t,
            top_k=0,
            top_p=1.0,
            max_new_tokens=self.max_new_tokens,
            pad_token_id=trainer.processing_class.pad_token_id,
            eos_token_id=trainer.eos_token_ids,
        )[0, len(ids) :].tolist()
        ends = [i for i, token in enumerate(sampled) if token in trainer.eos_token_ids]
        completion = sampled[: ends[0] + 1] if ends else sampled
        whole = torch.tensor([ids + completion])
        logits = self.model(whole).logits[0, len(ids) - 1 : -1].float() / t
        logp = torch.log_softmax(logits, dim=-1)
        return completion, logp.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def _trainer(config: RunConfig, model: str, policy: StalePolicy, out: Path) -> Any:
    from datasets import Dataset
    from rollout_lens.trainer.escalation import task
    from rollout_lens.trainer.escalation.grpo import grpo_args
    from trl import GRPOTrainer

    env = task.make_env(config)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[task.make_reward_function(config)],
        args=grpo_args(config, out),
        train_dataset=Dataset.from_list(task.dataset_rows(env, config)),
        rollout_func=policy,
    )
    trainer.use_vllm = True  # TRL's IS correction and sampling/* metrics are behind it
    trainer.vllm_importance_sampling_correction = True
    trainer._last_loaded_step = 0
    original = trainer._generate_and_score_completions

    def scored(inputs: Any) -> Any:
        trainer._last_loaded_step = trainer.state.global_step  # no vLLM weights to sync
        output = original(inputs)
        sides = [
            mm.Sides(output["old_per_token_logps"][i][: len(g)].double().numpy(), g)
            for i, g in enumerate(policy.given)
        ]
        trainer.mismatch_figures = mm.step_figures(sides)
        return output

    trainer._generate_and_score_completions = scored
    return trainer


def _model(name: str) -> str:
    from rollout_lens.server.core.config import get_settings

    cache = get_settings().models_dir
    if name == "tiny":
        from rollout_lens.trainer.builders.prebuilt import ensure_tiny

        return str(ensure_tiny(cache))
    if name == "real":
        from rollout_lens.trainer.builders import pretrained

        return str(pretrained.ensure(cache))
    return name


def run(args: argparse.Namespace, staleness: int) -> None:
    import torch
    from transformers import TrainerCallback

    model = _model(args.model)
    config = RunConfig(
        model="tiny" if args.model == "tiny" else model,
        steps=args.steps,
        seed=args.seed,
        group_size=args.group_size,
        learning_rate=args.lr,
        verifier=args.verifier,
        verifier_noise=args.verifier_noise,
    )
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    policy = StalePolicy(model, staleness, dtype, config.max_completion_tokens)
    rows: list[str] = []

    class Print(TrainerCallback):  # type: ignore[misc]
        def on_log(self, _args: Any, state: Any, _control: Any, logs: Any = None, **_: Any) -> None:
            if not logs or "loss" not in logs:
                return
            ours = getattr(trainer, "mismatch_figures", {})
            cells = [f"{logs.get(key, float('nan')):9.4g}" for _, key in TRL]
            cells += [f"{ours.get(key, float('nan')):9.4g}" for _, key in OURS]
            rows.append(f"{state.global_step:5d} " + " ".join(cells))
            print(rows[-1], flush=True)

    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(config, model, policy, Path(out))
        trainer.add_callback(Print())
        print(
            f"\nstaleness {staleness}, {'bfloat16' if args.bf16 else 'float32'} generator, "
            f"{args.model} model, {args.verifier} verifier: TRL's sampling/* | core.mismatch's"
        )
        print(" step " + " ".join(f"{h:>9}" for h, _ in (*TRL, *OURS)))
        trainer.train()


def parser() -> argparse.ArgumentParser:
    """The bench's options (the release test parses its own arguments with them)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 4])
    parser.add_argument("--bf16", action="store_true", help="sample in bfloat16")
    parser.add_argument("--model", default="tiny", help="tiny, real (SmolLM2-135M) or a folder")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3, help="high: stale weights drift fast")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--verifier", default="exact", help="the reward: exact, format, noisy (see the docstring)"
    )
    parser.add_argument("--verifier-noise", type=float, default=0.1, help="noisy's flip rate")
    return parser


def main() -> None:
    args = parser().parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    for staleness in args.staleness:
        run(args, staleness)


if __name__ == "__main__":
    main()
