"""Solving every layer of a model, and the Plan artifact that holds the result.

:func:`solve_model` runs one solver over a list of :class:`LayerProblem` (one per MoE layer),
in worker processes when ``jobs > 1``, each layer on its own or, with the n-gram term
(:mod:`planner.solve.ngram_term`), in order within fixed runs of layers. Layer l runs with
its own seed :func:`layer_seed` ``(seed, l)``, so the result does not depend on the job
count or on the order in which layers finish. With ``chain_passes`` the chain polish
(:mod:`planner.solve.chain`) then revisits each run's layers (runs in parallel with ``jobs``).

:class:`Plan` is the on-disk result: expert placement per layer, a vocabulary-wide token
table per layer with confidences, optional n-gram tables, the solver reports, and the
model's identity (metadata + fingerprint) so that a plan cannot be combined with another
model. A plan is a directory::

    plan.json     {"format": "moeplan-plan", "format_version": 1, "model": {...},
                   "fingerprint", "ep_size", "method", "seed", "config", "ngram_order",
                   "reports": [per-layer solver report], "created_by"}
    tables.npz    expert_to_device [L, N] int16, token_to_device [L, V] int16,
                  token_confidence [L, V] float16, and when present
                  ngram_to_device [L, E**n] int16, ngram_confidence [L, E**n] float16
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import io
import json
import multiprocessing as mp
import os
import signal
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from planner._checks import is_integer
from planner._io import atomic_path, check_output
from planner._progress import progress_bar
from planner.errors import InputError, MismatchError, SchemaError
from planner.predict.ngram import MAX_ORDER
from planner.solve.batch_prices import batch_priced
from planner.solve.ceo import model_layer_effort
from planner.solve.chain import chain_polish
from planner.solve.highs_child import die_with_parent
from planner.solve.ngram_term import NgramTerm, restrict
from planner.solve.problem import LayerPlacement, LayerProblem, SolverConfig
from planner.solve.registry import get_solver, solve_layer
from planner.solve.settle import (
    check_replan,
    no_worse_than_deployed,
    with_deployed,
    without_deployed,
)

PLAN_FORMAT = "moeplan-plan"
PLAN_FORMAT_VERSION = 1


PLAN_FILE = "plan.json"  # marks a plan directory
PLAN_TABLES_FILE = "tables.npz"


def check_plan_output(path: str | Path, inputs: tuple = ()) -> Path:
    """``path`` as a Path if a plan may be written there (:func:`planner._io.check_output`)."""
    return check_output(
        path, marker=PLAN_FILE, what="plan", inputs=inputs, members=(PLAN_FILE, PLAN_TABLES_FILE)
    )


def layer_seed(seed: int, layer: int) -> int:
    """The seed layer ``layer`` is solved with: independent streams per (seed, layer)."""
    return int(
        np.random.SeedSequence([int(seed), int(layer)]).generate_state(1, dtype=np.uint32)[0]
    )


def _model_budget(config: SolverConfig, method: str, num_layers: int) -> SolverConfig:
    """CEO's per-layer ``effort`` for a model of ``num_layers`` layers, unless one was given.

    The default is a budget for the whole model shared over its layers
    (:func:`planner.solve.ceo.model_layer_effort`); other methods are left as they are.
    """
    if method != "ceo":
        return config
    opts = config.for_method(method)
    if "effort" in opts:
        return config
    opts["effort"] = model_layer_effort(num_layers)
    return dataclasses.replace(config, options={**config.options, method: opts})


def _solve_one(args: tuple[LayerProblem, str, SolverConfig]) -> LayerPlacement:
    problem, method, config = args
    return solve_layer(problem, method, config)


def solve_model(
    problems: Sequence[LayerProblem],
    method: str,
    config: SolverConfig | None = None,
    *,
    jobs: int = 1,
    progress: bool = True,
    ngram_term: NgramTerm | None = None,
    chain_passes: int = 0,
    reference: np.ndarray | None = None,
    move_cost: float = 0.0,
) -> list[LayerPlacement]:
    """Solve every layer with ``method``; returns placements in layer order.

    Args:
        problems: one problem per MoE layer (list index = layer index for the seeds).
        config: seed, time limit and options; layer l uses ``layer_seed(config.seed, l)``.
        jobs: worker processes (spawned, so this is safe from threads and notebooks);
            1 solves in this process.
        progress: show a progress bar on stderr.
        ngram_term: solve layers in order within runs, each layer's problem extended by
            the n-gram context rows of its placed predecessors
            (:mod:`planner.solve.ngram_term`); None solves every layer on its own.
        chain_passes: with ``ngram_term``, sweeps of the chain polish
            (:mod:`planner.solve.chain`) over each run once all its layers are placed;
            0 skips it. With a move cost the polish counts the moves as the solvers do.
        reference, move_cost: re-planning a deployed model (:mod:`planner.solve.settle`):
            with ``move_cost`` > 0 each layer is solved with ``reference``'s groups ([L, N],
            the deployed device of each expert) as load-free rows, so that an expert leaves
            its group only where that raises the layer's LAR by ``move_cost`` or more.
    """
    get_solver(method)  # unknown method -> InputError before any work
    config = config if config is not None else SolverConfig()
    if jobs < 1:
        raise InputError(f"jobs={jobs} must be at least 1")
    num_layers = len(problems)
    if not num_layers:
        return []
    # checked here too: a library caller's cost without a reference would do nothing unseen
    n, e = problems[0].num_experts, problems[0].ep_size
    deployed = check_replan(reference, move_cost, num_layers, n, e)
    deployed = deployed if move_cost > 0 else None
    config = _model_budget(config, method, num_layers)
    runs = [[i] for i in range(num_layers)] if ngram_term is None else ngram_term.runs(num_layers)
    placed = np.zeros((num_layers, problems[0].num_experts), np.int64)
    results: list[LayerPlacement | None] = [None] * num_layers

    extended: dict[int, LayerProblem] = {}  # each layer's problem without the deployed rows

    def task(run: list[int], pos: int) -> tuple[LayerProblem, str, SolverConfig]:
        layer, problem = run[pos], problems[run[pos]]
        if ngram_term is not None:
            problem = ngram_term.extend(problem, layer, placed, run[0])
        if deployed is not None:  # c * A, A the layer's routed activations (planner.solve.settle)
            extended[layer] = problem
            bonus = move_cost * problems[layer].total_activations
            problem = with_deployed(problem, deployed[layer], bonus)
        return problem, method, config.with_seed(layer_seed(config.seed, layer))

    def record(layer: int, solved: LayerProblem, placement: LayerPlacement) -> None:
        if deployed is not None:
            placement = no_worse_than_deployed(
                solved, placement, deployed[layer], config.expert_beta, config.batch_prices
            )
            solved = extended.pop(layer)
            placement = without_deployed(solved, placement, deployed[layer])
        placement = restrict(problems[layer], solved, placement)
        results[layer] = placement
        placed[layer] = placement.expert_to_device

    with progress_bar(progress, f"solve ({method})", num_layers, unit="layers") as advance:
        if jobs == 1 or len(runs) == 1:  # one run: its layers can only go in order
            for run in runs:
                for pos, layer in enumerate(run):
                    args = task(run, pos)
                    record(layer, args[0], _solve_one(args))
                    advance()
        else:
            # Every run has one layer in flight at most; a finished layer submits the next.
            with _worker_pool(min(jobs, len(runs))) as pool:
                pending = {}
                for r, run in enumerate(runs):
                    args = task(run, 0)
                    pending[pool.submit(_solve_one, args)] = (r, 0, args[0])
                while pending:
                    done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                    for future in done:
                        r, pos, solved = pending.pop(future)
                        record(runs[r][pos], solved, future.result())
                        advance()
                        if pos + 1 < len(runs[r]):
                            args = task(runs[r], pos + 1)
                            pending[pool.submit(_solve_one, args)] = (r, pos + 1, args[0])
    placements = [r for r in results if r is not None]
    if ngram_term is not None and chain_passes > 0:
        with progress_bar(
            progress, f"solve ({method}, chain polish)", num_layers, unit="layers"
        ) as advance:
            # Runs are polished independently (a run's terms read only its own layers).
            tasks = [
                _polish_task(
                    problems,
                    placements,
                    ngram_term,
                    run,
                    chain_passes,
                    config.expert_beta,
                    deployed,
                    move_cost,
                )
                for run in runs
            ]

            def apply(run: list[int], polished: dict[int, LayerPlacement]) -> None:
                for layer, placement in polished.items():
                    # the polish re-assigned the tokens of the layers it changed
                    if config.batch_prices:
                        placement = batch_priced(problems[layer], placement)
                    placements[layer] = placement
                for _ in run:
                    advance()

            if jobs == 1 or len(runs) == 1:
                for run, args in zip(runs, tasks, strict=True):
                    apply(run, _polish_run(args))
            else:
                with _worker_pool(min(jobs, len(runs))) as pool:
                    for run, polished in zip(runs, pool.map(_polish_run, tasks), strict=True):
                        apply(run, polished)
    return placements


# The thread-count variables of the BLAS and OpenMP runtimes numpy and scipy may load.
_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@contextmanager
def _worker_pool(workers: int) -> Iterator[cf.ProcessPoolExecutor]:
    """A pool of ``workers`` spawned processes whose BLAS uses its share of the cores.

    Left alone, each worker's OpenBLAS starts a thread per core, and its idle threads spin:
    two workers on two cores then solve a DeepSeek-V3-shaped CEO layer in 13.3 s each
    instead of 9.8-10.3 s (one thread each; alone, a solve takes 9.8 s either way, so the
    solvers gain nothing from BLAS threads). The workers inherit the variables below, set
    for the pool's lifetime to ``cores // workers`` (at least 1) unless the user set them;
    this process's own BLAS has read them already and is unaffected.

    The workers ignore Ctrl-C (a terminal sends it to the whole process group; each worker's
    KeyboardInterrupt printed a traceback beside this process's one line) and die with this
    process (a parent killed outright left them running). On any exception here, Ctrl-C
    and SIGTERM included, they are stopped at once: leaving the pool's block normally waits
    for every queued layer to be solved.
    """
    threads = str(max(1, (os.cpu_count() or 1) // workers))
    added = [name for name in _THREAD_VARS if name not in os.environ]
    os.environ.update(dict.fromkeys(added, threads))
    try:
        ctx = mp.get_context("spawn")
        pool = cf.ProcessPoolExecutor(
            max_workers=workers, mp_context=ctx, initializer=_start_worker
        )
        try:
            yield pool
        except BaseException:
            _stop_pool(pool)
            raise
        pool.shutdown(wait=True)
    finally:
        for name in added:
            os.environ.pop(name, None)


def _start_worker() -> None:
    """A pool worker's start: see :func:`_worker_pool`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()


def _stop_pool(pool: cf.ProcessPoolExecutor) -> None:
    """Drop the queued work and kill the workers, waiting until they are gone."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.kill()
    for process in processes:
        process.join(timeout=5)


def _polish_task(
    problems, placements, term, run, passes, expert_beta, reference, move_cost
) -> tuple:
    """Arguments of :func:`_polish_run` for one run: only the run's problems travel."""
    members = set(run)
    kept = [p if i in members else None for i, p in enumerate(problems)]
    return kept, placements, term, run, passes, expert_beta, reference, move_cost


def _polish_run(args: tuple) -> dict[int, LayerPlacement]:
    problems, placements, term, run, passes, expert_beta, reference, move_cost = args
    return chain_polish(
        problems, placements, term, run, passes=passes, expert_beta=expert_beta,
        reference=reference, move_cost=move_cost,
    )  # fmt: skip


@dataclass(frozen=True, eq=False)
class Plan:
    """A solved placement for every MoE layer of one model (see the module docstring).

    Attributes:
        model: model metadata (``TraceMeta.to_json()``-style dict: model, num_layers,
            num_experts, top_k, vocab_size, ...).
        fingerprint: the model fingerprint carried by every derived artifact.
        ep_size: E.
        method: solver registry name; seed: the config seed; config: ``SolverConfig.to_json()``.
        expert_to_device: [L, N] int16, N/E experts per device per layer.
        token_to_device: [L, V] int16.
        token_confidence: [L, V] float16 in [0, 1].
        ngram_order: n of the n-gram tables (0 = none).
        ngram_to_device: [L, E**n] int16 or None; ngram_confidence: [L, E**n] float16 or None.
        reports: per-layer solver reports (``LayerPlacement.report()``).
    """

    model: dict[str, Any]
    fingerprint: str
    ep_size: int
    method: str
    seed: int
    config: dict[str, Any]
    expert_to_device: np.ndarray
    token_to_device: np.ndarray
    token_confidence: np.ndarray
    ngram_order: int = 0
    ngram_to_device: np.ndarray | None = None
    ngram_confidence: np.ndarray | None = None
    reports: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for key in ("num_layers", "num_experts", "vocab_size"):
            if not isinstance(self.model.get(key), int):
                raise SchemaError(f"plan: model metadata lacks integer {key!r}")
        big_l, n, v = self.model["num_layers"], self.model["num_experts"], self.model["vocab_size"]
        e = self.ep_size
        if not isinstance(e, int) or e < 1 or n % e:
            raise SchemaError(f"plan: ep_size={e!r} does not divide num_experts={n}")
        x = np.asarray(self.expert_to_device)
        t = np.asarray(self.token_to_device)
        c = np.asarray(self.token_confidence)
        _expect(x, "expert_to_device", (big_l, n))
        _expect(t, "token_to_device", (big_l, v))
        _expect(c, "token_confidence", (big_l, v))
        for name, arr in (("expert_to_device", x), ("token_to_device", t)):
            _check_devices(arr, name, e)
        counts = (
            np.stack([np.bincount(row, minlength=e) for row in x.astype(np.int64)])
            if big_l
            else None
        )
        if counts is not None and (counts != n // e).any():
            raise SchemaError(
                f"plan: some layer does not hold exactly N/E = {n // e} experts per device"
            )
        if not _shares(c):
            raise SchemaError("plan: token_confidence outside [0, 1]")
        object.__setattr__(self, "expert_to_device", x.astype(np.int16))
        object.__setattr__(self, "token_to_device", t.astype(np.int16))
        object.__setattr__(self, "token_confidence", c.astype(np.float16))
        if not is_integer(self.ngram_order) or not 0 <= self.ngram_order <= MAX_ORDER:
            raise SchemaError(f"plan: ngram_order={self.ngram_order!r} is not in [0, {MAX_ORDER}]")
        if (self.ngram_to_device is None) != (self.ngram_confidence is None):
            raise SchemaError("plan: ngram_to_device and ngram_confidence come together")
        if self.ngram_to_device is not None:
            shape = (big_l, e**self.ngram_order)
            _expect(np.asarray(self.ngram_to_device), "ngram_to_device", shape)
            _expect(np.asarray(self.ngram_confidence), "ngram_confidence", shape)
            _check_devices(np.asarray(self.ngram_to_device), "ngram_to_device", e)
            if not _shares(np.asarray(self.ngram_confidence)):
                raise SchemaError("plan: ngram_confidence outside [0, 1]")
            object.__setattr__(
                self, "ngram_to_device", np.asarray(self.ngram_to_device).astype(np.int16)
            )
            object.__setattr__(
                self, "ngram_confidence", np.asarray(self.ngram_confidence).astype(np.float16)
            )
        if not isinstance(self.reports, list) or len(self.reports) not in (0, big_l):
            got = len(self.reports) if isinstance(self.reports, list) else repr(self.reports)
            raise SchemaError(f"plan: {got} layer reports for {big_l} layers")
        if not all(isinstance(r, dict) for r in self.reports):
            raise SchemaError("plan: every layer report must be a JSON object")

    def check_model(self, fingerprint: str) -> None:
        """Refuse a plan made for another model (MismatchError)."""
        if fingerprint != self.fingerprint:
            raise MismatchError(
                f"plan was made for model {self.model.get('model')!r} (fingerprint {self.fingerprint}), "
                f"not for fingerprint {fingerprint}"
            )

    def save(self, path: str | Path) -> Path:
        """Write the plan directory atomically; returns its path."""
        path = Path(path)
        meta = {
            "format": PLAN_FORMAT,
            "format_version": PLAN_FORMAT_VERSION,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "ep_size": self.ep_size,
            "method": self.method,
            "seed": int(self.seed),
            "config": self.config,
            "ngram_order": int(self.ngram_order),
            "reports": self.reports,
            "created_by": _created_by(),
        }
        arrays: dict[str, Any] = {
            "expert_to_device": self.expert_to_device,
            "token_to_device": self.token_to_device,
            "token_confidence": self.token_confidence,
        }
        if self.ngram_to_device is not None:
            arrays["ngram_to_device"] = self.ngram_to_device
            arrays["ngram_confidence"] = self.ngram_confidence
        buffer = io.BytesIO()
        np.savez_compressed(buffer, **arrays)
        check_plan_output(path)
        with atomic_path(path) as tmp:
            tmp.mkdir()
            (tmp / PLAN_TABLES_FILE).write_bytes(buffer.getvalue())
            (tmp / PLAN_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        meta_path, tables_path = path / PLAN_FILE, path / PLAN_TABLES_FILE
        if not meta_path.is_file() or not tables_path.is_file():
            raise InputError(f"{path} is not a plan directory (plan.json and tables.npz expected)")
        try:
            meta = json.loads(meta_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise SchemaError(f"{meta_path}: not JSON ({e})") from None
        if not isinstance(meta, dict):
            raise SchemaError(f"{meta_path}: not a JSON object")
        if meta.get("format") != PLAN_FORMAT:
            raise SchemaError(f"{meta_path}: format {meta.get('format')!r} is not {PLAN_FORMAT!r}")
        if meta.get("format_version") != PLAN_FORMAT_VERSION:
            raise SchemaError(
                f"{meta_path}: format_version {meta.get('format_version')!r} is not supported "
                f"(expected {PLAN_FORMAT_VERSION})"
            )
        for key, ok, kind in _META_FIELDS:
            if key not in meta and key in _META_OPTIONAL:
                continue
            if key not in meta or not ok(meta[key]):
                got = repr(meta[key]) if key in meta else "missing"
                raise SchemaError(f"{meta_path}: {key} must be {kind} ({got})")
        with open(tables_path, "rb"):  # unreadable (permissions): the OSError says so, where
            pass  # is_zipfile would answer False and blame the format
        if not zipfile.is_zipfile(tables_path):  # np.load would read a bare .npy, or pickles
            raise SchemaError(f"{tables_path}: not a readable table archive (not an .npz file)")
        try:
            with np.load(tables_path, allow_pickle=False) as tables:
                arrays = {k: tables[k] for k in tables.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
            raise SchemaError(f"{tables_path}: not a readable table archive ({e})") from None
        for key in ("expert_to_device", "token_to_device", "token_confidence"):
            if key not in arrays:
                raise SchemaError(f"{tables_path}: missing table {key!r}")
        return cls(
            model=meta["model"], fingerprint=meta["fingerprint"], ep_size=meta["ep_size"],
            method=meta["method"], seed=meta["seed"], config=meta.get("config", {}),
            expert_to_device=arrays["expert_to_device"], token_to_device=arrays["token_to_device"],
            token_confidence=arrays["token_confidence"], ngram_order=meta.get("ngram_order", 0),
            ngram_to_device=arrays.get("ngram_to_device"), ngram_confidence=arrays.get("ngram_confidence"),
            reports=meta.get("reports", []),
        )  # fmt: skip


# plan.json's fields: (key, check, what it must be); config, ngram_order and reports may be absent
_META_FIELDS = (
    ("model", lambda v: isinstance(v, dict), "a JSON object"),
    ("fingerprint", lambda v: isinstance(v, str), "a string"),
    ("ep_size", is_integer, "an integer"),
    ("method", lambda v: isinstance(v, str), "a string"),
    ("seed", lambda v: is_integer(v) and v >= 0, "an integer >= 0"),
    ("config", lambda v: isinstance(v, dict), "a JSON object"),
    ("ngram_order", is_integer, "an integer"),
    ("reports", lambda v: isinstance(v, list), "a list"),
)
_META_OPTIONAL = ("config", "ngram_order", "reports")


def _check_devices(arr: np.ndarray, name: str, e: int) -> None:
    """A device table holds integers in [0, E) (a float table would be truncated silently)."""
    if not np.issubdtype(arr.dtype, np.integer):
        raise SchemaError(f"plan: {name} has dtype {arr.dtype}, expected integers")
    if arr.size and (arr.min() < 0 or arr.max() >= e):
        raise SchemaError(f"plan: {name} holds devices outside [0, {e})")


def _shares(arr: np.ndarray) -> bool:
    """Whether ``arr`` holds real numbers in [0, 1] (not complex: a hand-edited table's
    complex confidences were cast to float16 with a warning, their imaginary parts dropped)."""
    real = np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)
    return bool(
        real and (not arr.size or (np.isfinite(arr).all() and arr.min() >= 0 and arr.max() <= 1))
    )


def _expect(arr: np.ndarray, name: str, shape: tuple[int, ...]) -> None:
    if arr.shape != shape:
        raise SchemaError(f"plan: {name} has shape {arr.shape}, expected {shape}")


def _created_by() -> str:
    try:
        from importlib.metadata import version

        return f"moeplan {version('moeplan')}"
    except Exception:  # pragma: no cover - not installed
        return "moeplan"
