"""Quest page scores on Mosaic GPU (Pallas ``plgpu``): every listed page's logit bound.

The kernel of ``paged.sparse_quest.quest_page_scores`` (the reference, which this matches): for
query head ``h`` of KV head ``k = h // G`` and a listed page with key bounds ``(kmin, kmax)``
(``PageKeyBounds``, ``[num_pages, KVH, D]`` each),

    U = sum_i max(q_i * kmin_i, q_i * kmax_i)

and ``per="kv_head"`` keeps the largest ``U`` over the ``G`` query heads of each KV head,
``per="query_head"`` each. Scores come out as the reference's ``[B, R, nnz_padded]`` (``R =
KVH`` or ``H``), ``-inf`` where entry ``j`` of ``page_indices`` is not one of request ``b``'s
pages and for a page with empty bounds. ``paged.sparse_decode_attention`` runs it under
``backend="pallas"`` (``"auto"`` keeps the reference until it is measured on the H200);
selection (the top pages) is ``quest_selected_pages`` or its kernel, ``kernels_pallas/
quest_select.py``, chosen the same way.

What it costs. Scoring is memory bound: each page row of ``kmin`` and ``kmax`` (``D`` float32,
512 bytes at ``D = 128``) serves only the ``G`` query heads of its KV head, two products, a
maximum and an add per element and head: ``G / 2`` float32 operations a byte, against the
H200's ~14 (67 TFLOP/s over 4.8 TB/s). So the floor is the bytes read,
``2 x num_listed_pages x KVH x D x 4`` (plus ``q``, the page numbers and the scores, each
under a few percent of that at decode shapes): at B = 8 requests of 32K tokens, page size 16,
8 KV heads, ``D = 128``, that is ``2 x 16384 x 8 x 128 x 4 = 128 MiB``, about 28 us at the
H200's 4.8 TB/s (B = 1: 16 MiB, 3.5 us). Not measured yet: ``bench/probes/quest_scores.py``
checks and times it beside the reference on the GPU.

Latency hiding. A program's shared memory is ``num_stages`` x 64 KiB of tiles at ``D = 128``
(``shared_memory_bytes``): one block an SM at two stages (131 KiB). What keeps HBM busy is
therefore the gathers in flight inside a program, not other blocks: while one 64 KiB step is
computed the next is in flight, about twice the ~36 KiB an SM must have outstanding to stream
4.8 TB/s at a microsecond of latency over 132 SMs. ``num_stages=3`` (195 KiB) is the launch to
try if the probe shows the copies exposed. The risk to measure first: a step is 128 TMA copies
of 512 bytes, issued one after another by one thread. If their issue rate is the limit, the
alternative is page-major: a program for all KV heads of its pages, one ``[KVH, D]`` box (4 KiB)
a page and bound, 1/KVH of the copies, at the price of a query tile whose rows follow the
heads (``G`` tiles of ``[64, D]`` in shared memory, which do not fit beside two stages at
``G = 4``; hence not the first version).

Work split. One program per (work item, KV head); a work item is up to ``pages_per_item``
consecutive entries of one request's page list (built in the wrapper from ``page_indptr``, a
request of ``n`` pages giving ``ceil(n / pages_per_item)`` items). Programs are therefore
balanced whatever the requests' lengths, an empty request launches none, and a program loads
its request's ``G`` query rows once. (One program per request and KV head would leave most of
the H200's 132 SMs idle at B = 8, and its slowest program would be its longest request.)

One program, one warpgroup:

- Prologue: copy the item's page numbers (``pages_per_item`` int32 and up to 3 before them: a
  copy starts on 16 bytes, ``index_windows.py``; zero-filled past ``page_indices``' end) and the KV
  head's ``G`` query rows (float32) into shared memory.
- Steps of 64 pages (a 64-row register tile, the row count of Mosaic GPU's WGMMA register
  layout, whose row reductions are cheap warp shuffles): the page rows ``kmin[page, k, :]`` and
  ``kmax[page, k, :]`` of 64 pages are gathered, one 1 x ``D`` TMA copy each, into a
  ``[64, D]`` shared-memory tile; ``num_stages`` steps are in flight (double buffering by
  default). A slot is refilled right after its step is computed, behind a ``commit_smem`` (a
  warpgroup barrier and an async-proxy fence: the warps' reads of the slot come before the
  copies that overwrite it; the interpreter's race detector finds the race without it). Page numbers are cut to the pool (one unsigned minimum), so a bad table reads a
  wrong page, never outside ``kmin``/``kmax``.
- Compute of a step, for each query head ``g`` of the group: the query row broadcast down the
  tile, ``max(q * kmin, q * kmax)`` element-wise, summed along ``D``: 64 scores. A row whose
  bounds are empty somewhere (``kmin_i > kmax_i``, the ``+inf``/``-inf`` of an unwritten page)
  scores ``-inf``, as the reference says. ``per="kv_head"`` keeps the running maximum over the
  group.
- Scores go straight from registers to ``[num_items, R, pages_per_item]`` in global memory;
  the wrapper places item ``w``'s entry ``t`` at ``page_indices`` entry ``start[w] + t`` and
  writes ``-inf`` where the reference does (an XLA select over ``[B, R, nnz_padded]``, the
  output's size; the reference's own output format is ``B`` times larger than the
  ``[R, nnz_padded]`` a consumer needs, since each entry belongs to at most one request).

Shared-memory banks. A tile row is ``D`` float32 (512 bytes at ``D = 128``), so with unpadded
rows the 8 rows a warp reads at once in the register layout start on the same bank: an 8-way
conflict, about 4x the 2 shared-memory cycles a warp's 256-byte load needs. By arithmetic,
loading a step's 64 KiB then takes about 2000 cycles an SM (~1.1 us), a ceiling near 7 TB/s
over 132 SMs, above the HBM's 4.8 but not by much once the compute is added.
``row_padding=8`` pads each row by 32 bytes, which spreads the 8 rows over all banks (2 cycles,
the minimum); the price is that a row's TMA destination is then 32-byte aligned, not 128-byte
aligned, and on the H200 a TMA copy into a destination off 128 bytes faulted
(``CUDA_ERROR_MISALIGNED_ADDRESS``, another kernel's copy, 2026-12-02; ``index_windows.py``).
So the padded layout runs interpreted only (its arithmetic stays tested) and a compiled call
refuses it; the default is the unpadded, 128-byte aligned layout.

Rows of a step past the item's end gather whatever page numbers lie there (another request's,
or page 0): wasted bytes, at most 63 rows an item, never stored.

Numerics. Each product and maximum is exact in the reference's sense (the same float32 product,
rounded once); only the order of the ``D``-term sum differs (Mosaic GPU's row reduction is a
tree across lanes). Two float32 sums of the same ``D`` terms in different orders differ by at
most about ``2 (D - 1) u sum_i |t_i|`` (``u = 2^-24``, the standard bound for recursive
summation, applied to both), so the tests compare with ``atol = 2 D u sum_i |t_i|`` per score
(``t_i`` the chosen product), computed from the inputs; a real indexing error moves a score by
a whole term, far more.

Selection by kernel: ``kernels_pallas/quest_select.py``, a second small kernel over ``[B, R, n]``
(a radix threshold select on the scores' order-preserving integer keys, then the earliest ties,
the first and last page forced; equal to the reference bit for bit). It could instead run in
this kernel's epilogue if one program owned a whole request and head, which the work split above
gives up for balance.

Mosaic GPU's interpreter (``interpret=True``, ``plgpu.InterpretGPUParams()``) runs the whole
kernel on a CPU: TMA, barriers, the register-layout loads, broadcasts and reductions. The
compiled path's Mosaic GPU lowering (layout inference, TMA descriptors) also runs on a CPU
(``jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))``, a test); only ptxas and the
run itself need the GPU (``bench/probes/quest_scores.py`` checks and times it there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.index_windows import (
    aligned_window_start,
    index_buffer_entries,
    pad_page_indices,
)
from kernels_pallas.paged_decode import unsigned_min

# x64 mode (kernels_pallas/x64.py), with an interpreted call traced with x64 off: the
# interpreter's host callbacks cannot be exported.
from kernels_pallas.paged_decode_mgpu import (
    _runs_in_32_bits_also_interpreted as runs_in_32_bits_also_interpreted,
)
from paged.page_table import PageTable
from paged.sparse_quest import (
    GRANULARITIES,
    PageKeyBounds,
    _check_bounds,
    _check_query,
    _check_table_fits,
)

TILE_PAGES = 64  # rows of one step's register tile (the WGMMA register layout has 64 rows)
# One copy of page numbers, at most 256 entries, holds an item's and the up to 3 before it (a
# copy starts on 16 bytes: index_windows.py), so the largest multiple of 64 pages is 192.
MAX_PAGES_PER_ITEM = 192
MAX_GROUP = 256  # the group's query rows are one TMA box too
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # D float32 per row: a multiple of 8 columns, <= 256
MAX_SHARED_MEMORY_BYTES = 227 * 1024  # a Hopper block's dynamic shared memory
ROW_PADDINGS = (0, 8)  # float32 columns after each tile row (module docstring)


def quest_scores_kernel(
    work_request_ref,  # [W] int32, GMEM: the item's request (any value for an empty item)
    work_start_ref,  # [W] int32, GMEM: the item's first entry of page_indices
    work_end_ref,  # [W] int32, GMEM: one past its last (start == end: an empty item)
    page_indices_ref,  # [nnz] int32, GMEM
    q_ref,  # [B * H, D] float32, GMEM: row (request * KVH + kv_head) * G + g
    kmin_ref,  # [num_pages, KVH, D] float32, GMEM
    kmax_ref,  # [num_pages, KVH, D] float32, GMEM
    scores_ref,  # [W, R, pages_per_item] float32, GMEM, R = KVH or H
    *,
    group_size: int,
    per_query_head: bool,
    pages_per_item: int,
    num_stages: int,
    row_padding: int,
):
    work = lax.axis_index("work")
    kv_head = lax.axis_index("kv_head")
    num_pages, num_kv_heads, head_dim = kmin_ref.shape
    num_query_rows = q_ref.shape[0]
    batch = num_query_rows // (num_kv_heads * group_size)
    request = jnp.minimum(unsigned_min(work_request_ref[work], batch), batch - 1)
    start = unsigned_min(work_start_ref[work], page_indices_ref.shape[0])
    item_pages = jnp.clip(work_end_ref[work] - start, 0, pages_per_item)
    # The page numbers are copied from the multiple of 4 entries at or below the item's first
    # (a copy starts on 16 bytes: index_windows.py); the item's begin at `index_shift`.
    index_start, index_shift = aligned_window_start(start)
    num_steps = pl.cdiv(item_pages, TILE_PAGES)
    first_query_row = (request * num_kv_heads + kv_head) * group_size
    tile_layout = plgpu.Layout.WGMMA
    column_layout = plgpu.Layout.WGMMA.reduce(0)  # a [D] row, broadcast down the tile
    tile_shape = (TILE_PAGES, head_dim)

    def scoped(page_numbers, queries, kmin_tiles, kmax_tiles, setup_barrier, tile_barriers):
        plgpu.copy_gmem_to_smem(
            page_indices_ref.at[pl.ds(index_start, index_buffer_entries(pages_per_item))],
            page_numbers,
            setup_barrier,
        )
        plgpu.copy_gmem_to_smem(
            q_ref.at[pl.ds(first_query_row, group_size)], queries, setup_barrier
        )
        plgpu.barrier_wait(setup_barrier)

        def gather_step(step, slot):
            # One 1 x D copy a page row; all 2 x 64 arrive on the slot's barrier. A loop, not
            # 128 unrolled copies: the issuing thread's work is the same, the code 1/64th.
            def copy_row(row, carry):
                entry = index_shift + step * TILE_PAGES + row
                page = unsigned_min(page_numbers[entry], num_pages - 1)
                for bounds_ref, tiles in ((kmin_ref, kmin_tiles), (kmax_ref, kmax_tiles)):
                    plgpu.copy_gmem_to_smem(
                        bounds_ref.at[pl.ds(page, 1), kv_head],
                        tiles.at[slot, pl.ds(row, 1), pl.ds(0, head_dim)],
                        tile_barriers.at[slot],
                    )
                return carry

            lax.fori_loop(0, TILE_PAGES, copy_row, 0)

        for step in range(num_stages):

            @pl.when(step < num_steps)
            def _(step=step):
                gather_step(step, step)

        def step_body(step, carry):
            slot = lax.rem(step, num_stages)
            plgpu.barrier_wait(tile_barriers.at[slot])
            tile = (slot, slice(None), pl.ds(0, head_dim))  # the padding columns left out
            kmin = plgpu.load(kmin_tiles.at[tile], layout=tile_layout, optimized=False)
            kmax = plgpu.load(kmax_tiles.at[tile], layout=tile_layout, optimized=False)
            # A page no key was written to has kmin = +inf > kmax = -inf: its largest logit is
            # the maximum over no keys, -inf (the sum below would give +inf or NaN).
            empty = jnp.where(kmin > kmax, 1.0, 0.0).max(axis=1) > 0.0
            best = None
            for g in range(group_size):
                query = plgpu.load(queries.at[g], layout=column_layout, optimized=False)
                query = lax.broadcast_in_dim(query, tile_shape, [1])
                upper = jnp.maximum(query * kmin, query * kmax).sum(axis=1)
                upper = jnp.where(empty, -jnp.inf, upper)
                if per_query_head:
                    row = kv_head * group_size + g
                    scores_ref[work, row, pl.ds(step * TILE_PAGES, TILE_PAGES)] = upper
                else:
                    best = upper if best is None else jnp.maximum(best, upper)
            if not per_query_head:
                scores_ref[work, kv_head, pl.ds(step * TILE_PAGES, TILE_PAGES)] = best

            @pl.when(step + num_stages < num_steps)
            def _():
                # The refill overwrites the slot every warp just read. Nothing above syncs the
                # warps (each reduces its own rows), and one thread issues the copies, so wait
                # for all of them and order their reads before the TMA writes.
                plgpu.commit_smem()
                gather_step(step + num_stages, slot)

            return carry

        lax.fori_loop(0, num_steps, step_body, 0)

    pl.run_scoped(
        scoped,
        plgpu.SMEM((index_buffer_entries(pages_per_item),), jnp.int32),
        plgpu.SMEM((group_size, head_dim), jnp.float32),
        plgpu.SMEM((num_stages, TILE_PAGES, head_dim + row_padding), jnp.float32),
        plgpu.SMEM((num_stages, TILE_PAGES, head_dim + row_padding), jnp.float32),
        plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_arrivals=2 * TILE_PAGES, num_barriers=num_stages),
    )


def quest_work_items(page_indptr: jax.Array, pages_per_item: int, num_items: int):
    """Each request's page list cut into items of at most ``pages_per_item`` entries.

    Request ``b`` of ``n`` pages gives ``ceil(n / pages_per_item)`` items, in request order; the
    ``num_items`` slots (static, at least the total) past the last item are empty (start = end
    = 0, request 0).

    Returns:
      ``(work_request, work_start, work_end, item_indptr)``: int32 ``[num_items]`` three times
      (``[work_start, work_end)`` entries of ``page_indices``), and int32 ``[B + 1]``, the first
      item of each request.

    Example:
      >>> items = quest_work_items(jnp.array([0, 3, 3, 8], jnp.int32), 4, 5)
      >>> [a.tolist() for a in items]
      [[0, 2, 2, 0, 0], [0, 3, 7, 0, 0], [3, 7, 8, 0, 0], [0, 1, 1, 3]]
    """
    batch = page_indptr.shape[0] - 1
    pages = jnp.maximum(page_indptr[1:] - page_indptr[:-1], 0)
    items = (pages + pages_per_item - 1) // pages_per_item
    item_indptr = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(items, dtype=jnp.int32)])
    work = jnp.arange(num_items, dtype=jnp.int32)
    # The last request whose first item is at or before the slot: empty requests are skipped.
    request = jnp.clip(
        jnp.searchsorted(item_indptr, work, side="right").astype(jnp.int32) - 1, 0, batch - 1
    )
    start = page_indptr[request] + (work - item_indptr[request]) * pages_per_item
    end = jnp.minimum(start + pages_per_item, page_indptr[request + 1])
    real = work < item_indptr[-1]
    zero = jnp.zeros_like(work)
    return (
        jnp.where(real, request, zero),
        jnp.where(real, start, zero),
        jnp.where(real, end, zero),
        item_indptr,
    )


def quest_page_scores_pallas(
    q: jax.Array,
    bounds: PageKeyBounds,
    page_table: PageTable,
    *,
    per: str = "kv_head",
    pages_per_item: int = MAX_PAGES_PER_ITEM,
    num_stages: int = 2,
    row_padding: int = 0,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> jax.Array:
    """``paged.sparse_quest.quest_page_scores`` computed by the Mosaic GPU kernel.

    Args:
      q: ``[B, H, D]`` float32, bfloat16 or float16 (cast to float32, exactly), one new token
        per request; ``H`` a multiple of the bounds' KV heads, ``D`` one of
        ``SUPPORTED_HEAD_DIMS``.
      bounds: ``PageKeyBounds`` of the pool, ``[num_pages, KVH, D]`` each, float32 or narrower.
      page_table: the requests' pages (its ``page_size`` is not used by the scores).
      per: ``"kv_head"`` or ``"query_head"``.
      pages_per_item: entries of one request's page list a program scores (a multiple of 64,
        at most 192; static).
      num_stages: 64-page steps of bound rows in flight a program (static, >= 1).
      row_padding: float32 columns of padding after each row of the shared-memory tiles: 0 or
        8, the latter interpreted only (static; module docstring, "Shared-memory banks").
      interpret: run in Mosaic GPU's interpret mode (CPU); a ``plgpu.InterpretGPUParams`` sets
        the interpreter's options.

    Returns:
      float32 ``[B, R, nnz_padded]`` (``R = KVH`` or ``H``), the reference's scores: entry
      ``[b, r, j]`` scores ``page_indices[j]`` for request b; ``-inf`` where ``j`` is not one
      of b's pages and for a page whose bounds are empty. Equal to the reference up to the
      order of the ``D``-term sums (module docstring).

    Raises:
      ValueError: what the reference refuses (``per``, ``q``'s shape against the bounds, the
        bounds' shapes, page-table invariants when concrete), and what the kernel cannot run:
        float64 inputs, a head_dim or group size it does not take, bad ``pages_per_item`` or
        ``num_stages``, ``row_padding=8`` compiled (naming the argument and the value).

    Example:
      >>> bounds = PageKeyBounds(jnp.full((1, 1, 64), -1.0), jnp.full((1, 1, 64), 2.0))
      >>> table = PageTable.from_page_lists([[0]], seq_lens=[1], page_size=4)
      >>> scores = quest_page_scores_pallas(jnp.ones((1, 1, 64)), bounds, table, interpret=True)
      >>> scores[0, 0, :2].tolist()
      [128.0, -inf]
    """
    if per not in GRANULARITIES:
        raise ValueError(f"per must be one of {GRANULARITIES}, got {per!r}")
    _check_bounds(bounds)
    num_pages, num_kv_heads, head_dim = bounds.kmin.shape
    _check_query(q, num_kv_heads, head_dim)
    _check_table_fits(page_table, num_pages, page_table.page_size, batch_size=q.shape[0])
    validate_quest_scores_arguments(q, bounds, pages_per_item, num_stages, row_padding)
    if row_padding and not interpret:
        raise ValueError(
            f"row_padding={row_padding} runs interpreted only: its rows' TMA destinations lie "
            "off 128 bytes, which faults compiled (module docstring, 'Shared-memory banks')"
        )
    return _quest_page_scores(
        q,
        bounds.kmin,
        bounds.kmax,
        page_table.page_indptr,
        page_table.page_indices,
        page_table.last_page_len,
        per=per,
        pages_per_item=pages_per_item,
        num_stages=num_stages,
        row_padding=row_padding,
        interpret=interpret,
    )


def validate_quest_scores_arguments(q, bounds, pages_per_item, num_stages, row_padding=0) -> None:
    """Raises ValueError for what the kernel cannot run (beyond the reference's checks)."""
    for name, dtype in (("q", q.dtype), ("bounds.kmin", bounds.kmin.dtype)):
        if not jnp.issubdtype(dtype, jnp.floating) or jnp.dtype(dtype).itemsize > 4:
            raise ValueError(
                f"{name} must be float32, bfloat16 or float16 (the kernel computes in float32; "
                f"the reference scores float64), got {dtype}"
            )
    if bounds.kmax.dtype != bounds.kmin.dtype:
        raise ValueError(
            f"bounds.kmin and bounds.kmax must share a dtype, got {bounds.kmin.dtype} and "
            f"{bounds.kmax.dtype}"
        )
    num_pages, num_kv_heads, head_dim = bounds.kmin.shape
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    group_size = q.shape[1] // num_kv_heads
    if group_size > MAX_GROUP:
        raise ValueError(
            f"num_q_heads / num_kv_heads = {group_size} query heads a KV head; at most {MAX_GROUP}"
        )
    if num_pages < 1:
        raise ValueError(f"the pool must hold at least one page, got num_pages={num_pages}")
    if not (
        isinstance(pages_per_item, int)
        and TILE_PAGES <= pages_per_item <= MAX_PAGES_PER_ITEM
        and pages_per_item % TILE_PAGES == 0
    ):
        raise ValueError(
            f"pages_per_item must be a multiple of {TILE_PAGES} up to {MAX_PAGES_PER_ITEM}, "
            f"got {pages_per_item!r}"
        )
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if row_padding not in ROW_PADDINGS:
        raise ValueError(f"row_padding must be one of {ROW_PADDINGS}, got {row_padding!r}")
    shared = shared_memory_bytes(head_dim, group_size, pages_per_item, num_stages, row_padding)
    if shared > MAX_SHARED_MEMORY_BYTES:
        raise ValueError(
            f"num_stages={num_stages} at head_dim={head_dim} (group {group_size}) needs "
            f"{shared} bytes of shared memory, more than a block's {MAX_SHARED_MEMORY_BYTES}; "
            "use fewer stages"
        )


def shared_memory_bytes(head_dim, group_size, pages_per_item, num_stages, row_padding=0) -> int:
    """A program's shared memory: the kmin and kmax tiles of every stage, the group's query
    rows, the page numbers, and the barriers (8 bytes each).

    Example:
      >>> shared_memory_bytes(128, 4, 192, 2)  # 2 x 2 x 64 x 128 x 4 + 4 x 128 x 4 + 896 + 24
      134040
    """
    tiles = 2 * num_stages * TILE_PAGES * (head_dim + row_padding) * 4
    page_numbers = index_buffer_entries(pages_per_item) * 4
    return tiles + group_size * head_dim * 4 + page_numbers + 8 * (1 + num_stages)


def _interpret_params(interpret):
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else None


@runs_in_32_bits_also_interpreted
@functools.partial(
    jax.jit, static_argnames=("per", "pages_per_item", "num_stages", "row_padding", "interpret")
)
def _quest_page_scores(
    q,
    kmin,
    kmax,
    page_indptr,
    page_indices,
    last_page_len,
    *,
    per,
    pages_per_item,
    num_stages,
    row_padding,
    interpret,
):
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = kmin.shape[1]
    group_size = num_q_heads // num_kv_heads
    per_query_head = per == "query_head"
    num_rows = num_q_heads if per_query_head else num_kv_heads
    num_indices = page_indices.shape[0]
    if batch == 0 or num_indices == 0:  # no page listed: no program to launch
        return jnp.full((batch, num_rows, num_indices), -jnp.inf, jnp.float32)
    num_items = num_indices // pages_per_item + batch  # >= sum_b ceil(n_b / pages_per_item)
    work_request, work_start, work_end, item_indptr = quest_work_items(
        page_indptr, pages_per_item, num_items
    )
    # Padded to a multiple of 4 entries and to at least one copy's (index_windows.py).
    padded_indices = pad_page_indices(page_indices, pages_per_item)
    kernel = functools.partial(
        quest_scores_kernel,
        group_size=group_size,
        per_query_head=per_query_head,
        pages_per_item=pages_per_item,
        num_stages=num_stages,
        row_padding=row_padding,
    )
    item_scores = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((num_items, num_rows, pages_per_item), jnp.float32),
        # Items on the last axis (CUDA's x, up to 2^31 - 1 blocks), as paged_decode_mgpu does.
        grid=(num_kv_heads, num_items),
        grid_names=("kv_head", "work"),
        interpret=_interpret_params(interpret),
        kernel_name=f"quest_scores_{per}_i{pages_per_item}_s{num_stages}_r{row_padding}",
    )(
        work_request,
        work_start,
        work_end,
        padded_indices,
        q.astype(jnp.float32).reshape(batch * num_q_heads, head_dim),
        kmin.astype(jnp.float32),
        kmax.astype(jnp.float32),
    )
    # Entry j of page_indices: its request, the item holding it and its place in the item.
    j = jnp.arange(num_indices, dtype=jnp.int32)
    request = jnp.minimum(
        jnp.searchsorted(page_indptr[1:], j, side="right").astype(jnp.int32), batch - 1
    )
    in_request = j - page_indptr[request]
    item = jnp.clip(item_indptr[request] + in_request // pages_per_item, 0, num_items - 1)
    offset = jnp.clip(in_request % pages_per_item, 0, pages_per_item - 1)
    scores = jnp.swapaxes(item_scores[item, :, offset], 0, 1)  # [R, nnz]
    # The reference's -inf: entries outside a request, and (as token_mask says) the last page of
    # a request whose last_page_len is 0, which holds none of its tokens.
    start = page_indptr[:-1, None]
    end = page_indptr[1:, None]
    owned = (start <= j) & (j < end) & ((j != end - 1) | (last_page_len[:, None] > 0))
    return jnp.where(owned[:, None, :], scores[None], -jnp.inf)
