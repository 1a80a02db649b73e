"""Chain speculative sampling kernel (Pallas, Triton lowering): accept tests, then the draw.

What it computes: for each request ``b``, the verification step of ``speculative/reference.py``
with the very same uniforms (``rng``, one stream, four columns a position, listed below): the
drafts' accept tests ``u * q_i(t_i) < p_i(t_i)`` in order, the stopping position ``s`` (the first
rejection, or ``n``), and a token drawn at ``s`` from ``max(p_s - q_s, 0)`` (or ``p_s`` where
that has no mass, and at the bonus position ``s = n``) by the reference's two-level inverse
transform: a chunk of ``chunk_size`` tokens in proportion to its mass, then a token inside it.

What it reads: only what the step needs. The accept tests load two probabilities each, and stop
at the first rejection; then the rows ``p_s`` and ``q_s`` are read once (``q_s`` not at all at the
bonus position, nor with a deterministic drafter, whose ``q`` is one-hot and never stored). About
``8 V`` bytes a request, where the dense inputs hold ``4 (2n + 1) V``.

How: the grid is ``(B, C)``, one program per chunk of the stopping rows, so that even a small
batch spreads over many SMs (B = 64 at vocab 128256 gives 1024 programs). Every program of a row
repeats the row's few accept tests (scalar loads, cheaper than a second launch), then reads its
chunk of ``p_s`` and ``q_s`` block by block, keeping a *block table* of masses in registers
(``row_select``), and draws its chunk's candidate with the second uniform by
``row_select.pick_by_table`` (the table finds the block, one block is read again). A program
writes its chunk's mass and candidate; a merge over the ``C`` chunks of a row (a few XLA
operations on ``[B, C]``) draws the chunk with the first uniform and takes its candidate. The
first level needs only chunk masses, so no program waits for another.

A candidate is drawn from the residual when the chunk's residual has mass, else from ``p_s``.
This is the reference's rule: if the row's residual has mass, the merge only ever draws a chunk
whose residual has mass; if it has none, no chunk's has, and every candidate comes from ``p_s``.

Randomness (the contract with ``speculative/api.py``, which defines the stream): position
``i`` owns columns ``4i`` (its accept test), ``4i + 1`` (the chunk draw) and ``4i + 2`` (the
token draw inside the chunk) of the stream; ``4i + 3`` is unused.

What can differ from the reference: chunk masses are block-order sums here, XLA sums there, and
the in-chunk draw compares running sums with ``uniform * mass`` where the reference compares
normalized running maxima with ``uniform``. A draw whose uniform falls within a float32 rounding
error of a boundary can pick the neighbouring token. The tests measure how often.
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
from kernels_pallas.row_select import RowReader, pick_by_table

COLUMNS_PER_POSITION = 4
ACCEPT_COLUMN, CHUNK_COLUMN, TOKEN_COLUMN = 0, 1, 2
# Launch priors, not yet tuned on a GPU: 1024 columns of two rows a block with 4 warps
# (8 elements a thread per row), so re-reading the chosen block costs an eighth of a chunk.
DEFAULT_BLOCK = 1024
DEFAULT_NUM_WARPS = 4


def _uniform(words, position, offset: int, stream: int) -> jax.Array:
    """The float32 uniform of column ``4 * position + offset`` (module docstring)."""
    column = (position * COLUMNS_PER_POSITION + offset).astype(jnp.uint32)
    return rng.uniform_open(rng.random_bits(words, column, stream))


def spec_accept_kernel(
    key0_ref,  # [B] uint32, the rows' key words
    key1_ref,  # [B] uint32
    draft_token_ids_ref,  # [B, max(n, 1)] int32 inside [0, V)
    target_ref,  # [B * (n + 1), V] float32: row b * (n + 1) + i holds p_i of request b
    *refs,
    num_drafts: int,
    chunk_size: int,
    block: int,
    stream: int,
    deterministic_draft: bool,
):
    if deterministic_draft:
        draft_ref = None
        num_accepted_ref, residual_mass_ref, target_mass_ref, candidate_ref = refs
    else:
        # draft_ref: [B * n, V] float32, row b * n + i holds q_i of request b
        draft_ref, num_accepted_ref, residual_mass_ref, target_mass_ref, candidate_ref = refs
    # outputs, all [B, C]: num_accepted int32, residual and target chunk masses float32, and
    # the chunk's candidate int32 (-1 for a chunk without mass)
    row = pl.program_id(0)
    chunk = pl.program_id(1)
    vocab = target_ref.shape[1]
    words = (key0_ref[row], key1_ref[row])
    last_draft = max(num_drafts - 1, 0)

    def untested(state):
        tested, stopped = state
        return (tested < num_drafts) & ~stopped

    def test_draft(state):
        position, _ = state
        token = draft_token_ids_ref[row, position]
        target_prob = target_ref[row * (num_drafts + 1) + position, token]
        if deterministic_draft:
            draft_prob = jnp.float32(1.0)
        else:
            draft_prob = draft_ref[row * num_drafts + position, token]
        uniform = _uniform(words, position, ACCEPT_COLUMN, stream)
        accepted = uniform * draft_prob < target_prob
        return position + accepted.astype(jnp.int32), ~accepted

    stop, _ = lax.while_loop(untested, test_draft, (jnp.int32(0), jnp.bool_(False)))
    has_draft = stop < num_drafts
    target_row = row * (num_drafts + 1) + stop
    draft_row = row * num_drafts + jnp.minimum(stop, last_draft)
    stop_token = draft_token_ids_ref[row, jnp.minimum(stop, last_draft)]
    chunk_start = chunk * chunk_size
    blocks_per_chunk = chunk_size // block

    def block_weights(block_index):
        """``(columns, residual, target)`` of one block of the chunk, each ``[block]``."""
        start = chunk_start + block_index * block
        columns = start + jnp.arange(block, dtype=jnp.int32)
        in_row = columns < vocab
        target = plgpu.load(target_ref.at[target_row, pl.ds(start, block)], mask=in_row, other=0.0)
        if deterministic_draft:
            draft = jnp.where(has_draft & (columns == stop_token), 1.0, 0.0)
        else:
            # At the bonus position no draft row exists: a fully masked load reads nothing.
            draft = plgpu.load(
                draft_ref.at[draft_row, pl.ds(start, block)], mask=in_row & has_draft, other=0.0
            )
        difference = target - draft
        residual = jnp.where(difference > 0, difference, 0.0)
        return columns, residual, jnp.where(target > 0, target, 0.0)

    # A reader over this chunk: its blocks, and its table of one entry a block.
    reader = RowReader(target_ref, target_row, block, blocks_per_chunk, blocks_per_chunk)

    def tabulate(block_index, tables):
        residual_table, target_table = tables
        _, residual, target = block_weights(block_index)
        return (
            reader.set_entry(residual_table, block_index, jnp.sum(residual)),
            reader.set_entry(target_table, block_index, jnp.sum(target)),
        )

    zeros = jnp.zeros((blocks_per_chunk,), jnp.float32)
    residual_table, target_table = lax.fori_loop(0, blocks_per_chunk, tabulate, (zeros, zeros))
    residual_mass = jnp.sum(residual_table)
    use_residual = residual_mass > 0

    def drawn_weights(block_index):
        columns, residual, target = block_weights(block_index)
        return columns, jnp.where(use_residual, residual, target)

    candidate, _ = pick_by_table(
        reader,
        jnp.where(use_residual, residual_table, target_table),
        _uniform(words, stop, TOKEN_COLUMN, stream),
        drawn_weights,
    )
    num_accepted_ref[row, chunk] = stop
    residual_mass_ref[row, chunk] = residual_mass
    target_mass_ref[row, chunk] = jnp.sum(target_table)
    candidate_ref[row, chunk] = candidate


def _draw_chunks(masses: jax.Array, uniform: jax.Array) -> jax.Array:
    """int32 ``[B]``: each row's chunk, the reference's inverse transform (``sampling.reference.
    inverse_transform``, restated here: ``kernels_pallas`` imports nothing above it) on
    ``masses[B, C]`` with ``uniform[B]``: the running maximum of the running sums, normalized,
    counted below the uniform; a chunk of no mass is never drawn while the row has mass."""
    num_chunks = masses.shape[1]
    cumulative = lax.cummax(jnp.cumsum(masses, axis=1), axis=1)
    normalized = cumulative / cumulative[:, -1:]
    chosen = jnp.sum(normalized <= uniform[:, None], axis=1).astype(jnp.int32)
    positions = jnp.arange(num_chunks, dtype=jnp.int32)
    last_positive = jnp.max(jnp.where(masses > 0, positions, 0), axis=1)
    chosen_mass = jnp.take_along_axis(masses, jnp.minimum(chosen, num_chunks - 1)[:, None], 1)
    past_the_end = (chosen >= num_chunks) | (chosen_mass[:, 0] <= 0)
    return jnp.where(past_the_end, last_positive, chosen)


@functools.partial(
    jax.jit,
    static_argnames=("chunk_size", "stream", "block", "num_warps", "num_stages", "interpret"),
)
def chain_speculative_sample(
    draft_probs: jax.Array | None,
    draft_token_ids: jax.Array,
    target_probs: jax.Array,
    row_key_words: jax.Array,
    *,
    chunk_size: int,
    stream: int,
    block: int = DEFAULT_BLOCK,
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = 1,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Chain speculative sampling: the kernel, then the merge over chunks.

    Args:
      draft_probs: float32 ``[B, n, V]``, or None for a deterministic drafter.
      draft_token_ids: int32 ``[B, n]`` inside ``[0, V)``.
      target_probs: float32 ``[B, n + 1, V]``.
      row_key_words: uint32 ``[B, 2]`` from ``rng.row_keys``.
      chunk_size: the two-level draw's chunk, a power of two (the reference's, to pick its
        tokens).
      stream: the generator stream (``speculative.api.SPECULATIVE_STREAM``).
      block, num_warps, num_stages: launch parameters (``block`` a power of two; it is
        capped at the chunk).
      interpret: Pallas interpret mode (CPU).

    Returns:
      ``(output_token_ids int32[B, n + 1], num_accepted int32[B])``; ``-1`` past the emitted
      tokens, which are always inside ``[0, V)``.
    """
    batch, positions, vocab = target_probs.shape
    num_drafts = positions - 1
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    # A chunk longer than the row only adds masked columns: cut it to the row's power of two.
    chunk_size = min(chunk_size, pl.next_power_of_2(vocab))
    block = min(block, chunk_size)
    num_chunks = pl.cdiv(vocab, chunk_size)
    deterministic = draft_probs is None or num_drafts == 0
    tokens = draft_token_ids.astype(jnp.int32)
    if num_drafts == 0:
        tokens = jnp.zeros((batch, 1), jnp.int32)  # never read: the chain stops at once

    operands = [
        row_key_words[:, 0],
        row_key_words[:, 1],
        tokens,
        target_probs.astype(jnp.float32).reshape(batch * positions, vocab),
    ]
    if not deterministic:
        operands.append(draft_probs.astype(jnp.float32).reshape(batch * num_drafts, vocab))
    per_chunk = (batch, num_chunks)
    out_shape = (
        jax.ShapeDtypeStruct(per_chunk, jnp.int32),
        jax.ShapeDtypeStruct(per_chunk, jnp.float32),
        jax.ShapeDtypeStruct(per_chunk, jnp.float32),
        jax.ShapeDtypeStruct(per_chunk, jnp.int32),
    )
    accepted, residual_mass, target_mass, candidate = pl.pallas_call(
        functools.partial(
            spec_accept_kernel,
            num_drafts=num_drafts,
            chunk_size=chunk_size,
            block=block,
            stream=stream,
            deterministic_draft=deterministic,
        ),
        grid=per_chunk,
        in_specs=[whole_array(x.shape) for x in operands],
        out_specs=tuple(whole_array(per_chunk) for _ in out_shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"spec_accept_{'deterministic' if deterministic else 'probs'}_c{chunk_size}_b{block}",
    )(*operands)

    # The merge: the first level of the draw, over each row's chunks.
    stop = accepted[:, 0]
    has_residual = jnp.sum(residual_mass, axis=1) > 0
    masses = jnp.where(has_residual[:, None], residual_mass, target_mass)
    chunk_uniform = _uniform(row_key_words, stop, CHUNK_COLUMN, stream)  # [B]
    chosen = _draw_chunks(masses, chunk_uniform)
    drawn = jnp.take_along_axis(candidate, chosen[:, None], axis=1)[:, 0]
    drawn = jnp.clip(drawn, 0, vocab - 1)  # a row without mass (bad input under jit): in range
    position = jnp.arange(positions)[None, :]
    drafts = jnp.concatenate([tokens[:, :num_drafts], jnp.full((batch, 1), -1, jnp.int32)], 1)
    out = jnp.where(position < stop[:, None], drafts, -1)
    out = jnp.where(position == stop[:, None], drawn[:, None], out)
    return out.astype(jnp.int32), stop
