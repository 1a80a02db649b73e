"""What users get wrong, for every public function of ``sampling``, ``speculative`` and the norms
of ``serving.layers``, on both backends (kernels interpreted on a CPU):

- x64 mode (``jax.enable_x64(True)``, how researchers run float64 references): float32 inputs
  give the very results, dtypes included, that they give without it;
- a batch of 0 gives an empty result of the documented shape and dtype;
- ``top_k`` that is not an integer, and inputs that are not arrays;
- rows whose every logit is masked, under ``jit`` (where nothing can be checked).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sampling
import speculative
from serving import layers
from tests.conftest import ON_GPU, enable_x64
from tests.test_sampling_kernels import FAST_COMPILE

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
# Functions with one implementation (no backend=) run once.
SINGLE_BACKEND = {"chain_greedy_verify", "sampling_distribution"}


def _with_backends(names):
    return [
        (name, backend)
        for name in names
        for backend in BACKENDS
        if name not in SINGLE_BACKEND or backend == "reference"
    ]


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


@pytest.mark.parametrize(("name", "backend"), _with_backends(sorted(CALLS)))
def test_x64_mode_changes_nothing_for_float32_inputs(name, backend):
    """Under x64, float32 inputs give the same results as without it, bit for bit and dtype for
    dtype (int32 tokens, float32 values): the kernels keep their integers int32 where x64 would
    widen Python ints and integer sums to int64."""
    call = CALLS[name]
    expected = _described(call(_as_arrays(_inputs(BATCH)), backend))
    with enable_x64():
        got = _described(call(_as_arrays(_inputs(BATCH)), backend))
    _assert_same(got, expected, f"{name} on {backend}")


@pytest.mark.parametrize(("name", "backend"), _with_backends(SAMPLING_CALLS))
def test_an_empty_batch_gives_an_empty_result(name, backend):
    """Batch 0: every output has 0 rows, and the dtype and trailing shape of a batch of 3."""
    call = CALLS[name]
    full = jax.tree.leaves(call(_as_arrays(_inputs(BATCH)), backend))
    empty = jax.tree.leaves(call(_as_arrays(_inputs(0)), backend))
    assert [(x.dtype, (0, *x.shape[1:])) for x in full] == [(x.dtype, x.shape) for x in empty]


# Every function that takes top_k, called with a given top_k on valid inputs.
TOP_K_CALLS = {
    "filtered_sample": lambda a, k: sampling.filtered_sample(
        jax.random.key(0), a["probs"], top_k=k
    ),
    "top_k_sample": lambda a, k: sampling.top_k_sample(jax.random.key(0), a["probs"], k),
    "top_k_top_p_sample": lambda a, k: sampling.top_k_top_p_sample(
        jax.random.key(0), a["probs"], k, 0.9
    ),
    "top_k_renorm_probs": lambda a, k: sampling.top_k_renorm_probs(a["probs"], k),
    "top_k_mask_logits": lambda a, k: sampling.top_k_mask_logits(a["logits"], k),
    "sampling_distribution": lambda a, k: speculative.sampling_distribution(a["logits"], top_k=k),
    "sample_draft": lambda a, k: speculative.sample_draft(jax.random.key(0), a["logits"], top_k=k),
}


@pytest.mark.parametrize("top_k", [2.7, 2.0, True, np.float32(3.0), [2.0, 3.0, 1.0]])
@pytest.mark.parametrize("name", sorted(TOP_K_CALLS))
def test_a_non_integer_top_k_raises_everywhere(name, top_k):
    """One rule for top_k: an integer dtype or nothing (``top_k_mask_logits(logits, 2.7)`` kept
    2 a row where ``top_k_sample`` raised)."""
    with pytest.raises(
        ValueError, match=r"top_k must be an integer .*got " + re.escape(repr(top_k))
    ):
        TOP_K_CALLS[name](_as_arrays(_inputs(BATCH)), top_k)


@pytest.mark.parametrize("name", sorted(TOP_K_CALLS))
def test_integer_top_k_of_any_integer_type_is_accepted(name):
    arrays = _as_arrays(_inputs(BATCH))
    expected = _described(TOP_K_CALLS[name](arrays, 3))
    for top_k in (np.int64(3), jnp.int32(3), np.array([3, 3, 3], np.int16), [3, 3, 3]):
        _assert_same(_described(TOP_K_CALLS[name](arrays, top_k)), expected, f"{name} {top_k!r}")


@pytest.mark.parametrize("name", SAMPLING_CALLS)
def test_array_likes_are_accepted_as_arrays(name):
    """Python lists and NumPy arrays give what JAX arrays give (they raised AttributeError)."""
    inputs = _inputs(BATCH)
    expected = _described(CALLS[name](_as_arrays(inputs), "reference"))
    as_lists = {key: value.tolist() for key, value in inputs.items()}
    _assert_same(_described(CALLS[name](as_lists, "reference")), expected, f"{name}, lists")
    _assert_same(_described(CALLS[name](inputs, "reference")), expected, f"{name}, NumPy")


NOT_ARRAYS = [
    (sampling.sample_from_logits, "logits", "text"),
    (sampling.sample_from_probs, "probs", {"a": 1}),
    (sampling.top_k_sample, "probs", [[0.5, 0.5], [1.0]]),  # ragged
]


@pytest.mark.parametrize("function,argument,value", NOT_ARRAYS)
def test_what_is_not_an_array_like_raises_a_type_error_naming_it(function, argument, value):
    extra = {"top_k": 1} if function is sampling.top_k_sample else {}
    with pytest.raises(TypeError, match=f"{argument} must be an array or array-like"):
        function(jax.random.key(0), **{argument: value}, **extra)
    with pytest.raises(TypeError, match="draft_token_ids must be an array or array-like"):
        speculative.chain_speculative_sampling(jax.random.key(0), None, "ids", jnp.ones((1, 2, 3)))


INF = np.inf
# Rows only jit lets through: every token masked, a NaN (read as masked), a +inf, a valid row.
DEGENERATE_LOGITS = np.array(
    [
        [-INF, -INF, -INF, -INF, -INF],
        [np.nan, 1.0, 0.5, -INF, 0.25],
        [1.0, INF, 0.0, INF, -INF],
        [0.0, 1.0, -INF, 2.0, 0.5],
    ],
    np.float32,
)
# The token each sampler returns for those rows whatever the key (rows 0 and 2: a point mass).
POINT_MASS_TOKEN = {0: 0, 2: 1}
FILTERS = {
    "none": {},
    "greedy": dict(temperature=0.0),
    "hot": dict(temperature=np.inf),
    "top_k": dict(top_k=2),
    "top_p": dict(top_p=0.5),
    "min_p": dict(min_p=0.2),
    "all": dict(top_k=3, top_p=0.6, min_p=0.1, order="top_k_first"),
}


@functools.cache
def _jitted_sample_from_logits(temperature: float, backend: str):
    """``sample_from_logits`` of ``DEGENERATE_LOGITS`` under ``jit`` at one temperature (a
    constant of the program, as a caller's would be). Cached: five of the filter cases share a
    temperature of 1, and the interpreted kernel takes seconds to compile; the pallas program
    compiles unoptimized (``tests/test_sampling_kernels.py``, ``FAST_COMPILE``)."""
    return jax.jit(
        lambda x: sampling.sample_from_logits(
            jax.random.key(3), x, temperature=temperature, return_logprob=True, backend=backend
        ),
        compiler_options=FAST_COMPILE if backend == "pallas" and not ON_GPU else None,
    )


@pytest.mark.parametrize("filters", sorted(FILTERS))
def test_under_jit_a_row_without_finite_logits_is_a_point_mass_never_nan(filters):
    """A fully masked row is one-hot at token 0 (the token the samplers return), a row with
    ``+inf`` one-hot at its first ``+inf``, and NaN is a masked token: never a NaN probability
    (a softmax of such a row is 0 / 0). The samplers agree: they return that token, with
    log-probability 0."""
    kwargs = FILTERS[filters]
    logits = jnp.asarray(DEGENERATE_LOGITS)
    probs = np.asarray(jax.jit(lambda x: speculative.sampling_distribution(x, **kwargs))(logits))
    assert not np.isnan(probs).any(), probs
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-6)
    for row, token in POINT_MASS_TOKEN.items():
        assert probs[row].tolist() == np.eye(5)[token].tolist(), (row, probs[row])
    assert probs[1, 0] == 0 and probs[1, 3] == 0  # NaN and -inf: masked
    draft_kwargs = {k: v for k, v in kwargs.items()}
    tokens, q = jax.jit(lambda x: speculative.sample_draft(jax.random.key(3), x, **draft_kwargs))(
        logits
    )
    np.testing.assert_array_equal(np.asarray(q), probs)
    assert q[np.arange(4), tokens].min() > 0, (tokens, q)
    temperature = kwargs.get("temperature", 1.0)
    for backend in BACKENDS:
        tokens, logprob = _jitted_sample_from_logits(temperature, backend)(logits)
        for row, token in POINT_MASS_TOKEN.items():
            assert (int(tokens[row]), float(logprob[row])) == (token, 0.0), (backend, row)
        assert not np.isnan(np.asarray(logprob)).any(), (backend, logprob)
        assert int(tokens[1]) not in (0, 3), backend  # NaN and -inf never drawn


# Functions of probabilities, each row given as the bad row's valid reading.
PROBABILITY_CALLS = {
    "sample_from_probs": lambda p, b: sampling.sample_from_probs(
        jax.random.key(1), p, return_logprob=True, backend=b
    ),
    "filtered_sample": lambda p, b: sampling.filtered_sample(
        jax.random.key(1), p, top_k=3, top_p=0.7, return_logprob=True, backend=b
    ),
    "min_p_sample": lambda p, b: sampling.min_p_sample(
        jax.random.key(1), p, 0.3, return_logprob=True, backend=b
    ),
    "top_k_renorm_probs": lambda p, b: sampling.top_k_renorm_probs(p, 2, backend=b),
    "top_p_renorm_probs": lambda p, b: sampling.top_p_renorm_probs(p, 0.6, backend=b),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(PROBABILITY_CALLS))
def test_under_jit_nan_and_negative_probabilities_weigh_zero(name, backend):
    """What jit lets through: NaN and negative entries read as 0 on every backend (the
    reference counted a negative entry into the row's total, so top-p kept another set than
    the kernel), so the result is the one of the row with those entries zeroed."""
    bad = jnp.array([[np.nan, 0.2, 0.5, 0.3, 0.1], [0.4, -0.5, 0.3, 0.3, 0.0]], jnp.float32)
    zeroed = jnp.where(jnp.isnan(bad) | (bad < 0), 0.0, bad)
    # The interpreted Gumbel kernel compiles unoptimized (``FAST_COMPILE``): the same bits.
    fast = backend == "pallas" and not ON_GPU
    call = jax.jit(
        lambda p: PROBABILITY_CALLS[name](p, backend),
        compiler_options=FAST_COMPILE if fast else None,
    )
    _assert_same(_described(call(bad)), _described(call(zeroed)), f"{name} on {backend}")


def test_under_jit_greedy_verification_masks_nan_and_stops_at_a_bad_draft_id():
    """NaN logits are masked, as in the greedy sampler (``jnp.argmax`` alone would pick them);
    an all-masked position has arg max 0; a draft id outside the vocabulary never matches."""
    logits = jnp.array(
        [
            [[np.nan, 1.0, 0.0], [0.0, 1.0, 2.0], [-INF, -INF, -INF]],
            [[0.0, 1.0, 3.0], [-INF, -INF, -INF], [0.0, 0.0, 0.0]],
            [[0.0, 5.0, 1.0], [0.0, 1.0, 2.0], [1.0, 0.0, 0.0]],
        ]
    )
    draft_ids = jnp.array([[1, 2], [2, 0], [7, 2]], jnp.int32)
    out, accepted = jax.jit(speculative.chain_greedy_verify)(draft_ids, logits)
    assert out.tolist() == [[1, 2, 0], [2, 0, 0], [1, -1, -1]]
    assert accepted.tolist() == [2, 2, 0]
    greedy = jax.jit(
        lambda x: sampling.sample_from_logits(jax.random.key(0), x[:, 0], temperature=0.0)
    )(logits)
    assert greedy.tolist() == out[:, 0].tolist()
