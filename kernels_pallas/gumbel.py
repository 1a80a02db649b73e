"""The Gumbel-max race as a Pallas kernel (Triton lowering): one read of the row, no softmax,
no noise array.

What it computes, per row: ``argmax_i (logits_i / T + G_i)`` from logits (greedy
``argmax_i logits_i`` at ``T = 0``) or ``argmax_i (log p_i + G_i)`` from probabilities, with
``G_i = rng.gumbel(rng.noise_bits(row_key, i, stream))``: the numbers ``sampling/api.py``'s
reference draws, so both pick the same token (up to float rounding of a near-tie, which the
GPU test counts).

What it optimizes. The read of ``B x V`` float32 values is the floor. The noise is computed in
registers, and it is what costs: this kernel is bound by instruction issue, not by memory, so it
spends as few instructions a token as it can:

- Philox-4x32-10 (``rng.noise_bit_quads``): four tokens' bits a call, about fifteen integer
  instructions a token; on a GPU the multiply's high word is one ``mul.hi.u32`` by inline PTX
  (``fast_math``), where the portable form takes four 16-bit products.
- ``rng.gumbel``: two ``log2`` (the special-function unit's ``lg2.approx`` under
  ``fast_math``) and five multiply-adds a token, where ``-log(exponential)`` takes three
  full-precision logarithms.
- No reduction inside the loop: each position of the ``[quads, 4]`` tile keeps its own best
  score and the step it came from (a compare and two selects a token); one reduction at the
  end of the program.
- A row is cut into ``num_chunks`` chunks (programs) so that small batches fill the GPU; each
  program writes its chunk's best and a small XLA reduction picks the row's winner. (A single
  launch that merges through a per-row atomic counter was measured slower: the counters must be
  zeroed by another launch first.)

How far from the floor: the measured figures, against ``jax.random.categorical`` and the copy
ceiling, are in the newest sampling report (``docs/benchmark_results/README.md`` lists it); the
sweeps and cut-down variants behind the launch defaults, which show where the time goes, are in
``docs/benchmark_results/archive/2026-12-01-gumbel-tuning.md``.

Layout: a step covers ``4 * quads`` consecutive columns, viewed as ``[quads, 4]``; row ``q`` of
the tile is one Philox call (counter ``start / 4 + q``), whose four words are the four columns
of that row, so no value moves between threads. Ties go to the lowest column everywhere:
strict ``>`` across steps (a position's columns rise with the step), the lowest column among
equal scores inside a program, and the first chunk among equal chunk bests in the merge.
Out-of-row columns and NaN scores never win (a NaN compares false); a row with no finite score
returns its first column, always inside ``[0, V)``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import rng
from kernels_pallas.platform import whole_array
from kernels_pallas.row_select import INDEX_SENTINEL

# The same floor as sampling.reference.MIN_TEMPERATURE (kernels_pallas imports nothing above it).
MIN_TEMPERATURE = 1e-30
_LN2 = np.float32(np.log(2.0))


def _mulhilo_ptx(a: jax.Array, multiplier: int) -> tuple[jax.Array, jax.Array]:
    """``rng.mulhilo32`` on a GPU: the high word by one ``mul.hi.u32``, the low by a multiply."""
    signed = lax.bitcast_convert_type(a, jnp.int32)
    (high,) = plgpu.elementwise_inline_asm(
        f"mul.hi.u32 $0, $1, {multiplier};",
        args=[signed],
        constraints="=r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)],
    )
    return lax.bitcast_convert_type(high, jnp.uint32), a * np.uint32(multiplier)


def _log2_ptx(x: jax.Array) -> jax.Array:
    """``log2`` by the special-function unit (``lg2.approx.f32``): absolute error ``2**-22``
    on ``[1/2, 2]``, relative ``2**-22`` elsewhere (CUDA's ``__log2f``)."""
    (out,) = plgpu.elementwise_inline_asm(
        "lg2.approx.f32 $0, $1;",
        args=[x],
        constraints="=f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return out


def _tile_noise(words, start, quads: int, stream: int, fast_math: bool) -> jax.Array:
    """float32 ``[quads, 4]``: the Gumbel noise of columns ``start .. start + 4 quads - 1``."""
    quad = (start // 4 + jnp.arange(quads, dtype=jnp.int32)).astype(jnp.uint32)
    mulhilo = _mulhilo_ptx if fast_math else rng.mulhilo32
    log2 = _log2_ptx if fast_math else jnp.log2
    bits = rng.noise_bit_quads(words, quad, stream, mulhilo=mulhilo)
    g0, g1, g2, g3 = (rng.gumbel(b, log2=log2)[:, None] for b in bits)
    lane = jnp.arange(4, dtype=jnp.int32)[None, :]
    # Each lane's value is a compile-time choice per register: the selects fold away.
    return jnp.where(lane < 2, jnp.where(lane == 0, g0, g1), jnp.where(lane == 2, g2, g3))


def gumbel_race_kernel(
    key_ref,  # [B, 2] uint32 rows' key words, or [2] one key's words (row keys derived here)
    temperature_ref,  # [B] or [1] float32 (from logits); unused from probabilities
    values_ref,  # [B, V] logits or probabilities, the whole array
    *refs,
    from_logits: bool,
    quads: int,
    steps: int,
    num_chunks: int,
    stream: int,
    fast_math: bool,
):
    # outputs: the token [B] int32 with one chunk a row; else each chunk's best score [B, C]
    # float32 and the lowest column reaching it [B, C] int32
    if num_chunks == 1:
        (token_ref,) = refs
    else:
        score_ref, index_ref = refs
    row = pl.program_id(0)
    chunk = pl.program_id(1)
    vocab = values_ref.shape[1]
    if len(key_ref.shape) == 1:
        # One key: row b's words are rng.row_keys's, threefry2x32(key, (ROW_DOMAIN, b)),
        # derived here (about 100 scalar integer operations) rather than by an XLA launch.
        words = rng.threefry2x32(key_ref[0], key_ref[1], rng.ROW_DOMAIN, row)
    else:
        words = (key_ref[row, 0], key_ref[row, 1])
    temperature = temperature_ref[row if temperature_ref.shape[0] > 1 else 0]
    greedy = temperature < MIN_TEMPERATURE
    inverse_temperature = 1.0 / jnp.where(greedy, 1.0, temperature)

    width = 4 * quads
    first_column = chunk * (steps * width)
    offsets = jnp.arange(width, dtype=jnp.int32)
    tile_offsets = offsets.reshape(quads, 4)

    def step(i, carry):
        best, best_step = carry  # [quads, 4] float32, int32
        start = first_column + i * width
        in_row = start + offsets < vocab
        values = plgpu.load(
            values_ref.at[row, pl.ds(start, width)],
            mask=in_row,
            other=-jnp.inf if from_logits else 0.0,
        ).astype(jnp.float32)
        values = values.reshape(quads, 4)
        noise = _tile_noise(words, start, quads, stream, fast_math)
        if from_logits:
            # -inf logits stay -inf: inverse_temperature is positive and finite.
            score = jnp.where(greedy, values, values * inverse_temperature + noise)
        else:
            # log 0 = -inf never wins; jnp.log is the reference's, bit for bit in interpret mode
            log_values = _LN2 * _log2_ptx(values) if fast_math else jnp.log(values)
            score = log_values + noise
        better = score > best  # NaN is never better; an earlier step keeps a tie
        return jnp.where(better, score, best), jnp.where(better, i, best_step)

    init = (
        jnp.full((quads, 4), -jnp.inf, jnp.float32),
        jnp.zeros((quads, 4), jnp.int32),
    )
    best, best_step = lax.fori_loop(0, steps, step, init)
    top = jnp.max(best)
    columns = first_column + best_step * width + tile_offsets
    best_column = jnp.min(jnp.where(best == top, columns, INDEX_SENTINEL))
    # A chunk without a finite score (every column out of the row, -inf or NaN) offers its
    # first column, clamped into the row, with score -inf: it wins only if no chunk scores.
    best_column = jnp.minimum(best_column, vocab - 1)
    if num_chunks == 1:
        token_ref[row] = best_column
        return
    score_ref[row, chunk] = top
    index_ref[row, chunk] = best_column


def default_launch(batch: int, vocab: int) -> dict:
    """The launch parameters ``gumbel_sample`` uses unless told otherwise: steps of
    ``4 * quads`` columns, and at least ``min_chunks`` chunks a row and ``min_programs``
    programs in all (as many chunks as steps at most)."""
    quads = DEFAULT_LAUNCH["quads"]
    steps_per_row = pl.cdiv(vocab, 4 * quads)
    wanted = max(DEFAULT_LAUNCH["min_chunks"], pl.cdiv(DEFAULT_LAUNCH["min_programs"], batch))
    chunks = min(steps_per_row, wanted)
    return dict(
        quads=quads,
        steps=pl.cdiv(steps_per_row, chunks),
        num_warps=DEFAULT_LAUNCH["num_warps"],
        num_stages=DEFAULT_LAUNCH["num_stages"],
    )


# From the H200 sweeps (docs/benchmark_results/archive/2026-12-01-gumbel-tuning.md), vocab
# 128256: 16 chunks a row were best at B = 256 and 128 (78 and 43 us; 1 to 8 chunks 81 to 175 us at 256),
# 32 at B = 64 and 64 at B = 32 (25.5 and 14.9 us), one step a program at B = 1; 1024-column
# steps and 4 warps beat 256- to 4096-column steps with 2 or 8 warps, or came within 2%.
DEFAULT_LAUNCH = dict(quads=256, min_chunks=16, min_programs=2048, num_warps=4, num_stages=1)


@functools.partial(
    jax.jit,
    static_argnames=(
        "from_logits",
        "stream",
        "quads",
        "steps",
        "num_warps",
        "num_stages",
        "fast_math",
        "interpret",
    ),
)
def gumbel_sample(
    values: jax.Array,
    key_words: jax.Array,
    temperature: jax.Array,
    *,
    from_logits: bool,
    stream: int,
    quads: int | None = None,
    steps: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fast_math: bool | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Samples one token per row by the Gumbel-max race (module docstring).

    Args:
      values: ``[B, V]`` logits (``from_logits``) or non-negative probabilities; float32 or
        bfloat16 (read as is, raced in float32).
      key_words: uint32 ``[B, 2]`` rows' key words (``rng.row_keys``), or ``[2]``, one key's
        words (``rng.key_words``), from which the kernel derives row ``b``'s as ``row_keys``
        does (the same tokens, one XLA launch fewer).
      temperature: float32 ``[B]`` or ``[1]`` (one for every row); ignored for probabilities;
        below ``MIN_TEMPERATURE`` is greedy.
      from_logits: which race.
      stream: the noise stream (``sampling.api.EXPONENTIAL_STREAM``).
      quads, steps, num_warps, num_stages: launch parameters; ``None`` takes
        ``default_launch``'s. A step is ``4 * quads`` columns (``quads`` a power of two), a
        program ``steps`` steps.
      fast_math: the GPU's ``mul.hi`` and ``lg2.approx`` by inline PTX; ``None`` means on
        unless ``interpret`` (inline PTX cannot be interpreted). The bits are the same either
        way; ``lg2.approx`` (2 ulp outside ``[1/2, 2]``) moves the noise by about
        ``2**-20 max(1, |G|)`` and, from probabilities, ``log p`` by about ``2**-22 |log2 p|``.
      interpret: Pallas interpret mode (CPU).

    Returns:
      int32 ``[B]`` tokens, always inside ``[0, V)``.

    Raises:
      ValueError: ``quads`` not a power of two, or ``fast_math`` with ``interpret``.
    """
    batch, vocab = values.shape
    if batch == 0:
        return jnp.zeros((0,), jnp.int32)
    launch = default_launch(batch, vocab)
    quads = launch["quads"] if quads is None else quads
    steps = launch["steps"] if steps is None else steps
    num_warps = launch["num_warps"] if num_warps is None else num_warps
    num_stages = launch["num_stages"] if num_stages is None else num_stages
    fast_math = not interpret if fast_math is None else fast_math
    if quads < 1 or quads & (quads - 1):
        raise ValueError(f"quads must be a power of two, got {quads}")
    if fast_math and interpret:
        raise ValueError("fast_math=True needs a GPU: inline PTX cannot be interpreted")
    num_chunks = pl.cdiv(vocab, 4 * quads * steps)

    operands = [key_words, temperature.astype(jnp.float32), values]
    if num_chunks == 1:
        out_shape = [jax.ShapeDtypeStruct((batch,), jnp.int32)]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((batch, num_chunks), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_chunks), jnp.int32),
        ]
    outputs = pl.pallas_call(
        functools.partial(
            gumbel_race_kernel,
            from_logits=from_logits,
            quads=quads,
            steps=steps,
            num_chunks=num_chunks,
            stream=stream,
            fast_math=fast_math,
        ),
        grid=(batch, num_chunks),
        in_specs=[whole_array(operand.shape) for operand in operands],
        out_specs=[whole_array(shape.shape) for shape in out_shape],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"gumbel_{'logits' if from_logits else 'probs'}_q{quads}x{steps}",
    )(*operands)
    if num_chunks == 1:
        return outputs[0]
    scores, indices = outputs
    winner = jnp.argmax(scores, axis=1)  # the first chunk with the maximum: lowest index on ties
    return jnp.take_along_axis(indices, winner[:, None], axis=1)[:, 0]
