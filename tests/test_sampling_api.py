"""The public samplers: calibrated statistics, key semantics, log-probabilities, bad input.

Statistics use the Bretagnolle-Huber-Carol bound (``testing.md``): for ``k`` categories and
``n`` independent draws, ``P(||p_hat - p||_1 >= t) <= 2^k exp(-n t^2 / 2)``. With ``n = 100000``
and ``k <= 20`` (rare tokens lumped into one category), ``t`` is set so that a correct sampler
fails with probability at most ``ALPHA = 1e-6`` per test: ``t = sqrt(2 (k ln 2 + ln(1/ALPHA)) /
n) <= 0.024``, so a sampler off by total variation 0.02 (L1 distance 0.04) fails with
probability near one. Any draw outside the kept set fails outright. Seeds are fixed.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sampling
from sampling import reference
from sampling.filters import FilterParams, filtered_distribution
from tests.conftest import ON_GPU
from tests.test_sampling_kernels import FAST_COMPILE

# Programs that run long (calibrated statistics over many draws): compiled with XLA's CPU
# optimizations (tests/conftest.py).
CPU_PROGRAMS_OPTIMIZED = True

ALPHA = 1e-6
NUM_DRAWS = 100_000
VOCAB = 64
MAX_CATEGORIES = 20


def _distribution(seed: int) -> np.ndarray:
    """A 64-token distribution with a long tail and exact ties (float32)."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.full(VOCAB, 0.3))
    weights[5:9] = weights[5]  # a block of exact ties
    weights[10] = 0.0
    return (weights / weights.sum()).astype(np.float32)


def bhc_threshold(num_categories: int, num_draws: int, alpha: float = ALPHA) -> float:
    """The L1 distance a correct sampler exceeds with probability at most ``alpha``."""
    return math.sqrt(2 * (num_categories * math.log(2) + math.log(1 / alpha)) / num_draws)


def assert_distributed_as(tokens: np.ndarray, target: np.ndarray) -> None:
    """Calibrated check that ``tokens`` are draws from ``target`` (rare categories lumped)."""
    assert tokens.min() >= 0 and tokens.max() < target.shape[0]
    outside = target[tokens] == 0
    assert not outside.any(), f"drew tokens of probability 0: {np.unique(tokens[outside])}"
    counts = np.bincount(tokens, minlength=target.shape[0]) / tokens.shape[0]
    order = np.argsort(-target)
    common = order[: MAX_CATEGORIES - 1]
    rest = order[MAX_CATEGORIES - 1 :]
    observed = np.concatenate([counts[common], [counts[rest].sum()]])
    expected = np.concatenate([target[common], [target[rest].sum()]])
    distance = np.abs(observed - expected).sum()
    threshold = bhc_threshold(len(expected), tokens.shape[0])
    assert distance < threshold, f"L1 distance {distance:.4f} >= {threshold:.4f}"


def _draw(sampler, probs, **kwargs):
    batch = jnp.broadcast_to(jnp.asarray(probs), (NUM_DRAWS, probs.shape[0]))
    return np.asarray(jax.jit(lambda p: sampler(jax.random.key(7), p, **kwargs))(batch))


FILTER_CASES = {
    "top_k": dict(top_k=7),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.05),
    "joint": dict(top_k=12, top_p=0.7),
    "top_k_first": dict(top_k=12, top_p=0.7, order="top_k_first"),
    "all": dict(top_k=20, top_p=0.9, min_p=0.02),
}


@functools.cache
def _filtered_draws(order: str):
    """``_draw``'s program for ``filtered_sample``, the filter values as data (a filter left
    off is top_k V, top_p 1, min_p 0: what None means), so that the cases of one order share
    one compile: the same key, rows and draws as ``_draw``'s."""
    return jax.jit(
        lambda rows, top_k, top_p, min_p: sampling.filtered_sample(
            jax.random.key(7), rows, top_k=top_k, top_p=top_p, min_p=min_p, order=order
        )
    )


@pytest.mark.parametrize("name", sorted(FILTER_CASES))
def test_filtered_samplers_draw_the_filtered_distribution(name):
    probs = _distribution(1)
    options = dict(FILTER_CASES[name])
    order = options.pop("order", "joint")
    params = FilterParams(
        options.get("top_k", VOCAB), options.get("top_p", 1.0), options.get("min_p", 0.0)
    )
    rows = jnp.broadcast_to(jnp.asarray(probs), (NUM_DRAWS, VOCAB))
    tokens = np.asarray(
        _filtered_draws(order)(
            rows, jnp.int32(params.top_k), jnp.float32(params.top_p), jnp.float32(params.min_p)
        )
    )
    target = np.asarray(filtered_distribution(jnp.asarray(probs), params, order), np.float64)
    assert_distributed_as(tokens, target / target.sum())


def test_sample_from_probs_draws_probs():
    probs = _distribution(2)
    assert_distributed_as(_draw(sampling.sample_from_probs, probs), probs / probs.sum())


def test_sample_from_logits_draws_the_tempered_softmax():
    probs = _distribution(3)
    logits = np.log(np.maximum(probs, 1e-30)).astype(np.float32)
    logits[10] = -np.inf  # masked
    temperature = 0.7
    tokens = _draw(sampling.sample_from_logits, logits, temperature=temperature)
    tempered = np.exp(np.where(np.isfinite(logits), logits / temperature, -np.inf))
    assert_distributed_as(tokens, tempered / tempered.sum())


def test_rounds_are_few_and_reported():
    probs = jnp.broadcast_to(jnp.asarray(_distribution(4)), (4096, VOCAB))
    _, rounds = sampling.top_p_sample(jax.random.key(1), probs, 0.9, return_rounds=True)
    rounds = np.asarray(rounds)
    assert rounds.min() >= 1 and rounds.mean() < 4, rounds.mean()


def test_per_row_keys_make_a_row_independent_of_its_slot():
    probs = jnp.asarray(np.stack([_distribution(5), _distribution(6), _distribution(7)]))
    keys = jax.random.split(jax.random.key(3), 3)
    for sampler, extra in [
        (sampling.sample_from_probs, {}),
        (sampling.top_p_sample, {"top_p": 0.9}),
        (sampling.sample_from_logits, {}),
    ]:
        inputs = jnp.log(probs + 1e-30) if sampler is sampling.sample_from_logits else probs
        tokens = np.asarray(sampler(keys, inputs, **extra))
        swapped = np.asarray(sampler(keys[::-1], inputs[::-1], **extra))
        assert np.array_equal(tokens, swapped[::-1])


def test_one_key_is_reproducible_and_rows_draw_their_own_streams():
    probs = jnp.ones((256, VOCAB)) / VOCAB
    first = np.asarray(sampling.sample_from_probs(jax.random.key(9), probs))
    again = np.asarray(sampling.sample_from_probs(jax.random.key(9), probs))
    assert np.array_equal(first, again)
    assert len(np.unique(first)) > 20  # identical rows, different streams


def test_greedy_is_the_lowest_index_maximum():
    logits = jnp.array([[1.0, 3.0, 3.0, -jnp.inf], [0.0, 0.0, 0.0, 0.0]])
    tokens, logprob = sampling.sample_from_logits(
        jax.random.key(0), logits, temperature=0.0, return_logprob=True
    )
    assert tokens.tolist() == [1, 0] and logprob.tolist() == [0.0, 0.0]


def test_logprob_is_of_the_distribution_drawn_from():
    probs = jnp.asarray(_distribution(8))[None].repeat(8, axis=0)
    tokens, logprob = sampling.top_k_sample(jax.random.key(2), probs, 5, return_logprob=True)
    kept = np.asarray(filtered_distribution(probs[0], FilterParams(5, 1.0, 0.0)))
    np.testing.assert_allclose(np.asarray(logprob), np.log(kept[np.asarray(tokens)]), rtol=1e-5)
    tokens, logprob = sampling.sample_from_probs(jax.random.key(2), probs, return_logprob=True)
    np.testing.assert_allclose(
        np.asarray(logprob), np.log(np.asarray(probs[0])[np.asarray(tokens)]), rtol=1e-5
    )


def test_renorm_and_mask_follow_the_definition():
    probs = jnp.array([[0.4, 0.3, 0.3, 0.0]])
    np.testing.assert_allclose(
        np.asarray(sampling.top_k_renorm_probs(probs, 2)), [[4 / 7, 3 / 7, 0, 0]], rtol=1e-6
    )
    np.testing.assert_allclose(
        np.asarray(sampling.top_p_renorm_probs(probs, 0.5)), [[4 / 7, 3 / 7, 0, 0]], rtol=1e-6
    )
    logits = jnp.array([[2.0, 1.0, 1.0, -1.0]])
    masked = np.asarray(sampling.top_k_mask_logits(logits, 2))
    assert masked.tolist() == [[2.0, 1.0, -np.inf, -np.inf]]


GOOD_PROBS = jnp.array([[0.5, 0.5], [0.1, 0.9]])
BAD_INPUTS = [
    (
        sampling.sample_from_probs,
        dict(probs=jnp.array([[0.5, jnp.nan]])),
        "probs row 0 contains NaN",
    ),
    (sampling.sample_from_probs, dict(probs=jnp.array([[0.5, -0.1]])), "negative probability"),
    (sampling.sample_from_probs, dict(probs=jnp.array([[0.0, 0.0]])), "sums to 0"),
    (sampling.sample_from_probs, dict(probs=jnp.array([[0.5, jnp.inf]])), "infinity"),
    (
        sampling.sample_from_probs,
        dict(probs=jnp.ones(3)),
        r"probs must have shape \[batch, vocab\]",
    ),
    (
        sampling.sample_from_logits,
        dict(logits=jnp.array([[0.0, jnp.nan]])),
        "logits row 0 contains NaN",
    ),
    (sampling.sample_from_logits, dict(logits=jnp.array([[0.0, jnp.inf]])), r"contains \+inf"),
    (sampling.sample_from_logits, dict(logits=jnp.full((1, 3), -jnp.inf)), "entirely -inf"),
    (
        sampling.sample_from_logits,
        dict(logits=jnp.zeros((1, 3)), temperature=-1.0),
        r"temperature\[0\]=-1.0",
    ),
    (sampling.top_k_sample, dict(probs=GOOD_PROBS, top_k=0), r"top_k\[0\]=0 is outside \[1, 2\]"),
    (sampling.top_k_sample, dict(probs=GOOD_PROBS, top_k=3), r"top_k\[0\]=3 is outside \[1, 2\]"),
    (
        sampling.top_p_sample,
        dict(probs=GOOD_PROBS, top_p=0.0),
        r"top_p\[0\]=0.0 is outside \(0.0, 1.0\]",
    ),
    (sampling.top_p_sample, dict(probs=GOOD_PROBS, top_p=1.5), r"top_p\[0\]=1.5"),
    (sampling.min_p_sample, dict(probs=GOOD_PROBS, min_p=-0.1), r"min_p\[0\]"),
    (
        sampling.top_k_sample,
        dict(probs=GOOD_PROBS, top_k=jnp.array([1, 2, 3])),
        "top_k must be a scalar or have shape",
    ),
    (sampling.top_k_sample, dict(probs=GOOD_PROBS, top_k=1.5), "top_k must be an integer"),
    (
        sampling.top_k_top_p_sample,
        dict(probs=GOOD_PROBS, top_k=1, top_p=0.5, order="sideways"),
        "order must be one of",
    ),
]


@pytest.mark.parametrize("sampler,arguments,message", BAD_INPUTS)
def test_bad_input_raises_naming_it(sampler, arguments, message):
    with pytest.raises(ValueError, match=message):
        sampler(jax.random.key(0), **arguments)


def test_auto_picks_per_family_and_the_kill_switch_wins(monkeypatch):
    """``"auto"`` follows ``AUTO_PICKS_KERNEL`` on a GPU (for Gumbel-max, from
    ``GUMBEL_KERNEL_MIN_BATCH`` rows up), is the reference elsewhere, and the kill switch forces
    the reference even for a function the table sends to its kernel. Read through the record of
    each traced call's choice (``platform.record_backends``)."""
    from kernels_pallas import platform
    from sampling import api

    def chosen(function, batch, **options) -> str:
        probs = jax.ShapeDtypeStruct((batch, 8), jnp.float32)
        with platform.record_backends() as records:
            jax.eval_shape(lambda p: function(jax.random.key(0), p, **options), probs)
        assert len(records) == 1, records
        return records[0].backend

    monkeypatch.setattr(platform, "on_gpu", lambda: True)  # "a GPU"
    assert chosen(api.top_k_sample, 2, top_k=3) == "pallas"
    assert chosen(lambda key, p: api.top_k_renorm_probs(p, 3), 2) == "reference"
    minimum = api.GUMBEL_KERNEL_MIN_BATCH
    assert chosen(api.sample_from_probs, minimum) == "pallas"
    assert chosen(api.sample_from_logits, 4 * minimum) == "pallas"
    assert chosen(api.sample_from_probs, minimum - 1) == "reference"
    assert chosen(api.sample_from_logits, 1) == "reference"
    assert chosen(api.sample_from_logits, 1, backend="pallas") == "pallas"  # explicit wins
    monkeypatch.setenv("DECODELAB_BACKEND", "reference")
    assert chosen(api.top_k_sample, 2, top_k=3) == "reference"
    assert chosen(api.sample_from_probs, 4 * minimum) == "reference"
    assert chosen(api.top_k_sample, 2, top_k=3, backend="pallas") == "pallas"  # explicit wins


def test_under_jit_bad_values_never_give_an_out_of_range_token():
    """Inside jit nothing can be checked: parameters are clamped, and rows without positive
    finite mass still return a token id inside the row (documented in sampling/validation.py)."""
    probs = jnp.array([[0.0, 0.0, 0.0], [jnp.nan, 0.5, 0.5], [0.2, 0.3, 0.5]])
    sample = jax.jit(lambda p, k, tp: sampling.top_k_top_p_sample(jax.random.key(0), p, k, tp))
    tokens = np.asarray(sample(probs, jnp.array([0, 9, 2]), jnp.array([0.0, 2.0, 0.5])))
    assert ((tokens >= 0) & (tokens < 3)).all()
    assert tokens[2] == 2  # top_k 2 and top_p 0.5 keep token 2 only


def test_bfloat16_probabilities_are_sampled_without_bias():
    """bfloat16 rows are upcast before the inverse transform: a 0.003 token keeps its rate (it
    was drawn at about twice its rate when the running sums and uniforms were bfloat16).

    A deviation this small is below what the L1 bound resolves, so the count of the rare token
    is checked with Bernstein's inequality, ``P(|X - n p| >= t) <= 2 exp(-t^2 / (2 (n p (1 - p)
    + t / 3)))``, at the same ``ALPHA``: ``t`` is about 98 draws around an expected 300, while
    the biased sampler drew about 590."""
    probs = jnp.asarray([0.997, 0.003], jnp.bfloat16)
    tokens = _draw(sampling.top_p_sample, probs, top_p=1.0)
    target = np.asarray(probs.astype(jnp.float32), np.float64)
    rare = target[1] / target.sum()
    variance = NUM_DRAWS * rare * (1 - rare)
    log_term = math.log(2 / ALPHA)
    # Solve t^2 = 2 log(2 / alpha) (variance + t / 3) for t > 0.
    t = (2 * log_term / 3 + math.sqrt((2 * log_term / 3) ** 2 + 8 * log_term * variance)) / 2
    count = int(np.sum(tokens == 1))
    assert abs(count - NUM_DRAWS * rare) < t, (count, NUM_DRAWS * rare, t)


# ----------------------------------------------------------------------------------------------
# Edge cases found in review: each would have been a silent distribution error.


def test_sampler_and_definition_agree_on_top_p_boundaries_in_float32():
    """Uniform and tied rows put top_p exactly on a partial sum; the sampler's test and the
    definition read one prefix-mass table, so every drawn token has the log-probability of the
    kept set the definition (and top_p_renorm_probs) describes, never -inf."""
    # One compiled program a vocabulary (the rows and top_p are data; traced eagerly, each call
    # compiled the reference's rejection loop again).
    sample = jax.jit(
        lambda key, probs, top_p: sampling.top_p_sample(key, probs, top_p, return_logprob=True)
    )
    for vocab, top_p in [(50, 0.5), (83, 0.8), (40, 0.9)]:
        levels = np.where(np.arange(vocab) % 2 == 0, 0.1, 0.05).astype(np.float32)
        for row in (np.full(vocab, 1.0 / vocab, np.float32), levels / levels.sum()):
            probs = jnp.broadcast_to(jnp.asarray(row), (2000, vocab))
            tokens, logprob = sample(jax.random.key(vocab), probs, jnp.float32(top_p))
            renormed = np.asarray(sampling.top_p_renorm_probs(probs[:1], top_p))[0]
            tokens = np.asarray(tokens)
            assert np.all(renormed[tokens] > 0)
            np.testing.assert_allclose(np.asarray(logprob), np.log(renormed[tokens]), rtol=1e-5)


def test_inverse_transform_gives_zero_weight_tokens_no_interval():
    """Float running sums dip; without the running maximum the dips' intervals fell to the last
    positive token, drawn at hundreds of times its rate on rows with many zero weights."""
    rng_np = np.random.default_rng(3)
    weights = rng_np.random(4096).astype(np.float32)
    weights[rng_np.random(4096) < 0.7] = 0
    weights = jnp.asarray(weights)
    last = int(np.flatnonzero(np.asarray(weights))[-1])
    uniforms = (jnp.arange(1 << 16, dtype=jnp.float32) + 0.5) / (1 << 16)
    tokens = np.asarray(jax.vmap(lambda u: reference.inverse_transform(weights, u))(uniforms))
    assert np.all(np.asarray(weights)[tokens] > 0)
    share = float(weights[last] / jnp.sum(weights))
    observed = float(np.mean(tokens == last))
    assert abs(observed - share) < 2 / (1 << 16) + 1e-4, (observed, share)


def test_the_fallback_alone_draws_the_filtered_distribution():
    """max_rounds=0 sends every row to the fallback: it must draw the kept set exactly too."""
    probs = _distribution(11)
    tokens = _draw(sampling.top_k_sample, probs, top_k=7, max_rounds=0)
    target = np.asarray(filtered_distribution(jnp.asarray(probs), FilterParams(7, 1.0, 0.0)))
    assert_distributed_as(tokens, target.astype(np.float64))


def test_enough_rounds_never_reach_the_fallback():
    """A round that does not accept removes its token (Lemma 3), so V + 1 rounds always decide:
    an over-strict accept test would hide behind the exact fallback; this catches it."""
    rng_np = np.random.default_rng(12)
    probs = jnp.asarray(rng_np.dirichlet(np.full(12, 0.5), size=512), jnp.float32)
    # One compiled program for the four filter settings (a filter left off is top_k V, top_p 1,
    # min_p 0, what None means).
    rounds_of = jax.jit(
        lambda top_k, top_p, min_p: sampling.filtered_sample(
            jax.random.key(4),
            probs,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            max_rounds=13,
            return_rounds=True,
        )[1]
    )
    for options in ({"top_k": 3}, {"top_p": 0.7}, {"min_p": 0.2}, {"top_k": 5, "top_p": 0.5}):
        rounds = rounds_of(
            jnp.int32(options.get("top_k", 12)),
            jnp.float32(options.get("top_p", 1.0)),
            jnp.float32(options.get("min_p", 0.0)),
        )
        assert int(np.max(np.asarray(rounds))) <= 13, options


def test_temperature_must_be_finite_and_tiny_temperatures_are_greedy():
    logits = jnp.array([[10.0, 20.0, -jnp.inf]])
    with pytest.raises(ValueError, match="temperature"):
        sampling.sample_from_logits(jax.random.key(0), logits, temperature=float("inf"))
    tokens = sampling.sample_from_logits(jax.random.key(0), logits, temperature=2e-38)
    assert tokens.tolist() == [1]


def test_huge_weights_do_not_overflow_the_race():
    probs = jnp.asarray([1e38, 2e38], jnp.float32)
    tokens = _draw(sampling.sample_from_probs, probs)
    assert_distributed_as(tokens, np.array([1 / 3, 2 / 3]))
    with pytest.raises(ValueError, match="subnormal"):
        sampling.sample_from_probs(jax.random.key(0), jnp.asarray([[0.0, 1e-40, 1e-41]]))


def test_nan_under_jit_never_wins_in_reference_or_kernel():
    logits = jnp.zeros((4, 300)).at[:, 200].set(50.0).at[:, 5].set(jnp.nan)
    for backend in ("reference", "pallas"):
        sample = jax.jit(
            lambda x, backend=backend: sampling.sample_from_logits(
                jax.random.key(1), x, backend=backend
            ),
            compiler_options=FAST_COMPILE if backend == "pallas" and not ON_GPU else None,
        )
        assert np.asarray(sample(logits)).tolist() == [200] * 4, backend


# ----------------------------------------------------------------------------------------------
# Log-probabilities against float64 definitions, at several temperatures and with every filter.
#
# What each function documents: ``sample_from_logits`` returns ``log softmax(logits / T)`` at the
# token (the tempered distribution it draws from; 0 for greedy rows); ``filtered_sample`` and
# its wrappers ``log q(token)`` with ``q`` the filtered distribution of the probabilities given
# (kept mass renormalized, ``sampling/filters.py``); ``sample_from_probs`` ``log(p / sum p)``.
# An engine samples at temperature T through filters by passing ``softmax(logits / T)`` to a
# filtered sampler (or ``speculative.sample_draft``'s ``q`` to ``sample_from_probs``), so the
# logprob it reports is that of the tempered, filtered distribution: checked below at several
# temperatures, so that a logprob of the untempered logits (equal only at T = 1) fails.
#
# Tolerance: float32 log-softmax of logits up to about 30 in magnitude is within a few ulps of
# 30 (absolute, about 1e-5); the bugs this guards against move a logprob by O(1).
LOGPROB_TEMPERATURES = (0.25, 0.6, 1.0, 1.7, 4.0)
LOGPROB_ATOL = 2e-5


def _logprob_logits(batch: int = 32, vocab: int = VOCAB) -> np.ndarray:
    generator = np.random.default_rng(6)
    logits = (3 * generator.standard_normal((batch, vocab))).astype(np.float32)
    logits[:, 11] = -np.inf  # a masked token
    return logits


def _log_softmax64(logits: np.ndarray, temperature: float) -> np.ndarray:
    scaled = np.asarray(logits, np.float64) / temperature
    top = scaled.max(axis=1, keepdims=True)
    return scaled - top - np.log(np.exp(scaled - top).sum(axis=1, keepdims=True))


def filtered_distribution64(
    probs: np.ndarray, top_k: int, top_p: float, min_p: float, order: str
) -> np.ndarray:
    """float64 ``[V]``: the filtered distribution by definition (``sampling/filters.py``),
    written again in NumPy: rank by (probability descending, index ascending)."""
    vocab = probs.shape[0]
    ranked = np.lexsort((np.arange(vocab), -probs))
    sorted_probs = probs[ranked]
    mass_before = np.concatenate([[0.0], np.cumsum(sorted_probs)[:-1]])
    rank = np.arange(vocab)
    in_top_k = rank < top_k
    nucleus = sorted_probs.sum() if order == "joint" else sorted_probs[:top_k].sum()
    in_top_p = (rank == 0) | (top_p >= 1) | (mass_before < top_p * nucleus)
    in_min_p = sorted_probs >= min_p * sorted_probs[0]
    keep = np.zeros(vocab, bool)
    keep[ranked] = in_top_k & in_top_p & in_min_p & (sorted_probs > 0)
    kept = np.where(keep, probs, 0.0)
    return kept / kept.sum()


LOGPROB_FILTERS = {
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.1),
    "joint": dict(top_k=8, top_p=0.7),
    "top_k_first": dict(top_k=8, top_p=0.7, order="top_k_first"),
    "all": dict(top_k=10, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_logits_logprob_is_the_tempered_log_softmax(backend):
    """Per-row temperatures (one greedy row, logprob 0) in one call, then each temperature
    alone: ``log_softmax(logits / T)[token]`` in float64."""
    logits = _logprob_logits()
    batch = logits.shape[0]
    temperatures = np.resize(np.asarray((0.0, *LOGPROB_TEMPERATURES), np.float32), batch)
    sample = jax.jit(
        lambda x, t: sampling.sample_from_logits(
            jax.random.key(4), x, temperature=t, return_logprob=True, backend=backend
        ),
        compiler_options=FAST_COMPILE if backend == "pallas" and not ON_GPU else None,
    )
    for temperature in [temperatures, *LOGPROB_TEMPERATURES]:
        per_row = np.broadcast_to(np.asarray(temperature, np.float32), (batch,))
        tokens, logprob = (np.asarray(x) for x in sample(logits, per_row))
        greedy = per_row == 0
        expected = np.zeros(batch)
        for temperature_value in np.unique(per_row[~greedy]):
            rows = per_row == temperature_value
            table = _log_softmax64(logits[rows], float(temperature_value))
            expected[rows] = table[np.arange(rows.sum()), tokens[rows]]
        assert (logprob[greedy] == 0).all()
        np.testing.assert_allclose(logprob, expected, rtol=0, atol=LOGPROB_ATOL)


@functools.cache
def _logprob_programs(backend: str, order: str):
    """The three samplers the next test calls, under ``jit`` with the temperature and the filter
    values as data (a filter left off is top_k V, top_p 1, min_p 0: what None means), so that
    one compiled program serves every temperature and every filter case of an order. (Traced
    eagerly, each call compiled the reference's rejection loop again.) The interpreted Gumbel
    kernel compiles unoptimized (``FAST_COMPILE``)."""
    from speculative import sample_draft

    options = dict(compiler_options=FAST_COMPILE if backend == "pallas" and not ON_GPU else None)
    filtered = jax.jit(
        lambda probs, top_k, top_p, min_p: sampling.filtered_sample(
            jax.random.key(8),
            probs,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            order=order,
            return_logprob=True,
            backend=backend,
        ),
        **options,
    )
    draft = jax.jit(
        lambda logits, temperature, top_k, top_p, min_p: sample_draft(
            jax.random.key(9),
            logits,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            order=order,
            backend=backend,
        ),
        **options,
    )
    return filtered, draft, _race_program(backend)


@functools.cache
def _race_program(backend: str):
    """``sample_from_probs`` under ``jit`` for ``_logprob_programs`` (one for both orders)."""
    return jax.jit(
        lambda q: sampling.sample_from_probs(
            jax.random.key(9), q, return_logprob=True, backend=backend
        ),
        compiler_options=FAST_COMPILE if backend == "pallas" and not ON_GPU else None,
    )


@pytest.mark.parametrize("backend", ["reference", "pallas"])
@pytest.mark.parametrize("name", sorted(LOGPROB_FILTERS))
def test_filtered_logprob_is_of_the_tempered_filtered_distribution(name, backend):
    """``softmax(logits / T)`` through the filters: the reported logprob is ``log`` of the
    filtered, renormalized, tempered distribution at the token (float64 definition), at every
    temperature; and ``speculative.sample_draft``'s ``q`` sampled by ``sample_from_probs``
    reports the same number."""
    logits = _logprob_logits()
    filters = LOGPROB_FILTERS[name]
    params = (
        filters.get("top_k", VOCAB),
        filters.get("top_p", 1.0),
        filters.get("min_p", 0.0),
        filters.get("order", "joint"),
    )
    filtered, draft, race = _logprob_programs(backend, params[3])
    values = (jnp.int32(params[0]), jnp.float32(params[1]), jnp.float32(params[2]))
    for temperature in LOGPROB_TEMPERATURES:
        probs = jax.nn.softmax(jnp.asarray(logits) / temperature, axis=-1)
        tokens, logprob = filtered(probs, *values)
        tokens, logprob = np.asarray(tokens), np.asarray(logprob)
        probs64 = np.asarray(probs, np.float64)
        expected = [
            np.log(filtered_distribution64(row, *params)[token])
            for row, token in zip(probs64, tokens, strict=True)
        ]
        np.testing.assert_allclose(logprob, expected, rtol=0, atol=LOGPROB_ATOL, err_msg=name)
        draws, q = draft(jnp.asarray(logits), jnp.float32(temperature), *values)
        draws, q = np.asarray(draws), np.asarray(q, np.float64)
        resampled, draft_logprob = race(jnp.asarray(q, jnp.float32))
        np.testing.assert_array_equal(np.asarray(resampled), draws)  # the same race on q
        tempered = np.exp(_log_softmax64(logits, temperature))
        expected = [
            np.log(filtered_distribution64(row, *params)[token])
            for row, token in zip(tempered, draws, strict=True)
        ]
        np.testing.assert_allclose(draft_logprob, expected, rtol=0, atol=LOGPROB_ATOL, err_msg=name)
