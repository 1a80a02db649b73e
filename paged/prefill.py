"""Chunked prefill over the paged KV cache: a prompt's attention, one chunk of tokens at a time.

A prompt of ``T`` new tokens per request (the last ``T`` tokens of each request in the final
page table; earlier tokens, such as a shared prefix, are already in the cache) is cut into
chunks of ``chunk_size`` tokens. Chunk ``[start, stop)`` runs against the table *truncated* to
end at the chunk's last token, so its ``L = stop - start`` tokens are the last ``L`` of every
request in that table. That is exactly the query of ``paged.decode_attention`` with
``q [B, L, H, D]``: query ``l`` sees the keys at positions ``< seq_len - L + l + 1``, which are
the earlier chunks' keys (already written), the prefix's, and its own chunk's up to itself.
So prefill needs no attention API of its own: append the chunk's keys and values, then call
decode attention, which runs chunks longer than ``paged.decode.MAX_KERNEL_Q_LEN`` tokens on its
causal prefill kernel (``kernels_pallas/paged_prefill.py``: query blocks, each stopping at its
causal bound) on the Pallas backend. Scores exist for one chunk at a time (``L`` queries
against the table's slots), never for the whole prompt at once.

- ``prefill_chunks``: the host-side schedule (each chunk's token range and truncated table).
  A model runs every layer on one chunk before the next chunk (``serving.programs.prefill_step``).
- ``new_token_positions``: where the new tokens sit (every paged forward needs it).
- ``prefill_attention``: one attention layer's chunked prefill, the reference for "new tokens
  attending causally to the paged cache", chunk by chunk.

Truncated tables keep the final table's padded ``page_indices`` length, so every chunk of one
length reuses one compiled program.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.platform import is_concrete
from paged.decode import decode_attention
from paged.kv_cache import KVCache, append_kv, validate_kv_cache
from paged.page_table import PageTable, check_holds_new_tokens, validate_page_table
from paged.rope import RopeParams
from paged.rope_append import rope_append_kv


class PrefillChunk(NamedTuple):
    """One chunk of a prefill.

    Attributes:
      start, stop: the chunk's tokens ``[start, stop)`` among the ``T`` new tokens.
      page_table: the requests up to and including the chunk's last token.
    """

    start: int
    stop: int
    page_table: PageTable


def truncated_page_table(page_table: PageTable, seq_lens) -> PageTable:
    """The table of each request's first ``seq_lens[b]`` tokens (host-side).

    Request ``b`` keeps its first ``ceil(seq_lens[b] / page_size)`` pages; ``page_indices``
    keeps its padded length, so the result has the input's static shapes.

    Args:
      page_table: concrete table.
      seq_lens: ``B`` ints, each in ``[0, current length]``.

    Raises:
      ValueError: for a traced table, or a length that is negative or longer than the request.

    Example:
      >>> table = PageTable.from_page_lists([[5, 2, 7]], seq_lens=[40], page_size=16)
      >>> short = truncated_page_table(table, [17])
      >>> short.page_lists(), short.last_page_len.tolist(), short.page_indices.shape
      ([[5, 2]], [1], (16,))
    """
    if not is_concrete(page_table.page_indptr, page_table.page_indices, page_table.last_page_len):
        raise ValueError("truncated_page_table needs a concrete page_table (it runs on the host)")
    current = np.asarray(page_table.seq_lens())
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    if seq_lens.shape != current.shape:
        raise ValueError(f"seq_lens must have {current.shape[0]} entries, got {seq_lens.shape}")
    bad = (seq_lens < 0) | (seq_lens > current)
    if np.any(bad):
        b = int(np.argmax(bad))
        raise ValueError(f"seq_lens[{b}]={seq_lens[b]} is outside request {b}'s [0, {current[b]}]")
    page_size = page_table.page_size
    page_lists = [
        pages[: -(-int(length) // page_size)]
        for pages, length in zip(page_table.page_lists(), seq_lens, strict=True)
    ]
    return PageTable.from_page_lists(
        page_lists,
        seq_lens.tolist(),
        page_size,
        num_indices=page_table.page_indices.shape[0],
    )


def new_token_positions(page_table: PageTable, num_new_tokens: int) -> jax.Array:
    """int32 ``[B, L]``: positions of the last ``L`` tokens of each request, ``seq_len[b] - L + l``.

    Not checked (``check_holds_new_tokens`` checks a concrete table): a request shorter than
    ``L`` gets negative positions, whose tokens ``append_kv`` drops and ``decode_attention``
    gives no keys.

    Example:
      >>> new_token_positions(PageTable.from_seq_lens([5, 2], page_size=4), 2).tolist()
      [[3, 4], [0, 1]]
    """
    offsets = jnp.arange(num_new_tokens, dtype=jnp.int32) - num_new_tokens
    return page_table.seq_lens()[:, None] + offsets[None, :]


def prefill_chunks(page_table: PageTable, num_new_tokens: int, chunk_size: int):
    """Cuts the last ``num_new_tokens`` tokens of every request into chunks (host-side).

    Args:
      page_table: concrete table of the requests after the prompt; every request has at least
        ``num_new_tokens`` tokens.
      num_new_tokens: ``T >= 1``, the prompt tokens per request (the same for every request).
      chunk_size: tokens per chunk, ``>= 1``; the last chunk may be shorter.

    Returns:
      A list of ``PrefillChunk`` in order: ``ceil(T / chunk_size)`` chunks.

    Raises:
      ValueError: for a ``chunk_size`` or ``num_new_tokens`` below 1, a traced table, or a
        request shorter than ``num_new_tokens``.

    Example:
      >>> table = PageTable.from_seq_lens([10], page_size=4)
      >>> [(c.start, c.stop, c.page_table.seq_lens().tolist()) for c in prefill_chunks(table, 6, 4)]
      [(0, 4, [8]), (4, 6, [10])]
    """
    for name, value in [("num_new_tokens", num_new_tokens), ("chunk_size", chunk_size)]:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not is_concrete(page_table.page_indptr, page_table.last_page_len):
        raise ValueError("prefill_chunks needs a concrete page_table (it runs on the host)")
    check_holds_new_tokens(page_table, num_new_tokens, f"num_new_tokens={num_new_tokens}")
    seq_lens = np.asarray(page_table.seq_lens())
    prefix = seq_lens - num_new_tokens  # tokens each request had before the prompt
    chunks = []
    for start in range(0, num_new_tokens, chunk_size):
        stop = min(start + chunk_size, num_new_tokens)
        table = (
            page_table
            if stop == num_new_tokens
            else truncated_page_table(page_table, prefix + stop)
        )
        chunks.append(PrefillChunk(start, stop, table))
    return chunks


@functools.partial(jax.jit, static_argnames=("rope", "sm_scale", "logits_soft_cap", "backend"))
def _prefill_chunk(q, k, v, cache, page_table, *, rope, sm_scale, logits_soft_cap, backend):
    """One chunk: append its keys and values (rotated), then its causal attention.

    ``q [B, L, Hq, D]``, ``k, v [B, L, Hkv, D]``, ``page_table`` ending at the chunk's last token.
    One compiled program per chunk length.
    """
    batch, size = q.shape[:2]
    rows = lambda x: x.reshape(batch * size, *x.shape[2:])  # [B, L, H, D] -> [B * L, H, D]
    positions = new_token_positions(page_table, size).reshape(-1)
    batch_indices = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), size)
    q_rows = rows(q)
    if rope is None:
        cache = append_kv(cache, page_table, rows(k), rows(v), batch_indices, positions)
    else:
        q_rows, cache = rope_append_kv(
            q_rows,
            rows(k),
            rows(v),
            positions,
            batch_indices,
            cache,
            page_table,
            rope=rope,
            backend=backend,
        )
    o = decode_attention(
        q_rows.reshape(q.shape),
        cache,
        page_table,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        backend=backend,
    )
    return o, cache


def prefill_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache: KVCache,
    page_table: PageTable,
    *,
    chunk_size: int,
    rope: RopeParams | None = None,
    sm_scale: float | None = None,
    logits_soft_cap: float | None = None,
    backend: str = "auto",
) -> tuple[jax.Array, KVCache]:
    """One attention layer's prefill of ``T`` new tokens per request, ``chunk_size`` at a time.

    For each chunk (one jitted program per chunk length): write its keys and values into the pages (rotating q and k first when
    ``rope`` is given: ``paged.rope_append_kv``; else ``paged.append_kv``), then attend with
    ``paged.decode_attention`` and a ``[B, L, H, D]`` query over the truncated table. The result
    does not depend on ``chunk_size`` (up to the float rounding of differently batched sums).

    Args:
      q: ``[B, T, Hq, D]`` the new tokens' queries.
      k, v: ``[B, T, Hkv, D]`` their keys and values.
      cache: the KV pool; earlier tokens (a prefix) already written.
      page_table: concrete table after the prompt (it covers all ``T`` tokens).
      chunk_size: tokens per chunk, ``>= 1``.
      rope: rotate q and k by their positions (``seq_len - T + t``), or None for no rotation.
      sm_scale, logits_soft_cap, backend: as ``paged.decode_attention`` (``backend`` also goes
        to ``rope_append_kv``).

    Returns:
      ``(o [B, T, Hq, D] in q's dtype, the cache with the prompt's keys and values)``.

    Raises:
      ValueError: for shapes unlike ``[B, T, H, D]``, a batch unlike the table's, everything
        ``prefill_chunks`` rejects, and what the append and attention reject.

    Example:
      >>> from paged.kv_cache import new_kv_cache
      >>> cache = new_kv_cache(4, 4, 1, 8, jnp.float32)
      >>> table = PageTable.from_seq_lens([6], page_size=4)
      >>> x = jnp.ones((1, 6, 1, 8))
      >>> o, cache = prefill_attention(x, x, x, cache, table, chunk_size=4, backend="reference")
      >>> o.shape
      (1, 6, 1, 8)
    """
    if q.ndim != 4:
        raise ValueError(f"q must have shape [batch, T, num_q_heads, head_dim], got {q.shape}")
    batch, length = q.shape[:2]
    for name, array in [("k", k), ("v", v)]:
        if array.ndim != 4 or array.shape[:2] != (batch, length):
            raise ValueError(
                f"{name} must have shape [batch, T, num_kv_heads, head_dim] with q's "
                f"(batch, T)={(batch, length)}, got {array.shape}"
            )
    if page_table.batch_size != batch:
        raise ValueError(f"q has {batch} requests but page_table describes {page_table.batch_size}")
    validate_kv_cache(cache)
    validate_page_table(page_table, cache.num_pages)  # values too: the chunks run under jit
    outputs = []
    for chunk in prefill_chunks(page_table, length, chunk_size):
        o, cache = _prefill_chunk(
            q[:, chunk.start : chunk.stop],
            k[:, chunk.start : chunk.stop],
            v[:, chunk.start : chunk.stop],
            cache,
            chunk.page_table,
            rope=rope,
            sm_scale=sm_scale,
            logits_soft_cap=logits_soft_cap,
            backend=backend,
        )
        outputs.append(o)
    return jnp.concatenate(outputs, axis=1), cache
