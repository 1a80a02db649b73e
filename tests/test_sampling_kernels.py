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
