"""The fused paged decode kernel (and its merge) against the float64 reference.

On a CPU the kernels run in Pallas interpret mode on small shapes; on a GPU the same tests run
compiled, plus the ``gpu``-marked ones at benchmark shapes. Error measure:
``||out - ref|| / ||ref||`` with the reference in float64 on the same (rounded) inputs; bounds
from ``testing.md``: float32 < 1e-5, bfloat16 < 1e-2.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import paged
from bench.suites import peers
from kernels_pallas import paged_decode_tuning as tuning
from kernels_pallas import platform
from kernels_pallas.merge_states import merge_partial_states
from kernels_pallas.paged_decode import paged_decode, partial_rows
from paged import decode as decode_module
from paged.attention_reference import decode_attention_reference
from paged.plan import traced_default_plan
from tests.conftest import ON_GPU, enable_x64

PAGE_SIZE = 16
# Pairwise cover of layout x group size x head_dim x dtype (every pair appears at least once).
CONFIGS = [
    ("HND", 1, 64, jnp.float32),
    ("HND", 4, 128, jnp.bfloat16),
    ("HND", 8, 64, jnp.bfloat16),
    ("NHD", 1, 128, jnp.bfloat16),
    ("NHD", 4, 64, jnp.float32),
    ("NHD", 8, 128, jnp.float32),
]
# One token, a full page, a page plus one, empty, thousands, lengths that do not divide a split.
RAGGED_LENS = (1, 16, 17, 0, 2000, 45, 33)
NUM_KV_HEADS = 2
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def make_inputs(
    seed,
    lens,
    layout,
    group,
    head_dim,
    dtype,
    num_pool_pages=192,
    num_kv_heads=2,
    *,
    q_len=None,
    first_page=0,
):
    """Random q and pool (never zeros), pages scattered over the pool in random order.

    ``q`` is ``[B, H, D]``, or ``[B, q_len, H, D]`` when ``q_len`` is given; pages below
    ``first_page`` are never listed (``first_page=1`` keeps page 0 out of every request)."""
    rng = np.random.default_rng(seed)
    pages = first_page + rng.permutation(num_pool_pages - first_page)
    table = paged.PageTable.from_seq_lens(lens, PAGE_SIZE, pages=pages.tolist())
    if layout == "HND":
        shape = (num_pool_pages, num_kv_heads, PAGE_SIZE, head_dim)
    else:
        shape = (num_pool_pages, PAGE_SIZE, num_kv_heads, head_dim)
    cache = paged.KVCache(
        jnp.asarray(rng.standard_normal(shape), dtype),
        jnp.asarray(rng.standard_normal(shape), dtype),
        layout,
    )
    tokens = () if q_len is None else (q_len,)
    q_shape = (len(lens), *tokens, num_kv_heads * group, head_dim)
    q = jnp.asarray(rng.standard_normal(q_shape) * 2.0, dtype)
    return q, cache, table


# The float64 reference through jit: called eagerly, its lax.map over requests compiles anew on
# every call (about three compilations); jitted, once per shape and soft cap.
_decode_attention_reference_jit = jax.jit(
    decode_attention_reference, static_argnames=("sm_scale", "logits_soft_cap")
)


def reference64(q, cache, table, soft_cap=None):
    """The reference in float64 on the same rounded inputs: (o, lse) as NumPy arrays."""
    with enable_x64():
        cache64 = paged.KVCache(
            cache.k_pages.astype(jnp.float64), cache.v_pages.astype(jnp.float64), cache.layout
        )
        o, lse = _decode_attention_reference_jit(
            q.astype(jnp.float64),
            cache64,
            table,
            sm_scale=float(1.0 / np.sqrt(q.shape[-1])),
            logits_soft_cap=soft_cap,
        )
        return np.asarray(o), np.asarray(lse)


def relative_error(out, ref):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(out)), "kernel output has NaN or inf"
    if not np.any(ref):  # an all-empty batch: the output must be exactly zero
        return float(np.max(np.abs(out), initial=0.0))
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def check_against_reference(q, cache, table, lens, plan=None, soft_cap=None):
    o, lse = paged.decode_attention(
        q, cache, table, return_lse=True, plan=plan, backend="pallas", logits_soft_cap=soft_cap
    )
    ref_o, ref_lse = reference64(q, cache, table, soft_cap)
    assert o.dtype == q.dtype and lse.dtype == jnp.float32
    assert relative_error(o, ref_o) < TOLERANCE[q.dtype.type]
    empty = np.array(lens) == 0
    lse = np.asarray(lse)
    assert np.all(np.asarray(o)[empty] == 0)
    assert np.all(np.isneginf(lse[empty]))
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout,group,head_dim,dtype", CONFIGS)
@pytest.mark.parametrize("split", ["planner", "fixed3", "no_split"])
def test_kernel_matches_reference(layout, group, head_dim, dtype, split):
    q, cache, table = make_inputs(0, RAGGED_LENS, layout, group, head_dim, dtype)
    num_q_heads = q.shape[1]
    if split == "planner":
        plan = paged.plan_decode(table, num_q_heads, NUM_KV_HEADS, head_dim)
    elif split == "fixed3":  # 3 pages: splits that divide no length above
        plan = paged.plan_decode(table, num_q_heads, NUM_KV_HEADS, head_dim, fixed_split_pages=3)
    else:
        plan = paged.plan_decode(table, num_q_heads, NUM_KV_HEADS, head_dim, max_grid=1)
        assert plan.write_final
    check_against_reference(q, cache, table, RAGGED_LENS, plan=plan)


@pytest.mark.parametrize("soft_cap", [None, 3.0])
def test_traced_default_plan_and_soft_cap(soft_cap):
    """Under jit the table is traced: the static default split runs and still matches."""
    q, cache, table = make_inputs(1, RAGGED_LENS, "HND", 4, 64, jnp.float32)
    decode = jax.jit(
        lambda q, cache, table: paged.decode_attention(
            q, cache, table, return_lse=True, backend="pallas", logits_soft_cap=soft_cap
        )
    )
    o, lse = decode(q, cache, table)
    ref_o, ref_lse = reference64(q, cache, table, soft_cap)
    assert relative_error(o, ref_o) < 1e-5
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
    assert np.all(np.isneginf(np.asarray(lse)[~finite]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fixed_split_is_batch_invariant_bit_for_bit(dtype):
    """With fixed_split_pages, a request's output does not depend on its batch neighbours: each
    request alone equals itself inside the batch, bit for bit (request 2 has 16 chunks, more
    than the merge folds in one step, and sits at another offset alone than in the batch)."""
    lens = (300, 7, 1000)
    q, cache, table = make_inputs(2, lens, "HND", 4, 128, dtype)
    full = paged.decode_attention(
        q,
        cache,
        table,
        backend="pallas",
        plan=paged.plan_decode(table, q.shape[1], NUM_KV_HEADS, 128, fixed_split_pages=4),
    )
    pages = table.page_lists()
    for b in range(len(lens)):
        alone_table = paged.PageTable.from_page_lists([pages[b]], [lens[b]], PAGE_SIZE)
        alone = paged.decode_attention(
            q[b : b + 1],
            cache,
            alone_table,
            backend="pallas",
            plan=paged.plan_decode(alone_table, q.shape[1], NUM_KV_HEADS, 128, fixed_split_pages=4),
        )
        assert np.array_equal(np.asarray(full[b]), np.asarray(alone[0])), b


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_unused_slots_holding_nan_never_reach_the_output(layout):
    """Stale data in page tails and unlisted pages (here NaN) must be masked, never weighted 0."""
    lens = (1, 17, 0, 40)
    q, cache, table = make_inputs(4, lens, layout, 4, 64, jnp.float32, num_pool_pages=32)
    k = np.full(cache.k_pages.shape, np.nan, np.float32)
    v = np.full(cache.v_pages.shape, np.nan, np.float32)
    real_k, real_v = np.asarray(cache.k_pages), np.asarray(cache.v_pages)
    for b, pages in enumerate(table.page_lists()):
        for j, page in enumerate(pages):
            filled = min(PAGE_SIZE, lens[b] - j * PAGE_SIZE)
            if layout == "HND":
                k[page, :, :filled], v[page, :, :filled] = (
                    real_k[page, :, :filled],
                    real_v[page, :, :filled],
                )
            else:
                k[page, :filled], v[page, :filled] = real_k[page, :filled], real_v[page, :filled]
    poisoned = paged.KVCache(jnp.asarray(k), jnp.asarray(v), layout)
    clean = paged.decode_attention(q, cache, table, backend="pallas")
    for fixed in (None, 1):
        plan = paged.plan_decode(table, q.shape[1], NUM_KV_HEADS, 64, fixed_split_pages=fixed)
        out = paged.decode_attention(q, poisoned, table, plan=plan, backend="pallas")
        assert np.all(np.isfinite(np.asarray(out)))
        np.testing.assert_allclose(np.asarray(out), np.asarray(clean), rtol=1e-5, atol=1e-6)


def test_plans_inside_a_bucket_compile_once():
    """Changing lengths inside a bucket changes plan values, not shapes: one compilation."""
    traces = []

    @jax.jit
    def decode(q, cache, table, plan):
        traces.append(1)
        return paged.decode_attention(q, cache, table, plan=plan, backend="pallas")

    for seed, lens in enumerate([(5, 40, 17), (100, 1, 60), (33, 34, 35)]):
        q, cache, table = make_inputs(seed, lens, "HND", 4, 64, jnp.float32, num_pool_pages=48)
        table = table.padded(32)
        plan = paged.plan_decode(
            table, q.shape[1], NUM_KV_HEADS, 64, fixed_split_pages=2, num_work_items=64
        )
        decode(q, cache, table, plan).block_until_ready()
    assert len(traces) == 1


def test_plan_for_another_batch_is_rejected():
    q, cache, table = make_inputs(3, (5, 40), "HND", 4, 64, jnp.float32)
    other = paged.PageTable.from_seq_lens([5, 40, 3], PAGE_SIZE)
    plan = paged.plan_decode(other, q.shape[1], NUM_KV_HEADS, 64)
    with pytest.raises(ValueError, match="plan was made for 3 requests but the batch has 2"):
        paged.decode_attention(q, cache, table, plan=plan, backend="pallas")


def test_plan_decode_rejects_traced_tables_and_bad_splits():
    table = paged.PageTable.from_seq_lens([5, 40], PAGE_SIZE)
    with pytest.raises(ValueError, match="fixed_split_pages must be >= 1, got 0"):
        paged.plan_decode(table, 8, 2, 64, fixed_split_pages=0)
    with pytest.raises(ValueError, match="num_q_heads=6 must be a positive multiple"):
        paged.plan_decode(table, 6, 4, 64)
    with pytest.raises(ValueError, match="needs concrete page-table arrays"):
        jax.jit(lambda t: paged.plan_decode(t, 8, 2, 64).chunk_pages)(table)


def test_planner_follows_the_grid_rule():
    """No split when the requests x KV heads fill the grid; otherwise the smallest chunk (not
    below min_chunk_pages) whose programs fit the grid."""

    def programs(pages, chunk):
        return int(np.sum(-(-np.asarray(pages) // chunk))) * 8

    for lens in ([4096], [4096, 100, 30000], [700] * 5):
        table = paged.PageTable.from_seq_lens(lens, PAGE_SIZE)
        pages = np.diff(np.asarray(table.page_indptr))
        plan = paged.plan_decode(
            table, 32, 8, 128, max_grid=264, min_chunk_pages=8, kernel="paged_decode"
        )
        chunk = int(plan.chunk_pages)
        assert programs(pages, chunk) <= 264
        assert chunk == 8 or programs(pages, chunk - 1) > 264  # the smallest that fits
        assert plan.splits_per_request().tolist() == (-(-pages // chunk)).tolist()
    many = paged.PageTable.from_seq_lens([1024] * 64, PAGE_SIZE)
    plan = paged.plan_decode(many, 32, 8, 128, max_grid=264)
    assert plan.write_final and plan.splits_per_request().tolist() == [1] * 64


@given(
    pages=st.lists(st.integers(0, 3000), min_size=1, max_size=80),
    num_kv_heads=st.sampled_from([1, 2, 8]),
    max_grid=st.integers(1, 300),
    min_chunk=st.integers(1, 16),
    max_splits=st.integers(0, 16),
)
def test_chunk_choice_is_the_rules_in_python_and_numpy(
    pages, num_kv_heads, max_grid, min_chunk, max_splits
):
    """choose_chunk_pages counts programs in Python ints for small batches and in NumPy for
    large ones (a speed choice): both give the chunk of the rule (module docstring of
    paged/plan.py), found here by trying every chunk."""
    from paged import plan as plan_module

    lengths = np.asarray(pages, np.int32)
    kwargs = dict(max_grid=max_grid, min_chunk_pages=min_chunk, max_splits_per_request=max_splits)
    chosen = []
    for threshold in (0, len(pages)):  # NumPy, then Python
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(plan_module, "PYTHON_COUNT_MAX_REQUESTS", threshold)
            chosen.append(plan_module.choose_chunk_pages(lengths, num_kv_heads, **kwargs))
    longest = max(pages)
    if longest == 0:
        expected = 1
    elif np.count_nonzero(lengths) * num_kv_heads >= max_grid or longest <= min_chunk:
        expected = longest
    else:
        programs = lambda chunk: sum(-(-n // chunk) for n in pages) * num_kv_heads
        expected = next(c for c in range(min_chunk, longest + 1) if programs(c) <= max_grid)
        if max_splits:
            expected = max(expected, -(-longest // max_splits))
    assert chosen == [expected, expected]


def test_planner_caps_splits_a_request_for_the_mosaic_gpu_kernel(monkeypatch):
    """For the Mosaic GPU kernel a request is cut into 16 items at most (measured faster at one
    request), the grid rule's smaller chunk otherwise; the Triton kernel's plan is the grid
    rule's; the default follows what backend="auto" runs on the platform."""
    from paged import plan as plan_module

    one = paged.PageTable.from_seq_lens([32768 - 3], PAGE_SIZE)  # 2048 pages
    grid = paged.plan_decode(one, 32, 8, 128, max_grid=264, kernel="paged_decode")
    capped = paged.plan_decode(one, 32, 8, 128, max_grid=264, kernel="paged_decode_mgpu")
    assert grid.splits_per_request().tolist() == [33]
    assert int(capped.chunk_pages) == 128 and capped.splits_per_request().tolist() == [16]
    four = paged.PageTable.from_seq_lens([4096] * 4, PAGE_SIZE)  # the grid rule's 8 splits stay
    for kernel in ("paged_decode", "paged_decode_mgpu"):
        plan = paged.plan_decode(four, 32, 8, 128, max_grid=264, kernel=kernel)
        assert plan.splits_per_request().tolist() == [8] * 4
    with pytest.raises(ValueError, match=r"kernel must be one of .* got 'triton'"):
        paged.plan_decode(one, 32, 8, 128, kernel="triton")
    monkeypatch.setattr(plan_module, "on_gpu", lambda: False)
    assert plan_module.default_planned_kernel() == "paged_decode"
    monkeypatch.setattr(plan_module, "on_gpu", lambda: True)
    assert plan_module.default_planned_kernel() == "paged_decode_mgpu"
    assert paged.plan_decode(one, 32, 8, 128, max_grid=264).splits_per_request().tolist() == [16]
    monkeypatch.setattr(paged.decode, "AUTO_PICKS_MOSAIC_GPU_DECODE", False)
    assert plan_module.default_planned_kernel() == "paged_decode"


def test_auto_backend_and_kill_switch(monkeypatch):
    """auto = pallas on a GPU, reference elsewhere; DECODELAB_BACKEND=reference forces it."""
    monkeypatch.setattr(platform, "on_gpu", lambda: True)
    assert platform.resolve_backend("auto") == "pallas"
    monkeypatch.setenv("DECODELAB_BACKEND", "reference")
    assert platform.resolve_backend("auto") == "reference"
    assert platform.resolve_backend("pallas") == "pallas"  # an explicit argument wins
    monkeypatch.setenv("DECODELAB_BACKEND", "fast")
    with pytest.raises(ValueError, match="DECODELAB_BACKEND must be 'reference' or unset"):
        platform.resolve_backend("auto")
    with pytest.raises(ValueError, match="backend must be one of"):
        platform.resolve_backend("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("batch,context", [(1, 32768), (4, 4096), (32, 4096), (256, 512)])
def test_benchmark_shapes_on_gpu(layout, batch, context):
    """Compiled, at the benchmark's shapes: 32 query heads, 8 KV heads, head_dim 128, bf16."""
    assert ON_GPU
    lens = [context] * batch
    lens[0] = context - 5  # a ragged tail
    pages_needed = sum(-(-n // PAGE_SIZE) for n in lens)
    q, cache, table = make_inputs(
        7, lens, layout, 4, 128, jnp.bfloat16, num_pool_pages=pages_needed + 64, num_kv_heads=8
    )
    o, lse = paged.decode_attention(q, cache, table, return_lse=True, backend="pallas")
    ref_o, ref_lse = decode_attention_reference(
        q.astype(jnp.float32),
        paged.KVCache(cache.k_pages.astype(jnp.float32), cache.v_pages.astype(jnp.float32), layout),
        table,
        sm_scale=1.0 / np.sqrt(128),
    )
    assert relative_error(o, np.asarray(ref_o, np.float64)) < 1e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-4, atol=1e-3)


def test_a_stale_plan_is_rejected():
    """A plan made before the table grew (last step's plan) would attend over the wrong tokens."""
    q, cache, table = make_inputs(5, (40, 300), "HND", 4, 64, jnp.float32)
    plan = paged.plan_decode(table, q.shape[1], NUM_KV_HEADS, 64)
    grown = paged.PageTable.from_page_lists(table.page_lists(), [41, 301], PAGE_SIZE)
    with pytest.raises(ValueError, match="the plan is stale"):
        paged.decode_attention(q, cache, grown, plan=plan, backend="pallas")
    longer = paged.PageTable.from_seq_lens([400, 900], PAGE_SIZE)
    other_plan = paged.plan_decode(longer, q.shape[1], NUM_KV_HEADS, 64)
    with pytest.raises(ValueError, match="plan"):
        paged.decode_attention(q, cache, table, plan=other_plan, backend="pallas")


def test_invalid_tables_under_jit_stay_inside_the_arrays():
    """Under jit nothing is validated; the kernel clamps instead of reading past its arrays.
    A request whose table is wrong gets a wrong but finite answer; the others are unaffected."""
    q, cache, table = make_inputs(6, (20, 33, 50), "HND", 4, 64, jnp.float32, num_pool_pages=16)
    good = np.asarray(paged.decode_attention(q, cache, table, backend="pallas"))
    bad_indices = table.page_indices.at[0].set(1000)  # request 0's first page: outside the pool
    bad_last = table.last_page_len.at[1].set(PAGE_SIZE + 4)  # request 1: beyond a page
    bad = paged.PageTable(table.page_indptr, bad_indices, bad_last, PAGE_SIZE)
    decode = jax.jit(lambda q, c, t: paged.decode_attention(q, c, t, backend="pallas"))
    out = np.asarray(decode(q, cache, bad))
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out[2], good[2], rtol=1e-5, atol=1e-6)
    broken_plan = paged.plan_decode(table, q.shape[1], NUM_KV_HEADS, 64)
    broken_plan = dataclasses.replace(
        broken_plan,
        work_request=jnp.asarray(broken_plan.work_request).at[0].set(7),  # outside the batch
        work_page_end=jnp.asarray(broken_plan.work_page_end).at[1].set(10_000),  # past the pages
    )
    decode_with = jax.jit(
        lambda q, c, t, p: paged.decode_attention(q, c, t, plan=p, backend="pallas")
    )
    out = np.asarray(decode_with(q, cache, table, broken_plan))
    # Request 0 lost its only work item (its rows are left unwritten); request 1's range was cut
    # to page_indices (a wrong but finite answer); request 2 is untouched.
    assert np.all(np.isfinite(out[1]))
    np.testing.assert_allclose(out[2], good[2], rtol=1e-5, atol=1e-6)


def test_empty_batch():
    q = jnp.ones((0, 8, 64), jnp.float32)
    cache = paged.new_kv_cache(4, PAGE_SIZE, NUM_KV_HEADS, 64, jnp.float32)
    table = paged.PageTable.from_seq_lens([], PAGE_SIZE)
    o, lse = paged.decode_attention(q, cache, table, return_lse=True, backend="pallas")
    assert o.shape == (0, 8, 64) and lse.shape == (0, 8)


def test_merge_kernel_directly():
    """merge_partial_states against paged.merge_states: more than one fold step of items, all-empty
    requests, large log-sum-exp spreads, a group that is not a power of two (rows padded)."""
    rng = np.random.default_rng(8)
    num_kv_heads, group, head_dim = 2, 3, 32
    partial_rows = 4  # 3 padded to a power of two
    counts = [11, 1, 3, 2]  # request 0 needs two fold steps of eight
    num_work = 32
    o = rng.standard_normal((num_work, num_kv_heads, partial_rows, head_dim)).astype(np.float32)
    lse = (rng.standard_normal((num_work, num_kv_heads, partial_rows)) * 30).astype(np.float32)
    lse[11] = -np.inf  # request 1's only item is empty: zeros and -inf expected
    lse[12, :, :] = 80.0  # a spread of ~80 against request 2's other items
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    out, out_lse = merge_partial_states(
        jnp.asarray(o),
        jnp.asarray(lse),
        jnp.asarray(indptr),
        num_q_heads=num_kv_heads * group,
        out_dtype=jnp.float32,
        interpret=not ON_GPU,
    )
    out = np.asarray(out).reshape(len(counts), num_kv_heads, group, head_dim)
    out_lse = np.asarray(out_lse).reshape(len(counts), num_kv_heads, group)
    for b in range(len(counts)):
        items = slice(indptr[b], indptr[b + 1])
        # merge_states wants [..., S, H, D]: put the KV head first and the items next.
        expected, expected_lse = paged.merge_states(
            jnp.asarray(o[items, :, :group].transpose(1, 0, 2, 3)),
            jnp.asarray(lse[items, :, :group].transpose(1, 0, 2)),
        )
        np.testing.assert_allclose(out[b], np.asarray(expected), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out_lse[b], np.asarray(expected_lse), rtol=1e-6)
    assert np.all(out[1] == 0) and np.all(np.isneginf(out_lse[1]))


def test_traced_plan_without_splits_writes_final(monkeypatch):
    """Under jit with batch x KV heads filling the (here tiny) grid, the traced plan does not
    split and the kernel writes final outputs directly."""
    monkeypatch.setattr(tuning, "num_sms", lambda: 1)
    q, cache, table = make_inputs(9, (5, 40, 0), "HND", 4, 64, jnp.float32)
    plan = jax.jit(lambda t: traced_default_plan(t, q.shape[1], NUM_KV_HEADS, 64))(table)
    assert plan.write_final
    decode = jax.jit(lambda q, c, t: paged.decode_attention(q, c, t, backend="pallas"))
    ref_o, _ = reference64(q, cache, table)
    assert relative_error(decode(q, cache, table), ref_o) < 1e-5


def test_auto_runs_the_kernel_on_a_gpu(monkeypatch):
    """backend="auto" routes to the kernel when a GPU is present (simulated, kernel interpreted),
    and to the reference under the kill switch or for shapes the kernel cannot run."""
    calls = []
    real_kernel = decode_module.paged_decode
    monkeypatch.setattr(platform, "on_gpu", lambda: True)
    monkeypatch.setattr(decode_module, "interpret_mode", lambda: True)
    monkeypatch.setattr(
        decode_module, "paged_decode", lambda *a, **k: calls.append(1) or real_kernel(*a, **k)
    )
    q, cache, table = make_inputs(10, (5, 40), "HND", 4, 64, jnp.float32)
    paged.decode_attention(q, cache, table)
    assert calls == [1]
    monkeypatch.setenv("DECODELAB_BACKEND", "reference")
    paged.decode_attention(q, cache, table)
    assert calls == [1]
    monkeypatch.delenv("DECODELAB_BACKEND")
    q48, cache48, table48 = make_inputs(10, (5, 40), "HND", 4, 48, jnp.float32)
    paged.decode_attention(q48, cache48, table48)  # head_dim 48: auto falls back
    assert calls == [1]
    with pytest.raises(ValueError, match="head_dim=48 is not a power of two"):
        paged.decode_attention(q48, cache48, table48, backend="pallas")


def test_traced_sm_scale_is_rejected_with_its_name():
    q, cache, table = make_inputs(11, (5, 40), "HND", 4, 64, jnp.float32)
    decode = jax.jit(
        lambda q, s: paged.decode_attention(q, cache, table, sm_scale=s, backend="pallas")
    )
    with pytest.raises(ValueError, match="sm_scale must be a Python float"):
        decode(q, 0.1)


# --------------------------------------------------------------------------------------------
# Several new tokens per request (speculative verification): rows = q_len x group, causal


def make_multi_token_inputs(seed, lens, q_len, layout, group, head_dim, dtype, num_pool_pages=32):
    """``make_inputs`` with ``q [B, q_len, H, D]``."""
    _, cache, table = make_inputs(seed, lens, layout, group, head_dim, dtype, num_pool_pages)
    rng = np.random.default_rng(seed + 1)
    shape = (len(lens), q_len, NUM_KV_HEADS * group, head_dim)
    return jnp.asarray(rng.standard_normal(shape) * 2.0, dtype), cache, table


def check_multi_token(q, cache, table, plan=None, soft_cap=None, decode=None):
    """The kernel against the float64 reference, per query token: a query that sees no key
    (an empty request, or under jit a position before 0) gets exactly 0 and -inf."""
    decode = decode or functools.partial(paged.decode_attention, plan=plan)
    o, lse = decode(q, cache, table, return_lse=True, backend="pallas", logits_soft_cap=soft_cap)
    ref_o, ref_lse = reference64(q, cache, table, soft_cap)
    assert o.shape == q.shape and lse.shape == q.shape[:-1]
    assert o.dtype == q.dtype and lse.dtype == jnp.float32
    assert relative_error(o, ref_o) < TOLERANCE[q.dtype.type]
    lse, sees_nothing = np.asarray(lse), np.isneginf(ref_lse)
    assert np.all(np.asarray(o)[sees_nothing] == 0)
    assert np.all(np.isneginf(lse[sees_nothing]))
    np.testing.assert_allclose(lse[~sees_nothing], ref_lse[~sees_nothing], rtol=1e-5, atol=1e-5)


# (q_len, group, layout, dtype, head_dim): q_len 1 (as 4-D), 2, 5, 9 and the kernel's maximum 16;
# groups 1 and 4 (tiles of 16 to 64 rows); each layout and dtype with several of them.
MULTI_TOKEN_CONFIGS = [
    (1, 4, "HND", jnp.float32, 32),
    (2, 1, "NHD", jnp.bfloat16, 32),
    (5, 4, "NHD", jnp.float32, 32),
    (9, 1, "HND", jnp.bfloat16, 64),
    (9, 4, "HND", jnp.float32, 32),
    (16, 4, "NHD", jnp.bfloat16, 32),
]


@pytest.mark.parametrize("q_len,group,layout,dtype,head_dim", MULTI_TOKEN_CONFIGS)
@pytest.mark.parametrize("split", ["fixed1", "no_split"])
def test_multi_token_kernel_matches_reference(q_len, group, layout, dtype, head_dim, split):
    """Ragged lengths from exactly q_len up; with one-page chunks the last chunk of 33 or 17
    tokens holds 1 key, so the causal bound cuts into the chunk before it as well."""
    lens = [q_len, 0, max(17, q_len), 33, 70]
    q, cache, table = make_multi_token_inputs(q_len, lens, q_len, layout, group, head_dim, dtype)
    if split == "fixed1":
        plan = paged.plan_decode(table, q.shape[2], NUM_KV_HEADS, head_dim, fixed_split_pages=1)
    else:
        plan = paged.plan_decode(table, q.shape[2], NUM_KV_HEADS, head_dim, max_grid=1)
        assert plan.write_final
    check_multi_token(q, cache, table, plan=plan)


def test_multi_token_under_jit_with_the_traced_plan_and_soft_cap():
    """The traced default split and a soft cap; a request of 2 tokens with q_len 5 (which only
    jit lets through) gets 0 and -inf for its queries before position 0, like the reference."""
    q, cache, table = make_multi_token_inputs(20, [2, 40, 0, 21], 5, "HND", 4, 32, jnp.float32)
    decode = jax.jit(
        paged.decode_attention, static_argnames=("return_lse", "backend", "logits_soft_cap")
    )
    check_multi_token(q, cache, table, soft_cap=3.0, decode=decode)


def test_one_new_token_as_4d_equals_3d_bit_for_bit():
    q, cache, table = make_inputs(21, (5, 40, 0, 17), "NHD", 4, 32, jnp.float32, num_pool_pages=32)
    plan = paged.plan_decode(table, q.shape[1], NUM_KV_HEADS, 32, fixed_split_pages=1)
    three = paged.decode_attention(q, cache, table, plan=plan, return_lse=True, backend="pallas")
    four = paged.decode_attention(
        q[:, None], cache, table, plan=plan, return_lse=True, backend="pallas"
    )
    for a, b in zip(three, four, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[:, 0])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Pallas Triton backend's
def test_decode_kernel_lowers_to_triton_for_an_h200(monkeypatch, verify_triton_modules):
    """As far as a CPU can follow the GPU path: at the benchmark's head shape (32/8 heads,
    head_dim 128, bfloat16), the kernel lowers to a Triton call for an H200 for one new token
    and for q_len up to the maximum, final and partial, with the launch parameters the public
    API would use, and the merge lowers for q_len x H rows. Compiling needs the GPU."""
    gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
    h200 = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
    monkeypatch.setitem(gpu_info.registry, jax.devices()[0].device_kind, lambda: h200)
    batch, num_pages, num_work = 4, 1024, 64
    pool = jax.ShapeDtypeStruct((num_pages, 8, PAGE_SIZE, 128), jnp.bfloat16)
    int32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    work = [int32((num_work,))] * 4
    table = dict(page_indptr=int32((batch + 1,)), last_page_len=int32((batch,)))
    for q_len in (1, 2, 9, decode_module.MAX_KERNEL_Q_LEN):
        q_shape = (batch, 32, 128) if q_len == 1 else (batch, q_len, 32, 128)
        q = jax.ShapeDtypeStruct(q_shape, jnp.bfloat16)
        for write_final in (True, False):
            params = tuning.kernel_parameters(128, 4, write_final, True)
            if q_len > 1:
                params = tuning.multi_token_parameters(params, q_len * 4, PAGE_SIZE)
            lowered = paged_decode.trace(
                q,
                pool,
                pool,
                int32((num_pages,)),
                *work,
                **table,
                layout="HND",
                sm_scale=0.088,
                logits_soft_cap=None,
                write_final=write_final,
                **params,
            )
            text = lowered.lower(lowering_platforms=("cuda",)).as_text()
            suffix = (f"_q{q_len}" if q_len > 1 else "") + ("_final" if write_final else "_partial")
            names = peers.triton_kernel_names(text, "paged_decode")
            assert len(names) == 1 and names[0].endswith(suffix), (q_len, write_final, names)
        rows = partial_rows(q_len * 4)
        merge = merge_partial_states.trace(
            jax.ShapeDtypeStruct((num_work, 8, rows, 128), jnp.float32),
            jax.ShapeDtypeStruct((num_work, 8, rows), jnp.float32),
            int32((batch + 1,)),
            num_q_heads=q_len * 32,
            out_dtype=jnp.bfloat16,
        )
        assert "__gpu$xla.gpu.triton" in merge.lower(lowering_platforms=("cuda",)).as_text()
