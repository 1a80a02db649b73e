"""Fused split-KV paged decode attention (Pallas, Triton lowering).

What it computes: grouped-query attention of each request's newest ``q_len`` query tokens (one
in plain decode; a few when verifying speculative drafts) over that request's keys and values,
which live in pages of a KV pool reached through a CSR page table. The new tokens are the last
``q_len`` of the request's sequence, their keys already in the pool, and attention among them is
causal: query token ``l`` sits at position ``seq_len - q_len + l`` and sees keys up to it.

What it optimizes. Decode attention is memory bound: each key and value byte is used by only
``G = num_q_heads / num_kv_heads`` query heads, far too few multiply-adds a byte to keep tensor
cores busy. The kernel's whole job is to stream K and V at the copy bandwidth:

- Pages are read in place through ``page_indices`` (no gathered copy of the cache is ever
  materialized); one program handles one (work item, KV head), where a work item is a chunk of
  one request's pages, and loads ``pages_per_step`` pages of ``[page_size, head_dim]`` per loop
  step (one contiguous 4 KiB tile a page in the HND layout at 16 x 128 bfloat16).
- All ``G`` query heads that share a KV head, for all ``q_len`` new tokens, are computed from
  one read of its K and V: the query tile's rows are ``q_len x G`` (token-major), so verifying
  eight drafts costs about the KV bytes of one decode step, not nine. The rows are padded to a
  power of two, at least 16 (the smallest tensor-core tile), in registers only: q is loaded with
  a row mask, output rows are stored with a row mask; nothing padded touches memory. The causal
  mask among the new tokens is a per-row bound on the key index (row ``r`` is token
  ``r // G``), which only cuts into a request's last ``q_len - 1`` keys.
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

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import online_softmax
from kernels_pallas.online_softmax import LOG2_E, MASKED_LOGIT
from kernels_pallas.platform import whole_array
from kernels_pallas.x64 import runs_in_32_bits

MIN_ROWS = 16  # tensor-core dots need at least 16 rows


def paged_decode_kernel(
    # Scalar work description, one entry per work item (the grid's first axis).
    work_request_ref,  # [num_work] int32; -1 (or any value outside the batch) marks padding
    work_page_start_ref,  # [num_work] int32, offset into page_indices
    work_page_end_ref,  # [num_work] int32
    work_last_page_len_ref,  # [num_work] int32, valid slots in the item's final page
    page_indices_ref,  # [num_indices] int32
    # Only when q_len > 1 (the causal bound needs each request's length), the table's
    #   page_indptr_ref,  # [batch + 1] int32
    #   request_last_page_len_ref,  # [batch] int32
    # then always:
    #   q_ref,  # [batch * num_kv_heads * q_len * G, head_dim], rows (b, kv head, token, g)
    #   k_pages_ref,  # [num_pages, page_size, head_dim], this program's KV head
    #   v_pages_ref,  # [num_pages, page_size, head_dim]
    # and the outputs: final (write_final) or per-work-item partials, rows as in q_ref:
    #   o_ref,  # [batch * KVH * q_len * G, head_dim] | [num_work * KVH * partial_rows, head_dim]
    #   lse_ref,  # [batch * KVH * q_len * G] | [num_work * KVH * partial_rows] float32
    # (With one new token the table's arrays are not operands at all, not even unread ones.)
    *refs,
    q_len: int,
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
    if q_len > 1:
        page_indptr_ref, request_last_page_len_ref, *refs = refs
    q_ref, k_pages_ref, v_pages_ref, o_ref, lse_ref = refs
    work = pl.program_id(0)
    kv_head = pl.program_id(1)
    num_pages, page_size, head_dim = k_pages_ref.shape
    num_indices = page_indices_ref.shape[0]
    query_rows = q_len * group_size  # real rows of the tile: every new token's group of heads
    batch = q_ref.shape[0] // (num_kv_heads * query_rows)
    block_tokens = pages_per_step * page_size
    # The public API validates plans and tables when they are concrete; under jit it cannot.
    # These clamps keep every access inside its array whatever the work arrays and the table
    # say, and no more: a request outside the batch is a padding item (its output rows are not
    # stored) and a page range is cut to page_indices (an end before the start is an empty
    # range). A bad last-page length only changes which keys are masked, so it is not clamped.
    # Each clamp is one unsigned minimum: on the H200 the two-sided clips of the first
    # version cost 6% at B=4 x 32768 (docs/benchmark_results/archive/2026-12-01-clamp-probe.md).
    request = work_request_ref[work]
    is_padding = request.astype(jnp.uint32) >= batch  # -1 (the planner's padding) wraps up
    request = jnp.where(is_padding, 0, request)
    page_start = unsigned_min(work_page_start_ref[work], num_indices)
    page_end = unsigned_min(work_page_end_ref[work], num_indices)
    last_page_len = work_last_page_len_ref[work]

    row_ids = jnp.arange(rows)
    row_is_real = row_ids < query_rows
    first_row = (request * num_kv_heads + kv_head) * query_rows
    q = plgpu.load(
        q_ref.at[pl.ds(first_row, rows), :], mask=row_is_real[:, None], other=0.0
    )  # [rows, head_dim]

    num_tokens = jnp.where(
        page_end > page_start,
        (page_end - page_start - 1) * page_size + last_page_len,
        0,
    )
    # Steps cover the item's pages. (Counting them from num_tokens instead, which would never
    # give an all-masked step, cost 3% at B=32 x 4096 on the H200: archive/2026-12-01-clamp-probe.md.)
    num_steps = pl.cdiv(page_end - page_start, pages_per_step)
    if q_len > 1:
        # Causal bound per row, as a count of this item's keys the row may see. Token l of the
        # request sits at position seq_len - q_len + l and sees positions up to its own; this
        # item's first key sits at position (page_start - page_indptr[request]) * page_size.
        # Only the request's last q_len - 1 keys are ever cut, but they may fall in an earlier
        # item than the last when the final chunk is short, so every item computes the bound.
        # (Under jit a request shorter than q_len gets a bound <= 0 for its early tokens: they
        # see no key, as positions before 0 do not exist.)
        request_first_page = page_indptr_ref[request]
        request_pages = page_indptr_ref[request + 1] - request_first_page
        seq_len = jnp.where(
            request_pages > 0,
            (request_pages - 1) * page_size + request_last_page_len_ref[request],
            0,
        )
        item_first_position = (page_start - request_first_page) * page_size
        row_token = row_ids // group_size  # [rows]
        visible_keys = jnp.minimum(
            seq_len - q_len + row_token + 1 - item_first_position, num_tokens
        )  # [rows]

    def load_pages(i):
        first = page_start + i * pages_per_step
        page_is_real = first + jnp.arange(pages_per_step) < page_end
        pages = plgpu.load(
            page_indices_ref.at[pl.ds(first, pages_per_step)], mask=page_is_real, other=0
        )  # [pages_per_step]
        # A bad index reads a wrong page, never past the pool: one unsigned minimum (a negative
        # index wraps to a huge one and is cut to the last page) rather than a two-sided clip.
        return unsigned_min(pages, num_pages - 1)

    def step(i, state):
        pages = load_pages(i)
        k = k_pages_ref[pages].reshape(block_tokens, head_dim)
        v = v_pages_ref[pages].reshape(block_tokens, head_dim)
        logits = online_softmax.scaled_logits(
            q,
            k,
            logit_scale_log2=logit_scale_log2,
            logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale,
            precision=precision,
        )  # [rows, block_tokens] float32, base 2
        key_index = i * block_tokens + jnp.arange(block_tokens)  # [block_tokens], in the item
        token_is_real = key_index < num_tokens
        if q_len > 1:
            visible = key_index[None, :] < visible_keys[:, None]  # [rows, block_tokens]
        else:
            visible = token_is_real[None, :]  # [1, block_tokens]
        logits = jnp.where(visible, logits, MASKED_LOGIT)
        # A zero weight times a NaN left in an unused slot is still NaN: zero those values.
        v = jnp.where(token_is_real[:, None], v, jnp.zeros_like(v))
        if q_len == 1:
            # With one new token only the item's last step has masked keys, and for a valid
            # table (last page length >= 1) it follows a real key, so each row's running max is
            # a real logit and exp2(MASKED_LOGIT - max) is exactly 0: masked keys need no second
            # select on the weights. (Dropping that per-element select, added with the bounds
            # clamps, saved more than 4% at B=32 x 4096 on the H200, net of a step count from
            # tokens that cost 3%: archive/2026-12-01-clamp-probe.md.) The one case
            # left, a last page declared empty under jit, gives o = 0 and an LSE near -7e29
            # instead of -inf: a wrong value for an invalid table, which merges as weight 0.
            return online_softmax.update(state, logits, v, None, precision=precision)
        # Several tokens: a row whose causal bound falls before this block sees no key in it,
        # and its weights must still be exactly 0 (online_softmax.update's select does that).
        return online_softmax.update(state, logits, v, visible, precision=precision)

    state = online_softmax.initial_state(rows, head_dim)
    out, lse = online_softmax.finish(lax.fori_loop(0, num_steps, step, state))
    if write_final:
        keep = row_is_real & ~is_padding
        plgpu.store(
            o_ref.at[pl.ds(first_row, rows), :], out.astype(o_ref.dtype), mask=keep[:, None]
        )
        plgpu.store(lse_ref.at[pl.ds(first_row, rows)], lse, mask=keep)
    else:
        # Partials keep only the q_len x G real rows (padded to a power of two, partial_rows),
        # not the 16 rows of the dot tile: a quarter of the bytes at G = 4, q_len = 1 for the
        # merge to read.
        keep = row_ids < partial_rows
        first_partial = (work * num_kv_heads + kv_head) * partial_rows
        plgpu.store(o_ref.at[pl.ds(first_partial, rows), :], out, mask=keep[:, None])
        plgpu.store(lse_ref.at[pl.ds(first_partial, rows)], lse, mask=keep)


@runs_in_32_bits  # x64 mode: kernels_pallas/x64.py
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
    page_indptr: jax.Array | None = None,
    last_page_len: jax.Array | None = None,
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
      q: ``[B, H, D]`` (one new token a request) or ``[B, L, H, D]`` (the last ``L`` tokens of
        each request, causal among themselves; ``L`` is static).
      k_pages, v_pages: ``[num_pages, KVH, page_size, D]`` (``layout="HND"``) or
        ``[num_pages, page_size, KVH, D]`` (``"NHD"``).
      page_indices: int32 ``[num_indices]``; every ``[start, end)`` range of a work item should
        lie inside it and name valid pages (the public API validates concrete inputs; the
        kernel clamps ranges and page numbers, so invalid ones give wrong values, never an
        access outside an array).
      work_request, work_page_start, work_page_end, work_last_page_len: int32 ``[W]``, one work
        item each: a request (``-1`` for padding), its page range in ``page_indices``, and the
        number of valid slots in the range's final page.
      page_indptr, last_page_len: the table's int32 ``[B + 1]`` and ``[B]``: where each
        request's pages start and its length, which place an item's keys relative to the new
        tokens for the causal mask. Read only when ``L > 1`` (ignored otherwise: with one new
        token they are not the kernel's operands).
      layout, sm_scale, logits_soft_cap: as in ``paged.decode_attention``.
      write_final: every request is exactly one work item, so write normalized outputs
        ``(o, lse)`` shaped like ``q`` (``o`` in q.dtype, ``lse`` float32 without ``D``)
        directly; otherwise write partial states ``(o [W, KVH, P, D] float32, lse [W, KVH, P]
        float32)`` with ``P = partial_rows(L * G)``: row ``l * G + g`` is token ``l``, head
        ``g`` of the KV head's group, padded to a power of two (rows past ``L * G`` are
        padding). ``merge_partial_states(..., num_q_heads=L * H)`` merges them into rows
        ``[B, KVH * L * G]``, which ``token_major`` turns into ``[B, L, H]``.
      pages_per_step, num_warps, num_stages: launch parameters (``paged_decode_tuning.py``).
      interpret: run in Pallas interpret mode (CPU).

    Returns:
      The final or partial ``(o, lse)`` described above.
    """
    q_len = 1 if q.ndim == 3 else q.shape[1]
    batch, num_q_heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    num_pages = k_pages.shape[0]
    if layout == "HND":
        _, num_kv_heads, page_size, _ = k_pages.shape
        kv_spec = pl.BlockSpec((num_pages, None, page_size, head_dim), lambda w, h: (0, h, 0, 0))
    elif layout == "NHD":
        _, page_size, num_kv_heads, _ = k_pages.shape
        kv_spec = pl.BlockSpec((num_pages, page_size, None, head_dim), lambda w, h: (0, 0, h, 0))
    else:
        raise ValueError(f"layout must be 'HND' or 'NHD', got {layout!r}")
    if q_len > 1 and (page_indptr is None or last_page_len is None):
        raise ValueError(
            f"q_len={q_len} needs the table's page_indptr and last_page_len for the causal mask"
        )
    group_size = num_q_heads // num_kv_heads
    query_rows = q_len * group_size
    rows = dot_rows(query_rows)
    partial = partial_rows(query_rows)
    num_work = work_request.shape[0]
    total_rows = batch * num_q_heads * q_len
    # Rows grouped by (request, KV head): the q_len x G rows that share a KV head lie together,
    # token-major. For q_len = 1 this is q's own order; otherwise a small copy of q (B L H D
    # elements, nothing next to the KV stream).
    q_rows = head_major(q.reshape(batch, q_len, num_q_heads, head_dim), num_kv_heads)
    q_rows = q_rows.reshape(total_rows, head_dim)

    if write_final:
        out_shape = (
            jax.ShapeDtypeStruct((total_rows, head_dim), q.dtype),
            jax.ShapeDtypeStruct((total_rows,), jnp.float32),
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
        q_len=q_len,
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
    table_arrays = (page_indptr, last_page_len) if q_len > 1 else ()  # read for the causal bound
    o, lse = pl.pallas_call(
        kernel,
        grid=(num_work, num_kv_heads),
        in_specs=[
            *(whole_array(a.shape) for a in work_arrays),
            whole_array(page_indices.shape),
            *(whole_array(a.shape) for a in table_arrays),
            whole_array(q_rows.shape),
            kv_spec,
            kv_spec,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_decode_{layout}_p{pages_per_step}_w{num_warps}_s{num_stages}"
        + (f"_q{q_len}" if q_len > 1 else "")
        + ("_final" if write_final else "_partial"),
    )(*work_arrays, page_indices, *table_arrays, q_rows, k_pages, v_pages)
    if write_final:
        o = token_major(o.reshape(batch, num_q_heads * q_len, head_dim), q_len, num_kv_heads)
        lse = token_major(lse.reshape(batch, num_q_heads * q_len), q_len, num_kv_heads)
        return o.reshape(q.shape), lse.reshape(q.shape[:-1])
    return (
        o.reshape(num_work, num_kv_heads, partial, head_dim),
        lse.reshape(num_work, num_kv_heads, partial),
    )


def unsigned_min(x: jax.Array, bound: int) -> jax.Array:
    """``x`` (int32) clamped to ``[0, bound]`` in one unsigned minimum: negative values wrap
    to values above ``bound`` and become ``bound``."""
    return jnp.minimum(x.astype(jnp.uint32), jnp.uint32(bound)).astype(x.dtype)


def dot_rows(query_rows: int) -> int:
    """Rows of the query tile: the ``q_len x G`` query rows of a KV head padded to a power of
    two, at least the 16 rows of a tensor-core tile (padding lives in registers only)."""
    return max(MIN_ROWS, pl.next_power_of_2(query_rows))


def partial_rows(query_rows: int) -> int:
    """Rows a work item's partial state keeps per KV head: the ``q_len x G`` query rows, padded
    to a power of 2."""
    return pl.next_power_of_2(query_rows)


def head_major(x: jax.Array, num_kv_heads: int) -> jax.Array:
    """``[B, L, KVH * G, ...]`` -> ``[B, KVH, L, G, ...]``: the kernel's row order, where the
    ``L x G`` query rows of one KV head are consecutive. A reshape alone when ``L = 1``."""
    batch, q_len, num_q_heads, *rest = x.shape
    x = x.reshape(batch, q_len, num_kv_heads, num_q_heads // num_kv_heads, *rest)
    return x.reshape(batch, num_kv_heads, 1, *x.shape[3:]) if q_len == 1 else jnp.moveaxis(x, 1, 2)


def token_major(x: jax.Array, q_len: int, num_kv_heads: int) -> jax.Array:
    """``[B, KVH * L * G, ...]`` (the kernel's and the merge's row order) -> ``[B, L, KVH * G,
    ...]`` (q's order). A reshape alone when ``L = 1``."""
    batch, total, *rest = x.shape
    group = total // (num_kv_heads * q_len)
    x = x.reshape(batch, num_kv_heads, q_len, group, *rest)
    if q_len > 1:
        x = jnp.moveaxis(x, 2, 1)
    return x.reshape(batch, q_len, num_kv_heads * group, *rest)
