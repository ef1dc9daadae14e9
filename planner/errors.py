"""Typed exceptions. The CLI turns each into one line on stderr and a non-zero exit."""


class MoeplanError(Exception):
    """Base class of every error moeplan reports to a user as one line."""

    exit_code = 2


class InputError(MoeplanError):
    """A file, directory or argument given by the user is missing or malformed."""


class SchemaError(MoeplanError):
    """An artifact does not follow its declared format (trace, counts, predictor, bundle)."""


class ModelError(MoeplanError):
    """A model directory cannot be profiled (not an MoE model, unsupported architecture)."""


class MismatchError(MoeplanError):
    """Artifacts that belong to different models (or shapes) were combined."""


class InfeasibleError(MoeplanError):
    """A placement problem has no solution under the given constraints."""
