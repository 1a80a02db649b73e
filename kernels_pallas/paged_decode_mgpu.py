"""Split-KV paged decode attention on Mosaic GPU (Pallas ``plgpu``): pages streamed by TMA.

Same contract as ``kernels_pallas/paged_decode.py`` (the Triton kernel) in the HND layout
(the layout whose page of one KV head is one contiguous tile, one TMA box; NHD would need a
strided box per page and is left out): the work items of ``paged.plan_decode``, the CSR page
table, one new token a request or ``q_len`` of them (causal among themselves, as there), final
``(o, lse)`` when ``write_final`` or partial states that ``merge_states.py`` merges unchanged
(or, with ``merge="folded"``, merges in the same launch: see below).
``paged.decode_attention`` runs it under ``backend="auto"`` on a GPU for the shapes it takes
(``paged.decode.decode_kernel_for``), or by name (``backend="pallas_mgpu"``). Measured through
that public path on the H200 (``docs/benchmark_results/2026-12-02-decode.md``, ring, four pages
a step, two slots; the planner cuts a request into 16 items at most for it): faster than the
Triton kernel on every case of the standard grid, 1.15x as a geometric mean (1.03x to 1.33x),
82-92% of the copy ceiling on the 512 MiB cases (3.9-4.3 TB/s of the kernel's own device time,
read from a profiler trace), 1.56x JAX's Pallas ``paged_attention``; the 16 MiB cases take about
19 us against a 10 us target, of which the kernel and the merge are 10.5-12 us of device time
(``docs/benchmark_results/archive/2026-12-02-decode-overhead-probe.md``).

Every operand must start on 256 bytes: Mosaic GPU checks it at launch ("Input buffer N is not
256-byte aligned"). A freshly allocated array always does, but XLA may hand a kernel a
contiguous slice of a larger buffer in place, as it did with the serving engine's packed step
inputs (``serving/host_inputs.py`` now aligns each of them).

What it optimizes. Decode attention is memory bound (each K/V byte serves only the ``G`` query
heads of its KV head), so the kernel's job is to keep enough page copies in flight to stream K
and V at the copy bandwidth. The Triton lowering cannot: its software pipeliner keeps at most one
load in flight whose address comes from the page table. Here each page of one KV head (a
contiguous ``[page_size, head_dim]`` tile in HND, 4 KiB at 16 x 128 bfloat16) is one TMA copy
into shared memory, and ``plgpu.emit_pipeline`` keeps ``num_stages`` steps of
``pages_per_step`` pages in flight: its BlockSpec ``index_map`` reads each page number inside the
kernel, from a copy of the program's slice of ``page_indices`` in shared memory.

The pipeline, for one program (one work item, one KV head; one warpgroup of 128 threads):

- Prologue: TMA the query tile ``[64, D]`` (the ``q_len x G`` query rows of the KV head,
  padded, see below) and the first window of ``index_window`` page numbers into shared memory; then the
  pipeline issues the K and V copies of steps ``0 .. num_stages - 1``.
- Step ``i`` waits for its own pages (issued ``num_stages`` steps earlier), computes on them, and
  on return frees their slots, into which the copies of step ``i + num_stages`` are issued at
  once. So while step ``i`` is computed, the pages of steps ``i + 1 .. i + num_stages - 1`` are
  in flight: ``(num_stages - 1) x pages_per_step`` pages of K and V a program.
- Compute of a step, per page: ``s = q @ K_page^T`` on the tensor cores (WGMMA, ``[64,
  page_size]`` float32), base-2 scaled (soft-capped) logits, keys past the item's end (and,
  for several new tokens, keys after a row's token) masked,
  the online softmax of ``online_softmax.py`` in float32 (one running max a step), then ``p @
  V_page`` on the tensor cores. ``p`` (bfloat16/float16) is either stored to shared memory first
  (``probs_in_smem=True``: the path Mosaic GPU's interpreter can run on a CPU) or fed from
  registers (``False``, the default on the GPU: no shared-memory round trip; FlashAttention-3's
  way, compiled only).
- Page numbers come in windows of ``index_window`` (at most 252, one copy each, from a 16-byte
  aligned start: ``index_windows.py``) into two
  alternating buffers: window ``k + 1`` is copied while window ``k``'s pages stream. A work item
  of more pages than one window runs one pipeline a window, so the pipeline drains and refills
  once every ``index_window`` pages (one copy latency each; the planner's chunks usually fit one
  window).
- Epilogue: normalize, write the ``q_len x G`` output rows (final, or the real rows of a
  partial state's block) through shared memory by TMA, and the LSE rows as scalars (a TMA row
  must be 16 bytes; ``q_len x G`` scalar stores a program, to be measured).

Two pipelines (the static ``pipeline``):

- ``"emit"``: ``plgpu.emit_pipeline`` as above. Its BlockSpecs give each page its own slot, so
  a step of ``pages_per_step`` pages is that many small WGMMA pairs (``q @ K_page^T`` of N = 16,
  ``p @ V_page`` of K = 16), each a latency on the step's critical path (one softmax update a
  step over all of them).
- ``"ring"``: a hand-written ring of ``num_stages`` slots, each ``[pages_per_step x 16, D]``
  for K and for V, and two barriers a slot (K's and V's; ``pages_per_step`` copies arrive on
  each, K's issued first). A step's pages land side by side in one slot, so the step is ONE
  ``q @ K^T`` of N = ``16 x pages_per_step`` keys, ONE softmax update, and ONE ``p @ V`` of
  K = ``16 x pages_per_step``: p and V take the swizzle of that K (32 bytes for one page, 64
  for two, 128 from four pages up; tiles 8 rows by the swizzle's width), q and K the 128-byte
  swizzle of ``head_dim``. A page's 16 rows are two whole 8-row tiles, so each page's TMA
  lands in a contiguous part of the slot. One loop runs over all the item's steps: step ``i``
  waits for its K, computes the logits and the softmax, waits for its V, computes ``p @ V``,
  then (its WGMMAs done reading the slot) issues the copies of step ``i + num_stages`` into
  it. The index windows are fetched ahead inside the issue: the first step of window ``k``
  waits for it and starts window ``k + 1``'s copy into the other buffer (whose entries were
  all issued by then), so the ring never drains between windows. ``pages_per_step`` 1 to 16
  (N at most 256).

Shared memory a program (``smem_bytes_per_program``): the query tile (16 KiB at ``D = 128``),
``2 x num_stages x pages_per_step`` page slots (4 KiB each at ``D = 128``; both pipelines),
p when it goes through shared memory, two index windows, the barriers; a configuration above
the H200's 227 KiB is refused (ValueError naming ``num_stages`` and ``pages_per_step``). It
sets the programs an SM can hold (``programs_per_sm``: 3 at 67 KiB, 2 at 83 KiB, 1 above 113
KiB), traded against pages in flight a program.

GQA padding. A WGMMA tile has 64 rows (one warpgroup), so the ``G`` (1 to 8) query heads of a KV
head fill ``G`` of 64 rows (``q_len x G`` with several new tokens; they must fit,
``max_query_len``). The tile starts on the 8-row boundary at or before the head's first row of
``q`` (a tiled TMA starts on a tile), so the head's rows sit at an offset of 0 to 7 in it. What
the padding costs: ``64 / G`` times the tensor-core work the heads need (64x at ``G = 1``, 8x
at ``G = 8``; a page's two small WGMMAs stay far below the tensor cores' rate at one page every
few hundred nanoseconds a program, but they and the ``[64, 16]`` softmax are latency on the
critical path of each step), a 64-row query tile in shared memory (16 KiB at ``D = 128``) read
once a program (its extra rows belong to neighbouring heads and mostly hit L2), and 64 rows of
float32 softmax state in registers. No padded row is ever stored; no HBM byte is added to the
K/V stream.

Unused key slots. The last page of an item holds ``last_page_len`` keys, the rest of its slots
whatever was there before (possibly NaN); a step may also hold page slots past the item's end.
Their logits are masked (``MASKED_LOGIT``, so their weights are exactly 0) and, because a zero
weight times a NaN value is still NaN, their V rows are zeroed in shared memory before ``p @ V``
(only in the step that has such slots).

Bounds. The kernel never reads or writes outside its arrays, whatever the plan and table say:
a request outside the batch is a padding item whose rows are not stored (final output); the
page range is cut to ``page_indices`` by one unsigned minimum each end; each page number is cut
to the pool by one unsigned minimum; copies that run past the end of ``q`` or ``page_indices``
are filled with zeros by the TMA unit.

The merge folded in (``merge="folded"``, issue 16; default ``"separate"``). A split plan's
partial states are otherwise merged by ``merge_states.py`` in a second launch; at B = 1 and 4
(every request split, 8 to 33 items) that launch and the partials' round trip are a visible
share of a 10-25 us call. Folded, each program stores its partial state as before, then counts
its arrival on its (request, KV head) counter, and the program that completes the count merges
the request's items into the final rows (``_merge_if_last_to_arrive``; same rule as
``merge_partial_states``). What Mosaic GPU Pallas (jax 0.11.2) offers for coordinating programs:
``plgpu.atomic_add`` (and max, min, and, or, xor) are store-only reductions (no old value comes
back, so no program learns it was last); ``pl.get_global(plgpu.SemaphoreType.REGULAR((n,)))``
gives global semaphores that Pallas zeroes before every launch (an aliased zero operand, one
small memset), ``plgpu.semaphore_signal`` adds to one after a warpgroup barrier
(``red.release.gpu``), ``pl.semaphore_read`` reads it (``ld.acquire``) and
``plgpu.semaphore_wait`` spins on it (not used: a program that waits for others deadlocks when
they are not all resident); ``plgpu.inline_mgpu`` reaches the NVVM dialect (the
``fence.proxy.async.global`` that orders a TMA store before the release); there is no grid-wide
barrier (cluster barriers only). Signal-then-read is the atomic "last one merges": the last
signal's own read sees the full count. The count is read once for the warpgroup
(``_read_uniformly``): a branch on per-thread reads diverged and hung the launch on an H100. Mosaic GPU's interpreter runs none of these (global
semaphores fail to trace, atomics fail on their effects, ``inline_mgpu`` is refused), but it
runs the grid one program at a time in order, so interpreted the item's rank in its request
stands in for the count; the semaphores are tested by lowering and compiled (``gpu``-marked
tests). The persistent alternative (one program a request and KV head looping over its splits)
would give up the split's parallelism, which is the reason to split. The partial states of a
folded launch keep ``folded_partial_rows`` rows an item, so the merge loads each as one ``[rows,
D]`` array over the 128 threads.

The arrival count is read once for the warpgroup: one thread reads it and stores it to shared
memory, a warpgroup barrier follows, and every thread branches on that one value. Read by every
thread, the count could differ between threads that read at different moments; threads that
skipped the merge never reached its warpgroup barrier, and the kernel hung on the GPU (an
H100, earlier on 2026-12-07). With the single read it passed its compiled tests on an H100 the
same day and measured 0.92x to 1.00x the separate merge at B = 1 and 4, so ``"separate"``
stays the default (``docs/benchmark_results/2026-11-30-gpu-checks.md``).

Mosaic GPU's interpreter (``interpret=True`` here, ``plgpu.InterpretGPUParams()``) runs TMA
copies, barriers, ``emit_pipeline`` and WGMMA with both operands in shared memory; it cannot run
a WGMMA whose left operand is in registers, nor ``pl.run_state`` accumulators, so the default
``probs_in_smem=False`` path runs compiled only (``tests/test_paged_decode_mgpu.py``'s
``gpu``-marked tests).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir.dialects import nvvm  # the NVVM dialect Mosaic GPU lowers to

from kernels_pallas.index_windows import (
    MAX_INDEX_WINDOW,
    aligned_window_start,
    index_buffer_entries,
    pad_page_indices,
    resolve_index_window,
)
from kernels_pallas.online_softmax import LN_2, LOG2_E, MASKED_LOGIT
from kernels_pallas.paged_decode import head_major, partial_rows, token_major, unsigned_min
from kernels_pallas.x64 import runs_in_32_bits

TILE_ROWS = 64  # a WGMMA tile's rows: one warpgroup
MAX_GROUP = 8  # query heads per KV head (the tile holds q_len x G rows: max_query_len)
PAGE_SIZE = 16  # the WGMMA K dimension of p @ V is one page
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
SUPPORTED_HEAD_DIMS = (64, 128)
MERGES = ("separate", "folded")  # split plans: merge_partial_states after, or in this launch
PIPELINES = ("emit", "ring")  # emit_pipeline (one WGMMA pair a page) or the hand-written ring
RING_PAGES_PER_STEP = (1, 2, 4, 8, 16)  # the ring's step: one WGMMA of N = 16 to 256 keys
MERGE_ITEMS_PER_CHUNK = 8  # merge="folded": partial states loaded at once (fewer for big blocks)
H200_SMEM_PER_PROGRAM_BYTES = 227 * 1024  # the most one block may allocate (sm_90)
H200_SMEM_PER_SM_BYTES = 228 * 1024


def _swizzle_bytes(minor_elements: int, dtype) -> int:
    """The widest shared-memory swizzle (32, 64 or 128 bytes) for a minor dimension of
    ``minor_elements``: 128 for q and K (head_dim), and for ``p @ V`` the bytes of its K
    dimension (the step's keys): 32 for one 16-token page, 64 for two, 128 from four up (both
    operands of one WGMMA share the swizzle)."""
    return min(128, minor_elements * jnp.dtype(dtype).itemsize)


def _transforms(minor_elements: int, dtype) -> tuple:
    """Shared-memory tiling and swizzle for a WGMMA operand whose minor dimension has
    ``minor_elements``: 8-row tiles as wide as the swizzle (``_swizzle_bytes``)."""
    swizzle = _swizzle_bytes(minor_elements, dtype)
    return (
        plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )


def _row_broadcast(row_values, shape):
    """``[rows]`` (WGMMA row layout) -> ``[rows, n]``: each row's value along its row."""
    return lax.broadcast_in_dim(row_values, shape, [0])


def paged_decode_mgpu_kernel(
    work_request_ref,  # [num_work] int32, GMEM; -1 (or any value outside the batch) = padding
    work_page_start_ref,  # [num_work] int32, GMEM, offset into page_indices
    work_page_end_ref,  # [num_work] int32, GMEM
    work_last_page_len_ref,  # [num_work] int32, GMEM, valid slots in the item's final page
    page_indices_ref,  # [num_indices] int32, GMEM
    # Only when q_len > 1 (the causal bound needs each request's length), the table's
    #   page_indptr_ref,  # [batch + 1] int32, GMEM
    #   request_last_page_len_ref,  # [batch] int32, GMEM
    # then always:
    #   q_ref,  # [batch * KVH * q_len * G, head_dim], GMEM, rows (request, KV head, token, g)
    #   k_pages_ref,  # [num_pages, KVH, page_size, head_dim], GMEM
    #   v_pages_ref,  # [num_pages, KVH, page_size, head_dim], GMEM
    # and the outputs, final (write_final) or per-work-item partials (R = q_len * G rows a KV
    # head, P = R padded to a power of two):
    #   o_ref,  # [batch * KVH * R, head_dim] q.dtype | [num_work * KVH * P, head_dim] float32
    #   lse_ref,  # [batch * KVH * R] | [num_work * KVH * P] float32
    # With merge="folded" (partials merged in this launch) the table's merge_indptr comes after
    # page_indices (and the causal table), the partials are the first two outputs (blocks of
    # P_fold = folded_partial_rows rows) and the final (o, lse) the last two:
    #   merge_indptr_ref,  # [batch + 1] int32, GMEM
    #   final_o_ref,  # [batch * KVH * R, head_dim] q.dtype
    #   final_lse_ref,  # [batch * KVH * R] float32
    *refs,
    q_len: int,
    group_size: int,
    partial_block: int,
    num_kv_heads: int,
    pages_per_step: int,
    num_stages: int,
    index_window: int,
    logit_scale_log2: float,
    logits_soft_cap: float | None,
    sm_scale: float,
    write_final: bool,
    probs_in_smem: bool,
    pipeline: str,
    merge: str = "separate",
    folded_interpret: bool = False,
    table_entries: int | None = None,
):
    if q_len > 1:
        page_indptr_ref, request_last_page_len_ref, *refs = refs
    folded = merge == "folded" and not write_final
    if folded:
        merge_indptr_ref, *refs = refs
        q_ref, k_pages_ref, v_pages_ref, o_ref, lse_ref, final_o_ref, final_lse_ref = refs
    else:
        q_ref, k_pages_ref, v_pages_ref, o_ref, lse_ref = refs
    work = lax.axis_index("work")
    kv_head = lax.axis_index("kv_head")
    num_pages, _, page_size, head_dim = k_pages_ref.shape
    # The table's own length, before the wrapper's padding (index_windows.py): an item's range
    # past it is cut there, as the Triton kernel cuts it.
    num_indices = page_indices_ref.shape[0] if table_entries is None else table_entries
    dtype = k_pages_ref.dtype
    query_rows = q_len * group_size  # this KV head's rows: every new token's group of heads
    batch = q_ref.shape[0] // (num_kv_heads * query_rows)
    steps_per_window = index_window // pages_per_step

    # The clamps of the Triton kernel (its docstring says why each is one unsigned minimum).
    request = work_request_ref[work]
    is_padding = request.astype(jnp.uint32) >= batch  # -1 (the planner's padding) wraps up
    request = jnp.where(is_padding, 0, request)
    page_start = unsigned_min(work_page_start_ref[work], num_indices)
    page_end = unsigned_min(work_page_end_ref[work], num_indices)
    last_page_len = work_last_page_len_ref[work]
    num_item_pages = jnp.maximum(page_end - page_start, 0)
    num_tokens = jnp.where(num_item_pages > 0, (num_item_pages - 1) * page_size + last_page_len, 0)
    num_windows = pl.cdiv(num_item_pages, index_window)
    # Windows are copied from the multiple of 4 entries at or below the item's first (a bulk
    # copy starts on 16 bytes: kernels_pallas/index_windows.py); the item's pages begin at entry
    # `index_shift` of each window's buffer.
    index_start, index_shift = aligned_window_start(page_start)
    first_row = (request * num_kv_heads + kv_head) * query_rows
    row_offset = lax.rem(first_row, 8)  # of the head's rows in the query tile
    causal = None
    if q_len > 1:
        # Token l of the request sits at position seq_len - q_len + l and sees the keys up to
        # its own: in this item's key numbering, keys below causal_base + l (the Triton
        # kernel's rule; a request shorter than q_len under jit gives its early tokens no key).
        request_first_page = page_indptr_ref[request]
        request_pages = page_indptr_ref[request + 1] - request_first_page
        seq_len = jnp.where(
            request_pages > 0,
            (request_pages - 1) * page_size + request_last_page_len_ref[request],
            0,
        )
        item_first_position = (page_start - request_first_page) * page_size
        causal = dict(
            base=seq_len - q_len + 1 - item_first_position,
            row_offset=row_offset,
            group_size=group_size,
        )

    ring = pipeline == "ring"
    # Keys of one WGMMA pair: a page (emit_pipeline: one pair a page), or the step's pages side
    # by side (the ring: one pair a step).
    pair_tokens = pages_per_step * page_size if ring else page_size
    k_transforms = _transforms(head_dim, dtype)
    v_transforms = _transforms(pair_tokens, dtype)
    # A step of either pipeline: what every step passes to _attend_step besides its key and
    # value slots, the number of its first key and (the ring) when its values have landed.
    attend_step = functools.partial(
        _attend_step,
        num_tokens=num_tokens,
        causal=causal,
        logit_scale_log2=logit_scale_log2,
        logits_soft_cap=logits_soft_cap,
        sm_scale=sm_scale,
        probs_in_smem=probs_in_smem,
        dtype=dtype,
    )

    def copy_index_window(window, buffers, barriers):
        slot = lax.rem(window, 2)
        plgpu.copy_gmem_to_smem(
            page_indices_ref.at[
                pl.ds(index_start + window * index_window, index_buffer_entries(index_window))
            ],
            buffers.at[slot],
            barriers.at[slot],
        )

    def stream_ring(state, q_smem, probs_smem, index_buffers, index_barriers, rings):
        """The item's pages through the hand-written ring: ``num_stages`` slots, each the K (and
        the V) of one step's ``pages_per_step`` pages side by side, ``[pair_tokens, D]``, one
        barrier a slot for K and one for V (``pages_per_step`` copies arrive on each): a step's
        ``q @ K^T`` and softmax start when its K has landed, while its V may still be in
        flight (K is issued first). One loop over all the item's steps: the index windows are
        fetched ahead inside it, so nothing drains between windows."""
        k_ring, v_ring, k_ready, v_ready = rings
        num_steps = pl.cdiv(num_item_pages, pages_per_step)

        def issue(step):
            # Step `step`'s page numbers: entries offset .. of window `window`, held in buffer
            # window % 2. The first step of a window waits for that window's copy, then starts
            # the next window's into the other buffer, whose entries were all issued by then
            # (steps are issued in order).
            window = lax.div(step, steps_per_window)
            offset = (step - window * steps_per_window) * pages_per_step
            buffer = lax.rem(window, 2)

            @pl.when(offset == 0)
            def _():
                plgpu.barrier_wait(index_barriers.at[buffer])

                @pl.when(window + 1 < num_windows)
                def _():
                    copy_index_window(window + 1, index_buffers, index_barriers)

            slot = lax.rem(step, num_stages)
            # A bad index reads a wrong page, never past the pool (one unsigned minimum).
            numbers = [
                unsigned_min(index_buffers[buffer, index_shift + offset + page], num_pages - 1)
                for page in range(pages_per_step)
            ]
            for pages_ref, ring_ref, ready in (
                (k_pages_ref, k_ring, k_ready),
                (v_pages_ref, v_ring, v_ready),
            ):
                for page, number in enumerate(numbers):
                    plgpu.copy_gmem_to_smem(
                        pages_ref.at[number, kv_head],
                        ring_ref.at[slot, pl.ds(page * page_size, page_size)],
                        ready.at[slot],
                    )

        lax.fori_loop(0, jnp.minimum(num_steps, num_stages), lambda step, _: issue(step), None)

        def step_body(step, state):
            slot = lax.rem(step, num_stages)
            plgpu.barrier_wait(k_ready.at[slot])
            state = attend_step(
                state,
                q_smem,
                probs_smem,
                [k_ring.at[slot]],
                [v_ring.at[slot]],
                first_key=step * pair_tokens,
                wait_for_values=lambda: plgpu.barrier_wait(v_ready.at[slot]),
            )

            # The step's WGMMAs have finished reading the slot (their results are in
            # registers): refill it with the step num_stages ahead.
            @pl.when(step + num_stages < num_steps)
            def _():
                issue(step + num_stages)

            return state

        return lax.fori_loop(0, num_steps, step_body, state)

    def scoped(q_smem, probs_smem, index_buffers, q_barrier, index_barriers, *rings):
        # The query tile: 64 rows from the 8-row tile boundary at or before this KV head's first
        # row (a tiled copy starts on a tile), so the head's R = q_len x G rows are rows
        # row_offset .. row_offset + R - 1; the others belong to other heads (or lie past q's
        # end, zero-filled) and are computed but never stored.
        plgpu.copy_gmem_to_smem(
            q_ref.at[pl.ds(pl.multiple_of(first_row - row_offset, 8), TILE_ROWS)],
            q_smem,
            q_barrier,
        )

        @pl.when(num_windows > 0)
        def _():
            copy_index_window(0, index_buffers, index_barriers)

        plgpu.barrier_wait(q_barrier)

        def window_body(window, state):
            slot = lax.rem(window, 2)
            plgpu.barrier_wait(index_barriers.at[slot])

            @pl.when(window + 1 < num_windows)
            def _():
                copy_index_window(window + 1, index_buffers, index_barriers)

            window_pages = jnp.minimum(num_item_pages - window * index_window, index_window)
            page_numbers = index_buffers.at[slot]

            def index_map(step, page):
                # A bad index reads a wrong page, never past the pool (one unsigned minimum).
                entry = index_shift + step * pages_per_step + page
                number = unsigned_min(page_numbers[entry], num_pages - 1)
                return number, kv_head, 0, 0

            block = (None, None, page_size, head_dim)
            # One slot a page, K's then V's, each operand with its own smem transforms.
            k_specs, v_specs = (
                [
                    plgpu.BlockSpec(
                        block, functools.partial(index_map, page=t), transforms=transforms
                    )
                    for t in range(pages_per_step)
                ]
                for transforms in (k_transforms, v_transforms)
            )

            def step_body(indices, *slots_and_state):
                *slots, state = slots_and_state
                k_slots, v_slots = slots[:pages_per_step], slots[pages_per_step:]
                (step,) = indices
                first_key = ((window * steps_per_window + step) * pages_per_step) * page_size
                return attend_step(state, q_smem, probs_smem, k_slots, v_slots, first_key=first_key)

            return plgpu.emit_pipeline(
                step_body,
                grid=(pl.cdiv(window_pages, pages_per_step),),
                in_specs=k_specs + v_specs,
                max_concurrent_steps=num_stages,
                init_carry=state,
            )(*([k_pages_ref] * pages_per_step), *([v_pages_ref] * pages_per_step))

        state = (
            plgpu.layout_cast(jnp.zeros((TILE_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(
                jnp.full((TILE_ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)
            ),
            plgpu.layout_cast(jnp.zeros((TILE_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        )
        if ring:
            return stream_ring(state, q_smem, probs_smem, index_buffers, index_barriers, rings)
        return lax.fori_loop(0, num_windows, window_body, state)

    pairs_per_step = 1 if ring else pages_per_step
    probs_scratch = (
        plgpu.SMEM((pairs_per_step, TILE_ROWS, pair_tokens), dtype, transforms=v_transforms)
        if probs_in_smem
        else None
    )
    ring_scratch = ()
    if ring:
        ring_scratch = (
            plgpu.SMEM((num_stages, pair_tokens, head_dim), dtype, transforms=k_transforms),
            plgpu.SMEM((num_stages, pair_tokens, head_dim), dtype, transforms=v_transforms),
            plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=num_stages),
        )
    acc, running_max, running_sum = pl.run_scoped(
        scoped,
        plgpu.SMEM((TILE_ROWS, head_dim), dtype, transforms=k_transforms),
        probs_scratch,
        plgpu.SMEM((2, index_buffer_entries(index_window)), jnp.int32),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=2),
        *ring_scratch,
    )

    # finish: the normalized output and the natural-log LSE; a row that saw no key gets o = 0
    # and lse = -inf (online_softmax.finish, in the WGMMA layouts).
    nonempty = running_sum > 0
    out = acc / _row_broadcast(jnp.where(nonempty, running_sum, 1.0), acc.shape)
    lse = jnp.where(nonempty, (running_max + jnp.log2(running_sum)) * LN_2, -jnp.inf)
    if write_final:
        first_out = first_row
        store = jnp.logical_not(is_padding)  # a padding item's rows would be request 0's
    else:
        first_out = (work * num_kv_heads + kv_head) * partial_block
        store = None  # every item's partial rows are its own; a padding item's stay empty
    # (partial_block is folded_partial_rows(R, D) with merge="folded": the merge's load width)

    def write(o_smem, lse_smem):
        o_smem[...] = out.astype(o_ref.dtype)
        lse_smem[...] = lse
        plgpu.commit_smem()

        def store_rows():
            # The R real rows; a partial block's padding rows (P - R) are left unwritten, as
            # merge_partial_states discards them.
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(row_offset, query_rows)], o_ref.at[pl.ds(first_out, query_rows)]
            )
            # Scalars: a TMA row must be a multiple of 16 bytes (4 float32) and start aligned.
            for row in range(query_rows):
                lse_ref[first_out + row] = lse_smem[row_offset + row]

        if store is None:
            store_rows()
        else:
            pl.when(store)(store_rows)
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        write,
        plgpu.SMEM((TILE_ROWS, head_dim), o_ref.dtype),  # rows row_offset .. + R - 1 used
        plgpu.SMEM((TILE_ROWS,), jnp.float32),
    )
    if folded:
        _merge_if_last_to_arrive(
            o_ref,
            lse_ref,
            merge_indptr_ref,
            final_o_ref,
            final_lse_ref,
            work=work,
            kv_head=kv_head,
            request=request,
            is_padding=is_padding,
            first_row=first_row,
            query_rows=query_rows,
            partial_block=partial_block,
            num_kv_heads=num_kv_heads,
            interpret=folded_interpret,
        )


def folded_partial_rows(query_rows: int, head_dim: int) -> int:
    """Rows a (work item, KV head) partial state keeps with ``merge="folded"``: ``partial_rows``
    (``q_len x G`` padded to a power of two), at least ``128 / head_dim``, so that the merge
    loads one block as a ``[rows, head_dim]`` array spread over the warpgroup's 128 threads
    (a strided register layout needs a multiple of 128 elements).

    Example:
      >>> folded_partial_rows(1, 64), folded_partial_rows(1, 128), folded_partial_rows(3, 64)
      (2, 1, 4)
    """
    return max(partial_rows(query_rows), 128 // head_dim)


def _fence_async_proxy_global():
    """``fence.proxy.async.global``: orders this thread's TMA (async proxy) writes to global
    memory, completed by ``wait_smem_to_gmem``, before its later generic accesses (the release
    of the arrival counter), so that the program that merges, with generic loads, sees them.
    Compiled only (the interpreter has no proxies)."""

    @plgpu.inline_mgpu()
    def fence(ctx):
        del ctx
        nvvm.fence_proxy(nvvm.ProxyKind.async_global)

    fence()


def _strided_layout(rows: int, head_dim: int):
    """The merge's register layout of a ``[rows, head_dim]`` float32 block: consecutive
    elements over the 128 threads, two at a time (8-byte loads) where the block allows."""
    return plgpu.Layout.WG_STRIDED((rows, head_dim), vec_size=min(2, rows * head_dim // 128))


def _read_uniformly(counter) -> jax.Array:
    """The count of ``counter`` as ONE value for the whole warpgroup.

    ``pl.semaphore_read`` is a load by every thread (``ld.acquire``), and threads that load at
    different moments can see different counts while other programs still signal. A branch on
    such a count diverges inside the warpgroup; the merge's body holds a warpgroup barrier (the
    ``commit_smem`` before its TMA store), which the threads that skipped the branch never reach:
    the launch hangs (seen on an H100, 2026-12-07: compiled, launched, never finished). So every
    thread stores what it read to one shared-memory word, a warpgroup barrier follows
    (``commit_smem``), and every thread loads the word: one of the reads, the same for all.
    A count only grows, so the value is at most the true count and "full" still means every
    item arrived; the last program to signal reads the full count in every thread (each of its
    reads follows its own signal), so at least one program merges. Each thread's own acquire
    load came first, so the partial states it then reads are those the signals released."""
    read = pl.semaphore_read(counter)

    def through_smem(word):
        word[0] = read
        plgpu.commit_smem()
        return word[0]

    return pl.run_scoped(through_smem, plgpu.SMEM((1,), jnp.int32))


def _merge_if_last_to_arrive(
    partial_o_ref,  # [num_work * KVH * P_fold, head_dim] float32, GMEM
    partial_lse_ref,  # [num_work * KVH * P_fold] float32, GMEM
    merge_indptr_ref,  # [batch + 1] int32, GMEM
    final_o_ref,  # [batch * KVH * R, head_dim] q.dtype, GMEM
    final_lse_ref,  # [batch * KVH * R] float32, GMEM
    *,
    work,
    kv_head,
    request,
    is_padding,
    first_row,
    query_rows: int,
    partial_block: int,
    num_kv_heads: int,
    interpret: bool,
):
    """``merge="folded"``: after this program's partial state is in global memory, count its
    arrival on its (request, KV head); the program that brings the count to the request's
    number of items merges all of them into the final rows.

    The counter: one of ``batch x KVH`` global semaphores (``pl.get_global``; Pallas zeroes
    them before every launch, so no program resets them). A program signals its counter
    (``red.release.gpu`` after a warpgroup barrier, so the partial rows written before it are
    released) and reads it back (``ld.acquire``): a count equal to the request's items means
    every item's partial state is visible. At least one program sees the full count (the last
    signal is followed by its own read); more than one may, when the last signals land before
    earlier readers read, and then each writes the same final rows from the same partials
    (same bits), which is harmless.

    The merge (``proofs/merge_states.md``, as ``merge_partial_states``): per row, the largest
    LSE over the items, each item's weight ``2^(lse2_i - max)`` in base 2 (``lse2 = lse x
    log2 e``), empty items (``lse = -inf``) weight 0, a row that saw no key in any item gets o =
    0 and lse = -inf; the LSE written is natural-log. One pass over the items in chunks of up
    to ``MERGE_ITEMS_PER_CHUNK`` (their ``R`` LSE scalars and ``[P_fold, D]`` blocks loaded
    together, then one online-softmax rescale a chunk), the blocks in a strided register
    layout (each thread a few elements of a block; a row's weight is spread over the block by
    one select a row on the row index). Items past the request's last in a chunk reread its
    first item's block (in bounds) with weight 0.

    Interpreted, there are no semaphores, but Mosaic GPU's interpreter runs the grid one program
    at a time in grid order (work items innermost), so a request's items arrive in index order
    and the count after item ``w`` is ``w - first + 1``, which stands in for the counter."""
    num_work = partial_lse_ref.shape[0] // (num_kv_heads * partial_block)
    head_dim = partial_o_ref.shape[1]
    batch = merge_indptr_ref.shape[0] - 1
    first = jnp.clip(merge_indptr_ref[request], 0, num_work)
    last = jnp.clip(merge_indptr_ref[request + 1], first, num_work)
    if interpret:
        arrived = work - first + 1
    else:
        counters = pl.get_global(plgpu.SemaphoreType.REGULAR((batch * num_kv_heads,)))
        counter = counters.at[request * num_kv_heads + kv_head]
        _fence_async_proxy_global()

        @pl.when(jnp.logical_not(is_padding))
        def _():
            plgpu.semaphore_signal(counter, 1, memory_scope="gpu")

        arrived = _read_uniformly(counter)
    layout = _strided_layout(partial_block, head_dim)
    row = plgpu.broadcasted_iota(jnp.int32, (partial_block, head_dim), 0, layout=layout)

    def spread(per_row):
        """``R`` scalars -> ``[P_fold, D]``: row ``r`` holds scalar ``r``, padding rows 0."""
        block = jnp.zeros((partial_block, head_dim), jnp.float32)
        for r, value in enumerate(per_row):
            block = jnp.where(row == r, value, block)
        return block

    def block_row(item):
        return (item * num_kv_heads + kv_head) * partial_block

    # Items a chunk: their loads are independent straight-line code, issued together (one
    # memory latency a chunk, not one an item), as many as ~32 float32 registers a thread hold.
    elements_per_thread = partial_block * head_dim // 128
    items_per_chunk = max(1, min(MERGE_ITEMS_PER_CHUNK, 32 // elements_per_thread))

    @pl.when(jnp.logical_and(jnp.logical_not(is_padding), arrived == last - first))
    def _():
        def merge_chunk(chunk, carry):
            # One online-softmax step over the chunk's items (base 2): rescale what was
            # merged so far to the new per-row maximum, add the chunk's weighted blocks.
            acc, maxima, sums = carry
            items = [first + chunk * items_per_chunk + u for u in range(items_per_chunk)]
            real = [item < last for item in items]
            # Past the request's last item: a real item's block again (in bounds), weight 0.
            bases = [
                block_row(jnp.where(ok, item, first)) for item, ok in zip(items, real, strict=True)
            ]
            lse2 = [
                [
                    jnp.where(ok, partial_lse_ref[base + r] * LOG2_E, -jnp.inf)
                    for r in range(query_rows)
                ]
                for base, ok in zip(bases, real, strict=True)
            ]
            blocks = [
                plgpu.load(
                    partial_o_ref.at[pl.ds(base, partial_block)], layout=layout, optimized=False
                )
                for base in bases
            ]
            new_maxima = [
                functools.reduce(jnp.maximum, [item_lse2[r] for item_lse2 in lse2], maxima[r])
                for r in range(query_rows)
            ]
            # Where every item so far is empty (-inf), shift by 0: the weights stay 0, not NaN.
            shifts = [jnp.where(m == -jnp.inf, jnp.float32(0.0), m) for m in new_maxima]
            scales = [jnp.exp2(m - shift) for m, shift in zip(maxima, shifts, strict=True)]
            weights = [
                [jnp.exp2(x - shift) for x, shift in zip(item_lse2, shifts, strict=True)]
                for item_lse2 in lse2
            ]
            acc = acc * spread(scales)
            for item_weights, block in zip(weights, blocks, strict=True):
                acc = acc + spread(item_weights) * block
            sums = tuple(
                sums[r] * scales[r] + sum(item_weights[r] for item_weights in weights)
                for r in range(query_rows)
            )
            return acc, tuple(new_maxima), sums

        acc = plgpu.layout_cast(jnp.zeros((partial_block, head_dim), jnp.float32), layout)
        rows_init = (jnp.float32(-jnp.inf),) * query_rows, (jnp.float32(0.0),) * query_rows
        num_chunks = pl.cdiv(last - first, items_per_chunk)
        acc, maxima, sums = lax.fori_loop(0, num_chunks, merge_chunk, (acc, *rows_init))
        shifts = [jnp.where(m == -jnp.inf, jnp.float32(0.0), m) for m in maxima]
        nonempty = [s > 0 for s in sums]
        inverse = [
            jnp.where(n, 1.0 / jnp.where(n, s, 1.0), 0.0)
            for n, s in zip(nonempty, sums, strict=True)
        ]
        out = acc * spread(inverse)
        for r in range(query_rows):
            final_lse_ref[first_row + r] = jnp.where(
                nonempty[r],
                (shifts[r] + jnp.log2(jnp.where(nonempty[r], sums[r], 1.0))) * LN_2,
                -jnp.inf,
            )

        def store(out_smem):
            out_smem[...] = out.astype(out_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                out_smem.at[pl.ds(0, query_rows)], final_o_ref.at[pl.ds(first_row, query_rows)]
            )
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(store, plgpu.SMEM((partial_block, head_dim), final_o_ref.dtype))


def _attend_step(
    state,
    q_smem,
    probs_smem,
    k_slots,
    v_slots,
    *,
    first_key,
    num_tokens,
    causal,
    logit_scale_log2,
    logits_soft_cap,
    sm_scale,
    probs_in_smem,
    dtype,
    wait_for_values=None,
):
    """One pipeline step: the online-softmax update over ``len(k_slots)`` key blocks in SMEM,
    one ``q @ K^T`` and one ``p @ V`` WGMMA a block: each block a page (``emit_pipeline``, one
    slot a page) or the step's pages side by side (the ring, one ``[pages_per_step x
    page_size, D]`` slot a step, so one block and larger matmuls). One running max a step.

    ``causal`` (several new tokens) holds ``base``, ``row_offset`` and ``group_size``: tile row
    ``r`` is token ``(r - row_offset) // group_size`` and sees the item's keys below ``base``
    plus its token; None for one new token (every key of the item is visible).
    ``wait_for_values``, when given, is called before V is first touched (the ring's V
    barrier); the K slots must have landed before the call."""
    acc, running_max, running_sum = state
    num_blocks = len(k_slots)
    block_tokens = k_slots[0].shape[0]
    head_dim = acc.shape[1]

    def qk(*accumulators):
        for k_slot, accumulator in zip(k_slots, accumulators, strict=True):
            plgpu.wgmma(accumulator, q_smem, k_slot.T)
        return [accumulator[...] for accumulator in accumulators]

    logits = pl.run_scoped(qk, *[plgpu.ACC((TILE_ROWS, block_tokens), jnp.float32)] * num_blocks)
    column = plgpu.broadcasted_iota(
        jnp.int32, (TILE_ROWS, block_tokens), 1, layout=plgpu.Layout.WGMMA
    )
    visible_keys = num_tokens
    if causal is not None:
        row = plgpu.broadcasted_iota(
            jnp.int32, (TILE_ROWS, block_tokens), 0, layout=plgpu.Layout.WGMMA
        )
        group = causal["group_size"]
        # (r - row_offset) // G with a non-negative numerator (truncating division = floor).
        token = lax.div(row + (8 * group - causal["row_offset"]), jnp.int32(group)) - 8
        visible_keys = jnp.minimum(causal["base"] + token, num_tokens)  # [64, block_tokens]
    masked_logits, visible = [], []
    for block, block_logits in enumerate(logits):
        if logits_soft_cap is None:
            block_logits = block_logits * logit_scale_log2
        else:
            block_logits = (
                logits_soft_cap * jnp.tanh(block_logits * (sm_scale / logits_soft_cap)) * LOG2_E
            )
        key = column + (first_key + block * block_tokens)
        visible.append(key < visible_keys)
        masked_logits.append(jnp.where(visible[-1], block_logits, MASKED_LOGIT))
    new_max = running_max
    for block_logits in masked_logits:
        new_max = jnp.maximum(new_max, block_logits.max(axis=1))
    correction = jnp.exp2(running_max - new_max)
    probs = [jnp.exp2(x - _row_broadcast(new_max, x.shape)) for x in masked_logits]
    if causal is not None:
        # A row that sees no key of this step (nor before) has only MASKED_LOGIT, its max too,
        # so exp2 gives 1, not 0: its weights must be zeroed. With one new token a masked key
        # only ever follows a real one in the item (online_softmax.py's argument), so no select.
        probs = [jnp.where(v, p, 0.0) for v, p in zip(visible, probs, strict=True)]
    running_sum = running_sum * correction
    for block_probs in probs:
        running_sum = running_sum + block_probs.sum(axis=1)

    if wait_for_values is not None:
        wait_for_values()
    # A zero weight times a NaN in an unused slot is still NaN: zero the V rows of keys past the
    # item's end (the last page's tail, slots past the last page) before p @ V. Only the item's
    # last step has any.
    for block, v_slot in enumerate(v_slots):
        valid_rows = num_tokens - (first_key + block * block_tokens)

        @pl.when(valid_rows < block_tokens)
        def _(v_slot=v_slot, valid_rows=valid_rows):
            layout = plgpu.Layout.SMEM_GMEM_COPY(
                (block_tokens, head_dim), dtype, _swizzle_bytes(block_tokens, dtype)
            )
            values = plgpu.load(v_slot, layout=layout)
            row = plgpu.broadcasted_iota(jnp.int32, (block_tokens, head_dim), 0, layout=layout)
            v_slot[...] = jnp.where(row < valid_rows, values, jnp.zeros_like(values))
            plgpu.commit_smem()

    acc = acc * _row_broadcast(correction, acc.shape)
    if probs_in_smem:
        for block, block_probs in enumerate(probs):
            probs_smem[block] = block_probs.astype(dtype)
        plgpu.commit_smem()

        def pv(accumulator):
            for block, v_slot in enumerate(v_slots):
                plgpu.wgmma(accumulator, probs_smem.at[block], v_slot)
            return accumulator[...]

        acc = acc + pl.run_scoped(pv, plgpu.ACC((TILE_ROWS, head_dim), jnp.float32))
    else:

        def pv_from_registers(accumulator):
            for block_probs, v_slot in zip(probs, v_slots, strict=True):
                plgpu.wgmma(accumulator, block_probs.astype(dtype), v_slot)

        acc = pl.run_state(pv_from_registers)(plgpu.ACC.init(acc))
    return acc, new_max, running_sum


def _runs_in_32_bits_also_interpreted(jitted):
    """``x64.runs_in_32_bits``, except for an interpreted call with x64 on: Mosaic GPU's
    interpreter runs host callbacks, which ``jax.export`` cannot serialize, so that call is
    traced and run with x64 off instead (eagerly; under an outer ``jit`` with x64 on the
    interpreter's lowering may still meet 64-bit indices, as ``x64.py`` says of Pallas's)."""
    exported = runs_in_32_bits(jitted)

    @functools.wraps(jitted)
    def call(*args, **kwargs):
        if kwargs.get("interpret") and jax.config.read("jax_enable_x64"):
            with jax.enable_x64(False):
                return jitted(*args, **kwargs)
        return exported(*args, **kwargs)

    call.trace, call.lower = jitted.trace, jitted.lower
    return call


@_runs_in_32_bits_also_interpreted  # x64 mode: kernels_pallas/x64.py
@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "logits_soft_cap",
        "write_final",
        "pages_per_step",
        "num_stages",
        "index_window",
        "probs_in_smem",
        "pipeline",
        "merge",
        "interpret",
    ),
)
def paged_decode_mgpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_indices: jax.Array,
    work_request: jax.Array,
    work_page_start: jax.Array,
    work_page_end: jax.Array,
    work_last_page_len: jax.Array,
    *,
    page_indptr: jax.Array | None = None,
    last_page_len: jax.Array | None = None,
    merge_indptr: jax.Array | None = None,
    sm_scale: float,
    logits_soft_cap: float | None,
    write_final: bool,
    pages_per_step: int = 1,
    num_stages: int = 4,
    index_window: int | None = None,
    probs_in_smem: bool = False,
    pipeline: str = "emit",
    merge: str = "separate",
    interpret: bool | plgpu.InterpretGPUParams = False,
):
    """Runs the Mosaic GPU decode kernel over a list of work items (HND layout).

    Args:
      q: ``[B, H, D]`` (one new token a request) or ``[B, L, H, D]`` (the last ``L`` tokens of
        each request, causal among themselves), bfloat16 or float16; ``D`` 64 or 128. The
        ``L x G`` query rows of a KV head (``G = H / KVH``, 1 to 8) must fit one 64-row tile
        (``max_query_len``).
      k_pages, v_pages: ``[num_pages, KVH, page_size, D]`` (HND) in q's dtype; ``page_size`` 16.
      page_indices: int32 ``[num_indices]``.
      work_request, work_page_start, work_page_end, work_last_page_len: int32 ``[W]``, the work
        items of ``paged.plan_decode`` (request ``-1`` for padding; page range in
        ``page_indices``; valid slots of the range's final page). Invalid values give wrong
        results, never an access outside an array.
      page_indptr, last_page_len: the table's int32 ``[B + 1]`` and ``[B]``, which place an
        item's keys relative to the new tokens for the causal mask; needed when ``L > 1``,
        ignored (no kernel operands) otherwise.
      sm_scale, logits_soft_cap: as in ``paged.decode_attention``.
      write_final: write normalized ``(o, lse)`` shaped like ``q`` (``o`` in q's dtype, ``lse``
        float32 without ``D``; every request is one work item); else partial states ``(o [W,
        KVH, P, D] float32, lse [W, KVH, P] float32)``, ``P = partial_rows(L * G)``, row ``l *
        G + g`` token ``l``, head ``g``, as the Triton kernel writes them for
        ``merge_partial_states(..., num_q_heads=L * H)`` (rows past ``L * G`` are padding and
        are left unwritten here).
      pages_per_step: pages of K and of V a pipeline step copies and computes (static); with
        ``pipeline="ring"`` 1, 2, 4, 8 or 16 (one WGMMA over the step's keys: N of ``q @ K^T``
        at most 256).
      num_stages: pipeline steps in flight (``emit_pipeline``'s ``max_concurrent_steps``, or
        the ring's slots). The K and V slots of ``num_stages x pages_per_step`` pages must fit
        the H200's shared memory with the rest (``smem_bytes_per_program``).
      index_window: page numbers copied to shared memory at once (a multiple of 4 and of
        ``pages_per_step``, at most 252; default the largest such).
      probs_in_smem: store the softmax weights to shared memory before ``p @ V`` (runs in
        interpret mode); False feeds them from registers (compiled only).
      pipeline: how pages reach shared memory. ``"emit"``: ``plgpu.emit_pipeline``, one slot
        and one ``q @ K^T``, ``p @ V`` WGMMA pair a page (one softmax update a step), restarted
        every ``index_window`` pages. ``"ring"``: a hand-written ring of ``num_stages`` slots,
        each holding a step's pages side by side (``[pages_per_step x page_size, D]``), so one
        WGMMA pair over ``pages_per_step x 16`` keys and one softmax update a step, and one
        loop over the item's steps that fetches the next index window ahead (no drain).
      merge_indptr: the plan's int32 ``[B + 1]`` (request ``b``'s items are ``merge_indptr[b]
        .. merge_indptr[b + 1] - 1``); needed with ``merge="folded"`` and partial states.
      merge: for partial states (``write_final=False``): ``"separate"`` returns them, for
        ``merge_partial_states`` to merge in a second launch; ``"folded"`` merges them in
        this launch (the last item of a request to finish merges, through a global arrival
        counter, ``_merge_if_last_to_arrive``) and returns the final ``(o, lse)`` as
        ``write_final`` does. Ignored for final plans (nothing to merge).
      interpret: run in Mosaic GPU's interpret mode (CPU); needs ``probs_in_smem=True``. A
        ``plgpu.InterpretGPUParams`` sets the interpreter's options (its race detector).

    Returns:
      The final (``write_final`` or ``merge="folded"``) or partial ``(o, lse)`` described
      above.

    Raises:
      ValueError: for shapes, dtypes or static parameters the kernel does not take, and a
        missing table for ``L > 1`` (naming the argument and its value).
    """
    index_window = resolve_index_window(index_window, pages_per_step)
    validate_mgpu_decode_arguments(
        q,
        k_pages,
        v_pages,
        pages_per_step,
        num_stages,
        index_window,
        probs_in_smem,
        interpret,
        pipeline=pipeline,
        write_final=write_final,
        merge=merge,
    )
    q_len = 1 if q.ndim == 3 else q.shape[1]
    batch, num_q_heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    if q_len > 1:
        if page_indptr is None or last_page_len is None:
            raise ValueError(
                f"q_len={q_len} needs the table's page_indptr and last_page_len for the causal mask"
            )
        if page_indptr.shape != (batch + 1,) or last_page_len.shape != (batch,):
            raise ValueError(
                f"page_indptr and last_page_len must be [{batch + 1}] and [{batch}] for q's batch "
                f"of {batch} (the kernel reads them at a request's index), got "
                f"{page_indptr.shape} and {last_page_len.shape}"
            )
    folded = merge == "folded" and not write_final
    if folded and (merge_indptr is None or merge_indptr.shape != (batch + 1,)):
        raise ValueError(
            f"merge='folded' needs the plan's merge_indptr, [{batch + 1}] for q's batch of "
            f"{batch}, got {None if merge_indptr is None else merge_indptr.shape}"
        )
    num_kv_heads = k_pages.shape[1]
    group_size = num_q_heads // num_kv_heads
    query_rows = q_len * group_size
    partial_block = (
        folded_partial_rows(query_rows, head_dim) if folded else partial_rows(query_rows)
    )
    num_work = work_request.shape[0]
    total_rows = batch * num_q_heads * q_len
    final_type = (
        jax.ShapeDtypeStruct((total_rows, head_dim), q.dtype),
        jax.ShapeDtypeStruct((total_rows,), jnp.float32),
    )
    count = num_work * num_kv_heads * partial_block
    partial_type = (
        jax.ShapeDtypeStruct((count, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((count,), jnp.float32),
    )
    out_type = final_type if write_final else partial_type + (final_type if folded else ())
    if num_work == 0 or batch == 0:  # no program to launch
        outs = [jnp.zeros(t.shape, t.dtype) for t in out_type]
        if folded:  # the merge of no item: no key, o = 0 and lse = -inf
            outs[3] = jnp.full(outs[3].shape, -jnp.inf, jnp.float32)
    else:
        # Rows grouped by (request, KV head), token-major inside: q's own order for one token,
        # a small copy of q otherwise (the Triton kernel's row order).
        q_rows = head_major(q.reshape(batch, q_len, num_q_heads, head_dim), num_kv_heads)
        table = (page_indptr, last_page_len) if q_len > 1 else ()
        if folded:
            table += (merge_indptr,)
        outs = launch_paged_decode_mgpu_kernel(
            (work_request, work_page_start, work_page_end, work_last_page_len),
            page_indices,
            table,
            q_rows.reshape(total_rows, head_dim),
            k_pages,
            v_pages,
            out_type=out_type,
            q_len=q_len,
            group_size=group_size,
            partial_block=partial_block,
            sm_scale=sm_scale,
            logits_soft_cap=logits_soft_cap,
            write_final=write_final,
            pages_per_step=pages_per_step,
            num_stages=num_stages,
            index_window=index_window,
            probs_in_smem=probs_in_smem,
            pipeline=pipeline,
            merge=merge,
            interpret=interpret,
            name="paged_decode_mgpu",
            name_suffix=(f"_q{q_len}" if q_len > 1 else "")
            + ("_final" if write_final else "_folded" if folded else "_partial"),
        )
    if write_final or folded:
        o, lse = outs[-2:]
        o = token_major(o.reshape(batch, num_q_heads * q_len, head_dim), q_len, num_kv_heads)
        lse = token_major(lse.reshape(batch, num_q_heads * q_len), q_len, num_kv_heads)
        return o.reshape(q.shape), lse.reshape(q.shape[:-1])
    o, lse = outs
    return (
        o.reshape(num_work, num_kv_heads, partial_block, head_dim),
        lse.reshape(num_work, num_kv_heads, partial_block),
    )


def launch_paged_decode_mgpu_kernel(
    work: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    page_indices: jax.Array,
    table: tuple[jax.Array, ...],
    q_rows: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    *,
    out_type: tuple[jax.ShapeDtypeStruct, ...],
    q_len: int,
    group_size: int,
    partial_block: int,
    sm_scale: float,
    logits_soft_cap: float | None,
    write_final: bool,
    pages_per_step: int,
    num_stages: int,
    index_window: int,
    probs_in_smem: bool,
    pipeline: str,
    merge: str = "separate",
    interpret: bool | plgpu.InterpretGPUParams = False,
    name: str,
    name_suffix: str = "",
) -> tuple[jax.Array, ...]:
    """Launches ``paged_decode_mgpu_kernel`` once a (KV head, work item): the one launch that
    ``paged_decode_mgpu`` and the cascade's shared level (``cascade_shared_mgpu.py``, whose
    64-row query tiles pose as requests) share. Arguments are taken as checked
    (``validate_mgpu_decode_arguments``, ``validate_mgpu_pipeline_arguments``).

    Args:
      work: the work items ``(request, page_start, page_end, last_page_len)``, int32 ``[W]``
        each (request ``-1`` or outside the batch for padding).
      page_indices: int32 ``[num_indices]``, unpadded (padded here for the index windows).
      table: the kernel's optional operands after the page numbers, in its order: the table's
        ``(page_indptr [B + 1], last_page_len [B])`` when ``q_len > 1``, then ``merge_indptr
        [B + 1]`` for a folded merge; ``()`` otherwise.
      q_rows: ``[B x KVH x q_len x G, D]``, rows grouped by (request, KV head), token-major.
      k_pages, v_pages: ``[num_pages, KVH, 16, D]`` (HND).
      out_type: the kernel's outputs (the partial ``(o, lse)``, then the final ones when folded;
        or only the final ones with ``write_final``).
      q_len, group_size, partial_block: the kernel's row layout (``q_len x group_size`` rows a
        KV head, ``partial_block`` rows a partial state's block).
      sm_scale, logits_soft_cap, write_final, pages_per_step, num_stages, index_window,
      probs_in_smem, pipeline, merge, interpret: as ``paged_decode_mgpu`` takes them.
      name, name_suffix: the compiled kernel's name is ``{name}_{pipeline}_p{pages_per_step}
        _s{num_stages}`` then ``_psmem`` or ``_preg``, then ``name_suffix``.

    Returns:
      The kernel's outputs, shaped as ``out_type``.
    """
    num_kv_heads = k_pages.shape[1]
    kernel = functools.partial(
        paged_decode_mgpu_kernel,
        q_len=q_len,
        group_size=group_size,
        partial_block=partial_block,
        num_kv_heads=num_kv_heads,
        pages_per_step=pages_per_step,
        num_stages=num_stages,
        index_window=index_window,
        logit_scale_log2=sm_scale * LOG2_E,
        logits_soft_cap=logits_soft_cap,
        sm_scale=sm_scale,
        write_final=write_final,
        probs_in_smem=probs_in_smem,
        pipeline=pipeline,
        merge=merge,
        folded_interpret=bool(interpret),
        table_entries=page_indices.shape[0],
    )
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        # Mosaic GPU maps the last grid axis to CUDA's x (up to 2^31 - 1 blocks; y and z stop
        # at 65535): work items there, so any plan fits, launched item-fastest as the Triton
        # kernel's grid is.
        grid=(num_kv_heads, work[0].shape[0]),
        grid_names=("kv_head", "work"),
        interpret=_interpret_params(interpret),
        kernel_name=f"{name}_{pipeline}_p{pages_per_step}_s{num_stages}"
        + ("_psmem" if probs_in_smem else "_preg")
        + name_suffix,
    )(
        *work,
        pad_page_indices(page_indices, index_window),  # index_windows.py says why
        *table,
        q_rows,
        k_pages,
        v_pages,
    )


def _interpret_params(interpret):
    """``interpret`` as ``plgpu.kernel`` takes it: None (compiled), default interpreter
    parameters for True, or the caller's ``plgpu.InterpretGPUParams`` (e.g. with the race
    detector on)."""
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else None


# Cached: the decode entry asks once a traced call and the engine's host plan once a step
# (paged.decode.mgpu_kernel_supports), and the scan of 64 lengths cost ~10 us a call on a CPU.
@functools.cache
def max_query_len(group_size: int) -> int:
    """The most new tokens a request may bring for this group size: the ``L x G`` rows of a KV
    head, from their offset inside an 8-row tile (up to ``8 - gcd(L x G, 8)``), must fit the
    64-row query tile.

    Example:
      >>> [max_query_len(g) for g in (1, 2, 4, 8)]
      [64, 32, 16, 8]
    """
    fits = [
        q_len
        for q_len in range(1, TILE_ROWS + 1)
        if q_len * group_size + (8 - math.gcd(q_len * group_size, 8)) % 8 <= TILE_ROWS
    ]
    return max(fits, default=0)


def smem_bytes_per_program(
    head_dim: int,
    dtype,
    *,
    pages_per_step: int,
    num_stages: int,
    index_window: int = MAX_INDEX_WINDOW,
    probs_in_smem: bool = False,
    pipeline: str = "emit",
    write_final: bool = False,
    page_size: int = PAGE_SIZE,
) -> int:
    """Shared memory one program allocates, in bytes, at its peak (the main loop; the epilogue's
    buffers replace the loop's). Each buffer is counted rounded up to 1 KiB, the alignment a
    128-byte swizzle needs; barriers 8 bytes each, rounded up likewise.

    The loop holds the query tile ``[64, D]``, the K and V slots of ``num_stages x
    pages_per_step`` pages (both pipelines allocate the same), ``p`` when it goes through
    shared memory, the two index windows, and the barriers. The epilogue holds ``o``'s 64 rows
    (float32 for partial states) and 64 LSE values.

    Example:
      >>> import jax.numpy as jnp
      >>> smem_bytes_per_program(128, jnp.bfloat16, pages_per_step=4, num_stages=3) // 1024
      115
    """
    itemsize = jnp.dtype(dtype).itemsize

    def rounded(n: int) -> int:
        return -(-n // 1024) * 1024

    pair_tokens = pages_per_step * page_size if pipeline == "ring" else page_size
    pairs_per_step = 1 if pipeline == "ring" else pages_per_step
    kv_slot = rounded(pages_per_step * page_size * head_dim * itemsize)
    loop = (
        rounded(TILE_ROWS * head_dim * itemsize)
        + 2 * num_stages * kv_slot
        + (rounded(pairs_per_step * TILE_ROWS * pair_tokens * itemsize) if probs_in_smem else 0)
        + rounded(2 * index_buffer_entries(index_window) * 4)
        + rounded(8 * (3 + (2 if pipeline == "ring" else 1) * num_stages))
    )
    out_itemsize = itemsize if write_final else 4
    epilogue = rounded(TILE_ROWS * head_dim * out_itemsize) + rounded(TILE_ROWS * 4)
    return max(loop, epilogue)


def programs_per_sm(smem_bytes: int) -> int:
    """Programs of ``smem_bytes`` that fit one H200 SM's shared memory at once (its 228 KiB,
    1 KiB of which CUDA reserves per block); registers may allow fewer."""
    return H200_SMEM_PER_SM_BYTES // (smem_bytes + 1024)


def validate_mgpu_decode_arguments(
    q,
    k_pages,
    v_pages,
    pages_per_step,
    num_stages,
    index_window,
    probs_in_smem,
    interpret,
    *,
    pipeline="emit",
    write_final=False,
    merge="separate",
) -> None:
    """Raises ValueError for what ``paged_decode_mgpu`` cannot run, naming the value."""
    if q.ndim not in (3, 4):
        raise ValueError(
            "q must be [batch, num_q_heads, head_dim] or [batch, q_len, num_q_heads, head_dim], "
            f"got {q.shape}"
        )
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(
            "k_pages and v_pages must share one HND shape [num_pages, num_kv_heads, page_size, "
            f"head_dim], got {k_pages.shape} and {v_pages.shape}"
        )
    if not any(q.dtype == d for d in SUPPORTED_DTYPES) or k_pages.dtype != q.dtype:
        raise ValueError(
            f"q and the pages must both be bfloat16 or float16, got {q.dtype} and {k_pages.dtype}"
        )
    num_pages, num_kv_heads, page_size, head_dim = k_pages.shape
    if page_size != PAGE_SIZE:
        raise ValueError(f"page_size must be {PAGE_SIZE}, got {page_size}")
    if q.shape[-1] != head_dim or head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim must be one of {SUPPORTED_HEAD_DIMS} and equal in q and the pages, got "
            f"q's {q.shape[-1]} and the pages' {head_dim}"
        )
    num_q_heads = q.shape[-2]
    if num_q_heads % num_kv_heads or not 1 <= num_q_heads // num_kv_heads <= MAX_GROUP:
        raise ValueError(
            f"num_q_heads={num_q_heads} must be 1 to {MAX_GROUP} times num_kv_heads={num_kv_heads}"
        )
    q_len = 1 if q.ndim == 3 else q.shape[1]
    group_size = num_q_heads // num_kv_heads
    if not 1 <= q_len <= max_query_len(group_size):
        raise ValueError(
            f"q_len={q_len} must be 1 to {max_query_len(group_size)} for a group of "
            f"{group_size}: its q_len x group query rows must fit the {TILE_ROWS}-row tile"
        )
    if num_pages < 1:
        raise ValueError(f"the pool must hold at least one page, got num_pages={num_pages}")
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    validate_mgpu_pipeline_arguments(
        head_dim,
        q.dtype,
        pages_per_step=pages_per_step,
        num_stages=num_stages,
        index_window=index_window,
        probs_in_smem=probs_in_smem,
        pipeline=pipeline,
        interpret=interpret,
        write_final=write_final,
    )


def validate_mgpu_pipeline_arguments(
    head_dim: int,
    dtype,
    *,
    pages_per_step,
    num_stages,
    index_window,
    probs_in_smem,
    pipeline,
    interpret,
    write_final: bool = False,
) -> int:
    """Raises ValueError, naming the value, for a pipeline ``paged_decode_mgpu_kernel`` cannot
    run: the checks of the launch's static parameters that ``paged_decode_mgpu`` and the
    cascade's shared level (``cascade_shared_mgpu.py``) share.

    Args:
      head_dim: ``D`` of the pages (64 or 128, checked by the caller).
      dtype: the pages' dtype (bfloat16 or float16, checked by the caller).
      pages_per_step, num_stages, index_window, probs_in_smem, pipeline, interpret,
      write_final: as ``paged_decode_mgpu`` takes them (``index_window`` resolved, not None).

    Returns:
      The shared memory one program of this pipeline allocates, in bytes
      (``smem_bytes_per_program``), checked to fit the H200's 227 KiB.
    """
    if pages_per_step < 1:
        raise ValueError(f"pages_per_step must be >= 1, got {pages_per_step}")
    if pages_per_step > MAX_INDEX_WINDOW:
        raise ValueError(
            f"pages_per_step must be at most {MAX_INDEX_WINDOW} (one window of page numbers), "
            f"got {pages_per_step}"
        )
    if isinstance(index_window, bool) or not isinstance(index_window, (int, np.integer)):
        raise ValueError(f"index_window must be an int, got {index_window!r}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if not (
        1 <= index_window <= MAX_INDEX_WINDOW
        and index_window % pages_per_step == 0
        and index_window % 4 == 0
    ):
        raise ValueError(
            f"index_window must be a multiple of 4 and of pages_per_step={pages_per_step}, at "
            f"most {MAX_INDEX_WINDOW}, got {index_window}"
        )
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline must be one of {PIPELINES}, got {pipeline!r}")
    if pipeline == "ring" and pages_per_step not in RING_PAGES_PER_STEP:
        raise ValueError(
            f"pages_per_step must be one of {RING_PAGES_PER_STEP} with pipeline='ring' (one "
            f"WGMMA over the step's keys: a power of two, at most 256 keys), got {pages_per_step}"
        )
    smem_bytes = smem_bytes_per_program(
        head_dim,
        dtype,
        pages_per_step=pages_per_step,
        num_stages=num_stages,
        index_window=index_window,
        probs_in_smem=probs_in_smem,
        pipeline=pipeline,
        write_final=write_final,
    )
    if smem_bytes > H200_SMEM_PER_PROGRAM_BYTES:
        raise ValueError(
            f"num_stages={num_stages} with pages_per_step={pages_per_step} needs "
            f"{smem_bytes / 1024:.0f} KiB of shared memory a program (head_dim={head_dim}), over "
            f"the H200's {H200_SMEM_PER_PROGRAM_BYTES // 1024} KiB: lower num_stages or "
            "pages_per_step"
        )
    if interpret and not probs_in_smem:
        raise ValueError(
            "interpret=True needs probs_in_smem=True: Mosaic GPU's interpreter cannot run a "
            "WGMMA whose left operand is in registers"
        )
    return smem_bytes
