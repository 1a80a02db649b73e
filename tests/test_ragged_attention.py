"""Ragged attention (``paged/ragged_attention.py``) and its Mosaic GPU prototype kernel
(``kernels_pallas/ragged_attention_mgpu.py``).

The reference is tied to the two attention paths a mixed step runs today (decode rows through
``decode_attention``'s reference, a prompt chunk through ``prefill_attention``'s) and to the
independent float64 oracle of ``tests/reference_dense.py``. The kernel runs on a CPU in Mosaic
GPU's interpret mode (``probs_in_smem=True``, the path the interpreter runs) against the
reference in float64 on the same rounded inputs; error ``||out - ref|| / ||ref||`` below 1e-2 for
16-bit inputs (``docs/testing.md``). The register path lowers for CUDA here and runs compiled
in the ``gpu``-marked test.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import paged
from bench.probes import ragged_attention as probe
from kernels_pallas.ragged_attention_mgpu import (
    TILE_ROWS,
    TMA_TILE_ROWS,
    plan_ragged,
    ragged_attention_mgpu,
    run_ragged_plan,
)
from paged.attention_reference import decode_attention_reference
from paged.ragged_attention import ragged_attention_reference, validate_ragged_inputs
from tests.conftest import ON_GPU, enable_x64
from tests.reference_dense import dense_attention, gather_tokens, request_page_lists

# Programs that run long (long ragged batches run through the reference): compiled with XLA's CPU
# optimizations (tests/conftest.py).
CPU_PROGRAMS_OPTIMIZED = True

PAGE_SIZE = 16
NUM_KV_HEADS = 2
TOLERANCE_16_BIT = 1e-2  # docs/testing.md: 16-bit inputs
# A mixed step: a decode row of 5 pages, a decode row at a page plus one, an idle slot, a 21-token chunk
# after a 16-token prefix, a 3-token chunk with no prefix (the whole prompt), a decode row of one
# token (its own key only). At G = 4 the first chunk's first tile is a full 64-row tile (16
# tokens from token 2), its second and the decode rows sit at offsets 0 and 4 of their TMA
# tiles; at G = 2 the chunk is one 42-row tile at offset 4. At G = 3 (odd row counts, every
# offset) the tiles store 3 rows at offsets 0 and 3, 57 rows at 6, 6 at 7, 9 at 5 and 3 at 6:
# every store size but 64 (the 1-row copy only ever at an odd G).
MIXED_NEW_TOKENS = (1, 1, 0, 21, 3, 1)
MIXED_SEQ_LENS = (80, 17, 0, 37, 3, 1)


def make_step(seed, new_tokens, seq_lens, *, group, head_dim, dtype, num_kv_heads=NUM_KV_HEADS):
    """Random ``q [T, H, D]``, ``qo_indptr``, an HND pool (never zeros) and a table whose pages
    are scattered over the pool in random order."""
    rng = np.random.default_rng(seed)
    needed = sum(-(-n // PAGE_SIZE) for n in seq_lens)
    num_pool_pages = needed + 3
    table = paged.PageTable.from_seq_lens(
        seq_lens, PAGE_SIZE, pages=rng.permutation(num_pool_pages).tolist()
    )
    shape = (num_pool_pages, num_kv_heads, PAGE_SIZE, head_dim)
    cache = paged.KVCache(
        jnp.asarray(rng.standard_normal(shape), dtype),
        jnp.asarray(rng.standard_normal(shape), dtype),
        "HND",
    )
    qo_indptr = jnp.asarray(np.concatenate([[0], np.cumsum(new_tokens)]), jnp.int32)
    q = jnp.asarray(
        rng.standard_normal((int(qo_indptr[-1]), num_kv_heads * group, head_dim)) * 2.0, dtype
    )
    return q, qo_indptr, cache, table


def as64(q, cache):
    return q.astype(jnp.float64), paged.KVCache(
        cache.k_pages.astype(jnp.float64), cache.v_pages.astype(jnp.float64), cache.layout
    )


def reference64(q, qo_indptr, cache, table, soft_cap=None):
    """The ragged reference in float64 on the same rounded inputs, as NumPy."""
    with enable_x64():
        q64, cache64 = as64(q, cache)
        o, lse = ragged_attention_reference(
            q64, qo_indptr, cache64, table, sm_scale=q.shape[-1] ** -0.5, logits_soft_cap=soft_cap
        )
        return np.asarray(o), np.asarray(lse)


def test_all_decode_batch_equals_the_decode_reference():
    q, qo_indptr, cache, table = make_step(
        0, (1, 1, 1), (40, 1, 17), group=4, head_dim=32, dtype=jnp.float32
    )
    with enable_x64():
        q64, cache64 = as64(q, cache)
        expected = decode_attention_reference(q64, cache64, table, sm_scale=0.3)
        got = ragged_attention_reference(q64, qo_indptr, cache64, table, sm_scale=0.3)
        assert got[0].dtype == jnp.float64
        np.testing.assert_allclose(got[0], expected[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got[1], expected[1], rtol=1e-12, atol=1e-12)


def test_single_chunk_equals_prefill_attention():
    """One request prefilling 19 tokens after a 13-token prefix: ``paged.prefill_attention``
    (reference backend, chunks of 8 against truncated tables) writes the chunk's keys, then the
    ragged reference over the written cache gives its outputs."""
    q, qo_indptr, cache, table = make_step(1, (19,), (32,), group=2, head_dim=32, dtype=jnp.float32)
    rng = np.random.default_rng(1)
    k_new, v_new = (rng.standard_normal((1, 19, NUM_KV_HEADS, 32)) for _ in range(2))
    with enable_x64():
        q64, cache64 = as64(q, cache)
        expected, written = paged.prefill_attention(
            q64[None],
            jnp.asarray(k_new),
            jnp.asarray(v_new),
            cache64,
            table,
            chunk_size=8,
            sm_scale=0.3,
            backend="reference",
        )
        got, _ = ragged_attention_reference(q64, qo_indptr, written, table, sm_scale=0.3)
        np.testing.assert_allclose(got, expected[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("soft_cap", [None, 2.5])
def test_mixed_batch_equals_dense_attention_request_by_request(soft_cap):
    q, qo_indptr, cache, table = make_step(
        2, MIXED_NEW_TOKENS, MIXED_SEQ_LENS, group=2, head_dim=16, dtype=jnp.float32
    )
    o, lse = reference64(q, qo_indptr, cache, table, soft_cap)
    page_lists, seq_lens = request_page_lists(
        table.page_indptr, table.page_indices, table.last_page_len, PAGE_SIZE
    )
    offsets = np.asarray(qo_indptr)
    for b, (pages, seq_len) in enumerate(zip(page_lists, seq_lens, strict=True)):
        keys = gather_tokens(cache.k_pages, "HND", pages, seq_len)
        values = gather_tokens(cache.v_pages, "HND", pages, seq_len)
        count = offsets[b + 1] - offsets[b]
        for index, token in enumerate(range(offsets[b], offsets[b + 1])):
            visible = seq_len - count + index + 1  # keys at positions 0 .. its own
            want_o, want_lse = dense_attention(
                np.asarray(q[token]),
                keys[:visible],
                values[:visible],
                sm_scale=16**-0.5,
                logits_soft_cap=soft_cap,
            )
            np.testing.assert_allclose(o[token], want_o, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(lse[token], want_lse, rtol=1e-10)


def test_empty_requests_and_an_empty_step():
    """Requests with no new tokens take no rows of q and change no other request's output;
    a step with no new tokens at all gives empty outputs."""
    q, qo_indptr, cache, table = make_step(
        3, (0, 2, 0, 1, 0), (5, 18, 0, 3, 9), group=2, head_dim=16, dtype=jnp.float32
    )
    o, _ = reference64(q, qo_indptr, cache, table)
    # The same two requests alone.
    keep = [1, 3]
    lists = table.page_lists()
    alone = paged.PageTable.from_page_lists([lists[b] for b in keep], [18, 3], PAGE_SIZE)
    o_alone, _ = reference64(q, jnp.asarray([0, 2, 3], jnp.int32), cache, alone)
    np.testing.assert_allclose(o, o_alone, rtol=1e-12, atol=1e-12)  # float64 sums, reordered
    empty_o, empty_lse = reference64(q[:0], jnp.zeros(6, jnp.int32), cache, table)
    assert empty_o.shape == (0, 4, 16) and empty_lse.shape == (0, 4)


def bad_inputs(change):
    q, qo_indptr, cache, table = make_step(
        4, (1, 2), (5, 18), group=2, head_dim=16, dtype=jnp.float32
    )
    inputs = dict(q=q, qo_indptr=qo_indptr, cache=cache, page_table=table)
    if change == "decreasing":
        inputs["qo_indptr"] = jnp.asarray([0, 2, 1], jnp.int32)
    elif change == "not_from_zero":
        inputs["qo_indptr"] = jnp.asarray([1, 2, 3], jnp.int32)
    elif change == "total":
        inputs["qo_indptr"] = jnp.asarray([0, 1, 2], jnp.int32)
    elif change == "too_many_new":
        inputs["qo_indptr"] = jnp.asarray([0, 3, 3], jnp.int32)
        inputs["page_table"] = paged.PageTable.from_seq_lens([2, 0], PAGE_SIZE)
    elif change == "batch":
        inputs["qo_indptr"] = jnp.asarray([0, 1, 2, 3], jnp.int32)
    elif change == "dtype":
        inputs["qo_indptr"] = qo_indptr.astype(jnp.float32)
    elif change == "q_rank":
        inputs["q"] = q[None]
    elif change == "heads":
        inputs["q"] = q[:, :3]
    return inputs


@pytest.mark.parametrize(
    "change,message",
    [
        (
            "decreasing",
            r"qo_indptr must be non-decreasing, but qo_indptr\[1\]=2 > qo_indptr\[2\]=1",
        ),
        ("not_from_zero", r"qo_indptr must start at 0, got qo_indptr\[0\]=1"),
        ("total", r"qo_indptr\[-1\]=2 must equal q's number of new tokens T=3"),
        ("too_many_new", r"request 0 has 3 new tokens in qo_indptr but seq_len 2"),
        ("batch", r"qo_indptr has 4 entries \(B=3 requests\) but page_table describes 2"),
        ("dtype", r"qo_indptr must be a 1-D int32 array, got shape \(3,\) dtype float32"),
        ("q_rank", r"q must have shape \[T, num_q_heads, head_dim\], got \(1, 3, 4, 16\)"),
        ("heads", r"num_q_heads=3 is not a multiple of the cache's num_kv_heads=2"),
    ],
)
def test_bad_inputs_are_rejected_with_their_values(change, message):
    with pytest.raises(ValueError, match=message):
        validate_ragged_inputs(**bad_inputs(change))
    with pytest.raises(ValueError, match=message):
        ragged_attention_reference(**bad_inputs(change), sm_scale=1.0)


@given(
    new_and_prefix=st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 50)), min_size=1, max_size=6
    ),
    group=st.sampled_from([1, 2, 3, 4, 8]),
    max_pages_per_item=st.sampled_from([None, 1, 2]),
)
def test_plan_covers_every_query_row_once_within_its_tile(
    new_and_prefix, group, max_pages_per_item
):
    """Every new token is in exactly one tile, which fits its 64-row tile from its TMA offset;
    a tile's items are consecutive and split its pages (those its last token sees) in order,
    each with the causal base counted from its own first key."""
    new_tokens = [n for n, _ in new_and_prefix]
    seq_lens = [n + p for n, p in new_and_prefix]
    table = paged.PageTable.from_seq_lens(seq_lens, PAGE_SIZE)
    qo_indptr = np.concatenate([[0], np.cumsum(new_tokens)])
    plan = plan_ragged(
        qo_indptr,
        np.asarray(table.page_indptr),
        np.asarray(table.last_page_len),
        page_size=PAGE_SIZE,
        group_size=group,
        num_work_items=4 * (len(new_tokens) + sum(new_tokens)) + 2,
        max_pages_per_item=max_pages_per_item,
    )
    covered = np.zeros(qo_indptr[-1], int)
    indptr = np.asarray(table.page_indptr)
    merge_indptr = plan.merge_indptr
    assert merge_indptr[0] == 0 and np.all(np.diff(merge_indptr) >= 1)
    for tile in range(len(merge_indptr) - 1):
        items = range(merge_indptr[tile], merge_indptr[tile + 1])
        b, start, count = (field[items.start] for field in plan.work_arrays[:3])
        assert count >= 1
        assert (start * group) % TMA_TILE_ROWS + count * group <= TILE_ROWS
        assert qo_indptr[b] <= start and start + count <= qo_indptr[b + 1]
        covered[start : start + count] += 1
        np.testing.assert_array_equal(plan.token_tile[start : start + count], tile)
        # The first token's key count from its position; the pages those of the last token.
        position = seq_lens[b] - new_tokens[b] + (start - qo_indptr[b])
        num_keys = position + count
        expected_page = indptr[b]
        for item in items:
            assert plan.work_request[item] == b and plan.work_q_start[item] == start
            assert plan.work_q_len[item] == count
            assert plan.work_page_start[item] == expected_page
            pages = plan.work_page_end[item] - expected_page
            assert 1 <= pages <= (max_pages_per_item or pages)
            first_key = (expected_page - indptr[b]) * PAGE_SIZE
            assert plan.work_causal_base[item] == position + 1 - first_key
            expected_page = plan.work_page_end[item]
            last = plan.work_last_page_len[item]
            assert 1 <= last <= PAGE_SIZE
        # The last item ends at the last token's key.
        assert (expected_page - indptr[b] - 1) * PAGE_SIZE + last == num_keys
    np.testing.assert_array_equal(covered, 1)
    real = plan.work_request >= 0
    assert real.sum() == merge_indptr[-1]
    assert np.all(~real[real.sum() :])  # padding items last
    assert plan.write_final == (len(merge_indptr) - 1 == merge_indptr[-1])


def test_plan_rejects_what_it_cannot_plan():
    with pytest.raises(ValueError, match="group_size must be 1 to 8, got 9"):
        plan_ragged([0, 1], [0, 1], [1], page_size=16, group_size=9)
    with pytest.raises(ValueError, match="request 0 has 3 new tokens but seq_len 2"):
        plan_ragged([0, 3], [0, 1], [2], page_size=16, group_size=1)
    with pytest.raises(ValueError, match="must describe the same 1 requests"):
        plan_ragged([0, 1], [0, 1, 2], [1, 1], page_size=16, group_size=1)
    with pytest.raises(ValueError, match="num_work_items=1 is below the 2 items needed"):
        plan_ragged([0, 1, 2], [0, 1, 2], [1, 1], page_size=16, group_size=1, num_work_items=1)
    with pytest.raises(ValueError, match="max_pages_per_item must be >= 1 or None, got 0"):
        plan_ragged([0, 1], [0, 1], [1], page_size=16, group_size=1, max_pages_per_item=0)
    # Tokens outside every tile would be left unwritten by the kernel.
    with pytest.raises(ValueError, match=r"qo_indptr must start at 0, got qo_indptr\[0\]=1"):
        plan_ragged([1, 2], [0, 1], [2], page_size=16, group_size=1)
    with pytest.raises(
        ValueError, match=r"non-decreasing, but qo_indptr\[1\]=2 > qo_indptr\[2\]=1"
    ):
        plan_ragged([0, 2, 1], [0, 1, 2], [2, 2], page_size=16, group_size=1)
    with pytest.raises(ValueError, match=r"qo_indptr must be 1-D with B \+ 1 >= 1 entries"):
        plan_ragged([], [0], [], page_size=16, group_size=1)


def run_kernel(
    q,
    qo_indptr,
    cache,
    table,
    *,
    num_work_items=None,
    max_pages_per_item=None,
    interpret=None,
    **launch,
):
    """The whole ragged step through ``run_ragged_plan`` (kernel, and merge when split)."""
    plan = plan_ragged(
        np.asarray(qo_indptr),
        np.asarray(table.page_indptr),
        np.asarray(table.last_page_len),
        page_size=PAGE_SIZE,
        group_size=q.shape[1] // cache.num_kv_heads,
        num_work_items=num_work_items,
        max_pages_per_item=max_pages_per_item,
    )
    assert plan.write_final == (max_pages_per_item is None)  # the mixed steps here do split
    return run_ragged_plan(
        q,
        cache.k_pages,
        cache.v_pages,
        table.page_indices,
        plan,
        batch=table.batch_size,
        write_final=plan.write_final,
        sm_scale=q.shape[-1] ** -0.5,
        interpret=(not ON_GPU) if interpret is None else interpret,
        **launch,
    )


@pytest.mark.parametrize(
    "dtype,group,launch",
    [
        # Windows of 4 page numbers (the 80-token decode row's 5 pages take two), two pages a
        # step, soft cap; then split-KV (one page an item, merged), one page a step; then odd
        # row counts at every TMA offset, unsplit (the output stores of 1 to 32 rows).
        (
            jnp.bfloat16,
            4,
            dict(index_window=4, pages_per_step=2, num_stages=3, logits_soft_cap=3.0),
        ),
        (jnp.float16, 2, dict(max_pages_per_item=1)),
        (jnp.bfloat16, 3, dict()),
    ],
)
def test_kernel_matches_reference_on_a_mixed_step(dtype, group, launch):
    """The unsplit case runs, off the GPU, under the interpreter's happens-before race
    detector: the double-buffered index windows, the pipeline's slots, the V rows zeroed in
    place, p in shared memory and the output rows stored in several copies plus LSE scalars
    after the commit are read and written in order."""
    q, qo_indptr, cache, table = make_step(
        5, MIXED_NEW_TOKENS, MIXED_SEQ_LENS, group=group, head_dim=64, dtype=dtype
    )
    interpret = None
    detect_races = not ON_GPU and group == 4  # once is enough
    if detect_races:
        # Private JAX module: if a JAX version moves it, the test skips rather than fails.
        gpu_callbacks = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks")
        from jax.experimental.pallas import mosaic_gpu as plgpu

        interpret = plgpu.InterpretGPUParams(detect_races=True)
    o, lse = run_kernel(
        q,
        qo_indptr,
        cache,
        table,
        num_work_items=16,
        probs_in_smem=True,
        return_lse=True,
        interpret=interpret,
        **launch,
    )
    ref_o, ref_lse = reference64(q, qo_indptr, cache, table, launch.get("logits_soft_cap"))
    assert o.dtype == dtype and lse.dtype == jnp.float32
    out = np.asarray(o.astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(out))
    assert np.linalg.norm(out - ref_o) / np.linalg.norm(ref_o) < TOLERANCE_16_BIT
    # The LSE is float32 arithmetic on 16-bit logits: within float32 rounding of its size.
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-5, atol=1e-5)
    if detect_races:
        assert not gpu_callbacks.get_races().races_found


def test_bad_plans_and_tables_stay_inside_the_arrays():
    """Page numbers outside the pool, an item starting past q's end and one claiming more
    tokens than its tile holds give wrong rows, never an access outside an array (which
    memcheck on the GPU would show; here: the call completes), every stored value is finite,
    and a row the bad items recompute from the right keys is still right."""
    q, qo_indptr, cache, table = make_step(
        7, (1, 5), (20, 5), group=4, head_dim=64, dtype=jnp.bfloat16
    )
    indices = np.asarray(table.page_indices).copy()
    indices[0] = 10_000  # request 0's first page: outside the pool (read as the last page)
    bad_table = paged.PageTable(
        table.page_indptr, jnp.asarray(indices), table.last_page_len, PAGE_SIZE
    )
    plan = plan_ragged(
        np.asarray(qo_indptr),
        np.asarray(table.page_indptr),
        np.asarray(table.last_page_len),
        page_size=PAGE_SIZE,
        group_size=4,
        num_work_items=4,
    )
    fields = [np.array(a) for a in plan.work_arrays]
    # Item 2: request 1 again, starting far past q; item 3: request 1's tokens with q_len 1000.
    fields[0][2:], fields[1][2], fields[1][3], fields[2][2:] = 1, 10**6, 1, 1000
    for f in fields[3:]:
        f[2:] = f[1]
    o = ragged_attention_mgpu(
        q,
        cache.k_pages,
        cache.v_pages,
        bad_table.page_indices,
        *(jnp.asarray(f) for f in fields),
        batch=2,
        sm_scale=0.125,
        probs_in_smem=True,
        interpret=not ON_GPU,
    )
    out = np.asarray(o.astype(jnp.float32))
    assert np.all(np.isfinite(out))
    # Request 1's first token (row 1) is written by its own item and by item 3 (tokens 1 to
    # 15, cut to the tile): both compute it from request 1's keys, so it is still right.
    ref_o, _ = reference64(q, qo_indptr, cache, table)
    assert np.linalg.norm(out[1] - ref_o[1]) / np.linalg.norm(ref_o[1]) < TOLERANCE_16_BIT


def test_every_variant_lowers_for_an_h200():
    """Both p paths, final (with and without the LSE) and partial, at Llama-3-8B's head shape
    (32/8 x 128, bfloat16), lower through Mosaic GPU to its dialect for CUDA (PTX and the
    shared-memory limit are checked only when compiling on the GPU)."""

    def int32(n):
        return jax.ShapeDtypeStruct((n,), jnp.int32)

    pool = jax.ShapeDtypeStruct((1024, 8, PAGE_SIZE, 128), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((300, 32, 128), jnp.bfloat16)
    variants = ((True, True, 1, True), (False, False, 2, True), (False, True, 1, False))
    for probs_in_smem, return_lse, pages_per_step, write_final in variants:
        traced = ragged_attention_mgpu.trace(
            q,
            pool,
            pool,
            int32(1024),
            *[int32(64)] * 7,
            batch=33,
            sm_scale=0.088,
            logits_soft_cap=30.0 if return_lse else None,
            pages_per_step=pages_per_step,
            probs_in_smem=probs_in_smem,
            return_lse=return_lse,
            write_final=write_final,
        )
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text, (probs_in_smem, return_lse, write_final)


def test_probe_dry_run(tmp_path):
    """The probe's CPU path: tiny mixed steps, the two launches and the ragged one checked
    against each other, no figures."""
    assert probe.main(["--dry-run", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "ragged_attention_probe.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="compiled Mosaic GPU kernels need a GPU")
@pytest.mark.parametrize(
    "probs_in_smem,max_pages_per_item", [(True, None), (False, None), (False, 8)]
)
def test_benchmark_shapes_on_gpu(probs_in_smem, max_pages_per_item):
    """32 decode rows at 512 tokens and a 300-token chunk after a 1000-token prefix, 32/8 x 128
    bfloat16, compiled (both p paths; split-KV too), against the float64 reference."""
    new_tokens = (1,) * 32 + (300,)
    seq_lens = (512,) * 32 + (1300,)
    q, qo_indptr, cache, table = make_step(
        6, new_tokens, seq_lens, group=4, head_dim=128, dtype=jnp.bfloat16, num_kv_heads=8
    )
    o, lse = run_kernel(
        q,
        qo_indptr,
        cache,
        table,
        probs_in_smem=probs_in_smem,
        max_pages_per_item=max_pages_per_item,
        return_lse=True,
    )
    ref_o, ref_lse = reference64(q, qo_indptr, cache, table)
    out = np.asarray(o.astype(jnp.float32), np.float64)
    assert np.linalg.norm(out - ref_o) / np.linalg.norm(ref_o) < TOLERANCE_16_BIT
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-5, atol=1e-5)


def test_probe_split_arms_follow_the_chosen_variants():
    """``--max-pages-per-item`` splits the variants finally chosen (``--variants`` included),
    in a dry run too; 0 leaves no split arm."""
    chosen = probe.chosen_variants(
        probe.parse_args(["--variants", "reg.p1.s4", "--max-pages-per-item", "32"])
    )
    assert chosen == ((("reg", 1, 4),), ((32, "reg", 1, 4),))
    chosen = probe.chosen_variants(
        probe.parse_args(["--dry-run", "--variants", "smem.p2.s3", "--max-pages-per-item", "1"])
    )
    assert chosen == ((("smem", 2, 3),), ((1, "smem", 2, 3),))
    assert probe.chosen_variants(probe.parse_args(["--max-pages-per-item", "0"]))[1] == ()
    assert probe.chosen_variants(probe.parse_args([])) == (probe.VARIANTS, probe.SPLIT_VARIANTS)


def test_probe_reports_ragged_arms_unchecked_when_the_two_launches_fail(tmp_path, monkeypatch):
    """A failing ``two_launches`` (the output the ragged arms are checked against) is a result:
    the ragged arms are reported unchecked, not run, and the probe ends with status 1 and its
    JSON, rather than dying on a comparison with nothing."""
    arms_for = probe.arms_for

    def broken_two_launches(*args, **kwargs):
        arms, operands, plan = arms_for(*args, **kwargs)

        def fails(set_index, operands):
            raise RuntimeError("two launches do not compile")

        return dict(arms, two_launches=fails), operands, plan

    monkeypatch.setattr(probe, "arms_for", broken_two_launches)
    assert probe.main(["--dry-run", "--out", str(tmp_path)]) == 1
    rows = json.loads((tmp_path / "ragged_attention_probe.json").read_text())["rows"]
    statuses = {row["arm"]: row["status"] for row in rows}
    assert statuses.pop("two_launches") == "failed"
    assert statuses and set(statuses.values()) == {"unchecked"}


def test_a_split_plan_run_as_final_is_refused():
    """``write_final`` is passed beside the plan (static under ``jit``); True with a concrete
    split plan would store each item's page-range state as the output, so it is refused."""
    q, qo_indptr, cache, table = make_step(8, (1,), (40,), group=4, head_dim=64, dtype=jnp.bfloat16)
    plan = plan_ragged(
        np.asarray(qo_indptr),
        np.asarray(table.page_indptr),
        np.asarray(table.last_page_len),
        page_size=PAGE_SIZE,
        group_size=4,
        max_pages_per_item=1,
    )
    assert not plan.write_final
    with pytest.raises(ValueError, match=r"write_final=True but the plan splits tile 0 into 3"):
        run_ragged_plan(
            q, cache.k_pages, cache.v_pages, table.page_indices, plan, batch=1,
            write_final=True, sm_scale=0.125, probs_in_smem=True, interpret=True,
        )  # fmt: skip


def test_probe_check_is_relative_per_part():
    """The probe's check of a ragged arm against the two launches: relative, the decode rows
    and the chunk each on their own. Decode rows at long context have small outputs (here
    0.03): an absolute bound passed rows 12% off, and one norm over the step let a chunk of
    outputs of order 1 hide them."""
    rng = np.random.default_rng(0)
    decode = rng.standard_normal((4, 2, 8)) * 0.03
    chunk = rng.standard_normal((6, 2, 8))
    expected = np.concatenate([decode, chunk])
    wrong_rows = np.concatenate([decode * 0.88, chunk])
    errors = probe.part_errors(wrong_rows, expected, batch=4)
    assert errors["decode"] == pytest.approx(0.12) and errors["chunk"] == 0.0
    assert np.max(np.abs(wrong_rows - expected)) < 0.05  # what the old bound let through
    assert max(errors.values()) > probe.TOLERANCE
    assert np.isnan(probe.part_errors(expected * np.nan, expected, batch=4)["chunk"])


@pytest.mark.parametrize("cap", [0.0, -1.0, "30", True])
def test_a_bad_soft_cap_is_named(cap):
    inputs = bad_inputs("none")
    with pytest.raises(
        ValueError, match=rf"logits_soft_cap must be a number > 0 or None, got {cap!r}"
    ):
        validate_ragged_inputs(**inputs, logits_soft_cap=cap)


@pytest.mark.parametrize("text", ["reg.p1", "reg.1.4", "gpu.p1.s4", "reg.p0.s4", "reg.p1.sx"])
def test_the_probe_names_a_malformed_variant(text):
    from bench.probes.ragged_attention import parse_variant

    with pytest.raises(ValueError, match=rf"--variants entries must look like .*got {text!r}"):
        parse_variant(text)
