"""Device labels of a new plan matched to a deployed one, so that re-deploying moves few experts.

A plan's device numbers are arbitrary: any permutation of one layer's devices, applied to
its experts, its tokens and its n-gram tables alike, is the same plan (the same local
activations, the same loads). A plan solved again from fresh traces (a nightly job) comes
with labels of its own, and rolling it out as is would move most experts to another device
even where the new placement groups them as the old one did. :func:`align_plan` picks, per
layer, the relabelling that leaves the most experts on the device the reference (the plan
or bundle now deployed) has them on: a linear assignment on the [E, E] overlap of the two
placements, the same tool CEO uses to align its elite samples (:func:`planner.solve.ceo.relabel_map`).

What is relabelled, with ``sigma[l]`` the map of layer l (new label -> deployed label):

- ``expert_to_device[l]`` and ``token_to_device[l]``: through ``sigma[l]``;
- ``ngram_to_device[l]`` (row = base-E number of the devices at layers l-n .. l-1, most
  recent last): the predicted device through ``sigma[l]``, and each row moved to the row of
  its context's relabelled devices (through ``sigma[l-n]`` .. ``sigma[l-1]``), so that the
  runtime, which reads the context off the (relabelled) placement of the earlier layers,
  finds the same prediction. Layers l < n have no context: their rows all hold the layer's
  most common device at confidence 0, and only that device is relabelled;
- confidences are unchanged.

Nothing the metrics of ``../shared/DESIGN.md`` measure changes, except where the balanced
LAR's overflow breaks a tie between devices with room by the lower device id
(:func:`planner.runtime_shim.tables.assign_with_capacity`). Only device-level moves are
counted: within a device the bundle orders slots by logical expert id
(:func:`planner.export.bundle.permutation_from_placement`), a local copy at most.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
from scipy.optimize import linear_sum_assignment

from planner.errors import MismatchError

if TYPE_CHECKING:  # planner.solve.plan imports planner.solve.settle, which imports this
    from planner.solve.plan import Plan


def device_maps(expert_to_device: np.ndarray, reference: np.ndarray, ep_size: int) -> np.ndarray:
    """Per layer, the relabelling of ``expert_to_device`` that agrees most with ``reference``.

    Args:
        expert_to_device: [L, N] device of each expert in the new plan.
        reference: [L, N] device of each expert in the deployed plan (same L, N, E).
        ep_size: E.

    Returns:
        sigma: [L, E] int64; ``sigma[l, d]`` is the deployed label given to the new plan's
        device d of layer l. Each row is a permutation of 0..E-1.
    """
    x = np.asarray(expert_to_device, np.int64)
    ref = np.asarray(reference, np.int64)
    sigma = np.empty((x.shape[0], ep_size), np.int64)
    for layer in range(x.shape[0]):
        rows, cols = linear_sum_assignment(overlap(x[layer], ref[layer], ep_size), maximize=True)
        sigma[layer, rows] = cols
    return sigma


def overlap(expert_to_device: np.ndarray, reference: np.ndarray, ep_size: int) -> np.ndarray:
    """[E, E] int64: how many experts of one layer are on device a in ``expert_to_device``
    [N] and on device b in ``reference`` [N]."""
    counts = np.zeros((ep_size, ep_size), np.int64)
    np.add.at(counts, (np.asarray(expert_to_device, np.int64), np.asarray(reference, np.int64)), 1)
    return counts


def relabel(table: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """An [L, M] table of devices (experts, tokens or n-gram predictions) with layer l's
    devices renamed through ``sigma[l]`` ([L, E] from :func:`device_maps`); int64."""
    return sigma[np.arange(sigma.shape[0])[:, None], np.asarray(table, np.int64)]


def experts_moved(expert_to_device: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """[L] number of experts whose device differs between two [L, N] placements."""
    return (np.asarray(expert_to_device) != np.asarray(reference)).sum(axis=1)


def relabel_ngram(table: np.ndarray, sigma: np.ndarray, order: int) -> np.ndarray:
    """An [L, E**n] n-gram table (devices or confidences) with its rows moved to the
    relabelled contexts (module doc); the values are left as they are."""
    big_l, e = sigma.shape
    out = np.array(table, copy=True)
    rows = np.arange(e**order, dtype=np.int64)
    # digits[:, j]: the device of context layer l - order + j (most recent last)
    digits = np.stack([(rows // e ** (order - 1 - j)) % e for j in range(order)], axis=1)
    for layer in range(order, big_l):
        moved = np.zeros_like(rows)
        for j in range(order):
            moved = moved * e + sigma[layer - order + j][digits[:, j]]
        out[layer, moved] = table[layer, rows]
    return out


def check_reference(reference: np.ndarray, ep_size: int) -> None:
    """MismatchError unless ``reference`` [L, N] places N/E experts on each of E devices."""
    ref, e = np.asarray(reference), ep_size
    in_range = not ref.size or (ref.min() >= 0 and ref.max() < e)
    counts = [np.bincount(row, minlength=e) for row in ref.astype(np.int64)] if in_range else []
    if not in_range or any((c != c[0]).any() for c in counts):
        raise MismatchError(
            f"the reference placement is not one of EP {e} (devices outside [0, {e}) or "
            "unequal experts per device): align to a plan of the same EP size"
        )


def align_plan(plan: Plan, reference: np.ndarray, reference_fingerprint: str) -> Plan:
    """``plan`` relabelled, layer by layer, to keep the most experts where ``reference`` has them.

    Args:
        plan: the new plan.
        reference: [L, N] ``expert_to_device`` of the deployed plan or bundle, for the same
            model and EP size.
        reference_fingerprint: the model fingerprint the reference carries.

    Returns the relabelled plan. Its config records ``aligned`` (experts that change device
    with and without the relabelling, over all layers) and each layer's report
    ``experts_moved`` / ``experts_moved_unaligned``.

    Raises:
        MismatchError: the reference was made for another model, EP size or layer count.
    """
    plan.check_model(reference_fingerprint)
    ref = np.asarray(reference)
    if ref.shape != plan.expert_to_device.shape:
        raise MismatchError(
            f"the reference placement has shape {ref.shape}, the plan {plan.expert_to_device.shape}"
        )
    e = plan.ep_size
    check_reference(ref, e)
    sigma = device_maps(plan.expert_to_device, ref, e)
    x, tokens = relabel(plan.expert_to_device, sigma), relabel(plan.token_to_device, sigma)
    ngram_dev, ngram_conf = plan.ngram_to_device, plan.ngram_confidence
    if ngram_dev is not None and ngram_conf is not None:
        n = plan.ngram_order
        ngram_dev = relabel_ngram(relabel(ngram_dev, sigma), sigma, n)
        ngram_conf = relabel_ngram(ngram_conf, sigma, n)
    before = experts_moved(plan.expert_to_device, ref)
    after = experts_moved(x, ref)
    reports = [
        {**r, "experts_moved": int(a), "experts_moved_unaligned": int(b)}
        for r, a, b in zip(plan.reports, after, before, strict=False)
    ]
    aligned = {
        "experts_moved": int(after.sum()),
        "experts_moved_unaligned": int(before.sum()),
        "experts": int(ref.size),
    }
    return dataclasses.replace(
        plan,
        config={**plan.config, "aligned": aligned},
        expert_to_device=x,
        token_to_device=tokens,
        ngram_to_device=ngram_dev,
        ngram_confidence=ngram_conf,
        reports=reports,
    )
