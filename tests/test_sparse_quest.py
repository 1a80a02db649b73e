"""Quest metadata and selection (``paged/sparse_quest.py``) against NumPy recomputations.

- Bounds kept current by ``update_page_key_bounds`` over any sequence of appends equal the
  bounds recomputed from the keys (``page_key_bounds``), and both equal a NumPy min/max over
  each page's tokens gathered by walking the page lists.
- The Quest score is a true upper bound of every key's logit in its page (float64).
- Selection keeps the first and last page, the highest scores within the budget, breaks ties
  by position, and the virtual table lists the kept pages in order.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import PagedBucket, pages_needed, scattered_page_tables

import paged
from paged.sparse_quest import (
    PageKeyBounds,
    empty_page_key_bounds,
    head_split_cache,
    head_split_page_table,
    page_key_bounds,
    quest_page_scores,
    quest_selected_pages,
    reset_page_key_bounds,
    update_page_key_bounds,
)
from tests.conftest import enable_x64

NUM_KV_HEADS = 2
HEAD_DIM = 4
BUCKET = PagedBucket(batch_size=3, page_size=4, max_seq_len=19)


def random_cache(seed: int, layout: str, dtype=jnp.float32) -> paged.KVCache:
    rng = np.random.default_rng(seed)
    shape = (BUCKET.num_pool_pages, BUCKET.page_size, NUM_KV_HEADS, HEAD_DIM)
    k, v = (rng.standard_normal(shape) for _ in range(2))
    if layout == "HND":
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    return paged.KVCache(jnp.asarray(k, dtype), jnp.asarray(v, dtype), layout)


def page_tokens(cache: paged.KVCache, page: int, count: int) -> np.ndarray:
    """float64 ``[count, KVH, D]``: the first ``count`` keys of ``page``, read by hand."""
    k = np.asarray(cache.k_pages, np.float64)
    return k[page, :, :count].transpose(1, 0, 2) if cache.layout == "HND" else k[page, :count]


def numpy_bounds(cache: paged.KVCache, page_lists, seq_lens) -> tuple[np.ndarray, np.ndarray]:
    """Bounds by walking each request's pages: the oracle (shares no code with the module)."""
    page_size = BUCKET.page_size
    kmin = np.full((cache.num_pages, NUM_KV_HEADS, HEAD_DIM), np.inf)
    kmax = np.full_like(kmin, -np.inf)
    for pages, length in zip(page_lists, seq_lens, strict=True):
        for i, page in enumerate(pages):
            keys = page_tokens(cache, page, min(page_size, length - i * page_size))
            kmin[page] = np.minimum(kmin[page], keys.min(axis=0))
            kmax[page] = np.maximum(kmax[page], keys.max(axis=0))
    return kmin, kmax


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@given(batch=scattered_page_tables(BUCKET), seed=st.integers(0, 2**16))
def test_page_key_bounds_equal_min_max_of_each_pages_keys(layout, batch, seed):
    cache = random_cache(seed, layout)
    bounds = page_key_bounds(cache, batch.page_table)
    kmin, kmax = numpy_bounds(cache, batch.page_lists, batch.seq_lens)
    np.testing.assert_array_equal(np.asarray(bounds.kmin, np.float64), kmin)
    np.testing.assert_array_equal(np.asarray(bounds.kmax, np.float64), kmax)


@st.composite
def append_schedules(draw):
    """A scattered table and, per step, how many tokens each request appends (0 to 8)."""
    batch = draw(scattered_page_tables(BUCKET))
    done = [0] * BUCKET.batch_size
    steps = []
    while done != batch.seq_lens:
        step = [
            draw(st.integers(0, min(8, n - d))) for n, d in zip(batch.seq_lens, done, strict=True)
        ]
        done = [d + s for d, s in zip(done, step, strict=True)]
        steps.append(step)
    return batch, steps


# Every step appends a fixed NNZ tokens, padded with tokens at a position past every request:
# under jit both append_kv and update_page_key_bounds drop those (one compilation per layout).
APPEND_NNZ = BUCKET.batch_size * 8
PADDING_POSITION = 10_000
append_jit = jax.jit(paged.append_kv)
update_jit = jax.jit(update_page_key_bounds)
bounds_jit = jax.jit(page_key_bounds)


@given(
    schedule=append_schedules(),
    seed=st.integers(0, 2**16),
    layout=st.sampled_from(["HND", "NHD"]),
)
def test_bounds_updated_by_appends_equal_bounds_recomputed_from_keys(schedule, seed, layout):
    """After every step of prefill chunks and decode tokens, in any interleaving (and under
    jit, where tokens outside the table are dropped by both)."""
    batch, steps = schedule
    rng = np.random.default_rng(seed)
    cache = paged.new_kv_cache(
        BUCKET.num_pool_pages, BUCKET.page_size, NUM_KV_HEADS, HEAD_DIM, jnp.float32, layout
    )
    bounds = empty_page_key_bounds(BUCKET.num_pool_pages, NUM_KV_HEADS, HEAD_DIM)
    done = [0] * BUCKET.batch_size
    for step in steps:
        done = [d + s for d, s in zip(done, step, strict=True)]
        table = paged.host_page_table(
            batch.page_lists, done, BUCKET.page_size, num_indices=BUCKET.num_indices
        )
        requests = np.zeros(APPEND_NNZ, np.int32)
        positions = np.full(APPEND_NNZ, PADDING_POSITION, np.int32)
        real = sum(step)
        requests[:real] = np.repeat(np.arange(BUCKET.batch_size), step)
        positions[:real] = np.concatenate(
            [np.arange(d - s, d) for d, s in zip(done, step, strict=True)]
        )
        k_new = jnp.asarray(rng.standard_normal((APPEND_NNZ, NUM_KV_HEADS, HEAD_DIM)), jnp.float32)
        cache = append_jit(cache, table, k_new, k_new, requests, positions)
        bounds = update_jit(bounds, table, k_new, requests, positions)
        recomputed = bounds_jit(cache, table)
        np.testing.assert_array_equal(bounds.kmin, recomputed.kmin)
        np.testing.assert_array_equal(bounds.kmax, recomputed.kmax)
    kmin, kmax = numpy_bounds(cache, batch.page_lists, batch.seq_lens)
    np.testing.assert_array_equal(np.asarray(bounds.kmin, np.float64), kmin)
    np.testing.assert_array_equal(np.asarray(bounds.kmax, np.float64), kmax)


def test_reset_page_key_bounds_empties_a_reused_page():
    bounds = PageKeyBounds(jnp.zeros((3, 1, 2)), jnp.ones((3, 1, 2)))
    reset = reset_page_key_bounds(bounds, jnp.array([2, 0]))
    assert reset.kmin[:, 0, 0].tolist() == [np.inf, 0.0, np.inf]
    assert reset.kmax[:, 0, 0].tolist() == [-np.inf, 1.0, -np.inf]


@given(batch=scattered_page_tables(BUCKET), seed=st.integers(0, 2**16))
def test_quest_score_bounds_every_logit_of_its_page(batch, seed):
    """``q . k <= U(q, page)`` for every key of every page, per query head; the per-KV-head
    score bounds every head of its group."""
    with enable_x64():
        check_quest_bound(batch, seed)


def check_quest_bound(batch, seed):
    rng = np.random.default_rng(seed)
    cache = random_cache(seed, "NHD", jnp.float64)
    # Queries with zeros and large entries, where q_i * kmin_i vs q_i * kmax_i flips sign.
    q = rng.standard_normal((BUCKET.batch_size, 2 * NUM_KV_HEADS, HEAD_DIM)) * 4
    q[rng.random(q.shape) < 0.2] = 0.0
    bounds = page_key_bounds(cache, batch.page_table)
    per_query = np.asarray(
        quest_page_scores(jnp.asarray(q), bounds, batch.page_table, per="query_head")
    )
    per_kv = np.asarray(quest_page_scores(jnp.asarray(q), bounds, batch.page_table))
    for b, (pages, length) in enumerate(zip(batch.page_lists, batch.seq_lens, strict=True)):
        start = int(batch.page_table.page_indptr[b])
        for i, page in enumerate(pages):
            keys = page_tokens(cache, page, min(BUCKET.page_size, length - i * BUCKET.page_size))
            for h in range(q.shape[1]):
                logits = keys[:, h // 2] @ q[b, h]
                slack = 1e-12 * np.abs(keys[:, h // 2]) @ np.abs(q[b, h])
                assert np.all(logits <= per_query[b, h, start + i] + slack)
                assert per_query[b, h, start + i] <= per_kv[b, h // 2, start + i]
                # Tight where a key attains every bound's chosen end: not the test's point, but
                # the bound must not be +inf or NaN for a page with keys.
                assert np.isfinite(per_query[b, h, start + i])
    owned = np.zeros(per_kv.shape[-1], bool)
    owned[: int(batch.page_table.page_indptr[-1])] = True
    assert np.all(per_kv[:, :, ~owned] == -np.inf)


def test_an_empty_page_scores_minus_infinity():
    bounds = empty_page_key_bounds(2, 1, 2)
    table = paged.PageTable.from_page_lists([[1]], [3], page_size=4)
    scores = quest_page_scores(jnp.array([[[0.0, 1.0]]]), bounds, table)
    assert scores[0, 0, 0] == -np.inf


def expected_selection(scores_row: np.ndarray, num_pages: int, keep: int) -> list[int]:
    """The documented rule, written independently: first and last page, then the highest
    scores, earlier position first among equals. Returns kept positions in the request."""
    forced = {0, num_pages - 1}
    rest = sorted(
        (i for i in range(num_pages) if i not in forced), key=lambda i: (-scores_row[i], i)
    )
    return sorted(forced | set(rest[: max(keep - len(forced), 0)]))


@given(
    batch=scattered_page_tables(BUCKET),
    budget=st.integers(1, 24),
    scores=st.lists(st.sampled_from([-2.0, 0.0, 3.0]), min_size=16, max_size=16),
)
def test_selection_keeps_first_last_and_top_pages_with_ties_by_position(batch, budget, scores):
    """Few score values, so ties are common; the first and last page often score lowest."""
    table = batch.page_table
    score_array = jnp.broadcast_to(jnp.asarray(scores, jnp.float32), (BUCKET.batch_size, 2, 16))
    selected = np.asarray(quest_selected_pages(score_array, table, budget))
    keep = max(budget // BUCKET.page_size, 2)
    for b, pages in enumerate(batch.page_lists):
        start = int(table.page_indptr[b])
        row_scores = np.asarray(scores)[start : start + len(pages)]
        want = expected_selection(row_scores, len(pages), min(keep, len(pages))) if pages else []
        for r in range(2):
            got = np.flatnonzero(selected[b, r]).tolist()
            assert got == [start + i for i in want]
            if pages:
                assert start in got and start + len(pages) - 1 in got


@given(batch=scattered_page_tables(BUCKET), budget=st.integers(1, 24), seed=st.integers(0, 99))
def test_head_split_table_lists_kept_pages_in_order_with_last_page_len(batch, budget, seed):
    table = batch.page_table
    rng = np.random.default_rng(seed)
    scores = jnp.asarray(rng.standard_normal((BUCKET.batch_size, 4, 16)), jnp.float32)
    selected = np.asarray(quest_selected_pages(scores, table, budget))
    virtual = head_split_page_table(table, jnp.asarray(selected), NUM_KV_HEADS)
    paged.validate_page_table(virtual, BUCKET.num_pool_pages * NUM_KV_HEADS)
    rows = virtual.page_lists()
    for b, (pages, length) in enumerate(zip(batch.page_lists, batch.seq_lens, strict=True)):
        start = int(table.page_indptr[b])
        for r in range(4):
            kv_head = r * NUM_KV_HEADS // 4
            kept = [pages[j - start] for j in np.flatnonzero(selected[b, r])]
            assert rows[b * 4 + r] == [p * NUM_KV_HEADS + kv_head for p in kept]
            want_last = length - BUCKET.page_size * (pages_needed(length, 4) - 1) if pages else 0
            assert int(virtual.last_page_len[b * 4 + r]) == want_last


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_head_split_cache_page_is_one_head_of_one_page(layout):
    cache = random_cache(3, layout)
    view = head_split_cache(cache)
    nhd = np.asarray(cache.to_nhd(cache.k_pages))
    for page, head in [(0, 0), (5, 1), (BUCKET.num_pool_pages - 1, 1)]:
        np.testing.assert_array_equal(
            np.asarray(view.k_pages[page * NUM_KV_HEADS + head, 0]), nhd[page, :, head]
        )


def test_equal_scores_keep_the_earliest_middle_pages():
    """Seven pages, all scoring the same, budget of four pages: first, last, then pages 1, 2."""
    table = paged.PageTable.from_page_lists([[9, 4, 7, 1, 3, 0, 2]], [27], page_size=4)
    scores = jnp.zeros((1, 1, table.page_indices.shape[0]))
    kept = quest_selected_pages(scores, table, token_budget=16)
    assert np.flatnonzero(kept[0, 0]).tolist() == [0, 1, 2, 6]
    # A strictly better later page displaces the latest of the tied ones.
    kept = quest_selected_pages(scores.at[0, 0, 4].set(1.0), table, token_budget=16)
    assert np.flatnonzero(kept[0, 0]).tolist() == [0, 1, 4, 6]


def test_selection_works_under_jit():
    table = paged.PageTable.from_page_lists([[3, 1, 2, 0]], [15], page_size=4)
    scores = jnp.array([[[0.0, 5.0, 1.0, 0.0] + [0.0] * 12]])
    select = jax.jit(quest_selected_pages, static_argnums=2)
    assert np.flatnonzero(select(scores, table, 12)[0, 0]).tolist() == [0, 1, 3]


@pytest.mark.parametrize(
    ("budget", "error", "message"),
    [
        (0, ValueError, "token_budget must be >= 1, got 0"),
        (-16, ValueError, "token_budget must be >= 1, got -16"),
        (8.0, TypeError, "token_budget must be an int, got 8.0"),
        (True, TypeError, "token_budget must be an int, got True"),
    ],
)
def test_bad_token_budget_is_named(budget, error, message):
    table = paged.PageTable.from_seq_lens([5], page_size=4)
    with pytest.raises(error, match=re.escape(message)):
        quest_selected_pages(jnp.zeros((1, 1, 16)), table, budget)


def test_mismatched_shapes_are_named():
    table = paged.PageTable.from_seq_lens([5], page_size=4)
    bounds = empty_page_key_bounds(4, 2, 8)
    with pytest.raises(ValueError, match=r"q has head_dim 4 but the bounds have 8"):
        quest_page_scores(jnp.zeros((1, 2, 4)), bounds, table)
    with pytest.raises(ValueError, match=r"num_q_heads=3 is not a multiple of num_kv_heads=2"):
        quest_page_scores(jnp.zeros((1, 3, 8)), bounds, table)
    with pytest.raises(ValueError, match=r"per must be one of .* got 'head'"):
        quest_page_scores(jnp.zeros((1, 2, 8)), bounds, table, per="head")
    with pytest.raises(ValueError, match=r"scores must have shape \[1, R, 16\]"):
        quest_selected_pages(jnp.zeros((1, 2, 8)), table, 8)
    with pytest.raises(ValueError, match=r"k_new must have shape \[nnz, 2, 8\], got \(1, 2, 4\)"):
        update_page_key_bounds(
            bounds, table, jnp.zeros((1, 2, 4)), jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32)
        )
    with pytest.raises(ValueError, match=r"positions\[0\]=5 is outside request 0's length 5"):
        update_page_key_bounds(
            bounds, table, jnp.zeros((1, 2, 8)), jnp.zeros(1, jnp.int32), jnp.full(1, 5, jnp.int32)
        )
    with pytest.raises(ValueError, match=r"page_indices\[1\]=4 is outside the pool of 4 pages"):
        update_page_key_bounds(
            bounds,
            paged.PageTable.from_page_lists([[0, 4]], [5], page_size=4),
            jnp.zeros((1, 2, 8)),
            jnp.zeros(1, jnp.int32),
            jnp.zeros(1, jnp.int32),
        )
