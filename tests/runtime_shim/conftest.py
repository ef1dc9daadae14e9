"""Helpers shared by the runtime-shim tests: PlanTables built directly from arrays."""

from __future__ import annotations

import numpy as np
import torch

from planner.runtime_shim.tables import PlanTables


def make_tables(
    expert_permutation: np.ndarray,
    ep_size: int,
    vocab_size: int = 72,
    token_to_device: np.ndarray | None = None,
    token_confidence: np.ndarray | None = None,
    ngram_order: int = 1,
    manifest: dict | None = None,
) -> PlanTables:
    """A consistent PlanTables: expert_to_device follows the permutation (slot s on device
    s // (N/E)); token tables default to device 0 with confidence 0; n-gram tables empty."""
    perm = np.asarray(expert_permutation, dtype=np.int64)
    big_l, n = perm.shape
    per_device = n // ep_size
    expert_to_device = np.empty_like(perm)
    for layer in range(big_l):
        expert_to_device[layer, perm[layer]] = np.arange(n) // per_device
    if token_to_device is None:
        token_to_device = np.zeros((big_l, vocab_size), np.int64)
    if token_confidence is None:
        token_confidence = np.zeros(np.shape(token_to_device))
    cols = ep_size**ngram_order
    return PlanTables(
        expert_to_device=torch.from_numpy(expert_to_device.astype(np.int16)),
        expert_permutation=torch.from_numpy(perm.astype(np.int16)),
        token_to_device=torch.from_numpy(np.asarray(token_to_device).astype(np.int16)),
        token_confidence=torch.from_numpy(np.asarray(token_confidence).astype(np.float16)),
        ngram_to_device=torch.zeros((big_l, cols), dtype=torch.int16),
        ngram_confidence=torch.zeros((big_l, cols), dtype=torch.float16),
        ep_size=ep_size,
        ngram_order=ngram_order,
        num_layers=big_l,
        num_experts=n,
        vocab_size=int(np.shape(token_to_device)[1]),
        manifest=manifest or {},
    )
