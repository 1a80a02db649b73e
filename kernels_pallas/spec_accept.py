"""Chain speculative sampling kernels (Pallas, Triton lowering): accept tests and draw, then merge.

What it computes: for each request ``b``, the verification step of ``speculative/reference.py``
with the very same uniforms (``rng``, one stream, four columns a position, listed below): the
drafts' accept tests ``u * q_i(t_i) < p_i(t_i)`` in order, the stopping position ``s`` (the first
rejection, or ``n``), and a token drawn at ``s`` from ``max(p_s - q_s, 0)`` (or ``p_s`` where
that has no mass, and at the bonus position ``s = n``) by the reference's two-level inverse
transform: a chunk of ``chunk_size`` tokens in proportion to its mass, then a token inside it.

What it reads: only what the step needs. The accept tests load two probabilities each; then the
rows ``p_s`` and ``q_s`` are read once (``q_s`` not at all at the bonus position, nor with a
deterministic drafter, whose ``q`` is one-hot and never stored). About ``8 V`` bytes a request,
where the dense inputs hold ``4 (2n + 1) V``.

How: two launches and nothing else (no XLA operation before, between or after them).

1. ``spec_accept_kernel``, grid ``(B, C)``, one program per chunk of the stopping rows, so that
   even a small batch spreads over many SMs (B = 64 at vocab 128256 gives 1024 programs, one
   wave). Every program of a row repeats the row's few accept tests (cheaper than a third
   launch), then reads its chunk of ``p_s`` and ``q_s`` block by block, keeping a *block table*
   of masses in registers (``row_select``), and draws its chunk's candidate with the second
   uniform by ``row_select.pick_by_table`` (the table finds the block, one block is read again).
   It writes its chunk's masses and candidate, and the row's ``s`` and chunk uniform (so the
   merge needs no key). The first level needs only chunk masses, so no program waits for
   another.
2. ``spec_merge_kernel`` (``merge_chunks``), one program per block of rows, a row a thread: the
   first level of the draw over each row's ``C`` chunks (the reference's inverse transform,
   restated exactly), then the output row (accepted drafts, the drawn token, ``-1`` past it).

Where the time goes, and what each choice saves. The step moves ~56 MB at the benchmark's shape
(B = 64, n = 4, vocab 128256: ~13 us at the copy ceiling), so a microsecond of fixed latency
counts. The two-launch design below replaced one kernel plus an XLA merge, key derivation and
clipping, and was measured faster on the H200, as was cutting the blocks to 512 columns and
prefetching them (``row_select.fold_blocks``). The figures, for the full grid of batches and
draft counts, are in the newest speculative report (``docs/benchmark_results/README.md`` lists
it). The changes below were made together, so their shares of the time saved are estimates, not
measured one by one:

- The accept tests are vector loads, not a loop: the ``n`` drafted tokens are loaded at once
  (padded to a power of two, as Triton wants), then their ``n`` target and ``n`` draft
  probabilities (one gather each), and ``n`` accept uniforms computed at once; ``s`` is the
  smallest rejected position (a min-reduction). This is the reference's rule: a draft after the
  first rejection is never *used*, so testing it changes nothing. A loop that stops at the first
  rejection pays a dependent global load per test (~0.7 us each) before a program can
  start its row read, and with all programs in one wave that latency adds to the whole call.
- Token ids are clipped into ``[0, V)`` where the kernels load them, and a single key's per-row
  words (``rng.row_keys``: ``threefry2x32(key, (ROW_DOMAIN, b))``) are derived in the first
  kernel: each would otherwise be a separate XLA launch (~2 us) before it.
- The merge is one small kernel instead of the XLA ops it replaces (cumulative sum and maximum,
  a comparison count, gathers, the output's concatenation and selects: several launches).
  The kernel's per-chunk outputs are chunk-major (``[C, B]``), so the merge reads each chunk's
  rows as one contiguous vector and needs no cross-lane work.

A candidate is drawn from the residual when the chunk's residual has mass, else from ``p_s``.
This is the reference's rule: if the row's residual has mass, the merge only ever draws a chunk
whose residual has mass; if it has none, no chunk's has, and every candidate comes from ``p_s``.

Randomness (the contract with ``speculative/api.py``, which defines the stream): position
``i`` owns columns ``4i`` (its accept test), ``4i + 1`` (the chunk draw) and ``4i + 2`` (the
token draw inside the chunk) of the stream; ``4i + 3`` is unused.

What can differ from the reference: chunk masses are block-order sums here, XLA sums there, and
the in-chunk draw compares running sums with ``uniform * mass`` where the reference compares
normalized running maxima with ``uniform``. A draw whose uniform falls within a float32 rounding
error of a boundary can pick the neighbouring token. The tests measure how often. The chunk draw
itself is the reference's arithmetic on the same masses: running sums added left to right (as
XLA's ``cumsum`` adds them on a CPU; on a GPU XLA may associate them otherwise), their running
maximum, an IEEE division (Triton's ``/`` on float32 is PTX's approximate ``div.full.f32``, so
the compiled merge divides by inline ``div.rn.f32``), the count of values at or below the
uniform, the past-the-end fallback.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import rng
from kernels_pallas.platform import whole_array
from kernels_pallas.row_select import RowReader, fold_blocks, pick_by_table

COLUMNS_PER_POSITION = 4
ACCEPT_COLUMN, CHUNK_COLUMN, TOKEN_COLUMN = 0, 1, 2
# Chosen by bench/tuning/speculative.py on the H200 at B=64, n=4 (2026-12-01): 512 columns of
# two rows a block, 4 warps (4 elements a thread per row), each block's loads issued one block
# early (row_select.fold_blocks): 25.26 us, against 25.59 us for the previous 1024 columns
# without prefetching (27.14 us with it; 2048 and 4096 columns: 29 to 32 us). With eight
# programs an SM the latency is mostly hidden already, hence the small gain.
DEFAULT_BLOCK = 512
DEFAULT_NUM_WARPS = 4
DEFAULT_PREFETCH = True
# The merge: rows a program (one a thread) and its warps. It unrolls its loop over chunks, so
# the chunk count is bounded (16 at vocab 128256 with the default chunk of 8192).
MERGE_ROWS = 64
MERGE_NUM_WARPS = 2
MAX_CHUNKS = 256


def _uniform(words, position, offset: int, stream: int) -> jax.Array:
    """The float32 uniform of column ``4 * position + offset`` (module docstring); ``position``
    a scalar or a vector, ``words`` the row's key words (or one pair a lane)."""
    column = (position * COLUMNS_PER_POSITION + offset).astype(jnp.uint32)
    return rng.uniform_open(rng.random_bits(words, column, stream))


def spec_accept_kernel(
    key_ref,  # [B, 2] uint32, the rows' key words; or [2], one key's (rows derived here)
    draft_token_ids_ref,  # [B, max(n, 1)] int32, clipped here into [0, V)
    target_ref,  # [B * (n + 1), V] float32: row b * (n + 1) + i holds p_i of request b
    *refs,
    num_drafts: int,
    chunk_size: int,
    block: int,
    stream: int,
    deterministic_draft: bool,
    prefetch: bool,
):
    if deterministic_draft:
        draft_ref = None
    else:
        # draft_ref: [B * n, V] float32, row b * n + i holds q_i of request b
        draft_ref, *refs = refs
    # outputs, all [C, B] (chunk-major: the merge reads a chunk's rows contiguously): the
    # row's num_accepted int32 and chunk uniform float32 (the same in every chunk), the chunk's
    # residual and target masses float32, and its candidate int32 (-1 for a chunk without mass)
    num_accepted_ref, chunk_uniform_ref, residual_mass_ref, target_mass_ref, candidate_ref = refs
    row = pl.program_id(0)
    chunk = pl.program_id(1)
    vocab = target_ref.shape[1]
    if len(key_ref.shape) == 1:
        # One key: row b's words are ``rng.row_keys``'s, threefry2x32(key, (ROW_DOMAIN, b)),
        # derived here (about 100 integer operations) rather than by an XLA launch.
        words = rng.threefry2x32(key_ref[0], key_ref[1], rng.ROW_DOMAIN, row)
    else:
        words = (key_ref[row, 0], key_ref[row, 1])

    if num_drafts == 0:
        stop, stop_token = jnp.int32(0), jnp.int32(0)
    else:
        # All n tests at once (module docstring). Lanes past n (padding to a power of two)
        # read an entry of the last draft's row, in bounds, and never reject.
        lanes = pl.next_power_of_2(num_drafts)
        position = jnp.arange(lanes, dtype=jnp.int32)
        is_draft = position < num_drafts
        tokens = plgpu.load(
            draft_token_ids_ref.at[row, pl.ds(0, lanes)], mask=is_draft, other=0
        )  # [lanes]
        tokens = jnp.clip(tokens, 0, vocab - 1)
        tested = jnp.minimum(position, num_drafts - 1)
        target_prob = target_ref[row * (num_drafts + 1) + tested, tokens]  # [lanes] gather
        if deterministic_draft:
            draft_prob = jnp.float32(1.0)
        else:
            draft_prob = draft_ref[row * num_drafts + tested, tokens]  # [lanes] gather
        uniform = _uniform(words, position, ACCEPT_COLUMN, stream)  # [lanes]
        rejected = is_draft & ~(uniform * draft_prob < target_prob)
        stop = jnp.min(jnp.where(rejected, position, num_drafts))
        # int32 under x64 too; 0 (unused) at s = n
        stop_token = jnp.sum(jnp.where(position == stop, tokens, 0), dtype=jnp.int32)

    has_draft = stop < num_drafts
    target_row = row * (num_drafts + 1) + stop
    draft_row = row * num_drafts + jnp.minimum(stop, max(num_drafts - 1, 0))
    chunk_start = chunk * chunk_size
    blocks_per_chunk = chunk_size // block

    def block_columns(block_index):
        return chunk_start + block_index * block + jnp.arange(block, dtype=jnp.int32)

    def load_block(block_index):
        """The raw ``(target, draft)`` values of one block of the chunk, each ``[block]`` (a
        block past the chunk, which a prefetch asks for, is the next chunk's or masked)."""
        start = chunk_start + block_index * block
        in_row = block_columns(block_index) < vocab
        target = plgpu.load(target_ref.at[target_row, pl.ds(start, block)], mask=in_row, other=0.0)
        if deterministic_draft:
            return target, None
        # At the bonus position no draft row exists: a fully masked load reads nothing.
        draft = plgpu.load(
            draft_ref.at[draft_row, pl.ds(start, block)], mask=in_row & has_draft, other=0.0
        )
        return target, draft

    def weigh(block_index, loaded):
        """``(columns, residual, target)`` of one block from its raw values, each ``[block]``."""
        target, draft = loaded
        columns = block_columns(block_index)
        if deterministic_draft:
            draft = jnp.where(has_draft & (columns == stop_token), 1.0, 0.0)
        difference = target - draft
        residual = jnp.where(difference > 0, difference, 0.0)
        return columns, residual, jnp.where(target > 0, target, 0.0)

    def block_weights(block_index):
        return weigh(block_index, load_block(block_index))

    # A reader over this chunk: its blocks, and its table of one entry a block.
    reader = RowReader(target_ref, target_row, block, blocks_per_chunk, blocks_per_chunk)

    def tabulate(block_index, loaded, tables):
        residual_table, target_table = tables
        _, residual, target = weigh(block_index, loaded)
        return (
            reader.set_entry(residual_table, block_index, jnp.sum(residual)),
            reader.set_entry(target_table, block_index, jnp.sum(target)),
        )

    zeros = jnp.zeros((blocks_per_chunk,), jnp.float32)
    residual_table, target_table = fold_blocks(
        blocks_per_chunk, load_block, tabulate, (zeros, zeros), prefetch=prefetch
    )
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
    num_accepted_ref[chunk, row] = stop
    # The merge's uniform, drawn here where the row's key words are at hand.
    chunk_uniform_ref[chunk, row] = _uniform(words, stop, CHUNK_COLUMN, stream)
    residual_mass_ref[chunk, row] = residual_mass
    target_mass_ref[chunk, row] = jnp.sum(target_table)
    candidate_ref[chunk, row] = candidate


def _divide(numerator: jax.Array, denominator: jax.Array, interpret: bool) -> jax.Array:
    """float32 division rounded to nearest, as XLA divides (and the reference with it).

    Triton lowers ``/`` on float32 to PTX ``div.full.f32``, within about 2 ulp: a chunk boundary
    would move off the reference's, and a uniform next to it would pick the neighbouring chunk.
    The compiled kernel therefore divides with ``div.rn.f32``; interpreted, ``/`` is XLA's.
    """
    if interpret:
        return numerator / denominator
    [quotient] = plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[numerator, denominator],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(numerator.shape, jnp.float32)],
    )
    return quotient


def spec_merge_kernel(
    draft_token_ids_ref,  # [B, max(n, 1)] int32, clipped here into [0, V)
    num_accepted_ref,  # [C, B] int32: the rows' stopping positions (every chunk the same)
    chunk_uniform_ref,  # [C, B] float32: the rows' chunk uniforms (every chunk the same)
    residual_mass_ref,  # [C, B] float32
    target_mass_ref,  # [C, B] float32
    candidate_ref,  # [C, B] int32
    out_ref,  # [B, n + 1] int32: the emitted tokens, -1 past them
    out_num_accepted_ref,  # [B] int32
    *,
    num_drafts: int,
    block_rows: int,
    vocab: int,
    interpret: bool,
):
    batch = out_ref.shape[0]
    num_chunks = candidate_ref.shape[0]
    first_row = pl.program_id(0) * block_rows
    row_is_real = first_row + jnp.arange(block_rows, dtype=jnp.int32) < batch  # [R]
    block = pl.ds(first_row, block_rows)

    def chunk_column(ref, chunk, other):
        """``ref[chunk, rows]``, ``[R]``: one contiguous load (rows past B read ``other``)."""
        # (An index held as a jnp scalar: interpret mode cannot load at a Python int.)
        return plgpu.load(ref.at[jnp.int32(chunk), block], mask=row_is_real, other=other)

    stop = chunk_column(num_accepted_ref, 0, 0)
    uniform = chunk_column(chunk_uniform_ref, 0, 0.5)
    # All loads at once (the loop is unrolled), then only arithmetic: C is small (MAX_CHUNKS).
    residual = [chunk_column(residual_mass_ref, c, 0.0) for c in range(num_chunks)]
    target = [chunk_column(target_mass_ref, c, 0.0) for c in range(num_chunks)]
    candidates = [chunk_column(candidate_ref, c, -1) for c in range(num_chunks)]

    # The masses drawn from: the residual's where the row's residual has mass, else p's.
    has_residual = functools.reduce(jnp.logical_or, [mass > 0 for mass in residual])
    masses = [jnp.where(has_residual, r, t) for r, t in zip(residual, target, strict=True)]

    # The reference's inverse transform (``sampling.reference.inverse_transform``) over the
    # chunks, with ``uniform`` the chunk draw's: the running maximum of the running sums (added
    # left to right), normalized by the last, counted at or below the uniform; past the end,
    # or on a chunk without mass, the last chunk with mass.
    running_sum = jnp.zeros((block_rows,), jnp.float32)
    running_max = jnp.full((block_rows,), -jnp.inf, jnp.float32)
    cumulative = []
    last_positive = jnp.zeros((block_rows,), jnp.int32)
    for c, mass in enumerate(masses):
        running_sum = running_sum + mass
        running_max = jnp.maximum(running_max, running_sum)
        cumulative.append(running_max)
        last_positive = jnp.where(mass > 0, c, last_positive)
    total = cumulative[-1]
    chosen = jnp.zeros((block_rows,), jnp.int32)
    for value in cumulative:
        chosen = chosen + (_divide(value, total, interpret) <= uniform).astype(jnp.int32)
    in_range = jnp.minimum(chosen, num_chunks - 1)
    chosen_mass = jnp.zeros((block_rows,), jnp.float32)
    for c, mass in enumerate(masses):
        chosen_mass = jnp.where(in_range == c, mass, chosen_mass)
    past_the_end = (chosen >= num_chunks) | (chosen_mass <= 0)
    chosen = jnp.where(past_the_end, last_positive, chosen)
    drawn = jnp.zeros((block_rows,), jnp.int32)
    for c, candidate in enumerate(candidates):
        drawn = jnp.where(chosen == c, candidate, drawn)
    drawn = jnp.clip(drawn, 0, vocab - 1)  # a row without mass (bad input under jit): in range

    # The output rows: the accepted drafts, the drawn token at s, -1 past it.
    lanes = pl.next_power_of_2(num_drafts + 1)
    position = jnp.arange(lanes, dtype=jnp.int32)
    tokens = plgpu.load(
        draft_token_ids_ref.at[block, pl.ds(0, lanes)],
        mask=row_is_real[:, None] & (position < num_drafts)[None, :],
        other=0,
    )  # [R, lanes]
    tokens = jnp.clip(tokens, 0, vocab - 1)
    out = jnp.where(position[None, :] < stop[:, None], tokens, -1)
    out = jnp.where(position[None, :] == stop[:, None], drawn[:, None], out)
    # An int32 start, not the literal 0: under x64, interpret mode would make the literal
    # int64 beside the int32 row index, and its store refuses mixed index types.
    plgpu.store(
        out_ref.at[block, pl.ds(jnp.int32(0), lanes)],
        out,
        mask=row_is_real[:, None] & (position < num_drafts + 1)[None, :],
    )
    plgpu.store(out_num_accepted_ref.at[block], stop, mask=row_is_real)


@functools.partial(
    jax.jit,
    static_argnames=(
        "chunk_size",
        "stream",
        "block",
        "num_warps",
        "num_stages",
        "prefetch",
        "interpret",
    ),
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
    prefetch: bool = DEFAULT_PREFETCH,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Chain speculative sampling: the accept-and-draw kernel, then the merge kernel.

    Args:
      draft_probs: float32 ``[B, n, V]``, or None for a deterministic drafter.
      draft_token_ids: int32 ``[B, n]``; ids outside ``[0, V)`` (bad input under ``jit``) are
        clipped into it, in the kernels.
      target_probs: float32 ``[B, n + 1, V]``.
      row_key_words: uint32 ``[B, 2]``, the rows' key words from ``rng.row_keys``; or uint32
        ``[2]``, one key's words (``rng.key_words``), from which the kernels derive row ``b``'s
        words as ``rng.row_keys`` does (the same tokens, one XLA launch fewer).
      chunk_size: the two-level draw's chunk, a power of two (the reference's, to pick its
        tokens); at most ``MAX_CHUNKS`` chunks a row.
      stream: the generator stream (``speculative.api.SPECULATIVE_STREAM``).
      block, num_warps, num_stages: launch parameters of the first kernel (``block`` a power of
        two; it is capped at the chunk).
      prefetch: the chunk's pass issues a block's loads one block early
        (``row_select.fold_blocks``); the same tokens either way.
      interpret: Pallas interpret mode (CPU).

    Returns:
      ``(output_token_ids int32[B, n + 1], num_accepted int32[B])``; ``-1`` past the emitted
      tokens, which are always inside ``[0, V)``.

    Raises:
      ValueError: a ``chunk_size`` or ``block`` that is not a power of two, more than
        ``MAX_CHUNKS`` chunks, or ``row_key_words`` of another shape.
    """
    batch, positions, vocab = target_probs.shape
    num_drafts = positions - 1
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    if row_key_words.shape not in ((2,), (batch, 2)):
        raise ValueError(
            f"row_key_words must be uint32[{batch}, 2] or uint32[2], got "
            f"{row_key_words.dtype}{list(row_key_words.shape)}"
        )
    # A chunk longer than the row only adds masked columns: cut it to the row's power of two.
    chunk_size = min(chunk_size, pl.next_power_of_2(vocab))
    block = min(block, chunk_size)
    num_chunks = pl.cdiv(vocab, chunk_size)
    if num_chunks > MAX_CHUNKS:
        raise ValueError(
            f"chunk_size {chunk_size} cuts vocab {vocab} into {num_chunks} chunks; the merge "
            f"takes at most {MAX_CHUNKS}"
        )
    deterministic = draft_probs is None or num_drafts == 0
    key_words = row_key_words.astype(jnp.uint32)
    tokens = draft_token_ids.astype(jnp.int32)
    if num_drafts == 0:
        tokens = jnp.zeros((batch, 1), jnp.int32)  # never read: the chain stops at once

    operands = [
        key_words,
        tokens,
        target_probs.astype(jnp.float32).reshape(batch * positions, vocab),
    ]
    if not deterministic:
        operands.append(draft_probs.astype(jnp.float32).reshape(batch * num_drafts, vocab))
    per_chunk = (num_chunks, batch)
    out_shape = (
        jax.ShapeDtypeStruct(per_chunk, jnp.int32),
        jax.ShapeDtypeStruct(per_chunk, jnp.float32),
        jax.ShapeDtypeStruct(per_chunk, jnp.float32),
        jax.ShapeDtypeStruct(per_chunk, jnp.float32),
        jax.ShapeDtypeStruct(per_chunk, jnp.int32),
    )
    per_chunk_outputs = pl.pallas_call(
        functools.partial(
            spec_accept_kernel,
            num_drafts=num_drafts,
            chunk_size=chunk_size,
            block=block,
            stream=stream,
            deterministic_draft=deterministic,
            prefetch=prefetch,
        ),
        grid=(batch, num_chunks),
        in_specs=[whole_array(x.shape) for x in operands],
        out_specs=tuple(whole_array(per_chunk) for _ in out_shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"spec_accept_{'deterministic' if deterministic else 'probs'}_c{chunk_size}_b{block}",
    )(*operands)

    # The merge: the first level of the draw, over each row's chunks, and the output rows.
    return merge_chunks(
        tokens, *per_chunk_outputs, num_drafts=num_drafts, vocab=vocab, interpret=interpret
    )


def merge_chunks(
    draft_token_ids: jax.Array,
    num_accepted: jax.Array,
    chunk_uniform: jax.Array,
    residual_mass: jax.Array,
    target_mass: jax.Array,
    candidate: jax.Array,
    *,
    num_drafts: int,
    vocab: int,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The merge kernel (``spec_merge_kernel``) on the first kernel's chunk-major outputs.

    Args:
      draft_token_ids: int32 ``[B, max(n, 1)]``, clipped into ``[0, vocab)``.
      num_accepted: int32 ``[C, B]``: each row's stopping position ``s`` (row 0 is read).
      chunk_uniform: float32 ``[C, B]``: each row's uniform of the chunk draw (row 0 is read).
      residual_mass, target_mass: float32 ``[C, B]``: the chunks' masses, ``>= 0``.
      candidate: int32 ``[C, B]``: each chunk's token.
      num_drafts: ``n``.
      vocab: ``V``.
      interpret: Pallas interpret mode (CPU).

    Returns:
      ``(output_token_ids int32[B, n + 1], num_accepted int32[B])``.
    """
    num_chunks, batch = candidate.shape
    block_rows = min(MERGE_ROWS, pl.next_power_of_2(batch))
    operands = [draft_token_ids, num_accepted, chunk_uniform, residual_mass, target_mass, candidate]
    return pl.pallas_call(
        functools.partial(
            spec_merge_kernel,
            num_drafts=num_drafts,
            block_rows=block_rows,
            vocab=vocab,
            interpret=interpret,
        ),
        grid=(pl.cdiv(batch, block_rows),),
        in_specs=[whole_array(x.shape) for x in operands],
        out_specs=(whole_array((batch, num_drafts + 1)), whole_array((batch,))),
        out_shape=(
            jax.ShapeDtypeStruct((batch, num_drafts + 1), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=MERGE_NUM_WARPS, num_stages=1),
        interpret=interpret,
        name=f"spec_accept_merge_c{num_chunks}",
    )(*operands)
