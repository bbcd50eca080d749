"""What recording costs: the same tiny GRPO run with and without the recorder, in one process.

Alternates plain GRPOTrainer and RecordingGRPOTrainer (writing to a temporary SQLite file through
the background writer) for a few rounds and prints the ratio of median step times.

    .venv/bin/python bench/overhead.py --steps 60 --rounds 3 --variant patched
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


def one_run(config: RunConfig, model_path: str, tmp: Path, factory, record: bool) -> list[float]:  # type: ignore[no-untyped-def]
    set_seed(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    control_tokens = default_control_tokens(tokenizer)
    writer = recorder = None
    if record:
        with session_scope(factory) as session:
            run_id = store.create_run(session, **config.run_columns()).id
        writer = StepWriter(
            factory, run_id=run_id, control_tokens=control_tokens, price_per_device_hour=0
        )
        recorder = Recorder(writer.put)
    trainer = make_trainer(
        config, model, tokenizer, tmp / "out", recorder=recorder, control_tokens=control_tokens
    )
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
    args = parser.parse_args()
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
        plain: list[float] = []
        recorded: list[float] = []
        for round_ in range(args.rounds):
            for record in (False, True) if round_ % 2 == 0 else (True, False):
                times = one_run(config, model_path, tmp, factory, record)
                (recorded if record else plain).extend(times)
                print(
                    f"round {round_ + 1} {'recorded' if record else 'plain   '}: median {statistics.median(times) * 1e3:.1f} ms/step"
                )
    p50_plain, p50_rec = statistics.median(plain), statistics.median(recorded)
    mean_plain, mean_rec = statistics.fmean(plain), statistics.fmean(recorded)
    print(
        f"\n{args.variant}, {args.steps} steps x {args.rounds} rounds per arm ({len(plain)} timed steps each)"
    )
    print(f"plain     median {p50_plain * 1e3:7.1f} ms/step   mean {mean_plain * 1e3:7.1f}")
    print(f"recorded  median {p50_rec * 1e3:7.1f} ms/step   mean {mean_rec * 1e3:7.1f}")
    print(
        f"ratio recorded/plain: median {p50_rec / p50_plain:.3f}   mean {mean_rec / mean_plain:.3f}"
    )


if __name__ == "__main__":
    main()
