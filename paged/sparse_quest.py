"""Quest: query-aware page selection from per-page key bounds (reference).

Quest (Tang et al., 2024) keeps, beside the KV pool, the element-wise minimum and maximum of
each page's keys, per KV head. For a query ``q`` and a page with bounds ``(kmin, kmax)``,

    U(q, page) = sum_i max(q_i * kmin_i, q_i * kmax_i)

is at least ``q . k`` for every key ``k`` of the page (``docs/sparse_decode.md`` has the proof),
so pages with a low ``U`` cannot hold a large logit. A decode step scores every page of a
request, keeps the highest-scoring ones within a token budget (always the first page, the
attention sinks, and the last, the recent tokens and the page being written) and attends over
those through a virtual page table: the decode kernel is not changed.

Selection granularity (``per``):

- ``"kv_head"`` (Quest's choice under GQA): one selection per request and KV head, scoring a page
  by the largest bound over the group's query heads; the group shares the pages.
- ``"query_head"``: one selection per request and query head.

Either way different heads read different pages, which one ``PageTable`` (one page list per
request, all heads) cannot say. So the virtual table has one row per (request, head) and lists
pages of a head-split view of the pool (``head_split_cache``), in which page ``p`` of KV head
``h`` is page ``p * num_kv_heads + h`` of a one-head pool.

Bounds of pages no request has written yet are empty: ``kmin = +inf``, ``kmax = -inf``, the
identities of min and max, so an append only ever tightens them to the keys written, and an
empty page's score is ``-inf`` (the maximum over no keys).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.platform import is_concrete
from paged.attention_reference import token_mask
from paged.kv_cache import INVALID_PAGE, KVCache, token_slots, validate_kv_cache, written_keys
from paged.page_table import PageTable, validate_page_table
from paged.sparse_tables import MIN_INDICES, compact_rows

GRANULARITIES = ("kv_head", "query_head")


class PageKeyBounds(NamedTuple):
    """Element-wise key bounds of every page of a pool, per KV head.

    Attributes:
      kmin: ``[num_pages, num_kv_heads, head_dim]``, the smallest value of each key element over
        the page's written slots; ``+inf`` for a page with none.
      kmax: same shape, the largest; ``-inf`` for a page with none.
    """

    kmin: jax.Array
    kmax: jax.Array


def empty_page_key_bounds(
    num_pages: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32
) -> PageKeyBounds:
    """Bounds of a pool with nothing written: ``kmin = +inf``, ``kmax = -inf`` everywhere.

    Example:
      >>> bounds = empty_page_key_bounds(2, 1, 3)
      >>> bounds.kmin[0, 0].tolist(), bounds.kmax[0, 0].tolist()
      ([inf, inf, inf], [-inf, -inf, -inf])
    """
    shape = (num_pages, num_kv_heads, head_dim)
    return PageKeyBounds(jnp.full(shape, jnp.inf, dtype), jnp.full(shape, -jnp.inf, dtype))


def page_key_bounds(cache: KVCache, page_table: PageTable) -> PageKeyBounds:
    """Bounds recomputed from the keys: per page and KV head, min and max over its valid slots.

    A slot is valid when some request of ``page_table`` holds a token there (every slot of a
    listed page but the unwritten tail of a request's last page). A page listed by several
    requests (a shared prefix) is bounded over the union of their valid slots; a page no request
    lists gets the empty bounds. Computed in the cache's dtype (min and max are exact).

    Args:
      cache: the KV pool, either layout.
      page_table: the requests whose tokens count.

    Returns:
      ``PageKeyBounds`` of ``[cache.num_pages, cache.num_kv_heads, cache.head_dim]`` each, in
      the cache's dtype.

    Raises:
      ValueError: an inconsistent cache, a page table that does not fit it (page size, indices
        outside the pool when concrete).

    Example:
      >>> from paged import append_kv, new_kv_cache
      >>> cache = new_kv_cache(3, 2, 1, 1, jnp.float32)
      >>> table = PageTable.from_page_lists([[2, 0]], seq_lens=[3], page_size=2)
      >>> keys = jnp.array([4.0, -1.0, 7.0]).reshape(3, 1, 1)
      >>> cache = append_kv(cache, table, keys, keys, jnp.zeros(3, jnp.int32), jnp.arange(3))
      >>> bounds = page_key_bounds(cache, table)
      >>> bounds.kmin[:, 0, 0].tolist(), bounds.kmax[:, 0, 0].tolist()
      ([7.0, inf, -1.0], [7.0, -inf, 4.0])
    """
    validate_kv_cache(cache)
    _check_table_fits(page_table, cache.num_pages, cache.page_size)
    return _page_key_bounds(cache, page_table)


@jax.jit  # one compilation per shape: the eager version is many small dispatches
def _page_key_bounds(cache: KVCache, page_table: PageTable) -> PageKeyBounds:
    keys = cache.to_nhd(cache.k_pages[page_table.page_indices])  # [nnz, page_size, KVH, D]
    valid = jnp.any(token_mask(page_table), axis=0)[:, :, None, None]  # [nnz, page_size, 1, 1]
    listed_min = jnp.min(jnp.where(valid, keys, jnp.inf), axis=1)  # [nnz, KVH, D]
    listed_max = jnp.max(jnp.where(valid, keys, -jnp.inf), axis=1)
    # Padding entries of page_indices (page 0) have no valid slot: they scatter the identities.
    empty = empty_page_key_bounds(cache.num_pages, cache.num_kv_heads, cache.head_dim, cache.dtype)
    return PageKeyBounds(
        empty.kmin.at[page_table.page_indices].min(listed_min.astype(cache.dtype)),
        empty.kmax.at[page_table.page_indices].max(listed_max.astype(cache.dtype)),
    )


def update_page_key_bounds(
    bounds: PageKeyBounds,
    page_table: PageTable,
    k_new: jax.Array,
    batch_indices: jax.Array,
    positions: jax.Array,
) -> PageKeyBounds:
    """The bounds after ``append_kv(cache, page_table, k_new, v_new, batch_indices, positions)``.

    The reference of what ``append_kv`` and ``rope_append_kv`` are to do beside their writes:
    each new key widens its page's bounds (``kmin = min(kmin, k)``, ``kmax = max(kmax, k)``).
    Exact for appends into unwritten slots, which is all a decode step does. Overwriting a slot
    (a speculative rollback rewriting positions) leaves bounds that still hold the old key: still
    true upper bounds, only looser. A page given back to the pool must be reset
    (``reset_page_key_bounds``) before its next owner writes it.

    Args:
      bounds: the current bounds, ``[num_pages, KVH, D]`` each.
      page_table: the table after the append (it covers the new tokens), as for ``append_kv``.
      k_new: ``[nnz, KVH, D]`` the new keys, after RoPE where the cache holds rotated keys.
      batch_indices: int ``[nnz]``, each token's request.
      positions: int ``[nnz]``, each token's position in its request.

    Returns:
      The updated ``PageKeyBounds`` (same shapes and dtype; ``k_new`` is cast to it).

    Raises:
      ValueError: mismatched shapes, and (concrete inputs) page-table invariants and a request
        or position outside the table. Under ``jit`` such a token is dropped, as ``append_kv``
        drops it.

    Example:
      >>> bounds = empty_page_key_bounds(2, 1, 2)
      >>> table = PageTable.from_page_lists([[1]], seq_lens=[2], page_size=2)
      >>> k = jnp.array([[[1.0, -2.0]], [[3.0, 0.5]]])
      >>> bounds = update_page_key_bounds(bounds, table, k, jnp.zeros(2, jnp.int32), jnp.arange(2))
      >>> bounds.kmin[1, 0].tolist(), bounds.kmax[1, 0].tolist()
      ([1.0, -2.0], [3.0, 0.5])
    """
    _check_bounds(bounds)
    num_pages, num_kv_heads, head_dim = bounds.kmin.shape
    _check_table_fits(page_table, num_pages, page_table.page_size)
    if k_new.ndim != 3 or k_new.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"k_new must have shape [nnz, {num_kv_heads}, {head_dim}], got {k_new.shape}"
        )
    nnz = k_new.shape[0]
    for name, array in [("batch_indices", batch_indices), ("positions", positions)]:
        if array.shape != (nnz,):
            raise ValueError(f"{name} must have shape [{nnz}], got {array.shape}")
        if not jnp.issubdtype(array.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {array.dtype}")
    if is_concrete(batch_indices, positions, page_table.page_indptr, page_table.last_page_len):
        batch = np.asarray(batch_indices)
        bad = (batch < 0) | (batch >= page_table.batch_size)
        if np.any(bad):
            i = int(np.argmax(bad))
            raise ValueError(
                f"batch_indices[{i}]={batch[i]} is outside the batch of {page_table.batch_size}"
            )
        lengths = np.asarray(page_table.seq_lens())[batch]
        pos = np.asarray(positions)
        bad = (pos < 0) | (pos >= lengths)
        if np.any(bad):
            i = int(np.argmax(bad))
            raise ValueError(
                f"positions[{i}]={pos[i]} is outside request {batch[i]}'s length {lengths[i]}"
            )
    pages, _ = token_slots(page_table, batch_indices, positions)  # INVALID_PAGE: dropped
    k_new = k_new.astype(bounds.kmin.dtype)
    return PageKeyBounds(
        bounds.kmin.at[pages].min(k_new, mode="drop"),
        bounds.kmax.at[pages].max(k_new, mode="drop"),
    )


def reset_page_key_bounds(bounds: PageKeyBounds, pages: jax.Array) -> PageKeyBounds:
    """The bounds with ``pages`` (int ``[n]``) made empty again, for pages freed or reallocated.

    Example:
      >>> bounds = PageKeyBounds(jnp.zeros((2, 1, 1)), jnp.ones((2, 1, 1)))
      >>> reset_page_key_bounds(bounds, jnp.array([1])).kmin[:, 0, 0].tolist()
      [0.0, inf]
    """
    _check_bounds(bounds)
    return PageKeyBounds(
        bounds.kmin.at[pages].set(jnp.inf, mode="drop"),
        bounds.kmax.at[pages].set(-jnp.inf, mode="drop"),
    )


def restart_opened_pages(
    bounds: PageKeyBounds, pages: jax.Array, slots: jax.Array
) -> PageKeyBounds:
    """The bounds with every page an append opens made empty: the pages of the tokens written
    into slot 0 (``pages``, ``slots``: int ``[nnz]`` from ``token_slots``; ``INVALID_PAGE``, a
    dropped token, restarts nothing).

    Why slot 0: a request writes its positions in increasing order into its own pages, so the
    first write its current owner makes into a page is at slot 0, and whatever the bounds held
    before (a previous owner's keys, before the page was freed and reused) must be forgotten
    then (``serving/sparse_step.py`` has the whole argument).

    Example:
      >>> bounds = PageKeyBounds(jnp.zeros((3, 1, 1)), jnp.ones((3, 1, 1)))
      >>> out = restart_opened_pages(bounds, jnp.array([1, 2]), jnp.array([0, 3]))
      >>> out.kmin[:, 0, 0].tolist()
      [0.0, inf, 0.0]
    """
    return reset_page_key_bounds(bounds, jnp.where(slots == 0, pages, INVALID_PAGE))


def validate_key_bounds(key_bounds, cache: KVCache, *, name: str = "key_bounds") -> None:
    """Raises ValueError (naming ``name``) unless ``key_bounds`` is a ``PageKeyBounds`` of
    ``cache``'s pool: ``kmin`` and ``kmax`` both ``[num_pages, num_kv_heads, head_dim]`` of the
    cache, of one floating dtype (their own: float32 typically, whatever the pool's)."""
    if not isinstance(key_bounds, PageKeyBounds):
        raise ValueError(
            f"{name} must be a paged.PageKeyBounds (kmin, kmax), got {type(key_bounds).__name__}"
        )
    expected = (cache.num_pages, cache.num_kv_heads, cache.head_dim)
    for field, array in zip(("kmin", "kmax"), key_bounds, strict=True):
        shape = getattr(array, "shape", None)
        if shape != expected:
            raise ValueError(
                f"{name}.{field} must have the cache's shape [num_pages, num_kv_heads, head_dim]"
                f" = {expected}, got {shape}"
            )
        if not jnp.issubdtype(array.dtype, jnp.floating):
            raise ValueError(f"{name}.{field} must be a floating array, got dtype {array.dtype}")
    if key_bounds.kmin.dtype != key_bounds.kmax.dtype:
        raise ValueError(
            f"{name}.kmin dtype {key_bounds.kmin.dtype} differs from {name}.kmax dtype "
            f"{key_bounds.kmax.dtype}"
        )


def append_page_key_bounds(
    bounds: PageKeyBounds,
    cache: KVCache,
    page_table: PageTable,
    batch_indices: jax.Array,
    positions: jax.Array,
) -> PageKeyBounds:
    """The bounds after an append whose keys ``cache`` already holds (the reference of
    ``append_kv(..., key_bounds=)`` and ``rope_append_kv(..., key_bounds=)``).

    Two steps: every page the append opened (wrote slot 0 of) restarts
    (``restart_opened_pages``), then each written key, read back from the pool, so exactly as
    the pool holds it (cast to its dtype, after RoPE where the append rotated), widens its page's
    bounds (``update_page_key_bounds``). A token the append dropped (outside the table, under
    ``jit``) touches no bound. Of two tokens writing one slot (undetectable under ``jit``) the
    key the pool kept counts, for both.

    Args:
      bounds: ``[num_pages, KVH, D]`` each, the pool's bounds before the append.
      cache: the pool after the append.
      page_table: the table the append wrote through.
      batch_indices, positions: int ``[nnz]``, the append's tokens.

    Returns:
      The updated ``PageKeyBounds``, in ``bounds``' dtype.

    Raises:
      ValueError: ``bounds`` not a ``PageKeyBounds`` of the pool, and ``update_page_key_bounds``'s
        errors.

    Example:
      >>> from paged import append_kv, new_kv_cache
      >>> cache = new_kv_cache(2, 2, 1, 1, jnp.bfloat16)
      >>> table = PageTable.from_page_lists([[1]], seq_lens=[1], page_size=2)
      >>> key = jnp.full((1, 1, 1), 1.001)  # stored as bfloat16: 1.0
      >>> rows, pos = jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32)
      >>> cache = append_kv(cache, table, key, key, rows, pos)
      >>> stale = PageKeyBounds(jnp.full((2, 1, 1), -5.0), jnp.full((2, 1, 1), 5.0))
      >>> out = append_page_key_bounds(stale, cache, table, rows, pos)
      >>> out.kmin[:, 0, 0].tolist(), out.kmax[:, 0, 0].tolist()
      ([-5.0, 1.0], [5.0, 1.0])
    """
    validate_key_bounds(bounds, cache, name="bounds")
    pages, slots = token_slots(page_table, batch_indices, positions)
    bounds = restart_opened_pages(bounds, pages, slots)
    keys = written_keys(cache, pages, slots)
    return update_page_key_bounds(bounds, page_table, keys, batch_indices, positions)


def quest_page_scores(
    q: jax.Array, bounds: PageKeyBounds, page_table: PageTable, *, per: str = "kv_head"
) -> jax.Array:
    """Quest's upper bound of the logits of every listed page, per request and head.

    For query head ``h`` (KV head ``h // G``, ``G = H / KVH``) and a page with bounds
    ``(kmin, kmax)`` of that KV head: ``U = sum_i max(q_i * kmin_i, q_i * kmax_i) >= q . k`` for
    every key of the page. Unscaled: ``sm_scale > 0`` and the soft cap are increasing, so they do
    not change which pages rank highest. ``per="kv_head"`` takes the largest ``U`` over the
    group's query heads (a bound for every head of the group), ``per="query_head"`` keeps each.

    Args:
      q: ``[B, H, D]``, one new token per request.
      bounds: ``PageKeyBounds`` of the pool.
      page_table: the requests' pages.
      per: ``"kv_head"`` or ``"query_head"``.

    Returns:
      float ``[B, R, nnz_padded]`` (``R = KVH`` or ``H``) in float32 (float64 for float64
      inputs): entry ``[b, r, j]`` scores ``page_indices[j]`` for request b; ``-inf`` where
      ``j`` is not one of b's pages, and for a page whose bounds are empty.

    Raises:
      ValueError: ``per`` unknown, ``q`` not ``[B, H, D]`` with ``H`` a multiple of the bounds'
        KV heads and ``D`` their ``head_dim``, and page-table invariants (concrete).

    Example:
      >>> bounds = PageKeyBounds(jnp.array([[[-1.0, 0.0]]]), jnp.array([[[2.0, 1.0]]]))
      >>> table = PageTable.from_page_lists([[0]], seq_lens=[1], page_size=4)
      >>> quest_page_scores(jnp.array([[[1.0, -3.0]]]), bounds, table)[0, 0, :1].tolist()
      [2.0]
    """
    if per not in GRANULARITIES:
        raise ValueError(f"per must be one of {GRANULARITIES}, got {per!r}")
    _check_bounds(bounds)
    num_pages, num_kv_heads, head_dim = bounds.kmin.shape
    _check_query(q, num_kv_heads, head_dim)
    _check_table_fits(page_table, num_pages, page_table.page_size, batch_size=q.shape[0])
    return _quest_page_scores(q, bounds, page_table, per)


@functools.partial(jax.jit, static_argnums=3)
def _quest_page_scores(q, bounds: PageKeyBounds, page_table: PageTable, per: str) -> jax.Array:
    num_kv_heads, head_dim = bounds.kmin.shape[1:]
    dtype = jnp.promote_types(jnp.result_type(q, bounds.kmin), jnp.float32)
    batch, num_heads, _ = q.shape
    group = num_heads // num_kv_heads
    kmin = jnp.swapaxes(bounds.kmin[page_table.page_indices], 0, 1).astype(dtype)  # [KVH, nnz, D]
    kmax = jnp.swapaxes(bounds.kmax[page_table.page_indices], 0, 1).astype(dtype)
    q_grouped = q.astype(dtype).reshape(batch, num_kv_heads, group, 1, head_dim)
    upper = jnp.sum(
        jnp.maximum(q_grouped * kmin[None, :, None], q_grouped * kmax[None, :, None]), -1
    )
    # A page with empty bounds has no key: its largest logit is the maximum over nothing, -inf
    # (the formula would give +inf, or NaN where q_i = 0).
    empty = jnp.any(kmin > kmax, axis=-1)[None, :, None, :]  # [1, KVH, 1, nnz]
    upper = jnp.where(empty, -jnp.inf, upper)  # [B, KVH, G, nnz]
    num_indices = page_table.page_indices.shape[0]
    if per == "kv_head":
        upper = upper.max(axis=2)
    else:
        upper = upper.reshape(batch, num_heads, num_indices)
    owned = jnp.any(token_mask(page_table), axis=-1)  # [B, nnz]
    return jnp.where(owned[:, None, :], upper, -jnp.inf)


def quest_selected_pages(scores: jax.Array, page_table: PageTable, token_budget: int) -> jax.Array:
    """Which listed pages each (request, head) keeps: bool ``[B, R, nnz_padded]``.

    A request of ``n`` pages keeps ``min(n, max(token_budget // page_size, 2))`` of them: the
    budget in whole pages, but never fewer than its first and last page, which are always kept
    (the first holds the attention sinks, the last the recent tokens and the page being
    written). The rest go to the highest scores. Ties: among equal scores the page earlier in the
    request wins (a stable order by position), so the choice is deterministic. A NaN score ranks
    below every number.

    Args:
      scores: float ``[B, R, nnz_padded]`` from ``quest_page_scores``.
      page_table: the table the scores were computed over.
      token_budget: tokens to read per request and head, a Python int ``>= 1``.

    Raises:
      TypeError: ``token_budget`` not an int.
      ValueError: ``token_budget < 1``, ``scores`` not ``[B, R, nnz_padded]`` for the table.

    Example:
      >>> table = PageTable.from_page_lists([[7, 3, 5, 1, 2]], seq_lens=[18], page_size=4)
      >>> scores = jnp.array([[[0.0, 9.0, 1.0, 8.0, -5.0] + [0.0] * 11]])
      >>> quest_selected_pages(scores, table, token_budget=12)[0, 0, :5].tolist()
      [True, True, False, False, True]
    """
    check_token_budget(token_budget)
    check_scores_shape(scores, page_table)
    budget_pages = max(token_budget // page_table.page_size, 2)
    return _keep_top_pages(scores, page_table.page_indptr, jnp.int32(budget_pages))


@jax.jit  # one compilation per shape, whatever the budget (a traced argument here)
def _keep_top_pages(scores: jax.Array, page_indptr: jax.Array, budget_pages: jax.Array):
    num_indices = scores.shape[2]
    j = jnp.arange(num_indices)
    start = page_indptr[:-1, None]  # [B, 1]
    end = page_indptr[1:, None]
    owned = (start <= j) & (j < end)  # [B, nnz]
    forced = owned & ((j == start) | (j == end - 1))
    keep = jnp.minimum(end - start, budget_pages)  # [B, 1]

    def rank_row(score, owned_row, forced_row):
        # Order: owned before not, forced before not, high score before low, early before late.
        # jnp.lexsort sorts by its last key first; NaN sorts last, as -NaN is NaN.
        order = jnp.lexsort((j, -score, ~forced_row, ~owned_row))
        return (
            jnp.zeros(num_indices, jnp.int32)
            .at[order]
            .set(jnp.arange(num_indices, dtype=jnp.int32))
        )

    ranks = jax.vmap(jax.vmap(rank_row, in_axes=(0, None, None)))(scores, owned, forced)
    return owned[:, None, :] & (ranks < keep[:, :, None])


def head_split_cache(cache: KVCache) -> KVCache:
    """The pool as a one-KV-head pool of ``num_pages * num_kv_heads`` pages, HND.

    Page ``p * num_kv_heads + h`` of the view is KV head ``h`` of page ``p``. For an HND pool
    this is a reshape of contiguous memory (no copy); an NHD pool's heads are interleaved
    within a page, so its view is a transposed copy (a kernel would stride instead).

    Example:
      >>> from paged import new_kv_cache
      >>> head_split_cache(new_kv_cache(4, 16, 2, 8)).k_pages.shape
      (8, 1, 16, 8)
    """
    validate_kv_cache(cache)

    def split(pages):
        hnd = jnp.swapaxes(pages, 1, 2) if cache.layout == "NHD" else pages  # [P, KVH, S, D]
        num_pages, num_kv_heads, page_size, head_dim = hnd.shape
        return hnd.reshape(num_pages * num_kv_heads, 1, page_size, head_dim)

    return KVCache(split(cache.k_pages), split(cache.v_pages), "HND")


def head_split_page_table(
    page_table: PageTable, selected: jax.Array, num_kv_heads: int
) -> PageTable:
    """The virtual table of a per-head selection, over ``head_split_cache``'s pages.

    Row ``b * R + r`` lists, in their original order, the pages request ``b`` keeps for head
    ``r`` (KV head ``r * num_kv_heads // R``), numbered ``p * num_kv_heads + kv_head``. The last
    page keeps the request's ``last_page_len`` when selected (Quest always selects it), else a
    row's last listed page is full.

    Args:
      page_table: the requests' table.
      selected: bool ``[B, R, nnz_padded]``, a subset of each request's own pages
        (``quest_selected_pages``), ``R`` a multiple of ``num_kv_heads``.
      num_kv_heads: KV heads of the pool.

    Returns:
      A ``PageTable`` of ``B * R`` rows, ``page_indices`` padded to ``R * nnz_padded`` (at
      least ``MIN_INDICES``).
    """
    heads = selected.shape[1]
    if heads % num_kv_heads:
        raise ValueError(
            f"selected has {heads} heads, not a multiple of num_kv_heads={num_kv_heads}"
        )
    return _head_split_page_table(page_table, selected, num_kv_heads)


@functools.partial(jax.jit, static_argnums=2)
def _head_split_page_table(page_table: PageTable, selected: jax.Array, num_kv_heads: int):
    batch, heads, num_indices = selected.shape
    kv_head = jnp.arange(heads) * num_kv_heads // heads  # [R]
    pages = page_table.page_indices[None, None, :] * num_kv_heads + kv_head[None, :, None]
    indptr, indices = compact_rows(
        jnp.broadcast_to(pages, selected.shape).reshape(batch * heads, num_indices),
        selected.reshape(batch * heads, num_indices),
        max(heads * num_indices, MIN_INDICES),
    )
    last_entry = jnp.clip(page_table.page_indptr[1:] - 1, 0, max(num_indices - 1, 0))  # [B]
    if num_indices:
        keeps_last = selected[jnp.arange(batch), :, last_entry]  # [B, R]
    else:
        keeps_last = jnp.zeros((batch, heads), bool)
    last_len = jnp.where(keeps_last, page_table.last_page_len[:, None], page_table.page_size)
    has_pages = indptr[1:] > indptr[:-1]
    last_len = jnp.where(has_pages, last_len.reshape(-1), 0).astype(jnp.int32)
    return PageTable(indptr, indices, last_len, page_table.page_size)


@dataclasses.dataclass(frozen=True)
class QuestSelection:
    """A request for Quest selection inside ``paged.sparse_decode_attention``.

    Attributes:
      bounds: ``PageKeyBounds`` of the pool, current for every listed page.
      token_budget: tokens each (request, head) reads, a Python int ``>= 1``; rounded down to
        whole pages, never below the first and last page.
      per: ``"kv_head"`` or ``"query_head"`` (see the module docstring).
    """

    bounds: PageKeyBounds
    token_budget: int
    per: str = "kv_head"


jax.tree_util.register_dataclass(
    QuestSelection, data_fields=["bounds"], meta_fields=["token_budget", "per"]
)


def check_scores_shape(scores: jax.Array, page_table: PageTable) -> None:
    """Raises ValueError unless ``scores`` is ``[B, R, nnz_padded]`` for ``page_table`` (one
    score a table entry, per request and head row): the selection's input, reference or kernel."""
    batch = page_table.batch_size
    num_indices = page_table.page_indices.shape[0]
    if scores.ndim != 3 or scores.shape[0] != batch or scores.shape[2] != num_indices:
        raise ValueError(
            f"scores must have shape [{batch}, R, {num_indices}] for page_table, got {scores.shape}"
        )


def check_token_budget(token_budget) -> None:
    """Raises ``TypeError`` unless ``token_budget`` is an int, ``ValueError`` unless >= 1."""
    if isinstance(token_budget, bool) or not isinstance(token_budget, (int, np.integer)):
        raise TypeError(f"token_budget must be an int, got {token_budget!r}")
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")


def _check_bounds(bounds: PageKeyBounds) -> None:
    if bounds.kmin.ndim != 3 or bounds.kmin.shape != bounds.kmax.shape:
        raise ValueError(
            "bounds.kmin and bounds.kmax must share a [num_pages, num_kv_heads, head_dim] shape, "
            f"got {bounds.kmin.shape} and {bounds.kmax.shape}"
        )


def _check_query(q: jax.Array, num_kv_heads: int, head_dim: int) -> None:
    if q.ndim != 3:
        raise ValueError(f"q must have shape [batch, num_q_heads, head_dim], got {q.shape}")
    if q.shape[2] != head_dim:
        raise ValueError(f"q has head_dim {q.shape[2]} but the bounds have {head_dim}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(
            f"q's num_q_heads={q.shape[1]} is not a multiple of num_kv_heads={num_kv_heads}"
        )


def _check_table_fits(
    page_table: PageTable, num_pages: int, page_size: int, *, batch_size: int | None = None
) -> None:
    if page_table.page_size != page_size:
        raise ValueError(
            f"page_table.page_size={page_table.page_size} differs from the cache's "
            f"page_size={page_size}"
        )
    validate_page_table(page_table, num_pages, batch_size=batch_size)
