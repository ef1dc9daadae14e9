"""Re-planning a deployed model: an expert changes device only where the move pays.

A plan solved again from fresh traces (the nightly job) is, even aligned to the deployed
one (:mod:`planner.solve.align`), a new local optimum: it regroups experts for gains of a
fraction of a percent, and every expert that changes device costs the serving cluster a
weight transfer. With a move cost c (``PlanConfig.move_cost``; ``moeplan solve --align-to
DEPLOYED --move-cost C``) each layer is solved for

    local activations + c * A * (experts that stay with their deployed device's group)

where A is the layer's routed activations (the LAR's denominator): a regrouping must raise
the layer's LAR by c per expert it moves.

The term enters as rows of the problem, so that every solver optimises it with its own
search, as it does the n-gram term (:mod:`planner.solve.ngram_term`): one load-free row per
deployed device d, with affinity c * A on each expert the deployed plan has on d. A row,
like a token, is worth its activations on the device it is given, so its best device is
the one holding most of its group, and it gains c * A for each expert of the group there.
Device labels are arbitrary, and so is this term: it counts the experts that keep their
group, whatever the devices are called, and the plan is relabelled onto the deployed
devices afterwards (:func:`planner.solve.align.align_plan`). Two rows may pick the same
device where no group is kept whole (the rows carry no load), so the term can count a few
more experts as kept than the relabelled plan keeps; the plan reports the moves as counted
after relabelling.

The rows carry no token load and stand for no run-time occurrences (``row_occurrences`` 0),
so neither the capacity nor the per-batch cap sees them; :func:`without_deployed` takes them
off the solved placement before its report is made.

A method's search need not end above the deployed placement on this objective: CEO's
weighs each move against the rows, but METIS' partitions and alternating's and k-means'
iterations regroup by their own rules and can return a layer that moves experts for less
than they cost (a review found METIS moving 4-10 experts a layer of FLAME-MoE for 0.003-0.017
LAR where 0.008-0.020 was due). So :func:`no_worse_than_deployed` keeps the deployed
placement itself wherever it scores at least as high, net of the batch cap, as every method
chooses among its candidates.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
from scipy import sparse

from planner._checks import is_real
from planner.errors import InputError, MismatchError
from planner.solve.align import check_reference, overlap
from planner.solve.batch_prices import batch_priced
from planner.solve.common import device_gains, finish, improves, net_objective
from planner.solve.expert_balance import expert_imbalance
from planner.solve.problem import LayerPlacement, LayerProblem


def check_move_cost(move_cost: float, name: str = "move_cost") -> None:
    """InputError unless ``move_cost`` is a LAR share in [0, 1] (NaN is not); the message
    calls it ``name`` (the CLI's ``--move-cost``)."""
    if not (is_real(move_cost) and 0 <= move_cost <= 1):
        raise InputError(f"{name}={move_cost!r} must be a LAR share in [0, 1], e.g. 0.002")


def check_replan(
    reference: np.ndarray | None, move_cost: float, num_layers: int, num_experts: int, ep_size: int
) -> np.ndarray | None:
    """``reference`` as an int64 [L, N] array fit for ``move_cost`` (None when the cost is 0
    and no reference is given); one-line errors for a cost out of [0, 1], a cost without a
    reference, and a reference of another shape or EP size."""
    check_move_cost(move_cost)
    if reference is None:
        if move_cost:
            raise InputError("move_cost needs the deployed plan to count moves from (--align-to)")
        return None
    ref = np.asarray(reference)
    if ref.shape != (num_layers, num_experts):
        raise MismatchError(
            f"the deployed placement has shape {ref.shape}, the model {(num_layers, num_experts)}"
        )
    check_reference(ref, ep_size)
    return ref.astype(np.int64)


def with_deployed(problem: LayerProblem, reference: np.ndarray, stay_bonus: float) -> LayerProblem:
    """``problem`` with one load-free row per deployed device appended (module doc).

    Args:
        problem: the layer's problem (with the n-gram term's rows, if any).
        reference: [N] the device each expert has in the deployed plan (0..E-1).
        stay_bonus: what one expert kept with its group is worth: c * A.
    """
    rows = deployed_rows(reference, problem.ep_size, stay_bonus)
    return problem.with_load_free_rows(rows, np.zeros(problem.ep_size))


def deployed_rows(reference: np.ndarray, ep_size: int, stay_bonus: float) -> sparse.csr_matrix:
    """[E, N] the deployed groups as rows: row d holds ``stay_bonus`` on each expert that
    ``reference`` [N] puts on device d. A placement x gains ``sum_d max_b (rows @ onehot(x))
    [d, b]``, ``stay_bonus`` for each expert kept with its group (module doc)."""
    ref = np.asarray(reference, dtype=np.int64)
    n = ref.size
    return sparse.csr_matrix(
        (np.full(n, float(stay_bonus)), (ref, np.arange(n))), shape=(ep_size, n), dtype=np.float64
    )


def experts_kept(reference: np.ndarray, expert_to_device: np.ndarray) -> int:
    """Experts of ``expert_to_device`` [N] kept with their ``reference`` [N] group: for each
    deployed group, those on the device that holds most of it (labels do not matter)."""
    e = int(max(np.max(reference), np.max(expert_to_device))) + 1
    return int(overlap(expert_to_device, reference, e).max(axis=0).sum())


def no_worse_than_deployed(
    problem: LayerProblem,
    placement: LayerPlacement,
    reference: np.ndarray,
    expert_beta: float | None = None,
    batch_prices: bool = False,
) -> LayerPlacement:
    """``placement``, solved on ``problem`` (a :func:`with_deployed` problem), or the
    deployed placement ``reference`` [N] with the shared token assignment where that scores
    at least as high there net of the batch cap (module doc) and, with an expert-load cap
    ``expert_beta``, keeps to it as well as ``placement`` does; ``info["kept_deployed"]``
    says which. With ``batch_prices`` the deployed placement's tokens are priced per
    fitting batch as the solvers' are (:mod:`planner.solve.batch_prices`)."""
    ref = np.asarray(reference, dtype=np.int64)
    if expert_beta is not None:
        allowed = max(expert_beta, expert_imbalance(problem, placement.expert_to_device))
        if expert_imbalance(problem, ref) > allowed * (1 + 1e-9):
            return dataclasses.replace(placement, info=placement.info | {"kept_deployed": False})
    ours = net_objective(
        problem, device_gains(problem, placement.expert_to_device), placement.token_to_device
    )
    started = time.perf_counter() - placement.seconds
    info = placement.info | {"kept_deployed": True}
    stay = finish(problem, placement.method, ref, seed=placement.seed, started=started, info=info)
    if batch_prices:
        stay = batch_priced(problem, stay)
    theirs = net_objective(problem, device_gains(problem, ref), stay.token_to_device)
    if improves(theirs, ours) or theirs == ours:
        return stay
    return dataclasses.replace(placement, info=placement.info | {"kept_deployed": False})


def without_deployed(
    problem: LayerProblem, placement: LayerPlacement, reference: np.ndarray
) -> LayerPlacement:
    """A placement of :func:`with_deployed` ``(problem, reference, ...)`` as one of ``problem``.

    The report is recomputed on ``problem``'s rows; ``info["deployed_rows"]`` gives the
    experts the solver kept with their deployed group, as the term counts them. A layer
    with no token load, which every method gives the default deployment
    (:func:`planner.solve.registry.solve_layer`), keeps the deployed placement instead:
    nothing there pays for a move.
    """
    j, ref = problem.num_tokens, np.asarray(reference, dtype=np.int64)
    started = time.perf_counter() - placement.seconds
    if problem.total_freq <= 0:
        info = placement.info | {"deployed_rows": {"experts_kept": int(ref.size)}}
        return finish(problem, placement.method, ref, seed=placement.seed, started=started,
                      info=info)  # fmt: skip
    x, t = placement.expert_to_device, placement.token_to_device
    kept = int((x == t[j:][ref]).sum())  # expert k's row is ref[k]; it sits on t[j + ref[k]]
    info = placement.info | {"deployed_rows": {"experts_kept": kept}}
    return finish(
        problem, placement.method, x, seed=placement.seed, started=started,
        token_to_device=t[:j], info=info,
    )  # fmt: skip
