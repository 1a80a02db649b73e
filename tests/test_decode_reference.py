"""Reference decode attention and append against the independent float64 oracle.

The oracle (``reference_dense``) gathers each request's tokens on the host by walking its page list
and runs a textbook float64 softmax; the reference under test masks a gather of every listed page.
Error measure (``docs/testing.md``): ``||out - ref|| / ||ref||`` per request, under 1e-5 for
float32 inputs and 1e-2 for bfloat16 inputs (the oracle sees the same bf16-rounded values).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jitted_reference import reference_decode
from reference_dense import (
    dense_attention,
    gather_tokens,
    paged_attention_oracle,
    relative_error,
    request_page_lists,
)
from strategies import (
    PagedBucket,
    fixed_total_seq_lens,
    page_tables_with_shared_prefix,
    pages_needed,
    scattered_page_tables,
    sequence_lengths,
)

import paged

# Programs that run long (long contexts run through the float64 reference): compiled with XLA's CPU
# optimizations (tests/conftest.py).
CPU_PROGRAMS_OPTIMIZED = True

NUM_KV_HEADS = 2
SOFT_CAP = 5.0
# Queries are scaled so that logits spread over several units: the soft cap then bends them
# (a test with the cap ignored fails) and the softmax is far from uniform.
QUERY_SCALE = 3.0
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
# The reference accumulates in float32 whatever the input dtype, so its LSE is float32-accurate.
LSE_TOLERANCE = 1e-5

# Ragged batches of up to 100 tokens in pages of 16: lengths 0, 1, 15, 16, 17, 32, 100 and
# anything between, pages scattered over a pool with spare pages, one padded shape.
DECODE_BUCKET = PagedBucket(batch_size=5, page_size=16, max_seq_len=100)

# Every pair of (layout, GQA group, head_dim, dtype, soft cap) values appears in some case
# (a covering array), so six cases stand in for the 32 of the full product.
PAIRWISE_CASES = [
    ("HND", 1, 16, jnp.float32, None),
    ("HND", 1, 16, jnp.float32, SOFT_CAP),
    ("HND", 4, 32, jnp.bfloat16, None),
    ("NHD", 1, 32, jnp.bfloat16, None),
    ("NHD", 4, 16, jnp.bfloat16, SOFT_CAP),
    ("NHD", 4, 32, jnp.float32, SOFT_CAP),
]


def _case_id(case) -> str:
    layout, group, head_dim, dtype, cap = case
    return f"{layout}-group{group}-d{head_dim}-{jnp.dtype(dtype).name}-cap{cap}"


def random_cache(rng, bucket: PagedBucket, head_dim: int, dtype, layout: str) -> paged.KVCache:
    """A pool filled everywhere (used or not) with random normals: no zeros, no equal values."""
    if layout == "HND":
        shape = (bucket.num_pool_pages, NUM_KV_HEADS, bucket.page_size, head_dim)
    else:
        shape = (bucket.num_pool_pages, bucket.page_size, NUM_KV_HEADS, head_dim)
    return paged.KVCache(
        jnp.asarray(rng.standard_normal(shape), dtype),
        jnp.asarray(rng.standard_normal(shape), dtype),
        layout,
    )


def random_queries(rng, batch_size: int, num_heads: int, head_dim: int, dtype) -> jnp.ndarray:
    return jnp.asarray(QUERY_SCALE * rng.standard_normal((batch_size, num_heads, head_dim)), dtype)


def assert_matches_oracle(o, lse, o_ref, lse_ref, seq_lens, dtype):
    """Per request: relative error of ``o`` under the dtype's bound, LSE to float32 accuracy,
    empty requests exactly ``0`` and ``-inf``, and nothing NaN anywhere."""
    o = np.asarray(o).astype(np.float64)
    lse = np.asarray(lse)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    for b, length in enumerate(seq_lens):
        if length == 0:
            assert (o[b] == 0).all(), f"empty request {b} must give o = 0"
            assert (lse[b] == -np.inf).all(), f"empty request {b} must give lse = -inf"
            continue
        error = relative_error(o[b], o_ref[b])
        assert error < TOLERANCE[dtype], f"request {b} (length {length}): error {error:.3g}"
        assert np.isfinite(lse[b]).all()
        np.testing.assert_allclose(lse[b], lse_ref[b], rtol=LSE_TOLERANCE, atol=LSE_TOLERANCE)


@pytest.mark.parametrize("case", PAIRWISE_CASES, ids=_case_id)
@given(batch=scattered_page_tables(DECODE_BUCKET), seed=st.integers(0, 2**32 - 1))
def test_decode_matches_dense_float64_attention(case, batch, seed):
    layout, group, head_dim, dtype, cap = case
    rng = np.random.default_rng(seed)
    cache = random_cache(rng, DECODE_BUCKET, head_dim, dtype, layout)
    q = random_queries(rng, DECODE_BUCKET.batch_size, NUM_KV_HEADS * group, head_dim, dtype)
    o, lse = reference_decode(q, cache, batch.page_table, logits_soft_cap=cap)
    assert o.dtype == dtype and o.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == q.shape[:2]
    o_ref, lse_ref = paged_attention_oracle(
        q,
        cache.k_pages,
        cache.v_pages,
        layout,
        batch.page_table,
        sm_scale=head_dim**-0.5,
        logits_soft_cap=cap,
    )
    assert_matches_oracle(o, lse, o_ref, lse_ref, batch.seq_lens, dtype)


@given(
    batch=page_tables_with_shared_prefix(DECODE_BUCKET),
    seed=st.integers(0, 2**32 - 1),
    sm_scale=st.sampled_from([None, 0.05, 0.4]),
)
def test_decode_with_shared_prefix_pages_matches_dense(batch, seed, sm_scale):
    """Requests that list the same prefix pages each read them in full; ``sm_scale`` is honoured."""
    head_dim, group = 16, 4
    rng = np.random.default_rng(seed)
    cache = random_cache(rng, DECODE_BUCKET, head_dim, jnp.float32, "NHD")
    q = random_queries(rng, DECODE_BUCKET.batch_size, NUM_KV_HEADS * group, head_dim, jnp.float32)
    o, lse = reference_decode(q, cache, batch.page_table, sm_scale=sm_scale)
    o_ref, lse_ref = paged_attention_oracle(
        q,
        cache.k_pages,
        cache.v_pages,
        "NHD",
        batch.page_table,
        sm_scale=head_dim**-0.5 if sm_scale is None else sm_scale,
    )
    assert_matches_oracle(o, lse, o_ref, lse_ref, batch.seq_lens, jnp.float32)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("seq_lens", [[0, 5, 0], [0, 0, 0], [16, 0, 17]])
def test_empty_requests_give_zero_output_and_minus_inf_lse(layout, seq_lens):
    rng = np.random.default_rng(len(seq_lens) + sum(seq_lens))
    bucket = PagedBucket(batch_size=3, page_size=16, max_seq_len=17)
    cache = random_cache(rng, bucket, 16, jnp.float32, layout)
    table = paged.PageTable.from_seq_lens(
        seq_lens, 16, pages=rng.permutation(bucket.num_pool_pages).tolist()
    )
    q = random_queries(rng, 3, NUM_KV_HEADS, 16, jnp.float32)
    o, lse = paged.decode_attention(q, cache, table, return_lse=True, backend="reference")
    o_ref, lse_ref = paged_attention_oracle(
        q, cache.k_pages, cache.v_pages, layout, table, sm_scale=16**-0.5
    )
    assert_matches_oracle(o, lse, o_ref, lse_ref, seq_lens, jnp.float32)
    assert sum(1 for n in seq_lens if n == 0) == int(np.isneginf(np.asarray(lse)[:, 0]).sum())


def test_empty_batch_gives_empty_outputs():
    cache = paged.new_kv_cache(4, 16, NUM_KV_HEADS, 16, jnp.float32)
    table = paged.PageTable.from_seq_lens([], 16)
    o, lse = paged.decode_attention(
        jnp.ones((0, 4, 16), jnp.float32), cache, table, return_lse=True, backend="reference"
    )
    assert o.shape == (0, 4, 16) and lse.shape == (0, 4)


def test_return_lse_false_returns_the_output_alone():
    rng = np.random.default_rng(7)
    bucket = PagedBucket(batch_size=2, page_size=16, max_seq_len=40)
    cache = random_cache(rng, bucket, 16, jnp.float32, "HND")
    table = paged.PageTable.from_seq_lens([40, 3], 16, pages=[5, 0, 2, 7])
    q = random_queries(rng, 2, NUM_KV_HEADS, 16, jnp.float32)
    alone = paged.decode_attention(q, cache, table, backend="reference")
    with_lse = paged.decode_attention(q, cache, table, return_lse=True, backend="reference")
    assert isinstance(alone, jnp.ndarray)
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(with_lse[0]))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("seq_lens", [[1, 16, 17, 100, 0], [33, 2, 64, 0, 99]])
def test_float64_decode_is_exact_up_to_rounding(float64, layout, seq_lens):
    """With x64 on and float64 inputs the reference computes in float64: ``o`` agrees with the
    oracle to 1e-12; ``lse`` is returned as float32 (documented), so it agrees to float32."""
    rng = np.random.default_rng(sum(seq_lens))
    cache = random_cache(rng, DECODE_BUCKET, 16, jnp.float64, layout)
    q = random_queries(rng, 5, NUM_KV_HEADS * 4, 16, jnp.float64)
    table = paged.PageTable.from_seq_lens(
        seq_lens, 16, pages=rng.permutation(DECODE_BUCKET.num_pool_pages).tolist()
    )
    o, lse = paged.decode_attention(
        q, cache, table, logits_soft_cap=SOFT_CAP, return_lse=True, backend="reference"
    )
    assert o.dtype == jnp.float64
    o_ref, lse_ref = paged_attention_oracle(
        q, cache.k_pages, cache.v_pages, layout, table, sm_scale=0.25, logits_soft_cap=SOFT_CAP
    )
    for b, length in enumerate(seq_lens):
        if length:
            assert relative_error(o[b], o_ref[b]) < 1e-12
    np.testing.assert_allclose(np.asarray(lse), lse_ref.astype(np.float32), rtol=1e-6)


def test_unwritten_slots_never_reach_the_output():
    """Slots no request has written (the tail of a last page, unused pages, the page that padding
    entries name) may hold anything, NaN included, as recycled or uninitialized memory does; the
    output must depend only on each request's own tokens.

    Guards against a bug this test found: a weight of 0 times a NaN value is still NaN, so the
    reference once let a NaN in any gathered slot poison every request; it now zeroes the values
    a request does not own before the weighted sum.
    """
    page_size, head_dim, seq_lens = 4, 8, [3, 6, 0]
    cache = paged.new_kv_cache(8, page_size, NUM_KV_HEADS, head_dim, jnp.float32, layout="NHD")
    cache = paged.KVCache(
        jnp.full_like(cache.k_pages, jnp.nan), jnp.full_like(cache.v_pages, jnp.nan), "NHD"
    )
    table = paged.PageTable.from_seq_lens(seq_lens, page_size, pages=[6, 1, 3])
    rng = np.random.default_rng(3)
    total = sum(seq_lens)
    k_new = rng.standard_normal((total, NUM_KV_HEADS, head_dim))
    v_new = rng.standard_normal((total, NUM_KV_HEADS, head_dim))
    batch_indices = np.repeat(np.arange(len(seq_lens)), seq_lens)
    positions = np.concatenate([np.arange(n) for n in seq_lens])
    cache = paged.append_kv(
        cache,
        table,
        jnp.asarray(k_new, jnp.float32),
        jnp.asarray(v_new, jnp.float32),
        jnp.asarray(batch_indices, jnp.int32),
        jnp.asarray(positions, jnp.int32),
    )
    q = random_queries(rng, len(seq_lens), NUM_KV_HEADS, head_dim, jnp.float32)
    o, lse = paged.decode_attention(q, cache, table, return_lse=True, backend="reference")
    o_ref, lse_ref = paged_attention_oracle(
        q, cache.k_pages, cache.v_pages, "NHD", table, sm_scale=head_dim**-0.5
    )
    assert_matches_oracle(o, lse, o_ref, lse_ref, seq_lens, jnp.float32)


def test_a_nan_in_one_request_stays_in_that_request():
    """A request whose own value holds NaN (a diverged sequence) may return NaN itself, but the
    requests batched with it must not notice (the same ``0 * NaN`` trap as above)."""
    page_size, head_dim = 4, 8
    rng = np.random.default_rng(5)
    bucket = PagedBucket(batch_size=3, page_size=page_size, max_seq_len=6)
    cache = random_cache(rng, bucket, head_dim, jnp.float32, "HND")
    table = paged.PageTable.from_seq_lens([6, 5, 1], page_size, pages=[4, 0, 7, 2, 1])
    poisoned_page = table.page_lists()[0][1]  # holds request 0's tokens 4 and 5
    cache = paged.KVCache(cache.k_pages, cache.v_pages.at[poisoned_page, 0, 1, 0].set(jnp.nan))
    q = random_queries(rng, 3, NUM_KV_HEADS, head_dim, jnp.float32)
    o, lse = paged.decode_attention(q, cache, table, return_lse=True, backend="reference")
    o_ref, lse_ref = paged_attention_oracle(
        q, cache.k_pages, cache.v_pages, "HND", table, sm_scale=head_dim**-0.5
    )
    assert np.isnan(o_ref[0]).any(), "the oracle propagates request 0's own NaN"
    assert_matches_oracle(o[1:], lse[1:], o_ref[1:], lse_ref[1:], [5, 1], jnp.float32)


# --------------------------------------------------------------------------------------------
# Append, then decode
# --------------------------------------------------------------------------------------------

APPEND_BUCKET = PagedBucket(batch_size=4, page_size=16, max_seq_len=100)
PROMPT_TOKENS, DECODE_TOKENS = 70, 30  # fixed nnz of the two appends, so shapes stay fixed


def _append_in_order(cache, table, k_all, v_all, starts, stops, order):
    """Appends tokens ``[starts[b], stops[b])`` of every request, in the drawn ``order``."""
    entries = [(b, t) for b in range(len(starts)) for t in range(starts[b], stops[b])]
    entries = [entries[i] for i in order]
    batch_indices = np.array([b for b, _ in entries], np.int32)
    positions = np.array([t for _, t in entries], np.int32)
    k_new = np.stack([k_all[b][t] for b, t in entries])
    v_new = np.stack([v_all[b][t] for b, t in entries])
    return paged.append_kv(
        cache,
        table,
        jnp.asarray(k_new, cache.dtype),
        jnp.asarray(v_new, cache.dtype),
        jnp.asarray(batch_indices),
        jnp.asarray(positions),
    )


@pytest.mark.parametrize(
    "layout, dtype, group", [("HND", jnp.float32, 4), ("NHD", jnp.bfloat16, 1)]
)
@given(
    prompt_lens=fixed_total_seq_lens(APPEND_BUCKET.batch_size, PROMPT_TOKENS, max_seq_len=70),
    decode_lens=fixed_total_seq_lens(APPEND_BUCKET.batch_size, DECODE_TOKENS, max_seq_len=30),
    pool_order=st.permutations(range(APPEND_BUCKET.num_pool_pages)),
    prompt_order=st.permutations(range(PROMPT_TOKENS)),
    decode_order=st.permutations(range(DECODE_TOKENS)),
    seed=st.integers(0, 2**32 - 1),
)
def test_append_then_decode_equals_dense_attention(
    layout, dtype, group, prompt_lens, decode_lens, pool_order, prompt_order, decode_order, seed
):
    """Prompts appended into an empty cache, then more tokens crossing page boundaries (in a
    shuffled order, under a table that has grown new pages); decode must equal dense attention
    over the tokens as they were appended, not as they were stored."""
    head_dim, page_size = 16, APPEND_BUCKET.page_size
    final_lens = [p + d for p, d in zip(prompt_lens, decode_lens, strict=True)]
    rng = np.random.default_rng(seed)
    # Round through the cache dtype now, so the oracle sees exactly what the cache will hold.
    k_all = [
        np.asarray(jnp.asarray(rng.standard_normal((n, NUM_KV_HEADS, head_dim)), dtype))
        for n in final_lens
    ]
    v_all = [
        np.asarray(jnp.asarray(rng.standard_normal((n, NUM_KV_HEADS, head_dim)), dtype))
        for n in final_lens
    ]
    page_lists, start = [], 0
    for n in final_lens:
        page_lists.append(list(pool_order[start : start + pages_needed(n, page_size)]))
        start += pages_needed(n, page_size)
    prompt_table = paged.PageTable.from_page_lists(
        [
            pages[: pages_needed(n, page_size)]
            for pages, n in zip(page_lists, prompt_lens, strict=True)
        ],
        prompt_lens,
        page_size,
        num_indices=APPEND_BUCKET.num_indices,
    )
    final_table = paged.PageTable.from_page_lists(
        page_lists, final_lens, page_size, num_indices=APPEND_BUCKET.num_indices
    )
    cache = paged.new_kv_cache(
        APPEND_BUCKET.num_pool_pages, page_size, NUM_KV_HEADS, head_dim, dtype, layout
    )
    no_tokens_yet = [0] * APPEND_BUCKET.batch_size
    cache = _append_in_order(
        cache, prompt_table, k_all, v_all, no_tokens_yet, prompt_lens, prompt_order
    )
    cache = _append_in_order(
        cache, final_table, k_all, v_all, prompt_lens, final_lens, decode_order
    )

    q = random_queries(rng, APPEND_BUCKET.batch_size, NUM_KV_HEADS * group, head_dim, dtype)
    o, lse = reference_decode(q, cache, final_table)
    o_ref, lse_ref = zip(
        *(
            dense_attention(q_b, k, v, sm_scale=head_dim**-0.5)
            for q_b, k, v in zip(np.asarray(q).astype(np.float64), k_all, v_all, strict=True)
        ),
        strict=True,
    )
    assert_matches_oracle(o, lse, np.stack(o_ref), np.stack(lse_ref), final_lens, dtype)
    # Pages no request holds were never written.
    unused = sorted(set(range(APPEND_BUCKET.num_pool_pages)) - {p for ps in page_lists for p in ps})
    assert not np.asarray(cache.k_pages[jnp.asarray(unused, jnp.int32)]).astype(np.float32).any()
    assert not np.asarray(cache.v_pages[jnp.asarray(unused, jnp.int32)]).astype(np.float32).any()


def _append_error_inputs():
    """A 3-request table (5, 0 and 17 tokens, pages of 16) and two new tokens' worth of inputs."""
    cache = paged.new_kv_cache(6, 16, NUM_KV_HEADS, 8, jnp.float32, layout="NHD")
    table = paged.PageTable.from_seq_lens([5, 0, 17], 16, pages=[4, 1, 2])
    k_new = jnp.ones((2, NUM_KV_HEADS, 8), jnp.float32)
    return dict(cache=cache, page_table=table, k_new=k_new, v_new=k_new)


BAD_APPENDS = {
    "position at the request's length": (
        dict(batch_indices=[0, 0], positions=[4, 5]),
        "positions[1]=5 is outside request 0's length 5",
    ),
    "position in an empty request": (
        dict(batch_indices=[2, 1], positions=[3, 0]),
        "positions[1]=0 is outside request 1's length 0",
    ),
    "negative position": (
        dict(batch_indices=[2, 2], positions=[-1, 16]),
        "positions[0]=-1 is outside request 2's length 17",
    ),
    "duplicate token": (
        dict(batch_indices=[2, 2], positions=[16, 16]),
        "(batch_indices, positions)=(2, 16) appears more than once",
    ),
    "batch index past the batch": (
        dict(batch_indices=[0, 3], positions=[0, 0]),
        "batch_indices[1]=3 is outside the batch of 3",
    ),
    "negative batch index": (
        dict(batch_indices=[-1, 0], positions=[0, 0]),
        "batch_indices[0]=-1 is outside the batch of 3",
    ),
    "batch_indices of the wrong length": (
        dict(batch_indices=[0, 0, 0], positions=[0, 1]),
        "batch_indices must have shape [2], got (3,)",
    ),
    "float positions": (
        dict(batch_indices=[0, 0], positions=jnp.array([0.0, 1.0])),
        "positions must be an integer array, got float32",
    ),
    "k_new with the wrong head_dim": (
        dict(batch_indices=[0, 0], positions=[0, 1], k_new=jnp.ones((2, NUM_KV_HEADS, 4))),
        "k_new must have shape [nnz, 2, 8], got (2, 2, 4)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_APPENDS))
def test_invalid_appends_raise_naming_argument_and_value(case):
    overrides, message = BAD_APPENDS[case]
    overrides = dict(overrides)  # popped below; the table stays intact for other runs
    arguments = _append_error_inputs()
    for name in ("batch_indices", "positions"):
        value = overrides.pop(name)
        arguments[name] = value if isinstance(value, jnp.ndarray) else jnp.asarray(value, jnp.int32)
    arguments.update(overrides)
    with pytest.raises(ValueError, match=re.escape(message)):
        paged.append_kv(**arguments)


def test_valid_append_of_the_error_cases_base_succeeds():
    """The base inputs above are valid; each failure comes from its one change."""
    arguments = _append_error_inputs()
    out = paged.append_kv(
        **arguments,
        batch_indices=jnp.asarray([0, 2], jnp.int32),
        positions=jnp.asarray([4, 16], jnp.int32),
    )
    # Request 0's token 4 is page 4, slot 4; request 2's token 16 is its second page (2), slot 0.
    assert np.asarray(out.k_pages)[4, 4].tolist() == [[1.0] * 8] * NUM_KV_HEADS
    assert np.asarray(out.k_pages)[2, 0].tolist() == [[1.0] * 8] * NUM_KV_HEADS
    assert float(np.abs(np.asarray(out.k_pages)).sum()) == 2 * NUM_KV_HEADS * 8


@pytest.mark.parametrize(
    "batch_index, position",
    [(0, 5), (0, 16), (1, 0), (2, 40), (0, -1), (3, 0)],
    ids=["one-past-the-end", "a-page-past", "empty-request", "far-past", "negative", "no-request"],
)
def test_jitted_append_of_a_bad_token_leaves_other_requests_pages_alone(batch_index, position):
    """Under ``jit`` the value checks cannot run, so a bad (request, position) goes through; it
    may be dropped, but it must not land in a page that another request reads (``design.md``:
    no write to a page another request still reads; nothing returns garbage silently).

    Guards against a bug this test found: ``paged.kv_cache.token_slots`` once clipped an
    out-of-range position to a valid entry of ``page_indices`` (the next request's page) and the
    token was written there; such tokens are now sent past the pool and dropped.
    """
    arguments = _append_error_inputs()  # requests: 5 tokens on [4], empty, 17 tokens on [1, 2]
    cache = arguments["cache"]
    filled = paged.KVCache(
        jnp.full_like(cache.k_pages, 3.0), jnp.full_like(cache.v_pages, 3.0), cache.layout
    )
    arguments["cache"] = filled
    arguments["k_new"] = arguments["v_new"] = jnp.full((1, NUM_KV_HEADS, 8), -7.0, jnp.float32)
    out = jax.jit(paged.append_kv)(
        **arguments,
        batch_indices=jnp.asarray([batch_index], jnp.int32),
        positions=jnp.asarray([position], jnp.int32),
    )
    own_pages = {0: [4], 1: [], 2: [1, 2]}.get(batch_index, [])
    for page in range(cache.num_pages):
        if page in own_pages:
            continue
        assert (np.asarray(out.k_pages[page]) == 3.0).all(), f"page {page} was written"
        assert (np.asarray(out.v_pages[page]) == 3.0).all(), f"page {page} was written"


def test_jitted_append_through_a_negative_page_number_writes_nothing():
    """A corrupt table under ``jit`` (a negative page number, which ``validate_page_table``
    rejects when concrete): the token is dropped. JAX indexing wraps negative indices, so page
    -1 once landed in the pool's last page, which another request may read."""
    arguments = _append_error_inputs()
    cache = arguments["cache"]
    arguments["cache"] = paged.KVCache(
        jnp.full_like(cache.k_pages, 3.0), jnp.full_like(cache.v_pages, 3.0), cache.layout
    )
    table = arguments["page_table"]
    arguments["page_table"] = dataclasses.replace(
        table, page_indices=table.page_indices.at[0].set(-1)
    )
    arguments["k_new"] = arguments["v_new"] = jnp.full((1, NUM_KV_HEADS, 8), -7.0, jnp.float32)
    out = jax.jit(paged.append_kv)(
        **arguments,
        batch_indices=jnp.asarray([0], jnp.int32),
        positions=jnp.asarray([2], jnp.int32),
    )
    assert (np.asarray(out.k_pages) == 3.0).all()
    assert (np.asarray(out.v_pages) == 3.0).all()


# --------------------------------------------------------------------------------------------
# Several new tokens per request (speculative verification, prompt chunks): causal among them
# --------------------------------------------------------------------------------------------


def causal_oracle(q, cache, page_table, *, sm_scale, logits_soft_cap=None):
    """float64 ``(o [B, L, H, D], lse [B, L, H])``: query ``i`` of a request of ``n`` tokens
    attends densely to its first ``n - L + i + 1`` tokens, gathered by walking its page list
    (nothing from ``paged``'s attention code); queries at negative positions see no key."""
    q = np.asarray(q).astype(np.float64)
    q_len = q.shape[1]
    page_lists, seq_lens = request_page_lists(
        page_table.page_indptr,
        page_table.page_indices,
        page_table.last_page_len,
        page_table.page_size,
    )
    o = np.zeros(q.shape)
    lse = np.full(q.shape[:-1], -np.inf)
    for b, (page_list, seq_len) in enumerate(zip(page_lists, seq_lens, strict=True)):
        keys = gather_tokens(cache.k_pages, cache.layout, page_list, seq_len)
        values = gather_tokens(cache.v_pages, cache.layout, page_list, seq_len)
        for i in range(q_len):
            visible = max(seq_len - q_len + i + 1, 0)
            o[b, i], lse[b, i] = dense_attention(
                q[b, i],
                keys[:visible],
                values[:visible],
                sm_scale=sm_scale,
                logits_soft_cap=logits_soft_cap,
            )
    return o, lse


def assert_matches_causal_oracle(o, lse, o_ref, lse_ref, dtype):
    """Per query token: relative error of ``o`` under the dtype's bound, LSE to float32 accuracy;
    a query that sees no key exactly ``0`` and ``-inf``; nothing NaN anywhere."""
    o = np.asarray(o).astype(np.float64)
    lse = np.asarray(lse)
    assert o.shape == o_ref.shape and lse.shape == lse_ref.shape
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    for b, i in np.ndindex(*o.shape[:2]):
        if np.isneginf(lse_ref[b, i]).all():
            assert (o[b, i] == 0).all(), f"query {i} of request {b} sees no key: o must be 0"
            assert np.isneginf(lse[b, i]).all(), f"query {i} of request {b}: lse must be -inf"
            continue
        error = relative_error(o[b, i], o_ref[b, i])
        assert error < TOLERANCE[dtype], f"request {b}, query {i}: error {error:.3g}"
        np.testing.assert_allclose(lse[b, i], lse_ref[b, i], rtol=LSE_TOLERANCE, atol=LSE_TOLERANCE)


def multi_token_seq_lens(bucket: PagedBucket, q_len: int):
    """Lengths a batch with ``q_len`` new tokens can have: empty (0), or at least ``q_len``
    (edge cases near page boundaries favoured)."""
    length = st.one_of(
        st.just(0), sequence_lengths(bucket.page_size, bucket.max_seq_len, min_len=q_len)
    )
    return st.lists(length, min_size=bucket.batch_size, max_size=bucket.batch_size)


def random_multi_token_queries(rng, batch_size, q_len, num_heads, head_dim, dtype):
    shape = (batch_size, q_len, num_heads, head_dim)
    return jnp.asarray(QUERY_SCALE * rng.standard_normal(shape), dtype)


# q_len 1 to 9 (up to 8 drafts), each with one of the pairwise cases in turn: every q_len once,
# every case at least once; 40 spans pages (a prompt chunk).
Q_LEN_CASES = [
    (q_len, PAIRWISE_CASES[i % len(PAIRWISE_CASES)]) for i, q_len in enumerate(range(1, 10))
]
Q_LEN_CASES.append((40, PAIRWISE_CASES[2]))


@pytest.mark.parametrize(
    "q_len, case", Q_LEN_CASES, ids=[f"L{q}-{_case_id(c)}" for q, c in Q_LEN_CASES]
)
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=5)
def test_multi_token_decode_matches_causal_dense_float64(q_len, case, data, seed):
    """Query ``i`` sees the keys up to its own position ``seq_len - L + i``, over ragged, page-
    scattered batches (empty requests, lengths of exactly ``L``, page boundaries)."""
    layout, group, head_dim, dtype, cap = case
    batch = data.draw(
        scattered_page_tables(DECODE_BUCKET, multi_token_seq_lens(DECODE_BUCKET, q_len))
    )
    rng = np.random.default_rng(seed)
    cache = random_cache(rng, DECODE_BUCKET, head_dim, dtype, layout)
    q = random_multi_token_queries(
        rng, DECODE_BUCKET.batch_size, q_len, NUM_KV_HEADS * group, head_dim, dtype
    )
    o, lse = reference_decode(q, cache, batch.page_table, logits_soft_cap=cap)
    assert o.dtype == dtype and o.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == q.shape[:3]
    o_ref, lse_ref = causal_oracle(
        q, cache, batch.page_table, sm_scale=head_dim**-0.5, logits_soft_cap=cap
    )
    assert_matches_causal_oracle(o, lse, o_ref, lse_ref, dtype)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_multi_token_decode_equals_one_token_calls_on_truncated_tables(float64, layout):
    """Query ``i`` of ``L`` equals a one-token decode over the table cut after its own token:
    verification of ``L`` tokens is ``L`` decode steps done at once. In float64, so the two paths'
    different summation orders cost ~1e-15, and any masking difference stands out."""
    q_len, seq_lens = 6, [6, 0, 16, 17, 38]  # exactly L, empty, a full page, page + 1, longer
    rng = np.random.default_rng(11)
    bucket = PagedBucket(batch_size=len(seq_lens), page_size=16, max_seq_len=40)
    cache = random_cache(rng, bucket, 16, jnp.float64, layout)
    table = paged.PageTable.from_seq_lens(
        seq_lens, 16, pages=rng.permutation(bucket.num_pool_pages).tolist()
    )
    q = random_multi_token_queries(rng, len(seq_lens), q_len, NUM_KV_HEADS * 4, 16, jnp.float64)
    o, lse = paged.decode_attention(
        q, cache, table, logits_soft_cap=SOFT_CAP, return_lse=True, backend="reference"
    )
    page_lists = table.page_lists()
    for i in range(q_len):
        lens = [max(n - q_len + i + 1, 0) if n else 0 for n in seq_lens]
        truncated = paged.PageTable.from_page_lists(
            [pages[: pages_needed(n, 16)] for pages, n in zip(page_lists, lens, strict=True)],
            lens,
            16,
        )
        o_l, lse_l = paged.decode_attention(
            q[:, i],
            cache,
            truncated,
            logits_soft_cap=SOFT_CAP,
            return_lse=True,
            backend="reference",
        )
        assert o.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(o[:, i]), np.asarray(o_l), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.asarray(lse[:, i]), np.asarray(lse_l), rtol=1e-12, atol=1e-12)


def test_one_new_token_as_4d_equals_3d():
    rng = np.random.default_rng(12)
    cache = random_cache(rng, DECODE_BUCKET, 16, jnp.float32, "HND")
    table = paged.PageTable.from_seq_lens([1, 0, 17, 100, 33], 16)
    q = random_queries(rng, 5, NUM_KV_HEADS * 2, 16, jnp.float32)
    o3, lse3 = paged.decode_attention(q, cache, table, return_lse=True, backend="reference")
    o4, lse4 = paged.decode_attention(
        q[:, None], cache, table, return_lse=True, backend="reference"
    )
    assert o4.shape == (5, 1, 4, 16) and lse4.shape == (5, 1, 4)
    np.testing.assert_array_equal(np.asarray(o4[:, 0]), np.asarray(o3))
    np.testing.assert_array_equal(np.asarray(lse4[:, 0]), np.asarray(lse3))


def test_multi_token_float64_is_exact_up_to_rounding(float64):
    """A whole prompt as one chunk (``L = seq_len``: query 0 sees only key 0) and a speculative
    step, in float64: ``o`` agrees with the oracle to 1e-12."""
    rng = np.random.default_rng(13)
    for q_len, seq_lens in ((17, [17, 0, 17, 40, 99]), (9, [9, 10, 0, 16, 100])):
        cache = random_cache(rng, DECODE_BUCKET, 16, jnp.float64, "NHD")
        table = paged.PageTable.from_seq_lens(
            seq_lens, 16, pages=rng.permutation(DECODE_BUCKET.num_pool_pages).tolist()
        )
        q = random_multi_token_queries(rng, 5, q_len, NUM_KV_HEADS * 4, 16, jnp.float64)
        o = paged.decode_attention(q, cache, table, logits_soft_cap=SOFT_CAP, backend="reference")
        assert o.dtype == jnp.float64
        o_ref, _ = causal_oracle(q, cache, table, sm_scale=0.25, logits_soft_cap=SOFT_CAP)
        for b, i in np.ndindex(5, q_len):
            if seq_lens[b]:
                assert relative_error(o[b, i], o_ref[b, i]) < 1e-12, (q_len, b, i)
            else:
                assert (np.asarray(o[b, i]) == 0).all()


def test_request_shorter_than_q_len_is_rejected_when_concrete():
    cache = paged.new_kv_cache(8, 16, NUM_KV_HEADS, 8, jnp.float32)
    table = paged.PageTable.from_seq_lens([5, 0, 3], 16)
    q = jnp.ones((3, 4, NUM_KV_HEADS, 8), jnp.float32)
    message = "request 2 has seq_len 3 in page_table, fewer than q's q_len=4 new tokens"
    with pytest.raises(ValueError, match=re.escape(message)):
        paged.decode_attention(q, cache, table, backend="reference")


def test_request_shorter_than_q_len_under_jit_sees_only_existing_positions():
    """Under jit the lengths cannot be checked: a request of 2 tokens with L = 5 has queries at
    positions -3 .. 1; those before 0 see no key (``o = 0``, ``lse = -inf``), the others attend
    causally to keys 0 .. their position."""
    rng = np.random.default_rng(14)
    bucket = PagedBucket(batch_size=2, page_size=16, max_seq_len=20)
    cache = random_cache(rng, bucket, 8, jnp.float32, "HND")
    table = paged.PageTable.from_seq_lens([2, 20], 16, pages=[3, 0, 5])
    q = random_multi_token_queries(rng, 2, 5, NUM_KV_HEADS, 8, jnp.float32)
    decode = jax.jit(
        lambda q, table: paged.decode_attention(
            q, cache, table, return_lse=True, backend="reference"
        )
    )
    o, lse = decode(q, table)
    o_ref, lse_ref = causal_oracle(q, cache, table, sm_scale=8**-0.5)
    assert np.isneginf(lse_ref[0, :3]).all() and np.isfinite(lse_ref[0, 3:]).all()
    assert_matches_causal_oracle(o, lse, o_ref, lse_ref, jnp.float32)


@pytest.mark.parametrize(
    "shape, message",
    [
        ((2, 0, 4, 8), "q's q_len (axis 1 of (2, 0, 4, 8)) must be >= 1, got 0"),
        ((2, 1, 1, 4, 8), "q must have shape [batch, num_q_heads, head_dim] or [batch, q_len"),
        ((2, 3, 3, 8), "q's num_q_heads=3 is not a multiple of the cache's num_kv_heads=2"),
        ((3, 3, 4, 8), "page_table describes 2 requests but the batch has 3"),
    ],
)
def test_bad_multi_token_query_shapes_raise(shape, message):
    cache = paged.new_kv_cache(8, 16, NUM_KV_HEADS, 8, jnp.float32)
    table = paged.PageTable.from_seq_lens([5, 0], 16)
    with pytest.raises(ValueError, match=re.escape(message)):
        paged.decode_attention(jnp.ones(shape, jnp.float32), cache, table, backend="reference")
