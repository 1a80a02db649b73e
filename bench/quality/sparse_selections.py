"""The selections the sparse decode quality study adds beside Quest's.

- ``oracle_top_k_selection``: the ``top_k`` tokens of each request that receive the most
  attention from the new token, summed over the layer's query heads, one selection shared by
  every head (the shape of DeepSeek's lightning indexer, whose weights this project has not
  trained). It reads the very attention it approximates, so it is an *upper bound* of what a
  trained indexer selecting ``top_k`` tokens by a cheaper score could reach, not a method.
- ``quest_two_last_pages_selected``: Quest per KV head with the page before the last forced
  too, so at least one full page of recent tokens is always read (Quest's forced last page holds
  a single token when the new token opens a page). The same page count as Quest: the forced page
  takes the place of the lowest-ranked scored one.

The first returns a selection ``paged.sparse_decode_attention`` takes (a ``TokenSelection``), so
the decode runs on the project's own virtual tables; the second returns Quest's per-head page
mask, for ``paged.sparse_quest.head_split_page_table``.

The "recent pages only" baseline the study also measures is the library's
``paged.recent_pages_selection`` (``paged/sparse_recent.py``), the selection the engine serves
as ``sparse="recent"``: the study imports it from there rather than keeping its own copy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged.attention_reference import scaled_logits, token_mask, token_positions
from paged.kv_cache import KVCache
from paged.page_table import PageTable
from paged.sparse_quest import (
    PageKeyBounds,
    check_token_budget,
    quest_page_scores,
    quest_selected_pages,
)
from paged.sparse_tokens import TokenSelection


def attention_received(q: jax.Array, cache: KVCache, page_table: PageTable) -> jax.Array:
    """float32 ``[B, nnz_padded * page_size]``: per key slot of the table, the softmax weight the
    new token gives it, summed over query heads (``-inf`` where the slot is not the request's).

    Args:
      q: ``[B, H, D]``, rotated queries of each request's new token.
      cache: the pool, keys already rotated and the new token's key appended.
      page_table: the requests' tables (new token included).
    """
    batch, _, head_dim = q.shape
    num_kv_heads = cache.num_kv_heads
    k = cache.to_nhd(cache.k_pages[page_table.page_indices]).astype(jnp.float32)
    num_slots = k.shape[0] * k.shape[1]
    k = k.reshape(num_slots, num_kv_heads, head_dim)  # [T, KVH, D]
    q_grouped = q.astype(jnp.float32).reshape(batch, num_kv_heads, -1, head_dim)
    logits = scaled_logits(
        jnp.einsum("bkgd,tkd->bkgt", q_grouped, k), 1.0 / float(head_dim) ** 0.5, None
    )
    mine = token_mask(page_table).reshape(batch, 1, 1, num_slots)
    weights = jax.nn.softmax(jnp.where(mine, logits, -jnp.inf), axis=-1)
    return jnp.where(mine[:, 0, 0], weights.sum(axis=(1, 2)), -jnp.inf)


def oracle_top_k_selection(
    q: jax.Array, cache: KVCache, page_table: PageTable, top_k: int
) -> TokenSelection:
    """The ``top_k`` positions of each request by attention received (``attention_received``).

    Ties go to the earlier position, as in ``paged.lightning_indexer_top_k``; a request shorter
    than ``top_k`` keeps every token.

    Returns:
      ``TokenSelection``: ``positions [B, min(top_k, nnz_padded * page_size)]`` increasing per
      row (padding 0), ``counts = min(top_k, seq_len)``.

    Raises:
      TypeError, ValueError: ``top_k`` not an int ``>= 1``.
    """
    check_token_budget(top_k)
    scores = attention_received(q, cache, page_table)
    batch, num_slots = scores.shape
    width = min(top_k, num_slots)
    mine = token_mask(page_table).reshape(batch, num_slots)
    positions = token_positions(page_table).reshape(batch, num_slots)
    # Order: the request's own tokens, then high score before low, early position before late.
    order = jax.vmap(lambda s, m, p: jnp.lexsort((p, -s, ~m)))(scores, mine, positions)
    counts = jnp.minimum(page_table.seq_lens(), width).astype(jnp.int32)
    taken = jnp.take_along_axis(positions, order[:, :width], axis=1)
    used = jnp.arange(width)[None, :] < counts[:, None]
    kept = jnp.sort(jnp.where(used, taken, jnp.iinfo(jnp.int32).max), axis=1)
    return TokenSelection(jnp.where(used, kept, 0).astype(jnp.int32), counts)


def quest_two_last_pages_selected(
    q: jax.Array, bounds: PageKeyBounds, page_table: PageTable, token_budget: int
) -> jax.Array:
    """Quest's per-KV-head page mask with each request's second-to-last page forced in.

    Quest's rule (``quest_selected_pages``) on its scores (``per="kv_head"``), except that the
    page before the last scores ``+inf``: after the forced first and last page it is the first
    kept, whenever the budget keeps three pages or more.

    Returns:
      bool ``[B, num_kv_heads, nnz_padded]``, as ``quest_selected_pages``.
    """
    scores = quest_page_scores(q, bounds, page_table, per="kv_head")  # [B, R, nnz]
    entry = jnp.arange(page_table.page_indices.shape[0])[None, None, :]
    before_last = (page_table.page_indptr[1:] - 2)[:, None, None]
    owned = before_last >= page_table.page_indptr[:-1, None, None]
    scores = jnp.where(owned & (entry == before_last), jnp.inf, scores)
    return quest_selected_pages(scores, page_table, token_budget)
