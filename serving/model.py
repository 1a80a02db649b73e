"""A Llama-style decoder: parameters, a dense forward and a paged forward.

Its configuration and presets are ``serving/config.py``; weight files ``serving/model_files.py``.

The architecture (Llama 2/3): token embedding; per layer, RMSNorm, grouped-query attention with
rotary embeddings, residual add, RMSNorm, SwiGLU MLP, residual add; a final RMSNorm and an
untied output projection. The residual adds are folded into the next norm
(``serving.layers.fused_add_rmsnorm``), as serving engines do.

Two forwards share every line of the layer stack and differ only in attention:

- ``forward_dense``: plain causal attention over the tokens given, no cache. For training, and the
  reference the paged path is tested against.
- ``forward_paged``: ``L`` new tokens per request at the end of each request's sequence in a page
  table. Each layer rotates q and k and writes k and v into its pages (``paged.rope_append_kv``),
  then attends over the pages (``paged.decode_attention``; or, as the engine chooses, its
  cascade over shared prefixes, or a sparse decode over a selection of the pages:
  ``serving/cascade_step.py``, ``serving/sparse_step.py``). ``L = 1`` is a decode step;
  ``L > 1`` is a prefill chunk or the verification of ``L - 1`` drafted tokens. The engine
  runs prompts through it chunk by chunk (``serving.programs.prefill_step``).

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
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import paged
from kernels_pallas.platform import is_concrete
from serving.cascade_step import cascade_attention_backend
from serving.config import ModelConfig
from serving.layers import fused_add_rmsnorm, rmsnorm
from serving.sparse_step import SparseDecode, sparse_attention

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
      >>> from serving.config import TINY_DRAFT
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
    for name, shape in flat_items(expected):
        array = _lookup(params, name)
        if array is None:
            raise ValueError(f"params is missing {name!r} (shape {shape})")
        if tuple(array.shape) != shape:
            raise ValueError(
                f"params {name!r} has shape {tuple(array.shape)}, config needs {shape}"
            )


def flat_items(tree) -> list[tuple[str, object]]:
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
      >>> from serving.config import TINY_DRAFT
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
      >>> from serving.config import TINY_DRAFT
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
    cascade: paged.CascadeLevels | None = None,
    sparse: SparseDecode | None = None,
    key_bounds: list[paged.PageKeyBounds] | None = None,
):
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
      cascade: the step's ``paged.CascadeLevels`` over ``page_table``'s rows (the engine's
        ``serving/cascade_step.py``), or None. Given, every layer attends through
        ``paged.cascade_decode_attention`` (a group's shared pages as one level, each row's own
        pages as another, merged exactly; its backend ``cascade_attention_backend``'s) and
        ``plan`` is not used; the keys and values are still written through ``page_table``.
      sparse: a ``serving.sparse_step.SparseDecode`` (a decode step, ``L = 1``), or None. Given,
        every layer attends through ``paged.sparse_decode_attention`` over the mode's selection
        of each request's pages (``serving.sparse_step.sparse_attention``; ``"quest"`` reads
        ``key_bounds``, which must be given) and ``plan`` is not used (the virtual table is
        another table). Prefill chunks pass None: they attend densely.
      key_bounds: one ``paged.PageKeyBounds`` a layer, or None. Given, each layer's bounds are
        kept current with the keys it writes (``paged.rope_append_kv``'s ``key_bounds``: a page
        whose slot 0 is written restarts) before it attends, and returned.

    Returns:
      ``(logits, caches)``: float32 ``[B, L, V]``, and the caches with the new keys and values;
      with ``key_bounds``, ``(logits, caches, key_bounds)``, the bounds with the new keys.

    Raises:
      ValueError: naming the argument, for tokens not ``[B, L]`` integers, a batch unlike the
        table's, caches unlike the config (count, heads, head_dim, dtype, pool shape, page
        size), parameters unlike the config, and with concrete inputs a token id outside the
        vocabulary or a request shorter than ``L``; ``sparse`` with ``L > 1``, with
        ``cascade``, or in mode ``"quest"`` without ``key_bounds``; ``key_bounds`` not one a
        layer; plus whatever the paged ops reject (page indices outside the pool, ...). Under
        ``jit`` an out-of-vocabulary id gives NaN logits for its request.

    Example:
      >>> from serving.config import TINY_DRAFT
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
    _validate_sparse(sparse, key_bounds, cascade, length, config)
    positions = paged.new_token_positions(page_table, length).reshape(-1)  # [B * L], row-major
    batch_indices = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), length)
    new_caches_list = []
    new_bounds = []

    def attention(index, q, k, v):
        flat = lambda x: x.reshape(batch * length, *x.shape[2:])
        # With the layer's bounds the append keeps them too (a page whose slot 0 it writes
        # restarts, then each written key widens its page), before the attention: Quest scores
        # the new keys' pages too.
        bounds = None if key_bounds is None else key_bounds[index]
        appended = paged.rope_append_kv(
            flat(q),
            flat(k),
            flat(v),
            positions,
            batch_indices,
            caches[index],
            page_table,
            rope=config.rope,
            backend=backend,
            key_bounds=bounds,
        )
        if bounds is None:
            q_rotated, cache = appended
        else:
            q_rotated, cache, bounds = appended
            new_bounds.append(bounds)
        new_caches_list.append(cache)
        # One new token keeps decode's [B, H, D] query (the single-token kernel path).
        q_rotated = q_rotated.reshape(q.shape if length > 1 else (batch, *q.shape[2:]))
        if sparse is not None:
            o = sparse_attention(q_rotated, cache, page_table, sparse, bounds, backend=backend)
        elif cascade is None:
            o = paged.decode_attention(q_rotated, cache, page_table, plan=plan, backend=backend)
        else:
            o = paged.cascade_decode_attention(
                q_rotated,
                cache,
                cascade,
                backend=cascade_attention_backend(backend, q_rotated, cache),
            )
        return o.reshape(q.shape)

    logits = _decoder(params, config, tokens, attention, backend)
    if key_bounds is None:
        return logits, new_caches_list
    return logits, new_caches_list, new_bounds


def _validate_sparse(sparse, key_bounds, cascade, length: int, config: ModelConfig) -> None:
    if key_bounds is not None and (
        not isinstance(key_bounds, (list, tuple)) or len(key_bounds) != config.num_layers
    ):
        count = len(key_bounds) if isinstance(key_bounds, (list, tuple)) else key_bounds
        raise ValueError(
            f"key_bounds must be a list of config.num_layers={config.num_layers} "
            f"paged.PageKeyBounds, got {count!r}"
        )
    if sparse is None:
        return
    if not isinstance(sparse, SparseDecode):
        raise ValueError(
            f"sparse must be a serving.sparse_step.SparseDecode or None, got {sparse!r}"
        )
    if length != 1:
        raise ValueError(
            f"sparse decode attends one new token a request, got L={length} (prefill chunks "
            "and verification steps attend densely: pass sparse=None)"
        )
    if cascade is not None:
        raise ValueError("sparse and cascade cannot be combined: pass one of them")
    if sparse.keeps_bounds and key_bounds is None:
        raise ValueError(f"sparse mode {sparse.mode!r} reads key bounds: pass key_bounds")
