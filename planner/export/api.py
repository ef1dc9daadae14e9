"""Export a plan: write its bundle and, beside it, the engine placement files asked for.

``moeplan export`` is a thin call to :func:`export_plan` (and ``--verify`` to
:func:`planner.export.bundle.verify_bundle`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from planner.export.bundle import Bundle, save_bundle, verify_bundle
from planner.export.engines import EnginePlacement, get_format


def export_plan(
    bundle: Bundle,
    out: str | os.PathLike,
    *,
    engines: Sequence[str] = (),
    num_model_layers: int | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Write ``bundle`` to the directory ``out`` with one file per engine format.

    Everything lands in one atomic directory write; engine files are listed with their
    sha256 in the manifest, so :func:`verify_bundle` checks them too.

    Args:
        bundle: the plan's tables (build one with :meth:`Bundle.from_arrays`).
        out: bundle directory to create or replace.
        engines: names from :data:`planner.export.engines.FORMATS` ("sglang",
            "vllm-ascend", "trtllm").
        num_model_layers: decoder layers of the model, dense ones included, for formats
            indexed by model layer (default: last MoE layer index + 1).
        verify: re-read the written bundle and include :func:`verify_bundle`'s report.

    Returns:
        ``{"path": str, "files": {name: path}, "engines": {name: {"file", "usage"}},
        "verify": report | None}``.
    """
    formats = [get_format(name) for name in dict.fromkeys(engines)]
    extra: dict[str, bytes] = {}
    if formats:
        placement = EnginePlacement.from_bundle(bundle, num_model_layers)
        extra = {f.filename: f.render(placement).encode() for f in formats}
    dest = save_bundle(bundle, out, extra_files=extra)
    names = ["tables.safetensors", "manifest.json", *extra]
    return {
        "path": str(dest),
        "files": {name: str(Path(dest) / name) for name in names},
        "engines": {
            f.name: {"file": str(Path(dest) / f.filename), "usage": f.usage} for f in formats
        },
        "verify": verify_bundle(dest) if verify else None,
    }
