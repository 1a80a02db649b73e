"""Variable-length merge of split-KV partial attention states (Pallas, Triton lowering).

Request ``b``'s partial states are the work items ``merge_indptr[b] .. merge_indptr[b + 1] - 1``
written by ``paged_decode`` (``write_final=False``). One program per (request, KV head) folds
them, in order, into the final output with the exact rule of ``proofs/merge_states.md``:
``v = sum_i v_i e^{s_i - m} / sum_i e^{s_i - m}``, ``s = m + log sum_i e^{s_i - m}``, with
``m`` the running maximum. The fold order is fixed (work-item order), so a request's result
does not depend on what else is in the batch.

Bytes: it reads ``num_work x num_kv_heads x P x head_dim`` float32 partials once (``P`` the
query-head group padded to a power of two) and writes ``B x H x D`` outputs, small next to the
KV stream of the decode kernel (a 33-way split of a 32K-token request at G = 4 reads 0.5 MiB of
partials against 128 MiB of KV). What it costs is latency: each program folds its request's
items ``items_per_step`` at a time so that many loads are in flight together.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.platform import whole_array
from kernels_pallas.x64 import runs_in_32_bits


def merge_states_kernel(
    merge_indptr_ref,  # [B + 1] int32
    partial_o_ref,  # [num_work * num_kv_heads * partial_rows, head_dim] float32, whole array
    partial_lse_ref,  # [num_work * num_kv_heads * partial_rows] float32, whole array
    o_ref,  # [B * num_q_heads, head_dim], the whole array
    lse_ref,  # [B * num_q_heads] float32, the whole array
    *,
    group_size: int,
    num_kv_heads: int,
    partial_rows: int,
    items_per_step: int,
):
    request = pl.program_id(0)
    kv_head = pl.program_id(1)
    head_dim = partial_o_ref.shape[1]
    num_work = partial_lse_ref.shape[0] // (num_kv_heads * partial_rows)
    # Clamped so that a bad merge_indptr under jit (unvalidated there) cannot read past the
    # partials; the public API checks it when it is concrete.
    first = jnp.clip(merge_indptr_ref[request], 0, num_work)
    last = jnp.clip(merge_indptr_ref[request + 1], first, num_work)

    def fold(i, carry):
        acc, running_max, running_sum = carry
        # items_per_step partial states at once: independent loads in flight, where one item at a
        # time would pay a memory latency per item.
        slot = jnp.arange(items_per_step * partial_rows)  # [S * P], item-major
        item = first + i * items_per_step + slot // partial_rows
        real = item < last
        rows = (item * num_kv_heads + kv_head) * partial_rows + slot % partial_rows
        rows = jnp.where(real, rows, 0)  # items past the last read row 0 (in bounds), then masked
        part_lse = jnp.where(real, partial_lse_ref[rows], -jnp.inf)
        part_o = jnp.where(real[:, None], partial_o_ref[rows], 0.0)
        part_lse = part_lse.reshape(items_per_step, partial_rows)  # [S, P]
        part_o = part_o.reshape(items_per_step, partial_rows, head_dim)  # [S, P, D]
        new_max = jnp.maximum(running_max, jnp.max(part_lse, axis=0))
        # Where everything so far is empty (-inf), shift by 0: weights stay 0, not NaN.
        shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        old_weight = jnp.exp(running_max - shift)  # [P]
        new_weight = jnp.exp(part_lse - shift[None, :])  # [S, P]
        acc = acc * old_weight[:, None] + jnp.sum(new_weight[:, :, None] * part_o, axis=0)
        running_sum = running_sum * old_weight + jnp.sum(new_weight, axis=0)
        return acc, new_max, running_sum

    init = (
        jnp.zeros((partial_rows, head_dim), jnp.float32),
        jnp.full((partial_rows,), -jnp.inf, jnp.float32),
        jnp.zeros((partial_rows,), jnp.float32),
    )
    num_steps = pl.cdiv(last - first, items_per_step)
    acc, running_max, running_sum = lax.fori_loop(0, num_steps, fold, init)
    nonempty = running_sum > 0
    out = acc / jnp.where(nonempty, running_sum, 1.0)[:, None]
    shift = jnp.where(running_max == -jnp.inf, 0.0, running_max)
    lse = jnp.where(nonempty, shift + jnp.log(jnp.where(nonempty, running_sum, 1.0)), -jnp.inf)

    keep = jnp.arange(partial_rows) < group_size
    first_row = (request * num_kv_heads + kv_head) * group_size
    plgpu.store(
        o_ref.at[pl.ds(first_row, partial_rows), :], out.astype(o_ref.dtype), mask=keep[:, None]
    )
    plgpu.store(lse_ref.at[pl.ds(first_row, partial_rows)], lse, mask=keep)


@runs_in_32_bits  # x64 mode: kernels_pallas/x64.py
@functools.partial(
    jax.jit,
    static_argnames=("num_q_heads", "out_dtype", "items_per_step", "num_warps", "interpret"),
)
def merge_partial_states(
    partial_o: jax.Array,
    partial_lse: jax.Array,
    merge_indptr: jax.Array,
    *,
    num_q_heads: int,
    out_dtype,
    items_per_step: int = 8,
    num_warps: int = 4,
    interpret: bool = False,
):
    """Merges each request's partial states into its final output.

    Args:
      partial_o: float32 ``[num_work, KVH, P, D]`` from ``paged_decode(write_final=False)``,
        ``P`` the group size padded to a power of two.
      partial_lse: float32 ``[num_work, KVH, P]``.
      merge_indptr: int32 ``[B + 1]``; request b's items are ``merge_indptr[b]:merge_indptr[b+1]``.
      num_q_heads: ``H``; the group size is ``H / KVH`` (rows past it are padding and ignored).
      out_dtype: dtype of the output (the query dtype).
      items_per_step: partial states loaded at once (a power of two).

    Returns:
      ``(o [B, H, D] out_dtype, lse [B, H] float32)``; a request with only empty partials gets
      ``o = 0, lse = -inf``.
    """
    num_work, num_kv_heads, partial_rows, head_dim = partial_o.shape
    batch = merge_indptr.shape[0] - 1
    group_size = num_q_heads // num_kv_heads
    partial_o = partial_o.reshape(num_work * num_kv_heads * partial_rows, head_dim)
    partial_lse = partial_lse.reshape(num_work * num_kv_heads * partial_rows)

    out_shape = (
        jax.ShapeDtypeStruct((batch * num_q_heads, head_dim), out_dtype),
        jax.ShapeDtypeStruct((batch * num_q_heads,), jnp.float32),
    )
    o, lse = pl.pallas_call(
        functools.partial(
            merge_states_kernel,
            group_size=group_size,
            num_kv_heads=num_kv_heads,
            partial_rows=partial_rows,
            items_per_step=items_per_step,
        ),
        grid=(batch, num_kv_heads),
        in_specs=[
            whole_array(merge_indptr.shape),
            whole_array(partial_o.shape),
            whole_array(partial_lse.shape),
        ],
        out_specs=(whole_array(out_shape[0].shape), whole_array(out_shape[1].shape)),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="merge_partial_states",
    )(merge_indptr, partial_o, partial_lse)
    return o.reshape(batch, num_q_heads, head_dim), lse.reshape(batch, num_q_heads)
