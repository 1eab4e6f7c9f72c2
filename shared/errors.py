"""User-facing error types: raised for bad input, caught by the CLIs and turned into clear messages."""


class DFlashError(Exception):
    """Base class of every error that is the user's input, not a bug in this project."""


class ConfigError(DFlashError, ValueError):
    """A config.json (or a CLI flag) holds a value this project cannot serve."""


class CheckpointError(DFlashError):
    """A checkpoint folder is missing files, or holds tensors of the wrong name, shape or dtype."""


class RequestError(DFlashError, ValueError):
    """A generation request is invalid (empty prompt, too long, bad sampling parameters). param: the API field
    at fault, where one is; code: a machine-readable kind (e.g. context_length_exceeded), where one applies."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class WorkerFault(DFlashError):
    """A fault of the worker itself (e.g. a lost tensor-parallel rank), not of any request: the engine does not
    look for a request to blame, the worker stops."""
