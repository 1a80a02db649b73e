"""Public RoPE + paged KV append: rotate a ragged batch's new q and k, write k and v into pages.

The reference is the composition of the two definitions, ``paged.rope.apply_rope`` and
``paged.append_kv``; the Pallas backend (``kernels_pallas/rope_append.py``) does both in one
launch. The kernel was compiled, checked against the reference and timed on an H200 at commit
07ce647 and re-measured at 4138e14 (``docs/benchmark_results/2026-12-01-fused_ops.md``), so ``backend="auto"`` runs it on a
GPU (``kernels_pallas.platform.AUTO_PICKS_KERNEL``) and the reference elsewhere or for float64
arrays; ``backend="pallas"`` runs it everywhere (interpreted on a CPU), and
``DECODELAB_BACKEND=reference`` turns ``"auto"`` back to the reference.

Quest's key bounds (``key_bounds=``, issue 19): the reference keeps them by
``paged.append_page_key_bounds`` after the append (pages opened at slot 0 restart, then each
written key, read back from the pool, widens its page's bounds). On the Pallas backend two paths
give the same bounds bit for bit (``tests/test_append_key_bounds.py``), with one exception: two
tokens of one call writing the same slot (undetectable under ``jit``) widen the two-step bounds
by the key the pool kept, the fused ones by both keys (looser, still true bounds):

- ``"two_step"``: the plain kernel, then ``append_page_key_bounds`` in XLA (the engine's flow:
  the engine keeps its bounds in the pools' dtype, bfloat16 on a GPU, so it always takes this
  path, whatever ``AUTO_FUSES_KEY_BOUNDS`` says).
- ``"fused"``: one XLA scatter restarts the opened pages, then the kernel's bounds variant writes
  and widens in one launch (float32 atomic min/max: ``kernels_pallas/rope_append.py``). Float32
  bounds only (the atomics' type); ``"auto"`` falls back to ``"two_step"`` for any other dtype.

``key_bounds_path="auto"`` takes ``"fused"`` only while ``AUTO_FUSES_KEY_BOUNDS`` says so.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import rope_append as rope_append_kernels
from kernels_pallas.platform import choose_backend, interpret_mode
from paged.kv_cache import KVCache, _validate_append, append_kv, token_slots, validate_kv_cache
from paged.page_table import PageTable
from paged.rope import RopeParams, apply_rope, inverse_frequencies
from paged.sparse_quest import (
    PageKeyBounds,
    append_page_key_bounds,
    restart_opened_pages,
    validate_key_bounds,
)

DEFAULT_ROPE = RopeParams()  # Llama 2's: theta 10000, rotate-half, no scaling
KEY_BOUNDS_PATHS = ("auto", "fused", "two_step")

# Whether key_bounds_path="auto" takes the fused kernel (which keeps the bounds in the append's
# launch) over the two-step flow (the plain kernel, then XLA's update) on the Pallas backend.
# Measured on an H100 at d16a256 (docs/sparse_decode.md, section "Quest"), median us a call,
# plain append / fused / two-step: decode B=64 4.24 / 29.57 / 11.08, decode B=8 3.61 / 27.66 /
# 8.85, chunk 1 x 512 5.90 / 37.85 / 59.38 (fused at 8 warps: 18.58, 17.37, 39.32). The fused
# launch is slower at decode, the step that matters (its atomics, not the restart), so "auto"
# keeps the two-step update and the fused path is opt-in. Not yet measured on the H200.
AUTO_FUSES_KEY_BOUNDS = False


def _validate_rope_append(q, k, v, positions, batch_indices, cache, page_table, rope) -> None:
    """Shapes always; the page table, batch indices and positions when they are concrete."""
    if not isinstance(rope, RopeParams):
        raise ValueError(f"rope must be a paged.RopeParams, got {rope!r}")
    validate_kv_cache(cache)
    head_dim = cache.head_dim
    if head_dim % 2:
        raise ValueError(f"the cache's head_dim={head_dim} must be even (RoPE rotates pairs)")
    if q.ndim != 3:
        raise ValueError(f"q must have shape [tokens, num_q_heads, head_dim], got {q.shape}")
    if q.shape[2] != head_dim:
        raise ValueError(f"q has head_dim {q.shape[2]} but the cache has {head_dim}")
    for name, array in [("q", q), ("k", k), ("v", v)]:
        if not jnp.issubdtype(array.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating array, got dtype {array.dtype}")
    expected = (q.shape[0], cache.num_kv_heads, head_dim)
    for name, array in [("k", k), ("v", v)]:
        if array.shape != expected:
            raise ValueError(
                f"{name} must have shape [tokens, num_kv_heads, head_dim] = {expected} (q's "
                f"tokens, the cache's heads), got {array.shape}"
            )
    # Page table (indices outside the pool, ...), batch indices, positions, duplicates.
    _validate_append(cache, page_table, k, v, batch_indices, positions)


def rope_append_kv(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    batch_indices: jax.Array,
    cache: KVCache,
    page_table: PageTable,
    *,
    rope: RopeParams = DEFAULT_ROPE,
    backend: str = "auto",
    key_bounds: PageKeyBounds | None = None,
    key_bounds_path: str = "auto",
):
    """Applies RoPE to new tokens' q and k, and writes the rotated k and v into the pages.

    Token ``t`` (request ``b = batch_indices[t]``, position ``p = positions[t]``) is rotated by
    the angles ``float32(p) * inv_freq`` (``paged.rope``), and its k and v go to page
    ``page_indices[page_indptr[b] + p // page_size]``, slot ``p % page_size``, as in
    ``paged.append_kv``. Rotation in float32; q_rotated is rounded to q's dtype, the pages'
    entries to the cache's dtype.

    For the in-place update of serving engines, call it inside a jitted step that donates the
    cache (or carries it through a loop): the kernel writes only the new slots, into the pool's
    buffers. A cache that stays live is copied first (JAX semantics).

    Args:
      q: ``[T, Hq, D]`` floating.
      k, v: ``[T, Hkv, D]`` floating, ``Hkv`` and ``D`` the cache's.
      positions: int ``[T]``, each token's position in its request.
      batch_indices: int ``[T]``, each token's request.
      cache: the KV pool (``HND`` or ``NHD``), ``D`` even.
      page_table: the table after the append (it already covers the new tokens).
      rope: the model's ``RopeParams`` (theta, convention, Llama 3.1 scaling); static.
      backend: ``"auto"``, ``"reference"`` or ``"pallas"`` (module docstring).
      key_bounds: optional ``PageKeyBounds`` of the pool, ``[num_pages, Hkv, D]`` each, any
        floating dtype (float32 typically), kept up to date when given: pages whose slot 0 this
        call writes restart, then every written key, rotated and rounded as the pool stores
        it, widens its page's bounds; a token not written (outside the table under ``jit``)
        touches nothing (``paged.append_page_key_bounds``).
      key_bounds_path: with ``key_bounds`` on the Pallas backend, ``"fused"`` (the kernel keeps
        the bounds in its launch; float32 bounds), ``"two_step"`` (the kernel, then XLA's update)
        or ``"auto"`` (``AUTO_FUSES_KEY_BOUNDS``: today ``"two_step"``). The reference backend
        has one path, the reference. Same bounds either way but for one case (module docstring).

    Returns:
      ``(q_rotated [T, Hq, D] in q's dtype, the updated cache)``; with ``key_bounds``,
      ``(q_rotated, cache, bounds)``, the bounds in their own dtype.

    Raises:
      ValueError: naming the argument and value, for shape or dtype mismatches (q, k, v, the
        cache's heads or head_dim), an odd head_dim, and, when the inputs are concrete, a
        negative position or one not below its request's length, a batch index outside the
        batch, a (request, position) given twice, and page-table invariants (page indices
        outside the pool, ...), two tokens writing one (page, slot) of a shared page (copying it
        first, copy-on-write, is the caller's job: ``paged.append_kv``);
        ``backend="pallas"`` with float64 arrays; ``key_bounds`` not a ``PageKeyBounds`` of the
        pool's shape, an unknown ``key_bounds_path``, ``"fused"`` on the Pallas backend with
        bounds not float32. Under ``jit`` the value checks cannot run:
        such a token's q is still rotated but its k and v are not written (the kernel masks
        the store; never an access outside the pool), and of two tokens writing one slot one
        write is kept, unspecified which (``docs/invalid_input.md``).

    Example:
      >>> from paged import new_kv_cache
      >>> cache = new_kv_cache(4, 2, 1, 2, jnp.float32, layout="NHD")
      >>> table = PageTable.from_page_lists([[3]], seq_lens=[2], page_size=2)
      >>> x = jnp.array([[[1.0, 0.0]]])
      >>> q, cache = rope_append_kv(x, x, x, jnp.array([1]), jnp.array([0]), cache, table,
      ...                           backend="reference")
      >>> [round(float(value), 4) for value in (*q.ravel(), *cache.k_pages[3, 1, 0])]
      [0.5403, 0.8415, 0.5403, 0.8415]
    """
    _validate_rope_append(q, k, v, positions, batch_indices, cache, page_table, rope)
    if key_bounds_path not in KEY_BOUNDS_PATHS:
        raise ValueError(
            f"key_bounds_path must be one of {KEY_BOUNDS_PATHS}, got {key_bounds_path!r}"
        )
    if key_bounds is not None:
        validate_key_bounds(key_bounds, cache)
    chosen = choose_backend(
        "rope_append_kv",
        backend,
        unsupported=kernel_supports(q, k, v, cache),
        kernel="rope_append",
    ).backend
    if q.shape[0] == 0:  # nothing to rotate or write
        return (q, cache) if key_bounds is None else (q, cache, key_bounds)
    if chosen == "reference":
        return _rope_append_reference(
            q, k, v, positions, batch_indices, cache, page_table, rope, key_bounds
        )
    fused = key_bounds is not None and _fuses_key_bounds(key_bounds, key_bounds_path)
    outputs = rope_append_pallas(
        q,
        k,
        v,
        positions,
        batch_indices,
        cache,
        page_table,
        rope=rope,
        key_bounds=key_bounds if fused else None,
    )
    if key_bounds is None or fused:
        return outputs
    q_rotated, cache = outputs
    bounds = append_page_key_bounds(key_bounds, cache, page_table, batch_indices, positions)
    return q_rotated, cache, bounds


def _fuses_key_bounds(key_bounds: PageKeyBounds, key_bounds_path: str) -> bool:
    """Whether the Pallas path keeps ``key_bounds`` in the kernel's launch (module docstring)."""
    float32 = key_bounds.kmin.dtype == jnp.float32
    if key_bounds_path == "fused" and not float32:
        raise ValueError(
            "key_bounds_path='fused' needs float32 bounds (the kernel's atomic min and max), got "
            f"key_bounds of dtype {key_bounds.kmin.dtype}"
        )
    if key_bounds_path == "auto":
        return AUTO_FUSES_KEY_BOUNDS and float32
    return key_bounds_path == "fused"


def rope_append_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    batch_indices: jax.Array,
    cache: KVCache,
    page_table: PageTable,
    *,
    rope: RopeParams = DEFAULT_ROPE,
    key_bounds: PageKeyBounds | None = None,
    num_warps: int = 4,
):
    """``rope_append_kv``'s kernel call, unvalidated (the public function validates): the
    plain kernel, or with ``key_bounds`` (float32) the fused path, one XLA scatter restarting the
    pages this call opens and then the kernel's bounds variant. For probes and tuning, which
    set the launch (``num_warps``).

    Returns:
      ``(q_rotated, cache)``, or ``(q_rotated, cache, bounds)`` with ``key_bounds``.
    """
    bounds = ()
    if key_bounds is not None:
        # Before the launch: inside it, the program of slot 0 could not restart its page
        # before the page's other programs widen it (kernels_pallas/rope_append.py).
        pages, slots = token_slots(page_table, batch_indices, positions)
        bounds = tuple(restart_opened_pages(key_bounds, pages, slots))
    outputs = rope_append_kernels.rope_append(
        q,
        k,
        v,
        positions,
        batch_indices,
        # A NumPy array (static parameters only): a constant of the program, not a computation.
        inverse_frequencies(cache.head_dim, rope),
        page_table.last_page_len,
        page_table.page_indptr,
        page_table.page_indices,
        cache.k_pages,
        cache.v_pages,
        *bounds,
        layout=cache.layout,
        interleaved=rope.interleaved,
        num_warps=num_warps,
        interpret=interpret_mode(),
    )
    q_rotated, k_pages, v_pages = outputs[:3]
    cache = KVCache(k_pages, v_pages, cache.layout)
    if key_bounds is None:
        return q_rotated, cache
    return q_rotated, cache, PageKeyBounds(*outputs[3:])


def kernel_supports(q, k, v, cache: KVCache) -> str | None:
    """Why the kernel cannot run these arrays, or None if it can: it rotates in float32, so for
    float64 arrays ``"auto"`` keeps the reference and ``"pallas"`` raises."""
    wide = [a.dtype for a in (q, k, v, cache.k_pages) if jnp.dtype(a.dtype).itemsize > 4]
    if wide:
        return f"it rotates in float32: dtype {wide[0]} would lose precision"
    return None


def _rope_append_reference(
    q, k, v, positions, batch_indices, cache, page_table, rope, key_bounds=None
):
    """Rotate (``apply_rope``), round once to the stored dtypes, then ``append_kv`` (which keeps
    ``key_bounds`` when given)."""
    q_rotated = apply_rope(q, positions, rope).astype(q.dtype)
    k_rotated = apply_rope(k, positions, rope).astype(cache.dtype)
    if key_bounds is None:
        cache = append_kv(cache, page_table, k_rotated, v, batch_indices, positions)
        return q_rotated, cache
    cache, bounds = append_kv(
        cache, page_table, k_rotated, v, batch_indices, positions, key_bounds=key_bounds
    )
    return q_rotated, cache, bounds
