"""Public decode attention over the paged KV cache, with backend selection."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kernels_pallas.platform import resolve_backend
from paged.attention_reference import decode_attention_reference
from paged.kv_cache import KVCache, validate_kv_cache
from paged.page_table import PageTable, validate_page_table


def validate_decode_inputs(
    q: jax.Array, cache: KVCache, page_table: PageTable, logits_soft_cap: float | None
) -> None:
    """Shape, dtype and (concrete) page-table checks shared by every backend."""
    validate_kv_cache(cache)
    if q.ndim != 3:
        raise ValueError(f"q must have shape [batch, num_q_heads, head_dim], got {q.shape}")
    batch, num_heads, head_dim = q.shape
    if head_dim != cache.head_dim:
        raise ValueError(f"q has head_dim {head_dim} but the cache has {cache.head_dim}")
    if num_heads % cache.num_kv_heads:
        raise ValueError(
            f"q's num_q_heads={num_heads} is not a multiple of the cache's "
            f"num_kv_heads={cache.num_kv_heads}"
        )
    if q.dtype != cache.dtype:
        raise ValueError(f"q dtype {q.dtype} differs from the cache dtype {cache.dtype}")
    if page_table.page_size != cache.page_size:
        raise ValueError(
            f"page_table.page_size={page_table.page_size} differs from the cache's "
            f"page_size={cache.page_size}"
        )
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap}")
    validate_page_table(page_table, cache.num_pages, batch_size=batch)


def decode_attention(
    q: jax.Array,
    cache: KVCache,
    page_table: PageTable,
    *,
    sm_scale: float | None = None,
    logits_soft_cap: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
):
    """Grouped-query decode attention: one new query token per request over its paged keys.

    Query head ``h`` attends with KV head ``h // (H // num_kv_heads)``. Logits are
    ``(q . k) * sm_scale``, soft-capped as ``cap * tanh(s / cap)`` when ``logits_soft_cap`` is
    given; accumulation is in float32.

    The backend is chosen when the function is traced (``kernels_pallas.platform``):
    ``"auto"`` is the Pallas kernel on a GPU and the reference elsewhere, unless
    ``DECODELAB_BACKEND=reference``; an explicit ``backend=`` wins.

    Args:
      q: ``[B, H, D]`` queries, in the cache's dtype.
      cache: the KV pool (``HND`` or ``NHD``).
      page_table: ``B`` requests' pages.
      sm_scale: logit scale; default ``1 / sqrt(D)``.
      logits_soft_cap: optional cap ``> 0``.
      return_lse: also return the log-sum-exp.
      backend: ``"auto"``, ``"reference"`` or ``"pallas"``.

    Returns:
      ``o [B, H, D]`` in q's dtype, and with ``return_lse=True`` also ``lse`` float32 ``[B, H]``
      (natural log). An empty request (no pages) gets ``o = 0`` and ``lse = -inf``.

    Raises:
      ValueError: for mismatched shapes or dtypes, head counts that do not divide, and (concrete
        tables) page-table invariants: indices outside the pool, ``page_indptr`` not starting at
        0 or decreasing, ``last_page_len`` out of range.

    Example:
      >>> from paged import new_kv_cache
      >>> cache = new_kv_cache(4, 16, 2, 8, jnp.float32)
      >>> table = PageTable.from_seq_lens([20, 3], page_size=16)
      >>> o, lse = decode_attention(jnp.ones((2, 4, 8)), cache, table, return_lse=True)
      >>> o.shape, lse.shape
      ((2, 4, 8), (2, 4))
    """
    validate_decode_inputs(q, cache, page_table, logits_soft_cap)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    chosen = resolve_backend(backend, pallas_available=False)
    assert chosen == "reference"
    o, lse = decode_attention_reference(
        q, cache, page_table, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap
    )
    o = o.astype(q.dtype)
    lse = lse.astype(jnp.float32)
    return (o, lse) if return_lse else o

