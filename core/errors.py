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


class OptionalDependencyError(AtelierError):
    """A feature needs a package or hardware that is not present."""


class Cancelled(AtelierError):
    """The job was cancelled by its owner."""
