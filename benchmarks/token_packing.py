"""Every method's token balance on layers of a few tokens a device; prints JSON.

Each method's plan must keep every device's token load within the cap ``beta * S / E``
where an assignment within it exists (a token heavier than the cap filling a device alone;
only where none exists may a device go over, by the slack rule of
:mod:`planner.solve.problem`). On real layers of thousands of tokens the shared greedy
assignment meets the cap with room to spare; with a few tokens a device it is a packing
problem, and a greedy that places each token where it fits leaves tokens that fit nowhere.
The layers here are generated, not real: J tokens with Zipf-like integer counts (exponent
``--zipf``), each routed to 4 of N experts, on E devices, at beta 1.0 and 1.1:

    python benchmarks/token_packing.py [--seeds 0:4] [--out FILE]

For every layer, whether a packing within the cap exists (the makespan program of
:func:`planner.solve.assign.least_lift` on the loads, which finds one or gives up within its
node limit: "unknown" then), and for every method its peak (each device's load, a token
heavier than the cap counted as the cap, over the cap), token imbalance, objective and
seconds. The summary counts, per method, the plans over the cap, those of them where a
packing within it was found, the plans at beta 1.1 whose token imbalance (heavy tokens
counted as the cap) exceeds 1.10, and the sum of the objectives. About 6 minutes on 2 cores.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
from _common import (  # (benchmarks/ is on sys.path when run as a script)
    ArgumentParser,
    add_out_option,
    emit_json,
    run,
    seed_range,
)

from planner.solve.assign import least_lift
from planner.solve.problem import LayerProblem, SolverConfig
from planner.solve.registry import solve_layer

METHODS = ("ceo", "metis", "kmeans", "alternating", "vanilla")
# (tokens, experts, devices): two to six tokens a device
SHAPES = ((30, 32, 16), (40, 32, 16), (60, 16, 8), (100, 64, 32), (200, 64, 16))
ZIPF = (0.3, 0.5)
BETAS = (1.0, 1.1)
TOL = 1e-9


def instance(seed: int, shape: tuple[int, int, int], zipf: float, beta: float) -> LayerProblem:
    """J tokens with counts ``round(50 / rank**zipf)`` (shuffled), each routed to 4 experts."""
    j, n, e = shape
    rng = np.random.default_rng(seed)
    freq = np.maximum(1.0, np.round(50.0 / np.arange(1, j + 1) ** zipf))
    rng.shuffle(freq)
    w = np.zeros((j, n))
    for row in range(j):
        w[row, rng.choice(n, 4, replace=False)] = freq[row]
    return LayerProblem(w, freq, e, beta=beta)


def packable(problem: LayerProblem) -> bool | None:
    """Whether an assignment within the cap exists (heavy tokens filling a device alone):
    True where one is found, False where the loads cannot fit, None where the program
    gives up."""
    loads = np.minimum(problem.token_freq, problem.capacity)
    if loads.sum() > problem.ep_size * problem.capacity * (1 + TOL):
        return False
    lift = least_lift(loads, np.full(problem.ep_size, problem.capacity))
    return None if lift is None or lift > TOL * problem.capacity else True


def main() -> int:
    parser = ArgumentParser(__doc__)
    parser.add_argument(
        "--seeds", type=seed_range, default=(0, 4), help="A:B, the seeds A .. B-1 (default 0:4)"
    )
    add_out_option(parser)
    args = parser.parse_args()
    started = time.perf_counter()
    rows = []
    summary = {
        m: {"over_cap": 0, "over_cap_packable": 0, "imbalance_over_1_10": 0, "worst_peak": 0.0,
            "objective_sum": 0.0, "seconds": 0.0}
        for m in METHODS
    }  # fmt: skip
    grid = itertools.product(range(*args.seeds), SHAPES, ZIPF, BETAS)
    for seed, shape, zipf, beta in grid:
        problem = instance(seed, shape, zipf, beta)
        fits = packable(problem)
        row = {"seed": seed, "shape": list(shape), "zipf": zipf, "beta": beta,
               "packable": "unknown" if fits is None else fits, "methods": {}}  # fmt: skip
        clipped = np.minimum(problem.token_freq, problem.capacity)
        for method in METHODS:
            tick = time.perf_counter()
            plan = solve_layer(problem, method, SolverConfig(seed=0, time_limit=60))
            seconds = time.perf_counter() - tick
            loads = np.bincount(plan.token_to_device, weights=clipped, minlength=problem.ep_size)
            peak = float(loads.max() / problem.capacity)
            row["methods"][method] = {"peak": round(peak, 4), "objective": plan.objective,
                                      "token_imbalance": round(plan.token_imbalance, 4),
                                      "seconds": round(seconds, 2)}  # fmt: skip
            s = summary[method]
            over = peak > 1 + TOL
            s["over_cap"] += over
            s["over_cap_packable"] += over and fits is True
            s["imbalance_over_1_10"] += beta == 1.1 and peak * beta > 1.1 + TOL
            s["worst_peak"] = round(max(s["worst_peak"], peak), 4)
            s["objective_sum"] += plan.objective
            s["seconds"] += seconds
        rows.append(row)
    for s in summary.values():
        s["seconds"] = round(s["seconds"], 1)
    report = {
        "benchmark": "token_packing",
        "seeds": list(args.seeds),
        "layers": len(rows),
        "packable": {
            str(k): sum(r["packable"] == k for r in rows) for k in (True, False, "unknown")
        },
        "by_method": summary,
        "seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    emit_json(report, args.out)
    return 0


if __name__ == "__main__":
    run(main)
