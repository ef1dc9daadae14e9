"""Inter-layer n-gram device predictor (Speculative MoE, paper 000 §3.3 and App. B.1).

A token's device at layer l is predicted from the devices of its top-1 experts at layers
l-n .. l-1: ``Pr(D_l | D_{l-1}, ..., D_{l-n})``, tabulated as the argmax table A and its
confidence Ap (n = 2 in the paper). Devices depend on the expert placement, which the
solver chooses later, so the trace is reduced once to a placement-free sufficient
statistic, :class:`TopOneTransitions`: for each layer l the distinct tuples
``(e_{l-3}, e_{l-2}, e_{l-1}, e_l, r)`` of the top-1 experts of the three previous layers
(-1 before layer 0), one routed expert ``e_l`` of layer l and its rank r, with their
counts. Any placement's table of order n <= 3 is then :func:`fit_ngram_device_table`,
without re-reading the trace.

Two targets (``target=``):

- ``"top1"``, the paper's: D_l is the device of the top-1 expert at layer l; the
  confidence is Pr(top-1 expert on the predicted device).
- ``"routed"`` (default): D_l is the device holding most of the token's k routed experts
  in expectation; the confidence is the expected share of its k experts on that device.
  That is the same quantity as the token table's confidence (the local share of a token's
  activations on its device), so Algorithm 2's "use the more confident table" compares
  like with like. With the paper's top-1 confidence the n-gram table won too often: on the
  example model (EP 4) it chose the n-gram for 46% of tokens and lowered the held-out
  balanced LAR from 0.450 (token table alone) to 0.419.

Backoff. With E**n contexts, many are seen a few times in fitting or never (FLAME-MoE at
EP 32, n = 2: 1024 contexts for ~1000 fitting tokens). A context seen once predicts its one
token's device with confidence 1, and an unseen one predicted the layer's common device with
confidence 0. The table therefore interpolates each order with the one below (Dirichlet
smoothing, as in n-gram language models): ``P_j(d | c) = (count(c, d) + m P_{j-1}(d | c'))
/ (count(c) + m)``, where c' is c without its oldest layer and ``P_0`` is the layer's device
shares; m = :data:`BACKOFF_COUNTS` pseudo-counts, in token occurrences (with routed
statistics a token adds k tuples, one per routed expert, so m weighs m * k of them:
until 2026-11-24 m counted tuples, 2/k of a token, and a context seen once by a top-8 token
kept confidence 0.85 where the formula gives 0.5). Dense contexts keep their own estimate,
unseen ones take the lower order's prediction and confidence. Measured on held-out halves
(``benchmarks/compare_traces.py``, every solver's balanced LAR against the table without
backoff): FLAME-MoE +1.5-1.9% on average at EP 16 (up to +4%) and +2.2-7.9% at EP 32 (mean
+4.8%, 4 solvers x 4 cases); EP 2-8 on FLAME-MoE and on the example move by less than 1%
either way, the noise of CEO's time budget.

Table layout (DESIGN.md bundle ``ngram_to_device`` / ``ngram_confidence``): row index of a
context = the base-E number of the devices at layers l-n .. l-1 with the most recent layer
last (least significant): ``row = sum_{i=1..n} D_{l-i} * E**(i-1)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from scipy import sparse

from planner._checks import is_finite_number, is_integer
from planner.errors import InputError, MismatchError, SchemaError
from planner.export.bundle import ngram_row_index
from planner.predict.counts import BUFFER_KEYS, SortedKeyCounter

MAX_ORDER = 3
_WIDTH = MAX_ORDER + 1  # experts per tuple: three context layers and the current one
_RANK = _WIDTH  # column of the routed expert's rank
TARGETS = ("routed", "top1")
# Most cells E**(n+1) of one layer's joint counts that a table fit holds (float64, several
# arrays of it at once; measured peaks of a whole solve: 1.2 GB at 2**24 cells, EP 256 and
# order 2, 12 GB at 2**28, EP 128 and order 3, which this limit refuses).
MAX_TABLE_CELLS = 2**26
# Pseudo-counts of the interpolated backoff of :func:`fit_ngram_device_table` (module doc).
BACKOFF_COUNTS = 2.0


@dataclass(frozen=True)
class TopOneTransitions:
    """Counts of (previous top-1 experts, routed expert, rank) tuples per layer.

    Attributes:
        keys: [M, 5] int16, rows ``(e_{l-3}, e_{l-2}, e_{l-1}, e_l, r)``: top-1 experts of
            the three previous layers (-1 before layer 0), a routed expert of layer l and its
            rank r (0 = top-1).
        counts: [M] int64 token occurrences with that tuple.
        layer_offsets: [L+1] int64; layer l's tuples are rows ``offsets[l]:offsets[l+1]``.
        num_experts: N.

    Example (L = 2, N = 4, k = 2): a token routed to experts (3, 0) at layer 0 and (1, 2) at
    layer 1 adds one to tuples (-1, -1, -1, 3, 0) and (-1, -1, -1, 0, 1) of layer 0 and to
    (-1, -1, 3, 1, 0) and (-1, -1, 3, 2, 1) of layer 1.
    """

    keys: np.ndarray
    counts: np.ndarray
    layer_offsets: np.ndarray
    num_experts: int

    def __post_init__(self) -> None:
        k, c, off = self.keys, self.counts, self.layer_offsets
        if k.ndim != 2 or k.shape[1] != _WIDTH + 1 or c.shape != (k.shape[0],):
            raise SchemaError(f"transitions keys {k.shape} / counts {c.shape} are not [M, 5] / [M]")
        if k.dtype.kind not in "iu" or c.dtype.kind not in "iu" or off.dtype.kind not in "iu":
            raise SchemaError("transitions keys, counts and layer_offsets must hold integers")
        if (
            off.ndim != 1
            or off.shape[0] < 2
            or off[0] != 0
            or off[-1] != k.shape[0]
            or (np.diff(off) < 0).any()
        ):
            raise SchemaError("transitions layer_offsets are inconsistent with the tuples")
        if k.size and (
            int(k[:, :_WIDTH].min()) < -1 or int(k[:, :_WIDTH].max()) >= self.num_experts
        ):
            raise SchemaError(f"transitions hold expert ids outside [-1, {self.num_experts})")
        if c.size and int(c.min()) <= 0:
            raise SchemaError("transitions counts must be positive")
        # Layer l's tuple holds the top-1 expert of layer l - i in column MAX_ORDER - i: -1
        # exactly when l - i < 0. The routed expert and its rank are never negative.
        # (layer by layer: one layer's temporaries, not the model's)
        bad = any(
            ((k[lo:hi, :MAX_ORDER] < 0) != (layer < np.arange(MAX_ORDER, 0, -1))).any()
            for layer, (lo, hi) in enumerate(zip(off[:-1], off[1:], strict=True))
        )
        if k.size and (bad or int(k[:, MAX_ORDER:].min()) < 0):
            raise SchemaError(
                "transitions tuples hold expert -1 where the layer has a previous layer, "
                "or a negative routed expert or rank"
            )

    @property
    def num_layers(self) -> int:
        return int(self.layer_offsets.shape[0] - 1)

    def layer(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(tuples [M_l, 5] int16, counts [M_l] int64) of layer ``l``."""
        if not 0 <= layer < self.num_layers:  # -1 read the last layer
            raise InputError(f"layer {layer} outside [0, {self.num_layers})")
        lo, hi = int(self.layer_offsets[layer]), int(self.layer_offsets[layer + 1])
        return self.keys[lo:hi], self.counts[lo:hi]

    def to_tensors(self) -> dict[str, np.ndarray]:
        return {
            # no copies where the arrays already have the file's dtypes
            "keys": self.keys.astype(np.int16, copy=False),
            "counts": self.counts.astype(np.int64, copy=False),
            "layer_offsets": self.layer_offsets.astype(np.int64, copy=False),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, np.ndarray], num_experts: int) -> TopOneTransitions:
        try:
            return cls(tensors["keys"], tensors["counts"], tensors["layer_offsets"], num_experts)
        except KeyError as e:
            raise SchemaError(f"transitions tensors lack {e.args[0]!r}") from None


class TransitionAccumulator:
    """Accumulates :class:`TopOneTransitions` from trace batches (memory: distinct tuples,
    plus raw-key buffers of at most as many keys as a :class:`CountsAccumulator`'s).

    Args:
        routed: count every routed expert of layer l (k tuples per token and layer, what
            the ``"routed"`` target needs); False counts the top-1 expert only (the paper's
            statistic, k times fewer tuples: fitting a DeepSeek-V3-shaped trace runs at
            ~25-35M activations/s instead of ~10M). With top-1-only statistics both targets
            give the paper's table.
    """

    def __init__(self, num_layers: int, num_experts: int, routed: bool = True):
        self.num_layers, self.num_experts = num_layers, num_experts
        # made by the first chunk, whose k sizes the keys
        self._counters: list[SortedKeyCounter] = []
        self._top_k: int | None = None
        self.routed = routed

    def add(self, experts: np.ndarray) -> None:
        """Count one chunk: ``experts`` [T, L, k] int16 (rank 0 = top-1)."""
        if not self.routed:
            experts = experts[:, :, :1]
        t, _, k = experts.shape
        if self._top_k is None:
            self._top_k = k
            # A key is the tuple's base-N digits, then the rank: below N**4 * k, 4 bytes
            # for up to 256 experts with top-1 statistics (128 routed), else 8. The slots
            # before layer 0 are digit 0: the layer says which they are (result()).
            dtype = np.uint32 if self.num_experts**_WIDTH * k <= 2**32 else np.uint64
            # each layer buffers as many keys as a CountsAccumulator's (2**22 a layer at
            # most, 2**27 in all)
            capacity = min(1 << 22, max(BUFFER_KEYS // self.num_layers, 1))
            self._counters = [SortedKeyCounter(dtype, capacity) for _ in range(self.num_layers)]
        padded = np.zeros((t, self.num_layers + MAX_ORDER), np.uint64)
        padded[:, MAX_ORDER:] = experts[:, :, 0]  # [T, L] top-1 experts after 3 zero slots
        b, ranks = np.uint64(self.num_experts), np.arange(k, dtype=np.uint64)
        for layer in range(self.num_layers):
            win = padded[:, layer : layer + MAX_ORDER]  # top-1 of layers l-3 .. l-1
            ctx = (win[:, 0] * b + win[:, 1]) * b + win[:, 2]
            routed = experts[:, layer].astype(np.uint64)  # [T, k]
            key = (ctx[:, None] * b + routed) * np.uint64(k) + ranks
            self._counters[layer].add_keys(key.ravel())

    def release_buffers(self) -> None:
        """Fold every layer's buffer into its total and free it
        (:meth:`SortedKeyCounter.release_buffer`); :meth:`result` starts with it."""
        for counter in self._counters:
            counter.release_buffer()

    def result(self) -> TopOneTransitions:
        """The tuples and their counts, decoded layer by layer straight into the result's
        arrays (no second copy of them all to concatenate)."""
        b, k = self.num_experts, self._top_k or 1
        self.release_buffers()  # before the result's arrays, not under them
        offsets = np.zeros(self.num_layers + 1, np.int64)
        sizes = [c.size() for c in self._counters] or [0] * self.num_layers
        np.cumsum(sizes, out=offsets[1:])
        keys = np.empty((int(offsets[-1]), _WIDTH + 1), np.int16)
        counts = np.empty(int(offsets[-1]), np.int64)
        for layer, counter in enumerate(self._counters):
            key, c = counter.result()
            out = keys[offsets[layer] : offsets[layer + 1]]
            rest = key.astype(np.int64)
            out[:, _RANK] = rest % k
            rest //= k
            for col in range(_WIDTH - 1, -1, -1):
                out[:, col] = rest % b
                rest //= b
            out[:, : max(MAX_ORDER - layer, 0)] = -1  # the slots before layer 0
            counts[offsets[layer] : offsets[layer + 1]] = c
        return TopOneTransitions(keys, counts, offsets, self.num_experts)


@dataclass(frozen=True)
class NgramDeviceTable:
    """n-gram device table of one placement, in the bundle's layout.

    Attributes:
        to_device: [L, E**n] int16 predicted device of the token's top-1 expert at layer l.
        confidence: [L, E**n] float16 probability of that device given the context (the
            backed-off estimate, module doc); 0 where undefined (l < n).
        order: n.
        ep_size: E.
    """

    to_device: np.ndarray
    confidence: np.ndarray
    order: int
    ep_size: int

    def __post_init__(self) -> None:
        rows = self.ep_size**self.order
        if self.to_device.ndim != 2 or self.to_device.shape[1] != rows:
            raise SchemaError(f"to_device has shape {self.to_device.shape}, expected [L, {rows}]")
        if self.confidence.shape != self.to_device.shape:
            raise SchemaError("confidence and to_device shapes differ")


def contiguous_placement(num_layers: int, num_experts: int, ep_size: int) -> np.ndarray:
    """[L, N] int16 vanilla placement: expert e on device e // (N / E)."""
    _check_ep(num_experts, ep_size)
    per = num_experts // ep_size
    return np.broadcast_to(np.arange(num_experts) // per, (num_layers, num_experts)).astype(
        np.int16
    )


def _check_ep(num_experts: int, ep_size: int) -> None:
    if not is_integer(ep_size) or ep_size < 1 or num_experts % ep_size:
        raise InputError(
            f"ep_size={ep_size!r} must be a positive divisor of num_experts={num_experts}"
        )


def check_table_size(ep_size: int, order: int) -> None:
    """InputError unless an order-``order`` table at ``ep_size`` devices is small enough to fit
    (:data:`MAX_TABLE_CELLS`); it would otherwise fail for memory after the solve."""
    if ep_size ** (order + 1) > MAX_TABLE_CELLS:
        fits = [n for n in range(1, order) if ep_size ** (n + 1) <= MAX_TABLE_CELLS]
        hint = (
            f"use n-gram order {fits[-1]}{' or lower' if fits[-1] > 1 else ''}"
            if fits
            else "n-gram tables are not available"
        )
        raise InputError(
            f"an order-{order} n-gram table at EP {ep_size} needs {ep_size}**{order + 1} counts a "
            f"layer, more than the table fit holds "
            f"(2**{MAX_TABLE_CELLS.bit_length() - 1}); {hint}"
        )


def _check_placement(
    expert_to_device: np.ndarray, num_layers: int, num_experts: int, ep_size: int
) -> np.ndarray:
    e2d = np.asarray(expert_to_device)
    if e2d.shape != (num_layers, num_experts):
        raise MismatchError(
            f"expert_to_device has shape {e2d.shape}, expected (L, N) = ({num_layers}, {num_experts})"
        )
    if e2d.size and (int(e2d.min()) < 0 or int(e2d.max()) >= ep_size):
        raise InputError(f"expert_to_device holds devices outside [0, {ep_size})")
    return e2d.astype(np.int64)


def fit_ngram_device_table(
    transitions: TopOneTransitions,
    expert_to_device: np.ndarray,
    ep_size: int,
    order: int = 2,
    target: str = "routed",
    backoff: float = BACKOFF_COUNTS,
) -> NgramDeviceTable:
    """Fit the n-gram device table of a placement from the transition counts.

    Args:
        transitions: statistic from the fitting data (:class:`TopOneTransitions`).
        expert_to_device: [L, N] device of each expert at each layer.
        ep_size: E devices.
        order: n in 1..3 (2 in the paper).
        target: "routed" (device holding most routed experts; confidence = expected local
            share) or "top1" (the paper's: device of the top-1 expert), see the module doc.
        backoff: pseudo-counts m of the interpolated backoff (module doc); 0 gives the
            paper's table of raw frequencies.

    Returns the table. Every row of layers l < n predicts the layer's most common device
    with confidence 0; so do rows whose context was never seen when ``backoff`` is 0.
    """
    e2d = _check_table_args(transitions, expert_to_device, ep_size, order, target)
    if not (is_finite_number(backoff) and backoff >= 0):
        raise InputError(f"n-gram backoff {backoff!r} must be a number >= 0")
    big_l = transitions.num_layers
    rows_per_layer = ep_size**order
    to_device = np.zeros((big_l, rows_per_layer), np.int16)
    confidence = np.zeros((big_l, rows_per_layer), np.float16)
    for layer in range(big_l):
        tuples, counts = target_tuples(transitions, layer, target)
        routed_device = e2d[layer][tuples[:, 3].astype(np.int64)]
        weights = counts.astype(np.float64)
        shares = np.bincount(routed_device, weights=weights, minlength=ep_size)[None, :]
        to_device[layer] = int(np.argmax(shares))
        if layer < order or tuples.shape[0] == 0:
            continue
        shares = shares / shares.sum()  # order 0: the layer's device shares
        # m pseudo-counts are m token occurrences: with routed statistics a token adds one
        # tuple per routed expert (ranks 0..k-1), so m tokens weigh m * k tuples
        m = backoff * (int(tuples[:, _RANK].max()) + 1)
        for j in range(1 if backoff > 0 else order, order + 1):
            cell = _context_rows(tuples, e2d, layer, j, ep_size) * ep_size + routed_device
            joint = np.bincount(cell, weights=weights, minlength=ep_size ** (j + 1))
            joint = joint.reshape(ep_size**j, ep_size)
            total = joint.sum(axis=1)
            # context c backs off to its most recent j-1 devices: row c mod E**(j-1)
            lower = shares[np.arange(ep_size**j) % shares.shape[0]]
            shares = (joint + m * lower) / np.maximum(total + m, 1e-300)[:, None]
        # ``cell`` and ``total`` are now order n's (the loop's last step). Ties go to the
        # device of the top-1 expert (exact ties are common when k experts spread evenly
        # over devices).
        top1 = tuples[:, _RANK] == 0
        top1_joint = np.bincount(
            cell[top1], weights=weights[top1], minlength=rows_per_layer * ep_size
        ).reshape(rows_per_layer, ep_size)
        best = np.argmax(shares + 1e-6 * top1_joint / np.maximum(total, 1)[:, None], axis=1)
        defined = (total > 0) | (backoff > 0)
        to_device[layer, defined] = best[defined]
        confidence[layer, defined] = shares[defined, best[defined]].astype(np.float16)
    return NgramDeviceTable(to_device, confidence, order, ep_size)


def ngram_context_affinity(
    transitions: TopOneTransitions,
    expert_to_device: np.ndarray,
    layer: int,
    ep_size: int,
    order: int = 2,
    target: str = "routed",
) -> np.ndarray:
    """[E**n, N] activations of layer ``layer``'s experts per n-gram context (sparse CSR).

    Row c counts, over the fitting tokens whose top-1 experts at layers l-n .. l-1 sat on
    the devices of context c (the n-gram table's row c, same layout), the activations of
    each expert of layer l (all k routed experts for ``target="routed"``, the top-1 only for
    ``"top1"``). Only rows ``l-n .. l-1`` of ``expert_to_device`` are read. Under a
    placement x of layer l, the n-gram table predicts for context c the device d maximising
    ``sum_{k on d} row_c[k]``, and that maximum is what the table gets right on the fitting
    data; so these rows, appended to layer l's problem as load-free tokens, make a solver
    optimise the n-gram table along with the token table (see
    :mod:`planner.solve.ngram_term`). Layers l < n have no context: all zeros. Sparse,
    because E**n x N can be large (EP 64, n = 3, 256 experts: 67M entries) while only the
    contexts seen in fitting have entries.
    """
    e2d = _check_table_args(transitions, expert_to_device, ep_size, order, target)
    if not is_integer(layer) or not 0 <= layer < transitions.num_layers:
        raise InputError(f"layer {layer!r} outside [0, {transitions.num_layers})")
    shape = (ep_size**order, transitions.num_experts)
    tuples, counts = target_tuples(transitions, layer, target)
    if layer < order or tuples.shape[0] == 0:
        return sparse.csr_array(shape, dtype=np.float64)
    ctx = _context_rows(tuples, e2d, layer, order, ep_size)
    rows = sparse.coo_array(
        (counts.astype(np.float64), (ctx, tuples[:, 3].astype(np.int64))), shape=shape
    ).tocsr()
    rows.sum_duplicates()
    return rows


def _check_table_args(
    transitions: TopOneTransitions,
    expert_to_device: np.ndarray,
    ep_size: int,
    order: int,
    target: str,
) -> np.ndarray:
    """Validate the arguments shared by the table fit and the context affinity; -> [L, N] int64."""
    if not is_integer(order) or order not in range(1, MAX_ORDER + 1):
        raise InputError(f"ngram order {order!r} must be 1, 2 or 3")
    if target not in TARGETS:
        raise InputError(f"n-gram target {target!r} must be one of {', '.join(TARGETS)}")
    _check_ep(transitions.num_experts, ep_size)
    check_table_size(ep_size, order)
    return _check_placement(
        expert_to_device, transitions.num_layers, transitions.num_experts, ep_size
    )


def target_tuples(
    transitions: TopOneTransitions, layer: int, target: str
) -> tuple[np.ndarray, np.ndarray]:
    """Layer l's (tuples, counts), the top-1 rows only for the ``"top1"`` target.

    Column ``MAX_ORDER - i`` of a tuple is the top-1 expert of layer l - i (i = 1..3), column
    ``MAX_ORDER`` the routed expert of layer l, the last its rank.
    """
    tuples, counts = transitions.layer(layer)
    if target == "top1":
        keep = tuples[:, _RANK] == 0
        tuples, counts = tuples[keep], counts[keep]
    return tuples, counts


def _context_rows(
    tuples: np.ndarray, e2d: np.ndarray, layer: int, order: int, ep_size: int
) -> np.ndarray:
    """[M] int64 n-gram table row of each tuple's context under placement ``e2d``."""
    ctx = np.stack(
        [e2d[layer - i][tuples[:, MAX_ORDER - i].astype(np.int64)] for i in range(order, 0, -1)],
        axis=1,
    )
    return ngram_row_index(ctx, ep_size)


def predict_devices(
    table: NgramDeviceTable, experts: np.ndarray, expert_to_device: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Online n-gram prediction for trace rows ``experts`` [T, L, k].

    Returns (device [T, L] int64, confidence [T, L] float32); layers l < n get the table's
    default device and confidence 0, as at serving time.
    """
    t, big_l, _ = experts.shape
    e2d = _check_placement(expert_to_device, big_l, expert_to_device.shape[1], table.ep_size)
    if table.to_device.shape[0] != big_l:
        raise MismatchError(
            f"n-gram table has {table.to_device.shape[0]} layers, trace has {big_l}"
        )
    top1_dev = np.stack(
        [e2d[layer][experts[:, layer, 0].astype(np.int64)] for layer in range(big_l)], axis=1
    )
    device = np.empty((t, big_l), np.int64)
    conf = np.zeros((t, big_l), np.float32)
    n = table.order
    for layer in range(big_l):
        if layer < n:
            device[:, layer] = table.to_device[layer, 0]
            continue
        rows = ngram_row_index(top1_dev[:, layer - n : layer], table.ep_size)
        device[:, layer] = table.to_device[layer, rows]
        conf[:, layer] = table.confidence[layer, rows]
    return device, conf


@dataclass
class NgramEvaluation:
    """Held-out accuracy of an n-gram device table, accumulated over batches.

    Per layer: ``hits`` tokens whose top-1 expert sat on the predicted device, ``local``
    routed activations on the predicted device, ``tokens`` occurrences evaluated.
    Layers l < n are not evaluated (no full context).
    """

    order: int
    ep_size: int
    hits: np.ndarray
    local: np.ndarray
    tokens: np.ndarray
    top_k: int

    def add(
        self, table: NgramDeviceTable, experts: np.ndarray, expert_to_device: np.ndarray
    ) -> None:
        device, _ = predict_devices(table, experts, expert_to_device)
        e2d = np.asarray(expert_to_device, np.int64)
        for layer in range(self.order, experts.shape[1]):
            dev_of_routed = e2d[layer][experts[:, layer].astype(np.int64)]  # [T, k]
            on = dev_of_routed == device[:, layer][:, None]
            self.hits[layer] += int(on[:, 0].sum())
            self.local[layer] += int(on.sum())
            self.tokens[layer] += experts.shape[0]

    def summary(self) -> dict:
        ev = self.tokens > 0
        acc = np.where(ev, self.hits / np.maximum(self.tokens, 1), np.nan)
        lar = np.where(ev, self.local / np.maximum(self.tokens * self.top_k, 1), np.nan)
        total = int(self.tokens.sum())
        return {
            "order": self.order,
            "ep_size": self.ep_size,
            "top1_device_accuracy": {
                "per_layer": [_round(x) for x in acc],
                "overall": _round(self.hits.sum() / total) if total else None,
            },
            "local_activation_rate": {
                "per_layer": [_round(x) for x in lar],
                "overall": _round(self.local.sum() / (total * self.top_k)) if total else None,
            },
        }


def evaluate_ngram_device_table(
    table: NgramDeviceTable,
    batches: Iterable[np.ndarray],
    expert_to_device: np.ndarray,
    top_k: int,
) -> NgramEvaluation:
    """Accuracy of ``table`` on held-out rows: ``batches`` yields ``experts`` [T, L, k]."""
    big_l = table.to_device.shape[0]
    ev = NgramEvaluation(
        table.order, table.ep_size, np.zeros(big_l, np.int64), np.zeros(big_l, np.int64),
        np.zeros(big_l, np.int64), top_k,
    )  # fmt: skip
    for experts in batches:
        ev.add(table, experts, expert_to_device)
    return ev


def _round(x: float) -> float | None:
    return None if x is None or not np.isfinite(x) else round(float(x), 6)
