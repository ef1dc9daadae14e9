"""A deterministic work budget: what a search has done, counted instead of timed.

A search stopped by the clock returns a plan that depends on the machine's speed and load
(and on ``--jobs``, when processes share cores): the same predictor and seed give different
plans on different nights. An :class:`Effort` meter counts the work instead. The shared
kernels (:mod:`planner.solve.assign`, :mod:`planner.solve.polish`,
:mod:`planner.solve.common`) charge it as they go (token-assignment sweeps, the heavy-token
loop, swap scoring, device gains), in *units* whose cost was measured on the
reference machine (2-core x86, numpy 2; ``benchmarks/solve_speed.py``): a unit is about a
microsecond there. A search that stops when its meter reaches a limit stops at the same
point on every machine, so with the same inputs and seed its result is the same, only
sooner or later. On another machine a unit costs a different time, the same everywhere for
every kernel only roughly, so a budget's seconds scale with the machine.

The constants are a cost model, not a clock: what they must be is deterministic. How close
units track seconds on a given machine is reported by the solvers (``info["effort"]`` next
to the solve's seconds) and by ``benchmarks/solve_speed.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

# Cost of each kernel's work in units: (per call, per matrix entry, per loop step). What a
# call, an entry and a step are is the kernel's own (see where it charges). Fitted (least
# squares on relative error, then rounded) to each kernel's measured time in CEO solves of
# FLAME-MoE and example-model layers at EP 2, 8 and 32 and of the DeepSeek-V3-shaped layer of
# ``benchmarks/solve_speed.py`` at EP 8 and 32: whole solves came within 0.9-1.5 units per
# microsecond; ``benchmarks/solve_speed.py`` reports each CEO solve's units and seconds.
COSTS: dict[str, tuple[float, float, float]] = {
    "assign": (137.0, 0.025, 7.3),  # entry: token x device; step: a heavy token placed
    "assign_exact": (3000.0, 0.0, 0.0),  # a tiny problem's 0-1 program
    "dual_prices": (100.0, 0.012, 0.12),  # call: a sweep; entry: token x device; step: a token
    "regret_fill": (150.0, 0.02, 6.0),  # call: a proposal round; step: a token placed alone
    "exchange": (25.0, 0.006, 0.0),  # call: an exchange step; entry: a candidate pair
    "move_to_room": (35.0, 0.003, 1.1),  # call: a pass; step: a candidate move
    "relieve_overflow": (60.0, 0.02, 0.0),  # call: a move or trade; entry: token x device
    "swap_candidates": (60.0, 0.04, 0.0),  # entry: token x device
    "swap_pair": (55.0, 0.018, 0.0),  # call: a device pair; entry: a token x swap pair
    "place_experts": (20.0, 0.004, 0.011),  # entry: a nonzero of W; step: an N x N entry
    "device_gains": (6.0, 0.0035, 0.0),  # entry: a nonzero of W or a token x device
    "batch_overflow": (20.0, 0.028, 0.0),  # entry: a batch entry or a token x device
    "ce_joint": (100.0, 0.05, 0.0),  # call: a sample; entry: nonzeros and items x devices
    "chain_swaps": (800.0, 0.016, 0.0),  # call: a chain-polish round; entry: swap x its width
    "two_device_bound": (50.0, 0.065, 0.0),  # entry: a token row x a placement
    "batch_prices": (40.0, 0.01, 0.0),  # entry: a batch entry x device or a token x device
}


@dataclass
class Effort:
    """Work spent so far, and where the current phase of a search must stop.

    Attributes:
        spent: units charged so far.
        stop: the spent total at which :attr:`exhausted` turns true (None: never).
    """

    spent: float = 0.0
    stop: float | None = None

    def charge(
        self, kernel: str, entries: float = 0.0, steps: float = 0.0, calls: float = 1.0
    ) -> None:
        """Add the cost (:data:`COSTS`) of ``calls`` calls, ``entries`` entries, ``steps`` steps."""
        per_call, per_entry, per_step = COSTS[kernel]
        self.spent += per_call * calls + per_entry * entries + per_step * steps

    @property
    def exhausted(self) -> bool:
        return self.stop is not None and self.spent >= self.stop


def charge(
    effort: Effort | None, kernel: str, entries: float = 0.0, steps: float = 0.0, calls=1.0
) -> None:
    """:meth:`Effort.charge` when there is a meter (kernels take ``effort=None``)."""
    if effort is not None:
        effort.charge(kernel, entries, steps, calls)


def exhausted(effort: Effort | None) -> bool:
    return effort is not None and effort.exhausted
