"""Split-KV paged decode attention on Mosaic GPU (Pallas ``plgpu``): pages streamed by TMA.

Same contract as ``kernels_pallas/paged_decode.py`` (the Triton kernel) in the HND layout
(the layout whose page of one KV head is one contiguous tile, one TMA box; NHD would need a
strided box per page and is left out): the work items of ``paged.plan_decode``, the CSR page
table, one new token a request or ``q_len`` of them (causal among themselves, as there), final
``(o, lse)`` when ``write_final`` or partial states that ``merge_states.py`` merges unchanged.
Not yet wired into ``paged.decode_attention``. First compiled run on the H200 (2026-12-01,
``bench/probes/mgpu_decode.py``, two cases only; ``docs/benchmark_results/archive/
2026-12-01-mgpu-decode-probe.md``): it agrees with the Triton kernel (largest difference of o
4.9e-4 in bfloat16) and is not yet faster: 171.6 against 165.1 us at B=32 x 4096 (3.13 TB/s;
the issue asks 3.6), 21.8 against 21.5 us at B=1 x 4096, with the register path, two pages a
step, three stages. The whole grid, tuning and memcheck are still to run.

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


def _transforms(minor_elements: int, dtype) -> tuple:
    """Shared-memory tiling and swizzle for a WGMMA operand whose minor dimension has
    ``minor_elements``: 8-row tiles as wide as the swizzle (128 bytes for q and K, whose minor
    dimension is head_dim; 32 bytes for p and V of a 16-token page, the K of ``p @ V``)."""
    swizzle = min(128, minor_elements * jnp.dtype(dtype).itemsize)
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
):
    if q_len > 1:
        page_indptr_ref, request_last_page_len_ref, *refs = refs
    q_ref, k_pages_ref, v_pages_ref, o_ref, lse_ref = refs
    work = lax.axis_index("work")
    kv_head = lax.axis_index("kv_head")
    num_pages, _, page_size, head_dim = k_pages_ref.shape
    num_indices = page_indices_ref.shape[0]
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

    k_transforms = _transforms(head_dim, dtype)
    v_transforms = _transforms(page_size, dtype)

    def copy_index_window(window, buffers, barriers):
        slot = lax.rem(window, 2)
        plgpu.copy_gmem_to_smem(
            page_indices_ref.at[
                pl.ds(index_start + window * index_window, index_buffer_entries(index_window))
            ],
            buffers.at[slot],
            barriers.at[slot],
        )

    def scoped(q_smem, probs_smem, index_buffers, q_barrier, index_barriers):
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
            k_specs = [
                plgpu.BlockSpec(
                    block, functools.partial(index_map, page=t), transforms=k_transforms
                )
                for t in range(pages_per_step)
            ]
            v_specs = [
                plgpu.BlockSpec(
                    block, functools.partial(index_map, page=t), transforms=v_transforms
                )
                for t in range(pages_per_step)
            ]

            def step_body(indices, *slots_and_state):
                *slots, state = slots_and_state
                k_slots, v_slots = slots[:pages_per_step], slots[pages_per_step:]
                (step,) = indices
                first_key = ((window * steps_per_window + step) * pages_per_step) * page_size
                return _attend_step(
                    state,
                    q_smem,
                    probs_smem,
                    k_slots,
                    v_slots,
                    first_key=first_key,
                    num_tokens=num_tokens,
                    causal=causal,
                    logit_scale_log2=logit_scale_log2,
                    logits_soft_cap=logits_soft_cap,
                    sm_scale=sm_scale,
                    probs_in_smem=probs_in_smem,
                    dtype=dtype,
                )

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
        return lax.fori_loop(0, num_windows, window_body, state)

    probs_scratch = (
        plgpu.SMEM((pages_per_step, TILE_ROWS, page_size), dtype, transforms=v_transforms)
        if probs_in_smem
        else None
    )
    acc, running_max, running_sum = pl.run_scoped(
        scoped,
        plgpu.SMEM((TILE_ROWS, head_dim), dtype, transforms=k_transforms),
        probs_scratch,
        plgpu.SMEM((2, index_buffer_entries(index_window)), jnp.int32),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=2),
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
):
    """One pipeline step: the online-softmax update over ``len(k_slots)`` pages in SMEM.

    ``causal`` (several new tokens) holds ``base``, ``row_offset`` and ``group_size``: tile row
    ``r`` is token ``(r - row_offset) // group_size`` and sees the item's keys below ``base``
    plus its token; None for one new token (every key of the item is visible)."""
    acc, running_max, running_sum = state
    pages_per_step = len(k_slots)
    page_size = k_slots[0].shape[0]
    head_dim = acc.shape[1]

    def qk(*accumulators):
        for k_slot, accumulator in zip(k_slots, accumulators, strict=True):
            plgpu.wgmma(accumulator, q_smem, k_slot.T)
        return [accumulator[...] for accumulator in accumulators]

    logits = pl.run_scoped(qk, *[plgpu.ACC((TILE_ROWS, page_size), jnp.float32)] * pages_per_step)
    column = plgpu.broadcasted_iota(jnp.int32, (TILE_ROWS, page_size), 1, layout=plgpu.Layout.WGMMA)
    visible_keys = num_tokens
    if causal is not None:
        row = plgpu.broadcasted_iota(
            jnp.int32, (TILE_ROWS, page_size), 0, layout=plgpu.Layout.WGMMA
        )
        group = causal["group_size"]
        # (r - row_offset) // G with a non-negative numerator (truncating division = floor).
        token = lax.div(row + (8 * group - causal["row_offset"]), jnp.int32(group)) - 8
        visible_keys = jnp.minimum(causal["base"] + token, num_tokens)  # [64, page_size]
    masked_logits, visible = [], []
    for page, page_logits in enumerate(logits):
        if logits_soft_cap is None:
            page_logits = page_logits * logit_scale_log2
        else:
            page_logits = (
                logits_soft_cap * jnp.tanh(page_logits * (sm_scale / logits_soft_cap)) * LOG2_E
            )
        key = column + (first_key + page * page_size)
        visible.append(key < visible_keys)
        masked_logits.append(jnp.where(visible[-1], page_logits, MASKED_LOGIT))
    new_max = running_max
    for page_logits in masked_logits:
        new_max = jnp.maximum(new_max, page_logits.max(axis=1))
    correction = jnp.exp2(running_max - new_max)
    probs = [jnp.exp2(x - _row_broadcast(new_max, x.shape)) for x in masked_logits]
    if causal is not None:
        # A row that sees no key of this step (nor before) has only MASKED_LOGIT, its max too,
        # so exp2 gives 1, not 0: its weights must be zeroed. With one new token a masked key
        # only ever follows a real one in the item (online_softmax.py's argument), so no select.
        probs = [jnp.where(v, p, 0.0) for v, p in zip(visible, probs, strict=True)]
    running_sum = running_sum * correction
    for page_probs in probs:
        running_sum = running_sum + page_probs.sum(axis=1)

    # A zero weight times a NaN in an unused slot is still NaN: zero the V rows of keys past the
    # item's end (the last page's tail, slots past the last page) before p @ V. Only the item's
    # last step has any.
    for page, v_slot in enumerate(v_slots):
        valid_rows = num_tokens - (first_key + page * page_size)

        @pl.when(valid_rows < page_size)
        def _(v_slot=v_slot, valid_rows=valid_rows):
            layout = plgpu.Layout.SMEM_GMEM_COPY((page_size, head_dim), dtype, 32)
            values = plgpu.load(v_slot, layout=layout)
            row = plgpu.broadcasted_iota(jnp.int32, (page_size, head_dim), 0, layout=layout)
            v_slot[...] = jnp.where(row < valid_rows, values, jnp.zeros_like(values))
            plgpu.commit_smem()

    acc = acc * _row_broadcast(correction, acc.shape)
    if probs_in_smem:
        for page, page_probs in enumerate(probs):
            probs_smem[page] = page_probs.astype(dtype)
        plgpu.commit_smem()

        def pv(accumulator):
            for page, v_slot in enumerate(v_slots):
                plgpu.wgmma(accumulator, probs_smem.at[page], v_slot)
            return accumulator[...]

        acc = acc + pl.run_scoped(pv, plgpu.ACC((TILE_ROWS, head_dim), jnp.float32))
    else:

        def pv_from_registers(accumulator):
            for page_probs, v_slot in zip(probs, v_slots, strict=True):
                plgpu.wgmma(accumulator, page_probs.astype(dtype), v_slot)

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
    sm_scale: float,
    logits_soft_cap: float | None,
    write_final: bool,
    pages_per_step: int = 1,
    num_stages: int = 4,
    index_window: int | None = None,
    probs_in_smem: bool = False,
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
      pages_per_step: pages of K and of V a pipeline step copies and computes (static).
      num_stages: pipeline steps in flight (``emit_pipeline``'s ``max_concurrent_steps``).
      index_window: page numbers copied to shared memory at once (a multiple of 4 and of
        ``pages_per_step``, at most 252; default the largest such).
      probs_in_smem: store the softmax weights to shared memory before ``p @ V`` (runs in
        interpret mode); False feeds them from registers (compiled only).
      interpret: run in Mosaic GPU's interpret mode (CPU); needs ``probs_in_smem=True``. A
        ``plgpu.InterpretGPUParams`` sets the interpreter's options (its race detector).

    Returns:
      The final or partial ``(o, lse)`` described above.

    Raises:
      ValueError: for shapes, dtypes or static parameters the kernel does not take, and a
        missing table for ``L > 1`` (naming the argument and its value).
    """
    index_window = resolve_index_window(index_window, pages_per_step)
    validate_mgpu_decode_arguments(
        q, k_pages, v_pages, pages_per_step, num_stages, index_window, probs_in_smem, interpret
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
    num_kv_heads = k_pages.shape[1]
    group_size = num_q_heads // num_kv_heads
    query_rows = q_len * group_size
    partial_block = partial_rows(query_rows)
    num_work = work_request.shape[0]
    total_rows = batch * num_q_heads * q_len
    if write_final:
        out_type = (
            jax.ShapeDtypeStruct((total_rows, head_dim), q.dtype),
            jax.ShapeDtypeStruct((total_rows,), jnp.float32),
        )
    else:
        count = num_work * num_kv_heads * partial_block
        out_type = (
            jax.ShapeDtypeStruct((count, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((count,), jnp.float32),
        )
    if num_work == 0 or batch == 0:  # no program to launch
        o, lse = (jnp.zeros(t.shape, t.dtype) for t in out_type)
    else:
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
        )
        # Rows grouped by (request, KV head), token-major inside: q's own order for one token,
        # a small copy of q otherwise (the Triton kernel's row order).
        q_rows = head_major(q.reshape(batch, q_len, num_q_heads, head_dim), num_kv_heads)
        table = (page_indptr, last_page_len) if q_len > 1 else ()
        o, lse = plgpu.kernel(
            kernel,
            out_type=out_type,
            # Mosaic GPU maps the last grid axis to CUDA's x (up to 2^31 - 1 blocks; y and z
            # stop at 65535): work items there, so any plan fits, launched item-fastest as
            # the Triton kernel's grid is.
            grid=(num_kv_heads, num_work),
            grid_names=("kv_head", "work"),
            interpret=_interpret_params(interpret),
            kernel_name=f"paged_decode_mgpu_p{pages_per_step}_s{num_stages}"
            + ("_psmem" if probs_in_smem else "_preg")
            + (f"_q{q_len}" if q_len > 1 else "")
            + ("_final" if write_final else "_partial"),
        )(
            work_request,
            work_page_start,
            work_page_end,
            work_last_page_len,
            pad_page_indices(page_indices, index_window),  # index_windows.py says why
            *table,
            q_rows.reshape(total_rows, head_dim),
            k_pages,
            v_pages,
        )
    if write_final:
        o = token_major(o.reshape(batch, num_q_heads * q_len, head_dim), q_len, num_kv_heads)
        lse = token_major(lse.reshape(batch, num_q_heads * q_len), q_len, num_kv_heads)
        return o.reshape(q.shape), lse.reshape(q.shape[:-1])
    return (
        o.reshape(num_work, num_kv_heads, partial_block, head_dim),
        lse.reshape(num_work, num_kv_heads, partial_block),
    )


def _interpret_params(interpret):
    """``interpret`` as ``plgpu.kernel`` takes it: None (compiled), default interpreter
    parameters for True, or the caller's ``plgpu.InterpretGPUParams`` (e.g. with the race
    detector on)."""
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else None


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


def validate_mgpu_decode_arguments(
    q, k_pages, v_pages, pages_per_step, num_stages, index_window, probs_in_smem, interpret
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
    if interpret and not probs_in_smem:
        raise ValueError(
            "interpret=True needs probs_in_smem=True: Mosaic GPU's interpreter cannot run a "
            "WGMMA whose left operand is in registers"
        )
