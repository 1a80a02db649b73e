"""A Llama-style decoder: configuration, parameters, a dense forward and a paged forward.

The architecture (Llama 2/3): token embedding; per layer, RMSNorm, grouped-query attention with
rotary embeddings, residual add, RMSNorm, SwiGLU MLP, residual add; a final RMSNorm and an
untied output projection. The residual adds are folded into the next norm
(``serving.layers.fused_add_rmsnorm``), as serving engines do.

Two forwards share every line of the layer stack and differ only in attention:

- ``forward_dense``: plain causal attention over the tokens given, no cache. For training, and the
  reference the paged path is tested against.
- ``forward_paged``: ``L`` new tokens per request at the end of each request's sequence in a page
  table. Each layer rotates q and k and writes k and v into its pages (``paged.rope_append_kv``),
  then attends over the pages (``paged.decode_attention``). ``L = 1`` is a decode step;
  ``L > 1`` is a prefill chunk or the verification of ``L - 1`` drafted tokens.
- ``prefill``: a prompt through ``forward_paged`` chunk by chunk (``paged.prefill_chunks``).

KV caches: a Python list of ``paged.KVCache``, one per layer, all with the same pool shape and
sharing one page table (a page index means the same page in every layer). A list keeps each
layer's pool a separate buffer, so a jitted step that donates the list updates every pool in
place.

Parameters are a dict (a pytree) of arrays in ``config.dtype``; weights are stored
``[in, out]`` so that a projection is ``x @ w``::

    embed [V, hidden], final_norm [hidden], lm_head [hidden, V],
    layers: list of {attn_norm [hidden], wq [hidden, Hq * D], wk [hidden, Hkv * D],
                     wv [hidden, Hkv * D], wo [Hq * D, hidden], mlp_norm [hidden],
                     w_gate [hidden, I], w_up [hidden, I], w_down [I, hidden]}

Weight files (``save_model`` / ``load_model``): ``NAME.npz`` holds the arrays under flat names
(``layers.0.wq``), bfloat16 stored as its raw uint16 bits (NumPy has no bfloat16);
``NAME.json`` holds the configuration, the storage dtype and whatever the trainer recorded.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import paged
from kernels_pallas.platform import is_concrete
from serving.layers import fused_add_rmsnorm, rmsnorm

DTYPES = ("float32", "bfloat16", "float16")
STORAGE_DTYPES = ("float32", "bfloat16")
DEFAULT_ROPE = paged.RopeParams()  # Llama 2's: theta 10000, rotate-half, no scaling


# ----------------------------------------------------------------------------------------------
# Configuration


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-style decoder (hashable: a static argument under ``jit``).

    Attributes:
      vocab_size: ``V``, tokens in the vocabulary.
      hidden: width of the residual stream.
      num_layers: decoder layers.
      num_q_heads: ``Hq``, query heads.
      num_kv_heads: ``Hkv``, key/value heads; divides ``Hq`` (grouped-query attention).
      head_dim: ``D``, even (RoPE rotates pairs); a power of two for the Pallas decode kernel.
      intermediate: ``I``, width of the SwiGLU MLP.
      rope: the rotary embedding (theta, pairing convention, Llama 3.1 scaling).
      norm_eps: RMSNorm's epsilon.
      dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``: parameters, activations, KV cache.

    Raises:
      ValueError: naming the field, for a non-positive size, ``Hq`` not a multiple of ``Hkv``,
        an odd ``head_dim``, a non-positive ``norm_eps``, an unknown dtype or a ``rope`` that is
        not a ``paged.RopeParams``.

    Example:
      >>> config = ModelConfig(vocab_size=256, hidden=64, num_layers=2, num_q_heads=4,
      ...                      num_kv_heads=2, head_dim=16, intermediate=128)
      >>> config.group_size, config.jnp_dtype
      (2, dtype('float32'))
    """

    vocab_size: int
    hidden: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    rope: paged.RopeParams = DEFAULT_ROPE
    norm_eps: float = 1e-5
    dtype: str = "float32"

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden",
            "num_layers",
            "num_q_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if not isinstance(self.rope, paged.RopeParams):
            raise ValueError(f"rope must be a paged.RopeParams, got {self.rope!r}")
        if not (isinstance(self.norm_eps, float) and math.isfinite(self.norm_eps)):
            raise ValueError(f"norm_eps must be a finite float, got {self.norm_eps!r}")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    def to_dict(self) -> dict:
        """A JSON-ready dict (``from_dict`` inverts it)."""
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(fields: dict) -> ModelConfig:
        """The configuration ``to_dict`` wrote.

        Raises:
          ValueError: for missing or unknown fields, and anything ``ModelConfig`` rejects.
        """
        fields = dict(fields)
        names = {field.name for field in dataclasses.fields(ModelConfig)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}")
        rope = dict(fields.get("rope") or {})
        if rope.get("scaling") is not None:
            rope["scaling"] = paged.Llama3Scaling(**rope["scaling"])
        fields["rope"] = paged.RopeParams(**rope)
        try:
            return ModelConfig(**fields)
        except TypeError as error:  # a missing field
            raise ValueError(f"incomplete ModelConfig fields {sorted(fields)}: {error}") from None


# The byte-level pair trained by ``serving/train_tiny.py`` (weights in ``serving/weights/``).
# head_dim and, later, the page size are powers of two: the Pallas decode kernel needs them.
TINY_TARGET = ModelConfig(
    vocab_size=256,
    hidden=256,
    num_layers=4,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate=512,
)
TINY_DRAFT = ModelConfig(
    vocab_size=256,
    hidden=128,
    num_layers=2,
    num_q_heads=2,
    num_kv_heads=1,
    head_dim=64,
    intermediate=256,
)


def llama3_8b_like(num_layers: int = 32, dtype: str = "bfloat16") -> ModelConfig:
    """Llama 3 8B's layer shapes (random weights, for benchmarks), with ``num_layers`` layers.

    Hidden 4096, 32 query heads, 8 KV heads, head_dim 128, MLP 14336, vocabulary 128256, RoPE
    theta 500000 with Llama 3.1's frequency scaling.

    Example:
      >>> llama3_8b_like(2).intermediate
      14336
    """
    return ModelConfig(
        vocab_size=128256,
        hidden=4096,
        num_layers=num_layers,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate=14336,
        rope=paged.RopeParams(theta=500000.0, scaling=paged.Llama3Scaling()),
        norm_eps=1e-5,
        dtype=dtype,
    )


# ----------------------------------------------------------------------------------------------
# Parameters


def param_shapes(config: ModelConfig) -> dict:
    """The parameter pytree's structure with a shape tuple at every leaf."""
    hidden, q_width = config.hidden, config.num_q_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    layer = {
        "attn_norm": (hidden,),
        "wq": (hidden, q_width),
        "wk": (hidden, kv_width),
        "wv": (hidden, kv_width),
        "wo": (q_width, hidden),
        "mlp_norm": (hidden,),
        "w_gate": (hidden, config.intermediate),
        "w_up": (hidden, config.intermediate),
        "w_down": (config.intermediate, hidden),
    }
    return {
        "embed": (config.vocab_size, hidden),
        "layers": [dict(layer) for _ in range(config.num_layers)],
        "final_norm": (hidden,),
        "lm_head": (hidden, config.vocab_size),
    }


def _is_shape(node) -> bool:
    return isinstance(node, tuple) and all(isinstance(size, int) for size in node)


def init_params(config: ModelConfig, key: jax.Array) -> dict:
    """Random parameters: norms at 1, every matrix normal with a fan-in scale.

    A projection ``[n_in, n_out]`` has standard deviation ``1 / sqrt(n_in)``, so activations keep
    their size through it; the two that write into the residual stream (``wo``, ``w_down``) are
    further scaled by ``1 / sqrt(2 num_layers)`` so that the stream's variance stays bounded as
    layers add to it (GPT-2's rule). Embeddings are standard normal (the first norm rescales).

    Args:
      config: the model.
      key: a ``jax.random`` key.

    Returns:
      The parameter dict (module docstring) in ``config.dtype``.

    Example:
      >>> params = init_params(TINY_DRAFT, jax.random.key(0))
      >>> params["layers"][0]["wk"].shape, param_count(params)
      ((128, 64), 361088)
    """
    shapes = param_shapes(config)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=_is_shape)
    paths = [
        jax.tree_util.keystr(path)
        for path, _ in jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)[0]
    ]
    keys = jax.random.split(key, len(leaves))
    residual_scale = 1.0 / math.sqrt(2 * config.num_layers)
    values = []
    for path, shape, leaf_key in zip(paths, leaves, keys, strict=True):
        if len(shape) == 1:  # a norm's weight
            values.append(jnp.ones(shape, config.jnp_dtype))
            continue
        scale = 1.0 if "embed" in path else 1.0 / math.sqrt(shape[0])
        if "'wo'" in path or "'w_down'" in path:
            scale *= residual_scale
        values.append((scale * jax.random.normal(leaf_key, shape)).astype(config.jnp_dtype))
    return jax.tree.unflatten(treedef, values)


def param_count(params) -> int:
    """Number of scalars in a parameter pytree."""
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params))


def validate_params(params, config: ModelConfig) -> None:
    """Checks the parameter pytree's structure and every array's shape against ``config``.

    Raises:
      ValueError: naming the first parameter whose structure or shape differs.
    """
    expected = param_shapes(config)
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
    for name, shape in _flat_items(expected):
        array = _lookup(params, name)
        if array is None:
            raise ValueError(f"params is missing {name!r} (shape {shape})")
        if tuple(array.shape) != shape:
            raise ValueError(
                f"params {name!r} has shape {tuple(array.shape)}, config needs {shape}"
            )


def _flat_items(tree) -> list[tuple[str, object]]:
    """``[("layers.0.wq", leaf), ...]``: flat names for weight files and error messages."""
    items = []
    for name, node in tree.items():
        if name == "layers":
            for index, layer in enumerate(node):
                items += [(f"layers.{index}.{key}", value) for key, value in layer.items()]
        else:
            items.append((name, node))
    return items


def _lookup(params, flat_name: str):
    parts = flat_name.split(".")
    node = params
    try:
        for part in parts:
            node = node[int(part)] if part.isdigit() else node[part]
    except (KeyError, IndexError, TypeError):
        return None
    return node


# ----------------------------------------------------------------------------------------------
# The layer stack, shared by both forwards


def _compute_dtype(dtype) -> jnp.dtype:
    """float32, or float64 for float64 inputs (the tests' float64 oracle)."""
    return jnp.promote_types(dtype, jnp.float32)


def _linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    """``x @ weight`` accumulated in float32 (bfloat16 sums of thousands of terms drift), stored
    in x's dtype."""
    return jnp.matmul(x, weight, preferred_element_type=_compute_dtype(x.dtype)).astype(x.dtype)


def _add_norm(x, residual, weight, config: ModelConfig, backend: str):
    """``(rmsnorm(x + residual), x + residual)``; the first layer has no residual yet."""
    if residual is None:
        return rmsnorm(x, weight, config.norm_eps, backend=backend), x
    return fused_add_rmsnorm(x, residual, weight, config.norm_eps, backend=backend)


def _swiglu(layer: dict, x: jax.Array) -> jax.Array:
    """``w_down(silu(w_gate x) * w_up x)``, the gate's nonlinearity in float32."""
    gate = _linear(x, layer["w_gate"]).astype(_compute_dtype(x.dtype))
    up = _linear(x, layer["w_up"]).astype(_compute_dtype(x.dtype))
    return _linear((jax.nn.silu(gate) * up).astype(x.dtype), layer["w_down"])


# attention(layer_index, q [B, L, Hq, D], k [B, L, Hkv, D], v [B, L, Hkv, D]) -> o [B, L, Hq, D];
# q and k arrive unrotated: where the rotation happens is the attention's business.
Attention = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


def _decoder(params, config: ModelConfig, tokens, attention: Attention, backend: str):
    """The model from token ids to float32 logits ``[B, L, V]`` (float64 for float64
    parameters), with attention plugged in."""
    batch, length = tokens.shape
    # mode="fill": an id outside the vocabulary (possible only under jit, where ids cannot be
    # checked) embeds as NaN and shows up in its logits instead of silently reading a clamped row.
    x = jnp.take(params["embed"], tokens, axis=0, mode="fill", fill_value=jnp.nan)
    residual = None
    for index, layer in enumerate(params["layers"]):
        normed, residual = _add_norm(x, residual, layer["attn_norm"], config, backend)
        q = _linear(normed, layer["wq"]).reshape(batch, length, config.num_q_heads, -1)
        k = _linear(normed, layer["wk"]).reshape(batch, length, config.num_kv_heads, -1)
        v = _linear(normed, layer["wv"]).reshape(batch, length, config.num_kv_heads, -1)
        o = attention(index, q, k, v)
        x = _linear(o.reshape(batch, length, -1), layer["wo"])
        normed, residual = _add_norm(x, residual, layer["mlp_norm"], config, backend)
        x = _swiglu(layer, normed)
    normed, _ = _add_norm(x, residual, params["final_norm"], config, backend)
    return jnp.matmul(normed, params["lm_head"], preferred_element_type=_compute_dtype(x.dtype))


def _validate_tokens(tokens, config: ModelConfig) -> None:
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have shape [batch, length], got {tokens.shape}")
    if tokens.shape[1] < 1:
        raise ValueError(f"tokens must hold at least one token per request, got {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
    if not is_concrete(tokens):
        return
    ids = np.asarray(tokens)
    bad = (ids < 0) | (ids >= config.vocab_size)
    if np.any(bad):
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"tokens{list(where)}={ids[where]} is outside the vocabulary [0, {config.vocab_size})"
        )


# ----------------------------------------------------------------------------------------------
# Dense forward (training, parity reference)


def dense_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Textbook causal grouped-query attention in float32, every score materialized.

    Args:
      q: ``[B, T, Hq, D]`` (rotated).
      k, v: ``[B, T, Hkv, D]`` (k rotated); query head ``h`` uses KV head ``h // (Hq / Hkv)``.

    Returns:
      ``[B, T, Hq, D]`` in q's dtype; scale ``1 / sqrt(D)``; token ``t`` sees tokens ``<= t``.
    """
    batch, length, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_q_heads // num_kv_heads
    compute = _compute_dtype(q.dtype)
    q_grouped = q.astype(compute).reshape(batch, length, num_kv_heads, group, head_dim)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q_grouped, k.astype(compute)) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((length, length), bool))  # [query, key]
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    o = jnp.einsum("bkgqs,bskd->bqkgd", weights, v.astype(compute))
    return o.reshape(q.shape).astype(q.dtype)


def forward_dense(params, config: ModelConfig, tokens: jax.Array, *, backend: str = "auto"):
    """Logits of every position of ``tokens``, with plain causal attention and no cache.

    Token ``t`` of a row sits at position ``t``. For training (differentiable with
    ``backend="reference"``) and as the reference ``forward_paged`` is tested against.

    Args:
      params: the parameter dict (``init_params``, ``load_model``).
      config: the model (static under ``jit``).
      tokens: int ``[B, T]`` token ids in ``[0, V)``.
      backend: for the norms (``serving.layers``); attention here is always the dense reference.

    Returns:
      float32 ``[B, T, V]`` logits (float64 with float64 parameters, for tests with x64 on).

    Raises:
      ValueError: for tokens not ``[B, T]`` integers, a token id outside the vocabulary
        (concrete tokens), or parameters whose shapes do not match ``config``.

    Example:
      >>> params = init_params(TINY_DRAFT, jax.random.key(0))
      >>> forward_dense(params, TINY_DRAFT, jnp.array([[104, 105]])).shape
      (1, 2, 256)
    """
    _validate_tokens(tokens, config)
    validate_params(params, config)
    batch, length = tokens.shape
    positions = jnp.tile(jnp.arange(length, dtype=jnp.int32), batch)  # [B * T], row-major

    def attention(index, q, k, v):
        del index  # every layer is the same function of its inputs

        def rotate(x):
            flat = x.reshape(batch * length, *x.shape[2:])
            return paged.apply_rope(flat, positions, config.rope).astype(x.dtype).reshape(x.shape)

        return dense_causal_attention(rotate(q), rotate(k), v)

    return _decoder(params, config, tokens, attention, backend)


# ----------------------------------------------------------------------------------------------
# Paged forward (prefill chunks, decode steps, verification)


def new_caches(
    config: ModelConfig, num_pages: int, page_size: int, layout: str = "HND"
) -> list[paged.KVCache]:
    """One all-zero ``paged.KVCache`` per layer, each ``num_pages`` pages of ``page_size``.

    Example:
      >>> caches = new_caches(TINY_DRAFT, num_pages=8, page_size=16)
      >>> len(caches), caches[0].k_pages.shape
      (2, (8, 1, 16, 64))
    """
    return [
        paged.new_kv_cache(
            num_pages, page_size, config.num_kv_heads, config.head_dim, config.jnp_dtype, layout
        )
        for _ in range(config.num_layers)
    ]


def _validate_caches(caches, config: ModelConfig, page_table: paged.PageTable) -> None:
    if not isinstance(caches, (list, tuple)) or len(caches) != config.num_layers:
        count = len(caches) if isinstance(caches, (list, tuple)) else type(caches).__name__
        raise ValueError(
            f"caches must be a list of config.num_layers={config.num_layers} KVCache, got {count}"
        )
    expected = (config.num_kv_heads, config.head_dim, config.jnp_dtype)
    shape = caches[0].k_pages.shape if isinstance(caches[0], paged.KVCache) else None
    for index, cache in enumerate(caches):
        if not isinstance(cache, paged.KVCache):
            raise ValueError(f"caches[{index}] must be a paged.KVCache, got {type(cache).__name__}")
        found = (cache.num_kv_heads, cache.head_dim, cache.dtype)
        if found != expected:
            raise ValueError(
                f"caches[{index}] has (num_kv_heads, head_dim, dtype)={found}, config needs "
                f"{expected}"
            )
        if cache.k_pages.shape != shape:
            raise ValueError(
                f"caches[{index}] has pages of shape {cache.k_pages.shape} but caches[0] has "
                f"{shape}: every layer shares one page table, so one pool shape"
            )
    if page_table.page_size != caches[0].page_size:
        raise ValueError(
            f"page_table.page_size={page_table.page_size} differs from the caches' "
            f"page_size={caches[0].page_size}"
        )


def forward_paged(
    params,
    config: ModelConfig,
    tokens: jax.Array,
    caches: list[paged.KVCache],
    page_table: paged.PageTable,
    *,
    plan: paged.DecodePlan | None = None,
    backend: str = "auto",
) -> tuple[jax.Array, list[paged.KVCache]]:
    """Runs ``L`` new tokens per request through the model over the paged KV cache.

    The page table already covers the new tokens: token ``l`` of request ``b`` sits at position
    ``seq_len[b] - L + l``. Every layer rotates the new q and k, writes k and v into the layer's
    pages (``paged.rope_append_kv``) and attends causally over the request's keys up to and
    including its own position (``paged.decode_attention``; a ``[B, H, D]`` query for ``L = 1``,
    ``[B, L, H, D]`` otherwise). Jit it once for a whole step (``config`` and ``backend``
    static; donate ``caches`` to update the pools in place). The backend is chosen when traced.

    Args:
      params: the parameter dict.
      config: the model.
      tokens: int ``[B, L]`` new token ids, ``L >= 1``.
      caches: one ``paged.KVCache`` per layer (``new_caches``), pools of one shape, dtype
        ``config.dtype``.
      page_table: ``B`` requests, each of length at least ``L``, new tokens included.
      plan: the step's ``paged.plan_decode`` plan, shared by every layer (Pallas attention).
      backend: ``"auto"``, ``"reference"`` or ``"pallas"``, passed to every op (norms, RoPE +
        append, attention).

    Returns:
      ``(logits, caches)``: float32 ``[B, L, V]``, and the caches with the new keys and values.

    Raises:
      ValueError: naming the argument, for tokens not ``[B, L]`` integers, a batch unlike the
        table's, caches unlike the config (count, heads, head_dim, dtype, pool shape, page
        size), parameters unlike the config, and with concrete inputs a token id outside the
        vocabulary or a request shorter than ``L``; plus whatever the paged ops reject (page
        indices outside the pool, ...). Under ``jit`` an out-of-vocabulary id gives NaN logits
        for its request.

    Example:
      >>> params = init_params(TINY_DRAFT, jax.random.key(0))
      >>> caches = new_caches(TINY_DRAFT, num_pages=4, page_size=16)
      >>> table = paged.PageTable.from_seq_lens([3], page_size=16)
      >>> logits, caches = forward_paged(params, TINY_DRAFT, jnp.array([[10, 11, 12]]), caches,
      ...                                table, backend="reference")
      >>> logits.shape
      (1, 3, 256)
    """
    _validate_tokens(tokens, config)
    validate_params(params, config)
    _validate_caches(caches, config, page_table)
    batch, length = tokens.shape
    if page_table.batch_size != batch:
        raise ValueError(
            f"tokens has {batch} requests but page_table describes {page_table.batch_size}"
        )
    paged.check_holds_new_tokens(page_table, length, f"L={length} new ones")
    positions = paged.new_token_positions(page_table, length).reshape(-1)  # [B * L], row-major
    batch_indices = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), length)
    new_caches_list = []

    def attention(index, q, k, v):
        flat = lambda x: x.reshape(batch * length, *x.shape[2:])
        q_rotated, cache = paged.rope_append_kv(
            flat(q),
            flat(k),
            flat(v),
            positions,
            batch_indices,
            caches[index],
            page_table,
            rope=config.rope,
            backend=backend,
        )
        new_caches_list.append(cache)
        # One new token keeps decode's [B, H, D] query (the single-token kernel path).
        q_rotated = q_rotated.reshape(q.shape if length > 1 else (batch, *q.shape[2:]))
        o = paged.decode_attention(q_rotated, cache, page_table, plan=plan, backend=backend)
        return o.reshape(q.shape)

    logits = _decoder(params, config, tokens, attention, backend)
    return logits, new_caches_list


# One program per (config, backend, shapes); the caches are donated so that a jitted chunk
# writes its keys and values into the pools in place rather than copying every pool.
_forward_paged_jit = jax.jit(
    forward_paged, static_argnames=("config", "backend"), donate_argnames=("caches",)
)
# jit copies forward_paged's docstring; doctest would run its example a second time.
_forward_paged_jit.__doc__ = "``forward_paged``, jitted, caches donated (used by ``prefill``)."


def prefill(
    params,
    config: ModelConfig,
    tokens: jax.Array,
    caches: list[paged.KVCache],
    page_table: paged.PageTable,
    *,
    chunk_size: int,
    all_logits: bool = False,
    backend: str = "auto",
) -> tuple[jax.Array, list[paged.KVCache]]:
    """Runs prompts of ``T`` tokens into the paged cache, ``chunk_size`` tokens at a time.

    Each chunk is one jitted ``forward_paged`` over a table that covers the requests up to the
    chunk's end (``paged.prefill_chunks``): its keys and values are appended before its
    attention, and attention scores exist for one chunk at a time (``chunk_size`` queries
    against the table's slots), so a 32K prompt never builds a 32K x 32K score matrix. Chunks of
    one length share one compiled program (the tables keep one static size); a shorter last
    chunk compiles once more.

    Tokens already in the table before the prompt (a shared prefix in read-only pages) are
    attended to and left untouched. Requests of a batch share ``T``; prompts of different
    lengths are prefilled as separate calls, the pool shared.

    Args:
      params, config: the model.
      tokens: int ``[B, T]``, the prompts.
      caches: one ``paged.KVCache`` per layer. They are donated: use the returned ones.
      page_table: concrete table of the requests after the prompt (it covers all ``T`` tokens).
      chunk_size: tokens per chunk, ``>= 1``.
      all_logits: return the logits of every prompt position, not only the last.
      backend: passed to every op. ``paged.decode_attention`` runs chunks of more than
        ``paged.decode.MAX_KERNEL_Q_LEN`` tokens on its causal prefill kernel and shorter ones
        on its decode kernel (``paged.decode.kernel_name_for``).

    Returns:
      ``(logits, caches)``: float32 ``[B, V]`` logits of each prompt's last token (``[B, T, V]``
      with ``all_logits``), and the filled caches.

    Raises:
      ValueError: for a traced table, a ``chunk_size`` below 1, and everything
        ``forward_paged`` rejects.

    Example:
      >>> params = init_params(TINY_DRAFT, jax.random.key(0))
      >>> caches = new_caches(TINY_DRAFT, num_pages=4, page_size=16)
      >>> table = paged.PageTable.from_seq_lens([20], page_size=16)
      >>> prompt = jnp.arange(20).reshape(1, 20)
      >>> logits, caches = prefill(params, TINY_DRAFT, prompt, caches, table, chunk_size=8,
      ...                          backend="reference")
      >>> logits.shape
      (1, 256)
    """
    _validate_tokens(tokens, config)
    _validate_caches(caches, config, page_table)
    # The chunks run under jit, where the table's values cannot be checked: check them here.
    paged.validate_page_table(page_table, caches[0].num_pages, batch_size=tokens.shape[0])
    kept = []
    for chunk in paged.prefill_chunks(page_table, tokens.shape[1], chunk_size):
        logits, caches = _forward_paged_jit(
            params,
            config,
            tokens[:, chunk.start : chunk.stop],
            caches,
            chunk.page_table,
            backend=backend,
        )
        kept.append(logits if all_logits else logits[:, -1])
    return (jnp.concatenate(kept, axis=1) if all_logits else kept[-1]), caches


# ----------------------------------------------------------------------------------------------
# Weight files


def _stem(path) -> pathlib.Path:
    path = pathlib.Path(path)
    return path.with_suffix("") if path.suffix in (".npz", ".json") else path


def save_model(
    path, config: ModelConfig, params, *, storage: str = "bfloat16", metadata=None
) -> tuple[pathlib.Path, pathlib.Path]:
    """Writes ``PATH.npz`` (the arrays) and ``PATH.json`` (config, storage dtype, metadata).

    Args:
      path: the files' common stem (a ``.npz`` or ``.json`` suffix is dropped).
      config: the model.
      params: its parameters.
      storage: ``"bfloat16"`` (raw uint16 bits: half the bytes) or ``"float32"``.
      metadata: anything JSON-serializable to record beside the config (training details).

    Returns:
      The two paths written.
    """
    if storage not in STORAGE_DTYPES:
        raise ValueError(f"storage must be one of {STORAGE_DTYPES}, got {storage!r}")
    validate_params(params, config)
    stem = _stem(path)
    arrays = {}
    for name, array in _flat_items(params):
        values = np.asarray(jnp.asarray(array, jnp.float32))
        if storage == "bfloat16":
            values = values.astype(ml_dtypes.bfloat16).view(np.uint16)
        arrays[name] = values
    weights_path, config_path = stem.with_suffix(".npz"), stem.with_suffix(".json")
    np.savez(weights_path, **arrays)
    record = {"config": config.to_dict(), "storage": storage, "metadata": metadata or {}}
    config_path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return weights_path, config_path


def load_model(path) -> tuple[ModelConfig, dict]:
    """Reads what ``save_model`` wrote: ``(config, params)``, params in ``config.dtype``.

    Args:
      path: the stem, or either file (``serving/weights/target`` or ``.../target.npz``).

    Raises:
      FileNotFoundError: if either file is missing.
      ValueError: for a config that ``ModelConfig`` rejects, an unknown storage dtype, or
        arrays missing or misshapen for the config.

    Example:
      >>> config, params = load_model(pathlib.Path(__file__).parent / "weights" / "draft")
      >>> config.vocab_size, config.num_layers
      (256, 2)
    """
    stem = _stem(path)
    record = json.loads(stem.with_suffix(".json").read_text())
    config = ModelConfig.from_dict(record["config"])
    storage = record.get("storage")
    if storage not in STORAGE_DTYPES:
        raise ValueError(f"{stem}.json has storage {storage!r}, expected one of {STORAGE_DTYPES}")
    with np.load(stem.with_suffix(".npz")) as arrays:
        stored = {name: arrays[name] for name in arrays.files}
    shapes = param_shapes(config)
    names = [name for name, _ in _flat_items(shapes)]
    missing = [name for name in names if name not in stored]
    if missing:
        raise ValueError(f"{stem}.npz lacks {missing[:3]} (needed by its config)")

    def to_array(name):
        values = stored[name]
        if storage == "bfloat16":
            values = values.view(ml_dtypes.bfloat16)
        return jnp.asarray(values.astype(np.float32), config.jnp_dtype)

    params = {
        "embed": to_array("embed"),
        "layers": [
            {key: to_array(f"layers.{index}.{key}") for key in layer}
            for index, layer in enumerate(shapes["layers"])
        ],
        "final_norm": to_array("final_norm"),
        "lm_head": to_array("lm_head"),
    }
    validate_params(params, config)
    return config, params
