"""Where a step of a launched run goes, stage by stage: timers put around a GRPOTrainer's own
methods on the instance (bench/real_model.py's runs), one JSON line a step.

generation: `_generate_single_turn` (sampling the group, with the recorder's hooks);
scoring: `_calculate_rewards` (the verifier, and the recorder keeping the completions);
loss: `_compute_loss` (the forward pass of the update, with the recorder's probe);
backward: `accelerator.backward`; recording: the recorder callback's `on_step_end` on the
training thread (its writes to the database run on the writer's thread); other: the rest of the
step's wall time (the optimizer step, TRL's bookkeeping). The SFT phase before RL is timed apart.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STAGES = ("generation", "scoring", "loss", "backward", "recording")


class StageTimer:
    """Times a trainer's stages and appends each step's seconds to `out` (JSON lines)."""

    def __init__(self, trainer: Any, out: Path) -> None:
        self.trainer, self.out = trainer, out
        self.spent = dict.fromkeys(STAGES, 0.0)
        self.step_started = time.perf_counter()

    def _timed(self, stage: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.spent[stage] += time.perf_counter() - started

        return timed

    def install(self, recorder: Any) -> None:
        trainer = self.trainer
        for stage, name in (
            ("generation", "_generate_single_turn"),
            ("scoring", "_calculate_rewards"),
            ("loss", "_compute_loss"),
        ):
            setattr(trainer, name, self._timed(stage, getattr(trainer, name)))
        accelerator = trainer.accelerator
        accelerator.backward = self._timed("backward", accelerator.backward)
        on_step_end = recorder.on_step_end

        def recorded(args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return on_step_end(args, state, control, **kwargs)
            finally:
                self.spent["recording"] += time.perf_counter() - started
                self._write(state.global_step)

        recorder.on_step_end = recorded
        for callback in trainer.callback_handler.callbacks:
            if hasattr(callback, "_phase"):  # SFTPhases: a phase before RL, or between phases
                callback._phase = self._sft_timed(callback._phase)

    def _sft_timed(self, phase: Callable[[list[Any]], float]) -> Callable[[list[Any]], float]:
        def timed(examples: list[Any]) -> float:
            started = time.perf_counter()
            loss = phase(examples)
            seconds = time.perf_counter() - started
            with self.out.open("a") as handle:
                handle.write(json.dumps({"sft_seconds": seconds, "sft_loss": loss}) + "\n")
            self.step_started = time.perf_counter()
            return loss

        return timed

    def _write(self, step: int) -> None:
        now = time.perf_counter()
        line = {"step": step, "wall": now - self.step_started} | self.spent
        line["other"] = line["wall"] - sum(self.spent.values())
        with self.out.open("a") as handle:
            handle.write(json.dumps(line) + "\n")
        self.spent = dict.fromkeys(STAGES, 0.0)
        self.step_started = now


def read(path: Path) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """(per-step stage seconds, SFT phases) from a timings file."""
    steps, phases = [], []
    if path.is_file():
        for line in path.read_text().splitlines():
            item = json.loads(line)
            (phases if "sft_seconds" in item else steps).append(item)
    return steps, phases
