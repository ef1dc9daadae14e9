"""Bundles (int16 tables + manifest) and serving-engine placement files.

- :mod:`planner.export.bundle`   bundle format v1: :class:`Bundle`, save, load, verify
- :mod:`planner.export.engines`  SGLang / vllm-ascend / TensorRT-LLM placement files
- :mod:`planner.export.api`      :func:`export_plan`, what ``moeplan export`` calls
"""

from planner.export.bundle import (
    FORMAT,
    FORMAT_VERSION,
    Bundle,
    check_compatible,
    load_bundle_arrays,
    permutation_from_placement,
    save_bundle,
    verify_bundle,
)
from planner.export.engines import (
    FORMATS,
    EngineFormat,
    EnginePlacement,
    render_engine_file,
    write_engine_file,
)

# The api module converts solver plans, so it imports the solve stage; load it on first use
# so that ``planner.export.bundle`` stays importable from lower stages without a cycle.
_API = ("bundle_from_plan", "export_plan", "load_tables")


def __getattr__(name: str):
    if name in _API:
        from planner.export import api

        return getattr(api, name)
    raise AttributeError(f"module 'planner.export' has no attribute {name!r}")


__all__ = [
    "FORMAT",
    "FORMATS",
    "FORMAT_VERSION",
    "Bundle",
    "EngineFormat",
    "EnginePlacement",
    "check_compatible",
    "bundle_from_plan",
    "export_plan",
    "load_tables",
    "load_bundle_arrays",
    "permutation_from_placement",
    "render_engine_file",
    "save_bundle",
    "verify_bundle",
    "write_engine_file",
]
