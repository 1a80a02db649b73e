"""What users get wrong, for every public function of ``sampling``, ``speculative`` and the norms
of ``serving.layers``, on both backends (kernels interpreted on a CPU):

- x64 mode (``jax.enable_x64(True)``, how researchers run float64 references): float32 inputs
  give the very results, dtypes included, that they give without it;
- a batch of 0 gives an empty result of the documented shape and dtype;
- ``top_k`` that is not an integer, and inputs that are not arrays;
- rows whose every logit is masked, under ``jit`` (where nothing can be checked).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sampling
import speculative
from serving import layers
from tests.conftest import enable_x64

BACKENDS = ("reference", "pallas")
BATCH, VOCAB, NUM_DRAFTS, HIDDEN = 3, 40, 2, 24


def _inputs(batch: int):
    """float32 inputs of every function, ``batch`` rows (deterministic, never all-equal)."""
    generator = np.random.default_rng(15)
    logits = generator.normal(size=(batch, VOCAB)).astype(np.float32) * 2
    logits[:, 7] = -np.inf  # a masked token
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = (probs / probs.sum(axis=1, keepdims=True)).astype(np.float32)
    target = generator.dirichlet(np.full(VOCAB, 0.5), size=(batch, NUM_DRAFTS + 1))
    draft = generator.dirichlet(np.full(VOCAB, 0.5), size=(batch, NUM_DRAFTS))
    draft_ids = generator.integers(0, VOCAB, size=(batch, NUM_DRAFTS)).astype(np.int32)
    x = generator.normal(size=(batch, HIDDEN)).astype(np.float32)
    residual = 4 * generator.normal(size=(batch, HIDDEN)).astype(np.float32)
    weight = (1 + 0.5 * generator.normal(size=HIDDEN)).astype(np.float32)
    return dict(
        logits=logits,
        probs=probs,
        target=target.astype(np.float32),
        draft=draft.astype(np.float32),
        draft_ids=draft_ids,
        x=x,
        residual=residual,
        weight=weight,
    )


KEY = 5
# Every public function, called on inputs(batch) with a backend. Functions without ``backend=``
# (one implementation) run once for each, the same call.
CALLS = {
    "sample_from_logits": lambda a, b: sampling.sample_from_logits(
        jax.random.key(KEY), a["logits"], temperature=0.8, return_logprob=True, backend=b
    ),
    "sample_from_probs": lambda a, b: sampling.sample_from_probs(
        jax.random.key(KEY), a["probs"], return_logprob=True, backend=b
    ),
    "filtered_sample": lambda a, b: sampling.filtered_sample(
        jax.random.key(KEY),
        a["probs"],
        top_k=9,
        top_p=0.8,
        min_p=0.01,
        return_logprob=True,
        return_rounds=True,
        backend=b,
    ),
    "filtered_sample_top_k_first": lambda a, b: sampling.filtered_sample(
        jax.random.key(KEY), a["probs"], top_k=9, top_p=0.8, order="top_k_first", backend=b
    ),
    "filtered_sample_fallback": lambda a, b: sampling.filtered_sample(
        jax.random.key(KEY), a["probs"], top_k=3, top_p=0.5, max_rounds=0, backend=b
    ),
    "top_k_sample": lambda a, b: sampling.top_k_sample(
        jax.random.key(KEY), a["probs"], 5, backend=b
    ),
    "top_p_sample": lambda a, b: sampling.top_p_sample(
        jax.random.key(KEY), a["probs"], 0.7, backend=b
    ),
    "min_p_sample": lambda a, b: sampling.min_p_sample(
        jax.random.key(KEY), a["probs"], 0.1, backend=b
    ),
    "top_k_top_p_sample": lambda a, b: sampling.top_k_top_p_sample(
        jax.random.key(KEY), a["probs"], 6, 0.7, backend=b
    ),
    "top_k_renorm_probs": lambda a, b: sampling.top_k_renorm_probs(a["probs"], 5, backend=b),
    "top_p_renorm_probs": lambda a, b: sampling.top_p_renorm_probs(a["probs"], 0.7, backend=b),
    "top_k_mask_logits": lambda a, b: sampling.top_k_mask_logits(a["logits"], 5, backend=b),
    "chain_speculative_sampling": lambda a, b: speculative.chain_speculative_sampling(
        jax.random.key(KEY), a["draft"], a["draft_ids"], a["target"], backend=b
    ),
    "chain_speculative_sampling_deterministic": lambda a, b: speculative.chain_speculative_sampling(
        jax.random.key(KEY), None, a["draft_ids"], a["target"], backend=b
    ),
    "chain_greedy_verify": lambda a, b: speculative.chain_greedy_verify(
        a["draft_ids"], np.log(a["target"])
    ),
    "sampling_distribution": lambda a, b: speculative.sampling_distribution(
        a["logits"], temperature=0.7, top_k=9, top_p=0.8, min_p=0.01
    ),
    "sample_draft": lambda a, b: speculative.sample_draft(
        jax.random.key(KEY), a["logits"], temperature=0.7, top_p=0.8, backend=b
    ),
    "rmsnorm": lambda a, b: layers.rmsnorm(a["x"], a["weight"], backend=b),
    "fused_add_rmsnorm": lambda a, b: layers.fused_add_rmsnorm(
        a["x"], a["residual"], a["weight"], backend=b
    ),
}
# The norms keep the rows' leading shape; their batch of 0 is the norm tests' business.
SAMPLING_CALLS = sorted(name for name in CALLS if "rmsnorm" not in name)


def _as_arrays(inputs: dict) -> dict:
    return {name: jnp.asarray(value) for name, value in inputs.items()}


def _described(result) -> list[tuple[str, tuple, np.ndarray]]:
    """Each output's dtype, shape and values, for exact comparison."""
    return [(str(x.dtype), x.shape, np.asarray(x)) for x in jax.tree.leaves(result)]


def _assert_same(ours, theirs, label: str) -> None:
    assert len(ours) == len(theirs), label
    for (dtype, shape, values), (dtype2, shape2, values2) in zip(ours, theirs, strict=True):
        assert (dtype, shape) == (dtype2, shape2), label
        np.testing.assert_array_equal(values, values2, err_msg=label)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CALLS))
def test_x64_mode_changes_nothing_for_float32_inputs(name, backend):
    """Under x64, float32 inputs give the same results as without it, bit for bit and dtype for
    dtype (int32 tokens, float32 values): the kernels keep their integers int32 where x64 would
    widen Python ints and integer sums to int64."""
    call = CALLS[name]
    expected = _described(call(_as_arrays(_inputs(BATCH)), backend))
    with enable_x64():
        got = _described(call(_as_arrays(_inputs(BATCH)), backend))
    _assert_same(got, expected, f"{name} on {backend}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", SAMPLING_CALLS)
def test_an_empty_batch_gives_an_empty_result(name, backend):
    """Batch 0: every output has 0 rows, and the dtype and trailing shape of a batch of 3."""
    call = CALLS[name]
    full = jax.tree.leaves(call(_as_arrays(_inputs(BATCH)), backend))
    empty = jax.tree.leaves(call(_as_arrays(_inputs(0)), backend))
    assert [(x.dtype, (0, *x.shape[1:])) for x in full] == [(x.dtype, x.shape) for x in empty]
