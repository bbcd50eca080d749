"""Multi-turn Escalation smoke run: leaky vs patched through TRL's own tool loop, on the CPU.

Trains the multi-turn tiny model (built and cached on first use) with a plain GRPOTrainer on the
multi-step env, one run per variant, and prints per-bucket (default 10 steps) true accuracy,
verifier reward, tool calls per rollout, the share of calls that hit a needed tool, the share of
right first calls, tool errors and malformed calls per rollout, turns, and the share of rollouts
that ended with an answer. Nothing is recorded: this is for choosing a collapse recipe.

    PYTHONPATH=. .venv/bin/python bench/multiturn_smoke.py --steps 60
    PYTHONPATH=. .venv/bin/python bench/multiturn_smoke.py --steps 60 --lr 3e-3 --variants leaky
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollout_lens.server.core.runconfig import RunConfig
from rollout_lens.trainer.builders.prebuilt import ensure_multiturn  # noqa: E402
from rollout_lens.trainer.escalation import multiturn as mt  # noqa: E402

COLUMNS = (
    ("true acc", "multiturn/true_accuracy"),
    ("reward", "reward"),
    ("calls", "multiturn/calls"),
    ("right%", "multiturn/right_call_share"),
    ("1st ok", "multiturn/first_call_right"),
    ("errors", "multiturn/tool_errors"),
    ("malf", "multiturn/malformed_calls"),
    ("turns", "multiturn/turns"),
    ("answer", "multiturn/answered"),
    ("chain", "multiturn/chain_followed"),
    ("len", "completions/mean_length"),
    ("entropy", "entropy"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--variants", nargs="+", default=["leaky", "patched"])
    parser.add_argument("--mode", default="mixed", choices=["single", "chain", "mixed"])
    parser.add_argument("--model", default="tiny", help="`tiny` or a local model folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--kl", type=float, default=0.0)
    parser.add_argument("--max-calls", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--verifier", default="exact", choices=["exact", "format", "noisy"])
    parser.add_argument("--every", type=int, default=10, help="steps per printed bucket")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (2 cores are shared)")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, set_seed

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(args.threads)
    path = args.model
    if path == "tiny":
        cache = os.environ.get("ROLLOUT_LENS_MODEL_CACHE_DIR", ".rollout-lens/models")
        path = str(ensure_multiturn(Path(cache)))
    for variant in args.variants:
        config = RunConfig(
            turns="multi",
            variant=variant,
            k=args.k,
            episodes=args.mode,
            steps=args.steps,
            group_size=args.group_size,
            prompts_per_step=args.prompts_per_step,
            learning_rate=args.lr,
            temperature=args.temperature,
            max_completion_tokens=args.max_tokens,
            max_calls=args.max_calls,
            verifier=args.verifier,
            kl_coef=args.kl,
            seed=args.seed,
        )
        set_seed(args.seed)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path)
        with tempfile.TemporaryDirectory() as out:
            trainer = mt.make_trainer(config, model, tokenizer, Path(out))
            trainer.remove_callback(PrinterCallback)
            started = time.perf_counter()
            trainer.train()
            wall = time.perf_counter() - started
        logs = [h for h in trainer.state.log_history if "loss" in h]
        print(
            f"\n{variant} ({config.mode}, {args.steps} steps, seed {args.seed}, lr {args.lr}, "
            f"verifier {args.verifier}): {wall:.0f}s, {wall / max(1, len(logs)):.2f}s/step"
        )
        print(f"{'steps':>9} " + " ".join(f"{name:>8}" for name, _ in COLUMNS))
        for lo in range(0, len(logs), args.every):
            bucket = logs[lo : lo + args.every]
            cells = []
            for _, key in COLUMNS:
                values = [h[key] for h in bucket if key in h]
                cells.append(f"{sum(values) / len(values):>8.3f}" if values else f"{'-':>8}")
            print(f"{lo + 1:>4}-{lo + len(bucket):<4} " + " ".join(cells))


if __name__ == "__main__":
    main()
