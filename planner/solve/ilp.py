"""The exact 0-1 program of the co-placement (paper 000 §3.4, paper 001 §3.3), via PuLP.

Variables (E devices, d in 0..E-1):

- ``x[k, d]`` binary: expert k on device d;
- ``y[j, d]`` binary: token j sent to device d;
- ``z[j, k, d]`` in [0, 1], only where ``W[j, k] > 0``: activation (j, k) local on d. The
  product ``x[k, d] * y[j, d]`` is linearised by ``z <= x`` and ``z <= y``; since z has a
  positive objective weight, maximisation drives it to ``min(x, y)``, so z need not be
  declared integer.

Objective: maximise ``sum W[j, k] z[j, k, d]`` ("cap" mode), or ``(1 - θ) sum W z - θ sum_d
dev_d`` with ``dev_d >= |load_d - S/E|`` ("penalty" mode). Constraints (named as shown):

- ``expert_once_k``: ``sum_d x[k, d] = 1``; ``experts_on_d``: ``sum_k x[k, d] = N/E``;
- ``token_once_j``: ``sum_d y[j, d] = 1``;
- ``load_d``: ``sum_j a_j y[j, d] <= beta S / E`` (cap mode). When no placement fits
  because tokens are indivisible, the program is solved again, first with each token's load
  counted as at most the cap (a token heavier than the cap fills a device alone; where one
  is, no program meets the plain cap, and this rule is the first program solved), then
  under the heaviest load its start (the shared assignment) reached, where that is lower
  than the next rule's (on a few tokens, the least any assignment of them reaches:
  :func:`planner.solve.assign.least_lift`), then with the cap raised by the heaviest token
  on every device (the slack rule of :mod:`planner.solve.problem`); ``info["token_rule"]`` (``cap``,
  ``heavy_fill``, ``start_load`` or ``slack``) and ``info["token_cap"]`` say which
  (``program_token_rule`` and
  ``program_token_cap`` when the program held only the most frequent tokens, whose own cap
  it scales; ``token_cap`` is then the problem's, under which every token is placed);
- ``zx_j_k_d``: ``z <= x[k, d]``; ``zy_j_k_d``: ``z <= y[j, d]``.

Symmetry breaking (``symmetry_breaking``, on by default): devices are interchangeable, so
we may number them by their lowest-numbered expert; then device d's lowest expert is at
least d, i.e. ``x[k, d] = 0`` for ``d > k`` (those variables are simply not created). This
removes the E! relabellings of every solution without cutting off any placement up to
relabelling, and speeds up optimality proofs.

Large instances: the program has ``nnz(W) x E`` z-variables. When that exceeds
``max_variables`` the program is built on the most frequent tokens only (as many as fit the
budget, their cap scaled to their own load), the remaining tokens are placed afterwards by
the shared capacity assignment on the program's expert placement, and ``info`` says so
(``exact: False``, ``tokens_in_program``). Likewise when the time limit stops the solver
before a proof, ``info["status"]`` is "feasible (time limit)" and ``info["bound"]`` gives
the best proven upper bound on the objective of the program that was solved.

Start: both solvers are handed a feasible placement to start from (``start``, on by
default): the contiguous expert placement of ``vanilla`` (it respects the symmetry
breaking) with the shared capacity assignment of the tokens. Without it the solver may
reach its time limit with no placement at all (the example model at EP 4 with the default
``max_variables``: "found no placement within 10 s"); with it the program's answer is at
least that start's. HiGHS checks its time limit only between phases, so it may run past it
(with its presolve on, a 64-expert EP 32 layer took 76 s under a 10 s limit, in the root's
cut loop; below; without it, the example's layer 0 at EP 4 and the default 50k variables took
431 s under a 60 s limit, and an interrupt requested at 61 s was not seen either). So HiGHS
runs in a child process (:mod:`planner.solve.highs_child`) that is killed at the time limit
plus :func:`_grace`; the child saves every improving solution as it finds it, and a killed
solve returns the last one (or the start), with ``info["stopped_at_deadline"]``. That case
now ends after 73 s with the same placement. ``info["seconds_over_limit"]`` reports any
overrun beyond a second.

Presolve: HiGHS runs without its presolve (``presolve``, off by default). On the 32 small
EP 2 and 4 instances of ``benchmarks/solve_quality.py --sections ilp`` both settings prove the same
optima, without it in 103 s in all (the slowest 15 s) instead of 288 s (59 s), run side by
side. It also keeps HiGHS near its time limit: under a 10 s limit the example's layer 0
(EP 4 and 8, default ``max_variables``) takes 13.4 s and 14.0 s in all instead of 48 s and 65 s,
and the 64-expert EP 32 layer above 12.8 s instead of 76 s.

Solvers: HiGHS through its Python API (``pulp.HiGHS``, needs highspy) or CBC
(``pulp.PULP_CBC_CMD``, whose process is killed at the same deadline: ``_CbcWithDeadline``).
``lp_path`` (a name ending in ``.lp``) writes the program in LP format before solving; a
layer of a model solve writes its own file, the layer's index before the suffix (``prog.lp``
-> ``prog.layer3.lp``), so no layer's program replaces another's. ``moeplan solve`` and
``compare`` write them in a staging folder and move them into place together once every
layer is solved (:func:`lp_files_together`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import highspy
import numpy as np
import pulp
from pulp.apis import coin_api

from planner._io import (
    atomic_path,
    make_folders_for,
    native_stdout,
    remove_empty_folders,
    signals_deferred,
)
from planner.errors import InfeasibleError, InputError
from planner.solve import highs_child
from planner.solve.assign import heavy_fill_loads, shift_to_one
from planner.solve.common import (
    assign_for_problem,
    check_options,
    device_gains,
    finish,
    objective,
)
from planner.solve.problem import LOAD_RTOL, LayerPlacement, LayerProblem, SolverConfig

DEFAULTS: dict[str, object] = {
    "solver": "highs",  # "highs" (highspy API) or "cbc"
    "max_variables": 50_000,  # z-variable budget before falling back to the top tokens
    "symmetry_breaking": True,
    "gap_rel": 1e-6,  # relative MIP gap at which the solver may stop and call it optimal
    "lp_path": None,  # write the program in LP format here
    "msg": False,  # the solver log, on stderr (off: not even HiGHS's banner)
    "start": True,  # hand the solver a feasible placement to start from (module doc)
    "presolve": False,  # HiGHS's presolve (module doc: off proves the same optima faster)
}
KINDS = {
    "max_variables": "count+",
    "lp_path": "text?",
    "gap_rel": "share",
}  # see common.check_options
DEFAULT_TIME_LIMIT = 60.0
# Largest ``max_variables`` accepted: PuLP holds about 2 KB per z-variable while it builds the
# program (512k took 1.2 GB and 14 s on the reference machine, before HiGHS starts and
# outside the time limit); a whole DeepSeek-V3 layer would need tens of GB.
MAX_VARIABLES = 2_000_000
# The script HiGHS runs in (a child process killed at the deadline, _HighsWithStart).
_CHILD = highs_child.__file__


def check_lp_path(lp_path: str) -> Path:
    """``lp_path`` as a Path if it ends in ``.lp``: the program is written in LP format, one
    file a layer (``NAME.layerL.lp``), and so only ever replaces an earlier LP file."""
    path = Path(lp_path)
    if path.suffix.lower() != ".lp":
        raise InputError(f"ilp: lp_path={lp_path!r} must end in .lp")
    return path


def layer_lp_path(lp_path: str | Path, layer: int | None) -> Path:
    """Where layer ``layer``'s program is written for ``lp_path`` (``NAME.layerL.lp``; the
    path itself for a problem of no layer)."""
    path = check_lp_path(str(lp_path))
    return path if layer is None else path.with_name(f"{path.stem}.layer{layer}{path.suffix}")


@contextmanager
def lp_files_together(options: dict, layers: int) -> Iterator[dict]:
    """Per-method ``options`` whose ILP ``lp_path`` (if any) points into a hidden staging
    folder beside it, from which the ``layers`` LP files are moved into place together when
    the block ends without error (Ctrl-C held back meanwhile). A run that fails or is
    stopped part-way leaves every earlier LP file as it was, where each layer's file
    replaced its own as it was solved (the first layers new, the rest old)."""
    lp_path = lp_path_option(options)
    if lp_path is None:
        yield options
        return
    final = check_lp_path(lp_path)
    made = make_folders_for(final)
    stage = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    moved = False
    try:
        staged = stage / final.name
        yield {**options, "ilp": {**options["ilp"], "lp_path": str(staged)}}
        with signals_deferred():
            for layer in range(layers):
                written = layer_lp_path(staged, layer)
                if written.exists():
                    os.replace(written, layer_lp_path(final, layer))
                    moved = True
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if not moved:
            remove_empty_folders(made)


def lp_path_option(options: dict) -> str | None:
    """The ILP's ``lp_path`` in per-method ``options`` (``{"ilp": {"lp_path": ...}}``), if
    it is a string; None otherwise (the solver's own check words a wrong kind)."""
    ilp = options.get("ilp")
    lp_path = ilp.get("lp_path") if isinstance(ilp, dict) else None
    return lp_path if isinstance(lp_path, str) else None


def solve(problem: LayerProblem, config: SolverConfig) -> LayerPlacement:
    started = time.perf_counter()
    opts = check_options("ilp", config.for_method("ilp"), DEFAULTS, KINDS)
    if int(opts["max_variables"]) > MAX_VARIABLES:
        raise InputError(
            f"ilp: max_variables={opts['max_variables']} is more than {MAX_VARIABLES:,} "
            f"(PuLP needs about 2 KB of memory for each while it builds the program)"
        )
    time_limit = float(config.time_limit or DEFAULT_TIME_LIMIT)
    keep = _tokens_in_budget(problem, int(opts["max_variables"]))
    sub = problem if keep.size == problem.num_tokens else problem.select_tokens(keep)
    solver = _make_solver(
        str(opts["solver"]),
        time_limit,
        float(opts["gap_rel"]),
        bool(opts["msg"]),
        presolve=bool(opts["presolve"]),
    )
    symmetry = bool(opts["symmetry_breaking"])
    capacity = sub.capacity
    start = _start(sub) if opts["start"] else None
    # a token heavier than the cap: no program meets the cap, and proving so can take HiGHS
    # the whole time limit (3 s of a Qwen1.5-MoE-shaped layer's, before the fallback ran
    # over it by 6 s); it is solved under the heavy-fill rule from the start
    heavy = bool(sub.balance == "cap" and sub.num_tokens and sub.token_freq.max() > capacity)
    prog, x_vars, y_vars = build_program(
        sub, symmetry_breaking=symmetry, heavy_fill=heavy, start=start
    )
    if opts["lp_path"] is not None:
        lp_path = layer_lp_path(opts["lp_path"], problem.layer)
        with atomic_path(lp_path) as tmp:
            prog.writeLP(str(tmp))
    solve_started = time.perf_counter()
    with native_stdout(bool(opts["msg"])):
        prog.solve(solver)
    status = _checked_status(prog, sub, y_vars, capacity, heavy, solver=solver, since=solve_started)
    token_rule = "heavy_fill" if heavy else "cap"
    # no point found in time while the start breaks the cap (the shared assignment could not
    # meet it either): as if infeasible, the fallbacks start from a point they admit
    unproven = (
        status == "no solution" and start is not None and _over_cap(sub, start[1], capacity, False)
    )
    if (status == "infeasible" or unproven) and sub.balance == "cap":
        # tokens are indivisible: first let a token heavier than the cap fill a device alone,
        # then allow one maximal token above the cap on every device (the slack rule of
        # planner.solve.problem), rather than give up; planner.solve.assign falls back alike
        fallbacks = [("slack", sub.capacity + sub.load_slack, False)]
        if start is not None:
            # the heaviest device of the start (the shared assignment's answer, which every
            # other method's tokens get): a cap the program can meet, usually far below the
            # slack rule's (beta 1 with an odd total: 145 against 174 for the slack)
            reached = float(
                np.bincount(start[1], weights=sub.token_freq, minlength=sub.ep_size).max()
            )
            if reached < sub.capacity + sub.load_slack:
                fallbacks.insert(0, ("start_load", reached, False))
        for rule, capacity, heavy_fill in fallbacks:
            token_rule = rule
            prog, x_vars, y_vars = build_program(
                sub, symmetry_breaking=symmetry, capacity=capacity, heavy_fill=heavy_fill,
                start=start,
            )  # fmt: skip
            # the fallbacks share the time limit with the first program
            solver.timeLimit = max(solve_started + time_limit - time.perf_counter(), 1.0)
            since = time.perf_counter()
            with native_stdout(bool(opts["msg"])):
                prog.solve(solver)
            status = _checked_status(
                prog, sub, y_vars, capacity, heavy_fill, solver=solver, since=since
            )
            if status != "infeasible":
                break
    over = time.perf_counter() - solve_started - time_limit
    if status == "infeasible":
        raise InfeasibleError(
            f"ilp: no placement meets the token cap {capacity:.6g} (beta={problem.beta:g}); "
            "raise beta or use balance='penalty'"
        )
    if status == "no solution":
        raise InfeasibleError(
            f"ilp: the solver found no placement within {time_limit:g} s; raise the time "
            "limit or lower max_variables"
        )
    per = problem.experts_per_device
    x = np.array([_argmax_var(x_vars[k]) for k in range(problem.num_experts)], dtype=np.int64)
    if np.bincount(x, minlength=problem.ep_size).tolist() != [per] * problem.ep_size:
        raise InfeasibleError(
            "ilp: the solver returned an expert placement that breaks N/E per device"
        )
    exact = keep.size == problem.num_tokens
    shift, bound = _program_shifts(sub, capacity)[0], _bound(prog, solver)
    t = None
    if exact:
        t = np.array([_argmax_var(y_vars[j]) for j in range(problem.num_tokens)], dtype=np.int64)
    overrun = (
        t is not None
        and problem.balance == "cap"
        and _over_cap(problem, t, capacity, token_rule == "heavy_fill")
    )
    if overrun:  # a safety net: the scaling of _program_shifts keeps tolerances from this
        t = None
    info = {
        "status": status,
        "solver": str(opts["solver"]),
        "exact": exact,
        "tokens_in_program": int(keep.size),
        "tokens": int(problem.num_tokens),
        "program_objective": math.ldexp(float(pulp.value(prog.objective) or 0.0), -shift),
        "bound": _reported_bound(sub, bound, shift),
        "symmetry_breaking": bool(opts["symmetry_breaking"]),
        "time_limit": time_limit,
        "start": start is not None,
    }
    if problem.balance == "cap":
        cap_info: dict[str, object] = {
            "token_cap": capacity if np.isfinite(capacity) else None,
            "token_rule": token_rule,
        }
        if not exact:
            # the program placed the kept tokens under their own scaled cap; every token is
            # then placed by the shared assignment under the problem's
            cap_info = {f"program_{k}": v for k, v in cap_info.items()}
            cap_info["token_cap"] = problem.capacity
        info |= cap_info
    if over > 1.0:
        info["seconds_over_limit"] = round(over, 1)
    if getattr(solver, "stopped", False):
        info["stopped_at_deadline"] = True
    if overrun:
        info["note"] = (
            "the program's token assignment broke its cap (the solver's tolerances on large "
            "loads); the tokens placed by the shared assignment"
        )
    if not exact:
        info["note"] = (
            f"program on the {keep.size} most frequent of {problem.num_tokens} tokens; "
            "the rest placed by the shared assignment"
        )
        # the program saw only the heaviest tokens: on the whole problem its placement can
        # score below the start it was given (a k-means start: 0.5416, the program 0.52)
        x, t = _better_of_start(problem, x, info) if start is not None else (x, t)
    return finish(
        problem, "ilp", x, seed=config.seed, started=started, token_to_device=t, info=info
    )


def build_program(
    problem: LayerProblem,
    *,
    symmetry_breaking: bool = True,
    capacity: float | None = None,
    heavy_fill: bool = False,
    start: tuple[np.ndarray, np.ndarray] | None = None,
):
    """The PuLP program of ``problem``. Returns (program, x_vars, y_vars).

    ``capacity`` overrides the token cap of "cap" mode (default ``problem.capacity``).
    ``heavy_fill`` counts each token's load as at most the cap, so a token heavier than the
    cap may fill a device alone (:func:`~planner.solve.assign.heavy_fill_loads`).
    ``start`` = (expert_to_device, token_to_device) sets every variable's initial value
    (the solver's start, :func:`_start`); it must respect the symmetry breaking.

    ``x_vars[k]`` / ``y_vars[j]`` map device -> variable (absent = fixed to 0 by symmetry).
    """
    n, e, per = problem.num_experts, problem.ep_size, problem.experts_per_device
    cap = problem.capacity if capacity is None else float(capacity)
    # activations and loads all below 1 (given as shares) are scaled up by a power of two,
    # and any of 2**30 or more down: HiGHS's tolerances are absolute (at 1e-9 it took every
    # objective for zero) and it reads 1e20 as infinite
    shift, load_shift = _program_shifts(problem, cap)
    w = problem.affinity
    freq, cap = np.ldexp(problem.token_freq, load_shift), math.ldexp(cap, load_shift)
    prog = pulp.LpProblem("moeplan_coplacement", pulp.LpMaximize)
    x_vars = [
        {
            d: pulp.LpVariable(f"x_{k}_{d}", cat="Binary")
            for d in range(e)
            if not (symmetry_breaking and d > k)
        }
        for k in range(n)
    ]
    y_vars = [
        {d: pulp.LpVariable(f"y_{j}_{d}", cat="Binary") for d in range(e)}
        for j in range(problem.num_tokens)
    ]
    if start is not None:
        _set_start(x_vars, y_vars, *start)
    local_terms = []
    for j in range(problem.num_tokens):
        for pos in range(w.indptr[j], w.indptr[j + 1]):
            k, weight = int(w.indices[pos]), math.ldexp(float(w.data[pos]), shift)
            for d, xv in x_vars[k].items():
                z = pulp.LpVariable(f"z_{j}_{k}_{d}", lowBound=0, upBound=1)
                if start is not None:  # z = x[k, d] * y[j, d]
                    z.setInitialValue(xv.varValue * y_vars[j][d].varValue)
                prog += z <= xv, f"zx_{j}_{k}_{d}"
                prog += z <= y_vars[j][d], f"zy_{j}_{k}_{d}"
                local_terms.append((z, weight))
    local = pulp.LpAffineExpression(local_terms)
    if heavy_fill:
        freq = heavy_fill_loads(freq, cap)[:, 0]
    loads = [
        pulp.lpSum(float(freq[j]) * y_vars[j][d] for j in range(problem.num_tokens))
        for d in range(e)
    ]
    if problem.balance == "cap":
        prog += local
        if np.isfinite(cap) and cap < float(freq.sum()):  # else no load can reach it
            for d in range(e):
                prog += loads[d] <= cap, f"load_{d}"
    else:
        mean = float(freq.sum()) / e
        dev = [pulp.LpVariable(f"dev_{d}", lowBound=0) for d in range(e)]
        for d in range(e):
            if start is not None:  # dev_d = |load_d - S/E|
                dev[d].setInitialValue(abs(pulp.value(loads[d]) - mean))
            prog += dev[d] >= loads[d] - mean, f"dev_hi_{d}"
            prog += dev[d] >= mean - loads[d], f"dev_lo_{d}"
        prog += (1 - problem.theta) * local - problem.theta * pulp.lpSum(dev)
    for k in range(n):
        prog += pulp.lpSum(x_vars[k].values()) == 1, f"expert_once_{k}"
    for d in range(e):
        prog += (
            pulp.lpSum(x_vars[k][d] for k in range(n) if d in x_vars[k]) == per,
            f"experts_on_{d}",
        )
    for j in range(problem.num_tokens):
        prog += pulp.lpSum(y_vars[j].values()) == 1, f"token_once_{j}"
    return prog, x_vars, y_vars


def _over_cap(problem: LayerProblem, t: np.ndarray, capacity: float, heavy_fill: bool) -> bool:
    """Whether token assignment ``t`` puts more than ``capacity`` on a device (with
    ``heavy_fill``, each token counted as at most ``capacity``)."""
    freq = (
        heavy_fill_loads(problem.token_freq, capacity)[:, 0] if heavy_fill else problem.token_freq
    )
    loads = np.bincount(t, weights=freq, minlength=problem.ep_size)
    return bool(loads.max() > capacity * (1 + LOAD_RTOL))


# The program's coefficients stay below 2**30 (a trace's do up to a billion tokens): HiGHS
# reads 1e20 and more as infinite (loads of 1e20 found "no placement"), and its absolute
# tolerances are coarse on large loads (near 1e14 its integrality tolerance let a y of 1e-6
# hide 1e8 tokens, and the token assignment broke the cap).
_MAX_COEFFICIENT_LOG2 = 30


def _program_shifts(problem: LayerProblem, capacity: float) -> tuple[int, int]:
    """The powers of two the program's activations and its loads are scaled by (see
    :func:`_coefficient_shift`). Exact. In cap mode each has its own, as the objective holds
    activations only and the cap constraints loads only: with one for both, activations of
    1e-8 against loads of 1-10 stayed at 1e-8, HiGHS's absolute gap took them for noise and
    reported "optimal" for a LAR of 0.44 where the optimum is 0.50. Penalty mode's objective
    mixes the two, so there both share one."""
    # a cap no load can reach is left out: a huge one (beta 1e15) scaled every activation to
    # noise HiGHS's tolerances ignored, and it returned the start as "optimal"
    binding = [capacity] if capacity < float(problem.token_freq.sum()) else []
    loads = np.concatenate((problem.token_freq, binding))
    if problem.balance != "cap":
        shift = _coefficient_shift(np.concatenate((problem.affinity.data, loads)))
        return shift, shift
    return _coefficient_shift(problem.affinity.data), _coefficient_shift(loads)


def _coefficient_shift(values: np.ndarray) -> int:
    """Positive when every value is below 1 (:func:`planner.solve.assign.shift_to_one`),
    negative when the largest is 2**30 or more (it then lies in [2**29, 2**30)), else 0."""
    top = float(np.abs(values[np.isfinite(values)]).max(initial=0.0))
    if top >= 2.0**_MAX_COEFFICIENT_LOG2:
        return _MAX_COEFFICIENT_LOG2 - 1 - math.floor(math.log2(top))
    return shift_to_one(values)


def _better_of_start(
    problem: LayerProblem, x: np.ndarray, info: dict
) -> tuple[np.ndarray, np.ndarray | None]:
    """(placement, tokens) of the program's answer or of the start on the whole problem,
    whichever scores more; ``info["kept_start"]`` says which."""
    gain = device_gains(problem, x)
    t = assign_for_problem(problem, gain).token_to_device
    x0, t0 = _start(problem)
    info["kept_start"] = bool(
        objective(problem, device_gains(problem, x0), t0) > objective(problem, gain, t)
    )
    return (x0, t0) if info["kept_start"] else (x, t)


def _start(problem: LayerProblem) -> tuple[np.ndarray, np.ndarray]:
    """The contiguous expert placement (``vanilla``'s) and the shared token assignment on it.

    Expert k sits on device k // (N/E) <= k, so the symmetry breaking keeps it.
    """
    x = np.arange(problem.num_experts, dtype=np.int64) // problem.experts_per_device
    return x, assign_for_problem(problem, device_gains(problem, x)).token_to_device


def _set_start(x_vars, y_vars, x: np.ndarray, t: np.ndarray) -> None:
    for k, by_device in enumerate(x_vars):
        for d, var in by_device.items():
            var.setInitialValue(float(x[k] == d))
    for j, by_device in enumerate(y_vars):
        for d, var in by_device.items():
            var.setInitialValue(float(t[j] == d))


def _tokens_in_budget(problem: LayerProblem, max_variables: int) -> np.ndarray:
    """Row ids of the heaviest rows (most frequent tokens) whose z-variables fit the budget."""
    nnz = np.diff(problem.affinity.indptr)
    order = np.argsort(-problem.row_mass, kind="stable")
    fits = np.cumsum(nnz[order]) * problem.ep_size <= max_variables
    count = max(int(fits.sum()), min(1, problem.num_tokens))
    return np.sort(order[:count])


class _HighsWithStart(pulp.HiGHS):
    """``pulp.HiGHS`` that hands HiGHS the variables' initial values as its MIP start and
    runs it in a child process killed at the deadline (:mod:`planner.solve.highs_child`).

    (PuLP passes a start to CBC with ``warmStart=True``, but not to HiGHS.) The deadline is
    the time limit plus :func:`_grace`; a killed solve keeps the last improving solution the
    child saved (``stopped_at_deadline`` in the ILP's info), or none.
    """

    result: dict | None = None
    stopped: bool = False

    def callSolver(self, lp):
        self.result, self.stopped = None, False
        options = {
            "output_flag": bool(self.msg), "time_limit": float(self.timeLimit),
            "mip_rel_gap": float(self.gapRel), "threads": int(self.threads),
            **self.optionsDict,
        }  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="moeplan-highs-") as tmp:
            model, start = os.path.join(tmp, "program.mps"), ""
            lp.solverModel.writeModel(model)
            values = [var.varValue for var in lp.variables()]  # var.index order
            if values and all(v is not None for v in values):
                start = os.path.join(tmp, "start.npy")
                np.save(start, np.asarray(values, dtype=np.float64))
            child = subprocess.Popen(
                [sys.executable, _CHILD, model, json.dumps(options), start, tmp],
                stdin=subprocess.DEVNULL,
            )
            try:
                child.wait(timeout=float(self.timeLimit) + _grace(float(self.timeLimit)))
            except subprocess.TimeoutExpired:
                self.stopped = True
            finally:
                if child.poll() is None:
                    child.kill()
                    child.wait()
            for name in (highs_child.RESULT, highs_child.INCUMBENT):
                path = os.path.join(tmp, name)
                if os.path.exists(path):
                    with np.load(path) as saved:
                        self.result = {key: saved[key] for key in saved.files}
                    break
            if self.result is None and self.stopped and start:  # stopped before any incumbent
                self.result = {"x": np.load(start), "objective": np.float64(0.0)}
        if self.result is None and not self.stopped and child.returncode != 0:
            raise InfeasibleError(f"ilp: the HiGHS process failed (exit {child.returncode})")

    def findSolutionValues(self, lp):
        r = self.result
        status = highspy.HighsModelStatus(int(r["status"])) if r and "status" in r else None
        if status in (
            highspy.HighsModelStatus.kInfeasible,
            highspy.HighsModelStatus.kUnboundedOrInfeasible,
        ):
            return pulp.LpStatusInfeasible, pulp.LpSolutionInfeasible
        if r is None or not bool(r.get("valid", True)) or not np.isfinite(float(r["objective"])):
            return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound
        for var in lp.variables():
            var.varValue = float(r["x"][var.index])
        if status == highspy.HighsModelStatus.kOptimal:
            return pulp.LpStatusOptimal, pulp.LpSolutionOptimal
        # time limit, interrupt, or the incumbent of a stopped solve: a feasible point
        return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible


class _CbcWithDeadline(pulp.PULP_CBC_CMD):
    """``pulp.PULP_CBC_CMD`` whose process is killed at the deadline, as HiGHS's is.

    CBC reads its time limit (``-sec``) only between branch-and-bound nodes: on the
    example's layer 0 at EP 4 (default ``max_variables``, 5 s limit) it was still in the
    root node after 110 s, and an interrupt did not stop it either. The deadline is the time
    limit plus :func:`_grace`; a killed solve writes no solution, so it returns the start
    (``stopped_at_deadline`` in the ILP's info), or no placement. PuLP's temporary files go
    to a directory of their own, removed whatever happens.
    """

    stopped: bool = False

    def actualSolve(self, lp, **kwargs):
        self.stopped = False
        deadline = float(self.timeLimit) + _grace(float(self.timeLimit))
        solver = self

        class Popen(subprocess.Popen):
            def __init__(self, *args, **popen_kwargs):
                super().__init__(*args, preexec_fn=highs_child.die_with_parent, **popen_kwargs)

            def wait(self, timeout=None):
                if timeout is not None:
                    return super().wait(timeout)
                try:
                    return super().wait(deadline)
                except subprocess.TimeoutExpired:
                    solver.stopped = True
                    self.kill()
                    return super().wait()

        calls = SimpleNamespace(Popen=Popen)  # PuLP's coin_api calls subprocess.Popen only
        saved_dir = self.tmpDir
        try:
            with (
                tempfile.TemporaryDirectory(prefix="moeplan-cbc-") as tmp,
                mock.patch.object(coin_api, "subprocess", calls),
            ):
                self.tmpDir = tmp
                try:
                    return super().actualSolve(lp, **kwargs)
                except pulp.PulpSolverError as e:
                    if not self.stopped:  # CBC failed (a time limit too short to start)
                        first = (str(e).splitlines() or [""])[0]
                        raise InfeasibleError(f"ilp: the CBC process failed ({first})") from None
        finally:
            self.tmpDir = saved_dir
        # killed at the deadline: the variables still hold the start, if one was given
        if all(var.varValue is not None for var in lp.variables()):
            lp.assignStatus(pulp.LpStatusNotSolved, pulp.LpSolutionIntegerFeasible)
        else:
            lp.assignStatus(pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound)
        return lp.status


def _grace(time_limit: float) -> float:
    """Seconds past the time limit before the HiGHS process is killed: HiGHS stops by itself
    within about 2 s of the limit on most programs (module doc)."""
    return 5.0 + 0.1 * time_limit


def _make_solver(name: str, time_limit: float, gap_rel: float, msg: bool, *, presolve: bool):
    if name == "highs":
        solver = _HighsWithStart(
            msg=msg,
            timeLimit=time_limit,
            gapRel=gap_rel,
            threads=1,
            presolve="on" if presolve else "off",
        )
    elif name == "cbc":
        solver = _CbcWithDeadline(
            msg=msg, timeLimit=time_limit, gapRel=gap_rel, threads=1, warmStart=True
        )
    else:
        raise InputError(f"ilp: solver={name!r} is not one of highs, cbc")
    if not solver.available():
        raise InputError(
            f"ilp: the {name} solver is not available here (pip install highspy / pulp's CBC)"
        )
    return solver


def _status(prog: pulp.LpProblem) -> str:
    if prog.status in (pulp.LpStatusInfeasible,) or prog.sol_status == pulp.LpSolutionInfeasible:
        return "infeasible"
    if prog.sol_status == pulp.LpSolutionOptimal:
        return "optimal"
    values = [v.varValue for v in prog.variables()[:1]]
    if prog.sol_status == pulp.LpSolutionIntegerFeasible and values and values[0] is not None:
        return "feasible (time limit)"
    return "no solution"


def _reported_bound(sub: LayerProblem, bound: float | None, shift: int) -> float | None:
    """The solver's proven bound on the program's objective, in activations; in cap mode
    at most the program's total activations (where no root LP finished, HiGHS's bound is
    the sum of every objective coefficient: 13334 of 1892 activations)."""
    if bound is None:
        return None
    value = math.ldexp(bound, -shift)
    return min(value, float(sub.affinity.sum())) if sub.balance == "cap" else value


def _checked_status(
    prog: pulp.LpProblem,
    sub: LayerProblem,
    y_vars: list[dict[int, pulp.LpVariable]],
    capacity: float,
    heavy_fill: bool = False,
    *,
    solver=None,
    since: float | None = None,
) -> str:
    """:func:`_status`, where a point found at the time limit (or the start a killed
    solver left in the variables) that breaks the program's token cap counts as none: a
    solver stopped early can hand back a start it rejected. CBC stopped by its time limit
    (``since`` = when the solve began) can write "Infeasible" without a proof; that counts
    as no solution too, so the fallbacks' looser caps are not reported as forced by an
    infeasible cap (nor the first program's answer as "optimal" under them)."""
    status = _status(prog)
    if (
        status == "infeasible"
        and isinstance(solver, _CbcWithDeadline)
        and since is not None
        and time.perf_counter() - since >= float(solver.timeLimit)
    ):
        return "no solution"
    if status != "feasible (time limit)" or sub.balance != "cap" or not y_vars:
        return status
    t = np.array([_argmax_var(y) for y in y_vars], dtype=np.int64)
    return "no solution" if _over_cap(sub, t, capacity, heavy_fill) else status


def _bound(prog: pulp.LpProblem, solver) -> float | None:
    """Best proven upper bound (HiGHS only; None elsewhere)."""
    result = getattr(solver, "result", None)
    if not result or "bound" not in result:
        return None
    bound = float(result["bound"])
    if not np.isfinite(bound):
        return None
    return float(-bound) if prog.sense == pulp.LpMaximize else bound


def _argmax_var(variables: dict[int, pulp.LpVariable]) -> int:
    return max(variables, key=lambda d: variables[d].varValue or 0.0)
