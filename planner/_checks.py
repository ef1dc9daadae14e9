"""Argument checks shared by the public APIs (each caller words its own error)."""

from __future__ import annotations

import math
from typing import TypeGuard

import numpy as np


def is_integer(value: object) -> bool:
    """A Python or numpy integer, not a bool (``True`` is an ``int`` to Python)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def is_seed(value: object) -> bool:
    """An integer in [0, 2**64): what numpy's and torch's generators take, and the one
    range of every command's ``--seed``."""
    return is_integer(value) and 0 <= int(value) < 2**64  # type: ignore[call-overload]


def is_bool(value: object) -> TypeGuard[bool | np.bool_]:
    """A Python or numpy bool (a flag; 0 and 1 are not flags)."""
    return isinstance(value, bool | np.bool_)


def is_plain_int(value: object) -> TypeGuard[int]:
    """A Python int, not a bool: for a value that is written to JSON as it is (a numpy
    integer is not JSON)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> TypeGuard[int | float | np.integer | np.floating]:
    """A Python or numpy real number: not a bool, not a complex number."""
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def is_finite_number(value: object) -> TypeGuard[int | float | np.integer | np.floating]:
    """A finite real number (:func:`is_real`, so not a bool): a metric read from JSON, an
    option given in a config or to the API."""
    if not is_real(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past float's range (10**400 from JSON)
        return False
