"""One generation's rollouts as the capture keeps them on the training thread, and their Samples.

The capture (trainer/recorder/capture.py) keeps what TRL hands it by reference (its lists, the
dataset rows) or copied off the device once a tensor (ids, rewards, advantages, the generator's
logprobs; the probe copies each chunk it read once), and does nothing a rollout but find each
one's reading. `Captured.samples` builds each rollout's Sample from that (the write entity with
its arrays, and what judging it needs) once, on the thread that first asks: the writer's for a
user's script, the training thread only where a hook wants the rollouts as soon as they are
scored (a launched run's failures for SFT).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rollout_lens.server.core.records import ControlProbs, RolloutRecord
from rollout_lens.trainer.recorder import turns
from rollout_lens.trainer.recorder.probe import ForwardRow, SamplingProbe
from rollout_lens.trainer.recorder.reading import Sample

# Arrays a rollout was read with: logprobs [n], control-token probabilities [n × k] (None: not
# read) and the watched logprobs; or the forward probe's row, turned into those when built.
Arrays = tuple[Any, Any, list[float] | None]
Reading = ForwardRow | Arrays | None

MAX_LIST = 64  # a list column is kept when it is this short and holds scalars only


@dataclass(eq=False)
class Captured:
    """This process's rollouts of one generation, in group order, as TRL handed them: its lists
    by reference, its tensors as host copies (`tensors`: those of `completion_ids`,
    `sampling_per_token_logps`, `tool_mask`, and with tools `prompt_ids` and `prompt_mask`, that
    TRL's output has), and each row's reading (`readings`; None until read)."""

    inputs: list[dict[str, Any]]  # the dataset rows, one per completion
    completions: list[Any]  # TRL's completions: chat messages or text
    ids: Sequence[Sequence[int]]  # TRL's completion ids, a list a row
    rewards: Any  # [n × reward functions] on the host (NaN: a function gave none)
    weights: list[float]  # the reward functions' weights
    advantages: Any  # [n] on the host
    control_tokens: list[str]  # the run's, in the entity's column order
    tensors: dict[str, Any]
    readings: list[Reading]
    tool_calling: bool = False
    tool_mask: list[list[int]] | None = None  # from TRL's tool loop, unpadded
    prompt_ids: list[list[int]] | None = None  # the first generation call's prompts
    row_meta: dict[int, dict[str, Any]] = field(default_factory=dict)  # the hooks' meta a row
    # transformers' generation: each call's SamplingProbe (its readings on the host) and the
    # ids it returned, and the rows the hooks replaced (an expert reply, not sampled)
    sampling: list[tuple[SamplingProbe, list[list[int]]]] = field(default_factory=list)
    swapped: set[int] = field(default_factory=set)
    _samples: list[Sample] | None = field(default=None, repr=False)

    def samples(self) -> list[Sample]:
        """Each rollout's Sample, built on the first call."""
        if self._samples is None:
            self._samples = self._build()
        return self._samples

    def read(self, readings: Sequence[Reading]) -> None:
        """The rows' readings taken after capture (off the loss passes); into the Samples
        themselves when a hook had them built already."""
        self.readings = list(readings)
        if self._samples is None:
            return
        for sample, reading in zip(self._samples, readings, strict=True):
            n = len(sample.record.completion_ids)
            found = _arrays(reading, n, sample.tool_mask)
            if found is not None:
                sample.read(*found)

    def total_rewards(self) -> np.ndarray:
        """Each rollout's total reward [n], its functions' weighted sum over those that gave
        one (as `_build` sets each record's), without building the Samples."""
        rewards = np.asarray(self.rewards, dtype=np.float64)  # [n × functions], NaN: none given
        return np.nansum(rewards * np.asarray(self.weights), axis=1)

    def _build(self) -> list[Sample]:
        ids_list = self.ids
        rewards = self.rewards.tolist()
        advantages = self.advantages.tolist()
        masks = self._masks()
        id_rows = _id_rows(self.tensors.get("completion_ids"), ids_list)
        generator = self._sampled_rows()
        if generator is None:
            generator = _generator_rows(
                self.tensors.get("sampling_per_token_logps"),
                self.tensors.get("tool_mask"),
                ids_list,
            )
        prompt_ids = self._prompt_rows()
        samples = []
        for i, row in enumerate(self.inputs):
            values = [None if math.isnan(v) else float(v) for v in rewards[i]]
            total = sum(w * v for w, v in zip(self.weights, values, strict=True) if v is not None)
            n = len(ids_list[i])
            found = _arrays(self.readings[i], n, masks[i])
            logprobs, control, watched = found if found is not None else (np.zeros(0), None, None)
            record = RolloutRecord.captured(
                completion_ids=id_rows[i],
                token_logprobs=logprobs,
                control_probs=_control(control, n, self.control_tokens),
                verifier_reward=total,
                advantage=float(advantages[i]),
                generator_logprobs=generator[i],
            )
            samples.append(
                Sample(
                    record,
                    prompt=row.get("prompt"),
                    completion=self.completions[i],
                    row=_plain_columns(row),
                    rewards=values,
                    meta=self.row_meta.get(i, {}),
                    tool_mask=masks[i],
                    prompt_ids=prompt_ids[i] if prompt_ids else None,
                    watched=watched,
                )
            )
        return samples

    def _sampled_rows(self) -> list[np.ndarray | None] | None:
        """Each row's generator logprobs [n] as the sampling probes read them (one call, or
        stitched turn by turn with tools, NaN on tool results), None for a row the hooks
        replaced; None where no probe read any (vLLM, a rollout_func: TRL's own are taken)."""
        read: list[np.ndarray] | None = None
        if self.sampling and self.tool_mask is not None:
            read = turns.stitch_sampled(self.sampling, self.ids, self.tool_mask)
        elif len(self.sampling) == 1 and self.sampling[0][0].used:
            read = self.sampling[0][0].sampled(self.ids)
        if read is None:
            return None
        return [
            None if i in self.swapped or len(row) != len(ids) else row
            for i, (row, ids) in enumerate(zip(read, self.ids, strict=True))
        ]

    def _masks(self) -> list[list[int] | None]:
        """Each row's tool_mask: None unless TRL's tool loop ran (and the mask fits the ids)."""
        found = self.tool_mask or []
        return [
            found[i] if i < len(found) and len(found[i]) == len(ids) else None
            for i, ids in enumerate(self.ids)
        ]

    def _prompt_rows(self) -> list[list[int]] | None:
        """Each row's prompt ids as the model saw them (tool-calling runs only)."""
        if not self.tool_calling:
            return None
        if self.prompt_ids is not None:
            return self.prompt_ids
        prompts, masks = self.tensors["prompt_ids"], self.tensors["prompt_mask"]
        return [ids[mask.bool()].tolist() for ids, mask in zip(prompts, masks, strict=True)]


def unread(captured: Captured) -> int:
    """How many of its rows the forward probe did not read whole."""
    return sum(
        1
        for reading, ids in zip(captured.readings, captured.ids, strict=True)
        if not isinstance(reading, ForwardRow) or not reading.whole(len(ids))
    )


def _arrays(reading: Reading, n: int, tool_mask: Sequence[int] | None) -> Arrays | None:
    """A row's reading as arrays (None: not read)."""
    if isinstance(reading, ForwardRow):
        return reading.arrays(n, tool_mask)
    return reading


def _id_rows(found: Any, ids_list: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Each row's ids as int64 arrays: views of TRL's right-padded `completion_ids` (`found`,
    copied off the device once for the generation), paired with TRL's lists by their lengths
    and ends; else each list converted."""
    shape: tuple[int, ...] = tuple(getattr(found, "shape", ()))
    if found is not None and len(shape) == 2 and shape[0] == len(ids_list):
        padded = found.numpy().astype(np.int64, copy=False)
        if all(len(ids) <= padded.shape[1] for ids in ids_list):
            rows = [padded[i, : len(ids)] for i, ids in enumerate(ids_list)]
            ends = [(ids[0], ids[-1]) for ids in ids_list if ids]
            if ends == [(int(r[0]), int(r[-1])) for r in rows if len(r)]:
                return rows
    return [np.asarray(ids, dtype=np.int64) for ids in ids_list]


def _generator_rows(
    found: Any, tool: Any, ids_list: Sequence[Sequence[int]]
) -> list[np.ndarray | None]:
    """Each row's generator logprobs: TRL's `sampling_per_token_logps` (`found`: vLLM's
    sampling logprobs, or the `logprobs` a rollout_func returned; NaN where it gave none) as
    float64, NaN where TRL's tool mask (`tool`) is off (a tool or environment result, not
    sampled); None for every row where TRL has none (transformers' generate and continuous
    batching: the sampling probes' rows are taken there), never zeros."""
    shape: tuple[int, ...] = tuple(getattr(found, "shape", ()))
    if found is None or len(shape) != 2 or shape[0] != len(ids_list):
        return [None] * len(ids_list)
    rows = found.double().numpy()
    off = None if tool is None else tool.numpy() == 0
    out: list[np.ndarray | None] = []
    for i, ids in enumerate(ids_list):
        if len(ids) > shape[1]:
            out.append(None)
            continue
        row = rows[i, : len(ids)].copy()
        if off is not None:
            row[off[i, : len(ids)]] = np.nan
        out.append(row)
    return out


def _control(control: Any, n: int, tokens: list[str]) -> ControlProbs:
    """A rollout's control-token probabilities as the entity holds them, a column per control
    token of the run (none read: no rows)."""
    if control is None:
        return ControlProbs(tokens, np.zeros((0, len(tokens))))
    return ControlProbs.of(control, n, tokens)


def _plain_columns(row: dict[str, Any]) -> dict[str, Any]:
    """The dataset row's small columns (besides the prompt), kept with the rollout: scalars, and
    short lists of scalars (the tools an episode needs, say)."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if key == "prompt":
            continue
        if isinstance(value, list | tuple):
            items = [_scalar(v) for v in value]
            if len(value) <= MAX_LIST and all(v is not _SKIP for v in items):
                out[key] = items
        elif (plain := _scalar(value)) is not _SKIP:
            out[key] = plain
    return out


_SKIP = object()


def _scalar(value: Any) -> Any:
    """A JSON-safe copy of a scalar column value (long text cut), or _SKIP."""
    if isinstance(value, str):
        return value if len(value) <= 2000 else value[:2000] + "…"
    if isinstance(value, float):
        return value if math.isfinite(value) else None  # JSON has no NaN
    if isinstance(value, bool | int) or value is None:
        return value
    return _SKIP
