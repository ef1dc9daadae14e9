"""The token->expert table: confidence, top-k, top-1, fallbacks, persistence."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from safetensors.numpy import save_file

from planner.errors import InputError, SchemaError
from planner.predict.affinity import TokenExpertAffinity, load_embeddings, nearest_known_tokens
from planner.predict.counts import CountsAccumulator, counts_from_triples
from planner.trace import TraceMeta
from planner.trace.io import open_trace

META = TraceMeta("test/aff", num_layers=2, num_experts=6, top_k=2, vocab_size=8)


def hand_counts():
    """Token 1: experts {0: 4, 3: 4, 5: 2}; token 2: {1: 2, 2: 2}; layer 1 only token 1."""
    rows = [(0, 1, 0, 4), (0, 1, 3, 4), (0, 1, 5, 2), (0, 2, 1, 2), (0, 2, 2, 2), (1, 1, 4, 10)]
    layer, tok, ex, cnt = (np.array(c) for c in zip(*rows, strict=True))
    return counts_from_triples(META, layer, tok, ex, cnt)


def test_confidence_topk_and_expected_activations():
    aff = TokenExpertAffinity().fit(hand_counts())
    cp = aff.confidence(0).toarray()
    np.testing.assert_allclose(cp[1], [0.4, 0, 0, 0.4, 0, 0.2])
    np.testing.assert_allclose(cp.sum(axis=1)[[1, 2]], 1.0)
    assert cp[0].sum() == 0  # unseen token: empty row
    np.testing.assert_array_equal(
        aff.token_counts_[:3], [0, 5, 1]
    )  # (10/2 + 10/2) / 2, (4/2 + 0)/2
    w = aff.expected_activations(0)
    np.testing.assert_allclose(w.sum(axis=1)[1], 10.0)
    top = aff.predict_topk(np.array([1, 2]), 0)
    assert sorted(top[0].tolist()) == [0, 3]
    assert sorted(top[1].tolist()) == [1, 2]


def test_ties_break_towards_popular_experts_and_short_rows_are_filled():
    aff = TokenExpertAffinity().fit(hand_counts())
    # Layer 1: token 1 saw only expert 4; its second expert is the layer's most popular
    # among the rest (all zero load: the lowest id).
    assert aff.predict_topk(np.array([1]), 1).tolist() == [[4, 0]]
    # Layer 0 load: expert 0 and 3 have 4, 1 and 2 have 2, 5 has 2: 0 before 3 (lower id).
    assert aff.predict_topk(np.array([1]), 0).tolist() == [[0, 3]]
    assert aff.global_topk_[0].tolist() == [0, 3]


def test_unseen_and_unknown_tokens_use_the_global_top_k():
    aff = TokenExpertAffinity().fit(hand_counts())
    assert aff.fallback_ == "global"
    out = aff.predict_topk(np.array([7, -1]), 0)
    assert out.tolist() == [aff.global_topk_[0].tolist()] * 2
    with pytest.raises(InputError, match="outside"):
        aff.predict_topk(np.array([8]), 0)
    with pytest.raises(InputError, match="not fitted"):
        TokenExpertAffinity().predict_topk(np.array([1]), 0)


@pytest.mark.parametrize(
    "ids", [np.array([1.7]), np.array([np.nan]), np.array([2**64 - 1], np.uint64)]
)
def test_token_ids_that_are_not_integers_are_refused(ids):
    """1.7 read token 1; a uint64 past int64 wrapped to -1, the unknown token."""
    aff = TokenExpertAffinity().fit(hand_counts())
    with pytest.raises(InputError, match="must be integers"):
        aff.predict_topk(ids, 0)
    assert aff.predict_topk(np.array([], np.float64), 0).shape == (0, 2)


def test_routed_share_refuses_expert_ids_outside_the_layer():
    """Expert 6 of 6 read the count of token 2's expert 0 (key 1 * 6 + 6 = 2 * 6 + 0)."""
    aff = TokenExpertAffinity().fit(hand_counts())
    np.testing.assert_allclose(aff.routed_share(np.array([1]), np.array([[0, 3]]), 0), [[0.8, 0.8]])
    for bad in (6, -1):
        with pytest.raises(InputError, match=r"expert ids must lie in \[0, 6\)"):
            aff.routed_share(np.array([1]), np.array([[0, bad]]), 0)


def test_embedding_fallback_borrows_the_nearest_known_token():
    # Token 6 (unseen) points the same way as token 2; token 7 the same way as token 1.
    emb = np.zeros((8, 3), np.float32)
    emb[1] = [1, 0, 0]
    emb[2] = [0, 1, 0]
    emb[6] = [0.1, 2.0, 0.05]
    emb[7] = [3.0, -0.2, 0.1]
    aff = TokenExpertAffinity().fit(hand_counts(), emb)
    assert aff.fallback_ == "embedding"
    assert aff.nearest_known_[[1, 2, 6, 7]].tolist() == [1, 2, 2, 1]
    assert aff.nearest_known_[0] == -1  # zero embedding: no neighbour
    np.testing.assert_array_equal(
        aff.predict_topk(np.array([6, 7]), 0), aff.predict_topk(np.array([2, 1]), 0)
    )
    glob = aff.without_embedding_fallback()
    assert glob.predict_topk(np.array([6]), 0).tolist() == [aff.global_topk_[0].tolist()]
    with pytest.raises(InputError, match="disagrees with the vocabulary"):
        TokenExpertAffinity().fit(hand_counts(), emb[:5])


def test_nearest_known_is_cosine_not_euclidean():
    emb = np.array([[1.0, 0.0], [0.0, 10.0], [5.0, 0.5]], np.float32)
    seen = np.array([True, True, False])
    assert nearest_known_tokens(emb, seen).tolist() == [0, 1, 0]


def test_nearest_known_is_scale_free_for_tiny_embeddings_too():
    # a known row below the old 1e-12 floor kept its tiny length and lost every match, and
    # a subnormal query made every product 0 (the first known token won)
    emb = np.array([[1e-13, 0, 0], [0.5, 0.5, 0], [1, 0, 0]], np.float32)
    assert nearest_known_tokens(emb, np.array([True, True, False])).tolist() == [0, 1, 0]
    emb = np.array([[1, 0], [0.6, 0.8], [1e-40, 1e-40]], np.float32)
    assert nearest_known_tokens(emb, np.array([True, True, False])).tolist() == [0, 1, 1]
    rng = np.random.default_rng(1)
    base = rng.integers(-3, 4, size=(100, 8)).astype(np.float32)
    seen = rng.random(100) < 0.5
    for scale in (1e-14, 1e-30):
        got = nearest_known_tokens(base * np.float32(scale), seen)
        assert got.tolist() == nearest_known_tokens(base, seen).tolist()


def test_nearest_known_survives_huge_embeddings():
    # Squares of float32 values near 1e30 overflow: the match must be scale-free, no warning.
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(200, 16)).astype(np.float32)
    seen = rng.random(200) < 0.5
    expected = nearest_known_tokens(emb, seen)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert nearest_known_tokens(emb * np.float32(1e30), seen).tolist() == expected.tolist()


def test_load_embeddings_formats(tmp_path):
    emb = np.random.default_rng(0).random((8, 4)).astype(np.float32)
    np.save(tmp_path / "e.npy", emb)
    save_file(
        {"embeddings": emb.astype(np.float16), "other": np.zeros(3, np.float32)},
        str(tmp_path / "e.safetensors"),
    )
    np.testing.assert_allclose(load_embeddings(tmp_path / "e.npy", 8), emb)
    np.testing.assert_allclose(load_embeddings(tmp_path / "e.safetensors", 8), emb, atol=1e-3)
    with pytest.raises(InputError, match="disagrees"):
        load_embeddings(tmp_path / "e.npy", 9)
    (tmp_path / "e.txt").write_text("x")
    with pytest.raises(InputError):
        load_embeddings(tmp_path / "e.txt", 8)
    bad = emb.astype(np.float64)
    bad[5, 1] = np.nan
    np.save(tmp_path / "nan.npy", bad)
    with pytest.raises(InputError, match="row 5 holds a NaN or infinite value"):
        load_embeddings(tmp_path / "nan.npy", 8)
    bad[5, 1] = 1e300  # finite in float64, infinite once in float32
    np.save(tmp_path / "big.npy", bad)
    with pytest.raises(InputError, match="row 5 holds a NaN or infinite value"):
        load_embeddings(tmp_path / "big.npy", 8)
    np.save(tmp_path / "empty.npy", np.zeros((8, 0), np.float32))
    with pytest.raises(InputError, match="no columns"):
        load_embeddings(tmp_path / "empty.npy", 8)
    with open(tmp_path / "zip.npy", "wb") as f:  # an .npz archive under an .npy name
        np.savez(f, a=emb)
    for header_only in (True, False):
        with pytest.raises(InputError, match="is an .npz archive, not a .npy array"):
            load_embeddings(tmp_path / "zip.npy", 8, header_only=header_only)


def test_top1_is_the_most_frequent_rank0_expert(small_meta):
    # Token 3 always routes to {5, 2} with 2 ranked first; the set's counts tie.
    from tests.predict.conftest import chain_batch

    tokens = np.array([3, 3, 3, 4])
    batch = chain_batch(small_meta, tokens, np.array([0, 0, 1, 1]))
    acc = CountsAccumulator(small_meta)
    acc.add(batch.token_id, batch.experts)
    aff = TokenExpertAffinity().fit(acc.result())
    for layer in range(small_meta.num_layers):
        top1 = aff.predict_top1(np.array([3, 4]), layer)
        assert top1.tolist() == [(3 + layer) % 8, (4 + layer) % 8]
        assert aff.predict_topk(np.array([3]), layer)[0, 0] == (3 + layer) % 8


def test_tensor_round_trip_preserves_predictions(exact_trace):
    path, _ = exact_trace
    trace = open_trace(path)
    acc = CountsAccumulator(trace.meta)
    batch = trace.read_all()
    acc.add(batch.token_id, batch.experts)
    counts = acc.result()
    emb = np.random.default_rng(0).random((trace.meta.vocab_size, 5)).astype(np.float32)
    aff = TokenExpertAffinity(confident_threshold=0.3).fit(counts, emb)
    back = TokenExpertAffinity.from_tensors(
        trace.meta, aff.to_tensors(), fallback=aff.fallback_, confident_threshold=0.3
    )
    ids = np.arange(-1, trace.meta.vocab_size)
    for layer in range(trace.meta.num_layers):
        np.testing.assert_array_equal(back.predict_topk(ids, layer), aff.predict_topk(ids, layer))
        np.testing.assert_array_equal(back.predict_top1(ids, layer), aff.predict_top1(ids, layer))
    tensors = aff.to_tensors()
    tensors["indices"] = tensors["indices"].copy()
    tensors["indices"][0] = 99
    with pytest.raises(SchemaError, match="outside"):
        TokenExpertAffinity.from_tensors(
            trace.meta, tensors, fallback="global", confident_threshold=0.5
        )


def test_seen_tokens_recover_their_preferred_sets(exact_trace):
    path, gen = exact_trace
    trace = open_trace(path)
    acc = CountsAccumulator(trace.meta)
    for b in trace.iter_batches(4096):
        acc.add(b.token_id, b.experts)
    aff = TokenExpertAffinity().fit(acc.result())
    seen = np.flatnonzero(aff.seen_)
    for layer in range(trace.meta.num_layers):
        pred = np.sort(aff.predict_topk(seen, layer), axis=1)
        truth = np.sort(gen.preferred_experts(seen, layer), axis=1)
        np.testing.assert_array_equal(pred, truth)


def test_layer_problem_inputs_are_compact_and_consistent():
    aff = TokenExpertAffinity().fit(hand_counts())
    ids, w, a = aff.layer_problem_inputs(0)
    assert ids.tolist() == [1, 2]
    np.testing.assert_allclose(w.sum(axis=1), [10, 4])
    np.testing.assert_allclose(a, [5, 1])


def test_thinned_counts_keep_seen_tokens_weighing_and_shares_per_layer():
    # Thinned counts (fit --holdout on a counts table) count each layer on other samples:
    # a token seen once keeps about half its k activations a layer. Rounding the layers'
    # mean occurrence gave such seen tokens a_j = 0 (a solver then read them as weighing
    # nothing) and routed shares of 0, while the confident sets divided by max(a_j, 1).
    from planner.predict.split import thin_counts

    big_l, n, k, v = 8, 16, 4, 300
    meta = TraceMeta(model="m", num_layers=big_l, num_experts=n, top_k=k, vocab_size=v)
    rng = np.random.default_rng(0)
    layer = np.repeat(np.arange(big_l), v * k)
    token = np.tile(np.repeat(np.arange(v), k), big_l)
    expert = np.concatenate([rng.permutation(n)[:k] for _ in range(big_l * v)])
    counts = counts_from_triples(meta, layer, token, expert, np.ones(layer.size, np.int64))
    fit, _ = thin_counts(counts, 0.5, seed=0)
    aff = TokenExpertAffinity(confident_threshold=0.5).fit(fit)
    assert (aff.token_counts_[aff.seen_] >= 1).all()
    assert (aff.token_counts_[~aff.seen_] == 0).all()
    _, _, a = aff.layer_problem_inputs(0)
    assert (a > 0).all()
    for lay in (0, big_l - 1):
        mat = fit.by_layer[lay]
        rows = np.repeat(np.arange(v), np.diff(mat.indptr))
        share = aff.routed_share(rows, mat.indices[:, None].astype(np.int64), lay)[:, 0]
        own = np.asarray(mat.sum(axis=1)).ravel() / k  # the layer's occurrences
        want = np.minimum(mat.data / own[rows], 1.0)
        np.testing.assert_allclose(share, want)
        assert (share > 0).all()
        size = aff.confident_size(np.arange(v), lay)
        np.testing.assert_array_equal(
            size, np.bincount(rows[mat.data / own[rows] >= 0.5], minlength=v)
        )


def test_saved_tables_use_int32_where_it_fits(exact_trace):
    # indptr is [L, V+1] whatever the trace: int64 (with int64 counts) made it most of a
    # predictor fitted on a short trace of a large vocabulary. int32 reads back the same.
    path, _ = exact_trace
    trace = open_trace(path)
    acc = CountsAccumulator(trace.meta)
    batch = trace.read_all()
    acc.add(batch.token_id, batch.experts)
    aff = TokenExpertAffinity(confident_threshold=0.3).fit(acc.result())
    tensors = aff.to_tensors()
    for prefix in ("", "top1_"):
        assert tensors[prefix + "indptr"].dtype == np.int32
        assert tensors[prefix + "data"].dtype == np.int32
    back = TokenExpertAffinity.from_tensors(
        trace.meta, tensors, fallback=aff.fallback_, confident_threshold=0.3
    )
    for layer in range(trace.meta.num_layers):
        assert (back.counts_[layer] != aff.counts_[layer]).nnz == 0
        assert back.counts_[layer].data.dtype == np.int64
    # a predictor saved before (int64 arrays) still loads
    wide = {k: (v.astype(np.int64) if k.endswith(("indptr", "data")) else v)
            for k, v in tensors.items()}  # fmt: skip
    old = TokenExpertAffinity.from_tensors(
        trace.meta, wide, fallback=aff.fallback_, confident_threshold=0.3
    )
    assert all((old.counts_[i] != aff.counts_[i]).nnz == 0 for i in range(trace.meta.num_layers))


def test_counts_beyond_int32_stay_int64():
    from scipy import sparse

    from planner._safetensors import joined
    from planner.predict.affinity import _pack_csr

    m = sparse.csr_array(np.array([[0, 2**31 + 5], [1, 0]], np.int64))
    out = _pack_csr((m,), "")
    assert joined(out["data"]).dtype == np.int64 and joined(out["data"]).max() == 2**31 + 5
    assert out["indptr"].dtype == np.int32
