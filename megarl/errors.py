"""Errors megarl raises for bad input. Each names the field, file or rank at fault."""


class MegarlError(Exception):
    """Base class: a problem the user can fix, reported without a traceback by the CLI."""


class ConfigError(MegarlError, ValueError):
    """A configuration value is invalid; the message names the field."""


class UnsupportedModelError(MegarlError, ValueError):
    """The model is not a Llama-family architecture megarl can run; names the field."""


class CheckpointError(MegarlError, FileNotFoundError):
    """A path is missing or is not the kind of checkpoint expected; names the path."""
