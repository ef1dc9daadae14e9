"""Runtime shim: apply a bundle online (Speculative MoE, paper 000 §3, §B.2).

- :mod:`~planner.runtime_shim.tables`       bundle tables on a device, Algorithm 2's choice
- :mod:`~planner.runtime_shim.rebatch`      re-batch tokens by device and resume the order
- :mod:`~planner.runtime_shim.collectives`  shuffled reduce-scatter / all-gather (SRS / SAG)
- :mod:`~planner.runtime_shim.permute`      apply an expert placement to a loaded model
- :mod:`~planner.runtime_shim.schedule`     Attention-DP request scheduling
"""

from planner.runtime_shim.collectives import shuffled_all_gather, shuffled_reduce_scatter
from planner.runtime_shim.permute import apply_expert_placement
from planner.runtime_shim.rebatch import RebatchInfo, rebatch, resume
from planner.runtime_shim.schedule import schedule_requests
from planner.runtime_shim.tables import PlanTables, load_bundle

__all__ = [
    "PlanTables",
    "RebatchInfo",
    "apply_expert_placement",
    "load_bundle",
    "rebatch",
    "resume",
    "schedule_requests",
    "shuffled_all_gather",
    "shuffled_reduce_scatter",
]
