"""The project's error types. Each message is written for the person who can act on it."""


class AtelierError(Exception):
    """Base class: a problem with a message a person can act on (shown as-is by UI and CLI)."""


class InputError(AtelierError, ValueError):
    """A request parameter is out of range or malformed."""


class ModelLoadError(AtelierError):
    """A model file or id could not be found, parsed or matched to a known architecture."""


class UnsafeModelError(ModelLoadError):
    """A model file asks to run code or import names we do not allow."""


class ResourceError(AtelierError):
    """Not enough memory, queue full, device unavailable."""


class QueueFull(ResourceError):
    """The bounded GPU queue has no free place; `retry_after_s` is a fair guess of when one frees up."""

    def __init__(self, message: str, retry_after_s: int = 5):
        super().__init__(message)
        self.retry_after_s = int(retry_after_s)


class OutOfMemory(ResourceError):
    """One request needs more memory than the device (or the process's allocation limit) can give it.
    Retrying the same request will fail again; a smaller one works."""


class OptionalDependencyError(AtelierError):
    """A feature needs a package or hardware that is not present."""


class Cancelled(AtelierError):
    """The job was cancelled by its owner."""
