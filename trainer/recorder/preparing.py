"""A recorded step's raw parts, judged: the half of preparing a step that stays in the training
process.

The capture's Samples are built (trainer/recorder/captured.py: each one's write entity from
the host copies of TRL's tensors the capture kept) and each is judged by the user's functions,
which stay where the user's script defined them (a lambda, a function of `__main__`): a
JudgedStep. Its StepReader (trainer/recorder/reading.py) reads it into its StepRecord: a user's
script's database sink does so in the writer's own process, a launched run's on its writer's
thread; a dashboard's recording API is sent prepared steps (`prepare`, the StepWriter's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollout_lens.server.core.records import StepRecord
from rollout_lens.trainer.recorder import metrics as m
from rollout_lens.trainer.recorder import tags
from rollout_lens.trainer.recorder.judging import Completion, FunctionJudge, Judge, message_text
from rollout_lens.trainer.recorder.reading import JudgedStep, Sample, StepReader, Verdict

if TYPE_CHECKING:
    from rollout_lens.trainer.recorder.capture import RolloutCapture


class StepPreparer:
    """Prepares the steps of one run, as the callback attached to its trainer reads them: judged
    here (`judged`: the user's functions run in the training process) and read by its
    StepReader (`reader`), here (`prepare`) or where a sink reads them (a script's writer
    process)."""

    def __init__(
        self,
        trainer: Any,
        capture: RolloutCapture,
        *,
        judge: Judge,
        functions: FunctionJudge,
        target: Callable[[dict[str, Any]], str | None] | None,
        formats: list[tags.CallTags],
        end_tokens: list[str],
        control_tokens: list[str],
        watched: list[str],
    ) -> None:
        self.judge = judge
        self.target = target
        # found once: a tokenizer's missing attribute (tokenizer_of asks) is a slow look-up
        self.tokenizer = tokenizer = tokenizer_of(trainer)
        self.eos = set(getattr(trainer, "eos_token_ids", None) or [tokenizer.eos_token_id])
        self.reader = StepReader(
            tokenizer,
            group_size=int(trainer.num_generations),
            reward_names=list(getattr(trainer, "reward_func_names", []) or []),
            template_kwargs=dict(getattr(trainer, "chat_template_kwargs", None) or {}),
            scored=capture.reading == "forward",  # the trainer's side is TRL's scoring pass
            tool_calling=capture.tool_calling,
            # what no function judged is unknown, not zero
            unjudged=judge is functions and not functions.given("vote"),
            vote_given=functions.given("vote"),
            formats=formats,
            end_tokens=end_tokens,
            control_tokens=control_tokens,
            watched=watched,
        )

    def prepare(self, raw: dict[str, Any]) -> StepRecord:
        """A step's raw parts (the callback's) → its StepRecord, judged and read here."""
        return self.reader.complete(self.judged(raw))

    def judged(self, raw: dict[str, Any]) -> JudgedStep:
        """A step's raw parts → the step judged (the user's functions run here), to be read."""
        samples = [s for part in raw["captured"] for s in part.samples()]
        verdicts = [self._verdict(sample) for sample in samples]
        rewards = [s.record.verifier_reward for s in samples]
        return JudgedStep(
            step=raw["step"],
            rollout_step=raw["rollout_step"],
            values={},
            rollouts=[s.record for s in samples],
            samples=samples,
            verdicts=verdicts,
            raw={key: value for key, value in raw.items() if key != "captured"},
            kept={"reward_mean": m.mean(rewards)} if samples else {},
        )

    def _verdict(self, sample: Sample) -> Verdict:
        """One rollout judged: its text (with tools, the whole conversation as the model saw
        it, tool results included), whether it was cut off, the judge's word, its target."""
        ids = sample.record.completion_ids
        text = (
            message_text(sample.completion)
            if sample.tool_mask is None
            else self.tokenizer.decode(ids.tolist())
        )
        truncated = not len(ids) or int(ids[-1]) not in self.eos
        judgement = self.judge(
            Completion(
                text=text,
                messages=sample.completion,
                row=sample.row,
                prompt=sample.prompt,
                truncated=truncated,
            )
        )
        return Verdict(text, truncated, judgement, self._target(sample.row))

    def _target(self, row: dict[str, Any]) -> str | None:
        if self.target is not None:
            try:
                found = self.target(row)
            except Exception:  # noqa: BLE001
                return None
            return None if found is None else str(found)
        value = row.get("target")
        return None if value is None else str(value)

    def tag_notes(self) -> list[str]:
        """What the run page says of the call tags (the reader's)."""
        return self.reader.tag_notes()


def tokenizer_of(trainer: Any) -> Any:
    processing = trainer.processing_class
    return getattr(processing, "tokenizer", None) or processing
