"""An MLA decoder (DeepSeek-V2-Lite-like attention): parameters, a dense forward and a paged
forward over the latent cache.

The layer is ``serving/model.py``'s Llama-style one with multi-head latent attention in place
of grouped-query attention: RMSNorm, MLA, residual add, RMSNorm, SwiGLU MLP, residual add; a
final RMSNorm and an untied LM head over ``config.vocab_size`` tokens (256 bytes for
``MLA_TINY``). Sizes: ``serving.mla_config.MLAModelConfig``. MLA of one layer, ``x`` the
normalized hidden state of a token at position ``t`` (``serving/mla_config.py``'s docstring)::

    q_nope, q_rope = split(x @ w_q)            [H, N], [H, P]; q_rope rotated by t
    latent, k_rope = split(x @ w_dkv)          [R], [P]; latent RMSNorm'ed, k_rope rotated by t
    head h: key concat(latent @ w_uk[h], k_rope), value latent @ w_uv[h]
    out = sum_h attention_h @ w_o[h]           [hidden]

Two forwards share the layer stack and differ in attention only:

- ``forward_dense_mla``: the model as written (un-absorbed: per-head keys and values from every
  latent), causal, no cache. The reference the paged path is tested against in float64.
- ``forward_paged_mla``: ``L`` new tokens per request at the end of each request's sequence in a
  page table over per-layer ``paged.LatentCache`` pools. Each layer appends the new tokens'
  normalized latents and rotated RoPE keys (``paged.append_latent``; 576 values a token at
  DeepSeek's sizes, against 5120 for the expanded keys and values), then attends: absorbed
  (``paged.mla_decode_attention``, in latent space) or un-absorbed over the gathered latents
  (``paged.mla_prefill.mla_prefill_attention_unabsorbed``). ``attention_form="auto"`` takes the
  cheaper in FLOP for the step's ``L`` (``paged.mla_prefill.unabsorbed_is_cheaper``): absorbed
  for decode and verification steps and short chunks, un-absorbed for long prefill chunks
  (from 171 tokens at DeepSeek's sizes).

Caches: a list of ``paged.LatentCache``, one per layer, one pool shape, sharing one page table.

Parameters are a dict of arrays in the config's dtype (weights ``[in, ...]``, so a projection
is ``x @ w``)::

    embed [V, hidden], final_norm [hidden], lm_head [hidden, V],
    layers: list of {attn_norm [hidden], w_q [hidden, H, N + P], w_dkv [hidden, R + P],
                     latent_norm [R], w_uk [H, R, N], w_uv [H, R, V], w_o [H, V, hidden],
                     mlp_norm [hidden], w_gate [hidden, I], w_up [hidden, I], w_down [I, hidden]}
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

import paged
from paged.mla_prefill import mla_prefill_attention_unabsorbed, unabsorbed_is_cheaper
from serving.layers import fused_add_rmsnorm, rmsnorm
from serving.mla_config import (
    MLAModelConfig,
    init_mla_attention_params,
    mla_attention_param_shapes,
)
from serving.model import _compute_dtype, _linear, _swiglu, _validate_tokens

# attention_form values of forward_paged_mla.
ATTENTION_FORMS = ("auto", "absorbed", "unabsorbed")

# ----------------------------------------------------------------------------------------------
# Parameters


def mla_model_param_shapes(config: MLAModelConfig) -> dict:
    """The parameter pytree's structure with a shape tuple at every leaf (module docstring)."""
    hidden, intermediate = config.hidden, config.intermediate
    layer = {
        "attn_norm": (hidden,),
        **mla_attention_param_shapes(config.attention),
        "mlp_norm": (hidden,),
        "w_gate": (hidden, intermediate),
        "w_up": (hidden, intermediate),
        "w_down": (intermediate, hidden),
    }
    return {
        "embed": (config.vocab_size, hidden),
        "layers": [dict(layer) for _ in range(config.num_layers)],
        "final_norm": (hidden,),
        "lm_head": (hidden, config.vocab_size),
    }


def init_mla_model_params(config: MLAModelConfig, key: jax.Array) -> dict:
    """Random parameters from a key: the attention's from ``init_mla_attention_params``; norms
    at 1; the embedding standard normal; every other matrix normal with standard deviation
    ``1 / sqrt(fan_in)``, ``w_down`` further by ``1 / sqrt(2 num_layers)`` (it writes into the
    residual stream, as ``serving.model.init_params`` scales it).

    Example:
      >>> from serving.mla_config import MLA_TEST
      >>> params = init_mla_model_params(MLA_TEST, jax.random.key(0))
      >>> params["layers"][0]["w_uk"].shape, params["lm_head"].shape
      ((4, 32, 16), (28, 256))
    """
    if not isinstance(config, MLAModelConfig):
        raise ValueError(f"config must be an MLAModelConfig, got {config!r}")
    shapes = mla_model_param_shapes(config)
    dtype = config.jnp_dtype
    attention_key, embed_key, head_key, *mlp_keys = jax.random.split(key, 3 + config.num_layers)
    attention = init_mla_attention_params(config.attention, attention_key)

    def normal(key, shape, scale):
        return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    layers = []
    residual_scale = 1.0 / math.sqrt(2 * config.num_layers)
    for attention_layer, layer_shapes, layer_key in zip(
        attention, shapes["layers"], mlp_keys, strict=True
    ):
        gate_key, up_key, down_key = jax.random.split(layer_key, 3)
        layers.append(
            {
                "attn_norm": jnp.ones(layer_shapes["attn_norm"], dtype),
                **attention_layer,
                "mlp_norm": jnp.ones(layer_shapes["mlp_norm"], dtype),
                "w_gate": normal(gate_key, layer_shapes["w_gate"], 1 / math.sqrt(config.hidden)),
                "w_up": normal(up_key, layer_shapes["w_up"], 1 / math.sqrt(config.hidden)),
                "w_down": normal(
                    down_key,
                    layer_shapes["w_down"],
                    residual_scale / math.sqrt(config.intermediate),
                ),
            }
        )
    return {
        "embed": normal(embed_key, shapes["embed"], 1.0),
        "layers": layers,
        "final_norm": jnp.ones(shapes["final_norm"], dtype),
        "lm_head": normal(head_key, shapes["lm_head"], 1 / math.sqrt(config.hidden)),
    }


def validate_mla_model_params(params, config: MLAModelConfig) -> None:
    """Checks the parameter pytree against ``config``.

    Raises:
      ValueError: naming the first parameter missing or of the wrong shape, or a wrong layer
        count.
    """
    expected = mla_model_param_shapes(config)
    if not isinstance(params, dict) or set(params) != set(expected):
        found = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(f"params must be a dict with keys {sorted(expected)}, got {found}")
    layers = params["layers"]
    if not isinstance(layers, (list, tuple)) or len(layers) != config.num_layers:
        count = len(layers) if isinstance(layers, (list, tuple)) else type(layers).__name__
        raise ValueError(
            f"params['layers'] must be a list of config.num_layers={config.num_layers} layers, "
            f"got {count}"
        )
    named = [(name, params[name], shape) for name, shape in expected.items() if name != "layers"]
    for index, (layer, shapes) in enumerate(zip(layers, expected["layers"], strict=True)):
        for name, shape in shapes.items():
            named.append((f"layers.{index}.{name}", layer.get(name), shape))
    for name, array, shape in named:
        if array is None:
            raise ValueError(f"params is missing {name!r} (shape {shape})")
        if tuple(array.shape) != shape:
            raise ValueError(
                f"params {name!r} has shape {tuple(array.shape)}, config needs {shape}"
            )


# ----------------------------------------------------------------------------------------------
# The layer stack, shared by both forwards

# attention(layer_index, layer, q_nope [B, L, H, N], q_rope [B, L, H, P] rotated,
#           latent [B, L, R] normalized, k_rope [B, L, P] rotated) -> out [B, L, H, V]
MLAAttention = Callable[..., jax.Array]


def _add_norm(x, residual, weight, eps: float, backend: str):
    """``(rmsnorm(x + residual), x + residual)``; the first layer has no residual yet."""
    if residual is None:
        return rmsnorm(x, weight, eps, backend=backend), x
    return fused_add_rmsnorm(x, residual, weight, eps, backend=backend)


def _rotate(x: jax.Array, positions: jax.Array, config: MLAModelConfig) -> jax.Array:
    """RoPE of ``x [B, L, heads, P]`` by ``positions [B, L]``, stored in x's dtype."""
    flat = x.reshape(-1, *x.shape[2:])
    rotated = paged.apply_rope(flat, positions.reshape(-1), config.attention.rope)
    return rotated.astype(x.dtype).reshape(x.shape)


def _decoder(params, config: MLAModelConfig, tokens, positions, attention: MLAAttention, backend):
    """Token ids ``[B, L]`` at ``positions [B, L]`` to float32 logits ``[B, L, V]`` (float64
    for float64 parameters), with MLA's attention plugged in."""
    sizes = config.attention
    nope, rank = sizes.qk_nope_head_dim, sizes.kv_lora_rank
    # mode="fill": an id outside the vocabulary (possible only under jit) embeds as NaN and
    # shows in its logits instead of reading a clamped row.
    x = jnp.take(params["embed"], tokens, axis=0, mode="fill", fill_value=jnp.nan)
    compute = _compute_dtype(x.dtype)
    residual = None
    for index, layer in enumerate(params["layers"]):
        normed, residual = _add_norm(x, residual, layer["attn_norm"], config.norm_eps, backend)
        q = jnp.einsum("bld,dhe->blhe", normed, layer["w_q"], preferred_element_type=compute)
        q = q.astype(x.dtype)
        compressed = _linear(normed, layer["w_dkv"])  # [B, L, R + P]
        latent = rmsnorm(
            compressed[..., :rank], layer["latent_norm"], sizes.norm_eps, backend=backend
        )
        k_rope = _rotate(compressed[..., None, rank:], positions, config)[..., 0, :]
        q_rope = _rotate(q[..., nope:], positions, config)
        out = attention(index, layer, q[..., :nope], q_rope, latent, k_rope)
        x = jnp.einsum(
            "blhv,hvd->bld", out.astype(x.dtype), layer["w_o"], preferred_element_type=compute
        ).astype(x.dtype)
        normed, residual = _add_norm(x, residual, layer["mlp_norm"], config.norm_eps, backend)
        x = _swiglu(layer, normed)
    normed, _ = _add_norm(x, residual, params["final_norm"], config.norm_eps, backend)
    return jnp.matmul(normed, params["lm_head"], preferred_element_type=compute)


def _check_config(config) -> None:
    if not isinstance(config, MLAModelConfig):
        raise ValueError(f"config must be an MLAModelConfig, got {config!r}")


# ----------------------------------------------------------------------------------------------
# Dense forward (the reference)


def dense_mla_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, *, softmax_scale: float):
    """Textbook causal MLA, un-absorbed: per-head keys and values from every latent.

    Args:
      q_nope: ``[B, T, H, N]``; q_rope: ``[B, T, H, P]`` (rotated).
      latent: ``[B, T, R]`` (normalized); k_rope: ``[B, T, P]`` (rotated).
      w_uk: ``[H, R, N]``; w_uv: ``[H, R, V]``.
      softmax_scale: the logit scale (``1 / sqrt(N + P)``).

    Returns:
      ``[B, T, H, V]`` in the compute dtype; token ``t`` sees tokens ``<= t``.
    """
    compute = _compute_dtype(jnp.result_type(q_nope.dtype, latent.dtype, w_uk.dtype))
    cast = lambda x: x.astype(compute)
    k_nope = jnp.einsum("btr,hrn->bthn", cast(latent), cast(w_uk), precision="highest")
    values = jnp.einsum("btr,hrv->bthv", cast(latent), cast(w_uv), precision="highest")
    logits = jnp.einsum("bqhn,bthn->bhqt", cast(q_nope), k_nope, precision="highest")
    logits += jnp.einsum("bqhp,btp->bhqt", cast(q_rope), cast(k_rope), precision="highest")
    length = latent.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))  # [query, key]
    weights = jax.nn.softmax(jnp.where(causal, softmax_scale * logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhqt,bthv->bqhv", weights, values, precision="highest")


def forward_dense_mla(
    params, config: MLAModelConfig, tokens: jax.Array, *, backend: str = "auto"
) -> jax.Array:
    """Logits of every position of ``tokens``, un-absorbed causal MLA, no cache.

    Token ``t`` of a row sits at position ``t``. The reference ``forward_paged_mla`` is tested
    against (float64 parameters with x64 on give float64 logits).

    Args:
      params: ``init_mla_model_params``'s dict.
      config: the model (static under ``jit``).
      tokens: int ``[B, T]`` token ids in ``[0, V)``.
      backend: for the norms (``serving.layers``).

    Returns:
      float32 ``[B, T, V]`` logits (float64 for float64 parameters).

    Raises:
      ValueError: for tokens not ``[B, T]`` integers, an id outside the vocabulary (concrete
        tokens), or parameters unlike ``config``.

    Example:
      >>> from serving.mla_config import MLA_TEST
      >>> params = init_mla_model_params(MLA_TEST, jax.random.key(0))
      >>> forward_dense_mla(params, MLA_TEST, jnp.array([[104, 105]])).shape
      (1, 2, 256)
    """
    _check_config(config)
    _validate_tokens(tokens, config)
    validate_mla_model_params(params, config)
    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))

    def attention(index, layer, q_nope, q_rope, latent, k_rope):
        del index
        return dense_mla_attention(
            q_nope,
            q_rope,
            latent,
            k_rope,
            layer["w_uk"],
            layer["w_uv"],
            softmax_scale=config.attention.softmax_scale,
        )

    return _decoder(params, config, tokens, positions, attention, backend)


# ----------------------------------------------------------------------------------------------
# Paged forward over the latent cache


def new_mla_caches(
    config: MLAModelConfig, num_pages: int, page_size: int, dtype=None
) -> list[paged.LatentCache]:
    """One all-zero ``paged.LatentCache`` per layer (``dtype`` default: the config's).

    Example:
      >>> from serving.mla_config import MLA_TINY
      >>> caches = new_mla_caches(MLA_TINY, num_pages=4, page_size=16)
      >>> len(caches), caches[0].latent_pages.shape, caches[0].bytes_per_token
      (2, (4, 16, 512), 1152)
    """
    _check_config(config)
    sizes = config.attention
    return [
        paged.new_latent_cache(
            num_pages,
            page_size,
            sizes.kv_lora_rank,
            sizes.qk_rope_head_dim,
            config.jnp_dtype if dtype is None else dtype,
        )
        for _ in range(config.num_layers)
    ]


def _validate_caches(caches, config: MLAModelConfig, params, page_table) -> None:
    if not isinstance(caches, (list, tuple)) or len(caches) != config.num_layers:
        count = len(caches) if isinstance(caches, (list, tuple)) else type(caches).__name__
        raise ValueError(
            f"caches must be a list of config.num_layers={config.num_layers} LatentCache, "
            f"got {count}"
        )
    sizes = config.attention
    # The parameters' dtype, not config.dtype: float64 parameters and caches are the tests'.
    expected = (sizes.kv_lora_rank, sizes.qk_rope_head_dim, jnp.dtype(params["embed"].dtype))
    for index, cache in enumerate(caches):
        if not isinstance(cache, paged.LatentCache):
            raise ValueError(
                f"caches[{index}] must be a paged.LatentCache, got {type(cache).__name__}"
            )
        found = (cache.kv_lora_rank, cache.qk_rope_head_dim, jnp.dtype(cache.dtype))
        if found != expected:
            raise ValueError(
                f"caches[{index}] has (kv_lora_rank, qk_rope_head_dim, dtype)={found}, the "
                f"config and parameters need {expected}"
            )
        if cache.latent_pages.shape != caches[0].latent_pages.shape:
            raise ValueError(
                f"caches[{index}] has pages of shape {cache.latent_pages.shape} but caches[0] "
                f"has {caches[0].latent_pages.shape}: every layer shares one page table, so one "
                "pool shape"
            )
    if page_table.page_size != caches[0].page_size:
        raise ValueError(
            f"page_table.page_size={page_table.page_size} differs from the caches' "
            f"page_size={caches[0].page_size}"
        )


def choose_attention_form(attention_form: str, config: MLAModelConfig, q_len: int) -> str:
    """``"absorbed"`` or ``"unabsorbed"`` for a step of ``q_len`` new tokens a request:
    ``attention_form`` itself unless it is ``"auto"``, then the form of fewer FLOP
    (``paged.mla_prefill.unabsorbed_is_cheaper``).

    Raises:
      ValueError: for an unknown ``attention_form``.

    Example:
      >>> from serving.mla_config import MLA_TINY
      >>> choose_attention_form("auto", MLA_TINY, 1), choose_attention_form("auto", MLA_TINY, 256)
      ('absorbed', 'unabsorbed')
    """
    if attention_form not in ATTENTION_FORMS:
        raise ValueError(f"attention_form must be one of {ATTENTION_FORMS}, got {attention_form!r}")
    if attention_form != "auto":
        return attention_form
    sizes = config.attention
    cheaper = unabsorbed_is_cheaper(
        q_len,
        sizes.kv_lora_rank,
        sizes.qk_nope_head_dim,
        sizes.qk_rope_head_dim,
        sizes.v_head_dim,
    )
    return "unabsorbed" if cheaper else "absorbed"


def forward_paged_mla(
    params,
    config: MLAModelConfig,
    tokens: jax.Array,
    caches: list[paged.LatentCache],
    page_table: paged.PageTable,
    *,
    attention_form: str = "auto",
    plan: paged.DecodePlan | None = None,
    backend: str = "auto",
) -> tuple[jax.Array, list[paged.LatentCache]]:
    """Runs ``L`` new tokens per request through the model over the paged latent cache.

    The page table already covers the new tokens: token ``l`` of request ``b`` sits at position
    ``seq_len[b] - L + l``. Every layer appends the new tokens' normalized latents and rotated
    RoPE keys into its pool (``paged.append_latent``), then attends causally over the request's
    tokens up to each new token's own position: absorbed (``paged.mla_decode_attention``) or
    un-absorbed over the gathered latents (``mla_prefill_attention_unabsorbed``), as
    ``attention_form`` says (``choose_attention_form``). ``L = 1`` is a decode step; ``L > 1``
    a prefill chunk (``paged.prefill_chunks`` cuts a prompt into them) or the verification of
    ``L - 1`` drafted tokens. Jit it once for a step (``config``, ``attention_form``,
    ``backend`` static; donate ``caches``).

    Args:
      params: ``init_mla_model_params``'s dict.
      config: the model.
      tokens: int ``[B, L]`` new token ids, ``L >= 1``.
      caches: one ``paged.LatentCache`` per layer (``new_mla_caches``), one pool shape, the
        parameters' dtype, the config's ``kv_lora_rank`` and ``qk_rope_head_dim``.
      page_table: ``B`` requests, each of at least ``L`` tokens, new ones included.
      attention_form: ``"auto"``, ``"absorbed"`` or ``"unabsorbed"``.
      plan: for the absorbed form's Mosaic GPU kernel (``paged.mla_decode_attention``).
      backend: ``"auto"``, ``"reference"`` or ``"pallas"``: the norms' backend, and the
        absorbed attention's (``"pallas"`` is its Mosaic GPU kernel; ``"auto"`` is its
        reference until that kernel is measured on the H200).

    Returns:
      ``(logits, caches)``: float32 ``[B, L, V]`` (float64 for float64 parameters), and the
      caches with the new tokens appended.

    Raises:
      ValueError: naming the argument and the value, for tokens not ``[B, L]`` integers, a
        batch unlike the table's, caches unlike the config and parameters (count, widths,
        dtype, pool shape, page size), parameters unlike the config, an unknown
        ``attention_form``, and with concrete inputs an id outside the vocabulary or a request
        shorter than ``L``; plus what the paged ops refuse.

    Example:
      >>> from serving.mla_config import MLA_TEST
      >>> params = init_mla_model_params(MLA_TEST, jax.random.key(0))
      >>> caches = new_mla_caches(MLA_TEST, num_pages=4, page_size=8)
      >>> table = paged.PageTable.from_seq_lens([3], page_size=8)
      >>> logits, caches = forward_paged_mla(
      ...     params, MLA_TEST, jnp.array([[10, 11, 12]]), caches, table, backend="reference"
      ... )
      >>> logits.shape
      (1, 3, 256)
    """
    _check_config(config)
    _validate_tokens(tokens, config)
    validate_mla_model_params(params, config)
    _validate_caches(caches, config, params, page_table)
    batch, length = tokens.shape
    form = choose_attention_form(attention_form, config, length)
    if page_table.batch_size != batch:
        raise ValueError(
            f"tokens has {batch} requests but page_table describes {page_table.batch_size}"
        )
    paged.check_holds_new_tokens(page_table, length, f"L={length} new ones")
    positions = paged.new_token_positions(page_table, length)  # [B, L]
    batch_indices = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), length)
    scale = config.attention.softmax_scale
    updated = []

    def attention(index, layer, q_nope, q_rope, latent, k_rope):
        cache = paged.append_latent(
            caches[index],
            page_table,
            latent.reshape(batch * length, -1),
            k_rope.reshape(batch * length, -1),  # rotated already (rope=None)
            batch_indices,
            positions.reshape(-1),
        )
        updated.append(cache)
        w_uk, w_uv = layer["w_uk"], layer["w_uv"]
        if form == "unabsorbed":
            return mla_prefill_attention_unabsorbed(
                q_nope, q_rope, cache, page_table, w_uk, w_uv, softmax_scale=scale
            )
        return paged.mla_decode_attention(
            q_nope,
            q_rope,
            cache,
            page_table,
            w_uk,
            w_uv,
            softmax_scale=scale,
            plan=plan,
            backend=backend,
        )

    logits = _decoder(params, config, tokens, positions, attention, backend)
    return logits, updated
