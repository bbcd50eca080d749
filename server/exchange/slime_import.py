"""Read slime's debug dumps (and the rollout dumps of miles, its fork), which hold the rollout
engine's logprobs and, in the train dump, the trainer's.

With `--dump-details DIR`, slime (THUDM/slime at 624b824a, slime/utils/arguments.py lines
1890–1892) sets `--save-debug-rollout-data DIR/rollout_data/{rollout_id}.pt` and
`--save-debug-train-data DIR/train_data/{rollout_id}.pt`:

- the rollout dump (slime/observability/rollout_data_utils.py lines 140–152, called from
  slime/ray/rollout.py lines 500–505): `torch.save({"rollout_id", "samples": [Sample.to_dict()]})`,
  one sample a rollout in group order (slime/utils/types.py lines 93–227: `group_index`,
  `index`, `prompt`, `tokens` = prompt and response ids, `response`, `response_length`, `label`,
  `reward`, `loss_mask` over the response (None: all 1; 0 on tool results),
  `rollout_log_probs` over the response, `status` as its value); evaluation dumps are
  `eval_{rollout_id}.pt` (skipped). miles writes the same samples (miles/ray/rollout/
  debug_data.py lines 103–118, radixark/miles at 31f1ca96) plus `metadata`.
- slime's train dump (slime/observability/train_data_utils.py lines 117–225, format_version 2):
  `samples`, one dict a training sample with its `rollout_position` (its index in the rollout
  dump) and the per-sample columns as tensors: `log_probs` (the trainer's, over the response),
  `advantages`, `rollout_log_probs`, `loss_masks`, `response_lengths`, …

miles' train dumps differ: one file a rank, `train_data/{rollout_id}_{rank}.pt`, its rows joined
to the rollout dump's samples by sample index (server/exchange/miles_train.py). Files are read
without torch (server.exchange.torch_file). A step is rollout_id + 1. Without a train dump (only
--save-debug-rollout-data) the rollouts carry the engine's side alone: no trainer logprobs, no
mismatch figures.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.core.records import NO_FLOATS, StepRecord
from rollout_lens.server.exchange import miles_train, torch_file
from rollout_lens.server.exchange.dump_files import DumpFile, Unit, numbered
from rollout_lens.server.exchange.dump_import import RunPlan
from rollout_lens.server.exchange.dump_rows import (
    detect_group_size,
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

FILE_NAME = re.compile(r"^(\d+)\.pt$")  # eval_{id}.pt does not match: evaluation is skipped
ROLLOUT = ("group_index", "index", "prompt", "tokens", "response", "response_length", "reward")


@dataclass(frozen=True)
class SlimeSample:
    group: int
    prompt: str
    completion: str
    label: str | None
    reward: float
    sided: Sided
    advantage: float
    trained: bool  # the trainer's side is there (a train dump)


def _listed(value: Any) -> Any:
    """A tensor (read as a numpy array) as the list slime's Sample fields usually are."""
    return value.tolist() if isinstance(value, np.ndarray) else value


def _payload(path: Path, what: str) -> list[dict[str, Any]]:
    data = torch_file.load(path)
    if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
        raise InvalidInput(f"{path}: no samples list: not slime's {what} dump")
    if not all(isinstance(s, dict) for s in data["samples"]):
        raise InvalidInput(f"{path}: a sample is not a dict: not slime's {what} dump")
    return list(data["samples"])


def _reward(raw: dict[str, Any], key: str | None, where: str) -> float:
    """The sample's reward: a number, or with `key` (slime's --reward-key) that key of a dict."""
    reward = raw["reward"]
    if key is not None and isinstance(reward, dict):
        if key not in reward:
            raise InvalidInput(
                f"{where}: reward has no key {key!r} (its keys: {sorted(reward)[:8]})"
            )
        reward = reward[key]
    if isinstance(reward, bool) or number(reward) is None:
        raise InvalidInput(
            f"{where}: reward is {type(reward).__name__} {reward!r}, not a number "
            "(a reward dict needs the --reward-key slime ran with)"
        )
    return float(reward)


def rollout_sample(raw: dict[str, Any], where: str) -> tuple[Sided, dict[str, Any]]:
    """A rollout dump's sample: its response's ids, the engine's logprobs and the loss mask
    (the trainer's side empty until a train dump fills it), and its checked fields."""
    missing = [k for k in ROLLOUT if k not in raw]
    if missing:
        raise InvalidInput(f"{where}: no {', '.join(missing)}: not one of slime's samples")
    n = raw["response_length"]
    tokens = integers(_listed(raw["tokens"]), where, "tokens")
    if type(n) is not int or not 0 < n <= len(tokens):
        raise InvalidInput(f"{where}: response_length {n!r} is not a length within its tokens")
    mask = raw.get("loss_mask")
    keep = flags(_listed(mask), where, "loss_mask") if mask is not None else np.ones(n, bool)
    given = raw.get("rollout_log_probs")
    engine = (
        floats(_listed(given), where, "rollout_log_probs", missing=True)
        if given is not None
        else np.full(n, np.nan)
    )
    ids = tokens[-n:]
    same_length(where, response=ids, loss_mask=keep, rollout_log_probs=engine)
    if not isinstance(raw["response"], str):
        raise InvalidInput(f"{where}: response is not text")
    if type(raw["group_index"]) is not int:
        raise InvalidInput(f"{where}: group_index {raw['group_index']!r} is not a number")
    return Sided(ids, np.full(n, np.nan), engine, keep), raw


def with_trainer(sided: Sided, raw: dict[str, Any], where: str) -> tuple[Sided, float]:
    """The train dump's sample joined to its rollout: the trainer's logprobs and advantage."""
    trainer = floats(_listed(raw.get("log_probs")), where, "log_probs", missing=False)
    advantages = np.asarray(_listed(raw.get("advantages")), dtype=np.float64).reshape(-1)
    same_length(where, response=sided.ids, log_probs=trainer, advantages=advantages)
    if not np.isfinite(advantages).all():
        raise InvalidInput(f"{where}: advantages holds a value that is not a finite number")
    first = np.flatnonzero(sided.mask)
    advantage = float(advantages[first[0]]) if len(first) else 0.0
    return Sided(sided.ids, trainer, sided.generator, sided.mask), advantage


def _slime_rows(train: Path, rollout: Path, count: int) -> dict[int, dict[str, Any]]:
    """slime's train dump: each sample by its `rollout_position` in the rollout dump."""
    joined: dict[int, dict[str, Any]] = {}
    for k, raw in enumerate(_payload(train, "train")):
        position = raw.get("rollout_position")
        if type(position) is not int or not 0 <= position < count or position in joined:
            raise InvalidInput(
                f"{train} sample {k}: rollout_position {position!r} does not name one "
                f"sample of the {count} in {rollout.name}"
            )
        joined[position] = raw
    return joined


def _joined(
    rollout: Path, train: Sequence[Path], rows: list[dict[str, Any]]
) -> dict[int, dict[str, Any]]:
    """The trainer's rows by rollout-dump position: slime's one train dump, or miles' one a
    rank (server.exchange.miles_train), joined by the samples' index."""
    if not train:
        return {}
    if not all(miles_train.FILE_NAME.match(path.name) for path in train):
        if len(train) == 1:
            return _slime_rows(train[0], rollout, len(rows))
        raise InvalidInput(
            f"{train[0].parent}: train dumps of rollout {rollout.stem} named both as slime's "
            "({rollout_id}.pt) and as miles' ({rollout_id}_{rank}.pt)"
        )
    positions: dict[int, int] = {}
    for k, raw in enumerate(rows):
        index = raw.get("index")
        if type(index) is int and index not in positions:
            positions[index] = k
    return miles_train.rows(list(train), positions)


def read_step(
    rollout: Path, train: Sequence[Path] = (), reward_key: str | None = None
) -> list[SlimeSample]:
    """A step's samples in the rollout dump's order, joined with the train dumps' when given
    (slime's by `rollout_position`, miles' by sample index): InvalidInput for anything not in
    their formats."""
    rows = _payload(rollout, "rollout")
    joined = _joined(rollout, train, rows)
    source = train[0] if len(train) == 1 else train[0].parent if train else None
    out = []
    for k, raw in enumerate(rows):
        where = f"{rollout} sample {k}"
        sided, fields = rollout_sample(raw, where)
        reward = _reward(fields, reward_key, where)
        advantage, trained = 0.0, k in joined
        if trained:
            sided, advantage = with_trainer(sided, joined[k], f"{source} sample for {k}")
        out.append(_sample(fields, reward, sided, advantage, trained))
    return out


def _sample(
    raw: dict[str, Any], reward: float, sided: Sided, advantage: float, trained: bool
) -> SlimeSample:
    prompt = raw["prompt"]
    label = raw.get("label")
    return SlimeSample(
        group=raw["group_index"],
        prompt=prompt if isinstance(prompt, str) else keys([prompt])[0],
        completion=raw["response"],
        label=None if label is None else str(label)[:64],
        reward=reward,
        sided=sided,
        advantage=advantage,
        trained=trained,
    )


def two_sided_step(
    step: int, samples: list[SlimeSample], group_size: int, where: str
) -> TwoSidedStep:
    places = positions([str(s.group) for s in samples], group_size, where, "samples", "group size")
    rollouts = []
    for s, (group, index) in zip(samples, places, strict=True):
        rollout = token_rollout(
            s.sided,
            group=group,
            index=index,
            prompt=s.prompt,
            completion=s.completion,
            target=s.label,
            verifier_reward=s.reward,
            true_score=None,
            advantage=s.advantage,
            meta={},
        )
        if not s.trained:
            rollout.token_logprobs = NO_FLOATS  # the trainer's side was not dumped
        rollouts.append(rollout)
    record = StepRecord(
        step=step,
        rollout_step=step,
        values=step_values(rollouts, group_size),
        rollouts=rollouts,
        metrics=step_metrics([s.sided for s in samples if s.trained]),
    )
    return TwoSidedStep(
        record, [s.sided.generator for s in samples], [s.sided.mask for s in samples]
    )


class SlimeDump:
    """A `--dump-details` folder (rollout_data/ and train_data/), or a folder of rollout dumps
    alone, read step by step (server.exchange.dump_import's DumpFormat)."""

    source = RunSource.slime_import
    folder_key = "slime_dump_dir"

    def __init__(
        self,
        folder: Path,
        *,
        name: str | None = None,
        group_size: int | None = None,
        reward_key: str | None = None,
    ) -> None:
        if group_size is not None and group_size < 1:
            raise InvalidInput(f"group size must be at least 1, not {group_size}")
        self.folder = folder
        self.name = name
        self.reward_key = reward_key
        nested = (folder / "rollout_data").is_dir()
        self.rollouts = folder / "rollout_data" if nested else folder
        self.train = folder / "train_data" if nested else None
        self.group_size = group_size
        self.empty = f"{self.rollouts}: no {{rollout_id}}.pt files (slime's --dump-details)"

    def scan(self) -> list[DumpFile]:
        """Each dump as the step rollout_id + 1 (a run's steps start at 1)."""
        found = [
            DumpFile(f.path, f.step + 1, "rollout") for f in numbered(self.rollouts, FILE_NAME)
        ]
        if self.train is not None and self.train.is_dir():
            for pattern in (FILE_NAME, miles_train.FILE_NAME):  # slime's, miles' (one a rank)
                found += [DumpFile(f.path, f.step + 1) for f in numbered(self.train, pattern)]
        return sorted(found, key=lambda f: f.step)

    def wants_more(self, unit: Unit) -> bool:
        # slime writes a step's rollout dump before it trains on it, its train dump after
        return unit.of("rollout") is None or (self.train is not None and unit.of("train") is None)

    def _read(self, unit: Unit) -> list[SlimeSample]:
        rollout = unit.of("rollout")
        train = [f.path for f in unit.files if f.kind == "train"]
        if rollout is None:
            raise InvalidInput(f"{train[0]}: a train dump without its rollout dump")
        return read_step(rollout.path, train, self.reward_key)

    def check(self, unit: Unit) -> list[int]:
        return run_lengths([str(s.group) for s in self._read(unit)])

    def plan(self, checked: Sequence[list[int]]) -> RunPlan:
        self.group_size = self.group_size or detect_group_size(
            [n for c in checked for n in c], str(self.folder), "the group size", "--group-size N"
        )
        folder = self.folder.resolve()
        notes = [
            f"imported from slime's or miles' debug dumps in {folder} ({{rollout_id}}.pt; step = "
            "rollout_id + 1; slime's train dump joined by rollout_position, miles' "
            "{rollout_id}_{rank}.pt by sample index)",
            "Σ logprob and the token logprobs are the trainer's (train dump `log_probs`); the "
            "engine's (rollout dump `rollout_log_probs`) give the mismatch figures",
        ]
        if self.train is None:
            notes.append("no train dumps: the trainer's logprobs are unknown, no mismatch figures")
        return RunPlan(
            name=self.name or f"slime {folder.name}",
            model="unknown",
            group_size=self.group_size,
            config={
                self.folder_key: str(folder),
                "group_size": self.group_size,
                "reward_key": self.reward_key,
            },
            notes=notes,
        )

    def adopt(self, run: Any) -> None:
        config = run.config or {}
        stored = int(config.get("group_size") or run.group_size)
        for option, given, kept in (
            ("--group-size", self.group_size, stored),
            ("--reward-key", self.reward_key, config.get("reward_key")),
        ):
            if given is not None and given != kept:
                raise InvalidInput(
                    f"run {run.id} ({run.name}) follows {self.folder} with {option} {kept}, "
                    f"not {given}: leave it out to resume that run"
                )
        self.group_size, self.reward_key = stored, config.get("reward_key")

    def read(self, unit: Unit) -> TwoSidedStep:
        assert self.group_size is not None
        return two_sided_step(unit.step, self._read(unit), self.group_size, str(self.folder))

    def record(self, unit: Unit) -> StepRecord:
        return self.read(unit).record
