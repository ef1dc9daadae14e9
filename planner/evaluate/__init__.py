"""Score a plan or bundle on a held-out trace with the metrics of DESIGN.md."""

from planner.evaluate.metrics import EvalConfig, evaluate_bundle

__all__ = ["EvalConfig", "evaluate_bundle"]
