"""slime's debug dumps as its own code writes them, for tests (slime is not installed: it needs
Megatron and SGLang). THUDM/slime at 624b824a:

- slime/utils/types.py lines 93–227: `Sample`'s fields and `to_dict` (its `__dict__`, `status`
  as its value, `spec_info` and `prefix_cache_info` as dicts), reproduced below;
- slime/observability/rollout_data_utils.py lines 140–152, `save_debug_rollout_data`:
  `torch.save({"rollout_id": id, "samples": [s.to_dict() for s in data]}, path)`;
- slime/ray/rollout.py lines 657–683 and rollout_data_utils.py lines 12–50: the train data's
  columns (`tokens` int64, `loss_masks` int32, `rollout_log_probs` float32 tensors, one a
  sample), the trainer's `log_probs` and `advantages` added by the actor;
- slime/observability/train_data_utils.py lines 117–188, `_build_dump_payload` for one data
  parallel rank: a dict a sample of every per-sample column, `partition` as its
  `rollout_position`, sorted by it, and `format_version` 2.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class Sample:
    """slime.utils.types.Sample's fields, in order, with their defaults."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: Any = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: Any = None
    multimodal_train_inputs: Any = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: Any = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: Any = None
    rollout_top_p_token_offsets: Any = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    status: str = "completed"
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return sample_dict(self)


def sample_dict(sample: Any) -> dict[str, Any]:
    """`Sample.to_dict` (slime's and miles' alike): its fields, with `spec_info` and
    `prefix_cache_info` as the dicts of their defaults."""
    value: dict[str, Any] = sample.__dict__.copy()
    value["spec_info"] = {
        "spec_accept_token_num": 0,
        "spec_draft_token_num": 0,
        "spec_verify_ct": 0,
        "completion_token_num": 0,
    }
    value["prefix_cache_info"] = {"cached_tokens": 0, "total_prompt_tokens": 0}
    return value


def step_units(fmt: Any) -> list[Any]:
    """A dump folder's steps as the import reads them: every file of a step in one Unit."""
    from rollout_lens.server.exchange.dump_files import Unit

    by_step: dict[int, list[Any]] = {}
    for f in fmt.scan():
        by_step.setdefault(f.step, []).append(f)
    return [Unit(step, tuple(files), followed=False) for step, files in sorted(by_step.items())]


def rollout(rng: random.Random, prompts: list[str], n: int, tool: bool) -> list[Sample]:
    """A step's samples, a prompt's n in a row; with `tool`, a tool result inside each response
    (loss_mask 0 there, as slime's multi-turn generate masks it)."""
    out = []
    for g, prompt in enumerate(prompts):
        prompt_ids = [rng.randint(5, 999) for _ in range(rng.randint(4, 9))]
        for i in range(n):
            reply = [rng.randint(5, 999) for _ in range(rng.randint(3, 9))]
            mask = [1] * len(reply)
            if tool:
                result = [rng.randint(5, 999) for _ in range(3)]
                more = [rng.randint(5, 999) for _ in range(2)]
                reply, mask = reply + result + more, mask + [0] * 3 + [1] * 2
            engine = [-rng.uniform(0.01, 4.0) for _ in reply]
            out.append(
                Sample(
                    group_index=g,
                    index=g * n + i,
                    prompt=prompt,
                    tokens=prompt_ids + reply,
                    response=f"answer {g}.{i}",
                    response_length=len(reply),
                    label=str(g),
                    reward=float(rng.random() < 0.5),
                    loss_mask=mask if tool else None,
                    rollout_log_probs=engine,
                )
            )
    return out


def save_rollout(path: Path, rollout_id: int, samples: list[Sample]) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"rollout_id": rollout_id, "samples": [s.to_dict() for s in samples]}, path)


def trainer_logprobs(rng: random.Random, samples: list[Sample], noise: float) -> list[torch.Tensor]:
    """The trainer's logprobs of each response: the engine's, a little off."""
    import torch

    return [
        torch.tensor(
            [min(0.0, v + rng.gauss(0.0, noise)) for v in s.rollout_log_probs or []],
            dtype=torch.float32,
        )
        for s in samples
    ]


def save_train(
    path: Path, rollout_id: int, samples: list[Sample], log_probs: list[torch.Tensor]
) -> None:
    """`_build_dump_payload` of one rank's rollout_data, written as save_debug_train_data does
    (the rank's samples in a shuffled partition order, restored by rollout_position)."""
    import torch

    order = list(range(len(samples)))
    random.Random(rollout_id).shuffle(order)
    # --reward-key picks a reward dict's value (slime's _post_process_rewards)
    rewards = [float(s.reward["acc"] if isinstance(s.reward, dict) else s.reward) for s in samples]
    mean = sum(rewards) / len(rewards)
    dumped = []
    for position in order:
        s = samples[position]
        n = s.response_length
        dumped.append(
            {
                "data_parallel_rank": 0,
                "sample_index": s.index,
                "rollout_position": position,
                "tokens": torch.tensor(s.tokens, dtype=torch.long),
                "response_lengths": n,
                "total_lengths": len(s.tokens),
                "rewards": rewards[position] - mean,
                "truncated": 0,
                "rollout_ids": position,
                "loss_masks": torch.tensor(s.loss_mask or [1] * n, dtype=torch.int),
                "rollout_log_probs": torch.tensor(s.rollout_log_probs, dtype=torch.float32),
                "log_probs": log_probs[position],
                "advantages": torch.full((n,), rewards[position] - mean, dtype=torch.float32),
            }
        )
    dumped.sort(key=lambda sample: sample["rollout_position"])
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "format_version": 2,
            "rollout_id": rollout_id,
            "rank": 0,
            "samples": dumped,
            "dp_shards": [{"rank": 0, "data_parallel_rank": 0, "partition": order}],
            "raw_reward": rewards,
        },
        path,
    )
