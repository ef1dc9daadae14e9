"""The per-layer co-placement problem, the solver configuration, and the result every solver returns.

Balanced token-expert co-clustering (Speculative MoE, paper 000 §3.4 and App. B; Sem-MoE,
paper 001 §3.3 and App. B), one MoE layer at a time:

- J distinct tokens, token j occurring ``a_j`` times (``token_freq``);
- N experts, E devices (EP size), each device hosting exactly N/E experts;
- affinity ``W[j, k]``: expected routed activations of expert k by token j, summed over the
  token's occurrences, so ``sum_k W[j, k] = a_j * top_k``.

A placement maps every expert to a device (``expert_to_device``) and every token to a device
(``token_to_device``). An activation (j, k) is *local* when token j is sent to the device that
hosts expert k. The solvers maximise the local activations
``sum_j sum_{k on device(j)} W[j, k]`` under one of two balance rules:

- ``balance="cap"`` (default): the token load of each device (sum of ``a_j`` of the tokens sent
  there) stays within ``capacity = beta * sum(a) / E``. Tokens are indivisible, so a token
  that no longer fits anywhere goes to the least-loaded device; that device's load then stays
  below ``sum(a) / E + a_j``. The rule a placement is validated against is therefore
  ``load_d <= capacity + max_j a_j`` (the *slack* is one maximal token). On small instances
  or at large EP a single token can be heavier than ``capacity`` by itself: it then sits on a
  device of its own choosing, alone where the other tokens fit elsewhere (the exact paths, the
  ILP's and the shared assignment's, solve first with each token's load counted as at most
  the cap, :func:`planner.solve.assign.heavy_fill_loads`), and the same slack rule covers it.
- ``balance="penalty"``: no hard cap; the objective is the paper's θ-weighted one, written as
  a maximisation: ``(1 - θ) * local - θ * sum_d |load_d - sum(a) / E|``.

A row with ``a_j = 0`` and positive affinity is *load-free*: its local activations count in
the objective, but it puts no load on its device, so every solver sends it where most of
its activations are local. The n-gram term (:mod:`planner.solve.ngram_term`) adds one such
row per n-gram context; a solver needs nothing special for them, except that anything
ranking rows by weight uses :attr:`LayerProblem.row_mass` rather than ``a_j``.

Glossary: *LAR* (local activation rate) = local activations / all activations; *token
imbalance* = max device token load / mean device token load.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import sparse

from planner._checks import is_bool, is_finite_number, is_real, is_seed
from planner.errors import InfeasibleError, InputError, MismatchError

BALANCE_MODES = ("cap", "penalty")
# Relative tolerance when comparing loads with a capacity (float sums of frequencies).
LOAD_RTOL = 1e-9


@dataclass(frozen=True, eq=False)
class LayerProblem:
    """One layer's co-placement problem, validated when built.

    Attributes:
        affinity: W [J, N] sparse (CSR, float64): expected activations of expert k by token j,
            summed over the token's occurrences. Any scipy sparse matrix/array or dense array
            is accepted and converted (duplicates summed, explicit zeros dropped).
        token_freq: a [J] float64 >= 0: occurrences of each token.
        ep_size: E devices; N must be a multiple of E and E <= N.
        beta: token load factor of the cap (>= 1; 1.1 in both papers).
        balance: "cap" (hard cap ``beta * sum(a) / E``) or "penalty" (θ-weighted objective).
        theta: weight of the balance term in penalty mode, in [0, 1].
        token_ids: optional [J] int64 vocabulary ids of the J rows (carried, never used by
            the solvers; lets a caller turn a placement into a vocabulary table).
        layer: optional MoE layer index (for messages and reports).
        batch_freq: optional [J, G] sparse occurrences of each row's token in each of G
            fitting batches (:mod:`planner.predict.batches`); the rows of load-free items
            are empty or hold the occurrences the row stands for. Used to estimate what the
            runtime's per-batch cap takes back (:func:`planner.solve.common.batch_overflow`).
        row_occurrences: optional [J] occurrences each row stands for at run time (None:
            ``token_freq``). A load-free row can still stand for occurrences: an n-gram
            context row stands for the fitting tokens seen in its context, which the n-gram
            table sends to the row's device, so the runtime's per-batch cap can take them
            back (:func:`planner.solve.common.batch_overflow`).

    Example: 3 tokens, 4 experts, E = 2::

        W = [[2, 2, 0, 0],     a = [2, 1, 1]   (top-2 routing: rows sum to 2 a_j)
             [0, 0, 1, 1],
             [1, 0, 1, 0]]
        experts {0, 1} on device 0, {2, 3} on device 1; tokens -> [0, 1, 0]:
        local = 4 + 2 + 1 = 7 of 8 activations, LAR = 0.875; loads [3, 1], imbalance 1.5.
    """

    affinity: sparse.csr_matrix
    token_freq: np.ndarray
    ep_size: int
    beta: float = 1.1
    balance: str = "cap"
    theta: float = 0.5
    token_ids: np.ndarray | None = None
    layer: int | None = None
    batch_freq: sparse.csr_matrix | None = None
    row_occurrences: np.ndarray | None = None

    def __post_init__(self) -> None:
        where = "" if self.layer is None else f" (layer {self.layer})"
        w = self.affinity
        if not sparse.issparse(w):
            w = np.asarray(w)
            if w.ndim != 2:
                raise InputError(
                    f"affinity{where} must be 2-D [tokens, experts], got shape {w.shape}"
                )
        try:
            w = sparse.csr_matrix(w, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise InputError(f"affinity{where} is not a numeric matrix: {exc}") from exc
        w.sum_duplicates()
        w.eliminate_zeros()
        w.sort_indices()
        if w.data.size and not np.isfinite(w.data).all():
            raise InputError(f"affinity{where} holds non-finite values")
        if w.data.size and w.data.min() < 0:
            raise InputError(f"affinity{where} holds negative values (min {w.data.min():g})")
        num_tokens, num_experts = w.shape
        freq = np.asarray(self.token_freq, dtype=np.float64)
        if freq.shape != (num_tokens,):
            raise InputError(
                f"token_freq{where} has shape {freq.shape}, expected ({num_tokens},) "
                f"to match affinity {w.shape}"
            )
        if freq.size and not np.isfinite(freq).all():
            raise InputError(f"token_freq{where} holds non-finite values")
        if freq.size and freq.min() < 0:
            raise InputError(f"token_freq{where} holds negative values (min {freq.min():g})")
        for name, values in (("affinity", w.data), ("token_freq", freq)):
            with np.errstate(over="ignore"):
                total = float(values.sum())
            if not math.isfinite(total):
                raise InputError(f"{name}{where} sums to more than a float64 holds; scale it down")
        e = self.ep_size
        if isinstance(e, bool) or not isinstance(e, int | np.integer) or e < 1:
            raise InputError(f"ep_size={e!r} must be a positive integer")
        if num_experts < 1:
            raise InputError(f"affinity{where} has no experts (shape {w.shape})")
        if e > num_experts:
            raise InfeasibleError(
                f"ep_size E={e} exceeds the number of experts N={num_experts}{where}: "
                "every device must host at least one expert; use E <= N"
            )
        if num_experts % e:
            raise InfeasibleError(
                f"N={num_experts} experts cannot be split evenly over E={e} devices{where}: "
                f"N % E = {num_experts % e}; choose an EP size that divides {num_experts}"
            )
        for name in ("beta", "theta"):
            if not is_real(getattr(self, name)):  # a bool was taken as 1.0
                raise InputError(f"{name}={getattr(self, name)!r} must be a number")
        if not math.isfinite(self.beta) or self.beta < 1.0:
            raise InfeasibleError(
                f"beta={self.beta!r}: a token load cap below the mean (beta < 1) cannot hold "
                "all tokens; use beta >= 1 (1.1 is the papers' value)"
            )
        if self.balance not in BALANCE_MODES:
            raise InputError(f"balance={self.balance!r} is not one of {', '.join(BALANCE_MODES)}")
        if not (0.0 <= self.theta <= 1.0):
            raise InputError(f"theta={self.theta!r} must lie in [0, 1]")
        ids = self.token_ids
        if ids is not None:
            ids = np.asarray(ids, dtype=np.int64)
            if ids.shape != (num_tokens,):
                raise InputError(
                    f"token_ids{where} has shape {ids.shape}, expected ({num_tokens},)"
                )
            object.__setattr__(self, "token_ids", ids)
        if self.batch_freq is not None:
            b = sparse.csr_matrix(self.batch_freq, dtype=np.float64)
            if b.shape[0] != num_tokens or (
                b.data.size and not (np.isfinite(b.data).all() and b.data.min() >= 0)
            ):
                raise InputError(
                    f"batch_freq{where} must be [{num_tokens}, G], finite and >= 0, got shape "
                    f"{b.shape}"
                )
            object.__setattr__(self, "batch_freq", b)
        if self.row_occurrences is not None:
            occ = np.asarray(self.row_occurrences, dtype=np.float64)
            if occ.shape != (num_tokens,) or not np.isfinite(occ).all() or (occ < 0).any():
                raise InputError(
                    f"row_occurrences{where} must be [{num_tokens}] finite and >= 0, got "
                    f"shape {occ.shape}"
                )
            object.__setattr__(self, "row_occurrences", occ)
        object.__setattr__(self, "affinity", w)
        object.__setattr__(self, "token_freq", freq)
        object.__setattr__(self, "ep_size", int(e))
        object.__setattr__(self, "beta", float(self.beta))
        object.__setattr__(self, "theta", float(self.theta))

    # Shapes -------------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """J distinct tokens."""
        return self.affinity.shape[0]

    @property
    def num_experts(self) -> int:
        """N experts."""
        return self.affinity.shape[1]

    @property
    def experts_per_device(self) -> int:
        """N / E."""
        return self.num_experts // self.ep_size

    @property
    def total_freq(self) -> float:
        """S = sum(a): token occurrences."""
        return float(self.token_freq.sum())

    @property
    def total_activations(self) -> float:
        """sum(W): routed activations (the LAR's denominator)."""
        return float(self.affinity.data.sum())

    @property
    def occurrences(self) -> np.ndarray:
        """[J] occurrences each row stands for at run time (``row_occurrences`` or ``a``)."""
        return self.token_freq if self.row_occurrences is None else self.row_occurrences

    @property
    def capacity(self) -> float:
        """Token load cap per device: beta * sum(a) / E."""
        return self.beta * self.total_freq / self.ep_size

    @property
    def load_slack(self) -> float:
        """What validation tolerates above ``capacity``: one maximal token (see module doc)."""
        return float(self.token_freq.max()) if self.num_tokens else 0.0

    # Derived arrays shared by the solvers (computed once, kept with the problem) -----------

    @functools.cached_property
    def nnz_rows(self) -> np.ndarray:
        """[nnz] int64 token (row) index of each stored affinity entry, in CSR order."""
        w = self.affinity
        return np.repeat(np.arange(w.shape[0], dtype=np.int64), np.diff(w.indptr))

    @functools.cached_property
    def batch_entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """(row [M], batch [M], occurrences [M], batch capacity [G]) of ``batch_freq``.

        The capacity is the runtime cap ``beta * S_g / E`` of each batch over these rows;
        None without batches.
        """
        b = self.batch_freq
        if b is None:
            return None
        rows = np.repeat(np.arange(b.shape[0], dtype=np.int64), np.diff(b.indptr))
        with np.errstate(over="ignore"):  # a beta near 1e308: infinite caps, none at all
            cap = self.beta * np.asarray(b.sum(axis=0)).ravel() / self.ep_size
        return rows, b.indices.astype(np.int64), b.data, cap

    @functools.cached_property
    def affinity_csc(self) -> sparse.csc_matrix:
        """W [J, N] in CSC form (column access: the tokens that route to an expert)."""
        return self.affinity.tocsc()

    @functools.cached_property
    def expert_load(self) -> np.ndarray:
        """[N] float64 routed activations of each expert (column sums of W)."""
        return np.asarray(self.affinity.sum(axis=0)).ravel()

    @functools.cached_property
    def token_activations(self) -> np.ndarray:
        """[J] float64 routed activations of each token (row sums of W)."""
        return np.asarray(self.affinity.sum(axis=1)).ravel()

    @functools.cached_property
    def row_mass(self) -> np.ndarray:
        """[J] float64 weight of each row in token occurrences: activations / (k per occurrence).

        k is the token rows' mean activations per occurrence. For a token row this is ``a_j``
        (a token routes to k experts per occurrence); for a load-free row (``a_j = 0``) it is
        the occurrences its activations stand for. Solvers rank and weight rows by it, and
        balance loads by ``a_j``.
        """
        act, loaded = self.token_activations, self.token_freq > 0
        total_act, total_freq = float(act[loaded].sum()), self.total_freq
        per_occurrence = total_act / total_freq if total_freq > 0 and total_act > 0 else 1.0
        return act / per_occurrence

    def select_tokens(self, rows: np.ndarray) -> LayerProblem:
        """The same problem restricted to token rows ``rows`` (capacity follows their load)."""
        rows = np.asarray(rows, dtype=np.int64)
        return dataclasses.replace(
            self,
            affinity=self.affinity[rows],
            token_freq=self.token_freq[rows],
            token_ids=None if self.token_ids is None else self.token_ids[rows],
            batch_freq=None if self.batch_freq is None else self.batch_freq[rows],
            row_occurrences=None if self.row_occurrences is None else self.row_occurrences[rows],
        )

    def with_load_free_rows(
        self,
        rows: sparse.csr_matrix,
        occurrences: np.ndarray,
        batch_freq: sparse.csr_matrix | None = None,
    ) -> LayerProblem:
        """This problem with R load-free rows appended (no token load): the n-gram term's
        context rows (:mod:`planner.solve.ngram_term`), the deployed plan's groups
        (:mod:`planner.solve.settle`).

        Args:
            rows: [R, N] their affinities.
            occurrences: [R] run-time occurrences each row stands for (``row_occurrences``).
            batch_freq: the whole [J + R, G] batch matrix where the rows take a share of the
                fitting batches; None gives them empty batch rows (when there are batches).

        The result has no ``token_ids`` (they would not cover the new rows).
        """
        r = rows.shape[0]
        if batch_freq is None and self.batch_freq is not None:
            empty = sparse.csr_matrix((r, self.batch_freq.shape[1]))
            batch_freq = sparse.vstack([self.batch_freq, empty], format="csr")
        return dataclasses.replace(
            self,
            affinity=sparse.vstack([self.affinity, sparse.csr_matrix(rows)], format="csr"),
            token_freq=np.concatenate([self.token_freq, np.zeros(r)]),
            token_ids=None,
            batch_freq=batch_freq,
            row_occurrences=np.concatenate([self.occurrences, occurrences]),
        )

    def heaviest_rows(self, count: int, among: np.ndarray | None = None) -> np.ndarray:
        """Sorted row ids of the ``count`` rows of largest :attr:`row_mass` (of ``among``).

        For token rows, the most frequent tokens; load-free rows rank by the occurrences
        they stand for. ``among``: optional [J] bool mask of the rows to choose from.
        """
        ids = np.arange(self.num_tokens) if among is None else np.flatnonzero(among)
        order = ids[np.argsort(-self.row_mass[ids], kind="stable")]
        return np.sort(order[: max(0, int(count))])

    def with_options(self, **changes: Any) -> LayerProblem:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        where = "" if self.layer is None else f"layer {self.layer}: "
        return (
            f"{where}J={self.num_tokens} tokens, N={self.num_experts} experts, E={self.ep_size}, "
            f"nnz={self.affinity.nnz}, balance={self.balance}, beta={self.beta:g}"
        )


@dataclass
class SolverConfig:
    """How to run a solver: one seed, one time limit, per-method options.

    Attributes:
        seed: seed of every random choice (a layer's own seed is derived from it by
            :func:`planner.solve.plan.layer_seed` when a whole model is solved).
        time_limit: wall-clock seconds a solver may spend (ILP: the MIP time limit; iterative
            solvers stop early when they reach it). None = each solver's own default.
        options: per-method option dicts, e.g. ``{"ceo": {"variant": "paper"}, "ilp":
            {"lp_path": "layer0.lp"}}``; each solver documents its keys and rejects unknown
            ones with :class:`InputError`.
        expert_beta: cap on each device's expert load as a multiple of the mean
            (:mod:`planner.solve.expert_balance`): every method's result is brought under
            it, and CEO's search keeps to it. None leaves expert load unbounded.
        polish: run the local search CEO ends with on the result of the other methods
            (not ``vanilla``, the default deployment as it is;
            :func:`planner.solve.polish.polish_placement`), after the expert-load cap and
            keeping to it, as CEO's polish does.
        batch_prices: end every method but ``vanilla`` with its tokens re-assigned priced
            per fitting batch (:mod:`planner.solve.batch_prices`), so that the runtime's
            per-batch cap takes back less where the served batches are made up as the
            fitting batches were; off by default (it loses where they are mixed). A
            predictor without recorded batches is unaffected.
    """

    seed: int = 0
    time_limit: float | None = None
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    expert_beta: float | None = None
    polish: bool = False
    batch_prices: bool = False

    def __post_init__(self) -> None:
        if not is_seed(self.seed):  # as trace split's and fit's
            raise InputError(f"seed={self.seed!r} must be an integer in [0, 2**64)")
        if self.time_limit is not None and not (
            is_real(self.time_limit) and 0 < self.time_limit < math.inf
        ):
            raise InputError(
                f"time_limit={self.time_limit!r} must be positive, finite seconds (give none for "
                "no limit)"
            )
        if not isinstance(self.options, dict):
            raise InputError(
                f"options must be a dict of per-method dicts, got {type(self.options).__name__}"
            )
        check_expert_beta(self.expert_beta)
        for name in ("polish", "batch_prices"):
            value = getattr(self, name)
            if not is_bool(value):
                raise InputError(f"{name}={value!r} must be true or false")
            setattr(self, name, bool(value))

    def for_method(self, method: str) -> dict[str, Any]:
        """The option dict of one method (empty when none were given)."""
        opts = self.options.get(method, {})
        if not isinstance(opts, dict):
            raise InputError(f"options[{method!r}] must be a dict, got {type(opts).__name__}")
        return dict(opts)

    def deadline(self, started: float) -> float | None:
        """The ``time.perf_counter()`` value at which a solve begun at ``started`` must stop
        (None: no time limit)."""
        return None if self.time_limit is None else started + self.time_limit

    def with_seed(self, seed: int) -> SolverConfig:
        return dataclasses.replace(self, seed=int(seed))

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": int(self.seed),
            "time_limit": self.time_limit,
            "options": self.options,
            "expert_beta": self.expert_beta,
            "polish": self.polish,
            "batch_prices": self.batch_prices,
        }


def check_expert_beta(expert_beta: float | None) -> None:
    """InputError unless ``expert_beta`` is None or a finite number >= 1 (not a bool)."""
    if expert_beta is None:
        return
    if not (is_finite_number(expert_beta) and expert_beta >= 1):
        raise InputError(f"expert_beta={expert_beta} must be a finite number >= 1 (or none)")


@dataclass(frozen=True, eq=False)
class LayerPlacement:
    """A solver's answer for one layer, with its report.

    Attributes:
        expert_to_device: [N] int64 device of each expert; exactly N/E experts per device.
        token_to_device: [J] int64 device each token is sent to.
        token_confidence: [J] float64 in [0, 1]: share of the token's predicted activations
            that are local on its device (``W[j, experts of device] / sum_k W[j, k]``; 0 for a
            token without activations). Comparable with an n-gram table's confidence.
        objective: the maximised value: local activations ("cap"), or
            ``(1-θ) local - θ sum_d |load_d - S/E|`` ("penalty").
        local_rate: LAR on W (local activations / all activations).
        token_imbalance: max device token load / mean device token load.
        seconds: wall-clock solve time.
        seed: the seed the solver ran with.
        method: registry name of the solver.
        info: free-form solver report (status, iterations, what was approximated).
    """

    expert_to_device: np.ndarray
    token_to_device: np.ndarray
    token_confidence: np.ndarray
    objective: float
    local_rate: float
    token_imbalance: float
    seconds: float
    seed: int
    method: str
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, dtype in (("expert_to_device", np.int64), ("token_to_device", np.int64),
                            ("token_confidence", np.float64)):  # fmt: skip
            value = np.asarray(getattr(self, name))
            if value.ndim != 1:
                raise InputError(f"{name} must be 1-D, got shape {value.shape}")
            if dtype is np.int64 and value.size and value.dtype.kind not in "iu":
                # a device id of 1.7 must not pass as device 1
                raise InputError(f"{name} must hold integer device ids, got {value.dtype}")
            object.__setattr__(self, name, value.astype(dtype, copy=False))

    def device_loads(self, problem: LayerProblem) -> np.ndarray:
        """[E] float64 token load (sum of frequencies) sent to each device."""
        return np.bincount(
            self.token_to_device, weights=problem.token_freq, minlength=problem.ep_size
        )

    def validate(self, problem: LayerProblem) -> None:
        """Check this placement against ``problem``; raise on the first violation.

        Checks: shapes match (:class:`MismatchError`); device ids in [0, E); exactly N/E
        experts per device; confidences in [0, 1]; in "cap" mode every device's token load
        <= capacity + max_j a_j (see the module docstring) (:class:`InfeasibleError`).
        """
        n, j, e = problem.num_experts, problem.num_tokens, problem.ep_size
        if self.expert_to_device.shape != (n,):
            raise MismatchError(
                f"expert_to_device has shape {self.expert_to_device.shape}, problem has N={n}"
            )
        if self.token_to_device.shape != (j,):
            raise MismatchError(
                f"token_to_device has shape {self.token_to_device.shape}, problem has J={j}"
            )
        if self.token_confidence.shape != (j,):
            raise MismatchError(
                f"token_confidence has shape {self.token_confidence.shape}, problem has J={j}"
            )
        for name, arr in (
            ("expert_to_device", self.expert_to_device),
            ("token_to_device", self.token_to_device),
        ):
            if arr.size and (arr.min() < 0 or arr.max() >= e):
                raise InfeasibleError(
                    f"{self.method}: {name} holds ids outside [0, {e}): [{arr.min()}, {arr.max()}]"
                )
        counts = np.bincount(self.expert_to_device, minlength=e)
        if (counts != problem.experts_per_device).any():
            raise InfeasibleError(
                f"{self.method}: experts per device {counts.tolist()} differ from N/E = "
                f"{problem.experts_per_device}"
            )
        conf = self.token_confidence
        if conf.size and (not np.isfinite(conf).all() or conf.min() < 0 or conf.max() > 1 + 1e-9):
            raise InfeasibleError(f"{self.method}: token_confidence outside [0, 1]")
        if problem.balance == "cap" and j:
            loads = self.device_loads(problem)
            bound = problem.capacity + problem.load_slack
            if loads.max() > bound * (1 + LOAD_RTOL):
                d = int(loads.argmax())
                raise InfeasibleError(
                    f"{self.method}: device {d} has token load {loads[d]:.6g} > capacity "
                    f"{problem.capacity:.6g} + slack {problem.load_slack:.6g}"
                )

    def report(self) -> dict[str, Any]:
        """The scalar part as JSON-ready data (arrays left out)."""
        return {
            "method": self.method,
            "seed": int(self.seed),
            "objective": float(self.objective),
            "local_rate": float(self.local_rate),
            "token_imbalance": float(self.token_imbalance),
            "seconds": float(self.seconds),
            "info": _jsonable(self.info),
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value
