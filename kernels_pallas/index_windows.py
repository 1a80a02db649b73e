"""Page numbers copied into shared memory in windows, each copy starting on 16 bytes.

A Mosaic GPU kernel that streams pages through a page table first copies the page numbers of its
work item (a run of ``page_indices``) into shared memory. ``plgpu.copy_gmem_to_smem`` issues it
as a TMA tensor copy (``cp.async.bulk.tensor``, entries past the array's end zero-filled) of at
most 256 entries. A work item starts at any entry of the table (request ``b``'s pages start at
``page_indptr[b]``; a split cuts them anywhere), and on the H200 a copy whose first entry does
not lie on 16 bytes faults: measured on 2026-12-02, ``CUDA_ERROR_ILLEGAL_INSTRUCTION`` at the
copy, for every Mosaic GPU kernel here that did it (decode at B=1 x 32K, whose planner cuts
63-page chunks; MLA over a ragged batch), and only there. A copy whose shared-memory destination
does not lie on 128 bytes faults too (``CUDA_ERROR_MISALIGNED_ADDRESS``: a 1008-byte first
buffer put the second off). The interpreter on a CPU has neither rule, so only a compiled run
shows them.

The fix, used by every such kernel:

- A window's copy starts at the multiple of ``INDEX_ALIGN`` entries at or below its first entry,
  and the kernel reads the window at an offset ``shift`` (0 to 3; the same for every window of an
  item, since a window's length is a multiple of 4). The buffer holds ``INDEX_ALIGN`` entries
  more than a window's pages, rounded up to 128 bytes, so a window of ``MAX_INDEX_WINDOW`` pages
  fits one copy of ``MAX_INDEX_BUFFER`` entries, the most Mosaic GPU copies along one dimension.
- The wrappers pad a table shorter than one window's buffer (a copy's static size may not exceed
  the array's) and, as a precaution not shown to be needed (the copy zero-fills what lies past
  the end), one whose length is not a multiple of 4 (``pad_page_indices``; an engine whose tables
  are sized in powers of two of at least 256 never pays for either).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

INDEX_ALIGN = 4  # int32 entries in 16 bytes: where a copy of page numbers may start
BUFFER_ALIGN = 32  # int32 entries in 128 bytes, a TMA copy's shared-memory alignment
MAX_INDEX_BUFFER = 256  # entries of one copy: Mosaic GPU copies at most 256 a dimension
MAX_INDEX_WINDOW = MAX_INDEX_BUFFER - INDEX_ALIGN  # page numbers a window: 252


def index_buffer_entries(index_window: int) -> int:
    """Entries of one window's shared-memory buffer, and of its copy, for windows of
    ``index_window`` page numbers: room for the up to 3 entries before an item's first one,
    rounded up to 128 bytes so that the second of two buffers side by side starts on 128 bytes
    as a TMA destination must (a 1008-byte buffer faulted with a misaligned address on the
    H200). At most ``MAX_INDEX_BUFFER`` for a window of at most ``MAX_INDEX_WINDOW``."""
    return -(-(index_window + INDEX_ALIGN) // BUFFER_ALIGN) * BUFFER_ALIGN


def default_index_window(pages_per_step: int) -> int:
    """The largest window (page numbers a copy) that is a multiple of 4 and of
    ``pages_per_step`` and fits one buffer: 252 for 1, 2 or 4 pages a step, 248 for 8, 240 for
    16."""
    unit = math.lcm(INDEX_ALIGN, pages_per_step)
    return MAX_INDEX_WINDOW // unit * unit


def resolve_index_window(index_window, pages_per_step):
    """``index_window`` as given, or (None) the default for ``pages_per_step`` when that is an
    int from 1 to ``MAX_INDEX_WINDOW``; otherwise None, left for the caller's validation to
    name ``pages_per_step``."""
    if index_window is not None:
        return index_window
    if isinstance(pages_per_step, bool) or not isinstance(pages_per_step, (int, np.integer)):
        return None
    if not 1 <= pages_per_step <= MAX_INDEX_WINDOW:
        return None
    return default_index_window(int(pages_per_step))


def aligned_window_start(first_entry: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(start, shift)`` for an item whose page numbers begin at entry ``first_entry`` (a
    non-negative traced int32): ``start`` is the multiple of 4 at or below it, where every window
    of the item is copied from (window ``w`` at ``start + w * index_window``), and ``shift`` the
    entry of a window buffer that holds the item's page ``w * index_window``."""
    shift = lax.rem(first_entry, INDEX_ALIGN)
    return pl.multiple_of(first_entry - shift, INDEX_ALIGN), shift


def pad_page_indices(page_indices: jax.Array, index_window: int) -> jax.Array:
    """``page_indices`` padded with zeros to a multiple of 4 entries and to at least one window
    buffer's (returned unchanged when it is both already, so no copy is made): a copy's static
    size never exceeds the array, and the array's extent is whole 16-byte units. For a valid
    plan the padding is never read as a page (every item's pages end where its table says); an
    invalid plan whose range runs into it reads page 0, still inside the pool."""
    entries = page_indices.shape[0]
    padded = max(-(-entries // INDEX_ALIGN) * INDEX_ALIGN, index_buffer_entries(index_window))
    if padded == entries:
        return page_indices
    return jnp.pad(page_indices, (0, padded - entries))
