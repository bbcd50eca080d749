"""What recording costs: the same tiny GRPO run with and without recording, in one process.

Two arms, each against a plain GRPOTrainer measured in the same rounds (alternating order):
- launched: RecordingGRPOTrainer writing through the background StepWriter (runs from the form);
- callback: an unmodified GRPOTrainer with RolloutLensCallback added (a user's own script);
- capture (with --arm all): the launched trainer with its records thrown away, no database: what
  the training thread itself pays (probes, records), apart from the writer thread.
Both write to a temporary SQLite file; the ratio of median step times is printed per arm.

    .venv/bin/python bench/overhead.py --steps 60 --rounds 3 --variant patched [--arm both]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from rollout_lens.server import store  # noqa: E402
from rollout_lens.server.config import get_settings  # noqa: E402
from rollout_lens.server.db import make_engine, make_session_factory, session_scope  # noqa: E402
from rollout_lens.server.domain.runconfig import RunConfig  # noqa: E402
from rollout_lens.server.migrate import upgrade  # noqa: E402
from rollout_lens.trainer.callback import RolloutLensCallback  # noqa: E402
from rollout_lens.trainer.grpo import Recorder  # noqa: E402
from rollout_lens.trainer.run import default_control_tokens, make_trainer, resolve_model  # noqa: E402
from rollout_lens.trainer.writer import StepWriter  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed  # noqa: E402

WARMUP_STEPS = 5  # the first steps pay for lazy initialisation in both arms


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step, generation included."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t = 0.0

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.times.append(time.perf_counter() - self._t)


def one_run(
    config: RunConfig, model_path: str, tmp: Path, factory, arm: str, url: str
) -> list[float]:  # type: ignore[no-untyped-def]
    """Median-ready step times of one run; `arm` is plain, launched or callback."""
    set_seed(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    control_tokens = default_control_tokens(tokenizer)
    writer = recorder = None
    if arm == "capture":  # the launched trainer's capture with the records thrown away
        recorder = Recorder(lambda record: None)
    if arm == "launched":
        with session_scope(factory) as session:
            run_id = store.create_run(session, **config.run_columns()).id
        writer = StepWriter(
            factory, run_id=run_id, control_tokens=control_tokens, price_per_device_hour=0
        )
        recorder = Recorder(writer.put)
    trainer = make_trainer(
        config, model, tokenizer, tmp / "out", recorder=recorder, control_tokens=control_tokens
    )
    if arm == "callback":  # what a user adds to their script, nothing else
        trainer.add_callback(RolloutLensCallback(project="bench", database_url=url))
    timer = StepTimer()
    trainer.add_callback(timer)
    trainer.train()
    if writer is not None:
        writer.close()  # the writes must have landed: their cost counts
    return timer.times[WARMUP_STEPS:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variant", choices=["patched", "leaky"], default="patched")
    parser.add_argument(
        "--arm", choices=["launched", "callback", "capture", "both", "all"], default="both"
    )
    args = parser.parse_args()
    arms = {"both": ["launched", "callback"], "all": ["capture", "launched", "callback"]}.get(
        args.arm, [args.arm]
    )
    # Evaluation is a separate feature with its own cost: off in both arms.
    config = RunConfig(variant=args.variant, steps=args.steps, eval_every=0)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        settings = get_settings(data_dir=tmp)
        engine = make_engine(settings.database_url)
        upgrade(engine)
        factory = make_session_factory(engine)
        model_path = resolve_model(config, settings, print)
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)  # as trainer.run.train does
        times: dict[str, list[float]] = {"plain": [], **{arm: [] for arm in arms}}
        for round_ in range(args.rounds):
            order = ["plain", *arms]
            for arm in order if round_ % 2 == 0 else order[::-1]:
                step_times = one_run(config, model_path, tmp, factory, arm, settings.database_url)
                times[arm].extend(step_times)
                print(
                    f"round {round_ + 1} {arm:<8}: median {statistics.median(step_times) * 1e3:.1f} ms/step"
                )
    plain = times["plain"]
    print(
        f"\n{args.variant}, {args.steps} steps x {args.rounds} rounds per arm ({len(plain)} timed steps each)"
    )
    for arm, arm_times in times.items():
        print(
            f"{arm:<9} median {statistics.median(arm_times) * 1e3:7.1f} ms/step   mean {statistics.fmean(arm_times) * 1e3:7.1f}"
        )
    for arm in arms:
        print(
            f"ratio {arm}/plain: median {statistics.median(times[arm]) / statistics.median(plain):.3f}"
            f"   mean {statistics.fmean(times[arm]) / statistics.fmean(plain):.3f}"
        )


if __name__ == "__main__":
    main()
