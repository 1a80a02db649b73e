"""MLA attention of new tokens over the paged latent cache, un-absorbed: the prefill form.

``paged.mla_decode_attention`` computes attention in latent space (absorbed): every query head
scores the ``R + P`` = 576 wide cached vector and sums ``R`` = 512 wide latents. That is the
right form for decode, where a step reads the whole cache for a few query rows and is memory
bound: the cache is read once, as it is stored. A prompt chunk is the other regime: ``L``
query rows (hundreds) against a context that is mostly the chunk itself, compute bound. There
the per-token FLOP decide, and the un-absorbed form is cheaper: expand each visible token's
latent once into per-head keys ``c @ W_UK[h]`` (``N`` = 128) and values ``c @ W_UV[h]``
(``V`` = 128), then attend with ``N + P`` = 192 wide keys and 128 wide values per head, instead
of 576 and 512. Per (query row, key, head) that is ``2 (N + P + V)`` = 640 FLOP against the
absorbed ``2 (2R + P)`` = 2176 (3.4x), for an expansion of ``2 R (N + V)`` = 262144 FLOP a key
and head, paid once per chunk, not per query row. Both totals grow with the context length
alike, so the break-even is a chunk length: un-absorbed is cheaper from
``L > 2R (N + V) / (2 (2R + P) - 2 (N + P + V))`` = 171 query tokens at DeepSeek's sizes
(``unabsorbed_is_cheaper``; a FLOP count, not a measurement). DeepSeek's inference code makes
the same split (un-absorbed attention for prefill, the absorbed one for decode).

``mla_prefill_attention_unabsorbed`` is that form, as a plain-JAX reference: one request at a
time, the table's pages gathered, the request's own tokens masked in, causal by position. It
computes the same function as the absorbed decode (``docs/mla.md``, "The absorption algebra"):
``tests/test_mla_model.py`` checks a model's paged forward through either form against its
dense forward in float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged.attention_reference import (
    _compute_dtype,
    attention_over_visible_keys,
    token_mask,
    token_positions,
)
from paged.mla_cache import LatentCache
from paged.mla_reference import _validate_mla_inputs
from paged.page_table import PageTable
from paged.prefill import new_token_positions


def unabsorbed_is_cheaper(
    q_len: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int
) -> bool:
    """Whether ``L = q_len`` new tokens a request take fewer FLOP un-absorbed (module docstring).

    Per cached key and head: un-absorbed ``2 R (N + V) + L * 2 (N + P + V)``, absorbed
    ``L * 2 (2R + P)`` (the query absorption and the ``W_UV`` projection, per query row and not
    per key, are left out: next to a context of many keys they are small). So un-absorbed wins
    when ``L * (2 (2R + P) - 2 (N + P + V)) > 2 R (N + V)``.

    Example:
      >>> unabsorbed_is_cheaper(170, 512, 128, 64, 128), unabsorbed_is_cheaper(171, 512, 128, 64, 128)
      (False, True)
    """
    for name, value in (
        ("q_len", q_len),
        ("kv_lora_rank", kv_lora_rank),
        ("qk_nope_head_dim", qk_nope_head_dim),
        ("qk_rope_head_dim", qk_rope_head_dim),
        ("v_head_dim", v_head_dim),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    saved_per_row = 2 * (2 * kv_lora_rank + qk_rope_head_dim) - 2 * (
        qk_nope_head_dim + qk_rope_head_dim + v_head_dim
    )
    expansion = 2 * kv_lora_rank * (qk_nope_head_dim + v_head_dim)
    return saved_per_row > 0 and q_len * saved_per_row > expansion


def mla_prefill_attention_unabsorbed(
    q_nope: jax.Array,
    q_rope: jax.Array,
    cache: LatentCache,
    page_table: PageTable,
    w_uk: jax.Array,
    w_uv: jax.Array,
    *,
    softmax_scale: float | None = None,
) -> jax.Array:
    """Each request's ``L`` newest tokens attend causally over its paged latents, un-absorbed.

    The same convention as ``paged.mla_decode_attention``: the new tokens are the last ``L`` of
    each request in ``page_table``, their latents already appended (``paged.append_latent``);
    query ``l`` sits at position ``seq_len - L + l`` and sees the keys at positions up to its
    own. Only the table's pages are expanded (``page_indices``, padded length included), not the
    whole pool: ``nnz_padded * page_size * H * (N + V)`` values, once for all requests.

    Args:
      q_nope: ``[B, L, H, N]``: each new token's non-rotary query per head.
      q_rope: ``[B, L, H, P]``: its rotated RoPE query per head.
      cache: the latent pool.
      page_table: B requests, already covering the new tokens.
      w_uk: ``[H, R, N]``; ``w_uv``: ``[H, R, V]``.
      softmax_scale: a Python float; default ``1 / sqrt(N + P)``.

    Returns:
      ``out [B, L, H, V]`` in the compute dtype (float32, float64 for float64 inputs).

    Raises:
      ValueError: as ``paged.mla_decode_attention`` does (``paged.mla_reference``'s checks),
        naming the argument and the value; and for queries that are not 4-D.
    """
    if q_nope.ndim != 4:
        raise ValueError(f"q_nope must have shape [B, L, H, N], got {q_nope.shape}")
    nope, rope, scale = _validate_mla_inputs(
        q_nope, q_rope, cache, page_table, w_uk, w_uv, softmax_scale
    )
    batch, q_len, num_heads = nope.shape[:3]
    dtype = _compute_dtype(jnp.result_type(nope.dtype, cache.dtype, w_uk.dtype, w_uv.dtype))
    # Every listed page's tokens, gathered once and expanded once for all requests: [T, ...].
    latent = cache.latent_pages[page_table.page_indices].astype(dtype)
    num_tokens = latent.shape[0] * latent.shape[1]
    latent = latent.reshape(num_tokens, cache.kv_lora_rank)
    rope_key = cache.rope_key_pages[page_table.page_indices].astype(dtype)
    rope_key = rope_key.reshape(num_tokens, 1, cache.qk_rope_head_dim)
    k_nope = jnp.einsum("tr,hrn->thn", latent, w_uk.astype(dtype), precision="highest")
    keys = jnp.concatenate(
        [k_nope, jnp.broadcast_to(rope_key, (num_tokens, num_heads, cache.qk_rope_head_dim))],
        axis=-1,
    )  # [T, H, N + P]: the RoPE key is the same for every head
    values = jnp.einsum("tr,hrv->thv", latent, w_uv.astype(dtype), precision="highest")
    # [B, L, H, 1, N + P]: one KV head a query head (the GQA reference's G = 1).
    queries = jnp.concatenate([nope.astype(dtype), rope.astype(dtype)], axis=-1)[:, :, :, None]
    owns_token = token_mask(page_table).reshape(batch, num_tokens)
    key_position = token_positions(page_table).reshape(batch, num_tokens)
    query_position = new_token_positions(page_table, q_len)

    def attend(request):
        q_b, mine, key_pos, query_pos = request  # [L, H, 1, N+P], bool[T], int[T], int[L]
        visible = mine[None, :] & (key_pos[None, :] <= query_pos[:, None])  # [L, T], causal
        out, _ = attention_over_visible_keys(
            q_b, keys, values, visible, sm_scale=scale, logits_soft_cap=None
        )
        return out

    out = jax.lax.map(attend, (queries, owns_token, key_position, query_position))
    return out[:, :, :, 0]  # [B, L, H, V]
