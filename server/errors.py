"""Domain exceptions: raised anywhere, turned into messages or HTTP errors in one place each."""


class RolloutLensError(Exception):
    """Base for errors a person should read."""


class DatabaseBehind(RolloutLensError):
    """The database is not at the latest migration."""


class NotFound(RolloutLensError):
    """A run or step that does not exist."""


class InvalidInput(RolloutLensError):
    """Input that fails validation."""


class InvalidState(RolloutLensError):
    """An action that the run's current status does not allow."""


class BrokerUnavailable(RolloutLensError):
    """The task queue cannot be reached: nothing was queued."""
