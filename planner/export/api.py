"""Export a plan: write its bundle and, beside it, the engine placement files asked for.

``moeplan export`` is a thin call to :func:`export_plan` (and ``--verify`` to
:func:`planner.export.bundle.verify_bundle`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from planner._checks import is_finite_number
from planner.errors import InputError, SchemaError
from planner.export.bundle import (
    MANIFEST_FILE,
    Bundle,
    load_bundle_arrays,
    save_bundle,
    verify_bundle,
)
from planner.export.engines import EnginePlacement, get_format
from planner.solve.pipeline import plan_meta
from planner.solve.plan import PLAN_FILE, Plan

# what a bundle's metrics take from each layer's solver report
_REPORTED = ("local_rate", "token_imbalance")


def bundle_from_plan(plan: Plan, metrics: dict[str, Any] | None = None) -> Bundle:
    """The bundle v1 tables of a plan (validated, int16 / float16).

    A plan without n-gram tables (its predictor came from a counts table) gets an order-1
    n-gram table with confidence 0 everywhere, so the runtime always uses the token table.
    """
    big_l, e = plan.expert_to_device.shape[0], plan.ep_size
    order = plan.ngram_order or 1
    ngram_dev, ngram_conf = plan.ngram_to_device, plan.ngram_confidence
    if ngram_dev is None:
        ngram_dev = np.zeros((big_l, e**order), np.int16)
        ngram_conf = np.zeros((big_l, e**order), np.float16)
    meta = plan_meta(plan)
    if plan.fingerprint != meta.fingerprint():
        raise SchemaError(
            f"plan fingerprint {plan.fingerprint} does not match its model fields "
            f"({meta.fingerprint()}, model {meta.model!r}); the plan was edited"
        )
    if metrics is None:
        if not all(is_finite_number(r.get(k)) for r in plan.reports for k in _REPORTED):
            raise SchemaError("plan: a layer report lacks numeric local_rate and token_imbalance")
        metrics = {
            "solver_local_rate": [round(r["local_rate"], 6) for r in plan.reports],
            "solver_token_imbalance": [round(r["token_imbalance"], 6) for r in plan.reports],
        }
    return Bundle.from_arrays(
        meta,
        ep_size=e,
        ngram_order=order,
        expert_to_device=plan.expert_to_device,
        token_to_device=plan.token_to_device,
        token_confidence=plan.token_confidence,
        ngram_to_device=ngram_dev,
        ngram_confidence=ngram_conf,
        method=plan.method,
        seed=int(plan.seed),
        metrics=metrics,
    )


def load_tables(path: str | os.PathLike) -> Bundle:
    """A plan directory (``plan.json``) or a bundle directory, as bundle tables."""
    p = Path(path)
    if (p / PLAN_FILE).is_file():
        return bundle_from_plan(Plan.load(p))
    if p.is_dir() and not (p / MANIFEST_FILE).exists():
        raise InputError(
            f"{p}: neither a plan (no {PLAN_FILE}, from `moeplan solve`) nor a bundle (no "
            f"{MANIFEST_FILE}, from `moeplan export`)"
        )
    return load_bundle_arrays(p)


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
