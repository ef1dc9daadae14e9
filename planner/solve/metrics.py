"""How good a placement is on affinity data it was not fitted on (W-based metrics).

DESIGN.md defines the metrics on a trace (per token occurrence, batches in trace order).
Token-expert counts have no order, so these are their W-based counterparts, used by the
solver benchmarks and tests; the trace evaluator is separate.

Shapes: V vocabulary ids, J rows of an evaluation matrix, N experts, E devices.

- A *token table* maps every vocabulary id to a device (``token_to_device`` [V]) with a
  confidence (``token_confidence`` [V]); :func:`token_table` builds one from a placement
  solved on some token rows, filling the ids the placement never saw by a fallback.
- :func:`local_rate`: LAR of a table on an evaluation W: every activation counts, the token
  goes where the table says.
- :func:`balanced_local_rate`: the same when each device may take at most
  ``beta x S / E`` of the evaluation token load: on an over-full device the most confident
  tokens keep their place; the overflow (occurrences are routed one by one, so a token's
  occurrences may split) is spread over the devices with room, in proportion to their room
  (a runtime that fills free devices without knowing where the token's experts are does no
  better in expectation). This is the figure plans are judged by.
- :func:`oracle_bound`: per token, the largest share of its activations any single device
  with N/E experts could host (sum of its top-N/E expert counts); no placement beats it.
- :func:`vanilla_local_rate`: contiguous experts with positional token chunks: a token
  occurrence lands on each device with probability 1/E, so the expected LAR is exactly 1/E
  whatever W is.
"""

from __future__ import annotations

import numpy as np
from scipy import sparse

from planner.errors import InputError, MismatchError

FALLBACKS = ("popular", "round_robin")


def token_table(
    token_ids: np.ndarray,
    token_to_device: np.ndarray,
    token_confidence: np.ndarray,
    expert_to_device: np.ndarray,
    vocab_size: int,
    ep_size: int,
    *,
    expert_load: np.ndarray | None = None,
    fallback: str = "popular",
) -> tuple[np.ndarray, np.ndarray]:
    """A vocabulary-wide table from a placement solved on some token rows.

    Args:
        token_ids: [J] vocabulary id of each solved row.
        token_to_device, token_confidence: [J] the placement's token choices.
        expert_to_device: [N] the placement's experts.
        vocab_size: V.
        ep_size: E.
        expert_load: [N] routed activations per expert (needed by ``fallback="popular"``).
        fallback: for ids not in ``token_ids``: "popular" sends them to the device holding
            the most expert load (the best guess for a token we know nothing about);
            "round_robin" to ``id % E``. Their confidence is 0.

    Returns:
        (token_to_device [V] int64, token_confidence [V] float64).
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise InputError(f"token ids outside [0, {vocab_size}): [{ids.min()}, {ids.max()}]")
    e = int(ep_size)
    if fallback == "popular":
        if expert_load is None:
            raise InputError("fallback='popular' needs expert_load")
        device_load = np.bincount(expert_to_device, weights=expert_load, minlength=e)
        table = np.full(vocab_size, int(device_load.argmax()), dtype=np.int64)
    elif fallback == "round_robin":
        table = np.arange(vocab_size, dtype=np.int64) % e
    else:
        raise InputError(f"fallback={fallback!r} is not one of {', '.join(FALLBACKS)}")
    confidence = np.zeros(vocab_size, dtype=np.float64)
    table[ids] = token_to_device
    confidence[ids] = token_confidence
    return table, confidence


def _gains(w: sparse.csr_matrix, expert_to_device: np.ndarray, e: int) -> np.ndarray:
    rows = np.repeat(np.arange(w.shape[0], dtype=np.int64), np.diff(w.indptr))
    key = rows * e + expert_to_device[w.indices]
    # float64 even without entries (bincount of no weights is int64)
    gain = np.bincount(key, weights=w.data, minlength=w.shape[0] * e)
    return gain.astype(np.float64, copy=False).reshape(-1, e)


def _check(w, token_ids, expert_to_device):
    w = sparse.csr_matrix(w, dtype=np.float64)
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.shape != (w.shape[0],):
        raise MismatchError(f"token_ids has shape {ids.shape}, W has {w.shape[0]} rows")
    if len(expert_to_device) != w.shape[1]:
        raise MismatchError(
            f"expert_to_device covers {len(expert_to_device)} experts, W has {w.shape[1]}"
        )
    return w, ids


def local_rate(
    w_eval, token_ids: np.ndarray, expert_to_device: np.ndarray, table: np.ndarray, ep_size: int
) -> float:
    """LAR of ``table`` [V] on an evaluation W [J, N] whose rows are ``token_ids`` [J]."""
    w, ids = _check(w_eval, token_ids, expert_to_device)
    gain = _gains(w, np.asarray(expert_to_device, dtype=np.int64), ep_size)
    total = w.data.sum()
    return float(gain[np.arange(ids.size), table[ids]].sum() / total) if total > 0 else 0.0


def balanced_local_rate(
    w_eval,
    freq_eval: np.ndarray,
    token_ids: np.ndarray,
    expert_to_device: np.ndarray,
    table: np.ndarray,
    confidence: np.ndarray,
    ep_size: int,
    beta: float = 1.1,
) -> dict[str, float]:
    """LAR under a per-device token cap ``beta x S / E`` on the evaluation load.

    Args:
        w_eval: [J, N] evaluation activations; freq_eval: [J] evaluation occurrences.
        token_ids: [J] vocabulary id of each row; table, confidence: [V] token table.

    Returns:
        {"lar": unbalanced LAR, "lar_balanced": LAR after the cap (see module doc),
        "imbalance": max/mean device load before the cap, "imbalance_balanced": after,
        "moved_share": share of occurrences moved by the cap}.
    """
    w, ids = _check(w_eval, token_ids, expert_to_device)
    freq = np.asarray(freq_eval, dtype=np.float64)
    e = ep_size
    gain = _gains(w, np.asarray(expert_to_device, dtype=np.int64), e)
    total = w.data.sum()
    dev = table[ids]
    conf = confidence[ids]
    loads = np.bincount(dev, weights=freq, minlength=e)
    mean = loads.sum() / e
    cap = beta * mean
    # share of each token's occurrences kept on its device: most confident first, the token
    # that crosses the cap keeps the part that fits
    keep = np.ones(ids.size)
    order = np.lexsort((-freq, -conf, dev))
    csum = np.cumsum(freq[order])
    before = np.concatenate(([0.0], csum))[np.searchsorted(dev[order], np.arange(e))]
    start = csum - freq[order] - before[dev[order]]  # load already kept before this token
    room_left = cap - start
    kept = np.clip(room_left / np.maximum(freq[order], 1e-300), 0.0, 1.0)
    keep[order] = np.where(freq[order] > 0, kept, 1.0)
    moved = freq * (1.0 - keep)
    new_loads = loads - np.bincount(dev, weights=moved, minlength=e)
    room = np.maximum(cap - new_loads, 0.0)
    share = room / room.sum() if room.sum() > 0 else np.full(e, 1.0 / e)
    local = gain[np.arange(ids.size), dev] * keep
    # moved occurrences: spread over devices by share; their local activations per occurrence
    per_occurrence = np.divide(
        gain, freq[:, None], out=np.zeros_like(gain), where=freq[:, None] > 0
    )
    local_moved = moved * (per_occurrence @ share)
    final_loads = new_loads + moved.sum() * share
    return {
        "lar": float(gain[np.arange(ids.size), dev].sum() / total) if total > 0 else 0.0,
        "lar_balanced": float((local.sum() + local_moved.sum()) / total) if total > 0 else 0.0,
        "imbalance": float(loads.max() / mean) if mean > 0 else 1.0,
        "imbalance_balanced": float(final_loads.max() / mean) if mean > 0 else 1.0,
        "moved_share": float(moved.sum() / freq.sum()) if freq.sum() > 0 else 0.0,
    }


def oracle_bound(w, experts_per_device: int) -> float:
    """Upper bound on any placement's LAR: sum over tokens of their top-N/E expert counts / total."""
    w = sparse.csr_matrix(w, dtype=np.float64)
    total = w.data.sum()
    if total <= 0:
        return 0.0
    best = 0.0
    for j in range(0, w.shape[0], 8192):  # dense blocks keep memory bounded
        block = w[j : j + 8192].toarray()
        if experts_per_device < block.shape[1]:
            block = -np.partition(-block, experts_per_device - 1, axis=1)[:, :experts_per_device]
        best += block.sum()
    return float(best / total)


def vanilla_local_rate(ep_size: int) -> float:
    """Expected LAR of the default deployment (positional token chunks): exactly 1/E."""
    return 1.0 / ep_size
