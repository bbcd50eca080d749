"""Supervisory SFT phases and greedy evaluation for multi-turn runs.

The expert of a multi-step episode calls the tools it needs in order, reads each real result,
and answers with the last one: `expert_sequence` renders that conversation through the model's
own chat template and trains on the model's turns only (the prompt and the tool results are
context, as `tool_mask` keeps them out of the GRPO loss). trainer.escalation.supervision.SFTPhases runs the
phases (before RL, or every N steps on the episodes that failed since the last phase).

`MultiTurnEvaluator` plays held-in and held-out episodes greedily through the same tool loop
(trainer.builders.multiturn_model.sample_conversations) and records the share answered exactly as
`eval/id` and `eval/content_ood`. Format-OOD has no multi-turn counterpart here: the call format
is the chat template's, not the task's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rollout_lens.server.core import vocab
from rollout_lens.trainer.builders.multiturn_model import sample_conversations, tool_schemas
from rollout_lens.trainer.envs import multistep as ms
from transformers import PreTrainedTokenizerBase, TrainerCallback

EVAL_TURN_TOKENS = 32  # tokens per sampled turn in evaluation (a call or an answer)


def expert_messages(env: ms.MultiStepEnv, ep: ms.Episode) -> list[dict[str, Any]]:
    """The right conversation: each needed tool called in turn with its real result, then the
    answer."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": ep.prompt}]
    for name in ep.needed:
        call = {"type": "function", "function": {"name": name, "arguments": {}}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "name": name, "content": env.observe(ep, name)})
    messages.append({"role": "assistant", "content": f"<answer>{ep.answer}</answer>"})
    return messages


def expert_sequence(
    tokenizer: PreTrainedTokenizerBase, env: ms.MultiStepEnv, ep: ms.Episode
) -> tuple[list[int], list[int]]:
    """(ids, labels) of the expert conversation as the chat template renders it: labels are the
    ids of the model's turns and -100 elsewhere (prompt, tool results, turn openers)."""
    tools = tool_schemas(env, ep.tool_ids)
    messages = expert_messages(env, ep)
    ids: list[int] = []
    labels: list[int] = []
    for k, message in enumerate(messages, start=1):
        model_turn = message["role"] == "assistant"
        rendered = list(
            tokenizer.apply_chat_template(
                messages[:k],
                tools=tools,
                add_generation_prompt=not model_turn,
                tokenize=True,
                return_dict=False,
            )
        )
        if rendered[: len(ids)] != ids:
            # Some templates add text after an end-of-turn that the next message replaces
            # (as TRL's own tool loop finds): keep the prefix through the last end-of-turn.
            eos = [i for i, t in enumerate(ids) if t == tokenizer.eos_token_id]
            keep = eos[-1] + 1 if eos else 0
            if rendered[:keep] != ids[:keep]:
                raise ValueError("the chat template does not render conversations by prefix")
            ids, labels = ids[:keep], labels[:keep]
        new = rendered[len(ids) :]
        ids += new
        labels += new if model_turn else [-100] * len(new)
    return ids, labels


def sft_rows(env: ms.MultiStepEnv) -> list[dict[str, Any]]:
    """SFT-then-RL's data: one episode per training query and kind the env draws."""
    kinds = ms.KINDS if env.mode == "mixed" else (env.mode,)
    return [
        env.episode(q.text, kind=kind, episode=i).row()
        for i, (q, kind) in enumerate((q, k) for q in env.train_queries for k in kinds)
    ]


def row_encoder(
    tokenizer: PreTrainedTokenizerBase, env: ms.MultiStepEnv
) -> Callable[[dict[str, Any]], tuple[list[int], list[int]]]:
    """SFTPhases' `encode` for multi-turn rows."""
    return lambda row: expert_sequence(tokenizer, env, ms.Episode.from_row(row))


def eval_episodes(env: ms.MultiStepEnv) -> dict[str, list[ms.Episode]]:
    """In-distribution (the training queries) and content-OOD (their held-out paraphrases),
    each asked directly and behind a ticket."""

    def episodes(queries: Sequence[Any]) -> list[ms.Episode]:
        return [
            env.episode(q.text, kind=kind, episode=10_000 + i)
            for i, (q, kind) in enumerate((q, k) for q in queries for k in ms.KINDS)
        ]

    return {"id": episodes(env.train_queries), "content_ood": episodes(env.heldout_queries)}


class MultiTurnEvaluator(TrainerCallback):
    """Every `every` steps (and after the last), greedy accuracy through the tool loop on each
    set → `eval/<set>`, handed to `sink(step, metrics)`."""

    def __init__(
        self,
        trainer: Any,
        sink: Callable[[int, dict[str, float | None]], None],
        env: ms.MultiStepEnv,
        *,
        every: int,
        max_calls: int,
    ) -> None:
        self.trainer, self.sink, self.env = trainer, sink, env
        self.every, self.max_calls = every, max_calls
        self.sets = eval_episodes(env)

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        last = state.global_step >= state.max_steps or control.should_training_stop
        if state.global_step % self.every == 0 or last:
            self.sink(state.global_step, self.evaluate())

    def evaluate(self) -> dict[str, float | None]:
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        was_training = model.training
        model.eval()
        try:
            out: dict[str, float | None] = {}
            for name, episodes in self.sets.items():
                played = sample_conversations(
                    model,
                    self.trainer.processing_class,
                    self.env,
                    episodes,
                    max_calls=self.max_calls,
                    max_new_tokens=EVAL_TURN_TOKENS,
                    temperature=0.0,
                )
                right = [
                    ms.true_score(ms.read_rollout(messages, ep.needed), ep.answer)
                    for messages, ep in zip(played, episodes, strict=True)
                ]
                out[vocab.eval_set(name)] = sum(right) / len(right) if right else None
            return out
        finally:
            model.train(was_training)
