"""The Gumbel-max sampling kernel against the reference: the same tokens for the same keys.

In interpret mode (CPU) the kernel evaluates the very same float operations as the reference,
so the tokens must be identical. Compiled on a GPU, ``log`` and ``log1p`` may differ from XLA's
in the last bit, which can flip a race only when two scores are within an ulp: the GPU run
allows a mismatch rate of 1e-3 (at these small batches, any mismatch fails; measuring the rate
at 128K-token rows belongs to the kernel's first GPU run). The distribution itself is tested
on the reference (``tests/test_sampling_api.py``); equal tokens carry it over to the kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sampling
from kernels_pallas import rng
from kernels_pallas.sampling import gumbel_sample
from sampling.api import EXPONENTIAL_STREAM
from tests.conftest import ON_GPU

ALLOWED_MISMATCH = 1e-3 if ON_GPU else 0.0


def _logits(seed, batch, vocab, dtype):
    rng_np = np.random.default_rng(seed)
    logits = rng_np.standard_normal((batch, vocab)) * 3
    logits[0, : vocab // 3] = -np.inf  # masked tokens
    if vocab > 4:
        logits[1, 2] = logits[1, 3] = logits[1].max() + 1  # an exact tie at the top
    return jnp.asarray(logits, dtype)


def _mismatch(got, expected):
    return float(np.mean(np.asarray(got) != np.asarray(expected)))


@pytest.mark.parametrize("vocab", [1, 7, 1000, 3000])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_picks_the_references_tokens_from_logits(vocab, dtype):
    batch = 6
    logits = _logits(vocab, batch, vocab, dtype)
    temperature = jnp.array([1.0, 0.0, 0.5, 2.0, 1.0, 0.0])
    key = jax.random.key(vocab)
    expected = sampling.sample_from_logits(
        key, logits, temperature=temperature, backend="reference"
    )
    got = sampling.sample_from_logits(key, logits, temperature=temperature, backend="pallas")
    assert _mismatch(got, expected) <= ALLOWED_MISMATCH
    assert np.asarray(got)[1] == (2 if vocab > 4 else np.argmax(np.asarray(logits[1])))


@pytest.mark.parametrize("vocab", [7, 3000])
def test_kernel_picks_the_references_tokens_from_probs(vocab):
    probs = jax.nn.softmax(_logits(vocab + 1, 6, vocab, jnp.float32), axis=-1)
    keys = jax.random.split(jax.random.key(5), 6)  # per-row keys
    expected = sampling.sample_from_probs(keys, probs, backend="reference")
    got = sampling.sample_from_probs(keys, probs, backend="pallas")
    assert _mismatch(got, expected) <= ALLOWED_MISMATCH


def test_launch_shapes_do_not_change_the_tokens():
    """Blocks and chunks partition the row differently; the winner must not move."""
    logits = _logits(9, 4, 2500, jnp.float32)
    words = rng.row_keys(jax.random.key(1), 4)
    temperature = jnp.ones(4)
    results = [
        np.asarray(
            gumbel_sample(
                logits,
                words,
                temperature,
                from_logits=True,
                stream=EXPONENTIAL_STREAM,
                block=block,
                blocks_per_program=blocks,
                interpret=not ON_GPU,
            )
        )
        for block, blocks in [(128, 1), (256, 4), (1024, 8)]
    ]
    assert all(np.array_equal(results[0], other) for other in results[1:])


def test_auto_keeps_the_reference_until_the_kernel_ran_on_a_gpu(monkeypatch):
    from kernels_pallas import platform

    monkeypatch.setattr(platform, "on_gpu", lambda: True)
    calls = []
    monkeypatch.setattr("kernels_pallas.sampling.gumbel_sample", lambda *a, **k: calls.append(1))
    sampling.sample_from_logits(jax.random.key(0), jnp.zeros((2, 5)))
    assert calls == []


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


# ----------------------------------------------------------------------------------------------
# Dual-pivot rejection and the renorm / mask kernels against the reference (interpret mode).
#
# The kernel runs the reference's rounds with the same uniforms, but sums in block order where the
# reference reads one sorted running sum. A top-p test or an inverse-transform draw within a
# float32 rounding error of its threshold can therefore go the other way. How often grows with
# the vocabulary (the running sums' rounding grows like sqrt(V) ulps while tail tokens shrink
# like 1 / V): on the H200 at vocab 128256, 1 row in 64 differed for top-p, top-k and joint, 0
# for min-p (bench/tune_sampling.py, 2026-11-30). At the vocabularies here the rate is far lower;
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


DUAL_PIVOT_CASES = (
    [(3000, name, 32) for name in sorted(FILTER_CASES)]  # the rounds
    + [(1000, name, 0) for name in sorted(FILTER_CASES)]  # every row through the fallback
    + [(1000, "joint", 1), (1000, "top_k_first", 1), (7, "top_p", 32), (7, "all", 1)]
)


@pytest.mark.parametrize(("vocab", "name", "max_rounds"), DUAL_PIVOT_CASES)
def test_dual_pivot_kernel_picks_the_references_tokens(vocab, name, max_rounds):
    """Same keys, same uniforms: the same tokens and rounds, up to the measured rounding flips;
    ``max_rounds`` 0 and 1 send rows through the exact fallback (radix-selected kept set)."""
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


def test_min_p_alone_takes_one_round_in_the_kernel():
    """The kernel starts from min-p's kept set as the reference does, and with min-p the only
    filter it skips the pivot pass: every row, the all-zero-but-one row and ties included,
    decides in exactly one round and draws a kept token."""
    batch, vocab = 16, 3000
    probs = _filter_rows(11, batch, vocab)
    keys = jax.random.split(jax.random.key(5), batch)
    min_p = jnp.linspace(0.0, 1.0, batch)  # 0 (no filter) to 1 (only the maximum's ties)
    ours, rounds = sampling.filtered_sample(
        keys, probs, min_p=min_p, return_rounds=True, backend="pallas"
    )
    theirs = sampling.filtered_sample(keys, probs, min_p=min_p, backend="reference")
    np.testing.assert_array_equal(np.asarray(rounds), 1)
    assert _mismatch(ours, theirs) <= FILTERED_MISMATCH_BOUND
    chosen = np.asarray(probs)[np.arange(batch), np.asarray(ours)]
    largest = np.asarray(probs).max(axis=1)
    assert (chosen >= np.asarray(min_p) * largest).all() and (chosen > 0).all()


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
    one program at a time; the bound is computed for the draws taken."""
    from tests.test_sampling_api import _distribution, assert_distributed_as

    probs = jnp.asarray(_distribution(5))
    parameters = dict(top_k=12, top_p=0.7, min_p=0.01)
    rows = jnp.broadcast_to(probs, (16384, probs.shape[0]))
    tokens = np.asarray(
        jax.jit(
            lambda p: sampling.filtered_sample(jax.random.key(2), p, backend="pallas", **parameters)
        )(rows)
    )
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
    # The last case is min-p alone: the path that skips the pivot pass.
    for order, filters in (
        ("joint", dict(top_k=5, top_p=0.5, min_p=0.1)),
        ("top_k_first", dict(top_k=5, top_p=0.5, min_p=0.1)),
        ("joint", dict(min_p=0.1)),
    ):
        for max_rounds in (32, 0):
            tokens = jax.jit(
                lambda p, order=order, max_rounds=max_rounds, filters=filters: (
                    sampling.filtered_sample(
                        keys, p, order=order, max_rounds=max_rounds, backend="pallas", **filters
                    )
                )
            )(probs)
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
    from kernels_pallas.sampling import gumbel_sample

    for from_logits in (True, False):
        text = cuda_text(
            lambda v, w, t, from_logits=from_logits: gumbel_sample(
                v, w, t, from_logits=from_logits, stream=0
            ),
            probs,
            words,
            floats,
        )
        assert f"gumbel_{'logits' if from_logits else 'probs'}_b1024x2" in text


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

    batch, vocab = 24, 200
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
