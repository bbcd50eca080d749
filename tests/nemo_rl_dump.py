"""NeMo-RL's training dump as its own code writes it, for tests (NeMo-RL is not installed: its
requirements are Ray, Megatron and vLLM). Each step follows, in order:

- nemo_rl/algorithms/grpo.py (NVIDIA-NeMo/RL at 7ea279ab), lines 1910–1941,
  `add_grpo_token_loss_masks_and_generation_logprobs`: every message gets `token_loss_mask`
  (ones for the assistant's generated messages, zeros otherwise) and `generation_logprobs`
  (float32 zeros where the engine generated nothing); `advantages` the sample's, at every token;
- nemo_rl/data/llm_message_utils.py `batched_message_log_to_flat_message`: each sample's messages
  concatenated, right-padded to the batch's longest (token ids with the pad id, the rest 0);
- grpo.py lines 3631–3654: `log_data` of `.tolist()`s, `content` the messages' texts;
- nemo_rl/utils/logger.py lines 1071–1098 `log_batched_dict_as_jsonl`: a line a sample, each key
  a one-element slice (`make_microbatch_iterator(1)`), `json.dumps({**sample, "idx": i})`.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PAD = 0


@dataclass
class Message:
    role: str  # system, user, assistant, environment
    content: str
    token_ids: list[int]
    generation_logprobs: list[float] | None = None  # the engine's, assistant messages only


@dataclass
class Sample:
    messages: list[Message]
    reward: float
    prev_logprobs: list[float] = field(default_factory=list)  # the trainer's, every token
    sample_loss_mask: float = 1.0


def conversation(rng: random.Random, prompt: list[Message], turns: int, nan_every: int) -> Sample:
    """A sample: the prompt's messages, then `turns` assistant replies with an environment
    result between each; the engine's logprobs a little off the trainer's, NaN now and then
    (vLLM's None in a float tensor)."""
    messages = list(prompt)
    for turn in range(turns):
        if turn:
            ids = [rng.randint(5, 99) for _ in range(rng.randint(2, 4))]
            messages.append(Message("environment", f"<result {turn}>", ids))
        ids = [rng.randint(5, 99) for _ in range(rng.randint(3, 7))]
        engine = [-rng.uniform(0.01, 5.0) for _ in ids]
        for k in range(0, len(engine), nan_every):
            engine[k] = math.nan if nan_every < 99 else engine[k]
        messages.append(
            Message("assistant", f"reply {turn} " + " ".join(map(str, ids)), ids, engine)
        )
    n = sum(len(m.token_ids) for m in messages)
    trainer = [0.0] + [-rng.uniform(0.01, 5.0) for _ in range(n - 1)]
    for position, value in _engine_positions(messages):  # the trainer near the engine
        if not math.isnan(value):
            trainer[position] = min(0.0, value + rng.gauss(0.0, 0.3))
    return Sample(messages, reward=float(rng.random() < 0.5), prev_logprobs=trainer)


def _engine_positions(messages: list[Message]) -> list[tuple[int, float]]:
    out, at = [], 0
    for m in messages:
        if m.generation_logprobs is not None:
            out += [(at + k, v) for k, v in enumerate(m.generation_logprobs)]
        at += len(m.token_ids)
    return out


def log_data(samples: list[Sample], advantages: list[float]) -> dict[str, Any]:
    """grpo.py's `log_data` for a batch, its tensors built as NeMo-RL builds them."""
    import torch

    rows: dict[str, list[torch.Tensor]] = {k: [] for k in ("ids", "mask", "gen", "adv", "prev")}
    for sample, advantage in zip(samples, advantages, strict=True):
        ids = [torch.tensor(m.token_ids) for m in sample.messages]
        rows["ids"].append(torch.cat(ids))
        rows["mask"].append(
            torch.cat(
                [
                    torch.ones_like(t) if m.role == "assistant" else torch.zeros_like(t)
                    for m, t in zip(sample.messages, ids, strict=True)
                ]
            )
        )
        rows["gen"].append(
            torch.cat(
                [
                    torch.tensor(m.generation_logprobs, dtype=torch.float32)
                    if m.generation_logprobs is not None
                    else torch.zeros_like(t, dtype=torch.float32)
                    for m, t in zip(sample.messages, ids, strict=True)
                ]
            )
        )
        rows["adv"].append(torch.tensor(advantage).expand(rows["ids"][-1].shape))
        rows["prev"].append(torch.tensor(sample.prev_logprobs, dtype=torch.float32))
    lengths = torch.tensor([len(t) for t in rows["ids"]])
    width = int(lengths.max())

    def pad(tensors: list[torch.Tensor], value: float) -> torch.Tensor:
        return torch.stack(
            [torch.nn.functional.pad(t, (0, width - len(t)), value=value) for t in tensors]
        )

    return {
        "content": [[m.content for m in s.messages] for s in samples],
        "rewards": torch.tensor([s.reward for s in samples]).tolist(),
        "input_lengths": lengths.tolist(),
        "token_ids": pad(rows["ids"], PAD).tolist(),
        "token_loss_mask": pad(rows["mask"], 0).tolist(),
        "sample_loss_mask": torch.tensor([s.sample_loss_mask for s in samples]).tolist(),
        "advantages": pad(rows["adv"], 0).tolist(),
        "generation_logprobs": pad(rows["gen"], 0).tolist(),
        "prev_logprobs": pad(rows["prev"], 0).tolist(),
    }


def write(folder: Path, step: int, data: dict[str, Any]) -> Path:
    """Logger.log_batched_dict_as_jsonl(data, f"train_data_step{step}.jsonl")."""
    path = folder / f"train_data_step{step}.jsonl"
    folder.mkdir(parents=True, exist_ok=True)
    size = len(next(iter(data.values())))
    with path.open("w") as f:
        for i in range(size):
            sample = {key: value[i : i + 1] for key, value in data.items()}
            f.write(json.dumps({**sample, "idx": i}, default=str) + "\n")
    return path


def grpo_advantages(rewards: list[float], group: int) -> list[float]:
    """GRPO's leave-one-in advantage, reward minus the group's mean (NeMo-RL's default)."""
    out = []
    for start in range(0, len(rewards), group):
        members = rewards[start : start + group]
        out += [r - sum(members) / len(members) for r in members]
    return out
