"""A TRL user's GRPO script, run as-is in a virtual environment with one TRL version.

It trains tests/user_script.py's own model on its own rewards for a few steps on the CPU and
writes what it saw to `--out`/result.json; the tests read that file. Arguments:

    --db URL      database the Rollout Lens callback records into
    --model DIR   folder for the user's model (built on first use)
    --out DIR     TRL's output_dir, and where result.json goes
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: user_script.py

import user_script  # noqa: E402


def main() -> int:
    """Train, then write result.json."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--db", required=True, help="SQLAlchemy URL for Rollout Lens")
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    # from rollout_lens import RolloutLensCallback  # CALLBACK: once the callback lands

    model_dir = user_script.build_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    dataset = Dataset.from_list(user_script.conversational(user_script.questions(32)))
    config = GRPOConfig(
        output_dir=str(args.out),
        num_generations=4,
        per_device_train_batch_size=8,
        max_steps=4,
        logging_steps=2,
        num_iterations=2,
        max_completion_length=8,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[user_script.says_the_color, user_script.is_short],
        args=config,
        train_dataset=dataset,
        # callbacks=[RolloutLensCallback(database_url=args.db)],  # CALLBACK: TODO
    )
    output = trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    result = {
        "versions": {p: metadata.version(p) for p in ("trl", "transformers", "torch")},
        "global_step": output.global_step,
        "logged_steps": [entry["step"] for entry in logged],
        "reward_keys": sorted({k for entry in logged for k in entry if k.startswith("rewards/")}),
        "db": args.db,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
