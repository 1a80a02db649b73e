"""The shape of an MLA (multi-head latent attention) decoder, and random attention weights.

The model itself is ``serving/mla_model.py`` (run by ``serving.engine.Engine`` as a target, and
outside it by ``serving/mla_generate.py``: ``docs/mla.md``). This fixes the sizes and the weight
layout that the latent cache (``paged.mla_cache``), the MLA references (``paged.mla_reference``)
and the model take, so a model and a benchmark can share them.

- ``MLAConfig``: widths, heads, MLA ranks, RoPE, norm epsilon and dtype (hashable).
- ``deepseek_v2_lite_like``: DeepSeek-V2-Lite's attention shapes, with fewer layers.
- ``init_mla_attention_params``: random attention weights of every layer.
- ``MLAModelConfig``: a whole decoder (attention, SwiGLU MLP, vocabulary); ``MLA_TINY`` (V2-Lite's
  attention, 2 layers, hidden 256, bytes) and ``MLA_TEST`` (test sizes); ``MLA_MODELS`` by name.
- ``cache_bytes_per_token``: KV-cache bytes a token, latent or expanded per head.

One layer's attention, with ``x`` a token's hidden state (DeepSeek-V2-Lite has no query
compression, ``q_lora_rank`` None, so the query comes straight from ``x``):

    q = x @ w_q                      [H, N + P] -> q_nope [H, N], q_rope [H, P] (rotated)
    latent, k_rope = split(x @ w_dkv)   [R], [P]; latent RMSNorm'ed by latent_norm, k_rope rotated
    (cache: latent, k_rope)  -> attention with w_uk [H, R, N], w_uv [H, R, V] -> [H, V]
    out = sum_h attention[h] @ w_o[h]   [hidden]

YaRN (DeepSeek's long-context RoPE) is not modelled here: these configurations keep their
original context, so ``softmax_scale`` is the plain ``1 / sqrt(N + P)``. ``paged.rope`` has the
YaRN frequencies and ``paged.mla_reference.default_softmax_scale(..., yarn=)`` its ``mscale``
for a configuration that needs them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp

import paged
from paged.mla_reference import default_softmax_scale

DTYPES = ("float32", "bfloat16", "float16")
# DeepSeek's checkpoints pair RoPE dimensions (2i, 2i + 1).
DEEPSEEK_ROPE = paged.RopeParams(theta=10000.0, interleaved=True)


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """The attention shape of an MLA decoder (hashable: a static argument under ``jit``).

    Attributes:
      hidden: width of the residual stream.
      num_layers: decoder layers.
      num_heads: ``H``, query heads (all share one latent stream).
      kv_lora_rank: ``R``, the latent's width.
      qk_nope_head_dim: ``N``, a head's non-rotary query/key width.
      qk_rope_head_dim: ``P``, the rotary query/key width (even).
      v_head_dim: ``V``, a head's value width.
      rope: the rotary embedding of the ``P`` dimensions.
      norm_eps: the latent RMSNorm's epsilon.
      dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``: weights and cache.

    Raises:
      ValueError: naming the field, for a size below 1, an odd ``qk_rope_head_dim``, a bad
        ``norm_eps``, an unknown dtype or a ``rope`` that is not a ``paged.RopeParams``.

    Example:
      >>> config = deepseek_v2_lite_like()
      >>> config.softmax_scale == 1 / 192 ** 0.5, config.latent_bytes_per_token
      (True, 1152)
    """

    hidden: int
    num_layers: int
    num_heads: int
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope: paged.RopeParams = DEEPSEEK_ROPE
    norm_eps: float = 1e-6
    dtype: str = "bfloat16"

    def __post_init__(self):
        for name in (
            "hidden",
            "num_layers",
            "num_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}"
            )
        if not isinstance(self.rope, paged.RopeParams):
            raise ValueError(f"rope must be a paged.RopeParams, got {self.rope!r}")
        if not (
            isinstance(self.norm_eps, float) and math.isfinite(self.norm_eps) and self.norm_eps > 0
        ):
            raise ValueError(f"norm_eps must be a finite float > 0, got {self.norm_eps!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def softmax_scale(self) -> float:
        """``1 / sqrt(N + P)``: the model's, not the latent dot product's ``1 / sqrt(R + P)``."""
        return default_softmax_scale(self.qk_nope_head_dim, self.qk_rope_head_dim)

    @property
    def latent_bytes_per_token(self) -> int:
        """Latent cache bytes a token a layer: ``(R + P) * itemsize``."""
        return (self.kv_lora_rank + self.qk_rope_head_dim) * self.jnp_dtype.itemsize

    @property
    def expanded_bytes_per_token(self) -> int:
        """Bytes a token a layer of the same attention with per-head keys and values:
        ``H * (N + P + V) * itemsize`` (what MLA's latent cache saves)."""
        width = self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim
        return self.num_heads * width * self.jnp_dtype.itemsize


def deepseek_v2_lite_like(num_layers: int = 4, dtype: str = "bfloat16") -> MLAConfig:
    """DeepSeek-V2-Lite's attention shapes (random weights, for tests and benchmarks).

    Hidden 2048, 16 heads, latent 512, RoPE 64, ``qk_nope`` 128, ``v`` 128 (the checkpoint has
    27 layers; ``num_layers`` picks fewer).

    Example:
      >>> deepseek_v2_lite_like(2).expanded_bytes_per_token
      10240
    """
    return MLAConfig(hidden=2048, num_layers=num_layers, num_heads=16, dtype=dtype)


def mla_attention_param_shapes(config: MLAConfig) -> dict[str, tuple[int, ...]]:
    """The shape of each attention weight of one layer (module docstring)."""
    heads, rank = config.num_heads, config.kv_lora_rank
    return {
        "w_q": (config.hidden, heads, config.qk_nope_head_dim + config.qk_rope_head_dim),
        "w_dkv": (config.hidden, rank + config.qk_rope_head_dim),
        "latent_norm": (rank,),
        "w_uk": (heads, rank, config.qk_nope_head_dim),
        "w_uv": (heads, rank, config.v_head_dim),
        "w_o": (heads, config.v_head_dim, config.hidden),
    }


def init_mla_attention_params(config: MLAConfig, key: jax.Array) -> list[dict[str, jax.Array]]:
    """Random attention weights of every layer: the norm at 1, each matrix normal with standard
    deviation ``1 / sqrt(fan_in)`` (its contracted axis: ``hidden`` for ``w_q``, ``w_dkv``;
    ``R`` for ``w_uk``, ``w_uv``; ``H * V`` for ``w_o``), in ``config.dtype``.

    ``w_uk[h]`` is ``[R, N]``: a checkpoint's ``kv_b_proj.weight`` ``[H * (N + V), R]``, viewed
    as ``[H, N + V, R]``, holds ``w_uk[h]`` transposed in its first ``N`` rows of head ``h`` and
    ``w_uv[h]`` transposed in the next ``V``.

    Example:
      >>> config = MLAConfig(hidden=64, num_layers=1, num_heads=16)  # DeepSeek's ranks
      >>> layers = init_mla_attention_params(config, jax.random.key(0))
      >>> layers[0]["w_uk"].shape, layers[0]["w_dkv"].dtype
      ((16, 512, 128), dtype(bfloat16))
    """
    shapes = mla_attention_param_shapes(config)
    fan_in = {
        "w_q": config.hidden,
        "w_dkv": config.hidden,
        "w_uk": config.kv_lora_rank,
        "w_uv": config.kv_lora_rank,
        "w_o": config.num_heads * config.v_head_dim,
    }
    sizes = [math.prod(shapes[name]) for name in fan_in]
    layers = []
    for layer_key in jax.random.split(key, config.num_layers):
        # One draw a layer, cut into the matrices: one random-number program of one shape,
        # compiled once, instead of one a matrix shape.
        normals = jax.random.normal(layer_key, (sum(sizes),), jnp.float32)
        pieces = jnp.split(normals, list(itertools.accumulate(sizes))[:-1])
        layer = {"latent_norm": jnp.ones(shapes["latent_norm"], config.jnp_dtype)}
        for (name, size), piece in zip(fan_in.items(), pieces, strict=True):
            layer[name] = (piece.reshape(shapes[name]) / math.sqrt(size)).astype(config.jnp_dtype)
        layers.append(layer)
    return layers


# ----------------------------------------------------------------------------------------------
# The whole decoder (serving/mla_model.py)


@dataclasses.dataclass(frozen=True)
class MLAModelConfig:
    """A whole MLA decoder: its attention (``MLAConfig``), a SwiGLU MLP and a vocabulary
    (hashable: a static argument under ``jit``).

    The layer is the Llama-style one of ``serving/model.py`` with MLA in place of grouped-query
    attention: RMSNorm, MLA, residual add, RMSNorm, SwiGLU MLP, residual add; a final RMSNorm and
    an untied LM head. Every norm uses ``attention.norm_eps``; weights are ``attention.dtype``.

    Attributes:
      attention: the attention's sizes; its ``hidden`` and ``num_layers`` are the model's.
      vocab_size: tokens in the vocabulary (256: bytes, the tiny draft's vocabulary).
      intermediate: the MLP's hidden width.

    Raises:
      ValueError: naming the field, for an ``attention`` that is not an ``MLAConfig`` or a size
        below 1.

    Example:
      >>> MLA_TINY.attention.num_heads, MLA_TINY.vocab_size, MLA_TINY.num_layers
      (16, 256, 2)
    """

    attention: MLAConfig
    vocab_size: int = 256
    intermediate: int = 512

    def __post_init__(self):
        if not isinstance(self.attention, MLAConfig):
            raise ValueError(f"attention must be an MLAConfig, got {self.attention!r}")
        for name in ("vocab_size", "intermediate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    @property
    def hidden(self) -> int:
        return self.attention.hidden

    @property
    def num_layers(self) -> int:
        return self.attention.num_layers

    @property
    def norm_eps(self) -> float:
        return self.attention.norm_eps

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return self.attention.jnp_dtype


# DeepSeek-V2-Lite's attention (16 heads, latent 512, RoPE 64, qk_nope 128, v 128) in a decoder
# small enough for a CPU: hidden 256, 2 layers, byte vocabulary (the tiny draft's, so it could
# propose tokens for it). Random weights (``serving.mla_model.init_mla_model_params``).
MLA_TINY = MLAModelConfig(
    attention=MLAConfig(hidden=256, num_layers=2, num_heads=16, dtype="bfloat16"),
    vocab_size=256,
    intermediate=512,
)
# The same structure at test sizes (the widths of every weight's axes distinct, so a transposed
# weight fails a shape: w_q is [hidden, H, N + P], and hidden = N + P = 24 would hide it).
MLA_TEST = MLAModelConfig(
    attention=MLAConfig(
        hidden=28,
        num_layers=2,
        num_heads=4,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        dtype="float32",
    ),
    vocab_size=256,
    intermediate=40,
)
MLA_MODELS = {"mla-tiny": MLA_TINY, "mla-test": MLA_TEST}

# What ``cache_bytes_per_token`` measures: MLA's latent cache, or the same attention's keys and
# values expanded per head (what a grouped-query cache with one KV head a query head stores).
CACHE_LAYOUTS = ("latent", "expanded")


def cache_bytes_per_token(config: MLAConfig | MLAModelConfig, layout: str) -> int:
    """KV-cache bytes one token occupies in the whole model (every layer), in ``config.dtype``.

    - ``"latent"``: ``num_layers * (R + P) * itemsize``: a latent and a RoPE key a layer.
    - ``"expanded"``: ``num_layers * H * (N + P + V) * itemsize``: each head's key (``N``
      non-rotary values and the ``P`` RoPE values, which the latent stores once for all heads)
      and its value. (``paged.mla_reference.expand_latent_cache`` pads keys and values to one
      width, ``max(N + P, V)``, for a plain ``KVCache``: ``2 H max(N + P, V)`` values, more.)

    DeepSeek-V2-Lite (27 layers, bfloat16): latent ``27 * 576 * 2`` = 31104 bytes a token;
    expanded ``27 * 16 * 320 * 2`` = 276480 (``2 * 16 * 128`` keys and values plus
    ``16 * 64`` RoPE keys = 5120 values a layer, against 576): 8.9x.

    Raises:
      ValueError: for a config that is neither, or an unknown layout.

    Example:
      >>> cache_bytes_per_token(deepseek_v2_lite_like(1), "latent")
      1152
    """
    if isinstance(config, MLAModelConfig):
        config = config.attention
    if not isinstance(config, MLAConfig):
        raise ValueError(f"config must be an MLAConfig or MLAModelConfig, got {config!r}")
    if layout == "latent":
        per_layer = config.latent_bytes_per_token
    elif layout == "expanded":
        per_layer = config.expanded_bytes_per_token
    else:
        raise ValueError(f"layout must be one of {CACHE_LAYOUTS}, got {layout!r}")
    return config.num_layers * per_layer
