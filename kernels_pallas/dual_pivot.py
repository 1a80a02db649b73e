"""Dual-pivot rejection sampling kernel (Pallas, Triton lowering): top-k, top-p, min-p, joint.

What it computes: for each row of ``probs[B, V]``, a token drawn from the row restricted to the
filters' kept set, by exactly the rounds of ``sampling/reference.py`` (``pivot_round``) with
the very same uniforms (``rng``, stream ``ROUND_STREAM``, column = round), so for the same key it
picks the reference's token; only float32 summation order can differ (see below).

How a round runs here (one program per row):

- The candidates (tokens above ``low``) are summarized by a *block table*: their mass in each
  block of the row, a vector in registers. Drawing a candidate by inverse transform needs no
  pass: the table's running sum finds the block holding ``uniform * mass``, and only that
  block is read (``row_select.pick_by_table``).
- One full pass then tests both pivots at once: the count and mass of the tokens above the
  drawn token ``(p_j, j)`` and above ``((p_j + high) / 2, 0)``, and, block by block, the two
  tables those sets would leave as the next candidates. Whichever becomes ``low`` hands its
  table to the next round.

So a row costs one pass for its maximum and first table, plus one pass a round (the reference
reads the row twice a round). With min-p, one more pass tabulates min-p's kept set
(``weight >= min_p * max``): the rounds start from it, the same candidates as the reference's
``initial_state``. When min-p is the only filter every candidate is kept, the first draw is
accepted and the round skips its pivot pass (its loop runs no iteration; with prefetching it
still loads block 0): two passes and about two blocks in all. Min-p combined with top-k or top-p
pays the extra pass and saves the rounds it spares. ``order="top_k_first"`` first finds the
top-k mass by radix selection (``row_select.top_k_boundary``, 9 passes). A row still undecided after
``max_rounds`` rounds takes the reference's exact fallback: the kept set is found by radix
selection (``row_select``) and sampled with the last uniform.

What can differ from the reference: its masses come from one sorted running sum; here they
are block-order sums. A top-p test, or an inverse-transform draw, within a float32 rounding
error of its threshold can go the other way. The tests measure how often.

Byte floor: one read of the row, ``4 V`` bytes; each round reads it once more (from L2 when the
batch's rows fit in its 60 MB).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import rng
from kernels_pallas.platform import whole_array
from kernels_pallas.row_select import (
    RowReader,
    order_keys,
    pick_by_table,
    tie_ranks,
    top_k_boundary,
    top_p_boundary,
)

ORDERS = ("joint", "top_k_first")
# Measured on the H200 (bench/tuning/sampling.py, 2026-11-30): 16 elements a thread; 8192 columns
# with 8 warps spills registers (4x slower), 4096 with 8 warps is 1.2x to 1.4x slower.
DEFAULT_BLOCK = 8192
DEFAULT_NUM_WARPS = 16
# The streaming passes (first table, min-p table, pivot tests) issue a block's loads one block
# early (row_select.fold_blocks; the radix-selection passes do not). Measured on the
# H200 (bench/tuning/sampling.py, 2026-12-01, B=256, times including a 60 us slice copy): top-k
# 334 -> 263 us, top-p 250 -> 201 us, min-p 181 -> 156 us; 8192 columns and 16 warps stay best.
DEFAULT_PREFETCH = True


def _probability_blocks(reader: RowReader):
    """``block_index -> (keys, weights, in_row)`` for a row of probabilities."""

    def load(block_index):
        _, in_row, values = reader.raw(block_index, 0.0)
        weights = jnp.where(values > 0, values, 0.0)
        return order_keys(weights), weights, in_row

    return load


def _first_table(reader: RowReader):
    """One pass: ``(table of positive mass per block, largest weight)``.

    The maximum is kept per lane and reduced once after the loop: one reduction a block (the
    table's sum) instead of two keeps the loop's critical path short."""

    def accumulate(block_index, _, weights, carry):
        table, largest = carry
        table = reader.set_entry(table, block_index, jnp.sum(weights))
        return table, jnp.maximum(largest, weights)

    table, largest = reader.fold(
        accumulate,
        (jnp.zeros((reader.table_size,), jnp.float32), jnp.zeros((reader.block,), jnp.float32)),
    )
    return table, jnp.max(largest)


def _min_p_table(reader: RowReader, floor):
    """One pass: the mass per block of the tokens with ``weight >= floor`` (min-p's kept set,
    the first round's candidates when min-p filters)."""

    def accumulate(block_index, _, weights, table):
        return reader.set_entry(
            table, block_index, jnp.sum(jnp.where(weights >= floor, weights, 0.0))
        )

    return reader.fold(accumulate, jnp.zeros((reader.table_size,), jnp.float32))


def _pivot_pass(reader: RowReader, value, token, middle, blocks_to_read):
    """One pass over the row for both pivots of a round.

    Returns ``(count0, table0, count1, table1)``: tokens above position ``(value, token)`` and
    their mass per block, and the same for position ``(middle, 0)``, over the first
    ``blocks_to_read`` blocks (all of them, or none when the round needs no pivot test).
    """

    # Counts are kept per lane and reduced once after the loop; the two masses of a block are
    # reduced together, as one [2, block] sum: one reduction a block on the critical path.
    def accumulate(block_index, columns, weights, carry):
        counts0, table0, counts1, table1 = carry
        above0 = (weights > value) | ((weights == value) & (columns < token))
        above1 = weights > middle
        masses = jnp.sum(
            jnp.where(jnp.stack([above0, above1], axis=-1), weights[:, None], 0.0), axis=0
        )  # [2]
        lane = jnp.arange(2)
        return (
            counts0 + above0.astype(jnp.int32),
            reader.set_entry(table0, block_index, jnp.sum(jnp.where(lane == 0, masses, 0.0))),
            counts1 + above1.astype(jnp.int32),
            reader.set_entry(table1, block_index, jnp.sum(jnp.where(lane == 1, masses, 0.0))),
        )

    zeros = jnp.zeros((reader.table_size,), jnp.float32)
    no_counts = jnp.zeros((reader.block,), jnp.int32)
    counts0, table0, counts1, table1 = reader.fold(
        accumulate, (no_counts, zeros, no_counts, zeros), blocks_to_read
    )
    return jnp.sum(counts0, dtype=jnp.int32), table0, jnp.sum(counts1, dtype=jnp.int32), table1


def dual_pivot_kernel(
    key0_ref,  # [B] uint32, the rows' key words
    key1_ref,  # [B] uint32
    top_k_ref,  # [B] int32 in [1, V]
    top_p_ref,  # [B] float32 in (0, 1]
    min_p_ref,  # [B] float32 in [0, 1]
    probs_ref,  # [B, V] the whole array
    token_ref,  # [B] int32 out
    rounds_ref,  # [B] int32 out
    *,
    block: int,
    num_blocks: int,
    table_size: int,
    max_rounds: int,
    stream: int,
    order: str,
    prefetch: bool,
):
    row = pl.program_id(0)
    reader = RowReader(probs_ref, row, block, num_blocks, table_size, prefetch)
    vocab = reader.vocab
    words = (key0_ref[row], key1_ref[row])
    top_k = top_k_ref[row]
    top_p = top_p_ref[row]
    min_p = min_p_ref[row]
    load = _probability_blocks(reader)

    def uniform(round_index):
        return rng.uniform_open(rng.random_bits(words, round_index, stream))

    table, largest = _first_table(reader)
    total = jnp.sum(table)
    top_k_filters = top_k < vocab
    if order == "joint":
        nucleus = total
    else:  # top-p of the renormalized top-k: the top-k mass, found without sorting
        # (only where top-p filters at all: otherwise the nucleus is never read)
        top_k_edge = top_k_boundary(num_blocks, load, top_k, top_k_filters & (top_p < 1))
        top_k_mass = top_k_edge.mass_above + top_k_edge.ties_kept.astype(jnp.float32) * (
            top_k_edge.value
        )
        nucleus = jnp.where(top_k_filters & (top_p < 1), top_k_mass, total)
    top_p_bound = top_p * nucleus
    min_p_bound = min_p * largest

    def passes(count_above, mass_above, value):
        """``threshold_passes`` of the reference, from a pass's count and mass."""
        return (
            (count_above < top_k)
            & ((count_above == 0) | (top_p >= 1) | (mass_above < top_p_bound))
            & (value >= min_p_bound)
        )

    def undecided(state):
        _, _, _, token, rounds, _ = state
        return (token < 0) & (rounds < max_rounds)

    def one_round(state):
        low_value, low_index, high_value, _, rounds, candidates = state

        def candidate_weights(block_index):
            columns, weights = reader.weights(block_index)
            above_low = (weights > low_value) | ((weights == low_value) & (columns < low_index))
            return columns, jnp.where(above_low, weights, 0.0)

        token, value = pick_by_table(reader, candidates, uniform(rounds), candidate_weights)
        middle = (value + high_value) / 2
        # Only min-p filters: every candidate is kept, so the pivot tests cannot fail and need
        # no counts; the pass runs no iteration (passes(0, 0, value) is the full pass's verdict
        # then). A trip count, not a lax.cond: a cond inside this while loop does not lower; and
        # a product, not a jnp.where of two ints, whose lowering gives the loop's upper bound
        # another type than its lower bound (the GPU host's verifier refuses that scf.for).
        blocks_to_read = (top_k_filters | (top_p < 1)).astype(jnp.int32) * num_blocks
        count0, table0, count1, table1 = _pivot_pass(reader, value, token, middle, blocks_to_read)
        accept = passes(count0, jnp.sum(table0), value)
        middle_passes = passes(count1, jnp.sum(table1), middle)
        return (
            jnp.where(middle_passes, value, middle),
            jnp.where(middle_passes, token, 0),
            jnp.where(middle_passes, middle, high_value),
            jnp.where(accept, token, -1),
            rounds + 1,
            jnp.where(middle_passes, table0, table1),
        )

    # With min-p, the first candidates are the tokens min-p keeps, ``weight >= min_p_bound``:
    # position (min_p_bound, V): the same candidates as the reference's ``initial_state``,
    # whose threshold is the smallest weight at or above the bound. One more pass, and
    # min-p alone then takes exactly one round.
    uses_min_p = min_p_bound > 0
    first_candidates = lax.cond(
        uses_min_p, lambda: _min_p_table(reader, min_p_bound), lambda: table
    )
    state = (
        jnp.where(uses_min_p, min_p_bound, 0.0),
        jnp.where(uses_min_p, jnp.int32(vocab), jnp.int32(0)),
        largest,
        jnp.int32(-1),
        jnp.int32(0),
        first_candidates,
    )
    _, _, _, token, rounds, _ = lax.while_loop(undecided, one_round, state)

    def fallback():
        """The reference's exact fallback: draw from the kept set with the last uniform."""
        k_edge = top_k_boundary(num_blocks, load, top_k, top_k_filters)
        p_edge = top_p_boundary(num_blocks, load, top_p_bound, top_p < 1, order_keys(largest))

        def kept_weights(block_index, k_ties_before, p_ties_before):
            keys, weights, _ = load(block_index)
            k_tie, k_rank = tie_ranks(keys, k_edge.key, k_ties_before)
            p_tie, p_rank = tie_ranks(keys, p_edge.key, p_ties_before)
            keep = k_edge.keeps(keys, k_rank) & p_edge.keeps(keys, p_rank)
            keep = keep & (weights >= min_p_bound)
            return jnp.where(keep, weights, 0.0), k_tie, p_tie

        def tabulate(block_index, carry):
            kept_table, k_ties, p_ties, k_ties_table, p_ties_table = carry
            kept, k_tie, p_tie = kept_weights(block_index, k_ties, p_ties)
            return (
                reader.set_entry(kept_table, block_index, jnp.sum(kept)),
                k_ties + jnp.sum(k_tie.astype(jnp.int32), dtype=jnp.int32),
                p_ties + jnp.sum(p_tie.astype(jnp.int32), dtype=jnp.int32),
                reader.set_entry(k_ties_table, block_index, k_ties),
                reader.set_entry(p_ties_table, block_index, p_ties),
            )

        zeros = jnp.zeros((table_size,), jnp.float32)
        zero_counts = jnp.zeros((table_size,), jnp.int32)
        kept_table, _, _, k_ties_table, p_ties_table = lax.fori_loop(
            0,
            num_blocks,
            tabulate,
            (zeros, jnp.int32(0), jnp.int32(0), zero_counts, zero_counts),
        )

        def block_kept(block_index):
            kept, _, _ = kept_weights(
                block_index,
                reader.entry(k_ties_table, block_index),
                reader.entry(p_ties_table, block_index),
            )
            return reader.columns(block_index), kept

        chosen, _ = pick_by_table(reader, kept_table, uniform(max_rounds), block_kept)
        return chosen

    fell_back = token < 0
    token = lax.cond(fell_back, fallback, lambda: token)
    rounds = jnp.where(fell_back, max_rounds + 1, rounds)
    token_ref[row] = jnp.clip(token, 0, vocab - 1)
    rounds_ref[row] = rounds


@functools.partial(
    jax.jit,
    static_argnames=(
        "order",
        "max_rounds",
        "stream",
        "block",
        "num_warps",
        "num_stages",
        "prefetch",
        "interpret",
    ),
)
def dual_pivot_sample(
    probs: jax.Array,
    row_key_words: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    *,
    order: str,
    max_rounds: int,
    stream: int,
    block: int = DEFAULT_BLOCK,
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = 1,
    prefetch: bool = DEFAULT_PREFETCH,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row through the filters by dual-pivot rejection.

    Args:
      probs: float32 ``[B, V]`` non-negative weights.
      row_key_words: uint32 ``[B, 2]`` from ``rng.row_keys``.
      top_k: int32 ``[B]`` in ``[1, V]`` (``V`` disables).
      top_p: float32 ``[B]`` in ``(0, 1]`` (1 disables).
      min_p: float32 ``[B]`` in ``[0, 1]`` (0 disables).
      order: ``"joint"`` or ``"top_k_first"``.
      max_rounds: rounds before the exact fallback.
      stream: the generator stream of the round uniforms (``sampling.api.ROUND_STREAM``).
      block, num_warps, num_stages: launch parameters (a power-of-two ``block``).
      prefetch: each pass issues a block's loads one block early (``row_select.fold_blocks``);
        the same tokens either way.
      interpret: Pallas interpret mode (CPU).

    Returns:
      ``(tokens int32[B], rounds int32[B])``; ``rounds = max_rounds + 1`` where the fallback
      decided. Tokens are always inside ``[0, V)``.
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    batch, vocab = probs.shape
    if batch == 0:  # no program to launch (a grid of 0 is no launch at all)
        return jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.int32)
    # A short row needs no block longer than itself, nor more warps than a block keeps busy (16
    # columns a thread); interpret mode (tests) gains the most.
    block = min(block, max(32, pl.next_power_of_2(vocab)))
    num_warps = max(1, min(num_warps, block // 256))
    num_blocks = pl.cdiv(vocab, block)
    table_size = pl.next_power_of_2(num_blocks)

    operands = (
        row_key_words[:, 0],
        row_key_words[:, 1],
        top_k.astype(jnp.int32),
        top_p.astype(jnp.float32),
        min_p.astype(jnp.float32),
        probs.astype(jnp.float32),
    )
    out_shape = (
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    )
    tokens, rounds = pl.pallas_call(
        functools.partial(
            dual_pivot_kernel,
            block=block,
            num_blocks=num_blocks,
            table_size=table_size,
            max_rounds=max_rounds,
            stream=stream,
            order=order,
            prefetch=prefetch,
        ),
        grid=(batch,),
        in_specs=[whole_array(x.shape) for x in operands],
        out_specs=(whole_array((batch,)), whole_array((batch,))),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"dual_pivot_{order}_b{block}",
    )(*operands)
    return tokens, rounds
