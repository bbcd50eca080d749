"""Read NeMo-RL's per-step training dumps, which hold both sides of every sampled token.

NeMo-RL's GRPO loop (nemo_rl/algorithms/grpo.py, NVIDIA-NeMo/RL at 7ea279ab, lines 3631–3654;
the async loop the same at 5259–5282) writes after every step, into the logger's log dir,
`train_data_step{N}.jsonl` (N counts from 1) through Logger.log_batched_dict_as_jsonl
(nemo_rl/utils/logger.py, lines 1071–1098): one line a sample, cut from the batch by
`make_microbatch_iterator(1)`, so each key holds a one-element list: `content` (the sample's
messages' texts), `rewards`, `input_lengths`, `token_ids` (the whole conversation, right-padded
to the batch's length), `token_loss_mask` (1 on the assistant's tokens), `sample_loss_mask`,
`advantages` (the sample's advantage at every token), `generation_logprobs` (the inference
engine's logprob of each token; zeros where it generated none) and `prev_logprobs` (the
trainer's, from its forward pass before the update), plus `idx`. Samples of one prompt are
consecutive (`repeat_interleave` by num_generations_per_prompt). Older dumps without token ids,
masks and advantages (NVIDIA/NeMo-RL at 54bec9d1, June 2025, grpo.py lines 688–694 wrote only
content, rewards, input_lengths and the two logprobs) are refused, saying so.

A sample's completion is its tokens from the first assistant token to its input length; the
masked stretches inside (environment and tool results) stay in it, masked out of the figures as
NeMo-RL masks them out of the loss.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.exchange import bounds
from rollout_lens.server.exchange.dump_files import DumpFile, Incomplete, Unit, numbered
from rollout_lens.server.exchange.dump_import import RunPlan
from rollout_lens.server.exchange.dump_rows import (
    BLANK,
    detect_group_size,
    dump_line,
    json_line,
    keys,
    number,
    positions,
    run_lengths,
    step_values,
)
from rollout_lens.server.exchange.two_sided import (
    Sided,
    TwoSidedStep,
    flags,
    floats,
    integers,
    same_length,
    step_metrics,
    token_rollout,
)
from rollout_lens.server.store.models import RunSource

FILE_NAME = re.compile(r"^train_data_step(\d+)\.jsonl$")
ARRAYS = ("token_ids", "token_loss_mask", "advantages", "generation_logprobs", "prev_logprobs")
SCALARS = ("rewards", "input_lengths", "sample_loss_mask")
REQUIRED = ("content", *SCALARS, *ARRAYS)


@dataclass(frozen=True)
class NemoSample:
    """One line of a NeMo-RL training dump, checked."""

    prompt: str
    completion: str
    sided: Sided
    reward: float
    advantage: float
    sample_weight: float  # sample_loss_mask: 0 for a sample NeMo-RL left out of the loss


def read_step(file: DumpFile) -> list[NemoSample]:
    """A dump file's samples in order; Incomplete when it does not read whole, InvalidInput
    naming the file and line for anything not in NeMo-RL's format."""
    path = file.path
    samples = []
    try:
        with path.open("rb") as f:
            for line, raw in bounds.lines(f, str(path)):
                if not raw.endswith(b"\n"):
                    raise Incomplete(f"{path} line {line}: ends mid-line (cut short?)")
                where = f"{path} line {line}"
                row = json_line(raw, where)
                if row is not BLANK:
                    samples.append(sample(row, where))
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot be read ({exc.strerror})") from exc
    if not samples:
        raise Incomplete(f"{path}: empty (still being written?)")
    return samples


def _one(row: dict[str, Any], key: str, where: str) -> Any:
    """A key's value: NeMo-RL writes each as a one-element list (a microbatch of one)."""
    value = row[key]
    if not isinstance(value, list) or len(value) != 1:
        raise InvalidInput(f"{where}: {key} is not a one-element list (NeMo-RL's microbatch of 1)")
    return value[0]


def sample(row: Any, where: str) -> NemoSample:
    """One line, checked against NeMo-RL's training dump format."""
    row = dump_line(
        row,
        REQUIRED,
        where,
        what="a NeMo-RL train_data_step line with both sides and their masks",
        hint="older NeMo-RL wrote neither token ids nor masks: its dumps cannot say which tokens "
        "the model sampled",
    )
    ids = integers(_one(row, "token_ids", where), where, "token_ids")
    mask = flags(_one(row, "token_loss_mask", where), where, "token_loss_mask")
    generator = floats(
        _one(row, "generation_logprobs", where), where, "generation_logprobs", missing=True
    )
    trainer = floats(_one(row, "prev_logprobs", where), where, "prev_logprobs", missing=False)
    advantages = floats_any(_one(row, "advantages", where), where, "advantages")
    width = same_length(
        where,
        token_ids=ids,
        token_loss_mask=mask,
        advantages=advantages,
        generation_logprobs=generator,
        prev_logprobs=trainer,
    )
    length = _one(row, "input_lengths", where)
    if type(length) is not int or not 0 < length <= width:
        raise InvalidInput(f"{where}: input_lengths {length!r} is not a length within {width}")
    sampled = np.flatnonzero(mask[:length])
    if not len(sampled):
        raise InvalidInput(f"{where}: no assistant token (token_loss_mask is 0 up to its length)")
    start = int(sampled[0])
    keep = mask[start:length]
    sided = Sided(
        ids=ids[start:length],
        trainer=trainer[start:length],
        generator=np.where(keep, generator[start:length], np.nan),  # zeros: none generated
        mask=keep,
    )
    prompt, completion = _texts(_one(row, "content", where), mask[:length], where)
    return NemoSample(
        prompt=prompt,
        completion=completion,
        sided=sided,
        reward=_finite(row, "rewards", where),
        advantage=float(advantages[start]),
        sample_weight=_finite(row, "sample_loss_mask", where),
    )


def floats_any(values: Any, where: str, what: str) -> np.ndarray:
    """Finite numbers of any sign (advantages)."""
    if not isinstance(values, list) or len(values) > bounds.MAX_TOKENS:
        raise InvalidInput(
            f"{where}: {what} is not a list of at most {bounds.MAX_TOKENS:,} numbers"
        )
    if not all(type(v) in (int, float) and number(v) is not None for v in values):
        raise InvalidInput(f"{where}: {what} holds a value that is not a finite number")
    return np.asarray(values, dtype=np.float64)


def _finite(row: dict[str, Any], key: str, where: str) -> float:
    value = _one(row, key, where)
    if isinstance(value, bool) or number(value) is None:
        raise InvalidInput(f"{where}: {key} is {value!r}, not a finite number")
    return float(value)


def _texts(content: Any, mask: np.ndarray, where: str) -> tuple[str, str]:
    """(prompt, completion) from the sample's messages' texts. The dump does not say which
    message is whose, so they are counted from the mask: each run of 1s is one assistant
    message, each run of 0s after the first a result message between or after them; every
    message before those is the prompt."""
    if not isinstance(content, list) or not all(isinstance(c, str) for c in content):
        raise InvalidInput(f"{where}: content is not a list of message texts")
    edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    runs = np.split(mask, edges)
    first = next(i for i, run in enumerate(runs) if run[0])
    replies = len(runs) - first  # every run from the first assistant message on
    if replies >= len(content):
        raise InvalidInput(
            f"{where}: {len(content)} message texts for a prompt and {replies} reply messages"
        )
    return "".join(content[: len(content) - replies]), "".join(content[len(content) - replies :])


def two_sided_step(
    step: int, samples: list[NemoSample], group_size: int, where: str
) -> TwoSidedStep:
    """A step's samples as the import path takes them, the generator's side beside."""
    places = positions(keys(s.prompt for s in samples), group_size, where, "lines", "group size")
    rollouts = [
        token_rollout(
            s.sided,
            group=group,
            index=index,
            prompt=s.prompt,
            completion=s.completion,
            target=None,
            verifier_reward=s.reward,
            true_score=None,
            advantage=s.advantage,
            meta={} if s.sample_weight == 1 else {"sample_loss_mask": s.sample_weight},
        )
        for s, (group, index) in zip(samples, places, strict=True)
    ]
    record = StepRecord(
        step=step,
        rollout_step=step,
        values=step_values(rollouts, group_size),
        rollouts=rollouts,
        metrics=step_metrics([s.sided for s in samples]),
    )
    return TwoSidedStep(
        record, [s.sided.generator for s in samples], [s.sided.mask for s in samples]
    )


class NemoRlDump:
    """A NeMo-RL log dir's training dumps, read step by step (server.exchange.dump_import's
    DumpFormat); `read` gives a step with the generator's side beside its StepRecord."""

    source = RunSource.nemo_rl_import
    folder_key = "nemo_rl_log_dir"

    def __init__(
        self, folder: Path, *, name: str | None = None, group_size: int | None = None
    ) -> None:
        if group_size is not None and group_size < 1:
            raise InvalidInput(f"group size must be at least 1, not {group_size}")
        self.folder = folder
        self.name = name
        self.group_size = group_size
        self.empty = f"{folder}: no train_data_step{{N}}.jsonl files (NeMo-RL's logger writes them)"

    def scan(self) -> list[DumpFile]:
        return numbered(self.folder, FILE_NAME)

    def check(self, unit: Unit) -> list[int]:
        """The step's runs of identical prompts (its file read whole and checked)."""
        file = unit.of("train")
        assert file is not None
        return run_lengths(keys(s.prompt for s in read_step(file)))

    def wants_more(self, unit: Unit) -> bool:
        return False  # one file a step

    def plan(self, checked: Sequence[list[int]]) -> RunPlan:
        lengths = [n for c in checked for n in c]
        detected = self.group_size is None
        self.group_size = self.group_size or detect_group_size(
            lengths, str(self.folder), "the group size", "--group-size N"
        )
        folder = self.folder.resolve()
        notes = [
            f"imported from NeMo-RL's training dumps in {folder} (train_data_step{{N}}.jsonl)",
            "Σ logprob and the token logprobs are the trainer's (prev_logprobs); the inference "
            "engine's (generation_logprobs) give the mismatch figures",
            "no control-token probabilities, targets or true scores: NeMo-RL's dump has none",
        ]
        if detected:
            notes.append(f"group size {self.group_size}: detected from runs of identical prompts")
        return RunPlan(
            name=self.name or f"NeMo-RL {folder.name}",
            model="unknown",
            group_size=self.group_size,
            config={self.folder_key: str(folder), "group_size": self.group_size},
            notes=notes,
        )

    def adopt(self, run: Any) -> None:
        stored = int((run.config or {}).get("group_size") or run.group_size)
        if self.group_size is not None and self.group_size != stored:
            raise InvalidInput(
                f"run {run.id} ({run.name}) follows {self.folder} with --group-size {stored}, "
                f"not {self.group_size}: leave it out to resume that run"
            )
        self.group_size = stored

    def read(self, unit: Unit) -> TwoSidedStep:
        file = unit.of("train")
        assert file is not None and self.group_size is not None
        return two_sided_step(unit.step, read_step(file), self.group_size, str(file.path))

    def record(self, unit: Unit) -> StepRecord:
        return self.read(unit).record
