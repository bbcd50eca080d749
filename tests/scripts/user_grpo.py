"""A GRPO script written as a TRL user writes one, plus the one Rollout Lens line.

    python user_grpo.py --model DIR --out DIR [--db URL] [--steps N] [--grad-accum N] ...

With --save-every N and --kill-at K it checkpoints every N steps and dies (SIGKILL) at the end
of step K; run again with --resume it continues from its last checkpoint.

The model folder is built on first use (tests/user_script.py) with the TRL/transformers at hand.

It is run as its own process (plain, or under `accelerate launch`) from a folder that may hold a
`trainer.py` or `server.py` of the user's own. It writes what its reward functions saw, in call
order, to OUT/seen-RANK.jsonl, the oracle the tests compare the recorded run against.
"""

import argparse
import gc
import json
import os
from pathlib import Path

import torch
import user_script as us  # the user's own model and rewards, copied beside this script
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from rollout_lens import RolloutLensCallback

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--db", default="", help="empty: ROLLOUT_LENS_* from the environment")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--grad-accum", type=int, default=1)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--generations", type=int, default=4)
parser.add_argument("--iterations", type=int, default=1)
parser.add_argument("--logging-steps", type=int, default=1)
parser.add_argument("--crash-at", type=int, default=0, help="raise at the end of this step")
parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step sleeps")
parser.add_argument("--save-every", type=int, default=0, help="a checkpoint every N steps")
parser.add_argument("--kill-at", type=int, default=0, help="SIGKILL itself at this step's end")
parser.add_argument("--resume", action="store_true", help="from the last checkpoint in --out")
parser.add_argument("--restore-callbacks", action="store_true")
args = parser.parse_args()

out = Path(args.out)
rank = int(os.environ.get("RANK", "0"))
seen = (out / f"seen-{rank}.jsonl").open("a" if args.resume else "w")


def says_the_color(completions, answer, prompts, **kwargs):
    rewards = us.says_the_color(completions, answer)
    for p, c, r in zip(prompts, completions, rewards, strict=True):
        seen.write(json.dumps({"prompt": p, "completion": c, "reward": r}) + "\n")
    seen.flush()
    return rewards


config = GRPOConfig(
    output_dir=str(out),
    num_generations=args.generations,
    per_device_train_batch_size=args.batch,
    gradient_accumulation_steps=args.grad_accum,
    num_iterations=args.iterations,
    max_steps=args.steps,
    logging_steps=args.logging_steps,
    max_completion_length=8,
    report_to="none",
    use_cpu=True,
    save_strategy="steps" if args.save_every else "no",
    save_steps=args.save_every or 500,
    restore_callback_states_from_checkpoint=args.restore_callbacks,
    disable_tqdm=True,
)


crash_at = args.crash_at
step_sleep = args.step_sleep
kill_at = args.kill_at
recorder = RolloutLensCallback(project="user", database_url=args.db or None)


class CrashAt(TrainerCallback):
    """The user's own bug, or their node dying, some steps in."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == crash_at:
            raise RuntimeError(f"the user's script broke at step {state.global_step}")
        if state.global_step == kill_at:
            # the node dies: every step before this one recorded, this one not, no exit handler
            if recorder.sink is not None:
                recorder.sink.flush()
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        if step_sleep:
            import time

            time.sleep(step_sleep)


trainer = GRPOTrainer(
    model=str(us.build_model(Path(args.model))),
    reward_funcs=[says_the_color, us.is_short],
    args=config,
    train_dataset=Dataset.from_list(us.questions(64)),
    callbacks=[recorder, CrashAt()],
)
trainer.train(resume_from_checkpoint=True if args.resume else None)
# As a distributed script should: let go of the trainer (its DDP model holds the process group)
# and end the process group before the interpreter exits. Left to the exit, gloo's threads are
# torn down under a rank that then aborts in C++ after its last line ("terminate called without
# an active exception", SIGABRT, no Python frame), after every step was recorded: 6 of 40 runs
# of test_accelerate_two_processes_recorded_once_by_the_main_one with destroy_process_group
# alone (1 of 28 on the code before 6 Dec 2026's changes), 0 of 64 with the trainer let go first.
trainer = recorder = None  # type: ignore[assignment]
gc.collect()
if torch.distributed.is_available() and torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
