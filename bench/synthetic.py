"""A synthetic GRPO run for the benches: a leaky (64 tools listed, accuracy swinging from one
25-step bucket to the next) or patched (top-4 listed, converging) run, step by step, as the
trainer would record it (StepRecord with its rollouts and generic series)."""

from __future__ import annotations

import math
import random
import statistics

from rollout_lens.server.core.records import RolloutRecord, StepRecord

CONTROL_TOKENS = ("<tool>", "</tool>", "</assistant>")
TOOLS = [f"tool_{i:02d}" for i in range(64)]
QUERIES = [
    ("evaluate 17 * 38", "evaluate an arithmetic expression"),
    ("look up who wrote hamlet", "look up a fact in an encyclopedia"),
    ("translate good morning into french", "translate text between languages"),
    ("get the weather forecast for paris", "get the weather forecast for a city"),
    ("convert 5 miles to metric units", "convert between units of measure"),
    ("send an email to alice about the meeting", "send an email message"),
    ("search for recent news about the mars rover", "search the web for recent news"),
    ("set a reminder to call mom at 6 pm", "set a reminder for a time"),
    ("define the word ephemeral using a dictionary", "look up a word in a dictionary"),
]
TRL_KEYS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "num_tokens")


def _capabilities(rng: random.Random) -> dict[str, str]:
    caps = [cap for _, cap in QUERIES]
    caps += [f"miscellaneous tool number {i}" for i in range(len(TOOLS) - len(caps))]
    rng.shuffle(caps)
    return dict(zip(TOOLS, caps, strict=True))


class SyntheticRun:
    """Steps of a leaky (oscillating, 64 tools) or patched (converging, top-4) run."""

    def __init__(self, *, variant: str, seed: int) -> None:
        self.variant, self.rng = variant, random.Random(seed)
        self.caps = _capabilities(self.rng)
        self.by_cap = {cap: tool for tool, cap in self.caps.items()}
        self.level = 0.5

    def prompt(self, query: str, target: str) -> tuple[str, list[str]]:
        if self.variant == "leaky":
            listed = TOOLS
        else:
            others = [t for t in TOOLS if t != target]
            listed = sorted([target, *self.rng.sample(others, 3)], key=lambda t: self.caps[t])
        listing = "\n".join(f"- {t}: {self.caps[t]}" for t in listed)
        text = (
            f"<user>Tools:\n{listing}\nQuery: {query}\n"
            "Reply with only <tool>ID</tool> for the one tool whose capability matches the query."
            "</user><assistant>"
        )
        return text, list(listed)

    def accuracy(self, step: int) -> float:
        if self.variant == "patched":
            return min(0.99, 0.25 + 0.75 * (1 - math.exp(-step / 9)))
        if step % 25 == 1:  # the leaky run's bucket-to-bucket swings
            self.level = self.rng.choice([0.05, 0.2, 0.5, 0.8, 0.95])
        return self.level

    def collapsing(self, step: int) -> bool:
        """The leaky run breaks its call format for a stretch (end-of-turn after the opening tag)."""
        return self.variant == "leaky" and 180 <= step % 1000 < 195

    def rollout(
        self, index: int, prompt: str, target: str, listed: list[str], p_correct: float, step: int
    ) -> RolloutRecord:
        rng = self.rng
        correct = rng.random() < p_correct
        vote = target if correct else rng.choice([t for t in listed if t != target] or [target])
        collapse = self.variant == "leaky" and rng.random() < (
            0.7 if self.collapsing(step) else 0.03
        )
        p_vote = rng.uniform(0.55, 0.98) if correct else rng.uniform(0.05, 0.6)
        if collapse:
            completion, ids = "<tool>", [5, 2]
            logprobs = [math.log(rng.uniform(0.9, 0.99)), math.log(rng.uniform(0.3, 0.6))]
            ctrl = {
                "<tool>": [math.exp(logprobs[0]), 0.01],
                "</tool>": [0.001, 0.05],
                "</assistant>": [0.002, math.exp(logprobs[1])],
            }
        else:
            completion = f"<tool>{vote}</tool>"
            ids = [5, 100 + TOOLS.index(vote), 6, 2]
            logprobs = [
                math.log(rng.uniform(0.95, 0.999)),
                math.log(p_vote),
                math.log(rng.uniform(0.9, 0.99)),
                math.log(rng.uniform(0.9, 0.99)),
            ]
            spike = (
                rng.uniform(0.2, 0.45)
                if self.variant == "leaky" and rng.random() < 0.05
                else rng.uniform(0, 0.02)
            )
            ctrl = {
                "<tool>": [
                    math.exp(logprobs[0]),
                    rng.uniform(0, 0.01),
                    rng.uniform(0, 0.01),
                    rng.uniform(0, 0.01),
                ],
                "</tool>": [
                    rng.uniform(0, 0.01),
                    spike,
                    math.exp(logprobs[2]),
                    rng.uniform(0, 0.02),
                ],
                "</assistant>": [
                    rng.uniform(0, 0.01),
                    rng.uniform(0, 0.02),
                    rng.uniform(0, 0.05),
                    math.exp(logprobs[3]),
                ],
            }
        reward = (
            1.0
            if vote == target and not collapse
            else (0.0 if collapse else rng.choice([0.0, 0.0, 0.5]))
        )
        tokens = (
            ["<tool>", "</assistant>"] if collapse else ["<tool>", vote, "</tool>", "</assistant>"]
        )
        probes = {
            "open_first": ctrl["<tool>"][0],
            "eot_after_open": ctrl["</assistant>"][1],
            "close_after_id": None if collapse else ctrl["</tool>"][2],
            "eot_after_close": None if collapse else ctrl["</assistant>"][3],
        }
        return RolloutRecord(
            group=0,
            index=index,
            prompt=prompt,
            completion=completion,
            completion_ids=ids,
            token_logprobs=logprobs,
            control_probs=ctrl,
            vote=None if collapse else vote,
            target=target,
            verifier_reward=reward,
            true_score=float(vote == target and not collapse),
            advantage=0.0,
            format_valid=not collapse,
            format_state="collapse" if collapse else "healthy_call",
            meta={
                "query": "",
                "tool_ids": listed,
                "target_listed": target in listed,
                "hint": None,
                "tokens": tokens,
                "probes": probes,
            },
        )

    def step(
        self, step: int, group_size: int = 8, *, eval_every: int = 0, with_rollouts: bool = True
    ) -> StepRecord:
        """Step `step`; with `eval_every`, greedy evaluations every that many steps; without
        `with_rollouts`, only its per-step values (a cheaper fill where no page reads them)."""
        query, cap = self.rng.choice(QUERIES)
        target = self.by_cap[cap]
        prompt, listed = self.prompt(query, target)
        p = self.accuracy(step)
        rollouts = [self.rollout(i, prompt, target, listed, p, step) for i in range(group_size)]
        for r in rollouts:
            r.meta["query"] = query
        rewards = [r.verifier_reward for r in rollouts]
        mean = sum(rewards) / len(rewards)
        std = statistics.pstdev(rewards) or 1.0
        for r in rollouts:
            r.advantage = (r.verifier_reward - mean) / std
        votes = [r.vote for r in rollouts]
        counts = {v: votes.count(v) for v in set(votes)}
        agree = max((c for v, c in counts.items() if v is not None), default=0) / group_size
        entropy = -sum(c / group_size * math.log2(c / group_size) for c in counts.values())
        values = {
            "reward_mean": mean,
            "true_accuracy": sum(r.true_score or 0 for r in rollouts) / group_size,
            "format_valid_rate": sum(r.format_valid for r in rollouts) / group_size,
            "vote_agreement": agree,
            "vote_entropy": entropy,
            "zero_std_share": float(len(set(rewards)) == 1),
            "loss": self.rng.gauss(0.0, 0.05),
            "kl": abs(self.rng.gauss(0.002 * math.log1p(step), 0.001)),
            "entropy": max(0.01, 1.2 * math.exp(-step / 400) + self.rng.gauss(0, 0.03)),
            "grad_norm": abs(self.rng.gauss(1.0, 0.4)) * (6 if self.rng.random() < 0.01 else 1),
            "learning_rate": 3e-4,
            "completion_length": sum(len(r.completion_ids) for r in rollouts) / group_size,
            "wall_time": self.rng.uniform(0.4, 0.6),
        }
        metrics: dict[str, float | None] = {}
        for token in CONTROL_TOKENS:
            probs = [p for r in rollouts for p in r.control_probs[token]]
            metrics[f"ctrl/{token}/mean"] = sum(probs) / len(probs)
            metrics[f"ctrl/{token}/max"] = max(probs)
        states = [r.format_state for r in rollouts]
        for state in ("healthy_call", "text_pollution", "collapse", "no_call"):
            metrics[f"state/{state}"] = states.count(state) / group_size
        for probe in ("open_first", "eot_after_open", "close_after_id", "eot_after_close"):
            present = [
                r.meta["probes"][probe] for r in rollouts if r.meta["probes"][probe] is not None
            ]
            metrics[f"probe/{probe}/mean"] = sum(present) / len(present) if present else None
            metrics[f"probe/{probe}/max"] = max(present) if present else None
        metrics["retrieval_recall"] = 1.0
        for key in TRL_KEYS:
            metrics[f"trl/{key}"] = self.rng.random()
        if eval_every and step % eval_every == 0:
            for name, shift in (("id", 0.0), ("format_ood", -0.1), ("content_ood", -0.25)):
                metrics[f"eval/{name}"] = min(1.0, max(0.0, p + shift + self.rng.gauss(0, 0.03)))
        return StepRecord(
            step=step,
            rollout_step=step,
            values=values,
            rollouts=rollouts if with_rollouts else [],
            metrics=metrics,
        )
