"""The small neural token->expert predictor."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from planner.errors import InputError, SchemaError
from planner.predict.counts import CountsAccumulator
from planner.predict.neural import NeuralConfig, NeuralPredictor
from planner.trace import TraceMeta
from tests.predict.conftest import chain_batch

META = TraceMeta("test/nn", num_layers=3, num_experts=8, top_k=2, vocab_size=40)


def chain_counts(tokens=np.arange(30)):
    batch = chain_batch(META, np.repeat(tokens, 3), np.zeros(tokens.size * 3, np.int64))
    acc = CountsAccumulator(META)
    acc.add(batch.token_id, batch.experts)
    return acc.result()


def precision(pred: np.ndarray, tokens: np.ndarray) -> float:
    truth = (tokens[:, None, None] + np.arange(3)[None, :, None] + np.arange(2)[None, None, :]) % 8
    return float((pred[..., :, None] == truth[..., None, :]).any(-1).mean())


def test_learns_a_deterministic_mapping_and_is_seeded():
    cfg = NeuralConfig(max_steps=300, batch_size=64, seed=5)
    assert cfg.time_budget_s is None  # no clock unless asked: the same seed, the same predictor
    nn = NeuralPredictor(cfg).fit(chain_counts())
    tokens = np.arange(30)
    assert precision(nn.predict_topk(tokens), tokens) > 0.95
    assert (
        nn.train_log_["steps"] == 300 and nn.train_log_["final_loss"] < nn.train_log_["first_loss"]
    )
    assert nn.train_log_["stopped_by"] == "steps"
    again = NeuralPredictor(cfg).fit(chain_counts())
    np.testing.assert_array_equal(again.predict_topk(tokens), nn.predict_topk(tokens))


def test_model_embeddings_let_it_generalise_to_unseen_tokens():
    # Embedding = one-hot of (token mod 8): tokens 30..39 share the routing of 22..29, 30..31.
    emb = np.eye(8, dtype=np.float32)[np.arange(40) % 8]
    nn = NeuralPredictor(NeuralConfig(max_steps=300, batch_size=64)).fit(chain_counts(), emb)
    assert nn.input_ == "model-embedding"
    unseen = np.arange(30, 40)
    assert precision(nn.predict_topk(unseen), unseen) > 0.95
    # Rows are scaled to unit RMS without overflow, however large the model's values.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        big = NeuralPredictor(NeuralConfig(max_steps=300, batch_size=64)).fit(
            chain_counts(), emb * 1e30
        )
    assert precision(big.predict_topk(unseen), unseen) > 0.95


def test_tensor_round_trip_and_unknown_tokens():
    nn = NeuralPredictor(NeuralConfig(max_steps=20)).fit(chain_counts())
    back = NeuralPredictor.from_tensors(nn.to_tensors(), nn.settings(), META.vocab_size)
    ids = np.array([-1, 0, 5, 39])
    np.testing.assert_array_equal(back.predict_topk(ids), nn.predict_topk(ids))
    assert nn.predict_topk(ids).shape == (4, 3, 2)
    with pytest.raises(InputError):
        nn.predict_topk(np.array([40]))
    with pytest.raises(InputError, match=r"hidden=0 must be an integer in \[1, "):
        NeuralConfig(hidden=0)


@pytest.mark.parametrize(
    "edit",
    [{"config": {"hidden": 200_000}}, {"num_experts": 200_000}, {"num_layers": 10**6}],
    ids=["hidden", "experts", "layers"],
)
def test_settings_that_disagree_with_the_tensors_are_refused_before_allocating(edit):
    # an edited manifest built the body at its own size first (hidden 200000: 160 GB)
    nn = NeuralPredictor(NeuralConfig(max_steps=5)).fit(chain_counts())
    settings = nn.settings()
    for key, value in edit.items():
        settings[key] = dict(settings[key], **value) if isinstance(value, dict) else value
    with pytest.raises(SchemaError, match="shape|do not match") as e:
        NeuralPredictor.from_tensors(nn.to_tensors(), settings, META.vocab_size)
    assert "allocate" not in str(e.value)


def test_token_ids_are_checked_as_the_token_table_checks_them():
    """A float id (1.7) was truncated to token 1, where the token table refuses it."""
    nn = NeuralPredictor(NeuralConfig(max_steps=2, batch_size=8)).fit(chain_counts())
    for bad, message in (([1.7], "must be integers"), ([-2], "outside"), ([10**6], "outside")):
        with pytest.raises(InputError, match=message):
            nn.predict_topk(np.array(bad))
    assert nn.predict_topk(np.array([-1, 0])).shape[0] == 2
