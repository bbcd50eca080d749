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
from rollout_lens.server.config import Settings
from rollout_lens.server.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.domain.runconfig import RunConfig
from rollout_lens.server.domain.task import IN_GROUP_MODES, SFT_MODES, TINY
from rollout_lens.server.models import RunStatus
from rollout_lens.server.records import StepRecord
from rollout_lens.trainer import multiturn, prebuilt, task
from rollout_lens.trainer import multiturn_supervision as mts
from rollout_lens.trainer.evaluation import Evaluator
from rollout_lens.trainer.grpo import Recorder, RecordingGRPOTrainer
from rollout_lens.trainer.modelref import ModelUnavailable, check_model, unusable
from rollout_lens.trainer.monitor import CheckpointRecorder, RunMonitor
from rollout_lens.trainer.retry import DatabaseAway, mark_finished
from rollout_lens.trainer.supervision import MetricSink, SFTPhases, SupervisedGRPOTrainer
from rollout_lens.trainer.tiny_model import CONTROL_TOKENS as TINY_CONTROL_TOKENS
from rollout_lens.trainer.writer import StepWriter
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PrinterCallback,
    set_seed,
)
from trl import GRPOConfig, GRPOTrainer

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
    use, telling `phase` how a build goes."""
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


def _phase_writer(factory: Any, run_id: int) -> Callable[[str], None]:
    """Writes what the run is doing before its first step onto its row (the pages show it)."""

    def write(text: str) -> None:
        with session_scope(factory) as session:
            store.set_phase(session, run_id=run_id, phase=text)

    return write


def load_model(named: str, path: str) -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    """The tokenizer and model at `path`; a folder that does not load is ModelUnavailable saying
    no more than modelref.unusable (transformers' message can quote the folder's files), with
    the detail in this process's log."""
    try:
        return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    except Exception:  # any loading error: its text is for the operator only
        log.warning("model %r could not be loaded from %s", named, path, exc_info=True)
        raise ModelUnavailable(unusable(named)) from None


def default_control_tokens(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The first known set whose tokens the tokenizer has, else its end-of-turn token."""
    vocab = tokenizer.get_vocab()
    for candidates in KNOWN_CONTROL_TOKENS:
        if all(t in vocab for t in candidates):
            return list(candidates)
    return [tokenizer.eos_token] if tokenizer.eos_token else []


def device_name() -> str:
    """Where this process trains."""
    if torch.cuda.is_available():
        return f"cuda ({torch.cuda.get_device_name(0)})"
    return "cpu"


def grpo_args(config: RunConfig, output_dir: Path, *, checkpoint_every: int = 0) -> GRPOConfig:
    """TRL's config for one run: G rollouts × prompts_per_step groups per optimizer step."""
    cuda = torch.cuda.is_available()
    return GRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=config.group_size * config.prompts_per_step,
        num_generations=config.group_size,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        num_iterations=config.num_iterations,
        max_steps=config.steps,
        learning_rate=config.learning_rate,
        lr_scheduler_type="constant",
        temperature=config.temperature,
        max_completion_length=config.max_completion_tokens,
        beta=config.kl_coef,
        seed=config.seed,
        data_seed=config.seed,
        shuffle_dataset=False,  # the env's stream is already drawn with the run's seed
        logging_steps=1,
        report_to="none",
        save_strategy="steps" if checkpoint_every else "no",
        save_steps=checkpoint_every or 500,
        save_total_limit=2,
        disable_tqdm=True,
        # TRL defaults both on; bf16 only pays on CUDA and checkpointing only for big models.
        bf16=cuda and torch.cuda.is_bf16_supported(),
        activation_checkpointing=False,
        use_cpu=not cuda,
        dataloader_num_workers=0,
    )


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
            run_id = store.create_run(session, **config.run_columns()).id
    try:
        return _train(
            config, settings, factory, run_id, on_step, should_stop, log_line, resume_from
        )
    finally:
        engine.dispose()


def make_trainer(
    config: RunConfig,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    output_dir: Path,
    *,
    recorder: Recorder | None,
    control_tokens: list[str],
    checkpoint_every: int = 0,
) -> GRPOTrainer:
    """The Escalation GRPO trainer for `config`; a plain GRPOTrainer when `recorder` is None."""
    kwargs = {
        "model": model,
        "processing_class": tokenizer,
        "reward_funcs": [task.make_reward_function(config)],
        "args": grpo_args(config, output_dir, checkpoint_every=checkpoint_every),
        "train_dataset": Dataset.from_list(task.dataset_rows(task.make_env(config), config)),
    }
    if recorder is None:
        trainer = GRPOTrainer(**kwargs)
    else:
        recording: dict[str, Any] = {
            "recorder": recorder,
            "control_tokens": control_tokens,
            "judge": task.judge,
            "id_tokens": task.id_tokens(),
        }
        if config.supervision in IN_GROUP_MODES:
            trainer = SupervisedGRPOTrainer(
                **kwargs,
                **recording,
                mode=config.supervision,
                per_group=config.supervised_per_group,
                expert_reply=lambda row: task.expert_reply(row["target"]),
                hinted_prompt=task.hinted_prompt,
            )
        else:
            trainer = RecordingGRPOTrainer(**kwargs, **recording)
        _add_phases(trainer, recorder, config)
    trainer.remove_callback(PrinterCallback)  # a progress bar and the database replace it
    return trainer


def make_multiturn_trainer(
    config: RunConfig,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    output_dir: Path,
    *,
    callback: multiturn.LaunchedCallback,
    checkpoint_every: int = 0,
) -> GRPOTrainer:
    """A plain GRPOTrainer on the multi-step env through TRL's tool loop, recorded by
    `callback` (attached here, so its control tokens are known before training)."""
    trainer = multiturn.make_trainer(
        multiturn.config_from_run(config),
        model,
        tokenizer,
        output_dir,
        callbacks=[callback],
        num_iterations=config.num_iterations,
        save_strategy="steps" if checkpoint_every else "no",
        save_steps=checkpoint_every or 500,
        save_total_limit=2,
    )
    callback.attach(trainer)
    trainer.remove_callback(PrinterCallback)
    env = multiturn.make_env(multiturn.config_from_run(config))
    if config.supervision in SFT_MODES:
        trainer.add_callback(
            _sft_phases(
                trainer,
                callback,
                config,
                all_examples=lambda: mts.sft_rows(env),
                encode=mts.row_encoder(tokenizer, env),
                failures=callback.failures,
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


def _add_phases(trainer: RecordingGRPOTrainer, recorder: Recorder, config: RunConfig) -> None:
    """SFT phases and periodic evaluation, as the config asks."""
    env = task.make_env(config)
    if config.supervision in SFT_MODES:
        trainer.add_callback(
            _sft_phases(
                trainer,
                recorder,
                config,
                all_examples=lambda: task.sft_examples(env),
                expert_reply=task.expert_reply,
            )
        )
    if config.eval_every:
        trainer.add_callback(
            Evaluator(
                trainer,
                recorder,
                task.eval_sets(env),
                every=config.eval_every,
                max_new_tokens=config.max_completion_tokens,
            )
        )


def _train(config, settings, factory, run_id, on_step, should_stop, log_line, resume_from) -> int:  # type: ignore[no-untyped-def]
    writer: StepWriter | None = None
    monitor = RunMonitor(factory, run_id=run_id, interval=settings.heartbeat_seconds)
    try:
        with monitor:
            if settings.torch_threads:
                torch.set_num_threads(settings.torch_threads)
            set_seed(config.seed)
            phase = _phase_writer(factory, run_id)
            phase("starting: loading the model")
            model_path = resolve_model(config, settings, log_line, phase)
            phase("starting: loading the model and preparing TRL's trainer")
            tokenizer, model = load_model(config.model, model_path)

            def stop_requested() -> bool:
                return monitor.should_stop() or bool(should_stop and should_stop())

            output_dir = run_output_dir(settings, run_id)
            launched: multiturn.LaunchedCallback | None = None
            if config.turns == "multi":
                launched = multiturn.LaunchedCallback(
                    lambda record: writer.put(record) if writer else None,
                    should_stop=stop_requested,
                    control_tokens=config.control_tokens,
                    keep_tokens_every=None,  # the run row has it: the store applies it
                    settings=settings,
                )
                trainer = make_multiturn_trainer(
                    config,
                    model,
                    tokenizer,
                    output_dir,
                    callback=launched,
                    checkpoint_every=settings.checkpoint_every,
                )
                control_tokens = launched.control_tokens
            else:
                control_tokens = config.control_tokens or default_control_tokens(tokenizer)
            with session_scope(factory) as session:
                store.truncate_after(session, run_id=run_id, step=resume_from)
                store.mark_running(
                    session,
                    run_id=run_id,
                    worker_host=socket.gethostname(),
                    device=device_name(),
                    control_tokens=control_tokens,
                )
            writer = StepWriter(
                factory,
                run_id=run_id,
                control_tokens=control_tokens,
                price_per_device_hour=settings.price_per_device_hour,
                on_written=on_step,
                give_up_after=settings.lost_after_seconds,
            )
            if launched is None:
                trainer = make_trainer(
                    config,
                    model,
                    tokenizer,
                    output_dir,
                    recorder=Recorder(writer.put, should_stop=stop_requested),
                    control_tokens=control_tokens,
                    checkpoint_every=settings.checkpoint_every,
                )
            trainer.add_callback(CheckpointRecorder(factory, writer, run_id=run_id))
            checkpoint = output_dir / f"checkpoint-{resume_from}" if resume_from else None
            trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
            writer.close()
            status = RunStatus.cancelled if stop_requested() else RunStatus.completed
            mark_finished(factory, run_id, settings.lost_after_seconds, status=status)
            return run_id
    except BaseException as exc:
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
            )
        except DatabaseAway:
            log.error("run %s %s; the dashboard will show it lost", run_id, _error_text(exc))
        raise


def run_output_dir(settings: Settings, run_id: int) -> Path:
    """Where a run's checkpoints go (Settings.run_dir: deleting the run removes it)."""
    return settings.run_dir(run_id)


def resume_step(settings: Settings, run_id: int, checkpoint_step: int | None) -> int:
    """The step to continue after: the recorded checkpoint if its files exist, else 0."""
    if (
        checkpoint_step
        and (run_output_dir(settings, run_id) / f"checkpoint-{checkpoint_step}").is_dir()
    ):
        return checkpoint_step
    return 0


def _error_text(exc: BaseException) -> str:
    """The message a person needs first, then the traceback's last frames."""
    tail = "".join(traceback.format_exception(exc)[-6:])
    return f"{type(exc).__name__}: {exc}\n\n{tail}"[:8000]
