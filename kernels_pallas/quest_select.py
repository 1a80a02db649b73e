"""Quest page selection by kernel (Pallas, Triton lowering): each request's top pages, no sort.

The kernel of ``paged.sparse_quest.quest_selected_pages`` (the reference, matched bit for bit):
a request of ``n`` pages keeps ``keep = min(n, max(token_budget // page_size, 2))`` of them,
always its first and its last, the other ``m = keep - min(n, 2)`` by highest score; among equal
scores the earlier page wins; NaN ranks below every number (``-inf`` included). The output is
the reference's: bool ``[B, R, nnz_padded]``, True at the kept entries of ``page_indices``,
False everywhere else (entries of other requests, the padding). ``paged.sparse_decode_attention``
runs it under ``backend="pallas"`` (``"auto"`` keeps the reference until it is measured).

Algorithm: a threshold (radix) select, one program per (request, score row). The ``m``-th
largest score among the request's middle pages (its candidates: every page but the first and
the last) is found on the scores' order-preserving int32 keys (``row_select.order_keys``, with
``-0.0`` made ``+0.0`` and NaN given the smallest key, so that key order is the reference's
order), ``RADIX_BITS = 4`` bits a pass: 8 passes, each counting the candidates at or above 16
thresholds at once (``row_select.largest_key_reaching`` with unit weights; float32 sums of ones
are exact below 2^24 pages). One pass counts the candidates above that key; a last one keeps
those and, of the candidates equal to it, the earliest ``m - count_above``, by a running tie
rank (a cumsum within a block, the ties of earlier blocks carried), which is exactly the
reference's stable order; the first and last pages are forced. With ``m = 0`` the threshold
comes out as the largest key, which no score has, and nothing but the forced pages is kept.

What it costs. A program reads its request's scores, ``4 n`` bytes, 10 times (8 radix passes,
one pass counting the scores above the threshold, one selection pass; all but the first from
L1/L2, a row being at most a few KiB), and writes ``4 n`` bytes of flags. At B = 8 requests of
32K tokens, page size 16 (n = 2048) and R = 8 rows, one pass reads 8 KiB a row, 512 KiB over
the batch; the 10 passes 5 MiB, nearly all from cache, against the scoring's 128 MiB of bound
reads from HBM (``kernels_pallas/quest_scores.py``). The wrapper costs more bytes than the
kernel: it pads the ``[B * R, nnz_padded]`` scores (the reference format, ``B`` times larger
than the rows a consumer needs: 4 MiB here, read and written) and selects over the output's
size. The kernel's time will be latency (10 dependent passes over 2 blocks of 1024), not
bandwidth. Not measured (no GPU time this session): ``bench/probes/quest_select.py`` checks
and times it beside the reference on the GPU.

Why the Triton lowering, not Mosaic GPU (checked with jax 0.11.2 on a CPU, on a 1-D row of 256
float32 in shared memory): Mosaic GPU's interpreter runs the comparisons, a count reduced to a
scalar and ``jnp.cumsum``, and the compiled lowering takes the count, but it has no rule for
``cumsum`` (``NotImplementedError``, warpgroup semantics): a Mosaic GPU kernel with this
algorithm would pass its interpreted tests and fail to compile. The tie rank could avoid the
prefix sum (a bisection on the position among the ties, about ``log2(n)`` more counting passes),
which is the way to port it; this version instead reuses ``row_select`` (the sampling kernels'
radix select, Triton lowering, tested and measured on the H200), one implementation of the
radix select and its tie rule. Triton is deprecated in the project: the port is future work.

Layout. The scores come as ``[B * R, nnz_padded + block]`` (zero-padded by the wrapper, so a
block starting anywhere inside a request stays inside the array: no masked loads); a program
visits ``cdiv(n, block)`` blocks from the request's first entry, and writes int32 flags over
the same columns of its own row of ``[B * R, nnz_padded + block]``. Columns past the request's
end hold whatever the block computed there; the wrapper keeps only the request's own entries
(an XLA select over the output's size, as ``quest_scores.py``'s wrapper does), so nothing else
need be initialized.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.platform import whole_array
from kernels_pallas.row_select import largest_key_reaching, order_keys
from kernels_pallas.x64 import runs_in_32_bits
from paged.page_table import PageTable
from paged.sparse_quest import check_scores_shape, check_token_budget

DEFAULT_BLOCK = 1024  # columns a block: a request of 2048 pages (32K tokens / 16) in 2 blocks
_SMALLEST_KEY = -(2**31)  # below order_keys(-inf): where NaN goes


def selection_keys(scores: jax.Array) -> jax.Array:
    """int32 keys whose order is the reference's ranking of float32 scores: ``-0.0`` equals
    ``+0.0`` (they tie, as in a float sort), and NaN is below everything (``-inf`` too).

    Example:
      >>> selection_keys(jnp.array([-0.0, 0.0, -jnp.inf, jnp.nan])).tolist()
      [0, 0, -2139095041, -2147483648]
    """
    scores = jnp.where(scores == 0.0, 0.0, scores.astype(jnp.float32))
    return jnp.where(jnp.isnan(scores), jnp.int32(_SMALLEST_KEY), order_keys(scores))


def quest_select_kernel(
    indptr_ref,  # [B + 1] int32: request b's entries are [indptr[b], indptr[b + 1])
    budget_ref,  # [1] int32: budget pages, max(token_budget // page_size, 2)
    scores_ref,  # [B * R, nnz_padded + block] float32, row b * R + r
    keep_ref,  # [B * R, nnz_padded + block] int32 out: 1 where kept (the request's columns)
    *,
    num_rows: int,
    block: int,
):
    row = pl.program_id(0)
    request = row // num_rows
    start = indptr_ref[request]
    end = indptr_ref[request + 1]
    count = jnp.maximum(end - start, 0)
    forced_count = jnp.minimum(count, 2)
    target = jnp.minimum(count, budget_ref[0]) - forced_count  # m: pages chosen by score
    num_blocks = pl.cdiv(count, block)
    offsets = jnp.arange(block, dtype=jnp.int32)

    def load_block(block_index):
        """``(columns, keys, is_candidate)`` of one block: entries strictly between the first
        and the last page of the request."""
        first = start + block_index * block
        columns = first + offsets
        scores = plgpu.load(scores_ref.at[row, pl.ds(first, block)])
        is_candidate = (columns > start) & (columns < end - 1)
        return columns, selection_keys(scores), is_candidate

    def keys_and_weights(block_index):
        _, keys, is_candidate = load_block(block_index)
        return keys, jnp.where(is_candidate, 1.0, 0.0)

    threshold = largest_key_reaching(num_blocks, keys_and_weights, target.astype(jnp.float32))

    def count_above(block_index, above):
        _, keys, is_candidate = load_block(block_index)
        over = is_candidate & (keys > threshold)
        return above + jnp.sum(over.astype(jnp.int32), dtype=jnp.int32)

    above = lax.fori_loop(0, num_blocks, count_above, jnp.int32(0))
    ties_wanted = target - above  # the earliest this many candidates at the threshold

    def select(block_index, ties_before):
        columns, keys, is_candidate = load_block(block_index)
        is_tie = is_candidate & (keys == threshold)
        tie_count = is_tie.astype(jnp.int32)
        rank = ties_before + jnp.cumsum(tie_count, dtype=jnp.int32) - tie_count  # earlier ties
        kept = (
            (is_candidate & (keys > threshold))
            | (is_candidate & is_tie & (rank < ties_wanted))
            | (columns == start)
            | (columns == end - 1)
        )
        plgpu.store(
            keep_ref.at[row, pl.ds(start + block_index * block, block)], kept.astype(jnp.int32)
        )
        return ties_before + jnp.sum(tie_count, dtype=jnp.int32)

    lax.fori_loop(0, num_blocks, select, jnp.int32(0))


def quest_selected_pages_pallas(
    scores: jax.Array,
    page_table: PageTable,
    token_budget: int,
    *,
    block: int = DEFAULT_BLOCK,
    interpret: bool = False,
) -> jax.Array:
    """``paged.sparse_quest.quest_selected_pages`` computed by the selection kernel.

    Args:
      scores: float32 (or narrower float) ``[B, R, nnz_padded]`` from ``quest_page_scores`` or
        ``quest_page_scores_pallas``; entries outside a request are ignored.
      page_table: the table the scores were computed over.
      token_budget: tokens to read per request and row, a Python int ``>= 1``.
      block: columns a block, a power of two >= 32 (static).
      interpret: Pallas interpret mode (CPU).

    Returns:
      bool ``[B, R, nnz_padded]``: the reference's selection, equal to it bit for bit.

    Raises:
      TypeError: ``token_budget`` not an int.
      ValueError: ``token_budget < 1``, ``scores`` not ``[B, R, nnz_padded]`` for the table or
        not a float of at most 32 bits, ``block`` not a power of two >= 32 (naming the
        argument and the value).

    Example:
      >>> table = PageTable.from_page_lists([[7, 3, 5, 1, 2]], seq_lens=[18], page_size=4)
      >>> scores = jnp.array([[[0.0, 9.0, 1.0, 8.0, -5.0] + [0.0] * 11]])
      >>> kept = quest_selected_pages_pallas(scores, table, token_budget=12, interpret=True)
      >>> kept[0, 0, :5].tolist()
      [True, True, False, False, True]
    """
    check_token_budget(token_budget)
    check_scores_shape(scores, page_table)
    if not jnp.issubdtype(scores.dtype, jnp.floating) or jnp.dtype(scores.dtype).itemsize > 4:
        raise ValueError(
            f"scores must be float32, bfloat16 or float16 (the kernel ranks float32), "
            f"got {scores.dtype}"
        )
    if not isinstance(block, int) or isinstance(block, bool) or block < 32 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 32, got {block!r}")
    budget_pages = max(token_budget // page_table.page_size, 2)
    return _selected_pages(
        scores,
        page_table.page_indptr,
        jnp.full((1,), min(budget_pages, 2**31 - 1), jnp.int32),
        block=block,
        interpret=interpret,
    )


@runs_in_32_bits  # x64 mode: kernels_pallas/x64.py
@functools.partial(jax.jit, static_argnames=("block", "interpret"))
def _selected_pages(scores, page_indptr, budget_pages, *, block, interpret):
    batch, num_rows, num_indices = scores.shape
    if batch * num_rows == 0 or num_indices == 0:  # no program to launch
        return jnp.zeros(scores.shape, bool)
    page_indptr = page_indptr.astype(jnp.int32)
    # A block from any entry of a request stays inside the padded row.
    padded = jnp.pad(
        scores.astype(jnp.float32).reshape(batch * num_rows, num_indices), ((0, 0), (0, block))
    )
    flags = pl.pallas_call(
        functools.partial(quest_select_kernel, num_rows=num_rows, block=block),
        grid=(batch * num_rows,),
        in_specs=[whole_array(x.shape) for x in (page_indptr, budget_pages, padded)],
        out_specs=whole_array(padded.shape),
        out_shape=jax.ShapeDtypeStruct(padded.shape, jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=max(1, min(8, block // 256))),
        interpret=interpret,
        name=f"quest_select_b{block}",
    )(page_indptr, budget_pages, padded)
    kept = flags[:, :num_indices].reshape(batch, num_rows, num_indices) != 0
    j = jnp.arange(num_indices, dtype=jnp.int32)
    owned = (page_indptr[:-1, None] <= j) & (j < page_indptr[1:, None])  # [B, nnz]
    return owned[:, None, :] & kept
