"""Sampling kernels (Pallas, Triton lowering): the Gumbel-max race here, and the public names of
the other two families, each in its own module:

- ``gumbel_sample`` (this module): one pass, no softmax, no noise array;
- ``dual_pivot_sample`` (``kernels_pallas/dual_pivot.py``): top-k, top-p, min-p and joint
  filtered sampling by dual-pivot rejection, one pass a round;
- ``filter_rows`` (``kernels_pallas/filter_masks.py``): top-k / top-p renormalization and
  top-k masking of logits by radix selection.

All three were written against the references of ``sampling/`` and checked in interpret mode;
``sampling.api.KERNELS_CHECKED_ON_GPU`` records whether they were also compiled and timed on a
GPU.

**The Gumbel-max race.** What it computes: for each row, ``argmax_i (logits_i / T - log E_i)``
(from logits; greedy ``argmax_i logits_i`` at ``T = 0``) or ``argmax_i p_i / E_i`` (from
probabilities, raced as ``log p_i - log E_i`` so huge weights cannot overflow), with
``E_i = rng.exponential(rng.random_bits(row_key, i, stream))``: the same numbers the reference
draws (``sampling/api.py``), so both pick the same token.

What it optimizes: sampling is a read of ``B x V`` values once. The noise is computed in
registers from the counter-based generator, never read from memory. A row is cut into chunks
of ``blocks_per_program`` blocks of ``block`` columns so that even one row fills many SMs; each
program writes its chunk's best score and the lowest index reaching it, and a tiny XLA reduction
over chunks picks the row's winner (the first chunk with the maximum, so ties go to the lowest
index everywhere).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import rng
from kernels_pallas.dual_pivot import dual_pivot_sample
from kernels_pallas.filter_masks import filter_rows
from kernels_pallas.platform import whole_array
from kernels_pallas.row_select import INDEX_SENTINEL

__all__ = ["dual_pivot_sample", "filter_rows", "gumbel_sample"]

# The same floor as sampling.reference.MIN_TEMPERATURE (kernels_pallas imports nothing above it).
MIN_TEMPERATURE = 1e-30


def gumbel_race_kernel(
    key0_ref,  # [B] uint32, the rows' key words (whole arrays)
    key1_ref,  # [B] uint32
    temperature_ref,  # [B] float32 (from logits) | unused (from probabilities)
    values_ref,  # [B, V] logits or probabilities, the whole array
    best_score_ref,  # [B, num_chunks] float32, the whole array
    best_index_ref,  # [B, num_chunks] int32, the whole array
    *,
    from_logits: bool,
    block: int,
    blocks_per_program: int,
    stream: int,
):
    row = pl.program_id(0)
    chunk = pl.program_id(1)
    vocab = values_ref.shape[1]
    words = (key0_ref[row], key1_ref[row])
    temperature = temperature_ref[row]
    greedy = temperature < MIN_TEMPERATURE
    divisor = jnp.where(greedy, 1.0, temperature)

    half = block // 2
    lane = jnp.arange(2, dtype=jnp.int32)[None, :]

    def step(i, carry):
        best_score, best_index = carry
        start = (chunk * blocks_per_program + i) * block
        columns = start + jnp.arange(block, dtype=jnp.int32)
        in_row = columns < vocab
        empty = -jnp.inf if from_logits else 0.0
        values = plgpu.load(
            values_ref.at[row, pl.ds(start, block)], mask=in_row, other=empty
        ).astype(jnp.float32)  # [block]
        # Columns 2m and 2m + 1 take the two words of one Threefry block (rng.random_bit_pairs):
        # half the generator's work of one call per column, the very same numbers. The block
        # is viewed as [block / 2, 2] (pair, lane) so each pair's two words meet their columns.
        values = values.reshape(half, 2)
        columns = columns.reshape(half, 2)
        in_row = in_row.reshape(half, 2)
        pairs = (start // 2 + jnp.arange(half, dtype=jnp.int32)).astype(jnp.uint32)
        even_bits, odd_bits = rng.random_bit_pairs(words, pairs, stream)
        noise = jnp.where(
            lane == 0,
            rng.exponential(even_bits)[:, None],
            rng.exponential(odd_bits)[:, None],
        )  # [block / 2, 2]
        if from_logits:
            scaled = jnp.where(values == -jnp.inf, -jnp.inf, values / divisor)
            score = jnp.where(greedy, values, scaled - jnp.log(noise))
        else:
            # log space: p / E would overflow for huge weights (E >= 2**-33)
            score = jnp.log(values) - jnp.log(noise)
        # Out of the row, and NaN (invalid input only jit lets through), never win.
        score = jnp.where(in_row & ~jnp.isnan(score), score, -jnp.inf)
        block_best = jnp.max(score)
        block_index = jnp.min(jnp.where(score == block_best, columns, INDEX_SENTINEL))
        better = block_best > best_score  # strict: an earlier block keeps a tie
        return (
            jnp.where(better, block_best, best_score),
            jnp.where(better, block_index, best_index),
        )

    init = (jnp.float32(-jnp.inf), jnp.int32(chunk * blocks_per_program * block))
    best_score, best_index = lax.fori_loop(0, blocks_per_program, step, init)
    best_score_ref[row, chunk] = best_score
    best_index_ref[row, chunk] = jnp.minimum(best_index, vocab - 1).astype(jnp.int32)


@functools.partial(
    jax.jit,
    static_argnames=(
        "from_logits",
        "stream",
        "block",
        "blocks_per_program",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def gumbel_sample(
    values: jax.Array,
    row_key_words: jax.Array,
    temperature: jax.Array,
    *,
    from_logits: bool,
    stream: int,
    block: int = 1024,
    blocks_per_program: int = 2,  # best or within 1% at B = 1, 32, 256 (bench/tune_sampling.py)
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool = False,
) -> jax.Array:
    """Samples one token per row by the exponential race.

    Args:
      values: ``[B, V]`` logits (``from_logits``) or non-negative probabilities.
      row_key_words: uint32 ``[B, 2]`` from ``rng.row_keys``.
      temperature: float32 ``[B]`` (ignored for probabilities); below ``MIN_TEMPERATURE`` is
        greedy.
      from_logits: which race (module docstring).
      stream: the generator stream of the noise (``sampling.api.EXPONENTIAL_STREAM``).
      block, blocks_per_program, num_warps, num_stages: launch parameters (a power-of-two ``block``).
      interpret: Pallas interpret mode (CPU).

    Returns:
      int32 ``[B]`` tokens, always inside ``[0, V)``.
    """
    batch, vocab = values.shape
    chunk_columns = block * blocks_per_program
    num_chunks = pl.cdiv(vocab, chunk_columns)

    key0 = row_key_words[:, 0]
    key1 = row_key_words[:, 1]
    out_shape = (
        jax.ShapeDtypeStruct((batch, num_chunks), jnp.float32),
        jax.ShapeDtypeStruct((batch, num_chunks), jnp.int32),
    )
    scores, indices = pl.pallas_call(
        functools.partial(
            gumbel_race_kernel,
            from_logits=from_logits,
            block=block,
            blocks_per_program=blocks_per_program,
            stream=stream,
        ),
        grid=(batch, num_chunks),
        in_specs=[
            whole_array(key0.shape),
            whole_array(key1.shape),
            whole_array(temperature.shape),
            whole_array(values.shape),
        ],
        out_specs=(whole_array(out_shape[0].shape), whole_array(out_shape[1].shape)),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"gumbel_{'logits' if from_logits else 'probs'}_b{block}x{blocks_per_program}",
    )(key0, key1, temperature.astype(jnp.float32), values)
    winner = jnp.argmax(scores, axis=1)  # the first chunk with the maximum: lowest index on ties
    return jnp.take_along_axis(indices, winner[:, None], axis=1)[:, 0]
