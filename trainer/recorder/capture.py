"""Capture every generation of an unmodified TRL GRPOTrainer, rollout by rollout, in group order.

`RolloutCapture.install(trainer)` wraps some of the trainer's own methods on the instance (no
subclass, nothing for the user to change; every run is recorded this way, launched or a user's):
- TRL's scoring forward pass (`_get_per_token_logps_and_entropies`, and `_compute_loss` to know
  which rollouts a micro-batch holds), to read sampled-token logprobs and control-token
  probabilities with a ForwardProbe: on every generation path (transformers' generate,
  continuous batching, vLLM, TRL's tool loop), from the pass at the weights that sampled;
- generation, for the hooks below (and, with `reading="generate"`, to bind a GenerationProbe:
  the same numbers read off generate's logits, one log-softmax per token);
- reward calculation, to keep the completions and each reward function's values;
- `_generate_and_score_completions`, to pair them with the advantages and hand one generation
  on. Under several processes the rollouts of every process are gathered to the main one in
  process order, which is the order TRL forms its groups in.

Which forward pass is the sampling policy's: TRL computes an old-policy pass inside
`_generate_and_score_completions` (num_iterations > 1, a generation spread over optimizer steps,
vLLM's importance-sampling correction); it runs right after generation, before any update, so
its weights are the ones that sampled. Otherwise TRL skips it because every micro-batch of the
generation is trained within one optimizer step (gradient_accumulation_steps is a multiple of
steps_per_generation × num_iterations): all of its loss passes run before that step's update,
at the sampling weights, so each rollout's first loss pass is read. TRL shuffles a generation
and splits it into micro-batches (`_prepare_inputs`); a row-id column added to the generation's
output travels with them and says which rollout each row is.

A run launched from the dashboard adds to this through GenerationHooks: in-group supervision
(rows sampled from a hinted prompt, or replaced by an expert reply, measured by one forward pass
of the policy) and its failures collected for SFT; the id-position probe is the probe's
`watch_ids` after the opening tag.

A generation is kept here as a Captured (trainer/recorder/captured.py): TRL's lists by
reference and its tensors (ids, rewards, advantages, the generator's `sampling_per_token_logps`,
the probe's readings a chunk) copied off the device once each, nothing done a rollout on the
training thread but finding its reading. Each rollout's Sample (the store's write entity,
RolloutRecord: ids, logprobs [n] and control-token probabilities [n × k] as numpy arrays in the
entity's orientation, the generator's logprobs or None, the total reward and the advantage;
with what judging it needs beside it) is built from that later, on the writer's thread with
the rest of the step (the callback's `_prepare` completes the entity: prompts rendered, user
functions run, summaries computed); on the training thread only where a hook wants the
rollouts as soon as they are scored.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rollout_lens.trainer.recorder import turns
from rollout_lens.trainer.recorder.captured import Arrays, Captured, Reading, Sample, unread
from rollout_lens.trainer.recorder.probe import ForwardProbe, GenerationProbe, SamplingProbe, bound

log = logging.getLogger("rollout_lens")

# Methods of GRPOTrainer the capture wraps (present in TRL 1.0 to 1.x).
_GENERATE = "_generate_single_turn"
_REWARDS = "_calculate_rewards"
_SCORE = "_generate_and_score_completions"
_TOOL_LOOP = "_tool_call_loop"  # TRL's tool loop (tool-calling runs): its first result is tool_mask
_LOGPS = "_get_per_token_logps_and_entropies"  # TRL's scoring forward pass (fused LM head)
_LOSS = "_compute_loss"  # one micro-batch's loss: its own scoring pass
ROW_KEY = "rollout_lens_row"  # the column of row ids added to a generation's output

# The readings a capture can take: off TRL's scoring pass, or off generate's logits.
READINGS = ("forward", "generate")
# TRL's output tensors a generation keeps (host copies), those it has
_KEPT = ("completion_ids", "sampling_per_token_logps", "tool_mask")


class GenerationHooks:
    """What a run adds around generation; every method may be left as it is (no change).

    `rows` are the dataset rows of the generation in progress (TRL's inputs, prompt included),
    one per completion, in group order."""

    def sampling_prompts(
        self, trainer: Any, prompt_ids: list[list[int]], rows: list[dict[str, Any]], group: int
    ) -> tuple[list[list[int]], dict[int, dict[str, Any]]]:
        """The prompts to sample from (the update still sees TRL's own), and meta per row."""
        return prompt_ids, {}

    def replace_completions(
        self,
        trainer: Any,
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        rows: list[dict[str, Any]],
        group: int,
    ) -> tuple[dict[int, list[int]], dict[int, dict[str, Any]]]:
        """Completions to train on instead of the sampled ones (row -> ids), and meta per row."""
        return {}, {}

    def on_generation(self, rollouts: list[Sample]) -> None:
        """Every training generation's rollouts (this process's), as soon as they are scored."""


@dataclass
class Generation:
    """The rollouts of one generation, all processes together, in TRL's group order: each
    process's Captured, its Samples built when first asked for (`rollouts`)."""

    rollout_step: int  # the optimizer step that first trains on them
    parts: list[Captured] = field(default_factory=list)

    @property
    def rollouts(self) -> list[Sample]:
        return [sample for part in self.parts for sample in part.samples()]


@dataclass
class _Pending:
    """This process's rollouts of a generation whose readings come from its loss passes."""

    rollout_step: int
    captured: Captured
    rows: list[int]  # the row id of each rollout


@dataclass
class _Generating:
    """The generation in progress (one `_generate_and_score_completions` call): what the
    capture's wrappers found of it, kept as a Captured once it is scored (`captured`)."""

    inputs: list[dict[str, Any]]  # the dataset rows, one per completion, in group order
    rows: list[int]  # their row ids (unique over the run)
    row_meta: dict[int, dict[str, Any]] = field(default_factory=dict)  # the hooks' meta a row
    replaced: dict[int, Arrays] = field(default_factory=dict)
    # Each `_generate_single_turn` call: its probe and the ids it returned. One call for a
    # single-turn generation; with tools, the first turn of every row, then one call per tool
    # iteration on the rows that called a tool (trainer/recorder/turns.py).
    calls: list[tuple[GenerationProbe, list[list[int]]]] = field(default_factory=list)
    # The same calls' sampling probes (transformers' generate): the generator's own logprobs.
    sampling: list[tuple[SamplingProbe, list[list[int]]]] = field(default_factory=list)
    swapped: set[int] = field(default_factory=set)  # rows the hooks replaced: not sampled
    prompt_ids: list[list[int]] | None = None  # the first call's: the prompts as seen
    tool_mask: list[list[int]] | None = None  # from TRL's tool loop, unpadded
    # TRL's completions, completion ids and this process's rewards [n × functions] (host)
    scored: tuple[list[Any], list[list[int]], Any] | None = None

    def captured(
        self, capture: RolloutCapture, output: dict[str, Any], *, read_now: bool = True
    ) -> Captured:
        """This process's rollouts of the generation just scored, as TRL gave them, with the
        readings taken so far (`read_now`: off the old-policy pass; else `flush` takes them
        off the loss passes). A tensor is copied to the host once; nothing is done a rollout."""
        completions, ids_list, rewards = self.scored  # type: ignore[misc]
        kept = list(_KEPT) + (["prompt_ids", "prompt_mask"] if capture.tool_calling else [])
        return Captured(
            inputs=self.inputs,
            completions=completions,
            ids=ids_list,
            rewards=rewards,
            weights=[float(w) for w in capture.trainer.reward_weights.tolist()],
            advantages=_host(output["advantages"]),
            control_tokens=capture.control_tokens,
            tensors={k: _host(output[k]) for k in kept if output.get(k) is not None},
            readings=self._readings(capture, output, ids_list, read_now),
            tool_calling=capture.tool_calling,
            tool_mask=self.tool_mask,
            prompt_ids=self.prompt_ids,
            row_meta=self.row_meta,
            sampling=self._settled(ids_list),
            swapped=set(self.swapped),
        )

    def _settled(self, ids_list: list[list[int]]) -> list[tuple[SamplingProbe, list[list[int]]]]:
        """The sampling probes of the generation, each call's readings copied to the host
        once (single-turn: its one call, whose ids are TRL's)."""
        calls = [(probe, returned or ids_list) for probe, returned in self.sampling]
        for probe, returned in calls:
            probe.settle(returned)
        return calls

    def _readings(
        self,
        capture: RolloutCapture,
        output: dict[str, Any],
        ids_list: list[list[int]],
        read_now: bool,
    ) -> list[Reading]:
        """Each row's reading: the forward probe's (now, or None until `flush`), else the
        arrays generate's probe or TRL's own give; replaced completions (expert replies) as
        their forward pass read them."""
        readings: list[Reading]
        if capture.forward is not None:
            readings = list(
                capture.forward.taken(self.rows) if read_now else [None] * len(ids_list)
            )
            has_control = True
        else:
            logprobs, control = self.logprobs(capture, output, ids_list)
            watched: list[list[float] | None] = [None] * len(ids_list)
            if len(self.calls) == 1 and capture.watch_ids:
                watched = [self.calls[0][0].watched(i) for i in range(len(ids_list))]
            probes = control if control is not None else [None] * len(ids_list)
            readings = list(zip(logprobs, probes, watched, strict=True))
            has_control = control is not None
        for i, (sampled, probs, seen) in self.replaced.items():
            readings[i] = (sampled, probs if has_control else None, seen)
        return readings

    def logprobs(
        self, capture: RolloutCapture, output: dict[str, Any], ids_list: list[list[int]]
    ) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
        """Per row, logprobs [n] and control-token probabilities [n × k] as float64 arrays:
        the probe's when it ran (stitched turn by turn with tools); else the sampling (vLLM) or
        old-policy logprobs TRL has, and no control-token probabilities (None)."""
        if self.tool_mask is not None and self.calls:
            stitched = turns.stitch(
                self.calls, ids_list, self.tool_mask, len(capture.control_token_ids)
            )
            if stitched is not None:
                return stitched
            if not capture._warned_stitch:
                capture._warned_stitch = True
                log.warning(
                    "Rollout Lens: the generation calls did not line up with the tool turns; "
                    "logprobs of this generation are not recorded"
                )
            return [np.zeros(0) for _ in ids_list], None
        if len(self.calls) == 1 and self.calls[0][0].used:
            return self.calls[0][0].finish(ids_list)
        for key in ("sampling_per_token_logps", "old_per_token_logps"):
            found = output.get(key)
            if found is not None:
                rows = found.detach().cpu().double().numpy()
                return [row[: len(ids)] for row, ids in zip(rows, ids_list, strict=True)], None
        return [np.zeros(0) for _ in ids_list], None


class RolloutCapture:
    """Wraps a GRPOTrainer's generation and scoring to hand each generation to `on_generation`."""

    def __init__(
        self,
        trainer: Any,
        *,
        control_token_ids: list[int],
        on_generation: Callable[[Generation], None],
        control_tokens: list[str] | None = None,
        watch_ids: list[int] | None = None,
        after_token_id: int | None = None,
        hooks: GenerationHooks | None = None,
        reading: str = "forward",
    ) -> None:
        """`watch_ids` (e.g. every tool id) are read right after `after_token_id` (the opening
        tag): the distribution the policy chooses its answer from. `reading` says where the
        logprobs and control-token probabilities come from: "forward" (TRL's scoring pass,
        every generation path) or "generate" (generate's logits; other paths record none)."""
        if reading not in READINGS:
            raise ValueError(f"reading must be one of {READINGS}, not {reading!r}")
        self.reading: str | None = reading
        self.trainer = trainer
        self.control_token_ids = control_token_ids
        self.control_tokens = list(control_tokens or [])  # their names (the entity's columns)
        self.on_generation = on_generation
        self.watch_ids = list(watch_ids or [])
        self.after_token_id = after_token_id
        self.hooks = hooks or GenerationHooks()
        self.notes: list[str] = []
        self._gen = _Generating([], [])  # the generation in progress
        missing = [name for name in (_REWARDS, _SCORE) if not hasattr(trainer, name)]
        if missing:
            raise RuntimeError(
                f"this TRL GRPOTrainer has no {', '.join(missing)}: Rollout Lens supports "
                "trl>=1.0,<2"
            )
        self._warned_stitch = False
        self._warned_unread = False
        self.forward: ForwardProbe | None = None
        self._arm: list[int | None] | None = None  # row ids of the next scoring pass to read
        self._next_row = 0  # row ids are unique over the run
        self._pending: list[_Pending] = []  # generations waiting for their loss passes
        self._wanted: set[int] = set()  # their row ids not read yet
        self._unwrapped: tuple[Any, Any] | None = None  # (trainer.model, the model inside it)
        self.reading = choose_reading(trainer, reading, self.notes)
        self.probing = self.reading is not None

    def install(self) -> None:
        """Wrap the trainer's methods on the instance."""
        trainer = self.trainer
        if self.reading == "generate" or (
            self.reading == "forward" and hasattr(trainer, _GENERATE)
        ):
            original_generate = getattr(trainer, _GENERATE)
            setattr(trainer, _GENERATE, functools.partial(self._generate, original_generate))
        if self.reading == "forward":
            self.forward = ForwardProbe(
                trainer.accelerator.unwrap_model(trainer.model),
                self.control_token_ids,
                float(trainer.temperature or 1.0),
                after_token_id=self.after_token_id,
                watch_ids=self.watch_ids,
            )
            original_logps = getattr(trainer, _LOGPS)
            setattr(trainer, _LOGPS, functools.partial(self._scoring_pass, original_logps))
            original_loss = getattr(trainer, _LOSS)
            setattr(trainer, _LOSS, functools.partial(self._loss, original_loss))
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
        trainer = self.trainer
        training = bool(trainer.model.training) and not self.tool_calling
        training = training and len(args) >= 4  # (prompt_ids, images, fields, num_generations)
        if training and self._hooked("sampling_prompts"):
            sampled_from, meta = self.hooks.sampling_prompts(
                trainer, list(args[0]), self._gen.inputs, int(args[3])
            )
            self._gen.row_meta.update(meta)
            args = (sampled_from, *args[1:])
        # the scoring pass reads every row (every turn of a tool-calling one) at once; generate's
        # probe, with reading "generate", reads them off generation instead
        probe = None
        if self.reading == "generate":
            probe = GenerationProbe(
                self.control_token_ids,
                float(trainer.temperature or 1.0),
                after_token_id=self.after_token_id,
                watch_ids=self.watch_ids,
            )
        sampling = None
        if trainer.model.training and generates_locally(trainer):
            sampling = SamplingProbe()  # the generator's own logprobs
        with bound(self._model(), probe, sampling, batched=batches(trainer)):
            result = original(*args, **kwargs)
        if not self.tool_calling:  # one call per generation: no turns to stitch
            self._gen.calls = [(probe, [])] if probe is not None else []
            self._gen.sampling = [(sampling, [])] if sampling is not None else []
            replacing = training and self._hooked("replace_completions")
            return self._replace(probe, args, result) if replacing else result
        prompt_ids, completion_ids = _call_ids(result, args, kwargs)
        returned = [[int(t) for t in ids] for ids in completion_ids]
        if sampling is not None:
            self._gen.sampling.append((sampling, returned))
        if probe is not None:
            if not self._gen.calls and prompt_ids is not None:
                self._gen.prompt_ids = [[int(t) for t in p] for p in prompt_ids]
            self._gen.calls.append((probe, returned))
        return result

    def _hooked(self, name: str) -> bool:
        """Whether the run's hooks do something at `name` (a method GenerationHooks leaves as
        it is costs nothing, not even the copies of every row's ids it would be handed)."""
        return getattr(type(self.hooks), name) is not getattr(GenerationHooks, name)

    def _model(self) -> Any:
        """The model inside the trainer's, found once a wrapping (accelerate's unwrap_model
        asks the file system whether deepspeed is installed on every call)."""
        wrapped = self.trainer.model
        if self._unwrapped is None or self._unwrapped[0] is not wrapped:
            self._unwrapped = (wrapped, self.trainer.accelerator.unwrap_model(wrapped))
        return self._unwrapped[1]

    def _replace(self, probe: GenerationProbe | None, args: tuple[Any, ...], result: Any) -> Any:
        """The hooks' replacement completions (expert replies), measured by a forward pass when
        generate's probe read them (it saw the sampled reply, not the one trained on); TRL's
        scoring pass reads the reply trained on itself."""
        completion_ids, logprobs = result[0], result[1]
        prompt_ids = [list(p) for p in args[0]]
        replaced, meta = self.hooks.replace_completions(
            self.trainer,
            prompt_ids,
            [list(c) for c in completion_ids],
            self._gen.inputs,
            int(args[3]),
        )
        self._gen.row_meta.update(meta)
        if not replaced:
            return result
        self._gen.swapped.update(replaced)
        completion_ids = list(completion_ids)
        for i, ids in replaced.items():
            completion_ids[i] = list(ids)
            if probe is not None and probe.used:
                self._gen.replaced[i] = forward_measure(
                    self.trainer,
                    prompt_ids[i],
                    list(ids),
                    self.control_token_ids,
                    self.watch_ids,
                    self.after_token_id,
                )
        return (completion_ids, logprobs, *result[2:])

    def _tool_loop(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        self._gen.tool_mask = [list(mask) for mask in result[0]]
        return result

    def _scoring_pass(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """TRL's `_get_per_token_logps_and_entropies`: read by the ForwardProbe when armed."""
        names = ("model", "input_ids", "attention_mask", "logits_to_keep")
        named = dict(zip(names, args, strict=False))
        named.update(kwargs)
        if self._arm is None or self.forward is None or "input_ids" not in named:
            return original(*args, **kwargs)
        if named.get("model") is getattr(self.trainer, "ref_model", None):
            return original(*args, **kwargs)  # the reference model: not the policy
        rows, self._arm = self._arm, None  # one pass: the next policy pass only
        batch_size = named.get("batch_size", args[4] if len(args) > 4 else None)
        return self.forward.read(
            lambda: original(*args, **kwargs),
            named["input_ids"],
            named["attention_mask"],
            int(named["logits_to_keep"]),
            batch_size,
            rows,
        )

    def _loss(self, original: Callable[..., Any], model: Any, inputs: Any) -> Any:
        """One micro-batch's loss: its scoring pass is read for the rollouts still waiting."""
        found = inputs.get(ROW_KEY) if isinstance(inputs, dict) else None
        if found is None or not self._wanted:
            return original(model, inputs)
        rows = [r if r in self._wanted else None for r in found.tolist()]
        if not any(r is not None for r in rows):
            return original(model, inputs)
        self._arm = rows
        try:
            return original(model, inputs)
        finally:
            self._arm = None
            assert self.forward is not None
            self._wanted.difference_update(self.forward.readings)

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
        rows = _host(rewards_per_func[start : start + n])
        self._gen.scored = (completions, list(completion_ids_list), rows)
        return rewards_per_func

    def _score(self, original: Callable[..., Any], inputs: list[dict[str, Any]]) -> Any:
        rows = list(range(self._next_row, self._next_row + len(inputs)))
        self._gen = _Generating(list(inputs), rows)
        trainer = self.trainer
        training = bool(trainer.model.training)
        if self.forward is not None and training:
            self._next_row += len(inputs)
            # TRL's old-policy pass, when it computes one, is the next pass of the policy
            self._arm = list(self._gen.rows)
        try:
            output = original(inputs)
        finally:
            self._arm = None
        if not training or self._gen.scored is None:
            return output  # evaluation: not a training generation
        pending = False
        if self.forward is not None and "old_per_token_logps" not in output:
            # No old-policy pass: what was read (a PEFT reference pass, if any) is not the
            # policy's. Each rollout's first loss pass is read instead (the module docstring).
            for row in self._gen.rows:
                self.forward.readings.pop(row, None)
            output[ROW_KEY] = torch_rows(self._gen.rows, output["advantages"].device)
            self._wanted.update(self._gen.rows)
            pending = True
        local = self._gen.captured(self, output, read_now=not pending)
        if self._hooked("on_generation"):
            self.hooks.on_generation(local.samples())  # built now: a hook wants them
        step = trainer.state.global_step + 1
        if pending:
            self._pending.append(_Pending(step, local, list(self._gen.rows)))
        else:
            self._hand_on(step, local)
        return output

    def flush(self, step: int) -> None:
        """Hand on the generations read off their loss passes, at the end of the optimizer
        step that trained them (every process calls this: it may gather)."""
        while self._pending and self._pending[0].rollout_step <= step:
            waiting = self._pending.pop(0)
            assert self.forward is not None
            self._wanted.difference_update(waiting.rows)
            waiting.captured.read(self.forward.taken(waiting.rows))
            missed = unread(waiting.captured)
            if missed and not self._warned_unread:
                self._warned_unread = True
                log.warning(
                    "Rollout Lens: %d rollouts of the generation trained at step %d were not "
                    "seen whole by a scoring pass before the update; their logprobs and "
                    "control-token probabilities are not recorded",
                    missed,
                    waiting.rollout_step,
                )
            self._hand_on(waiting.rollout_step, waiting.captured)

    def _hand_on(self, rollout_step: int, local: Captured) -> None:
        accelerator = self.trainer.accelerator
        if accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            everything = gather_object([local])  # a collective: every process calls it here
        else:
            everything = [local]
        if accelerator.is_main_process:
            self.on_generation(Generation(rollout_step, everything))


def _call_ids(result: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The prompt ids and completion ids of one `_generate_single_turn` call: trl 1.x returns
    (completion_ids, logprobs) and takes prompt ids; older ones returned (prompt_ids,
    completion_ids, logprobs, extra)."""
    if isinstance(result, tuple) and len(result) >= 4:
        return result[0], result[1]
    return kwargs.get("prompt_ids", args[0] if args else None), result[0]


def generates_locally(trainer: Any) -> bool:
    """Whether TRL's `_generate_single_turn` samples with transformers (`generate`, or
    continuous batching's `generate_batch`; not vLLM, and a rollout_func bypasses it), where a
    SamplingProbe can read the generator's logprobs."""
    return not (
        getattr(trainer, "use_vllm", False) or getattr(trainer, "rollout_func", None) is not None
    )


def forward_measure(
    trainer: Any,
    prompt_ids: list[int],
    completion_ids: list[int],
    control_token_ids: list[int],
    watch_ids: list[int],
    after_token_id: int | None,
) -> tuple[Any, Any, list[float] | None]:
    """Logprobs [n], control probs [n × k] (numpy arrays) and watched logprobs of a
    completion the policy did not sample (an expert reply): one no-grad forward at the
    sampling temperature."""
    import torch

    model = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        ids = torch.tensor([prompt_ids + completion_ids], device=trainer.accelerator.device)
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
        logprobs = torch.log_softmax(logits / float(trainer.temperature or 1.0), dim=-1)
        sampled = logprobs.gather(1, ids[0, len(prompt_ids) :, None]).squeeze(1)
        sampled = sampled.cpu().double().numpy()
        control = logprobs[:, control_token_ids].exp().cpu().double().numpy()
        watched = None
        if watch_ids and after_token_id is not None and after_token_id in completion_ids:
            position = completion_ids.index(after_token_id) + 1
            if position < len(completion_ids):
                watched = logprobs[position, watch_ids].tolist()
    return sampled, control, watched


def choose_reading(trainer: Any, wanted: str, notes: list[str]) -> str | None:
    """Where this trainer's readings can come from (None: nowhere), with the run's note."""
    if wanted == "forward":
        if hasattr(trainer, _LOGPS) and hasattr(trainer, _LOSS):
            notes.append(_forward_note(trainer))
            if getattr(trainer, "mask_truncated_completions", False):
                notes.append(
                    "mask_truncated_completions: TRL's pass does not see a truncated "
                    "completion, so its logprobs and control-token probabilities are not "
                    "recorded"
                )
            return "forward"
        notes.append(
            "this TRL version scores completions elsewhere: logprobs and control-token "
            "probabilities are not read off its forward pass"
        )
    return "generate" if can_probe(trainer, notes) else None


def batches(trainer: Any) -> bool:
    """Whether TRL generates with transformers' continuous batching (`generate_batch`)."""
    return bool(
        getattr(trainer, "use_transformers_continuous_batching", False)
        or getattr(trainer, "use_transformers_paged", False)
    )


def _forward_note(trainer: Any) -> str:
    scoring = (
        "per-token logprobs and control-token probabilities are read off TRL's own scoring "
        "forward pass at the weights that sampled (its old-policy pass when it computes one, "
        "else each rollout's first loss pass before the optimizer step)"
    )
    if getattr(trainer, "rollout_func", None) is not None:
        return (
            "generation by a rollout_func (the logprobs it returns are recorded as the "
            f"generator's; none where it returns none): {scoring}"
        )
    if getattr(trainer, "use_vllm", False):
        return (
            f"generation by vLLM (its sampling logprobs are recorded as the generator's): {scoring}"
        )
    if batches(trainer):
        return (
            f"continuous-batching generation: {scoring}; the generator's logprobs are those "
            "generate_batch returns with return_logprobs, under the processed scores each "
            "token was drawn from, on every training generation"
        )
    return (
        f"generation by transformers' generate: {scoring}; the generator's logprobs are read "
        "off generate's own sampling distribution, after its temperature, top-k, top-p and "
        "other processors, on every training generation"
    )


def can_probe(trainer: Any, notes: list[str]) -> bool:
    """Whether generate's logits can be read (else the run's note says why not)."""
    if getattr(trainer, "use_vllm", False):
        notes.append(
            "generation by vLLM: per-token logprobs are vLLM's sampling logprobs; "
            "control-token probabilities are not recorded"
        )
        return False
    if batches(trainer):
        notes.append("continuous-batching generation: control-token probabilities are not recorded")
        return False
    if not hasattr(trainer, _GENERATE):
        notes.append(
            "this TRL version generates elsewhere: control-token probabilities are not recorded"
        )
        return False
    return True


def torch_rows(rows: list[int], device: Any) -> Any:
    """Row ids as a tensor TRL shuffles and splits with the rest of a generation."""
    import torch

    return torch.tensor(rows, dtype=torch.long, device=device)


def _host(tensor: Any) -> Any:
    """A tensor copied to the host (a copy even there: TRL's own is not kept)."""
    return tensor.detach().to("cpu", copy=True)
