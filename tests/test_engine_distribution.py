"""The engine keeps the target's distribution, with and without speculation (on the CPU).

Speculative decoding at temperature 1 with top-p: the first two emitted tokens of thousands of
requests that differ only in their seed, against their exact joint distribution computed from
the target's dense forward (calibrated bound below). In a module of its own because its programs
run long (thousands of requests through the engine) while ``test_engine.py``'s mostly compile:
each module is compiled the way that suits it (``CPU_PROGRAMS_OPTIMIZED``, ``tests/conftest.py``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import speculative
from serving.demo import encode_text, load_tiny_pair
from serving.model import forward_dense
from serving.requests import Request, SamplingParams
from tests.test_engine import _engine, _tokens

# Programs that run long (thousands of requests through the engine): compiled with XLA's CPU
# optimizations (tests/conftest.py).
CPU_PROGRAMS_OPTIMIZED = True


@pytest.fixture(scope="module")
def pair():
    return load_tiny_pair()


# Bretagnolle-Huber-Carol: P(||p_hat - p||_1 >= t) <= 2^k exp(-N t^2 / 2) for k categories and
# N draws. With k = 20 (the 19 likeliest token pairs and the rest lumped) and ALPHA = 1e-6, a
# correct engine fails a check with probability at most 1e-6 (two checks: 2e-6 for the test).
# N = 8192 speculative draws: t = 0.082, so a deviation of total variation 0.05 on those
# categories (L1 0.1) fails with probability near one; N = 4096 plain draws: t = 0.116.
ALPHA = 1e-6
NUM_CATEGORIES = 20
STAT_PROMPT = "import os\nimport "  # 17 bytes: one full page, shared by every request
STAT_PARAMS = dict(temperature=1.0, top_p=0.9)


def _bhc_threshold(num_draws: int) -> float:
    return math.sqrt(2 * (NUM_CATEGORIES * math.log(2) + math.log(1 / ALPHA)) / num_draws)


def _exact_first_two(target) -> np.ndarray:
    """float64[V, V]: P(first token, second token) under the target with ``STAT_PARAMS``.

    One jitted dense forward of the prompt followed by each of the V tokens: causal, so the
    logits before the appended token are the prompt's (the first token's distribution) and
    the last ones row ``t``'s second-token distribution given first token ``t``. (One program
    instead of a forward of each shape and op-by-op sampling filters, ~10 s of compiles.)"""
    config, params = target

    @jax.jit
    def first_and_second(tokens):
        logits = forward_dense(params, config, tokens, backend="reference")
        first = speculative.sampling_distribution(logits[:1, -2], **STAT_PARAMS)
        return first[0], speculative.sampling_distribution(logits[:, -1], **STAT_PARAMS)

    prompt = encode_text(STAT_PROMPT)
    tokens = jnp.array([[*prompt, t] for t in range(config.vocab_size)])
    first, second = (np.asarray(d, np.float64) for d in first_and_second(tokens))
    joint = first[:, None] * second  # rows of first tokens outside top-p are zero
    return joint / joint.sum()


def _assert_pairs_drawn_from(pairs: np.ndarray, joint: np.ndarray) -> None:
    vocab = joint.shape[0]
    index = pairs[:, 0] * vocab + pairs[:, 1]
    flat = joint.ravel()
    impossible = flat[index] == 0
    assert not impossible.any(), f"pairs of probability 0 drawn: {pairs[impossible][:5].tolist()}"
    frequencies = np.bincount(index, minlength=flat.size) / index.size
    common = np.argsort(-flat)[: NUM_CATEGORIES - 1]
    observed = np.append(frequencies[common], 1 - frequencies[common].sum())
    expected = np.append(flat[common], 1 - flat[common].sum())
    distance = np.abs(observed - expected).sum()
    threshold = _bhc_threshold(index.size)
    assert distance < threshold, f"L1 distance {distance:.4f} >= {threshold:.4f}"


@pytest.fixture(scope="module")
def exact_first_two(pair) -> np.ndarray:
    """``_exact_first_two`` of the target, computed once for both cases (it only reads it)."""
    return _exact_first_two(pair[0])


@pytest.mark.parametrize("num_speculative, num_draws", [(2, 8192), (0, 4096)])
def test_first_two_tokens_follow_the_targets_distribution(
    pair, exact_first_two, num_speculative, num_draws
):
    """Requests that differ only in their seed; their first two tokens against the exact
    joint distribution (with speculation: both the path where the first step emits two tokens
    or more and the one where the first draft is rejected)."""
    joint = exact_first_two
    parallel = 16
    engine = _engine(
        pair,
        num_speculative=num_speculative,
        parallel=parallel,
        num_pages=2 * parallel + 2,
    )
    requests = [
        Request(i, encode_text(STAT_PROMPT), SamplingParams(**STAT_PARAMS, max_tokens=2, seed=i))
        for i in range(num_draws)
    ]
    pairs = np.array(_tokens(engine.generate(requests)))
    _assert_pairs_drawn_from(pairs, joint)
    if num_speculative:
        rates = engine.acceptance.rate_at()
        assert 0.3 < rates[0] < 0.99  # both branches of the first verification were taken
