"""Capture every generation of an unmodified TRL GRPOTrainer, rollout by rollout, in group order.

`RolloutCapture.install(trainer)` wraps three of the trainer's own methods on the instance (no
subclass, nothing for the user to change):
- generation, to bind a GenerationProbe (sampled-token logprobs and control-token
  probabilities read off the logits, one log-softmax per token) when transformers generates;
- reward calculation, to keep the completions and each reward function's values;
- `_generate_and_score_completions`, to pair them with the advantages and hand one generation
  on. Under several processes the rollouts of every process are gathered to the main one in
  process order, which is the order TRL forms its groups in.

Work on the training thread is kept to copying ids and numbers into plain lists; prompts are
rendered, user functions run and summaries computed later, on the writer's thread.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_lens.trainer import turns
from rollout_lens.trainer.probe import GenerationProbe

log = logging.getLogger("rollout_lens")

# Methods of GRPOTrainer the capture wraps (present in TRL 1.0 to 1.x).
_GENERATE = "_generate_single_turn"
_REWARDS = "_calculate_rewards"
_SCORE = "_generate_and_score_completions"
_TOOL_LOOP = "_tool_call_loop"  # TRL's tool loop (tool-calling runs): its first result is tool_mask


@dataclass
class Generation:
    """The rollouts of one generation, all processes together, in TRL's group order."""

    rollout_step: int  # the optimizer step that first trains on them
    rollouts: list[dict[str, Any]] = field(default_factory=list)


class RolloutCapture:
    """Wraps a GRPOTrainer's generation and scoring to hand each generation to `on_generation`."""

    def __init__(
        self,
        trainer: Any,
        *,
        control_token_ids: list[int],
        on_generation: Callable[[Generation], None],
    ) -> None:
        self.trainer = trainer
        self.control_token_ids = control_token_ids
        self.on_generation = on_generation
        self.notes: list[str] = []
        # Each `_generate_single_turn` call of the current generation: its probe and the ids it
        # returned. One call for a single-turn generation; with tools, the first turn of every
        # row, then one call per tool iteration on the rows that called a tool (trainer/turns.py).
        self._calls: list[tuple[GenerationProbe, list[list[int]]]] = []
        self._prompt_ids: list[list[int]] | None = None  # the first call's: the prompts as seen
        self._tool_mask: list[list[int]] | None = None  # from TRL's tool loop, unpadded
        self._scored: tuple[list[Any], list[list[int]], list[list[float]]] | None = None
        missing = [name for name in (_REWARDS, _SCORE) if not hasattr(trainer, name)]
        if missing:
            raise RuntimeError(
                f"this TRL GRPOTrainer has no {', '.join(missing)}: Rollout Lens supports "
                "trl>=1.0,<2"
            )
        self._warned_stitch = False
        self.probing = self._can_probe()

    def _can_probe(self) -> bool:
        trainer = self.trainer
        if getattr(trainer, "use_vllm", False):
            self.notes.append(
                "generation by vLLM: per-token logprobs are vLLM's sampling logprobs; "
                "control-token probabilities are not recorded"
            )
            return False
        if getattr(trainer, "use_transformers_paged", False):
            self.notes.append(
                "paged transformers generation: control-token probabilities are not recorded"
            )
            return False
        if not hasattr(trainer, _GENERATE):
            self.notes.append(
                "this TRL version generates elsewhere: control-token probabilities are not recorded"
            )
            return False
        return True

    def install(self) -> None:
        """Wrap the trainer's methods on the instance."""
        trainer = self.trainer
        if self.probing:
            original_generate = getattr(trainer, _GENERATE)
            setattr(trainer, _GENERATE, functools.partial(self._generate, original_generate))
        original_rewards = getattr(trainer, _REWARDS)
        setattr(trainer, _REWARDS, functools.partial(self._rewards, original_rewards))
        original_score = getattr(trainer, _SCORE)
        setattr(trainer, _SCORE, functools.partial(self._score, original_score))
        if getattr(trainer, "tools", None) and hasattr(trainer, _TOOL_LOOP):
            original_loop = getattr(trainer, _TOOL_LOOP)
            setattr(trainer, _TOOL_LOOP, functools.partial(self._tool_loop, original_loop))

    @property
    def tool_calling(self) -> bool:
        """Whether the trainer runs TRL's tool loop (rollouts are recorded turn by turn)."""
        return bool(getattr(self.trainer, "tools", None)) and hasattr(self.trainer, _TOOL_LOOP)

    # -- the wrappers ------------------------------------------------------------------------------

    def _generate(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from transformers import LogitsProcessorList

        trainer = self.trainer
        probe = GenerationProbe(self.control_token_ids, float(trainer.temperature or 1.0))
        model = trainer.accelerator.unwrap_model(trainer.model)
        generate = type(model).generate

        def probed_generate(*g_args: Any, **g_kwargs: Any) -> Any:
            processors = LogitsProcessorList(
                [probe, *(g_kwargs.pop("logits_processor", None) or [])]
            )
            return generate(model, *g_args, logits_processor=processors, **g_kwargs)

        model.generate = probed_generate  # for this call only
        try:
            result = original(*args, **kwargs)
        finally:
            del model.generate
        if not self.tool_calling:
            self._calls = [(probe, [])]  # one call per generation: no turns to stitch
            return result
        # trl 1.x returns (completion_ids, logprobs) and takes prompt ids; older ones returned
        # (prompt_ids, completion_ids, logprobs, extra)
        if isinstance(result, tuple) and len(result) >= 4:
            prompt_ids, completion_ids = result[0], result[1]
        else:
            prompt_ids, completion_ids = (
                kwargs.get("prompt_ids", args[0] if args else None),
                result[0],
            )
        if not self._calls and prompt_ids is not None:
            self._prompt_ids = [[int(t) for t in p] for p in prompt_ids]
        self._calls.append((probe, [[int(t) for t in ids] for ids in completion_ids]))
        return result

    def _tool_loop(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        self._tool_mask = [list(mask) for mask in result[0]]
        return result

    def _rewards(
        self,
        original: Callable[..., Any],
        inputs: list[dict[str, Any]],
        prompts: list[Any],
        completions: list[Any],
        completion_ids_list: list[list[int]],
    ) -> Any:
        rewards_per_func = original(inputs, prompts, completions, completion_ids_list)
        # TRL gathers the rewards of every process; keep this process's rows.
        n = len(prompts)
        start = self.trainer.accelerator.process_index * n
        rows = rewards_per_func[start : start + n].tolist()
        self._scored = (completions, [list(ids) for ids in completion_ids_list], rows)
        return rewards_per_func

    def _score(self, original: Callable[..., Any], inputs: list[dict[str, Any]]) -> Any:
        self._calls, self._prompt_ids, self._tool_mask, self._scored = [], None, None, None
        output = original(inputs)
        trainer = self.trainer
        if not trainer.model.training or self._scored is None:
            return output  # evaluation: not a training generation
        local = self._local_rollouts(inputs, output)
        accelerator = trainer.accelerator
        if accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            everything = gather_object(local)  # a collective: every process calls it here
        else:
            everything = local
        if accelerator.is_main_process:
            self.on_generation(Generation(trainer.state.global_step + 1, everything))
        return output

    def _local_rollouts(self, inputs: list[dict[str, Any]], output: dict[str, Any]) -> list[dict]:
        trainer = self.trainer
        completions, ids_list, reward_rows = self._scored  # type: ignore[misc]
        weights = [float(w) for w in trainer.reward_weights.tolist()]
        advantages = output["advantages"].tolist()
        logprobs, control = self._logprobs(output, ids_list)
        # each row's tool_mask: None unless TRL's tool loop ran (and the mask fits the ids)
        found = self._tool_mask or []
        masks = [
            found[i] if i < len(found) and len(found[i]) == len(ids) else None
            for i, ids in enumerate(ids_list)
        ]
        prompt_ids = self._prompt_ids if self.tool_calling else None
        rollouts = []
        for i, row in enumerate(inputs):
            rewards = [None if math.isnan(v) else float(v) for v in reward_rows[i]]
            total = sum(w * v for w, v in zip(weights, rewards, strict=True) if v is not None)
            rollouts.append(
                {
                    "prompt": row.get("prompt"),
                    "completion": completions[i],
                    "ids": ids_list[i],
                    "logprobs": logprobs[i],
                    "control": control[i] if control is not None else None,
                    "rewards": rewards,
                    "reward": total,
                    "advantage": float(advantages[i]),
                    "row": _plain_columns(row),
                    "tool_mask": masks[i],
                    "prompt_ids": prompt_ids[i] if prompt_ids else None,
                }
            )
        return rollouts

    def _logprobs(
        self, output: dict[str, Any], ids_list: list[list[int]]
    ) -> tuple[list[list[float]], list[list[list[float]]] | None]:
        """The probe's rows when it ran (stitched turn by turn with tools); else the sampling
        (vLLM) or old-policy logprobs TRL has."""
        if self._tool_mask is not None and self._calls:
            stitched = turns.stitch(
                self._calls, ids_list, self._tool_mask, len(self.control_token_ids)
            )
            if stitched is not None:
                return stitched
            if not self._warned_stitch:
                self._warned_stitch = True
                log.warning(
                    "Rollout Lens: the generation calls did not line up with the tool turns; "
                    "logprobs of this generation are not recorded"
                )
            return [[] for _ in ids_list], None
        if len(self._calls) == 1 and self._calls[0][0].used:
            return self._calls[0][0].finish(ids_list)
        for key in ("sampling_per_token_logps", "old_per_token_logps"):
            found = output.get(key)
            if found is not None:
                rows = found.tolist()
                return [row[: len(ids)] for row, ids in zip(rows, ids_list, strict=True)], None
        return [[] for _ in ids_list], None


MAX_LIST = 64  # a list column is kept when it is this short and holds scalars only


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
