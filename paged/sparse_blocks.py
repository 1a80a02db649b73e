"""Block-sparse masks in BSR form, read as a page table whose page size is the block size.

A block-sparse mask over a request's keys, in block compressed sparse row form (as FlashInfer's
block-sparse attention takes it), lists per query block the key blocks it attends to. In decode
each request's one new token is its query block, so the mask is per request:

- ``block_indptr[B + 1]``: request ``b``'s key blocks are
  ``block_indices[block_indptr[b]:block_indptr[b + 1]]``;
- ``block_indices[nnz]``: key block numbers in the request's sequence (block ``i`` covers
  positions ``[i * block_size, (i + 1) * block_size)``), strictly increasing per request.

With ``block_size == page_size`` key block ``i`` of request ``b`` is exactly its ``i``-th page,
so the mask is a CSR page table once block numbers become page numbers (``block_page_table``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.platform import is_concrete
from paged.page_table import PageTable, check_csr_offsets
from paged.sparse_tables import MIN_INDICES, compact_rows


@dataclasses.dataclass(frozen=True)
class BlockSelection:
    """A decode block-sparse mask in BSR form (a pytree; ``block_size`` is static).

    Attributes:
      block_indptr: int32 ``[B + 1]``, CSR offsets into ``block_indices``.
      block_indices: int32 ``[nnz_padded]``, per request strictly increasing key block numbers
        in ``[0, num_pages[b])``; entries past ``block_indptr[-1]`` are ignored.
      block_size: tokens per key block; must equal the page table's ``page_size``.
    """

    block_indptr: jax.Array | np.ndarray
    block_indices: jax.Array | np.ndarray
    block_size: int


jax.tree_util.register_dataclass(
    BlockSelection, data_fields=["block_indptr", "block_indices"], meta_fields=["block_size"]
)


def validate_block_selection(selection: BlockSelection, page_table: PageTable) -> None:
    """Checks a BSR mask against the table: shapes always, values when concrete.

    Raises:
      ValueError: naming the ``selection`` field and the bad value: ``block_size`` other than
        ``page_table.page_size``, non-int32 or non-1-D arrays, ``block_indptr`` of the wrong
        length, not starting at 0, decreasing or past ``block_indices``, a block outside its
        request's pages, or a request's blocks not strictly increasing.
    """
    if selection.block_size != page_table.page_size:
        raise ValueError(
            f"selection.block_size={selection.block_size} must equal page_table.page_size="
            f"{page_table.page_size} (a key block is a page)"
        )
    for name in ("block_indptr", "block_indices"):
        array = getattr(selection, name)
        if array.dtype != jnp.int32 or array.ndim != 1:
            raise ValueError(
                f"selection.{name} must be 1-D int32, got {array.dtype} of shape {array.shape}"
            )
    batch = page_table.batch_size
    if selection.block_indptr.shape != (batch + 1,):
        raise ValueError(
            f"selection.block_indptr must have shape [{batch + 1}] for {batch} requests, "
            f"got {selection.block_indptr.shape}"
        )
    if not is_concrete(
        selection.block_indptr,
        selection.block_indices,
        page_table.page_indptr,
        page_table.last_page_len,
    ):
        return
    indptr = np.asarray(selection.block_indptr)
    indices = np.asarray(selection.block_indices)
    check_csr_offsets(indptr, "selection", "block_indptr", "block_indices", indices.shape[0])
    num_pages = np.asarray(page_table.num_pages())
    for b in range(batch):
        row = indices[indptr[b] : indptr[b + 1]]
        outside = (row < 0) | (row >= num_pages[b])
        if np.any(outside):
            i = int(indptr[b] + np.argmax(outside))
            raise ValueError(
                f"selection.block_indices[{i}]={indices[i]} is outside request {b}'s key blocks "
                f"[0, {num_pages[b]})"
            )
        if np.any(np.diff(row) <= 0):
            i = int(indptr[b] + np.argmax(np.diff(row) <= 0))
            raise ValueError(
                f"selection.block_indices of request {b} must be strictly increasing, but "
                f"block_indices[{i}]={indices[i]} >= block_indices[{i + 1}]={indices[i + 1]}"
            )


def block_page_table(page_table: PageTable, selection: BlockSelection) -> PageTable:
    """The virtual page table of a BSR mask: each request's chosen pages, in block order.

    Key block ``i`` of request ``b`` becomes page ``page_indices[page_indptr[b] + i]``; the
    request's last block keeps its ``last_page_len``, every other block is a full page. Under
    ``jit`` a block outside its request cannot be rejected: it is left out, never read.

    Args:
      page_table: the requests' table.
      selection: ``BlockSelection`` with ``block_size == page_table.page_size``.

    Returns:
      A ``PageTable`` over the same pool, ``page_indices`` as long as ``block_indices``.

    Raises:
      ValueError: as ``validate_block_selection``.

    Example:
      >>> table = PageTable.from_page_lists([[4, 2, 7]], seq_lens=[10], page_size=4)
      >>> mask = BlockSelection(jnp.array([0, 2], jnp.int32), jnp.array([0, 2], jnp.int32), 4)
      >>> view = block_page_table(table, mask)
      >>> view.page_lists(), view.last_page_len.tolist()
      ([[4, 7]], [2])
    """
    validate_block_selection(selection, page_table)
    return _block_page_table(page_table, selection)


@jax.jit  # one compilation per shape: the eager version is dozens of small dispatches
def _block_page_table(page_table: PageTable, selection: BlockSelection) -> PageTable:
    indptr, blocks = selection.block_indptr, selection.block_indices
    entries = jnp.arange(blocks.shape[0])[None, :]
    num_pages = page_table.num_pages()[:, None]  # [B, 1]
    # [B, width]: entry e is request b's when it lies in b's BSR row and names one of its pages.
    chosen = (
        (indptr[:-1, None] <= entries)
        & (entries < indptr[1:, None])
        & (blocks >= 0)
        & (blocks < num_pages)
    )
    entry = page_table.page_indptr[:-1, None] + blocks[None, :]
    entry = jnp.clip(entry, 0, max(page_table.page_indices.shape[0] - 1, 0))
    if page_table.page_indices.shape[0]:
        pages = page_table.page_indices[entry]
    else:  # no pages at all: nothing can be chosen
        pages = jnp.zeros_like(entry)
    new_indptr, new_indices = compact_rows(pages, chosen, max(blocks.shape[0], MIN_INDICES))
    # A row's last listed page is the request's last page exactly when its last valid block is.
    last_block = jnp.max(jnp.where(chosen, blocks[None, :], -1), axis=1, initial=-1)  # [B]
    last_len = jnp.where(
        last_block == num_pages[:, 0] - 1, page_table.last_page_len, page_table.page_size
    )
    last_len = jnp.where(new_indptr[1:] > new_indptr[:-1], last_len, 0).astype(jnp.int32)
    return PageTable(new_indptr, new_indices, last_len, page_table.page_size)
