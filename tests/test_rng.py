"""The shared counter-based generator: Threefry bit for bit, its counter layout, and its noise.

What is checked, and how:

- ``threefry2x32`` against Random123's published known answers and, bit for bit, against JAX's
  own Threefry primitive (``jax.extend.random.threefry2x32_p``) on hypothesis-drawn words.
- Keys: typed, legacy and batched keys give the same words; anything else raises ``ValueError``
  naming ``key``. Per-row keys make a row's numbers depend on its key alone (permuting the batch
  permutes the numbers); one key gives distinct rows; streams and columns never share a counter.
- Kernels: a Pallas kernel (interpreted on a CPU, compiled on a GPU) computes the same bits,
  uniforms, exponentials and Gumbels as plain JAX, bit for bit.
- Noise, by exact arguments on the bit patterns where possible: ``uniform_open`` is checked on
  all ``2**24`` patterns of the bits it reads; ``exponential`` by counting exactly, in each tail,
  the patterns that map past a threshold and comparing with ``2**32`` times the Exp(1) tail; and
  the race ``argmax(p / E)`` with a token of probability 1e-6 (or 1e-9) by summing over that
  token's patterns exactly. Sampling tests (Kolmogorov-Smirnov, chi-square) use fixed keys and
  state their false-failure probability ``ALPHA``: each fails with probability at most ``ALPHA``
  for a generator that is exactly right.
"""

from __future__ import annotations

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

UINT32_WORDS = st.integers(0, 2**32 - 1)
# False-failure probability of each statistical test below.
ALPHA = 1e-6
# Relative error of exponential() against the exact centre of its cell (module docstring).
EXPONENTIAL_RELATIVE_ERROR = 2.0**-22

# Random123's kat_vectors for threefry2x32_20: (counter, key) -> output.
KNOWN_ANSWERS = [
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x243F6A88, 0x85A308D3), (0x13198A2E, 0x03707344), (0xC4923A9C, 0x483DF7A0)),
]

# jit once per shape, so that tests pay for compilation once and not for op-by-op dispatch.
exponential = jax.jit(rng.exponential)
uniform_open = jax.jit(rng.uniform_open)
gumbel = jax.jit(rng.gumbel)
threefry2x32 = jax.jit(rng.threefry2x32)


@jax.jit
def _grid_bits(row_key_words, num_columns_like, stream):
    """``random_bits`` over a ``[B, V]`` grid: row ``b`` with key words ``row_key_words[b]``."""
    columns = jnp.arange(num_columns_like.shape[0])
    return rng.random_bits(row_key_words[:, None, :], columns, stream)


def grid_bits(row_key_words, num_columns: int, stream=0) -> np.ndarray:
    return np.asarray(_grid_bits(row_key_words, jnp.zeros(num_columns), stream))


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


def test_one_key_rows_streams_and_columns_differ():
    words = rng.row_keys(jax.random.key(0), 8)
    stream0, stream1 = grid_bits(words, 256, 0), grid_bits(words, 256, 1)
    # 2 x 8 x 256 = 2**12 values of 32 bits from distinct counters: a chance repeat has
    # probability about 2**-9 (none with this fixed key); equal rows or streams would repeat
    # thousands.
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


# --- Inside a Pallas kernel -----------------------------------------------------------------------

KERNEL_ROWS, KERNEL_COLUMNS, KERNEL_STREAM = 8, 256, 3


def noise_kernel(
    key0_ref,  # [rows] uint32, word 0 of each row's key
    key1_ref,  # [rows] uint32
    bits_ref,  # [rows, columns] uint32
    uniform_ref,  # [rows, columns] float32
    exponential_ref,  # [rows, columns] float32
    gumbel_ref,  # [rows, columns] float32
):
    key0 = key0_ref[...][:, None]  # [rows, 1]
    key1 = key1_ref[...][:, None]
    columns = jnp.arange(KERNEL_COLUMNS, dtype=jnp.int32)[None, :]  # [1, columns]
    bits = rng.random_bits((key0, key1), columns, KERNEL_STREAM)
    bits_ref[...] = bits
    uniform_ref[...] = rng.uniform_open(bits)
    exponential_ref[...] = rng.exponential(bits)
    gumbel_ref[...] = rng.gumbel(bits)


def test_pallas_kernel_draws_the_same_numbers_as_plain_jax(interpret):
    words = rng.row_keys(jax.random.split(jax.random.key(4), KERNEL_ROWS), KERNEL_ROWS)
    shape = (KERNEL_ROWS, KERNEL_COLUMNS)
    kernel_out = pl.pallas_call(
        noise_kernel,
        out_shape=(
            jax.ShapeDtypeStruct(shape, jnp.uint32),
            *[jax.ShapeDtypeStruct(shape, jnp.float32)] * 3,
        ),
        interpret=interpret,
    )(words[:, 0], words[:, 1])
    bits = grid_bits(words, KERNEL_COLUMNS, KERNEL_STREAM)
    outside = (bits, uniform_open(bits), exponential(bits), gumbel(bits))
    for name, inside, expected in zip(
        ["bits", "uniform_open", "exponential", "gumbel"], kernel_out, outside, strict=True
    ):
        np.testing.assert_array_equal(np.asarray(inside), np.asarray(expected), err_msg=name)


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


def test_exponential_extremes_never_zero_never_infinite():
    e = np.asarray(exponential(np.uint32([0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF])))
    assert e[0] == 2.0**-33 and e[1] == np.float32(3 * 2.0**-33)
    assert e[2] == e[4] == np.float32(math.log(2))  # the halves meet at the median
    assert e[3] == np.float32(33 * math.log(2))


def test_exponential_relative_error_and_monotonicity():
    """Relative error <= 2**-22 against the cell centre, on every pattern of m < 2**20 in both
    halves, around every power of two of m, and on random patterns; monotone in m in each half
    on those same runs (the exact tail counts below rely on it)."""
    runs = [np.arange(1 << 20, dtype=np.uint64)]
    runs += [np.arange(2**k - 2048, 2**k + 2048, dtype=np.uint64) for k in range(20, 31)]
    runs += [np.arange(2**31 - 4096, 2**31, dtype=np.uint64)]
    sampled = np.random.default_rng(3).integers(0, 2**31, 1 << 16, dtype=np.uint64)
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


def test_gumbel_is_minus_log_exponential():
    bits = grid_bits(rng.row_keys(jax.random.key(22), 64), 1024)
    g, e = np.asarray(gumbel(bits)), np.asarray(exponential(bits))
    # The very same float32 operation (bit for bit), and within float32 rounding of the exact
    # -log of each E.
    np.testing.assert_array_equal(g, np.asarray(jax.jit(lambda e: -jnp.log(e))(e)))
    np.testing.assert_allclose(g, -np.log(e.astype(np.float64)), rtol=2.0**-22, atol=2.0**-24)
    assert np.isfinite(g).all() and g.min() >= -math.log(33 * math.log(2)) - 1e-6
    assert float(gumbel(np.uint32(0x80000000))) == pytest.approx(-math.log(33 * math.log(2)))
    assert float(gumbel(np.uint32(0))) == pytest.approx(33 * math.log(2))


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
    # Float32 rounding may swap two near-tied candidates; no more than one draw in 10**4 here.
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
