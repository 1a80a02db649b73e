"""The paged latent cache of MLA: layout, append into scattered pages, and bad input.

The oracle walks each request's page list on the host (``reference_dense.gather_tokens``, a
latent page read as a one-head NHD page), sharing no code with ``append_latent``'s scatter.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from reference_dense import gather_tokens
from strategies import PagedBucket, fixed_total_seq_lens, scattered_page_tables

import paged
from paged.mla_cache import (
    LatentCache,
    append_latent,
    new_latent_cache,
    validate_latent_cache,
)

KV_LORA_RANK = 16
QK_ROPE_HEAD_DIM = 8
NUM_NEW_TOKENS = 24  # a static nnz: hypothesis spreads it over the requests
BUCKET = PagedBucket(batch_size=3, page_size=4, max_seq_len=NUM_NEW_TOKENS)


def _random_tokens(rng, nnz: int):
    latent = jnp.asarray(rng.standard_normal((nnz, KV_LORA_RANK)), jnp.float32)
    rope_key = jnp.asarray(rng.standard_normal((nnz, QK_ROPE_HEAD_DIM)), jnp.float32)
    return latent, rope_key


def _prefilled_cache(rng) -> LatentCache:
    """A pool full of random values, so a token written to the wrong slot shows."""
    shape = (BUCKET.num_pool_pages, BUCKET.page_size)
    return LatentCache(
        jnp.asarray(rng.standard_normal((*shape, KV_LORA_RANK)), jnp.float32),
        jnp.asarray(rng.standard_normal((*shape, QK_ROPE_HEAD_DIM)), jnp.float32),
    )


def _every_token(seq_lens):
    """``(batch_indices, positions)`` of every token of every request, request by request."""
    batch = np.concatenate([np.full(n, b, np.int32) for b, n in enumerate(seq_lens)])
    positions = np.concatenate([np.arange(n, dtype=np.int32) for n in seq_lens])
    return jnp.asarray(batch), jnp.asarray(positions)


def test_new_latent_cache_defaults_are_deepseek_sizes():
    cache = new_latent_cache(num_pages=3, page_size=16)
    assert cache.latent_pages.shape == (3, 16, 512)
    assert cache.rope_key_pages.shape == (3, 16, 64)
    assert cache.dtype == jnp.bfloat16
    assert (cache.kv_lora_rank, cache.qk_rope_head_dim, cache.page_size) == (512, 64, 16)
    # 576 bfloat16 values a token; a 16-head GQA cache of K and V at head_dim 128 holds 8192.
    assert cache.bytes_per_token == 1152


@given(
    batch=scattered_page_tables(
        BUCKET, seq_lens=fixed_total_seq_lens(BUCKET.batch_size, NUM_NEW_TOKENS)
    )
)
def test_append_writes_every_token_at_its_page_and_slot(batch):
    rng = np.random.default_rng(sum(batch.seq_lens) + len(batch.page_lists[0]))
    cache = _prefilled_cache(rng)
    latent, rope_key = _random_tokens(rng, NUM_NEW_TOKENS)
    batch_indices, positions = _every_token(batch.seq_lens)
    out = append_latent(cache, batch.page_table, latent, rope_key, batch_indices, positions)

    start = 0
    for page_list, seq_len in zip(batch.page_lists, batch.seq_lens, strict=True):
        as_one_head = np.asarray(out.latent_pages)[:, :, None, :]
        written = gather_tokens(as_one_head, "NHD", page_list, seq_len)[:, 0]
        np.testing.assert_array_equal(written, np.asarray(latent)[start : start + seq_len])
        as_one_head = np.asarray(out.rope_key_pages)[:, :, None, :]
        written = gather_tokens(as_one_head, "NHD", page_list, seq_len)[:, 0]
        np.testing.assert_array_equal(written, np.asarray(rope_key)[start : start + seq_len])
        start += seq_len
    # Pages no request lists are untouched.
    used = {p for pages in batch.page_lists for p in pages}
    unused = [p for p in range(BUCKET.num_pool_pages) if p not in used]
    for before, after in [
        (cache.latent_pages, out.latent_pages),
        (cache.rope_key_pages, out.rope_key_pages),
    ]:
        np.testing.assert_array_equal(np.asarray(after)[unused], np.asarray(before)[unused])


def test_append_rotates_the_rope_key_by_position_when_given_rope_params():
    rng = np.random.default_rng(0)
    table = paged.PageTable.from_page_lists([[2, 0]], seq_lens=[7], page_size=4)
    cache = new_latent_cache(3, 4, KV_LORA_RANK, QK_ROPE_HEAD_DIM, jnp.float32)
    latent, rope_key = _random_tokens(rng, 3)
    positions = jnp.array([6, 0, 3], jnp.int32)  # out of order on purpose
    rope = paged.RopeParams(theta=100.0, interleaved=True)
    batch_indices = jnp.zeros(3, jnp.int32)
    raw = append_latent(cache, table, latent, rope_key, batch_indices, positions)
    rotated = append_latent(cache, table, latent, rope_key, batch_indices, positions, rope=rope)

    expected = paged.apply_rope(rope_key[:, None, :], positions, rope)[:, 0]
    pages, slots = np.array([0, 2, 2]), np.array([2, 0, 3])  # positions 6, 0, 3 of [2, 0]
    np.testing.assert_array_equal(rotated.rope_key_pages[pages, slots], expected)
    np.testing.assert_array_equal(raw.rope_key_pages[pages, slots], rope_key)
    assert not np.allclose(expected[0], rope_key[0])  # position 6 does rotate
    np.testing.assert_array_equal(rotated.latent_pages, raw.latent_pages)  # latent as given


def _append_args():
    table = paged.PageTable.from_page_lists([[1], [0, 2]], seq_lens=[3, 5], page_size=4)
    cache = new_latent_cache(3, 4, KV_LORA_RANK, QK_ROPE_HEAD_DIM, jnp.float32)
    latent, rope_key = _random_tokens(np.random.default_rng(1), 2)
    return dict(
        cache=cache,
        page_table=table,
        latent_new=latent,
        rope_key_new=rope_key,
        batch_indices=jnp.array([0, 1], jnp.int32),
        positions=jnp.array([2, 4], jnp.int32),
    )


def _bad(**overrides):
    args = _append_args()
    args.update(overrides)
    return args


BAD_APPENDS = [
    (
        "latent_new_width",
        lambda: _bad(latent_new=jnp.zeros((2, 15))),
        "latent_new must have shape [nnz, 16] (the cache's kv_lora_rank), got (2, 15)",
    ),
    (
        "rope_key_new_width",
        lambda: _bad(rope_key_new=jnp.zeros((2, 64))),
        "rope_key_new must have shape [nnz, 8] (the cache's qk_rope_head_dim), got (2, 64)",
    ),
    (
        "token_counts_differ",
        lambda: _bad(rope_key_new=jnp.zeros((3, 8))),
        "rope_key_new has 3 tokens but latent_new has 2",
    ),
    (
        "position_past_length",
        lambda: _bad(positions=jnp.array([3, 4], jnp.int32)),
        "positions[0]=3 is outside request 0's length 3",
    ),
    (
        "batch_index_outside",
        lambda: _bad(batch_indices=jnp.array([0, 2], jnp.int32)),
        "batch_indices[1]=2 is outside the batch of 2",
    ),
    (
        "same_token_twice",
        lambda: _bad(
            batch_indices=jnp.array([1, 1], jnp.int32), positions=jnp.array([4, 4], jnp.int32)
        ),
        "(batch_indices, positions)=(1, 4) appears more than once",
    ),
    (
        "page_size_differs",
        lambda: _bad(
            page_table=paged.PageTable.from_page_lists([[1], [0]], seq_lens=[3, 5], page_size=8)
        ),
        "page_table.page_size=8 differs from the cache's page_size=4",
    ),
    (
        "page_outside_pool",
        lambda: _bad(
            page_table=paged.PageTable.from_page_lists([[1], [0, 9]], seq_lens=[3, 5], page_size=4)
        ),
        "page_table.page_indices[2]=9 is outside the pool of 3 pages",
    ),
    (
        "cache_pages_disagree",
        lambda: _bad(
            cache=LatentCache(jnp.zeros((3, 4, KV_LORA_RANK)), jnp.zeros((2, 4, QK_ROPE_HEAD_DIM)))
        ),
        "must agree on [num_pages, page_size]",
    ),
    (
        "cache_dtypes_disagree",
        lambda: _bad(
            cache=LatentCache(
                jnp.zeros((3, 4, KV_LORA_RANK), jnp.bfloat16),
                jnp.zeros((3, 4, QK_ROPE_HEAD_DIM), jnp.float32),
            )
        ),
        "cache.latent_pages dtype bfloat16 differs from cache.rope_key_pages dtype float32",
    ),
]


@pytest.mark.parametrize(
    "make_args, message", [case[1:] for case in BAD_APPENDS], ids=[c[0] for c in BAD_APPENDS]
)
def test_append_refuses_bad_input(make_args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        append_latent(**make_args())


def test_append_takes_the_good_arguments_the_bad_cases_start_from():
    """The bad cases above differ from these in one argument each, so each names its cause."""
    out = append_latent(**_append_args())
    assert out.latent_pages.shape == (3, 4, KV_LORA_RANK)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(qk_rope_head_dim=7), "qk_rope_head_dim must be even (RoPE rotates pairs), got 7"),
        (dict(kv_lora_rank=0), "kv_lora_rank must be an int >= 1, got 0"),
        (dict(page_size=2.0), "page_size must be an int >= 1, got 2.0"),
    ],
)
def test_new_latent_cache_refuses_bad_sizes(kwargs, message):
    args = dict(num_pages=2, page_size=4) | kwargs
    with pytest.raises(ValueError, match=re.escape(message)):
        new_latent_cache(**args)


def test_validate_latent_cache_refuses_a_flat_array():
    cache = LatentCache(jnp.zeros((3, 4 * KV_LORA_RANK)), jnp.zeros((3, 4, QK_ROPE_HEAD_DIM)))
    with pytest.raises(ValueError, match=re.escape("got (3, 64)")):
        validate_latent_cache(cache)
