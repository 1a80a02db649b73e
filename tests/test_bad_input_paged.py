"""What users get wrong with ``paged``, and x64 mode: each case raises a clear error or gives a
documented result.

- x64 mode (``jax.enable_x64(True)``, as researchers run float64 references): every public
  function works on both backends, float32 inputs give float32 results equal to the ones
  without x64, and float64 inputs stay on the reference (``backend="pallas"`` refuses them).
- ``plan_decode`` refuses tables whose work items would end before they start.
- ``append_kv`` and ``rope_append_kv`` refuse two tokens writing one (page, slot).
- Counts that are not ints, zero page sizes and empty merges raise errors naming the argument.
- The reference decode attention normalizes by the sum of max-subtracted exponentials, exact at
  logits far from 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged
from paged import KVCache, PagePool, PageTable

# Programs that run long (measured faster with optimizations (2026-12-07)): compiled with XLA's CPU
# optimizations (tests/conftest.py).
CPU_PROGRAMS_OPTIMIZED = True

BACKENDS = ("reference", "pallas")
PAGE_SIZE, NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM, NUM_POOL_PAGES = 4, 2, 4, 16, 16
SEQ_LENS = (9, 3)  # three pages and a partial last page; one partial page


def _random_cache(seed: int, dtype=np.float32) -> KVCache:
    rng = np.random.default_rng(seed)
    shape = (NUM_POOL_PAGES, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM)
    return KVCache(
        jnp.asarray(rng.standard_normal(shape), dtype),
        jnp.asarray(rng.standard_normal(shape), dtype),
    )


def _table(seq_lens=SEQ_LENS) -> PageTable:
    # Pages scattered over the pool, in no order.
    return PageTable.from_seq_lens(
        seq_lens, PAGE_SIZE, pages=[11, 2, 7, 5, 14, 0, 9, 3, 12, 6, 15, 1, 8, 4, 13, 10]
    )


def _queries(seed: int, q_len: int | None, dtype=np.float32) -> jax.Array:
    shape = (len(SEQ_LENS), NUM_Q_HEADS, HEAD_DIM)
    if q_len is not None:
        shape = (shape[0], q_len, *shape[1:])
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _same_without_and_with_x64(run):
    """``run()`` without x64, then with it: the outputs must have the same dtypes and values
    (float32 inputs compute in float32 either way, and the kernels run the same 32-bit
    program), bit for bit."""
    expected = jax.tree.map(np.asarray, run())
    with jax.enable_x64(True):
        got = jax.tree.map(np.asarray, run())
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        assert g.dtype == e.dtype
        np.testing.assert_array_equal(g, e)
    return got


# ------------------------------------------------------------------------------------------------
# x64 mode


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "q_len, split",
    [
        (None, False),  # plain decode, one work item a request (write_final)
        (None, True),  # split-KV: partial states and the merge kernel
        (3, True),  # speculative verification's causal query tile
        (17, False),  # past MAX_KERNEL_Q_LEN: the prefill kernel
    ],
)
def test_decode_attention_under_x64(backend, q_len, split):
    def run():
        # Built inside, so that x64 mode sees its own arrays (Python ints become int64 there).
        table = _table()
        cache = _random_cache(0)
        plan = paged.plan_decode(
            table, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, fixed_split_pages=1 if split else None
        )
        q = _queries(1, q_len)
        if q_len == 17:
            table = _table((20, 17))
            plan = None
        return paged.decode_attention(q, cache, table, plan=plan, return_lse=True, backend=backend)

    o, lse = _same_without_and_with_x64(run)
    assert np.isfinite(o).all() and np.isfinite(lse).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_jitted_decode_attention_under_x64(backend):
    """Under jit the table is traced: the traced default plan, built with x64 on."""
    step = jax.jit(lambda q, cache, table: paged.decode_attention(q, cache, table, backend=backend))
    _same_without_and_with_x64(lambda: step(_queries(2, None), _random_cache(3), _table()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_append_kv_under_x64(backend):
    def run():
        rng = np.random.default_rng(4)
        tokens = 3
        q = jnp.asarray(rng.standard_normal((tokens, NUM_Q_HEADS, HEAD_DIM)), jnp.float32)
        k, v = (
            jnp.asarray(rng.standard_normal((tokens, NUM_KV_HEADS, HEAD_DIM)), jnp.float32)
            for _ in range(2)
        )
        # jnp.array of Python ints: int64 under x64.
        positions, batch_indices = jnp.array([8, 7, 2]), jnp.array([0, 0, 1])
        q_rotated, cache = paged.rope_append_kv(
            q, k, v, positions, batch_indices, _random_cache(5), _table(), backend=backend
        )
        return q_rotated, cache.k_pages, cache.v_pages

    _same_without_and_with_x64(run)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_attention_under_x64(backend):
    def run():
        rng = np.random.default_rng(6)
        table = _table()
        new_tokens = 3

        def tokens(heads):
            shape = (len(SEQ_LENS), new_tokens, heads, HEAD_DIM)
            return jnp.asarray(rng.standard_normal(shape), jnp.float32)

        o, cache = paged.prefill_attention(
            tokens(NUM_Q_HEADS),
            tokens(NUM_KV_HEADS),
            tokens(NUM_KV_HEADS),
            _random_cache(7),
            table,
            chunk_size=2,
            rope=paged.RopeParams(),
            backend=backend,
        )
        return o, cache.k_pages

    _same_without_and_with_x64(run)


def test_host_and_reference_helpers_under_x64():
    def run():
        table = _table()
        cache = _random_cache(8)
        rng = np.random.default_rng(9)
        k = jnp.asarray(rng.standard_normal((2, NUM_KV_HEADS, HEAD_DIM)), jnp.float32)
        appended = paged.append_kv(cache, table, k, k, jnp.array([0, 1]), jnp.array([8, 2]))
        v = jnp.asarray(rng.standard_normal((2, 3, NUM_Q_HEADS, HEAD_DIM)), jnp.float32)
        s = jnp.asarray(rng.standard_normal((2, 3, NUM_Q_HEADS)), jnp.float32)
        plan = paged.plan_decode(table, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, fixed_split_pages=1)
        pool = PagePool(4)
        pages = pool.allocate(2)
        paged.validate_page_table(table, NUM_POOL_PAGES, batch_size=len(SEQ_LENS))
        paged.check_holds_new_tokens(table, 3, "3 new tokens")
        return (
            appended.k_pages,
            paged.merge_states(v, s),
            paged.merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1]),
            table.seq_lens(),
            table.num_pages(),
            paged.new_token_positions(table, 2),
            paged.truncated_page_table(table, [5, 1]).page_indices,
            [chunk.page_table.last_page_len for chunk in paged.prefill_chunks(table, 3, 2)],
            plan.work_page_start,
            plan.merge_indptr,
            paged.apply_rope(v[0], jnp.array([1, 5, 9]), paged.RopeParams()),
            paged.inverse_frequencies(HEAD_DIM, paged.RopeParams()),
            np.asarray(pages),
            paged.new_kv_cache(2, PAGE_SIZE, 1, HEAD_DIM, jnp.float32).k_pages,
            table.padded(32).page_indices,
        )

    got = _same_without_and_with_x64(run)
    # Index arrays stay int32 with x64 on (the page table's documented dtype).
    for index_array in got[3:10]:
        for leaf in jax.tree.leaves(index_array):
            assert leaf.dtype == np.int32


def test_float64_decode_stays_on_the_reference_and_pallas_refuses_it():
    with jax.enable_x64(True):
        cache = _random_cache(10, np.float64)
        q = _queries(11, None, np.float64)
        table = _table()
        expected = paged.decode_attention(q, cache, table, backend="reference")
        assert expected.dtype == jnp.float64
        np.testing.assert_array_equal(paged.decode_attention(q, cache, table), expected)
        with pytest.raises(ValueError, match="dtype float64: the kernels compute in 32 bits"):
            paged.decode_attention(q, cache, table, backend="pallas")


# ------------------------------------------------------------------------------------------------
# plan_decode: tables whose work items would end before they start


def _raw_table(indptr, last_page_len, num_indices=8) -> PageTable:
    return PageTable(
        page_indptr=np.asarray(indptr, np.int32),
        page_indices=np.arange(num_indices, dtype=np.int32),
        last_page_len=np.asarray(last_page_len, np.int32),
        page_size=PAGE_SIZE,
    )


@pytest.mark.parametrize(
    "indptr, last_page_len, message",
    [
        ([0, 3, 1, 4], [2, 2, 2], r"page_indptr\[1\]=3 > page_indptr\[2\]=1"),
        ([0, 2, 3], [2, 0], r"last_page_len\[1\]=0 must be in \[1, 4\]"),
        ([0, 2, 3], [5, 1], r"last_page_len\[0\]=5 must be in \[1, 4\]"),
        ([0, 0, 1], [3, 1], r"last_page_len\[0\]=3 must be in 0 \(the request has no pages\)"),
        ([1, 2, 3], [1, 1], r"page_indptr must start at 0, got 1"),
        ([0, 2, 9], [1, 1], r"page_indptr\[-1\]=9 exceeds len\(page_indices\)=8"),
    ],
)
def test_plan_decode_refuses_an_invalid_table(indptr, last_page_len, message):
    with pytest.raises(ValueError, match=message):
        paged.plan_decode(_raw_table(indptr, last_page_len), NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM)


@pytest.mark.parametrize(
    "argument, value, error, message",
    [
        ("min_chunk_pages", 0, ValueError, "min_chunk_pages must be >= 1, got 0"),
        ("max_grid", 0, ValueError, "max_grid must be >= 1, got 0"),
        ("num_work_items", -1, ValueError, "num_work_items must be >= 0, got -1"),
        (
            "fixed_split_pages",
            2.5,
            TypeError,
            r"fixed_split_pages must be an int or None, got 2\.5",
        ),
        ("min_chunk_pages", 1.5, TypeError, r"min_chunk_pages must be an int or None, got 1\.5"),
    ],
)
def test_plan_decode_refuses_bad_planner_arguments(argument, value, error, message):
    """A zero min_chunk_pages divided by zero; a float chunk failed inside range()."""
    with pytest.raises(error, match=message):
        paged.plan_decode(_table(), NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, **{argument: value})


def test_plan_decode_accepts_empty_requests():
    plan = paged.plan_decode(
        _raw_table([0, 0, 2, 2], [0, 3, 0]), NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM
    )
    real = int(plan.num_work_items)
    assert np.all(plan.work_page_end[:real] >= plan.work_page_start[:real])


# ------------------------------------------------------------------------------------------------
# append_kv, rope_append_kv: two tokens, one (page, slot)


def _shared_page_table() -> PageTable:
    """Two requests of 5 tokens whose second page (page 6) is the same page."""
    return PageTable.from_page_lists([[1, 6], [2, 6]], seq_lens=[5, 5], page_size=PAGE_SIZE)


def _new_tokens(count: int):
    rng = np.random.default_rng(12)
    k = jnp.asarray(rng.standard_normal((count, NUM_KV_HEADS, HEAD_DIM)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((count, NUM_Q_HEADS, HEAD_DIM)), jnp.float32)
    return q, k


COLLISION = r"tokens 0 \(batch_indices=0, positions=4\) and 1 \(batch_indices=1, positions=4\) " + (
    r"would both write page 6, slot 0: .*copy-on-write is the caller's job"
)


def test_append_kv_refuses_two_requests_writing_one_shared_slot():
    _, k = _new_tokens(2)
    with pytest.raises(ValueError, match=COLLISION):
        paged.append_kv(
            _random_cache(13), _shared_page_table(), k, k, jnp.array([0, 1]), jnp.array([4, 4])
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_append_kv_refuses_two_requests_writing_one_shared_slot(backend):
    q, k = _new_tokens(2)
    with pytest.raises(ValueError, match=COLLISION):
        paged.rope_append_kv(
            q,
            k,
            k,
            jnp.array([4, 4]),
            jnp.array([0, 1]),
            _random_cache(14),
            _shared_page_table(),
            backend=backend,
        )


def test_append_kv_writes_next_to_a_shared_read_only_page():
    """Sharing a page is fine as long as nobody writes it: the private pages take the writes."""
    table = PageTable.from_page_lists([[6, 1], [6, 2]], seq_lens=[5, 5], page_size=PAGE_SIZE)
    _, k = _new_tokens(2)
    cache = _random_cache(15)
    out = paged.append_kv(cache, table, k, k, jnp.array([0, 1]), jnp.array([4, 4]))
    np.testing.assert_array_equal(out.k_pages[1, :, 0], k[0])
    np.testing.assert_array_equal(out.k_pages[2, :, 0], k[1])
    np.testing.assert_array_equal(out.k_pages[6], cache.k_pages[6])


# ------------------------------------------------------------------------------------------------
# Uninformative errors made clear


def test_page_table_from_seq_lens_refuses_page_size_zero_and_non_ints():
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        PageTable.from_seq_lens([5], 0)
    with pytest.raises(TypeError, match=r"page_size must be an int, got 2\.5"):
        PageTable.from_seq_lens([5], 2.5)
    with pytest.raises(ValueError, match="page_size must be >= 1, got -4"):
        PageTable.from_page_lists([[0]], [1], -4)


def test_page_pool_refuses_counts_that_are_not_positive_ints():
    with pytest.raises(TypeError, match=r"num_pages must be an int, got 2\.5"):
        PagePool(2.5)
    with pytest.raises(TypeError, match="num_pages must be an int, got True"):
        PagePool(True)
    with pytest.raises(ValueError, match="num_pages must be >= 1, got 0"):
        PagePool(0)
    pool = PagePool(np.int64(4))  # a NumPy int is an int
    with pytest.raises(TypeError, match=r"n must be an int, got 1\.5"):
        pool.allocate(1.5)
    with pytest.raises(TypeError, match=r"a page must be an int, got 0\.0"):
        pool.free([0.0])
    assert pool.num_free == 4


def test_merge_states_refuses_zero_states():
    with pytest.raises(ValueError, match=r"at least one state, but v \(2, 0, 4, 8\) has S=0"):
        paged.merge_states(jnp.zeros((2, 0, 4, 8)), jnp.zeros((2, 0, 4)))


# ------------------------------------------------------------------------------------------------
# The reference at extreme logits


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_equal_extreme_logits_average_exactly(dtype, backend):
    """Two keys with equal logits near -46341 (q = 64, k = -64, head_dim 128): the answer is the
    mean of the values, 1 exactly. Weighting by exp(logits - lse) gave 1.00174 (float32) and
    1.00195 (float16): lse's rounding step there is 0.004."""
    head_dim = 128
    shape = (1, 1, 2, head_dim)  # one page of two slots, one KV head
    cache = KVCache(jnp.full(shape, -64, dtype), jnp.ones(shape, dtype))
    table = PageTable.from_seq_lens([2], page_size=2)
    q = jnp.full((1, 1, head_dim), 64, dtype)
    o, lse = paged.decode_attention(q, cache, table, return_lse=True, backend=backend)
    np.testing.assert_array_equal(np.asarray(o, np.float64), 1.0)
    logit = -64 * 64 * head_dim / np.sqrt(head_dim)
    np.testing.assert_allclose(lse, logit + np.log(2), rtol=1e-7)
