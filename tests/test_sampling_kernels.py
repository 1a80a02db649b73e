"""The Gumbel-max sampling kernel against the reference: the same tokens for the same keys.

In interpret mode (CPU) the kernel evaluates the very same float operations as the reference
(``fast_math`` is off: ``rng.mulhilo32`` and ``jnp.log2``), so the tokens must be identical.
Compiled on a GPU, ``fast_math`` (on by default there) takes the multiply's high word from
``mul.hi.u32`` (the same bits) and ``log2`` from ``lg2.approx.f32``, which moves the noise by
about ``2**-20``: that can flip a race only when the two best scores are that close. The GPU
runs of the small tests below allow a mismatch rate of 1e-3 (at these small batches, any
mismatch fails); the GPU-marked test at vocab 128256 measures the rate over thousands of rows
and prints it. The distribution itself is tested on the reference
(``tests/test_sampling_api.py``); equal tokens carry it over to the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import sampling
from kernels_pallas import rng
from kernels_pallas.gumbel import default_launch
from kernels_pallas.sampling import gumbel_sample
from sampling import reference
from sampling.api import EXPONENTIAL_STREAM
from sampling.filters import ORDERS
from tests.conftest import ON_GPU

ALLOWED_MISMATCH = 1e-3 if ON_GPU else 0.0

# The Gumbel kernel's interpreted program is mostly Philox integer arithmetic, where LLVM's
# optimizer spends about 8 s a compile and the tiny test shapes run in milliseconds either way;
# unoptimized (``xla_backend_optimization_level`` 0) it compiles in about 2 s. LLVM's
# optimization level changes no float result (XLA's CPU backend compiles without fast-math at
# every level), so the kernel's tokens are the same bits.
FAST_COMPILE = {"xla_backend_optimization_level": 0}

# ``gumbel_sample`` compiled as above on a CPU (on a GPU, as the library compiles it). One
# module-level function, so that calls with the same shapes share its compiled program.
gumbel_sample_fast_compile = jax.jit(
    gumbel_sample,
    static_argnames=("from_logits", "stream", "quads", "steps", "interpret"),
    compiler_options=None if ON_GPU else FAST_COMPILE,
)


def _logits(seed, batch, vocab, dtype):
    rng_np = np.random.default_rng(seed)
    logits = rng_np.standard_normal((batch, vocab)) * 3
    logits[0, : vocab // 3] = -np.inf  # masked tokens
    if vocab > 4:
        logits[1, 2] = logits[1, 3] = logits[1].max() + 1  # an exact tie at the top
    return jnp.asarray(logits, dtype)


def _mismatch(got, expected):
    return float(np.mean(np.asarray(got) != np.asarray(expected)))


# The public samplers on the kernel, compiled as ``gumbel_sample_fast_compile`` is (under
# ``jit`` the API skips only its checks of concrete values, which these valid inputs pass).
api_logits_fast_compile = jax.jit(
    functools.partial(sampling.sample_from_logits, backend="pallas"),
    compiler_options=None if ON_GPU else FAST_COMPILE,
)
api_probs_fast_compile = jax.jit(
    functools.partial(sampling.sample_from_probs, backend="pallas"),
    compiler_options=None if ON_GPU else FAST_COMPILE,
)


# Vocab 1, 7 (and 1000, dropped: it has the same launch as 7, one 1024-column step a row with
# its tail masked) take one chunk a row; 3000 three.
@pytest.mark.parametrize("vocab", [1, 7, 3000])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_picks_the_references_tokens_from_logits(vocab, dtype):
    """Through the API: one key (the kernel derives the rows' keys) and a temperature a row,
    greedy rows among them; at vocab 3000 the default launch cuts a row into three chunks."""
    batch = 6
    logits = _logits(vocab, batch, vocab, dtype)
    temperature = jnp.array([1.0, 0.0, 0.5, 2.0, 1.0, 0.0])
    key = jax.random.key(vocab)
    expected = sampling.sample_from_logits(
        key, logits, temperature=temperature, backend="reference"
    )
    got = api_logits_fast_compile(key, logits, temperature=temperature)
    assert _mismatch(got, expected) <= ALLOWED_MISMATCH
    assert np.asarray(got)[1] == (2 if vocab > 4 else np.argmax(np.asarray(logits[1])))
    if vocab > 4:
        assert np.asarray(got)[0] >= vocab // 3  # a masked token never wins


@pytest.mark.parametrize("vocab", [7, 3000])
def test_kernel_picks_the_references_tokens_from_probs(vocab):
    probs = jax.nn.softmax(_logits(vocab + 1, 6, vocab, jnp.float32), axis=-1)
    keys = jax.random.split(jax.random.key(5), 6)  # per-row keys
    expected = sampling.sample_from_probs(keys, probs, backend="reference")
    got = api_probs_fast_compile(keys, probs)
    assert _mismatch(got, expected) <= ALLOWED_MISMATCH
    assert np.asarray(got)[0] >= vocab // 3  # a token of probability 0 never wins


# ----------------------------------------------------------------------------------------------
# The kernel called directly: every form of key and temperature, one chunk a row and several,
# and the rows the API refuses (NaN, nothing finite) that only jit lets through.

RACE_BATCH, RACE_VOCAB = 12, 1000  # 1000 is not a multiple of 4 * 16: the last step is masked
RACE_QUADS = 16  # 64 columns a step
ONE_CHUNK_STEPS = 16  # 1024 columns a program: one chunk a row, the kernel writes the token
CHUNKED_STEPS = 4  # 256 columns a program: four chunks, the last one 232 columns
VALID_ROWS = 9  # rows 0..8 are valid input for the public API; 9..11 are not
NO_FINITE_ROWS = [9, 10]
TIE_COLUMNS = {3: [5, 40, 69, 261, 999], 4: [300, 556, 812]}  # greedy rows' tied maxima
# The lowest tied column: within a step (5 and 40), across steps at one position (5 and 69; 300,
# 556 and 812 in one chunk), and across chunks (5 and 261; 300, 556 and 812 with four chunks).
GREEDY_TOKENS = {2: 0, 3: 5, 4: 300}
# Rows 2, 3 and 4 greedy; the plain random rows 5..8 at four other temperatures.
ROW_TEMPERATURES = [1.0, 0.5, 0.0, 0.0, 0.0, 0.3, 2.0, 5.0, 0.05, 1.0, 1.0, 0.7]


def _race_logits() -> jax.Array:
    """float32 ``[12, 1000]``: 0 random with its first third masked (-inf); 1 all -inf but the
    last column (inside the masked last step); 2 all equal; 3 and 4 random below ties at
    ``TIE_COLUMNS``; 5..8 random; 9 all NaN; 10 all -inf; 11 random with NaN columns."""
    generator = np.random.default_rng(17)
    logits = generator.standard_normal((RACE_BATCH, RACE_VOCAB)) * 3
    logits[0, : RACE_VOCAB // 3] = -np.inf
    logits[1] = -np.inf
    logits[1, -1] = 0.5
    logits[2] = 1.25
    for row, columns in TIE_COLUMNS.items():
        logits[row, columns] = logits[row].max() + 1
    logits[9] = np.nan
    logits[10] = -np.inf
    logits[11, ::3] = np.nan
    return jnp.asarray(logits, jnp.float32)


def _race_probs() -> jax.Array:
    """float32 ``[12, 1000]`` weights, not normalized: 0 random with its first third 0; 1 zero
    but the last column; 2 all equal; 3..8 random, 4 of them times 1e30; 9 all NaN; 10 all 0;
    11 random with NaN columns."""
    generator = np.random.default_rng(18)
    probs = np.exp(generator.standard_normal((RACE_BATCH, RACE_VOCAB)) * 2)
    probs[0, : RACE_VOCAB // 3] = 0.0
    probs[1] = 0.0
    probs[1, -1] = 0.25
    probs[2] = 1.0 / RACE_VOCAB
    probs[4] *= 1e30
    probs[9] = np.nan
    probs[10] = 0.0
    probs[11, ::3] = np.nan
    return jnp.asarray(probs, jnp.float32)


def _contract_tokens(values, key, temperature, from_logits: bool) -> np.ndarray:
    """The race as ``kernels_pallas/rng.py`` documents its numbers: row ``b``'s key words from
    ``row_keys``, token ``i``'s noise ``gumbel(noise_bits(row key, i, EXPONENTIAL_STREAM))``,
    raced by the reference (NaN scores never win; lowest column on ties)."""
    batch, vocab = values.shape
    words = rng.row_keys(key, batch)[:, None, :]
    bits = rng.noise_bits(words, jnp.arange(vocab), EXPONENTIAL_STREAM)
    gumbels = rng.gumbel(bits)
    if from_logits:
        temperature = jnp.broadcast_to(temperature, (batch,))
        return np.asarray(reference.sample_from_logits_from_gumbels(values, gumbels, temperature))
    return np.asarray(reference.sample_from_probs_from_gumbels(values, gumbels))


# (from_logits, keys, temperatures, steps): each pair of key form, temperature form and chunking
# appears at least once among the logits cases (an orthogonal array), and both key forms and
# both chunkings among the probability cases. Each case is one compile of the interpreted
# kernel (~5 s), so no more cases than that.
RACE_CASES = [
    (True, "one key", "one temperature", ONE_CHUNK_STEPS),
    (True, "one key", "row temperatures", CHUNKED_STEPS),
    (True, "row keys", "one temperature", CHUNKED_STEPS),
    (True, "row keys", "row temperatures", ONE_CHUNK_STEPS),
    (False, "one key", "one temperature", CHUNKED_STEPS),
    (False, "row keys", "one temperature", ONE_CHUNK_STEPS),
]


@pytest.mark.parametrize(("from_logits", "keys", "temperatures", "steps"), RACE_CASES)
def test_kernel_runs_the_documented_race(from_logits, keys, temperatures, steps):
    """Direct calls at tiny shapes: the tokens of the documented race for every row, and of the
    public API (``backend="reference"``) for the rows it accepts; a masked or zero-probability
    token never wins; rows without a finite score return column 0, inside the row; greedy ties
    go to the lowest column."""
    values = _race_logits() if from_logits else _race_probs()
    assert pl.cdiv(RACE_VOCAB, 4 * RACE_QUADS * steps) == (1 if steps == ONE_CHUNK_STEPS else 4)
    if keys == "one key":
        key = jax.random.key(31)
        key_words = rng.key_words(key)  # [2]: the kernel derives the rows' words
    else:
        key = jax.random.split(jax.random.key(32), RACE_BATCH)
        key_words = rng.row_keys(key, RACE_BATCH)  # [B, 2]
    if temperatures == "one temperature":
        temperature = jnp.array([0.7], jnp.float32)
        api_temperature = 0.7
    else:
        temperature = jnp.array(ROW_TEMPERATURES, jnp.float32)
        api_temperature = temperature[:VALID_ROWS]

    def kernel(temperature):
        return np.asarray(
            gumbel_sample_fast_compile(
                values,
                key_words,
                temperature,
                from_logits=from_logits,
                stream=EXPONENTIAL_STREAM,
                quads=RACE_QUADS,
                steps=steps,
                interpret=not ON_GPU,
            )
        )

    tokens = kernel(temperature)
    assert tokens.shape == (RACE_BATCH,) and tokens.dtype == np.int32
    expected = _contract_tokens(values, key, temperature, from_logits)
    # The contract and the public reference agree on valid rows (a row's key words do not
    # depend on the batch size, so the first rows draw the same numbers alone).
    if from_logits:
        public = sampling.sample_from_logits(
            key[:VALID_ROWS] if keys == "row keys" else key,
            values[:VALID_ROWS],
            temperature=api_temperature,
            backend="reference",
        )
    else:
        public = sampling.sample_from_probs(
            key[:VALID_ROWS] if keys == "row keys" else key,
            values[:VALID_ROWS],
            backend="reference",
        )
    np.testing.assert_array_equal(np.asarray(public), expected[:VALID_ROWS])
    assert _mismatch(tokens, expected) <= ALLOWED_MISMATCH, (tokens, expected)

    # Structural rows, exact on any device (no near-tie can be involved):
    assert tokens[0] >= RACE_VOCAB // 3  # masked (-inf) or zero-probability tokens never win
    assert tokens[1] == RACE_VOCAB - 1  # the only candidate, in the masked last step
    # No finite score: the first column, inside the row.
    assert tokens[NO_FINITE_ROWS].tolist() == expected[NO_FINITE_ROWS].tolist() == [0, 0]
    assert ((tokens >= 0) & (tokens < RACE_VOCAB)).all()
    if from_logits and temperatures == "row temperatures":
        assert [tokens[row] for row in GREEDY_TOKENS] == list(GREEDY_TOKENS.values())
    if from_logits and temperatures == "one temperature":
        # The same compiled kernel with one temperature 0: every row greedy.
        zero = jnp.array([0.0], jnp.float32)
        greedy = kernel(zero)
        assert [greedy[row] for row in GREEDY_TOKENS] == list(GREEDY_TOKENS.values())
        np.testing.assert_array_equal(greedy, _contract_tokens(values, key, zero, True))
        # Greedy is the first maximum of each valid row (NumPy's argmax, lowest index on ties).
        np.testing.assert_array_equal(
            greedy[:VALID_ROWS], np.argmax(np.asarray(values[:VALID_ROWS]), axis=1)
        )


def test_kernel_refuses_fast_math_when_interpreted_and_odd_quads():
    """Inline PTX cannot be interpreted; a step's ``[quads, 4]`` tile needs a power of two.
    Both are refused while tracing, before anything compiles."""
    values = jnp.zeros((2, 64), jnp.float32)
    words = rng.key_words(jax.random.key(0))
    arguments = dict(from_logits=True, stream=EXPONENTIAL_STREAM)
    with pytest.raises(ValueError, match="fast_math"):
        gumbel_sample(values, words, jnp.ones(1), fast_math=True, interpret=True, **arguments)
    with pytest.raises(ValueError, match="quads"):
        gumbel_sample(values, words, jnp.ones(1), quads=12, interpret=True, **arguments)


def test_auto_runs_the_gumbel_kernel_from_its_minimum_batch_on_a_gpu(monkeypatch):
    """On a GPU, ``backend="auto"`` keeps the XLA reference for small batches (as fast or
    faster there) and calls the kernel from ``GUMBEL_KERNEL_MIN_BATCH`` rows up, for both
    races."""
    from kernels_pallas import platform
    from sampling import api

    monkeypatch.setattr(platform, "on_gpu", lambda: True)
    calls = []

    def fake_kernel(values, *args, **kwargs):
        calls.append(values.shape[0])
        return jnp.zeros(values.shape[:1], jnp.int32)

    monkeypatch.setattr("kernels_pallas.sampling.gumbel_sample", fake_kernel)
    small, large = api.GUMBEL_KERNEL_MIN_BATCH - 1, api.GUMBEL_KERNEL_MIN_BATCH
    for batch in (small, large):
        sampling.sample_from_logits(jax.random.key(0), jnp.zeros((batch, 5)))
        sampling.sample_from_probs(jax.random.key(0), jnp.ones((batch, 5)))
    assert calls == [large, large]


# ----------------------------------------------------------------------------------------------
# On the GPU, at the full vocabulary: the kernels' draws against the target distribution.

FULL_VOCAB = 128256
GPU_DRAW_CHUNKS, GPU_DRAW_ROWS = 40, 2048  # 81920 draws, in chunks of 1 GB of rows
NUM_BUCKETS = 64


def _mass_buckets(target: np.ndarray) -> np.ndarray:
    """int ``[V]``: each token's bucket when the tokens, in the sampling order, are cut into
    ``NUM_BUCKETS`` runs of about equal target mass. A sampler that draws the target draws each
    bucket at its mass, so the calibrated test of ``tests/test_sampling_api.py`` applies to the
    buckets (64 categories) where 81920 draws could not test 128256 tokens one by one."""
    order = np.argsort(-target, kind="stable")
    mass_before = np.concatenate([[0.0], np.cumsum(target[order])[:-1]])
    buckets = np.empty(target.shape[0], np.int64)
    buckets[order] = np.minimum((mass_before * NUM_BUCKETS).astype(np.int64), NUM_BUCKETS - 1)
    return buckets


GPU_CASES = {
    "gumbel_probs": dict(),
    "top_p": dict(top_p=0.9),
    "top_k": dict(top_k=50),
    "min_p": dict(min_p=0.1),
    "joint": dict(top_k=50, top_p=0.9),
    "top_k_first": dict(top_k=50, top_p=0.9, order="top_k_first"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_kernels_draw_the_target_at_the_full_vocabulary(name):
    """81920 kernel draws at vocab 128256, bucketed by target mass, pass the calibrated L1 test
    (false-fail rate ``ALPHA`` = 1e-6, ``tests/test_sampling_api.py``)."""
    from sampling.filters import FilterParams, filtered_distribution
    from tests.test_sampling_api import assert_distributed_as

    generator = np.random.default_rng(11)
    probs = jax.nn.softmax(jnp.asarray(generator.standard_normal(FULL_VOCAB) * 3, jnp.float32))
    parameters = GPU_CASES[name]
    if name == "gumbel_probs":
        target = np.asarray(probs, np.float64)
    else:
        params = FilterParams(
            top_k=parameters.get("top_k", FULL_VOCAB),
            top_p=parameters.get("top_p", 1.0),
            min_p=parameters.get("min_p", 0.0),
        )
        kept = filtered_distribution(probs, params, parameters.get("order", "joint"))
        target = np.asarray(kept, np.float64)
    target /= target.sum()
    rows = jnp.broadcast_to(probs, (GPU_DRAW_ROWS, FULL_VOCAB))

    @jax.jit
    def draw(keys):
        if name == "gumbel_probs":
            return sampling.sample_from_probs(keys, rows, backend="pallas")
        return sampling.filtered_sample(keys, rows, backend="pallas", **parameters)

    keys = jax.random.split(jax.random.key(3), GPU_DRAW_CHUNKS * GPU_DRAW_ROWS)
    tokens = np.concatenate(
        [
            np.asarray(draw(keys[i * GPU_DRAW_ROWS : (i + 1) * GPU_DRAW_ROWS]))
            for i in range(GPU_DRAW_CHUNKS)
        ]
    )
    assert (target[tokens] > 0).all(), "drew a token outside the kept set"
    buckets = _mass_buckets(target)
    bucket_target = np.bincount(buckets, weights=target, minlength=NUM_BUCKETS)
    assert_distributed_as(buckets[tokens], bucket_target)


# lg2.approx moves a Gumbel by about 2**-20 max(1, |G|) (and log p by about 2**-22 |log2 p| in
# the probability race): a row's token can flip only when its two best scores are that close, a
# chance of order 1e-5 a row. The bound is 100 times that, and 4 rows in 4096: a kernel that breaks a rule (a wrong
# column, key, stream or tie) flips most rows.
GPU_AGREEMENT_ROWS = 1024
GPU_MISMATCH_BOUND = 1e-3


@pytest.mark.gpu
def test_gumbel_kernel_agrees_with_the_reference_at_the_full_vocabulary():
    """At vocab 128256, compiled with the default launch and ``fast_math``: the kernel's tokens
    against the reference's for the same keys (one key and per-row keys; logits at a
    temperature of 1 and one a row with greedy rows; probabilities). The share of rows that
    differ is printed and bounded by ``GPU_MISMATCH_BOUND``; greedy rows (no noise) agree
    exactly; and another launch (one chunk a row) gives the very same tokens (same noise,
    same tie rules)."""
    batch, vocab = GPU_AGREEMENT_ROWS, FULL_VOCAB
    logits = jax.random.normal(jax.random.key(40), (batch, vocab)) * 3.0
    probs = jax.nn.softmax(logits, axis=-1)
    temperatures = jnp.where(jnp.arange(batch) % 8 == 0, 0.0, 0.7)  # every 8th row greedy
    one_key = jax.random.key(41)
    row_keys = jax.random.split(jax.random.key(42), batch)
    differ = rows = 0
    for key in (one_key, row_keys):
        for temperature in (1.0, temperatures):
            ours, theirs = (
                np.asarray(
                    sampling.sample_from_logits(
                        key, logits, temperature=temperature, backend=backend
                    )
                )
                for backend in ("pallas", "reference")
            )
            assert ((ours >= 0) & (ours < vocab)).all()
            differ += int((ours != theirs).sum())
            rows += batch
            if temperature is temperatures:
                np.testing.assert_array_equal(ours[::8], theirs[::8])
                np.testing.assert_array_equal(ours[::8], np.argmax(np.asarray(logits[::8]), 1))
        ours, theirs = (
            np.asarray(sampling.sample_from_probs(key, probs, backend=backend))
            for backend in ("pallas", "reference")
        )
        differ += int((ours != theirs).sum())
        rows += batch
    share = differ / rows
    print(
        f"gumbel kernel vs reference at vocab {vocab}: {differ} of {rows} rows differ ({share:.2e})"
    )
    assert share <= GPU_MISMATCH_BOUND, (differ, rows)

    words = rng.row_keys(row_keys, batch)
    launches = [{}, dict(steps=pl.cdiv(vocab, 4 * default_launch(batch, vocab)["quads"]))]
    tokens = [
        np.asarray(
            gumbel_sample(
                logits,
                words,
                jnp.ones((1,), jnp.float32),
                from_logits=True,
                stream=EXPONENTIAL_STREAM,
                **launch,
            )
        )
        for launch in launches
    ]
    np.testing.assert_array_equal(tokens[0], tokens[1])


# ----------------------------------------------------------------------------------------------
# Dual-pivot rejection and the renorm / mask kernels against the reference (interpret mode).
#
# The kernel runs the reference's rounds with the same uniforms, but sums in block order where the
# reference reads one sorted running sum. A top-p test or an inverse-transform draw within a
# float32 rounding error of its threshold can therefore go the other way. How often grows with
# the vocabulary (the running sums' rounding grows like sqrt(V) ulps while tail tokens shrink
# like 1 / V): on the H200 at vocab 128256, 1 row in 64 differed for top-p, top-k and joint, 0
# for min-p (bench/tuning/sampling.py, 2026-11-30). At the vocabularies here the rate is far lower;
# the bound below is 1 row in 32 over 96 rows, so up to 3 flips pass and a kernel that breaks a
# rule (wrong pivot, wrong tie) fails it: such a bug flips a large share of the rows.

FILTERED_MISMATCH_BOUND = 1 / 32
FILTER_CASES = {
    "top_k": dict(top_k=7),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.05),
    "joint": dict(top_k=40, top_p=0.7),
    "all": dict(top_k=20, top_p=0.9, min_p=0.02),
    "top_k_first": dict(top_k=12, top_p=0.7, order="top_k_first"),
    "top_k_first_min_p": dict(top_k=12, top_p=0.7, min_p=0.05, order="top_k_first"),
}


def _filter_rows(seed: int, batch: int, vocab: int) -> jax.Array:
    """float32 ``[batch, vocab]`` rows with zeros, exact ties at the top and in the body, and a
    row whose only positive token is the last column."""
    generator = np.random.default_rng(seed)
    logits = generator.standard_normal((batch, vocab)) * 2.5
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs[0, : vocab // 2] = 0.0
    if vocab > 8:
        probs[1, 3:7] = probs[1].max()  # a tie at the top
        probs[2, 10:40] = np.median(probs[2])  # a long tie in the body
        probs[3] = 0.0
        probs[3, vocab - 1] = 1.0
    return jnp.asarray(probs / probs.sum(axis=1, keepdims=True), jnp.float32)


# The rounds at 3000 columns (``DUAL_PIVOT_ROUNDS_CASES``) run in
# ``tests/test_sampling_kernels_dual_pivot.py``, whose programs XLA optimizes; here every row
# through the exact fallback (``max_rounds`` 0), one round before it (1), and 7 columns.
DUAL_PIVOT_ROUNDS_CASES = [(3000, name, 32) for name in sorted(FILTER_CASES)]
DUAL_PIVOT_CASES = [(1000, name, 0) for name in sorted(FILTER_CASES)] + [
    (1000, "joint", 1),
    (1000, "top_k_first", 1),
    (7, "top_p", 32),
    (7, "all", 1),
]


@pytest.mark.parametrize(("vocab", "name", "max_rounds"), DUAL_PIVOT_CASES)
def test_dual_pivot_kernel_picks_the_references_tokens(vocab, name, max_rounds):
    """Same keys, same uniforms: the same tokens and rounds, up to the measured rounding flips;
    ``max_rounds`` 0 and 1 send rows through the exact fallback (radix-selected kept set)."""
    check_dual_pivot_picks_the_references_tokens(vocab, name, max_rounds)


def check_dual_pivot_picks_the_references_tokens(vocab: int, name: str, max_rounds: int) -> None:
    """The body of the dual-pivot agreement tests (this module's and the rounds' module's)."""
    batch = 96
    probs = _filter_rows(vocab + max_rounds, batch, vocab)
    keys = jax.random.split(jax.random.key(vocab), batch)
    filters = dict(FILTER_CASES[name])
    if "top_k" in filters:
        filters["top_k"] = min(filters["top_k"], vocab)
    parameters = dict(filters, max_rounds=max_rounds, return_rounds=True)
    ours, our_rounds = sampling.filtered_sample(keys, probs, backend="pallas", **parameters)
    theirs, their_rounds = sampling.filtered_sample(keys, probs, backend="reference", **parameters)
    differs = (np.asarray(ours) != np.asarray(theirs)) | (
        np.asarray(our_rounds) != np.asarray(their_rounds)
    )
    assert differs.mean() <= FILTERED_MISMATCH_BOUND, (name, np.flatnonzero(differs))
    kept = jax.vmap(
        lambda row: sampling.filters.kept_mask(
            row,
            sampling.filters.FilterParams(
                top_k=filters.get("top_k", vocab),
                top_p=filters.get("top_p", 1.0),
                min_p=filters.get("min_p", 0.0),
            ),
            filters.get("order", "joint"),
        )
    )(probs)
    # A token outside the definition's kept set is possible only through the same rounding flips
    # (proofs/sampling.md, Lemma 6), so it is bounded the same way.
    outside = ~np.asarray(kept)[np.arange(batch), np.asarray(ours)]
    assert outside.mean() <= FILTERED_MISMATCH_BOUND, np.flatnonzero(outside)
    if max_rounds == 0:
        assert (np.asarray(our_rounds) == 1).all()  # max_rounds + 1: the fallback decided


@pytest.mark.parametrize("name", sorted(FILTER_CASES))
def test_prefetching_changes_no_token(name):
    """``prefetch=True`` issues each block's loads a block early and sums the same values in
    the same order: the very same tokens and rounds."""
    batch, vocab = 24, 1000
    probs = _filter_rows(21, batch, vocab)
    filters = dict(FILTER_CASES[name])
    from kernels_pallas.sampling import dual_pivot_sample

    words = rng.row_keys(jax.random.split(jax.random.key(9), batch), batch)
    arguments = (
        probs,
        words,
        jnp.full((batch,), filters.get("top_k", vocab), jnp.int32),
        jnp.full((batch,), filters.get("top_p", 1.0), jnp.float32),
        jnp.full((batch,), filters.get("min_p", 0.0), jnp.float32),
    )
    outputs = [
        dual_pivot_sample(
            *arguments,
            order=filters.get("order", "joint"),
            max_rounds=32,
            stream=sampling.api.ROUND_STREAM,
            block=128,
            prefetch=prefetch,
            interpret=not ON_GPU,
        )
        for prefetch in (False, True)
    ]
    for without, with_prefetch in zip(*outputs, strict=True):
        np.testing.assert_array_equal(np.asarray(without), np.asarray(with_prefetch))


def test_dual_pivot_kernel_draws_the_filtered_distribution():
    """The kernel's own draws (not only its agreement with the reference) pass the calibrated
    test of ``tests/test_sampling_api.py`` (false-fail rate 1e-6) on a 64-token distribution
    with ties and a zero. 16384 draws, not the API tests' 100000: interpret mode runs the rows
    one program at a time; the bound is computed for the draws taken. The draws are taken 256
    rows a call, each row with its own key: interpret mode copies the whole batch into each
    row's program, so one call's time grows with the square of its rows (64 calls of 256 rows
    took 1 s, one call of 16384 rows 20 s)."""
    from tests.test_sampling_api import _distribution, assert_distributed_as

    probs = jnp.asarray(_distribution(5))
    parameters = dict(top_k=12, top_p=0.7, min_p=0.01)
    draws, rows_a_call = 16384, 256
    keys = jax.random.split(jax.random.key(2), draws)
    rows = jnp.broadcast_to(probs, (rows_a_call, probs.shape[0]))
    draw = jax.jit(lambda k: sampling.filtered_sample(k, rows, backend="pallas", **parameters))
    tokens = np.concatenate(
        [
            np.asarray(draw(keys[start : start + rows_a_call]))
            for start in range(0, draws, rows_a_call)
        ]
    )
    assert tokens.shape == (draws,)
    target = np.asarray(
        sampling.filters.filtered_distribution(
            probs.astype(jnp.float32), sampling.filters.FilterParams(12, 0.7, 0.01)
        ),
        np.float64,
    )
    assert_distributed_as(tokens, target / target.sum())


@pytest.mark.parametrize("vocab", [7, 1000, 3000])
def test_renorm_and_mask_kernels_follow_the_reference(vocab):
    """Top-k sets are exact (integer counts); top-p sets may differ only by a rounding flip at
    the boundary (none at these sizes); kept probabilities agree to a few float32 ulps (the
    kernel divides by a block-order sum, the reference by a sorted one)."""
    probs = _filter_rows(vocab, 8, vocab)
    logits = jnp.where(probs > 0, jnp.log(probs), -jnp.inf)
    for top_k in (1, 3, min(50, vocab), vocab):
        ours = sampling.top_k_renorm_probs(probs, top_k, backend="pallas")
        theirs = sampling.top_k_renorm_probs(probs, top_k, backend="reference")
        np.testing.assert_array_equal(np.asarray(ours) > 0, np.asarray(theirs) > 0)
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=8e-7, atol=0)
        masked = sampling.top_k_mask_logits(logits, top_k, backend="pallas")
        expected = sampling.top_k_mask_logits(logits, top_k, backend="reference")
        np.testing.assert_array_equal(np.asarray(masked), np.asarray(expected))
    for top_p in (1e-6, 0.3, 0.9, 1.0):
        ours = sampling.top_p_renorm_probs(probs, top_p, backend="pallas")
        theirs = sampling.top_p_renorm_probs(probs, top_p, backend="reference")
        np.testing.assert_array_equal(np.asarray(ours) > 0, np.asarray(theirs) > 0)
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=8e-7, atol=0)


def test_kernels_under_jit_never_return_an_out_of_range_token():
    """NaN, all-zero and all-tiny rows (bad input only jit lets through): a token inside the
    row from every kernel, whatever it is (``sampling/validation.py``)."""
    probs = _filter_rows(3, 6, 300)
    probs = probs.at[1].set(jnp.nan).at[2].set(0.0).at[4].set(-1.0).at[5].set(1e-38)
    keys = jax.random.split(jax.random.key(0), 6)
    # One program per order and round bound, the filters as data (a filter left off is top_k
    # V, top_p 1, min_p 0: what None means), so the two joint cases share a compile.
    programs = {
        (order, max_rounds): jax.jit(
            lambda p, top_k, top_p, min_p, order=order, max_rounds=max_rounds: (
                sampling.filtered_sample(
                    keys,
                    p,
                    top_k=top_k,
                    top_p=top_p,
                    min_p=min_p,
                    order=order,
                    max_rounds=max_rounds,
                    backend="pallas",
                )
            )
        )
        for order in ORDERS
        for max_rounds in (32, 0)
    }
    # The last case is min-p alone: the path that skips the pivot pass (decided at run time).
    for order, filters in (
        ("joint", dict(top_k=5, top_p=0.5, min_p=0.1)),
        ("top_k_first", dict(top_k=5, top_p=0.5, min_p=0.1)),
        ("joint", dict(min_p=0.1)),
    ):
        for max_rounds in (32, 0):
            tokens = programs[order, max_rounds](
                probs,
                jnp.int32(filters.get("top_k", 300)),
                jnp.float32(filters.get("top_p", 1.0)),
                jnp.float32(filters.get("min_p", 0.0)),
            )
            tokens = np.asarray(tokens)
            assert ((tokens >= 0) & (tokens < 300)).all(), (order, filters, tokens)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Pallas Triton backend's
def test_filter_kernels_lower_to_triton_for_an_h200(monkeypatch, verify_triton_modules):
    """The compiled path as far as a CPU can follow it: every dual-pivot, renorm/mask and
    Gumbel variant lowers to one Triton kernel for an H200 that the MLIR verifier accepts (a
    lowering the CPU never exercises: the Triton rules refuse, for example, a ``cond`` branch
    that yields a literal, and the GPU host's parser an ``scf.for`` with mixed bound types)."""
    gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
    h200 = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
    monkeypatch.setitem(gpu_info.registry, jax.devices()[0].device_kind, lambda: h200)
    from kernels_pallas.sampling import dual_pivot_sample, filter_rows

    batch, vocab = 4, 128256
    probs = jax.ShapeDtypeStruct((batch, vocab), jnp.float32)
    words = jax.ShapeDtypeStruct((batch, 2), jnp.uint32)
    ints = jax.ShapeDtypeStruct((batch,), jnp.int32)
    floats = jax.ShapeDtypeStruct((batch,), jnp.float32)

    def cuda_text(function, *arguments):
        return jax.jit(function).trace(*arguments).lower(lowering_platforms=("cuda",)).as_text()

    for order, prefetch in (("joint", False), ("top_k_first", False), ("joint", True)):
        text = cuda_text(
            lambda p, w, k, t, m, order=order, prefetch=prefetch: dual_pivot_sample(
                p, w, k, t, m, order=order, max_rounds=32, stream=1, prefetch=prefetch
            ),
            probs,
            words,
            ints,
            floats,
            floats,
        )
        assert f"dual_pivot_{order}_b8192" in text
    for mode, parameter in (("top_k_renorm", ints), ("top_p_renorm", floats), ("top_k_mask", ints)):
        text = cuda_text(lambda v, q, mode=mode: filter_rows(v, q, mode=mode), probs, parameter)
        assert f"{mode}_b2048" in text
    # The Gumbel race with the default launch (and fast_math, on when not interpreted: the
    # inline PTX must pass the verifier too), its name from default_launch: [B, 2] rows' keys
    # with a temperature a row, one key's [2] words with one temperature, a batch of one (one
    # program a step), and one chunk a row (the kernel writes the token itself).
    one_temperature = jax.ShapeDtypeStruct((1,), jnp.float32)
    one_key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    one_row = jax.ShapeDtypeStruct((1, vocab), jnp.float32)
    steps_per_row = pl.cdiv(vocab, 4 * default_launch(batch, vocab)["quads"])
    gumbel_calls = [
        (True, probs, words, floats, {}),
        (False, probs, words, floats, {}),
        (True, probs, one_key, one_temperature, {}),
        (False, one_row, one_key, one_temperature, {}),
        (True, one_row, one_key, one_temperature, {}),
        (True, probs, words, one_temperature, dict(steps=steps_per_row)),
    ]
    assert default_launch(1, vocab)["steps"] == 1  # one program a step at batch 1
    for from_logits, values, key_words, temperature, launch in gumbel_calls:
        text = cuda_text(
            lambda v, w, t, from_logits=from_logits, launch=launch: gumbel_sample(
                v, w, t, from_logits=from_logits, stream=0, **launch
            ),
            values,
            key_words,
            temperature,
        )
        expected = dict(default_launch(values.shape[0], vocab), **launch)
        kind = "logits" if from_logits else "probs"
        assert f"gumbel_{kind}_q{expected['quads']}x{expected['steps']}" in text
        assert "mul.hi.u32" in text and "lg2.approx.f32" in text  # fast_math by default


# Rows of integer counts / 1024: every partial sum is an exact float32 in any order, so block
# order and sorted order give the same floats and the kernels must equal the reference exactly.
# Blocks of 32 columns put ties across block boundaries, and top_p values that are multiples of
# 1/8 land exactly on partial sums: the cases where a wrong tie rule or pivot would show.
EXACT_BLOCK = 32
EXACT_CASES = [
    dict(top_k=10),
    dict(top_k=37),
    dict(top_p=0.25),
    dict(top_p=0.5),
    dict(min_p=0.5),
    dict(top_k=30, top_p=0.375),
    dict(top_k=10, top_p=0.3, order="top_k_first"),
    dict(top_k=40, top_p=0.5, min_p=0.25, order="top_k_first"),
]


def _exact_rows(batch: int, vocab: int) -> jax.Array:
    generator = np.random.default_rng(42)
    counts = generator.integers(0, 5, size=(batch, vocab)).astype(np.float64)
    counts[0] = 4.0  # every token tied
    counts[1, :] = 0.0
    counts[1, 29:35] = 3.0  # one tie straddling a block boundary
    counts[1, 100] = 3.0
    return jnp.asarray(counts / 1024, jnp.float32)


@pytest.mark.parametrize("case", range(len(EXACT_CASES)))
@pytest.mark.parametrize("max_rounds", [32, 0])
def test_kernels_equal_the_reference_where_every_sum_is_exact(case, max_rounds):
    from kernels_pallas.sampling import dual_pivot_sample

    # TIE_BATCH rows: the shape and launch of the tie test's 32-column-block calls below, whose
    # compiled kernels they share.
    batch, vocab = TIE_BATCH, TIE_VOCAB
    probs = _exact_rows(batch, vocab)
    keys = jax.random.split(jax.random.key(case), batch)
    filters = EXACT_CASES[case]
    theirs, their_rounds = sampling.filtered_sample(
        keys, probs, max_rounds=max_rounds, return_rounds=True, backend="reference", **filters
    )
    ours, our_rounds = dual_pivot_sample(
        probs,
        rng.row_keys(keys, batch),
        jnp.full((batch,), filters.get("top_k", vocab), jnp.int32),
        jnp.full((batch,), filters.get("top_p", 1.0), jnp.float32),
        jnp.full((batch,), filters.get("min_p", 0.0), jnp.float32),
        order=filters.get("order", "joint"),
        max_rounds=max_rounds,
        stream=sampling.api.ROUND_STREAM,
        block=EXACT_BLOCK,
        interpret=not ON_GPU,
    )
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    np.testing.assert_array_equal(np.asarray(our_rounds), np.asarray(their_rounds))


def test_renorm_and_mask_kernels_equal_the_reference_where_every_sum_is_exact():
    """Kept sets and masks equal exactly; renormalized values divide the same exact floats, so
    they agree to 1 ulp (XLA may multiply by the reciprocal where the kernel divides)."""
    from kernels_pallas.sampling import filter_rows

    batch, vocab = 8, 200
    probs = _exact_rows(batch, vocab)
    logits = jnp.where(probs > 0, jnp.log(probs), -jnp.inf)

    def kernel(values, parameter, mode):
        return np.asarray(
            filter_rows(
                values,
                jnp.full((batch,), parameter),
                mode=mode,
                block=EXACT_BLOCK,
                interpret=not ON_GPU,
            )
        )

    def same_renorm(ours, theirs):
        np.testing.assert_array_equal(ours > 0, theirs > 0)
        np.testing.assert_array_max_ulp(ours, theirs, maxulp=1)

    for top_k in (1, 10, 37, 150, vocab):
        same_renorm(
            kernel(probs, top_k, "top_k_renorm"),
            np.asarray(sampling.top_k_renorm_probs(probs, top_k, backend="reference")),
        )
        np.testing.assert_array_equal(
            kernel(logits, top_k, "top_k_mask"),
            np.asarray(sampling.top_k_mask_logits(logits, top_k, backend="reference")),
        )
    for top_p in (2.0**-20, 0.125, 0.25, 0.375, 0.5, 1.0):
        same_renorm(
            kernel(probs, top_p, "top_p_renorm"),
            np.asarray(sampling.top_p_renorm_probs(probs, top_p, backend="reference")),
        )


def test_a_top_p_mass_that_underflows_keeps_the_first_token():
    """``top_p * N`` can round to 0 (a tiny ``top_p`` of a tiny row); the definition still keeps
    the first token. Found in review: the radix search then returned the key of no token and
    the kernels kept nothing (token 0, of probability 0; a renormalized row of zeros)."""
    probs = jnp.array([[0.0, 0.1, 0.6, 0.3], [0.0, 1e-30, 3e-30, 2e-30]], jnp.float32)
    keys = jax.random.split(jax.random.key(0), 2)
    for order in ("joint", "top_k_first"):
        tokens = sampling.filtered_sample(
            keys, probs, top_k=2, top_p=1e-38, order=order, max_rounds=0, backend="pallas"
        )
        assert np.asarray(tokens).tolist() == [2, 2]
    renormed = sampling.top_p_renorm_probs(probs, 1e-9, backend="pallas")
    np.testing.assert_array_equal(np.asarray(renormed), [[0, 0, 1, 0], [0, 0, 1, 0]])


def test_top_k_mask_orders_negative_zero_as_zero_and_keeps_its_bits():
    """-0.0 and +0.0 are equal logits (the reference's sort ties them, then index decides); the
    mask keeps a kept logit bit for bit, sign of zero included."""
    logits = jnp.array([[-0.0, 0.0, -1.0, 0.0]], jnp.float32)
    for top_k in (1, 2):
        ours = np.asarray(sampling.top_k_mask_logits(logits, top_k, backend="pallas"))
        theirs = np.asarray(sampling.top_k_mask_logits(logits, top_k, backend="reference"))
        np.testing.assert_array_equal(ours, theirs)
        np.testing.assert_array_equal(np.signbit(ours), np.signbit(theirs))


def test_an_empty_batch_gives_no_tokens_on_the_kernel_path():
    """Batch 0 returns ``int32[0]``, as the reference does, rather than dividing by zero when
    the launch is chosen."""
    from sampling import api

    for function, values in (
        (api.sample_from_logits, jnp.zeros((0, 5), jnp.float32)),
        (api.sample_from_probs, jnp.ones((0, 5), jnp.float32)),
    ):
        for backend in ("pallas", "reference"):
            tokens = function(jax.random.key(0), values, backend=backend)
            assert tokens.shape == (0,) and tokens.dtype == jnp.int32, (function, backend)


# Tie-heavy rows where no comparison can flip by rounding: counts / 1024 (every partial sum an
# exact float32, in block order and in sorted order alike), each row with a block of tokens tied
# at a count of 3, scattered over the row and across 32-column blocks, and per-row parameters
# that put each filter's cut-off inside that block: top-k after some of the ties, top-p exactly
# on a partial sum inside it and halfway into a tie, min-p exactly at the tied value. Only the
# tie rule decides there, so the kernel must pick the reference's very token and rounds, row for
# row (the mismatch-rate bound above let a tie bug through on 5 of 96 rows).
TIE_BATCH, TIE_VOCAB, TIED_COUNT = 48, 200, 3


def _tie_heavy_rows():
    """``(probs float32[B, V], top_k int32[B], top_p_exact, top_p_halfway, min_p float32[B])``."""
    generator = np.random.default_rng(15)
    counts = generator.choice([0, 1, 2, 4, 5, 6, 8], size=(TIE_BATCH, TIE_VOCAB)).astype(np.int64)
    top_k = np.zeros(TIE_BATCH, np.int32)
    top_p_exact = np.zeros(TIE_BATCH, np.float32)
    top_p_halfway = np.zeros(TIE_BATCH, np.float32)
    for row in range(TIE_BATCH):
        ties = generator.choice(TIE_VOCAB, size=int(generator.integers(8, 60)), replace=False)
        counts[row, ties] = TIED_COUNT
        counts[row, 0] = 8  # the largest count is 8: min-p 3/8 is exactly the tied value
        above = counts[row] > TIED_COUNT
        kept_ties = int(generator.integers(1, ties.size))
        top_k[row] = above.sum() + kept_ties
        total = counts[row].sum()
        # The target mass lands exactly on the partial sum after kept_ties ties (that tie is
        # kept, the next is not: "mass before < target" fails with equality), or halfway.
        mass = counts[row][above].sum() + kept_ties * TIED_COUNT
        top_p_exact[row] = mass / total
        top_p_halfway[row] = (mass - TIED_COUNT / 2) / total
    probs = jnp.asarray(counts / 1024, jnp.float32)
    min_p = np.full(TIE_BATCH, TIED_COUNT / 8, np.float32)
    return probs, top_k, top_p_exact, top_p_halfway, min_p


TIE_FILTERS = ("top_k", "top_p_exact", "top_p_halfway", "min_p", "joint", "top_k_first")


@pytest.mark.parametrize("max_rounds", [32, 0])
@pytest.mark.parametrize("name", TIE_FILTERS)
def test_dual_pivot_kernel_equals_the_reference_on_ties_at_every_cut_off(name, max_rounds):
    from kernels_pallas.sampling import dual_pivot_sample

    probs, top_k, top_p_exact, top_p_halfway, min_p = _tie_heavy_rows()
    filters = {
        "top_k": dict(top_k=top_k),
        "top_p_exact": dict(top_p=top_p_exact),
        "top_p_halfway": dict(top_p=top_p_halfway),
        "min_p": dict(min_p=min_p),
        "joint": dict(top_k=top_k, top_p=top_p_halfway, min_p=min_p / 2),
        # top-p of the top-k mass: top-k keeps every token and top-p cuts inside the ties
        "top_k_first": dict(top_k=np.full(TIE_BATCH, TIE_VOCAB - 1, np.int32), top_p=top_p_exact),
    }[name]
    order = "top_k_first" if name == "top_k_first" else "joint"
    keys = jax.random.split(jax.random.key(max_rounds), TIE_BATCH)
    theirs, their_rounds = sampling.filtered_sample(
        keys,
        probs,
        order=order,
        max_rounds=max_rounds,
        return_rounds=True,
        backend="reference",
        **filters,
    )
    # The public kernel path (one block a row) and 32-column blocks (ties across blocks).
    ours, our_rounds = sampling.filtered_sample(
        keys,
        probs,
        order=order,
        max_rounds=max_rounds,
        return_rounds=True,
        backend="pallas",
        **filters,
    )
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    np.testing.assert_array_equal(np.asarray(our_rounds), np.asarray(their_rounds))
    blocked, blocked_rounds = dual_pivot_sample(
        probs,
        rng.row_keys(keys, TIE_BATCH),
        jnp.asarray(filters.get("top_k", np.full(TIE_BATCH, TIE_VOCAB)), jnp.int32),
        jnp.asarray(filters.get("top_p", np.ones(TIE_BATCH)), jnp.float32),
        jnp.asarray(filters.get("min_p", np.zeros(TIE_BATCH)), jnp.float32),
        order=order,
        max_rounds=max_rounds,
        stream=sampling.api.ROUND_STREAM,
        block=EXACT_BLOCK,
        interpret=not ON_GPU,
    )
    np.testing.assert_array_equal(np.asarray(blocked), np.asarray(theirs))
    np.testing.assert_array_equal(np.asarray(blocked_rounds), np.asarray(their_rounds))
    # And the reference's tokens are kept by the definition (the tie rule, by index).
    kept = jax.vmap(
        lambda row, k, p, m: sampling.filters.kept_mask(
            row, sampling.filters.FilterParams(k, p, m), order
        )
    )(
        probs,
        jnp.asarray(filters.get("top_k", np.full(TIE_BATCH, TIE_VOCAB)), jnp.int32),
        jnp.asarray(filters.get("top_p", np.ones(TIE_BATCH)), jnp.float32),
        jnp.asarray(filters.get("min_p", np.zeros(TIE_BATCH)), jnp.float32),
    )
    assert np.asarray(kept)[np.arange(TIE_BATCH), np.asarray(theirs)].all()
