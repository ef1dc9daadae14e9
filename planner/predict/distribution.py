"""Distribution-only prediction of expert load (MoE-GPS, paper 004 §3.2.1 and App. A).

Each MoE layer's expert choices are modelled as i.i.d. draws from a multinomial
``p[l] = (p_1 .. p_N)``; its maximum-likelihood estimate is ``p_hat[l, i] = n_i / sum n``
(routed activations of expert i over all activations of the layer). Fed batch by batch,
the MLE is the running mean of the batch distributions weighted by their sizes (the
"moving average" of the paper); an exponential moving average (``momentum``) is offered
for a load that drifts (``FitConfig.distribution_momentum``; ``moeplan fit`` has no flag
for it and fits the MLE). :func:`planner.predict.fit.fit_predictor` feeds it the fitting
rows in trace order cut into runtime batches of ``batch_tokens`` rows
(:class:`RuntimeBatchLoads`), so the estimate depends on the trace and the batch size
only, not on how the trace is read in chunks.

MoE-GPS's error rate of an estimate against the empirical distribution ``p`` of held-out
data is ``|p_hat - p| / (1 / N)`` averaged over experts, then over layers; per layer that
is exactly the L1 distance ``sum_i |p_hat_i - p_i|``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from planner._checks import is_real
from planner.errors import InputError, SchemaError


class DistributionPredictor:
    """Per-layer multinomial estimate of expert load.

    Args:
        momentum: None for the exact MLE over everything seen (size-weighted running
            mean); a float in (0, 1] for an exponential moving average, each batch moving
            the estimate by that fraction towards the batch's distribution.

    Fitted attributes:
        probabilities_: [L, N] float64, rows sum to 1.
        load_: [L, N] int64 routed activations seen (the MLE's sufficient statistic).
        batches_: number of batches folded in.
    """

    def __init__(self, momentum: float | None = None):
        self.momentum = momentum

    def partial_fit(self, load: np.ndarray) -> DistributionPredictor:
        """Fold in one batch's routed activations ``load`` [L, N] (non-negative counts)."""
        load = np.asarray(load)
        if load.ndim != 2 or load.shape[1] == 0:
            raise InputError(f"load must be [layers, experts], got shape {load.shape}")
        if load.dtype.kind not in "iuf" or not np.isfinite(load).all():
            raise InputError(f"load must hold finite counts, not {load.dtype} values")
        if load.size and load.min() < 0:
            raise InputError("load holds negative counts")
        # counts are whole and fit int64 (0.6 was truncated to 0; a uint64 past it wrapped)
        if load.size and (load.max() >= 2**63 or (load.dtype.kind == "f" and (load % 1).any())):
            raise InputError("load must hold whole counts below 2**63")
        momentum = self.momentum
        if momentum is not None and (not is_real(momentum) or not 0.0 < float(momentum) <= 1.0):
            raise InputError(f"momentum={self.momentum!r} must lie in (0, 1] or be None")
        if momentum is not None:
            self.momentum = float(momentum)  # a numpy float does not go to JSON
        if not hasattr(self, "load_"):
            self.load_ = np.zeros(load.shape, np.int64)
            self.probabilities_ = np.full(load.shape, 1.0 / load.shape[1])
            self.batches_ = 0
        if load.shape != self.load_.shape:
            raise InputError(
                f"load shape {load.shape} differs from earlier batches {self.load_.shape}"
            )
        self.load_ += load.astype(np.int64)
        if self.momentum is None or self.batches_ == 0:
            self.probabilities_ = empirical_distribution(self.load_)
        else:
            batch_p = empirical_distribution(load)
            has = load.sum(axis=1) > 0
            m = float(self.momentum)
            self.probabilities_[has] = (1 - m) * self.probabilities_[has] + m * batch_p[has]
        self.batches_ += 1
        return self

    def fit(self, loads: Iterable[np.ndarray]) -> DistributionPredictor:
        """Fit from scratch on an iterable of per-batch loads [L, N]."""
        for attr in ("load_", "probabilities_", "batches_"):
            self.__dict__.pop(attr, None)
        for load in loads:
            self.partial_fit(load)
        if not hasattr(self, "load_"):
            raise InputError("DistributionPredictor.fit got no batches")
        return self

    def predict(self) -> np.ndarray:
        """[L, N] float64 predicted share of routed activations per expert."""
        if not hasattr(self, "probabilities_"):
            raise InputError("DistributionPredictor is not fitted; call fit() first")
        return self.probabilities_

    def to_tensors(self) -> dict[str, np.ndarray]:
        return {
            "probabilities": self.predict().astype(np.float64),
            "load": self.load_.astype(np.int64),
            "batches": np.array([self.batches_], np.int64),
        }

    @classmethod
    def from_tensors(
        cls, tensors: dict[str, np.ndarray], momentum: float | None, shape: tuple[int, int]
    ) -> DistributionPredictor:
        try:
            p, load, batches = tensors["probabilities"], tensors["load"], tensors["batches"]
        except KeyError as e:
            raise SchemaError(f"distribution tensors lack {e.args[0]!r}") from None
        for name, tensor in (("probabilities", p), ("load", load)):
            if tensor.shape != shape:
                raise SchemaError(
                    f"distribution tensor {name!r} has shape {tensor.shape}, expected {shape}"
                )
        if not np.isfinite(p).all() or (p < 0).any():
            raise SchemaError("distribution probabilities must be finite and non-negative")
        if p.size and not np.allclose(p.sum(axis=1), 1.0, rtol=0.0, atol=1e-6):
            raise SchemaError("distribution probabilities must sum to 1 in every layer")
        if load.dtype.kind not in "iu" or (load < 0).any():
            raise SchemaError("distribution load must hold non-negative integer counts")
        if batches.shape != (1,) or batches.dtype.kind not in "iu" or batches[0] < 0:
            raise SchemaError("distribution batches must be one non-negative integer")
        if momentum is not None and not (
            isinstance(momentum, int | float)
            and not isinstance(momentum, bool)
            and 0.0 < momentum <= 1.0
        ):
            raise SchemaError(f"distribution momentum {momentum!r} must lie in (0, 1] or be None")
        self = cls(momentum=momentum)
        self.probabilities_ = p.astype(np.float64)
        self.load_ = load.astype(np.int64)
        self.batches_ = int(batches[0])
        return self


def empirical_distribution(load: np.ndarray) -> np.ndarray:
    """[L, N] float64 load normalised per layer (uniform where a layer has no activations)."""
    load = np.asarray(load, np.float64)
    total = load.sum(axis=1, keepdims=True)
    uniform = np.full_like(load, 1.0 / load.shape[1])
    return np.divide(load, total, out=uniform, where=total > 0)


def error_rate(p_hat: np.ndarray, p: np.ndarray) -> np.ndarray:
    """[L] MoE-GPS error rate per layer: mean over experts of ``|p_hat - p| / (1/N)``."""
    p_hat, p = np.asarray(p_hat, np.float64), np.asarray(p, np.float64)
    if p_hat.shape != p.shape or p.ndim != 2:
        raise InputError(f"distributions of shapes {p_hat.shape} and {p.shape} cannot be compared")
    return np.abs(p_hat - p).mean(axis=1) * p.shape[1]


class RuntimeBatchLoads:
    """The expert loads [L, N] of consecutive runtime batches of ``size`` rows, cut from rows
    that arrive in chunks of any length (trace order is kept across chunks)."""

    def __init__(self, size: int, num_experts: int):
        self.size, self.num_experts = int(size), int(num_experts)
        self._pending: np.ndarray | None = None
        self._rows = 0

    def add(self, experts: np.ndarray) -> list[np.ndarray]:
        """Fold in the next rows ``experts`` [T, L, k]; the loads of the batches they complete."""
        done, start = [], 0
        while start < len(experts):
            take = min(self.size - self._rows, len(experts) - start)
            load = batch_load(experts[start : start + take], self.num_experts)
            self._pending = load if self._pending is None else self._pending + load
            self._rows, start = self._rows + take, start + take
            if self._rows == self.size:
                done.append(self._pending)
                self._pending, self._rows = None, 0
        return done

    def rest(self) -> list[np.ndarray]:
        """The last, shorter batch's load (none when the rows ended on a batch boundary)."""
        rest = [] if self._pending is None else [self._pending]
        self._pending, self._rows = None, 0
        return rest


def batch_load(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """[L, N] int64 routed activations of each expert in ``experts`` [T, L, k]."""
    return np.stack(
        [
            np.bincount(experts[:, layer].ravel(), minlength=num_experts)
            for layer in range(experts.shape[1])
        ]
    ).astype(np.int64)
