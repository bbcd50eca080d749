"""A recorded step's raw parts → its StepRecord: on the writer's thread for a user's script,
on the training thread for a launched run (the StepWriter's `prepare`).

The capture's Samples are built (trainer/recorder/captured.py: each one's write entity from
the host copies of TRL's tensors the capture kept) and completed here: each rollout's place in
the step, its prompt as the model saw it, its completion's text and token pieces, the judge's
verdict, the call tags' states and the positional control-token probes; then the step's
summary values and TRL's logs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from rollout_lens.server.core import mismatch, tokentext, vocab
from rollout_lens.server.core.records import RolloutRecord, StepRecord
from rollout_lens.trainer.recorder import positional, tags, turns
from rollout_lens.trainer.recorder.capture import RolloutCapture
from rollout_lens.trainer.recorder.captured import Sample
from rollout_lens.trainer.recorder.judging import (
    Completion,
    FunctionJudge,
    Judge,
    Judgement,
    message_text,
)
from rollout_lens.trainer.recorder.summary import split_logs, summarize


class StepPreparer:
    """Prepares the steps of one run, as the callback attached to its trainer reads them."""

    def __init__(
        self,
        trainer: Any,
        capture: RolloutCapture,
        *,
        judge: Judge,
        functions: FunctionJudge,
        target: Callable[[dict[str, Any]], str | None] | None,
        formats: list[tags.CallTags],
        end_tokens: list[str],
        control_tokens: list[str],
        watched: list[str],
    ) -> None:
        self.trainer = trainer
        self.capture = capture
        self.judge = judge
        self.functions = functions
        self.target = target
        self.formats = formats  # the call formats completions are read with
        self.token_pieces = tags.TokenPieces(tokenizer_of(trainer))
        self.token_bytes = tags.TokenBytes(tokenizer_of(trainer), self.token_pieces)
        self.end_tokens = end_tokens
        self.control_tokens = control_tokens
        self.watched = watched  # the id-position probe's tokens
        self.eot = next((t for t in end_tokens if t in control_tokens), None)  # end of turn
        self._prompt_text: dict[str, str] = {}
        # (rollout step, values, series) of the last generation: a step that reuses it
        # (num_iterations > 1) shows the same rollout-derived values, never its logged ones.
        self._last_summary: tuple[int, dict[str, float | None], dict[str, float | None]] | None = (
            None
        )

    def prepare(self, raw: dict[str, Any]) -> StepRecord:
        """A step's raw parts (the callback's) → its StepRecord."""
        trainer = self.trainer
        group_size = int(trainer.num_generations)
        tokenizer = tokenizer_of(trainer)  # what every rollout of the step is read with, once
        eos = set(getattr(trainer, "eos_token_ids", None) or [tokenizer.eos_token_id])
        names = list(getattr(trainer, "reward_func_names", []) or [])
        rollouts = [
            self._rollout(i, sample, group_size, tokenizer=tokenizer, eos=eos, names=names)
            for i, sample in enumerate(s for part in raw["captured"] for s in part.samples())
        ]
        values: dict[str, float | None] = {}
        series: dict[str, float | None] = {}
        if rollouts:
            values, series = summarize(rollouts, group_size, self.control_tokens)
            if self.capture.forward is not None:  # the trainer's side is TRL's scoring pass
                series.update(mismatch_figures(rollouts))
            # what no function judged is unknown, not zero
            unjudged = self.judge is self.functions and not self.functions.given("vote")
            if unjudged and not self.capture.tool_calling:
                values["vote_agreement"] = values["vote_entropy"] = None
            # copies: the logs below belong to this step only, not to a step reusing these
            self._last_summary = (raw["rollout_step"], dict(values), dict(series))
        elif self._last_summary is not None and self._last_summary[0] == raw["rollout_step"]:
            values, series = dict(self._last_summary[1]), dict(self._last_summary[2])
        values.update(raw.get("kept") or {})  # what a lightened step kept of its rollouts
        values["wall_time"] = raw["wall_time"]
        columns, logged = split_logs(raw["logs"])
        values.update(columns)
        series.update(logged)
        series.update(raw.get("metrics") or {})
        return StepRecord(
            step=raw["step"],
            rollout_step=raw["rollout_step"],
            values=values,
            rollouts=rollouts,
            metrics=series,
        )

    def _rollout(
        self,
        i: int,
        sample: Sample,
        group_size: int,
        *,
        tokenizer: Any,
        eos: set[int],
        names: list[str],
    ) -> RolloutRecord:
        """The capture's entity completed: its place in the step, texts and judgement."""
        record = sample.record
        ids = record.completion_ids.tolist()  # as the tokenizer takes them
        mask = sample.tool_mask
        # tool-calling: the whole conversation as the model saw it, tool results included
        text = message_text(sample.completion) if mask is None else tokenizer.decode(ids)
        row = sample.row
        truncated = not ids or ids[-1] not in eos
        judgement: Judgement = self.judge(
            Completion(
                text=text,
                messages=sample.completion,
                row=row,
                prompt=sample.prompt,
                truncated=truncated,
            )
        )
        tokens = self.token_pieces.of(record.completion_ids, ids)
        meta = _meta(sample, names, truncated, judgement)
        vote, format_state, probes = self._structure(
            sample, ids, tokens, text, meta, judgement, tokenizer
        )
        watched = sample.watched
        if watched is not None:
            probes.update(
                positional.id_probes(
                    dict(zip(self.watched, watched, strict=True)),
                    row.get("tool_ids") or [],
                    row.get("target"),
                )
            )
        if probes:
            meta["probes"] = probes
        record.group, record.index = divmod(i, group_size)
        record.prompt = self._render_prompt(sample.prompt, sample.prompt_ids)
        record.completion = text
        record.vote = None if vote is None else str(vote)
        record.target = self._target(row)
        record.true_score = judgement.true_score
        record.format_valid = judgement.format_valid
        record.format_state = format_state
        record.meta = meta
        record.tokens = tokens
        return record

    def _structure(
        self,
        sample: Sample,
        ids: list[int],
        tokens: list[str],
        text: str,
        meta: dict[str, Any],
        judgement: Judgement,
        tokenizer: Any,
    ) -> tuple[str | None, str | None, dict[str, float | None]]:
        """The vote, the call tags' state (turn by turn with tools, into `meta`) and the
        positional control-token probes of one rollout (`tokenizer`: the step's, found once:
        a tokenizer's missing attribute is a slow lookup)."""
        mask = sample.tool_mask
        # positional reads any indexable of floats: the columns of the array, as they are
        by_token = cast(Mapping[str, Sequence[float]], sample.record.control_probs)
        vote, format_state = judgement.vote, judgement.format_state
        probes: dict[str, float | None] = {}
        spoken = text if mask is not None else tokenizer.decode(ids)  # special tokens kept
        form = tags.pick(self.formats, spoken) if self.formats else None
        if mask is not None:
            meta["turns"] = turns.read_turns(mask, sample.completion)
            meta["answer"] = turns.final_answer(sample.completion)
            meta["first_call"] = turns.first_call(meta["turns"])
            if form is not None:
                meta["turn_states"] = turns.turn_states(
                    meta["turns"],
                    functools.partial(_decode_span, tokenizer, ids),
                    form.pair,
                    self.end_tokens,
                )
                if format_state is None:
                    format_state = turns.rollout_state(meta["turn_states"])
            marks = self._marks(ids, tokens, spoken, form)
            if marks is not None and form is not None:
                probes = positional.turn_probes_at(
                    marks, by_token, meta["turns"], **self._roles(form)
                )
            if vote is None and not self.functions.given("vote"):
                vote = meta["answer"]  # the group's votes: each rollout's final answer
        else:
            if format_state is None and form is not None:
                format_state = turns.completion_state(spoken, form.pair, self.end_tokens)
            marks = self._marks(ids, tokens, spoken, form)
            if marks is not None and form is not None:
                probes = positional.probes_at(marks, by_token, **self._roles(form))
        return vote, format_state, probes

    def _probing(self, form: tags.CallTags) -> bool:
        """Positional probes need the tags' tokens and an end-of-turn among the control tokens."""
        return (
            form.spelled
            and self.eot is not None
            and all(t in self.control_tokens for t in (form.open_token, form.close_token))
        )

    def _marks(
        self, ids: list[int], tokens: list[str], spoken: str, form: tags.CallTags | None
    ) -> tags.Marks | None:
        """Where the completion's tags and end-of-turn stand (None: no probes to read): tags
        that are single tokens by the tokens themselves, others found in the decoded text."""
        if form is None or not self._probing(form) or self.token_bytes is None:
            return None
        assert self.eot is not None
        if form.single_tokens:
            return tags.single_token_marks(tokens, form.open, form.close, self.eot)
        laid = self.token_bytes.layout(ids, spoken)
        if laid is None:
            return None  # the tokens' bytes do not give the decoded text back
        return tags.find_marks(*laid, form, self.eot)

    def _roles(self, form: tags.CallTags) -> dict[str, str]:
        assert self.eot is not None
        return {"open_token": form.open_token, "close_token": form.close_token, "eot": self.eot}

    def tag_notes(self) -> list[str]:
        """What the run page says of call tags that are not single tokens of the tokenizer."""
        if not self.formats:
            tried = " or ".join(f"{o}…{c}" for o, c in tags.COMMON_TAGS)
            return [
                f"no structural states: this tokenizer cannot spell the call tags {tried}, and "
                "its chat template declares none (name them with RolloutLensCallback(call_tags="
                "(opening, closing)))"
            ]
        notes = []
        # where some format's tags are single tokens, those are the ones measured
        several = [f for f in self.formats if f.spelled]
        if any(f.single_tokens for f in self.formats):
            several = []
        for f in several:
            stands = [
                f"{tokentext.piece_text(tok)!r} for {tag}"
                for tag, tok in zip(f.pair, (f.open_token, f.close_token), strict=True)
                if tok != tag
            ]
            measured = self._probing(f)
            notes.append(
                f"the call tags {f.open}…{f.close} are several tokens in this tokenizer: they are "
                "found in the decoded text"
                + (
                    ", and their control-token probabilities are read at their first tokens ("
                    + ", ".join(stands)
                    + ")"
                    if measured
                    else " (their first tokens are not among the control tokens: no positional "
                    "probes for them)"
                )
            )
        if self.eot is None:
            notes.append(
                "no end-of-turn token among the control tokens: no positional control-token probes"
            )
        return notes

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
                self._prompt_text[key] = tokenizer_of(self.trainer).decode(ids)
            return self._prompt_text[key]
        if isinstance(prompt, str):
            return prompt
        key = repr(prompt)
        if key not in self._prompt_text:
            kwargs = getattr(self.trainer, "chat_template_kwargs", None) or {}
            self._prompt_text[key] = tokenizer_of(self.trainer).apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=True, **kwargs
            )
        return self._prompt_text[key]


def mismatch_figures(rollouts: Sequence[RolloutRecord]) -> dict[str, float]:
    """The step's mismatch figures (core.mismatch: mismatch/*) over the rollouts with both
    sides, the trainer's logprobs and the generator's of the same tokens (tool results are NaN
    on the generator's side: left out); none where no rollout has both, never zeros."""
    sides = [
        mismatch.Sides(r.token_logprobs, r.generator_logprobs)
        for r in rollouts
        if r.generator_logprobs is not None
        and len(r.token_logprobs)
        and len(r.generator_logprobs) == len(r.token_logprobs)
    ]
    return mismatch.step_figures(sides)


def _decode_span(tokenizer: Any, ids: list[int], start: int, end: int) -> str:
    """The text of completion positions [start, end), special tokens kept."""
    return str(tokenizer.decode(ids[start:end]))


def tokenizer_of(trainer: Any) -> Any:
    processing = trainer.processing_class
    return getattr(processing, "tokenizer", None) or processing


def _meta(
    sample: Sample, names: list[str], truncated: bool, judgement: Judgement
) -> dict[str, Any]:
    """A rollout's meta before its structure is read: each reward function's value, whether it
    was cut off, its dataset row, the hooks' own keys and, where the judge said, whether its
    format was free."""
    meta: dict[str, Any] = {
        "rewards": dict(zip(names, sample.rewards, strict=False)),
        "truncated": truncated,
    }
    if sample.row:
        meta["row"] = sample.row
    meta.update(sample.meta or {})
    if judgement.format_free is not None:
        meta[vocab.FORMAT_FREE_KEY] = judgement.format_free
    return meta
