"""Cascade attention's shared level on Mosaic GPU: a group's prefix pages read once for every 64
query rows of its requests (16 requests at G = 4), not once a request.

At a shared level (``paged/cascade.py``) every request of a group attends to the same pages, and
every one of its new tokens sees all of them (the prefix precedes the new tokens), so no mask
separates the requests: for one KV head, the ``G`` query heads x ``L`` new tokens x ``m``
requests of a group are ``m x L x G`` query rows of ONE attention problem over the group's keys.
Plain decode reads the prefix once per request with ``L x G`` rows (4 of the 64-row tensor-core
tile at ``G = 4``, ``L = 1``); here the rows of 16 requests fill a tile, and the prefix is read
once a tile instead of once a request.

The kernel IS the Mosaic GPU decode kernel (``kernels_pallas/paged_decode_mgpu.py``): its body
``paged_decode_mgpu_kernel`` is launched unchanged, with the query tiles of this level posing as
its "requests" of 64 query rows each (``q_len = 1``, a "group size" of 64: no causal mask, the
tile's rows are rows ``0 .. 63``, so nothing is padded inside a tile but the tail of a group's
last tile). Everything else is the decode kernel's: the pages by TMA through its ring (a step's
pages side by side in one shared-memory slot, one ``q @ K^T`` and one ``p @ V`` WGMMA a step,
index windows fetched ahead) or ``emit_pipeline``, its online softmax in base 2 with masked
tails and zeroed unused V rows, its clamps (a page number past the pool reads the pool's last
page; a range past ``page_indices`` is cut), and its partial states (normalized ``o`` float32
and natural-log LSE, ``[work, KVH, 64, D]``).

What this file adds, all plain JAX around the launch:

- the tiles: group ``g`` with ``m_g`` requests has ``ceil(m_g x L x G / 64)`` tiles; tile rows
  are the group's requests in ``group_requests`` order, each request's ``L x G`` rows token-major
  (row ``(l, g)`` of KV head ``h`` is query head ``h x G + g`` of token ``l``), zero rows after
  the group's last request (their results are never read);
- the work items: each tile's range of group pages cut into ``num_splits`` chunks (a multiple
  of ``pages_per_step`` pages each) when the tiles alone are too few to fill the 132 SMs
  (``choose_num_splits``), ordered tile-major; a tile's chunk states are then merged exactly
  by ``paged.merge_states`` (``proofs/merge_states.md``), which XLA fuses into one pass over
  the partials (the Triton ``merge_partial_states`` would fold them too, item-ordered, but
  cannot be lowered without a GPU, and its 64-row partials are large for its registers);
- the gather back: request ``b``'s ``L x H`` rows from its group's tiles, as ``(o [B, L, H, D]
  float32, lse [B, L, H])``, the return of ``paged.cascade.shared_level_state_reference``, so the
  state merges with the request's own level (``paged.merge_states``) exactly; a request in no
  group gets ``o = 0``, ``lse = -inf``.

What it optimizes, and how far from the floor it should be (estimates, not yet measured; the
H200 at 4.8 TB/s and 989 TFLOP/s dense bfloat16). Per prefix token and KV head a level reads
``2 x D x 2`` bytes of K and V and computes ``4 x D`` flops for each of its ``m x L x G``
query rows (``q @ K^T`` and ``p @ V``), so its arithmetic intensity is ``m x L x G`` flops a
byte: 512 at the issue's ``m = 128``, ``G = 4``, above the H200's ridge (about 206). The floor
is then the tensor cores, not the bandwidth: at (128 requests, 32K prefix, 32/8 heads of 128)
the prefix is 134 MB (28 us read once) and 6.9e10 flops (70 us at peak); at (32, 4K) 17 MB
(3.5 us) and 2.1e9 flops (2 us), where the launches (this kernel, the merge, the gather, the
own level's decode) cost more than either. This kernel is above the floor in two ways:

- it reads the prefix once a 64-row TILE, not once a group: ``T = ceil(m x L x G / 64)``
  times (2, 4 and 8 at ``m`` = 32, 64, 128 and ``G = 4``, ``L = 1``), against ``m`` times for
  plain decode (16x fewer). A group's tiles and chunks are neighbouring work items, and a
  launch of at most ``programs_per_sm x 132`` programs runs in one wave, so a group's tiles
  stream the same pages at about the same time and the repeats may hit L2 (60 MB); nothing
  synchronizes them, so a prefix larger than L2 (32K tokens: 134 MB) may come from HBM up to
  ``T`` times (8 x 28 us at (128, 32K)). Reading it once a group outright needs one program
  holding several tiles against one slot of pages (more warpgroups), which the decode
  kernel's body does not do;
- one warpgroup a program runs its softmax between its two WGMMAs, serially, so the tensor
  cores idle part of each step (FlashAttention-3 overlaps two warpgroups' softmax and WGMMAs
  to reach about 75% of an H100's peak); at large groups, where the floor is compute, expect
  a few times the 70 us.

The own level (each request's suffix, through plain decode) is not this kernel's: 128
requests x 256 tokens is another 134 MB, so at (128, 32K) a cascade step's floor is about
twice the prefix's.

Costs this layout accepts: a group's last tile is partly empty (a group of one request at
``G = 4`` computes 64 rows for 4, as plain decode does); the query tiles are a gathered copy of
``q`` (``T x KVH x 64 x D``, small next to the prefix); and the merge of the splits and the
gather back are separate small launches.

Interpret mode runs what the decode kernel's interpreter runs: the ``probs_in_smem=True`` path;
the register path is compiled only (``tests/test_cascade_shared_mgpu.py`` lowers it for CUDA).

From ``kernels_pallas/paged_decode_mgpu.py`` this file uses the kernel's launch
(``launch_paged_decode_mgpu_kernel``: the kernel body over a (KV head, work item) grid), the
checks of its pipeline parameters (``validate_mgpu_pipeline_arguments``, which also sizes its
shared memory), its constants, and one private helper, ``_runs_in_32_bits_also_interpreted``
(the x64 wrapper that also works interpreted). A change to any of them changes this kernel
too.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.index_windows import resolve_index_window
from kernels_pallas.paged_decode_mgpu import (
    PAGE_SIZE,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    TILE_ROWS,
    _runs_in_32_bits_also_interpreted,
    launch_paged_decode_mgpu_kernel,
    programs_per_sm,
    validate_mgpu_pipeline_arguments,
)
from kernels_pallas.paged_decode_tuning import H200_NUM_SMS
from kernels_pallas.platform import is_concrete
from paged.attention_reference import merge_states
from paged.cascade import CascadeLevels, SharedLevel, validate_cascade_levels
from paged.decode import _static_float
from paged.kv_cache import KVCache
from paged.page_table import PageTable

# A chunk of a split prefix holds at least this many pages (256 tokens): below it a program's
# prologue and epilogue (query tile, 64 scalar LSE stores, the merge's extra partial) outweigh
# its stream.
MIN_CHUNK_PAGES = 16
MAX_SPLITS = 64
# A program's fixed cost (query tile, pipeline fill, 64 LSE stores, one more partial to merge)
# in pages streamed: an estimate, not measured; it keeps the split from adding waves for a few
# pages less a chunk.
PROGRAM_OVERHEAD_PAGES = 4


def num_query_tiles(group_indptr: np.ndarray, rows_per_request: int) -> int:
    """Tiles of 64 query rows a level needs (one KV head): ``sum_g ceil(m_g x L x G / 64)``.

    Example:
      >>> num_query_tiles(np.array([0, 1, 17, 49]), rows_per_request=4)  # groups of 1, 16, 32
      4
    """
    members = np.maximum(np.diff(np.asarray(group_indptr)), 0)
    return int(np.sum(-(-members * rows_per_request // TILE_ROWS)))


def choose_num_splits(
    num_tiles: int, num_kv_heads: int, max_group_pages: int, *, programs_per_wave: int
) -> int:
    """Chunks to cut each tile's prefix into, so that the launch fills the GPU.

    ``num_tiles x num_kv_heads x s`` programs take ``ceil(programs / programs_per_wave)`` waves,
    each as long as a chunk (``ceil(max_group_pages / s)`` pages) plus a program's fixed cost
    (``PROGRAM_OVERHEAD_PAGES``, a guess until measured); the ``s`` of the shortest estimate is
    chosen, the smallest on a tie, with chunks of at least ``MIN_CHUNK_PAGES`` pages.

    Example:
      >>> choose_num_splits(2, 8, 256, programs_per_wave=132)  # B=32, G=4: 16 programs
      8
      >>> choose_num_splits(8, 8, 2048, programs_per_wave=132)  # B=128: 64 programs
      2
      >>> choose_num_splits(2, 8, 20, programs_per_wave=132)  # a short prefix is not cut
      1
    """
    base = max(num_tiles * num_kv_heads, 1)
    most = max(1, min(MAX_SPLITS, max_group_pages // MIN_CHUNK_PAGES))

    def estimate(splits):
        waves = -(-base * splits // programs_per_wave)
        return waves * (-(-max_group_pages // splits) + PROGRAM_OVERHEAD_PAGES)

    return min(range(1, most + 1), key=estimate)


def _cdiv(a, b):
    return -(-a // b)


def _tile_rows(group_indptr, group_requests, *, batch, rows_per_request, num_tiles):
    """Which query row every tile row is, and where every request's rows landed.

    Returns ``tile_group int32[T]`` (``num_groups`` for a tile past the level's), ``tile_start
    int32[num_groups]`` (each group's first tile), ``row_request int32[T, 64]`` (-1 for an
    empty row), ``row_within int32[T, 64]`` (the row's place among its request's ``L x G``),
    ``request_group int32[B]`` (-1 for none) and ``request_member int32[B]`` (its place in its
    group)."""
    num_groups = group_indptr.shape[0] - 1
    num_members = group_requests.shape[0]
    members = jnp.maximum(group_indptr[1:] - group_indptr[:-1], 0)  # [NG]
    tiles_per_group = -(-members * rows_per_request // TILE_ROWS)
    tile_end = jnp.cumsum(tiles_per_group)
    tile_start = tile_end - tiles_per_group
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    tile_group = jnp.searchsorted(tile_end, tile, side="right").astype(jnp.int32)
    safe_group = jnp.minimum(tile_group, num_groups - 1)
    flat = (tile - tile_start[safe_group])[:, None] * TILE_ROWS + jnp.arange(TILE_ROWS)[None, :]
    member = flat // rows_per_request
    slot = jnp.clip(group_indptr[safe_group][:, None] + member, 0, num_members - 1)
    request = group_requests[slot]
    real = (
        (tile_group < num_groups)[:, None]
        & (member < members[safe_group][:, None])
        & (request >= 0)
        & (request < batch)
    )
    row_request = jnp.where(real, request, -1)

    # Each request's group and place in it, by the same rule as SharedLevel.request_groups
    # (padding and members outside the batch dropped); a request listed twice (unchecked under
    # jit) keeps one position, and its group is that position's, so the two always agree.
    position = jnp.arange(num_members, dtype=jnp.int32)
    listed = (position < group_indptr[-1]) & (group_requests >= 0) & (group_requests < batch)
    target = jnp.where(listed, group_requests, batch)
    request_position = jnp.full((batch,), -1, jnp.int32).at[target].set(position, mode="drop")
    request_group = (jnp.searchsorted(group_indptr, request_position, side="right") - 1).astype(
        jnp.int32
    )
    request_group = jnp.where(request_position >= 0, jnp.clip(request_group, 0, num_groups - 1), -1)
    request_member = request_position - group_indptr[jnp.maximum(request_group, 0)]
    return (
        tile_group,
        tile_start,
        row_request,
        flat % rows_per_request,
        request_group,
        request_member,
    )


def _work_items(page_indptr, last_page_len, tile_group, *, num_splits, pages_per_step, page_size):
    """Tile-major work items ``(request, page_start, page_end, last_page_len) int32[T x S]``:
    tile ``t``'s chunk ``c`` of its group's pages; chunks past the group's end are empty, tiles
    past the level's are padding (request -1, no pages)."""
    num_groups = page_indptr.shape[0] - 1
    num_tiles = tile_group.shape[0]
    real_tile = tile_group < num_groups
    group = jnp.minimum(tile_group, num_groups - 1)
    group_first = page_indptr[group]
    group_pages = jnp.where(real_tile, jnp.maximum(page_indptr[group + 1] - group_first, 0), 0)
    group_end = group_first + group_pages
    # Each chunk a whole number of steps: only a group's last chunk ends inside a step.
    steps_per_chunk = _cdiv(_cdiv(group_pages, num_splits), pages_per_step)
    chunk = steps_per_chunk * pages_per_step  # [T] pages a chunk
    start = group_first[:, None] + jnp.arange(num_splits)[None, :] * chunk[:, None]
    start = jnp.minimum(start, group_end[:, None])
    end = jnp.minimum(start + chunk[:, None], group_end[:, None])
    last = jnp.where(end == group_end[:, None], last_page_len[group][:, None], page_size)
    request = jnp.where(real_tile, jnp.arange(num_tiles), -1)[:, None]
    request = jnp.broadcast_to(request, start.shape)
    return tuple(x.reshape(-1).astype(jnp.int32) for x in (request, start, end, last))


@dataclasses.dataclass(frozen=True)
class SharedLevelPlan:
    """One shared level's query-tile layout and work items, computed on the host with NumPy
    (``plan_shared_level``) once a step, so the kernel call skips the dozens of small device
    ops of ``_tile_rows`` and ``_work_items`` (a GPU pays ~1 us each).

    Data fields (int32 NumPy arrays, the returns of ``_tile_rows`` and ``_work_items``):
    ``tile_group [T]``, ``tile_start [NG]``, ``row_request [T, 64]``, ``row_within [T, 64]``,
    ``request_group [B]``, ``request_member [B]``, ``work_request``, ``work_page_start``,
    ``work_page_end``, ``work_last_page_len`` (each ``[T x S]``); and the two gathers the
    call's wrapper would otherwise index on the device: ``query_rows [T x KVH x 64]``, the row
    of ``queries.reshape(B x L x H, D)`` each tile row holds (-1: an empty row), and
    ``state_rows [B x L x H]``, the tile row (of ``[T x KVH x 64]``) holding each query row's
    state (-1: a request in no group). Meta fields (static):
    ``batch``, ``rows_per_request``, ``num_tiles`` (T), ``num_splits`` (S), ``pages_per_step``.
    """

    tile_group: np.ndarray
    tile_start: np.ndarray
    row_request: np.ndarray
    row_within: np.ndarray
    request_group: np.ndarray
    request_member: np.ndarray
    work_request: np.ndarray
    work_page_start: np.ndarray
    work_page_end: np.ndarray
    work_last_page_len: np.ndarray
    query_rows: np.ndarray
    state_rows: np.ndarray
    batch: int
    rows_per_request: int
    num_tiles: int
    num_splits: int
    pages_per_step: int

    @property
    def tile_rows(self):
        return (
            self.tile_group,
            self.tile_start,
            self.row_request,
            self.row_within,
            self.request_group,
            self.request_member,
        )

    @property
    def work(self):
        return (
            self.work_request,
            self.work_page_start,
            self.work_page_end,
            self.work_last_page_len,
        )


jax.tree_util.register_dataclass(
    SharedLevelPlan,
    data_fields=[
        "tile_group",
        "tile_start",
        "row_request",
        "row_within",
        "request_group",
        "request_member",
        "work_request",
        "work_page_start",
        "work_page_end",
        "work_last_page_len",
        "query_rows",
        "state_rows",
    ],
    meta_fields=["batch", "rows_per_request", "num_tiles", "num_splits", "pages_per_step"],
)


def _tile_rows_host(group_indptr, group_requests, *, batch, rows_per_request, num_tiles):
    """``_tile_rows`` in NumPy on concrete arrays, op for op (same returns)."""
    group_indptr = np.asarray(group_indptr, np.int64)
    group_requests = np.asarray(group_requests, np.int64)
    num_groups = group_indptr.shape[0] - 1
    num_members = group_requests.shape[0]
    members = np.maximum(group_indptr[1:] - group_indptr[:-1], 0)
    tiles_per_group = -(-members * rows_per_request // TILE_ROWS)
    tile_end = np.cumsum(tiles_per_group)
    tile_start = tile_end - tiles_per_group
    tile = np.arange(num_tiles)
    tile_group = np.searchsorted(tile_end, tile, side="right")
    safe_group = np.minimum(tile_group, num_groups - 1)
    flat = (tile - tile_start[safe_group])[:, None] * TILE_ROWS + np.arange(TILE_ROWS)[None, :]
    member = flat // rows_per_request
    slot = np.clip(group_indptr[safe_group][:, None] + member, 0, num_members - 1)
    request = group_requests[slot]
    real = (
        (tile_group < num_groups)[:, None]
        & (member < members[safe_group][:, None])
        & (request >= 0)
        & (request < batch)
    )
    row_request = np.where(real, request, -1)
    position = np.arange(num_members)
    listed = (position < group_indptr[-1]) & (group_requests >= 0) & (group_requests < batch)
    request_position = np.full((batch,), -1, np.int64)
    request_position[group_requests[listed]] = position[listed]
    request_group = np.searchsorted(group_indptr, request_position, side="right") - 1
    request_group = np.where(request_position >= 0, np.clip(request_group, 0, num_groups - 1), -1)
    request_member = request_position - group_indptr[np.maximum(request_group, 0)]
    out = (tile_group, tile_start, row_request, flat % rows_per_request)
    return tuple(x.astype(np.int32) for x in (*out, request_group, request_member))


def _work_items_host(
    page_indptr, last_page_len, tile_group, *, num_splits, pages_per_step, page_size
):
    """``_work_items`` in NumPy on concrete arrays, op for op (same returns)."""
    page_indptr = np.asarray(page_indptr, np.int64)
    last_page_len = np.asarray(last_page_len, np.int64)
    num_groups = page_indptr.shape[0] - 1
    num_tiles = tile_group.shape[0]
    real_tile = tile_group < num_groups
    group = np.minimum(tile_group, num_groups - 1)
    group_first = page_indptr[group]
    group_pages = np.where(real_tile, np.maximum(page_indptr[group + 1] - group_first, 0), 0)
    group_end = group_first + group_pages
    steps_per_chunk = _cdiv(_cdiv(group_pages, num_splits), pages_per_step)
    chunk = steps_per_chunk * pages_per_step
    start = group_first[:, None] + np.arange(num_splits)[None, :] * chunk[:, None]
    start = np.minimum(start, group_end[:, None])
    end = np.minimum(start + chunk[:, None], group_end[:, None])
    last = np.where(end == group_end[:, None], last_page_len[group][:, None], page_size)
    request = np.broadcast_to(np.where(real_tile, np.arange(num_tiles), -1)[:, None], start.shape)
    return tuple(x.reshape(-1).astype(np.int32) for x in (request, start, end, last))


def _gather_rows_host(tile_rows, *, q_len, num_q_heads, num_kv_heads, num_tiles):
    """The query gather into tiles and the state gather back to the requests, as flat row
    indices (see ``SharedLevelPlan``), by the formulas of ``cascade_shared_mgpu``."""
    _, tile_start, row_request, row_within, request_group, request_member = tile_rows
    group_size = num_q_heads // num_kv_heads
    rows_per_request = q_len * group_size
    # Tile row (t, h, r): queries[row_request, within // G, h x G + within % G].
    token = (row_within // group_size)[:, None, :]
    head = (np.arange(num_kv_heads) * group_size)[None, :, None] + (row_within % group_size)[
        :, None, :
    ]
    request = row_request[:, None, :].astype(np.int64)
    query_rows = np.where(request >= 0, (request * q_len + token) * num_q_heads + head, -1)
    # Query row (b, l, h x G + g) of a grouped request: tile tile_start[group] + flat // 64,
    # row flat % 64 of KV head h, flat = member x L x G + l x G + g.
    batch = request_group.shape[0]
    within = np.arange(q_len)[:, None, None] * group_size + np.arange(group_size)[None, None, :]
    flat = np.maximum(request_member, 0)[:, None, None, None] * rows_per_request + within[None]
    tile = np.clip(
        tile_start[np.maximum(request_group, 0)][:, None, None, None] + flat // TILE_ROWS,
        0,
        num_tiles - 1,
    )
    kv_head = np.arange(num_kv_heads)[None, None, :, None]
    state_rows = (tile.astype(np.int64) * num_kv_heads + kv_head) * TILE_ROWS + flat % TILE_ROWS
    state_rows = np.where((request_group >= 0)[:, None, None, None], state_rows, -1)
    shape = (batch, q_len, num_q_heads)
    return query_rows.reshape(-1).astype(np.int32), state_rows.reshape(shape).reshape(-1).astype(
        np.int32
    )


def plan_shared_level(
    level,
    *,
    batch: int,
    q_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype=jnp.bfloat16,
    page_size: int = PAGE_SIZE,
    num_splits: int | None = None,
    pages_per_step: int = 4,
    num_stages: int = 3,
    index_window: int | None = None,
    probs_in_smem: bool = False,
    pipeline: str = "ring",
) -> SharedLevelPlan | None:
    """The host plan of one CONCRETE shared level for ``shared_level_states_mgpu(...,
    plan=...)``: the same tile count, split count (``choose_num_splits``), tile layout and
    work items the traced path computes on the device, computed once with NumPy.

    Args:
      level: a ``paged.cascade.SharedLevel`` with concrete (NumPy or committed) arrays.
      batch, q_len, num_q_heads, num_kv_heads, head_dim, dtype: the queries' and cache's shape.
      num_splits, pages_per_step, num_stages, index_window, probs_in_smem, pipeline: as
        ``shared_level_states_mgpu`` takes them (they fix the split count).

    Returns:
      A ``SharedLevelPlan``, or None for a level that attends to no key (no groups, members or
      pages: the states are constants, nothing to plan).

    Example:
      >>> import paged
      >>> from paged.cascade import SharedLevel
      >>> level = SharedLevel(
      ...     group_pages=paged.PageTable.from_page_lists([[1, 3]], [20], page_size=16),
      ...     group_indptr=np.array([0, 2], np.int32),
      ...     group_requests=np.array([0, 2], np.int32),
      ... )
      >>> plan = plan_shared_level(
      ...     level, batch=3, q_len=1, num_q_heads=4, num_kv_heads=2, head_dim=64
      ... )
      >>> plan.num_tiles, plan.num_splits, plan.request_group.tolist()
      (1, 1, [0, -1, 0])
    """
    if not isinstance(level, SharedLevel):
        raise TypeError(f"level must be a SharedLevel, got {type(level).__name__}")
    pages = level.group_pages
    if not is_concrete(level.group_indptr, level.group_requests, pages.page_indptr):
        raise ValueError("level must have concrete arrays to be planned on the host, got traced")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}"
        )
    rows_per_request = q_len * (num_q_heads // num_kv_heads)
    num_groups = level.num_groups
    num_members = level.group_requests.shape[0]
    if batch == 0 or num_groups == 0 or num_members == 0 or pages.page_indices.shape[0] == 0:
        return None
    num_tiles = num_query_tiles(np.asarray(level.group_indptr), rows_per_request)
    if num_tiles == 0:
        return None
    if num_splits is None:
        smem = validate_mgpu_pipeline_arguments(
            head_dim,
            dtype,
            pages_per_step=pages_per_step,
            num_stages=num_stages,
            index_window=resolve_index_window(index_window, pages_per_step),
            probs_in_smem=probs_in_smem,
            pipeline=pipeline,
            interpret=False,
        )
        max_group_pages = int(np.max(np.diff(np.asarray(pages.page_indptr)), initial=0))
        num_splits = choose_num_splits(
            num_tiles,
            num_kv_heads,
            max_group_pages,
            programs_per_wave=H200_NUM_SMS * max(programs_per_sm(smem), 1),
        )
    tile_rows = _tile_rows_host(
        level.group_indptr,
        level.group_requests,
        batch=batch,
        rows_per_request=rows_per_request,
        num_tiles=num_tiles,
    )
    work = _work_items_host(
        pages.page_indptr,
        pages.last_page_len,
        tile_rows[0],
        num_splits=num_splits,
        pages_per_step=pages_per_step,
        page_size=page_size,
    )
    gathers = _gather_rows_host(
        tile_rows,
        q_len=q_len,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        num_tiles=num_tiles,
    )
    return SharedLevelPlan(
        *tile_rows,
        *work,
        *gathers,
        batch=batch,
        rows_per_request=rows_per_request,
        num_tiles=num_tiles,
        num_splits=num_splits,
        pages_per_step=pages_per_step,
    )


@_runs_in_32_bits_also_interpreted  # x64 mode: as paged_decode_mgpu
@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "logits_soft_cap",
        "num_tiles",
        "num_splits",
        "pages_per_step",
        "num_stages",
        "index_window",
        "probs_in_smem",
        "pipeline",
        "interpret",
    ),
)
def cascade_shared_mgpu(
    queries: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    group_page_indptr: jax.Array,
    group_page_indices: jax.Array,
    group_last_page_len: jax.Array,
    group_indptr: jax.Array,
    group_requests: jax.Array,
    layout: tuple | None = None,
    *,
    sm_scale: float,
    logits_soft_cap: float | None,
    num_tiles: int,
    num_splits: int,
    pages_per_step: int = 4,
    num_stages: int = 3,
    index_window: int | None = None,
    probs_in_smem: bool = False,
    pipeline: str = "ring",
    interpret: bool | plgpu.InterpretGPUParams = False,
):
    """The shared level's states on raw arrays (HND pages); ``shared_level_states_mgpu`` is
    the checked entry that picks ``num_tiles`` and ``num_splits``.

    Args:
      queries: ``[B, L, H, D]`` bfloat16 or float16.
      k_pages, v_pages: ``[num_pages, KVH, 16, D]``.
      group_page_indptr, group_page_indices, group_last_page_len: the level's page table over
        groups (int32 ``[NG + 1]``, ``[num_indices]``, ``[NG]``).
      group_indptr, group_requests: int32 ``[NG + 1]`` and ``[num_members]``, each group's
        requests.
      num_tiles: static count of 64-row query tiles, at least ``num_query_tiles`` (tiles past
        the level's are padding items that store nothing read).
      num_splits: static chunks a tile's pages are cut into.
      layout: None (computed on the device) or ``(work, query_rows, state_rows)``, the same
        work items and row gathers computed on the host for these ``num_tiles`` and
        ``num_splits`` (``SharedLevelPlan.work``, ``.query_rows``, ``.state_rows``).
      The rest: as ``paged_decode_mgpu``.

    Returns:
      ``(o [B, L, H, D] float32, lse [B, L, H] float32)``.
    """
    index_window = resolve_index_window(index_window, pages_per_step)
    batch, q_len, num_q_heads, head_dim = queries.shape
    num_kv_heads = k_pages.shape[1]
    group_size = num_q_heads // num_kv_heads
    rows_per_request = q_len * group_size
    if layout is None:
        tile_rows = _tile_rows(
            group_indptr,
            group_requests,
            batch=batch,
            rows_per_request=rows_per_request,
            num_tiles=num_tiles,
        )
        tile_group, tile_start, row_request, row_within, request_group, request_member = tile_rows
        # q_tiles[t, h, r] = query head h * G + (within % G) of token within // G of the row's
        # request: the decode kernel's row order (request, KV head, rows), tiles as requests.
        token = row_within // group_size
        head = (jnp.arange(num_kv_heads) * group_size)[None, :, None] + (row_within % group_size)[
            :, None, :
        ]
        rows = queries[jnp.maximum(row_request, 0)[:, None, :], token[:, None, :], head]
        q_tiles = jnp.where((row_request >= 0)[:, None, :, None], rows, 0).astype(queries.dtype)
        work = _work_items(
            group_page_indptr,
            group_last_page_len,
            tile_group,
            num_splits=num_splits,
            pages_per_step=pages_per_step,
            page_size=k_pages.shape[2],
        )
    else:  # the same tiles and items, computed on the host (SharedLevelPlan)
        work, query_rows, state_rows = layout
        work = tuple(work)
        rows = queries.reshape(-1, head_dim)[jnp.maximum(query_rows, 0)]
        q_tiles = jnp.where((query_rows >= 0)[:, None], rows, 0).astype(queries.dtype)
    num_work = num_tiles * num_splits
    count = num_work * num_kv_heads * TILE_ROWS
    # Work items fastest on the grid (the launch's order): a group's tiles side by side.
    partial_o, partial_lse = launch_paged_decode_mgpu_kernel(
        work,
        group_page_indices,
        (),  # one "token" a tile: no causal table; merged below, not folded
        q_tiles.reshape(-1, head_dim),
        k_pages,
        v_pages,
        out_type=(
            jax.ShapeDtypeStruct((count, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((count,), jnp.float32),
        ),
        q_len=1,
        group_size=TILE_ROWS,  # a tile's 64 rows, one "token": no causal mask, no offset
        partial_block=TILE_ROWS,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        write_final=False,
        pages_per_step=pages_per_step,
        num_stages=num_stages,
        index_window=index_window,
        probs_in_smem=probs_in_smem,
        pipeline=pipeline,
        interpret=interpret,
        name="cascade_shared_mgpu",
    )
    partial_o = partial_o.reshape(num_work, num_kv_heads, TILE_ROWS, head_dim)
    partial_lse = partial_lse.reshape(num_work, num_kv_heads, TILE_ROWS)
    if num_splits == 1:
        tile_o, tile_lse = partial_o, partial_lse
    else:
        # A tile's chunks (adjacent, in key order) by the exact merge with the maximum
        # subtracted (paged.merge_states; XLA fuses it, one read of T x S x KVH x 64 x D
        # float32 partials, small next to the prefix).
        chunks = (num_tiles, num_splits, num_kv_heads * TILE_ROWS)
        tile_o, tile_lse = merge_states(
            partial_o.reshape(*chunks, head_dim), partial_lse.reshape(chunks)
        )
        tile_o = tile_o.reshape(num_tiles, num_kv_heads, TILE_ROWS, head_dim)
        tile_lse = tile_lse.reshape(num_tiles, num_kv_heads, TILE_ROWS)

    if layout is not None:
        in_group = state_rows >= 0
        o = tile_o.reshape(-1, head_dim)[jnp.maximum(state_rows, 0)]
        lse = tile_lse.reshape(-1)[jnp.maximum(state_rows, 0)]
        o = jnp.where(in_group[:, None], o, 0.0).reshape(queries.shape)
        lse = jnp.where(in_group, lse, -jnp.inf).reshape(queries.shape[:-1])
        return o.astype(jnp.float32), lse
    # Back to the requests: request b's row (l, g) of KV head h sits in tile tile_start[group]
    # + flat // 64, row flat % 64, flat = member x L x G + l x G + g.
    in_group = request_group >= 0
    flat = (
        jnp.maximum(request_member, 0)[:, None] * rows_per_request
        + jnp.arange(rows_per_request)[None, :]
    )
    tile = jnp.clip(
        tile_start[jnp.maximum(request_group, 0)][:, None] + flat // TILE_ROWS, 0, num_tiles - 1
    )
    kv_head = jnp.arange(num_kv_heads)[None, :, None]
    o = tile_o[tile[:, None, :], kv_head, (flat % TILE_ROWS)[:, None, :]]  # [B, KVH, L * G, D]
    lse = tile_lse[tile[:, None, :], kv_head, (flat % TILE_ROWS)[:, None, :]]
    o = o.reshape(batch, num_kv_heads, q_len, group_size, head_dim).transpose(0, 2, 1, 3, 4)
    lse = lse.reshape(batch, num_kv_heads, q_len, group_size).transpose(0, 2, 1, 3)
    o = jnp.where(in_group[:, None, None, None, None], o, 0.0)
    lse = jnp.where(in_group[:, None, None, None], lse, -jnp.inf)
    return o.reshape(queries.shape).astype(jnp.float32), lse.reshape(queries.shape[:-1])


def shared_level_states_mgpu(
    queries: jax.Array,
    cache,
    level,
    *,
    sm_scale: float,
    logits_soft_cap: float | None = None,
    num_splits: int | None = None,
    pages_per_step: int = 4,
    num_stages: int = 3,
    index_window: int | None = None,
    probs_in_smem: bool = False,
    pipeline: str = "ring",
    interpret: bool | plgpu.InterpretGPUParams = False,
    plan: SharedLevelPlan | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Each request's partial state over its group's pages at one shared level, on Mosaic GPU.

    The kernel path of ``paged.cascade.shared_level_state_reference``, with the same return: the
    query rows of a group's requests fill 64-row tensor-core tiles that stream the group's pages
    once a tile (see the module docstring), split over the prefix when the tiles are too few to
    fill the GPU.

    Args:
      queries: ``[B, L, H, D]`` bfloat16 or float16 (``D`` 64 or 128; ``H`` a multiple of the
        KV heads; any ``L``: a request's ``L x G`` rows may span tiles).
      cache: a ``paged.KVCache`` in the ``HND`` layout, page size 16, queries' dtype.
      level: a ``paged.cascade.SharedLevel`` (its page numbers are checked against the pool,
        and its groups against the batch, when concrete; see ``validate_cascade_levels``).
      sm_scale, logits_soft_cap: Python floats, as in ``paged.decode_attention``.
      num_splits: chunks each tile's prefix is cut into (static). None: concrete levels get
        ``choose_num_splits`` for their tiles and longest group; traced levels the same from
        the bounds of the arrays' static sizes.
      pages_per_step, num_stages, index_window, probs_in_smem, pipeline: the decode kernel's
        pipeline (``paged_decode_mgpu``); default the ring, 4 pages a step, 3 slots.
      interpret: run in Mosaic GPU's interpret mode (CPU); needs ``probs_in_smem=True``.
      plan: None (the tile layout and work items computed on the device, in the call), or
        ``plan_shared_level``'s plan of this level for this batch, head layout and
        ``pages_per_step`` (its split count replaces ``num_splits``, which must then be None
        or equal). The plan is trusted to be of this level: only its shape is checked.

    Returns:
      ``(o [B, L, H, D] float32, lse [B, L, H] float32)``; ``o = 0``, ``lse = -inf`` for a
      request in no group or whose group has no pages.

    Raises:
      TypeError: ``level`` is not a ``SharedLevel`` or ``cache`` not a ``KVCache``.
      ValueError: naming the argument and its value, for queries that are not 4-D 16-bit
        arrays of the cache's dtype and head size, head counts that are not a multiple, an NHD
        cache, a page size other than 16, a level whose page size differs from the cache's, an
        invalid level (concrete), a traced or missing ``sm_scale``, a traced soft cap or one
        that is not ``> 0``, ``num_splits < 1``, pipeline parameters the decode kernel refuses,
        and ``interpret`` without ``probs_in_smem``.

    Example:
      >>> import paged
      >>> from paged.cascade import SharedLevel
      >>> cache = paged.new_kv_cache(4, 16, 2, 64, jnp.bfloat16)
      >>> level = SharedLevel(
      ...     group_pages=paged.PageTable.from_page_lists([[1, 3]], [20], page_size=16),
      ...     group_indptr=np.array([0, 2], np.int32),
      ...     group_requests=np.array([0, 2], np.int32),
      ... )
      >>> q = jnp.ones((3, 1, 4, 64), jnp.bfloat16)
      >>> o, lse = shared_level_states_mgpu(
      ...     q, cache, level, sm_scale=0.125, probs_in_smem=True, interpret=True
      ... )
      >>> o.shape, lse.shape, bool(jnp.isneginf(lse[1]).all())  # request 1 is in no group
      ((3, 1, 4, 64), (3, 1, 4), True)
    """
    if not isinstance(level, SharedLevel):
        raise TypeError(f"level must be a SharedLevel, got {type(level).__name__}")
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}")
    sm_scale = _static_float("sm_scale", sm_scale)
    if sm_scale is None:
        raise ValueError("sm_scale must be a Python float, got None")
    logits_soft_cap = _static_float("logits_soft_cap", logits_soft_cap)
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        # 0 would fail as a ZeroDivisionError deep in the kernel trace; a negative cap equals
        # its absolute value (c x tanh(s / c) is even in c) and is refused as decode refuses it.
        raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap}")
    index_window = resolve_index_window(index_window, pages_per_step)
    smem = _validate_arguments(
        queries,
        cache,
        num_splits=num_splits,
        pages_per_step=pages_per_step,
        num_stages=num_stages,
        index_window=index_window,
        probs_in_smem=probs_in_smem,
        pipeline=pipeline,
        interpret=interpret,
    )
    batch, q_len, num_q_heads, _ = queries.shape
    num_kv_heads = cache.num_kv_heads
    if level.group_pages.page_size != cache.page_size:
        raise ValueError(
            f"level.group_pages.page_size={level.group_pages.page_size} differs from the "
            f"cache's page_size={cache.page_size}"
        )
    # The level's checks, with an empty own level standing in for the batch's rows.
    empty_own = PageTable(
        page_indptr=np.zeros((batch + 1,), np.int32),
        page_indices=np.zeros((1,), np.int32),
        last_page_len=np.zeros((batch,), np.int32),
        page_size=cache.page_size,
    )
    try:
        validate_cascade_levels(CascadeLevels(shared=(level,), own=empty_own), cache.num_pages)
    except ValueError as error:  # name the argument as the caller passed it
        raise ValueError(str(error).replace("levels.shared[0]", "level")) from error

    pages = level.group_pages
    rows_per_request = q_len * (num_q_heads // num_kv_heads)
    num_groups = level.num_groups
    num_members = level.group_requests.shape[0]
    if batch == 0 or num_groups == 0 or num_members == 0 or pages.page_indices.shape[0] == 0:
        return _no_key_states(queries)
    if plan is not None:
        _check_plan(
            plan,
            batch=batch,
            rows_per_request=rows_per_request,
            num_groups=num_groups,
            pages_per_step=pages_per_step,
            num_splits=num_splits,
        )
        return cascade_shared_mgpu(
            queries,
            cache.k_pages,
            cache.v_pages,
            jnp.asarray(pages.page_indptr),
            jnp.asarray(pages.page_indices),
            jnp.asarray(pages.last_page_len),
            jnp.asarray(level.group_indptr),
            jnp.asarray(level.group_requests),
            (plan.work, plan.query_rows, plan.state_rows),
            sm_scale=sm_scale,
            logits_soft_cap=logits_soft_cap,
            num_tiles=plan.num_tiles,
            num_splits=plan.num_splits,
            pages_per_step=pages_per_step,
            num_stages=num_stages,
            index_window=index_window,
            probs_in_smem=probs_in_smem,
            pipeline=pipeline,
            interpret=interpret,
        )
    if is_concrete(level.group_indptr, pages.page_indptr):
        num_tiles = num_query_tiles(np.asarray(level.group_indptr), rows_per_request)
        max_group_pages = int(np.max(np.diff(np.asarray(pages.page_indptr)), initial=0))
    else:  # bounds from the static sizes: every member listed, the longest possible group
        num_tiles = -(-num_members * rows_per_request // TILE_ROWS) + num_groups
        max_group_pages = pages.page_indices.shape[0]
    if num_tiles == 0:
        return _no_key_states(queries)
    if num_splits is None:
        num_splits = choose_num_splits(
            num_tiles,
            num_kv_heads,
            max_group_pages,
            programs_per_wave=H200_NUM_SMS * max(programs_per_sm(smem), 1),
        )
    return cascade_shared_mgpu(
        queries,
        cache.k_pages,
        cache.v_pages,
        jnp.asarray(pages.page_indptr),
        jnp.asarray(pages.page_indices),
        jnp.asarray(pages.last_page_len),
        jnp.asarray(level.group_indptr),
        jnp.asarray(level.group_requests),
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        num_tiles=num_tiles,
        num_splits=num_splits,
        pages_per_step=pages_per_step,
        num_stages=num_stages,
        index_window=index_window,
        probs_in_smem=probs_in_smem,
        pipeline=pipeline,
        interpret=interpret,
    )


def _check_plan(plan, *, batch, rows_per_request, num_groups, pages_per_step, num_splits):
    """Raises ValueError naming ``plan`` when it was made for another batch, head layout,
    level size, ``pages_per_step`` or split count."""
    if not isinstance(plan, SharedLevelPlan):
        raise TypeError(f"plan must be a SharedLevelPlan or None, got {type(plan).__name__}")
    got = (plan.batch, plan.rows_per_request, plan.tile_start.shape[0], plan.pages_per_step)
    want = (batch, rows_per_request, num_groups, pages_per_step)
    if got != want:
        raise ValueError(
            "plan was made for (batch, rows_per_request, num_groups, pages_per_step)="
            f"{got}, this call has {want}"
        )
    if num_splits is not None and num_splits != plan.num_splits:
        raise ValueError(f"num_splits={num_splits} differs from plan.num_splits={plan.num_splits}")


def _no_key_states(queries: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The state of requests that attend to no key at this level (an empty batch, level or
    group): ``(o [B, L, H, D] float32 zeros, lse [B, L, H] float32 -inf)`` for ``queries``
    ``[B, L, H, D]``, which ``paged.merge_states`` weighs 0."""
    return (
        jnp.zeros(queries.shape, jnp.float32),
        jnp.full(queries.shape[:-1], -jnp.inf, jnp.float32),
    )


def _validate_arguments(
    queries,
    cache,
    *,
    num_splits,
    pages_per_step,
    num_stages,
    index_window,
    probs_in_smem,
    pipeline,
    interpret,
) -> int:
    """Raises ValueError for what the shared-level kernel cannot run, naming the value; the
    pipeline's checks are the decode kernel's (``validate_mgpu_pipeline_arguments``).

    Returns:
      The shared memory one program allocates, in bytes (``smem_bytes_per_program``).
    """
    if queries.ndim != 4:
        raise ValueError(
            f"queries must be [batch, q_len, num_q_heads, head_dim], got shape {queries.shape}"
        )
    if cache.layout != "HND":
        raise ValueError(
            f"cache.layout must be 'HND' (a page of one KV head is one TMA box), got "
            f"{cache.layout!r}"
        )
    if (
        not any(queries.dtype == d for d in SUPPORTED_DTYPES)
        or cache.k_pages.dtype != queries.dtype
    ):
        raise ValueError(
            "queries and the cache must both be bfloat16 or float16, got "
            f"{queries.dtype} and {cache.k_pages.dtype}"
        )
    if cache.page_size != PAGE_SIZE:
        raise ValueError(f"the cache's page_size must be {PAGE_SIZE}, got {cache.page_size}")
    head_dim = cache.k_pages.shape[-1]
    if queries.shape[-1] != head_dim or head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim must be one of {SUPPORTED_HEAD_DIMS} and equal in queries and the cache, "
            f"got queries' {queries.shape[-1]} and the cache's {head_dim}"
        )
    num_q_heads, num_kv_heads = queries.shape[2], cache.num_kv_heads
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}"
        )
    if num_splits is not None and not (isinstance(num_splits, int) and num_splits >= 1):
        raise ValueError(f"num_splits must be an int >= 1 or None, got {num_splits!r}")
    return validate_mgpu_pipeline_arguments(
        head_dim,
        queries.dtype,
        pages_per_step=pages_per_step,
        num_stages=num_stages,
        index_window=index_window,
        probs_in_smem=probs_in_smem,
        pipeline=pipeline,
        interpret=interpret,
    )
