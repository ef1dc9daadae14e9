"""Synthetic traces: determinism, shapes, routing invariants and the structure the knobs promise."""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest

from planner.cli.main import main
from planner.errors import InputError
from planner.trace import TraceBatch, open_trace
from planner.trace.info import LoadAccumulator
from planner.trace.synth import (
    DEEPSEEK_V3,
    SynthConfig,
    SynthGenerator,
    preset_config,
    synthesize,
)

SMALL = SynthConfig(
    num_layers=4, num_experts=16, top_k=4, vocab_size=2000, num_tokens=6000, num_requests=30
)


def _all(config: SynthConfig, batch_rows: int = 65536) -> TraceBatch:
    return TraceBatch.concat(list(SynthGenerator(config).batches(batch_rows)))


def _same(a: TraceBatch, b: TraceBatch) -> bool:
    cols = ("request_id", "position", "token_id", "experts", "weights")
    return all(np.array_equal(getattr(a, c), getattr(b, c)) for c in cols) and np.array_equal(
        a.extras["domain"], b.extras["domain"]
    )


def test_same_config_gives_identical_rows_whatever_the_batch_size():
    a = _all(SMALL, batch_rows=65536)
    b = _all(SMALL, batch_rows=777)
    assert _same(a, b)
    assert not _same(a, _all(dataclasses.replace(SMALL, seed=1)))


def test_synthesize_is_byte_identical(tmp_path):
    p1 = synthesize(SMALL, tmp_path / "a.parquet")
    p2 = synthesize(SMALL, tmp_path / "b.parquet")
    assert p1.read_bytes() == p2.read_bytes()


def test_shapes_meta_and_request_layout():
    gen = SynthGenerator(SMALL)
    batches = list(gen.batches(batch_rows=1000))
    assert [len(b) for b in batches] == [1000] * 6
    b = TraceBatch.concat(batches)
    b.validate(gen.meta)
    m = gen.meta
    assert (m.num_layers, m.num_experts, m.top_k, m.vocab_size) == (4, 16, 4, 2000)
    assert SynthConfig.from_json(m.source) == SMALL
    assert b.experts.shape == (6000, 4, 4) and b.experts.dtype == np.int16
    assert b.weights.dtype == np.float16
    # Request-major: ids ascend, each request's positions run 0, 1, 2, ...
    assert (np.diff(b.request_id) >= 0).all()
    assert np.unique(b.request_id).size == SMALL.num_requests
    starts = np.r_[True, b.request_id[1:] != b.request_id[:-1]]
    assert (b.position[starts] == 0).all()
    assert (b.position[~starts] == b.position[np.flatnonzero(~starts) - 1] + 1).all()
    lengths = np.bincount(b.request_id)
    assert lengths.min() >= 1 and lengths.std() > 0  # lengths vary
    # A request's rows all share its domain.
    dom = b.extras["domain"]
    assert dom.min() >= 0 and dom.max() < SMALL.num_domains
    assert all(np.unique(dom[b.request_id == r]).size == 1 for r in range(SMALL.num_requests))


def test_deepseek_preset_meta():
    gen = SynthGenerator(dataclasses.replace(DEEPSEEK_V3, num_tokens=10, num_requests=2))
    assert (gen.meta.num_layers, gen.meta.num_experts, gen.meta.top_k) == (58, 256, 8)
    assert gen.meta.vocab_size == 129280
    assert gen.meta.moe_layer_indices == tuple(range(3, 61))


@pytest.mark.parametrize(
    "config",
    [
        SMALL,
        dataclasses.replace(SMALL, affinity=0.0, expert_zipf=2.0),
        # k close to N with heavy skew: duplicates are frequent and must still be resolved.
        dataclasses.replace(SMALL, num_experts=8, top_k=7, expert_zipf=3.0, affinity=0.3),
        dataclasses.replace(SMALL, num_experts=5, top_k=5, layer_correlation=1.0),
        # so steep that most experts' probabilities underflow to 0: their log -inf tied
        # with the row's masked experts, which were drawn again (a trace nothing could read)
        dataclasses.replace(SMALL, num_experts=16, top_k=4, expert_zipf=1000.0),
    ],
)
def test_experts_distinct_and_weights_descending_summing_to_one(config):
    b = _all(config)
    srt = np.sort(b.experts, axis=2)
    assert (srt[:, :, 1:] != srt[:, :, :-1]).all()
    assert b.experts.min() >= 0 and b.experts.max() < config.num_experts
    w = b.weights.astype(np.float32)
    assert (w > 0).all()
    assert (np.diff(w, axis=2) <= 0).all()
    np.testing.assert_allclose(w.sum(axis=2), 1.0, atol=5e-3)
    gen = SynthGenerator(config)
    pref = gen.preferred_table
    srt = np.sort(pref, axis=2)
    assert (srt[:, :, 1:] != srt[:, :, :-1]).all()


def test_affinity_one_routes_every_occurrence_to_its_preferred_set():
    config = dataclasses.replace(SMALL, affinity=1.0, layer_correlation=0.0)
    gen = SynthGenerator(config)
    b = TraceBatch.concat(list(gen.batches()))
    for layer in range(config.num_layers):
        want = np.sort(gen.preferred_experts(b.token_id, layer), axis=1)
        np.testing.assert_array_equal(np.sort(b.experts[:, layer], axis=1), want)


def _overlap(experts: np.ndarray, preferred: np.ndarray) -> float:
    """Mean number of a row's experts [T, k] that are in its preferred set [T, k]."""
    return float((experts[:, :, None] == preferred[:, None, :]).any(axis=2).sum(axis=1).mean())


def test_affinity_zero_makes_routing_independent_of_the_token():
    config = dataclasses.replace(SMALL, num_tokens=20000, affinity=0.0)
    gen = SynthGenerator(config)
    b = TraceBatch.concat(list(gen.batches()))
    shuffled = np.random.default_rng(0).permutation(b.token_id)
    for layer in range(config.num_layers):
        real = _overlap(b.experts[:, layer], gen.preferred_experts(b.token_id, layer))
        chance = _overlap(b.experts[:, layer], gen.preferred_experts(shuffled, layer))
        assert abs(real - chance) < 0.05, (layer, real, chance)
    # ... while a little affinity ties routing to the token well above chance.
    gen = SynthGenerator(dataclasses.replace(config, affinity=0.5, layer_correlation=0.0))
    b = TraceBatch.concat(list(gen.batches()))
    real = _overlap(b.experts[:, 1], gen.preferred_experts(b.token_id, 1))
    chance = _overlap(b.experts[:, 1], gen.preferred_experts(shuffled, 1))
    assert real > chance + 1.0


def test_token_frequencies_have_a_long_tail():
    b = _all(dataclasses.replace(SMALL, vocab_size=20000, num_tokens=20000))
    counts = np.bincount(b.token_id)
    counts = np.sort(counts[counts > 0])[::-1]
    assert counts[0] > 50 * np.median(counts)  # a few very frequent tokens
    assert (counts <= 2).mean() > 0.4  # and many rare ones
    flat = _all(dataclasses.replace(SMALL, vocab_size=200, num_tokens=20000, token_zipf=0.0))
    flat_counts = np.bincount(flat.token_id, minlength=200)
    assert flat_counts.max() < 3 * flat_counts.mean()


def _skewness(config: SynthConfig) -> float:
    gen = SynthGenerator(config)
    acc = LoadAccumulator(gen.meta)
    for batch in gen.batches():
        acc.add(batch)
    return float(acc.skewness.mean())


def test_expert_zipf_skews_the_load():
    base = dataclasses.replace(SMALL, num_tokens=20000, affinity=0.0)
    assert _skewness(dataclasses.replace(base, expert_zipf=0.0)) < 1.15
    assert _skewness(dataclasses.replace(base, expert_zipf=1.0)) > 2.0
    # Preferred sets follow popularity too, so the skew holds with full affinity.
    assert _skewness(dataclasses.replace(base, affinity=1.0, expert_zipf=1.0)) > 2.0


def _next_top1_accuracy(config: SynthConfig) -> tuple[float, float]:
    """(accuracy of predicting layer l's top-1 from layer l-1's top-1, most-popular baseline)."""
    b = _all(config)
    top1 = b.experts[:, :, 0].astype(np.int64)
    n, half = config.num_experts, len(b) // 2
    acc, base = [], []
    for layer in range(1, config.num_layers):
        table = np.zeros((n, n))
        np.add.at(table, (top1[:half, layer - 1], top1[:half, layer]), 1)
        pred = table.argmax(axis=1)[top1[half:, layer - 1]]
        acc.append((pred == top1[half:, layer]).mean())
        base.append((top1[half:, layer] == np.bincount(top1[:half, layer]).argmax()).mean())
    return float(np.mean(acc)), float(np.mean(base))


def test_layer_correlation_makes_next_top1_predictable():
    base = dataclasses.replace(SMALL, num_experts=32, num_tokens=20000, affinity=0.9)
    corr, chance = _next_top1_accuracy(dataclasses.replace(base, layer_correlation=0.8))
    none, _ = _next_top1_accuracy(dataclasses.replace(base, layer_correlation=0.0))
    assert corr > chance + 0.3
    assert corr > none + 0.2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", 17),
        ("affinity", 1.5),
        ("affinity", -0.1),
        ("layer_correlation", float("nan")),
        ("num_layers", 0),
        ("num_experts", 40000),
        ("num_requests", 7000),
        ("token_zipf", -1.0),
        ("seed", -1),
        ("num_domains", 2001),
        ("vocab_size", True),
    ],
)
def test_invalid_config_raises_input_error(field, value):
    with pytest.raises(InputError, match=field):
        dataclasses.replace(SMALL, **{field: value})


def test_numpy_numbers_are_stored_as_python_numbers(tmp_path):
    # They went into the trace's source JSON as they were: a JSON TypeError traceback.
    config = dataclasses.replace(
        SMALL, num_tokens=np.int64(6000), seed=np.uint64(0), token_zipf=np.float32(1.1),
        affinity=np.float64(0.8),
    )  # fmt: skip
    assert type(config.num_tokens) is int and type(config.token_zipf) is float
    meta = open_trace(synthesize(config, tmp_path / "t.parquet")).meta
    assert SynthConfig.from_json(meta.source) == config


def test_preset_overrides_and_unknown_preset():
    cfg = preset_config("deepseek-v3", num_tokens=1000, num_requests=None)
    assert cfg.num_experts == 256 and cfg.num_tokens == 1000 and cfg.num_requests == 400
    with pytest.raises(InputError, match="unknown preset"):
        preset_config("nope")


def test_preferred_experts_checks_its_arguments():
    gen = SynthGenerator(SMALL)
    with pytest.raises(InputError, match="layer"):
        gen.preferred_experts(np.array([1]), 4)
    with pytest.raises(InputError, match="token id"):
        gen.preferred_experts(np.array([2000]), 0)
    assert gen.preferred_experts(np.array([3, 3]), 0).shape == (2, 4)


def test_directory_output_parts_and_refusal_to_overwrite(tmp_path):
    out = synthesize(SMALL, tmp_path / "tr", rows_per_part=2500)
    trace = open_trace(out)
    assert [p.name for p in trace.parts] == [
        "part-00000.parquet", "part-00001.parquet", "part-00002.parquet"
    ]  # fmt: skip
    assert trace.part_rows == [2500, 2500, 1000]
    assert _same(trace.read_all(extras=("domain",)), _all(SMALL))
    with pytest.raises(InputError, match="already exists"):
        synthesize(SMALL, out)
    synthesize(dataclasses.replace(SMALL, num_tokens=100, num_requests=3), out, overwrite=True)
    assert open_trace(out).num_rows == 100
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left


def test_cli_synth(tmp_path, capsys):
    out = tmp_path / "t.parquet"
    args = ["trace", "synth", "--out", str(out), "--layers", "3", "--experts", "8",
            "--top-k", "2", "--vocab", "100", "--tokens", "500", "--requests", "5",
            "--seed", "3", "--json"]  # fmt: skip
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tokens"] == 500 and summary["num_experts"] == 8
    meta = open_trace(out).meta
    assert SynthConfig.from_json(meta.source).seed == 3
    assert meta.moe_layer_indices == (0, 1, 2)
    dense_first = [*args[:3], str(tmp_path / "d.parquet"), *args[4:], "--first-moe-layer", "1"]
    assert main(dense_first) == 0  # a DeepSeek-V2-Lite-like model: layer 0 is dense
    capsys.readouterr()
    assert open_trace(tmp_path / "d.parquet").meta.moe_layer_indices == (1, 2, 3)
    assert main(["trace", "synth", "--out", str(tmp_path / "x"), "--top-k", "65"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "moeplan: error: synth: top_k=65 exceeds num_experts=64; choose top_k <= num_experts"
    ]


def test_a_moderate_config_generates_every_row(record_property):
    """32 layers x 128 experts x top-8 over 100k tokens: every row comes out. Its rows/s is
    recorded as a property, not checked (speed is the benchmarks' business, not a test's)."""
    config = SynthConfig(
        num_layers=32, num_experts=128, top_k=8, vocab_size=50000, num_tokens=100_000
    )
    t0 = time.perf_counter()
    rows = sum(len(b) for b in SynthGenerator(config).batches())
    seconds = time.perf_counter() - t0
    record_property("synth_rows_per_second", rows / seconds)
    assert rows == 100_000


def test_guide_table_sampler_agrees_with_bisection():
    from planner.trace.synth import _GroupedCdf, _zipf_probs

    rng = np.random.default_rng(1)
    probs = [_zipf_probs(1000, 3.0), _zipf_probs(7, 2.0), rng.dirichlet(np.full(300, 0.1))]
    cdf = _GroupedCdf(probs)
    group = rng.integers(0, 3, 100_000)
    u = rng.random(100_000)
    u[:5] = np.nextafter(1.0, 0.0)  # g + u rounds to g + 1: must stay in group g
    got = cdf.sample(u, group)
    want = np.searchsorted(np.concatenate([np.cumsum(p) + g for g, p in enumerate(probs)]),
                           u + group, side="right")  # fmt: skip
    want = np.minimum(want, cdf.offsets[group + 1] - 1)
    np.testing.assert_array_equal(got, want)
    assert ((got >= cdf.offsets[group]) & (got < cdf.offsets[group + 1])).all()


def test_force_replaces_only_an_earlier_trace(tmp_path, capsys):
    small = dataclasses.replace(SMALL, num_tokens=100, num_requests=3)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("keep")
    with pytest.raises(InputError, match="non-empty directory that is not a trace"):
        synthesize(small, notes, overwrite=True)
    assert [p.name for p in notes.iterdir()] == ["notes.txt"]
    afile = tmp_path / "f"
    afile.write_text("keep")
    args = ["trace", "synth", "--out", str(afile), "--force", "--tokens", "100", "--requests", "3"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"moeplan: error: {afile}: exists and is a file; a trace is a directory"]
    assert afile.read_text() == "keep"
    # An earlier trace, and an empty directory, are replaced.
    (tmp_path / "empty").mkdir()
    synthesize(small, tmp_path / "empty", overwrite=True)
    out = synthesize(small, tmp_path / "tr")
    synthesize(dataclasses.replace(small, num_tokens=50), out, overwrite=True)
    assert open_trace(out).num_rows == 50


def test_force_replaces_a_single_file_only_if_it_is_a_trace(tmp_path, capsys):
    """``--out X.parquet --force`` onto a user's own Parquet table (or a counts table) is
    refused, the file kept; an earlier single-file trace is replaced."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    small = dataclasses.replace(SMALL, num_tokens=100, num_requests=3)
    mine = tmp_path / "mydata.parquet"
    pq.write_table(pa.table({"user": [1, 2, 3]}), mine)
    before = mine.read_bytes()
    args = ["trace", "synth", "--out", str(mine), "--force", "--tokens", "100", "--requests", "3"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"moeplan: error: {mine}: exists and is not a trace (--force replaces only an earlier "
        "trace); choose another output path"
    ]
    assert mine.read_bytes() == before
    earlier = synthesize(small, tmp_path / "t.parquet")
    synthesize(dataclasses.replace(small, num_tokens=50), earlier, overwrite=True)
    assert open_trace(earlier).num_rows == 50


def test_metadata_with_a_scalar_layer_list_is_one_line(tmp_path, capsys):
    import pyarrow.parquet as pq

    out = synthesize(
        dataclasses.replace(SMALL, num_tokens=100, num_requests=3), tmp_path / "t.parquet"
    )
    table = pq.read_table(out)
    meta = json.loads(table.schema.metadata[b"moeplan"])
    for bad in (1, True, 5.0, "ab"):
        meta["moe_layer_indices"] = bad
        path = tmp_path / "bad.parquet"
        pq.write_table(table.replace_schema_metadata({b"moeplan": json.dumps(meta).encode()}), path)
        assert main(["trace", "info", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"moeplan: error: {path}: "), err
        assert "moe_layer_indices" in err[0]


@pytest.mark.parametrize(
    "change", [{"num_tokens": 10**20}, {"num_layers": 10**20}, {"first_moe_layer": 10**20}]
)
def test_sizes_beyond_any_machine_are_one_line(change):
    # an OverflowError traceback from numpy before
    with pytest.raises(InputError, match="exceeds"):
        dataclasses.replace(SMALL, **change)
