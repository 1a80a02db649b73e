"""Token-level selection (``paged/sparse_tokens.py``) and the lightning indexer
(``paged/sparse_indexer.py``), including the known porting mistakes of DeepSeek sparse attention:
a missing ReLU, selecting per head, off-by-one positions, padding tokens selected, and positions
outside a request read.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import PagedBucket, fixed_total_seq_lens, scattered_page_tables

import paged
from paged.sparse_indexer import (
    append_index_keys,
    lightning_indexer_scores,
    lightning_indexer_top_k,
)
from paged.sparse_tokens import (
    TokenSelection,
    token_page_table,
    token_view_cache,
    validate_token_selection,
)

BUCKET = PagedBucket(batch_size=3, page_size=4, max_seq_len=19)
INDEX_HEADS = 3
INDEX_DIM = 4


@st.composite
def token_selections(draw, seq_lens, width: int = 8):
    """Per request a sorted subset of its positions (at most ``width``), padded with junk."""
    positions = np.full((len(seq_lens), width), -7, np.int32)  # junk that must be ignored
    counts = np.zeros(len(seq_lens), np.int32)
    for b, length in enumerate(seq_lens):
        chosen = sorted(draw(st.sets(st.integers(0, max(length - 1, 0)), max_size=width)))
        chosen = [p for p in chosen if p < length]
        positions[b, : len(chosen)] = chosen
        counts[b] = len(chosen)
    return TokenSelection(jnp.asarray(positions), jnp.asarray(counts))


@given(batch=scattered_page_tables(BUCKET), data=st.data())
def test_token_table_lists_the_slot_of_each_chosen_position(batch, data):
    selection = data.draw(token_selections(batch.seq_lens))
    table = token_page_table(batch.page_table, selection)
    paged.validate_page_table(table, BUCKET.num_pool_pages * BUCKET.page_size)
    assert table.page_size == 1
    for b, pages in enumerate(batch.page_lists):
        count = int(selection.counts[b])
        chosen = np.asarray(selection.positions[b, :count]).tolist()
        want = [pages[p // 4] * 4 + p % 4 for p in chosen]
        assert table.page_lists()[b] == want
        assert int(table.last_page_len[b]) == (1 if count else 0)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_token_view_page_is_one_slot_of_one_page(layout):
    cache = paged.new_kv_cache(5, 4, 2, 3, jnp.float32, layout)
    values = jnp.arange(cache.k_pages.size, dtype=jnp.float32).reshape(cache.k_pages.shape)
    cache = paged.KVCache(values, -values, layout)
    view = token_view_cache(cache)
    nhd = np.asarray(cache.to_nhd(cache.k_pages))
    for page, slot in [(0, 0), (2, 3), (4, 1)]:
        np.testing.assert_array_equal(np.asarray(view.k_pages[page * 4 + slot, 0]), nhd[page, slot])
        np.testing.assert_array_equal(
            np.asarray(view.v_pages[page * 4 + slot, 0]), -nhd[page, slot]
        )


def test_positions_outside_the_request_are_dropped_under_jit():
    """Never read: a position past the request (or negative) is left out of the table."""
    table = paged.PageTable.from_page_lists([[2, 0], [1]], [5, 3], page_size=4)
    selection = TokenSelection(jnp.array([[1, 5, -1], [2, 3, 0]]), jnp.array([3, 2]))
    view = jax.jit(token_page_table)(table, selection)
    assert view.page_lists() == [[9], [6]]


@pytest.mark.parametrize(
    ("positions", "counts", "message"),
    [
        ([[0, 5]], [2], "selection.positions[0, 1]=5 is outside request 0's positions [0, 5)"),
        ([[-1, 2]], [2], "selection.positions[0, 0]=-1 is outside request 0's positions [0, 5)"),
        ([[3, 1]], [2], "positions[0, 0]=3 >= positions[0, 1]=1"),
        ([[2, 2]], [2], "positions[0, 0]=2 >= positions[0, 1]=2"),
        ([[0, 1]], [3], "selection.counts[0]=3 must be in [0, 2]"),
        ([[0, 1]], [-1], "selection.counts[0]=-1 must be in [0, 2]"),
        ([[0, 1], [0, 1]], [2, 2], "selection.positions must have shape [1, K]"),
        ([[0, 1]], [2, 2], "selection.counts must have shape [1], got (2,)"),
        ([[0.0, 1.0]], [2], "selection.positions must be an integer array, got float32"),
    ],
)
def test_bad_token_selection_is_named(positions, counts, message):
    table = paged.PageTable.from_seq_lens([5], page_size=4)
    selection = TokenSelection(jnp.asarray(positions), jnp.asarray(counts))
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_token_selection(selection, table)


# ----------------------------------------------------------------------------------------------
# The lightning indexer
# ----------------------------------------------------------------------------------------------


def indexer_inputs(seed: int):
    rng = np.random.default_rng(seed)
    q_index = rng.standard_normal((BUCKET.batch_size, INDEX_HEADS, INDEX_DIM))
    weights = rng.uniform(0.1, 2.0, (BUCKET.batch_size, INDEX_HEADS))
    keys = rng.standard_normal((BUCKET.num_pool_pages, BUCKET.page_size, INDEX_DIM))
    return q_index, weights, keys


def numpy_indexer_top_k(q_index, weights, keys, page_lists, seq_lens, top_k):
    """The oracle: walk each request's tokens, score them, keep the top_k (earlier wins ties)."""
    selections = []
    for b, (pages, length) in enumerate(zip(page_lists, seq_lens, strict=True)):
        scores = []
        for s in range(length):
            key = keys[pages[s // 4], s % 4]
            scores.append(
                sum(w * max(q @ key, 0.0) for q, w in zip(q_index[b], weights[b], strict=True))
            )
        order = sorted(range(length), key=lambda s: (-scores[s], s))
        selections.append(sorted(order[:top_k]))
    return selections


@pytest.mark.parametrize("top_k", [1, 5, 2048])
@given(batch=scattered_page_tables(BUCKET), seed=st.integers(0, 2**16))
def test_indexer_top_k_equals_numpy_oracle(top_k, batch, seed):
    q_index, weights, keys = indexer_inputs(seed)
    # Poison every slot no request owns with keys the queries love: padding must never win.
    owned = np.zeros(keys.shape[:2], bool)
    for pages, length in zip(batch.page_lists, batch.seq_lens, strict=True):
        for s in range(length):
            owned[pages[s // 4], s % 4] = True
    keys[~owned] = 100.0 * np.sign(q_index.sum(axis=(0, 1)))
    chosen = lightning_indexer_top_k(
        jnp.asarray(q_index, jnp.float32),
        jnp.asarray(weights, jnp.float32),
        jnp.asarray(keys, jnp.float32),
        batch.page_table,
        top_k=top_k,
    )
    validate_token_selection(chosen, batch.page_table)
    want = numpy_indexer_top_k(q_index, weights, keys, batch.page_lists, batch.seq_lens, top_k)
    for b in range(BUCKET.batch_size):
        count = int(chosen.counts[b])
        assert count == min(top_k, batch.seq_lens[b])
        assert np.asarray(chosen.positions[b, :count]).tolist() == want[b]


def one_request(index_keys, q_index, weights, top_k):
    """The indexer on one request whose tokens are ``index_keys`` ([T, index_dim], one page)."""
    length = len(index_keys)
    pool = np.zeros((2, 8, index_keys.shape[1]))
    pool[1, :length] = index_keys
    pool[1, length:] = 50.0  # unwritten slots of the last page: never candidates
    table = paged.PageTable.from_page_lists([[1]], [length], page_size=8)
    chosen = lightning_indexer_top_k(
        jnp.asarray(q_index, jnp.float32)[None],
        jnp.asarray(weights, jnp.float32)[None],
        jnp.asarray(pool, jnp.float32),
        table,
        top_k=top_k,
    )
    return np.asarray(chosen.positions[0, : int(chosen.counts[0])]).tolist()


def test_relu_is_applied_per_head_before_the_weighted_sum():
    """Token 0: head dots (+1, -10), score 1 with the ReLU, -9 without. Token 1: (0.6, 0), 0.6
    either way. Only with the ReLU does token 0 win."""
    index_keys = np.array([[1.0, -10.0], [0.6, 0.0], [0.1, 0.0]])
    q_index = np.eye(2)  # head h reads key element h
    assert one_request(index_keys, q_index, np.ones(2), top_k=1) == [0]


def test_selection_is_one_per_request_by_the_weighted_sum_not_per_head():
    """Head 0 prefers token 0 (dots 1.0 vs 0.7), head 1 token 2 (1.0 vs 0.7); token 1 is second
    for both and first in the sum (1.4 vs 1.0). Per-head top-1 would pick {0, 2}."""
    index_keys = np.array([[1.0, 0.0], [0.7, 0.7], [0.0, 1.0]])
    assert one_request(index_keys, np.eye(2), np.ones(2), top_k=1) == [1]
    assert one_request(index_keys, np.eye(2), np.array([3.0, 1.0]), top_k=1) == [0]


def test_the_current_token_is_a_candidate_and_positions_are_not_shifted():
    """The newest token (position seq_len - 1) is selectable; nothing past it is."""
    index_keys = np.array([[0.1], [0.2], [0.3], [5.0]])
    assert one_request(index_keys, np.ones((1, 1)), np.ones(1), top_k=1) == [3]
    assert one_request(index_keys, np.ones((1, 1)), np.ones(1), top_k=2) == [2, 3]
    # top_k beyond the length keeps every token, none of the unwritten (score 50) slots.
    assert one_request(index_keys, np.ones((1, 1)), np.ones(1), top_k=6) == [0, 1, 2, 3]


def test_ties_go_to_the_earlier_position():
    index_keys = np.array([[1.0], [2.0], [2.0], [2.0]])
    assert one_request(index_keys, np.ones((1, 1)), np.ones(1), top_k=2) == [1, 2]


def test_indexer_scores_match_the_formula(float64):
    q_index, weights, keys = indexer_inputs(3)
    table = paged.PageTable.from_page_lists([[4], [2, 7], []], [3, 6, 0], page_size=4)
    scores = np.asarray(
        lightning_indexer_scores(
            jnp.asarray(q_index), jnp.asarray(weights), jnp.asarray(keys), table
        )
    )
    relu_dots = np.maximum(np.einsum("hd,d->h", q_index[1], keys[7, 1]), 0)
    # Page 7 is entry 2 of page_indices ([4, 2, 7]); slot 1 of it is column 2 * 4 + 1.
    assert scores[1, 2 * 4 + 1] == pytest.approx(weights[1] @ relu_dots, rel=1e-14)
    assert scores[0, 3] == -np.inf  # slot 3 of request 0's only page is unwritten
    assert np.all(scores[2] == -np.inf)  # an empty request has no candidates


def test_bad_indexer_inputs_are_named():
    table = paged.PageTable.from_seq_lens([5], page_size=4)
    q, w, keys = jnp.zeros((1, 2, 4)), jnp.ones((1, 2)), jnp.zeros((3, 4, 4))
    with pytest.raises(ValueError, match=re.escape("top_k must be >= 1, got 0")):
        lightning_indexer_top_k(q, w, keys, table, top_k=0)
    with pytest.raises(TypeError, match=re.escape("top_k must be an int, got 2.5")):
        lightning_indexer_top_k(q, w, keys, table, top_k=2.5)
    with pytest.raises(ValueError, match=re.escape("head_weights must have shape (1, 2)")):
        lightning_indexer_top_k(q, jnp.ones((1, 3)), keys, table)
    with pytest.raises(
        ValueError, match=re.escape("index_k_pages must have shape [num_pages, 4, 4]")
    ):
        lightning_indexer_top_k(q, w, jnp.zeros((3, 8, 4)), table)
    with pytest.raises(ValueError, match=re.escape("q_index must have shape [1, num_index_heads")):
        lightning_indexer_top_k(jnp.zeros((2, 2, 4)), w, keys, table)


# A fixed token count: the append's nnz is a shape, so one compilation serves every example.
APPENDED_TOKENS = 30


@given(
    batch=scattered_page_tables(
        BUCKET, fixed_total_seq_lens(BUCKET.batch_size, APPENDED_TOKENS, BUCKET.max_seq_len)
    ),
    seed=st.integers(0, 2**16),
)
def test_appended_index_keys_land_where_the_indexer_reads_them(batch, seed):
    """Append every token's indexer key, then each request's scores equal the formula applied
    to its own keys, listed by position."""
    rng = np.random.default_rng(seed)
    total = sum(batch.seq_lens)
    requests = np.repeat(np.arange(BUCKET.batch_size), batch.seq_lens).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in batch.seq_lens]).astype(np.int32)
    new_keys = rng.standard_normal((total, INDEX_DIM))
    pool = jnp.full((BUCKET.num_pool_pages, BUCKET.page_size, INDEX_DIM), jnp.nan)
    pool = append_index_keys(
        pool, batch.page_table, jnp.asarray(new_keys, jnp.float32), requests, positions
    )
    q_index, weights, _ = indexer_inputs(seed)
    scores = np.asarray(
        lightning_indexer_scores(
            jnp.asarray(q_index, jnp.float32),
            jnp.asarray(weights, jnp.float32),
            pool,
            batch.page_table,
        )
    )
    for b, length in enumerate(batch.seq_lens):
        mine = new_keys[requests == b]  # [length, index_dim] in position order
        want = np.maximum(mine @ q_index[b].T, 0) @ weights[b]
        start = int(batch.page_table.page_indptr[b]) * BUCKET.page_size
        got = scores[b, start : start + length]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert np.sum(np.isfinite(scores[b])) == length


def test_bad_index_key_appends_are_named():
    table = paged.PageTable.from_seq_lens([3], page_size=4)
    pool = jnp.zeros((2, 4, 2))
    one = jnp.zeros(1, jnp.int32)
    with pytest.raises(ValueError, match=re.escape("(batch_indices[0], positions[0])=(0, 3)")):
        append_index_keys(pool, table, jnp.zeros((1, 2)), one, one + 3)
    with pytest.raises(ValueError, match=re.escape("(batch_indices[0], positions[0])=(1, 0)")):
        append_index_keys(pool, table, jnp.zeros((1, 2)), one + 1, one)
    with pytest.raises(ValueError, match=re.escape("k_index_new must have shape [nnz, 2]")):
        append_index_keys(pool, table, jnp.zeros((1, 3)), one, one)
