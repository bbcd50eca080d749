"""Domain exceptions: raised anywhere, turned into messages or HTTP errors in one place each."""


class RolloutLensError(Exception):
    """Base for errors a person should read."""


class DatabaseBehind(RolloutLensError):
    """The database is not at the latest migration."""


class NotFound(RolloutLensError):
    """A run or step that does not exist."""


class StepNotFound(NotFound):
    """A step that was not recorded; names the nearest recorded one for the 404 page."""

    def __init__(self, *, run_id: int, step: int, nearest: int | None) -> None:
        hint = f"; the nearest recorded step is {nearest}" if nearest is not None else ""
        super().__init__(f"run {run_id} has no step {step}{hint}")
        self.run_id, self.step, self.nearest = run_id, step, nearest


class GroupNotFound(StepNotFound):
    """A group that the step did not record; the 404 page offers the step's groups overview."""

    def __init__(self, *, run_id: int, step: int, group: int) -> None:
        NotFound.__init__(self, f"step {step} of run {run_id} has no group {group}")
        self.run_id, self.step, self.nearest, self.group = run_id, step, step, group


class InvalidInput(RolloutLensError):
    """Input that fails validation."""


class StepRefused(InvalidInput):
    """A step the run cannot take as it was sent, refused before any of it is written (a 409
    naming the `step`): a script's recorder drops it alone, counts it and goes on."""

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step


class StepOutOfOrder(StepRefused):
    """A step the run does not have that comes after a later one (the run's last recorded step,
    or one sent before it): steps only rise (a resumed trainer says so when it starts:
    server.store.resume)."""

    def __init__(self, *, step: int, last: int) -> None:
        super().__init__(
            f"step {step} comes after step {last}: a run's steps only rise (a trainer resumed "
            "from a checkpoint says so when it starts, and its steps after the checkpoint "
            "replace the run's)",
            step=step,
        )
        self.last = last


class RolloutsTaken(StepRefused):
    """A step whose rollouts were generated at an earlier step (its `rollout_step`) whose
    rollouts the run has already: a generation's rollouts are recorded once, with the first
    step that uses them (the later steps of the generation carry none)."""

    def __init__(self, *, step: int, rollout_step: int) -> None:
        super().__init__(
            f"step {step}'s rollouts were generated at step {rollout_step}, whose rollouts "
            "were recorded already: a generation's rollouts are recorded once, with the first "
            "step that uses them (send the later steps without rollouts)",
            step=step,
        )
        self.rollout_step = rollout_step


class InvalidState(RolloutLensError):
    """An action that the run's current status does not allow."""


class RunEnded(InvalidState):
    """A recorder writing to a run that has ended: a 409 whose JSON says the run's `status` and
    who ended it (`ended_by`), so the recorder knows to stop (a cancel: training stops too)."""

    def __init__(self, message: str, *, run_id: int, status: str, ended_by: str | None) -> None:
        super().__init__(message)
        self.run_id, self.status, self.ended_by = run_id, status, ended_by


class QueueFull(InvalidState):
    """Queuing more runs would pass ROLLOUT_LENS_MAX_QUEUED_RUNS: nothing was queued."""


class BrokerUnavailable(RolloutLensError):
    """The task queue cannot be reached: nothing was queued."""
