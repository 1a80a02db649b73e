"""The shared counter-based generators: Threefry and Philox bit for bit, their counter layouts,
and their noise.

What is checked, and how:

- ``threefry2x32`` against Random123's published known answers and, bit for bit, against JAX's
  own Threefry primitive (``jax.extend.random.threefry2x32_p``) on hypothesis-drawn words.
- ``philox4x32`` against Random123's published known answers and against a plain-integer
  restatement of the round on hypothesis-drawn words; ``mulhilo32`` against the exact 64-bit
  product; ``noise_bits`` against its quad layout, with distinct counters for distinct
  (column, stream) pairs and a row's numbers depending on its key alone.
- Keys: typed, legacy and batched keys give the same words; anything else raises ``ValueError``
  naming ``key``. Per-row keys make a row's numbers depend on its key alone (permuting the batch
  permutes the numbers); one key gives distinct rows; streams and columns never share a counter.
- Kernels: a Pallas kernel (interpreted on a CPU, compiled on a GPU) computes the same bits
  (Threefry and Philox), uniforms, exponentials and Gumbels as plain JAX, bit for bit; compiled,
  the Gumbels only to within ``2**-20 max(1, |G|)`` (two compilers' ``log2`` and contraction).
- Noise, by exact arguments on the bit patterns where possible: ``uniform_open`` is checked on
  all ``2**24`` patterns of the bits it reads; ``exponential`` by counting exactly, in each tail,
  the patterns that map past a threshold and comparing with ``2**32`` times the Exp(1) tail;
  ``gumbel`` against ``-log`` of the exact cell centre on the same pattern runs (it is its own
  cheaper formula, no longer ``-log(exponential)`` bit for bit); and the race ``argmax(p / E)``
  with a token of probability 1e-6 (or 1e-9) by summing over that token's patterns exactly.
  Sampling tests (Kolmogorov-Smirnov, chi-square) use fixed keys and state their false-failure
  probability ``ALPHA``: each fails with probability at most ``ALPHA`` for a generator that is
  exactly right.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.experimental import pallas as pl
from jax.extend.random import threefry2x32_p

from kernels_pallas import rng

# Programs that run long (statistics over many draws): compiled with XLA's CPU optimizations
# (tests/conftest.py).
CPU_PROGRAMS_OPTIMIZED = True

UINT32_WORDS = st.integers(0, 2**32 - 1)
# False-failure probability of each statistical test below.
ALPHA = 1e-6
# Relative error of exponential() against the exact centre of its cell (module docstring).
EXPONENTIAL_RELATIVE_ERROR = 2.0**-22
# Error of gumbel() against -log of the exact cell centre, relative to max(1, |G|). Why 2**-21
# and not float32's 2**-24: the middle piece (lower half, t >= 1/4) holds x = 1 - t to about
# 1.5 * 2**-25 (t's rounding and the subtraction's), up to about 2**-22.2 relative in E = -ln x
# and so absolute in G, before the two log2 add theirs (measured worst 2**-21.5 in the lower
# half, 2**-22.3 in the upper); and float32 rounds log2 t (up to 33 in magnitude) and G itself
# (half an ulp is 2**-21 at 8, 2**-20 above 16), hence an absolute bound below |G| = 1 and a
# relative one above.
GUMBEL_ERROR = 2.0**-21
# How closely t * q(t), q from GUMBEL_TAIL_COEFFICIENTS, must fit h(t) = log(-log1p(-t) / t) on
# [0, 1/4] in float64: the rounded float32 coefficients fit to 2**-23.07 (measured); the bound
# leaves room below the 2**-21 budget for the float32 evaluation and the log2 of -ln t, and
# changing any one coefficient by 1% (a wrong third digit) exceeds it (measured: 2**-19.6 at
# worst, for the last one).
GUMBEL_TAIL_FIT = 2.0**-22.5

# Random123's kat_vectors for threefry2x32_20: (counter, key) -> output.
KNOWN_ANSWERS = [
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x243F6A88, 0x85A308D3), (0x13198A2E, 0x03707344), (0xC4923A9C, 0x483DF7A0)),
]

# Random123's kat_vectors for philox4x32_10: (counter, key) -> output.
PHILOX_KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF),
        (0xFFFFFFFF, 0xFFFFFFFF),
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]

# jit once per shape, so that tests pay for compilation once and not for op-by-op dispatch.
exponential = jax.jit(rng.exponential)
uniform_open = jax.jit(rng.uniform_open)
gumbel = jax.jit(rng.gumbel)
threefry2x32 = jax.jit(rng.threefry2x32)
philox4x32 = jax.jit(rng.philox4x32)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _grid(draw, row_key_words, num_columns: int, stream):
    """``draw`` (``random_bits`` or ``noise_bits``) over a ``[B, V]`` grid: row ``b`` with key
    words ``row_key_words[b]``."""
    return draw(row_key_words[:, None, :], jnp.arange(num_columns), stream)


def grid_bits(row_key_words, num_columns: int, stream=0) -> np.ndarray:
    """Threefry element bits (``rng.random_bits``) of a ``[B, num_columns]`` grid."""
    return np.asarray(_grid(rng.random_bits, row_key_words, num_columns, stream))


def grid_noise_bits(row_key_words, num_columns: int, stream=0) -> np.ndarray:
    """Philox noise bits (``rng.noise_bits``) of a ``[B, num_columns]`` grid."""
    return np.asarray(_grid(rng.noise_bits, row_key_words, num_columns, stream))


def ks_statistic(cdf_values: np.ndarray) -> float:
    """Kolmogorov-Smirnov distance between the empirical CDF of a sample and the true CDF,
    given the true CDF at each sample point."""
    u = np.sort(cdf_values)
    n = u.size
    ranks = np.arange(1, n + 1)
    return float(max((ranks / n - u).max(), (u - (ranks - 1) / n).max()))


def ks_critical_value(n: int, alpha: float = ALPHA) -> float:
    """Dvoretzky-Kiefer-Wolfowitz-Massart: P(D > eps) <= 2 exp(-2 n eps^2) for every n."""
    return math.sqrt(-math.log(alpha / 2) / (2 * n))


def chi_square_3_dof_critical_value(alpha: float = ALPHA) -> float:
    """The x with P(chi-square(3) > x) = alpha, from the closed-form survival function
    ``erfc(sqrt(x/2)) + sqrt(2x/pi) exp(-x/2)`` by bisection (no scipy needed)."""

    def survival(x):
        return math.erfc(math.sqrt(x / 2)) + math.sqrt(2 * x / math.pi) * math.exp(-x / 2)

    low, high = 0.0, 200.0
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if survival(middle) > alpha else (low, middle)
    return high


# --- Threefry -------------------------------------------------------------------------------


@pytest.mark.parametrize(("counter", "key", "expected"), KNOWN_ANSWERS)
def test_threefry_matches_random123_known_answers(counter, key, expected):
    words = threefry2x32(np.uint32(key[0]), np.uint32(key[1]), *np.uint32(counter))
    assert [int(w) for w in words] == list(expected)


@given(st.lists(st.tuples(*[UINT32_WORDS] * 4), min_size=16, max_size=16))
def test_threefry_matches_jax_primitive_bit_for_bit(quadruples):
    key0, key1, counter0, counter1 = (
        np.array(column, dtype=np.uint32) for column in zip(*quadruples, strict=True)
    )
    ours = threefry2x32(key0, key1, counter0, counter1)
    theirs = threefry2x32_p.bind(*(jnp.asarray(w) for w in (key0, key1, counter0, counter1)))
    np.testing.assert_array_equal(np.asarray(ours[0]), np.asarray(theirs[0]))
    np.testing.assert_array_equal(np.asarray(ours[1]), np.asarray(theirs[1]))


def test_threefry_broadcasts_like_numpy():
    keys = np.array([[1], [0xFFFFFFFF], [12345]], dtype=np.uint32)  # [3, 1]
    counters = np.arange(5, dtype=np.uint32)[None, :]  # [1, 5]
    word0, word1 = rng.threefry2x32(keys, 7, counters, 0xFFFFFFFF)
    assert word0.shape == word1.shape == (3, 5) and word0.dtype == jnp.uint32
    for i in range(3):
        for j in range(5):
            one = threefry2x32_p.bind(
                *(jnp.uint32(w) for w in (keys[i, 0], 7, counters[0, j], 0xFFFFFFFF))
            )
            assert (int(word0[i, j]), int(word1[i, j])) == (int(one[0]), int(one[1]))


def test_threefry_rejects_non_integer_words():
    with pytest.raises(ValueError, match="counter1"):
        rng.threefry2x32(0, 0, 0, np.float32(1.0))


# --- Philox ---------------------------------------------------------------------------------

# Edge words for the 16-bit partial products of mulhilo32: all-zero, all-one, and each half
# saturated alone (the carries between the partial sums).
EDGE_WORDS = [0, 1, 0xFFFF, 0x10000, 0xFFFF0000, 0x0000FFFF, 0x80000000, 0xFFFFFFFF]


def philox_by_the_book(key, counter):
    """Philox-4x32-10 on Python integers, from Random123's ``philox4x32round`` and
    ``philox4x32bumpkey``: a 64-bit product split by shifts, no 16-bit pieces, no uint32 dtype."""
    mask = 0xFFFFFFFF
    k0, k1 = key
    c0, c1, c2, c3 = counter
    for round_index in range(10):
        if round_index > 0:
            k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
        product0, product2 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (
            (product2 >> 32) ^ c1 ^ k0,
            product2 & mask,
            (product0 >> 32) ^ c3 ^ k1,
            product0 & mask,
        )
    return c0, c1, c2, c3


@pytest.mark.parametrize(("counter", "key", "expected"), PHILOX_KNOWN_ANSWERS)
def test_philox_matches_random123_known_answers(counter, key, expected):
    words = philox4x32(*np.uint32(key), *np.uint32(counter))
    assert [int(w) for w in words] == list(expected)
    assert philox_by_the_book(key, counter) == expected  # the restatement below is right too


def test_philox_constants_are_random123s():
    assert rng.PHILOX_MULTIPLIERS == (0xD2511F53, 0xCD9E8D57)
    assert rng.PHILOX_WEYL == (0x9E3779B9, 0xBB67AE85)
    assert rng.PHILOX_ROUNDS == 10


@given(st.lists(st.tuples(*[UINT32_WORDS] * 6), min_size=16, max_size=16))
def test_philox_matches_the_plain_integer_rounds(sextuples):
    key0, key1, *counter = (
        np.array(column, dtype=np.uint32) for column in zip(*sextuples, strict=True)
    )
    ours = np.stack([np.asarray(w) for w in philox4x32(key0, key1, *counter)], axis=1)
    expected = [philox_by_the_book(words[:2], words[2:]) for words in sextuples]
    np.testing.assert_array_equal(ours, np.array(expected, dtype=np.uint32))


@given(
    st.lists(st.one_of(st.sampled_from(EDGE_WORDS), UINT32_WORDS), min_size=1, max_size=32),
    st.one_of(st.sampled_from(EDGE_WORDS), UINT32_WORDS),
)
def test_mulhilo32_is_the_exact_64_bit_product(words, random_multiplier):
    a = np.array([*words, 0, 0xFFFFFFFF], dtype=np.uint32)
    for multiplier in (*rng.PHILOX_MULTIPLIERS, random_multiplier):
        high, low = rng.mulhilo32(a, multiplier)
        product = a.astype(np.uint64) * np.uint64(multiplier)  # < 2**64: exact in uint64
        np.testing.assert_array_equal(np.asarray(high), (product >> 32).astype(np.uint32))
        np.testing.assert_array_equal(np.asarray(low), (product & 0xFFFFFFFF).astype(np.uint32))
        assert high.dtype == low.dtype == jnp.uint32


def test_philox_takes_the_mulhilo_it_is_given():
    """The hook a GPU kernel uses (one ``mul.hi.u32``): every multiply goes through it, and one
    with the same bits gives the same block."""
    calls = []

    def exact_mulhilo(a, multiplier):
        calls.append(multiplier)
        product = np.asarray(a).astype(np.uint64) * np.uint64(multiplier)
        return jnp.asarray((product >> 32).astype(np.uint32)), jnp.asarray(
            (product & 0xFFFFFFFF).astype(np.uint32)
        )

    counter, key, expected = PHILOX_KNOWN_ANSWERS[2]
    words = rng.philox4x32(*key, *counter, mulhilo=exact_mulhilo)
    assert [int(w) for w in words] == list(expected)
    assert calls == list(rng.PHILOX_MULTIPLIERS) * rng.PHILOX_ROUNDS


# --- Keys -------------------------------------------------------------------------------------


def test_key_words_of_typed_legacy_and_batched_keys():
    typed, legacy = jax.random.key(42), jax.random.PRNGKey(42)
    np.testing.assert_array_equal(rng.key_words(typed), rng.key_words(legacy))
    assert rng.key_words(typed).shape == (2,) and rng.key_words(typed).dtype == jnp.uint32
    batch = jax.random.split(typed, 4)  # typed [4]
    np.testing.assert_array_equal(rng.key_words(batch), jax.random.key_data(batch))
    legacy_batch = jax.random.key_data(batch)  # uint32[4, 2]
    np.testing.assert_array_equal(rng.key_words(legacy_batch), legacy_batch)
    # Traced keys under jit.
    np.testing.assert_array_equal(jax.jit(rng.key_words)(batch), legacy_batch)
    one_key_rows = jax.jit(rng.row_keys, static_argnums=1)(typed, 3)
    np.testing.assert_array_equal(one_key_rows, rng.row_keys(legacy, 3))


@pytest.mark.parametrize(
    "bad_key",
    [
        jax.random.key(0, impl="rbg"),  # four words
        jax.random.key(0, impl="threefry4x32"),
        np.array([0, 1], dtype=np.int32),  # legacy data must be uint32
        np.zeros(3, dtype=np.uint32),  # not two words
        np.float32(1.0),
        [0, 42],
        42,
    ],
    ids=["rbg", "threefry4x32", "int32", "three-words", "float", "list", "int"],
)
def test_key_words_rejects_anything_else_naming_the_argument(bad_key):
    with pytest.raises(ValueError, match=r"^key must"):
        rng.key_words(bad_key)


def test_row_keys_from_one_key_are_distinct_and_independent_of_batch_size():
    key = jax.random.key(3)
    words = np.asarray(rng.row_keys(key, 1 << 16))  # uint32[65536, 2]
    assert words.shape == (1 << 16, 2) and words.dtype == np.uint32
    as_64_bits = words[:, 0].astype(np.uint64) << 32 | words[:, 1]
    # Threefry is a bijection of the counter (ROW_DOMAIN, b), so this is a certainty, not luck.
    assert np.unique(as_64_bits).size == words.shape[0]
    np.testing.assert_array_equal(rng.row_keys(key, 5), words[:5])
    np.testing.assert_array_equal(rng.row_keys(jax.random.PRNGKey(3), 5), words[:5])
    # The documented derivation: both words of threefry2x32(key, (ROW_DOMAIN, row)).
    derived = threefry2x32_p.bind(
        jnp.uint32(0), jnp.uint32(3), jnp.uint32(0x7FFFFFFF), jnp.uint32(4)
    )
    assert (int(words[4, 0]), int(words[4, 1])) == (int(derived[0]), int(derived[1]))


def test_row_keys_from_batch_keys_are_their_words():
    keys = jax.random.split(jax.random.key(5), 6)
    np.testing.assert_array_equal(rng.row_keys(keys, 6), jax.random.key_data(keys))
    np.testing.assert_array_equal(
        rng.row_keys(jax.random.key_data(keys), 6), jax.random.key_data(keys)
    )
    with pytest.raises(ValueError, match=r"^key must be one key or 4 keys"):
        rng.row_keys(keys, 4)
    with pytest.raises(ValueError, match=r"^batch"):
        rng.row_keys(keys, -1)
    with pytest.raises(ValueError, match=r"^batch"):
        rng.row_keys(keys, 6.0)


# --- Counter layout -------------------------------------------------------------------------------


def test_a_rows_numbers_depend_on_its_key_not_its_slot():
    keys = jax.random.split(jax.random.key(11), 8)
    permutation = np.array([5, 2, 7, 0, 1, 6, 3, 4])
    bits = grid_bits(rng.row_keys(keys, 8), 64)
    permuted = grid_bits(rng.row_keys(keys[permutation], 8), 64)
    np.testing.assert_array_equal(permuted, bits[permutation])
    # A batch of one with that key draws the same numbers too.
    np.testing.assert_array_equal(grid_bits(rng.row_keys(keys[3:4], 1), 64)[0], bits[3])


@pytest.mark.parametrize("grid", [grid_bits, grid_noise_bits], ids=["threefry", "philox"])
def test_one_key_rows_streams_and_columns_differ(grid):
    words = rng.row_keys(jax.random.key(0), 8)
    stream0, stream1 = grid(words, 256, 0), grid(words, 256, 1)
    # 2 x 8 x 256 = 2**12 values of 32 bits from distinct counters: a chance repeat has
    # probability about 2**-9 (none with this fixed key); equal rows, streams or (Philox)
    # lanes of a block would repeat thousands.
    both = np.concatenate([stream0.ravel(), stream1.ravel()])
    assert np.unique(both).size == both.size


def test_random_bits_is_word_column_mod_2_of_block_column_div_2():
    words = rng.row_keys(jax.random.key(9), 3)
    bits = grid_bits(words, 64, 5)
    even, odd = rng.random_bit_pairs(words[:, None, :], jnp.arange(32), 5)
    np.testing.assert_array_equal(bits[:, 0::2], even)
    np.testing.assert_array_equal(bits[:, 1::2], odd)
    # The counter is (2**31 | column // 2, stream) under the row's own key words.
    block = rng.threefry2x32(words[1, 0], words[1, 1], 2**31 + 21, 5)
    assert int(bits[1, 43]) == int(block[1]) and int(bits[1, 42]) == int(block[0])
    # So the noise of columns 0 and 1 in stream 5 is not the key JAX derives by fold_in(key, 5),
    # the block at counter (0, 5).
    folded = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(words[1]), 5))
    np.testing.assert_array_equal(folded, rng.threefry2x32(words[1, 0], words[1, 1], 0, 5))
    assert [int(bits[1, 0]), int(bits[1, 1])] != [int(w) for w in folded]
    # Any batch shape: key words [3, 1, 2] against columns [2, 64] give [3, 2, 64].
    stacked = rng.random_bits(words[:, None, None, :], jnp.arange(64).reshape(1, 64), 5)
    np.testing.assert_array_equal(jnp.broadcast_to(stacked, (3, 2, 64))[:, 1], bits)
    # A pair of word arrays is the same key as uint32[..., 2]; eager equals jit.
    np.testing.assert_array_equal(
        rng.random_bits((words[:, 0:1], words[:, 1:2]), jnp.arange(64), 5), bits
    )


def test_no_collisions_across_rows_columns_and_streams():
    """Rows up to 2**31, columns up to 2**31, streams up to 2**16, drawn at random: every
    (row, column pair, stream) gets a distinct 64-bit block. Within a row key the counters are
    distinct, and Threefry is a bijection for a fixed key, so distinct blocks are certain there;
    rows have distinct keys (also certain), and a chance repeat of a block across them would
    have probability about 2**-35."""
    sampler = np.random.default_rng(1)
    n = 1 << 15
    rows = sampler.integers(0, 2**31, n, dtype=np.uint32)
    pairs = sampler.integers(0, 2**30, n, dtype=np.uint32)  # columns up to 2**31
    streams = sampler.integers(0, 2**16, n, dtype=np.uint32)
    # Some triples share their row, or their row and column, to exercise the other counters.
    rows[: n // 4], pairs[: n // 8] = rows[0], pairs[0]
    triples = np.unique(np.stack([rows, pairs, streams], axis=1), axis=0)
    # Row keys of rows far past any batch we could build, by the documented derivation (which
    # test_row_keys_from_one_key_... checks against row_keys itself).
    key = rng.key_words(jax.random.key(2))
    row_words = jnp.stack(rng.threefry2x32(key[0], key[1], rng.ROW_DOMAIN, triples[:, 0]), -1)
    even, odd = rng.random_bit_pairs(row_words, triples[:, 1], triples[:, 2])
    blocks = np.asarray(even).astype(np.uint64) << 32 | np.asarray(odd)
    assert np.unique(blocks).size == triples.shape[0]


def test_noise_bits_is_word_column_mod_4_of_the_block_of_column_div_4():
    words = rng.row_keys(jax.random.key(9), 3)
    bits = grid_noise_bits(words, 64, 5)
    quads = rng.noise_bit_quads(words[:, None, :], jnp.arange(16), 5)
    for lane in range(4):
        np.testing.assert_array_equal(bits[:, lane::4], quads[lane])
    # The counter is (column // 4, stream, 0, 0) under the row's own key words.
    block = rng.philox4x32(words[1, 0], words[1, 1], 10, 5, 0, 0)
    assert [int(bits[1, 40 + lane]) for lane in range(4)] == [int(w) for w in block]
    # Stream 0 is the default; a pair of word arrays is the same key as uint32[..., 2].
    np.testing.assert_array_equal(
        rng.noise_bits(words[:, None, :], jnp.arange(64)), grid_noise_bits(words, 64, 0)
    )
    np.testing.assert_array_equal(
        rng.noise_bits((words[:, 0:1], words[:, 1:2]), jnp.arange(64), 5), bits
    )


def test_noise_bits_of_a_row_depend_on_its_key_not_its_slot():
    keys = jax.random.split(jax.random.key(11), 8)
    permutation = np.array([5, 2, 7, 0, 1, 6, 3, 4])
    bits = grid_noise_bits(rng.row_keys(keys, 8), 64)
    permuted = grid_noise_bits(rng.row_keys(keys[permutation], 8), 64)
    np.testing.assert_array_equal(permuted, bits[permutation])
    np.testing.assert_array_equal(grid_noise_bits(rng.row_keys(keys[3:4], 1), 64)[0], bits[3])
    # One key: row b's words do not depend on the batch size, so neither do its numbers.
    one_key = rng.row_keys(jax.random.key(11), 8)
    np.testing.assert_array_equal(
        grid_noise_bits(one_key[:3], 64), grid_noise_bits(rng.row_keys(jax.random.key(11), 3), 64)
    )


def test_noise_blocks_never_collide_across_rows_quads_and_streams():
    """Rows up to 2**31, quads up to 2**30 (every column below 2**32), streams up to 2**32,
    drawn at random: every (row, quad, stream) gets a distinct 128-bit block. Within a row key
    the counters (quad, stream, 0, 0) are distinct and Philox is a bijection of the counter for
    a fixed key, so this is certain there; across rows (distinct keys) a chance repeat of 128
    bits has probability about 2**-98."""
    sampler = np.random.default_rng(4)
    n = 1 << 15
    rows = sampler.integers(0, 2**31, n, dtype=np.uint32)
    quads = sampler.integers(0, 2**30, n, dtype=np.uint32)
    streams = sampler.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    # Some triples share their row, or their row and quad, to exercise the other counters;
    # streams 0..3 (the ones in use) appear with the same row and quad.
    rows[: n // 4], quads[: n // 8] = rows[0], quads[0]
    streams[:4] = np.arange(4)
    triples = np.unique(np.stack([rows, quads, streams], axis=1), axis=0)
    key = rng.key_words(jax.random.key(2))
    row_words = jnp.stack(rng.threefry2x32(key[0], key[1], rng.ROW_DOMAIN, triples[:, 0]), -1)
    block = np.stack(
        [np.asarray(w) for w in rng.noise_bit_quads(row_words, triples[:, 1], triples[:, 2])], 1
    )
    assert np.unique(block, axis=0).shape[0] == triples.shape[0]


# --- Inside a Pallas kernel -----------------------------------------------------------------------

KERNEL_ROWS, KERNEL_COLUMNS, KERNEL_STREAM = 8, 256, 3


def noise_kernel(
    key0_ref,  # [rows] uint32, word 0 of each row's key
    key1_ref,  # [rows] uint32
    bits_ref,  # [rows, columns] uint32
    uniform_ref,  # [rows, columns] float32
    exponential_ref,  # [rows, columns] float32
    gumbel_ref,  # [rows, columns] float32
    noise_bits_ref,  # [rows, columns] uint32, Philox
    noise_gumbel_ref,  # [rows, columns] float32, gumbel of the Philox bits
):
    key0 = key0_ref[...][:, None]  # [rows, 1]
    key1 = key1_ref[...][:, None]
    columns = jnp.arange(KERNEL_COLUMNS, dtype=jnp.int32)[None, :]  # [1, columns]
    bits = rng.random_bits((key0, key1), columns, KERNEL_STREAM)
    bits_ref[...] = bits
    uniform_ref[...] = rng.uniform_open(bits)
    exponential_ref[...] = rng.exponential(bits)
    gumbel_ref[...] = rng.gumbel(bits)
    noise = rng.noise_bits((key0, key1), columns, KERNEL_STREAM)
    noise_bits_ref[...] = noise
    noise_gumbel_ref[...] = rng.gumbel(noise)


def test_pallas_kernel_draws_the_same_numbers_as_plain_jax(interpret):
    words = rng.row_keys(jax.random.split(jax.random.key(4), KERNEL_ROWS), KERNEL_ROWS)
    shape = (KERNEL_ROWS, KERNEL_COLUMNS)
    kernel_out = pl.pallas_call(
        noise_kernel,
        out_shape=(
            jax.ShapeDtypeStruct(shape, jnp.uint32),
            *[jax.ShapeDtypeStruct(shape, jnp.float32)] * 3,
            jax.ShapeDtypeStruct(shape, jnp.uint32),
            jax.ShapeDtypeStruct(shape, jnp.float32),
        ),
        interpret=interpret,
    )(words[:, 0], words[:, 1])
    bits = grid_bits(words, KERNEL_COLUMNS, KERNEL_STREAM)
    noise = grid_noise_bits(words, KERNEL_COLUMNS, KERNEL_STREAM)
    outside = (bits, uniform_open(bits), exponential(bits), gumbel(bits), noise, gumbel(noise))
    names = ["bits", "uniform_open", "exponential", "gumbel", "noise_bits", "noise gumbel"]
    for name, inside, expected in zip(names, kernel_out, outside, strict=True):
        inside, expected = np.asarray(inside), np.asarray(expected)
        if interpret or "gumbel" not in name:
            # The same jnp operations inside and outside: equal bit for bit.
            np.testing.assert_array_equal(inside, expected, err_msg=name)
            continue
        # Compiled, gumbel's float work is not bit for bit: Triton's log2 (libdevice) and XLA's
        # differ in the last bits, and each compiler contracts the polynomial's multiply-adds
        # its own way. The H200 (2026-12-01) measured at most 4.8e-7 = 2**-21.0 at G = 1.24;
        # allowed: 2**-20 max(1, |G|), twice the worst measured, and twice gumbel's own 2**-21 bound.
        allowed = 2.0**-20 * np.maximum(1.0, np.abs(expected.astype(np.float64)))
        difference = np.abs(inside.astype(np.float64) - expected.astype(np.float64))
        assert (difference <= allowed).all(), (name, float(difference.max()))


# --- uniform_open ---------------------------------------------------------------------------------


def test_uniform_open_on_every_pattern_it_reads():
    """It reads the top 24 bits: all 2**24 of them, with the low 8 bits 0 and then 0xFF."""
    assert float(uniform_open(np.uint32(0))) == 2.0**-24
    assert float(uniform_open(np.uint32(0xFFFFFFFF))) == 1 - 2.0**-24
    patterns = np.arange(1 << 24, dtype=np.uint32) << 8
    u = np.asarray(uniform_open(patterns)).astype(np.float64)
    np.testing.assert_array_equal(u, np.asarray(uniform_open(patterns | 0xFF)))
    assert u.min() == 2.0**-24 and u.max() == 1 - 2.0**-24  # never 0, never 1
    # Each value (2j + 1) 2**-24 exactly, each from two patterns: 2**23 equiprobable centres.
    np.testing.assert_array_equal(u * 2**24, (patterns >> 9) * 2 + 1)
    # The mean over all patterns, summed exactly (integers in float64), is exactly 1/2.
    assert (u * 2**24).sum() / 2**24 == 2**23


def test_uniform_open_kolmogorov_smirnov():
    words = rng.row_keys(jax.random.key(20), 512)
    u = np.asarray(uniform_open(grid_bits(words, 512))).ravel().astype(np.float64)  # n = 2**18
    # The discrete uniform's CDF is within 2**-24 of the continuous one at every point.
    assert ks_statistic(u) <= ks_critical_value(u.size) + 2.0**-24


# --- exponential --------------------------------------------------------------------------------


def exact_exponential(patterns: np.ndarray) -> np.ndarray:
    """Float64 Exp(1) quantile at the centre of each pattern's cell (the ideal the float32
    function rounds): lower half ``-log1p(-t)``, upper half ``-log(t)``, ``t = (2m + 1) 2**-33``."""
    patterns = patterns.astype(np.uint64)
    t = (2 * (patterns & 0x7FFFFFFF) + 1) * 2.0**-33
    return np.where(patterns >= 2**31, -np.log(t), -np.log1p(-t))


def tail_pattern_runs() -> list[np.ndarray]:
    """The low-31-bit patterns ``m`` the precision tests enumerate: every ``m < 2**20``, runs
    around every power of two from ``2**20`` to ``2**30``, the top of the half, and random
    ones (the last run)."""
    runs = [np.arange(1 << 20, dtype=np.uint64)]
    runs += [np.arange(2**k - 2048, 2**k + 2048, dtype=np.uint64) for k in range(20, 31)]
    runs += [np.arange(2**31 - 4096, 2**31, dtype=np.uint64)]
    return [*runs, np.random.default_rng(3).integers(0, 2**31, 1 << 16, dtype=np.uint64)]


def test_exponential_extremes_never_zero_never_infinite():
    e = np.asarray(exponential(np.uint32([0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF])))
    assert e[0] == 2.0**-33 and e[1] == np.float32(3 * 2.0**-33)
    assert e[2] == e[4] == np.float32(math.log(2))  # the halves meet at the median
    assert e[3] == np.float32(33 * math.log(2))


def test_exponential_relative_error_and_monotonicity():
    """Relative error <= 2**-22 against the cell centre, on every pattern of m < 2**20 in both
    halves, around every power of two of m, and on random patterns; monotone in m in each half
    on those same runs (the exact tail counts below rely on it)."""
    *runs, sampled = tail_pattern_runs()
    for top_bit in (0, 2**31):
        for m in [*runs, sampled]:
            patterns = (m + top_bit).astype(np.uint32)
            e = np.asarray(exponential(patterns)).astype(np.float64)
            ideal = exact_exponential(patterns)
            assert np.abs(e / ideal - 1).max() <= EXPONENTIAL_RELATIVE_ERROR
            if m is not sampled:
                steps = np.diff(e)
                assert (steps >= 0).all() if top_bit == 0 else (steps <= 0).all()


def _count_lower(e_threshold: float) -> int:
    """Patterns with E <= threshold: all in the lower half (threshold < ln 2), where E grows with
    m; the first m with E > threshold, by bisection."""
    low, high = 0, 2**31  # E(low - 1) <= threshold < E(high), with E(-1) = 0 and E(2**31) = inf
    while high - low > 1:
        middle = (low + high) // 2
        if float(exponential(np.uint32(middle - 1))) <= e_threshold:
            low = middle
        else:
            high = middle
    return low if float(exponential(np.uint32(low))) > e_threshold else high


def _count_upper(e_threshold: float) -> int:
    """Patterns with E > threshold (> ln 2): upper half, where E falls as m grows."""
    low, high = 0, 2**31
    while high - low > 1:
        middle = (low + high) // 2
        if float(exponential(np.uint32(2**31 + middle - 1))) > e_threshold:
            low = middle
        else:
            high = middle
    return low if float(exponential(np.uint32(2**31 + low))) <= e_threshold else high


@pytest.mark.parametrize("threshold", [2.0**-32, 2.0**-30, 2.0**-20, 1e-6, 1e-3, 0.1, 0.5])
def test_exponential_lower_tail_exact_count(threshold):
    """Of the 2**32 patterns, how many map to E <= e, against 2**32 (1 - exp(-e)): within half a
    cell plus the rounding allowance, ``0.5 + 2**32 * 2**-22 * e * exp(-e)`` patterns. At
    e = 2**-20 that is 0.501: the count is the exact one, where the naive -log(u) has none."""
    count = _count_lower(threshold)
    expected = 2.0**32 * -math.expm1(-threshold)
    allowance = 0.5 + 2.0**32 * EXPONENTIAL_RELATIVE_ERROR * threshold * math.exp(-threshold)
    assert abs(count - expected) <= allowance, (count, expected, allowance)
    # The bisection's answer, checked by enumeration around it (and from 0 when it is small).
    start = max(count - 4096, 0)
    e = np.asarray(exponential(np.arange(start, count + 4096, dtype=np.uint32)))
    assert ((e.astype(np.float64) <= threshold).sum() + start) == count


@pytest.mark.parametrize("threshold", [1.0, 3.0, 10.0, 16.0, 20.0, 22.0, 22.8])
def test_exponential_upper_tail_exact_count(threshold):
    """Of the 2**32 patterns, how many map to E > e, against 2**32 exp(-e), same allowance."""
    count = _count_upper(threshold)
    expected = 2.0**32 * math.exp(-threshold)
    allowance = 0.5 + 2.0**32 * EXPONENTIAL_RELATIVE_ERROR * threshold * math.exp(-threshold)
    assert abs(count - expected) <= allowance, (count, expected, allowance)
    start = max(count - 4096, 0)
    e = np.asarray(exponential(np.arange(start, count + 4096, dtype=np.uint32) | 2**31))
    assert ((e.astype(np.float64) > threshold).sum() + start) == count


def test_exponential_kolmogorov_smirnov():
    words = rng.row_keys(jax.random.key(21), 512)
    e = np.asarray(exponential(grid_bits(words, 512, 7))).ravel().astype(np.float64)
    # Our CDF is within 2**-33 + 2**-22 / e (the max of e exp(-e) is 1/e) of Exp(1)'s.
    allowance = 2.0**-33 + EXPONENTIAL_RELATIVE_ERROR / math.e
    assert ks_statistic(-np.expm1(-e)) <= ks_critical_value(e.size) + allowance


# --- gumbel and the race --------------------------------------------------------------------------


def test_gumbel_is_minus_log_of_the_exact_cell_centre():
    """``|gumbel(bits) - (-log E_exact)| <= GUMBEL_ERROR * max(1, |G_exact|)`` on the pattern
    runs of the exponential test, in both halves: the three pieces and both seams between them
    (``t = 1/4`` at ``m = 2**30``, the halves at ``m = 2**31 - 1``) are in the runs."""
    for top_bit in (0, 2**31):
        for m in tail_pattern_runs():
            patterns = (m + top_bit).astype(np.uint32)
            g = np.asarray(gumbel(patterns)).astype(np.float64)
            ideal = -np.log(exact_exponential(patterns))
            error = np.abs(g - ideal) / np.maximum(1.0, np.abs(ideal))
            assert error.max() <= GUMBEL_ERROR, (top_bit, int(m[np.argmax(error)]), error.max())
            assert np.isfinite(g).all()


def test_gumbel_extremes_are_finite():
    """The smallest ``G`` is at the largest ``E``, ``33 ln 2`` (upper half, ``m = 0``); the
    largest at the smallest ``E``, ``2**-33`` (lower half, ``m = 0``); never inf."""
    low, high = float(gumbel(np.uint32(0x80000000))), float(gumbel(np.uint32(0)))
    assert low == pytest.approx(-math.log(33 * math.log(2)), rel=1e-6)
    assert high == pytest.approx(33 * math.log(2), rel=1e-6)
    edges = np.uint32([0, 1, 0x3FFFFFFF, 0x40000000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF])
    g = np.asarray(gumbel(edges))
    assert np.isfinite(g).all() and low <= g.min() and g.max() <= high
    # Philox bits of a real row: finite and inside the same range.
    g = np.asarray(gumbel(grid_noise_bits(rng.row_keys(jax.random.key(22), 64), 1024)))
    assert np.isfinite(g).all() and low <= g.min() and g.max() <= high


def test_gumbel_tail_coefficients_fit_the_tail_function():
    """``t q(t)`` with ``q`` from ``GUMBEL_TAIL_COEFFICIENTS`` (float32, as the kernel holds
    them) fits ``h(t) = log(-log1p(-t) / t)`` on ``[0, 1/4]`` within ``GUMBEL_TAIL_FIT``, in
    float64 on a grid of ``2**20`` points (``h`` is smooth there, so a grid this dense sees the
    maximum to far below the bound). Guards the constant against a lost or mistyped digit."""
    coefficients = rng.GUMBEL_TAIL_COEFFICIENTS
    assert len(coefficients) == 5 and all(c.dtype == np.float32 for c in coefficients)
    t = np.linspace(0.0, 0.25, (1 << 20) + 1)[1:]  # h(0) = 0 in the limit; t q(t) = 0 there
    h = np.log(-np.log1p(-t) / t)
    fit = t * np.polynomial.polynomial.polyval(t, np.array(coefficients, np.float64))
    assert np.abs(fit - h).max() <= GUMBEL_TAIL_FIT, math.log2(np.abs(fit - h).max())


def test_race_frequencies_match_p_chi_square():
    """argmax(p / E) over 4 tokens, 2**17 draws (one row each, one key): the counts pass a
    chi-square test at ALPHA; argmax(log p + Gumbel) picks the same tokens."""
    p = np.array([0.5, 0.3, 0.15, 0.05])
    n = 1 << 17
    bits = grid_bits(rng.row_keys(jax.random.key(23), n), 4)
    e = np.asarray(exponential(bits)).astype(np.float64)
    tokens = np.argmax(p / e, axis=1)
    counts = np.bincount(tokens, minlength=4)
    statistic = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert statistic <= chi_square_3_dof_critical_value(), (counts, statistic)
    from_logits = np.argmax(np.log(p).astype(np.float32) + np.asarray(gumbel(bits)), axis=1)
    # gumbel() is within GUMBEL_ERROR * max(1, |G|) of -log E, plus float32 rounding of the
    # sum: only two candidates within about 2**-19 of each other can swap, a chance of order
    # 1e-5 a draw; none of the 2**17 here did (measured). No more than one in 10**4.
    assert (from_logits != tokens).mean() <= 1e-4


@pytest.mark.parametrize("tiny", [1e-6, 1e-9])
def test_race_tiny_token_wins_at_its_rate_exactly(tiny):
    """P(token of probability ``tiny`` wins argmax(p / E)), summed exactly over that token's bit
    patterns: it wins only with E_tiny <= tiny * min_j E_j / p_j, far inside the lower half (the
    rest has probability below exp(-60)). The other tokens' E enter through their Exp(1) tails,
    which ours match to 2**-33 + 2**-24 absolute (test above): a relative error below 1e-6 here.
    The sum then differs from ``tiny`` only by our discretization: each pattern is its cell's
    centre, cells of probability 2**-32 (a midpoint rule, relative error about
    (2**-32 / tiny)**2), plus float32 rounding."""
    others = np.array([0.5, 0.3, 0.2 - tiny])
    # Patterns with E_tiny / tiny <= 60: m < 2**32 * tiny * 60 / 2 + 1 in the lower half.
    patterns = np.arange(int(2**31 * tiny * 60) + 2, dtype=np.uint32)
    e_tiny = np.asarray(exponential(patterns)).astype(np.float64)
    race_against = np.exp(-np.outer(e_tiny / tiny, others).sum(axis=1))
    wins = race_against.sum() * 2.0**-32
    # Relative error allowed: float32 rounding of E_tiny (2**-22), the others' tails, and the
    # midpoint rule; with tiny = 1e-9 there are only about 4 cells per unit of E_tiny / tiny.
    # Measured: -1.8e-9 at tiny = 1e-6, -2.3e-3 at 1e-9 (a naive -log(u) with E >= 2**-24
    # would give that token no wins at all: it needs E_tiny <= 1e-9 * min_j E_j / p_j).
    tolerance = 1e-6 if tiny >= 1e-6 else 1e-2
    assert wins == pytest.approx(tiny, rel=tolerance)
