"""RoPE (``paged/rope.py``) and fused RoPE + paged KV append (``kernels_pallas/rope_append.py``
through ``paged.rope_append_kv``) against float64 references written here in NumPy.

- Frequencies: against the Llama 3.1 rule written out again below, independently, in plain
  Python floats, and against values computed by hand.
- Rotation: the oracle rotates in float64 by the float32 angles of the convention
  (``float32(p) * inv_freq``, one float32 product; ``paged/rope.py`` says why the angle itself is
  not compared with exact arithmetic), picking the pairs with index arrays of its own.
- Append: the oracle places token t at ``page_lists[b][p // page_size]``, slot
  ``p % page_size``, from the Python lists the table was built from, never from ``paged``.
  Slots no token writes must keep their old (random) values bit for bit.

Interpret mode on a CPU, compiled on a GPU (plus the ``gpu``-marked test at benchmark shapes).
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import paged
from kernels_pallas import platform
from kernels_pallas import rope_append as rope_append_kernels
from paged import rope_append as rope_append_module
from paged.rope import Llama3Scaling, RopeParams, apply_rope, inverse_frequencies, rope_angles
from tests.strategies import fixed_total_seq_lens

# Programs that run long (a 4096-token prefill): compiled with XLA's CPU optimizations
# (tests/conftest.py).
CPU_PROGRAMS_OPTIMIZED = True

# testing.md's bounds on ||out - ref|| / ||ref||.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
UNIT_ROUNDOFF = {jnp.float32: 2.0**-24, jnp.bfloat16: 2.0**-8}
LLAMA31 = RopeParams(theta=500000.0, scaling=Llama3Scaling())


def rotation_bound(dtype) -> float:
    """Largest error of one rotated element, relative to the norm r of its pair.

    In float32 units u = 2**-24: cos and sin of the same float32 angle are each off by at most
    2 u (libdevice's cosf/sinf: 2 ulp of a value below 1; XLA's CPU ones measure 0.55 ulp), which
    moves ``a cos - b sin`` by at most ``(|a| + |b|) 2 u <= 2 sqrt(2) r u``; the two products and
    the difference add at most ``3 r u``. Then one rounding to the stored dtype, at most its unit
    roundoff times the element (itself at most r).
    """
    return UNIT_ROUNDOFF[dtype] + (2 * math.sqrt(2) + 3) * 2.0**-24


# ----------------------------------------------------------------------------------------------
# Frequencies


def llama31_frequencies(head_dim, theta, factor, low_freq_factor, high_freq_factor, original):
    """The published Llama 3.1 rule, one frequency at a time, in Python floats (float64)."""
    result = []
    for i in range(head_dim // 2):
        frequency = 1.0 / theta ** (2 * i / head_dim)
        wavelength = 2 * math.pi / frequency
        if wavelength < original / high_freq_factor:
            result.append(frequency)
        elif wavelength > original / low_freq_factor:
            result.append(frequency / factor)
        else:
            smooth = (original / wavelength - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            result.append((1 - smooth) * frequency / factor + smooth * frequency)
    return np.array(result)


@pytest.mark.parametrize(
    "head_dim,theta,factor,low,high,original",
    [
        (128, 500000.0, 8.0, 1.0, 4.0, 8192),  # Llama 3.1
        (64, 500000.0, 32.0, 1.0, 4.0, 8192),  # Llama 3.2 (1B, 3B)
        (96, 10000.0, 4.0, 2.0, 8.0, 4096),  # a band elsewhere, head_dim not a power of two
    ],
)
def test_scaled_frequencies_follow_the_llama31_rule(head_dim, theta, factor, low, high, original):
    params = RopeParams(theta=theta, scaling=Llama3Scaling(factor, low, high, original))
    ours = inverse_frequencies(head_dim, params)
    expected = llama31_frequencies(head_dim, theta, factor, low, high, original)
    assert ours.dtype == np.float32 and ours.shape == (head_dim // 2,)
    # Both are float64 values rounded once to float32; computed in another order they may round
    # to neighbouring float32 numbers: at most one float32 ulp (2**-23 relative) apart.
    np.testing.assert_allclose(ours, expected, rtol=2.0**-23, atol=0)


def test_llama31_frequencies_computed_by_hand():
    """head_dim 128, theta 500000, factor 8, low 1, high 4, original 8192: wavelengths below
    8192 / 4 = 2048 keep their frequency, those above 8192 are slowed 8x, in between blend."""
    ours = inverse_frequencies(128, LLAMA31).astype(np.float64)
    unscaled = inverse_frequencies(128, RopeParams(theta=500000.0)).astype(np.float64)
    assert ours[0] == 1.0  # wavelength 2 pi
    # i = 63: 500000 ** (-126 / 128) = exp(-0.984375 x 13.122363) = exp(-12.917327) = 2.4551e-6,
    # wavelength 2.6e6 > 8192, so divided by 8: 3.0689e-7 (5 digits: rel 1e-4).
    assert ours[63] == pytest.approx(3.0689e-7, rel=1e-4)
    # i = 32: 500000 ** -0.5 = 1.41421e-3, wavelength 2 pi / 1.41421e-3 = 4442.88, inside
    # (2048, 8192): smooth = (8192 / 4442.88 - 1) / 3 = 0.281283, frequency
    # 1.41421e-3 x ((1 - 0.281283) / 8 + 0.281283) = 5.24846e-4 (6 digits: rel 1e-5).
    assert ours[32] == pytest.approx(5.24846e-4, rel=1e-5)
    # Bands: 2 pi 500000 ** (i / 64) crosses 2048 between i = 28 and 29, 8192 between 34 and 35.
    # Division by 8 is exact in floating point, so the two outer bands match exactly.
    np.testing.assert_array_equal(ours[:29], unscaled[:29])
    np.testing.assert_array_equal(ours[35:], unscaled[35:] / 8)
    blend = ours[29:35]
    assert np.all((unscaled[29:35] / 8 < blend) & (blend < unscaled[29:35]))


def test_unscaled_frequencies_and_hand_values():
    assert inverse_frequencies(4, RopeParams(theta=100.0)).tolist() == [1.0, np.float32(0.1)]
    expected = 10000.0 ** -(np.arange(0, 128, 2) / 128)
    np.testing.assert_allclose(inverse_frequencies(128, RopeParams()), expected, rtol=2.0**-24)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: RopeParams(theta=0.0), "theta must be finite and > 0, got 0.0"),
        (lambda: RopeParams(theta=float("nan")), "theta"),
        (lambda: RopeParams(interleaved=1), "interleaved must be a bool, got 1"),
        (lambda: RopeParams(scaling={"factor": 8}), "scaling must be a Llama3Scaling"),
        (lambda: Llama3Scaling(factor=-8.0), "factor must be finite and > 0, got -8.0"),
        (lambda: Llama3Scaling(low_freq_factor=4.0, high_freq_factor=4.0), "high_freq_factor"),
        (lambda: Llama3Scaling(original_max_position_embeddings=8192.5), "must be an int"),
        (lambda: inverse_frequencies(7, RopeParams()), "head_dim must be even"),
    ],
)
def test_bad_rope_parameters_are_rejected(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ----------------------------------------------------------------------------------------------
# Rotation


def rope64(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, interleaved: bool):
    """float64 rotation of ``x [T, H, D]`` by the float32 angles ``float32(p) * inv_freq``."""
    head_dim = x.shape[-1]
    if interleaved:
        first, second = np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)
    else:
        first, second = np.arange(head_dim // 2), np.arange(head_dim // 2, head_dim)
    angles = np.asarray(positions, np.float32)[:, None] * np.asarray(inv_freq, np.float32)
    cos = np.cos(angles.astype(np.float64))[:, None, :]
    sin = np.sin(angles.astype(np.float64))[:, None, :]
    a, b = x[..., first], x[..., second]
    out = np.empty_like(x, dtype=np.float64)
    out[..., first] = a * cos - b * sin
    out[..., second] = b * cos + a * sin
    radius = np.empty_like(out)
    radius[..., first] = radius[..., second] = np.hypot(a, b)
    return out, radius


def check_rotated(out, x, positions, inv_freq, interleaved, dtype) -> None:
    expected, radius = rope64(
        np.asarray(jnp.asarray(x, jnp.float32), np.float64), positions, inv_freq, interleaved
    )
    got = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got))
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < TOLERANCE[dtype]
    excess = np.abs(got - expected) - rotation_bound(dtype) * radius
    assert np.all(excess <= 0), float(np.max(excess))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotation_by_hand(interleaved):
    """x = [1, 2, 3, 4] at position 1, theta 100: frequencies 1 and 0.1. Rotate-half turns
    (x0, x2) by 1 and (x1, x3) by 0.1; interleaved turns (x0, x1) by 1 and (x2, x3) by 0.1."""
    c1, s1 = math.cos(1.0), math.sin(1.0)
    c2, s2 = math.cos(float(np.float32(0.1))), math.sin(float(np.float32(0.1)))
    if interleaved:
        expected = [1 * c1 - 2 * s1, 2 * c1 + 1 * s1, 3 * c2 - 4 * s2, 4 * c2 + 3 * s2]
    else:
        expected = [1 * c1 - 3 * s1, 2 * c2 - 4 * s2, 3 * c1 + 1 * s1, 4 * c2 + 2 * s2]
    x = jnp.array([[[1.0, 2.0, 3.0, 4.0]]])
    out = apply_rope(x, jnp.array([1]), RopeParams(theta=100.0, interleaved=interleaved))
    np.testing.assert_allclose(np.asarray(out).ravel(), expected, rtol=1e-6)


@pytest.mark.parametrize("interleaved", [False, True])
def test_reference_rotation_matches_float64(interleaved, float64):
    rng = np.random.default_rng(1)
    positions = np.array([0, 1, 17, 4095, 65536, 131072])
    x = rng.standard_normal((6, 3, 96))
    params = RopeParams(theta=500000.0, interleaved=interleaved, scaling=Llama3Scaling())
    out = apply_rope(jnp.asarray(x), jnp.asarray(positions), params)
    assert out.dtype == jnp.float64
    expected, _ = rope64(x, positions, inverse_frequencies(96, params), interleaved)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(np.asarray(out)[0], x[0])  # position 0: no rotation


def test_float32_angle_error_at_131072_is_as_documented():
    """paged/rope.py: at position 2**17 the float32 product is within 2**-7 of the product of
    the float32 operands, and inv_freq's own rounding adds at most p 2**-24 inv_freq = 2**-7."""
    positions = jnp.array([131072, 131071, 100003])
    exact_frequencies = 10000.0 ** -(np.arange(0, 128, 2) / 128)
    angles = np.asarray(rope_angles(positions, inverse_frequencies(128, RopeParams())), np.float64)
    exact = np.asarray(positions, np.float64)[:, None] * exact_frequencies[None, :]
    error = np.abs(angles - exact)
    assert np.max(error) <= 2.0**-6
    assert np.max(error) > 2.0**-12  # the error is real: float32 cannot hold these angles


# ----------------------------------------------------------------------------------------------
# RoPE + append: kernel and reference against the float64 oracle


def make_append_case(
    seed,
    prior_lens,
    new_lens,
    *,
    layout,
    num_q_heads,
    num_kv_heads,
    head_dim,
    page_size,
    dtype,
    num_pool_pages,
    page_lists=None,
):
    """Random q, k, v for new tokens appended after each request's prior tokens, in a random
    token order; a random pool (nothing is zero); pages scattered over the pool."""
    rng = np.random.default_rng(seed)
    seq_lens = [a + b for a, b in zip(prior_lens, new_lens, strict=True)]
    if page_lists is None:
        order = rng.permutation(num_pool_pages).tolist()
        page_lists, start = [], 0
        for length in seq_lens:
            count = -(-length // page_size)
            page_lists.append(order[start : start + count])
            start += count
    table = paged.PageTable.from_page_lists(page_lists, seq_lens, page_size)
    batch = np.concatenate([[b] * n for b, n in enumerate(new_lens)]).astype(np.int32)
    positions = np.concatenate(
        [np.arange(p, p + n) for p, n in zip(prior_lens, new_lens, strict=True)]
    )
    order = rng.permutation(len(batch))
    batch, positions = batch[order], positions[order].astype(np.int32)
    if layout == "HND":
        shape = (num_pool_pages, num_kv_heads, page_size, head_dim)
    else:
        shape = (num_pool_pages, page_size, num_kv_heads, head_dim)
    cache = paged.KVCache(
        jnp.asarray(rng.standard_normal(shape), dtype),
        jnp.asarray(rng.standard_normal(shape), dtype),
        layout,
    )
    tokens = len(batch)
    q = jnp.asarray(2 * rng.standard_normal((tokens, num_q_heads, head_dim)), dtype)
    k = jnp.asarray(2 * rng.standard_normal((tokens, num_kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((tokens, num_kv_heads, head_dim)), dtype)
    return q, k, v, positions, batch, cache, table, page_lists


def kernel_append_matches_oracle(q, k, v, positions, batch, cache, table, page_lists, rope):
    """``paged.rope_append_kv`` on the kernel, checked by ``check_append``."""
    q_rotated, new_cache = paged.rope_append_kv(
        q,
        k,
        v,
        jnp.asarray(positions),
        jnp.asarray(batch),
        cache,
        table,
        rope=rope,
        backend="pallas",
    )
    check_append(q, k, v, positions, batch, cache, page_lists, rope, q_rotated, new_cache)


def check_append(
    q, k, v, positions, batch, cache, page_lists, rope, q_rotated, new_cache, *, written=None
):
    """q_rotated and every slot of the pool against the oracle. ``written``: which tokens must
    land in the pool (default all)."""
    dtype = q.dtype.type
    inv_freq = inverse_frequencies(q.shape[-1], rope)
    assert q_rotated.dtype == q.dtype and q_rotated.shape == q.shape
    check_rotated(q_rotated, q, positions, inv_freq, rope.interleaved, dtype)
    page_size = cache.page_size
    expected_k = np.asarray(cache.to_nhd(cache.k_pages))  # [P, S, Hkv, D], old values
    expected_v = np.asarray(cache.to_nhd(cache.v_pages))
    got_k = np.asarray(new_cache.to_nhd(new_cache.k_pages))
    got_v = np.asarray(new_cache.to_nhd(new_cache.v_pages))
    assert new_cache.layout == cache.layout and got_k.dtype == expected_k.dtype
    touched = np.zeros(expected_k.shape[:2], bool)
    slots = []
    for t, (b, p) in enumerate(zip(batch.tolist(), positions.tolist(), strict=True)):
        if written is not None and not written[t]:
            continue
        page, slot = page_lists[b][p // page_size], p % page_size
        touched[page, slot] = True
        slots.append((t, page, slot))
    # Untouched slots: bit for bit the old pool.
    np.testing.assert_array_equal(got_k[~touched], expected_k[~touched])
    np.testing.assert_array_equal(got_v[~touched], expected_v[~touched])
    if not slots:
        return
    tokens, pages, slot_ids = (np.array(column) for column in zip(*slots, strict=True))
    # v is stored as given (same dtype: exactly); k rotated, within the rotation bound.
    np.testing.assert_array_equal(got_v[pages, slot_ids], np.asarray(v)[tokens])
    check_rotated(
        got_k[pages, slot_ids],
        np.asarray(k)[tokens],
        positions[tokens],
        inv_freq,
        rope.interleaved,
        dtype,
    )


# Pairwise cover of layout x convention x dtype x head_dim x group x page_size (every pair of
# layout, convention, dtype and head_dim appears), with head counts and halves of head_dim that
# are not powers of two (the kernel pads them in registers).
APPEND_CONFIGS = [
    ("HND", False, jnp.float32, 64, 4, 2, 16, LLAMA31),
    ("HND", True, jnp.bfloat16, 128, 8, 2, 16, RopeParams(interleaved=True)),
    ("NHD", False, jnp.bfloat16, 96, 6, 3, 5, RopeParams(theta=1e6)),
    ("NHD", True, jnp.float32, 128, 4, 4, 16, RopeParams(500000.0, True, Llama3Scaling())),
    ("HND", True, jnp.float32, 96, 3, 1, 7, RopeParams(interleaved=True)),
    ("NHD", False, jnp.bfloat16, 64, 2, 1, 1, LLAMA31),
]
# Prior and new tokens a request: a page boundary crossed (14 -> 19, 33 -> 49), the first token
# of an empty request, a page plus one (16 -> 17), a request with nothing new.
PRIOR_LENS = (14, 0, 33, 5, 16, 9)
NEW_LENS = (5, 1, 16, 3, 1, 0)


@pytest.mark.parametrize("layout,interleaved,dtype,head_dim,hq,hkv,page_size,rope", APPEND_CONFIGS)
def test_rope_append_matches_float64_oracle(
    layout, interleaved, dtype, head_dim, hq, hkv, page_size, rope
):
    assert rope.interleaved == interleaved
    case = make_append_case(
        head_dim + page_size,
        PRIOR_LENS,
        NEW_LENS,
        layout=layout,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        num_pool_pages=128,  # 103 pages in use at page_size 1; others scattered among spares
    )
    q, k, v, positions, batch, cache, table, page_lists = case
    for backend in ("pallas", "reference"):
        q_rotated, new_cache = paged.rope_append_kv(
            q,
            k,
            v,
            jnp.asarray(positions),
            jnp.asarray(batch),
            cache,
            table,
            rope=rope,
            backend=backend,
        )
        check_append(q, k, v, positions, batch, cache, page_lists, rope, q_rotated, new_cache)


def test_positions_up_to_131072():
    """A request at the end of a 128K context (positions 131060 to 131072, crossing a page),
    beside a short one. The long request's earlier pages all name page 0 (shared read-only);
    only its last two pages, and the short request's page, are written."""
    page_size = 16
    prior, new = [131060, 3], [13, 2]
    long_pages = [0] * (131060 // page_size) + [5, 9]
    case = make_append_case(
        7,
        prior,
        new,
        layout="HND",
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=128,
        page_size=page_size,
        dtype=jnp.float32,
        num_pool_pages=12,
        page_lists=[long_pages, [3]],
    )
    q, k, v, positions, batch, cache, table, page_lists = case
    assert positions.max() == 131072
    kernel_append_matches_oracle(q, k, v, positions, batch, cache, table, page_lists, LLAMA31)


def test_prefill_of_4096_tokens():
    """4096 new tokens (two prompts of 4000 and 96) in one call."""
    case = make_append_case(
        3,
        [0, 0],
        [4000, 96],
        layout="NHD",
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=32,
        page_size=16,
        dtype=jnp.bfloat16,
        num_pool_pages=260,
    )
    q, k, v, positions, batch, cache, table, page_lists = case
    kernel_append_matches_oracle(q, k, v, positions, batch, cache, table, page_lists, LLAMA31)


BUCKET_BATCH, BUCKET_TOKENS, BUCKET_PAGE_SIZE, BUCKET_POOL, BUCKET_INDICES = 4, 16, 4, 64, 64


@st.composite
def ragged_appends(draw):
    """Prior lengths, a fixed total of new tokens spread over the requests, pages drawn from a
    permutation of the pool, and a token order: values only, one static shape."""
    prior = draw(st.lists(st.integers(0, 40), min_size=BUCKET_BATCH, max_size=BUCKET_BATCH))
    new = draw(fixed_total_seq_lens(BUCKET_BATCH, BUCKET_TOKENS))
    pool_order = draw(st.permutations(range(BUCKET_POOL)))
    token_order = draw(st.permutations(range(BUCKET_TOKENS)))
    return prior, new, pool_order, token_order, draw(st.integers(0, 2**31 - 1))


@given(ragged_appends())
def test_random_ragged_appends_in_one_bucket(drawn):
    prior, new, pool_order, token_order, seed = drawn
    seq_lens = [a + b for a, b in zip(prior, new, strict=True)]
    page_lists, start = [], 0
    for length in seq_lens:
        count = -(-length // BUCKET_PAGE_SIZE)
        page_lists.append(list(pool_order[start : start + count]))
        start += count
    q, k, v, positions, batch, cache, _, _ = make_append_case(
        seed,
        prior,
        new,
        layout="HND",
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        page_size=BUCKET_PAGE_SIZE,
        dtype=jnp.float32,
        num_pool_pages=BUCKET_POOL,
        page_lists=page_lists,
    )
    table = paged.PageTable.from_page_lists(
        page_lists, seq_lens, BUCKET_PAGE_SIZE, num_indices=BUCKET_INDICES
    )
    order = np.array(token_order)
    q, k, v = q[order], k[order], v[order]
    positions, batch = positions[order], batch[order]
    kernel_append_matches_oracle(q, k, v, positions, batch, cache, table, page_lists, LLAMA31)


def test_invalid_tokens_under_jit_are_not_written():
    """Under jit nothing is validated (design.md): a token with a negative position, a position
    past its request, a request outside the batch, or a page outside the pool (above it, or
    negative) is dropped; the valid tokens land; q is rotated for all; nothing else changes."""
    page_size, pool = 4, 10
    # Request 0: 6 tokens in pages [2, 7]; request 1: 3 tokens, its page entry outside the pool;
    # request 2: 2 tokens, its page entry negative.
    table = paged.PageTable(
        page_indptr=jnp.array([0, 2, 3, 4], jnp.int32),
        page_indices=jnp.array([2, 7, 99, -3, 0, 0, 0, 0], jnp.int32),
        last_page_len=jnp.array([2, 3, 2], jnp.int32),
        page_size=page_size,
    )
    page_lists = [[2, 7], [99], [-3]]
    batch = np.array([0, 0, 0, 3, -1, 1, 2, 0], np.int32)
    positions = np.array([5, -1, 6, 0, 0, 1, 0, 2], np.int32)
    written = np.array([True, False, False, False, False, False, False, True])
    rng = np.random.default_rng(4)
    shape = (pool, 2, page_size, 8)
    cache = paged.KVCache(
        jnp.asarray(rng.standard_normal(shape), jnp.float32),
        jnp.asarray(rng.standard_normal(shape), jnp.float32),
        "HND",
    )
    q = jnp.asarray(rng.standard_normal((8, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((8, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((8, 2, 8)), jnp.float32)
    call = jax.jit(
        lambda q, k, v, positions, batch, cache, table: paged.rope_append_kv(
            q, k, v, positions, batch, cache, table, rope=LLAMA31, backend="pallas"
        )
    )
    q_rotated, new_cache = call(q, k, v, positions, batch, cache, table)
    check_append(
        q, k, v, positions, batch, cache, page_lists, LLAMA31, q_rotated, new_cache, written=written
    )


def test_donated_cache_is_updated_in_place():
    q, k, v, positions, batch, cache, table, _ = make_append_case(
        2,
        [3, 20],
        [2, 4],
        layout="NHD",
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=16,
        page_size=8,
        dtype=jnp.bfloat16,
        num_pool_pages=8,
    )
    expected_q = apply_rope(q, jnp.asarray(positions), LLAMA31).astype(q.dtype)
    old_k = np.asarray(cache.k_pages)
    # Fresh buffers that nothing else holds (an array sharing NumPy's memory is not donated).
    cache = paged.KVCache(jnp.copy(cache.k_pages), jnp.copy(cache.v_pages), cache.layout)
    k_address = cache.k_pages.unsafe_buffer_pointer()
    call = jax.jit(
        lambda cache, q, k, v: paged.rope_append_kv(
            q,
            k,
            v,
            jnp.asarray(positions),
            jnp.asarray(batch),
            cache,
            table,
            rope=LLAMA31,
            backend="pallas",
        ),
        donate_argnums=0,
    )
    q_rotated, new_cache = call(cache, q, k, v)
    assert cache.k_pages.is_deleted()
    assert new_cache.k_pages.unsafe_buffer_pointer() == k_address
    np.testing.assert_allclose(
        np.asarray(q_rotated, np.float32), np.asarray(expected_q, np.float32), atol=2**-6
    )
    assert np.sum(np.asarray(new_cache.k_pages) != old_k) > 0  # the new slots were written


def test_empty_append_and_auto_backend(monkeypatch):
    q, k, v, positions, batch, cache, table, _ = make_append_case(
        0,
        [3],
        [2],
        layout="HND",
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=8,
        page_size=4,
        dtype=jnp.float32,
        num_pool_pages=4,
    )
    empty = jnp.zeros((0, 2, 8)), jnp.zeros((0, 1, 8)), jnp.zeros((0, 1, 8))
    q_rotated, same = paged.rope_append_kv(
        *empty, jnp.zeros(0, jnp.int32), jnp.zeros(0, jnp.int32), cache, table, backend="pallas"
    )
    assert q_rotated.shape == (0, 2, 8) and same is cache
    assert platform.AUTO_PICKS_KERNEL["rope_append_kv"]

    def auto_calls_pallas() -> bool:
        jaxpr = jax.make_jaxpr(
            lambda q, k, v: paged.rope_append_kv(
                q, k, v, jnp.asarray(positions), jnp.asarray(batch), cache, table
            )
        )(q, k, v)
        return "pallas_call" in str(jaxpr)

    # Checked and timed on the H200, so "auto" runs the kernel on a GPU and the reference elsewhere.
    monkeypatch.setattr(platform, "on_gpu", lambda: False)
    assert not auto_calls_pallas()
    monkeypatch.setattr(platform, "on_gpu", lambda: True)
    assert auto_calls_pallas()
    monkeypatch.undo()
    monkeypatch.setenv(platform.KILL_SWITCH_VARIABLE, "pallas")
    with pytest.raises(ValueError, match="DECODELAB_BACKEND"):
        paged.rope_append_kv(q, k, v, jnp.asarray(positions), jnp.asarray(batch), cache, table)


# ----------------------------------------------------------------------------------------------
# Bad input (concrete): clear errors naming the argument and the value


def _valid_inputs():
    q, k, v, positions, batch, cache, table, _ = make_append_case(
        5,
        [3, 6],
        [2, 1],
        layout="HND",
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=8,
        page_size=4,
        dtype=jnp.float32,
        num_pool_pages=6,
    )
    return dict(
        q=q,
        k=k,
        v=v,
        positions=jnp.asarray(positions),
        batch_indices=jnp.asarray(batch),
        cache=cache,
        page_table=table,
    )


def _with(**changes):
    inputs = _valid_inputs()
    inputs.update({name: change(inputs) for name, change in changes.items()})
    return inputs


BAD_INPUTS = [
    (dict(positions=lambda a: a["positions"].at[0].set(-1)), r"positions\[0\]=-1 is outside"),
    (dict(positions=lambda a: a["positions"].at[1].set(99)), r"positions\[1\]=99 is outside"),
    (
        dict(batch_indices=lambda a: a["batch_indices"].at[2].set(5)),
        r"batch_indices\[2\]=5 is outside the batch of 2",
    ),
    (
        dict(
            page_table=lambda a: paged.PageTable(
                a["page_table"].page_indptr,
                a["page_table"].page_indices.at[1].set(6),
                a["page_table"].last_page_len,
                4,
            )
        ),
        r"page_table.page_indices\[1\]=6 is outside the pool of 6 pages",
    ),
    (
        dict(
            positions=lambda a: a["positions"].at[0].set(a["positions"][1]),
            batch_indices=lambda a: a["batch_indices"].at[0].set(a["batch_indices"][1]),
        ),
        "appears more than once",
    ),
    (dict(k=lambda a: a["k"][:, :1]), r"k must have shape .* = \(3, 2, 8\).*got \(3, 1, 8\)"),
    (dict(v=lambda a: a["v"][:2]), r"v must have shape .*got \(2, 2, 8\)"),
    (dict(q=lambda a: a["q"][..., :6]), "q has head_dim 6 but the cache has 8"),
    (dict(q=lambda a: a["q"][0]), r"q must have shape \[tokens, num_q_heads, head_dim\]"),
    (dict(positions=lambda a: a["positions"][:2]), r"positions must have shape \[3\]"),
    (dict(positions=lambda a: a["positions"].astype(jnp.float32)), "positions must be an integer"),
    (dict(k=lambda a: a["k"].astype(jnp.int32)), "k must be a floating array"),
    (dict(cache=lambda a: paged.new_kv_cache(6, 4, 2, 7, jnp.float32)), "head_dim=7 must be even"),
    (
        dict(page_table=lambda a: paged.PageTable.from_seq_lens([5, 7], page_size=8)),
        "page_table.page_size=8 differs from the cache's page_size=4",
    ),
]


@pytest.mark.parametrize("changes,match", BAD_INPUTS)
def test_bad_input_is_rejected(changes, match):
    inputs = _with(**changes)
    with pytest.raises(ValueError, match=match):
        paged.rope_append_kv(**inputs, backend="pallas")


def test_float64_is_not_rotated_in_float32(float64):
    inputs = _valid_inputs()
    inputs["q"] = inputs["q"].astype(jnp.float64)
    with pytest.raises(ValueError, match="float64 would lose precision"):
        paged.rope_append_kv(**inputs, backend="pallas")
    q_rotated, _ = paged.rope_append_kv(**inputs, backend="reference")
    assert q_rotated.dtype == jnp.float64


def test_bad_rope_and_backend_are_rejected():
    with pytest.raises(ValueError, match=r"rope must be a paged\.RopeParams"):
        paged.rope_append_kv(**_valid_inputs(), rope={"theta": 1e4})
    with pytest.raises(ValueError, match="backend must be one of"):
        paged.rope_append_kv(**_valid_inputs(), backend="cuda")


# ----------------------------------------------------------------------------------------------
# The GPU path


def _pool(layout, pages, heads, page_size, head_dim):
    shape = (
        (pages, heads, page_size, head_dim)
        if layout == "HND"
        else (pages, page_size, heads, head_dim)
    )
    return jax.ShapeDtypeStruct(shape, jnp.bfloat16)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Pallas Triton backend's
def test_kernel_lowers_to_triton_for_an_h200(monkeypatch, verify_triton_modules):
    """As far as a CPU can follow the GPU path: at the benchmark shape (64 tokens, 32 and 8
    heads, head_dim 128, pages of 16) and an odd one (6 and 3 heads, head_dim 96, pages of 5),
    for both layouts and conventions, the kernel lowers to one Triton call for an H200 with the
    pools (operands 9 and 10) aliased to its outputs 1 and 2. Compiling needs the GPU."""
    gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
    h200 = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
    monkeypatch.setitem(gpu_info.registry, jax.devices()[0].device_kind, lambda: h200)
    shapes = [(64, 32, 8, 128, 16, 4096), (5, 6, 3, 96, 5, 40)]
    for tokens, hq, hkv, head_dim, page_size, pages in shapes:

        def array(*shape, dtype=jnp.bfloat16):
            return jax.ShapeDtypeStruct(shape, dtype)

        for layout in ("HND", "NHD"):
            for interleaved in (False, True):
                pool = _pool(layout, pages, hkv, page_size, head_dim)
                lowered = rope_append_kernels.rope_append.trace(
                    array(tokens, hq, head_dim),
                    array(tokens, hkv, head_dim),
                    array(tokens, hkv, head_dim),
                    array(tokens, dtype=jnp.int32),
                    array(tokens, dtype=jnp.int32),
                    array(head_dim // 2, dtype=jnp.float32),
                    array(tokens, dtype=jnp.int32),  # last_page_len: a request a token
                    array(tokens + 1, dtype=jnp.int32),
                    array(pages, dtype=jnp.int32),
                    pool,
                    pool,
                    layout=layout,
                    interleaved=interleaved,
                    interpret=False,
                )
                text = lowered.lower(lowering_platforms=("cuda",)).as_text()
                name = f"rope_append_{layout}_{'interleaved' if interleaved else 'half'}"
                assert re.findall(r'name = "(rope_append\w*)"', text) == [name]
                aliases = re.findall(
                    r"output_operand_alias<output_tuple_indices = \[(\d)\], operand_index = (\d+)",
                    text,
                )
                assert aliases == [("1", "9"), ("2", "10")]


# Operations of a lowered program that launch nothing: a reshape of a row-major array is a
# bitcast, a constant is data in the executable, calls and returns are structure.
FREE_OPERATIONS = {
    "stablehlo.constant",
    "stablehlo.reshape",
    "call",
    "func.call",
    "return",
    "stablehlo.return",
}
TRITON_CALL = "stablehlo.custom_call @__gpu$xla.gpu.triton"


def lowered_operations(text: str) -> list[str]:
    """The operation of every statement of a StableHLO module's text, in order (``func.func``
    and ``module`` lines, which open regions, are not statements)."""
    operations = []
    for line in text.splitlines():
        match = re.match(r'\s*(?:%[^=]+= )?"?([a-z_]+(?:\.[a-z_]+)?)\b', line)
        if match and match.group(1) not in ("func.func", "module"):
            operation = match.group(1)
            if operation == "stablehlo.custom_call" and TRITON_CALL in line:
                operation = TRITON_CALL
            operations.append(operation)
    return operations


def _lower_public_path_for_cuda(backend, layout, interleaved):
    """``paged.rope_append_kv`` at the benchmark's shape (64 decode tokens, 32 and 8 heads,
    head_dim 128, pages of 16, bfloat16), jitted with the pool donated as an engine calls it,
    lowered for a GPU: its StableHLO text."""
    tokens, hq, hkv, head_dim, page_size, pages = 64, 32, 8, 128, 16, 4096

    def array(*shape, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dtype)

    def step(q, k, v, positions, batch, k_pages, v_pages, page_indptr, page_indices, last_len):
        cache = paged.KVCache(k_pages, v_pages, layout)
        table = paged.PageTable(page_indptr, page_indices, last_len, page_size)
        rope = RopeParams(500000.0, interleaved, Llama3Scaling())
        q_rotated, cache = paged.rope_append_kv(
            q, k, v, positions, batch, cache, table, rope=rope, backend=backend
        )
        return q_rotated, cache.k_pages, cache.v_pages

    pool = _pool(layout, pages, hkv, page_size, head_dim)
    arguments = (
        array(tokens, hq, head_dim, dtype=jnp.bfloat16),
        array(tokens, hkv, head_dim, dtype=jnp.bfloat16),
        array(tokens, hkv, head_dim, dtype=jnp.bfloat16),
        array(tokens),
        array(tokens),
        pool,
        pool,
        array(tokens + 1),
        array(64 * 260),
        array(tokens),
    )
    traced = jax.jit(step, donate_argnums=(5, 6)).trace(*arguments)
    return traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Pallas Triton backend's
@pytest.mark.parametrize("layout,interleaved", [("HND", False), ("NHD", True)])
def test_pallas_path_is_one_launch_and_nothing_else(monkeypatch, layout, interleaved):
    """A call of the public Pallas path, lowered for an H200, is one Triton custom call and
    nothing that launches a kernel: no cast, index arithmetic, gather, scatter, transpose or
    copy of q, k, v, the table or the pool; only bitcast reshapes and the constant frequency
    table. A decode step is launch-bound (about 1.5 MiB moved), so this is what makes the fused
    path faster than the unfused one.

    For comparison, at the same shape (HND, rotate-half, Llama 3.1 frequencies) the unfused
    reference lowers to 163 StableHLO operations besides its 38 constants and calls: 3 gathers
    (each request's length and page), 2 scatters into the pool, 2 cos and 2 sin, and the
    rotation and index arithmetic around them (61 broadcasts, 20 compares, 12 adds, 11
    converts, 11 multiplies, 11 selects, 6 slices, 6 ands, 5 subtracts, 4 concatenates, ...),
    which XLA fuses into several kernels. Before the kernel took the table's arrays as they are,
    the Pallas path had 13 operations besides its custom call, reshapes and constant (each
    request's length from the table: 2 slices, 2 subtracts, a compare, a multiply, an add, a
    select, 4 broadcasts, a convert), one more launch a call.
    """
    gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
    h200 = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
    monkeypatch.setitem(gpu_info.registry, jax.devices()[0].device_kind, lambda: h200)
    monkeypatch.setattr(rope_append_module, "interpret_mode", lambda: False)
    text = _lower_public_path_for_cuda("pallas", layout, interleaved)
    operations = lowered_operations(text)
    assert operations.count(TRITON_CALL) == 1
    name = f"rope_append_{layout}_{'interleaved' if interleaved else 'half'}"
    assert re.findall(r'name = "(rope_append\w*)"', text) == [name]
    launching = [op for op in operations if op not in FREE_OPERATIONS | {TRITON_CALL}]
    assert launching == []

    reference = lowered_operations(_lower_public_path_for_cuda("reference", layout, interleaved))
    assert TRITON_CALL not in reference
    assert reference.count("stablehlo.scatter") == 2 and reference.count("stablehlo.gather") == 3


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_benchmark_shape_on_gpu(layout):
    """Compiled, at the benchmark's shape (a decode step of 64 requests, one new token each)."""
    rng = np.random.default_rng(0)
    prior = rng.integers(0, 4000, 64).tolist()
    case = make_append_case(
        1,
        prior,
        [1] * 64,
        layout=layout,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        dtype=jnp.bfloat16,
        num_pool_pages=64 * 260,
    )
    for interleaved in (False, True):
        kernel_append_matches_oracle(*case, RopeParams(500000.0, interleaved, Llama3Scaling()))
