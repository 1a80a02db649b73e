"""Ragged attention: decode rows and prefill chunks of one step in one call (contract, reference).

A mixed step of the engine brings, for each request, some number of new tokens: one for a
decode row, a chunk for a prompt being prefilled, none for an idle slot. Today their attention
is two launches (``paged.decode_attention`` on the decode rows, then on the chunk as
``paged.prefill_attention`` does). This module fixes the contract of doing it in one: every new
token of the step packed request by request into one ``q [T, H, D]``, and CSR query offsets
``qo_indptr [B + 1]`` (request ``b``'s new tokens are ``q[qo_indptr[b]:qo_indptr[b + 1]]``),
the same CSR form as the page table's. Its one-launch kernel is the prototype
``kernels_pallas/ragged_attention_mgpu.py``; here are the checks and the reference it is tested
against.

The rule is ``paged.decode_attention``'s, per request: request ``b`` of ``seq_len`` tokens in
the page table (which already holds the new tokens' keys) with ``n`` new tokens has them at
positions ``seq_len - n .. seq_len - 1``; new token ``l`` attends to the keys at positions
``0 .. seq_len - n + l`` (causal among the new tokens, everything before them). Logits are
``(q . k) * sm_scale``, soft-capped as ``cap * tanh(s / cap)`` when a cap is given.

- ``validate_ragged_inputs``: shapes and dtypes always; ``qo_indptr``'s values and "no request
  has more new tokens than keys" when they are concrete (errors name the argument and value).
- ``ragged_attention_reference``: one new token at a time, gather its request's keys, masked
  softmax (``attention_over_visible_keys``). Simple and exact; float32, or float64 for float64
  inputs (tests with x64 enabled).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.platform import is_concrete
from paged.attention_reference import (
    attention_over_visible_keys,
    token_mask,
    token_positions,
)
from paged.kv_cache import KVCache, validate_kv_cache
from paged.page_table import PageTable, validate_page_table


def validate_ragged_inputs(
    q: jax.Array,
    qo_indptr: jax.Array | np.ndarray,
    cache: KVCache,
    page_table: PageTable,
    logits_soft_cap: float | None = None,
) -> None:
    """Checks a ragged step's inputs: shapes and dtypes always, values when concrete.

    Args:
      q: ``[T, H, D]``, the step's new tokens packed request by request.
      qo_indptr: int32 ``[B + 1]``, CSR offsets of each request's new tokens in ``q``.
      cache: the KV pool.
      page_table: ``B`` requests, already holding the new tokens' keys.
      logits_soft_cap: None or a float ``> 0``.

    Raises:
      ValueError: naming the argument and the bad value: ``q`` not 3-D, a head or dtype
        mismatch with the cache, ``qo_indptr`` not int32 ``[B + 1]`` for the table's ``B``
        requests, and with concrete values: ``qo_indptr`` not starting at 0 or decreasing, its
        total not ``T``, a request with more new tokens than its ``seq_len`` in the table, and
        the table's own invariants (``validate_page_table``).

    Example:
      >>> from paged import new_kv_cache
      >>> cache = new_kv_cache(4, 16, 1, 8, jnp.float32)
      >>> table = PageTable.from_seq_lens([5, 3], page_size=16)
      >>> validate_ragged_inputs(jnp.ones((3, 2, 8)), np.array([0, 1, 4], np.int32), cache, table)
      Traceback (most recent call last):
      ...
      ValueError: qo_indptr[-1]=4 must equal q's number of new tokens T=3
    """
    validate_kv_cache(cache)
    if q.ndim != 3:
        raise ValueError(f"q must have shape [T, num_q_heads, head_dim], got {q.shape}")
    num_tokens, num_heads, head_dim = q.shape
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
    if logits_soft_cap is not None and (
        isinstance(logits_soft_cap, bool)
        or not isinstance(logits_soft_cap, (int, float))
        or not logits_soft_cap > 0
    ):
        raise ValueError(f"logits_soft_cap must be a number > 0 or None, got {logits_soft_cap!r}")
    if qo_indptr.ndim != 1 or qo_indptr.dtype != jnp.int32:
        raise ValueError(
            f"qo_indptr must be a 1-D int32 array, got shape {qo_indptr.shape} dtype "
            f"{qo_indptr.dtype}"
        )
    batch = qo_indptr.shape[0] - 1
    if batch < 0:
        raise ValueError("qo_indptr must have B + 1 >= 1 entries, got an empty array")
    if page_table.batch_size != batch:
        raise ValueError(
            f"qo_indptr has {batch + 1} entries (B={batch} requests) but page_table describes "
            f"{page_table.batch_size}"
        )
    validate_page_table(page_table, cache.num_pages, batch_size=batch)
    if not is_concrete(qo_indptr):
        return
    offsets = np.asarray(qo_indptr)
    if offsets[0] != 0:
        raise ValueError(f"qo_indptr must start at 0, got qo_indptr[0]={offsets[0]}")
    new_tokens = np.diff(offsets)
    if np.any(new_tokens < 0):
        b = int(np.argmax(new_tokens < 0))
        raise ValueError(
            f"qo_indptr must be non-decreasing, but qo_indptr[{b}]={offsets[b]} > "
            f"qo_indptr[{b + 1}]={offsets[b + 1]}"
        )
    if offsets[-1] != num_tokens:
        raise ValueError(
            f"qo_indptr[-1]={offsets[-1]} must equal q's number of new tokens T={num_tokens}"
        )
    if is_concrete(page_table.page_indptr, page_table.last_page_len):
        seq_lens = np.asarray(page_table.seq_lens())
        too_many = new_tokens > seq_lens
        if np.any(too_many):
            b = int(np.argmax(too_many))
            raise ValueError(
                f"request {b} has {new_tokens[b]} new tokens in qo_indptr but seq_len "
                f"{seq_lens[b]} in page_table: the table must already hold the new tokens' keys"
            )


def token_requests_and_positions(
    qo_indptr: jax.Array, seq_lens: jax.Array, num_tokens: int
) -> tuple[jax.Array, jax.Array]:
    """int32 ``[T]`` twice: each new token's request, and its position in that request's
    sequence (``seq_len - n + l`` for token ``l`` of ``n``).

    Example:
      >>> requests, positions = token_requests_and_positions(
      ...     jnp.array([0, 1, 1, 4]), jnp.array([9, 0, 5]), 4)
      >>> requests.tolist(), positions.tolist()
      ([0, 2, 2, 2], [8, 2, 3, 4])
    """
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    # The request whose range [qo_indptr[b], qo_indptr[b + 1]) holds the token: the last b with
    # qo_indptr[b] <= token (empty requests share their offset with the next one, so "last").
    request = (jnp.searchsorted(qo_indptr, token, side="right") - 1).astype(jnp.int32)
    new_tokens = qo_indptr[request + 1] - qo_indptr[request]
    position = seq_lens[request] - new_tokens + (token - qo_indptr[request])
    return request, position.astype(jnp.int32)


def ragged_attention_reference(
    q: jax.Array,
    qo_indptr: jax.Array,
    cache: KVCache,
    page_table: PageTable,
    *,
    sm_scale: float,
    logits_soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of every new token of a ragged step over its own request's paged keys.

    One token at a time: its request and position (``token_requests_and_positions``), the keys
    of that request at positions up to its own (``token_mask``, ``token_positions``), and the
    reference softmax over them. Every page slot of the table is gathered once. Cost ``T x H x
    nnz x page_size`` logits: for tests and small steps.

    Args:
      q: ``[T, H, D]``, new tokens packed request by request.
      qo_indptr: int32 ``[B + 1]``, request ``b``'s tokens are ``q[qo_indptr[b]:qo_indptr[b+1]]``
        (0 of them allowed).
      cache: the KV pool (either layout).
      page_table: the ``B`` requests, already holding the new tokens' keys.
      sm_scale: logit scale.
      logits_soft_cap: optional cap on the scaled logits.

    Returns:
      ``(o [T, H, D], lse [T, H])`` in the compute dtype (float32, float64 for float64 inputs);
      ``lse`` natural log. A token that sees no key (only under ``jit``, with a table shorter
      than its new tokens) gets ``o = 0``, ``lse = -inf``.

    Raises:
      ValueError: what ``validate_ragged_inputs`` raises.

    Example:
      >>> from paged import new_kv_cache
      >>> cache = new_kv_cache(4, 16, 1, 8, jnp.float32)
      >>> table = PageTable.from_seq_lens([20, 0, 3], page_size=16)
      >>> qo_indptr = jnp.array([0, 1, 1, 4], jnp.int32)  # a decode row, idle, a 3-token chunk
      >>> o, lse = ragged_attention_reference(
      ...     jnp.ones((4, 2, 8)), qo_indptr, cache, table, sm_scale=0.35)
      >>> o.shape, lse.shape
      ((4, 2, 8), (4, 2))
    """
    validate_ragged_inputs(q, qo_indptr, cache, page_table, logits_soft_cap)
    dtype = jnp.promote_types(q.dtype, jnp.float32)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = cache.num_kv_heads
    group = num_heads // num_kv_heads
    # [nnz * page_size, KVH, D]: every listed page slot, token-major.
    k = cache.to_nhd(cache.k_pages[page_table.page_indices]).astype(dtype)
    v = cache.to_nhd(cache.v_pages[page_table.page_indices]).astype(dtype)
    num_slots = k.shape[0] * k.shape[1]
    k = k.reshape(num_slots, num_kv_heads, head_dim)
    v = v.reshape(num_slots, num_kv_heads, head_dim)
    owns_slot = token_mask(page_table).reshape(page_table.batch_size, num_slots)
    slot_position = token_positions(page_table).reshape(page_table.batch_size, num_slots)
    request, position = token_requests_and_positions(
        jnp.asarray(qo_indptr), page_table.seq_lens(), num_tokens
    )
    queries = q.astype(dtype).reshape(num_tokens, 1, num_kv_heads, group, head_dim)

    def attend(token):
        q_t, b, pos = token  # [1, KVH, G, D], scalar, scalar
        visible = owns_slot[b] & (slot_position[b] <= pos)  # [slots]: b's keys up to pos
        return attention_over_visible_keys(
            q_t, k, v, visible[None, :], sm_scale=sm_scale, logits_soft_cap=logits_soft_cap
        )

    if num_tokens == 0:
        return jnp.zeros(q.shape, dtype), jnp.zeros(q.shape[:-1], dtype)
    o, lse = jax.lax.map(attend, (queries, request, position))
    return o.reshape(q.shape), lse.reshape(num_tokens, num_heads)
