"""A step judged in the training process, read into its StepRecord where its sink is.

The capture's Samples (trainer/recorder/captured.py builds them) are judged in the training
process by the user's functions (trainer/recorder/preparing.py: a JudgedStep), and read here
(`StepReader.complete`): each rollout's place in the step, its prompt as the model saw it, its
completion's token pieces, the call tags' states and the positional control-token probes; then
the step's summary values and TRL's logs. A user's script's database sink reads its steps in
the writer's own process (trainer/recorder/sink_process.py): the reading, most of a step's
preparing and all of what grows with its tokens, holds no GIL of the training process. This
module loads no torch (the writer's process imports it: a contract in pyproject.toml).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from rollout_lens.server.core import mismatch, tokentext, vocab
from rollout_lens.server.core.records import ControlProbs, RolloutRecord, StepRecord
from rollout_lens.trainer.recorder import positional, tags, turns
from rollout_lens.trainer.recorder.judging import Judgement
from rollout_lens.trainer.recorder.summary import split_logs, summarize


@dataclass
class Sample:
    """One rollout as the capture read it off TRL: the write entity (`record`: ids, logprobs,
    control-token probabilities, total reward and advantage set; its place in the step, texts
    and judgement are set when its step is read) and what judging and reading it need."""

    record: RolloutRecord
    prompt: Any  # TRL's prompt: chat messages or text
    completion: Any  # TRL's completion: chat messages or text
    row: dict[str, Any]  # the dataset row's small columns (besides the prompt)
    rewards: list[float | None]  # each reward function's value (None: it gave none)
    meta: dict[str, Any]  # the hooks' (in-group supervision)
    tool_mask: list[int] | None = None  # TRL's tool loop: 1 on the model's tokens
    prompt_ids: list[int] | None = None  # the prompt as the model saw it (tool-calling)
    watched: list[float] | None = None  # the id-position probe's logprobs

    def read(self, logprobs: Any, control: Any, watched: list[float] | None) -> None:
        """A probe's readings of it: logprobs [n], control-token probabilities [n × k]."""
        record = self.record
        record.token_logprobs = logprobs
        if control is not None:
            tokens = record.control_probs.tokens
            record.control_probs = ControlProbs.of(control, len(record.completion_ids), tokens)
        self.watched = watched


@dataclass(frozen=True)
class Verdict:
    """What the training process said of one rollout with the user's functions: its text as
    judged, whether it was cut off, the judge's judgement and its target."""

    text: str
    truncated: bool
    judgement: Judgement
    target: str | None


@dataclass(eq=False)
class JudgedStep(StepRecord):
    """A step judged but not read yet: what the training thread hands a sink that reads steps
    itself (`StepReader.complete`: a script's writer process, a launched run's writer thread).
    As a StepRecord it is what the writer weighs and lightens: `rollouts` are its entities with
    their arrays (their texts, tokens and structure not read yet); `samples` and `verdicts` are
    theirs, one each, and go with them when the budget takes the rollouts (the step keeps
    `kept` then); `raw` the step's own parts (timing, logs, series)."""

    samples: list[Sample] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    kept: dict[str, float | None] = field(default_factory=dict)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "rollouts" and not value and "samples" in vars(self):  # the budget took them
            object.__setattr__(self, "samples", [])
            object.__setattr__(self, "verdicts", [])
        object.__setattr__(self, name, value)

    @property
    def text_bytes(self) -> int:
        """About what its rollouts' texts hold beside their arrays: each completion as TRL gave
        it and as judged."""
        return sum(2 * len(verdict.text) for verdict in self.verdicts)


class StepUnread(RuntimeError):
    """A step that could not be read into its StepRecord: a script's is dropped alone (the
    others written), a launched run fails at it, as at a step the database refuses."""


class StepReader:
    """Reads judged steps into StepRecords: each rollout's place in the step, its prompt as the
    model saw it, its completion's token pieces, the call tags' states and the positional
    control-token probes; then the step's summary values and TRL's logs. It holds no trainer
    and no user function (the tokenizer and the run's constants): it pickles, once, to a
    script's writer process that reads the steps there, off the training process (a launched
    run's writer thread reads them with it where it is)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        group_size: int,
        reward_names: list[str],
        template_kwargs: dict[str, Any],
        scored: bool,
        tool_calling: bool,
        unjudged: bool,
        vote_given: bool,
        formats: list[tags.CallTags],
        end_tokens: list[str],
        control_tokens: list[str],
        watched: list[str],
    ) -> None:
        self.tokenizer = tokenizer
        self.group_size = group_size
        self.reward_names = reward_names
        self.template_kwargs = template_kwargs
        self.scored = scored
        self.tool_calling = tool_calling
        self.unjudged = unjudged
        self.vote_given = vote_given
        self.formats = formats  # the call formats completions are read with
        self.end_tokens = end_tokens
        self.control_tokens = control_tokens
        self.watched = watched  # the id-position probe's tokens
        self.eot = next((t for t in end_tokens if t in control_tokens), None)  # end of turn
        self._tables: tuple[tags.TokenPieces, tags.TokenBytes] | None = None
        self._prompt_text: dict[str, str] = {}
        # (rollout step, values, series) of the last generation: a step that reuses it
        # (num_iterations > 1) shows the same rollout-derived values, never its logged ones.
        self._last_summary: tuple[int, dict[str, float | None], dict[str, float | None]] | None = (
            None
        )

    def __getstate__(self) -> dict[str, Any]:
        """What goes to the writer's process: its tables and prompts are made again there."""
        return {**vars(self), "_tables": None, "_prompt_text": {}}

    @property
    def token_pieces(self) -> tags.TokenPieces:
        return self._token_tables()[0]

    @property
    def token_bytes(self) -> tags.TokenBytes:
        return self._token_tables()[1]

    def _token_tables(self) -> tuple[tags.TokenPieces, tags.TokenBytes]:
        """Every id's piece and bytes (made on first use: a run's vocabulary, once)."""
        if self._tables is None:
            pieces = tags.TokenPieces(self.tokenizer)
            self._tables = (pieces, tags.TokenBytes(self.tokenizer, pieces))
        return self._tables

    def complete(self, step: StepRecord) -> StepRecord:
        """A judged step read into its StepRecord (any other StepRecord as it is)."""
        if not isinstance(step, JudgedStep):
            return step
        raw = step.raw
        pairs = zip(step.samples, step.verdicts, strict=True)
        rollouts = [self._rollout(i, sample, verdict) for i, (sample, verdict) in enumerate(pairs)]
        values: dict[str, float | None] = {}
        series: dict[str, float | None] = {}
        if rollouts:
            values, series = summarize(rollouts, self.group_size, self.control_tokens)
            if self.scored:  # the trainer's side is TRL's scoring pass
                series.update(mismatch_figures(rollouts))
            if self.unjudged and not self.tool_calling:
                values["vote_agreement"] = values["vote_entropy"] = None
            # copies: the logs below belong to this step only, not to a step reusing these
            self._last_summary = (step.rollout_step, dict(values), dict(series))
        elif step.kept:  # the budget took its rollouts: what it kept of them
            values.update(step.kept)
        elif self._last_summary is not None and self._last_summary[0] == step.rollout_step:
            values, series = dict(self._last_summary[1]), dict(self._last_summary[2])
        values.update(raw.get("kept") or {})  # what a lightened step kept of its rollouts
        values["wall_time"] = raw["wall_time"]
        columns, logged = split_logs(raw["logs"])
        values.update(columns)
        series.update(logged)
        series.update(raw.get("metrics") or {})
        return StepRecord(
            step=step.step,
            rollout_step=step.rollout_step,
            values=values,
            rollouts=rollouts,
            metrics=series,
        )

    def _rollout(self, i: int, sample: Sample, verdict: Verdict) -> RolloutRecord:
        """The capture's entity completed: its place in the step, texts and judgement."""
        record = sample.record
        ids = record.completion_ids.tolist()  # as the tokenizer takes them
        text, judgement = verdict.text, verdict.judgement
        tokens = self.token_pieces.of(record.completion_ids, ids)
        meta = _meta(sample, self.reward_names, verdict.truncated, judgement)
        vote, format_state, probes = self._structure(sample, ids, tokens, text, meta, judgement)
        watched = sample.watched
        if watched is not None:
            probes.update(
                positional.id_probes(
                    dict(zip(self.watched, watched, strict=True)),
                    sample.row.get("tool_ids") or [],
                    sample.row.get("target"),
                )
            )
        if probes:
            meta["probes"] = probes
        record.group, record.index = divmod(i, self.group_size)
        record.prompt = self._render_prompt(sample.prompt, sample.prompt_ids)
        record.completion = text
        record.vote = None if vote is None else str(vote)
        record.target = verdict.target
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
    ) -> tuple[str | None, str | None, dict[str, float | None]]:
        """The vote, the call tags' state (turn by turn with tools, into `meta`) and the
        positional control-token probes of one rollout."""
        tokenizer = self.tokenizer
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
            if vote is None and not self.vote_given:
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
        if form is None or not self._probing(form):
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

    def _render_prompt(self, prompt: Any, ids: list[int] | None = None) -> str:
        """The prompt as the model saw it (chat template applied), rendered once per text; with
        tools, its ids decoded (TRL rendered each prompt with its own tools)."""
        if ids is not None:
            key = repr(ids)
            if key not in self._prompt_text:
                self._prompt_text[key] = self.tokenizer.decode(ids)
            return self._prompt_text[key]
        if isinstance(prompt, str):
            return prompt
        key = repr(prompt)
        if key not in self._prompt_text:
            self._prompt_text[key] = self.tokenizer.apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=True, **self.template_kwargs
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
