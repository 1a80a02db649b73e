"""Fused split-KV paged decode attention (Pallas, Triton lowering).

What it computes: grouped-query attention of one new query token per request over that
request's keys and values, which live in pages of a KV pool reached through a CSR page table.

What it optimizes. Decode attention is memory bound: each key and value byte is used by only
``G = num_q_heads / num_kv_heads`` query heads, far too few multiply-adds a byte to keep tensor
cores busy. The kernel's whole job is to stream K and V at the copy bandwidth:

- Pages are read in place through ``page_indices`` (no gathered copy of the cache is ever
  materialized); one program handles one (work item, KV head), where a work item is a chunk of
  one request's pages, and loads ``pages_per_step`` pages of ``[page_size, head_dim]`` per loop
  step (one contiguous 4 KiB tile a page in the HND layout at 16 x 128 bfloat16).
- All ``G`` query heads that share a KV head are computed from one read of its K and V. The
  ``G`` rows are padded to 16 (the smallest tensor-core tile) in registers only: q is loaded with
  a row mask, output rows are stored with a row mask; nothing padded touches memory.
- Online softmax in float32, in base 2 (``exp2`` is one instruction; ``log2 e`` is folded into
  the logit scale), converted back to natural log for the returned log-sum-exp.
- Split-KV: when a batch has too few (request, KV head) pairs to fill the GPU, the planner
  (``paged/plan.py``) cuts long requests into chunks; each chunk's partial output and LSE go to a
  float32 workspace and ``merge_states.py`` combines them. When no request is split, this kernel
  normalizes and writes the final output itself (``write_final=True``), with no merge launch.

The kernel never reads or writes outside its arrays, whatever the page table and work items
say: page-index loads past a work item's end are masked (they fetch page 0, a valid page, whose
logits and values are then masked out, so stale or NaN data in unused slots never reaches the
output); page numbers, page ranges, last-page lengths and request ids are clamped (the public
API validates them only when they are concrete); query/output rows past ``G`` are masked.

Distance from the bandwidth floor: see ``docs/benchmark_results/*-decode.md`` (the floor is the
KV bytes of the batch over the measured copy bandwidth).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.platform import whole_array

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
# Masked logits get this instead of -inf so that exp2(masked - running_max) is exactly 0 and
# never exp2(-inf - (-inf)) = NaN; it is far below any real base-2 logit.
MASKED_LOGIT = -1e30
MIN_ROWS = 16  # tensor-core dots need at least 16 rows


def paged_decode_kernel(
    # Scalar work description, one entry per work item (the grid's first axis).
    work_request_ref,  # [num_work] int32; -1 (or any value outside the batch) marks padding
    work_page_start_ref,  # [num_work] int32, offset into page_indices
    work_page_end_ref,  # [num_work] int32
    work_last_page_len_ref,  # [num_work] int32, valid slots in the item's final page
    page_indices_ref,  # [num_indices] int32
    q_ref,  # [batch * num_q_heads, head_dim], the whole array
    k_pages_ref,  # [num_pages, page_size, head_dim], this program's KV head
    v_pages_ref,  # [num_pages, page_size, head_dim]
    # Outputs: final (write_final) or per-work-item partials, the whole arrays.
    o_ref,  # [batch * num_q_heads, head_dim] | [num_work * num_kv_heads * partial_rows, head_dim]
    lse_ref,  # [batch * num_q_heads] | [num_work * num_kv_heads * partial_rows] float32
    *,
    group_size: int,
    rows: int,
    partial_rows: int,
    num_kv_heads: int,
    pages_per_step: int,
    logit_scale_log2: float,
    logits_soft_cap: float | None,
    sm_scale: float,
    write_final: bool,
    precision,
):
    work = pl.program_id(0)
    kv_head = pl.program_id(1)
    num_pages, page_size, head_dim = k_pages_ref.shape
    num_indices = page_indices_ref.shape[0]
    batch = q_ref.shape[0] // (num_kv_heads * group_size)
    block_tokens = pages_per_step * page_size
    # The public API validates plans and tables when they are concrete; under jit it cannot.
    # These clamps (a few scalar ops a program) keep every access inside its array whatever
    # the work arrays and the table say: a request outside the batch is a padding item, a page
    # range is cut to page_indices, a last-page length to [0, page_size].
    request = work_request_ref[work]
    is_padding = (request < 0) | (request >= batch)
    request = jnp.where(is_padding, 0, request)
    page_start = jnp.clip(work_page_start_ref[work], 0, num_indices)
    page_end = jnp.clip(work_page_end_ref[work], page_start, num_indices)
    page_end = jnp.where(is_padding, page_start, page_end)
    last_page_len = jnp.clip(work_last_page_len_ref[work], 0, page_size)

    row_ids = jnp.arange(rows)
    row_is_real = row_ids < group_size
    first_row = (request * num_kv_heads + kv_head) * group_size
    q = plgpu.load(
        q_ref.at[pl.ds(first_row, rows), :], mask=row_is_real[:, None], other=0.0
    )  # [rows, head_dim]

    num_tokens = jnp.where(
        page_end > page_start,
        (page_end - page_start - 1) * page_size + last_page_len,
        0,
    )
    num_steps = pl.cdiv(page_end - page_start, pages_per_step)

    def load_pages(i):
        first = page_start + i * pages_per_step
        page_is_real = first + jnp.arange(pages_per_step) < page_end
        pages = plgpu.load(
            page_indices_ref.at[pl.ds(first, pages_per_step)], mask=page_is_real, other=0
        )  # [pages_per_step]
        return jnp.clip(pages, 0, num_pages - 1)  # a bad index reads a wrong page, never past

    def step(i, carry):
        acc, running_max, running_sum = carry
        pages = load_pages(i)
        k = k_pages_ref[pages].reshape(block_tokens, head_dim)
        v = v_pages_ref[pages].reshape(block_tokens, head_dim)
        logits = plgpu.dot(q, k, trans_b=True, precision=precision)  # [rows, block_tokens] f32
        if logits_soft_cap is None:
            logits = logits * logit_scale_log2
        else:
            capped = logits_soft_cap * jnp.tanh(logits * (sm_scale / logits_soft_cap))
            logits = capped * LOG2_E
        token_is_real = i * block_tokens + jnp.arange(block_tokens) < num_tokens
        logits = jnp.where(token_is_real[None, :], logits, MASKED_LOGIT)
        # A zero weight times a NaN left in an unused slot is still NaN: zero those values.
        v = jnp.where(token_is_real[:, None], v, jnp.zeros_like(v))
        new_max = jnp.maximum(running_max, jnp.max(logits, axis=1))
        correction = jnp.exp2(running_max - new_max)
        # Masked tokens get weight exactly 0 even in a block with no real token (possible only
        # for a last page declared empty), where logits - new_max would be 0 for them.
        probs = jnp.where(token_is_real[None, :], jnp.exp2(logits - new_max[:, None]), 0.0)
        running_sum = running_sum * correction + jnp.sum(probs, axis=1)
        acc = acc * correction[:, None] + plgpu.dot(probs.astype(v.dtype), v, precision=precision)
        return acc, new_max, running_sum

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, running_max, running_sum = lax.fori_loop(0, num_steps, step, init)

    nonempty = running_sum > 0
    out = acc / jnp.where(nonempty, running_sum, 1.0)[:, None]
    lse = jnp.where(nonempty, (running_max + jnp.log2(running_sum)) * LN_2, -jnp.inf)
    if write_final:
        keep = row_is_real & ~is_padding
        plgpu.store(
            o_ref.at[pl.ds(first_row, rows), :], out.astype(o_ref.dtype), mask=keep[:, None]
        )
        plgpu.store(lse_ref.at[pl.ds(first_row, rows)], lse, mask=keep)
    else:
        # Partials keep only the group's rows (padded to a power of two, partial_rows), not the
        # 16 rows of the dot tile: a quarter of the bytes at G = 4 for the merge to read.
        keep = row_ids < partial_rows
        first_partial = (work * num_kv_heads + kv_head) * partial_rows
        plgpu.store(o_ref.at[pl.ds(first_partial, rows), :], out, mask=keep[:, None])
        plgpu.store(lse_ref.at[pl.ds(first_partial, rows)], lse, mask=keep)


@functools.partial(
    jax.jit,
    static_argnames=(
        "layout",
        "sm_scale",
        "logits_soft_cap",
        "write_final",
        "pages_per_step",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def paged_decode(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_indices: jax.Array,
    work_request: jax.Array,
    work_page_start: jax.Array,
    work_page_end: jax.Array,
    work_last_page_len: jax.Array,
    *,
    layout: str,
    sm_scale: float,
    logits_soft_cap: float | None,
    write_final: bool,
    pages_per_step: int = 8,
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool = False,
):
    """Runs the decode kernel over a list of work items.

    Args:
      q: ``[B, H, D]``.
      k_pages, v_pages: ``[num_pages, KVH, page_size, D]`` (``layout="HND"``) or
        ``[num_pages, page_size, KVH, D]`` (``"NHD"``).
      page_indices: int32 ``[num_indices]``; every ``[start, end)`` range of a work item should
        lie inside it and name valid pages (the public API validates concrete inputs; the
        kernel clamps ranges and page numbers, so invalid ones give wrong values, never an
        access outside an array).
      work_request, work_page_start, work_page_end, work_last_page_len: int32 ``[W]``, one work
        item each: a request (``-1`` for padding), its page range in ``page_indices``, and the
        number of valid slots in the range's final page.
      layout, sm_scale, logits_soft_cap: as in ``paged.decode_attention``.
      write_final: every request is exactly one work item, so write normalized outputs
        ``(o [B, H, D] in q.dtype, lse [B, H] float32)`` directly; otherwise write partial states
        ``(o [W, KVH, P, D] float32, lse [W, KVH, P] float32)`` with ``P = partial_rows(G)``
        (the group padded to a power of two; rows past G are padding).
      pages_per_step, num_warps, num_stages: launch parameters (``paged_decode_tuning.py``).
      interpret: run in Pallas interpret mode (CPU).

    Returns:
      The final or partial ``(o, lse)`` described above.
    """
    batch, num_q_heads, head_dim = q.shape
    num_pages = k_pages.shape[0]
    if layout == "HND":
        _, num_kv_heads, page_size, _ = k_pages.shape
        kv_spec = pl.BlockSpec((num_pages, None, page_size, head_dim), lambda w, h: (0, h, 0, 0))
    elif layout == "NHD":
        _, page_size, num_kv_heads, _ = k_pages.shape
        kv_spec = pl.BlockSpec((num_pages, page_size, None, head_dim), lambda w, h: (0, 0, h, 0))
    else:
        raise ValueError(f"layout must be 'HND' or 'NHD', got {layout!r}")
    group_size = num_q_heads // num_kv_heads
    rows = dot_rows(group_size)
    partial = partial_rows(group_size)
    num_work = work_request.shape[0]
    q_rows = q.reshape(batch * num_q_heads, head_dim)

    if write_final:
        out_shape = (
            jax.ShapeDtypeStruct((batch * num_q_heads, head_dim), q.dtype),
            jax.ShapeDtypeStruct((batch * num_q_heads,), jnp.float32),
        )
        out_specs = (whole_array(out_shape[0].shape), whole_array(out_shape[1].shape))
    else:
        partial_count = num_work * num_kv_heads * partial
        out_shape = (
            jax.ShapeDtypeStruct((partial_count, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((partial_count,), jnp.float32),
        )
        out_specs = (whole_array(out_shape[0].shape), whole_array(out_shape[1].shape))
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        paged_decode_kernel,
        group_size=group_size,
        rows=rows,
        partial_rows=partial,
        num_kv_heads=num_kv_heads,
        pages_per_step=pages_per_step,
        logit_scale_log2=sm_scale * LOG2_E,
        logits_soft_cap=logits_soft_cap,
        sm_scale=sm_scale,
        write_final=write_final,
        precision=precision,
    )
    work_arrays = (work_request, work_page_start, work_page_end, work_last_page_len)
    o, lse = pl.pallas_call(
        kernel,
        grid=(num_work, num_kv_heads),
        in_specs=[
            *(whole_array(a.shape) for a in work_arrays),
            whole_array(page_indices.shape),
            whole_array(q_rows.shape),
            kv_spec,
            kv_spec,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_decode_{layout}_p{pages_per_step}_w{num_warps}_s{num_stages}"
        + ("_final" if write_final else "_partial"),
    )(*work_arrays, page_indices, q_rows, k_pages, v_pages)
    if write_final:
        return o.reshape(batch, num_q_heads, head_dim), lse.reshape(batch, num_q_heads)
    return (
        o.reshape(num_work, num_kv_heads, partial, head_dim),
        lse.reshape(num_work, num_kv_heads, partial),
    )


def dot_rows(group_size: int) -> int:
    """Rows of the query tile: the group padded to a power of two, at least the 16 rows of a
    tensor-core tile (padding lives in registers only)."""
    return max(MIN_ROWS, pl.next_power_of_2(group_size))


def partial_rows(group_size: int) -> int:
    """Rows a work item's partial state keeps per KV head: the group, padded to a power of 2."""
    return pl.next_power_of_2(group_size)
