"""The CSR page table: constructors, lengths, padding, validation, and one compile per bucket."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reference_dense import paged_attention_oracle, relative_error
from strategies import PagedBucket, page_tables_with_shared_prefix, scattered_page_tables

import paged

PAGE_SIZE = 16
POOL_PAGES = 8


# --------------------------------------------------------------------------------------------
# Constructors and accessors
# --------------------------------------------------------------------------------------------


def test_from_page_lists_builds_the_csr_arrays():
    table = paged.PageTable.from_page_lists(
        [[3, 0], [], [5], [7, 1, 2]], seq_lens=[20, 0, 16, 33], page_size=PAGE_SIZE
    )
    assert table.page_indptr.tolist() == [0, 2, 2, 3, 6]
    assert table.page_indices.tolist()[:6] == [3, 0, 5, 7, 1, 2]
    assert table.last_page_len.tolist() == [4, 0, 16, 1]
    assert table.seq_lens().tolist() == [20, 0, 16, 33]
    assert table.num_pages().tolist() == [2, 0, 1, 3]
    assert table.batch_size == 4
    assert table.page_lists() == [[3, 0], [], [5], [7, 1, 2]]
    for name in ("page_indptr", "page_indices", "last_page_len"):
        assert getattr(table, name).dtype == jnp.int32


def test_from_seq_lens_hands_out_pages_in_the_order_given():
    table = paged.PageTable.from_seq_lens([17, 0, 1], PAGE_SIZE, pages=[6, 2, 4, 0, 1])
    assert table.page_lists() == [[6, 2], [], [4]]
    assert table.last_page_len.tolist() == [1, 0, 1]
    default = paged.PageTable.from_seq_lens([17, 0, 1], PAGE_SIZE)
    assert default.page_lists() == [[0, 1], [], [2]]


def test_default_padding_is_the_bucket_size_and_holds_zeros():
    table = paged.PageTable.from_seq_lens([40, 3], PAGE_SIZE, pages=[5, 6, 7, 4])
    assert table.page_indices.shape == (paged.bucket_size(4),) == (16,)
    assert table.page_indices.tolist()[4:] == [0] * 12


def test_explicit_padding_and_padded():
    table = paged.PageTable.from_seq_lens([40, 3], PAGE_SIZE, pages=[5, 6, 7, 4], num_indices=4)
    assert table.page_indices.tolist() == [5, 6, 7, 4]
    wider = table.padded(10)
    assert wider.page_indices.tolist() == [5, 6, 7, 4, 0, 0, 0, 0, 0, 0]
    assert wider.page_lists() == table.page_lists()
    assert wider.seq_lens().tolist() == [40, 3]
    with pytest.raises(ValueError, match=re.escape("num_indices=3 is smaller than the current 4")):
        table.padded(3)


def test_bucket_size_examples_and_errors():
    assert [paged.bucket_size(n) for n in (0, 1, 16, 17, 32, 33, 1000)] == [
        16,
        16,
        16,
        32,
        32,
        64,
        1024,
    ]
    assert paged.bucket_size(3, minimum=1) == 4
    assert paged.bucket_size(0, minimum=0) == 1
    with pytest.raises(ValueError, match=re.escape("n must be >= 0, got -1")):
        paged.bucket_size(-1)


@given(n=st.integers(0, 1 << 20), minimum=st.sampled_from([1, 2, 16, 64]))
def test_bucket_size_is_the_smallest_power_of_two_above_n_and_minimum(n, minimum):
    size = paged.bucket_size(n, minimum=minimum)
    assert size >= max(n, minimum)
    assert size & (size - 1) == 0, "a power of two (every minimum drawn here is one)"
    # The smallest such size: halving it would drop below n or below the minimum.
    assert size // 2 < max(n, minimum)


def test_constructor_errors_name_the_bad_value():
    with pytest.raises(ValueError, match=re.escape("page_size must be >= 1, got 0")):
        paged.PageTable.from_page_lists([[0]], seq_lens=[1], page_size=0)
    with pytest.raises(ValueError, match=re.escape("page_lists has 2 requests but seq_lens has 1")):
        paged.PageTable.from_page_lists([[0], [1]], seq_lens=[1], page_size=PAGE_SIZE)
    with pytest.raises(ValueError, match=re.escape("seq_lens[0] must be >= 0, got -3")):
        paged.PageTable.from_page_lists([[]], seq_lens=[-3], page_size=PAGE_SIZE)
    with pytest.raises(
        ValueError, match=re.escape("request 1 has seq_len 17, which needs 2 pages")
    ):
        paged.PageTable.from_page_lists([[0], [1]], seq_lens=[3, 17], page_size=PAGE_SIZE)
    with pytest.raises(ValueError, match=re.escape("num_indices=2 is smaller than the 3 pages")):
        paged.PageTable.from_page_lists(
            [[0, 1], [2]], seq_lens=[20, 1], page_size=PAGE_SIZE, num_indices=2
        )
    with pytest.raises(ValueError, match=re.escape("pages has 1 entries but the lengths need 2")):
        paged.PageTable.from_seq_lens([17], PAGE_SIZE, pages=[4])


@given(scattered_page_tables(PagedBucket(batch_size=4, page_size=4, max_seq_len=13)))
def test_every_token_lives_where_the_csr_formula_says(batch):
    """Token t of request b sits in page ``page_indices[page_indptr[b] + t // page_size]``."""
    table = batch.page_table
    indptr = np.asarray(table.page_indptr)
    indices = np.asarray(table.page_indices)
    assert indices.shape == (PagedBucket(4, 4, 13).num_indices,)
    assert table.seq_lens().tolist() == batch.seq_lens
    assert table.page_lists() == batch.page_lists
    for b, (length, pages) in enumerate(zip(batch.seq_lens, batch.page_lists, strict=True)):
        for t in range(length):
            assert indices[indptr[b] + t // table.page_size] == pages[t // table.page_size]
    used = indices[: indptr[-1]]
    assert len(set(used.tolist())) == used.size, "scattered pages must be distinct"
    assert not indices[indptr[-1] :].any(), "padding must hold zeros"
    paged.validate_page_table(table, PagedBucket(4, 4, 13).num_pool_pages, batch_size=4)


@given(page_tables_with_shared_prefix(PagedBucket(batch_size=3, page_size=4, max_seq_len=13)))
def test_tables_that_share_pages_are_valid(batch):
    """A page listed by several requests (a shared prompt prefix) is legal in the table."""
    table = batch.page_table
    paged.validate_page_table(table, PagedBucket(3, 4, 13).num_pool_pages, batch_size=3)
    assert table.seq_lens().tolist() == batch.seq_lens
    assert table.page_lists() == batch.page_lists


# --------------------------------------------------------------------------------------------
# Validation: every error names the argument and the bad value
# --------------------------------------------------------------------------------------------


def _valid_table() -> paged.PageTable:
    """Three requests: 20 tokens on pages [3, 0], 5 tokens on [5], and an empty one."""
    return paged.PageTable.from_page_lists(
        [[3, 0], [5], []], seq_lens=[20, 5, 0], page_size=PAGE_SIZE
    )


def _with(table: paged.PageTable, **arrays) -> paged.PageTable:
    """``table`` with some of its arrays replaced by int32 lists (or arrays, kept as given)."""
    return dataclasses.replace(
        table,
        **{
            name: value if isinstance(value, jax.Array) else jnp.asarray(value, jnp.int32)
            for name, value in arrays.items()
        },
    )


def _small_cache(**overrides) -> paged.KVCache:
    shape = dict(num_pages=POOL_PAGES, page_size=PAGE_SIZE, num_kv_heads=2, head_dim=8)
    shape.update(overrides)
    return paged.new_kv_cache(**shape, dtype=jnp.float32)


def _validate(table):
    paged.validate_page_table(table, POOL_PAGES)


def _decode(table):
    """The public entry point, which users call; it must reject the same tables."""
    q = jnp.ones((table.batch_size, 4, 8), jnp.float32)
    paged.decode_attention(q, _small_cache(), table, backend="reference")


BAD_TABLES = {
    "index past the pool": (
        {"page_indices": [3, 8, 5] + [0] * 13},
        "page_table.page_indices[1]=8 is outside the pool of 8 pages",
    ),
    "negative index": (
        {"page_indices": [3, 0, -1] + [0] * 13},
        "page_table.page_indices[2]=-1 is outside the pool of 8 pages",
    ),
    "indptr not starting at 0": (
        {"page_indptr": [1, 2, 3, 3]},
        "page_table.page_indptr must start at 0, got 1",
    ),
    "indptr decreasing": (
        {"page_indptr": [0, 2, 1, 3]},
        "page_table.page_indptr must be non-decreasing, but page_indptr[1]=2 > page_indptr[2]=1",
    ),
    "indptr past the indices": (
        {"page_indptr": [0, 2, 3, 17]},
        "page_table.page_indptr[-1]=17 exceeds len(page_indices)=16",
    ),
    "last_page_len 0 with pages": (
        {"last_page_len": [4, 0, 0]},
        "page_table.last_page_len[1]=0 must be in [1, 16]",
    ),
    "last_page_len above page_size": (
        {"last_page_len": [17, 5, 0]},
        "page_table.last_page_len[0]=17 must be in [1, 16]",
    ),
    "last_page_len of an empty request": (
        {"last_page_len": [4, 5, 3]},
        "page_table.last_page_len[2]=3 must be in 0 (the request has no pages)",
    ),
    "float indices": (
        {"page_indices": jnp.zeros(16, jnp.float32)},
        "page_table.page_indices must be int32, got float32",
    ),
    "2-D last_page_len": (
        {"last_page_len": [[4, 5, 0]]},
        "page_table.last_page_len must be 1-D, got shape (1, 3)",
    ),
    "indptr of the wrong length": (
        {"page_indptr": [0, 2, 3]},
        "page_table.page_indptr has shape (3,) but last_page_len has 3 requests",
    ),
}


@pytest.mark.parametrize("check", [_validate, _decode], ids=["validate_page_table", "decode"])
@pytest.mark.parametrize("case", list(BAD_TABLES))
def test_invalid_page_tables_raise_naming_argument_and_value(case, check):
    arrays, message = BAD_TABLES[case]
    bad = _with(_valid_table(), **arrays)
    with pytest.raises(ValueError, match=re.escape(message)):
        check(bad)


def test_the_valid_table_passes_both_checks():
    """The cases above fail because of their one change, not because the base table is bad."""
    _validate(_valid_table())
    _decode(_valid_table())


def test_batch_size_mismatch_is_reported():
    with pytest.raises(
        ValueError, match=re.escape("page_table describes 3 requests but the batch has 2")
    ):
        paged.validate_page_table(_valid_table(), POOL_PAGES, batch_size=2)


BAD_DECODE_INPUTS = {
    "head counts that do not divide": (
        dict(q=jnp.ones((3, 6, 8), jnp.float32), cache=_small_cache(num_kv_heads=4)),
        "q's num_q_heads=6 is not a multiple of the cache's num_kv_heads=4",
    ),
    "q dtype differs from the cache": (
        dict(q=jnp.ones((3, 4, 8), jnp.bfloat16)),
        "q dtype bfloat16 differs from the cache dtype float32",
    ),
    "k and v dtypes differ": (
        dict(
            cache=paged.KVCache(
                jnp.zeros((POOL_PAGES, 2, PAGE_SIZE, 8), jnp.float32),
                jnp.zeros((POOL_PAGES, 2, PAGE_SIZE, 8), jnp.bfloat16),
            )
        ),
        "cache.k_pages dtype float32 differs from cache.v_pages dtype bfloat16",
    ),
    "head_dim differs": (
        dict(q=jnp.ones((3, 4, 16), jnp.float32)),
        "q has head_dim 16 but the cache has 8",
    ),
    "q not 3-D or 4-D": (
        dict(q=jnp.ones((3, 32), jnp.float32)),
        "q must have shape [batch, num_q_heads, head_dim] or [batch, q_len, num_q_heads, "
        "head_dim], got (3, 32)",
    ),
    "batch differs from the table": (
        dict(q=jnp.ones((2, 4, 8), jnp.float32)),
        "page_table describes 3 requests but the batch has 2",
    ),
    "page size differs from the cache": (
        dict(cache=_small_cache(page_size=8)),
        "page_table.page_size=16 differs from the cache's page_size=8",
    ),
    "unknown layout": (
        dict(
            cache=paged.KVCache(
                jnp.zeros((POOL_PAGES, 2, PAGE_SIZE, 8)),
                jnp.zeros((POOL_PAGES, 2, PAGE_SIZE, 8)),
                "HDN",
            )
        ),
        "cache.layout must be one of ('HND', 'NHD'), got 'HDN'",
    ),
    "zero soft cap": (dict(logits_soft_cap=0.0), "logits_soft_cap must be > 0 or None, got 0.0"),
    "negative soft cap": (
        dict(logits_soft_cap=-30.0),
        "logits_soft_cap must be > 0 or None, got -30.0",
    ),
    "unknown backend": (dict(backend="cuda"), "backend must be one of"),
}


@pytest.mark.parametrize("case", list(BAD_DECODE_INPUTS))
def test_invalid_decode_inputs_raise_naming_argument_and_value(case):
    overrides, message = BAD_DECODE_INPUTS[case]
    arguments = dict(
        q=jnp.ones((3, 4, 8), jnp.float32),
        cache=_small_cache(),
        page_table=_valid_table(),
        backend="reference",
    )
    arguments.update(overrides)
    with pytest.raises(ValueError, match=re.escape(message)):
        paged.decode_attention(**arguments)


# --------------------------------------------------------------------------------------------
# jit: one compilation per bucket
# --------------------------------------------------------------------------------------------


def test_jitted_decode_compiles_once_per_bucket():
    """Lengths that change inside one padded bucket reuse the compiled decode; a bigger bucket
    compiles once more. Each call is also checked against the oracle, so a stale cache entry
    returning old values would fail too."""
    num_pool_pages, num_kv_heads, head_dim = 40, 2, 8
    traces = []

    @jax.jit
    def jitted_decode(q, cache, table):
        traces.append(table.page_indices.shape)  # runs only while tracing
        return paged.decode_attention(q, cache, table, backend="reference")

    rng = np.random.default_rng(0)
    shape = (num_pool_pages, num_kv_heads, PAGE_SIZE, head_dim)
    cache = paged.KVCache(
        jnp.asarray(rng.standard_normal(shape), jnp.float32),
        jnp.asarray(rng.standard_normal(shape), jnp.float32),
    )
    q = jnp.asarray(rng.standard_normal((3, 4, head_dim)), jnp.float32)
    pages = rng.permutation(num_pool_pages).tolist()
    # Default padding: 3, 7 and 16 pages all pad to 16 entries; 20 pages pad to 32.
    lengths_by_bucket = [
        ([1, 17, 0], 16),
        ([48, 33, 5], 16),
        ([100, 0, 140], 16),
        ([160, 150, 1], 32),
        ([1, 300, 16], 32),
    ]
    for lengths, expected_padding in lengths_by_bucket:
        table = paged.PageTable.from_seq_lens(lengths, PAGE_SIZE, pages=pages)
        assert table.page_indices.shape == (expected_padding,)
        o = jitted_decode(q, cache, table)
        o_ref, _ = paged_attention_oracle(
            q, cache.k_pages, cache.v_pages, "HND", table, sm_scale=head_dim**-0.5
        )
        assert relative_error(o, o_ref) < 1e-5
    assert traces == [(16,), (32,)]
    if hasattr(jitted_decode, "_cache_size"):  # private in jax 0.11.2; cross-checks the counter
        assert jitted_decode._cache_size() == 2
