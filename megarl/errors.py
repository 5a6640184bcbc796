"""Exception types raised at megarl's boundaries (config, data, checkpoints, user code)."""


class MegarlError(Exception):
    """Base class of every error megarl raises on purpose."""


class ConfigError(MegarlError, ValueError):
    """An experiment config is invalid. The message names the key and what would be valid."""


class DataError(MegarlError, ValueError):
    """A dataset, row or column is invalid. The message names the file, row and column."""


class CheckpointError(MegarlError, RuntimeError):
    """A checkpoint is missing, incomplete or does not match the model."""


class WorkerError(MegarlError, RuntimeError):
    """A distributed worker failed; the message names the role and rank."""


class EngineStateError(MegarlError, RuntimeError):
    """An engine was asked to compute while its state is elsewhere (offloaded, asleep)."""
