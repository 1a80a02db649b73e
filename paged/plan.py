"""The split-KV decode planner: how a batch's pages are cut into work items for the kernel.

FlashInfer's plan/run split: ``plan_decode`` runs on the host from concrete lengths, once per
decode step, and every layer reuses its plan (``paged.decode_attention(..., plan=plan)``).

Why split at all: the kernel runs one program per (work item, KV head). A batch of 1 request
with 8 KV heads gives 8 programs, 8 of the H200's 132 SMs; the rest idle and the memory system
is far from saturated. Cutting each request's pages into chunks gives more programs, at the cost
of writing partial states and merging them (``kernels_pallas/merge_states.py``).

The rule (FlashInfer's, in ``docs/peers.md``): with ``max_grid = blocks_per_sm * num_sms``
programs, if ``nonempty_requests * num_kv_heads >= max_grid`` do not split; otherwise take the
smallest chunk (at least ``min_chunk_pages``) such that ``sum_b ceil(pages_b / chunk) *
num_kv_heads <= max_grid``. A fixed chunk (``fixed_split_pages``) instead makes every request's result
independent of the rest of the batch, bit for bit (its chunks and their merge order depend on
its own length only).

Work-item arrays are padded to ``bucket_size`` so that lengths changing inside a bucket reuse
the compiled program; padding items have request ``-1`` and an empty page range. Two fields are
static and select a compiled variant: ``write_final`` (split or not) and ``long_chunks`` (the
chunk length's class, which selects the tuned launch). The plan describes the work, not how to
launch it: ``paged.decode`` chooses the kernel's launch parameters where it calls the kernel,
from these two fields and the shapes of the call. As a batch grows from one token to long
contexts a jitted step meets a few variants (measured: three for four requests growing to 4096
tokens), each compiled once; a plan with ``fixed_split_pages`` keeps both fixed.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import paged_decode_tuning as tuning
from kernels_pallas.platform import is_concrete, on_gpu
from paged.page_table import PageTable, bucket_size, validate_page_table


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Work items for one decode step (a pytree; ``write_final`` and ``long_chunks`` are static).

    ``plan_decode`` fills the arrays with host NumPy arrays (the jitted step that takes the plan
    transfers them with its other inputs); ``traced_default_plan`` with traced arrays.

    Attributes:
      work_request: int32[W], each item's request; -1 for padding.
      work_page_start, work_page_end: int32[W], the item's range in ``page_indices``.
      work_last_page_len: int32[W], valid slots in the range's final page.
      merge_indptr: int32[B + 1]; request b's items are ``merge_indptr[b]:merge_indptr[b + 1]``.
      chunk_pages: int32 scalar, the chunk size chosen (pages), for reports.
      num_work_items: int32 scalar, the real (unpadded) items, for reports.
      write_final: every request is one item and results need no merge (static).
      long_chunks: the chunks are long (``paged_decode_tuning.is_long_chunk``; static). True,
        the default, where the chunk is unknown (a traced plan, or one built by hand).
    """

    work_request: np.ndarray | jax.Array
    work_page_start: np.ndarray | jax.Array
    work_page_end: np.ndarray | jax.Array
    work_last_page_len: np.ndarray | jax.Array
    merge_indptr: np.ndarray | jax.Array
    chunk_pages: np.ndarray | jax.Array
    num_work_items: np.ndarray | jax.Array
    write_final: bool
    long_chunks: bool = True

    def splits_per_request(self) -> np.ndarray:
        """Host-side: the number of work items of each request."""
        return np.diff(np.asarray(self.merge_indptr))


jax.tree_util.register_dataclass(
    DecodePlan,
    data_fields=[
        "work_request",
        "work_page_start",
        "work_page_end",
        "work_last_page_len",
        "merge_indptr",
        "chunk_pages",
        "num_work_items",
    ],
    meta_fields=["write_final", "long_chunks"],
)


# Batches up to this many requests count their chunks in Python ints (choose_chunk_pages).
PYTHON_COUNT_MAX_REQUESTS = 32


def choose_chunk_pages(
    pages_per_request: np.ndarray,
    num_kv_heads: int,
    *,
    max_grid: int,
    min_chunk_pages: int,
    max_splits_per_request: int = 0,
) -> int:
    """The smallest chunk (in pages) whose work items still fit ``max_grid`` programs, and that
    cuts no request into more than ``max_splits_per_request`` items (0: no such cap).

    Returns the longest request's page count (no split) when the batch already fills the grid.

    Example:
      >>> choose_chunk_pages(np.array([2048]), 8, max_grid=264, min_chunk_pages=8)  # 33 chunks
      63
      >>> choose_chunk_pages(np.array([64] * 64), 8, max_grid=264, min_chunk_pages=8)
      64
      >>> choose_chunk_pages(  # 16 chunks at most
      ...     np.array([2048]), 8, max_grid=264, min_chunk_pages=8, max_splits_per_request=16
      ... )
      128
    """
    longest = int(pages_per_request.max(initial=0))
    if longest == 0:
        return 1
    # Empty requests cost no program worth counting (theirs exit at once).
    nonempty = int(np.count_nonzero(pages_per_request))
    if nonempty * num_kv_heads >= max_grid or longest <= min_chunk_pages:
        return longest

    # The same count either way; which is cheaper depends on the batch. A NumPy reduction costs
    # a few microseconds of call overhead whatever its size, a Python sum ~80 ns a request: for
    # the small batches of a serving step (the engine plans every step) Python ints are ~10x
    # faster, for large ones NumPy is.
    if pages_per_request.size <= PYTHON_COUNT_MAX_REQUESTS:
        lengths = pages_per_request.tolist()

        def num_programs(chunk: int) -> int:
            return sum(-(-length // chunk) for length in lengths) * num_kv_heads

    else:

        def num_programs(chunk: int) -> int:
            return int(np.sum(-(-pages_per_request // chunk))) * num_kv_heads

    low, high = min_chunk_pages, longest  # num_programs(high) = nonempty * KVH < max_grid
    while low < high:
        middle = (low + high) // 2
        if num_programs(middle) <= max_grid:
            high = middle
        else:
            low = middle + 1
    if max_splits_per_request > 0:
        low = max(low, -(-longest // max_splits_per_request))
    return low


def _work_items(indptr, last_page_len, page_size, chunk):
    requests, starts, ends, last_lens, counts = [], [], [], [], []
    indptr, last_page_len = indptr.tolist(), last_page_len.tolist()  # Python ints: cheap to read
    for b in range(len(last_page_len)):
        begin, finish = indptr[b], indptr[b + 1]
        item_starts = list(range(begin, finish, chunk)) or [begin]
        for start in item_starts:
            end = min(start + chunk, finish)
            requests.append(b)
            starts.append(start)
            ends.append(end)
            last_lens.append(last_page_len[b] if end == finish else page_size)
        counts.append(len(item_starts))
    return requests, starts, ends, last_lens, counts


def default_planned_kernel() -> str:
    """The decode kernel a plan is cut for by default: ``"paged_decode_mgpu"`` on a GPU while
    ``backend="auto"`` runs the Mosaic GPU kernel (``paged.decode.AUTO_PICKS_MOSAIC_GPU_DECODE``),
    else ``"paged_decode"`` (the Triton kernel; also on a CPU, where plans feed interpreted
    kernels and tests)."""
    from paged import decode  # a late import: paged.decode imports this module

    return (
        "paged_decode_mgpu" if on_gpu() and decode.AUTO_PICKS_MOSAIC_GPU_DECODE else "paged_decode"
    )


def plan_decode(
    page_table: PageTable,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    fixed_split_pages: int | None = None,
    max_grid: int | None = None,
    min_chunk_pages: int | None = None,
    num_work_items: int | None = None,
    kernel: str | None = None,
) -> DecodePlan:
    """Plans one decode step on the host from the table's concrete lengths.

    Args:
      page_table: the batch's table (concrete arrays; it is read on the host).
      num_q_heads, num_kv_heads, head_dim: the attention shape (``head_dim`` and the group size
        select tuned planner parameters).
      fixed_split_pages: cut every request into chunks of exactly this many pages (the last one
        shorter) and always merge: batch-invariant, deterministic results.
      max_grid: programs that fill the GPU (default: the tuned ``blocks_per_sm`` x SM count).
      min_chunk_pages: never cut chunks smaller than this (default: tuned).
      num_work_items: static length to pad the work arrays to (default ``bucket_size``).
      kernel: the kernel that will run the plan, ``"paged_decode"`` (Triton) or
        ``"paged_decode_mgpu"`` (Mosaic GPU), whose tuned planner parameters differ (the Mosaic
        GPU kernel cuts a request into 16 items at most: ``paged_decode_tuning.MGPU_PLANNER``).
        Default ``default_planned_kernel()``: the kernel ``backend="auto"`` runs on this
        platform for the common shapes (HND pages of 16 tokens in bfloat16). Any plan is valid
        for either kernel; this only picks the faster cut.

    Returns:
      A ``DecodePlan``; reuse it for every layer of the step.

    Raises:
      TypeError: if ``fixed_split_pages``, ``max_grid``, ``min_chunk_pages`` or
        ``num_work_items`` is neither an int nor None.
      ValueError: for a traced table, bad head counts, ``fixed_split_pages``, ``max_grid`` or
        ``min_chunk_pages`` below 1 (a zero chunk would divide by zero), and
        page-table invariants (``page_indptr`` not starting at 0 or decreasing, past the end of
        ``page_indices``; ``last_page_len`` outside ``[1, page_size]`` for a request with pages
        or not 0 for one without; arrays not int32 and 1-D), naming the field and value. Page
        indices are not checked here (the pool is unknown): ``decode_attention`` checks them.
        An unknown ``kernel`` (naming it).

    Example:
      >>> table = PageTable.from_seq_lens([4096], page_size=16)
      >>> plan = plan_decode(table, 32, 8, 128)
      >>> int(plan.chunk_pages), plan.splits_per_request().tolist(), plan.write_final
      (8, [32], False)
    """
    arrays = (page_table.page_indptr, page_table.last_page_len)
    if not is_concrete(*arrays):
        raise ValueError(
            "plan_decode needs concrete page-table arrays (call it outside jit, once per step)"
        )
    # A non-monotone page_indptr or a non-empty request with last_page_len 0 would give work
    # items that end before they start; the pool is not known here, so page indices are not.
    validate_page_table(page_table, None)
    for name, value, minimum in [
        ("fixed_split_pages", fixed_split_pages, 1),
        ("max_grid", max_grid, 1),
        ("min_chunk_pages", min_chunk_pages, 1),
        ("num_work_items", num_work_items, 0),
    ]:
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int or None, got {value!r}")
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads={num_q_heads} must be a positive multiple of num_kv_heads={num_kv_heads}"
        )
    kernel = default_planned_kernel() if kernel is None else kernel
    params = tuning.planner_parameters(head_dim, num_q_heads // num_kv_heads, kernel)
    max_grid = params["blocks_per_sm"] * tuning.num_sms() if max_grid is None else max_grid
    min_chunk = params["min_chunk_pages"] if min_chunk_pages is None else min_chunk_pages
    indptr = np.asarray(page_table.page_indptr)
    last_page_len = np.asarray(page_table.last_page_len)
    pages = indptr[1:] - indptr[:-1]  # np.diff's result, without its call overhead
    if fixed_split_pages is not None:
        chunk, write_final = fixed_split_pages, False
    else:
        chunk = choose_chunk_pages(
            pages,
            num_kv_heads,
            max_grid=max_grid,
            min_chunk_pages=min_chunk,
            max_splits_per_request=params["max_splits_per_request"],
        )
        write_final = bool(int(pages.max(initial=0)) <= chunk)  # every request is one item
    requests, starts, ends, last_lens, counts = _work_items(
        indptr, last_page_len, page_table.page_size, chunk
    )
    real = len(requests)
    size = bucket_size(real) if num_work_items is None else num_work_items
    if size < real:
        raise ValueError(f"num_work_items={size} is smaller than the {real} work items needed")
    padding = size - real

    # Host NumPy arrays, not device arrays: a jitted step transfers them with its other inputs,
    # whereas jnp.asarray here ran eager device ops, seven a plan, every step (on the H200 the
    # serving suite measured 2.1 to 2.8 ms of host time a step with them, 0.28 to 0.69 ms
    # without: docs/benchmark_results/archive/2026-12-01-serving-9d4f043.md).
    def padded(values, fill):
        return np.array(values + [fill] * padding, np.int32)

    return DecodePlan(
        work_request=padded(requests, -1),
        work_page_start=padded(starts, 0),
        work_page_end=padded(ends, 0),
        work_last_page_len=padded(last_lens, 0),
        merge_indptr=np.array([0, *itertools.accumulate(counts)], np.int32),
        chunk_pages=np.asarray(chunk, np.int32),
        num_work_items=np.asarray(real, np.int32),
        write_final=write_final,
        long_chunks=tuning.is_long_chunk(chunk),
    )


def plan_decode_tables(
    page_tables: Sequence[PageTable], num_q_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[DecodePlan, ...]:
    """Plans every table a step runs attention over with one model: ``plan_decode`` of each.

    A speculative step reads its draft model's cache through ``n + 1`` tables (one per draft
    pass) and its target's through one; the engine plans each model's tables in one call, once
    a step, and every layer of every pass reuses them.

    Args:
      page_tables: the step's tables (concrete; host NumPy arrays are fine).
      num_q_heads, num_kv_heads, head_dim: the model's attention shape.

    Returns:
      One ``DecodePlan`` per table, in order (the same plans ``plan_decode`` makes).

    Raises:
      ValueError: whatever ``plan_decode`` refuses.

    Example:
      >>> tables = [PageTable.from_seq_lens([n], page_size=16) for n in (4095, 4096)]
      >>> [int(plan.num_work_items) for plan in plan_decode_tables(tables, 32, 8, 128)]
      [32, 32]
    """
    return tuple(plan_decode(table, num_q_heads, num_kv_heads, head_dim) for table in page_tables)


def traced_default_plan(page_table: PageTable, num_q_heads: int, num_kv_heads: int, head_dim: int):
    """A plan built on the device when lengths are not known on the host (under ``jit``).

    Every request is cut into the same static number of chunks ``S`` (its own pages divided
    evenly); ``S`` depends only on static shapes: enough programs to fill ``max_grid`` if every
    request were long. Empty chunks of short requests cost an early-exiting program each.
    """
    params = tuning.planner_parameters(head_dim, num_q_heads // num_kv_heads)
    max_grid = params["blocks_per_sm"] * tuning.num_sms()
    batch = page_table.batch_size
    splits = max(1, min(params["max_traced_splits"], -(-max_grid // (batch * num_kv_heads))))
    indptr = page_table.page_indptr
    pages = indptr[1:] - indptr[:-1]  # [B]
    chunk = (pages + splits - 1) // splits  # [B], 0 for an empty request
    index = jnp.arange(splits)
    starts = jnp.minimum(indptr[:-1, None] + index[None, :] * chunk[:, None], indptr[1:, None])
    ends = jnp.minimum(starts + chunk[:, None], indptr[1:, None])
    is_final = (ends == indptr[1:, None]) & (ends > starts)
    last_lens = jnp.where(is_final, page_table.last_page_len[:, None], page_table.page_size)
    requests = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, splits))
    return DecodePlan(
        work_request=requests.reshape(-1).astype(jnp.int32),
        work_page_start=starts.reshape(-1).astype(jnp.int32),
        work_page_end=ends.reshape(-1).astype(jnp.int32),
        work_last_page_len=last_lens.reshape(-1).astype(jnp.int32),
        merge_indptr=(jnp.arange(batch + 1) * splits).astype(jnp.int32),
        chunk_pages=jnp.max(chunk, initial=0).astype(jnp.int32),
        num_work_items=jnp.asarray(batch * splits, jnp.int32),
        write_final=splits == 1,
        long_chunks=tuning.is_long_chunk(None),
    )


def validate_plan(plan: DecodePlan, page_table: PageTable) -> None:
    """Checks that ``plan`` was made for ``page_table`` (its lengths as they are now).

    Shapes always; values when the plan and table are concrete: each request's work items must
    tile its pages ``[page_indptr[b], page_indptr[b + 1])`` in order, end with its
    ``last_page_len``, and stay inside ``page_indices``. A plan made before the table grew (a
    stale plan from the previous step) fails here instead of attending over the wrong tokens.

    Raises:
      ValueError: naming the plan field and the bad value.
    """
    batch = page_table.batch_size
    if plan.merge_indptr.shape != (batch + 1,):
        raise ValueError(
            f"plan was made for {plan.merge_indptr.shape[0] - 1} requests but the batch has {batch}"
        )
    fields = (plan.work_request, plan.work_page_start, plan.work_page_end, plan.work_last_page_len)
    if len({f.shape for f in fields}) != 1 or fields[0].ndim != 1:
        raise ValueError(
            f"plan work arrays must share one 1-D shape, got {[f.shape for f in fields]}"
        )
    arrays = (*fields, plan.merge_indptr, page_table.page_indptr, page_table.last_page_len)
    if not is_concrete(*arrays):
        return
    request, start, end, last_len = (np.asarray(f) for f in fields)
    merge_indptr = np.asarray(plan.merge_indptr)
    indptr = np.asarray(page_table.page_indptr)
    last_page_len = np.asarray(page_table.last_page_len)
    num_work = request.shape[0]
    if merge_indptr[0] != 0 or np.any(np.diff(merge_indptr) < 1) or merge_indptr[-1] > num_work:
        raise ValueError(
            f"plan.merge_indptr={merge_indptr.tolist()} must start at 0, give every request at "
            f"least one work item, and end at most at the {num_work} work items"
        )
    for b in range(batch):
        items = range(merge_indptr[b], merge_indptr[b + 1])
        expected_start = indptr[b]
        for item in items:
            if request[item] != b or start[item] != expected_start or end[item] < start[item]:
                raise ValueError(
                    f"plan work item {item} (request {request[item]}, pages {start[item]}:"
                    f"{end[item]}) does not continue request {b}'s pages at {expected_start}: "
                    "the plan was made for another page table"
                )
            expected_start = end[item]
        final = items[-1]
        if end[final] != indptr[b + 1] or (
            indptr[b + 1] > indptr[b] and last_len[final] != last_page_len[b]
        ):
            raise ValueError(
                f"plan's work items for request {b} end at page {end[final]} with "
                f"last_page_len {last_len[final]}, but the table has page_indptr[{b + 1}]="
                f"{indptr[b + 1]} and last_page_len[{b}]={last_page_len[b]}: the plan is stale "
                "(plan each step after the table changes)"
            )
    padding = request[merge_indptr[-1] :]
    if np.any(padding >= 0):
        raise ValueError("plan padding work items must have work_request -1")
