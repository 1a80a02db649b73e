"""Fused rotary embedding + paged KV append (Pallas, Triton lowering).

What it computes, for a ragged batch of ``T`` new tokens (token ``t`` belongs to request
``batch_indices[t]`` at position ``positions[t]``):

- ``q_rotated[t] = rope(q[t], positions[t])`` for every query head;
- ``rope(k[t], positions[t])`` and ``v[t]`` written into the KV pool at token ``t``'s slot:
  page ``page_indices[page_indptr[b] + p // page_size]``, slot ``p % page_size``, for
  ``b = batch_indices[t]`` and ``p = positions[t]`` (the slot ``paged.append_kv`` writes).

``rope`` rotates pair ``i`` of a head by ``float32(p) * inv_freq[i]`` (``paged/rope.py``: the
float32 angle, cos and sin in float32, the rotation in float32, one rounding on the way out). The
pairs are ``(i, i + D/2)`` (rotate-half) or ``(2i, 2i + 1)`` (interleaved): the wrapper views a
head ``[D]`` as ``[2, D/2]`` or ``[D/2, 2]`` (a free reshape), so the kernel loads the two members
of every pair as two ``[heads, D/2]`` tiles in either convention.

What it optimizes. The unfused path reads q and k, writes rotated copies, reads the rotated k
and v again and scatters them into the pages: three launches and two extra passes over k. Here
one program a token reads q, k and v once, rotates in registers (the angles come from
``positions`` and a ``[D/2]`` frequency table; no cos/sin cache is read), writes the rotated q
and stores k and v straight into their page slots. The pages are ``input_output_aliases`` of the
output pool: only the ``T`` new slots are written, in place, when the pool is donated (or is a
loop carry); otherwise XLA copies the pool first.

One launch a call, nothing around it. A decode step moves about 1.5 MiB here, so the call is
bound by launches (a few microseconds each on an H200), not bytes: any XLA operation before the
``pallas_call`` (a cast of the indices, each request's length from the table, a computed
frequency table) is one more launch and can cost as much as the kernel. So the kernel reads the
CSR table's own arrays, in whatever integer dtype they come, and derives each token's request
length from ``page_indptr`` and ``last_page_len`` itself; the frequency table depends only on
static parameters, so the public API passes it as a host (NumPy) constant, which a jitted
program embeds as data. The lowered program is this one custom call and bitcast reshapes.

One token a program. A block of tokens a program would amortize the per-program setup (five
scalar loads and ``D/2`` cos and sin), but that setup is small beside the program's
``(Hq + 2 Hkv) D`` element loads, and a decode step's 64 tokens already give fewer programs than
an H200 has SMs (132): blocks of tokens would leave SMs idle for the same single launch. Blocks
would pay off in long prefills only, which are not launch-bound.

Byte floor: read q, k, v (``T (Hq + 2 Hkv) D`` elements) and positions, batch indices and one
page-index entry a token; write q_rotated and the ``2 T Hkv D`` new KV elements. At batch 64,
32 query heads, 8 KV heads, head_dim 128, bfloat16: 1.5 MiB, about 0.4 us at 4 TB/s, so
a decode step's call is bound by launch latency, which fusing three launches into one cuts.

Bad tables and indices under ``jit`` (the public API validates them only when concrete): a
token whose request is outside the batch, whose position is negative or not below its request's
length, or whose page lies outside the pool is not written at all (its q is still rotated).
Every address is clamped into its array and every such store is skipped: the kernel never reads
or writes outside its arrays, and never writes a page the table does not give that token.

Quest's key bounds (opt-in: ``kmin`` and ``kmax`` given). The same launch also widens the
per-page, per-KV-head bounds of the keys (``paged.PageKeyBounds``, float32): each valid token's
rotated key, as the pool stores it (rounded to the pool's dtype, then widened to float32, exact),
goes into its page's ``kmin`` with an atomic min and into ``kmax`` with an atomic max. Atomics,
because several programs of one launch may write the same page (a prefill chunk: up to
``page_size`` tokens a page). The kernel only widens: pages the call opens (writes slot 0 of) must
already be restarted to the empty bounds (``+inf``, ``-inf``) by the caller, before the launch
(``paged.rope_append_kv`` does it with one XLA scatter). Restarting inside the launch would race:
the program of slot 0 cannot reset its page before the other programs of the same page widen it
without a grid-wide barrier, which Triton does not have.

What it optimizes and what it costs: the two-step flow (this kernel, then XLA's restart, a read
back of the written keys from the pool and two scatters, ``paged.append_page_key_bounds``) is
three or four more launches; here the bounds cost the restart's one XLA scatter and, per
program, ``2 Hkv D`` atomic updates (a min and a max of each key element). Pallas lowers a
float32 atomic min or max to integer atomics on the float's bits
(``jax._src.pallas.triton.primitives._expand_atomic_fp_min_max``), the standard trick: read as
signed integers, non-negative floats order as their bits do, and every negative float is below
every non-negative one; among negative floats the order of their bits as unsigned integers is
reversed. So ``min`` with a value ``>= 0`` is a signed integer min, with a value ``< 0`` an
unsigned integer max (and ``max`` the other way round): two masked atomics an element for each
bound (one of them does nothing), each with acquire-release semantics, issued one after another
by each thread. That chain, not bytes, is the cost, as measured on an H100 (the probe's device
trace at decode B=8: this launch 25.4 us a call against 3.8 for the plain kernel, 15.2 at 8
warps, where each thread's chain is half as long; the restart's scatters 2.7 us). The whole
fused call costs about 25 us more than the plain one at decode, where the two-step flow costs 5
to 7 us more; it is faster only at a 512-token chunk. So it is opt-in. Two consequences of the
integer order: ``-0.0`` counts as below ``+0.0`` (XLA's min of the two zeros may keep either; the
bounds then differ from the two-step flow's in the sign of a zero only, the same value), and NaN
keys are not ordered (a NaN key makes its page's bounds meaningless either way).

In interpret mode (a CPU) programs run one after another, so where an atomic needs a mask (a
block padded past the heads or the columns) the kernel reads, takes the min or max and writes
back instead: Pallas' interpreter takes atomics without a mask only (jax 0.11.2). An exact block
runs the atomic primitive itself there too.

Status: checked in interpret mode against float64 references, and compiled, checked and timed
on the H200 (``docs/benchmark_results/2026-12-01-fused_ops.md``). The bounds variant: checked in
interpret mode against the two-step flow (bit for bit), compiled, checked bit for bit and timed on
an H100 at d16a256 (``bench/probes/append_bounds.py``; figures in ``docs/sparse_decode.md``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.platform import whole_array
from kernels_pallas.x64 import runs_in_32_bits

LAYOUTS = ("HND", "NHD")


def _pair_index(interleaved: bool, member: int, columns):
    """Indices of pair member ``member`` of every pair in a head viewed as ``[2, D/2]``
    (rotate-half) or ``[D/2, 2]`` (interleaved)."""
    member = jnp.int32(member)  # a traced scalar index: Pallas' interpreter needs an array
    return (columns, member) if interleaved else (member, columns)


def rope_append_kernel(
    positions_ref,  # [T] int (any integer dtype: cast here, not by an XLA op before the call)
    batch_indices_ref,  # [T] int
    last_page_len_ref,  # [B] int, each request's last page's tokens after the append
    page_indptr_ref,  # [B + 1] int
    page_indices_ref,  # [num_indices] int
    inv_freq_ref,  # [D/2] float32
    q_ref,  # [T, Hq, 2, D/2] | [T, Hq, D/2, 2] (rotate-half | interleaved), the whole array
    k_ref,  # [T, Hkv, 2, D/2] | [T, Hkv, D/2, 2]
    v_ref,  # [T, Hkv, 2, D/2] | [T, Hkv, D/2, 2]
    k_pages_in_ref,  # aliased to k_pages_ref; never read
    v_pages_in_ref,  # aliased to v_pages_ref; never read
    # Without bounds: q_out_ref (like q_ref), k_pages_ref, v_pages_ref (HND: [P, Hkv, S, 2, D/2] |
    # [P, Hkv, S, D/2, 2]; NHD: [P, S, Hkv, 2, D/2] | [P, S, Hkv, D/2, 2]). With bounds
    # (keeps_bounds): kmin_in_ref, kmax_in_ref (aliased, never read), then those three outputs,
    # then kmin_ref, kmax_ref (float32 [P, Hkv, 2, D/2] | [P, Hkv, D/2, 2]). Pallas hands a
    # kernel its inputs' refs and then its outputs', so the variant's extra refs fall in between.
    *refs,
    layout: str,
    interleaved: bool,
    page_size: int,
    num_pages: int,
    block_q_heads: int,
    block_kv_heads: int,
    block_half: int,
    keeps_bounds: bool = False,
    interpret: bool = False,
):
    del k_pages_in_ref, v_pages_in_ref
    if keeps_bounds:
        _, _, q_out_ref, k_pages_ref, v_pages_ref, kmin_ref, kmax_ref = refs
    else:
        q_out_ref, k_pages_ref, v_pages_ref = refs
    token = pl.program_id(0)
    batch = last_page_len_ref.shape[0]
    num_indices = page_indices_ref.shape[0]
    num_q_heads = q_ref.shape[1]
    num_kv_heads = k_ref.shape[1]
    half = inv_freq_ref.shape[0]

    # Where this token's k and v go, and whether they go anywhere (module docstring): every
    # index is clamped into its array before it is used, and the stores happen only if `valid`.
    position = positions_ref[token].astype(jnp.int32)
    request = batch_indices_ref[token].astype(jnp.int32)
    request_ok = (request >= 0) & (request < batch)
    request = jnp.clip(request, 0, batch - 1)
    # The request's length, as ``PageTable.seq_lens`` computes it, from its two table entries:
    # computed here rather than by the caller, whose [B] computation would be a second launch.
    first_entry = page_indptr_ref[request].astype(jnp.int32)
    num_request_pages = page_indptr_ref[request + 1].astype(jnp.int32) - first_entry
    last_len = last_page_len_ref[request].astype(jnp.int32)
    seq_len = jnp.where(num_request_pages > 0, page_size * (num_request_pages - 1) + last_len, 0)
    valid = request_ok & (position >= 0) & (position < seq_len)
    position_in_table = jnp.clip(position, 0, jnp.maximum(seq_len - 1, 0))
    entry = first_entry + position_in_table // page_size
    page = page_indices_ref[jnp.clip(entry, 0, num_indices - 1)].astype(jnp.int32)
    valid = valid & (page >= 0) & (page < num_pages)
    page = jnp.clip(page, 0, num_pages - 1)
    slot = position_in_table % page_size

    columns = pl.ds(0, block_half)
    column_is_real = jnp.arange(block_half) < half
    # Masks only where a block is padded past its array (heads or D/2 not a power of two): an
    # exact block needs none. Unmasked accesses are simpler code for Triton, and the interpreter
    # runs them several times faster (4096 tokens on a CPU: 3 s instead of 19 s).
    inv_freq = plgpu.load(
        inv_freq_ref.at[columns],
        mask=column_is_real if block_half > half else None,
        other=0.0 if block_half > half else None,
    )
    angles = position.astype(jnp.float32) * inv_freq  # [block_half], the float32 product
    cos = jnp.cos(angles)[None, :]
    sin = jnp.sin(angles)[None, :]

    def rotate(first, second):
        first = first.astype(jnp.float32)
        second = second.astype(jnp.float32)
        return first * cos - second * sin, second * cos + first * sin

    def tile_mask(block_heads, num_heads):
        """``[block_heads, block_half]``: the real heads and columns, or None if all are."""
        if block_heads == num_heads and block_half == half:
            return None
        heads_are_real = jnp.arange(block_heads) < num_heads
        return heads_are_real[:, None] & column_is_real[None, :]

    def load_pair(ref, block_heads, mask):
        heads = pl.ds(0, block_heads)
        return tuple(
            plgpu.load(
                ref.at[(token, heads, *_pair_index(interleaved, member, columns))],
                mask=mask,
                other=None if mask is None else 0.0,
            )
            for member in (0, 1)
        )

    # q: every head, whatever the page table says.
    q_mask = tile_mask(block_q_heads, num_q_heads)
    q_rotated = rotate(*load_pair(q_ref, block_q_heads, q_mask))
    for member, values in enumerate(q_rotated):
        index = (token, pl.ds(0, block_q_heads), *_pair_index(interleaved, member, columns))
        plgpu.store(q_out_ref.at[index], values.astype(q_out_ref.dtype), mask=q_mask)

    # k (rotated) and v (as is) into the token's page slot, only for a valid token: a branch
    # on one scalar, the same for the whole program, rather than a mask on every element.
    kv_mask = tile_mask(block_kv_heads, num_kv_heads)
    kv_heads = pl.ds(0, block_kv_heads)
    if layout == "HND":
        slot_index = (page, kv_heads, slot)  # a [Hkv] column of [page_size] tiles
    else:
        slot_index = (page, slot, kv_heads)  # one token's heads, contiguous

    @pl.when(valid)
    def _store_kv():
        k_rotated = rotate(*load_pair(k_ref, block_kv_heads, kv_mask))
        v_pair = load_pair(v_ref, block_kv_heads, kv_mask)
        for member in (0, 1):
            index = (*slot_index, *_pair_index(interleaved, member, columns))
            k_values = k_rotated[member].astype(k_pages_ref.dtype)
            plgpu.store(k_pages_ref.at[index], k_values, mask=kv_mask)
            v_values = v_pair[member].astype(v_pages_ref.dtype)
            plgpu.store(v_pages_ref.at[index], v_values, mask=kv_mask)
            if keeps_bounds:  # the key as stored (rounded), widened exactly to float32
                bounds_index = (page, kv_heads, *_pair_index(interleaved, member, columns))
                stored = k_values.astype(jnp.float32)
                _widen(kmin_ref, bounds_index, stored, kv_mask, smallest=True, interpret=interpret)
                _widen(kmax_ref, bounds_index, stored, kv_mask, smallest=False, interpret=interpret)


def _widen(ref, index, values, mask, *, smallest: bool, interpret: bool) -> None:
    """``ref[index] = min(ref[index], values)`` (``smallest``) or the max, where ``mask`` holds
    (None: everywhere), atomically: other programs may widen the same page (module docstring)."""
    if interpret and mask is not None:
        # The interpreter runs one program at a time, so read-modify-write is what the atomic
        # does; its rule for atomics takes no mask (module docstring).
        old = plgpu.load(ref.at[index], mask=mask, other=0.0)
        new = jnp.minimum(old, values) if smallest else jnp.maximum(old, values)
        plgpu.store(ref.at[index], new, mask=mask)
        return
    atomic = plgpu.atomic_min if smallest else plgpu.atomic_max
    atomic(ref, index, values, mask=mask)


def pair_view(x: jax.Array, interleaved: bool) -> jax.Array:
    """``[..., D]`` as ``[..., 2, D/2]`` (rotate-half) or ``[..., D/2, 2]`` (interleaved): a
    reshape, free in memory."""
    half = x.shape[-1] // 2
    return x.reshape(*x.shape[:-1], *((half, 2) if interleaved else (2, half)))


@runs_in_32_bits  # x64 mode: kernels_pallas/x64.py
@functools.partial(jax.jit, static_argnames=("layout", "interleaved", "num_warps", "interpret"))
def rope_append(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    batch_indices: jax.Array,
    inv_freq: jax.Array,
    last_page_len: jax.Array,
    page_indptr: jax.Array,
    page_indices: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kmin: jax.Array | None = None,
    kmax: jax.Array | None = None,
    *,
    layout: str,
    interleaved: bool,
    num_warps: int = 4,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """Rotates q and k by position and writes k and v into their pages (module docstring).

    Args:
      q: ``[T, Hq, D]``, ``D`` even.
      k, v: ``[T, Hkv, D]``.
      positions, batch_indices: integer ``[T]`` (read and cast to int32 in the kernel).
      inv_freq: float32 ``[D/2]`` (``paged.rope.inverse_frequencies``). Pass the host's NumPy
        table: inside a jitted caller it is then a constant of the program, not a computation.
      last_page_len: integer ``[B]``, the table's ``last_page_len`` after the append (each
        request's length is derived from it and ``page_indptr`` in the kernel).
      page_indptr: integer ``[B + 1]``; page_indices: integer ``[num_indices]`` (the CSR table).
      k_pages, v_pages: the pool, ``[P, Hkv, page_size, D]`` (``layout="HND"``) or
        ``[P, page_size, Hkv, D]`` (``"NHD"``).
      kmin, kmax: optional float32 ``[P, Hkv, D]`` each, Quest's key bounds of the pool's pages
        (``paged.PageKeyBounds``), both or neither. Given, every written key widens its page's
        bounds (module docstring); the pages this call opens must already be restarted.
      layout: ``"HND"`` or ``"NHD"``.
      interleaved: pairs ``(2i, 2i + 1)`` instead of ``(i, i + D/2)``.
      num_warps: launch parameter.
      interpret: Pallas interpret mode (CPU).

    Returns:
      ``(q_rotated [T, Hq, D] in q's dtype, k_pages, v_pages)``, the pages in the pool's buffers
      (aliased) with the new tokens written; with bounds, ``(q_rotated, k_pages, v_pages, kmin,
      kmax)``, the bounds also aliased to their inputs' buffers.

    Launches: exactly one. Every operand goes to the ``pallas_call`` as given (the only other
    operations are reshapes that split or merge the last axis, which XLA lowers to bitcasts), so
    a call inside a jitted program is one kernel; ``tests/test_rope_append.py`` checks the
    lowered program for that.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    indices = {
        "positions": positions,
        "batch_indices": batch_indices,
        "last_page_len": last_page_len,
        "page_indptr": page_indptr,
        "page_indices": page_indices,
    }
    for name, array in indices.items():
        if not jnp.issubdtype(array.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {array.dtype}")
    if layout == "HND":
        num_pages, _, page_size, _ = k_pages.shape
    elif layout == "NHD":
        num_pages, page_size, _, _ = k_pages.shape
    else:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    keeps_bounds = kmin is not None or kmax is not None
    if keeps_bounds:
        expected = (num_pages, num_kv_heads, head_dim)
        for name, array in (("kmin", kmin), ("kmax", kmax)):
            if array is None or array.shape != expected or array.dtype != jnp.float32:
                raise ValueError(
                    f"{name} must be float32 of shape {expected} (pages, KV heads, head_dim), "
                    f"got {None if array is None else (array.shape, array.dtype)}"
                )
    pool_shape = k_pages.shape
    # No cast or index arithmetic here: each would be an XLA kernel launched before this one.
    inputs = (
        positions,
        batch_indices,
        last_page_len,
        page_indptr,
        page_indices,
        inv_freq.astype(jnp.float32),
        pair_view(q, interleaved),
        pair_view(k, interleaved),
        pair_view(v, interleaved),
        pair_view(k_pages, interleaved),
        pair_view(v_pages, interleaved),
    )
    out_shape = (
        jax.ShapeDtypeStruct(inputs[6].shape, q.dtype),
        jax.ShapeDtypeStruct(inputs[9].shape, k_pages.dtype),
        jax.ShapeDtypeStruct(inputs[10].shape, v_pages.dtype),
    )
    # Inputs 9 and 10 (the pools) are outputs 1 and 2: only the new slots are written.
    aliases = {9: 1, 10: 2}
    name = f"rope_append_{layout}_{'interleaved' if interleaved else 'half'}"
    if keeps_bounds:  # inputs 11 and 12 (the bounds) are outputs 3 and 4, widened in place
        inputs += (pair_view(kmin, interleaved), pair_view(kmax, interleaved))
        out_shape += (
            jax.ShapeDtypeStruct(inputs[11].shape, jnp.float32),
            jax.ShapeDtypeStruct(inputs[12].shape, jnp.float32),
        )
        aliases.update({11: 3, 12: 4})
        name += "_bounds"

    kernel = functools.partial(
        rope_append_kernel,
        layout=layout,
        interleaved=interleaved,
        page_size=page_size,
        num_pages=num_pages,
        block_q_heads=pl.next_power_of_2(num_q_heads),
        block_kv_heads=pl.next_power_of_2(num_kv_heads),
        block_half=pl.next_power_of_2(head_dim // 2),
        # Only the variant passes these, so the plain kernel's program is what it always was.
        **({"keeps_bounds": True, "interpret": interpret} if keeps_bounds else {}),
    )
    outputs = pl.pallas_call(
        kernel,
        grid=(num_tokens,),
        in_specs=[whole_array(a.shape) for a in inputs],
        out_specs=[whole_array(s.shape) for s in out_shape],
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=name,
    )(*inputs)
    q_rotated, k_pages, v_pages = outputs[:3]
    result = (q_rotated.reshape(q.shape), k_pages.reshape(pool_shape), v_pages.reshape(pool_shape))
    if keeps_bounds:
        result += tuple(bound.reshape(kmin.shape) for bound in outputs[3:])
    return result
