"""Building a virtual page table from chosen entries: the one step every sparse selection shares.

A sparse selection (Quest's top pages, a token top-k, a block-sparse mask) ends as, per row of
a batch, some entries of a fixed-width candidate array chosen by a flag. A page table wants them
compacted: each row's chosen entries back to back, in candidate order, with CSR offsets. This
file does that compaction with static shapes, so the selections stay ``jit``-able.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The fewest entries a virtual table's page_indices gets: the reference decode reduces over
# every listed slot, which fails on a table of no slots at all (a batch of 0, a selection of 0).
MIN_INDICES = 1


def compact_rows(
    values: jax.Array, chosen: jax.Array, num_indices: int
) -> tuple[jax.Array, jax.Array]:
    """CSR offsets and concatenated entries of each row's chosen values, in column order.

    Args:
      values: int ``[rows, width]``, the candidates of each row.
      chosen: bool ``[rows, width]``, which candidates a row keeps.
      num_indices: static length of the returned entries (at least the number chosen; entries
        past the last chosen one hold 0, as a padded ``page_indices`` does).

    Returns:
      ``(indptr int32[rows + 1], entries int32[num_indices])``. A chosen value that does not
      fit in ``num_indices`` is dropped (a caller bug: size ``num_indices`` from the widths).

    Example:
      >>> values = jnp.array([[5, 6, 7], [8, 9, 4]])
      >>> chosen = jnp.array([[True, False, True], [False, False, True]])
      >>> indptr, entries = compact_rows(values, chosen, 4)
      >>> indptr.tolist(), entries.tolist()
      ([0, 2, 3], [5, 7, 4, 0])
    """
    counts = jnp.sum(chosen, axis=1, dtype=jnp.int32)
    indptr = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
    # Entry (r, c) goes to indptr[r] + (how many of row r's chosen entries come before it).
    rank_in_row = jnp.cumsum(chosen, axis=1, dtype=jnp.int32) - 1
    destination = jnp.where(chosen, indptr[:-1, None] + rank_in_row, num_indices)
    entries = (
        jnp.zeros(num_indices, jnp.int32)
        .at[destination.reshape(-1)]
        .set(values.reshape(-1).astype(jnp.int32), mode="drop")
    )
    return indptr, entries
