"""The saved predictor: everything ``moeplan fit`` learned, as one versioned directory.

Layout of a predictor directory (written atomically, all or nothing)::

    predictor.json          manifest: format "moeplan-predictor", format_version 4, model
                            metadata and fingerprint, settings, fit info, the per-layer
                            token shrinkage (traces), sha256 of files
    affinity.safetensors    token->expert counts per layer (CSR, end to end), nearest_known
    distribution.safetensors  distribution-only estimate [L, N] and its load counts
    transitions.safetensors (previous top-1 experts, routed expert, rank) tuples per layer
                            (absent for counts tables)
    neural.safetensors      the neural predictor's weights (only with --neural)
    batches.safetensors     token counts of the fitting trace's runtime batches (traces only;
                            :mod:`planner.predict.batches`)
    report.json             the held-out report (only with --holdout / --eval-domain)

Loading checks the format, version and every file's checksum, so a truncated or edited
file is refused with :class:`SchemaError` rather than silently used. Artifacts derived from
a predictor compare :attr:`Predictor.fingerprint` with their trace's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from planner import __version__
from planner._checks import is_finite_number
from planner._io import atomic_path, check_output, read_json_object, sha256_file
from planner._safetensors import Chunked, save_tensors
from planner.errors import InputError, MismatchError, SchemaError
from planner.predict.affinity import TokenExpertAffinity
from planner.predict.batches import BatchMix
from planner.predict.distribution import DistributionPredictor
from planner.predict.neural import NeuralPredictor
from planner.predict.ngram import TopOneTransitions
from planner.trace.schema import TraceMeta

FORMAT = "moeplan-predictor"
# 2: transitions hold every routed expert of layer l with its rank (was top-1 only).
# 3: optional batches.safetensors (the fitting batches' token mix); version 2 still loads,
#    without it.
# 4: optional "token_shrinkage" in the manifest (per-layer m of
#    :mod:`planner.predict.reliability`); versions 2 and 3 still load, uncalibrated.
FORMAT_VERSION = 4
READABLE_VERSIONS = (2, 3, 4)
MANIFEST = "predictor.json"
REPORT = "report.json"


@dataclass(frozen=True)
class Predictor:
    """A fitted predictor bundle.

    Attributes:
        meta: the model and shapes it was fitted for (from the trace or counts table).
        affinity: fitted :class:`TokenExpertAffinity` (token->expert table).
        distribution: fitted :class:`DistributionPredictor` (expert-load distribution).
        transitions: :class:`TopOneTransitions` for n-gram device tables, or None when the
            input had no per-token routing paths (counts tables).
        neural: fitted :class:`NeuralPredictor`, or None.
        fit_info: how it was fitted (input path, split, seed, sizes, timings).
        report: the held-out report, or None when nothing was held out.
        batches: :class:`BatchMix` of the fitting trace, or None (counts tables, version 2).
        token_shrinkage: [L] float64 m of each layer (:mod:`planner.predict.reliability`),
            or None: token confidences are not calibrated (counts tables, versions 2-3).
    """

    meta: TraceMeta
    affinity: TokenExpertAffinity
    distribution: DistributionPredictor
    transitions: TopOneTransitions | None = None
    neural: NeuralPredictor | None = None
    fit_info: dict = field(default_factory=dict)
    report: dict | None = None
    batches: BatchMix | None = None
    token_shrinkage: np.ndarray | None = None

    def __post_init__(self) -> None:
        m = self.meta
        a = self.affinity
        if not hasattr(a, "meta_"):
            raise InputError("Predictor needs a fitted TokenExpertAffinity")
        if a.meta_.fingerprint() != m.fingerprint():
            raise MismatchError("the affinity table was fitted on another model or shape")
        if self.distribution.predict().shape != (m.num_layers, m.num_experts):
            raise MismatchError(
                f"distribution has shape {self.distribution.predict().shape}, "
                f"expected ({m.num_layers}, {m.num_experts})"
            )
        t = self.transitions
        if t is not None and (t.num_layers != m.num_layers or t.num_experts != m.num_experts):
            raise MismatchError("transitions were counted on another model or shape")
        b = self.batches
        if b is not None and b.counts.shape[1] != m.vocab_size:
            raise MismatchError("batch mix was counted over another vocabulary")
        nn = self.neural
        if nn is not None:
            nn._check_fitted()
            shapes = (nn.num_layers_, nn.num_experts_, nn.top_k_, nn.features_.shape[0] - 1)
            if shapes != (m.num_layers, m.num_experts, m.top_k, m.vocab_size):
                raise MismatchError(
                    f"the neural predictor has (L, N, k, V) = {shapes}, expected "
                    f"({m.num_layers}, {m.num_experts}, {m.top_k}, {m.vocab_size})"
                )
        if self.token_shrinkage is not None:
            try:
                shrink = np.asarray(self.token_shrinkage)
                if shrink.dtype.kind not in "iuf":  # not bools, strings or objects
                    raise TypeError
                shrink = shrink.astype(np.float64)
            except (TypeError, ValueError):
                shrink = np.full(1, np.nan)
            if shrink.shape != (m.num_layers,) or not (np.isfinite(shrink) & (shrink >= 0)).all():
                raise SchemaError(
                    f"token_shrinkage must be {m.num_layers} finite numbers >= 0 (one per layer)"
                )
            object.__setattr__(self, "token_shrinkage", shrink)

    @property
    def fingerprint(self) -> str:
        return self.meta.fingerprint()

    def check_compatible(self, meta: TraceMeta, what: str = "trace") -> None:
        """Raise :class:`MismatchError` unless ``meta`` describes the same model and shapes."""
        if meta.fingerprint() != self.fingerprint:
            raise MismatchError(
                f"predictor was fitted on {self.meta.model!r} (L={self.meta.num_layers}, "
                f"N={self.meta.num_experts}, k={self.meta.top_k}, V={self.meta.vocab_size}, "
                f"fingerprint {self.fingerprint}) but the {what} is {meta.model!r} "
                f"(L={meta.num_layers}, N={meta.num_experts}, k={meta.top_k}, "
                f"V={meta.vocab_size}, fingerprint {meta.fingerprint()}); refit on matching data"
            )
        if (differ := self.meta.layer_mismatch(meta, ("the predictor", f"the {what}"))) is not None:
            raise MismatchError(f"{differ}; refit on matching data")

    # -- persistence -------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Write the predictor directory at ``path`` atomically (replacing an older predictor)."""
        path = check_destination(path)
        # Each file's arrays are built when it is written and dropped after, and the counts
        # (the largest) are written layer by layer, never joined (planner._safetensors).
        tensors: dict[str, Callable[[], Mapping[str, np.ndarray | Chunked]]] = {
            "affinity.safetensors": self.affinity.file_tensors,
            "distribution.safetensors": self.distribution.to_tensors,
        }
        if self.transitions is not None:
            tensors["transitions.safetensors"] = self.transitions.to_tensors
        if self.neural is not None:
            tensors["neural.safetensors"] = self.neural.to_tensors
        if self.batches is not None:
            tensors["batches.safetensors"] = self.batches.to_tensors
        with atomic_path(path) as tmp:
            tmp.mkdir()
            files = {}
            for name, build in tensors.items():
                save_tensors(tmp / name, build())
                files[name] = {"sha256": sha256_file(tmp / name)}
            if self.report is not None:
                (tmp / REPORT).write_text(json.dumps(self.report, indent=2) + "\n")
                files[REPORT] = {"sha256": sha256_file(tmp / REPORT)}
            manifest = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "model": json.loads(self.meta.to_json()),
                "fingerprint": self.fingerprint,
                "affinity": {
                    "confident_threshold": self.affinity.confident_threshold,
                    "fallback": self.affinity.fallback_,
                },
                "distribution": {"momentum": self.distribution.momentum},
                "transitions": self.transitions is not None,
                "batches": self.batches is not None,
                "token_shrinkage": (
                    None if self.token_shrinkage is None else self.token_shrinkage.tolist()
                ),
                "neural": self.neural.settings() if self.neural is not None else None,
                "fit": self.fit_info,
                "files": files,
                "created_by": f"moeplan {__version__}",
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Predictor:
        """Read a predictor directory, refusing wrong formats, versions and corrupt files."""
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        path = Path(path)
        manifest_path = path / MANIFEST
        if not path.is_dir() or not manifest_path.is_file():
            raise InputError(f"{path}: not a predictor directory (no {MANIFEST}); run moeplan fit")
        manifest = read_json_object(manifest_path, str(manifest_path), SchemaError)
        if manifest.get("format") != FORMAT:
            raise SchemaError(f"{manifest_path}: format is not {FORMAT!r}")
        if manifest.get("format_version") not in READABLE_VERSIONS:
            raise SchemaError(
                f"{manifest_path}: format_version {manifest.get('format_version')!r} is not "
                f"supported (expected {FORMAT_VERSION}); refit with this moeplan"
            )
        try:
            meta = TraceMeta.from_json(json.dumps(manifest["model"]), where=str(manifest_path))
            files = manifest["files"]
            aff_settings = manifest["affinity"]
        except (KeyError, TypeError) as e:
            raise SchemaError(f"{manifest_path}: manifest lacks {e}") from None
        if manifest.get("fingerprint") != meta.fingerprint():
            raise SchemaError(f"{manifest_path}: fingerprint does not match the model metadata")
        if not isinstance(files, dict) or not all(
            isinstance(name, str) and _plain_name(name) and isinstance(info, dict)
            for name, info in files.items()
        ):
            raise SchemaError(
                f"{manifest_path}: 'files' must map the names of files in the predictor "
                'directory to {"sha256": ...}'
            )
        for key, optional in (("affinity", False), ("distribution", True)):
            value = manifest.get(key)
            if not (isinstance(value, dict) or (optional and value is None)):
                raise SchemaError(f"{manifest_path}: '{key}' must be a JSON object")
        threshold = aff_settings.get("confident_threshold", 0.5)
        if not is_finite_number(threshold):
            raise SchemaError(
                f"{manifest_path}: affinity confident_threshold={threshold!r} is not a number"
            )
        for name, info in files.items():
            f = path / name
            if not f.is_file():
                raise SchemaError(f"{path}: file {name} listed in the manifest is missing")
            if sha256_file(f) != info.get("sha256"):
                raise SchemaError(f"{f}: checksum mismatch; the file is corrupt or was edited")

        def tensors(name: str) -> dict[str, np.ndarray]:
            try:
                return load_file(str(path / name))
            except (SafetensorError, OSError) as e:
                raise SchemaError(f"{path / name}: unreadable ({e})") from None

        required = ("affinity.safetensors", "distribution.safetensors")
        for name in required:
            if name not in files:
                raise SchemaError(f"{manifest_path}: manifest does not list {name}")
        affinity = TokenExpertAffinity.from_tensors(
            meta,
            tensors("affinity.safetensors"),
            fallback=aff_settings.get("fallback", "global"),
            confident_threshold=float(threshold),
        )
        distribution = DistributionPredictor.from_tensors(
            tensors("distribution.safetensors"),
            (manifest.get("distribution") or {}).get("momentum"),
            (meta.num_layers, meta.num_experts),
        )
        transitions = None
        if manifest.get("transitions"):
            if "transitions.safetensors" not in files:
                raise SchemaError(f"{manifest_path}: transitions are declared but not listed")
            transitions = TopOneTransitions.from_tensors(
                tensors("transitions.safetensors"), meta.num_experts
            )
        neural = None
        if manifest.get("neural"):
            if "neural.safetensors" not in files:
                raise SchemaError(f"{manifest_path}: a neural predictor is declared but not listed")
            neural = NeuralPredictor.from_tensors(
                tensors("neural.safetensors"), manifest["neural"], meta.vocab_size
            )
        batches = None
        if manifest.get("batches"):
            if "batches.safetensors" not in files:
                raise SchemaError(f"{manifest_path}: batches are declared but not listed")
            batches = BatchMix.from_tensors(tensors("batches.safetensors"), meta.vocab_size)
        report = None
        if REPORT in files:
            report = read_json_object(path / REPORT, str(path / REPORT), SchemaError)
        return cls(
            meta,
            affinity,
            distribution,
            transitions,
            neural,
            manifest.get("fit") or {},
            report,
            batches,
            manifest.get("token_shrinkage"),
        )


def _plain_name(name: str) -> bool:
    """A file name directly inside the predictor directory (no separators, no '..')."""
    return name not in ("", ".", "..") and Path(name).name == name and "\\" not in name


def check_destination(path: str | Path, inputs: tuple = ()) -> Path:
    """``path`` as a Path if a predictor may be written there, else :class:`InputError`.

    An existing predictor is replaced; a file, any other non-empty directory, or one of
    the command's ``inputs`` is refused (:func:`planner._io.check_output`).
    """
    return check_output(
        path,
        marker=MANIFEST,
        what="predictor",
        inputs=inputs,
        members=(MANIFEST, REPORT, "*.safetensors"),
    )


def load_predictor(path: str | Path, meta: TraceMeta | None = None) -> Predictor:
    """:meth:`Predictor.load`, then check it belongs to ``meta``'s model when given."""
    p = Predictor.load(path)
    if meta is not None:
        p.check_compatible(meta)
    return p
