"""Argument checks shared by the public APIs (each caller words its own error)."""

from __future__ import annotations

import numpy as np


def is_integer(value: object) -> bool:
    """A Python or numpy integer, not a bool (``True`` is an ``int`` to Python)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)
