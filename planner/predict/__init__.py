"""Predictors of routing: token->expert affinity, n-gram devices, load distribution, neural.

Modules, in the order ``moeplan fit`` uses them:

- :mod:`~planner.predict.counts`       token-expert counts from traces or counts tables
- :mod:`~planner.predict.split`        request-level split, binomial thinning of counts
- :mod:`~planner.predict.affinity`     the token->expert confidence table (paper 000 §3.3)
- :mod:`~planner.predict.reliability`  how far a token's fitted routing carries over (shrinkage m)
- :mod:`~planner.predict.ngram`        n-gram device tables from top-1 transitions (000 App. B.1)
- :mod:`~planner.predict.distribution` distribution-only load predictor (paper 004 §3.2.1)
- :mod:`~planner.predict.neural`       small MLP token->expert predictor (paper 004 App. B)
- :mod:`~planner.predict.metrics`      the held-out report
- :mod:`~planner.predict.predictor`    the saved, versioned predictor directory
- :mod:`~planner.predict.fit`          the whole fit as one library call
"""

from planner.predict.affinity import TokenExpertAffinity, load_embeddings
from planner.predict.counts import (
    CountsAccumulator,
    CountsSelection,
    TokenExpertCounts,
    read_counts_table,
    write_counts_table,
)
from planner.predict.distribution import DistributionPredictor, error_rate
from planner.predict.fit import FitConfig, FitResult, fit_predictor
from planner.predict.neural import NeuralConfig, NeuralPredictor
from planner.predict.ngram import (
    NgramDeviceTable,
    TopOneTransitions,
    evaluate_ngram_device_table,
    fit_ngram_device_table,
)
from planner.predict.predictor import Predictor, load_predictor
from planner.predict.split import RequestSplit, thin_counts

__all__ = [
    "CountsAccumulator",
    "CountsSelection",
    "DistributionPredictor",
    "FitConfig",
    "FitResult",
    "NeuralConfig",
    "NeuralPredictor",
    "NgramDeviceTable",
    "Predictor",
    "RequestSplit",
    "TokenExpertAffinity",
    "TokenExpertCounts",
    "TopOneTransitions",
    "error_rate",
    "evaluate_ngram_device_table",
    "fit_ngram_device_table",
    "fit_predictor",
    "load_embeddings",
    "load_predictor",
    "read_counts_table",
    "thin_counts",
    "write_counts_table",
]
