"""RolloutLensCallback: one line in any TRL GRPO script records the run, rollout by rollout.

    from rollout_lens import RolloutLensCallback
    trainer = GRPOTrainer(..., callbacks=[RolloutLensCallback(project="my-project")])

Every optimizer step becomes a recorded step with the rollouts it trained on (each exactly once,
with its group and index), TRL's logged loss/KL/… on the steps where TRL logs, and every other
number TRL logs as a `trl/…` series. Recording never stops a user's training: see
trainer/recorder/writer.py (BufferAndDrop).

This is the one recording path: runs launched from the dashboard are recorded by the same
callback, with the worker's writer as its `sink` (WaitThenFail), the task's `judge`, its
`watch_tokens` (the id-position probe) and its GenerationHooks (in-group supervision).

A script resumed from a checkpoint (`trainer.train(resume_from_checkpoint=...)`) continues the
run it started: the run's key is kept in each checkpoint's trainer_state.json (see
`_resume`), and the steps after the checkpoint replace the dead process's (server.store.resume).
"""

from __future__ import annotations

import atexit
import inspect
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rollout_lens.server.core.config import Settings, get_settings
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.store.models import RunStatus
from rollout_lens.trainer.recorder import tags
from rollout_lens.trainer.recorder.capture import (
    READINGS,
    Generation,
    GenerationHooks,
    RolloutCapture,
)
from rollout_lens.trainer.recorder.captured import Captured
from rollout_lens.trainer.recorder.judging import (
    FunctionJudge,
    Judge,
    TextFn,
)
from rollout_lens.trainer.recorder.judging import message_text as message_text
from rollout_lens.trainer.recorder.preparing import StepPreparer, tokenizer_of
from rollout_lens.trainer.recorder.sinks import reads_steps
from rollout_lens.trainer.recorder.writer import RunSpec, StepWriter
from transformers import TrainerCallback

log = logging.getLogger("rollout_lens")

# End-of-turn tokens watched by default (beside the tokenizer's EOS) where the tokenizer has them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")

# The recorder's own facts, kept in the stored config beside (not inside) the GRPOConfig's keys.
CONFIG_KEY = "rollout_lens"
# The run's key in a checkpoint: TrainerState.stateful_callbacks[STATE_KEY], in ExportableState's
# shape. Not under this class's name: with restore_callback_states_from_checkpoint, transformers
# rebuilds a callback saved under its class name from its saved args, and this one's judges and
# token cannot be saved (transformers says it ignores an entry no callback is named after).
STATE_KEY = "rollout_lens"


def _resume(state: Any) -> tuple[str, int | None]:
    """The run's key, and the checkpoint's step when training resumed from one this
    callback recorded (None: a new run). TrainerState is read from the checkpoint whether or
    not restore_callback_states_from_checkpoint is set; the key goes into the state, and so
    into every checkpoint saved from now on."""
    saved = (state.stateful_callbacks or {}).get(STATE_KEY)
    attributes = saved.get("attributes") if isinstance(saved, dict) else None
    key = attributes.get("run_key") if isinstance(attributes, dict) else None
    resuming = isinstance(key, str) and bool(key) and state.global_step > 0
    if not resuming:
        key = uuid.uuid4().hex
    state.stateful_callbacks[STATE_KEY] = {"args": {}, "attributes": {"run_key": key}}
    return str(key), int(state.global_step) if resuming else None


def _choose_control_tokens(
    tokenizer: Any,
    requested: list[str] | None,
    formats: list[tags.CallTags],
    end_tokens: list[str],
) -> tuple[list[str], list[int]]:
    """The control tokens (`requested`, else the call tags' and the end-of-turn tokens the
    tokenizer has) and their ids."""
    vocab_ = tokenizer.get_vocab()
    if requested is not None:
        missing = [t for t in requested if t not in vocab_]
        if missing:
            raise ValueError(f"control tokens not in the tokenizer's vocabulary: {missing}")
        tokens = requested
    else:
        # the tags that are single tokens; if none is, the first format's first tokens
        singles = [t for f in formats if f.single_tokens for t in f.pair]
        firsts = [(f.open_token, f.close_token) for f in formats if f.spelled][:1]
        candidates = [*(singles or [t for pair in firsts for t in pair]), *end_tokens]
        tokens = list(dict.fromkeys(t for t in candidates if t and t in vocab_))
    return list(tokens), [vocab_[t] for t in tokens]


def _spec_notes(
    found: list[str],
    tool_calling: bool,
    vote_given: bool,
    judged: dict[str, bool],
    formats: list[tags.CallTags],
) -> list[str]:
    """What the run page says of how the run was recorded: the capture's notes (`found`),
    tool-calling, and what no function judged."""
    notes = list(found)
    if tool_calling:
        notes.append(
            "tool-calling rollouts: recorded turn by turn (model turns with their logprobs "
            "and control-token probabilities, tool results apart and not trained); votes "
            "are each rollout's final answer, with its first call beside"
            + ("" if not vote_given else " unless the vote function says")
        )
    if not judged["true_score"]:
        notes.append("no true_score function given: true accuracy is not recorded")
    if not judged["format_valid"]:
        notes.append(
            "no format_valid function given: format validity is not recorded (unknown, not "
            "valid); the structural state is read from the call tags "
            + " or ".join(f"{f.open}…{f.close}" for f in formats)
            if formats
            else "no format_valid function given: format validity is not recorded"
        )
    return notes


def _check_arguments(
    keep_tokens_every: int | None,
    reading: str,
    call_tags: tuple[str, str] | None,
    judge: Judge | None,
    functions: FunctionJudge,
) -> None:
    """The callback's arguments refused when it is made, not when training starts."""
    if keep_tokens_every is not None and keep_tokens_every < 1:
        raise ValueError(f"keep_tokens_every must be 1 or more, not {keep_tokens_every}")
    if reading not in READINGS:
        raise ValueError(f"reading must be one of {READINGS}, not {reading!r}")
    if call_tags is not None and (len(call_tags) != 2 or not all(call_tags)):
        raise ValueError(f"call_tags must be an (opening, closing) pair of texts: {call_tags!r}")
    if judge is not None and any(functions.given(k) for k in functions.functions):
        raise ValueError("pass a judge or the vote/true_score/format_valid functions, not both")


class RolloutLensCallback(TrainerCallback):
    """Records a `trl.GRPOTrainer` run into Rollout Lens.

    `database_url` and the other settings default to the ROLLOUT_LENS_* environment; `url`
    (ROLLOUT_LENS_URL) records into the dashboard at that address over HTTP instead, with
    `token` (ROLLOUT_LENS_TOKEN: an access or recording token), writing nothing locally; `vote`,
    `true_score` and `format_valid` judge a completion, and `format_free_score` scores it
    leniently, whatever its structure (recorded as format-free accuracy beside true accuracy:
    the gap is a skill hidden by a broken format); `target` names the right answer of a row;
    `call_tags` are the opening and closing tags of a tool call (default: the chat template's,
    else `<tool_call>`/`</tool_call>` and `<tool>`/`</tool>`, whichever a completion holds),
    found in the decoded text whether they are one token or several; `control_tokens` default to
    the tags' tokens (a tag of several tokens: its first) and the end-of-turn tokens;
    `buffer_mb` bounds the memory kept while the database is away; `keep_tokens_every` keeps
    token-level data only every N steps (and at the first and last step and at alerts) for very
    long runs.

    For a task of your own: `judge` replaces the four functions (a Completion in, a Judgement
    out); `watch_tokens` (answer tokens, e.g. tool ids) are probed right after the opening call
    tag; `hooks` change generation (trainer/recorder/capture.py); `sink` is the writer steps go
    to (default: one that creates the run and never stops training); `should_stop` is asked
    after every step; `reading` is where per-token logprobs and control-token probabilities are
    read: "forward" (TRL's own scoring pass, on every generation path) or "generate" (generate's
    logits; other paths record none)."""

    def __init__(
        self,
        project: str = "default",
        *,
        name: str | None = None,
        database_url: str | None = None,
        url: str | None = None,
        token: str | None = None,
        vote: TextFn | None = None,
        true_score: TextFn | None = None,
        format_valid: TextFn | None = None,
        format_free_score: TextFn | None = None,
        target: Callable[[dict[str, Any]], str | None] | None = None,
        control_tokens: Sequence[str] | None = None,
        call_tags: tuple[str, str] | None = None,
        buffer_mb: float = 256,
        keep_tokens_every: int | None = None,
        settings: Settings | None = None,
        judge: Judge | None = None,
        watch_tokens: Sequence[str] = (),
        hooks: GenerationHooks | None = None,
        sink: StepWriter | None = None,
        should_stop: Callable[[], bool] | None = None,
        reading: str = "forward",
    ) -> None:
        functions = FunctionJudge(
            vote=vote,
            true_score=true_score,
            format_valid=format_valid,
            format_free=format_free_score,
        )
        _check_arguments(keep_tokens_every, reading, call_tags, judge, functions)
        self.keep_tokens_every, self.project, self.name = keep_tokens_every, project, name
        self.settings = settings or get_settings()
        self.database_url = database_url or self.settings.database_url
        # a database named here wins over a dashboard URL from the environment
        self.url = url or (None if database_url else self.settings.url) or None
        self.token = token or self.settings.token.get_secret_value() or None
        self.functions, self.target = functions, target
        self.judge: Judge = judge or functions
        self.requested_control_tokens = list(control_tokens) if control_tokens else None
        self.requested_call_tags = (call_tags[0], call_tags[1]) if call_tags is not None else None
        self.watch_tokens = list(watch_tokens)
        self.hooks, self.should_stop, self.reading = hooks, should_stop, reading
        self.buffer_bytes = int(buffer_mb * 2**20)
        self.sink: StepWriter | None = sink
        self._own_sink = False  # made here at the start of training (no sink given)
        self.trainer: Any = None
        self.capture: RolloutCapture | None = None
        self.preparer: StepPreparer | None = None  # a step's parts → its StepRecord
        self._formats: list[tags.CallTags] = []  # the call formats completions are read with
        self._end_tokens: list[str] = []
        self.control_tokens: list[str] = []
        self._generations: list[Generation] = []
        self._last_rollout_step = 0
        self._pending: dict[str, Any] | None = None  # the step waiting for its logs
        self._extra: dict[int, dict[str, float | None]] = {}  # step -> series (add_metrics)
        self._step_started, self._installed = 0.0, False

    # -- attaching -----------------------------------------------------------------------------

    def attach(self, trainer: Any) -> None:
        """Wrap `trainer`'s generation and scoring (done by itself at the start of training)."""
        if self._installed:
            return
        self.trainer = trainer
        tokenizer = tokenizer_of(trainer)
        vocab_ = tokenizer.get_vocab()
        self._formats = tags.call_tags(tokenizer, self.requested_call_tags)
        self._end_tokens = [
            t for t in dict.fromkeys([tokenizer.eos_token, *END_OF_TURN_TOKENS]) if t in vocab_
        ]
        self.control_tokens, control_ids = _choose_control_tokens(
            tokenizer, self.requested_control_tokens, self._formats, self._end_tokens
        )
        watched = [t for t in self.watch_tokens if t in vocab_]
        # the id probe reads right after an opening tag that is one token
        opening = next((f.open for f in self._formats if f.single_tokens), None)
        capture = RolloutCapture(
            trainer,
            control_token_ids=control_ids,
            on_generation=self._generations.append,
            control_tokens=self.control_tokens,
            watch_ids=[vocab_[t] for t in watched],
            after_token_id=vocab_[opening] if opening else None,
            hooks=self.hooks,
            reading=self.reading,
        )
        if not capture.probing:
            self.control_tokens = capture.control_tokens = []
        self.preparer = StepPreparer(
            trainer,
            capture,
            judge=self.judge,
            functions=self.functions,
            target=self.target,
            formats=self._formats,
            end_tokens=self._end_tokens,
            control_tokens=self.control_tokens,
            watched=watched,
        )
        capture.install()
        self.capture = capture
        self._installed = True

    def add_metrics(self, step: int, metrics: dict[str, float | None]) -> None:
        """Extra series for `step` (evaluation, SFT phases, your own), written with that step
        (or the first step recorded after it)."""
        self._extra.setdefault(step, {}).update(metrics)

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if not self._installed:
            self.attach(_find_trainer())
        key, resume_step = _resume(state)
        if self.sink is None and state.is_world_process_zero:
            self._own_sink = True
            self.sink = _own_writer(self, self._run_spec(args, state), key, resume_step)
            atexit.register(self._at_exit)
        elif self.sink is not None:  # given (a launched run's): a database sink reads steps
            preparer = self.preparer
            assert preparer is not None
            reads = reads_steps(self.sink, preparer.reader)
            self.sink.prepare = preparer.judged if reads else self._prepare

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._step_started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self.capture is not None:
            self.capture.flush(state.global_step)  # every process: it may gather
        if self._cancelled(args):  # every process: it may broadcast
            control.should_training_stop = True  # the Trainer ends its loop after this step
        if self.sink is None:
            return
        self._send_pending()
        step = state.global_step
        captured: list[Captured] = []  # their Samples are built on the writer's thread
        while self._generations and self._generations[0].rollout_step <= step:
            generation = self._generations.pop(0)
            captured.extend(generation.parts)
            self._last_rollout_step = step
        self._pending = {
            "step": step,
            # a reused generation (num_iterations > 1) points at the step that recorded it
            "rollout_step": step if captured else (self._last_rollout_step or step),
            "captured": captured,
            "wall_time": time.perf_counter() - self._step_started,
            "logs": {},
        }
        if self.should_stop is not None and self.should_stop():
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        # Trainer logs a step right after its on_step_end: the logs join that step.
        if self._pending is not None and logs and self._pending["step"] == state.global_step:
            self._pending["logs"].update(logs)
            if "loss" in logs:
                self._send_pending()

    def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self._own_sink:
            stopped = self.sink is not None and self.sink.stop_requested
            self._close(RunStatus.cancelled if stopped else RunStatus.completed, None)
        else:
            self._send_pending()  # the worker closes its writer and marks the run

    def _cancelled(self, args: Any) -> bool:
        """Whether the run was cancelled from the dashboard (its writer heard it); every process
        of a distributed run gets the main one's answer, so that all of them stop together."""
        stop = self.sink is not None and self.sink.stop_requested
        if getattr(args, "world_size", 1) > 1:
            from accelerate.utils import broadcast_object_list

            stop = bool(broadcast_object_list([stop], from_process=0)[0])  # a collective
        return stop

    def _at_exit(self) -> None:
        """The script ended without on_train_end (an exception): keep what was recorded."""
        self._close(RunStatus.failed, "the training script stopped before the end of training")

    def _close(self, status: RunStatus, error: str | None) -> None:
        if self.sink is None:
            return
        self._send_pending()
        sink, self.sink = self.sink, None
        sink.close(status=status, error=error)
        atexit.unregister(self._at_exit)

    def _send_pending(self) -> None:
        if self._pending is not None and self.sink is not None:
            step = self._pending["step"]
            extra: dict[str, float | None] = {}
            for early in sorted(s for s in self._extra if s <= step):
                extra.update(self._extra.pop(early))
            self._pending["metrics"] = extra
            self.sink.put(self._pending)
        self._pending = None

    # -- the run -------------------------------------------------------------------------------

    @property
    def tool_calling(self) -> bool:
        return self.capture is not None and self.capture.tool_calling

    def _run_spec(self, args: Any, state: Any) -> RunSpec:
        trainer = self.trainer
        assert self.capture is not None
        config = json.loads(args.to_json_string())  # the GRPOConfig as given
        judged = {
            "vote": self.functions.given("vote") or self.tool_calling,
            "true_score": self.functions.given("true_score"),
            "format_valid": self.functions.given("format_valid"),
            "format_free": self.functions.given("format_free"),
        }
        if self.judge is not self.functions:
            judged = dict.fromkeys(judged, True)  # a task's judge says everything
        config[CONFIG_KEY] = {
            "project": self.project,
            "reward_funcs": list(getattr(trainer, "reward_func_names", []) or []),
            "judged": judged,
        }
        label = self.name or args.run_name or Path(args.output_dir or "run").name
        world = trainer.accelerator.num_processes
        group = int(getattr(trainer, "num_generations", None) or args.num_generations)
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
        model = getattr(trainer.model, "name_or_path", None) or getattr(
            trainer.model.config, "_name_or_path", "model"
        )
        notes = _spec_notes(
            self.capture.notes,
            self.tool_calling,
            self.functions.given("vote"),
            judged,
            self._formats,
        )
        notes.extend(self.tag_notes())
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

    def _prepare(self, raw: dict[str, Any]) -> StepRecord:
        """A step's raw parts → its StepRecord (the writer's `prepare`)."""
        assert self.preparer is not None
        return self.preparer.prepare(raw)

    @staticmethod
    def _lighten(raw: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """A step handed over without its rollouts, and how many it had (the writer's
        `lighten`, on the training thread: the writer's thread is held by a write and the budget
        is spent). Its logs stay, and of its rollouts' values the mean reward, from TRL's
        rewards as they are (a rollout's is its functions' weighted sum, as its record's)."""
        parts = raw["captured"]
        if not parts:  # a step that reuses a generation: nothing to take off, light already
            return dict(raw), 0
        totals = [p.total_rewards() for p in parts if p.inputs]
        rollouts = sum(len(p.inputs) for p in parts)
        kept = {"reward_mean": float(np.concatenate(totals).mean())} if totals else {}
        return {**raw, "captured": [], "kept": kept}, rollouts

    def tag_notes(self) -> list[str]:
        """What the run page says of call tags that are not single tokens of the tokenizer."""
        assert self.preparer is not None
        return self.preparer.tag_notes()


def _own_writer(
    callback: RolloutLensCallback, spec: RunSpec, key: str, resume_step: int | None
) -> StepWriter:
    """A script's own writer: into the dashboard at `callback.url`, else into its database (the
    run created under `key`, or continued from the checkpoint at `resume_step`)."""
    settings = callback.settings
    if callback.url:
        from rollout_lens.trainer.recorder.remote import RemoteStepWriter

        return RemoteStepWriter(
            url=callback.url,
            token=callback.token,
            spec=spec,
            prepare=callback._prepare,
            lighten=callback._lighten,
            max_bytes=callback.buffer_bytes,
            heartbeat_seconds=settings.heartbeat_seconds,
            key=key,
            resume_step=resume_step,
        )
    spec.config[CONFIG_KEY]["key"] = key  # found by it when a resumed script continues
    preparer = callback.preparer
    assert preparer is not None
    # the steps judged here, read where the database is written (the writer's own process)
    return StepWriter.for_script(
        database_url=callback.database_url,
        spec=spec,
        prepare=preparer.judged,
        reader=preparer.reader,
        lighten=callback._lighten,
        max_bytes=callback.buffer_bytes,
        heartbeat_seconds=settings.heartbeat_seconds,
        price_per_device_hour=settings.price_per_device_hour,
        busy_timeout_ms=settings.sqlite_busy_timeout_ms,
        resume=None if resume_step is None else (key, resume_step),
        process=settings.writer_process,
    )


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
