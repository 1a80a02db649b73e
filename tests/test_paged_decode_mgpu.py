"""The Mosaic GPU paged decode kernel against the float64 reference and the Triton kernel.

On a CPU the kernel runs in Mosaic GPU's interpret mode with the softmax weights in shared
memory (``probs_in_smem=True``, the only path the interpreter runs), on small shapes; the
default register path and benchmark shapes run compiled in the ``gpu``-marked tests. Error
measure and bounds as in ``test_paged_decode_kernel.py``: ``||out - ref|| / ||ref||`` against
the reference in float64 on the same rounded inputs, below 1e-2 for 16-bit inputs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged
from kernels_pallas.merge_states import merge_partial_states
from kernels_pallas.paged_decode import paged_decode, partial_rows, token_major
from kernels_pallas.paged_decode_mgpu import (
    H200_SMEM_PER_PROGRAM_BYTES,
    paged_decode_mgpu,
    programs_per_sm,
    smem_bytes_per_program,
)
from paged.attention_reference import decode_attention_reference
from tests.conftest import ON_GPU
from tests.test_paged_decode_kernel import make_inputs, reference64, relative_error

PAGE_SIZE = 16
NUM_KV_HEADS = 2
TOLERANCE = 1e-2  # 16-bit inputs (testing.md)
# The paths this machine can run: the interpreter runs only p from shared memory.
PROBS_PATHS = (True, False) if ON_GPU else (True,)
# One token, a full page, a page plus one, empty, lengths that do not divide a split, and one
# request longer than a 4-entry index window (7 pages).
RAGGED_LENS = (1, 16, 17, 0, 45, 100)


def plan_arrays(plan):
    return tuple(
        jnp.asarray(a)
        for a in (
            plan.work_request,
            plan.work_page_start,
            plan.work_page_end,
            plan.work_last_page_len,
        )
    )


def run_mgpu(q, cache, table, plan, *, soft_cap=None, probs_in_smem=True, **launch):
    """The kernel (and, for a split plan, the merge): ``(o [B, H, D], lse [B, H])``, plus the
    kernel's raw outputs (partial states for a split plan)."""
    raw = paged_decode_mgpu(
        q,
        cache.k_pages,
        cache.v_pages,
        table.page_indices,
        *plan_arrays(plan),
        sm_scale=1.0 / np.sqrt(q.shape[-1]),
        logits_soft_cap=soft_cap,
        write_final=plan.write_final,
        probs_in_smem=probs_in_smem,
        interpret=not ON_GPU,
        **launch,
    )
    if plan.write_final:
        return raw, raw
    merged = merge_partial_states(
        *raw,
        jnp.asarray(plan.merge_indptr),
        num_q_heads=q.shape[1],
        out_dtype=q.dtype,
        interpret=not ON_GPU,
    )
    return merged, raw


def run_triton(q, cache, table, plan, *, soft_cap=None):
    """The Triton kernel's raw outputs for the same plan."""
    return paged_decode(
        q,
        cache.k_pages,
        cache.v_pages,
        table.page_indices,
        *plan_arrays(plan),
        layout="HND",
        sm_scale=1.0 / np.sqrt(q.shape[-1]),
        logits_soft_cap=soft_cap,
        write_final=plan.write_final,
        interpret=not ON_GPU,
    )


def check_against_reference(o, lse, q, cache, table, lens, soft_cap=None):
    ref_o, ref_lse = reference64(q, cache, table, soft_cap)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == q.shape[:-1] and lse.dtype == jnp.float32
    assert relative_error(o, ref_o) < TOLERANCE
    empty = np.array(lens) == 0
    lse = np.asarray(lse)
    assert np.all(np.asarray(o)[empty] == 0)
    assert np.all(np.isneginf(lse[empty]))
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=1e-5, atol=1e-5)


def make_plan(table, num_q_heads, head_dim, split):
    if split in ("fixed2", "fixed8"):  # partial states: 2- or 8-page chunks, merged
        pages = int(split.removeprefix("fixed"))
        return paged.plan_decode(
            table, num_q_heads, NUM_KV_HEADS, head_dim, fixed_split_pages=pages
        )
    if split == "planner":
        return paged.plan_decode(table, num_q_heads, NUM_KV_HEADS, head_dim)
    plan = paged.plan_decode(table, num_q_heads, NUM_KV_HEADS, head_dim, max_grid=1)
    assert plan.write_final  # final outputs; the padding items of the bucket are not stored
    assert np.any(np.asarray(plan.work_request) == -1)
    return plan


def run_config_against_reference(lens, group, dtype, split, soft_cap, **launch):
    """One row of ``CONFIGS`` or ``RING_CONFIGS``: ``group`` query heads a KV head (also the
    inputs' seed), requests of ``lens`` tokens at head_dim 64, the ``split`` plan
    (``make_plan``), the kernel launched with ``launch`` (``run_mgpu``'s keywords), its merged
    ``(o, lse)`` checked against the float64 reference. Returns ``(q, cache, table, plan,
    raw)``, ``raw`` the kernel's own outputs (final, or partial states), for further checks."""
    q, cache, table = make_inputs(group, lens, "HND", group, 64, dtype, num_pool_pages=48)
    plan = make_plan(table, q.shape[1], 64, split)
    (o, lse), raw = run_mgpu(q, cache, table, plan, soft_cap=soft_cap, **launch)
    check_against_reference(o, lse, q, cache, table, lens, soft_cap)
    return q, cache, table, plan, raw


# (group, dtype, split, soft cap, pages_per_step, num_stages, index_window): each group with a
# final and a partial output, each dtype, pages_per_step 1 and 2, several stage counts, one
# index window shorter than the longest request (two windows, double-buffered).
CONFIGS = [
    (1, jnp.bfloat16, "no_split", None, 1, 2, None),
    (1, jnp.float16, "fixed2", 5.0, 2, 3, None),
    (4, jnp.bfloat16, "fixed2", None, 1, 4, None),
    (4, jnp.float16, "no_split", 5.0, 2, 2, 4),
    (8, jnp.bfloat16, "planner", None, 2, 2, None),
    (8, jnp.bfloat16, "no_split", None, 1, 1, 4),
]


@pytest.mark.parametrize("probs_in_smem", PROBS_PATHS)
@pytest.mark.parametrize("group,dtype,split,soft_cap,pages_per_step,num_stages,window", CONFIGS)
def test_kernel_matches_reference_and_triton(
    group, dtype, split, soft_cap, pages_per_step, num_stages, window, probs_in_smem
):
    q, cache, table, plan, raw = run_config_against_reference(
        RAGGED_LENS,
        group,
        dtype,
        split,
        soft_cap,
        probs_in_smem=probs_in_smem,
        pages_per_step=pages_per_step,
        num_stages=num_stages,
        index_window=window,
    )
    # The Triton kernel's raw outputs, same plan, same layout: final (o, lse) or the partial
    # states merge_partial_states reads (their real rows; padded rows and padding items differ).
    triton = run_triton(q, cache, table, plan, soft_cap=soft_cap)
    if plan.write_final:
        np.testing.assert_allclose(
            np.asarray(raw[0], np.float32), np.asarray(triton[0], np.float32), atol=2e-2
        )
        np.testing.assert_allclose(np.asarray(raw[1]), np.asarray(triton[1]), atol=1e-4)
    else:
        real_items = int(plan.num_work_items)
        assert raw[0].shape == triton[0].shape and raw[1].shape == triton[1].shape
        ours_o, theirs_o = (np.asarray(x)[:real_items, :, :group] for x in (raw[0], triton[0]))
        ours_lse, theirs_lse = (np.asarray(x)[:real_items, :, :group] for x in (raw[1], triton[1]))
        np.testing.assert_allclose(ours_o, theirs_o, atol=2e-2)
        np.testing.assert_allclose(ours_lse, theirs_lse, atol=1e-4)


# The ring (pipeline="ring") on RAGGED_LENS and a 300-token request (19 pages: more steps than
# slots, so slots are refilled): (group, dtype, split, soft cap, pages_per_step, num_stages,
# index_window). Partial outputs of 8-page chunks (four steps on two slots); one step a 4-entry
# window with more slots than a window's steps (the next window is fetched while the ring
# still holds the last one's pages); one page a step across five windows; eight pages a step
# (one 128-key WGMMA; the 100-token request in one step, its tail and the slots past it masked).
RING_LENS = (*RAGGED_LENS, 300)
RING_CONFIGS = [
    (1, jnp.bfloat16, "fixed8", None, 2, 2, None),
    (4, jnp.float16, "no_split", 5.0, 4, 3, 4),
    (3, jnp.bfloat16, "no_split", None, 1, 3, 4),
    (8, jnp.bfloat16, "planner", None, 8, 2, None),
]


@pytest.mark.parametrize("probs_in_smem", PROBS_PATHS)
@pytest.mark.parametrize(
    "group,dtype,split,soft_cap,pages_per_step,num_stages,window", RING_CONFIGS
)
def test_ring_pipeline_matches_reference(
    group, dtype, split, soft_cap, pages_per_step, num_stages, window, probs_in_smem
):
    run_config_against_reference(
        RING_LENS,
        group,
        dtype,
        split,
        soft_cap,
        probs_in_smem=probs_in_smem,
        pages_per_step=pages_per_step,
        num_stages=num_stages,
        index_window=window,
        pipeline="ring",
    )


@pytest.mark.parametrize("probs_in_smem", PROBS_PATHS)
def test_unused_slots_holding_nan_never_reach_the_output(probs_in_smem):
    """Stale data in page tails and in unlisted pages (NaN here) is masked and its V rows are
    zeroed before p @ V (a zero weight times NaN is NaN); pages_per_step 2 also leaves slots
    past an item's last page."""
    lens = (1, 17, 0, 40)
    q, cache, table = make_inputs(4, lens, "HND", 4, 64, jnp.bfloat16, num_pool_pages=32)
    k = np.full(cache.k_pages.shape, np.nan, np.float32)
    v = np.full(cache.v_pages.shape, np.nan, np.float32)
    real_k, real_v = np.asarray(cache.k_pages, np.float32), np.asarray(cache.v_pages, np.float32)
    for b, pages in enumerate(table.page_lists()):
        for j, page in enumerate(pages):
            filled = min(PAGE_SIZE, lens[b] - j * PAGE_SIZE)
            k[page, :, :filled] = real_k[page, :, :filled]
            v[page, :, :filled] = real_v[page, :, :filled]
    poisoned = paged.KVCache(jnp.asarray(k, q.dtype), jnp.asarray(v, q.dtype), "HND")
    plan = paged.plan_decode(table, q.shape[1], NUM_KV_HEADS, 64, max_grid=1)
    (o, lse), _ = run_mgpu(q, poisoned, table, plan, probs_in_smem=probs_in_smem, pages_per_step=2)
    check_against_reference(o, lse, q, cache, table, lens)
    # The ring's step of four pages: the 17- and 40-token requests end inside their one step,
    # the rest of its 64 rows of V stale or NaN.
    (o, lse), _ = run_mgpu(
        q, poisoned, table, plan, probs_in_smem=probs_in_smem, pages_per_step=4, pipeline="ring"
    )
    check_against_reference(o, lse, q, cache, table, lens)


@pytest.mark.parametrize("probs_in_smem", PROBS_PATHS)
def test_invalid_tables_and_plans_stay_inside_the_arrays(probs_in_smem):
    """Nothing is validated here. A page number outside the pool (too large, or negative, which
    wraps to a large unsigned value) reads the pool's last page, exactly; a request outside the
    batch is a padding item whose rows are not stored; a page range past page_indices is cut to
    it. Wrong but finite answers; the other requests are unaffected."""
    lens = (20, 33, 50)
    q, cache, table = make_inputs(6, lens, "HND", 4, 64, jnp.bfloat16, num_pool_pages=16)
    plan = paged.plan_decode(table, q.shape[1], NUM_KV_HEADS, 64, max_grid=1)
    (good, _), _ = run_mgpu(q, cache, table, plan, probs_in_smem=probs_in_smem)
    good = np.asarray(good, np.float32)
    indptr = np.asarray(table.page_indptr)
    last_page = cache.k_pages.shape[0] - 1

    def with_pages(first, second):
        indices = np.asarray(table.page_indices).copy()
        indices[indptr[0]] = first  # request 0's first page
        indices[indptr[1] + 1] = second  # request 1's second page
        return dataclasses.replace(table, page_indices=jnp.asarray(indices))

    (out, lse), _ = run_mgpu(q, cache, with_pages(10_000, -5), plan, probs_in_smem=probs_in_smem)
    (clamped, _), _ = run_mgpu(
        q, cache, with_pages(last_page, last_page), plan, probs_in_smem=probs_in_smem
    )
    out = np.asarray(out, np.float32)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(np.asarray(lse)))
    np.testing.assert_array_equal(out, np.asarray(clamped, np.float32))
    np.testing.assert_array_equal(out[2], good[2])

    broken = dataclasses.replace(
        plan,
        work_request=np.asarray(plan.work_request).copy(),
        work_page_end=np.asarray(plan.work_page_end).copy(),
    )
    broken.work_request[0] = 7  # request 0's item names a request outside the batch
    broken.work_page_end[1] = 10_000  # request 1's item runs past page_indices
    (out, _), _ = run_mgpu(q, cache, table, broken, probs_in_smem=probs_in_smem)
    out = np.asarray(out, np.float32)
    assert np.all(np.isfinite(out[1]))
    np.testing.assert_array_equal(out[2], good[2])  # request 0's rows: unwritten, not checked


def test_padding_items_store_nothing():
    """A final-output plan ends with padding items (request -1, clamped to request 0 for its
    reads): they must store nothing, or request 0's rows would be overwritten with an empty
    result (o = 0, lse = -inf)."""
    lens = (40, 7)
    q, cache, table = make_inputs(12, lens, "HND", 4, 64, jnp.bfloat16, num_pool_pages=16)
    plan = paged.plan_decode(table, q.shape[1], NUM_KV_HEADS, 64, max_grid=1)
    assert plan.write_final and plan.work_request[-1] == -1
    (o, lse), _ = run_mgpu(q, cache, table, plan)
    check_against_reference(o, lse, q, cache, table, lens)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(q_shape=(2, 64)), "q must be \\[batch, num_q_heads, head_dim\\] or"),
        (dict(q_shape=(2, 17, 8, 64)), "q_len=17 must be 1 to 16 for a group of 4"),
        (dict(q_shape=(2, 3, 8, 64)), "q_len=3 needs the table's page_indptr and last_page_len"),
        (
            dict(q_shape=(2, 3, 8, 64), table=(4, 2)),
            r"page_indptr and last_page_len must be \[3\] and \[2\]",
        ),
        (dict(dtype=jnp.float32), "bfloat16 or float16"),
        (dict(page_size=32), "page_size must be 16"),
        (dict(head_dim=32), "head_dim must be one of \\(64, 128\\)"),
        (dict(num_q_heads=32), "must be 1 to 8 times num_kv_heads=2"),
        (dict(pages_per_step=0), "pages_per_step must be >= 1, got 0"),
        (dict(num_stages=0), "num_stages must be >= 1, got 0"),
        (dict(index_window=6, pages_per_step=4), "index_window must be a multiple of 4"),
        (dict(index_window=512), "at most 252, got 512"),
        (dict(probs_in_smem=False), "interpret=True needs probs_in_smem=True"),
        (dict(pipeline="warp_specialized"), "pipeline must be one of \\('emit', 'ring'\\)"),
        (
            dict(pipeline="ring", pages_per_step=3, index_window=12),
            "pages_per_step must be one of \\(1, 2, 4, 8, 16\\) with pipeline='ring'",
        ),
        (
            dict(head_dim=128, pages_per_step=8, num_stages=4),
            "num_stages=4 with pages_per_step=8 needs 291 KiB of shared memory",
        ),
    ],
)
def test_bad_arguments_are_rejected_with_their_values(change, message):
    head_dim = change.get("head_dim", 64)
    page_size = change.get("page_size", PAGE_SIZE)
    dtype = change.get("dtype", jnp.bfloat16)
    q_shape = change.get("q_shape", (2, change.get("num_q_heads", 8), head_dim))  # G = 4
    pool = jnp.zeros((4, NUM_KV_HEADS, page_size, head_dim), dtype)
    work = jnp.zeros((4,), jnp.int32)
    launch = {
        k: change[k]
        for k in ("pages_per_step", "num_stages", "index_window", "probs_in_smem", "pipeline")
        if k in change
    }
    launch.setdefault("probs_in_smem", True)
    if "table" in change:  # page_indptr and last_page_len of these lengths
        launch.update(
            page_indptr=jnp.zeros(change["table"][:1], jnp.int32),
            last_page_len=jnp.zeros(change["table"][1:], jnp.int32),
        )
    with pytest.raises(ValueError, match=message):
        paged_decode_mgpu(
            jnp.zeros(q_shape, dtype),
            pool,
            pool,
            work,
            work,
            work,
            work,
            work,
            sm_scale=0.1,
            logits_soft_cap=None,
            write_final=True,
            interpret=True,
            **launch,
        )


@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_variant_lowers_for_an_h200(head_dim):
    """As far as a CPU can follow the GPU path: at the benchmark's head shape (32/8 heads,
    bfloat16), both p paths, final and partial, both pipelines, pages_per_step 1 to 16 (the
    ring's WGMMAs over 32 to 256 keys, their 64- and 128-byte swizzles), one and nine new
    tokens, lower through Mosaic GPU's layout inference to its dialect for CUDA (the PTX stage
    and the hardware's shared-memory limit are checked only when compiling on the GPU)."""

    def int32(n):
        return jax.ShapeDtypeStruct((n,), jnp.int32)

    pool = jax.ShapeDtypeStruct((1024, 8, PAGE_SIZE, head_dim), jnp.bfloat16)
    table = dict(page_indptr=int32(5), last_page_len=int32(4))
    # (pipeline, write_final, pages_per_step, num_stages, q_len)
    variants = (
        ("emit", True, 1, 4, 1),
        ("emit", False, 2, 4, 1),
        ("emit", False, 1, 4, 9),
        ("ring", True, 4, 3, 1),
        ("ring", False, 2, 4, 1),
        ("ring", False, 8, 2, 9),
        ("ring", True, 16, 1, 1),
    )
    for probs_in_smem in (True, False):
        for pipeline, write_final, pages_per_step, num_stages, q_len in variants:
            q_shape = (4, 32, head_dim) if q_len == 1 else (4, q_len, 32, head_dim)
            traced = paged_decode_mgpu.trace(
                jax.ShapeDtypeStruct(q_shape, jnp.bfloat16),
                pool,
                pool,
                int32(1024),
                *[int32(64)] * 4,
                **table,
                sm_scale=0.088,
                logits_soft_cap=30.0 if pages_per_step == 2 else None,
                write_final=write_final,
                pages_per_step=pages_per_step,
                num_stages=num_stages,
                probs_in_smem=probs_in_smem,
                pipeline=pipeline,
            )
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
            assert "mosaic_gpu" in text, (probs_in_smem, pipeline, write_final, q_len)


def test_shared_memory_per_program_counts_every_buffer():
    """The loop's buffers at head_dim 128, bfloat16, ring of 4 pages x 3 slots: q 16 KiB, K and
    V slots 2 x 3 x 16 KiB, p through shared memory 8 KiB, two 256-entry index windows 2 KiB,
    barriers 1 KiB; the H200 fits one such program an SM. The same slots under emit_pipeline
    cost the same bytes (p: four 2 KiB pages). The epilogue's float32 rows replace the loop's
    buffers when they are larger (a one-slot emit pipeline, head_dim 128, partial output)."""
    ring = dict(pages_per_step=4, num_stages=3, probs_in_smem=True)
    assert smem_bytes_per_program(128, jnp.bfloat16, pipeline="ring", **ring) == 123 * 1024
    assert smem_bytes_per_program(128, jnp.bfloat16, pipeline="emit", **ring) == 123 * 1024
    assert programs_per_sm(123 * 1024) == 1
    two_slots = dict(ring, num_stages=2, probs_in_smem=False)  # 83 KiB: two programs an SM
    assert programs_per_sm(smem_bytes_per_program(128, jnp.bfloat16, **two_slots)) == 2
    small = smem_bytes_per_program(
        64, jnp.bfloat16, pages_per_step=1, num_stages=1, index_window=4, write_final=False
    )
    assert small == 64 * 64 * 4 + 1024  # o's 64 float32 rows and the 64 LSE values
    largest = smem_bytes_per_program(128, jnp.bfloat16, pages_per_step=8, num_stages=3)
    assert largest <= H200_SMEM_PER_PROGRAM_BYTES


def test_partial_rows_match_the_merge_layout():
    """The partial state of G = 3 keeps P = 4 rows a (work item, KV head), as the Triton kernel's."""
    lens = (30, 70)
    q, cache, table = make_inputs(13, lens, "HND", 3, 64, jnp.bfloat16, num_pool_pages=16)
    plan = paged.plan_decode(table, q.shape[1], NUM_KV_HEADS, 64, fixed_split_pages=3)
    (o, lse), raw = run_mgpu(q, cache, table, plan)
    assert raw[0].shape == (plan.work_request.shape[0], NUM_KV_HEADS, partial_rows(3), 64)
    check_against_reference(o, lse, q, cache, table, lens)


# (batch, context, probs_in_smem, pages_per_step, num_stages, pipeline): every case on the
# register path at the default pipeline, two with p in shared memory, two with two pages a
# step; the ring at two, four and eight pages a step (32-, 64-, 128-key WGMMAs, their 64- and
# 128-byte swizzles), both p paths.
GPU_CASES = [
    (1, 4096, False, 1, 4, "emit"),
    (1, 32768, False, 1, 4, "emit"),
    (32, 4096, False, 1, 4, "emit"),
    (256, 512, False, 1, 4, "emit"),
    (1, 4096, True, 1, 4, "emit"),
    (32, 4096, True, 2, 3, "emit"),
    (1, 32768, False, 2, 3, "emit"),
    (256, 512, False, 2, 4, "emit"),
    (32, 4096, False, 4, 3, "ring"),
    (1, 32768, False, 8, 2, "ring"),
    (256, 512, False, 2, 4, "ring"),
    (1, 4096, True, 4, 4, "ring"),
    (4, 32768, False, 8, 2, "ring"),  # two windows of 248 an item: the second buffer's copy
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "batch,context,probs_in_smem,pages_per_step,num_stages,pipeline", GPU_CASES
)
def test_benchmark_shapes_on_gpu(
    batch, context, probs_in_smem, pages_per_step, num_stages, pipeline
):
    """Compiled, at the benchmark's shapes: 32 query heads, 8 KV heads, head_dim 128, bf16, the
    planner's split; against the reference in float32 and the Triton kernel."""
    assert ON_GPU
    lens = [context] * batch
    lens[0] = context - 5  # a ragged tail
    pages_needed = sum(-(-n // PAGE_SIZE) for n in lens)
    q, cache, table = make_inputs(
        7, lens, "HND", 4, 128, jnp.bfloat16, num_pool_pages=pages_needed + 64, num_kv_heads=8
    )
    plan = paged.plan_decode(table, 32, 8, 128)
    (o, lse), _ = run_mgpu(
        q,
        cache,
        table,
        plan,
        probs_in_smem=probs_in_smem,
        pages_per_step=pages_per_step,
        num_stages=num_stages,
        pipeline=pipeline,
    )
    ref_o, ref_lse = decode_attention_reference(
        q.astype(jnp.float32),
        paged.KVCache(cache.k_pages.astype(jnp.float32), cache.v_pages.astype(jnp.float32), "HND"),
        table,
        sm_scale=1.0 / np.sqrt(128),
    )
    assert relative_error(o, np.asarray(ref_o, np.float64)) < 1e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-4, atol=1e-3)
    triton = paged.decode_attention(q, cache, table, plan=plan, backend="pallas")
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(triton, np.float32), atol=3e-2)


# --------------------------------------------------------------------------------------------
# Several new tokens per request (speculative verification): rows = q_len x group, causal


def run_mgpu_multi_token(q, cache, table, plan, *, soft_cap=None, probs_in_smem=True, **launch):
    """``run_mgpu`` for ``q [B, L, H, D]``: the merge takes ``L x H`` rows a request."""
    q_len = q.shape[1]
    raw = paged_decode_mgpu(
        q,
        cache.k_pages,
        cache.v_pages,
        table.page_indices,
        *plan_arrays(plan),
        page_indptr=table.page_indptr,
        last_page_len=table.last_page_len,
        sm_scale=1.0 / np.sqrt(q.shape[-1]),
        logits_soft_cap=soft_cap,
        write_final=plan.write_final,
        probs_in_smem=probs_in_smem,
        interpret=not ON_GPU,
        **launch,
    )
    if plan.write_final:
        return raw
    o, lse = merge_partial_states(
        *raw,
        jnp.asarray(plan.merge_indptr),
        num_q_heads=q_len * q.shape[2],
        out_dtype=q.dtype,
        interpret=not ON_GPU,
    )
    batch = q.shape[0]
    o = token_major(o.reshape(batch, -1, q.shape[-1]), q_len, NUM_KV_HEADS)
    lse = token_major(lse.reshape(batch, -1), q_len, NUM_KV_HEADS)
    return o.reshape(q.shape), lse.reshape(q.shape[:-1])


# (q_len, group, split, pages_per_step, pipeline): q_len 2, 5, 9 (and one as 4-D) with groups
# 1, 3, 4, 8; one-page chunks put the causal cut in the chunk before the last too. On the ring:
# one-page items in a four-page step, and the causal cut inside a 32-key step.
MULTI_TOKEN_CONFIGS = [
    (1, 4, "fixed1", 1, "emit"),
    (2, 8, "no_split", 2, "emit"),
    (5, 4, "fixed1", 1, "emit"),
    (5, 3, "no_split", 1, "emit"),
    (9, 1, "fixed1", 2, "emit"),
    (16, 4, "no_split", 1, "emit"),
    (5, 4, "fixed1", 4, "ring"),
    (9, 2, "no_split", 2, "ring"),
]


@pytest.mark.parametrize("probs_in_smem", PROBS_PATHS)
@pytest.mark.parametrize("q_len,group,split,pages_per_step,pipeline", MULTI_TOKEN_CONFIGS)
def test_multi_token_matches_reference(
    q_len, group, split, pages_per_step, pipeline, probs_in_smem
):
    """Ragged lengths from exactly q_len up, an empty request; a query that sees no key gets
    exactly 0 and -inf."""
    lens = [q_len, 0, max(17, q_len), 33, 70]
    _, cache, table = make_inputs(q_len, lens, "HND", group, 64, jnp.bfloat16, 32)
    rng = np.random.default_rng(q_len + group)
    q = jnp.asarray(
        rng.standard_normal((len(lens), q_len, NUM_KV_HEADS * group, 64)) * 2.0, jnp.bfloat16
    )
    if split == "fixed1":
        plan = paged.plan_decode(table, q.shape[2], NUM_KV_HEADS, 64, fixed_split_pages=1)
    else:
        plan = paged.plan_decode(table, q.shape[2], NUM_KV_HEADS, 64, max_grid=1)
        assert plan.write_final
    o, lse = run_mgpu_multi_token(
        q,
        cache,
        table,
        plan,
        probs_in_smem=probs_in_smem,
        pages_per_step=pages_per_step,
        pipeline=pipeline,
    )
    ref_o, ref_lse = reference64(q, cache, table)
    assert o.shape == q.shape and lse.shape == q.shape[:-1]
    assert relative_error(o, ref_o) < TOLERANCE
    lse, sees_nothing = np.asarray(lse), np.isneginf(ref_lse)
    assert np.all(np.asarray(o)[sees_nothing] == 0)
    assert np.all(np.isneginf(lse[sees_nothing]))
    np.testing.assert_allclose(lse[~sees_nothing], ref_lse[~sees_nothing], rtol=1e-5, atol=1e-5)


def test_multi_token_request_shorter_than_q_len_sees_no_key_before_position_zero():
    """Only jit lets a request of 2 tokens bring 5: its queries before position 0 see no key
    (o = 0, lse = -inf), the others attend causally, like the reference; with a soft cap."""
    lens = [2, 40, 0, 21]
    _, cache, table = make_inputs(20, lens, "HND", 4, 64, jnp.bfloat16, 32)
    rng = np.random.default_rng(20)
    q = jnp.asarray(rng.standard_normal((4, 5, NUM_KV_HEADS * 4, 64)) * 2.0, jnp.bfloat16)
    plan = paged.plan_decode(table, q.shape[2], NUM_KV_HEADS, 64, fixed_split_pages=2)
    o, lse = run_mgpu_multi_token(q, cache, table, plan, soft_cap=3.0)
    ref_o, ref_lse = reference64(q, cache, table, 3.0)
    assert relative_error(o, ref_o) < TOLERANCE
    sees_nothing = np.isneginf(ref_lse)
    assert sees_nothing[0, :3].all() and not sees_nothing[0, 3:].any()
    assert np.all(np.asarray(o)[sees_nothing] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[sees_nothing]))


def test_x64_mode_gives_the_32_bit_result():
    """Researchers run with x64 on: the kernel still runs as a 32-bit program (interpreted: with
    x64 off for the call, as Mosaic GPU's interpreter cannot be exported) and returns the same
    bits, float32 LSE included."""
    lens = (5, 40)
    q, cache, table = make_inputs(14, lens, "HND", 4, 64, jnp.bfloat16, num_pool_pages=16)
    plan = paged.plan_decode(table, q.shape[1], NUM_KV_HEADS, 64, max_grid=1)
    expected, _ = run_mgpu(q, cache, table, plan)
    with jax.enable_x64(True):
        got, _ = run_mgpu(q, cache, table, plan)
    assert got[1].dtype == jnp.float32
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.skipif(ON_GPU, reason="the interpreter's race detector runs on the CPU")
@pytest.mark.parametrize("pipeline", ["emit", "ring"])
def test_interpreter_race_detector_finds_no_race(pipeline):
    """Mosaic GPU's interpreter with its happens-before race detector: the double-buffered
    index windows (items of 7 pages in 4-entry windows), the pipeline's slots, the V rows
    zeroed in place and p in shared memory are read and written in order. (It does find one:
    without the wait on an index window's barrier it reports the window's copy racing the
    reads of its page numbers; on the ring too, whose issue loop fetches the next window while
    the ring still streams the current one's pages.) The ring's refill of a slot only after the
    step that read it is checked by test_ring_pipeline_matches_reference's results instead: the
    detector does not report a copy into a slot issued before the step reads it, the results
    go wrong. A missing wait on the ring's V barrier the interpreter refuses in every test: a
    barrier phase completes that no thread observed."""
    # Private JAX module: if a JAX version moves it, the test skips rather than fails.
    gpu_callbacks = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks")
    from jax.experimental.pallas import mosaic_gpu as plgpu

    lens = (1, 17, 0, 100)
    q, cache, table = make_inputs(15, lens, "HND", 4, 64, jnp.bfloat16, num_pool_pages=16)
    # Unsplit: request 3's item has 7 pages, two windows of 4 page numbers.
    plan = paged.plan_decode(table, q.shape[1], NUM_KV_HEADS, 64, max_grid=1)
    paged_decode_mgpu(
        q,
        cache.k_pages,
        cache.v_pages,
        table.page_indices,
        *plan_arrays(plan),
        sm_scale=0.125,
        logits_soft_cap=None,
        write_final=plan.write_final,
        pages_per_step=2,
        num_stages=3,
        index_window=4,
        probs_in_smem=True,
        pipeline=pipeline,
        interpret=plgpu.InterpretGPUParams(detect_races=True),
    )[0].block_until_ready()
    assert not gpu_callbacks.get_races().races_found


# --------------------------------------------------------------------------------------------
# The public path: paged.decode_attention(backend="pallas_mgpu")


@pytest.mark.parametrize(
    "q_len,split",
    [(1, "no_split"), (3, "fixed2")],
)
def test_public_path_runs_the_mosaic_gpu_kernel(q_len, split):
    """``decode_attention(backend="pallas_mgpu")`` runs this kernel (recorded as
    ``paged_decode_mgpu``; interpreted here, compiled on a GPU) with the step's plan: final
    outputs (one new token), partial states merged (three); it equals the float64 reference."""
    from kernels_pallas.platform import record_backends

    lens = (max(1, q_len), 17, 0, 45, 100)  # a request holds at least its new tokens
    _, cache, table = make_inputs(30 + q_len, lens, "HND", 4, 64, jnp.bfloat16, 32)
    rng = np.random.default_rng(q_len)
    shape = (len(lens), *((q_len,) if q_len > 1 else ()), NUM_KV_HEADS * 4, 64)
    q = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    plan = make_plan(table, NUM_KV_HEADS * 4, 64, split)
    with record_backends() as records:
        o, lse = paged.decode_attention(
            q, cache, table, plan=plan, return_lse=True, backend="pallas_mgpu"
        )
    assert [(r.kernel, r.backend) for r in records] == [("paged_decode_mgpu", "pallas")]
    ref_o, ref_lse = reference64(q, cache, table)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == q.shape[:-1]
    assert relative_error(o, ref_o) < TOLERANCE
    lse, empty = np.asarray(lse), np.isneginf(ref_lse)
    assert np.all(np.asarray(o)[empty] == 0) and np.all(np.isneginf(lse[empty]))
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=1e-5, atol=1e-5)


def test_public_path_refuses_shapes_the_mosaic_gpu_kernel_cannot_run(monkeypatch):
    """``backend="pallas_mgpu"`` names why it cannot run (NHD pages, another page size, more
    new tokens than its tile holds); ``"auto"`` on a GPU runs it where it can (HND, bfloat16)
    and the Triton kernel elsewhere (NHD pages, float32) or when switched off."""
    from kernels_pallas import platform
    from kernels_pallas.platform import record_backends

    lens = (20, 33)
    q, cache, table = make_inputs(40, lens, "NHD", 4, 64, jnp.bfloat16, num_pool_pages=8)
    with pytest.raises(ValueError, match=r"backend='pallas_mgpu' cannot run .*layout NHD"):
        paged.decode_attention(q, cache, table, backend="pallas_mgpu")
    q, cache, table = make_inputs(40, lens, "HND", 4, 64, jnp.bfloat16, num_pool_pages=8)
    long_run = jnp.zeros((2, 17, *q.shape[1:]), q.dtype)
    with pytest.raises(ValueError, match="q_len=17: the Mosaic GPU kernel takes 16"):
        paged.decode_attention(long_run, cache, table, backend="pallas_mgpu")
    small_pages = paged.KVCache(cache.k_pages[:, :, :8], cache.v_pages[:, :, :8], "HND")
    small_table = paged.PageTable.from_seq_lens([5, 7], page_size=8)
    with pytest.raises(ValueError, match="page_size=8: the Mosaic GPU kernel takes 16"):
        paged.decode_attention(q, small_pages, small_table, backend="pallas_mgpu")

    monkeypatch.setattr(platform, "on_gpu", lambda: True)
    nhd_q, nhd_cache, nhd_table = make_inputs(40, lens, "NHD", 4, 64, jnp.bfloat16, 8)
    calls = [  # (q, cache, table) -> the kernel "auto" records
        ((q, cache, table), "paged_decode_mgpu"),
        ((nhd_q, nhd_cache, nhd_table), "paged_decode"),
        (
            (
                q.astype(jnp.float32),
                paged.KVCache(
                    *(p.astype(jnp.float32) for p in (cache.k_pages, cache.v_pages)), "HND"
                ),
                table,
            ),
            "paged_decode",
        ),
    ]
    for args, kernel in calls:
        with record_backends() as records:
            jax.eval_shape(lambda q, c, t: paged.decode_attention(q, c, t), *args)
        assert [(r.kernel, r.backend) for r in records] == [(kernel, "pallas")]
        assert paged.decode.decode_kernel_for(args[0], args[1], "auto") == kernel
    monkeypatch.setattr(paged.decode, "AUTO_PICKS_MOSAIC_GPU_DECODE", False)
    with record_backends() as records:
        jax.eval_shape(lambda q: paged.decode_attention(q, cache, table), q)
    assert [(r.kernel, r.backend) for r in records] == [("paged_decode", "pallas")]
    monkeypatch.setenv("DECODELAB_BACKEND", "reference")
    monkeypatch.setattr(paged.decode, "AUTO_PICKS_MOSAIC_GPU_DECODE", True)
    with record_backends() as records:
        jax.eval_shape(lambda q: paged.decode_attention(q, cache, table), q)
    assert [r.backend for r in records] == ["reference"]


# --------------------------------------------------------------------------------------------
# merge="folded": a split plan's partial states merged in the decode launch (the last item of
# a request to finish merges). Interpreted, the arrival counter is replaced by the item's rank
# in its request (the interpreter runs programs one at a time, in order); the semaphores run
# compiled only (the lowering test below and the gpu-marked test).


def run_folded(q, cache, table, arrays, merge_indptr, *, soft_cap=None, merge="folded", **launch):
    """The kernel with ``merge="folded"`` over raw plan arrays: final ``(o, lse)`` in q's
    shape. p through shared memory unless asked (the path the interpreter runs)."""
    multi_token = q.ndim == 4
    launch = {"probs_in_smem": True, **launch}
    return paged_decode_mgpu(
        q,
        cache.k_pages,
        cache.v_pages,
        table.page_indices,
        *arrays,
        page_indptr=table.page_indptr if multi_token else None,
        last_page_len=table.last_page_len if multi_token else None,
        merge_indptr=jnp.asarray(merge_indptr),
        sm_scale=1.0 / np.sqrt(q.shape[-1]),
        logits_soft_cap=soft_cap,
        write_final=False,
        merge=merge,
        interpret=not ON_GPU,
        **launch,
    )


def with_empty_item(plan, request):
    """The plan's real items plus one more item of ``request`` with no page (an empty split:
    o = 0, lse = -inf), placed among the request's items: ``(arrays, merge_indptr)``."""
    count = int(plan.num_work_items)
    items = [list(np.asarray(a)[:count]) for a in plan_arrays(plan)]
    merge_indptr = np.asarray(plan.merge_indptr).copy()
    at = int(merge_indptr[request]) + 1  # after the request's first item
    end = items[2][at - 1]
    for column, value in zip(items, (request, end, end, 0), strict=True):
        column.insert(at, value)
    merge_indptr[request + 1 :] += 1
    return tuple(jnp.asarray(c, jnp.int32) for c in items), merge_indptr


# (lens, group, head_dim, q_len, split, soft cap, pipeline, pages_per_step): B = 1 in nine
# one-page splits and an empty split inserted among them (ten items: two chunks of the merge's
# eight; G = 1 at head_dim 64: P_fold = 2 > P = 1); B = 4 ragged, one-page splits, with an
# empty request (its one item has no key) and three new tokens a request, causal (the 3-token
# request's first queries see no key; P_fold = P = 8), soft cap, the ring.
FOLDED_CASES = [
    ((130,), 1, 64, 1, "empty_split", None, "emit", 1),
    ((3, 40, 0, 21), 2, 64, 3, "fixed1", 5.0, "ring", 2),
]


@pytest.mark.parametrize(
    "lens,group,head_dim,q_len,split,soft_cap,pipeline,pages_per_step", FOLDED_CASES
)
def test_folded_merge_matches_separate_merge_and_reference(
    lens, group, head_dim, q_len, split, soft_cap, pipeline, pages_per_step
):
    """merge="folded" gives the separate merge's result (same float32 math, base 2 inside:
    equal to rounding) and the float64 reference's; a row that saw no key (empty request, a
    query before position 0) gets exactly o = 0 and lse = -inf; an empty split adds nothing."""
    q, cache, table = make_inputs(
        50 + group,
        lens,
        "HND",
        group,
        head_dim,
        jnp.bfloat16,
        num_pool_pages=24,
        q_len=q_len if q_len > 1 else None,
    )
    num_q_heads = q.shape[-2]
    pages = 2 if split == "fixed2" else 1
    plan = paged.plan_decode(table, num_q_heads, NUM_KV_HEADS, head_dim, fixed_split_pages=pages)
    assert not plan.write_final
    if split == "empty_split":
        arrays, merge_indptr = with_empty_item(plan, request=0)
        plan = dataclasses.replace(
            plan,
            work_request=np.asarray(arrays[0]),
            work_page_start=np.asarray(arrays[1]),
            work_page_end=np.asarray(arrays[2]),
            work_last_page_len=np.asarray(arrays[3]),
            merge_indptr=merge_indptr,
            num_work_items=np.int32(arrays[0].shape[0]),
        )
    else:
        arrays, merge_indptr = plan_arrays(plan), plan.merge_indptr
    assert np.diff(merge_indptr).max() >= 3  # several splits in one request
    launch = dict(pipeline=pipeline, pages_per_step=pages_per_step)
    o, lse = run_folded(q, cache, table, arrays, merge_indptr, soft_cap=soft_cap, **launch)
    if q_len > 1:
        separate = run_mgpu_multi_token(q, cache, table, plan, soft_cap=soft_cap, **launch)
    else:
        separate, _ = run_mgpu(q, cache, table, plan, soft_cap=soft_cap, **launch)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == q.shape[:-1]
    np.testing.assert_allclose(
        np.asarray(o, np.float32), np.asarray(separate[0], np.float32), atol=1e-2, rtol=0
    )
    ref_o, ref_lse = reference64(q, cache, table, soft_cap)
    assert relative_error(o, ref_o) < TOLERANCE
    lse, sees_nothing = np.asarray(lse), np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(np.asarray(separate[1])), sees_nothing)
    assert np.all(np.asarray(o)[sees_nothing] == 0)
    assert np.all(np.isneginf(lse[sees_nothing]))
    np.testing.assert_allclose(lse[~sees_nothing], ref_lse[~sees_nothing], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        lse[~sees_nothing], np.asarray(separate[1])[~sees_nothing], rtol=1e-6, atol=1e-6
    )


def test_folded_merge_keyword_is_checked():
    """A merge other than "separate" or "folded" is refused, naming it; "folded" needs the
    plan's merge_indptr for q's batch; a final plan has nothing to merge and ignores it."""
    lens = (20, 33)
    q, cache, table = make_inputs(41, lens, "HND", 4, 64, jnp.bfloat16, num_pool_pages=8)
    plan = paged.plan_decode(table, q.shape[1], NUM_KV_HEADS, 64, fixed_split_pages=1)
    with pytest.raises(ValueError, match=r"merge must be one of .*got 'fused'"):
        run_folded(q, cache, table, plan_arrays(plan), plan.merge_indptr, merge="fused")
    with pytest.raises(ValueError, match=r"needs the plan's merge_indptr, \[3\] .* got \(2,\)"):
        run_folded(q, cache, table, plan_arrays(plan), plan.merge_indptr[:2])


def test_folded_merge_lowers_for_an_h200_with_its_arrival_counter():
    """Compiled, the folded merge counts arrivals on global semaphores: after its partial
    state's TMA store, each program fences the async proxy, signals its (request, KV head)
    counter with a release (red.release.gpu) and reads it with an acquire; Pallas zeroes the
    counters before the launch (an aliased zero buffer). Both pipelines, one and nine new
    tokens, head_dim 128 and 64, p from registers."""

    def int32(n):
        return jax.ShapeDtypeStruct((n,), jnp.int32)

    for head_dim, q_len, pipeline, pages_per_step in ((128, 1, "emit", 2), (64, 9, "ring", 4)):
        pool = jax.ShapeDtypeStruct((1024, 8, PAGE_SIZE, head_dim), jnp.bfloat16)
        q_shape = (4, 32, head_dim) if q_len == 1 else (4, q_len, 32, head_dim)
        text = (
            paged_decode_mgpu.trace(
                jax.ShapeDtypeStruct(q_shape, jnp.bfloat16),
                pool,
                pool,
                int32(1024),
                *[int32(64)] * 4,
                page_indptr=int32(5),
                last_page_len=int32(4),
                merge_indptr=int32(5),
                sm_scale=0.088,
                logits_soft_cap=None,
                write_final=False,
                pages_per_step=pages_per_step,
                num_stages=3,
                probs_in_smem=False,
                pipeline=pipeline,
                merge="folded",
            )
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
        # The fence is an NVVM op (nvvm.fence.proxy, kind async.global), the rest inline PTX.
        for ptx in ("async.global", "red.release.gpu", "ld.acquire"):
            assert ptx in text, (ptx, head_dim, q_len, pipeline)
        assert "output_operand_aliases" in text  # the zeroed counters


def test_public_path_folds_the_merge_when_asked(monkeypatch):
    """``paged.decode.MGPU_MERGE = "folded"`` makes ``backend="pallas_mgpu"`` merge a split
    plan in the decode launch (one kernel recorded, no merge launch); same result as the
    reference."""
    from kernels_pallas.platform import record_backends
    from paged import decode

    monkeypatch.setattr(decode, "MGPU_MERGE", "folded")
    lens = (0, 45)
    q, cache, table = make_inputs(42, lens, "HND", 4, 64, jnp.bfloat16, num_pool_pages=16)
    plan = paged.plan_decode(table, q.shape[1], NUM_KV_HEADS, 64, fixed_split_pages=1)
    with record_backends() as records:
        o, lse = paged.decode_attention(
            q, cache, table, plan=plan, return_lse=True, backend="pallas_mgpu"
        )
    assert [(r.kernel, r.backend) for r in records] == [("paged_decode_mgpu", "pallas")]
    check_against_reference(o, lse, q, cache, table, lens)


# (batch, context): the probe's merge arms.
FOLDED_GPU_CASES = [(1, 4096), (1, 32768), (4, 4096), (4, 32768)]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,context", FOLDED_GPU_CASES)
def test_folded_merge_on_gpu(batch, context):
    """Compiled at the benchmark's shapes (32/8 heads, head_dim 128, bfloat16, the planner's
    split, a ragged tail), the decode path's launch parameters: the folded merge equals the
    separate one and the float32 reference, and three launches give the same bits (the
    counters start from zero every launch; a duplicate merge writes the same values)."""
    from paged.decode import MGPU_LAUNCH_PARAMETERS

    assert ON_GPU
    lens = [context] * batch
    lens[0] = context - 5
    pages_needed = sum(-(-n // PAGE_SIZE) for n in lens)
    q, cache, table = make_inputs(
        8, lens, "HND", 4, 128, jnp.bfloat16, num_pool_pages=pages_needed + 64, num_kv_heads=8
    )
    plan = paged.plan_decode(table, 32, 8, 128)
    assert not plan.write_final
    launch = dict(MGPU_LAUNCH_PARAMETERS, probs_in_smem=False)
    runs = [
        run_folded(q, cache, table, plan_arrays(plan), plan.merge_indptr, **launch)
        for _ in range(3)
    ]
    for o, lse in runs[1:]:
        np.testing.assert_array_equal(np.asarray(o), np.asarray(runs[0][0]))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(runs[0][1]))
    o, lse = runs[0]
    (separate_o, separate_lse), _ = run_mgpu(q, cache, table, plan, **launch)
    np.testing.assert_allclose(
        np.asarray(o, np.float32), np.asarray(separate_o, np.float32), atol=1e-2
    )
    np.testing.assert_allclose(np.asarray(lse), np.asarray(separate_lse), rtol=1e-6, atol=1e-5)
    ref_o, ref_lse = decode_attention_reference(
        q.astype(jnp.float32),
        paged.KVCache(cache.k_pages.astype(jnp.float32), cache.v_pages.astype(jnp.float32), "HND"),
        table,
        sm_scale=1.0 / np.sqrt(128),
    )
    assert relative_error(o, np.asarray(ref_o, np.float64)) < 1e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-4, atol=1e-3)
