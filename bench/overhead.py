"""What recording costs: the same tiny GRPO run with and without recording, in one process.

Two arms, each against a plain GRPOTrainer measured in the same rounds (alternating order):
- launched: the launched run's recorder (RolloutLensCallback with the task's judge, probes and
  hooks) writing through the worker's StepWriter (runs from the form);
- callback: an unmodified GRPOTrainer with RolloutLensCallback added (a user's own script);
- capture (with --arm all): the launched recorder with its records prepared and thrown away, no
  database: what the training thread itself pays (probes, records), apart from the writer thread.
Both write to a temporary SQLite file; the ratio of median step times is printed per arm.

`--shape ROLLOUTSxTOKENSxVOCAB` (e.g. 64x128x32000, issue 17's write-keeps-up shape) measures a
larger step: groups of 8 up to that many rollouts a step, every completion exactly that many
tokens long (end-of-turn held back until then), and the tiny model with its vocabulary widened
to that size (built in the bench: new pieces the tokenizer decodes, embedding rows drawn around
the old ones), so the logits, the logprobs and the control-token probabilities span it.

    .venv/bin/python bench/overhead.py --steps 60 --rounds 3 --variant patched [--arm both]
    .venv/bin/python bench/overhead.py --shape 64x128x32000 --arm callback --steps 30 --rounds 2
    .venv/bin/python bench/overhead.py --arm callback --reading generate   # generate's probe
    .venv/bin/python bench/overhead.py --real --shape 16x48x0 --arm callback --steps 6 --warmup 2

`--real` runs it on the real pretrained chat model (SmolLM2-135M-Instruct, `rollout-lens
build-model --real`) with a pretrained model's defaults; a shape's vocabulary of 0 keeps the
model's own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from rollout_lens.server import store  # noqa: E402
from rollout_lens.server.core.config import get_settings  # noqa: E402
from rollout_lens.server.core.runconfig import RunConfig  # noqa: E402
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope  # noqa: E402
from rollout_lens.server.store.migrate import upgrade  # noqa: E402
from rollout_lens.trainer.recorder.callback import RolloutLensCallback  # noqa: E402
from rollout_lens.trainer.recorder.writer import StepWriter  # noqa: E402
from rollout_lens.trainer.worker.run import (  # noqa: E402
    default_control_tokens,
    make_trainer,
    recorder,
    resolve_model,
)
from sqlalchemy import text  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed  # noqa: E402

WARMUP_STEPS = 5  # the first steps pay for lazy initialisation in both arms
GROUP_SIZE = 8  # rollouts a prompt at --shape
TARGET = 1.05  # a recorded step's time over the plain TRL step's (issue 17)


@dataclass(frozen=True)
class Shape:
    """A step of `rollouts` completions of exactly `tokens` tokens over a `vocab`-token model."""

    rollouts: int
    tokens: int
    vocab: int


def parse_shape(text: str) -> Shape:
    rollouts, tokens, vocab = (int(part) for part in text.lower().split("x"))
    if vocab < 0:
        raise argparse.ArgumentTypeError("the vocabulary is a token count (0: the model's own)")
    if rollouts % GROUP_SIZE or not 0 < rollouts <= GROUP_SIZE * 64:
        raise argparse.ArgumentTypeError(f"rollouts must be a multiple of {GROUP_SIZE} up to 512")
    return Shape(rollouts, tokens, vocab)


def widened_model(model_path: str, vocab: int, out: Path, seed: int) -> str:
    """The model at `model_path` with its vocabulary widened to `vocab` tokens, saved in `out`:
    pieces " w<id>" the tokenizer decodes (so a recorder stores each sampled token's text), and
    embedding rows drawn around the old ones (transformers' mean resizing, seeded)."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    tokenizer.save_pretrained(out)
    data = json.loads((Path(model_path) / "tokenizer.json").read_text())
    pieces = data["model"]["vocab"]
    # Turn markers are added tokens past the pieces: give them their ids among the pieces, or
    # the tokenizer would move them past the new ones.
    for added in data["added_tokens"]:
        pieces.setdefault(added["content"], added["id"])
    for token_id in range(len(pieces), vocab):
        pieces[f" w{token_id}"] = token_id
    (out / "tokenizer.json").write_text(json.dumps(data))
    set_seed(seed)
    model.resize_token_embeddings(vocab, mean_resizing=True)
    model.save_pretrained(out)
    return str(out)


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step, generation included."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t = 0.0

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.times.append(time.perf_counter() - self._t)


def recorded_shape(engine) -> str:  # type: ignore[no-untyped-def]
    """What the recorded arms wrote, to show the shape held: rollouts a step, tokens each."""
    with engine.connect() as conn:
        steps, tokens = conn.execute(
            text("SELECT count(*), avg(completion_length) FROM steps")
        ).one()
        rollouts = conn.scalar(text("SELECT count(*) FROM rollouts"))
    if not steps or not rollouts:
        return "recorded: no rollouts (no recording arm ran)"
    return f"recorded: {rollouts / steps:.0f} rollouts a step, {tokens:.1f} tokens each on average"


class Discard:
    """A sink that prepares each step as a launched run's writer does, then drops it."""

    prepare = staticmethod(lambda raw: raw)

    def put(self, raw: object) -> None:
        self.prepare(raw)

    def close(self, **_: object) -> bool:
        return True


def one_run(
    config: RunConfig,
    model_path: str,
    tmp: Path,
    factory,
    arm: str,
    url: str,
    reading: str = "forward",
    warmup: int = WARMUP_STEPS,
) -> list[float]:  # type: ignore[no-untyped-def]
    """Median-ready step times of one run; `arm` is plain, launched or callback; completions
    are held to exactly max_completion_tokens when it is over the default (--shape)."""
    set_seed(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    control_tokens = default_control_tokens(tokenizer)
    writer = callback = None
    if arm in ("capture", "launched"):  # the launched run's recorder
        callback = recorder(config, settings=get_settings(), control_tokens=control_tokens)
    if callback is not None:
        callback.reading = reading
    if arm == "capture":  # ... with its records prepared on the training thread, then dropped
        callback.sink = Discard()  # type: ignore[assignment]
    if arm == "launched":
        with session_scope(factory) as session:
            run_id = store.create_run(session, **config.run_columns()).id
        writer = StepWriter.for_launched(
            factory, run_id=run_id, control_tokens=control_tokens, price_per_device_hour=0
        )
        callback.sink = writer  # type: ignore[union-attr]
    trainer = make_trainer(config, model, tokenizer, tmp / "out", callback=callback)
    if config.max_completion_tokens > RunConfig(model=config.model).max_completion_tokens:
        trainer.generation_config.min_new_tokens = config.max_completion_tokens
    if arm == "callback":  # what a user adds to their script, nothing else
        trainer.add_callback(
            RolloutLensCallback(project="bench", database_url=url, reading=reading)
        )
    timer = StepTimer()
    trainer.add_callback(timer)
    trainer.train()
    if writer is not None:
        writer.close()  # the writes must have landed: their cost counts
    return timer.times[warmup:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variant", choices=["patched", "leaky"], default="patched")
    parser.add_argument(
        "--arm", choices=["launched", "callback", "capture", "both", "all"], default="both"
    )
    parser.add_argument(
        "--reading",
        choices=["forward", "generate"],
        default="forward",
        help="where the recorder reads logprobs and control-token probabilities",
    )
    parser.add_argument(
        "--shape", type=parse_shape, help="ROLLOUTSxTOKENSxVOCAB, e.g. 64x128x32000 (issue 17)"
    )
    parser.add_argument(
        "--real",
        action="store_true",
        help="the real pretrained chat model (SmolLM2-135M-Instruct) instead of the tiny one",
    )
    parser.add_argument(
        "--warmup", type=int, default=WARMUP_STEPS, help="untimed first steps of each run"
    )
    args = parser.parse_args(argv)
    arms = {"both": ["launched", "callback"], "all": ["capture", "launched", "callback"]}.get(
        args.arm, [args.arm]
    )
    # Evaluation is a separate feature with its own cost: off in both arms.
    model = "tiny"
    if args.real:
        from rollout_lens.trainer.builders import pretrained

        model = str(pretrained.ensure(get_settings().models_dir))
    config = RunConfig(model=model, variant=args.variant, steps=args.steps, eval_every=0)
    if args.shape:
        config = config.model_copy(
            update={
                "group_size": GROUP_SIZE,
                "prompts_per_step": args.shape.rollouts // GROUP_SIZE,
                "max_completion_tokens": args.shape.tokens,
            }
        )
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        settings = get_settings(data_dir=tmp)
        engine = make_engine(settings.database_url)
        upgrade(engine)
        factory = make_session_factory(engine)
        model_path = resolve_model(config, settings, print)
        if args.shape and args.shape.vocab:
            wide = tmp / f"vocab-{args.shape.vocab}"
            wide.mkdir()
            model_path = widened_model(model_path, args.shape.vocab, wide, config.seed)
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)  # as trainer.worker.run.train does
        times: dict[str, list[float]] = {"plain": [], **{arm: [] for arm in arms}}
        for round_ in range(args.rounds):
            order = ["plain", *arms]
            for arm in order if round_ % 2 == 0 else order[::-1]:
                step_times = one_run(
                    config,
                    model_path,
                    tmp,
                    factory,
                    arm,
                    settings.database_url,
                    args.reading,
                    args.warmup,
                )
                times[arm].extend(step_times)
                print(
                    f"round {round_ + 1} {arm:<8}: median {statistics.median(step_times) * 1e3:.1f} ms/step"
                )
        if args.shape:
            print(recorded_shape(engine))
        engine.dispose()
    plain = times["plain"]
    shape = (
        f", {args.shape.rollouts} rollouts x {args.shape.tokens} tokens a step"
        + (f", a {args.shape.vocab:,}-token vocabulary" if args.shape.vocab else "")
        if args.shape
        else ""
    )
    shape += f", model {Path(model).name}"
    print(
        f"\n{args.variant}{shape}, reading {args.reading}, {args.steps} steps x {args.rounds}"
        " rounds per arm"
        f" ({len(plain)} timed steps each)"
    )
    for arm, arm_times in times.items():
        print(
            f"{arm:<9} median {statistics.median(arm_times) * 1e3:7.1f} ms/step   mean {statistics.fmean(arm_times) * 1e3:7.1f}"
        )
    for arm in arms:
        median = statistics.median(times[arm]) / statistics.median(plain)
        print(
            f"ratio {arm}/plain: median {median:.3f}"
            f"   mean {statistics.fmean(times[arm]) / statistics.fmean(plain):.3f}"
            f"   (target ≤ {TARGET:.2f}: {'met' if median <= TARGET else 'not met'})"
        )


if __name__ == "__main__":
    main()
