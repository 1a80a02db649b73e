"""YaRN frequencies and temperature (``paged.rope``), checked against the definitions.

The expected values are computed here from the formulas of the papers (YaRN, Peng et al. 2023;
DeepSeek-V2's report), not from the module's code: a pair that turns at least ``beta_fast``
times over the original context keeps ``theta ** (-2i / D)``, one that turns at most
``beta_slow`` times gets it divided by ``factor``, and in between the weight is linear in the
pair index; ``mscale = 0.1 * c * ln(factor) + 1``.
"""

from __future__ import annotations

import math
import re

import jax.numpy as jnp
import numpy as np
import pytest

from paged.mla_reference import default_softmax_scale
from paged.rope import (
    Llama3Scaling,
    RopeParams,
    YarnScaling,
    apply_rope,
    apply_rope_frequencies,
    inverse_frequencies,
    yarn_inverse_frequencies,
    yarn_mscale,
    yarn_ramp_bounds,
)

DEEPSEEK = YarnScaling(factor=40.0, original_max_position_embeddings=4096)


def plain_float64(head_dim, theta):
    return theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def rotations_over_original_context(head_dim, theta, original):
    """``r_i``: how many full turns pair i makes over ``original`` positions."""
    return original * plain_float64(head_dim, theta) / (2 * math.pi)


@pytest.mark.parametrize("head_dim", [8, 64, 128])
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_factor_one_is_plain_rope_exactly(head_dim, theta):
    for scaling in (
        YarnScaling(factor=1.0),
        YarnScaling(factor=1, original_max_position_embeddings=32, beta_fast=4.0, beta_slow=2.0),
    ):
        np.testing.assert_array_equal(
            yarn_inverse_frequencies(head_dim, theta, scaling),
            inverse_frequencies(head_dim, RopeParams(theta=theta)),
        )
    assert yarn_mscale(1.0) == 1.0 and yarn_mscale(1.0, 0.707) == 1.0
    assert YarnScaling(factor=1.0).softmax_scale_multiplier == 1.0


@pytest.mark.parametrize(
    ("head_dim", "theta", "scaling"),
    [
        (64, 10000.0, DEEPSEEK),
        (128, 10000.0, YarnScaling(factor=4.0, original_max_position_embeddings=2048)),
        (128, 500000.0, YarnScaling(factor=8.0, original_max_position_embeddings=8192)),
        (64, 10000.0, YarnScaling(factor=16.0, beta_fast=8.0, beta_slow=2.0)),
    ],
)
def test_the_ramp_keeps_fast_pairs_and_divides_slow_ones(head_dim, theta, scaling):
    """Every pair turning at least beta_fast times keeps its frequency bit for bit, every pair
    turning at most beta_slow times has it divided by the factor; in between the frequency lies
    strictly between the two, and frequencies still fall with the pair index."""
    yarn = yarn_inverse_frequencies(head_dim, theta, scaling)
    plain = plain_float64(head_dim, theta)
    turns = rotations_over_original_context(
        head_dim, theta, scaling.original_max_position_embeddings
    )
    fast, slow = turns >= scaling.beta_fast, turns <= scaling.beta_slow
    assert fast.any() and slow.any()  # both limits are exercised
    np.testing.assert_array_equal(yarn[fast], plain[fast].astype(np.float32))
    np.testing.assert_array_equal(yarn[slow], (plain[slow] / scaling.factor).astype(np.float32))

    # The ramp's ends from the turn counts, rounded outward (floor and ceil: in two of these
    # cases rounding to nearest moves an end, so the rule is pinned, not only DeepSeek's).
    def pair_index(turns):
        original = scaling.original_max_position_embeddings
        return head_dim * math.log(original / (2 * math.pi * turns)) / (2 * math.log(theta))

    low, high = math.floor(pair_index(scaling.beta_fast)), math.ceil(pair_index(scaling.beta_slow))
    assert yarn_ramp_bounds(head_dim, theta, scaling) == (low, high)
    weight = np.clip((np.arange(head_dim // 2) - low) / (high - low), 0, 1)
    expected = (1 - weight) * plain + weight * plain / scaling.factor
    np.testing.assert_allclose(yarn, expected, rtol=2**-23, atol=0)
    inside = (np.arange(head_dim // 2) > low) & (np.arange(head_dim // 2) < high)
    assert np.all(yarn[inside] < plain[inside]) and np.all(
        yarn[inside] > plain[inside] / scaling.factor
    )
    assert np.all(np.diff(yarn) < 0)


def test_deepseek_ramp_is_linear_in_the_pair_index_between_10_and_23():
    """DeepSeek's RoPE (64 dims, theta 10000, 4096 positions, beta 32 and 1): the index where a
    pair turns 32 times is 64 ln(4096 / (64 pi)) / (2 ln 10000) = 10.47, once 22.51; rounded
    outward, the ramp runs from pair 10 (weight 0) to pair 23 (weight 1)."""
    assert yarn_ramp_bounds(64, 10000.0, DEEPSEEK) == (10, 23)
    yarn = yarn_inverse_frequencies(64, 10000.0, DEEPSEEK)
    plain = plain_float64(64, 10000.0)
    weight = np.clip((np.arange(32) - 10) / 13, 0, 1)
    expected = (1 - weight) * plain + weight * plain / 40.0
    np.testing.assert_allclose(yarn, expected, rtol=2**-23, atol=0)
    assert not np.allclose(yarn, plain, rtol=1e-3)  # the factor is applied at all


def test_rotating_with_yarn_frequencies():
    """``apply_rope_frequencies`` with the plain frequencies is ``apply_rope`` bit for bit; with
    YaRN's, a slow pair at position p turns as the plain one at p / factor."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 2, 64)), jnp.float32)
    positions = jnp.asarray([0, 1, 40, 4000, 160000], jnp.int32)
    params = RopeParams(theta=10000.0, interleaved=True)
    plain = inverse_frequencies(64, params)
    np.testing.assert_array_equal(
        apply_rope_frequencies(x, positions, plain, interleaved=True),
        apply_rope(x, positions, params),
    )
    yarn = yarn_inverse_frequencies(64, 10000.0, DEEPSEEK)
    rotated = np.asarray(apply_rope_frequencies(x, positions, yarn, interleaved=True))
    slowed = np.asarray(apply_rope(x, positions // 40, params))
    # Pair 31 (interleaved: elements 62, 63) is past the ramp; positions multiple of 40 only.
    multiples = np.asarray(positions) % 40 == 0
    np.testing.assert_allclose(
        rotated[multiples][..., 62:], slowed[multiples][..., 62:], rtol=0, atol=1e-4
    )


def test_mscale_values():
    assert yarn_mscale(40.0) == pytest.approx(0.1 * math.log(40.0) + 1, rel=1e-15)
    # DeepSeek-V2's fitted temperature: sqrt(t) = 0.0707 ln s + 1.
    assert yarn_mscale(40.0, 0.707) == pytest.approx(0.0707 * math.log(40.0) + 1, rel=1e-15)
    assert yarn_mscale(math.e, 1.0) == pytest.approx(1.1, rel=1e-15)
    assert yarn_mscale(40.0, 0.0) == 1.0
    assert DEEPSEEK.softmax_scale_multiplier == pytest.approx(
        (0.1 * math.log(40.0) + 1) ** 2, rel=1e-15
    )


def test_the_softmax_scale_takes_mscale_squared():
    plain = default_softmax_scale(128, 64)
    assert plain == 1 / math.sqrt(192)
    v3 = default_softmax_scale(128, 64, yarn=DEEPSEEK)
    assert v3 == pytest.approx((0.1 * math.log(40.0) + 1) ** 2 / math.sqrt(192), rel=1e-15)
    v2 = default_softmax_scale(128, 64, yarn=YarnScaling(mscale=0.707, mscale_all_dim=0.707))
    assert v2 == pytest.approx((0.0707 * math.log(40.0) + 1) ** 2 / math.sqrt(192), rel=1e-15)
    assert default_softmax_scale(128, 64, yarn=YarnScaling(factor=1.0)) == plain


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"factor": 0.5}, "factor must be >= 1 (YaRN stretches the context), got 0.5"),
        ({"factor": float("nan")}, "factor must be finite and > 0, got nan"),
        ({"factor": "40"}, "factor must be a number, got '40'"),
        ({"original_max_position_embeddings": 0}, "original_max_position_embeddings must be"),
        ({"original_max_position_embeddings": 4096.0}, "must be an int, got 4096.0"),
        ({"beta_fast": 1.0, "beta_slow": 1.0}, "beta_fast (1.0) must be > beta_slow (1.0)"),
        ({"beta_slow": -1.0}, "beta_slow must be finite and > 0, got -1.0"),
        ({"mscale": -1.0, "mscale_all_dim": -1.0}, "mscale must be finite and >= 0, got -1.0"),
        ({"mscale": 1.0, "mscale_all_dim": 0.707}, "mscale (1.0) must equal mscale_all_dim"),
    ],
)
def test_bad_yarn_fields_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        YarnScaling(**fields)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: yarn_mscale(0.9), "factor must be >= 1"),
        (lambda: yarn_mscale(40.0, float("inf")), "mscale_coefficient must be finite and >= 0"),
        (lambda: yarn_inverse_frequencies(63, 10000.0, DEEPSEEK), "head_dim must be even"),
        (lambda: yarn_inverse_frequencies(64, 1.0, DEEPSEEK), "theta must be > 1"),
        (
            lambda: yarn_inverse_frequencies(64, 10000.0, Llama3Scaling()),
            "scaling must be a YarnScaling, got Llama3Scaling(",
        ),
        (
            lambda: apply_rope_frequencies(
                jnp.ones((1, 1, 4)), jnp.zeros(1, jnp.int32), np.ones(3), interleaved=True
            ),
            "inv_freq must have shape (2,) (head_dim / 2), got (3,)",
        ),
        (
            lambda: apply_rope_frequencies(
                jnp.ones((1, 1, 4)), jnp.zeros(1, jnp.int32), np.ones(2), interleaved=1
            ),
            "interleaved must be a bool, got 1",
        ),
        (
            lambda: default_softmax_scale(128, 64, yarn=Llama3Scaling()),
            "yarn must be a paged.rope.YarnScaling or None",
        ),
    ],
)
def test_bad_arguments_are_refused_by_name(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()
