"""Reference decode attention over the paged cache, and exact merging of attention states.

Written for a reader to check line by line, not for speed: every kernel in ``kernels_pallas/``
is tested against these functions. Computation is in float32, or float64 when the inputs are
float64 (as in tests with x64 enabled).

An attention state over a subset of keys is ``(v, s)``: ``v`` the softmax-weighted values over
that subset, ``s`` the natural-log log-sum-exp of its scaled (and soft-capped) logits. Two states
over disjoint subsets merge exactly (``proofs/merge_states.md``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged.kv_cache import KVCache
from paged.page_table import PageTable


def _compute_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def scaled_logits(q_dot_k: jax.Array, sm_scale: float, logits_soft_cap: float | None):
    """``s = (q . k) * sm_scale``, then ``cap * tanh(s / cap)`` with a soft cap."""
    s = q_dot_k * sm_scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    return s


def token_mask(page_table: PageTable) -> jax.Array:
    """bool[B, nnz_padded, page_size]: which (page-slot, token-slot) pairs hold request b's keys.

    Entry ``[b, j, t]`` is true when ``page_indices[j]`` is one of request b's pages and slot ``t``
    of it holds one of its tokens (all slots but the tail of its last page).
    """
    num_indices = page_table.page_indices.shape[0]
    j = jnp.arange(num_indices)[None, :]
    start = page_table.page_indptr[:-1, None]
    end = page_table.page_indptr[1:, None]
    owns = (start <= j) & (j < end)  # [B, nnz]
    is_last = j == end - 1
    slot = jnp.arange(page_table.page_size)
    filled = jnp.where(
        is_last[..., None], slot[None, None, :] < page_table.last_page_len[:, None, None], True
    )
    return owns[..., None] & filled


def token_positions(page_table: PageTable) -> jax.Array:
    """int32[B, nnz_padded, page_size]: the position in request b's sequence of the token in
    (page-slot ``j``, token-slot ``t``), ``(j - page_indptr[b]) * page_size + t``.

    Meaningful only where ``token_mask`` is true (elsewhere it is some number, maybe negative).
    """
    num_indices = page_table.page_indices.shape[0]
    page_in_request = jnp.arange(num_indices)[None, :] - page_table.page_indptr[:-1, None]
    slot = jnp.arange(page_table.page_size)
    return (page_in_request[..., None] * page_table.page_size + slot).astype(jnp.int32)


def attention_over_visible_keys(
    queries: jax.Array,
    k: jax.Array,
    v: jax.Array,
    visible: jax.Array,
    *,
    sm_scale: float,
    logits_soft_cap: float | None,
) -> tuple[jax.Array, jax.Array]:
    """Grouped-query softmax attention of one request's query rows over the keys each row sees.

    The one softmax of the references: plain decode (``decode_attention_reference``, causal
    masks) and cascade levels (``paged/cascade.py``, a group's shared pages) both call it.

    Args:
      queries: ``[L, KVH, G, D]`` in the compute dtype; row ``l``'s heads of KV head ``k``.
      k, v: ``[T, KVH, D]`` gathered keys and values (unused slots may hold anything, NaN too).
      visible: ``bool[L, T]``: which keys row ``l`` attends to.
      sm_scale, logits_soft_cap: as in ``scaled_logits``.

    Returns:
      ``(o [L, KVH, G, D], lse [L, KVH, G])``; a row that sees no key gets ``o = 0``,
      ``lse = -inf``.
    """
    seen = visible[:, None, None, :]  # [L, 1, 1, T] against logits [L, KVH, G, T]
    logits = jnp.einsum("lkgd,tkd->lkgt", queries, k, precision="highest")
    logits = scaled_logits(logits, sm_scale, logits_soft_cap)
    logits = jnp.where(seen, logits, -jnp.inf)
    # Softmax as the kernels compute it: exponentials of the max-subtracted logits, divided
    # by their sum. (Weighting by exp(logits - lse) instead is off by the rounding of lse,
    # whose float32 step is 0.004 near lse = -46340: weights summing to 1 +- 0.4%.)
    peak = jnp.max(logits, axis=-1, keepdims=True)  # -inf for a row that sees no key
    shift = jnp.where(jnp.isfinite(peak), peak, 0)  # keeps exp() at 0 there, not NaN
    weights = jnp.where(seen, jnp.exp(logits - shift), 0)  # the largest is exactly 1
    total = jnp.sum(weights, axis=-1)  # [L, KVH, G], >= 1 when any key is visible
    safe_total = jnp.where(total > 0, total, 1)
    lse = jnp.where(total > 0, shift[..., 0] + jnp.log(safe_total), -jnp.inf)
    # Zero the values no row sees: a weight of 0 times a NaN left in an unused slot (or in
    # another request's token) would still be NaN.
    seen_values = jnp.where(jnp.any(visible, axis=0)[:, None, None], v, 0)
    weighted = jnp.einsum("lkgt,tkd->lkgd", weights, seen_values, precision="highest")
    return weighted / safe_total[..., None], lse


def decode_attention_reference(
    q: jax.Array,
    cache: KVCache,
    page_table: PageTable,
    *,
    sm_scale: float,
    logits_soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Grouped-query attention of each request's newest ``L`` tokens over its paged keys.

    ``q`` holds one new token per request (``[B, H, D]``, plain decode) or ``L`` of them
    (``[B, L, H, D]``: speculative verification, or a chunk of a prompt). The ``L`` new tokens are
    the last ``L`` tokens of each request's sequence, their keys already in the cache, and
    attention among them is causal: query ``l`` of a request of ``seq_len`` tokens sits at
    position ``seq_len - L + l`` and sees the keys at positions ``0 .. seq_len - L + l``. A query
    whose position is negative (a request shorter than ``L``; ``paged.decode_attention`` rejects
    it when the table is concrete) sees no keys: positions before 0 do not exist.

    Every page slot of the table is gathered once; then, one request at a time, the request
    masks in its own visible tokens and attends over them. Simple and exact; its cost is
    ``B x L x H x nnz x page_size`` logits, fine for tests, small batches and prompt chunks of
    a few hundred tokens.

    Args:
      q: ``[B, H, D]`` or ``[B, L, H, D]``, H a multiple of the cache's ``num_kv_heads``.
      cache: the KV pool.
      page_table: B requests.
      sm_scale: the logit scale.
      logits_soft_cap: optional soft cap on the scaled logits.

    Returns:
      ``(o, lse)``: ``o`` shaped like ``q`` in the compute dtype (float32 or float64), ``lse``
      (``q``'s shape without ``D``) the natural-log log-sum-exp of the scaled logits; a query that
      sees no key (every query of an empty request) gets ``o = 0`` and ``lse = -inf``.
    """
    dtype = _compute_dtype(q.dtype)
    single_token = q.ndim == 3
    queries = q[:, None] if single_token else q  # [B, L, H, D]
    batch, q_len, num_heads, head_dim = queries.shape
    num_kv_heads = cache.num_kv_heads
    group = num_heads // num_kv_heads
    # [nnz, page_size, KVH, D]: every listed page, token-major.
    k = cache.to_nhd(cache.k_pages[page_table.page_indices]).astype(dtype)
    v = cache.to_nhd(cache.v_pages[page_table.page_indices]).astype(dtype)
    num_tokens = k.shape[0] * k.shape[1]
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    v = v.reshape(num_tokens, num_kv_heads, head_dim)
    q_grouped = queries.astype(dtype).reshape(batch, q_len, num_kv_heads, group, head_dim)
    owns_token = token_mask(page_table).reshape(batch, num_tokens)
    key_position = token_positions(page_table).reshape(batch, num_tokens)
    # [B, L]: where each new token sits in its request's sequence.
    query_position = page_table.seq_lens()[:, None] - q_len + jnp.arange(q_len)[None, :]

    def attend(request):
        q_b, mine, key_pos, query_pos = request  # [L, KVH, G, D], bool[T], int[T], int[L]
        visible = mine[None, :] & (key_pos[None, :] <= query_pos[:, None])  # [L, T], causal
        return attention_over_visible_keys(
            q_b, k, v, visible, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap
        )

    o, lse = jax.lax.map(attend, (q_grouped, owns_token, key_position, query_position))
    o = o.reshape(batch, q_len, num_heads, head_dim)
    lse = lse.reshape(batch, q_len, num_heads)
    if single_token:
        return o[:, 0], lse[:, 0]
    return o, lse


def _merge_along(v: jax.Array, s: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """Merges states stacked along ``axis`` (negative) of ``s``; ``v`` has one more trailing axis,
    D, so its state axis is ``axis - 1``."""
    dtype = _compute_dtype(jnp.result_type(v, s))
    v = v.astype(dtype)
    s = s.astype(dtype)
    s_max = jnp.max(s, axis=axis, keepdims=True)
    # An all-empty set of states has s_max = -inf; shifting by 0 instead keeps exp() at 0, not NaN.
    shift = jnp.where(jnp.isfinite(s_max), s_max, 0)
    weights = jnp.exp(s - shift)  # in [0, 1]; the largest is exactly 1 when any state is non-empty
    total = jnp.sum(weights, axis=axis)
    weighted = jnp.sum(weights[..., None] * v, axis=axis - 1)
    safe_total = jnp.where(total > 0, total, 1)
    merged_v = jnp.where(total[..., None] > 0, weighted / safe_total[..., None], 0)
    merged_s = jnp.where(total > 0, jnp.squeeze(shift, axis) + jnp.log(safe_total), -jnp.inf)
    return merged_v, merged_s


def merge_state(
    v_a: jax.Array, s_a: jax.Array, v_b: jax.Array, s_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Merges two attention states over disjoint key sets into the state over their union.

    ``v = (v_a e^{s_a} + v_b e^{s_b}) / (e^{s_a} + e^{s_b})`` and ``s = logaddexp(s_a, s_b)``,
    computed with the larger ``s`` subtracted so nothing overflows; two empty states
    (``s = -inf``) merge to ``v = 0, s = -inf``.

    Args:
      v_a, v_b: ``[..., D]``.
      s_a, s_b: ``[...]`` (the leading shape of ``v_a``).

    Returns:
      ``(v [..., D], s [...])`` in float32 (float64 for float64 inputs).

    Raises:
      ValueError: for shapes that do not match. Values are never checked: a NaN in a state, or
        ``s = +inf``, makes that entry's result NaN.

    Example:
      >>> v, s = merge_state(jnp.ones((1, 2)), jnp.zeros(1), jnp.zeros((1, 2)), jnp.zeros(1))
      >>> v.tolist(), round(float(s[0]), 6)
      ([[0.5, 0.5]], 0.693147)
    """
    _check_state_shapes("v_a", v_a, "s_a", s_a)
    _check_state_shapes("v_b", v_b, "s_b", s_b)
    if v_a.shape != v_b.shape:
        raise ValueError(f"v_a {v_a.shape} and v_b {v_b.shape} differ")
    return _merge_along(jnp.stack([v_a, v_b], axis=-2), jnp.stack([s_a, s_b], axis=-1), -1)


def merge_states(v: jax.Array, s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Merges ``S`` attention states over disjoint key sets into one.

    Args:
      v: ``[..., S, H, D]`` partial outputs.
      s: ``[..., S, H]`` their log-sum-exps; ``-inf`` marks an empty state.

    Returns:
      ``(v [..., H, D], s [..., H])`` in float32 (float64 for float64 inputs).

    Raises:
      ValueError: if ``s`` is not ``v``'s shape without ``D``, ``v`` has fewer than 3 axes, or
        there are no states (``S = 0``). A NaN in a state cannot be checked under ``jit`` (and is
        not checked outside it): it propagates to that head's result.

    Example:
      >>> v = jnp.array([[[1.0, 1.0]], [[3.0, 5.0]]])  # S=2, H=1, D=2
      >>> s = jnp.log(jnp.array([[1.0], [3.0]]))
      >>> merged, lse = merge_states(v, s)
      >>> [round(x, 5) for x in merged[0].tolist()], round(float(jnp.exp(lse[0])), 5)
      ([2.5, 4.0], 4.0)
    """
    _check_state_shapes("v", v, "s", s)
    if v.ndim < 3:
        raise ValueError(f"v must have shape [..., S, H, D], got {v.shape}")
    if v.shape[-3] == 0:
        raise ValueError(f"merge_states needs at least one state, but v {v.shape} has S=0")
    return _merge_along(v, s, -2)


def _check_state_shapes(v_name, v, s_name, s):
    if v.shape[:-1] != s.shape:
        raise ValueError(
            f"{s_name} must have shape {v.shape[:-1]} (that of {v_name} without its last axis), "
            f"got {s.shape}"
        )
