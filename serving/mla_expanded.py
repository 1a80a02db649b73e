"""The MLA decoder with its latent expanded into plain per-head K/V pages: the baseline MLA's
latent cache is measured against (``bench/probes/mla_engine.py``).

The same model and weights as ``serving/mla_model.py`` (``init_mla_model_params``); only what
the cache holds and how attention reads it differ. Each layer writes, for every new token, one
key and one value per query head into an ordinary ``paged.KVCache`` (``H`` KV heads, one a query
head), as a grouped-query model's cache would hold them:

    key_h   = concat(latent @ w_uk[h], k_rope)      N + P values, zero-padded to D
    value_h = latent @ w_uv[h]                      V values, zero-padded to D
    query_h = concat(q_nope[h], q_rope[h])          N + P values, zero-padded to D

and attends with ``paged.decode_attention`` (the project's decode path, its kernels on the
Pallas backend, with the split-KV plan the engine makes for any KV cache) at the model's scale
``1 / sqrt(N + P)``, keeping the first ``V`` columns of the output. The zero padding adds
nothing to a logit (``0 * 0``) and its output columns are dropped, so the function is the
model's, un-absorbed: ``tests/test_engine_mla.py`` checks it against ``forward_paged_mla``.

Why ``D`` is padded: keys are ``N + P`` wide (192 at DeepSeek's sizes) and values ``V`` (128),
but a ``KVCache`` has one ``head_dim`` and the decode kernel takes power-of-two head dims of at
least 16 (``paged.decode.kernel_supports``; Triton tiles), so ``D`` defaults to the next power
of two of ``max(N + P, V)``: 256 at DeepSeek's sizes. Bytes a token a layer (bfloat16):
``2 H D * 2`` = 16384 padded, against the unpadded 10240 (``cache_bytes_per_token(...,
"expanded")``) and the latent cache's 1152.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import paged
from serving.mla_config import MLAModelConfig
from serving.mla_model import _decoder, validate_mla_model_params
from serving.model import _validate_tokens


def _next_power_of_two(value: int) -> int:
    return 1 << (value - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class ExpandedMLAConfig:
    """An ``MLAModelConfig`` run with its latent expanded into per-head K/V pages (hashable: a
    static argument under ``jit``). The engine takes it as a target like a Llama-style model:
    its pools are ``KVCache``s of ``num_kv_heads = num_q_heads = H`` heads of ``head_dim``.

    Attributes:
      model: the MLA model (its weights are ``init_mla_model_params``'s).
      head_dim: ``D``, the pages' head width, at least ``max(N + P, V)``; default (0) the next
        power of two of that, at least 16 (what the decode kernels take).

    Raises:
      ValueError: naming the field, for a ``model`` that is not an ``MLAModelConfig`` or a
        ``head_dim`` narrower than a key or a value.

    Example:
      >>> from serving.mla_config import MLA_TINY
      >>> ExpandedMLAConfig(MLA_TINY).head_dim, ExpandedMLAConfig(MLA_TINY).bytes_per_token
      (256, 32768)
    """

    model: MLAModelConfig
    head_dim: int = 0

    def __post_init__(self):
        if not isinstance(self.model, MLAModelConfig):
            raise ValueError(f"model must be an MLAModelConfig, got {self.model!r}")
        sizes = self.model.attention
        widest = max(sizes.qk_nope_head_dim + sizes.qk_rope_head_dim, sizes.v_head_dim)
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int):
            raise ValueError(f"head_dim must be an int, got {self.head_dim!r}")
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", max(16, _next_power_of_two(widest)))
        elif self.head_dim < widest:
            raise ValueError(
                f"head_dim must be at least max(N + P, V) = {widest} (a key or a value a head), "
                f"got {self.head_dim}"
            )

    # What the engine and its planning read of a Llama-style config.
    @property
    def num_q_heads(self) -> int:
        return self.model.attention.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.model.attention.num_heads

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return self.model.jnp_dtype

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes a token, every layer, as stored (padded): ``layers * 2 H D * itemsize``."""
        per_layer = 2 * self.num_kv_heads * self.head_dim * self.jnp_dtype.itemsize
        return self.num_layers * per_layer


def new_expanded_mla_caches(
    config: ExpandedMLAConfig, num_pages: int, page_size: int, layout: str = "HND", dtype=None
) -> list[paged.KVCache]:
    """One all-zero ``paged.KVCache`` a layer: ``H`` KV heads of ``config.head_dim``
    (``dtype`` default: the model's).

    Example:
      >>> from serving.mla_config import MLA_TEST
      >>> caches = new_expanded_mla_caches(ExpandedMLAConfig(MLA_TEST), num_pages=4, page_size=8)
      >>> len(caches), caches[0].k_pages.shape
      (2, (4, 4, 8, 32))
    """
    if not isinstance(config, ExpandedMLAConfig):
        raise ValueError(f"config must be an ExpandedMLAConfig, got {config!r}")
    return [
        paged.new_kv_cache(
            num_pages,
            page_size,
            config.num_kv_heads,
            config.head_dim,
            config.jnp_dtype if dtype is None else dtype,
            layout,
        )
        for _ in range(config.num_layers)
    ]


def _pad_last(x: jax.Array, width: int) -> jax.Array:
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def forward_paged_mla_expanded(
    params,
    config: ExpandedMLAConfig,
    tokens: jax.Array,
    caches: list[paged.KVCache],
    page_table: paged.PageTable,
    *,
    plan: paged.DecodePlan | None = None,
    backend: str = "auto",
) -> tuple[jax.Array, list[paged.KVCache]]:
    """``forward_paged_mla``'s function with per-head K/V pages (module docstring).

    Args:
      params: ``init_mla_model_params(config.model, ...)``'s dict.
      config: the expanded configuration.
      tokens: int ``[B, L]``, the last ``L`` tokens of each request in ``page_table``.
      caches: one ``paged.KVCache`` a layer (``new_expanded_mla_caches``).
      page_table: ``B`` requests covering the new tokens.
      plan: the decode kernel's split-KV plan (``paged.plan_decode_tables`` with ``H`` query and
        KV heads of ``D``), for the Pallas backend under ``jit``.
      backend: every op's (``paged.decode_attention``, the norms).

    Returns:
      ``(logits, caches)``: float32 ``[B, L, V]`` (float64 for float64 parameters) and the
      caches with the new tokens' keys and values appended.

    Raises:
      ValueError: for a config that is not an ``ExpandedMLAConfig``, tokens not ``[B, L]``
        integers, parameters unlike the model, a batch unlike the table's; plus what the paged
        ops refuse (caches of another shape among them).

    Example:
      >>> from serving.mla_config import MLA_TEST
      >>> from serving.mla_model import init_mla_model_params
      >>> config = ExpandedMLAConfig(MLA_TEST)
      >>> params = init_mla_model_params(MLA_TEST, jax.random.key(0))
      >>> caches = new_expanded_mla_caches(config, num_pages=4, page_size=8)
      >>> table = paged.PageTable.from_seq_lens([3], page_size=8)
      >>> logits, caches = forward_paged_mla_expanded(
      ...     params, config, jnp.array([[10, 11, 12]]), caches, table, backend="reference"
      ... )
      >>> logits.shape
      (1, 3, 256)
    """
    if not isinstance(config, ExpandedMLAConfig):
        raise ValueError(f"config must be an ExpandedMLAConfig, got {config!r}")
    model = config.model
    _validate_tokens(tokens, model)
    validate_mla_model_params(params, model)
    if not isinstance(caches, (list, tuple)) or len(caches) != model.num_layers:
        raise ValueError(f"caches must be a list of {model.num_layers} KVCache, got {caches!r}")
    batch, length = tokens.shape
    if page_table.batch_size != batch:
        raise ValueError(
            f"tokens has {batch} requests but page_table describes {page_table.batch_size}"
        )
    paged.check_holds_new_tokens(page_table, length, f"L={length} new ones")
    positions = paged.new_token_positions(page_table, length)  # [B, L]
    batch_indices = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), length)
    sizes = model.attention
    width, heads = config.head_dim, sizes.num_heads
    updated = []

    def attention(index, layer, q_nope, q_rope, latent, k_rope):
        dtype = caches[index].k_pages.dtype
        f32 = jnp.promote_types(dtype, jnp.float32)
        cast = lambda x: x.astype(f32)
        # Per-head keys and values, computed in float32 and stored in the pages' dtype (the
        # expansion a grouped-query model's projections would have written).
        k_nope = jnp.einsum("blr,hrn->blhn", cast(latent), cast(layer["w_uk"]))
        values = jnp.einsum("blr,hrv->blhv", cast(latent), cast(layer["w_uv"]))
        k_rope_heads = jnp.broadcast_to(
            cast(k_rope)[:, :, None, :], (*k_nope.shape[:3], k_rope.shape[-1])
        )
        keys = _pad_last(jnp.concatenate([k_nope, k_rope_heads], axis=-1), width)
        cache = paged.append_kv(
            caches[index],
            page_table,
            keys.reshape(batch * length, heads, width).astype(dtype),
            _pad_last(values, width).reshape(batch * length, heads, width).astype(dtype),
            batch_indices,
            positions.reshape(-1),
        )
        updated.append(cache)
        query = _pad_last(jnp.concatenate([q_nope, q_rope], axis=-1), width).astype(dtype)
        out = paged.decode_attention(
            query, cache, page_table, sm_scale=sizes.softmax_scale, plan=plan, backend=backend
        )
        return out[..., : sizes.v_head_dim]

    logits = _decoder(params, model, tokens, positions, attention, backend)
    return logits, updated
