"""Seeded fit / held-out splits of routing data.

- Traces are split by request (never by token), so no request has tokens on both sides:
  held-out figures then measure generalisation to new prompts, as in the papers (which fit
  on 20-25% of the profile and test on the rest).
- Counts tables have no requests. :func:`thin_counts` splits them by binomial thinning:
  every routed activation goes to the held-out side independently with probability
  ``fraction``. That is a split by token occurrence (even by activation): a token seen in
  held-out data is far more likely to also be in the fitting data than under a request
  split, so figures from thinned counts are optimistic. Cross-domain evaluation (fit on
  some domains, test on another) is the stricter alternative.
- Traces whose requests carry a ``domain`` column (``moeplan profile`` writes the prompts'
  ``domain``; synthetic traces their domain index) can also be split by domain
  (:func:`split_trace_by_domain`): the held-out side is every request of the named
  domains, for a test of how a plan carries over to traffic unlike what it was fitted on.
- Not a split, but beside them: :func:`shuffle_requests` writes a trace's requests in a
  random order, each request's rows kept together, for measuring a plan on the same
  requests served in batches that mix them (a trace profiled one prompt domain after
  another otherwise serves each domain in batches of its own).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import sparse

from planner._checks import is_seed
from planner._io import atomic_path, check_output, refuse_existing, signals_deferred
from planner.errors import InputError, SchemaError
from planner.predict.counts import TokenExpertCounts
from planner.trace.io import (
    EMBEDDINGS_FILE,
    PART_GLOB,
    TRACE_MEMBERS,
    TraceBatch,
    TraceWriter,
    open_trace,
)


def check_fraction(fraction: float, what: str = "holdout") -> float:
    """``fraction`` as a float in the open interval (0, 1), else :class:`InputError`."""
    try:
        f = float(fraction)
    except (TypeError, ValueError):
        raise InputError(f"{what} fraction {fraction!r} is not a number") from None
    if not 0.0 < f < 1.0:
        raise InputError(f"{what} fraction {fraction!r} must lie strictly between 0 and 1")
    return f


def check_seed(seed: object) -> int:
    """``seed`` as an int in [0, 2**64) (what numpy's and torch's generators take), else
    :class:`InputError`."""
    if not is_seed(seed):
        raise InputError(f"seed {seed!r} must be an integer in [0, 2**64)")
    return int(seed)  # type: ignore[call-overload]


@dataclass(frozen=True)
class RequestSplit:
    """Which requests are held out.

    Attributes:
        heldout_ids: [H] int64 sorted request ids on the held-out side.
        num_requests: R distinct requests in the trace.
        fraction: requested held-out share; ``H = round(fraction * R)`` clipped to [1, R-1].
        seed: seed of the draw.
    """

    heldout_ids: np.ndarray
    num_requests: int
    fraction: float
    seed: int

    @classmethod
    def make(cls, request_ids: np.ndarray, fraction: float, seed: int = 0) -> RequestSplit:
        """Hold out a seeded random ``fraction`` of the distinct ``request_ids``."""
        f = check_fraction(fraction)
        seed = check_seed(seed)
        ids = np.unique(np.asarray(request_ids, np.int64))
        if ids.size < 2:
            raise InputError(
                f"a request-level split needs at least 2 requests, the trace has {ids.size}"
            )
        h = int(min(max(round(f * ids.size), 1), ids.size - 1))
        rng = np.random.default_rng([int(seed), 0x5EED])
        chosen = np.sort(rng.choice(ids, size=h, replace=False))
        return cls(chosen, int(ids.size), f, int(seed))

    def heldout_mask(self, request_id: np.ndarray) -> np.ndarray:
        """[T] bool, rows of ``request_id`` [T] that belong to held-out requests."""
        ids = self.heldout_ids
        if ids.size == 0:
            return np.zeros(np.shape(request_id), bool)
        pos = np.minimum(np.searchsorted(ids, request_id), ids.size - 1)
        return ids[pos] == request_id

    def summary(self) -> dict:
        return {
            "kind": "request",
            "fraction": self.fraction,
            "seed": self.seed,
            "requests": self.num_requests,
            "heldout_requests": int(self.heldout_ids.size),
        }


def thin_counts(
    counts: TokenExpertCounts, fraction: float, seed: int = 0
) -> tuple[TokenExpertCounts, TokenExpertCounts]:
    """(fit, held-out) counts: each activation held out with probability ``fraction``."""
    f = check_fraction(fraction)
    rng = np.random.default_rng([check_seed(seed), 0x7417])
    fit: list[sparse.csr_array] = []
    held: list[sparse.csr_array] = []
    for mat in counts.by_layer:
        h = rng.binomial(mat.data, f).astype(np.int64)
        for part, data in ((held, h), (fit, mat.data - h)):
            m = sparse.csr_array((data, mat.indices.copy(), mat.indptr.copy()), shape=mat.shape)
            m.eliminate_zeros()
            part.append(m)
    return (
        TokenExpertCounts(counts.meta, tuple(fit), counts.domains),
        TokenExpertCounts(counts.meta, tuple(held), counts.domains),
    )


def split_trace(
    path: str | Path,
    fit_out: str | Path,
    heldout_out: str | Path,
    fraction: float,
    seed: int = 0,
    *,
    overwrite: bool = False,
) -> dict:
    """Write the fit and held-out sides of a request split as two traces.

    The same seed and fraction give the same split as ``moeplan fit --holdout``, so a
    predictor fitted with ``--holdout F --seed S`` and the held-out trace written here with
    ``F, S`` see disjoint requests. Both outputs are written atomically (all or nothing);
    an existing output is replaced only with ``overwrite`` (``--force``), and only if it is
    an earlier trace or an empty directory, as ``trace synth`` and ``ingest`` do.
    """
    trace = open_trace(path)
    split = RequestSplit.make(trace.request_ids(), fraction, seed)
    counts = _write_sides(
        trace, fit_out, heldout_out, lambda b: split.heldout_mask(b.request_id), overwrite
    )
    return split.summary() | counts


# The trace column that names each request's domain.
DOMAIN_COLUMN = "domain"


def trace_domains(trace) -> list[str]:
    """Sorted distinct domains of ``trace`` (as strings); InputError without a domain column."""
    lacking = trace.parts_without(DOMAIN_COLUMN)
    if len(lacking) == len(trace.parts):
        raise InputError(
            f"{trace.path}: has no {DOMAIN_COLUMN!r} column to split by; profile prompts that "
            'carry a "domain" field, or split by request (--holdout)'
        )
    if lacking:
        raise InputError(
            f"{lacking[0]}: has no {DOMAIN_COLUMN!r} column while other parts of {trace.path} "
            f"do ({len(lacking)} of {len(trace.parts)} parts lack it); split by request "
            "(--holdout), or profile those prompts again with their domains"
        )
    # A split holds out whole requests: a request whose rows name two domains would end up
    # on both sides, its held-out tokens fitted on.
    domain_of: dict[int, str] = {}
    for batch in trace.iter_batches(extras=(DOMAIN_COLUMN,), weights=False, validate=False):
        names, codes = np.unique(_domain_names(batch, trace.path), return_inverse=True)
        names = names.tolist()  # plain str, for the message
        rid = np.asarray(batch.request_id)
        pairs = np.unique(np.stack([rid, codes.astype(np.int64)], axis=1), axis=0)
        for r, c in pairs.tolist():
            if domain_of.setdefault(r, names[c]) != names[c]:
                raise InputError(
                    f"{trace.path}: request {r} has rows of domain {domain_of[r]!r} and of "
                    f"{names[c]!r}; a domain split holds out whole requests, so each request "
                    "needs one domain (split by request with --holdout)"
                )
    return sorted(set(domain_of.values()))


def _domain_names(batch, where: object) -> np.ndarray:
    """[T] str: each row's domain as a string, stripped as the names a user gives are.

    Read as numpy, an integer column with a null in the batch comes as floats (domain 1 as
    1.0, whose name "1.0" no --heldout-domain 1 matched, so its rows went to the fitting
    side), and a string column's null as None (a domain named "None"): nulls are refused
    and whole floats named as the integers they are."""
    values = np.asarray(batch.extras[DOMAIN_COLUMN])
    kind = values.dtype.kind
    float_null = kind == "f" and np.isnan(values).any()
    object_null = kind == "O" and (values == None).any()  # noqa: E711 (elementwise)
    if float_null or object_null:
        raise SchemaError(f"{where}: the domain column holds nulls; give every request a domain")
    if kind == "f" and np.isfinite(values).all() and (values == np.round(values)).all():
        values = values.astype(np.int64)
    return np.char.strip(values.astype(str))


def format_domains(domains: Iterable[str]) -> str:
    """Domains for a message, comma-separated; a request without a domain has the empty
    one, shown as ''."""
    return ", ".join(d if d else "''" for d in domains)


def split_trace_by_domain(
    path: str | Path,
    fit_out: str | Path,
    heldout_out: str | Path,
    domains: list[str],
    *,
    overwrite: bool = False,
) -> dict:
    """Hold out every request of ``domains``; the other domains' requests go to the fitting side.

    Domains are matched as strings, stripped of surrounding spaces (a synthetic trace's
    integer domain 1 is ``"1"``); at least one domain must stay on the fitting side. Both
    outputs are written atomically, replacing existing ones only with ``overwrite``.
    """
    trace = open_trace(path)
    trace.request_ids()  # refuses a repeated (request, position) occurrence
    available = trace_domains(trace)
    wanted = sorted({str(d).strip() for d in domains if str(d).strip()})
    unknown = [d for d in wanted if d not in available]
    if not wanted or unknown:
        raise InputError(
            f"{path}: no domain {', '.join(map(repr, unknown)) or 'given'} to hold out; "
            f"the trace's domains are {format_domains(available)}"
        )
    if len(wanted) == len(available):
        raise InputError(
            f"{path}: holding out every domain ({format_domains(available)}) leaves nothing to fit on"
        )
    held = np.array(wanted)
    counts = _write_sides(
        trace,
        fit_out,
        heldout_out,
        lambda b: np.isin(_domain_names(b, trace.path), held),
        overwrite,
    )
    return {"kind": "domain", "heldout_domains": wanted, "domains": available} | counts


def _check_outputs(trace, outs: tuple, overwrite: bool, what: str) -> None:
    """Refuse output trace directories ``outs`` that would lose a user's data.

    An existing output is replaced only with ``overwrite``: a mistyped --fit-out had
    replaced a recorded trace (its profile.json too, or an unfinished profile run) without
    a word, where ``trace synth`` and ``ingest`` ask for --force."""
    for out in outs:
        if Path(out).suffix == ".parquet":  # it made a directory of that name
            raise InputError(
                f"{out}: {what} as a directory of parts (with the model's embeddings, where "
                "the trace has them); give a name without .parquet"
            )
    for out in outs:
        check_output(
            out, marker=PART_GLOB, what="trace", inputs=(trace.path,), members=TRACE_MEMBERS
        )
    for out in outs:  # (after: an input or a user's directory says so)
        refuse_existing(out, overwrite)


def _copy_embeddings(trace, tmp: str | Path) -> None:
    """The model's embeddings, for `moeplan fit` on a written trace (nearest-token fallback)."""
    embeddings = trace.path / EMBEDDINGS_FILE if trace.path.is_dir() else None
    if embeddings is not None and embeddings.is_file():
        shutil.copyfile(embeddings, Path(tmp) / EMBEDDINGS_FILE)


def _write_sides(trace, fit_out, heldout_out, heldout_mask, overwrite: bool = False) -> dict:
    """Stream ``trace`` into a fitting and a held-out trace by ``heldout_mask(batch)`` [T] bool
    (existing outputs are replaced only with ``overwrite``: :func:`_check_outputs`)."""
    fit_at, held_at = Path(fit_out).resolve(), Path(heldout_out).resolve()
    if fit_at == held_at:
        raise InputError(f"--fit-out and --heldout-out are both {fit_out}; give two paths")
    if fit_at in held_at.parents or held_at in fit_at.parents:
        # the outer trace's commit would replace the inner one (or find it gone)
        raise InputError(
            f"--fit-out {fit_out} and --heldout-out {heldout_out} are nested; give two "
            "separate paths"
        )
    _check_outputs(trace, (fit_out, heldout_out), overwrite, "a split writes each side")
    counts = {"fit": 0, "heldout": 0}
    requests: dict[str, set] = {"fit": set(), "heldout": set()}
    # the last context to exit: from when both sides are written until both are renamed
    # into place, Ctrl-C and SIGTERM wait (a fitting side left from an earlier split with
    # a new held-out side would share requests with it)
    commit = contextlib.ExitStack()
    with commit, atomic_path(fit_out) as fit_tmp, atomic_path(heldout_out) as held_tmp:
        types = trace.extra_types()  # each extra column written back as it was read
        writers = {
            "fit": TraceWriter(fit_tmp, trace.meta, types),
            "heldout": TraceWriter(held_tmp, trace.meta, types),
        }
        # every extra column some part has; nulls in the parts without it (a column of
        # only some parts was dropped, and a later --heldout-domain then failed)
        extras = tuple(trace.extra_columns(in_any_part=True))
        # batches sized by their expert cells (the reader's default; one part per batch and
        # side): 65536 rows of a 48-layer top-8 trace took a split to 1.0 GB, 11k to 0.5 GB
        for batch in trace.iter_batches(extras=extras, fill_missing=True):
            held = heldout_mask(batch)
            for side, mask in (("fit", ~held), ("heldout", held)):
                if mask.any():
                    writers[side].write(batch.select(mask))
                    counts[side] += int(mask.sum())
                    requests[side].update(np.unique(batch.request_id[mask]).tolist())
        for tmp in (fit_tmp, held_tmp):
            _copy_embeddings(trace, tmp)
        commit.enter_context(signals_deferred())
    return {
        "fit_tokens": counts["fit"],
        "heldout_tokens": counts["heldout"],
        "fit_requests": len(requests["fit"]),
        "heldout_requests": len(requests["heldout"]),
    }


# Expert cells (rows x MoE layers x k) a shuffle holds at once: 2**27 cells are 512 MiB of
# experts and gate weights (int16 and float16). A longer trace is read once for each block
# of its new order.
SHUFFLE_CELLS = 2**27


def shuffle_requests(
    path: str | Path, out: str | Path, seed: int = 0, *, overwrite: bool = False
) -> dict:
    """Write the trace at ``path`` to ``out`` with its requests in a random order drawn with
    ``seed``, each request's rows kept together in position order.

    ``moeplan evaluate`` caps each batch of B rows in trace order (DESIGN.md's balanced
    LAR). A trace profiled one prompt file, or domain, after another serves each domain in
    batches of its own, where a serving engine that batches many users' requests together
    mixes them. The same requests shuffled measure a plan served that way: on the example,
    plans fitted on its trace-order batches gave up 1.7% of their balanced LAR served mixed,
    up to 4.4% (benchmarks/RESULTS.md, session 56). Extra columns and the model's embeddings
    are kept. The output is written atomically and replaces an earlier trace only with
    ``overwrite``. At most :data:`SHUFFLE_CELLS` expert cells are held at once: a longer
    trace is read once for each block of that many cells of its new order.
    """
    seed = check_seed(seed)
    trace = open_trace(path)
    _check_outputs(trace, (out,), overwrite, "a shuffle writes the trace")
    request, position = trace.occurrences()
    if request.size == 0:
        raise InputError(f"{path}: the trace has no rows to shuffle")
    ids, request_index = np.unique(request, return_inverse=True)
    rank = np.empty(ids.size, np.int64)  # each request's place in the new order
    rank[np.random.default_rng(seed).permutation(ids.size)] = np.arange(ids.size)
    order = np.lexsort((position, rank[request_index]))
    new_index = np.empty(request.size, np.int64)  # each row's place in the new order
    new_index[order] = np.arange(request.size)
    meta = trace.meta
    block_rows = max(1, SHUFFLE_CELLS // (meta.num_layers * meta.top_k))
    extras = tuple(trace.extra_columns(in_any_part=True))
    commit = contextlib.ExitStack()
    with commit, atomic_path(out) as tmp:
        writer = TraceWriter(tmp, meta, trace.extra_types())
        for block in range(-(-request.size // block_rows)):
            picked, places, offset = [], [], 0
            for batch in trace.iter_batches(extras=extras, fill_missing=True):
                place = new_index[offset : offset + len(batch)]
                offset += len(batch)
                mask = place // block_rows == block
                if mask.any():
                    picked.append(batch.select(mask))
                    places.append(place[mask])
            rows = TraceBatch.concat(picked)
            writer.write(rows.select(np.argsort(np.concatenate(places))))
        _copy_embeddings(trace, tmp)
        commit.enter_context(signals_deferred())
    return {"requests": int(ids.size), "tokens": int(request.size), "seed": seed}
