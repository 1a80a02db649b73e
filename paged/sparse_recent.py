"""The "recent pages only" baseline: each request's first page and its most recent pages.

The selection a query-aware method (Quest, ``paged/sparse_quest.py``) has to beat: the same
number of pages, the same first-and-last rule, but chosen by position alone. A request of ``n``
pages keeps ``min(n, max(token_budget // page_size, 2))`` of them (Quest's count): the first
(the attention sinks), the last (the newest tokens, the page being written) and, between them,
the latest. It is Quest's own rule (``quest_selected_pages``) with a page's position in its
request as its score, so the two differ in nothing but the scores. Every head reads the same
pages, so the result is a ``BlockSelection`` (blocks of one page) over the pool itself: no
head-split view, no copy.

The engine's ``sparse="recent"`` (``serving/sparse_step.py``) and the quality study's
``recent_pages`` method (``bench/quality``) are this selection.
"""

from __future__ import annotations

import jax.numpy as jnp

from paged.page_table import PageTable
from paged.sparse_blocks import BlockSelection
from paged.sparse_quest import check_token_budget, quest_selected_pages
from paged.sparse_tables import MIN_INDICES, compact_rows


def recent_pages_selection(page_table: PageTable, token_budget: int) -> BlockSelection:
    """The first page and the latest pages of each request, Quest's page count.

    Works under ``jit`` (``token_budget`` is static: it sets the selection's width).

    Args:
      page_table: the requests' tables, the new token included.
      token_budget: tokens each request reads, a Python int ``>= 1``; rounded down to whole
        pages, never below two (the first and the last page).

    Returns:
      ``BlockSelection(block_indptr [B + 1], block_indices, page_size)``: per request its kept
      page numbers in the request (``0`` and the latest ones), increasing; ``block_indices``
      of static length ``max(B * min(nnz_padded, budget_pages), 1)``.

    Raises:
      TypeError: ``token_budget`` not an int.
      ValueError: ``token_budget < 1``.

    Example:
      >>> table = PageTable.from_seq_lens([70, 20], page_size=16)  # 5 pages and 2
      >>> chosen = recent_pages_selection(table, token_budget=48)  # 3 pages a request
      >>> indptr, blocks = chosen.block_indptr.tolist(), chosen.block_indices.tolist()
      >>> blocks[indptr[0] : indptr[1]], blocks[indptr[1] : indptr[2]]
      ([0, 3, 4], [0, 1])
    """
    check_token_budget(token_budget)
    num_indices = page_table.page_indices.shape[0]
    # [B, nnz]: entry j's page number within request b (negative or past it where not b's).
    page_in_request = jnp.arange(num_indices)[None, :] - page_table.page_indptr[:-1, None]
    # Later pages score higher; one score row a request (every head reads the same pages).
    scores = page_in_request[:, None, :].astype(jnp.float32)
    kept = quest_selected_pages(scores, page_table, token_budget)[:, 0]  # bool [B, nnz]
    budget_pages = max(token_budget // page_table.page_size, 2)
    width = max(page_table.batch_size * min(num_indices, budget_pages), MIN_INDICES)
    indptr, blocks = compact_rows(page_in_request, kept, width)
    return BlockSelection(indptr, blocks, page_table.page_size)
