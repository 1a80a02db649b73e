"""Ragged paged attention on Mosaic GPU, a prototype: decode rows and prefill chunks in one launch.

The contract is ``paged/ragged_attention.py``'s: all new tokens of a step in ``q [T, H, D]``,
request ``b``'s at ``q[qo_indptr[b]:qo_indptr[b + 1]]`` (1 for a decode row, a chunk for a
prompt, 0 for an idle slot), the last tokens of their requests in the CSR page table, causal
among themselves. Today's engine runs such a step as two launches (the decode kernel over the
decode rows, the prefill kernel over the chunk); this kernel runs it as one, so that the
chunk's query tiles and the decode rows' page streams share one grid. Not wired into any public
function: ``bench/probes/ragged_attention.py`` is to measure whether it wins first. Nothing here
is measured yet.

Work items. ``plan_ragged`` (host, NumPy) cuts each request's new tokens into query tiles: a
tile holds ``q_len`` consecutive new tokens of one request, whose ``q_len x G`` rows (token-major,
then the ``G`` query heads of one KV head) fit one 64-row WGMMA tile from their offset in an
8-row TMA tile (as ``paged_decode_mgpu.py`` packs its ``q_len x G`` rows). A decode row is one
tile of one token (``G`` rows, the rest padding, exactly the decode kernel's tile); a 256-token
chunk at ``G = 4`` is 16 tiles of 16 tokens. The grid is ``(KV heads, work items)``: one program
a (tile, KV head), one warpgroup each.

A program, as the decode kernel's (whose pipeline this reuses: ``_attend_step`` and the
shared-memory transforms are imported from ``paged_decode_mgpu.py``):

- TMA the query tile (``64`` rows from the 8-row boundary at or before the tile's first row of
  the head-major copy of ``q``, ``[KVH, T_pad, G, D]``; ``T_pad`` is ``T`` rounded up to 8, so
  a tile's offset in its TMA tile, ``(q_start x G) mod 8``, is the same for every KV head and
  the planner can fit the tile to it).
- Stream the request's pages ``0 .. ceil(num_keys / page_size) - 1`` by TMA through
  ``plgpu.emit_pipeline`` (page numbers read in-kernel from a shared-memory window of
  ``page_indices``), ``num_keys`` being what the tile's LAST token sees: pages that lie wholly
  past every row's position are never read (the causal skip of the prefill kernel, at page
  granularity). A decode row's tile reads all of its request's pages.
- Per page: ``s = q @ K^T`` (WGMMA), base-2 scaled (or soft-capped) logits, each row masked at
  its own position (token ``l`` of the tile sees ``causal_base + l`` keys, the decode kernel's
  rule), the float32 online softmax, ``p @ V``; ``p`` from shared memory (``probs_in_smem=True``,
  what the interpreter runs) or registers (compiled only).
- Normalize; store the tile's ``q_len x G`` real rows by TMA. Their count differs from tile to
  tile (a decode row's ``G``, a chunk tile's up to 64) and a TMA box is static, so the rows go
  out in one copy a binary digit of the count (64 rows, or up to six copies of 32, 16, ..., 1);
  the natural-log LSE, when asked for, as guarded scalar stores.

Around the kernel, ``ragged_attention_mgpu`` copies ``q`` into the head-major rows and the
output back to token order: two XLA transposes that the probe counts in the ragged arm's time.
A 4-D TMA box ``[tokens, 1, G, D]`` over ``q`` viewed as ``[T, KVH, G, D]`` lands the same
``(token, g)`` rows in shared memory and could read ``q`` in place (not tried).

Split-KV, optional. Unsplit, every tile reads all the keys it sees in one program, and the
step is one launch. A step of few decode rows at long context (4 rows at 32K: 32 programs of
2K pages on 132 SMs) then leaves the GPU underfilled, its time set by one program. With
``plan_ragged(max_pages_per_item=N)`` a longer tile becomes several items over consecutive
page ranges; the kernel (``write_final=False``) writes each item's partial state, all 64 tile
rows, and ``merge_partial_states`` (``kernels_pallas/merge_states.py``, a second launch)
merges each tile's items; ``run_ragged_plan`` runs either form. How to pick ``N`` is left open
(no heuristic yet; ``paged.plan_decode`` sizes its chunks from the grid it wants to fill).

Bounds as in the decode kernel: page ranges are cut to ``page_indices``, page numbers to the
pool, a tile's rows to its 64-row tile and to ``q``; a padding item (request outside the batch,
or a tile starting past ``q``) stores nothing.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.index_windows import (
    aligned_window_start,
    index_buffer_entries,
    pad_page_indices,
    resolve_index_window,
)
from kernels_pallas.merge_states import merge_partial_states
from kernels_pallas.online_softmax import LN_2, LOG2_E
from kernels_pallas.paged_decode import unsigned_min
from kernels_pallas.paged_decode_mgpu import (
    TILE_ROWS,
    _attend_step,
    _interpret_params,
    _row_broadcast,
    _runs_in_32_bits_also_interpreted,
    _transforms,
    validate_mgpu_decode_arguments,
)
from kernels_pallas.platform import is_concrete

TMA_TILE_ROWS = 8  # a tiled TMA copy of the query starts on an 8-row boundary
# The row counts one output store may copy: a tile's q_len x G rows are at most 64, written as
# the binary digits of their count.
STORE_CHUNKS = (64, 32, 16, 8, 4, 2, 1)


class RaggedPlan(NamedTuple):
    """The work items of one ragged step (host NumPy int32 arrays).

    A tile is ``q_len`` consecutive new tokens of one request; it is one work item, or, split,
    several over consecutive page ranges (consecutive in the lists) whose partial states are
    merged.

    Attributes:
      work_request: ``[W]``, the item's request; -1 for padding (stores nothing).
      work_q_start: ``[W]``, its tile's first new token, an index into ``q``'s ``T`` tokens.
      work_q_len: ``[W]``, its tile's new tokens (``q_len x G`` rows, at most 64 with their
        offset in the TMA tile).
      work_causal_base: ``[W]``, keys of the item's range the tile's first token sees: its
        position plus one (``seq_len - n + l + 1`` for token ``l`` of the request's ``n``) less
        the item's first key; token ``i`` of the tile sees ``causal_base + i`` of them (0 or
        less: none).
      work_page_start, work_page_end: ``[W]``, the item's pages in ``page_indices``. The tile's
        pages are the request's first ``ceil(num_keys / page_size)``, ``num_keys`` what its last
        token sees; an unsplit item has them all.
      work_last_page_len: ``[W]``, keys in the item's last page.
      merge_indptr: ``[num_tiles + 1]``, tile ``j``'s items are ``merge_indptr[j]:merge_indptr[j
        + 1]`` (``merge_states.py``'s form).
      token_tile: ``[T]``, the tile of each new token.
    """

    work_request: np.ndarray
    work_q_start: np.ndarray
    work_q_len: np.ndarray
    work_causal_base: np.ndarray
    work_page_start: np.ndarray
    work_page_end: np.ndarray
    work_last_page_len: np.ndarray
    merge_indptr: np.ndarray
    token_tile: np.ndarray

    @property
    def num_work_items(self) -> int:
        return int(self.work_request.shape[0])

    @property
    def work_arrays(self) -> tuple:
        """The seven ``work_*`` arrays, in the kernel's operand order."""
        return tuple(self[:7])

    @property
    def write_final(self) -> bool:
        """Whether every tile is one item (the kernel writes the output itself); else the
        items write partial states to merge (host-side: reads ``merge_indptr``)."""
        return bool(np.all(np.diff(np.asarray(self.merge_indptr)) == 1))


def plan_ragged(
    qo_indptr,
    page_indptr,
    last_page_len,
    *,
    page_size: int,
    group_size: int,
    num_work_items: int | None = None,
    max_pages_per_item: int | None = None,
) -> RaggedPlan:
    """Cuts every request's new tokens into query tiles, and long tiles into items (host side).

    For request ``b`` with ``n > 0`` new tokens and ``seq_len`` keys, tiles are taken in token
    order: a tile starting at token ``t`` (of ``q``) sits at row offset ``o = (t x G) mod 8`` in
    its TMA tile and takes ``min(tokens left, (64 - o) // G)`` tokens. Its keys are what its
    last token sees; pages past them are never listed. Tiles are ordered by the keys they read,
    most first, so the longest programs start first (a decode row at 4K context before the
    early tiles of a chunk, which read few pages).

    Split-KV (``max_pages_per_item``): a tile of more pages becomes items of at most that many
    consecutive pages, each writing a partial state ``(o, lse)`` of its 64 tile rows that
    ``kernels_pallas/merge_states.py`` merges (``merge_partial_states`` over ``merge_indptr``,
    ``64 x KVH`` rows a tile), as the decode kernel's split plans are; the kernel then runs
    with ``write_final=False`` and a second launch merges. A step of few decode rows at long
    context needs it to fill the GPU. The threshold is the caller's (the prototype has no
    heuristic yet: ``paged.plan_decode`` sizes its chunks from the grid it wants to fill, and
    the same rule would carry over); None (the default) splits nothing, one launch.

    Args:
      qo_indptr: ``[B + 1]`` ints, CSR offsets of each request's new tokens (concrete).
      page_indptr, last_page_len: the page table's ``[B + 1]`` and ``[B]`` (concrete; the table
        already holds the new tokens).
      page_size: tokens a page.
      group_size: query heads a KV head, ``G`` (1 to 8).
      num_work_items: pad the work lists to this many items (request -1) for a static shape;
        None for exactly as many as needed.
      max_pages_per_item: split tiles of more pages than this (>= 1), or None.

    Returns:
      A ``RaggedPlan``.

    Raises:
      ValueError: for a ``group_size`` outside 1 to 8, a ``max_pages_per_item`` below 1,
        a ``qo_indptr`` not starting at 0 or decreasing, ``qo_indptr`` and the table of
        different batches, a request with more new tokens than
        keys, or ``num_work_items`` below the items needed.

    Example:
      >>> # A decode row at 36 keys, an idle slot, a 20-token chunk after 12 keys (G = 4).
      >>> plan = plan_ragged([0, 1, 1, 21], [0, 3, 3, 5], [4, 0, 16], page_size=16, group_size=4)
      >>> plan.work_request.tolist(), plan.work_q_start.tolist(), plan.work_q_len.tolist()
      ([0, 2, 2], [0, 16, 1], [1, 5, 15])
      >>> plan.work_causal_base.tolist(), plan.work_page_end.tolist(), plan.write_final
      ([36, 28, 13], [3, 5, 5], True)
      >>> split = plan_ragged([0, 1], [0, 3], [4], page_size=16, group_size=4, max_pages_per_item=2)
      >>> split.work_page_start.tolist(), split.work_causal_base.tolist(), split.write_final
      ([0, 2], [36, 4], False)
    """
    if not 1 <= group_size <= 8:
        raise ValueError(f"group_size must be 1 to 8, got {group_size}")
    if max_pages_per_item is not None and max_pages_per_item < 1:
        raise ValueError(f"max_pages_per_item must be >= 1 or None, got {max_pages_per_item}")
    qo_indptr = np.asarray(qo_indptr, np.int64)
    page_indptr = np.asarray(page_indptr, np.int64)
    last_page_len = np.asarray(last_page_len, np.int64)
    # A token before qo_indptr[0] or under a decreasing step would be in no tile: left
    # unwritten by the kernel, garbage with no error. (paged.ragged_attention's checks, for
    # the plan's raw arrays.)
    if qo_indptr.ndim != 1 or qo_indptr.shape[0] < 1:
        raise ValueError(f"qo_indptr must be 1-D with B + 1 >= 1 entries, got {qo_indptr.shape}")
    if qo_indptr[0] != 0:
        raise ValueError(f"qo_indptr must start at 0, got qo_indptr[0]={qo_indptr[0]}")
    if np.any(np.diff(qo_indptr) < 0):
        b = int(np.argmax(np.diff(qo_indptr) < 0))
        raise ValueError(
            f"qo_indptr must be non-decreasing, but qo_indptr[{b}]={qo_indptr[b]} > "
            f"qo_indptr[{b + 1}]={qo_indptr[b + 1]}"
        )
    batch = qo_indptr.shape[0] - 1
    if page_indptr.shape != (batch + 1,) or last_page_len.shape != (batch,):
        raise ValueError(
            f"qo_indptr has {batch + 1} entries but page_indptr has {page_indptr.shape} and "
            f"last_page_len {last_page_len.shape}: they must describe the same {batch} requests"
        )
    pages = np.diff(page_indptr)
    seq_lens = np.where(pages > 0, (pages - 1) * page_size + last_page_len, 0)
    tiles = []  # (keys, request, first token, tokens, keys its first token sees)
    for b in range(batch):
        first, stop = int(qo_indptr[b]), int(qo_indptr[b + 1])
        if stop - first > seq_lens[b]:
            raise ValueError(
                f"request {b} has {stop - first} new tokens but seq_len {seq_lens[b]}: the "
                "table must already hold them"
            )
        prefix = int(seq_lens[b]) - (stop - first)  # keys before the new tokens
        token = first
        while token < stop:
            offset = (token * group_size) % TMA_TILE_ROWS
            q_len = min(stop - token, (TILE_ROWS - offset) // group_size)
            causal_base = prefix + (token - first) + 1
            tiles.append((causal_base + q_len - 1, b, token, q_len, causal_base))
            token += q_len
    tiles.sort(key=lambda tile: -tile[0])  # stable: equal key counts keep token order
    items, merge_indptr = [], [0]
    token_tile = np.zeros(int(qo_indptr[-1]), np.int32)
    for index, (num_keys, b, token, q_len, causal_base) in enumerate(tiles):
        token_tile[token : token + q_len] = index
        num_pages = -(-num_keys // page_size)
        step = num_pages if max_pages_per_item is None else max_pages_per_item
        for first_page in range(0, num_pages, step):
            end_page = min(first_page + step, num_pages)
            last = num_keys - (num_pages - 1) * page_size if end_page == num_pages else page_size
            items.append(
                (
                    b,
                    token,
                    q_len,
                    causal_base - first_page * page_size,
                    int(page_indptr[b]) + first_page,
                    int(page_indptr[b]) + end_page,
                    last,
                )
            )
        merge_indptr.append(len(items))
    count = len(items) if num_work_items is None else num_work_items
    if count < len(items):
        raise ValueError(f"num_work_items={num_work_items} is below the {len(items)} items needed")
    columns = np.zeros((7, count), np.int32)
    columns[0] = -1  # padding items: no request
    if items:
        columns[:, : len(items)] = np.asarray(items, np.int64).T
    return RaggedPlan(*columns, np.asarray(merge_indptr, np.int32), token_tile)


def ragged_mgpu_kernel(
    work_request_ref,  # [W] int32, GMEM; outside [0, B) = padding
    work_q_start_ref,  # [W] int32, GMEM
    work_q_len_ref,  # [W] int32, GMEM
    work_causal_base_ref,  # [W] int32, GMEM
    work_page_start_ref,  # [W] int32, GMEM, offset into page_indices
    work_page_end_ref,  # [W] int32, GMEM
    work_last_page_len_ref,  # [W] int32, GMEM
    page_indices_ref,  # [num_indices] int32, GMEM
    q_ref,  # [KVH * T_pad * G, D], GMEM, rows (KV head, token, g)
    k_pages_ref,  # [num_pages, KVH, page_size, D], GMEM
    v_pages_ref,  # [num_pages, KVH, page_size, D], GMEM
    # Outputs, final (write_final: q's rows, the LSE only with write_lse) or an item's partial
    # state, all 64 tile rows (the merge reads rows row_offset .. of its tile):
    o_ref,  # [KVH * T_pad * G, D] q.dtype | [W * KVH * 64, D] float32, GMEM
    lse_ref,  # [KVH * T_pad * G] | [W * KVH * 64] float32, GMEM
    *,
    batch: int,
    write_final: bool,
    group_size: int,
    padded_tokens: int,
    pages_per_step: int,
    num_stages: int,
    index_window: int,
    logit_scale_log2: float,
    logits_soft_cap: float | None,
    sm_scale: float,
    write_lse: bool,
    probs_in_smem: bool,
):
    work = lax.axis_index("work")
    kv_head = lax.axis_index("kv_head")
    num_pages, _, page_size, head_dim = k_pages_ref.shape
    num_indices = page_indices_ref.shape[0]
    dtype = k_pages_ref.dtype
    steps_per_window = index_window // pages_per_step

    request = work_request_ref[work]
    # Anything outside the batch (-1 wraps up) is padding; so is a tile starting outside q.
    q_start = work_q_start_ref[work]
    is_padding = (request.astype(jnp.uint32) >= batch) | (
        q_start.astype(jnp.uint32) >= padded_tokens
    )
    q_start = jnp.where(is_padding, 0, q_start)
    head_first_row = (kv_head * padded_tokens + q_start) * group_size
    row_offset = lax.rem(head_first_row, TMA_TILE_ROWS)
    # The tile's real rows, cut to what fits the 64-row tile from its offset (a bad plan gives
    # wrong rows, never a store outside the tile or past the head's tokens).
    q_len = jnp.clip(work_q_len_ref[work], 0, padded_tokens - q_start)
    query_rows = jnp.where(is_padding, 0, jnp.minimum(q_len * group_size, TILE_ROWS - row_offset))
    page_start = unsigned_min(work_page_start_ref[work], num_indices)
    page_end = unsigned_min(work_page_end_ref[work], num_indices)
    num_item_pages = jnp.maximum(page_end - page_start, 0)
    num_keys = jnp.where(
        num_item_pages > 0, (num_item_pages - 1) * page_size + work_last_page_len_ref[work], 0
    )
    num_windows = pl.cdiv(num_item_pages, index_window)
    # Windows copied from a 16-byte aligned start (index_windows.py): the item's pages begin
    # at entry `index_shift` of each window's buffer.
    index_start, index_shift = aligned_window_start(page_start)
    causal = dict(base=work_causal_base_ref[work], row_offset=row_offset, group_size=group_size)

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
        # 64 rows from the 8-row boundary at or before the tile's first row: the tile's rows
        # are row_offset .. row_offset + query_rows - 1, the others are neighbours' (or past
        # q's end, zero-filled), computed and never stored.
        plgpu.copy_gmem_to_smem(
            q_ref.at[pl.ds(pl.multiple_of(head_first_row - row_offset, 8), TILE_ROWS)],
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
                (step,) = indices
                first_key = ((window * steps_per_window + step) * pages_per_step) * page_size
                return _attend_step(
                    state,
                    q_smem,
                    probs_smem,
                    slots[:pages_per_step],
                    slots[pages_per_step:],
                    first_key=first_key,
                    num_tokens=num_keys,
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

    # online_softmax.finish in the WGMMA layouts: a row that saw no key gets o = 0, lse = -inf.
    nonempty = running_sum > 0
    out = acc / _row_broadcast(jnp.where(nonempty, running_sum, 1.0), acc.shape)
    lse = jnp.where(nonempty, (running_max + jnp.log2(running_sum)) * LN_2, -jnp.inf)

    def write(o_smem, lse_smem):
        o_smem[...] = out.astype(o_ref.dtype)
        lse_smem[...] = lse
        plgpu.commit_smem()
        if not write_final:
            # The item's own 64-row block: one static copy each, 256-byte aligned.
            first_out = (work * k_pages_ref.shape[1] + kv_head) * TILE_ROWS

            @pl.when(jnp.logical_not(is_padding))
            def _():
                plgpu.copy_smem_to_gmem(o_smem, o_ref.at[pl.ds(first_out, TILE_ROWS)])
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[pl.ds(first_out, TILE_ROWS)])

            plgpu.wait_smem_to_gmem(0)
            return
        # query_rows = sum of its binary digits: one static-sized copy a digit, the larger
        # first; the rows before a digit's copy are the count's higher digits.
        for chunk in STORE_CHUNKS:
            done = lax.bitwise_and(query_rows, jnp.int32(-2 * chunk))

            @pl.when(lax.bitwise_and(query_rows, jnp.int32(chunk)) != 0)
            def _(chunk=chunk, done=done):
                plgpu.copy_smem_to_gmem(
                    o_smem.at[pl.ds(row_offset + done, chunk)],
                    o_ref.at[pl.ds(head_first_row + done, chunk)],
                )

        if write_lse:
            # Scalars: a TMA row must be a multiple of 16 bytes (4 float32) and start aligned.
            for row in range(TILE_ROWS):

                @pl.when(row < query_rows)
                def _(row=row):
                    lse_ref[head_first_row + row] = lse_smem[row_offset + row]

        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        write,
        plgpu.SMEM((TILE_ROWS, head_dim), o_ref.dtype),
        plgpu.SMEM((TILE_ROWS,), jnp.float32),
    )


def padded_token_count(num_tokens: int) -> int:
    """``T`` rounded up to a multiple of 8: the head-major copy of ``q`` holds this many tokens a
    KV head, so every head's rows start on an 8-row boundary and a tile's offset does not
    depend on its KV head."""
    return -(-num_tokens // TMA_TILE_ROWS) * TMA_TILE_ROWS


@_runs_in_32_bits_also_interpreted  # x64 mode: kernels_pallas/x64.py
@functools.partial(
    jax.jit,
    static_argnames=(
        "batch",
        "sm_scale",
        "logits_soft_cap",
        "pages_per_step",
        "num_stages",
        "index_window",
        "probs_in_smem",
        "return_lse",
        "write_final",
        "interpret",
    ),
)
def ragged_attention_mgpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_indices: jax.Array,
    work_request: jax.Array,
    work_q_start: jax.Array,
    work_q_len: jax.Array,
    work_causal_base: jax.Array,
    work_page_start: jax.Array,
    work_page_end: jax.Array,
    work_last_page_len: jax.Array,
    *,
    batch: int,
    sm_scale: float,
    logits_soft_cap: float | None = None,
    pages_per_step: int = 1,
    num_stages: int = 4,
    index_window: int | None = None,
    probs_in_smem: bool = False,
    return_lse: bool = False,
    write_final: bool = True,
    interpret: bool | plgpu.InterpretGPUParams = False,
):
    """One launch of ragged paged attention over a ``RaggedPlan``'s work items (HND layout).

    ``run_ragged_plan`` runs a whole plan (and the merge of a split one); this is the kernel.

    Args:
      q: ``[T, H, D]`` bfloat16 or float16, every new token of the step packed request by
        request (``paged/ragged_attention.py``); ``D`` 64 or 128, ``G = H / KVH`` 1 to 8.
      k_pages, v_pages: ``[num_pages, KVH, page_size, D]`` (HND) in q's dtype; ``page_size`` 16.
      page_indices: int32 ``[num_indices]``, the table's.
      work_*: int32 ``[W]``, the fields of ``plan_ragged``'s ``RaggedPlan`` in order. Invalid
        values give wrong results, never an access outside an array.
      batch: the step's ``B`` requests (static): items whose request is outside ``[0, B)`` are
        padding.
      sm_scale, logits_soft_cap: as in ``paged.decode_attention``.
      pages_per_step, num_stages, index_window: the page pipeline's shape, as in
        ``paged_decode_mgpu``.
      probs_in_smem: ``p @ V`` from shared memory (interpretable) or registers (compiled only).
      return_lse: also write the natural-log LSE (final output only).
      write_final: write the output (every tile one item); False writes each item's partial
        state for ``merge_partial_states`` (a split plan).
      interpret: Mosaic GPU's interpret mode (CPU); needs ``probs_in_smem=True``.

    Returns:
      ``o [T, H, D]`` in q's dtype, and ``lse [T, H]`` float32 with ``return_lse``; a token no
      item covers is left unwritten (``plan_ragged`` covers each once). With
      ``write_final=False``, partial states ``(o [W, KVH, 64, D], lse [W, KVH, 64])`` float32,
      all 64 rows of each item's tile (a padding item's left unwritten).

    Raises:
      ValueError: for shapes, dtypes or static parameters the kernel does not take, and work
        lists of different lengths (naming the value).
    """
    index_window = resolve_index_window(index_window, pages_per_step)
    validate_mgpu_decode_arguments(
        q, k_pages, v_pages, pages_per_step, num_stages, index_window, probs_in_smem, interpret
    )
    work = (
        work_request,
        work_q_start,
        work_q_len,
        work_causal_base,
        work_page_start,
        work_page_end,
        work_last_page_len,
    )
    if len({w.shape for w in work}) != 1 or work_request.ndim != 1:
        raise ValueError(
            f"the work lists must be 1-D of one length, got shapes {[w.shape for w in work]}"
        )
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[1]
    group_size = num_q_heads // num_kv_heads
    padded_tokens = padded_token_count(num_tokens)
    num_work = work_request.shape[0]
    total_rows = num_kv_heads * padded_tokens * group_size
    if write_final:
        out_type = (
            jax.ShapeDtypeStruct((total_rows, head_dim), q.dtype),
            jax.ShapeDtypeStruct((total_rows,), jnp.float32),
        )
    else:
        partial_count = num_work * num_kv_heads * TILE_ROWS
        out_type = (
            jax.ShapeDtypeStruct((partial_count, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((partial_count,), jnp.float32),
        )
    if not write_final and (num_work == 0 or num_tokens == 0):
        return (
            jnp.zeros((num_work, num_kv_heads, TILE_ROWS, head_dim), jnp.float32),
            jnp.full((num_work, num_kv_heads, TILE_ROWS), -jnp.inf, jnp.float32),
        )
    if num_work == 0 or num_tokens == 0:
        o = jnp.zeros(q.shape, q.dtype)
        lse = jnp.full(q.shape[:-1], -jnp.inf, jnp.float32)
        return (o, lse) if return_lse else o
    # Rows (KV head, token, g): one copy of q, transposed, each head's tokens padded to T_pad.
    q_rows = jnp.pad(q, ((0, padded_tokens - num_tokens), (0, 0), (0, 0)))
    q_rows = q_rows.reshape(padded_tokens, num_kv_heads, group_size, head_dim)
    q_rows = q_rows.transpose(1, 0, 2, 3).reshape(total_rows, head_dim)
    kernel = functools.partial(
        ragged_mgpu_kernel,
        batch=batch,
        write_final=write_final,
        group_size=group_size,
        padded_tokens=padded_tokens,
        pages_per_step=pages_per_step,
        num_stages=num_stages,
        index_window=index_window,
        logit_scale_log2=sm_scale * LOG2_E,
        logits_soft_cap=logits_soft_cap,
        sm_scale=sm_scale,
        write_lse=return_lse and write_final,
        probs_in_smem=probs_in_smem,
    )
    o_rows, lse_rows = plgpu.kernel(
        kernel,
        out_type=out_type,
        # Work items on the last grid axis (CUDA's x, up to 2^31 - 1 blocks), as the decode
        # kernel's.
        grid=(num_kv_heads, num_work),
        grid_names=("kv_head", "work"),
        interpret=_interpret_params(interpret),
        kernel_name=f"ragged_attention_mgpu_p{pages_per_step}_s{num_stages}"
        + ("_psmem" if probs_in_smem else "_preg")
        + ("_lse" if return_lse and write_final else "")
        + ("" if write_final else "_partial"),
    )(*work, pad_page_indices(page_indices, index_window), q_rows, k_pages, v_pages)
    if not write_final:
        return (
            o_rows.reshape(num_work, num_kv_heads, TILE_ROWS, head_dim),
            lse_rows.reshape(num_work, num_kv_heads, TILE_ROWS),
        )

    def token_order(rows, *trailing):
        rows = rows.reshape(num_kv_heads, padded_tokens, group_size, *trailing)
        rows = jnp.moveaxis(rows, 0, 1)[:num_tokens]
        return rows.reshape(num_tokens, num_q_heads, *trailing)

    o = token_order(o_rows, head_dim)
    return (o, token_order(lse_rows)) if return_lse else o


def run_ragged_plan(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_indices: jax.Array,
    plan: RaggedPlan,
    *,
    batch: int,
    write_final: bool,
    sm_scale: float,
    logits_soft_cap: float | None = None,
    return_lse: bool = False,
    interpret: bool | plgpu.InterpretGPUParams = False,
    **launch,
):
    """A whole ragged step over a plan: the kernel, and for a split plan the merge.

    Unsplit (``write_final``): one launch writes ``o``. Split: the kernel writes each item's
    partial state, ``merge_partial_states`` merges each tile's items (its 64 rows a KV head as
    ``64 x KVH`` "heads"), and a gather puts the tiles' real rows back in token order.

    Args:
      q, k_pages, v_pages, page_indices, batch, sm_scale, logits_soft_cap, return_lse,
        interpret, launch: as ``ragged_attention_mgpu`` (``launch``: ``pages_per_step``,
        ``num_stages``, ``index_window``, ``probs_in_smem``).
      plan: ``plan_ragged``'s plan, as NumPy or device arrays (traced under ``jit``).
      write_final: ``plan.write_final``, read on the host when the plan was made (static).

    Returns:
      ``o [T, H, D]`` in q's dtype, and ``lse [T, H]`` float32 with ``return_lse``.

    Raises:
      ValueError: ``write_final=True`` for a concrete plan that splits a tile (each item
        would write its own page range's state as the final output: wrong rows, silently).
    """
    merge_indptr = plan.merge_indptr
    if write_final and is_concrete(merge_indptr):
        tile_items = np.diff(np.asarray(merge_indptr))
        if np.any(tile_items != 1):
            raise ValueError(
                f"write_final=True but the plan splits tile {int(np.argmax(tile_items != 1))} "
                f"into {int(tile_items[tile_items != 1][0])} items: pass "
                "write_final=plan.write_final (False), so that their states are merged"
            )
    work = [jnp.asarray(a) for a in plan.work_arrays]
    common = dict(batch=batch, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap)
    if write_final:
        return ragged_attention_mgpu(
            q,
            k_pages,
            v_pages,
            page_indices,
            *work,
            **common,
            return_lse=return_lse,
            interpret=interpret,
            **launch,
        )
    partial_o, partial_lse = ragged_attention_mgpu(
        q,
        k_pages,
        v_pages,
        page_indices,
        *work,
        **common,
        write_final=False,
        interpret=interpret,
        **launch,
    )
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[1]
    group_size = num_q_heads // num_kv_heads
    merge_indptr = jnp.asarray(plan.merge_indptr)
    o_tiles, lse_tiles = merge_partial_states(
        partial_o,
        partial_lse,
        merge_indptr,
        num_q_heads=num_kv_heads * TILE_ROWS,
        out_dtype=q.dtype,
        interpret=bool(interpret),
    )  # [num_tiles, KVH * 64, ...]: tile j's rows, KV head major
    # Token t of tile j, head (kv, g): row (j * KVH + kv) * 64 + offset_j + (t - start_j) G + g.
    tile = jnp.asarray(plan.token_tile)
    tile_start = work[1][merge_indptr[tile]]
    tile_row = (
        lax.rem(tile_start * group_size, TMA_TILE_ROWS)
        + (jnp.arange(num_tokens, dtype=jnp.int32) - tile_start) * group_size
    )
    kv = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :, None]
    g = jnp.arange(group_size, dtype=jnp.int32)[None, None, :]
    rows = (tile[:, None, None] * num_kv_heads + kv) * TILE_ROWS + tile_row[:, None, None] + g
    rows = rows.reshape(num_tokens, num_q_heads)
    o = o_tiles.reshape(-1, head_dim)[rows]
    if return_lse:
        return o, lse_tiles.reshape(-1)[rows]
    return o
