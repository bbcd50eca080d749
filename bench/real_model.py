"""The seed's pair on a real pretrained chat model: SmolLM2-135M-Instruct on the Escalation env.

First zero-shot and greedy on the env's training queries, as the launched run's prompts put
them (the model's chat template), for the patched (4 tools listed) and the leaky (64) variant:
how many replies name the right tool somewhere, how many are in the `<tool>ID</tool>` format,
and which tool the leaky replies name most. Then (with --steps N > 0) a launched run of each
variant on the form's defaults for a pretrained model, trained here for N steps: true accuracy,
verifier reward, vote agreement, format shares, seconds a step and device-minutes, with what the
seed's 500 steps would take at that pace.

    .venv/bin/python bench/real_model.py                      # zero-shot only (a few minutes)
    .venv/bin/python bench/real_model.py --steps 10 --variants patched leaky
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollout_lens.server.core.config import get_settings  # noqa: E402
from rollout_lens.trainer.builders import pretrained  # noqa: E402
from rollout_lens.trainer.envs.onestep import EscalationEnv  # noqa: E402

TAGGED = re.compile(r"<tool>\s*(tool_\d\d)\s*</tool>")
NAMED = re.compile(r"tool_\d\d")
SEED_STEPS = 500  # the seed's runs


def zero_shot(path: Path, variant: str, max_new_tokens: int) -> dict[str, object]:
    """Greedy replies to the training queries of `variant`, as a launched run prompts them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    env = EscalationEnv(seed=0, variant=variant)
    right = tagged = 0
    named: collections.Counter[str] = collections.Counter()
    started = time.perf_counter()
    for query in env.train_queries:
        example = env.example(query)
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": example.prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        with torch.no_grad():
            out = model.generate(
                **inputs,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
            )
        reply = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        right += example.target in reply
        tagged += bool(TAGGED.search(reply))
        named.update(set(NAMED.findall(reply)))
    return {
        "queries": len(env.train_queries),
        "right": right,
        "tagged": tagged,
        "most_named": named.most_common(1)[0] if named else None,
        "seconds": time.perf_counter() - started,
    }


def train(path: Path, variant: str, steps: int, data_dir: Path) -> dict[str, object]:
    """A launched run on the pretrained model's defaults, trained here, read back."""
    from rollout_lens.server import store
    from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope

    from rollout_lens import cli

    os.environ["ROLLOUT_LENS_DATA_DIR"] = str(data_dir)
    os.environ["ROLLOUT_LENS_MODEL_CACHE_DIR"] = str(path.parent)
    argv = ["train", "--model", str(path), "--variant", variant, "--steps", str(steps)]
    started = time.perf_counter()
    code = cli.main([*argv, "--eval-every", "0", "--quiet"])
    wall = time.perf_counter() - started
    if code:
        raise SystemExit(f"training {variant} failed ({code})")
    engine = make_engine(get_settings().database_url)
    with session_scope(make_session_factory(engine)) as session:
        run = max(store.list_runs(session), key=lambda r: r.id)  # the one just trained
        rows = store.steps(session, run_id=run.id)
        series = store.metric_series(session, run_id=run.id)
        config = dict(store.get_run(session, run_id=run.id).config or {})
        minutes = run.device_seconds / 60.0
    engine.dispose()

    def column(name: str) -> list[float]:
        return [getattr(s, name) for s in rows if getattr(s, name) is not None]

    def named(name: str) -> list[float]:
        return [v for _, v in series.get(name, []) if v is not None]

    shares = {
        state: statistics.fmean(named(f"state/{state}")) if named(f"state/{state}") else 0.0
        for state in ("healthy_call", "text_pollution", "collapse", "no_call")
    }
    return {
        "steps": len(rows),
        "wall": wall,
        "step_seconds": statistics.median(column("wall_time")) if column("wall_time") else None,
        "true_accuracy": column("true_accuracy"),
        "reward": column("reward_mean"),
        "agreement": column("vote_agreement"),
        "format_free": named("format_free_accuracy"),
        "states": shares,
        "device_minutes": minutes,
        "lr": config.get("learning_rate"),
        "tokens": config.get("max_completion_tokens"),
    }


def _series(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=0, help="train each variant this long")
    parser.add_argument("--variants", nargs="+", default=["patched", "leaky"])
    parser.add_argument("--max-new-tokens", type=int, default=48, help="zero-shot reply length")
    parser.add_argument("--no-zero-shot", action="store_true")
    parser.add_argument(
        "--data-dir",
        type=Path,
        help="keep the trained runs here (`ROLLOUT_LENS_DATA_DIR=DIR rollout-lens serve` shows them)",
    )
    args = parser.parse_args(argv)
    path = pretrained.ensure(get_settings().models_dir)
    print(f"model: {pretrained.LABEL} at {path}")
    if not args.no_zero_shot:
        for variant in args.variants:
            found = zero_shot(path, variant, args.max_new_tokens)
            print(
                f"zero-shot {variant:<8}: right tool named {found['right']}/{found['queries']},"
                f" <tool>ID</tool> format {found['tagged']}/{found['queries']},"
                f" most named {found['most_named']}, {found['seconds']:.0f} s"
            )
    if args.steps:
        with tempfile.TemporaryDirectory() as tmp:
            for variant in args.variants:
                got = train(path, variant, args.steps, args.data_dir or Path(tmp))
                per_step = got["step_seconds"]
                print(
                    f"\ntrained {variant}: {got['steps']} steps in {got['wall']:.0f} s"
                    f" (lr {got['lr']}, {got['tokens']} completion tokens),"
                    f" median {per_step:.1f} s/step, {got['device_minutes']:.2f} device-minutes"
                )
                print(f"  true accuracy : {_series(got['true_accuracy'])}")  # type: ignore[arg-type]
                print(f"  reward        : {_series(got['reward'])}")  # type: ignore[arg-type]
                print(f"  vote agreement: {_series(got['agreement'])}")  # type: ignore[arg-type]
                print(f"  format-free   : {_series(got['format_free'])}")  # type: ignore[arg-type]
                states = ", ".join(f"{k} {v:.2f}" for k, v in got["states"].items())  # type: ignore[attr-defined]
                print(f"  states (mean share over the steps): {states}")
                if isinstance(per_step, float):
                    print(
                        f"  the seed's {SEED_STEPS} steps at this pace: "
                        f"{per_step * SEED_STEPS / 3600:.1f} h on this CPU"
                    )


if __name__ == "__main__":
    main()
