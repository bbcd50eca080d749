"""miles' debug dumps as its own code writes them, for tests (miles is not installed: it needs
Megatron and SGLang). radixark/miles at 31f1ca96:

- miles/utils/types.py lines 26–175: `Sample`'s fields (reproduced below with their defaults)
  and `to_dict` (its `__dict__`, `status` as its value, `spec_info` and `prefix_cache_info` as
  dicts);
- miles/ray/rollout/debug_data.py lines 103–118, `save_debug_rollout_data`:
  `torch.save(dict(rollout_id=rollout_id, metadata=metadata or {}, samples=[...to_dict()]))`;
- miles/utils/train_dump_utils.py lines 24–44, `save_debug_train_data_for_rank`:
  `torch.save(dict(rollout_id, rank, rollout_data, cp_rank, cp_size, qkv_format), path)` at
  `train_data/{rollout_id}_{rank}.pt`, `rollout_data` the rank's shard as the actor holds it
  after training: the columns miles/ray/rollout/train_data_conversion.py lines 16–47 and 72–120
  build (numpy arrays where its ValueSpec codec is "ndarray", lists otherwise), made tensors by
  miles/backends/training_utils/data.py lines 34–121 (`tokens` long, `loss_masks` int,
  `rollout_log_probs` float32), plus the trainer's `log_probs`, `advantages` and `returns`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tests import slime_dump

if TYPE_CHECKING:
    import torch


@dataclass
class Sample:
    """miles.utils.types.Sample's fields, in order, with their defaults."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: Any = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: Any = None
    multimodal_train_inputs: Any = None
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: Any = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: Any = None
    rollout_indexer_topk: Any = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    opd_reverse_kl: list[float] | None = None
    status: str = "completed"
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    train_metadata: dict | None = None
    adapter: Any = None
    reward_spec: Any = None
    routing_key: str | None = None
    non_generation_time: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return slime_dump.sample_dict(self)


def rollout(rng: random.Random, prompts: list[str], n: int, tool: bool) -> list[Sample]:
    """slime_dump's samples as miles' Sample (a tool result inside each response with `tool`)."""
    return [
        Sample(
            group_index=s.group_index,
            index=s.index,
            prompt=s.prompt,
            tokens=s.tokens,
            response=s.response,
            response_length=s.response_length,
            label=s.label,
            reward=s.reward,
            loss_mask=s.loss_mask,
            rollout_log_probs=s.rollout_log_probs,
            weight_versions=["3"],
        )
        for s in slime_dump.rollout(rng, prompts, n, tool)
    ]


def save_rollout(path: Path, rollout_id: int, samples: list[Sample]) -> None:
    """save_debug_rollout_data's torch.save."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"prompt_group_sizes": [sum(s.group_index == g for s in samples) for g in (0, 1)]}
    torch.save(
        dict(rollout_id=rollout_id, metadata=metadata, samples=[s.to_dict() for s in samples]),
        path,
    )


def shard(samples: list[Sample], rows: list[int], log_probs: list[torch.Tensor]) -> dict[str, Any]:
    """One data-parallel shard's rollout_data (its rows: positions in the rollout dump)."""
    import torch

    picked = [samples[k] for k in rows]
    rewards = [float(s.reward) for s in samples]
    mean = sum(rewards) / len(rewards)
    n = [s.response_length for s in picked]
    return {
        "tokens": [torch.tensor(s.tokens, dtype=torch.long) for s in picked],
        "response_lengths": np.asarray(n, dtype=np.int64),
        "total_lengths": [len(s.tokens) for s in picked],
        "rewards": np.asarray([rewards[k] - mean for k in rows], dtype=np.float32),
        "raw_reward": rewards,  # batch-global
        "truncated": np.zeros(len(rows), dtype=np.int64),
        "sample_indices": np.asarray([s.index for s in picked], dtype=np.int64),
        "rollout_ids": np.asarray([s.index for s in picked], dtype=np.int64),
        "loss_masks": [
            torch.tensor(s.loss_mask or [1] * s.response_length, dtype=torch.int) for s in picked
        ],
        "rollout_log_probs": [
            torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in picked
        ],
        "log_probs": [log_probs[k] for k in rows],
        "advantages": [torch.full((m,), rewards[k] - mean) for k, m in zip(rows, n, strict=True)],
        "returns": [torch.full((m,), rewards[k] - mean) for k, m in zip(rows, n, strict=True)],
    }


def save_train(
    folder: Path,
    rollout_id: int,
    samples: list[Sample],
    log_probs: list[torch.Tensor],
    *,
    cp_size: int = 1,
) -> list[Path]:
    """save_debug_train_data_for_rank on four ranks: two data-parallel shards (the rows split
    in a shuffled order), each on a pair of tensor-parallel ranks, the second of shard 1 a first
    pipeline stage (no log_probs, advantages or returns)."""
    import torch

    order = list(range(len(samples)))
    random.Random(rollout_id).shuffle(order)
    half = len(order) // 2
    shards = [shard(samples, order[:half], log_probs), shard(samples, order[half:], log_probs)]
    first_stage = {
        k: v for k, v in shards[1].items() if k not in ("log_probs", "advantages", "returns")
    }
    paths = []
    for rank, rollout_data in enumerate([shards[0], shards[0], shards[1], first_stage]):
        path = folder / f"{rollout_id}_{rank}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            dict(
                rollout_id=rollout_id,
                rank=rank,
                rollout_data=rollout_data,
                cp_rank=0,
                cp_size=cp_size,
                qkv_format="thd",
            ),
            path,
        )
        paths.append(path)
    return paths
