"""Cascade attention against plain decode over each request's whole sequence, in float64.

Every case builds plain per-request rows first, as a serving engine holds them (groups list the
same page numbers for their whole prefix pages; a prefix that ends mid-page continues on each
request's own copy of that page), splits them into levels with
``paged.cascade_levels_from_shared_prefix`` (or the nested form), and compares
``paged.cascade_decode_attention`` with the float64 oracle of ``reference_dense`` run over the
plain rows: the merge of the levels' states must be attention over all of a request's keys
(``proofs/merge_states.md``, Theorem 4). Error measure as in ``docs/testing.md``.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reference_dense import (
    dense_attention,
    gather_tokens,
    paged_causal_attention_oracle,
    relative_error,
)
from strategies import pages_needed

import paged
from kernels_pallas.platform import record_backends

# Programs that run long (long shared prefixes run through the reference): compiled with XLA's CPU
# optimizations (tests/conftest.py).
CPU_PROGRAMS_OPTIMIZED = True

NUM_KV_HEADS = 2
SOFT_CAP = 5.0
QUERY_SCALE = 3.0  # logits spread over several units: the soft cap bends them
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float64: 1e-12}
LSE_TOLERANCE = 1e-5

# One shape bucket: 5 requests, pages of 4 tokens (so prefixes end mid-page often), prefixes of
# up to 13 tokens and own suffixes of up to 11.
BATCH, PAGE_SIZE, MAX_PREFIX, MAX_SUFFIX = 5, 4, 13, 11
MAX_PAGES = pages_needed(MAX_PREFIX + MAX_SUFFIX, PAGE_SIZE)
NUM_POOL_PAGES = BATCH * MAX_PAGES + 3
NUM_INDICES = paged.bucket_size(BATCH * MAX_PAGES)

# Every pair of (layout, GQA group, head_dim, dtype, soft cap, q_len) values appears in some
# case (a covering array), so four cases stand in for the 64 of the full product.
PAIRWISE_CASES = [
    ("HND", 1, 16, jnp.float32, None, 1),
    ("HND", 4, 32, jnp.bfloat16, SOFT_CAP, 3),
    ("NHD", 1, 32, jnp.bfloat16, SOFT_CAP, 1),
    ("NHD", 4, 16, jnp.float32, None, 3),
]


def _case_id(case) -> str:
    layout, group, head_dim, dtype, cap, q_len = case
    return f"{layout}-group{group}-d{head_dim}-{jnp.dtype(dtype).name}-cap{cap}-q_len{q_len}"


def random_cache(rng, head_dim: int, dtype, layout: str) -> paged.KVCache:
    """A pool filled everywhere with random normals: no zeros, no equal values."""
    if layout == "HND":
        shape = (NUM_POOL_PAGES, NUM_KV_HEADS, PAGE_SIZE, head_dim)
    else:
        shape = (NUM_POOL_PAGES, PAGE_SIZE, NUM_KV_HEADS, head_dim)
    return paged.KVCache(
        jnp.asarray(rng.standard_normal(shape), dtype),
        jnp.asarray(rng.standard_normal(shape), dtype),
        layout,
    )


def random_queries(rng, q_len: int, num_heads: int, head_dim: int, dtype, batch=BATCH):
    shape = (batch, q_len, num_heads, head_dim)
    return jnp.asarray(QUERY_SCALE * rng.standard_normal(shape), dtype)


def plain_rows(
    groups, prefix_lens, suffix_lens, pool_order, *, page_size=PAGE_SIZE, num_indices=NUM_INDICES
):
    """Plain rows of a batch whose groups share prefixes, as an engine holds them.

    The requests of ``groups[g]`` list the same pages for the whole pages of their first
    ``prefix_lens[g]`` tokens; the rest of each row (a partly filled last prefix page, copied
    on write, then ``suffix_lens[b]`` tokens) is on the request's own pages. A request in no
    group has ``suffix_lens[b]`` tokens, all its own. Pages are taken from ``pool_order`` in
    order, shared prefixes first.

    Returns:
      ``(table, seq_lens)``: the plain ``PageTable`` of pages of ``page_size`` tokens (its
      ``page_indices`` padded to ``num_indices``; None: not padded) and the lengths.
    """
    order = iter(pool_order)
    page_lists = [[] for _ in suffix_lens]
    seq_lens = list(suffix_lens)
    for members, prefix_len in zip(groups, prefix_lens, strict=True):
        shared = [next(order) for _ in range(prefix_len // page_size)]
        for request in members:
            page_lists[request] = list(shared)
            seq_lens[request] += prefix_len
    for request, pages in enumerate(page_lists):
        pages.extend(
            next(order) for _ in range(pages_needed(seq_lens[request], page_size) - len(pages))
        )
    table = paged.PageTable.from_page_lists(
        page_lists, seq_lens, page_size, num_indices=num_indices
    )
    return table, seq_lens


def assert_matches_oracle(o, lse, o_ref, lse_ref, seq_lens, dtype):
    """Per request: relative error of ``o`` under the dtype's bound, LSE to float32 accuracy,
    requests without keys exactly ``0`` and ``-inf``, nothing NaN."""
    o = np.asarray(o).astype(np.float64)
    lse = np.asarray(lse)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    for b, length in enumerate(seq_lens):
        if length == 0:
            assert (o[b] == 0).all() and (lse[b] == -np.inf).all(), f"empty request {b}"
            continue
        error = relative_error(o[b], o_ref[b])
        assert error < TOLERANCE[dtype], f"request {b} (length {length}): error {error:.3g}"
        np.testing.assert_allclose(lse[b], lse_ref[b], rtol=LSE_TOLERANCE, atol=LSE_TOLERANCE)


def plain_oracle(q, cache, table, cap):
    return paged_causal_attention_oracle(
        q,
        cache.k_pages,
        cache.v_pages,
        cache.layout,
        table,
        sm_scale=q.shape[-1] ** -0.5,
        logits_soft_cap=cap,
    )


# --------------------------------------------------------------------------------------------
# Two levels equal plain decode
# --------------------------------------------------------------------------------------------


@st.composite
def grouped_batches(draw, q_len: int):
    """Groups (of 1 to 5 requests; some requests in none), prefixes of any length up to
    ``MAX_PREFIX`` (mid-page included), suffixes of any length with the new tokens in the own
    level (an empty suffix where ``q_len = 1`` allows it)."""
    group_of = draw(st.lists(st.integers(-1, 2), min_size=BATCH, max_size=BATCH))  # -1: none
    group_ids = sorted({g for g in group_of if g >= 0})
    groups = [[b for b in range(BATCH) if group_of[b] == g] for g in group_ids]
    prefix_lens = [draw(st.integers(0, MAX_PREFIX)) for _ in groups]
    prefix_of = {b: prefix_lens[i] for i, members in enumerate(groups) for b in members}
    suffix_lens = []
    for b in range(BATCH):
        suffix = draw(st.integers(0, MAX_SUFFIX))
        # The own level: the prefix's partly filled page (each request's copy), then the suffix.
        own_len = prefix_of.get(b, 0) % PAGE_SIZE + suffix
        if own_len < q_len and not (own_len == 0 and q_len == 1):
            suffix = q_len  # the new tokens must lie in the own level
        suffix_lens.append(suffix)
    pool_order = draw(st.permutations(range(NUM_POOL_PAGES)))
    return groups, prefix_lens, suffix_lens, pool_order


@pytest.mark.parametrize("case", PAIRWISE_CASES, ids=_case_id)
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_cascade_equals_plain_decode(case, data, seed):
    """Theorem 4 of ``proofs/merge_states.md`` with two levels: ragged suffixes, prefixes ending
    mid-page, groups of one, empty suffixes, requests in no group; output and LSE."""
    layout, group, head_dim, dtype, cap, q_len = case
    groups, prefix_lens, suffix_lens, pool_order = data.draw(grouped_batches(q_len))
    rng = np.random.default_rng(seed)
    cache = random_cache(rng, head_dim, dtype, layout)
    q = random_queries(rng, q_len, NUM_KV_HEADS * group, head_dim, dtype)
    table, seq_lens = plain_rows(groups, prefix_lens, suffix_lens, pool_order)
    levels = paged.cascade_levels_from_shared_prefix(table, groups, prefix_lens)
    o, lse = paged.cascade_decode_attention(
        q, cache, levels, logits_soft_cap=cap, return_lse=True, backend="reference"
    )
    assert o.dtype == dtype and o.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == q.shape[:-1]
    o_ref, lse_ref = plain_oracle(q, cache, table, cap)
    assert_matches_oracle(o, lse, o_ref, lse_ref, seq_lens, dtype)


@pytest.mark.parametrize("q_len", range(1, 10))
def test_every_q_len_up_to_9_equals_plain_decode(q_len):
    """Verification steps of 1 to 9 new tokens, causal among themselves in the own level, the
    shared prefix (ending mid-page for one group) visible to all of them."""
    rng = np.random.default_rng(q_len)
    layout = "NHD" if q_len % 2 else "HND"
    cache = random_cache(rng, 16, jnp.float32, layout)
    q = random_queries(rng, q_len, NUM_KV_HEADS * 2, 16, jnp.float32)
    groups, prefix_lens = [[0, 2, 3], [4]], [10, 8]
    suffix_lens = [9, 11, 9 + q_len % 3, 10, 9]
    table, seq_lens = plain_rows(groups, prefix_lens, suffix_lens, rng.permutation(NUM_POOL_PAGES))
    levels = paged.cascade_levels_from_shared_prefix(table, groups, prefix_lens)
    o, lse = paged.cascade_decode_attention(
        q, cache, levels, logits_soft_cap=SOFT_CAP, return_lse=True, backend="reference"
    )
    o_ref, lse_ref = plain_oracle(q, cache, table, SOFT_CAP)
    assert_matches_oracle(o, lse, o_ref, lse_ref, seq_lens, jnp.float32)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("prefix_len", [8, 9])
def test_whole_sequence_shared_and_groups_of_one(layout, prefix_len):
    """Requests whose whole sequence is the prefix (own level empty for a page-aligned prefix,
    the partly filled page for one ending mid-page), a group of one, a request in no group,
    and an empty request, with one new token (the last shared token when the own level is
    empty)."""
    rng = np.random.default_rng(prefix_len)
    cache = random_cache(rng, 16, jnp.float32, layout)
    q = random_queries(rng, 1, NUM_KV_HEADS * 4, 16, jnp.float32)[:, 0]  # [B, H, D]
    groups, prefix_lens = [[0, 1], [2]], [prefix_len, 5]
    suffix_lens = [0, 3, 0, 7, 0]  # request 4: no group, no tokens
    table, seq_lens = plain_rows(groups, prefix_lens, suffix_lens, rng.permutation(NUM_POOL_PAGES))
    levels = paged.cascade_levels_from_shared_prefix(table, groups, prefix_lens)
    assert levels.own.seq_lens().tolist() == [prefix_len % 4, prefix_len % 4 + 3, 1, 7, 0]
    o, lse = paged.cascade_decode_attention(q, cache, levels, return_lse=True, backend="reference")
    assert o.shape == q.shape and lse.shape == q.shape[:-1]
    o_ref, lse_ref = plain_oracle(q[:, None], cache, table, None)
    assert_matches_oracle(o[:, None], lse[:, None], o_ref, lse_ref, seq_lens, jnp.float32)


def test_float64_cascade_is_exact_up_to_rounding(float64):
    """With x64 on, the reference computes every level and the merge in float64: ``o`` agrees
    with the oracle to 1e-12 (``lse`` is returned as float32, documented)."""
    rng = np.random.default_rng(11)
    cache = random_cache(rng, 16, jnp.float64, "HND")
    q = random_queries(rng, 2, NUM_KV_HEADS * 4, 16, jnp.float64)
    groups, prefix_lens = [[1, 2, 4], [0]], [13, 4]
    table, seq_lens = plain_rows(
        groups, prefix_lens, [2, 5, 11, 3, 6], rng.permutation(NUM_POOL_PAGES)
    )
    levels = paged.cascade_levels_from_shared_prefix(table, groups, prefix_lens)
    o, lse = paged.cascade_decode_attention(
        q, cache, levels, logits_soft_cap=SOFT_CAP, return_lse=True, backend="reference"
    )
    assert o.dtype == jnp.float64
    o_ref, lse_ref = plain_oracle(q, cache, table, SOFT_CAP)
    assert_matches_oracle(o, lse, o_ref, lse_ref, seq_lens, jnp.float64)


# --------------------------------------------------------------------------------------------
# More levels, and a shared level that ends on a partly filled page
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout, q_len, cap", [("HND", 1, None), ("NHD", 4, SOFT_CAP)])
def test_three_levels_equal_plain_decode(layout, q_len, cap):
    """Nested prefixes: 6 tokens shared by all five requests, 13 by requests 0 and 1 (their
    page 1 holds the outer prefix's last two tokens and their own shared ones), 9 by requests
    2 and 3, request 4 only the outer prefix; then each request's own tokens."""
    rng = np.random.default_rng(q_len)
    cache = random_cache(rng, 16, jnp.float32, layout)
    q = random_queries(rng, q_len, NUM_KV_HEADS * 2, 16, jnp.float32)
    pages = iter(rng.permutation(NUM_POOL_PAGES).tolist())
    everyone = [next(pages)]  # page 0: tokens 0-3 of the outer prefix
    first_pair = [*everyone, next(pages), next(pages)]  # pages 1-2 of requests 0 and 1
    second_pair = [*everyone, next(pages)]  # page 1 of requests 2 and 3
    seq_lens = [13 + 5, 13 + 4, 9 + 6, 9 + 4, 6 + 7]
    page_lists = [list(first_pair), list(first_pair), list(second_pair), list(second_pair)]
    page_lists.append(list(everyone))
    for b, pages_so_far in enumerate(page_lists):
        pages_so_far.extend(
            next(pages) for _ in range(pages_needed(seq_lens[b], PAGE_SIZE) - len(pages_so_far))
        )
    table = paged.PageTable.from_page_lists(page_lists, seq_lens, PAGE_SIZE)
    levels = paged.cascade_levels_from_nested_prefixes(
        table, [([[0, 1, 2, 3, 4]], [6]), ([[0, 1], [2, 3]], [13, 9])]
    )
    assert [level.num_groups for level in levels.shared] == [1, 2]
    assert levels.shared[1].group_pages.page_lists() == [first_pair[1:], second_pair[1:]]
    o, lse = paged.cascade_decode_attention(
        q, cache, levels, logits_soft_cap=cap, return_lse=True, backend="reference"
    )
    o_ref, lse_ref = plain_oracle(q, cache, table, cap)
    assert_matches_oracle(o, lse, o_ref, lse_ref, seq_lens, jnp.float32)


def test_shared_level_ending_on_a_partly_filled_page():
    """The layout where a request's own tokens start on a fresh page after a shared, partly
    filled one (``last_page_len < page_size`` on the shared level): the request's keys are the
    group's 6 prefix tokens then its own, which no plain row can list, so the oracle is dense
    attention over the two gathered in order."""
    rng = np.random.default_rng(3)
    cache = random_cache(rng, 16, jnp.float32, "NHD")
    q_len = 2
    q = random_queries(rng, q_len, NUM_KV_HEADS * 2, 16, jnp.float32, batch=3)
    group_pages = paged.host_page_table([[9, 4]], [6], PAGE_SIZE)  # the last page holds 2 tokens
    assert group_pages.last_page_len.tolist() == [2]
    own_lists, own_lens = [[1, 7], [12], [5]], [5, 2, 3]
    levels = paged.CascadeLevels(
        shared=(
            paged.SharedLevel(
                group_pages, np.array([0, 2], np.int32), np.array([2, 0, 0, 0], np.int32)
            ),
        ),
        own=paged.host_page_table(own_lists, own_lens, PAGE_SIZE),
    )
    o, lse = paged.cascade_decode_attention(q, cache, levels, return_lse=True, backend="reference")
    for b in range(3):
        shared = b in (0, 2)
        key_parts = [gather_tokens(cache.k_pages, "NHD", own_lists[b], own_lens[b])]
        value_parts = [gather_tokens(cache.v_pages, "NHD", own_lists[b], own_lens[b])]
        if shared:
            key_parts.insert(0, gather_tokens(cache.k_pages, "NHD", [9, 4], 6))
            value_parts.insert(0, gather_tokens(cache.v_pages, "NHD", [9, 4], 6))
        keys, values = np.concatenate(key_parts), np.concatenate(value_parts)
        for token in range(q_len):
            visible = len(keys) - q_len + token + 1
            o_ref, lse_ref = dense_attention(
                q[b, token], keys[:visible], values[:visible], sm_scale=16**-0.5
            )
            assert relative_error(o[b, token], o_ref) < TOLERANCE[jnp.float32]
            np.testing.assert_allclose(lse[b, token], lse_ref, rtol=LSE_TOLERANCE)


# --------------------------------------------------------------------------------------------
# The kernel path, jit, empty batches, the backend record
# --------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Pallas Triton backend's
def test_per_level_kernel_path_equals_plain_decode():
    """``backend="pallas"`` (interpreted here): every level through the decode kernel, a shared
    level expanded to one row a request with the new tokens folded into heads."""
    rng = np.random.default_rng(5)
    q_len = 2
    cache = random_cache(rng, 16, jnp.float32, "HND")
    q = random_queries(rng, q_len, NUM_KV_HEADS * 2, 16, jnp.float32)
    groups, prefix_lens = [[0, 3, 4], [2]], [9, 4]
    table, seq_lens = plain_rows(
        groups, prefix_lens, [2, 6, 3, 5, 2], rng.permutation(NUM_POOL_PAGES)
    )
    levels = paged.cascade_levels_from_shared_prefix(table, groups, prefix_lens)
    with record_backends() as records:
        o, lse = paged.cascade_decode_attention(
            q, cache, levels, logits_soft_cap=SOFT_CAP, return_lse=True, backend="pallas"
        )
    assert [(r.operation, r.backend) for r in records] == [
        ("cascade_decode_attention", "pallas"),
        ("decode_attention", "pallas"),
        ("decode_attention", "pallas"),
    ]
    o_ref, lse_ref = plain_oracle(q, cache, table, SOFT_CAP)
    assert_matches_oracle(o, lse, o_ref, lse_ref, seq_lens, jnp.float32)


def test_per_request_page_table_lists_each_requests_group_pages():
    """Concrete and traced expansions of a shared level agree, and list the group's pages."""
    table, _ = plain_rows([[1, 3], [0]], [12, 9], [1, 2, 3, 4, 5], range(NUM_POOL_PAGES))
    level = paged.cascade_levels_from_shared_prefix(table, [[1, 3], [0]], [12, 9]).shared[0]
    expanded = level.per_request_page_table(BATCH)
    group_lists = level.group_pages.page_lists()
    assert expanded.page_lists() == [group_lists[1], group_lists[0], [], group_lists[0], []]
    assert expanded.last_page_len.tolist() == [4, 4, 0, 4, 0]
    with pytest.raises(ValueError, match="num_indices=4 is smaller than the 8 pages"):
        level.per_request_page_table(BATCH, num_indices=4)
    traced = jax.jit(lambda lv: lv.per_request_page_table(BATCH))(level)
    assert traced.page_lists() == expanded.page_lists()
    assert traced.last_page_len.tolist() == expanded.last_page_len.tolist()


def test_x64_mode_changes_nothing(float64):
    """With x64 on and float32 inputs: int32 tables from the expansion, float32 results that
    match the oracle (``docs/testing.md``: every public function works in x64 mode)."""
    rng = np.random.default_rng(2)
    cache = random_cache(rng, 16, jnp.float32, "NHD")
    q = random_queries(rng, 2, NUM_KV_HEADS * 2, 16, jnp.float32)
    groups, prefix_lens = [[0, 4], [1, 2]], [7, 12]
    table, seq_lens = plain_rows(groups, prefix_lens, [3, 2, 9, 4, 5], range(NUM_POOL_PAGES))
    levels = paged.cascade_levels_from_shared_prefix(table, groups, prefix_lens)
    expanded = levels.shared[0].per_request_page_table(BATCH)
    for array in (expanded.page_indptr, expanded.page_indices, expanded.last_page_len):
        assert array.dtype == jnp.int32
    o, lse = paged.cascade_decode_attention(q, cache, levels, return_lse=True, backend="reference")
    assert o.dtype == jnp.float32 and lse.dtype == jnp.float32
    o_ref, lse_ref = plain_oracle(q, cache, table, None)
    assert_matches_oracle(o, lse, o_ref, lse_ref, seq_lens, jnp.float32)


def test_jitted_cascade_equals_eager():
    """The levels are a pytree: a jitted call (values unchecked) gives the eager result."""
    rng = np.random.default_rng(8)
    cache = random_cache(rng, 16, jnp.float32, "HND")
    q = random_queries(rng, 1, NUM_KV_HEADS, 16, jnp.float32)[:, 0]
    groups, prefix_lens = [[0, 1, 2, 3]], [11]
    table, _ = plain_rows(groups, prefix_lens, [1, 4, 2, 9, 3], rng.permutation(NUM_POOL_PAGES))
    levels = paged.cascade_levels_from_shared_prefix(table, groups, prefix_lens)
    eager = paged.cascade_decode_attention(q, cache, levels, backend="reference")
    jitted = jax.jit(
        lambda q, cache, levels: paged.cascade_decode_attention(
            q, cache, levels, backend="reference"
        )
    )(q, cache, levels)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_empty_batch_gives_empty_outputs(backend):
    cache = paged.new_kv_cache(4, PAGE_SIZE, NUM_KV_HEADS, 16, jnp.float32)
    table = paged.PageTable.from_seq_lens([], PAGE_SIZE)
    levels = paged.cascade_levels_from_shared_prefix(table, [], [])
    q = jnp.ones((0, 4, 16), jnp.float32)
    o, lse = paged.cascade_decode_attention(q, cache, levels, return_lse=True, backend=backend)
    assert o.shape == (0, 4, 16) and lse.shape == (0, 4)


def test_auto_follows_the_kill_switch(monkeypatch):
    table, _ = plain_rows([[0, 1]], [5], [1, 1, 1, 1, 1], range(NUM_POOL_PAGES))
    levels = paged.cascade_levels_from_shared_prefix(table, [[0, 1]], [5])
    cache = paged.new_kv_cache(NUM_POOL_PAGES, PAGE_SIZE, NUM_KV_HEADS, 16, jnp.float32)
    monkeypatch.setenv("DECODELAB_BACKEND", "reference")
    with record_backends() as records:
        paged.cascade_decode_attention(jnp.ones((BATCH, 2, 16)), cache, levels)
    assert [(r.operation, r.backend) for r in records] == [
        ("cascade_decode_attention", "reference")
    ]


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


def _shared_pair_table():
    """Requests 0 and 1 share page 3 for their first 4 tokens; request 2 does not."""
    return paged.PageTable.from_page_lists([[3, 5], [3, 6], [7, 8]], [6, 7, 5], PAGE_SIZE)


@pytest.mark.parametrize(
    "groups, prefix_lens, match",
    [
        (
            [[0, 2]],
            [4],
            "groups[0] does not share its prefix: page 0 of request 2 is 7 but of request 0 it is 3",
        ),
        ([[0, 1], [1]], [4, 2], "request 1 is in groups[0] and groups[1]"),
        ([[0, 3]], [4], "groups[0] lists request 3, outside the batch of 3"),
        ([[0, -1]], [4], "groups[0] lists request -1, outside the batch of 3"),
        ([[0, 1]], [4, 4], "groups has 1 groups but prefix_lens has 2"),
        ([[]], [0], "groups[0] is empty"),
        ([[0, 1]], [-1], "prefix_lens[0] must be an int >= 0, got -1"),
        ([[0, 1]], [7], "prefix_lens[0]=7 exceeds the 6 tokens of request 0"),
    ],
)
def test_constructor_refuses_groups_that_do_not_hold(groups, prefix_lens, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        paged.cascade_levels_from_shared_prefix(_shared_pair_table(), groups, prefix_lens)


def test_nested_constructor_names_the_level():
    table = _shared_pair_table()
    with pytest.raises(ValueError, match=re.escape("prefix_levels[1]: groups[0] lists request 5")):
        paged.cascade_levels_from_nested_prefixes(table, [([[0, 1]], [4]), ([[5]], [4])])
    with pytest.raises(ValueError, match=re.escape("reach this level at different pages")):
        paged.cascade_levels_from_nested_prefixes(table, [([[0, 1]], [4]), ([[0, 2]], [4])])
    with pytest.raises(ValueError, match=re.escape("prefix_lens[0]=0 ends before the 4 tokens")):
        paged.cascade_levels_from_nested_prefixes(table, [([[0, 1]], [4]), ([[0]], [0])])


def test_constructor_refuses_a_traced_table():
    def build(table):
        paged.cascade_levels_from_shared_prefix(table, [[0, 1]], [4])
        return table.page_indptr

    with pytest.raises(ValueError, match="page_table must be concrete"):
        jax.jit(build)(_shared_pair_table())


def _good_levels():
    return paged.cascade_levels_from_shared_prefix(_shared_pair_table(), [[0, 1]], [4])


def _replace_shared(levels, **fields):
    import dataclasses

    level = dataclasses.replace(levels.shared[0], **fields)
    return dataclasses.replace(levels, shared=(level,))


@pytest.mark.parametrize(
    "mutate, q_shape, match",
    [
        (lambda lv: lv, (2, 4, 16), "levels.own describes 3 requests but the batch has 2"),
        (lambda lv: lv, (3, 3, 16), "not a multiple of the cache's num_kv_heads=2"),
        (
            lambda lv: lv,
            (3, 4, 4, 16),
            "request 0 has seq_len 2 in levels.own, fewer than q's q_len=4",
        ),
        (
            lambda lv: _replace_shared(lv, group_requests=np.array([0, 4], np.int32)),
            (3, 4, 16),
            "levels.shared[0].group_requests[1]=4 is outside the batch of 3 requests",
        ),
        (
            lambda lv: _replace_shared(lv, group_requests=np.array([1, 1], np.int32)),
            (3, 4, 16),
            "levels.shared[0].group_requests lists request 1 in groups [0, 0]",
        ),
        (
            lambda lv: _replace_shared(lv, group_indptr=np.array([0, 1, 2], np.int32)),
            (3, 4, 16),
            "levels.shared[0].group_indptr has 3 entries but group_pages has 1 groups",
        ),
        (
            lambda lv: _replace_shared(
                lv,
                group_indptr=np.array([0, 3], np.int32),
                group_requests=np.array([0, 1], np.int32),
            ),
            (3, 4, 16),
            "levels.shared[0].group_indptr[-1]=3 exceeds len(group_requests)=2",
        ),
        (
            lambda lv: _replace_shared(lv, group_indptr=np.array([0, 2], np.int64)),
            (3, 4, 16),
            "levels.shared[0].group_indptr must be a 1-D int32 array",
        ),
        (
            lambda lv: _replace_shared(
                lv, group_pages=paged.host_page_table([[40]], [4], PAGE_SIZE)
            ),
            (3, 4, 16),
            "levels.shared[0].group_pages.page_indices[0]=40 is outside the pool of 16 pages",
        ),
        (
            lambda lv: _replace_shared(lv, group_pages=paged.host_page_table([[3]], [4], 8)),
            (3, 4, 16),
            "levels.shared[0].group_pages.page_size=8 differs from levels.own.page_size=4",
        ),
    ],
)
def test_cascade_attention_refuses_bad_levels(mutate, q_shape, match):
    levels = _good_levels()
    levels = paged.CascadeLevels(
        shared=levels.shared,
        own=paged.host_page_table(levels.own.page_lists(), levels.own.seq_lens(), PAGE_SIZE),
    )
    levels = mutate(levels)
    cache = paged.new_kv_cache(16, PAGE_SIZE, NUM_KV_HEADS, 16, jnp.float32)
    with pytest.raises(ValueError, match=re.escape(match)):
        paged.cascade_decode_attention(jnp.ones(q_shape), cache, levels, backend="reference")


def test_an_empty_own_level_takes_one_new_token_only():
    """A request whose whole sequence is shared may decode its last token (L = 1) but not
    verify several: those would lie in the shared level and need its causal mask."""
    table = paged.PageTable.from_page_lists([[3], [3]], [4, 4], PAGE_SIZE)
    levels = paged.cascade_levels_from_shared_prefix(table, [[0, 1]], [4])
    cache = paged.new_kv_cache(4, PAGE_SIZE, NUM_KV_HEADS, 16, jnp.float32)
    paged.cascade_decode_attention(jnp.ones((2, 1, 2, 16)), cache, levels, backend="reference")
    with pytest.raises(ValueError, match=re.escape("request 0 has 0 tokens in levels.own")):
        paged.cascade_decode_attention(jnp.ones((2, 2, 2, 16)), cache, levels, backend="reference")


def test_levels_of_the_wrong_type_are_refused():
    cache = paged.new_kv_cache(4, PAGE_SIZE, NUM_KV_HEADS, 16, jnp.float32)
    table = paged.PageTable.from_seq_lens([4], PAGE_SIZE)
    with pytest.raises(TypeError, match="levels must be a CascadeLevels, got PageTable"):
        paged.cascade_decode_attention(jnp.ones((1, 2, 16)), cache, table)


# --------------------------------------------------------------------------------------------
# Compiled, at a benchmark shape (GPU only)
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 4])
def test_per_level_kernel_path_at_a_benchmark_shape_on_gpu(q_len):
    """Compiled: 32 requests sharing a 4100-token prefix (ending mid-page), ragged suffixes of
    up to 256 tokens, 32 query heads, 8 KV heads, head_dim 128, bfloat16, against the float32
    reference of plain decode over the plain rows."""
    from paged.attention_reference import decode_attention_reference

    page_size, prefix_len, batch, num_kv_heads, head_dim = 16, 4100, 32, 8, 128
    rng = np.random.default_rng(q_len)
    suffix_lens = rng.integers(q_len, 257, batch).tolist()
    shared = list(range(prefix_len // page_size))
    next_page = len(shared)
    page_lists, seq_lens = [], []
    for suffix in suffix_lens:
        seq_len = prefix_len + suffix
        own = pages_needed(seq_len, page_size) - len(shared)
        page_lists.append(shared + list(range(next_page, next_page + own)))
        next_page += own
        seq_lens.append(seq_len)
    table = paged.PageTable.from_page_lists(page_lists, seq_lens, page_size)
    shape = (next_page, num_kv_heads, page_size, head_dim)
    k = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    cache = paged.KVCache(k, v, "HND")
    q = jnp.asarray(rng.standard_normal((batch, q_len, 32, head_dim)), jnp.bfloat16)
    levels = paged.cascade_levels_from_shared_prefix(table, [list(range(batch))], [prefix_len])
    o, lse = paged.cascade_decode_attention(q, cache, levels, return_lse=True, backend="pallas")
    ref_o, ref_lse = decode_attention_reference(
        q.astype(jnp.float32),
        paged.KVCache(k.astype(jnp.float32), v.astype(jnp.float32), "HND"),
        table,
        sm_scale=head_dim**-0.5,
    )
    for b in range(batch):
        assert relative_error(o[b], np.asarray(ref_o[b], np.float64)) < TOLERANCE[jnp.bfloat16]
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-4, atol=1e-3)
