"""The Llama-style model: the paged forward equals the dense one, backends agree, the committed
weights load and are trained, and bad input is rejected by name.

Parity oracle: ``forward_dense`` run in float64 (x64 on, float64 parameters: every op of the
reference path computes in its inputs' precision) over each request's whole sequence. The paged
path runs in float32 through prefill chunks and single-token decode steps over scattered pages;
its logits must match within ``FLOAT32_TOLERANCE`` relative L2 error (testing.md's bound for
float32 inputs; measured: about 2e-7).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged
from serving import config as config_lib
from serving import model, model_files

FLOAT32_TOLERANCE = 1e-5
WEIGHTS = pathlib.Path(model.__file__).parent / "weights"

# Small enough for interpret mode; head_dim and page size are powers of two and head_dim is 16,
# the smallest the Pallas attention kernels take; Llama 3.1 scaling with a short original context puts RoPE's frequencies in
# all three bands (kept, divided, blended).
CONFIG = config_lib.ModelConfig(
    vocab_size=64,
    hidden=32,
    num_layers=2,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate=48,
    rope=paged.RopeParams(
        theta=10000.0, scaling=paged.Llama3Scaling(original_max_position_embeddings=16)
    ),
)
PAGE_SIZE = 4
NUM_POOL_PAGES = 32
# The backend comparison runs interpreted kernels: one layer is enough to cover every op.
PALLAS_CONFIG = dataclasses.replace(CONFIG, num_layers=1)
NUM_INDICES = 16  # every table of a test is padded to this: one compiled program per shape


def relative_error(actual, expected) -> float:
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert np.all(np.isfinite(actual)), "non-finite output"
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def dense_logits_float64(params, config, sequence) -> np.ndarray:
    """float64 ``[T, V]`` logits of one request's whole sequence (the oracle)."""
    with jax.enable_x64(True):  # thread-local, restored after the block
        params64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), params)
        tokens = jnp.asarray([sequence], jnp.int32)
        forward = jax.jit(model.forward_dense, static_argnames=("config", "backend"))
        return np.asarray(forward(params64, config, tokens, backend="reference"))[0]


def table_for(page_lists, seq_lens):
    return paged.PageTable.from_page_lists(page_lists, seq_lens, PAGE_SIZE, num_indices=NUM_INDICES)


_forward_paged_jit = jax.jit(
    model.forward_paged, static_argnames=("config", "backend"), donate_argnames=("caches",)
)


def prefill_in_chunks(params, config, tokens, caches, table, chunk_size, backend):
    """Prompts ``tokens[B, T]`` through the jitted ``forward_paged`` in chunks of
    ``chunk_size`` (``paged.prefill_chunks``), as the engine's prefill runs them
    (``serving.programs.prefill_step``), keeping every position's logits.

    Returns:
      ``(logits [B, T, V], caches)``.
    """
    kept = []
    for chunk in paged.prefill_chunks(table, tokens.shape[1], chunk_size):
        logits, caches = _forward_paged_jit(
            params,
            config,
            tokens[:, chunk.start : chunk.stop],
            caches,
            chunk.page_table,
            backend=backend,
        )
        kept.append(logits)
    return jnp.concatenate(kept, axis=1), caches


def generate_with_cache(params, config, prompts, continuations, *, chunk_size, backend):
    """Prefills every prompt (one request at a time, pool shared), then decodes the
    continuations (teacher-forced) as one batch of jitted single-token steps.

    Returns:
      ``(per-request float32 logits [len(prompt) + len(continuation), V], decode_compiles)``:
      the logits of every position, and how many programs the decode steps compiled.
    """
    rng = np.random.default_rng(7)
    free_pages = rng.permutation(NUM_POOL_PAGES).tolist()  # pages scattered over the pool
    final_lengths = [len(p) + len(c) for p, c in zip(prompts, continuations, strict=True)]
    page_lists = []
    for length in final_lengths:
        count = -(-length // PAGE_SIZE)
        page_lists.append(free_pages[:count])
        free_pages = free_pages[count:]

    def pages_for(b, length):
        return page_lists[b][: -(-length // PAGE_SIZE)]

    caches = model.new_caches(config, NUM_POOL_PAGES, PAGE_SIZE, layout="NHD")
    logits = []
    for b, prompt in enumerate(prompts):
        table = table_for([pages_for(b, len(prompt))], [len(prompt)])
        prompt_logits, caches = prefill_in_chunks(
            params, config, jnp.asarray([prompt], jnp.int32), caches, table, chunk_size, backend
        )
        logits.append([np.asarray(prompt_logits[0])])

    decode_step = _forward_paged_jit
    # The prefill chunks share this jit's cache: count the growth.
    compiled_before = decode_step._cache_size()
    lengths = [len(p) for p in prompts]
    for step in range(len(continuations[0])):
        lengths = [n + 1 for n in lengths]
        table = table_for([pages_for(b, n) for b, n in enumerate(lengths)], lengths)
        tokens = jnp.asarray([[c[step]] for c in continuations], jnp.int32)
        step_logits, caches = decode_step(params, config, tokens, caches, table, backend=backend)
        for b in range(len(prompts)):
            logits[b].append(np.asarray(step_logits[b]))
    decode_compiles = decode_step._cache_size() - compiled_before
    return [np.concatenate(parts) for parts in logits], decode_compiles


def ragged_requests(config, prompt_lengths, num_decode_steps, seed):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in prompt_lengths]
    continuations = [
        rng.integers(0, config.vocab_size, num_decode_steps).tolist() for _ in prompt_lengths
    ]
    return prompts, continuations


@pytest.mark.parametrize("chunk_size", [3, 16])
def test_paged_forward_equals_dense_float64(chunk_size):
    """Prefill in chunks (lengths 1, a page, a page + 1, several pages), then decode steps that
    cross page boundaries: every position's logits equal the dense float64 forward's."""
    params = model.init_params(CONFIG, jax.random.key(0))
    prompts, continuations = ragged_requests(CONFIG, [1, 4, 5, 11], num_decode_steps=5, seed=1)
    logits, decode_compiles = generate_with_cache(
        params, CONFIG, prompts, continuations, chunk_size=chunk_size, backend="reference"
    )
    for prompt, continuation, paged_logits in zip(prompts, continuations, logits, strict=True):
        expected = dense_logits_float64(params, CONFIG, prompt + continuation)
        assert paged_logits.shape == expected.shape
        assert relative_error(paged_logits, expected) < FLOAT32_TOLERANCE
    # Five steps over growing lengths inside one table bucket compile at most one program (none
    # when an earlier case already compiled this shape).
    assert decode_compiles <= 1


def test_reference_and_pallas_backends_agree():
    """Every op through its Pallas kernel (interpreted on a CPU) against every op's reference,
    through prefill chunks (4-token queries) and decode steps that cross a page boundary."""
    params = model.init_params(PALLAS_CONFIG, jax.random.key(1))
    prompts, continuations = ragged_requests(PALLAS_CONFIG, [4, 8], num_decode_steps=2, seed=2)
    outputs = {
        backend: generate_with_cache(
            params, PALLAS_CONFIG, prompts, continuations, chunk_size=4, backend=backend
        )[0]
        for backend in ("reference", "pallas")
    }
    for reference, kernel in zip(outputs["reference"], outputs["pallas"], strict=True):
        assert relative_error(kernel, reference) < FLOAT32_TOLERANCE


def test_forward_dense_is_causal():
    """Changing a later token leaves earlier positions' logits unchanged."""
    params = model.init_params(CONFIG, jax.random.key(2))
    tokens = jnp.asarray([[1, 2, 3, 4, 5]], jnp.int32)
    changed = tokens.at[0, 3].set(60)
    forward = jax.jit(model.forward_dense, static_argnames="config")
    before, after = forward(params, CONFIG, tokens), forward(params, CONFIG, changed)
    np.testing.assert_array_equal(before[:, :3], after[:, :3])
    assert not np.allclose(before[:, 3:], after[:, 3:])


# ----------------------------------------------------------------------------------------------
# Committed weights

# Held-out text written for this test (not a standard-library file), in the library's style.
SNIPPET = b'''def count_words(path, encoding="utf-8"):
    """Return a dictionary mapping each word in the file to its count."""
    counts = {}
    with open(path, encoding=encoding) as file:
        for line in file:
            for word in line.split():
                word = word.strip(".,;:!?").lower()
                if word:
                    counts[word] = counts.get(word, 0) + 1
    return counts


class Stack:
    def __init__(self):
        self._items = []

    def push(self, item):
        self._items.append(item)

    def pop(self):
        if not self._items:
            raise IndexError("pop from an empty stack")
        return self._items.pop()
'''
# Random weights score about 8.9 bits per byte here (log2(256) = 8 plus miscalibration), and
# byte frequencies alone about 4.5 on Python source. The committed weights score 2.20 (target)
# and 3.25 (draft, whose 2-layer context is short); the bounds keep room for a retraining.
SNIPPET_BITS_PER_BYTE_BOUND = {"target": 3.0, "draft": 4.0}


@pytest.mark.parametrize(
    "name, expected_config", [("target", config_lib.TINY_TARGET), ("draft", config_lib.TINY_DRAFT)]
)
def test_committed_weights_load_and_are_trained(name, expected_config):
    config, params = model_files.load_model(WEIGHTS / name)
    assert config == expected_config
    tokens = jnp.asarray([list(SNIPPET)], jnp.int32)
    logits = model.forward_dense(params, config, tokens[:, :-1])
    assert np.all(np.isfinite(np.asarray(logits)))
    log_probs = jax.nn.log_softmax(logits)
    nats = -jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1).mean()
    bits_per_byte = float(nats) / math.log(2)
    assert bits_per_byte < SNIPPET_BITS_PER_BYTE_BOUND[name], bits_per_byte


def test_save_and_load_round_trip(tmp_path):
    params = model.init_params(CONFIG, jax.random.key(3))
    model_files.save_model(tmp_path / "m", CONFIG, params, storage="float32", metadata={"note": 1})
    config, loaded = model_files.load_model(tmp_path / "m.npz")
    assert config == CONFIG
    for original, restored in zip(jax.tree.leaves(params), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(original), np.asarray(restored))


# ----------------------------------------------------------------------------------------------
# Bad input


@pytest.fixture(scope="module")
def small_setup():
    params = model.init_params(CONFIG, jax.random.key(4))
    table = table_for([[0, 1]], [6])
    return params, table


def paged_call(params, tokens, table, caches=None, config=CONFIG):
    if caches is None:
        caches = model.new_caches(config, NUM_POOL_PAGES, PAGE_SIZE)
    return model.forward_paged(params, config, tokens, caches, table, backend="reference")


@pytest.mark.parametrize("bad_id", [-1, 64, 1000])
def test_token_outside_vocabulary(small_setup, bad_id):
    params, table = small_setup
    tokens = jnp.asarray([[1, bad_id]], jnp.int32)
    with pytest.raises(ValueError, match=rf"tokens\[0, 1\]={bad_id} is outside the vocabulary"):
        paged_call(params, tokens, table)
    with pytest.raises(ValueError, match=r"tokens\[0, 1\]"):
        model.forward_dense(params, CONFIG, tokens)


def test_out_of_vocabulary_under_jit_gives_nan_logits_not_a_clamped_row(small_setup):
    """Under jit ids cannot be checked: the bad request's logits are NaN, its neighbour's not."""
    params, _ = small_setup
    logits = jax.jit(model.forward_dense, static_argnames="config")(
        params, CONFIG, jnp.asarray([[1, 99], [1, 2]], jnp.int32)
    )
    assert np.all(np.isnan(logits[0, 1])) and np.all(np.isfinite(logits[1]))


def test_bad_shapes_name_the_argument(small_setup):
    params, table = small_setup
    with pytest.raises(ValueError, match=r"tokens must have shape \[batch, length\]"):
        paged_call(params, jnp.asarray([1, 2], jnp.int32), table)
    with pytest.raises(ValueError, match="tokens must be integer"):
        paged_call(params, jnp.asarray([[1.0, 2.0]]), table)
    with pytest.raises(ValueError, match="tokens has 2 requests but page_table describes 1"):
        paged_call(params, jnp.asarray([[1], [2]], jnp.int32), table)
    with pytest.raises(ValueError, match="request 0 has 6 tokens, fewer than the L=7"):
        paged_call(params, jnp.ones((1, 7), jnp.int32), table)
    with pytest.raises(ValueError, match=r"caches must be a list of config\.num_layers=2"):
        paged_call(params, jnp.ones((1, 2), jnp.int32), table, caches=[])
    other = config_lib.ModelConfig(**{**CONFIG.to_dict(), "num_kv_heads": 4, "rope": CONFIG.rope})
    with pytest.raises(ValueError, match=r"caches\[0\] has \(num_kv_heads, head_dim, dtype\)"):
        paged_call(
            params, jnp.ones((1, 2), jnp.int32), table, model.new_caches(other, 32, PAGE_SIZE)
        )
    broken = {**params, "lm_head": params["lm_head"][:, :10]}
    with pytest.raises(ValueError, match=r"params 'lm_head' has shape \(32, 10\)"):
        paged_call(broken, jnp.ones((1, 2), jnp.int32), table)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_kv_heads", 3, "num_q_heads=4 must be a multiple of num_kv_heads=3"),
        ("head_dim", 7, "head_dim must be even"),
        ("hidden", 0, "hidden must be an int >= 1"),
        ("dtype", "int8", "dtype must be one of"),
        ("norm_eps", -1.0, "norm_eps must be > 0"),
    ],
)
def test_bad_config_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        config_lib.ModelConfig(**{**CONFIG.to_dict(), "rope": CONFIG.rope, field: value})


def test_config_json_round_trip_keeps_llama3_scaling():
    config = config_lib.llama3_8b_like(2)
    assert config_lib.ModelConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown ModelConfig fields"):
        config_lib.ModelConfig.from_dict({**config.to_dict(), "heads": 3})
