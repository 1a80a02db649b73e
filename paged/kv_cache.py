"""The paged KV pool and the append of new tokens into it.

Two layouts (``design.md``):

- ``"HND"``: ``[num_pages, num_kv_heads, page_size, head_dim]``. One (page, head) is a contiguous
  ``[page_size, head_dim]`` tile (4 KiB at 16 x 128 bfloat16), which is what the decode kernel
  streams; the default.
- ``"NHD"``: ``[num_pages, page_size, num_kv_heads, head_dim]``. One token's heads are
  contiguous, which suits appends.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.platform import is_concrete
from paged.page_table import PageTable, validate_page_table

LAYOUTS = ("HND", "NHD")
# A page index past any pool: scatters with mode="drop" skip tokens sent there.
INVALID_PAGE = np.iinfo(np.int32).max

if TYPE_CHECKING:  # paged.sparse_quest imports this module: named for annotations only
    from paged.sparse_quest import PageKeyBounds


@dataclasses.dataclass(frozen=True)
class KVCache:
    """Key and value pages of one attention layer (a pytree; ``layout`` is static).

    Attributes:
      k_pages: ``[num_pages, num_kv_heads, page_size, head_dim]`` (HND) or
        ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD).
      v_pages: same shape and dtype as ``k_pages``.
      layout: ``"HND"`` or ``"NHD"``.
    """

    k_pages: jax.Array
    v_pages: jax.Array
    layout: str = "HND"

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2] if self.layout == "HND" else self.k_pages.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_pages.shape[1] if self.layout == "HND" else self.k_pages.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k_pages.shape[3]

    @property
    def dtype(self):
        return self.k_pages.dtype

    def to_nhd(self, pages: jax.Array) -> jax.Array:
        """``pages`` (this cache's layout) as ``[..., page_size, num_kv_heads, head_dim]``."""
        return jnp.swapaxes(pages, -3, -2) if self.layout == "HND" else pages


jax.tree_util.register_dataclass(
    KVCache, data_fields=["k_pages", "v_pages"], meta_fields=["layout"]
)


def validate_kv_cache(cache: KVCache) -> None:
    """Raises ValueError if the cache's layout, shapes or dtypes are inconsistent."""
    if cache.layout not in LAYOUTS:
        raise ValueError(f"cache.layout must be one of {LAYOUTS}, got {cache.layout!r}")
    if cache.k_pages.ndim != 4:
        raise ValueError(f"cache.k_pages must be 4-D, got shape {cache.k_pages.shape}")
    if cache.k_pages.shape != cache.v_pages.shape:
        raise ValueError(
            f"cache.k_pages {cache.k_pages.shape} and cache.v_pages {cache.v_pages.shape} differ"
        )
    if cache.k_pages.dtype != cache.v_pages.dtype:
        raise ValueError(
            f"cache.k_pages dtype {cache.k_pages.dtype} differs from cache.v_pages dtype "
            f"{cache.v_pages.dtype}"
        )


def new_kv_cache(
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype=jnp.bfloat16,
    layout: str = "HND",
) -> KVCache:
    """An all-zero KV pool.

    Example:
      >>> new_kv_cache(8, 16, 2, 64, layout="NHD").k_pages.shape
      (8, 16, 2, 64)
    """
    for name, value in [
        ("num_pages", num_pages),
        ("page_size", page_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ]:
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "HND":
        shape = (num_pages, num_kv_heads, page_size, head_dim)
    else:
        shape = (num_pages, page_size, num_kv_heads, head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), layout)


def token_slots(
    page_table: PageTable, batch_indices: jax.Array, positions: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Where token ``positions[i]`` of request ``batch_indices[i]`` lives: ``(page, slot)``.

    Returns:
      ``(pages int32[nnz], slots int32[nnz])``. A token whose request or position is outside
      the table (possible only under ``jit``, where ``append_kv`` cannot validate) gets page
      ``INVALID_PAGE``, past any pool, so a scatter with ``mode="drop"`` drops it instead of
      writing into a page another request reads. (Not -1: JAX indexing wraps negative indices.)
      A negative entry of ``page_indices`` is dropped the same way; one past the pool is
      dropped by the scatter itself.
    """
    page_size = page_table.page_size
    batch = jnp.clip(batch_indices, 0, page_table.batch_size - 1)
    lengths = page_table.seq_lens()[batch]
    valid = (
        (batch_indices >= 0)
        & (batch_indices < page_table.batch_size)
        & (positions >= 0)
        & (positions < lengths)
    )
    flat = page_table.page_indptr[batch] + positions // page_size
    flat = jnp.clip(flat, 0, page_table.page_indices.shape[0] - 1)
    pages = page_table.page_indices[flat]
    # A negative page number (a corrupt table under jit) would wrap to the end of the pool.
    pages = jnp.where(valid & (pages >= 0), pages, INVALID_PAGE)
    return pages.astype(jnp.int32), (positions % page_size).astype(jnp.int32)


def written_keys(cache: KVCache, pages: jax.Array, slots: jax.Array) -> jax.Array:
    """The keys the pool holds at ``(pages[i], slots[i])`` (``token_slots``'s answer).

    Returns:
      ``[nnz, num_kv_heads, head_dim]`` in the cache's dtype. A page outside the pool
      (``INVALID_PAGE``: a token the append dropped) reads page 0; whoever uses the key must drop
      it as the append did (a scatter with ``mode="drop"`` at the same ``pages`` does).
    """
    pages = jnp.where(pages < cache.num_pages, pages, 0)
    if cache.layout == "HND":  # [P, KVH, S, D]: the two gathered axes go first, [nnz, KVH, D]
        return cache.k_pages[pages, :, slots]
    return cache.k_pages[pages, slots]  # [P, S, KVH, D]


def _validate_append(cache, page_table, k_new, v_new, batch_indices, positions):
    validate_kv_cache(cache)
    validate_page_table(page_table, cache.num_pages)
    if page_table.page_size != cache.page_size:
        raise ValueError(
            f"page_table.page_size={page_table.page_size} differs from the cache's "
            f"page_size={cache.page_size}"
        )
    expected = (cache.num_kv_heads, cache.head_dim)
    for name, array in [("k_new", k_new), ("v_new", v_new)]:
        if array.ndim != 3 or array.shape[1:] != expected:
            raise ValueError(
                f"{name} must have shape [nnz, {expected[0]}, {expected[1]}], got {array.shape}"
            )
    if k_new.shape != v_new.shape:
        raise ValueError(f"k_new {k_new.shape} and v_new {v_new.shape} differ")
    nnz = k_new.shape[0]
    for name, array in [("batch_indices", batch_indices), ("positions", positions)]:
        if array.shape != (nnz,):
            raise ValueError(f"{name} must have shape [{nnz}], got {array.shape}")
        if not jnp.issubdtype(array.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {array.dtype}")
    if not is_concrete(batch_indices, positions, page_table.page_indptr, page_table.last_page_len):
        return
    batch = np.asarray(batch_indices)
    pos = np.asarray(positions)
    bad = (batch < 0) | (batch >= page_table.batch_size)
    if np.any(bad):
        i = int(np.argmax(bad))
        raise ValueError(
            f"batch_indices[{i}]={batch[i]} is outside the batch of {page_table.batch_size}"
        )
    lengths = np.asarray(page_table.seq_lens())[batch]
    bad = (pos < 0) | (pos >= lengths)
    if np.any(bad):
        i = int(np.argmax(bad))
        raise ValueError(
            f"positions[{i}]={pos[i]} is outside request {batch[i]}'s length {lengths[i]} "
            "(page_table must already cover the appended tokens)"
        )
    pairs = batch.astype(np.int64) * (int(lengths.max(initial=0)) + 1) + pos
    unique, counts = np.unique(pairs, return_counts=True)
    if np.any(counts > 1):
        i = int(np.flatnonzero(np.isin(pairs, unique[counts > 1]))[0])
        raise ValueError(
            f"(batch_indices, positions)=({batch[i]}, {pos[i]}) appears more than once"
        )
    if is_concrete(page_table.page_indices):
        _check_distinct_slots(page_table, batch, pos)


def _check_distinct_slots(page_table: PageTable, batch: np.ndarray, pos: np.ndarray) -> None:
    """Raises if two tokens land in the same (page, slot): two requests sharing a page would
    both write it, and the scatter would silently keep one of them."""
    page_size = page_table.page_size
    flat = np.asarray(page_table.page_indptr)[batch] + pos // page_size
    pages = np.asarray(page_table.page_indices)[flat].astype(np.int64)
    slots = (pos % page_size).astype(np.int64)
    _, first, counts = np.unique(pages * page_size + slots, return_index=True, return_counts=True)
    if np.any(counts > 1):
        i = int(first[np.argmax(counts > 1)])
        clash = (pages == pages[i]) & (slots == slots[i])
        j = int(np.flatnonzero(clash)[1])
        raise ValueError(
            f"tokens {i} (batch_indices={batch[i]}, positions={pos[i]}) and {j} "
            f"(batch_indices={batch[j]}, positions={pos[j]}) would both write page {pages[i]}, "
            f"slot {slots[i]}: the requests share that page; copy it to a private page before "
            "writing (copy-on-write is the caller's job)"
        )


def append_kv(
    cache: KVCache,
    page_table: PageTable,
    k_new: jax.Array,
    v_new: jax.Array,
    batch_indices: jax.Array,
    positions: jax.Array,
    *,
    key_bounds: PageKeyBounds | None = None,
) -> KVCache | tuple[KVCache, PageKeyBounds]:
    """Writes ragged new tokens into their pages (reference; returns a new cache).

    Token ``i`` goes to page ``page_indices[page_indptr[b] + p // page_size]``, slot
    ``p % page_size``, for ``b = batch_indices[i]`` and ``p = positions[i]``.

    Args:
      cache: the KV pool.
      page_table: the table as it stands after the append (it already covers the new tokens).
      k_new, v_new: ``[nnz, num_kv_heads, head_dim]`` in the cache's dtype (cast otherwise).
      batch_indices: int ``[nnz]``, the request of each token.
      positions: int ``[nnz]``, each token's position in its request.
      key_bounds: optional ``paged.PageKeyBounds`` of the pool (Quest's per-page key bounds,
        ``[num_pages, num_kv_heads, head_dim]`` each, any floating dtype), kept up to date by
        this append when given: ``paged.append_page_key_bounds`` after the write (a page whose
        slot 0 is written restarts, then each written key, as the pool now holds it, widens its
        page's bounds; a dropped token touches nothing). There is no kernel here: this is the
        reference composition, also on a GPU.

    Returns:
      The updated cache; with ``key_bounds``, ``(cache, bounds)``, the bounds in their own dtype.

    Pages shared between requests (a common prompt prefix, ``PagePool.share``) are read-only
    here: writing a shared page is the caller's to avoid, by copying it to a private page first
    (copy-on-write) and pointing the writer's table at the copy. With concrete inputs, two
    tokens that would write the same (page, slot) raise ``ValueError``; under ``jit`` they cannot
    be detected and one of the two writes is silently kept. The serving engine never needs the
    copy (``serving/scheduler.py``): it shares only full prefix pages whose keys and values are
    already computed, writes only positions past a request's shared prefix, and keeps each
    request's last, partially filled page private.

    Under ``jit`` the value checks below cannot run: a token whose request or position is outside
    the table, or whose page index is negative or outside the pool, is dropped (not written);
    nothing is written outside the pool.

    Raises:
      ValueError: for shape mismatches, and (concrete inputs) a position outside its request's
        length, a batch index outside the batch, the same (request, position) twice, two tokens
        writing the same (page, slot) of a shared page, and page-table invariants; ``key_bounds``
        not a ``PageKeyBounds`` of this pool's pages, KV heads and head_dim.

    Example:
      >>> cache = new_kv_cache(4, 2, 1, 1, jnp.float32, layout="NHD")
      >>> table = PageTable.from_page_lists([[2, 0]], seq_lens=[3], page_size=2)
      >>> k = jnp.arange(3.0).reshape(3, 1, 1)
      >>> out = append_kv(cache, table, k, k, jnp.zeros(3, jnp.int32), jnp.arange(3))
      >>> out.k_pages[:, :, 0, 0].tolist()
      [[2.0, 0.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]]
    """
    _validate_append(cache, page_table, k_new, v_new, batch_indices, positions)
    if key_bounds is not None:
        # A late import: paged.sparse_quest imports this module (KVCache, token_slots).
        from paged.sparse_quest import append_page_key_bounds, validate_key_bounds

        validate_key_bounds(key_bounds, cache)
    pages, slots = token_slots(page_table, batch_indices, positions)
    k_new = k_new.astype(cache.dtype)
    v_new = v_new.astype(cache.dtype)
    if cache.layout == "NHD":
        k_pages = cache.k_pages.at[pages, slots].set(k_new, mode="drop")
        v_pages = cache.v_pages.at[pages, slots].set(v_new, mode="drop")
    else:
        k_pages = cache.k_pages.at[pages, :, slots].set(k_new, mode="drop")
        v_pages = cache.v_pages.at[pages, :, slots].set(v_new, mode="drop")
    cache = KVCache(k_pages, v_pages, cache.layout)
    if key_bounds is None:
        return cache
    return cache, append_page_key_bounds(key_bounds, cache, page_table, batch_indices, positions)
