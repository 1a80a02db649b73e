"""Token-level sparse decode: attend over chosen token positions through a page-size-1 view.

DeepSeek sparse attention chooses, per request, the top-k tokens of its context (by a lightning
indexer, ``paged/sparse_indexer.py``) and attends over exactly those. With the pool seen as pages
of one token (``token_view_cache``), a chosen position is a page of its own: token ``t`` of a
request lives in page ``p = page_indices[page_indptr[b] + t // page_size]`` at slot
``t % page_size``, which is page ``p * page_size + t % page_size`` of the view. A selection then
is a page table of page size 1 (``token_page_table``) and the ordinary decode runs over it; no
key or value is copied (for an NHD pool; see ``token_view_cache``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.platform import is_concrete
from paged.kv_cache import KVCache, validate_kv_cache
from paged.page_table import PageTable
from paged.sparse_tables import MIN_INDICES, compact_rows


@dataclasses.dataclass(frozen=True)
class TokenSelection:
    """Per request, the positions (in its sequence) of the tokens to attend over.

    Attributes:
      positions: int32 ``[B, K]``; row ``b``'s first ``counts[b]`` entries are strictly
        increasing positions in ``[0, seq_len[b])``; the rest are padding, ignored.
      counts: int32 ``[B]``, each in ``[0, K]``.
    """

    positions: jax.Array | np.ndarray
    counts: jax.Array | np.ndarray


jax.tree_util.register_dataclass(
    TokenSelection, data_fields=["positions", "counts"], meta_fields=[]
)


def token_view_cache(cache: KVCache) -> KVCache:
    """The pool as ``num_pages * page_size`` pages of one token each, NHD.

    Page ``p * page_size + s`` of the view is slot ``s`` of page ``p``. For an NHD pool
    (``[P, S, KVH, D]``) this is a reshape of contiguous memory, no copy; an HND pool's slots
    are strided within each head, so its view is a transposed copy (a kernel would stride).

    Example:
      >>> from paged import new_kv_cache
      >>> token_view_cache(new_kv_cache(4, 16, 2, 8, layout="NHD")).k_pages.shape
      (64, 1, 2, 8)
    """
    validate_kv_cache(cache)

    def view(pages):
        nhd = cache.to_nhd(pages)  # [P, S, KVH, D]
        num_pages, page_size, num_kv_heads, head_dim = nhd.shape
        return nhd.reshape(num_pages * page_size, 1, num_kv_heads, head_dim)

    return KVCache(view(cache.k_pages), view(cache.v_pages), "NHD")


def validate_token_selection(selection: TokenSelection, page_table: PageTable) -> None:
    """Checks a token selection's shapes always and its values when concrete.

    Raises:
      ValueError: naming ``selection.positions`` or ``selection.counts`` and the bad value:
        wrong shape or dtype, a count outside ``[0, K]``, a position outside its request
        (``[0, seq_len)``), or positions not strictly increasing (a duplicate would count a
        key twice).
    """
    positions, counts = selection.positions, selection.counts
    batch = page_table.batch_size
    if positions.ndim != 2 or positions.shape[0] != batch:
        raise ValueError(
            f"selection.positions must have shape [{batch}, K] (one row a request), "
            f"got {positions.shape}"
        )
    if counts.shape != (batch,):
        raise ValueError(f"selection.counts must have shape [{batch}], got {counts.shape}")
    for name, array in [("positions", positions), ("counts", counts)]:
        if not jnp.issubdtype(array.dtype, jnp.integer):
            raise ValueError(f"selection.{name} must be an integer array, got {array.dtype}")
    if not is_concrete(positions, counts, page_table.page_indptr, page_table.last_page_len):
        return
    positions = np.asarray(positions)
    counts = np.asarray(counts)
    width = positions.shape[1]
    bad = (counts < 0) | (counts > width)
    if np.any(bad):
        b = int(np.argmax(bad))
        raise ValueError(f"selection.counts[{b}]={counts[b]} must be in [0, {width}]")
    seq_lens = np.asarray(page_table.seq_lens())
    for b in range(batch):
        row = positions[b, : counts[b]]
        outside = (row < 0) | (row >= seq_lens[b])
        if np.any(outside):
            i = int(np.argmax(outside))
            raise ValueError(
                f"selection.positions[{b}, {i}]={row[i]} is outside request {b}'s "
                f"positions [0, {seq_lens[b]})"
            )
        not_increasing = np.diff(row) <= 0
        if np.any(not_increasing):
            i = int(np.argmax(not_increasing))
            raise ValueError(
                f"selection.positions[{b}] must be strictly increasing, but "
                f"positions[{b}, {i}]={row[i]} >= positions[{b}, {i + 1}]={row[i + 1]}"
            )


def token_page_table(page_table: PageTable, selection: TokenSelection) -> PageTable:
    """The page-size-1 table over ``token_view_cache`` that lists each request's chosen tokens.

    Row ``b`` lists ``page * page_size + slot`` for each chosen position, in the selection's
    order; every page holds one token (``last_page_len`` 1, or 0 for a row that chose none).
    Under ``jit`` a position outside its request or a padding entry cannot be rejected: it is
    left out, so nothing outside the request is ever read.

    Args:
      page_table: the requests' table (pages of ``page_size`` tokens).
      selection: ``TokenSelection`` with ``B`` rows.

    Returns:
      A ``PageTable`` with ``page_size=1``, ``page_indices`` of ``max(B * K, 1)`` entries.

    Raises:
      ValueError: as ``validate_token_selection``.

    Example:
      >>> table = PageTable.from_page_lists([[3, 1]], seq_lens=[6], page_size=4)
      >>> chosen = TokenSelection(jnp.array([[0, 5, 0]]), jnp.array([2]))
      >>> view = token_page_table(table, chosen)
      >>> view.page_lists(), view.last_page_len.tolist()
      ([[12, 5]], [1])
    """
    validate_token_selection(selection, page_table)
    return _token_page_table(page_table, selection)


@jax.jit  # one compilation per shape: the eager version is dozens of small dispatches
def _token_page_table(page_table: PageTable, selection: TokenSelection) -> PageTable:
    positions = selection.positions.astype(jnp.int32)
    batch, width = positions.shape
    page_size = page_table.page_size
    seq_lens = page_table.seq_lens()
    chosen = (
        (jnp.arange(width)[None, :] < selection.counts[:, None])
        & (positions >= 0)
        & (positions < seq_lens[:, None])
    )
    entry = page_table.page_indptr[:-1, None] + positions // page_size
    entry = jnp.clip(entry, 0, max(page_table.page_indices.shape[0] - 1, 0))
    if page_table.page_indices.shape[0]:
        pages = page_table.page_indices[entry]
    else:  # no pages at all: nothing can be chosen
        pages = jnp.zeros_like(entry)
    slots = pages * page_size + positions % page_size
    indptr, indices = compact_rows(slots, chosen, max(batch * width, MIN_INDICES))
    last = jnp.where(indptr[1:] > indptr[:-1], 1, 0).astype(jnp.int32)
    return PageTable(indptr, indices, last, 1)
