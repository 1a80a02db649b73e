"""The lightning indexer of DeepSeek sparse attention (reference): which tokens a query reads.

Each token of the context has a small indexer key ``k_s`` (``index_dim`` wide, one head), kept in
its own paged cache beside the KV pool, ``[num_pages, page_size, index_dim]``, under the same
page table. The new token brings ``H_I`` indexer queries ``q_h`` and per-head weights ``w_h``, and
scores every token ``s`` of its request:

    I[s] = sum_h w_h * ReLU(q_h . k_s)

The ``top_k`` highest-scoring tokens (all of them when the request is shorter) are the ones
every attention head then reads: one selection per request, shared by all heads.

Which tokens are candidates: positions ``0 .. seq_len - 1`` of the request, i.e. the new token's
own position included (its key, like its K and V, is appended before the step attends, and a
causal mask lets a token see itself). Unwritten slots, padding and other requests' pages never
are. Ties: at equal scores the earlier position wins. The selection lists positions in
increasing order (``TokenSelection``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.platform import is_concrete
from paged.attention_reference import token_mask, token_positions
from paged.kv_cache import token_slots
from paged.page_table import PageTable, validate_page_table
from paged.sparse_tokens import TokenSelection

DEFAULT_TOP_K = 2048


def append_index_keys(
    index_k_pages: jax.Array,
    page_table: PageTable,
    k_index_new: jax.Array,
    batch_indices: jax.Array,
    positions: jax.Array,
) -> jax.Array:
    """Writes new tokens' indexer keys into their pages (reference; returns the new pool).

    The same placement as ``paged.append_kv``: token ``i`` goes to slot ``positions[i] %
    page_size`` of its request's page for that position; the table already covers it. Under
    ``jit`` a token outside the table is dropped, never written elsewhere.

    Args:
      index_k_pages: ``[num_pages, page_size, index_dim]``.
      page_table: the table after the append.
      k_index_new: ``[nnz, index_dim]`` (cast to the pool's dtype).
      batch_indices, positions: int ``[nnz]``, each token's request and position.

    Raises:
      ValueError: mismatched shapes, and (concrete inputs) a request or position outside the
        table, or page-table invariants.

    Example:
      >>> table = PageTable.from_page_lists([[1]], seq_lens=[2], page_size=2)
      >>> pool = append_index_keys(jnp.zeros((2, 2, 1)), table, jnp.array([[5.0], [6.0]]),
      ...                          jnp.zeros(2, jnp.int32), jnp.arange(2))
      >>> pool[:, :, 0].tolist()
      [[0.0, 0.0], [5.0, 6.0]]
    """
    if index_k_pages.ndim != 3 or index_k_pages.shape[1] != page_table.page_size:
        raise ValueError(
            f"index_k_pages must have shape [num_pages, {page_table.page_size}, index_dim], "
            f"got {index_k_pages.shape}"
        )
    nnz = k_index_new.shape[0]
    if k_index_new.shape != (nnz, index_k_pages.shape[2]):
        raise ValueError(
            f"k_index_new must have shape [nnz, {index_k_pages.shape[2]}], got {k_index_new.shape}"
        )
    validate_page_table(page_table, index_k_pages.shape[0])
    for name, array in [("batch_indices", batch_indices), ("positions", positions)]:
        if array.shape != (nnz,) or not jnp.issubdtype(array.dtype, jnp.integer):
            raise ValueError(
                f"{name} must be an integer array of shape [{nnz}], got {array.dtype} "
                f"of shape {array.shape}"
            )
    if is_concrete(batch_indices, positions, page_table.page_indptr, page_table.last_page_len):
        batch = np.asarray(batch_indices)
        pos = np.asarray(positions)
        in_batch = (batch >= 0) & (batch < page_table.batch_size)
        lengths = np.asarray(page_table.seq_lens())[np.where(in_batch, batch, 0)]
        bad = ~in_batch | (pos < 0) | (pos >= lengths)
        if np.any(bad):
            i = int(np.argmax(bad))
            raise ValueError(
                f"(batch_indices[{i}], positions[{i}])=({batch[i]}, {pos[i]}) is outside the "
                "table (it must already cover the appended tokens)"
            )
    pages, slots = token_slots(page_table, batch_indices, positions)  # INVALID_PAGE: dropped
    return index_k_pages.at[pages, slots].set(k_index_new.astype(index_k_pages.dtype), mode="drop")


def lightning_indexer_scores(
    q_index: jax.Array,
    head_weights: jax.Array,
    index_k_pages: jax.Array,
    page_table: PageTable,
) -> jax.Array:
    """Indexer scores of every slot the table lists: ``sum_h w_h * ReLU(q_h . k_s)``.

    Args:
      q_index: ``[B, H_I, index_dim]``, the new token's indexer queries.
      head_weights: ``[B, H_I]``, its per-head weights (any scale folded in by the caller).
      index_k_pages: ``[num_pages, page_size, index_dim]``, the indexer keys' pool.
      page_table: the requests' pages (the KV pool's table).

    Returns:
      float ``[B, nnz_padded * page_size]`` (float32, float64 for float64 inputs): entry
      ``[b, j * page_size + t]`` scores slot ``t`` of ``page_indices[j]`` for request b, ``-inf``
      where that slot holds none of b's tokens.

    Raises:
      ValueError: shapes that do not match, and page-table invariants (concrete).

    Example:
      >>> keys = jnp.array([[[1.0], [-1.0]]])  # one page of two tokens, index_dim 1
      >>> table = PageTable.from_page_lists([[0]], seq_lens=[2], page_size=2)
      >>> q_index = jnp.array([[[2.0], [-1.0]]])  # two indexer heads
      >>> scores = lightning_indexer_scores(q_index, jnp.ones((1, 2)), keys, table)
      >>> scores[0, :3].tolist()  # ReLU(2) + ReLU(-1), ReLU(-2) + ReLU(1), no token
      [2.0, 1.0, -inf]
    """
    _check_indexer_inputs(q_index, head_weights, index_k_pages, page_table)
    return _indexer_scores(q_index, head_weights, index_k_pages, page_table)


@jax.jit  # one compilation per shape: the eager version is many small dispatches
def _indexer_scores(q_index, head_weights, index_k_pages, page_table: PageTable) -> jax.Array:
    dtype = jnp.promote_types(jnp.result_type(q_index, head_weights, index_k_pages), jnp.float32)
    keys = index_k_pages[page_table.page_indices].astype(dtype)  # [nnz, page_size, index_dim]
    keys = keys.reshape(-1, keys.shape[-1])  # [nnz * page_size, index_dim]
    dots = jnp.einsum("bhd,sd->bhs", q_index.astype(dtype), keys, precision="highest")
    scores = jnp.einsum("bh,bhs->bs", head_weights.astype(dtype), jax.nn.relu(dots))
    mine = token_mask(page_table).reshape(page_table.batch_size, -1)
    return jnp.where(mine, scores, -jnp.inf)


def lightning_indexer_top_k(
    q_index: jax.Array,
    head_weights: jax.Array,
    index_k_pages: jax.Array,
    page_table: PageTable,
    *,
    top_k: int = DEFAULT_TOP_K,
) -> TokenSelection:
    """The ``top_k`` positions of each request by indexer score, shared by all heads.

    Args:
      q_index, head_weights, index_k_pages, page_table: as in ``lightning_indexer_scores``.
      top_k: tokens to keep per request, a Python int ``>= 1``; a request with fewer tokens
        keeps them all.

    Returns:
      ``TokenSelection`` with ``positions`` ``[B, min(top_k, nnz_padded * page_size)]`` in
      increasing order per row (padding 0) and ``counts = min(top_k, seq_len)``.

    Raises:
      TypeError: ``top_k`` not an int.
      ValueError: ``top_k < 1``, and as ``lightning_indexer_scores``.

    Example:
      >>> keys = jnp.array([[[3.0], [1.0], [2.0]]])
      >>> table = PageTable.from_page_lists([[0]], seq_lens=[3], page_size=3)
      >>> chosen = lightning_indexer_top_k(
      ...     jnp.ones((1, 1, 1)), jnp.ones((1, 1)), keys, table, top_k=2)
      >>> chosen.positions.tolist(), chosen.counts.tolist()
      ([[0, 2]], [2])
    """
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
        raise TypeError(f"top_k must be an int, got {top_k!r}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    _check_indexer_inputs(q_index, head_weights, index_k_pages, page_table)
    return _indexer_top_k(q_index, head_weights, index_k_pages, page_table, int(top_k))


@functools.partial(jax.jit, static_argnums=4)
def _indexer_top_k(q_index, head_weights, index_k_pages, page_table: PageTable, top_k: int):
    scores = _indexer_scores(q_index, head_weights, index_k_pages, page_table)
    batch, num_slots = scores.shape
    width = min(top_k, num_slots)
    mine = token_mask(page_table).reshape(batch, num_slots)
    positions = token_positions(page_table).reshape(batch, num_slots)
    # Order: the request's own tokens first, high score before low, early position before late.
    order = jax.vmap(lambda s, m, p: jnp.lexsort((p, -s, ~m)))(scores, mine, positions)
    counts = jnp.minimum(page_table.seq_lens(), width).astype(jnp.int32)
    taken = jnp.take_along_axis(positions, order[:, :width], axis=1)  # [B, width]
    used = jnp.arange(width)[None, :] < counts[:, None]
    # Sort each row's kept positions; padding sorts last (a big key), then reads 0.
    kept = jnp.sort(jnp.where(used, taken, jnp.iinfo(jnp.int32).max), axis=1)
    return TokenSelection(jnp.where(used, kept, 0).astype(jnp.int32), counts)


def _check_indexer_inputs(q_index, head_weights, index_k_pages, page_table: PageTable) -> None:
    batch = page_table.batch_size
    if q_index.ndim != 3 or q_index.shape[0] != batch:
        raise ValueError(
            f"q_index must have shape [{batch}, num_index_heads, index_dim], got {q_index.shape}"
        )
    if head_weights.shape != q_index.shape[:2]:
        raise ValueError(
            f"head_weights must have shape {q_index.shape[:2]} (q_index's batch and heads), "
            f"got {head_weights.shape}"
        )
    if index_k_pages.ndim != 3 or index_k_pages.shape[1:] != (
        page_table.page_size,
        q_index.shape[2],
    ):
        raise ValueError(
            f"index_k_pages must have shape [num_pages, {page_table.page_size}, "
            f"{q_index.shape[2]}] (the table's page_size, q_index's index_dim), "
            f"got {index_k_pages.shape}"
        )
    validate_page_table(page_table, index_k_pages.shape[0], batch_size=batch)
