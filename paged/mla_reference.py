"""Reference MLA decode over the paged latent cache, two ways that must agree.

Notation per query head ``h`` (DeepSeek-V2 sizes in brackets): the latent ``c`` [R = 512] and
RoPE key ``k_rope`` [P = 64] of every cached token (``paged.mla_cache``); the query's ``q_nope``
[N = 128] and rotated ``q_rope`` [P]; the up-projections ``W_UK[h]`` [R, N] and ``W_UV[h]``
[R, V = 128]. Head ``h``'s key and value of a token are

    k_h = concat(c @ W_UK[h], k_rope)        v_h = c @ W_UV[h]

and the logit is ``softmax_scale * (q_nope . (c @ W_UK[h]) + q_rope . k_rope)``, with
``softmax_scale = 1 / sqrt(N + P)`` (= 1/sqrt(192)) by default: the scale of the head
dimension the model was trained with, NOT of the 576 values a latent-space kernel reads.

- **Un-absorbed** (``mla_decode_unabsorbed_reference``): expand the latent pool into the per-head
  K and V pages MLA avoids storing, and run the project's grouped-query decode reference
  (``decode_attention_reference``, one KV head per query head) on them.
- **Absorbed** (``mla_decode_absorbed_reference``): since ``q_nope . (c @ W_UK[h]) =
  (W_UK[h] @ q_nope) . c``, fold ``W_UK`` into the query (``absorb_query``: ``q_latent`` [R]),
  attend with every head against the one shared latent stream (keys ``concat(c, k_rope)``,
  values ``c``: ``mla_latent_attention_state``), then apply ``W_UV`` to the latent output
  (``project_latent_output``). This is what an MLA decode kernel computes.

Both return ``(out, lse)``, ``lse`` the natural-log log-sum-exp of the same scaled logits, so
states over disjoint parts of the context merge exactly with ``paged.merge_states``. New tokens
follow ``paged.decode_attention``'s convention: ``q_len = L`` new tokens are the last ``L`` of
each request, their latents already in the cache, causal among themselves.

Computation is in float32, or float64 for float64 inputs (tests with x64 enabled).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from paged.attention_reference import (
    _compute_dtype,
    attention_over_visible_keys,
    decode_attention_reference,
    token_mask,
    token_positions,
)
from paged.kv_cache import KVCache
from paged.mla_cache import LatentCache, validate_latent_cache
from paged.page_table import PageTable, check_holds_new_tokens, validate_page_table
from paged.prefill import new_token_positions
from paged.rope import YarnScaling


def default_softmax_scale(
    qk_nope_head_dim: int, qk_rope_head_dim: int, *, yarn: YarnScaling | None = None
) -> float:
    """``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``: 1/sqrt(192) for DeepSeek-V2, times
    YaRN's ``mscale ** 2`` when the model uses YaRN.

    The scale belongs to the model's query-key head dimension (128 + 64), not to the width of the
    latent-space dot product (512 + 64 = 576) that the absorbed form computes; the two give
    different attention. Under YaRN (``paged.rope.YarnScaling``) DeepSeek multiplies it by
    ``mscale ** 2``, ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1``
    (``paged.rope.yarn_mscale``): pass ``yarn=`` here and the result as ``softmax_scale``.

    Raises:
      ValueError: for a ``yarn`` that is neither None nor a ``YarnScaling``.

    Example:
      >>> default_softmax_scale(128, 64) == 1 / 192 ** 0.5
      True
      >>> round(default_softmax_scale(128, 64, yarn=YarnScaling(factor=40.0)), 6)  # DeepSeek-V3
      0.135234
    """
    scale = 1.0 / math.sqrt(qk_nope_head_dim + qk_rope_head_dim)
    if yarn is None:
        return scale
    if not isinstance(yarn, YarnScaling):
        raise ValueError(f"yarn must be a paged.rope.YarnScaling or None, got {yarn!r}")
    return scale * yarn.softmax_scale_multiplier


def _check_softmax_scale(softmax_scale) -> float:
    if isinstance(softmax_scale, jax.core.Tracer):
        raise ValueError("softmax_scale must be a Python float, not a traced value (it is static)")
    if isinstance(softmax_scale, bool) or not isinstance(
        softmax_scale, (int, float, np.integer, np.floating)
    ):
        raise ValueError(f"softmax_scale must be a float, got {softmax_scale!r}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale!r}")
    return float(softmax_scale)


def _with_q_len_axis(name: str, q: jax.Array) -> jax.Array:
    """``q`` as ``[B, L, H, D]``: a ``[B, H, D]`` query is one new token (``L = 1``)."""
    if q.ndim == 3:
        return q[:, None]
    if q.ndim == 4:
        if q.shape[1] < 1:
            raise ValueError(f"{name}'s q_len (axis 1 of {q.shape}) must be >= 1, got {q.shape[1]}")
        return q
    raise ValueError(f"{name} must have shape [B, H, D] or [B, q_len, H, D], got {q.shape}")


def _check_cache_and_table(cache: LatentCache, page_table: PageTable, batch: int, q_len: int):
    validate_latent_cache(cache)
    if page_table.page_size != cache.page_size:
        raise ValueError(
            f"page_table.page_size={page_table.page_size} differs from the cache's "
            f"page_size={cache.page_size}"
        )
    validate_page_table(page_table, cache.num_pages, batch_size=batch)
    # Idle (empty) rows may stand beside requests; the latents of the new tokens must be cached.
    check_holds_new_tokens(
        page_table, q_len, f"q_len={q_len} new tokens (their latents)", allow_empty=True
    )


def _check_projections(w_uk: jax.Array, w_uv: jax.Array, kv_lora_rank: int) -> None:
    for name, w, last in [("w_uk", w_uk, "qk_nope_head_dim"), ("w_uv", w_uv, "v_head_dim")]:
        if w.ndim != 3:
            raise ValueError(f"{name} must have shape [heads, kv_lora_rank, {last}], got {w.shape}")
        if w.shape[1] != kv_lora_rank:
            raise ValueError(
                f"{name} has kv_lora_rank {w.shape[1]} (axis 1 of {w.shape}) but the cache has "
                f"{kv_lora_rank}"
            )
    if w_uk.shape[0] != w_uv.shape[0]:
        raise ValueError(f"w_uk has {w_uk.shape[0]} heads but w_uv has {w_uv.shape[0]}")


def _check_queries(
    q_nope: jax.Array, q_rope: jax.Array, num_heads: int, qk_nope: int, qk_rope: int
) -> tuple[jax.Array, jax.Array]:
    """Both queries as ``[B, L, H, D]``, checked against each other and the sizes given."""
    nope = _with_q_len_axis("q_nope", q_nope)
    rope = _with_q_len_axis("q_rope", q_rope)
    if q_nope.ndim != q_rope.ndim or nope.shape[:3] != rope.shape[:3]:
        raise ValueError(
            f"q_nope {q_nope.shape} and q_rope {q_rope.shape} must agree on every axis but the "
            "last ([B, H] or [B, q_len, H])"
        )
    if nope.shape[2] != num_heads:
        raise ValueError(
            f"q_nope has {nope.shape[2]} heads but the projections have {num_heads} heads"
        )
    if nope.shape[3] != qk_nope:
        raise ValueError(
            f"q_nope has qk_nope_head_dim {nope.shape[3]} but w_uk has {qk_nope} (its last axis)"
        )
    if rope.shape[3] != qk_rope:
        raise ValueError(f"q_rope has qk_rope_head_dim {rope.shape[3]} but the cache has {qk_rope}")
    return nope, rope


# --------------------------------------------------------------------------------------------
# Un-absorbed: latent expanded into per-head K and V pages
# --------------------------------------------------------------------------------------------


def expand_latent_cache(cache: LatentCache, w_uk: jax.Array, w_uv: jax.Array) -> KVCache:
    """The per-head K and V pages the latent stands for, as a plain (NHD) ``KVCache``.

    Head ``h``'s key of a token is ``concat(c @ W_UK[h], k_rope)`` and its value ``c @ W_UV[h]``.
    ``KVCache`` wants keys and values of one width, so both are zero-padded on the right to
    ``max(qk_nope + qk_rope, v_head_dim)``: zeros add nothing to ``q . k`` (the query is padded
    the same way) and the value's padding is sliced off the output. What such a pool costs a
    token (``H * (N + P + V)`` values unpadded, against the latent's ``R + P``) is what MLA saves.

    Args:
      cache: ``[num_pages, page_size, R]`` latents and ``[num_pages, page_size, P]`` RoPE keys.
      w_uk: ``[H, R, N]``.
      w_uv: ``[H, R, V]``.

    Returns:
      ``KVCache`` in NHD layout, ``[num_pages, page_size, H, max(N + P, V)]``, in the compute
      dtype (float32, or float64 for float64 inputs).
    """
    validate_latent_cache(cache)
    _check_projections(w_uk, w_uv, cache.kv_lora_rank)
    dtype = _compute_dtype(jnp.result_type(cache.dtype, w_uk.dtype, w_uv.dtype))
    latent = cache.latent_pages.astype(dtype)
    qk_nope = w_uk.shape[2]
    v_head_dim = w_uv.shape[2]
    width = max(qk_nope + cache.qk_rope_head_dim, v_head_dim)
    k_nope = jnp.einsum("psr,hrn->pshn", latent, w_uk.astype(dtype), precision="highest")
    k_rope = jnp.broadcast_to(
        cache.rope_key_pages.astype(dtype)[:, :, None, :],
        (*k_nope.shape[:3], cache.qk_rope_head_dim),
    )  # one RoPE key a token, the same for every head
    k = jnp.concatenate([k_nope, k_rope], axis=-1)
    v = jnp.einsum("psr,hrv->pshv", latent, w_uv.astype(dtype), precision="highest")
    pad = [(0, 0)] * 3
    k = jnp.pad(k, [*pad, (0, width - k.shape[-1])])
    v = jnp.pad(v, [*pad, (0, width - v_head_dim)])
    return KVCache(k, v, "NHD")


def mla_decode_unabsorbed_reference(
    q_nope: jax.Array,
    q_rope: jax.Array,
    cache: LatentCache,
    page_table: PageTable,
    w_uk: jax.Array,
    w_uv: jax.Array,
    *,
    softmax_scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """MLA decode the way the model is written: per-head keys and values from the latent.

    Expands the pool (``expand_latent_cache``), then runs ``decode_attention_reference`` with
    ``q = concat(q_nope, q_rope)`` per head and one KV head per query head. Costs
    ``num_pages * page_size * H * (N + P + V)`` values of expansion: for tests.

    Args:
      q_nope: ``[B, H, N]`` or ``[B, L, H, N]``: each new token's non-rotary query per head.
      q_rope: ``[B, H, P]`` or ``[B, L, H, P]``: its rotated RoPE query per head.
      cache: the latent pool.
      page_table: B requests, already covering the new tokens.
      w_uk: ``[H, R, N]``, ``w_uv``: ``[H, R, V]``.
      softmax_scale: the logit scale; default ``1 / sqrt(N + P)`` (``default_softmax_scale``).

    Returns:
      ``(out [B, (L,) H, V], lse [B, (L,) H])`` in the compute dtype; ``lse`` is the natural-log
      log-sum-exp of the scaled logits. A query that sees no key gets ``out = 0``,
      ``lse = -inf``.

    Raises:
      ValueError: naming the argument and the value, for shapes that do not fit together, a
        bad ``softmax_scale``, a ``q_len < 1``, a request shorter than ``q_len``, or a bad page
        table.
    """
    nope, rope, scale = _validate_mla_inputs(
        q_nope, q_rope, cache, page_table, w_uk, w_uv, softmax_scale
    )
    expanded = expand_latent_cache(cache, w_uk, w_uv)
    dtype = expanded.dtype
    q = jnp.concatenate([nope.astype(dtype), rope.astype(dtype)], axis=-1)
    q = jnp.pad(q, [(0, 0)] * 3 + [(0, expanded.head_dim - q.shape[-1])])
    out, lse = decode_attention_reference(q, expanded, page_table, sm_scale=scale)
    out = out[..., : w_uv.shape[2]]
    if q_nope.ndim == 3:
        return out[:, 0], lse[:, 0]
    return out, lse


# --------------------------------------------------------------------------------------------
# Absorbed: attention in latent space
# --------------------------------------------------------------------------------------------


def absorb_query(q_nope: jax.Array, w_uk: jax.Array) -> jax.Array:
    """``q_latent[..., h, :] = W_UK[h] @ q_nope[..., h, :]``: the query in latent space.

    ``q_nope . (c @ W_UK[h]) = (W_UK[h] @ q_nope) . c`` (a transpose moved across a dot
    product), so scoring the latent with ``q_latent`` gives the un-absorbed logit exactly.

    Args:
      q_nope: ``[..., H, N]``.
      w_uk: ``[H, R, N]``.

    Returns:
      ``[..., H, R]`` in the compute dtype.
    """
    dtype = _compute_dtype(jnp.result_type(q_nope.dtype, w_uk.dtype))
    return jnp.einsum(
        "...hn,hrn->...hr", q_nope.astype(dtype), w_uk.astype(dtype), precision="highest"
    )


def project_latent_output(o_latent: jax.Array, w_uv: jax.Array) -> jax.Array:
    """``out[..., h, :] = o_latent[..., h, :] @ W_UV[h]``: the latent output back per head.

    Linear, so it commutes with merging states (a weighted mean): states may be merged before or
    after the projection.

    Args:
      o_latent: ``[..., H, R]``.
      w_uv: ``[H, R, V]``.

    Returns:
      ``[..., H, V]`` in the compute dtype.
    """
    dtype = _compute_dtype(jnp.result_type(o_latent.dtype, w_uv.dtype))
    return jnp.einsum(
        "...hr,hrv->...hv", o_latent.astype(dtype), w_uv.astype(dtype), precision="highest"
    )


def validate_latent_attention_inputs(
    q_latent: jax.Array,
    q_rope: jax.Array,
    cache: LatentCache,
    page_table: PageTable,
    *,
    holds_new_tokens: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """The checks of latent-space attention's queries, cache and table, shared by the reference
    (``mla_latent_attention_state``) and the kernel's wrapper
    (``kernels_pallas.mla_decode_mgpu.mla_decode_mgpu``), so both refuse bad input alike.

    Args:
      q_latent: ``[B, H, R]`` or ``[B, L, H, R]``.
      q_rope: ``[B, H, P]`` or ``[B, L, H, P]``.
      cache: the latent pool (``validate_latent_cache``).
      page_table: B requests, checked against the pool (values when concrete).
      holds_new_tokens: also check (concrete tables) that every non-empty request holds its
        ``L`` new tokens; off for a part of a split plan.

    Returns:
      Both queries as ``[B, L, H, D]``.

    Raises:
      ValueError: naming the argument and the value.
    """
    validate_latent_cache(cache)
    latent_q = _with_q_len_axis("q_latent", q_latent)
    rope_q = _with_q_len_axis("q_rope", q_rope)
    if q_latent.ndim != q_rope.ndim or latent_q.shape[:3] != rope_q.shape[:3]:
        raise ValueError(
            f"q_latent {q_latent.shape} and q_rope {q_rope.shape} must agree on every axis but "
            "the last ([B, H] or [B, q_len, H])"
        )
    if latent_q.shape[3] != cache.kv_lora_rank:
        raise ValueError(
            f"q_latent has width {latent_q.shape[3]} but the cache's kv_lora_rank is "
            f"{cache.kv_lora_rank}"
        )
    if rope_q.shape[3] != cache.qk_rope_head_dim:
        raise ValueError(
            f"q_rope has qk_rope_head_dim {rope_q.shape[3]} but the cache has "
            f"{cache.qk_rope_head_dim}"
        )
    batch, q_len = latent_q.shape[:2]
    _check_cache_and_table(cache, page_table, batch, q_len if holds_new_tokens else 1)
    return latent_q, rope_q


def mla_latent_attention_state(
    q_latent: jax.Array,
    q_rope: jax.Array,
    cache: LatentCache,
    page_table: PageTable,
    *,
    softmax_scale: float,
    query_positions: jax.Array | None = None,
    first_key_position: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Every query head against the shared latent stream: the state an MLA kernel computes.

    Logit of head ``h`` and token ``t``: ``softmax_scale * (q_latent[h] . c[t] + q_rope[h] .
    k_rope[t])``; output ``sum_t softmax_t * c[t]`` (in latent space, ``W_UV`` not applied).
    ``softmax_scale`` has no default here on purpose: it is the model's (``default_softmax_scale``
    of ``N + P``), which this function, seeing only ``R + P`` wide vectors, cannot know.

    A split-KV plan computes one state per part of each request's pages and merges them
    (``paged.merge_states``). For such a part, pass its own table with ``first_key_position``
    (the position of its first token in the request) and the new tokens' positions in the whole
    request (``query_positions``), so the causal mask among new tokens stays right.

    Args:
      q_latent: ``[B, H, R]`` or ``[B, L, H, R]`` (``absorb_query``).
      q_rope: ``[B, H, P]`` or ``[B, L, H, P]``, rotated.
      cache: the latent pool.
      page_table: B requests (or their parts).
      softmax_scale: the logit scale.
      query_positions: int ``[B, L]``, each new token's position in its request; default the
        last ``L`` positions of the table's requests (``seq_len - L + l``).
      first_key_position: int ``[B]``, the position of each request's first token in the table;
        default 0.

    Returns:
      ``(o_latent [B, (L,) H, R], lse [B, (L,) H])`` in the compute dtype; ``lse`` in natural
      log. Query ``l`` sees the keys at positions ``<= query_positions[b, l]``; one that sees
      none gets ``o_latent = 0``, ``lse = -inf``.

    Raises:
      ValueError: naming the argument and the value, for shapes that do not fit together, a
        bad ``softmax_scale`` or page table, positions of the wrong shape.
    """
    scale = _check_softmax_scale(softmax_scale)
    # A part of a split plan may hold fewer than q_len tokens: no length check then.
    latent_q, rope_q = validate_latent_attention_inputs(
        q_latent, q_rope, cache, page_table, holds_new_tokens=query_positions is None
    )
    batch, q_len = latent_q.shape[:2]
    if query_positions is None:
        query_positions = new_token_positions(page_table, q_len)
    if query_positions.shape != (batch, q_len):
        raise ValueError(
            f"query_positions must have shape [{batch}, {q_len}] ([B, q_len]), got "
            f"{query_positions.shape}"
        )
    if first_key_position is None:
        first_key_position = jnp.zeros((batch,), jnp.int32)
    if first_key_position.shape != (batch,):
        raise ValueError(
            f"first_key_position must have shape [{batch}] ([B]), got {first_key_position.shape}"
        )
    dtype = _compute_dtype(jnp.result_type(latent_q.dtype, rope_q.dtype, cache.dtype))
    # [T, 1, R + P] keys: every listed page's tokens, the latent and RoPE key side by side, so
    # one dot product gives q_latent . c + q_rope . k_rope. One "KV head" that all H query heads
    # share; the values are the latents alone.
    latent = cache.latent_pages[page_table.page_indices].astype(dtype)
    rope_key = cache.rope_key_pages[page_table.page_indices].astype(dtype)
    num_tokens = latent.shape[0] * latent.shape[1]
    latent = latent.reshape(num_tokens, 1, cache.kv_lora_rank)
    keys = jnp.concatenate([latent, rope_key.reshape(num_tokens, 1, -1)], axis=-1)
    queries = jnp.concatenate([latent_q.astype(dtype), rope_q.astype(dtype)], axis=-1)
    queries = queries[:, :, None]  # [B, L, 1, H, R + P]: H query heads of one KV head
    owns_token = token_mask(page_table).reshape(batch, num_tokens)
    key_position = token_positions(page_table).reshape(batch, num_tokens)
    key_position = key_position + first_key_position[:, None].astype(key_position.dtype)

    def attend(request):
        q_b, mine, key_pos, query_pos = request  # [L, 1, H, R+P], bool[T], int[T], int[L]
        visible = mine[None, :] & (key_pos[None, :] <= query_pos[:, None])  # [L, T], causal
        return attention_over_visible_keys(
            q_b, keys, latent, visible, sm_scale=scale, logits_soft_cap=None
        )

    o_latent, lse = jax.lax.map(attend, (queries, owns_token, key_position, query_positions))
    o_latent = o_latent[:, :, 0]  # [B, L, H, R]
    lse = lse[:, :, 0]  # [B, L, H]
    if q_latent.ndim == 3:
        return o_latent[:, 0], lse[:, 0]
    return o_latent, lse


def mla_decode_absorbed_reference(
    q_nope: jax.Array,
    q_rope: jax.Array,
    cache: LatentCache,
    page_table: PageTable,
    w_uk: jax.Array,
    w_uv: jax.Array,
    *,
    softmax_scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """MLA decode in latent space: ``absorb_query``, ``mla_latent_attention_state``,
    ``project_latent_output``. Same arguments, results and errors as
    ``mla_decode_unabsorbed_reference``, whose function it computes."""
    nope, rope, scale = _validate_mla_inputs(
        q_nope, q_rope, cache, page_table, w_uk, w_uv, softmax_scale
    )
    q_latent = absorb_query(nope, w_uk)
    o_latent, lse = mla_latent_attention_state(
        q_latent, rope, cache, page_table, softmax_scale=scale
    )
    out = project_latent_output(o_latent, w_uv)
    if q_nope.ndim == 3:
        return out[:, 0], lse[:, 0]
    return out, lse


def _validate_mla_inputs(q_nope, q_rope, cache, page_table, w_uk, w_uv, softmax_scale):
    """Checks both formulations' inputs; returns the queries as ``[B, L, H, D]`` and the scale."""
    validate_latent_cache(cache)
    _check_projections(w_uk, w_uv, cache.kv_lora_rank)
    num_heads, _, qk_nope = w_uk.shape
    nope, rope = _check_queries(q_nope, q_rope, num_heads, qk_nope, cache.qk_rope_head_dim)
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(qk_nope, cache.qk_rope_head_dim)
    scale = _check_softmax_scale(softmax_scale)
    _check_cache_and_table(cache, page_table, nope.shape[0], nope.shape[1])
    return nope, rope, scale
