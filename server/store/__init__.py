"""All SQL that writes, and the reads that export and scripts share, by job:

- runs: run lifecycle and the launch queue;
- writing: the one writer (RunWriter and write_steps, every source's way in);
- recording: the write path's SQL (a Recorder per run: steps, rollouts, series, rollups, alerts);
- rollups: per-bucket aggregates for long runs' charts;
- reading: steps, rollouts and series read back;
- layout, sql: how a step's series are packed; dialect helpers;
- models, db, migrate: the schema, engines and sessions, Alembic;
- packing, arrays, prompt_texts, search, serialize: bytes, per-token arrays, prompts compressed,
  full-text search, rows as dicts;
- resume: a resumed trainer's run, and one writer of a run's steps at a time;
- deletion, browser_sessions: deleting a run; signed-in browsers.

The pages' reads live in server.webapp.queries. Callers use `store.<function>`.
"""

from rollout_lens.server.store.reading import (
    TokenTextCache,
    first_recorded,
    iter_rollouts,
    iter_steps,
    last_recorded_step,
    last_step,
    last_values,
    metric_names,
    metric_series,
    series_names,
    step_rollouts,
    steps,
    token_texts,
)
from rollout_lens.server.store.recording import Recorder
from rollout_lens.server.store.resume import lock_run, note_refusal, resume_run
from rollout_lens.server.store.rollups import latest_value, rollup_series
from rollout_lens.server.store.runs import (
    RESUMABLE_STATUSES,
    add_device_time,
    callback_run,
    cancel_requested,
    claim_run,
    create_launched_run,
    create_run,
    discard_queued_runs,
    followed_run,
    get_run,
    heartbeat,
    list_runs,
    mark_finished,
    mark_following,
    mark_lost_runs,
    mark_running,
    present_steps,
    queue_position,
    queue_positions,
    queued_count,
    recorded_run,
    request_cancel,
    requeue_for_resume,
    restore_run_columns,
    restore_status,
    revive,
    set_checkpoint,
    set_dropped,
    set_phase,
    set_record_owner,
    set_task_id,
    truncate_after,
    unique_run_name,
)
from rollout_lens.server.store.writing import (
    RunWriter,
    add_rollouts,
    record_step,
    write_batch,
    write_steps,
)

__all__ = [
    "RESUMABLE_STATUSES",
    "Recorder",
    "RunWriter",
    "TokenTextCache",
    "add_device_time",
    "add_rollouts",
    "callback_run",
    "cancel_requested",
    "claim_run",
    "create_launched_run",
    "create_run",
    "unique_run_name",
    "discard_queued_runs",
    "first_recorded",
    "followed_run",
    "get_run",
    "heartbeat",
    "iter_rollouts",
    "iter_steps",
    "last_recorded_step",
    "last_step",
    "last_values",
    "latest_value",
    "list_runs",
    "lock_run",
    "mark_finished",
    "mark_following",
    "mark_lost_runs",
    "mark_running",
    "metric_names",
    "metric_series",
    "note_refusal",
    "queue_position",
    "queue_positions",
    "present_steps",
    "queued_count",
    "recorded_run",
    "revive",
    "set_record_owner",
    "record_step",
    "request_cancel",
    "requeue_for_resume",
    "restore_run_columns",
    "restore_status",
    "resume_run",
    "rollup_series",
    "series_names",
    "set_checkpoint",
    "set_dropped",
    "set_phase",
    "set_task_id",
    "step_rollouts",
    "steps",
    "token_texts",
    "truncate_after",
    "write_batch",
    "write_steps",
]
