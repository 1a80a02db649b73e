"""Renormalize-to-kept-set and mask kernels (Pallas, Triton lowering): no sort.

What they compute, row by row, exactly as ``sampling/api.py``'s references define them:

- ``top_k_renorm``: ``probs`` restricted to the first ``top_k`` tokens of the order
  (probability descending, index ascending) and divided by their sum;
- ``top_p_renorm``: ``probs`` restricted to the top-p set (the tokens ranked before the mass
  ``top_p * sum(probs)`` is reached, and the one that crosses it) and divided by their sum;
- ``top_k_mask``: ``logits`` with every token outside the first ``top_k`` set to ``-inf``.

How (one program per row): the boundary token is found by radix selection over order keys
(``row_select.top_k_boundary`` / ``top_p_boundary``: 9 passes of compares in registers, no
sort); tied tokens at the boundary are kept lowest index first, by a running tie rank. The
renorm kernels then sum the kept mass (one pass) and write the output (one pass); the mask
kernel writes directly.

What can differ from the reference: top-k decisions are exact (integer counts); a top-p
decision within a float32 rounding error of ``top_p * sum(probs)`` can differ, because the
kernel sums in block order and the reference in sorted order. Kept probabilities are divided by
a block-order sum: within a few float32 ulps of the reference's.

Byte floor: read the row once and write it once, ``8 V`` bytes; these kernels read it 11 times
(``top_p_renorm``: 12) (from L2 when the batch fits in its 60 MB), trading passes for having no sort.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.platform import whole_array
from kernels_pallas.row_select import (
    RowReader,
    order_keys,
    tie_ranks,
    top_k_boundary,
    top_p_boundary,
)

MODES = ("top_k_renorm", "top_p_renorm", "top_k_mask")


def filter_kernel(
    parameter_ref,  # [B] int32 top_k | float32 top_p
    values_ref,  # [B, V] probabilities or logits (the whole array)
    out_ref,  # [B, V]
    *,
    mode: str,
    block: int,
    num_blocks: int,
    table_size: int,
):
    row = pl.program_id(0)
    reader = RowReader(values_ref, row, block, num_blocks, table_size)
    vocab = reader.vocab
    parameter = parameter_ref[row]
    from_logits = mode == "top_k_mask"

    def load_values(block_index):
        """``(keys, weights, in_row, values)``: logits are ordered by value (-0.0 as +0.0, as
        the reference's sort has them) and weigh nothing; probabilities weigh themselves (bad
        values 0, as everywhere)."""
        if from_logits:
            _, in_row, values = reader.raw(block_index, -jnp.inf)
            keys = order_keys(jnp.where(values == 0, 0.0, values))
            return keys, jnp.zeros_like(values), in_row, values
        _, in_row, values = reader.raw(block_index, 0.0)
        weights = jnp.where(values > 0, values, 0.0)
        return order_keys(weights), weights, in_row, values

    def load(block_index):
        return load_values(block_index)[:3]

    if mode == "top_p_renorm":

        def add_block(block_index, carry):
            total, largest = carry
            weights = load(block_index)[1]
            return total + jnp.sum(weights), jnp.maximum(largest, jnp.max(weights))

        total, largest = lax.fori_loop(
            0, num_blocks, add_block, (jnp.float32(0.0), jnp.float32(0.0))
        )
        edge = top_p_boundary(
            num_blocks, load, parameter * total, parameter < 1, order_keys(largest)
        )
    else:
        edge = top_k_boundary(num_blocks, load, parameter, parameter < vocab)

    def kept(block_index, ties_before):
        keys, weights, in_row, values = load_values(block_index)
        is_tie, rank = tie_ranks(keys, edge.key, ties_before)
        return edge.keeps(keys, rank) & in_row, values, weights, in_row, is_tie

    if mode != "top_k_mask":

        def add_kept(block_index, carry):
            total, ties = carry
            keep, _, weights, _, is_tie = kept(block_index, ties)
            return (
                total + jnp.sum(jnp.where(keep, weights, 0.0)),
                ties + jnp.sum(is_tie.astype(jnp.int32), dtype=jnp.int32),
            )

        kept_mass, _ = lax.fori_loop(0, num_blocks, add_kept, (jnp.float32(0.0), jnp.int32(0)))

    def write(block_index, ties):
        keep, values, weights, in_row, is_tie = kept(block_index, ties)
        if from_logits:
            out = jnp.where(keep, values, -jnp.inf)  # the logit itself, bit for bit
        else:
            out = jnp.where(keep, weights / kept_mass, 0.0)
        plgpu.store(
            # int32 under x64 too, where the loop's index is int64 (the row index is int32)
            out_ref.at[row, pl.ds((block_index * block).astype(jnp.int32), block)],
            out.astype(out_ref.dtype),
            mask=in_row,
        )
        return ties + jnp.sum(is_tie.astype(jnp.int32), dtype=jnp.int32)

    lax.fori_loop(0, num_blocks, write, jnp.int32(0))


@functools.partial(
    jax.jit, static_argnames=("mode", "block", "num_warps", "num_stages", "interpret")
)
def filter_rows(
    values: jax.Array,
    parameter: jax.Array,
    *,
    mode: str,
    block: int = 2048,  # the faster of 1024 and 2048 on the H200 (bench/tuning/sampling.py)
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool = False,
) -> jax.Array:
    """Applies one filter to every row (module docstring).

    Args:
      values: ``[B, V]`` probabilities (``*_renorm``) or logits (``top_k_mask``), float32 or
        narrower (computed in float32, returned in the input dtype).
      parameter: ``[B]``: ``top_k`` int32 in ``[1, V]``, or ``top_p`` float32 in ``(0, 1]``.
      mode: one of ``MODES``.
      block, num_warps, num_stages: launch parameters (a power-of-two ``block``).
      interpret: Pallas interpret mode (CPU).

    Returns:
      ``[B, V]`` in ``values.dtype``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    batch, vocab = values.shape
    if batch == 0:  # no program to launch (a grid of 0 is no launch at all)
        return jnp.zeros(values.shape, values.dtype)
    # A short row needs no block longer than itself, nor more warps than a block keeps busy (16
    # columns a thread); interpret mode (tests) gains the most.
    block = min(block, max(32, pl.next_power_of_2(vocab)))
    num_warps = max(1, min(num_warps, block // 256))
    num_blocks = pl.cdiv(vocab, block)
    parameter = parameter.astype(jnp.float32 if mode == "top_p_renorm" else jnp.int32)

    return pl.pallas_call(
        functools.partial(
            filter_kernel,
            mode=mode,
            block=block,
            num_blocks=num_blocks,
            table_size=pl.next_power_of_2(num_blocks),
        ),
        grid=(batch,),
        in_specs=[whole_array(parameter.shape), whole_array(values.shape)],
        out_specs=whole_array(values.shape),
        out_shape=jax.ShapeDtypeStruct(values.shape, values.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"{mode}_b{block}",
    )(parameter, values)
