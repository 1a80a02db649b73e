"""MLA absorbed decode over the paged latent cache on Mosaic GPU (Pallas ``plgpu``).

What it computes: ``paged.mla_reference.mla_latent_attention_state``. Every query row (one
head of one new token) scores every cached token of its request with
``softmax_scale * (q_latent . c + q_rope . k_rope)`` and returns ``o_latent = sum_t p_t c_t``
(``W_UV`` not applied) and the natural-log LSE. The latent ``c`` is both the key (with the
RoPE key) and the value, so each page is read from HBM once for both products.

Why it is shaped this way. All ``H x q_len`` query rows of a request read the same latent
stream, so they share one tensor-core tile. On the 64-row tile path they are its rows (M),
64 a program (16 heads at one token fill 16, the rest is padding computed and never stored;
128 heads x 2 tokens are 4 programs, ``row_blocks``, that read the same pages, mostly from
L2); the transposed path (below) makes them the tile's N instead. Per step of 64 cached
tokens (``64 / page_size`` pages), on the tile path:

- ``logits [64, 64] = q_latent [64, R] @ latent^T + q_rope [64, P] @ rope_key^T`` (two WGMMAs
  into one float32 accumulator), online softmax in float32 and base 2 (``softmax_scale x
  log2 e`` folded into the logits), masked keys at ``MASKED_LOGIT``;
- ``o [64, R] += p [64, 64] @ latent [64, R]`` (WGMMA, ``p`` in bfloat16/float16).

Why 64 tokens a step: the ``p @ latent`` WGMMA's contraction runs over the step's tokens, and
the latent tile, whose rows are 1 KiB, takes the 128-byte swizzle (it is also the transposed
operand of ``q @ latent^T``, contracting over R); Mosaic GPU gives both operands of one WGMMA
one swizzle, so the contraction must be a multiple of 64 elements.

Why two compute warpgroups on the tile path. The float32 accumulator ``[64, 512]`` is 128 KiB, 256 registers a
thread for one warpgroup of 128 threads: more than a thread may hold (255), before the logits
and the softmax. So the R output columns are split over two warpgroups: warpgroup ``w``
accumulates ``o[:, w R/2 : (w + 1) R/2]`` (128 registers a thread at R = 512; a WGMMA's N is
at most 256, which this also respects). Each warpgroup computes the whole ``[64, 64]`` logits
and softmax itself (the same numbers in both): the ``q @ latent^T`` WGMMA is done twice, and in
exchange no logits cross shared memory (there is no room: the loop's buffers take 221 of the
227 KiB, below) and the two warpgroups meet at no barrier in a step but the last.

What that costs, per cached token of a request: the useful work is ``H x q_len x 2 x (2R +
P)`` FLOP (``docs/mla.md``); this path executes ``64 x 2 x (2 (R + P) + R)`` FLOP a row block
(64 rows, the logits twice). At 128 heads x 2-4 tokens (full tiles) that is 1.53x the useful
work, so at most 65% of the tensor peak can be useful FLOP/s. At 16 heads x 1 token (16 real
rows of 64) it would be 6.1x: streaming the cache at 4.3 TB/s would need 80% of the tensor
peak. Hence the second path.

The transposed path (``transposed``; the default, and allowed, for ``H x q_len <= 32``
rows). The keys become the tile's 64 rows (M) and the query rows its N: ``S^T [64, rows] =
latent [64, R] @ q_latent^T + rope_key @ q_rope^T``, the softmax's statistics along N (its
reductions across the tile's rows), and ``o^T [R, rows] += latent^T @ p^T`` (the latent slot
as a transposed left operand, M = R; ``p`` stored transposed, ``[rows, 64]``, into shared
memory, where the 128-byte swizzle of its 64 keys matches the latent's). One compute
warpgroup does it all: its accumulator is ``R x rows / 128`` registers a thread (64 at 16
rows, 128 at 32), and the reductions across the tile's rows go through the block's one
shared-memory reduction scratch, which two warpgroups reducing at once would both write.
Nothing is padded or done twice: at 16 rows it executes exactly the useful work, 13% of the
tensor peak at 4.3 TB/s; the query tile shrinks to ``rows x (R + P)`` (18 KiB at 16 rows).
Its output leaves the kernel as ``o^T`` (``[W, R, rows]``, transposed back by the wrapper, a
copy of ``W x rows x R`` floats). Both of its WGMMAs read shared memory only, so the
interpreter runs the same products the GPU does.

The pipeline (warp specialization, as in JAX's FlashAttention-3 example): one more warpgroup,
the producer, issues every copy; the compute warpgroups only wait and compute.

- Producer: TMA the query tile (``[64, R]`` and ``[64, P]``, or the request's rows on the
  transposed path) and the work item's page numbers
  (windows of ``index_window`` entries into two alternating shared-memory buffers: window
  ``k + 1`` is copied when window ``k`` starts being used); then for each step, once the
  compute warpgroups have released the step's ring slot (``num_stages`` steps earlier), TMA its
  pages' latents and RoPE keys into the slot, all arriving on the slot's barrier.
- Compute warpgroup: per step, wait for the slot, compute the logits and softmax, ``p @ its
  columns of the latent``, release the slot. ``num_stages`` slots of ``64 x (R + P)`` tokens
  (72 KiB at R = 512, P = 64, bfloat16) plus the query tile (72 KiB on the tile path) fill the
  H200's 227 KiB at two stages (``smem_bytes_per_program``): one program an SM, with one step
  in flight while the other is computed. (The transposed path's 18 KiB query tile at 16 rows
  leaves 169 KiB: still one program an SM, and still short of a third slot.)

Unused key slots. The final step of a work item may hold the tail of its last page and pages
past its end (slots of clamped page numbers). Their logits are masked, so their weights are
exactly 0, but a zero weight times a NaN left in an unused slot is NaN: in that one step the
compute warpgroups meet at a barrier (all are done reading the slot's latent for the
logits), then each zeroes the tail rows of its own columns before ``p @ latent``.

Several new tokens (``q_len > 1``): rows are token-major (row ``l x H + h``), and row ``r``'s
token ``l`` sees the keys at positions up to ``seq_len - q_len + l`` of its request (the
decode kernels' rule; in a split item's numbering, keys below ``seq_len - q_len + 1 + l -
item_first_position``). A row that sees no key of a step has its weights zeroed.

Output: per work item, the partial state of every real row (``o`` float32 ``[W, R_pad, R]``,
or ``[W, R, rows]`` on the transposed path, ``lse`` float32 ``[W, R_pad]``, natural log; ``o = 0``, ``lse = -inf`` for a row that saw no
key), in the order the existing merge (``kernels_pallas/merge_states.py``) reads with every
query row as its own "KV head" of one query head: ``merge_partial_states(o[:, :rows, None],
lse[:, :rows, None], merge_indptr, num_q_heads=rows)`` (``merge_row_states``; the wrapper
returns ``o`` as ``[W, rows, R]``). Each compute warpgroup stores its columns through shared
memory (the loop's buffers, reused: ``plgpu.RefUnion``) by TMA.

Bounds: a work item's page range is cut to ``page_indices`` and each page number to the pool
by one unsigned minimum (``kernels_pallas.paged_decode.unsigned_min``); copies past the end of
the query rows or of ``page_indices`` are zero-filled by the TMA unit; a request index outside
the batch reads request 0's queries (its item's range is what the plan says; a padding item's
is empty). No table can make the kernel read or write outside its arrays.

Mosaic GPU's interpreter (``interpret=True``) runs the warpgroups, TMA copies, barriers and
WGMMA with both operands in shared memory; it cannot run a WGMMA whose left operand is in
registers, nor ``pl.run_state`` accumulators, so ``probs_in_smem=True`` (each compute
warpgroup stores its ``p`` to shared memory first, and a fresh accumulator is added each step)
is the path the CPU tests run; the tile path's default, ``p`` from registers, runs compiled
only, the transposed path's products are the same in both (``tests/test_mla_decode_mgpu.py``:
lowering on the CPU, ``gpu``-marked tests on the H200).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.index_windows import (
    MAX_INDEX_WINDOW,
    aligned_window_start,
    default_index_window,
    index_buffer_entries,
    pad_page_indices,
)
from kernels_pallas.merge_states import merge_partial_states
from kernels_pallas.online_softmax import LN_2, LOG2_E, MASKED_LOGIT
from kernels_pallas.paged_decode import unsigned_min

TILE_ROWS = 64  # a WGMMA tile's rows: one warpgroup
BLOCK_TOKENS = 64  # cached tokens a step: p @ latent contracts over them (128-byte swizzle)
SWIZZLE_BYTES = 128


def num_compute_warpgroups(transposed: bool) -> int:
    """Compute warpgroups a program: two on the tile path (each holds half of the [64, R]
    float32 accumulator), one on the transposed path (its [R, rows] accumulator fits, and only
    one warpgroup may use the block's shared reduction scratch at a time: the softmax's
    reductions across the tile's rows go through it)."""
    return 1 if transposed else 2


SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
SUPPORTED_KV_LORA_RANKS = (128, 256, 512)  # halves of at most 256 columns: a WGMMA's N
SUPPORTED_ROPE_DIMS = (64, 128)
SUPPORTED_PAGE_SIZES = (8, 16, 32, 64)  # whole 8-row tiles, a power of two dividing 64
# The transposed path: its one compute warpgroup's accumulator [R, rows] float32 is at most
# 128 registers a thread (rows <= 32 at R = 512); chosen wherever it is allowed, where the
# 64-row tile would be half padding or more.
TRANSPOSED_MAX_ROWS = 32
H200_SMEM_PER_PROGRAM_BYTES = 227 * 1024
# Registers a thread after setmaxnreg: 2 x 232 + 40 = 504 <= 512 (65536 a SM / 128 threads).
COMPUTE_REGISTERS = 232
PRODUCER_REGISTERS = 40


def _operand_transforms(dtype) -> tuple:
    """The tiling and swizzle of every WGMMA operand here (q, the latent, the RoPE key, p):
    8-row tiles 128 bytes wide, the 128-byte swizzle."""
    columns = SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    return plgpu.TilingTransform((8, columns)), plgpu.SwizzleTransform(SWIZZLE_BYTES)


def mla_decode_mgpu_kernel(
    work_request_ref,  # [W] int32, GMEM; -1 (or any value outside the batch) = padding
    work_page_start_ref,  # [W] int32, GMEM, offset into page_indices
    work_page_end_ref,  # [W] int32, GMEM
    work_last_page_len_ref,  # [W] int32, GMEM, valid slots in the item's final page
    page_indices_ref,  # [num_indices] int32, GMEM (a multiple of 4, at least a window buffer)
    # Only when q_len > 1 (the causal bound needs each request's length), the table's
    #   page_indptr_ref,  # [B + 1] int32, GMEM
    #   request_last_page_len_ref,  # [B] int32, GMEM
    # then always:
    #   q_latent_ref,  # [B * rows, R], GMEM, rows token-major (l * H + h) a request
    #   q_rope_ref,  # [B * rows, P], GMEM
    #   latent_ref,  # [num_pages, page_size, R], GMEM
    #   rope_key_ref,  # [num_pages, page_size, P], GMEM
    #   o_ref,  # [W * padded_rows, R] float32, GMEM: partial states; transposed: [W * R, rows]
    #   lse_ref,  # [W * padded_rows] float32, GMEM; transposed: [W * rows]
    *refs,
    q_len: int,
    num_heads: int,
    num_stages: int,
    index_window: int,
    logit_scale_log2: float,
    probs_in_smem: bool,
    transposed: bool,
):
    if q_len > 1:
        page_indptr_ref, request_last_page_len_ref, *refs = refs
    q_latent_ref, q_rope_ref, latent_ref, rope_key_ref, o_ref, lse_ref = refs
    work = lax.axis_index("work")
    row_block = lax.axis_index("row_block")
    warpgroup = lax.axis_index("wg")
    num_pages, page_size, kv_lora_rank = latent_ref.shape
    rope_dim = rope_key_ref.shape[2]
    num_compute = num_compute_warpgroups(transposed)
    producer = num_compute  # the warpgroup index that issues the copies
    half = kv_lora_rank // num_compute  # the output columns of one compute warpgroup
    columns = pl.ds(pl.multiple_of(warpgroup * half, half), half)  # a compute warpgroup's
    num_indices = page_indices_ref.shape[0]
    dtype = latent_ref.dtype
    rows = q_len * num_heads  # a request's query rows
    rows_per_block = min(rows, TILE_ROWS)
    padded_rows = pl.cdiv(rows, TILE_ROWS) * rows_per_block
    # Query rows a program loads: a 64-row tile, or (transposed) the request's rows, the N side.
    q_tile_rows = rows if transposed else TILE_ROWS
    batch = q_latent_ref.shape[0] // rows
    pages_per_step = BLOCK_TOKENS // page_size
    steps_per_window = index_window // pages_per_step

    # The clamps of the decode kernels (one unsigned minimum each; kernels_pallas/paged_decode).
    request = work_request_ref[work]
    request = jnp.where(request.astype(jnp.uint32) >= batch, 0, request)
    page_start = unsigned_min(work_page_start_ref[work], num_indices)
    page_end = unsigned_min(work_page_end_ref[work], num_indices)
    num_item_pages = jnp.maximum(page_end - page_start, 0)
    num_tokens = jnp.where(
        num_item_pages > 0, (num_item_pages - 1) * page_size + work_last_page_len_ref[work], 0
    )
    num_tokens = jnp.clip(num_tokens, 0, num_item_pages * page_size)
    num_steps = pl.cdiv(num_tokens, BLOCK_TOKENS)
    # The windows the steps read (not the item's pages: a bad last_page_len may leave pages no
    # step reads), so every window copied is waited for before the program ends.
    num_windows = pl.cdiv(num_steps, steps_per_window)
    # Windows copied from a 16-byte aligned start (index_windows.py): the item's pages begin
    # at entry `index_shift` of each window's buffer.
    index_start, index_shift = aligned_window_start(page_start)
    first_row = request * rows + row_block * TILE_ROWS  # a multiple of 8: rows is
    causal_base = None
    if q_len > 1:
        # Token l sees the keys below causal_base + l of this item's numbering.
        request_first_page = page_indptr_ref[request]
        request_pages = page_indptr_ref[request + 1] - request_first_page
        seq_len = jnp.where(
            request_pages > 0,
            (request_pages - 1) * page_size + request_last_page_len_ref[request],
            0,
        )
        causal_base = seq_len - q_len + 1 - (page_start - request_first_page) * page_size

    transforms = _operand_transforms(dtype)

    def produce(q_latent_smem, q_rope_smem, latent_ring, rope_ring, buffers):
        """The producer warpgroup: the query tile, the index windows, every page copy."""
        index_buffers, q_ready, index_ready, slot_ready, slot_free = buffers
        start = pl.multiple_of(first_row, 8)
        plgpu.copy_gmem_to_smem(
            q_latent_ref.at[pl.ds(start, q_tile_rows)], q_latent_smem, q_ready.at[0]
        )
        plgpu.copy_gmem_to_smem(
            q_rope_ref.at[pl.ds(start, q_tile_rows)], q_rope_smem, q_ready.at[0]
        )

        def copy_index_window(window):
            plgpu.copy_gmem_to_smem(
                page_indices_ref.at[
                    pl.ds(index_start + window * index_window, index_buffer_entries(index_window))
                ],
                index_buffers.at[lax.rem(window, 2)],
                index_ready.at[lax.rem(window, 2)],
            )

        @pl.when(num_windows > 0)
        def _():
            copy_index_window(0)

        def issue(step, _):
            # The first step of window k waits for it and starts window k + 1's copy into the
            # other buffer, whose entries were all issued by then (steps are issued in order).
            window = lax.div(step, steps_per_window)
            offset = (step - window * steps_per_window) * pages_per_step
            buffer = lax.rem(window, 2)

            @pl.when(offset == 0)
            def _():
                plgpu.barrier_wait(index_ready.at[buffer])

                @pl.when(window + 1 < num_windows)
                def _():
                    # The other buffer's entries were read by this warpgroup (generic proxy)
                    # before the copy (async proxy) overwrites them: order the two.
                    plgpu.commit_smem()
                    copy_index_window(window + 1)

            slot = lax.rem(step, num_stages)

            @pl.when(step >= num_stages)
            def _():
                plgpu.barrier_wait(slot_free.at[slot])  # the compute warpgroups are done

            for page in range(pages_per_step):
                # A bad index reads a wrong page, never past the pool (one unsigned minimum).
                entry = index_shift + offset + page
                number = unsigned_min(index_buffers[buffer, entry], num_pages - 1)
                rows_of_page = pl.ds(page * page_size, page_size)
                plgpu.copy_gmem_to_smem(
                    latent_ref.at[number], latent_ring.at[slot, rows_of_page], slot_ready.at[slot]
                )
                plgpu.copy_gmem_to_smem(
                    rope_key_ref.at[number], rope_ring.at[slot, rows_of_page], slot_ready.at[slot]
                )

        lax.fori_loop(0, num_steps, issue, None)

        def drain(step, _):
            plgpu.barrier_wait(slot_free.at[lax.rem(step, num_stages)])

        # Observe the last releases too: every phase a barrier completes is waited for by its
        # waiter before the barriers are freed (the interpreter checks this).
        lax.fori_loop(jnp.maximum(num_steps - num_stages, 0), num_steps, drain, None)

    def compute(q_latent_smem, q_rope_smem, latent_ring, rope_ring, probs_smem, buffers):
        """A compute warpgroup: the online softmax over every step, its columns of o."""
        _, q_ready, _, slot_ready, slot_free, tail_sync = buffers
        plgpu.barrier_wait(q_ready.at[0])
        # The logits tile is [query rows, keys] (64 x 64), or transposed [keys, query rows]
        # (64 x rows); the accumulator [64, R/2], or transposed [R, rows]. The softmax's
        # statistics run along the query-row axis, its reductions along the key axis.
        key_axis = 0 if transposed else 1
        row_axis = 1 - key_axis
        logits_shape = (BLOCK_TOKENS, rows) if transposed else (TILE_ROWS, BLOCK_TOKENS)
        acc_shape = (half, rows) if transposed else (TILE_ROWS, half)

        def per_row(values, shape):
            """``[rows]`` statistics -> ``shape``: each query row's value along its keys (or
            its output columns)."""
            return lax.broadcast_in_dim(values, shape, [row_axis])

        def visible_in_step(step):
            """bool, the logits' shape: which of the step's keys each row sees. Built in the
            step (a few integer operations a thread), not held across the loop: the
            accumulator's 128 registers a thread leave little room for more arrays."""
            key = plgpu.broadcasted_iota(
                jnp.int32, logits_shape, key_axis, layout=plgpu.Layout.WGMMA
            )
            visible_keys = num_tokens
            if causal_base is not None:
                row = plgpu.broadcasted_iota(
                    jnp.int32, logits_shape, row_axis, layout=plgpu.Layout.WGMMA
                )
                token = lax.div(row + row_block * TILE_ROWS, jnp.int32(num_heads))
                visible_keys = jnp.minimum(causal_base + token, num_tokens)
            return key + step * BLOCK_TOKENS < visible_keys

        def step_body(step, state):
            acc, running_max, running_sum = state
            slot = lax.rem(step, num_stages)
            latent = latent_ring.at[slot]  # [64, R]
            plgpu.barrier_wait(slot_ready.at[slot])

            def qk(accumulator):
                if transposed:  # S^T = latent @ q^T: the keys are the 64 rows M
                    plgpu.wgmma(accumulator, latent, q_latent_smem.T)
                    plgpu.wgmma(accumulator, rope_ring.at[slot], q_rope_smem.T)
                else:
                    plgpu.wgmma(accumulator, q_latent_smem, latent.T)
                    plgpu.wgmma(accumulator, q_rope_smem, rope_ring.at[slot].T)
                return accumulator[...]

            logits = pl.run_scoped(qk, plgpu.ACC(logits_shape, jnp.float32))
            visible = visible_in_step(step)
            logits = jnp.where(visible, logits * logit_scale_log2, MASKED_LOGIT)
            new_max = jnp.maximum(running_max, logits.max(axis=key_axis))
            correction = jnp.exp2(running_max - new_max)
            probs = jnp.exp2(logits - per_row(new_max, logits_shape))
            if causal_base is not None:
                # A row that sees no key yet has only MASKED_LOGIT, its max too: exp2 gives 1.
                probs = jnp.where(visible, probs, 0.0)
            running_sum = running_sum * correction + probs.sum(axis=key_axis)
            acc = acc * per_row(correction, acc_shape)
            valid_rows = num_tokens - step * BLOCK_TOKENS

            @pl.when(valid_rows < BLOCK_TOKENS)
            def _():
                # The item's last step: zero the latent rows past its end (NaN x 0 is NaN) in
                # this warpgroup's columns, once all have read the whole slot for the logits.
                plgpu.barrier_arrive(tail_sync.at[0])
                plgpu.barrier_wait(tail_sync.at[0])
                # In chunks of at most 256 columns (64 registers a thread each): the whole
                # [64, 512] of the transposed path's one warpgroup would be 128 more.
                chunk = min(half, 256)
                layout = plgpu.Layout.SMEM_GMEM_COPY((BLOCK_TOKENS, chunk), dtype, SWIZZLE_BYTES)
                for c in range(half // chunk):
                    first = pl.multiple_of(warpgroup * half + c * chunk, chunk)
                    mine = latent.at[:, pl.ds(first, chunk)]
                    values = plgpu.load(mine, layout=layout)
                    key = plgpu.broadcasted_iota(jnp.int32, (BLOCK_TOKENS, chunk), 0, layout=layout)
                    mine[...] = jnp.where(key < valid_rows, values, jnp.zeros_like(values))
                plgpu.commit_smem()

            if transposed:
                # o^T [R, rows] += latent^T @ p^T: both operands in shared memory,
                # p stored transposed ([rows, 64], keys minor: the latent's 128-byte swizzle).
                my_probs = probs_smem.at[warpgroup]
                my_probs.T[...] = probs.astype(dtype)
                plgpu.commit_smem()

                def pv_transposed(accumulator):
                    plgpu.wgmma(accumulator, latent.at[:, columns].T, my_probs.T)

                if probs_in_smem:  # the interpreter's way to accumulate (no pl.run_state)

                    def fresh(accumulator):
                        pv_transposed(accumulator)
                        return accumulator[...]

                    acc = acc + pl.run_scoped(fresh, plgpu.ACC(acc_shape, jnp.float32))
                else:
                    acc = pl.run_state(pv_transposed)(plgpu.ACC.init(acc))
            elif probs_in_smem:
                my_probs = probs_smem.at[warpgroup]
                my_probs[...] = probs.astype(dtype)
                plgpu.commit_smem()

                def pv(accumulator):
                    plgpu.wgmma(accumulator, my_probs, latent.at[:, columns])
                    return accumulator[...]

                acc = acc + pl.run_scoped(pv, plgpu.ACC((TILE_ROWS, half), jnp.float32))
            else:
                probs = probs.astype(dtype)

                def pv_from_registers(accumulator):
                    plgpu.wgmma(accumulator, probs, latent.at[:, columns])

                acc = pl.run_state(pv_from_registers)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(slot_free.at[slot])  # this warpgroup is done with the slot
            return acc, new_max, running_sum

        stats_layout = plgpu.Layout.WGMMA.reduce(key_axis)
        num_stats = logits_shape[row_axis]
        state = (
            plgpu.layout_cast(jnp.zeros(acc_shape, jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((num_stats,), -jnp.inf, jnp.float32), stats_layout),
            plgpu.layout_cast(jnp.zeros((num_stats,), jnp.float32), stats_layout),
        )
        acc, running_max, running_sum = lax.fori_loop(0, num_steps, step_body, state)
        # finish: a row that saw no key gets o = 0 and lse = -inf (online_softmax.finish).
        nonempty = running_sum > 0
        out = acc / per_row(jnp.where(nonempty, running_sum, 1.0), acc_shape)
        lse = jnp.where(nonempty, (running_max + jnp.log2(running_sum)) * LN_2, -jnp.inf)
        return out, lse

    def scoped(loop_and_output, index_buffers, q_ready, index_ready, slot_ready, slot_free, syncs):
        (q_latent_smem, q_rope_smem, latent_ring, rope_ring, probs_smem), (o_smem, lse_smem) = (
            loop_and_output
        )
        tail_sync, output_sync = syncs
        loop_buffers = (q_latent_smem, q_rope_smem, latent_ring, rope_ring)

        @pl.when(warpgroup == producer)
        def _():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
            produce(*loop_buffers, (index_buffers, q_ready, index_ready, slot_ready, slot_free))

        @pl.when(warpgroup < producer)
        def _():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            out, lse = compute(
                *loop_buffers,
                probs_smem,
                (index_buffers, q_ready, index_ready, slot_ready, slot_free, tail_sync),
            )
            # The output buffers alias the loop's: wait until both compute warpgroups are done
            # reading it (the producer's copies were all waited for by both).
            plgpu.barrier_arrive(output_sync.at[0])
            plgpu.barrier_wait(output_sync.at[0])
            my_o = o_smem.at[warpgroup]
            my_o[...] = out

            @pl.when(warpgroup == 0)
            def _():
                lse_smem[...] = lse  # both warpgroups hold the same values; one stores them

            plgpu.commit_smem()
            if transposed:  # o^T's rows are R's columns: the wrapper transposes [W, R, rows]
                first_column = pl.multiple_of(work * kv_lora_rank + warpgroup * half, half)
                plgpu.copy_smem_to_gmem(my_o, o_ref.at[pl.ds(first_column, half)])
                first_out, stored_rows = work * rows, rows
            else:
                first_out = work * padded_rows + row_block * rows_per_block
                stored_rows = rows_per_block
                plgpu.copy_smem_to_gmem(
                    my_o.at[pl.ds(0, rows_per_block)],
                    o_ref.at[pl.ds(first_out, rows_per_block), columns],
                )

            @pl.when(warpgroup == 0)
            def _():
                plgpu.copy_smem_to_gmem(
                    lse_smem.at[pl.ds(0, stored_rows)], lse_ref.at[pl.ds(first_out, stored_rows)]
                )

            plgpu.wait_smem_to_gmem(0)

    if transposed:  # p of each compute warpgroup, [rows, 64] (stored transposed)
        probs_buffer = plgpu.SMEM((num_compute, rows, BLOCK_TOKENS), dtype, transforms=transforms)
    elif probs_in_smem:
        probs_buffer = plgpu.SMEM(
            (num_compute, TILE_ROWS, BLOCK_TOKENS), dtype, transforms=transforms
        )
    else:
        probs_buffer = None
    loop_buffers = (
        plgpu.SMEM((q_tile_rows, kv_lora_rank), dtype, transforms=transforms),
        plgpu.SMEM((q_tile_rows, rope_dim), dtype, transforms=transforms),
        plgpu.SMEM((num_stages, BLOCK_TOKENS, kv_lora_rank), dtype, transforms=transforms),
        plgpu.SMEM((num_stages, BLOCK_TOKENS, rope_dim), dtype, transforms=transforms),
        probs_buffer,
    )
    output_buffers = (
        plgpu.SMEM(
            (num_compute, *((half, rows) if transposed else (TILE_ROWS, half))),
            jnp.float32,
        ),
        plgpu.SMEM((rows if transposed else TILE_ROWS,), jnp.float32),
    )
    pl.run_scoped(
        scoped,
        plgpu.RefUnion(loop_buffers, output_buffers),
        plgpu.SMEM((2, index_buffer_entries(index_window)), jnp.int32),
        plgpu.Barrier(num_arrivals=2, num_barriers=1),  # the two query copies
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_arrivals=2 * pages_per_step, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=num_compute, num_barriers=num_stages),
        (
            plgpu.Barrier(num_arrivals=num_compute, num_barriers=1),
            plgpu.Barrier(num_arrivals=num_compute, num_barriers=1),
        ),
        collective_axes="wg",
    )


def smem_bytes_per_program(
    kv_lora_rank: int,
    rope_dim: int,
    dtype,
    *,
    num_stages: int,
    probs_in_smem: bool = False,
    index_window: int = MAX_INDEX_WINDOW,
    transposed_rows: int | None = None,
) -> int:
    """Shared memory one program allocates, in bytes: the larger of the loop's buffers (query
    tile, ``num_stages`` ring slots of 64 tokens' latents and RoPE keys, ``p`` of both compute
    warpgroups when it goes through shared memory) and the epilogue's (``o`` of 64 rows in
    float32, the LSE), which reuse the same memory, plus the index windows, the barriers and
    the reduction scratch.
    Buffers are counted rounded up to 1 KiB (the 128-byte swizzle's alignment).
    ``transposed_rows``: the query rows of the transposed path (its query tile, ``p`` and
    output hold that many rows, not 64), or None for the 64-row tile.

    Example:
      >>> import jax.numpy as jnp
      >>> smem_bytes_per_program(512, 64, jnp.bfloat16, num_stages=2) // 1024
      221
    """
    itemsize = jnp.dtype(dtype).itemsize

    def rounded(n: int) -> int:
        return -(-n // 1024) * 1024

    query_rows = TILE_ROWS if transposed_rows is None else transposed_rows
    has_probs = probs_in_smem or transposed_rows is not None
    loop = (
        rounded(query_rows * kv_lora_rank * itemsize)
        + rounded(query_rows * rope_dim * itemsize)
        + num_stages * rounded(BLOCK_TOKENS * kv_lora_rank * itemsize)
        + num_stages * rounded(BLOCK_TOKENS * rope_dim * itemsize)
        + (
            rounded(
                num_compute_warpgroups(transposed_rows is not None)
                * query_rows
                * BLOCK_TOKENS
                * itemsize
            )
            if has_probs
            else 0
        )
    )
    epilogue = rounded(query_rows * kv_lora_rank * 4) + rounded(query_rows * 4)
    barriers = rounded(8 * (1 + 2 + 2 * num_stages + 2))
    # Pallas reserves a scratch for reductions whenever a kernel reduces (CompilerParams'
    # reduction_scratch_bytes, 2 KiB by default).
    reduction_scratch = 2048
    index_buffers = rounded(2 * index_buffer_entries(index_window) * 4)
    return max(loop, epilogue) + index_buffers + barriers + reduction_scratch


def unsupported_reason(dtype, num_heads: int, kv_lora_rank: int, rope_dim: int, page_size: int):
    """Why the kernel cannot run these sizes, or None if it can.

    The kernel's own limits on input that is otherwise valid (``paged.mla_decode`` asks this
    before it picks a backend: ``"auto"`` then takes the reference, an explicit kernel backend
    raises with the reason); the raw entry raises it too.

    Example:
      >>> import jax.numpy as jnp
      >>> unsupported_reason(jnp.bfloat16, 16, 512, 64, 16) is None
      True
      >>> unsupported_reason(jnp.float32, 16, 512, 64, 16)
      'dtype float32: the kernel takes bfloat16 or float16'
    """
    if not any(jnp.dtype(dtype) == d for d in SUPPORTED_DTYPES):
        return f"dtype {jnp.dtype(dtype)}: the kernel takes bfloat16 or float16"
    if kv_lora_rank not in SUPPORTED_KV_LORA_RANKS:
        return f"kv_lora_rank must be one of {SUPPORTED_KV_LORA_RANKS}, got {kv_lora_rank}"
    if rope_dim not in SUPPORTED_ROPE_DIMS:
        return f"qk_rope_head_dim must be one of {SUPPORTED_ROPE_DIMS}, got {rope_dim}"
    if page_size not in SUPPORTED_PAGE_SIZES:
        return f"page_size must be one of {SUPPORTED_PAGE_SIZES}, got {page_size}"
    if num_heads < 1 or num_heads % 8:
        return (
            f"num_heads must be a positive multiple of 8, got {num_heads} (a request's rows "
            "must start on an 8-row tile of the query's TMA copy)"
        )
    return None


def _check_dtype_and_shapes(q_latent, q_rope, latent_pages, rope_key_pages) -> None:
    """The raw entry's checks. The structural ones restate, for raw arrays, what the paged
    validation (``paged.mla_reference.validate_latent_attention_inputs``) checks of a
    ``LatentCache`` and its queries; ``mla_decode_mgpu`` runs that one first, so through the
    wrapper (and ``paged.mla_decode_attention``) bad input meets the reference's errors. Then
    the kernel's limits (``unsupported_reason``)."""
    if q_latent.ndim != 4 or q_rope.ndim != 4:
        raise ValueError(
            "q_latent and q_rope must be [B, q_len, H, kv_lora_rank] and [B, q_len, H, "
            f"qk_rope_head_dim], got {q_latent.shape} and {q_rope.shape}"
        )
    if q_latent.shape[:3] != q_rope.shape[:3]:
        raise ValueError(
            f"q_latent {q_latent.shape} and q_rope {q_rope.shape} must agree on [B, q_len, H]"
        )
    if latent_pages.ndim != 3 or rope_key_pages.ndim != 3:
        raise ValueError(
            "latent_pages and rope_key_pages must be [num_pages, page_size, width], got "
            f"{latent_pages.shape} and {rope_key_pages.shape}"
        )
    if latent_pages.shape[:2] != rope_key_pages.shape[:2]:
        raise ValueError(
            f"latent_pages {latent_pages.shape} and rope_key_pages {rope_key_pages.shape} must "
            "agree on [num_pages, page_size]"
        )
    dtypes = {jnp.dtype(a.dtype) for a in (q_latent, q_rope, latent_pages, rope_key_pages)}
    if len(dtypes) != 1:
        raise ValueError(
            "q_latent, q_rope and the pages must share one dtype, bfloat16 or float16, got "
            f"{q_latent.dtype}, {q_rope.dtype}, {latent_pages.dtype}, {rope_key_pages.dtype}"
        )
    num_pages, page_size, kv_lora_rank = latent_pages.shape
    rope_dim = rope_key_pages.shape[2]
    if q_latent.shape[3] != kv_lora_rank:
        raise ValueError(
            f"q_latent has kv_lora_rank {q_latent.shape[3]} but the pages have {kv_lora_rank}"
        )
    if q_rope.shape[3] != rope_dim:
        raise ValueError(
            f"q_rope has qk_rope_head_dim {q_rope.shape[3]} but the pages have {rope_dim}"
        )
    if num_pages < 1:
        raise ValueError(f"the pool must hold at least one page, got num_pages={num_pages}")
    q_len, num_heads = q_latent.shape[1], q_latent.shape[2]
    if q_len < 1:
        raise ValueError(f"q_len (axis 1 of q_latent {q_latent.shape}) must be >= 1, got {q_len}")
    reason = unsupported_reason(q_latent.dtype, num_heads, kv_lora_rank, rope_dim, page_size)
    if reason is not None:
        raise ValueError(reason)


def _check_launch(
    num_stages, index_window, probs_in_smem, interpret, smem_bytes, page_size
) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if (
        not (isinstance(index_window, int) and 4 <= index_window <= MAX_INDEX_WINDOW)
        or index_window % 4
    ):
        raise ValueError(
            f"index_window must be a multiple of 4 from 4 to {MAX_INDEX_WINDOW}, got "
            f"{index_window!r}"
        )
    pages_per_step = BLOCK_TOKENS // page_size
    if index_window % pages_per_step:
        raise ValueError(
            f"index_window must be a multiple of the {pages_per_step} pages of a step (page_size "
            f"{page_size}), got {index_window}"
        )
    if interpret and not probs_in_smem:
        raise ValueError(
            "interpret=True needs probs_in_smem=True: Mosaic GPU's interpreter cannot run a "
            "WGMMA whose left operand is in registers"
        )
    if not interpret and smem_bytes > H200_SMEM_PER_PROGRAM_BYTES:
        raise ValueError(
            f"num_stages={num_stages} needs {smem_bytes / 1024:.0f} KiB of shared memory a "
            f"program, over the H200's {H200_SMEM_PER_PROGRAM_BYTES // 1024} KiB: lower num_stages"
        )


def _check_softmax_scale(softmax_scale) -> float:
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise ValueError(f"softmax_scale must be a Python float, got {softmax_scale!r}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale!r}")
    return float(softmax_scale)


def _interpret_params(interpret):
    """``interpret`` as ``plgpu.kernel`` takes it: None (compiled), default interpreter
    parameters for True, or the caller's ``plgpu.InterpretGPUParams``."""
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else None


@functools.partial(
    jax.jit,
    static_argnames=(
        "softmax_scale",
        "num_stages",
        "index_window",
        "probs_in_smem",
        "transposed",
        "interpret",
    ),
)
def mla_decode_mgpu_states(
    q_latent: jax.Array,
    q_rope: jax.Array,
    latent_pages: jax.Array,
    rope_key_pages: jax.Array,
    page_indices: jax.Array,
    work_request: jax.Array,
    work_page_start: jax.Array,
    work_page_end: jax.Array,
    work_last_page_len: jax.Array,
    *,
    page_indptr: jax.Array | None = None,
    last_page_len: jax.Array | None = None,
    softmax_scale: float,
    num_stages: int = 2,
    index_window: int | None = None,
    probs_in_smem: bool = False,
    transposed: bool | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> tuple[jax.Array, jax.Array]:
    """The kernel on raw arrays: one partial state a work item and query row.

    Args:
      q_latent: ``[B, L, H, R]`` absorbed queries (``paged.mla_reference.absorb_query``),
        bfloat16 or float16; ``R`` (kv_lora_rank) 128, 256 or 512; ``H`` a multiple of 8.
      q_rope: ``[B, L, H, P]`` rotated RoPE queries, same dtype; ``P`` 64 or 128.
      latent_pages: ``[num_pages, page_size, R]``; ``rope_key_pages``: ``[num_pages,
        page_size, P]`` (``paged.LatentCache``'s arrays), same dtype; page_size 8 to 64.
      page_indices: int32 ``[num_indices]``, the table's.
      work_request, work_page_start, work_page_end, work_last_page_len: int32 ``[W]``, work
        items as ``paged.plan_decode`` makes them (request -1 for padding). Invalid values give
        wrong results, never an access outside an array.
      page_indptr, last_page_len: the table's int32 ``[B + 1]`` and ``[B]``: where each
        request ends, for the causal rule among ``L > 1`` new tokens (ignored for ``L = 1``).
      softmax_scale: the model's logit scale (``1 / sqrt(qk_nope + qk_rope)``, not of R + P).
      num_stages: ring slots of 64 tokens (2 fit the H200 at R = 512).
      index_window: page numbers copied to shared memory at once (a multiple of 4 and of the
        ``64 / page_size`` pages of a step, at most 252; default the largest such, 248 or 252).
      probs_in_smem: ``p`` through shared memory (the interpreter's path) instead of
        registers (the 64-row tile); with ``transposed``, ``p`` is always in shared memory and
        this selects how the accumulator is updated (a fresh one added: the interpreter's way).
      transposed: the keys as the tile's 64 rows and the query rows as N (``S^T = latent @
        q^T``, ``o^T = latent^T @ p^T``), for ``L x H <= 32`` rows (``TRANSPOSED_MAX_ROWS``);
        default (None): wherever allowed (the 64-row tile would be half padding or more).
      interpret: Mosaic GPU's interpreter (needs ``probs_in_smem=True``).

    Returns:
      ``(o [W, L * H, R] float32, lse [W, L * H] float32)``: work item ``w``'s state of row
      ``l * H + h`` (token ``l``, head ``h``), normalized over the item's keys; ``lse`` in
      natural log; ``o = 0``, ``lse = -inf`` for a row that saw none of them.

    Raises:
      ValueError: naming the argument and value, for shapes, dtypes, sizes or launch
        parameters the kernel does not take, and a missing table for ``L > 1``.
    """
    _check_dtype_and_shapes(q_latent, q_rope, latent_pages, rope_key_pages)
    softmax_scale = _check_softmax_scale(softmax_scale)
    batch, q_len, num_heads, kv_lora_rank = q_latent.shape
    rope_dim = rope_key_pages.shape[2]
    rows = q_len * num_heads
    if transposed is None:
        transposed = rows <= TRANSPOSED_MAX_ROWS
    elif transposed not in (True, False) or (transposed and rows > TRANSPOSED_MAX_ROWS):
        raise ValueError(
            f"transposed must be None, False, or True for at most {TRANSPOSED_MAX_ROWS} query "
            f"rows (its [R, rows] float32 accumulator), got {transposed!r} for q_len x "
            f"num_heads = {rows}"
        )
    page_size = latent_pages.shape[1]
    if index_window is None:  # the largest window for this page size's pages a step (the
        # page size was checked above, by _check_dtype_and_shapes)
        index_window = default_index_window(BLOCK_TOKENS // page_size)
    _check_launch(
        num_stages,
        index_window,
        probs_in_smem,
        interpret,
        smem_bytes_per_program(
            kv_lora_rank,
            rope_dim,
            q_latent.dtype,
            num_stages=num_stages,
            probs_in_smem=probs_in_smem,
            index_window=index_window,
            transposed_rows=rows if transposed else None,
        ),
        latent_pages.shape[1],
    )
    if q_len > 1:
        if page_indptr is None or last_page_len is None:
            raise ValueError(
                f"q_len={q_len} needs the table's page_indptr and last_page_len for the causal rule"
            )
        if page_indptr.shape != (batch + 1,) or last_page_len.shape != (batch,):
            raise ValueError(
                f"page_indptr and last_page_len must be [{batch + 1}] and [{batch}] for q's batch "
                f"of {batch}, got {page_indptr.shape} and {last_page_len.shape}"
            )
    work_shapes = {a.shape for a in (work_request, work_page_start, work_page_end)}
    if len(work_shapes | {work_last_page_len.shape}) != 1 or work_request.ndim != 1:
        raise ValueError(
            "work_request, work_page_start, work_page_end and work_last_page_len must share one "
            f"1-D shape [W], got {sorted(work_shapes | {work_last_page_len.shape})}"
        )
    if page_indices.ndim != 1:
        raise ValueError(f"page_indices must be 1-D, got {page_indices.shape}")
    num_row_blocks = 1 if transposed else pl.cdiv(rows, TILE_ROWS)
    padded_rows = rows if transposed else num_row_blocks * min(rows, TILE_ROWS)
    num_work = work_request.shape[0]
    if num_work == 0 or batch == 0:  # no program to launch
        return (
            jnp.zeros((num_work, rows, kv_lora_rank), jnp.float32),
            jnp.full((num_work, rows), -jnp.inf, jnp.float32),
        )
    # At least one window buffer's entries, a multiple of 4 (index_windows.py): the padding is
    # past every request's pages, never read as one of them by a valid plan.
    page_indices = pad_page_indices(page_indices, index_window)
    kernel = functools.partial(
        mla_decode_mgpu_kernel,
        q_len=q_len,
        num_heads=num_heads,
        num_stages=num_stages,
        index_window=index_window,
        logit_scale_log2=softmax_scale * LOG2_E,
        probs_in_smem=probs_in_smem,
        transposed=transposed,
    )
    table = (page_indptr, last_page_len) if q_len > 1 else ()
    o, lse = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct(
                (num_work * kv_lora_rank, rows)
                if transposed
                else (num_work * padded_rows, kv_lora_rank),
                jnp.float32,
            ),
            jax.ShapeDtypeStruct((num_work * padded_rows,), jnp.float32),
        ),
        # Work items on the last axis (CUDA's x, up to 2^31 - 1 blocks): any plan fits.
        grid=(num_row_blocks, num_work),
        grid_names=("row_block", "work"),
        num_threads=num_compute_warpgroups(transposed) + 1,
        thread_name="wg",
        interpret=_interpret_params(interpret),
        kernel_name=f"mla_decode_mgpu_s{num_stages}"
        + ("_t" if transposed else "")
        + ("_psmem" if probs_in_smem else "_preg")
        + (f"_q{q_len}" if q_len > 1 else ""),
    )(
        work_request,
        work_page_start,
        work_page_end,
        work_last_page_len,
        page_indices,
        *table,
        q_latent.reshape(batch * rows, kv_lora_rank),
        q_rope.reshape(batch * rows, rope_dim),
        latent_pages,
        rope_key_pages,
    )
    if transposed:  # [W, R, rows] -> [W, rows, R]: a copy of W x rows x R floats
        o = jnp.swapaxes(o.reshape(num_work, kv_lora_rank, rows), 1, 2)
    else:
        o = o.reshape(num_work, padded_rows, kv_lora_rank)[:, :rows]
    lse = lse.reshape(num_work, padded_rows)[:, :rows]
    return o, lse


def merge_row_states(o, lse, merge_indptr, *, interpret=False):
    """Each request's partial states merged (``kernels_pallas/merge_states.py``): every query
    row is its own "KV head" of one query head there, so the merge folds ``[W, rows, R]``
    states per (request, row).

    Returns:
      ``(o [B, rows, R] float32, lse [B, rows] float32)``.
    """
    num_work, rows, kv_lora_rank = o.shape
    return merge_partial_states(
        o.reshape(num_work, rows, 1, kv_lora_rank),
        lse.reshape(num_work, rows, 1),
        merge_indptr,
        num_q_heads=rows,
        out_dtype=jnp.float32,
        interpret=bool(interpret),
    )


def plan_mla_decode(page_table, num_heads: int, q_len: int = 1, *, fixed_split_pages=None):
    """The split-KV plan for this kernel: ``paged.plan_decode`` with the kernel's program count
    (``ceil(q_len x H / 64)`` programs a work item, one program an SM: 169 to 221 KiB of
    shared memory each, ``smem_bytes_per_program``) and chunks of at least 256 tokens (4
    steps), so a split pays its merge only where the batch leaves SMs idle. (``plan_decode``'s
    ``head_dim`` only selects tuned defaults that the explicit grid and chunk replace.)"""
    from kernels_pallas.paged_decode_tuning import num_sms
    from paged.plan import plan_decode  # an upward import of the wrapper (see mla_decode_mgpu)

    row_blocks = -(-(q_len * num_heads) // TILE_ROWS)
    return plan_decode(
        page_table,
        row_blocks,
        row_blocks,
        512,
        fixed_split_pages=fixed_split_pages,
        max_grid=num_sms() if fixed_split_pages is None else None,
        min_chunk_pages=max(1, 4 * BLOCK_TOKENS // page_table.page_size),
    )


def mla_decode_mgpu(
    q_latent: jax.Array,
    q_rope: jax.Array,
    cache,
    page_table,
    *,
    softmax_scale: float,
    plan=None,
    fixed_split_pages: int | None = None,
    num_stages: int = 2,
    probs_in_smem: bool = False,
    transposed: bool | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> tuple[jax.Array, jax.Array]:
    """MLA absorbed decode over the paged latent cache: the kernel, then the merge of split
    states. Computes ``paged.mla_reference.mla_latent_attention_state``.

    A thin wrapper over ``mla_decode_mgpu_states`` for tests and benchmarks; it reads the
    cache's and table's arrays by attribute (``paged.LatentCache``, ``paged.PageTable``) and,
    without a plan, plans on the host (``plan_mla_decode``); it validates its input with the
    reference's checks. Those are the places this module reaches up into ``paged/`` (the public
    entry is ``paged.mla_decode_attention``).

    Args:
      q_latent: ``[B, H, R]`` or ``[B, L, H, R]``, the absorbed queries.
      q_rope: ``[B, H, P]`` or ``[B, L, H, P]``, rotated.
      cache: a ``paged.LatentCache`` (``latent_pages``, ``rope_key_pages``).
      page_table: a ``paged.PageTable`` for the B requests, covering the new tokens.
      softmax_scale: the model's logit scale.
      plan: a ``paged.DecodePlan`` for this table (``plan_mla_decode``); default: planned
        here from the table's concrete lengths.
      fixed_split_pages: without a plan, cut every request into chunks of this many pages.
      num_stages, probs_in_smem, transposed, interpret: as in ``mla_decode_mgpu_states``.

    Returns:
      ``(o_latent [B, (L,) H, R] float32, lse [B, (L,) H] float32)``, lse in natural log.

    Raises:
      ValueError: what ``paged.mla_reference.validate_latent_attention_inputs`` refuses (the
        reference's checks of the queries, the cache and the table, run first), then what
        ``mla_decode_mgpu_states`` refuses; a plan made for another table
        (``paged.plan.validate_plan``).
    """
    from paged.mla_reference import validate_latent_attention_inputs
    from paged.plan import validate_plan

    single_token = q_latent.ndim == 3
    # The reference's checks first (one validation path): bad input fails here as it does there.
    q_latent, q_rope = validate_latent_attention_inputs(q_latent, q_rope, cache, page_table)
    batch, q_len, num_heads, kv_lora_rank = q_latent.shape
    if plan is None:
        plan = plan_mla_decode(page_table, num_heads, q_len, fixed_split_pages=fixed_split_pages)
    validate_plan(plan, page_table)
    o, lse = mla_decode_mgpu_states(
        q_latent,
        q_rope,
        cache.latent_pages,
        cache.rope_key_pages,
        jnp.asarray(page_table.page_indices),
        jnp.asarray(plan.work_request),
        jnp.asarray(plan.work_page_start),
        jnp.asarray(plan.work_page_end),
        jnp.asarray(plan.work_last_page_len),
        page_indptr=jnp.asarray(page_table.page_indptr),
        last_page_len=jnp.asarray(page_table.last_page_len),
        softmax_scale=softmax_scale,
        num_stages=num_stages,
        probs_in_smem=probs_in_smem,
        transposed=transposed,
        interpret=interpret,
    )
    merge_indptr = jnp.asarray(plan.merge_indptr)
    if plan.write_final:  # one item a request: its state is the result
        o, lse = o[merge_indptr[:-1]], lse[merge_indptr[:-1]]
    else:
        o, lse = merge_row_states(o, lse, merge_indptr, interpret=interpret)
    o = o.reshape(batch, q_len, num_heads, kv_lora_rank)
    lse = lse.reshape(batch, q_len, num_heads)
    if single_token:
        return o[:, 0], lse[:, 0]
    return o, lse
