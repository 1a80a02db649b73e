"""RMSNorm and fused residual-add RMSNorm (Pallas, Triton lowering).

What it computes, for each row ``t`` of ``x [T, H]``:

- ``rmsnorm``: ``normed = x / sqrt(mean(x^2) + eps) * w``, with ``w = weight`` (Llama) or
  ``w = 1 + weight`` (Gemma, ``gemma=True``).
- ``fused_add_rmsnorm``: ``new_residual = x + residual``, then the same norm of
  ``new_residual``. The sum is formed in float32 and stored in the input dtype; the norm is taken
  of that *stored* value (the rounded residual, as vLLM does; FlashInfer normalizes the float32
  sum, which differs by about one ulp of the input dtype), so ``normed`` is exactly
  ``rmsnorm(new_residual)``: the next layer reads the very residual that was normalized.

Everything is computed in float32 (statistics, the scale, the weight product) and rounded once,
to the input dtype, on the way out. (Hugging Face's Llama rounds the normalized value to the
input dtype before multiplying by the weight; that differs by at most one bfloat16 ulp.)

What it optimizes. A norm is a read of its inputs and a write of its outputs; nothing else. One
program normalizes ``block_rows`` whole rows, each in one block of ``next_power_of_two(H)``
columns held in registers (``H <= MAX_HIDDEN``; the padding columns are masked on every load and
store and never touch memory), so each input byte is read once and each output byte written
once, in one launch, where XLA's fusion of the unfused expression reads the inputs twice (once
for the statistic, once for the scale) or runs several kernels. ``input_output_aliases`` hands
``x``'s buffer to ``normed`` and ``residual``'s to ``new_residual``: inside a jitted program where
the inputs die at this call (a model's layer, or a caller that donates them), the outputs are
written in place and no buffer is allocated. (Where an input stays live, XLA copies it first,
which is correct but costs a copy.)

Byte floor, bfloat16 ``[T, H]``: ``fused_add_rmsnorm`` reads ``x``, ``residual`` and ``weight`` and
writes ``normed`` and ``new_residual``: ``(4 T H + H) x 2`` bytes (four passes over ``T x H``;
128 MiB at 4096 x 4096, 32 us at 4.2 TB/s). ``rmsnorm`` moves ``(2 T H + H) x 2`` bytes.

``row_offset`` (the benchmark's rotating sets, and any caller that keeps activations in one
larger buffer) normalizes rows ``[row_offset, row_offset + num_rows)`` of its inputs in place
in memory, without a sliced copy, and writes new ``[num_rows, H]`` outputs (no aliasing then).

Status: checked in interpret mode against float64 references, and compiled, checked and timed
on the H200 (``docs/benchmark_results/2026-12-01-fused_ops.md``). Works under x64 too: its
stores take an int32 column start (see the kernel).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.platform import whole_array

# The largest hidden size one block of registers holds: 16384 float32 values a row spread over
# 16 warps is 32 values a thread. Llama 3's largest (405B) is 16384.
MAX_HIDDEN = 16384
# A program handles at least this many elements (several rows when H is small), so that small
# hidden sizes do not launch one tiny program a row.
TARGET_BLOCK_ELEMENTS = 4096
MAX_WARPS = 16


def rmsnorm_kernel(
    row_offset_ref,  # [1] int32: the first input row this call reads
    x_ref,  # [num_input_rows, H], the whole array
    *refs,
    hidden: int,
    block_rows: int,
    block_hidden: int,
    eps: float,
    gemma: bool,
    fused: bool,
):
    if fused:
        residual_ref, weight_ref, normed_ref, new_residual_ref = refs
        # residual_ref: [num_input_rows, H]; weight_ref: [H]; outputs: [num_rows, H]
    else:
        weight_ref, normed_ref = refs  # [H]; [num_rows, H]
    first_row = pl.program_id(0) * block_rows
    num_rows = normed_ref.shape[0]
    row_is_real = first_row + jnp.arange(block_rows, dtype=jnp.int32) < num_rows
    column_is_real = jnp.arange(block_hidden, dtype=jnp.int32) < hidden
    mask = row_is_real[:, None] & column_is_real[None, :]  # [block_rows, block_hidden]
    source_rows = pl.ds(row_offset_ref[0] + first_row, block_rows)
    out_rows = pl.ds(first_row, block_rows)
    columns = pl.ds(0, block_hidden)
    # Stores take an int32 start, not the literal 0: under x64, interpret mode would make the
    # literal int64 beside the int32 row index, and its store refuses mixed index types.
    store_columns = pl.ds(jnp.int32(0), block_hidden)

    values = plgpu.load(x_ref.at[source_rows, columns], mask=mask, other=0.0).astype(jnp.float32)
    if fused:
        residual = plgpu.load(residual_ref.at[source_rows, columns], mask=mask, other=0.0)
        # The residual stream is stored in the input dtype; the norm reads that stored value.
        stored = (values + residual.astype(jnp.float32)).astype(new_residual_ref.dtype)
        plgpu.store(new_residual_ref.at[out_rows, store_columns], stored, mask=mask)
        values = stored.astype(jnp.float32)
    # Padding columns hold 0 and add nothing; the mean divides by the real hidden size.
    mean_square = jnp.sum(values * values, axis=1) / hidden  # [block_rows]
    inverse_rms = lax.rsqrt(mean_square + eps)
    weight = plgpu.load(weight_ref.at[columns], mask=column_is_real, other=0.0)
    scale = weight.astype(jnp.float32)
    if gemma:
        scale = 1.0 + scale
    normed = values * inverse_rms[:, None] * scale[None, :]
    plgpu.store(normed_ref.at[out_rows, store_columns], normed.astype(normed_ref.dtype), mask=mask)


def launch_parameters(num_rows: int, hidden: int) -> tuple[int, int, int]:
    """``(block_hidden, block_rows, num_warps)`` for ``num_rows`` rows of ``hidden``.

    ``block_hidden`` is ``hidden`` rounded up to a power of two (Triton tiles have power-of-two
    sides); ``block_rows`` fills a block of about ``TARGET_BLOCK_ELEMENTS``; ``num_warps`` gives
    each thread 8 to 16 values (16 bytes of bfloat16: one vector load). Untuned: the first GPU
    run sets these.

    Example:
      >>> launch_parameters(4096, 4096), launch_parameters(4096, 96), launch_parameters(1, 3000)
      ((4096, 1, 8), (128, 32, 8), (4096, 1, 8))
    """
    block_hidden = pl.next_power_of_2(hidden)
    block_rows = max(1, TARGET_BLOCK_ELEMENTS // block_hidden)
    block_rows = min(block_rows, pl.next_power_of_2(max(num_rows, 1)))
    num_warps = max(1, min(MAX_WARPS, block_rows * block_hidden // 512))
    return block_hidden, block_rows, num_warps


def _norm_call(x, residual, weight, eps, gemma, row_offset, num_rows, num_warps, interpret):
    fused = residual is not None
    num_input_rows, hidden = x.shape
    if hidden > MAX_HIDDEN:
        raise ValueError(f"the kernel holds a row in registers: hidden={hidden} > {MAX_HIDDEN}")
    windowed = row_offset is not None
    if not windowed:
        num_rows = num_input_rows
        row_offset = 0
    elif num_rows is None or not 0 < num_rows <= num_input_rows:
        raise ValueError(
            f"num_rows must be in [1, {num_input_rows}] with row_offset, got {num_rows}"
        )
    # A window past the end would read outside x: clamp it (the caller's value is not checked
    # under jit), so a bad offset reads the wrong rows, never past the array.
    start = jnp.clip(jnp.asarray(row_offset, jnp.int32), 0, num_input_rows - num_rows)
    start = start.reshape(1)
    block_hidden, block_rows, default_warps = launch_parameters(num_rows, hidden)
    kernel = functools.partial(
        rmsnorm_kernel,
        hidden=hidden,
        block_rows=block_rows,
        block_hidden=block_hidden,
        eps=float(eps),
        gemma=gemma,
        fused=fused,
    )
    inputs = (start, x, residual, weight) if fused else (start, x, weight)
    out_shape = [jax.ShapeDtypeStruct((num_rows, hidden), x.dtype)]
    if fused:
        out_shape.append(jax.ShapeDtypeStruct((num_rows, hidden), residual.dtype))
    # Inputs are (row_offset, x, [residual,] weight): x's buffer becomes normed, residual's
    # becomes new_residual. A window's outputs differ in shape from its inputs: no aliasing.
    aliases = {} if windowed else ({1: 0, 2: 1} if fused else {1: 0})

    outputs = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_rows, block_rows),),
        in_specs=[whole_array(a.shape) for a in inputs],
        out_specs=[whole_array(s.shape) for s in out_shape],
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or default_warps, num_stages=1),
        interpret=interpret,
        name=f"{'fused_add_' if fused else ''}rmsnorm{'_gemma' if gemma else ''}_h{block_hidden}"
        f"_r{block_rows}",
    )(*inputs)
    return tuple(outputs)


@functools.partial(jax.jit, static_argnames=("eps", "gemma", "num_rows", "num_warps", "interpret"))
def fused_add_rmsnorm(
    x: jax.Array,
    residual: jax.Array,
    weight: jax.Array,
    eps: float,
    *,
    gemma: bool = False,
    row_offset: jax.Array | int | None = None,
    num_rows: int | None = None,
    num_warps: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``new_residual = x + residual``; ``normed = rmsnorm(new_residual)`` (module docstring).

    Args:
      x, residual: ``[T, H]``, one floating dtype; ``H <= MAX_HIDDEN``, any size.
      weight: ``[H]``, any floating dtype (read as float32).
      eps: added to the mean square, a Python float (static).
      gemma: scale by ``1 + weight`` instead of ``weight``.
      row_offset: optional int32 scalar: read rows ``[row_offset, row_offset + num_rows)`` (clamped
        into ``[0, T - num_rows]``) instead of all rows, and write new outputs.
      num_rows: the window's rows (static; with ``row_offset`` only).
      num_warps: launch parameter (default ``launch_parameters``).
      interpret: Pallas interpret mode (CPU).

    Returns:
      ``(normed, new_residual)``, ``[T, H]`` (``[num_rows, H]`` for a window) in x's dtype;
      without a window their buffers are x's and residual's (``input_output_aliases``).
    """
    return _norm_call(x, residual, weight, eps, gemma, row_offset, num_rows, num_warps, interpret)


@functools.partial(jax.jit, static_argnames=("eps", "gemma", "num_rows", "num_warps", "interpret"))
def rmsnorm(
    x: jax.Array,
    weight: jax.Array,
    eps: float,
    *,
    gemma: bool = False,
    row_offset: jax.Array | int | None = None,
    num_rows: int | None = None,
    num_warps: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps) * weight`` (``* (1 + weight)`` with ``gemma``), row by row.

    Args and window: as ``fused_add_rmsnorm``, without the residual.

    Returns:
      ``normed [T, H]`` (``[num_rows, H]`` for a window) in x's dtype; without a window, in x's
      buffer.
    """
    (normed,) = _norm_call(x, None, weight, eps, gemma, row_offset, num_rows, num_warps, interpret)
    return normed
