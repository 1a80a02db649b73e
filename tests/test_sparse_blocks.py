"""Block-sparse masks in BSR form read as a page table (``paged/sparse_blocks.py``)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import PagedBucket, scattered_page_tables

import paged
from paged.sparse_blocks import BlockSelection, block_page_table, validate_block_selection

BUCKET = PagedBucket(batch_size=3, page_size=4, max_seq_len=19)


@st.composite
def block_masks(draw, page_lists, width: int = 16):
    """Per request a sorted subset of its key blocks, as BSR padded to ``width`` entries."""
    rows = [
        sorted(draw(st.sets(st.integers(0, len(pages) - 1)))) if pages else []
        for pages in page_lists
    ]
    indptr = np.cumsum([0] + [len(r) for r in rows]).astype(np.int32)
    indices = np.zeros(width, np.int32)
    indices[: indptr[-1]] = [i for r in rows for i in r]
    return BlockSelection(jnp.asarray(indptr), jnp.asarray(indices), BUCKET.page_size), rows


@given(batch=scattered_page_tables(BUCKET), data=st.data())
def test_block_table_lists_each_chosen_page_with_the_right_last_length(batch, data):
    selection, rows = data.draw(block_masks(batch.page_lists))
    table = block_page_table(batch.page_table, selection)
    paged.validate_page_table(table, BUCKET.num_pool_pages)
    for b, (pages, length) in enumerate(zip(batch.page_lists, batch.seq_lens, strict=True)):
        assert table.page_lists()[b] == [pages[i] for i in rows[b]]
        if not rows[b]:
            want_last = 0
        elif rows[b][-1] == len(pages) - 1:
            want_last = length - 4 * (len(pages) - 1)
        else:
            want_last = 4
        assert int(table.last_page_len[b]) == want_last


def test_blocks_outside_a_request_are_dropped_under_jit():
    table = paged.PageTable.from_page_lists([[5, 3], [1]], [6, 2], page_size=4)
    mask = BlockSelection(jnp.array([0, 3, 5], jnp.int32), jnp.array([0, 1, 2, 0, 1], jnp.int32), 4)
    view = jax.jit(block_page_table)(table, mask)
    assert view.page_lists() == [[5, 3], [1]]
    assert view.last_page_len.tolist() == [2, 2]


@pytest.mark.parametrize(
    ("indptr", "indices", "block_size", "message"),
    [
        ([0, 2], [0, 1], 8, "selection.block_size=8 must equal page_table.page_size=4"),
        (
            [0, 2],
            [0, 2],
            4,
            "selection.block_indices[1]=2 is outside request 0's key blocks [0, 2)",
        ),
        ([0, 2], [-1, 0], 4, "selection.block_indices[0]=-1 is outside request 0's key blocks"),
        ([0, 2], [1, 0], 4, "block_indices[0]=1 >= block_indices[1]=0"),
        ([0, 2], [1, 1], 4, "block_indices[0]=1 >= block_indices[1]=1"),
        ([1, 2], [0, 1], 4, "selection.block_indptr must start at 0, got 1"),
        ([0, 3], [0, 1], 4, "selection.block_indptr[-1]=3 exceeds len(block_indices)=2"),
        ([0, 1, 2], [0, 1], 4, "selection.block_indptr must have shape [2] for 1 requests"),
    ],
)
def test_bad_block_selection_is_named(indptr, indices, block_size, message):
    table = paged.PageTable.from_seq_lens([5], page_size=4)
    mask = BlockSelection(jnp.array(indptr, jnp.int32), jnp.array(indices, jnp.int32), block_size)
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_block_selection(mask, table)


def test_block_arrays_must_be_int32():
    table = paged.PageTable.from_seq_lens([5], page_size=4)
    mask = BlockSelection(jnp.array([0, 1], jnp.int32), jnp.array([0.0]), 4)
    with pytest.raises(ValueError, match=re.escape("selection.block_indices must be 1-D int32")):
        block_page_table(table, mask)
