"""Every figure of ``moeplan evaluate`` against a slow per-token reference written from
DESIGN.md "Metrics" and docs/metrics.md (plain loops sharing no code with the
evaluator or the runtime shim), over many small random traces and bundles: the balanced LAR
with its per-batch cap, imbalances, remote fraction, all-to-all bytes, per-layer rows, the
overall figures and the per-request counts; the runtime's capacity rule and route() against
the same reference; and `moeplan compare`'s rows against `moeplan evaluate`'s figures.

Conventions the reference spells out (where DESIGN.md leaves a choice open):

- batches are consecutive blocks of B rows in trace order (they cross request boundaries);
  the last, shorter block is capped with its own size: ceil(slack * len / E);
- a token with id -1 (unknown) has no token-table entry: it goes to its request's
  contiguous (vanilla) chunk with confidence 0, so the n-gram table decides wherever it has
  any confidence; the oracle bound counts each of its occurrences as a token of its own;
- the n-gram table predicts only at layers l >= n (``lar_ngram`` counts those layers), and
  only at layers where some entry has a positive confidence (a plan without n-gram tables
  exports one of confidence 0 everywhere); an entry of confidence 0 predicts nothing, so it
  is never a token's second choice.
"""

from __future__ import annotations

import json
import math
from decimal import Decimal

import numpy as np
import pytest
import torch

from planner.cli.main import main
from planner.evaluate import EvalConfig, evaluate_bundle
from planner.evaluate.compare import ratio_interval
from planner.export import load_tables
from planner.export.bundle import Bundle
from planner.runtime_shim.tables import PlanTables, assign_with_capacity
from planner.trace import TraceBatch, TraceMeta, open_trace, write_trace
from planner.trace.synth import SynthConfig
from tests.conftest import random_batch, synth_predictor

IMBALANCES = (
    "token_imbalance",
    "token_imbalance_balanced",
    "expert_load_imbalance",
    "token_imbalance_batch",
)


def _random_bundle(meta: TraceMeta, ep: int, order: int, seed: int, levels: int = 0) -> Bundle:
    """Random tables; with ``levels`` > 0 the confidences take only that many values (ties)."""
    rng = np.random.default_rng(seed)
    big_l, n, v = meta.num_layers, meta.num_experts, meta.vocab_size

    def conf(*shape):
        x = rng.random(shape)
        return (np.floor(x * levels) / levels if levels else x).astype(np.float16)

    return Bundle.from_arrays(
        meta,
        ep_size=ep,
        ngram_order=order,
        expert_to_device=np.stack(
            [rng.permutation(np.arange(n) // (n // ep)) for _ in range(big_l)]
        ),
        token_to_device=rng.integers(0, ep, (big_l, v)),
        token_confidence=conf(big_l, v),
        ngram_to_device=rng.integers(0, ep, (big_l, ep**order)),
        ngram_confidence=conf(big_l, ep**order),
    )


# ---------------------------------------------------------------------------------------
# The reference


def _cap(tokens: int, ep: int, slack: float) -> int:
    """ceil(slack * B / E), exactly (slack as written in decimal)."""
    return math.ceil(Decimal(repr(slack)) * tokens / ep)


def _assign_reference(choice, conf, second, second_conf, cap: int, ep: int) -> list[int]:
    """The capacity rule of docs/metrics.md on one batch of one layer, one token at a time.

    The most confident ``cap`` tokens of each device keep it (ties: earlier first); each
    overflowing token then goes to its second choice where that has room (a device's free
    slots go to the tokens naming it with the highest second confidence, earlier first);
    the rest, most confident first, each to the least-loaded device with room (lower id).
    """
    t = len(choice)
    out = [-1] * t
    load = [0] * ep
    overflow = []
    for d in range(ep):
        mine = sorted((i for i in range(t) if choice[i] == d), key=lambda i: (-conf[i], i))
        for i in mine[:cap]:
            out[i] = d
            load[d] += 1
        overflow += mine[cap:]
    for d in range(ep):
        naming = sorted(
            (i for i in overflow if second[i] == d and out[i] < 0),
            key=lambda i: (-second_conf[i], i),
        )
        for i in naming[: cap - load[d]]:
            out[i] = d
            load[d] += 1
    for i in sorted((i for i in overflow if out[i] < 0), key=lambda i: (-conf[i], i)):
        d = min((d for d in range(ep) if load[d] < cap), key=lambda d: (load[d], d))
        out[i] = d
        load[d] += 1
    return out


def _reference(bundle: Bundle, rows: TraceBatch, cfg: EvalConfig) -> dict:
    """The report's figures from per-token loops (``rows`` in trace order)."""
    meta = bundle.meta
    big_l, n, k, ep, order = (
        meta.num_layers, meta.num_experts, meta.top_k, bundle.ep_size, bundle.ngram_order
    )  # fmt: skip
    per = n // ep
    t_all = len(rows)
    e2d = bundle.expert_to_device.astype(int).tolist()
    tok_dev = bundle.token_to_device.astype(int).tolist()
    tok_conf = bundle.token_confidence.astype(float).tolist()
    ng_dev = bundle.ngram_to_device.astype(int).tolist()
    ng_conf = bundle.ngram_confidence.astype(float).tolist()
    req = rows.request_id.tolist()
    pos = rows.position.tolist()
    tokens = rows.token_id.tolist()
    experts = rows.experts.astype(int).tolist()

    # vanilla: each request's positions split into E contiguous chunks
    first, last, count = {}, {}, {}
    for r, p in zip(req, pos, strict=True):
        first[r] = min(first.get(r, p), p)
        last[r] = max(last.get(r, p), p)
        count[r] = count.get(r, 0) + 1
    van = [
        min((p - first[r]) * ep // (last[r] - first[r] + 1), ep - 1)
        for r, p in zip(req, pos, strict=True)
    ]

    # per (token, layer): the two tables' predictions and the online choice
    choice = [[0] * big_l for _ in range(t_all)]
    conf = [[0.0] * big_l for _ in range(t_all)]
    second = [[-1] * big_l for _ in range(t_all)]
    second_conf = [[0.0] * big_l for _ in range(t_all)]
    token_choice = [[0] * big_l for _ in range(t_all)]
    ngram_choice = [[None] * big_l for _ in range(t_all)]
    for t in range(t_all):
        for layer in range(big_l):
            if tokens[t] >= 0:
                td, tc = tok_dev[layer][tokens[t]], tok_conf[layer][tokens[t]]
            else:
                td, tc = van[t], 0.0
            token_choice[t][layer] = td
            if layer >= order and max(ng_conf[layer]) > 0:
                row = 0
                for j in range(layer - order, layer):  # most recent layer last
                    row = row * ep + e2d[j][experts[t][j][0]]
                nd, nc = ng_dev[layer][row], ng_conf[layer][row]
                ngram_choice[t][layer] = nd
            else:
                nd, nc = None, 0.0
            if nd is not None and nc > tc:  # strictly more confident
                choice[t][layer], conf[t][layer] = nd, nc
                other, other_conf = td, tc
            else:
                choice[t][layer], conf[t][layer] = td, tc
                other, other_conf = (nd, nc) if nc > 0 else (None, 0.0)
            if other is not None and other != choice[t][layer]:
                second[t][layer], second_conf[t][layer] = other, other_conf

    # balanced: consecutive blocks of B rows, each layer capped on its own; each block's
    # heaviest device before the cap and its size, per layer
    balanced = [[0] * big_l for _ in range(t_all)]
    block_heaviest: list[list[tuple[int, int]]] = [[] for _ in range(big_l)]
    for start in range(0, t_all, cfg.batch_tokens):
        idx = list(range(start, min(start + cfg.batch_tokens, t_all)))
        cap = _cap(len(idx), ep, cfg.slack)
        for layer in range(big_l):
            sent = [0] * ep
            for i in idx:
                sent[choice[i][layer]] += 1
            block_heaviest[layer].append((max(sent), len(idx)))
            got = _assign_reference(
                [choice[i][layer] for i in idx], [conf[i][layer] for i in idx],
                [second[i][layer] for i in idx], [second_conf[i][layer] for i in idx], cap, ep,
            )  # fmt: skip
            for i, d in zip(idx, got, strict=True):
                balanced[i][layer] = d

    z = lambda: [0] * big_l  # noqa: E731
    local = {name: z() for name in ("token", "ngram", "online", "balanced", "vanilla")}
    ngram_occ, ngram_used = z(), z()
    remote = {name: z() for name in ("balanced", "vanilla")}
    touched = {name: z() for name in ("balanced", "vanilla")}
    tokens_on = {name: [[0] * ep for _ in range(big_l)] for name in ("online", "balanced")}
    expert_load = [[0] * ep for _ in range(big_l)]
    request_local = {r: 0 for r in count}
    for t in range(t_all):
        for layer in range(big_l):
            devs = [e2d[layer][x] for x in experts[t][layer]]
            van_devs = [x // per for x in experts[t][layer]]
            local["token"][layer] += devs.count(token_choice[t][layer])
            if ngram_choice[t][layer] is not None:
                local["ngram"][layer] += devs.count(ngram_choice[t][layer])
                ngram_occ[layer] += k
                tc = tok_conf[layer][tokens[t]] if tokens[t] >= 0 else 0.0
                ngram_used[layer] += conf[t][layer] > tc  # the n-gram table decided
            local["online"][layer] += devs.count(choice[t][layer])
            local["balanced"][layer] += devs.count(balanced[t][layer])
            request_local[req[t]] += devs.count(balanced[t][layer])
            local["vanilla"][layer] += van_devs.count(van[t])
            for name, ds, d in (
                ("balanced", devs, balanced[t][layer]),
                ("vanilla", van_devs, van[t]),
            ):
                touched[name][layer] += len(set(ds))
                remote[name][layer] += len(set(ds) - {d})
            tokens_on["online"][layer][choice[t][layer]] += 1
            tokens_on["balanced"][layer][balanced[t][layer]] += 1
            for d in devs:
                expert_load[layer][d] += 1

    # the oracle bound: per (layer, known token), its N/E most routed experts; an unknown
    # id's occurrence is a token of its own
    hosted, routed = z(), z()
    for layer in range(big_l):
        by_token: dict[object, dict[int, int]] = {}
        for t in range(t_all):
            c = by_token.setdefault(tokens[t] if tokens[t] >= 0 else ("unknown", t), {})
            for x in experts[t][layer]:
                c[x] = c.get(x, 0) + 1
        for c in by_token.values():
            hosted[layer] += sum(sorted(c.values(), reverse=True)[:per])
            routed[layer] += sum(c.values())

    occ = [t_all * k] * big_l
    ratios = {
        "lar_token": (local["token"], occ),
        "lar_ngram": (local["ngram"], ngram_occ),
        "lar": (local["online"], occ),
        "lar_balanced": (local["balanced"], occ),
        "lar_vanilla": (local["vanilla"], occ),
        "oracle_bound": (hosted, routed),
        "ngram_share": (ngram_used, [t_all] * big_l),
        "remote_fraction": (remote["balanced"], touched["balanced"]),
        "remote_fraction_vanilla": (remote["vanilla"], touched["vanilla"]),
    }

    def imbalance(load):  # max over devices / mean
        return max(load) / (sum(load) / ep) if sum(load) else None

    per_layer = []
    for layer in range(big_l):
        row = {
            name: (num[layer] / den[layer] if den[layer] else None)
            for name, (num, den) in ratios.items()
        }
        row["token_imbalance"] = imbalance(tokens_on["online"][layer])
        row["token_imbalance_balanced"] = imbalance(tokens_on["balanced"][layer])
        row["expert_load_imbalance"] = imbalance(expert_load[layer])
        # max / mean per batch, weighted by the batch's tokens (a last batch of 1 token
        # reads E and had weighed as much as a whole one)
        blocks = block_heaviest[layer]
        row["token_imbalance_batch"] = (
            sum(h for h, _ in blocks) * ep / sum(t for _, t in blocks) if blocks else None
        )
        per_layer.append(row)
    overall = {
        name: (sum(num) / sum(den) if sum(den) else None) for name, (num, den) in ratios.items()
    }
    for name in IMBALANCES:
        values = [r[name] for r in per_layer if r[name] is not None]
        overall[name] = sum(values) / len(values) if values else None
    # the worst batch at least half full (a shorter one only where none is)
    half_full = any(2 * t >= cfg.batch_tokens for blocks in block_heaviest for _, t in blocks)
    overall["token_imbalance_batch_worst"] = max(
        (h * ep / t for blocks in block_heaviest for h, t in blocks
         if 2 * t >= cfg.batch_tokens or not half_full),
        default=None,
    )  # fmt: skip
    wire = cfg.hidden_size * cfg.dtype_bytes * 2  # dispatch and combine
    overall["tokens"] = t_all
    overall["remote_activations"] = sum(remote["balanced"])
    overall["remote_activations_vanilla"] = sum(remote["vanilla"])
    overall["all_to_all_bytes"] = sum(remote["balanced"]) * wire if wire else None
    overall["all_to_all_bytes_vanilla"] = sum(remote["vanilla"]) * wire if wire else None
    ids = sorted(count)
    return {
        "overall": overall,
        "per_layer": per_layer,
        "per_request": {
            "request_id": ids,
            "tokens": [count[r] for r in ids],
            "local_balanced": [request_local[r] for r in ids],
        },
    }


def _assert_same(report: dict, ref: dict) -> None:
    def close(got, want, where):
        if want is None:
            assert got is None, where
        elif isinstance(want, int) and not isinstance(want, bool):
            assert got == want, where
        else:
            assert got == pytest.approx(want, abs=1e-6), where

    for name, want in ref["overall"].items():
        close(report["overall"][name], want, f"overall {name}")
    assert len(report["per_layer"]) == len(ref["per_layer"])
    for layer, (got, want) in enumerate(zip(report["per_layer"], ref["per_layer"], strict=True)):
        assert got["layer"] == layer
        for name, value in want.items():
            close(got[name], value, f"layer {layer} {name}")
    assert report["per_request"] == ref["per_request"]


# ---------------------------------------------------------------------------------------
# Random cases


def _case_rows(meta: TraceMeta, rows: int, seed: int, *, interleave: bool, unknown: float):
    """Random rows; ``interleave`` shuffles the requests' rows together (trace order then
    mixes requests), ``unknown`` is the share of token ids replaced by -1."""
    batch = random_batch(meta, rows, seed=seed, requests=5)
    rng = np.random.default_rng(seed + 1000)
    order = rng.permutation(rows) if interleave else np.arange(rows)
    token_id = batch.token_id.copy()
    token_id[rng.random(rows) < unknown] = -1
    # a continuation (positions from 100) and a sample (every other position)
    position = batch.position.astype(np.int64)
    position[batch.request_id == 1] += 100
    position[batch.request_id == 2] *= 2
    return TraceBatch.from_arrays(
        batch.request_id[order], position[order], token_id[order], batch.experts[order],
        batch.weights[order],
    )  # fmt: skip


CASES = [
    # (ep, order, rows, batch_tokens, slack, levels, interleave, unknown)
    (2, 1, 150, 32, 1.1, 0, False, 0.0),
    (2, 2, 150, 50, 1.0, 3, True, 0.1),  # B divides the trace; slack 1: the tightest cap
    (4, 1, 150, 64, 1.1, 2, True, 0.2),
    (4, 2, 150, 40, 1.3, 0, False, 0.0),
    (4, 3, 150, 7, 1.1, 4, True, 0.1),  # tiny batches: the last one has 3 rows
    (8, 1, 150, 16, 1.05, 2, False, 0.1),  # one expert a device
    (8, 2, 150, 150, 1.1, 0, True, 0.0),  # one batch of the whole trace
    (2, 3, 150, 4096, 1.1, 3, False, 0.0),  # DESIGN.md's B, more than the trace
]


@pytest.mark.parametrize("ep, order, rows, b, slack, levels, interleave, unknown", CASES)
def test_every_figure_matches_the_reference(
    tmp_path, ep, order, rows, b, slack, levels, interleave, unknown
):
    meta = TraceMeta("test/ref", num_layers=4, num_experts=8, top_k=2, vocab_size=12)
    seed = ep * 10 + order
    batch = _case_rows(meta, rows, seed, interleave=interleave, unknown=unknown)
    path = write_trace(tmp_path / "t.parquet", meta, batch)
    bundle = _random_bundle(meta, ep, order, seed, levels)
    cfg = EvalConfig(batch_tokens=b, slack=slack, hidden_size=7, dtype_bytes=2, per_request=True)
    report = evaluate_bundle(bundle, open_trace(path), cfg)
    _assert_same(report, _reference(bundle, batch, cfg))


def test_a_trace_in_parts_is_one_trace_order(tmp_path):
    """Batches run on across part files, in part order, as over one file."""
    meta = TraceMeta("test/ref", num_layers=3, num_experts=8, top_k=3, vocab_size=9)
    batch = _case_rows(meta, 130, 5, interleave=True, unknown=0.1)
    cut = [0, 45, 47, 130]
    for i in range(3):
        part = batch.select(slice(cut[i], cut[i + 1]))
        write_trace(tmp_path / "held" / f"part-{i:05d}.parquet", meta, part)
    bundle = _random_bundle(meta, 4, 2, 9, levels=3)
    cfg = EvalConfig(batch_tokens=20, per_request=True)
    report = evaluate_bundle(bundle, open_trace(tmp_path / "held"), cfg)
    ref = _reference(bundle, batch, cfg)
    _assert_same(report, ref)
    assert ref["overall"]["all_to_all_bytes"] is None  # hidden_size 0: activations only


def test_a_short_last_batch_weighs_its_tokens_in_the_batch_imbalance(tmp_path):
    """Each batch's max/mean weighed the same: a last batch of one token reads E (its one
    token on one device), so one row past a whole batch took the mean from 1.65 to 4.74 and
    the worst to E at E = 8, whatever the plan."""
    meta = TraceMeta("test/ref", num_layers=2, num_experts=8, top_k=2, vocab_size=12)
    batch = _case_rows(meta, 65, 3, interleave=False, unknown=0.0)
    bundle = _random_bundle(meta, 8, 1, 3)
    cfg = EvalConfig(batch_tokens=32)
    figures = []
    for rows in (64, 65):
        path = write_trace(tmp_path / f"t{rows}.parquet", meta, batch.select(slice(0, rows)))
        figures.append(evaluate_bundle(bundle, open_trace(path), cfg)["overall"])
    whole, one_more = figures
    assert one_more["token_imbalance_batch_worst"] == whole["token_imbalance_batch_worst"] < 8
    assert one_more["token_imbalance_batch"] < whole["token_imbalance_batch"] * 1.1


def test_a_last_batch_nearly_full_counts_in_the_worst_batch_imbalance(tmp_path):
    """Only whole batches had counted: a last batch of 92% of a batch (the example's thirds,
    3786 of 4096 tokens) was left out of the worst while its token-weighted share raised the
    mean, and the JSON read a mean of 2.16 beside a worst of 1.88."""
    meta = TraceMeta("test/ref", num_layers=1, num_experts=4, top_k=1, vocab_size=8)
    # batch 1 (32 rows) sends its tokens to the 4 devices evenly; the last batch (30 rows)
    # all to device 0
    tokens = np.concatenate([np.arange(32) % 4, np.zeros(30, int)])
    experts = tokens.reshape(-1, 1, 1)
    batch = TraceBatch.from_arrays(
        np.zeros(62), np.arange(62), tokens, experts, np.ones(experts.shape)
    )
    bundle = Bundle.from_arrays(
        meta, ep_size=4, ngram_order=1, expert_to_device=[[0, 1, 2, 3]],
        token_to_device=[[0, 1, 2, 3, 0, 0, 0, 0]], token_confidence=np.ones((1, 8)),
        ngram_to_device=np.zeros((1, 4), int), ngram_confidence=np.zeros((1, 4)),
    )  # fmt: skip
    path = write_trace(tmp_path / "t.parquet", meta, batch)
    ov = evaluate_bundle(bundle, open_trace(path), EvalConfig(batch_tokens=32))["overall"]
    assert ov["token_imbalance_batch_worst"] == pytest.approx(4.0)
    assert ov["token_imbalance_batch"] <= ov["token_imbalance_batch_worst"]


def test_capacity_rule_matches_the_reference():
    """The runtime's assign_with_capacity against the rule as docs/metrics.md states it, with
    many confidence ties and second choices competing for the same free slots."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        ep = int(rng.integers(1, 6))
        t = int(rng.integers(1, 40))
        cap = max(math.ceil(t / ep), int(rng.integers(0, t + 2)))
        skew = rng.random(ep) ** 3
        device = rng.choice(ep, t, p=skew / skew.sum())
        conf = (rng.integers(0, 4, t) / 4).astype(np.float32)
        second = np.where(rng.random(t) < 0.6, rng.integers(0, ep, t), -1)
        second = np.where(second == device, -1, second)
        second_conf = (rng.integers(0, 3, t) / 3).astype(np.float32)
        got = assign_with_capacity(device, conf, cap, ep, second, second_conf)
        want = _assign_reference(
            device.tolist(), conf.tolist(), second.tolist(), second_conf.tolist(), cap, ep
        )
        assert got.tolist() == want, trial
        plain = assign_with_capacity(device, conf, cap, ep)
        want = _assign_reference(device.tolist(), conf.tolist(), [-1] * t, [0.0] * t, cap, ep)
        assert plain.tolist() == want, trial


def test_the_runtime_routes_each_batch_as_the_reference():
    """PlanTables.route with the cap (what a runtime calls, layer by layer, on one batch)
    sends every token where the reference's balanced assignment does."""
    meta = TraceMeta("test/ref", num_layers=4, num_experts=8, top_k=2, vocab_size=12)
    for ep, order in ((2, 1), (4, 2), (4, 3)):
        bundle = _random_bundle(meta, ep, order, ep + order, levels=3)
        tables = PlanTables.from_bundle(bundle)
        batch = random_batch(meta, 60, seed=ep * order)
        experts = batch.experts.astype(np.int64)
        cap = _cap(60, ep, 1.1)
        e2d = bundle.expert_to_device
        for layer in range(4):
            prev = torch.from_numpy(experts[:, max(layer - order, 0) : layer, 0].copy())
            got = tables.route(
                torch.from_numpy(batch.token_id.astype(np.int64)), layer,
                prev if layer >= order else None, cap,
            ).tolist()  # fmt: skip
            choice, conf, second, second_conf = [], [], [], []
            for t in range(60):
                tok = int(batch.token_id[t])
                td, tc = (
                    int(bundle.token_to_device[layer, tok]),
                    float(bundle.token_confidence[layer, tok]),
                )
                nd, nc = None, 0.0
                if layer >= order:
                    row = 0
                    for j in range(layer - order, layer):
                        row = row * ep + int(e2d[j, experts[t, j, 0]])
                    nd, nc = (
                        int(bundle.ngram_to_device[layer, row]),
                        float(bundle.ngram_confidence[layer, row]),
                    )
                if nd is not None and nc > tc:
                    pick, other = (nd, nc), (td, tc)
                else:
                    pick, other = (td, tc), ((nd, nc) if nc > 0 else (None, 0.0))
                choice.append(pick[0])
                conf.append(pick[1])
                keep_other = other[0] is not None and other[0] != pick[0]
                second.append(other[0] if keep_other else -1)
                second_conf.append(other[1] if keep_other else 0.0)
            assert got == _assign_reference(choice, conf, second, second_conf, cap, ep)


def test_random_shapes_match_the_reference(tmp_path):
    """Forty random shapes: 1-5 layers, k up to N, E from 1 to 8, n from 1 to 3, any B and
    slack, from no to all token ids unknown, requests in order or interleaved."""
    rng = np.random.default_rng(7)
    for case in range(40):
        ep = int(rng.choice([1, 2, 4, 8]))
        n = ep * int(rng.integers(1, 4))
        meta = TraceMeta(
            "test/ref", num_layers=int(rng.integers(1, 6)), num_experts=n,
            top_k=int(rng.integers(1, n + 1)), vocab_size=int(rng.integers(2, 20)),
        )  # fmt: skip
        order = int(rng.integers(1, 4))
        batch = _case_rows(
            meta, int(rng.integers(1, 120)), case,
            interleave=bool(rng.random() < 0.5), unknown=float(rng.choice([0, 0.1, 0.5, 1.0])),
        )  # fmt: skip
        bundle = _random_bundle(meta, ep, order, case, levels=int(rng.choice([0, 1, 2, 5])))
        path = write_trace(tmp_path / f"t{case}.parquet", meta, batch)
        cfg = EvalConfig(
            batch_tokens=int(rng.integers(1, 150)),
            slack=float(rng.choice([1.0, 1.05, 1.1, 4 / 3, 2.0])),
            hidden_size=int(rng.integers(0, 5)),
            dtype_bytes=int(rng.integers(1, 4)),
            per_request=True,
        )
        _assert_same(evaluate_bundle(bundle, open_trace(path), cfg), _reference(bundle, batch, cfg))


def test_compare_rows_are_evaluate_figures_of_the_solved_plans(tmp_path, capsys):
    """`moeplan compare --json`: each row's figures are `moeplan evaluate --json`'s for the
    plan `moeplan solve` writes with the same settings, and the ratio columns are those
    figures' ratios; the 90% interval brackets the ratio of the per-request sums."""
    synth = SynthConfig(
        num_layers=3, num_experts=8, top_k=2, vocab_size=60, num_tokens=900, num_requests=12,
        affinity=0.8, seed=3,
    )  # fmt: skip
    trace = str(synth_predictor(tmp_path, synth))
    pred, args = str(tmp_path / "pred"), ["--ep", "4", "--batch-tokens", "100"]
    methods = ("kmeans", "metis", "vanilla")
    assert main(["compare", pred, trace, "--methods", ",".join(methods), *args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    overall, per_request = {}, {}
    for method in methods:
        plan = str(tmp_path / method)
        assert main(["solve", pred, "--ep", "4", "--method", method, "--out", plan]) == 0
        capsys.readouterr()
        assert main(["evaluate", plan, trace, "--batch-tokens", "100", "--json"]) == 0
        overall[method] = json.loads(capsys.readouterr().out)["overall"]
        cfg = EvalConfig(batch_tokens=100, per_request=True)
        report = evaluate_bundle(load_tables(plan), open_trace(trace), cfg)
        per_request[method] = report["per_request"]["local_balanced"]
    best = max(("kmeans", "metis"), key=lambda m: overall[m]["lar_balanced"])
    assert result["best_baseline"] == best
    assert result["oracle_bound"] == overall["kmeans"]["oracle_bound"]
    assert result["lar_vanilla"] == overall["vanilla"]["lar_vanilla"]
    assert result["requests"] == 12
    for row in result["rows"]:
        ov = overall[row["method"]]
        for name in (
            "lar_balanced", "lar", "lar_token", "lar_ngram", "token_imbalance",
            "token_imbalance_balanced", "expert_load_imbalance",
        ):  # fmt: skip
            assert row[name] == ov[name], (row["method"], name)
        bal = ov["lar_balanced"]
        assert row["gap_to_bound"] == pytest.approx(ov["oracle_bound"] - bal, abs=1e-6)
        ratio = bal / overall[best]["lar_balanced"]
        assert row["ratio_to_best_baseline"] == pytest.approx(ratio, abs=1e-4)
        assert row["ratio_to_vanilla"] == pytest.approx(bal / ov["lar_vanilla"], abs=1e-4)
        if row["method"] == best:
            assert row["ratio_ci90"] is None
        else:
            a, b = per_request[row["method"]], per_request[best]
            low, high = ratio_interval(a, b)
            assert row["ratio_ci90"] == [round(low, 4), round(high, 4)]
            assert low <= sum(a) / sum(b) <= high
