"""In-kernel building blocks for the filtered samplers: one row, read block by block, no sort.

Every function here runs inside a Pallas kernel (Triton lowering) whose program owns one row of
a ``[B, V]`` array, and loops over the row in blocks of ``block`` columns (a power of two; the
last block is masked). Nothing is sorted and nothing is written to scratch memory: what must
survive between passes lives in registers, including a *block table*, a vector with one entry
per block of the row (``table_size`` entries, a power of two at least ``cdiv(V, block)``).

The pieces, each one pass over the row unless said otherwise:

- ``RowReader``: masked loads of one block as non-negative weights (NaN, negative numbers and
  the padding past the row weigh 0) or as order keys.
- ``largest_key_reaching``: radix selection. For weights ``w`` and integer order keys ``key``,
  the largest threshold ``t`` with ``sum(w[key >= t]) >= target``, found ``RADIX_BITS`` bits at
  a time (``32 / RADIX_BITS`` passes, each summing ``2**RADIX_BITS`` thresholds at once). With
  unit weights and ``target = k`` it is the key of the k-th largest token (the top-k boundary);
  with probability weights and ``target = top_p * total`` it is the value of the token that
  crosses ``top_p`` (the top-p boundary).
- ``Boundary`` and ``kept``: the kept set of top-k, top-p and min-p from the boundaries,
  tie-correct: among tokens tied at a boundary value, the lowest indices are kept, counted
  with a running tie rank across blocks (the order of ``sampling/filters.py``).
- ``pick_by_table``: inverse-transform sampling from a block table of masses and one uniform:
  the block is found in the table (no pass), then that one block is read.

Integer sums and running counts name ``dtype=jnp.int32``: under x64 (``jax.enable_x64``),
``jnp.sum`` of int32 gives int64, which a loop's int32 carry refuses; every kernel here keeps
its integers int32 in either mode.

Float sums here run in block order, not in the sorted order of ``sampling/filters.py``; a
top-p decision within a rounding error of ``top_p * total`` can therefore differ from the
definition's. The kernels' tests measure how often.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

RADIX_BITS = 4
RADIX_LANES = 1 << RADIX_BITS
INDEX_SENTINEL = 2**31 - 1  # above any column: min() over it means "no column"
_SIGN_BIT = -(2**31)  # int32 with only bit 31 set


def order_keys(values: jax.Array) -> jax.Array:
    """int32 keys with the order of the float32 ``values``: ``a < b`` iff ``key(a) < key(b)``
    (NaN excepted). Non-negative floats keep their bit pattern; negative ones have their 31 low
    bits flipped, so more negative means smaller."""
    bits = lax.bitcast_convert_type(values.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def key_to_value(key) -> jax.Array:
    """The float32 whose ``order_keys`` is ``key`` (the inverse map)."""
    key = jnp.asarray(key, jnp.int32)
    bits = jnp.where(key < 0, key ^ jnp.int32(0x7FFFFFFF), key)
    return lax.bitcast_convert_type(bits, jnp.float32)


def as_weights(values: jax.Array) -> jax.Array:
    """Probabilities as weights ``>= 0`` (``+0.0``, never ``-0.0``): NaN and negative values
    (bad input only ``jit`` lets through) weigh 0."""
    return jnp.where(values > 0, values, 0.0)


@dataclasses.dataclass(frozen=True)
class RowReader:
    """Block reads of one row of a ``[B, V]`` ref.

    Attributes:
      ref: the whole ``[B, V]`` input ref.
      row: this program's row.
      block: columns per block (a power of two).
      num_blocks: ``cdiv(V, block)``.
      table_size: entries of a block table (a power of two, ``>= num_blocks``).
      prefetch: passes over the row (``fold``) issue each block's loads one block early
        (``fold_blocks``).
    """

    ref: object
    row: jax.Array
    block: int
    num_blocks: int
    table_size: int
    prefetch: bool = False

    @property
    def vocab(self) -> int:
        return self.ref.shape[1]

    def columns(self, block_index) -> jax.Array:
        """int32 ``[block]``: the columns of block ``block_index``."""
        return block_index * self.block + jnp.arange(self.block, dtype=jnp.int32)

    def raw(self, block_index, other) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(columns, in_row, values float32[block])``; columns past the row read ``other``."""
        columns = self.columns(block_index)
        in_row = columns < self.vocab
        values = plgpu.load(
            self.ref.at[self.row, pl.ds(block_index * self.block, self.block)],
            mask=in_row,
            other=other,
        ).astype(jnp.float32)
        return columns, in_row, values

    def weights(self, block_index) -> tuple[jax.Array, jax.Array]:
        """``(columns, weights)``: probabilities as weights ``>= 0`` (``+0.0``, never ``-0.0``);
        NaN and negative values (bad input only ``jit`` lets through) and padding weigh 0."""
        columns, _, values = self.raw(block_index, 0.0)
        return columns, as_weights(values)

    def fold(self, body, init, num_blocks=None):
        """One pass over the row's weights: ``carry = body(block_index, columns, weights,
        carry)`` for blocks ``0 .. num_blocks - 1`` (all by default), prefetching when
        ``self.prefetch``. Only the raw values travel between iterations; columns and weights
        are recomputed from them (cheaper than registers)."""
        return fold_blocks(
            self.num_blocks if num_blocks is None else num_blocks,
            lambda block_index: self.raw(block_index, 0.0)[2],
            lambda block_index, values, carry: body(
                block_index, self.columns(block_index), as_weights(values), carry
            ),
            init,
            prefetch=self.prefetch,
        )

    def table_ids(self) -> jax.Array:
        return jnp.arange(self.table_size, dtype=jnp.int32)

    def set_entry(self, table: jax.Array, block_index, value) -> jax.Array:
        """``table`` with entry ``block_index`` replaced (a register vector: no memory)."""
        return jnp.where(self.table_ids() == block_index, value, table)

    def entry(self, table: jax.Array, block_index) -> jax.Array:
        """``table[block_index]`` (0 when out of range)."""
        return jnp.sum(jnp.where(self.table_ids() == block_index, table, 0), dtype=table.dtype)


def fold_blocks(num_blocks, load, body, init, *, prefetch: bool):
    """``lax.fori_loop`` over a row's blocks: ``carry = body(block_index, load(block_index),
    carry)``, optionally with each block's loads issued one iteration early.

    Why: a program streams its row block by block, and every block ends in reductions (a
    table entry, a count) that wait for the whole block. Without prefetching, a block's loads
    start only after the previous block's reductions, so each iteration pays a full memory
    latency; Triton's software pipeliner does not take these masked loads (``num_stages``
    changed nothing in ``bench/tuning/sampling.py``). With ``prefetch=True`` iteration ``i``
    first issues block ``i + 1``'s loads, then reduces block ``i``, whose values it received
    in the carry: the latency hides behind the arithmetic, at the cost of a second block of
    registers. The last iteration loads block ``num_blocks``, past the range: ``load`` must
    mask it (``RowReader`` masks columns past the row) or keep it inside the array.

    Args:
      num_blocks: a static int or an int32 scalar (blocks to visit, from 0).
      load: ``block_index -> pytree of arrays``: the block's loads, no arithmetic on them that
        ``body`` could do later.
      body: ``(block_index, loaded, carry) -> carry``.
      init: the initial carry.
      prefetch: issue the loads one iteration early.
    """
    if not prefetch:
        return lax.fori_loop(0, num_blocks, lambda i, carry: body(i, load(i), carry), init)

    def step(block_index, state):
        carry, current = state
        upcoming = load(block_index + 1)  # issued first: in flight during body's reductions
        return body(block_index, current, carry), upcoming

    carry, _ = lax.fori_loop(0, num_blocks, step, (init, load(0)))
    return carry


def largest_key_reaching(num_blocks: int, load_block, target) -> jax.Array:
    """Radix selection: the largest int32 ``t`` with ``sum(w[key >= t]) >= target``.

    Bits are fixed from the most significant down, ``RADIX_BITS`` per pass: knowing the
    answer's high bits (``prefix``), one pass sums the weights at or above each of the
    ``RADIX_LANES`` thresholds ``prefix | digit`` and keeps the largest digit whose sum still
    reaches ``target``. Sums over nested sets of non-negative weights, taken in the same order,
    are monotone in floating point too, so the digit is well defined, and the same threshold
    summed in two passes gives the same float.

    If even ``sum(w)`` is below ``target``, the answer is the smallest key, ``-2**31``.

    Args:
      num_blocks: blocks in the row.
      load_block: ``block_index -> (keys int32[block], weights float32[block])``; padding must
        weigh 0.
      target: float32 scalar.

    Returns:
      int32 scalar: the key threshold.
    """
    digits = jnp.arange(RADIX_LANES, dtype=jnp.int32)
    num_levels = 32 // RADIX_BITS

    def level(step, biased_prefix):
        # Thresholds live in the "biased" unsigned order (key ^ sign bit), so that digits can be
        # appended from the top bit down; each is compared in the signed order it stands for.
        shift = 32 - RADIX_BITS * (step + 1)
        thresholds = (biased_prefix | (digits << shift)) ^ _SIGN_BIT  # int32[RADIX_LANES]

        def accumulate(block_index, reached):
            keys, weights = load_block(block_index)
            at_or_above = keys[:, None] >= thresholds[None, :]
            return reached + jnp.sum(jnp.where(at_or_above, weights[:, None], 0.0), axis=0)

        reached = lax.fori_loop(0, num_blocks, accumulate, jnp.zeros((RADIX_LANES,), jnp.float32))
        digit = jnp.maximum(jnp.sum((reached >= target).astype(jnp.int32), dtype=jnp.int32) - 1, 0)
        return biased_prefix | (digit << shift)

    biased = lax.fori_loop(0, num_levels, level, jnp.int32(0))
    return biased ^ _SIGN_BIT


def above_key(num_blocks: int, load_block, threshold) -> tuple[jax.Array, jax.Array]:
    """One pass: ``(count, mass)`` of the tokens with ``key > threshold`` (mass: the weights)."""

    def accumulate(block_index, carry):
        count, mass = carry
        keys, weights = load_block(block_index)
        over = keys > threshold
        return (
            count + jnp.sum(over.astype(jnp.int32), dtype=jnp.int32),
            mass + jnp.sum(jnp.where(over, weights, 0.0)),
        )

    return lax.fori_loop(0, num_blocks, accumulate, (jnp.int32(0), jnp.float32(0.0)))


@dataclasses.dataclass(frozen=True)
class Boundary:
    """Where one filter's kept prefix ends, as a key and a rule for the tokens tied at it.

    A token is kept iff its key is above ``key``, or equal and its tie rank (how many tokens of
    the same key come before it by index) passes ``keeps_tie``. ``active=False`` keeps every
    token.

    Attributes:
      active: bool scalar.
      key: int32 scalar, the boundary token's order key.
      value: float32 scalar, the boundary token's value.
      count_above: int32 scalar, tokens with a larger key.
      mass_above: float32 scalar, their weight.
      ties_kept: for top-k, how many tied tokens are kept (int32); None for top-p.
      target: for top-p, ``top_p * nucleus``; tie ``i`` is kept iff
        ``mass_above + i * value < target``, or it is the row's first token.
    """

    active: jax.Array
    key: jax.Array
    value: jax.Array
    count_above: jax.Array
    mass_above: jax.Array
    ties_kept: jax.Array | None = None
    target: jax.Array | None = None

    def keeps(self, keys: jax.Array, tie_rank: jax.Array) -> jax.Array:
        """bool[block] for tokens with these keys and (exclusive) tie ranks."""
        if self.ties_kept is not None:
            tie_ok = tie_rank < self.ties_kept
        else:
            tie_ok = (self.mass_above + tie_rank.astype(jnp.float32) * self.value < self.target) | (
                (self.count_above == 0) & (tie_rank == 0)  # the first token is always kept
            )
        return ~self.active | (keys > self.key) | ((keys == self.key) & tie_ok)


def _no_boundary(operand):
    """``(key, count, mass)`` of an inactive boundary: the smallest key, nothing above.

    Computed from ``operand`` rather than written as constants: the Triton lowering of
    ``lax.cond`` cannot yield a branch output that is a bare literal."""
    zero = (operand * 0).astype(jnp.int32)
    return zero + jnp.int32(_SIGN_BIT), zero, zero.astype(jnp.float32)


def top_k_boundary(num_blocks: int, load_block, top_k, active) -> Boundary:
    """The top-k boundary: the ``top_k``-th token of the order (``9`` passes when ``active``).

    ``load_block`` gives ``(keys, weights)``: the keys order the tokens, each in-row token
    counts once (the weights only feed ``mass_above``, the top-k mass above the boundary)."""

    def search():
        def counted(block_index):
            keys, _, in_row = load_block(block_index)
            return keys, in_row.astype(jnp.float32)

        key = largest_key_reaching(num_blocks, counted, top_k.astype(jnp.float32))
        count, mass = above_key(num_blocks, lambda i: load_block(i)[:2], key)
        return key, count, mass

    key, count, mass = lax.cond(active, search, lambda: _no_boundary(top_k))
    return Boundary(
        active=active,
        key=key,
        value=key_to_value(key),
        count_above=count,
        mass_above=mass,
        ties_kept=top_k - count,
    )


def top_p_boundary(num_blocks: int, load_block, target, active, largest_key) -> Boundary:
    """The top-p boundary: the token whose mass crosses ``target`` (``9`` passes when
    ``active``). ``load_block`` gives ``(keys, weights, in_row)`` of probabilities;
    ``largest_key`` is the row's largest key.

    Where ``target <= 0`` (``top_p * total`` underflows) every threshold reaches it, and the
    search would return the largest int32, the key of no token; the boundary is then the row's
    first token, which the definition always keeps (``Boundary.keeps``)."""

    def search():
        key = largest_key_reaching(num_blocks, lambda i: load_block(i)[:2], target)
        key = jnp.minimum(key, largest_key)
        count, mass = above_key(num_blocks, lambda i: load_block(i)[:2], key)
        return key, count, mass

    key, count, mass = lax.cond(active, search, lambda: _no_boundary(target))
    return Boundary(
        active=active,
        key=key,
        value=key_to_value(key),
        count_above=count,
        mass_above=mass,
        target=target,
    )


def tie_ranks(keys: jax.Array, boundary_key, ties_before) -> tuple[jax.Array, jax.Array]:
    """``(is_tie bool[block], rank int32[block])``: which tokens of the block share the boundary
    key, and each one's rank among all such tokens of the row (``ties_before`` came in earlier
    blocks)."""
    is_tie = keys == boundary_key
    inclusive = jnp.cumsum(is_tie.astype(jnp.int32), dtype=jnp.int32)
    return is_tie, ties_before + inclusive - is_tie.astype(jnp.int32)


def pick_by_table(reader: RowReader, table: jax.Array, uniform, block_weights):
    """Inverse-transform sampling from a block table and one uniform (one block read).

    ``table[b]`` is the mass of block ``b``'s eligible tokens and ``block_weights(b)`` gives
    ``(columns, eligible weights)`` of that block. The token chosen is the first whose running
    mass exceeds ``uniform * sum(table)``. If rounding leaves no such token in the block the
    table pointed to (or the target past the end), the last eligible token of positive weight
    in that block (or in the last block of positive mass) is taken: never a token of zero
    weight, unless the row has no eligible mass at all (then ``-1``).

    Returns:
      ``(token int32, value float32)``: the column and its weight.
    """
    ids = reader.table_ids()
    running_table = jnp.cumsum(table)
    target = uniform * jnp.sum(table)
    # The first block of positive mass whose running sum passes the target: a running sum that
    # dips by an ulp (a scan may reassociate) cannot send the draw to an empty block.
    crossing = (running_table > target) & (table > 0) & (ids < reader.num_blocks)
    chosen = jnp.min(jnp.where(crossing, ids, reader.table_size))
    last_positive_block = jnp.max(jnp.where(table > 0, ids, 0))
    past_the_end = chosen >= reader.num_blocks
    chosen = jnp.where(past_the_end, last_positive_block, chosen)
    before = jnp.sum(jnp.where(ids == chosen - 1, running_table, 0.0))
    columns, weights = block_weights(chosen)
    running = before + jnp.cumsum(weights)
    hit = (running > target) & (weights > 0)
    token = jnp.min(jnp.where(hit, columns, INDEX_SENTINEL))
    last_positive = jnp.max(jnp.where(weights > 0, columns, -1))
    token = jnp.where((token == INDEX_SENTINEL) | past_the_end, last_positive, token)
    value = jnp.sum(jnp.where(columns == token, weights, 0.0))
    return token.astype(jnp.int32), value
