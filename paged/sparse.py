"""Sparse decode attention: a selection becomes a page table, and the ordinary decode runs on it.

One public entry, ``sparse_decode_attention``, for three kinds of selection
(``docs/sparse_decode.md``):

- ``QuestSelection`` (``paged/sparse_quest.py``): top pages per (request, head) by Quest's key
  bounds, first and last page always kept; a table of ``B * R`` rows over a head-split view.
- ``TokenSelection`` (``paged/sparse_tokens.py``): chosen token positions per request (e.g. the
  lightning indexer's top-k, ``paged/sparse_indexer.py``); a table of page size 1 over a
  token view of the pool.
- ``BlockSelection`` (``paged/sparse_blocks.py``): a BSR block mask with blocks of one page; a
  table over the pool itself.

Every kind ends in ``paged.decode_attention`` on the virtual table, so the backends, the kill
switch ``DECODELAB_BACKEND=reference`` and the Pallas decode kernel are the existing ones,
unchanged; ``backend="reference"`` is the float64-checkable reference.
"""

from __future__ import annotations

import jax

from paged.decode import _static_float, decode_attention, validate_decode_inputs
from paged.kv_cache import KVCache
from paged.page_table import PageTable
from paged.sparse_blocks import BlockSelection, block_page_table
from paged.sparse_quest import (
    QuestSelection,
    check_token_budget,
    head_split_cache,
    head_split_page_table,
    quest_page_scores,
    quest_selected_pages,
)
from paged.sparse_tokens import TokenSelection, token_page_table, token_view_cache

Selection = QuestSelection | TokenSelection | BlockSelection


def sparse_page_table(
    q: jax.Array, cache: KVCache, page_table: PageTable, selection: Selection
) -> tuple[jax.Array, KVCache, PageTable]:
    """The dense decode problem a sparse one is: ``(q', cache', table')``.

    ``decode_attention(q', cache', table')`` attends over exactly the selected keys; its output
    ``[B', H', D]`` reshapes to ``q``'s ``[B, H, D]`` (rows of a Quest table are (request, head)
    pairs in row-major order).

    Raises:
      TypeError: an unknown kind of selection.
      ValueError: as each kind's validation.
    """
    if isinstance(selection, QuestSelection):
        check_token_budget(selection.token_budget)
        scores = quest_page_scores(q, selection.bounds, page_table, per=selection.per)
        selected = quest_selected_pages(scores, page_table, selection.token_budget)
        table = head_split_page_table(page_table, selected, cache.num_kv_heads)
        batch, num_heads, head_dim = q.shape
        rows = selected.shape[1]  # KV heads or query heads
        return q.reshape(batch * rows, num_heads // rows, head_dim), head_split_cache(cache), table
    if isinstance(selection, TokenSelection):
        return q, token_view_cache(cache), token_page_table(page_table, selection)
    if isinstance(selection, BlockSelection):
        return q, cache, block_page_table(page_table, selection)
    raise TypeError(
        "selection must be a QuestSelection, TokenSelection or BlockSelection, got "
        f"{type(selection).__name__}"
    )


def sparse_decode_attention(
    q: jax.Array,
    cache: KVCache,
    page_table: PageTable,
    selection: Selection,
    *,
    sm_scale: float | None = None,
    logits_soft_cap: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
):
    """Decode attention of each request's new token over a selected subset of its keys.

    The selection turns into a virtual page table (``sparse_page_table``) and
    ``paged.decode_attention`` runs over it: ``backend`` (``"auto"``, ``"reference"`` or
    ``"pallas"``), the kill switch and the kernel are decode's own, chosen when traced. The
    result equals dense attention restricted to exactly the selected keys: selecting every page
    (or token) gives dense decode, output and LSE.

    Only plain decode (one new token a request): with ``L > 1`` new tokens the causal order
    among them would be lost in a virtual table.

    Args:
      q: ``[B, H, D]`` in the cache's dtype.
      cache: the KV pool (``HND`` or ``NHD``).
      page_table: the requests' full tables (including the new token).
      selection: ``QuestSelection``, ``TokenSelection`` or ``BlockSelection``.
      sm_scale, logits_soft_cap, return_lse: as in ``paged.decode_attention``.
      backend: ``"auto"``, ``"reference"`` or ``"pallas"``.

    Returns:
      ``o [B, H, D]`` in ``q``'s dtype, and with ``return_lse=True`` also ``lse`` float32
      ``[B, H]`` over the selected keys. A request that selects nothing (an empty request) gets
      ``o = 0``, ``lse = -inf``.

    Raises:
      TypeError: an unknown selection kind, a non-int ``token_budget``.
      ValueError: ``q`` not ``[B, H, D]``, what ``paged.decode_attention`` refuses, and each
        selection's own checks (budget < 1, positions or blocks outside a request, unsorted or
        repeated positions or blocks, shapes that do not match the batch).

    Example:
      >>> import jax.numpy as jnp
      >>> from paged import PageTable, new_kv_cache
      >>> from paged.sparse_tokens import TokenSelection
      >>> cache = new_kv_cache(4, 4, 2, 8, jnp.float32, layout="NHD")
      >>> table = PageTable.from_seq_lens([7], page_size=4)
      >>> chosen = TokenSelection(jnp.array([[0, 6]], jnp.int32), jnp.array([2], jnp.int32))
      >>> o, lse = sparse_decode_attention(
      ...     jnp.ones((1, 4, 8)), cache, table, chosen, return_lse=True, backend="reference")
      >>> o.shape, round(float(lse[0, 0]), 4)  # two zero keys: lse = log 2
      ((1, 4, 8), 0.6931)
    """
    logits_soft_cap = _static_float("logits_soft_cap", logits_soft_cap)
    sm_scale = _static_float("sm_scale", sm_scale)
    if q.ndim != 3:
        raise ValueError(
            f"q must have shape [batch, num_q_heads, head_dim] (one new token a request), "
            f"got {q.shape}"
        )
    validate_decode_inputs(q, cache, page_table, logits_soft_cap)
    q_view, cache_view, table = sparse_page_table(q, cache, page_table, selection)
    o, lse = decode_attention(
        q_view,
        cache_view,
        table,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        return_lse=True,
        backend=backend,
    )
    o = o.reshape(q.shape)
    lse = lse.reshape(q.shape[:-1])
    return (o, lse) if return_lse else o
