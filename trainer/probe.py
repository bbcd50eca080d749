"""Read sampled-token logprobs and control-token probabilities off generation itself.

A LogitsProcessor sees the logits of every sampling step, so recording costs one log-softmax
per generated token instead of a second forward pass over prompt + completion.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


class GenerationProbe(LogitsProcessor):
    """Records, per generated position, log p(sampled token) and p(each control token).

    Transformers applies user processors before its temperature warper, so the probe divides by
    the temperature itself: the probabilities are the sampling policy's own (top-k/top-p off).
    """

    def __init__(
        self,
        control_token_ids: list[int],
        temperature: float,
        *,
        after_token_id: int | None = None,
        watch_ids: list[int] | None = None,
    ) -> None:
        self.control_ids = control_token_ids
        self.temperature = temperature
        # The distribution over `watch_ids` (e.g. every tool id) at the position right after
        # `after_token_id` (the opening tag): where the policy actually chooses its answer.
        self.after_token_id = after_token_id
        self.watch_ids = watch_ids or []
        self._watched: dict[int, torch.Tensor] = {}  # row -> logprobs over watch_ids
        self._control: list[torch.Tensor] = []  # per position: (B, n_ctrl)
        self._sampled: list[torch.Tensor] = []  # per position: (B,) log p of the token sampled
        self._last_logprobs: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        with torch.no_grad():
            if self._last_logprobs is not None:
                # input_ids[:, -1] is the token sampled from the previous position's distribution.
                self._sampled.append(self._last_logprobs.gather(1, input_ids[:, -1:]).squeeze(1))
            logprobs = torch.log_softmax(scores.float() / self.temperature, dim=-1)
            self._control.append(logprobs[:, self.control_ids].exp())
            if self.watch_ids and self.after_token_id is not None and len(self._control) > 1:
                hits = (input_ids[:, -1] == self.after_token_id).nonzero().flatten().tolist()
                for row in hits:
                    if row not in self._watched:
                        self._watched[row] = logprobs[row, self.watch_ids].cpu()
            self._last_logprobs = logprobs
        return scores

    def watched(self, row: int) -> list[float] | None:
        """Logprobs over `watch_ids` right after the first `after_token_id` of `row`, if any."""
        found = self._watched.get(row)
        return found.tolist() if found is not None else None

    @property
    def used(self) -> bool:
        """Whether generation called the probe at all."""
        return bool(self._control)

    def finish(
        self, completion_ids: list[list[int]]
    ) -> tuple[list[list[float]], list[list[list[float]]]]:
        """Per row: the logprobs of its completion tokens and the control probs (n_ctrl × T)."""
        if self._last_logprobs is not None:
            # The last sampled token never reaches another processor call.
            final = torch.tensor(
                [ids[-1] if len(ids) == len(self._control) else 0 for ids in completion_ids],
                device=self._last_logprobs.device,
            )
            self._sampled.append(self._last_logprobs.gather(1, final[:, None]).squeeze(1))
        if not self._control:
            empty: list[list[float]] = [[] for _ in completion_ids]
            return empty, [[[] for _ in self.control_ids] for _ in completion_ids]
        sampled = torch.stack(self._sampled, dim=1).cpu().tolist()  # (B, T)
        control = torch.stack(self._control, dim=2).cpu().tolist()  # (B, n_ctrl, T)
        logprobs, probs = [], []
        for row, ids in enumerate(completion_ids):
            n = len(ids)
            logprobs.append(sampled[row][:n])
            probs.append([series[:n] for series in control[row]])
        return logprobs, probs
