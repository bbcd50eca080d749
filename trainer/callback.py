"""RolloutLensCallback: one line in any TRL GRPO script records the run, rollout by rollout.

    from rollout_lens import RolloutLensCallback
    trainer = GRPOTrainer(..., callbacks=[RolloutLensCallback(project="my-project")])

Every optimizer step becomes a recorded step with the rollouts it trained on (each exactly once,
with its group and index), TRL's logged loss/KL/… on the steps where TRL logs, and every other
number TRL logs as a `trl/…` series. Recording never stops training: see trainer/outbox.py.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from rollout_lens.server import series as vocab
from rollout_lens.server.config import Settings, get_settings
from rollout_lens.server.models import RunStatus
from rollout_lens.server.records import RolloutRecord, StepRecord
from rollout_lens.trainer import positional, turns
from rollout_lens.trainer.capture import Generation, RolloutCapture
from rollout_lens.trainer.outbox import Outbox, RunSpec
from rollout_lens.trainer.task import message_text
from transformers import TrainerCallback

log = logging.getLogger("rollout_lens")

# Completion → value functions a user may pass for what TRL does not know. Each is called as
# fn(completion_text, row) where row holds the dataset columns of the prompt (not the prompt).
TextFn = Callable[[str, dict[str, Any]], Any]

# Tokens watched by default when they are single tokens of the tokenizer: tool-call tags of the
# common chat templates, then the end-of-turn tokens.
DEFAULT_CONTROL_TOKENS = ("<tool_call>", "</tool_call>", "<tool>", "</tool>")
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")
# Open/close tags of a tool call, tried in order: each model turn's structure is read with them.
CALL_TAGS = (("<tool_call>", "</tool_call>"), ("<tool>", "</tool>"))


class StepBox(Protocol):
    """Where a raw step goes (an Outbox; the worker's StepWriter for a launched run)."""

    def put(self, raw: Any) -> None: ...

    def close(self, *, status: RunStatus, error: str | None) -> Any: ...


class RolloutLensCallback(TrainerCallback):
    """Records an unmodified `trl.GRPOTrainer` run into Rollout Lens."""

    def __init__(
        self,
        project: str = "default",
        *,
        name: str | None = None,
        database_url: str | None = None,
        vote: TextFn | None = None,
        true_score: TextFn | None = None,
        format_valid: TextFn | None = None,
        format_free_score: TextFn | None = None,
        target: Callable[[dict[str, Any]], str | None] | None = None,
        control_tokens: Sequence[str] | None = None,
        buffer_mb: float = 256,
        keep_tokens_every: int | None = None,
        settings: Settings | None = None,
    ) -> None:
        """`database_url` and the other settings default to the ROLLOUT_LENS_* environment;
        `vote`, `true_score` and `format_valid` judge a completion, and `format_free_score`
        scores it leniently, whatever its structure (recorded as format-free accuracy beside
        true accuracy: the gap is a skill hidden by a broken format); `target` names the right
        answer of a row; `control_tokens` default to the tokenizer's tool-call tags and
        end-of-turn tokens; `buffer_mb` bounds the memory kept while the database is away;
        `keep_tokens_every` keeps token-level data only every N steps (and at the first and last
        step and at alerts) for very long runs."""
        if keep_tokens_every is not None and keep_tokens_every < 1:
            raise ValueError(f"keep_tokens_every must be 1 or more, not {keep_tokens_every}")
        self.keep_tokens_every = keep_tokens_every
        self.project = project
        self.name = name
        self.settings = settings or get_settings()
        self.database_url = database_url or self.settings.database_url
        self.judges = {
            "vote": vote,
            "true_score": true_score,
            "format_valid": format_valid,
            "format_free": format_free_score,
        }
        self.target = target
        self.requested_control_tokens = list(control_tokens) if control_tokens else None
        self.buffer_bytes = int(buffer_mb * 2**20)
        self.trainer: Any = None
        self.outbox: StepBox | None = None
        self._call_tags: tuple[str, str] | None = None
        self._end_tokens: list[str] = []
        self.control_tokens: list[str] = []
        self._generations: list[Generation] = []
        self._last_rollout_step = 0
        self._pending: dict[str, Any] | None = None  # the step waiting for its logs
        self._step_started = 0.0
        self._prompt_text: dict[str, str] = {}
        self._failed_judges: set[str] = set()
        # (rollout step, values, series) of the last generation: a step that reuses it
        # (num_iterations > 1) shows the same rollout-derived values, as launched runs do.
        self._last_summary: tuple[int, dict[str, float | None], dict[str, float | None]] | None = (
            None
        )
        self._installed = False

    # -- attaching -----------------------------------------------------------------------------

    def attach(self, trainer: Any) -> None:
        """Wrap `trainer`'s generation and scoring (done by itself at the start of training)."""
        if self._installed:
            return
        self.trainer = trainer
        tokenizer = _tokenizer(trainer)
        self.control_tokens, control_ids = self._control_tokens(tokenizer)
        vocab_ = tokenizer.get_vocab()
        self._call_tags = next((tags for tags in CALL_TAGS if all(t in vocab_ for t in tags)), None)
        self._end_tokens = [
            t for t in dict.fromkeys([tokenizer.eos_token, *END_OF_TURN_TOKENS]) if t in vocab_
        ]
        capture = RolloutCapture(
            trainer, control_token_ids=control_ids, on_generation=self._generations.append
        )
        if not capture.probing:
            self.control_tokens = []
        capture.install()
        self.capture = capture
        self._installed = True

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if not self._installed:
            self.attach(_find_trainer())
        if state.is_world_process_zero:
            self.outbox = Outbox(
                database_url=self.database_url,
                spec=self._run_spec(args, state),
                prepare=self._prepare,
                max_bytes=self.buffer_bytes,
                heartbeat_seconds=self.settings.heartbeat_seconds,
                price_per_device_hour=self.settings.price_per_device_hour,
                busy_timeout_ms=self.settings.sqlite_busy_timeout_ms,
            )
            atexit.register(self._at_exit)

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._step_started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self.outbox is None:
            return
        self._send_pending()
        step = state.global_step
        rollouts: list[dict[str, Any]] = []
        while self._generations and self._generations[0].rollout_step <= step:
            generation = self._generations.pop(0)
            rollouts.extend(generation.rollouts)
            self._last_rollout_step = step
        self._pending = {
            "step": step,
            # a reused generation (num_iterations > 1) points at the step that recorded it
            "rollout_step": step if rollouts else (self._last_rollout_step or step),
            "rollouts": rollouts,
            "wall_time": time.perf_counter() - self._step_started,
            "logs": {},
        }

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        # Trainer logs a step right after its on_step_end: the logs join that step.
        if self._pending is not None and logs and self._pending["step"] == state.global_step:
            self._pending["logs"].update(logs)
            if "loss" in logs:
                self._send_pending()

    def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._close(RunStatus.completed, None)

    def _at_exit(self) -> None:
        """The script ended without on_train_end (an exception): keep what was recorded."""
        self._close(RunStatus.failed, "the training script stopped before the end of training")

    def _close(self, status: RunStatus, error: str | None) -> None:
        if self.outbox is None:
            return
        self._send_pending()
        outbox, self.outbox = self.outbox, None
        outbox.close(status=status, error=error)
        atexit.unregister(self._at_exit)

    def _send_pending(self) -> None:
        if self._pending is not None and self.outbox is not None:
            self.outbox.put(self._pending)
        self._pending = None

    # -- the run -------------------------------------------------------------------------------

    def _control_tokens(self, tokenizer: Any) -> tuple[list[str], list[int]]:
        vocab = tokenizer.get_vocab()
        if self.requested_control_tokens is not None:
            missing = [t for t in self.requested_control_tokens if t not in vocab]
            if missing:
                raise ValueError(f"control tokens not in the tokenizer's vocabulary: {missing}")
            tokens = self.requested_control_tokens
        else:
            candidates = [*DEFAULT_CONTROL_TOKENS, tokenizer.eos_token, *END_OF_TURN_TOKENS]
            tokens = list(dict.fromkeys(t for t in candidates if t and t in vocab))
        return list(tokens), [vocab[t] for t in tokens]

    def _run_spec(self, args: Any, state: Any) -> RunSpec:
        trainer = self.trainer
        config = json.loads(args.to_json_string())
        config["project"] = self.project
        config["reward_funcs"] = list(getattr(trainer, "reward_func_names", []) or [])
        config["judged"] = {name: fn is not None for name, fn in self.judges.items()}
        if self.capture.tool_calling:
            config["judged"]["vote"] = True  # the first tool each rollout called
        label = self.name or args.run_name or Path(args.output_dir or "run").name
        world = trainer.accelerator.num_processes
        group = int(getattr(trainer, "num_generations", None) or args.num_generations)
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
        model = getattr(trainer.model, "name_or_path", None) or getattr(
            trainer.model.config, "_name_or_path", "model"
        )
        notes = list(self.capture.notes)
        if self.capture.tool_calling:
            notes.append(
                "tool-calling rollouts: recorded turn by turn (model turns with their logprobs "
                "and control-token probabilities, tool results apart and not trained); votes "
                "are the first tool each rollout called"
                + ("" if self.judges["vote"] is None else " unless the vote function says")
            )
        if not self.judges["true_score"]:
            notes.append("no true_score function given: true accuracy is not recorded")
        return RunSpec(
            name=f"{self.project}/{label}" if self.project else label,
            model=str(model),
            total_steps=int(state.max_steps or 0),
            group_size=group,
            prompts_per_step=max(1, per_step // group),
            seed=int(args.seed),
            config=config,
            control_tokens=self.control_tokens,
            device=str(trainer.accelerator.device),
            notes=notes,
            keep_tokens_every=self.keep_tokens_every,
        )

    # -- the writer thread: raw step → StepRecord ----------------------------------------------

    def _prepare(self, raw: dict[str, Any]) -> StepRecord:
        from rollout_lens.trainer.grpo import split_logs, summarize

        trainer = self.trainer
        group_size = int(trainer.num_generations)
        tokenizer = _tokenizer(trainer)
        eos = set(getattr(trainer, "eos_token_ids", None) or [tokenizer.eos_token_id])
        names = list(getattr(trainer, "reward_func_names", []) or [])
        rollouts = []
        for i, r in enumerate(raw["rollouts"]):
            ids = r["ids"]
            mask = r.get("tool_mask")
            # tool-calling: the whole conversation as the model saw it, tool results included
            text = message_text(r["completion"]) if mask is None else tokenizer.decode(ids)
            row = r["row"]
            judged = self._judged(text, row, r["completion"])
            control = r["control"] or [[] for _ in self.control_tokens]
            meta: dict[str, Any] = {
                "rewards": dict(zip(names, r["rewards"], strict=False)),
                "truncated": not ids or ids[-1] not in eos,
            }
            if row:
                meta["row"] = row
            tokens = tokenizer.convert_ids_to_tokens(ids)
            format_state = None
            if _number(judged.get("format_free")) is not None:
                meta[vocab.FORMAT_FREE_KEY] = _number(judged["format_free"])
            if mask is not None:
                meta["turns"] = turns.read_turns(mask, r["completion"])
                meta["answer"] = turns.final_answer(r["completion"])
                if self._call_tags is not None:
                    meta["turn_states"] = turns.turn_states(
                        meta["turns"],
                        functools.partial(_decode_span, tokenizer, ids),
                        self._call_tags,
                        self._end_tokens,
                    )
                    format_state = turns.rollout_state(meta["turn_states"])
                    eot = next((t for t in self._end_tokens if t in self.control_tokens), None)
                    if eot is not None and all(t in self.control_tokens for t in self._call_tags):
                        meta["probes"] = positional.turn_probes(
                            tokens,
                            dict(zip(self.control_tokens, control, strict=False)),
                            meta["turns"],
                            open_tag=self._call_tags[0],
                            close_tag=self._call_tags[1],
                            eot=eot,
                        )
                if self.judges["vote"] is None:  # the group's votes: the first tools called
                    judged["vote"] = turns.first_call(meta["turns"])
            rollouts.append(
                RolloutRecord(
                    group=i // group_size,
                    index=i % group_size,
                    prompt=self._render_prompt(r["prompt"], r.get("prompt_ids")),
                    completion=text,
                    completion_ids=ids,
                    token_logprobs=r["logprobs"],
                    control_probs=dict(zip(self.control_tokens, control, strict=False)),
                    vote=None if judged["vote"] is None else str(judged["vote"]),
                    target=self._target(row),
                    verifier_reward=r["reward"],
                    true_score=_number(judged["true_score"]),
                    advantage=r["advantage"],
                    format_valid=bool(judged["format_valid"])
                    if self.judges["format_valid"]
                    else True,
                    format_state=format_state,
                    meta=meta,
                    tokens=tokens,
                )
            )
        values: dict[str, float | None] = {}
        series: dict[str, float | None] = {}
        if rollouts:
            values, series = summarize(rollouts, group_size, self.control_tokens)
            # what no function judged is unknown, not zero
            if not self.judges["format_valid"]:
                values["format_valid_rate"] = None
            if not self.judges["vote"] and not self.capture.tool_calling:
                values["vote_agreement"] = values["vote_entropy"] = None
            self._last_summary = (raw["rollout_step"], values, series)
        elif self._last_summary is not None and self._last_summary[0] == raw["rollout_step"]:
            values, series = dict(self._last_summary[1]), dict(self._last_summary[2])
        values["wall_time"] = raw["wall_time"]
        columns, logged = split_logs(raw["logs"])
        values.update(columns)
        series.update(logged)
        return StepRecord(
            step=raw["step"],
            rollout_step=raw["rollout_step"],
            values=values,
            rollouts=rollouts,
            metrics=series,
        )

    def _judged(self, text: str, row: dict[str, Any], completion: Any) -> dict[str, Any]:
        """What the judge functions say of one completion (`text`: as recorded; `completion`:
        as TRL handed it to the reward functions, the messages of a conversation)."""
        return {key: self._judge(key, fn, text, row) for key, fn in self.judges.items()}

    def _judge(self, key: str, fn: TextFn | None, text: str, row: dict[str, Any]) -> Any:
        if fn is None:
            return None
        try:
            return fn(text, row)
        except Exception as exc:  # noqa: BLE001 - a user's function must not stop recording
            if key not in self._failed_judges:
                self._failed_judges.add(key)
                log.warning(
                    "Rollout Lens: the %s function raised (recorded as empty): %s", key, exc
                )
            return None

    def _target(self, row: dict[str, Any]) -> str | None:
        if self.target is not None:
            try:
                found = self.target(row)
            except Exception:  # noqa: BLE001
                return None
            return None if found is None else str(found)
        value = row.get("target")
        return None if value is None else str(value)

    def _render_prompt(self, prompt: Any, ids: list[int] | None = None) -> str:
        """The prompt as the model saw it (chat template applied), rendered once per text; with
        tools, its ids decoded (TRL rendered each prompt with its own tools)."""
        if ids is not None:
            key = repr(ids)
            if key not in self._prompt_text:
                self._prompt_text[key] = _tokenizer(self.trainer).decode(ids)
            return self._prompt_text[key]
        if isinstance(prompt, str):
            return prompt
        key = repr(prompt)
        if key not in self._prompt_text:
            kwargs = getattr(self.trainer, "chat_template_kwargs", None) or {}
            self._prompt_text[key] = _tokenizer(self.trainer).apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=True, **kwargs
            )
        return self._prompt_text[key]


def _decode_span(tokenizer: Any, ids: list[int], start: int, end: int) -> str:
    """The text of completion positions [start, end), special tokens kept."""
    return str(tokenizer.decode(ids[start:end]))


def _tokenizer(trainer: Any) -> Any:
    processing = trainer.processing_class
    return getattr(processing, "tokenizer", None) or processing


def _number(value: Any) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _find_trainer() -> Any:
    """The Trainer whose training loop is calling us (callbacks are not handed the trainer)."""
    from transformers import Trainer

    frame = inspect.currentframe()
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    raise RuntimeError(
        "RolloutLensCallback could not find its trainer: pass it to GRPOTrainer(callbacks=[...]) "
        "or call callback.attach(trainer) before train()"
    )
