"""Argument checks shared by the public APIs (each caller words its own error)."""

from __future__ import annotations

import math
from typing import TypeGuard

import numpy as np


def is_integer(value: object) -> bool:
    """A Python or numpy integer, not a bool (``True`` is an ``int`` to Python)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def is_real(value: object) -> TypeGuard[int | float | np.integer | np.floating]:
    """A Python or numpy real number: not a bool, not a complex number."""
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def is_finite_number(value: object) -> bool:
    """A finite Python int or float, not a bool (e.g. a metric read from JSON)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
