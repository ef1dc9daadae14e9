"""Bundles (int16 tables + manifest) and serving-engine placement files.

- :mod:`planner.export.bundle`   bundle format v1: :class:`Bundle`, save, load, verify
- :mod:`planner.export.engines`  SGLang / vllm-ascend / TensorRT-LLM placement files
- :mod:`planner.export.api`      :func:`export_plan`, what ``moeplan export`` calls
"""

from planner.export.api import export_plan
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

__all__ = [
    "FORMAT",
    "FORMATS",
    "FORMAT_VERSION",
    "Bundle",
    "EngineFormat",
    "EnginePlacement",
    "check_compatible",
    "export_plan",
    "load_bundle_arrays",
    "permutation_from_placement",
    "render_engine_file",
    "save_bundle",
    "verify_bundle",
    "write_engine_file",
]
