"""Profile a Hugging Face MoE checkpoint: record each token's routed experts into a v1 trace.

Importing this package pulls in torch; the CLI imports it only when ``moeplan profile`` runs.
"""

from planner.profile.prompts import Prompt, read_prompts
from planner.profile.routers import ADAPTERS, RouterAdapter, supported_architectures
from planner.profile.runner import (
    ProfileConfig,
    ProfileResult,
    ProfileSession,
    profile_model,
    render_profile_summary,
)

__all__ = [
    "ADAPTERS",
    "ProfileConfig",
    "ProfileResult",
    "ProfileSession",
    "Prompt",
    "RouterAdapter",
    "profile_model",
    "read_prompts",
    "render_profile_summary",
    "supported_architectures",
]
