"""Rows → the read view (read_rollout: per-token arrays decoded) and plain dicts for JSON (the\nAPI, the JSONL export)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollout_lens.server.core import tokentext
from rollout_lens.server.core.display import iso
from rollout_lens.server.core.mismatch import RolloutMismatch, stored_figures
from rollout_lens.server.core.read_models import RunData
from rollout_lens.server.core.records import ControlProbs, Floats
from rollout_lens.server.core.step_views import RolloutView
from rollout_lens.server.core.vocab import STEP_SERIES
from rollout_lens.server.store import arrays
from rollout_lens.server.store.models import RolloutRow, RunRow, RunSource, StepRow


def completion_text(rollout: RolloutRow, ids: Sequence[int], token_texts: Mapping[int, str]) -> str:
    """A rollout's completion: rebuilt from its ids where the store found that exact, else the
    text it stored (`token_texts` must hold the text of every id then)."""
    if rollout.text_rule is not None:
        return arrays.rebuild_text(rollout.text_rule, ids, token_texts)
    data = rollout.data
    return arrays.completion(None, None, data.text if data is not None else None, token_texts)


def completion_ids(rollout: RolloutRow) -> list[int]:
    """A rollout's token ids (empty when none were recorded)."""
    return arrays.decode_ids(rollout.data.ids).tolist() if rollout.data is not None else []


def token_pieces(ids: Sequence[int], token_texts: Mapping[int, str]) -> list[str] | None:
    """The run's stored pieces of `ids` (convert_ids_to_tokens: 'Ġcan'), None unless every id
    has one."""
    pieces = list(map(token_texts.get, ids))
    return None if not ids or None in pieces else pieces  # type: ignore[return-value]


def shown_tokens(rollout: RolloutRow, pieces: list[str] | None, *, whole: bool) -> list[str] | None:
    """Each token's text as decoding shows it (tokentext.token_texts: joined, the completion
    decoded with its special tokens), read by the rule that rebuilt its completion, else by the
    one its pieces show (runs stored before need no migration). `whole`: the pieces are the
    whole completion, not a page's first ones."""
    if pieces is None:
        return None
    rule = tokentext.rule_for(rollout.text_rule, pieces)
    return tokentext.token_texts(pieces, rule, final=whole)


def read_rollout(
    rollout: RolloutRow,
    prompt: str,
    control_tokens: Sequence[str],
    token_texts: Mapping[int, str] | None = None,
    *,
    max_tokens: int | None = None,
) -> RolloutView:
    """One rollout with its arrays decoded, as the read view (step_views.RolloutView; its
    `data()` is what the JSONL export writes and the API sends).

    `token_texts` (store.token_texts) gives each completion token's stored piece: it must hold
    every id of a rollout whose text is rebuilt from its ids. When every id has one,
    `token_pieces` lists them and `tokens` is each token's text (shown_tokens); else both are
    None. Where retention dropped the per-token logprobs and control-token probabilities,
    `tokens_kept` is False and those arrays are empty (the ids stay).

    With `max_tokens` only the first max_tokens positions of the per-token arrays are read (a
    page's view of a long completion: a window) and `tokens_total` says how many there are.
    """
    texts = token_texts or {}
    id_array = arrays.decode_ids(rollout.data.ids if rollout.data is not None else None)
    ids = id_array.tolist()  # the pieces are looked up by Python int
    # A completion rebuilt from its ids needs every id's piece: looked up once for both.
    every = token_pieces(ids, texts) if rollout.text_rule is not None else None
    completion = (
        arrays.rebuild_from_pieces(rollout.text_rule, every)
        if rollout.text_rule is not None and every is not None
        else completion_text(rollout, ids, texts)
    )
    shown = ids if max_tokens is None else ids[:max_tokens]
    pieces = every[: len(shown)] if every is not None else token_pieces(shown, texts)
    logprobs, generator, control, figures = per_token(rollout, control_tokens, max_tokens)
    return RolloutView(
        run_id=rollout.run_id,
        step=rollout.step,
        group=rollout.group,
        index=rollout.index,
        prompt=prompt,
        completion=completion,
        completion_ids=id_array if max_tokens is None else id_array[:max_tokens],
        tokens=shown_tokens(rollout, pieces, whole=len(shown) == len(ids)),
        token_pieces=pieces,
        tokens_kept=rollout.tokens_kept,
        vote=rollout.vote,
        target=rollout.target,
        verifier_reward=rollout.verifier_reward,
        true_score=rollout.true_score,
        advantage=rollout.advantage,
        sum_logprob=rollout.sum_logprob,
        format_valid=rollout.format_valid,
        format_state=rollout.format_state,
        token_logprobs=logprobs,
        generator_logprobs=generator,
        control_token_probs=control,
        meta=rollout.meta,
        tokens_total=len(ids),
        window=max_tokens is not None,
        mismatch=figures,
    )


def per_token(
    rollout: RolloutRow, control_tokens: Sequence[str], max_tokens: int | None
) -> tuple[Floats, Floats | None, ControlProbs, RolloutMismatch | None]:
    """A rollout's per-token arrays as the view holds them — logprobs float64, the
    generator's logprobs float64 (None: the generation path gave none) and control-token
    probabilities [position × token], as the store's decoders return them — cut to the first
    `max_tokens` positions (retention dropped the logprobs, the generator's and the
    control-token probabilities: empty, None), and the rollout's mismatch figures over all its
    positions (mismatch.stored_figures, before the cut)."""
    data = rollout.data if rollout.tokens_kept else None
    logprobs = arrays.decode_logprobs(data.logprobs if data else None)
    found = data.generator_logprobs if data else None
    generator = None if found is None else arrays.decode_logprobs(found)
    control = arrays.decode_control(data.control if data else None, len(control_tokens))
    figures = stored_figures(logprobs, generator)
    if max_tokens is not None:
        logprobs, control = logprobs[:max_tokens], control[:max_tokens]
        generator = None if generator is None else generator[:max_tokens]
    return logprobs, generator, ControlProbs(control_tokens, control), figures


def rollout_dict(
    rollout: RolloutRow,
    prompt: str,
    control_tokens: Sequence[str],
    token_texts: Mapping[int, str] | None = None,
    *,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """read_rollout's JSON: the read view's keys (step_views.ROLLOUT_KEYS: the JSONL export's,
    the API's)."""
    return read_rollout(rollout, prompt, control_tokens, token_texts, max_tokens=max_tokens).data()


def run_dict(run: RunRow) -> RunData:
    """A run's columns, JSON-ready (the run card)."""
    return {
        "id": run.id,
        "name": run.name,
        "status": run.status,
        "source": run.source,
        "external": run.source != RunSource.launched,
        "variant": run.variant,
        "model": run.model,
        "k": run.k,
        "group_size": run.group_size,
        "prompts_per_step": run.prompts_per_step,
        "seed": run.seed,
        "total_steps": run.total_steps,
        "current_step": run.current_step,
        "recent_true_accuracy": run.recent_true_accuracy,
        "recent_reward": run.recent_reward,
        "device": run.device,
        "worker_host": run.worker_host,
        "device_minutes": run.device_seconds / 60.0,
        "cost": run.cost,
        "error": run.error,
        "ended_by": run.ended_by,
        "dropped_steps": run.dropped_steps,
        "dropped_rollouts": run.dropped_rollouts,
        "notes": run.notes,
        "phase": run.phase,
        "judged": judged(run),
        "control_tokens": run.control_tokens,
        "config": run.config,
        # UTC with its zone: SQLite hands stored times back naive.
        "created_at": iso(run.created_at),
        "started_at": iso(run.started_at),
        "finished_at": iso(run.finished_at),
        "heartbeat_at": iso(run.heartbeat_at),
    }


JUDGEMENTS = ("vote", "true_score", "format_valid")


def judged(run: RunRow) -> dict[str, bool]:
    """Which judgements of a completion the run's recorder could make: all for runs launched
    here; for external runs only those the user gave a function for (the callback keeps them
    in config["rollout_lens"]["judged"], beside the GRPOConfig; imports in config["judged"])."""
    config = run.config or {}
    recorder = config.get("rollout_lens")
    given = recorder.get("judged") if isinstance(recorder, dict) else config.get("judged")
    if not isinstance(given, dict):
        return dict.fromkeys(JUDGEMENTS, True)
    return {name: bool(given.get(name)) for name in JUDGEMENTS}


def step_dict(step: StepRow) -> dict[str, Any]:
    """A step's scalar columns."""
    return {"step": step.step, "rollout_step": step.rollout_step} | {
        name: getattr(step, name) for name in STEP_SERIES
    }
