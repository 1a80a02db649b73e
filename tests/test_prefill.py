"""Chunked prefill: the chunk size changes how the work is cut, never the result.

Chunks of 1 token (every query a decode step), 3 tokens (chunks that straddle pages of 4) and the
whole prompt at once must give the same attention outputs, logits and cache contents. Each query
computes the same masked softmax over the same keys whichever chunk it is in, so equality is
exact in practice; the tests allow ``CHUNKING_TOLERANCE`` relative error in case a backend
batches a sum differently for a different number of queries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged
from serving import model
from tests.test_model import CONFIG as TINY_CONFIG
from tests.test_model import prefill_in_chunks

CHUNKING_TOLERANCE = 1e-6
PAGE_SIZE = 4
NUM_POOL_PAGES = 24
NUM_INDICES = 16
CHUNK_SIZES = (1, 3, None)  # None: the whole prompt in one chunk


def relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.all(np.isfinite(actual))
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def shared_prefix_table(prefix_len: int, prompt_len: int, batch: int):
    """``batch`` requests that share ``prefix_len`` tokens in full pages (read-only), each
    followed by its own ``prompt_len`` new tokens in pages scattered over the pool."""
    assert prefix_len % PAGE_SIZE == 0
    rng = np.random.default_rng(0)
    free = rng.permutation(NUM_POOL_PAGES).tolist()
    shared, free = free[: prefix_len // PAGE_SIZE], free[prefix_len // PAGE_SIZE :]
    own = -(-prompt_len // PAGE_SIZE)
    page_lists = [shared + free[b * own : (b + 1) * own] for b in range(batch)]
    return paged.PageTable.from_page_lists(
        page_lists, [prefix_len + prompt_len] * batch, PAGE_SIZE, num_indices=NUM_INDICES
    )


def test_prefill_attention_independent_of_chunk_size():
    """One attention layer, RoPE on, two requests behind a shared 4-token prefix."""
    batch, prompt_len, num_q_heads, num_kv_heads, head_dim = 2, 7, 4, 2, 8
    table = shared_prefix_table(prefix_len=4, prompt_len=prompt_len, batch=batch)
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (batch, prompt_len, num_q_heads, head_dim))
    k = jax.random.normal(keys[1], (batch, prompt_len, num_kv_heads, head_dim))
    v = jax.random.normal(keys[2], (batch, prompt_len, num_kv_heads, head_dim))
    cache = paged.new_kv_cache(NUM_POOL_PAGES, PAGE_SIZE, num_kv_heads, head_dim, jnp.float32)
    prefix_table = paged.truncated_page_table(table, [4, 4])
    prefix_k = jax.random.normal(keys[3], (4, num_kv_heads, head_dim))
    prefix_v = jax.random.normal(keys[4], (4, num_kv_heads, head_dim))
    only_first = paged.PageTable.from_page_lists(
        [prefix_table.page_lists()[0], []], [4, 0], PAGE_SIZE, num_indices=NUM_INDICES
    )
    cache = paged.append_kv(
        cache, only_first, prefix_k, prefix_v, jnp.zeros(4, jnp.int32), jnp.arange(4)
    )
    results = {}
    for chunk_size in CHUNK_SIZES:
        o, filled = paged.prefill_attention(
            q,
            k,
            v,
            cache,
            table,
            chunk_size=chunk_size or prompt_len,
            rope=paged.RopeParams(),
            backend="reference",
        )
        results[chunk_size] = (o, filled)
    whole_o, whole_cache = results[None]
    for chunk_size in (1, 3):
        o, filled = results[chunk_size]
        assert relative_error(o, whole_o) < CHUNKING_TOLERANCE
        np.testing.assert_array_equal(np.asarray(filled.k_pages), np.asarray(whole_cache.k_pages))
        np.testing.assert_array_equal(np.asarray(filled.v_pages), np.asarray(whole_cache.v_pages))
    # The prefix pages were read, not written.
    np.testing.assert_array_equal(
        np.asarray(whole_cache.to_nhd(whole_cache.k_pages)[table.page_lists()[0][0]]),
        np.asarray(prefix_k),
    )


def test_chunked_prefill_independent_of_chunk_size():
    config = TINY_CONFIG  # the model tests' config (RoPE scaling in all three bands)
    params = model.init_params(config, jax.random.key(1))
    prompt_len = 7
    table = shared_prefix_table(prefix_len=0, prompt_len=prompt_len, batch=2)
    tokens = jax.random.randint(jax.random.key(2), (2, prompt_len), 0, config.vocab_size)
    results = {}
    for chunk_size in CHUNK_SIZES:
        caches = model.new_caches(config, NUM_POOL_PAGES, PAGE_SIZE)
        results[chunk_size] = prefill_in_chunks(
            params, config, tokens, caches, table, chunk_size or prompt_len, "reference"
        )
    whole_logits, whole_caches = results[None]
    assert whole_logits.shape == (2, prompt_len, config.vocab_size)
    for chunk_size in (1, 3):
        logits, caches = results[chunk_size]
        assert relative_error(logits, whole_logits) < CHUNKING_TOLERANCE
        for cache, whole in zip(caches, whole_caches, strict=True):
            assert relative_error(cache.k_pages, whole.k_pages) < CHUNKING_TOLERANCE
            assert relative_error(cache.v_pages, whole.v_pages) < CHUNKING_TOLERANCE


def test_prefill_chunks_schedule():
    table = paged.PageTable.from_page_lists([[3, 9, 4], [7, 1]], [10, 8], PAGE_SIZE)
    chunks = paged.prefill_chunks(table, 6, 4)
    assert [(c.start, c.stop) for c in chunks] == [(0, 4), (4, 6)]
    # Chunk 0 ends 2 tokens before each request's end: 8 and 6 tokens.
    first = chunks[0].page_table
    assert first.page_lists() == [[3, 9], [7, 1]]
    assert first.seq_lens().tolist() == [8, 6]
    assert first.page_indices.shape == table.page_indices.shape
    assert chunks[1].page_table is table


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"num_new_tokens": 0, "chunk_size": 2}, "num_new_tokens must be an int >= 1, got 0"),
        ({"num_new_tokens": 4, "chunk_size": 0}, "chunk_size must be an int >= 1, got 0"),
        ({"num_new_tokens": 4, "chunk_size": 2.5}, "chunk_size must be an int >= 1, got 2.5"),
        ({"num_new_tokens": 9, "chunk_size": 2}, "request 1 has 8 tokens, fewer than"),
    ],
)
def test_prefill_chunks_rejects_bad_arguments(arguments, message):
    table = paged.PageTable.from_seq_lens([10, 8], PAGE_SIZE)
    with pytest.raises(ValueError, match=message):
        paged.prefill_chunks(table, **arguments)


def test_truncated_page_table_rejects_a_longer_length():
    table = paged.PageTable.from_seq_lens([10], PAGE_SIZE)
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=11 is outside request 0's \[0, 10\]"):
        paged.truncated_page_table(table, [11])


def test_prefill_attention_rejects_mismatched_shapes():
    table = paged.PageTable.from_seq_lens([4], PAGE_SIZE)
    cache = paged.new_kv_cache(4, PAGE_SIZE, 1, 8, jnp.float32)
    q = jnp.ones((1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"k must have shape .* with q's \(batch, T\)=\(1, 4\)"):
        paged.prefill_attention(q, jnp.ones((1, 3, 1, 8)), q[:, :, :1], cache, table, chunk_size=2)
    with pytest.raises(ValueError, match="q must have shape"):
        paged.prefill_attention(q[0], q, q, cache, table, chunk_size=2)
