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


class StepOutOfOrder(InvalidInput):
    """A step the run does not have that comes after a later one (the run's last recorded step,
    or one sent before it): steps only rise (a resumed trainer says so when it starts:
    server.store.resume)."""

    def __init__(self, *, step: int, last: int) -> None:
        super().__init__(
            f"step {step} comes after step {last}: a run's steps only rise (a trainer resumed "
            "from a checkpoint says so when it starts, and its steps after the checkpoint "
            "replace the run's)"
        )
        self.step, self.last = step, last


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
