"""The independent float64 oracle for paged attention tests: plain NumPy, one request at a time.

Nothing here imports ``paged``'s attention code. A request's keys are gathered on the host, in
token order, by walking its page list as ``design.md`` defines it (token ``t`` lives in page
``page_list[t // page_size]``, slot ``t % page_size``); then attention is a textbook softmax in
float64. The paged reference instead masks a gather of every listed page; the two share no code,
so agreement means something.
"""

from __future__ import annotations

import numpy as np


def request_page_lists(page_indptr, page_indices, last_page_len, page_size: int):
    """Each request's pages and length, read from the raw CSR arrays (host-side).

    Returns:
      ``(page_lists, seq_lens)``: lists of page lists and of ints. Padding past
      ``page_indptr[-1]`` is ignored, as the format says.
    """
    indptr = np.asarray(page_indptr).tolist()
    indices = np.asarray(page_indices).tolist()
    last = np.asarray(last_page_len).tolist()
    page_lists, seq_lens = [], []
    for b in range(len(last)):
        pages = indices[indptr[b] : indptr[b + 1]]
        page_lists.append(pages)
        seq_lens.append(page_size * (len(pages) - 1) + last[b] if pages else 0)
    return page_lists, seq_lens


def gather_tokens(pages_array, layout: str, page_list, seq_len: int) -> np.ndarray:
    """float64 ``[seq_len, num_kv_heads, head_dim]``: one request's keys (or values) in order.

    Args:
      pages_array: ``k_pages`` or ``v_pages`` of the cache, in ``layout``.
      layout: ``"HND"`` (``[pages, heads, slots, dim]``) or ``"NHD"`` (``[pages, slots, heads,
        dim]``).
      page_list: the request's pages in token order.
      seq_len: its number of tokens.
    """
    # Through NumPy first: bfloat16 arrays become ml_dtypes arrays, which convert exactly.
    pages_array = np.asarray(pages_array).astype(np.float64)
    if layout == "HND":
        _, num_kv_heads, page_size, head_dim = pages_array.shape
    else:
        _, page_size, num_kv_heads, head_dim = pages_array.shape
    tokens = []
    for t in range(seq_len):
        page, slot = page_list[t // page_size], t % page_size
        tokens.append(pages_array[page, :, slot] if layout == "HND" else pages_array[page, slot])
    if not tokens:
        return np.zeros((0, num_kv_heads, head_dim))
    return np.stack(tokens)


def dense_attention(q, keys, values, *, sm_scale: float, logits_soft_cap: float | None = None):
    """Grouped-query attention of one query token over listed keys, in float64.

    Args:
      q: ``[H, D]``.
      keys, values: ``[T, KVH, D]``; query head ``h`` uses KV head ``h // (H // KVH)``.
      sm_scale: logit scale.
      logits_soft_cap: optional ``cap``: logits become ``cap * tanh(logit / cap)``.

    Returns:
      ``(o [H, D], lse [H])`` float64; for ``T = 0``, ``o = 0`` and ``lse = -inf``.
    """
    q = np.asarray(q, dtype=np.float64)
    keys = np.asarray(keys, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    num_heads, head_dim = q.shape
    num_tokens, num_kv_heads, _ = keys.shape
    if num_tokens == 0:
        return np.zeros((num_heads, head_dim)), np.full(num_heads, -np.inf)
    kv_head = np.arange(num_heads) // (num_heads // num_kv_heads)
    # [H, T]: logit of every query head against every key of its KV head.
    logits = np.einsum("hd,thd->ht", q, keys[:, kv_head, :]) * sm_scale
    if logits_soft_cap is not None:
        logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
    peak = logits.max(axis=1, keepdims=True)
    weights = np.exp(logits - peak)
    total = weights.sum(axis=1, keepdims=True)
    o = np.einsum("ht,thd->hd", weights / total, values[:, kv_head, :])
    return o, (peak + np.log(total))[:, 0]


def paged_attention_oracle(
    q, k_pages, v_pages, layout: str, page_table, *, sm_scale: float, logits_soft_cap=None
):
    """Decode attention of every request over its own tokens, gathered through its page list.

    Args:
      q: ``[B, H, D]``.
      k_pages, v_pages: the cache's pools in ``layout``.
      page_table: anything with ``page_indptr``, ``page_indices``, ``last_page_len`` and
        ``page_size`` (a ``paged.PageTable``; only its raw arrays are read).

    Returns:
      ``(o [B, H, D], lse [B, H])`` float64.
    """
    # One new token a request: the causal oracle with L = 1 (the token sees every key).
    o, lse = paged_causal_attention_oracle(
        np.asarray(q)[:, None],
        k_pages,
        v_pages,
        layout,
        page_table,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
    )
    return o[:, 0], lse[:, 0]


def merge_oracle(values, lses):
    """Merges attention states over disjoint key sets, in float64, the textbook way.

    Args:
      values: ``[S, ..., D]``, one partial output per state.
      lses: ``[S, ...]``, their log-sum-exps (``-inf`` for an empty state).

    Returns:
      ``(v [..., D], lse [...])``: ``v = sum_i e^{s_i - m} v_i / sum_i e^{s_i - m}`` and
      ``lse = m + log sum_i e^{s_i - m}`` with ``m = max_i s_i``; all-empty gives ``0, -inf``.
    """
    values = np.asarray(values, dtype=np.float64)
    lses = np.asarray(lses, dtype=np.float64)
    peak = lses.max(axis=0)
    finite_peak = np.where(np.isfinite(peak), peak, 0.0)
    weights = np.exp(lses - finite_peak)
    total = weights.sum(axis=0)
    nonempty = total > 0
    merged = np.einsum("s...,s...d->...d", weights, values)
    merged = np.where(nonempty[..., None], merged / np.where(nonempty, total, 1.0)[..., None], 0.0)
    lse = np.where(nonempty, finite_peak + np.log(np.where(nonempty, total, 1.0)), -np.inf)
    return merged, lse


def relative_error(out, ref) -> float:
    """``||out - ref|| / ||ref||`` in float64 (the absolute error where ``ref`` is 0).

    NaN anywhere in ``out`` makes the result NaN, and NaN fails every ``<`` bound.
    """
    out = np.asarray(out).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    scale = np.linalg.norm(ref)
    error = np.linalg.norm(out - ref)
    return float(error / scale) if scale > 0 else float(error)


def paged_causal_attention_oracle(
    q, k_pages, v_pages, layout: str, page_table, *, sm_scale: float, logits_soft_cap=None
):
    """Causal attention of every request's last ``L`` tokens over its own keys, in float64.

    Token ``l`` of request ``b`` (``seq_len`` tokens) sits at position ``seq_len - L + l`` and
    attends to the keys at positions ``0 .. seq_len - L + l``, gathered through its page list;
    a position below 0 (a request shorter than ``L``) sees no key.

    Args:
      q: ``[B, L, H, D]``.
      k_pages, v_pages: the cache's pools in ``layout``.
      page_table: anything with ``page_indptr``, ``page_indices``, ``last_page_len`` and
        ``page_size`` (only its raw arrays are read).

    Returns:
      ``(o [B, L, H, D], lse [B, L, H])`` float64; ``o = 0``, ``lse = -inf`` where no key is seen.
    """
    page_lists, seq_lens = request_page_lists(
        page_table.page_indptr,
        page_table.page_indices,
        page_table.last_page_len,
        page_table.page_size,
    )
    q = np.asarray(q).astype(np.float64)
    q_len = q.shape[1]
    outputs, lses = [], []
    for b, (page_list, seq_len) in enumerate(zip(page_lists, seq_lens, strict=True)):
        keys = gather_tokens(k_pages, layout, page_list, seq_len)
        values = gather_tokens(v_pages, layout, page_list, seq_len)
        request_o, request_lse = [], []
        for token in range(q_len):
            visible = max(0, seq_len - q_len + token + 1)
            o, lse = dense_attention(
                q[b, token],
                keys[:visible],
                values[:visible],
                sm_scale=sm_scale,
                logits_soft_cap=logits_soft_cap,
            )
            request_o.append(o)
            request_lse.append(lse)
        outputs.append(np.stack(request_o))
        lses.append(np.stack(request_lse))
    return np.stack(outputs), np.stack(lses)
