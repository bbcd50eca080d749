"""Read sampled-token logprobs and control-token probabilities: off generation, or off TRL's pass.

SamplingProbe: the last of the logits processors `model.generate` builds sees the scores every
token is drawn from, so the generator's own log p(sampled token) costs a log-sum-exp over the
positions it kept, read a few at once (transformers' generate path: the generator's side of
the mismatch lens).
GenerationProbe: a LogitsProcessor on `model.generate` sees the logits of every sampling step,
so recording costs one log-softmax per generated token (the `generate` path only).
ForwardProbe: a forward hook on the backbone while TRL scores the completions reads k dot
products a position from the final hidden states, whatever generated them (every path).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList

FOLD_BYTES = 32 << 20  # the float32 scores a SamplingProbe holds before it reads them at once


class SamplingProbe(LogitsProcessor):
    """Records, per generated position, log p(sampled token) under the scores it is handed.

    Bound last (`bound`), it sees the scores generate's sampling step softmaxes and draws from
    (transformers 5.24.0 generation/utils.py: `_sample` lines 3251–3277, `next_token_scores =
    logits_processor(...)`, `softmax`, `multinomial`), after every processor and warper
    `_get_logits_processor` builds from TRL's GenerationConfig (line 1600 merges the user's
    processors, then lines 1603–1650 append temperature, top-k, top-p, min-p, ... when
    sampling; TRL 1.16.0 trl/trainer/grpo_trainer.py lines 1155–1173 sets do_sample, temperature,
    top_p, top_k, min_p and repetition_penalty): the distribution each token was drawn from.

    A call only keeps the scores it is handed (each position's own tensor: generate builds a new
    one a position and nothing after the last processor writes to it). Every FOLD_BYTES of them
    (float32), and at `settle`, the positions kept are read at once: one log-sum-exp over their
    stacked vocabularies and one gather of the tokens drawn from them, which the next call's
    `input_ids` hold (the last position's, TRL's completion ids). A handful of tensor operations
    a generation where reading each position as it came took four (at a toy step's few-ms
    generation, most of the probe's cost was those operations' dispatch, not their arithmetic).
    """

    normalised = False  # whether the scores kept are log-probabilities already

    def __init__(self) -> None:
        self._sampled: list[torch.Tensor] = []  # per read span: (B, n) log p of the tokens sampled
        self._scores: list[torch.Tensor] = []  # the positions not read yet: each one's (B, V)
        self._held = 0  # their float32 bytes
        self._input_ids: torch.Tensor | None = None  # the last call's: the tokens drawn so far
        self.positions = 0  # generation steps seen
        self.batch: list[Any] | None = None  # continuous batching's own, a row each (`bound`)
        self.host: np.ndarray | None = None  # (B, T) float64 once `settle` copied it off

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._keep(input_ids, scores)
        return scores

    def _keep(self, input_ids: torch.Tensor, scores: torch.Tensor) -> None:
        """Keep this position's `scores` (B, V); read the ones kept before when they reach
        FOLD_BYTES (`input_ids`' last columns: the tokens drawn from them)."""
        size = scores.numel() * 4
        if self._scores and self._held + size > FOLD_BYTES:
            self._fold(input_ids[:, -len(self._scores) :])
        self._scores.append(scores)
        self._held += size
        self._input_ids = input_ids
        self.positions += 1

    def _fold(self, tokens: torch.Tensor) -> None:
        """Log p of `tokens` (B, n), each drawn from the kept position's scores in order."""
        with torch.no_grad():
            kept = (
                self._scores[0][:, None] if len(self._scores) == 1 else torch.stack(self._scores, 1)
            )
            picked = kept.gather(2, tokens[..., None].to(kept.device))[..., 0]
            if not self.normalised:
                picked = picked - torch.logsumexp(kept.float(), dim=-1)  # (B, n)
            self._sampled.append(picked)
        self._scores = []
        self._held = 0

    def _final(self, completion_ids: Sequence[Sequence[int]]) -> None:
        """Read what the calls left: the kept positions, the last one's tokens from
        `completion_ids` (a row that ended earlier: any token; its positions are cut)."""
        if not self._scores:
            return
        device = self._scores[0].device
        final = torch.tensor(
            [[ids[-1] if len(ids) == self.positions else 0] for ids in completion_ids],
            device=device,
        )
        earlier = len(self._scores) - 1
        if earlier:
            assert self._input_ids is not None
            final = torch.cat([self._input_ids[:, -earlier:].to(device), final], dim=1)
        self._fold(final)
        self._input_ids = None

    @property
    def used(self) -> bool:
        """Whether generation called the probe at all (or continuous batching handed it its
        logprobs)."""
        return self.positions > 0 or self.batch is not None

    def settle(self, completion_ids: Sequence[Sequence[int]]) -> None:
        """Take the last sampled token of each row (it never reaches another processor call)
        and copy the readings off the device once (`host`), on the thread that generated: what
        is left (`sampled`) is numpy only."""
        if self.positions == 0 or self.host is not None:
            return
        self._final(completion_ids)
        self.host = torch.cat(self._sampled, dim=1).cpu().double().numpy()  # (B, T)
        self._sampled = []

    def sampled(self, completion_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Per row, the logprob of each of its completion tokens [n] (float64, views of the
        one host copy); none (0 positions) when generation never called it, nor for a row
        continuous batching gave none or another count of."""
        if self.batch is not None:
            return [
                np.asarray(row, dtype=np.float64)
                if row is not None and len(row) == len(ids)
                else np.zeros(0)
                for row, ids in zip(self.batch, completion_ids, strict=True)
            ]
        self.settle(completion_ids)
        if self.host is None:
            return [np.zeros(0) for _ in completion_ids]
        return [self.host[row, : len(ids)] for row, ids in enumerate(completion_ids)]


class GenerationProbe(SamplingProbe):
    """Records, per generated position, log p(sampled token) and p(each control token).

    Transformers applies user processors before its temperature warper, so the probe divides by
    the temperature itself: the probabilities are the sampling policy's own (top-k/top-p off).
    Each position's log-probabilities are kept as SamplingProbe keeps its scores.
    """

    normalised = True

    def __init__(
        self,
        control_token_ids: list[int],
        temperature: float,
        *,
        after_token_id: int | None = None,
        watch_ids: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.control_ids = control_token_ids
        self.temperature = temperature
        # The distribution over `watch_ids` (e.g. every tool id) at the position right after
        # `after_token_id` (the opening tag): where the policy actually chooses its answer.
        self.after_token_id = after_token_id
        self.watch_ids = watch_ids or []
        self._watched: dict[int, torch.Tensor] = {}  # row -> logprobs over watch_ids
        self._control: list[torch.Tensor] = []  # per position: (B, n_ctrl)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        with torch.no_grad():
            logprobs = torch.log_softmax(scores.float() / self.temperature, dim=-1)
            self._control.append(logprobs[:, self.control_ids].exp())
            if self.watch_ids and self.after_token_id is not None and len(self._control) > 1:
                # input_ids[:, -1]: the token sampled from the previous position's distribution
                hits = (input_ids[:, -1] == self.after_token_id).nonzero().flatten().tolist()
                for row in hits:
                    if row not in self._watched:
                        self._watched[row] = logprobs[row, self.watch_ids].cpu()
        self._keep(input_ids, logprobs)
        return scores

    def watched(self, row: int) -> list[float] | None:
        """Logprobs over `watch_ids` right after the first `after_token_id` of `row`, if any."""
        found = self._watched.get(row)
        return found.tolist() if found is not None else None

    def finish(self, completion_ids: list[list[int]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per row: the logprobs of its completion tokens [n] and the control-token
        probabilities [n × k] (float64 arrays, the step entity's orientation), copied off the
        device once for the whole batch; none (0 positions) when generation never called it."""
        sampled = self.sampled(completion_ids)
        if not self._control:
            k = len(self.control_ids)
            return sampled, [np.zeros((0, k)) for _ in completion_ids]
        control = torch.stack(self._control, dim=1).cpu().double().numpy()  # (B, T, k)
        return sampled, [control[row, : len(ids)] for row, ids in enumerate(completion_ids)]


# transformers' LogitsProcessorList inspects each processor's signature at every position: the
# probes' own, computed once, is what inspect.signature then returns (a third of its cost)
for _probe in (SamplingProbe, GenerationProbe):
    _probe.__call__.__signature__ = inspect.signature(_probe.__call__)  # type: ignore[attr-defined]


class _Patches:
    """Attributes set on instances for the calls inside a binding, then put back as they were
    (another capture's binding, or nothing)."""

    def __init__(self) -> None:
        self.kept: dict[tuple[int, str], tuple[Any, str, Any]] = {}

    def set(self, owner: Any, name: str, value: Any) -> None:
        self.kept.setdefault((id(owner), name), (owner, name, vars(owner).get(name)))
        setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, before in self.kept.values():
            if before is None:
                delattr(owner, name)
            else:
                setattr(owner, name, before)


@contextmanager
def bound(
    model: Any,
    probe: GenerationProbe | None,
    sampling: SamplingProbe | None,
    *,
    batched: bool = False,
) -> Iterator[None]:
    """The model's generation with the probes bound, for the calls inside: `probe` among the
    user's processors of `model.generate` (transformers runs them before its warpers);
    `sampling` appended to the list generate builds (`_get_logits_processor`, a private method
    of transformers' GenerationMixin since 4.x, wrapped on the instance; under PEFT the wrapped
    model's own), after its warpers: the last to see the scores. With `batched` (continuous
    batching, `generate_batch`, which runs processors of its own over one row a request) it
    takes instead the logprobs generate_batch returns with `return_logprobs` turned on in a copy
    of TRL's ContinuousBatchingConfig (transformers 5.24.0 continuous_batching/model_runner.py
    lines 220–248: the log of each sampled token's probability under the processed scores it
    was drawn from)."""
    patches = _Patches()
    try:
        if probe is not None:
            patches.set(model, "generate", _probed_generate(model, probe))
        if sampling is not None and batched:
            _bind_batch(model, sampling, patches)
        elif sampling is not None:
            target = model.get_base_model() if hasattr(model, "get_base_model") else model
            build = getattr(target, "_get_logits_processor", None)
            if build is not None:

                def built(*b_args: Any, **b_kwargs: Any) -> LogitsProcessorList:
                    processors = build(*b_args, **b_kwargs)
                    processors.append(sampling)
                    return processors

                patches.set(target, "_get_logits_processor", built)
        yield
    finally:
        patches.restore()


def _probed_generate(model: Any, probe: GenerationProbe) -> Callable[..., Any]:
    """`model.generate` with `probe` first among the user's logits processors."""
    generate = type(model).generate

    def probed_generate(*g_args: Any, **g_kwargs: Any) -> Any:
        processors = LogitsProcessorList([probe, *(g_kwargs.pop("logits_processor", None) or [])])
        return generate(model, *g_args, logits_processor=processors, **g_kwargs)

    return probed_generate


def _bind_batch(model: Any, sampling: SamplingProbe, patches: _Patches) -> None:
    """`model.generate_batch` returning its logprobs into `sampling.batch` (a row a request,
    in the order of the outputs TRL reads its completions in)."""
    batch = getattr(model, "generate_batch", None)
    if batch is None:
        return

    def logged_batch(*b_args: Any, **b_kwargs: Any) -> Any:
        config = b_kwargs.get("continuous_batching_config")
        if config is not None:
            config = b_kwargs["continuous_batching_config"] = copy.copy(config)
            config.return_logprobs = True
        outputs = batch(*b_args, **b_kwargs)
        sampling.batch = [getattr(out, "logprobs", None) or None for out in outputs.values()]
        return outputs

    patches.set(model, "generate_batch", logged_batch)


POSITIONS = 4096  # positions whose float32 hidden states the probe copies at once


@dataclass
class _Chunk:
    """What the backbone hook kept of one chunk of TRL's forward: the transformed logits of the
    sampled tokens and of the control tokens, and of the watched ids after the opening tag."""

    sampled: torch.Tensor  # (b, K) z(y), float32
    control: torch.Tensor  # (b, K, k) z(c)
    watched: dict[int, tuple[int, torch.Tensor]]  # chunk row -> (position, z over watch_ids)


@dataclass(eq=False)
class ForwardReading:
    """One chunk of TRL's scoring pass as the probe read it, a row a completion: log p(y)
    [b, K] (TRL's own), the control-token probabilities [b, K, k], which positions took part
    in the pass (attention mask 1) [b, K], and the watched logprobs (chunk row -> position,
    logprobs over watch_ids). Tensors on the model's device until `on_host` copies the chunk
    off it, once for all its rows; there `leading` counts each row's positions read from the
    first on."""

    logprobs: Any
    control: Any
    measured: Any
    watched: dict[int, tuple[int, Any]]
    leading: Any = None
    _host: ForwardReading | None = field(default=None, repr=False)

    def on_host(self) -> ForwardReading:
        """This chunk as numpy arrays (watched as lists), copied off the device once."""
        if self._host is None:
            measured = self.measured.cpu().numpy()
            self._host = ForwardReading(
                self.logprobs.cpu().numpy(),
                self.control.cpu().numpy(),
                measured,
                {r: (position, z.tolist()) for r, (position, z) in self.watched.items()},
                np.logical_and.accumulate(measured, axis=1).sum(axis=1),
            )
            self._host._host = self._host
        return self._host


@dataclass(frozen=True)
class ForwardRow:
    """Row `r` of a chunk's reading on the host: one rollout's, turned into the entity's arrays
    (`arrays`) later, on the writer's thread."""

    chunk: ForwardReading
    r: int

    def whole(self, n: int) -> bool:
        """Whether the pass read the row's first `n` positions (all it has, if fewer)."""
        return int(self.chunk.leading[self.r]) >= min(n, self.chunk.measured.shape[1])

    def arrays(
        self, n: int, tool_mask: Sequence[int] | None = None
    ) -> tuple[np.ndarray, np.ndarray, list[float] | None] | None:
        """The first `n` positions: logprobs [n], control probs [n × k] (position × token, the
        step entity's orientation) as float64 and the watched logprobs, tool-result positions
        (tool_mask 0) at 0.0; None when the pass did not read them whole."""
        if not self.whole(n):
            return None
        chunk, r = self.chunk, self.r
        logprobs = chunk.logprobs[r, :n]
        control = chunk.control[r, :n]
        if tool_mask is not None:
            keep = np.asarray(tool_mask[:n], dtype=bool)
            logprobs = np.where(keep, logprobs, logprobs.dtype.type(0.0))
            control = np.where(keep[:, None], control, control.dtype.type(0.0))
        found = chunk.watched.get(r)
        watched = found[1] if found is not None and found[0] < n else None
        return logprobs.astype(np.float64), control.astype(np.float64), watched


class ForwardProbe:
    """Control-token probabilities, read off TRL's own scoring forward pass (any generation path).

    TRL 1.x scores completions with a fused LM head: no (B, T, V) logits exist, only the final
    hidden state h of each position (the backbone's output: the final norm's) and TRL's log p(y)
    of the sampled token y. With z(t) = f(h·W[t] + b[t]) / T, f the model's logit scale and soft
    cap as TRL applies them and T the temperature, log Z = z(y) − log p(y), and so
    p(c) = exp(z(c) − log Z) for each control token c: k dot products a position, memory
    O(B × T × k), never the vocabulary. A forward hook on the backbone keeps z(y) and z(c) while
    TRL's pass runs; `read` pairs them with the log-probabilities the pass returns.

    The readings are only the sampling policy's when the pass runs at the weights that sampled:
    the capture (trainer/recorder/capture.py) says which pass that is.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        control_token_ids: list[int],
        temperature: float,
        *,
        after_token_id: int | None = None,
        watch_ids: list[int] | None = None,
    ) -> None:
        self.model = model  # the unwrapped model TRL patched with its fused head
        self.control_ids = list(control_token_ids)
        self.temperature = temperature
        self.after_token_id = after_token_id
        self.watch_ids = list(watch_ids or [])
        config = model.config.get_text_config()
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.logit_scale = _logit_scale(config)
        # row id -> its first reading: the chunk that read it and its row there
        self.readings: dict[int, tuple[ForwardReading, int]] = {}
        self._id_tensors: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}

    @property
    def _head(self) -> Any:
        """The LM head (its weights change as training goes, never the module)."""
        return self.model.get_output_embeddings()

    def backbone(self) -> torch.nn.Module:
        """The module whose output feeds the LM head (what TRL's fused forward calls)."""
        model = self.model
        if hasattr(model, "get_base_model"):  # PEFT: the patched transformers model inside
            model = model.get_base_model()
        return model.base_model  # type: ignore[return-value]

    def read(
        self,
        run: Callable[[], Any],
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None,
        rows: Sequence[int | None],
    ) -> Any:
        """Run TRL's `_get_per_token_logps_and_entropies` (`run`) over `input_ids`, whose row r
        is row id `rows[r]` (None: not kept), keeping each row's first reading; returns what
        `run` returns."""
        chunks: list[_Chunk] = []
        size = batch_size or input_ids.size(0)
        K = logits_to_keep

        def hook(module: Any, args: Any, output: Any) -> None:
            hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
            start = len(chunks) * size
            labels = input_ids[start : start + hidden.size(0), -K:]
            # position j of the completion is predicted from the hidden state just before it
            chunks.append(self._chunk(hidden[:, -K - 1 : -1], labels))

        handle = self.backbone().register_forward_hook(hook)
        try:
            result = run()
        finally:
            handle.remove()
        logps = result[0].detach().float()
        if sum(c.sampled.size(0) for c in chunks) != input_ids.size(0):
            return result  # not the pass we understood (the hook fired otherwise): no reading
        measured = attention_mask[:, -K:].bool()
        offset = 0
        for chunk in chunks:
            b = chunk.sampled.size(0)
            log_z = chunk.sampled - logps[offset : offset + b]  # (b, K)
            reading = ForwardReading(
                logps[offset : offset + b],
                # at most 1: log_z is TRL's logit less its logprob, and where a collapsed
                # policy's logits run to thousands, their rounding apart is a few hundredths
                torch.exp(chunk.control - log_z[..., None]).clamp_(max=1.0),
                measured[offset : offset + b],
                {r: (p, z - log_z[r, p]) for r, (p, z) in chunk.watched.items()},
            )
            for r in range(b):
                row = rows[offset + r]
                # a later pass of the same rollout (num_iterations > 1) is not kept
                if row is not None and row not in self.readings:
                    self.readings[row] = (reading, r)
            offset += b
        return result

    def _chunk(self, hidden: torch.Tensor, labels: torch.Tensor) -> _Chunk:
        with torch.no_grad():
            ids = self._ids(self.control_ids, hidden.device)
            control_rows = self._rows(ids)
            sampled_parts, control_parts = [], []
            # a few rows at a time: the float32 copies (hidden states, the sampled tokens' head
            # rows) stay near POSITIONS × width, whatever the batch
            step = max(1, POSITIONS // max(1, labels.size(1)))
            for start in range(0, hidden.size(0), step):
                h = hidden[start : start + step].detach().float()
                y = labels[start : start + step]
                dots = (h * self._rows(y)).sum(dim=-1)  # (b, K): each position's h·W[y]
                sampled_parts.append(self._logits(dots, y))
                control_parts.append(self._logits(h @ control_rows.T, ids))
            sampled = sampled_parts[0] if len(sampled_parts) == 1 else torch.cat(sampled_parts)
            control = control_parts[0] if len(control_parts) == 1 else torch.cat(control_parts)
            watched: dict[int, tuple[int, torch.Tensor]] = {}
            h = hidden
            if self.watch_ids and self.after_token_id is not None:
                # the first position right after the opening tag (never the completion's first)
                after = labels[:, :-1] == self.after_token_id
                ids = self._ids(self.watch_ids, h.device)
                for r in after.any(dim=1).nonzero().flatten().tolist():
                    position = int(after[r].nonzero()[0]) + 1
                    z = h[r, position].detach().float() @ self._rows(ids).T
                    watched[r] = (position, self._logits(z, ids))
        return _Chunk(sampled, control, watched)

    def _ids(self, ids: list[int], device: torch.device) -> torch.Tensor:
        """`ids` as a tensor on `device`, made once."""
        key = (tuple(ids), str(device))
        found = self._id_tensors.get(key)
        if found is None:
            found = self._id_tensors[key] = torch.tensor(ids, device=device)
        return found

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The LM head's weight rows of `ids`, float32."""
        return self._head.weight[ids].detach().float()  # type: ignore[index,union-attr]

    def _logits(self, dots: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """z = f(h·W + b) / T, as TRL's fused head transforms its logits (a factor of 1 is
        not applied: the same numbers, two tensor operations fewer)."""
        bias = getattr(self._head, "bias", None)
        if bias is not None:
            dots = dots + bias[ids].detach().float()
        z = dots * self.logit_scale if self.logit_scale != 1.0 else dots
        if self.softcap is not None:
            z = self.softcap * torch.tanh(z / self.softcap)
        return z / self.temperature if self.temperature != 1.0 else z

    def taken(self, rows: Sequence[int]) -> list[ForwardRow | None]:
        """The readings of `rows` (None: not read), taken out of the probe: each chunk they were
        read in copied off the device once, nothing done a row but finding it."""
        out: list[ForwardRow | None] = []
        for row in rows:
            found = self.readings.pop(row, None)
            out.append(None if found is None else ForwardRow(found[0].on_host(), found[1]))
        return out

    def clear(self) -> None:
        self.readings.clear()


def _logit_scale(config: Any) -> float:
    """The multiplier TRL's fused head applies to the logits (trl.trainer.utils.add_fused_lm_head
    reads the same attributes in the same order)."""
    scale = getattr(config, "logit_scale", None)
    if scale is None:
        scale = getattr(config, "output_multiplier", None)
    if scale is None:
        scale = getattr(config, "lm_head_multiplier", None)
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        scaling = config.logits_scaling
        scale = scaling if config.model_type == "hyperclovax" else 1 / scaling
    return 1.0 if scale is None else float(scale)
