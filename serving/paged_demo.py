"""The paged-cache demonstration (``python -m serving paged-demo``): pool, table, append, attention.

A ragged batch of requests gets pages from a ``PagePool`` (scattered, since earlier
requests come and go), their keys and values are appended into a paged ``KVCache``, and one
decode step of attention runs through the public ``paged.decode_attention``. The result is
checked against dense attention in float64 over the same tokens, gathered on the host.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import paged
from kernels_pallas.platform import resolve_backend

SEQ_LENS = (1, 16, 17, 100, 0, 300)  # one token, a full page, a page plus one, long, empty
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, NUM_POOL_PAGES = 8, 2, 64, 16, 64


def dense_attention_float64(q, keys_per_request, values_per_request, sm_scale):
    """Per request: softmax(q k^T * scale) v in float64, GQA by repeating KV heads."""
    outputs = []
    group = q.shape[1] // NUM_KV_HEADS
    for b, (k, v) in enumerate(zip(keys_per_request, values_per_request, strict=True)):
        if k.shape[0] == 0:
            outputs.append(np.zeros(q.shape[1:]))
            continue
        k = np.repeat(k, group, axis=1)  # [T, H, D]
        v = np.repeat(v, group, axis=1)
        logits = np.einsum("hd,thd->ht", q[b], k) * sm_scale
        weights = np.exp(logits - logits.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        outputs.append(np.einsum("ht,thd->hd", weights, v))
    return np.stack(outputs)


def device_description() -> str:
    """Where JAX runs: the platform, and the device's kind where it says more (``"gpu (NVIDIA
    H200)"``; a CPU's kind is ``"cpu"`` again, so just ``"cpu"``)."""
    platform, kind = jax.default_backend(), jax.devices()[0].device_kind
    return platform if kind.lower() == platform.lower() else f"{platform} ({kind})"


def run_paged_demo(seed: int = 0, backend: str = "auto") -> int:
    """Runs the demonstration; returns the exit status (0 when the output checked out)."""
    rng = np.random.default_rng(seed)
    print(f"decodelab paged KV cache demo on {device_description()}")

    # Pages come from a pool in which earlier requests have come and gone, so they scatter.
    pool = paged.PagePool(NUM_POOL_PAGES)
    churn = pool.allocate(NUM_POOL_PAGES // 2)
    pool.free(churn[::2])
    pages_needed = [-(-n // PAGE_SIZE) for n in SEQ_LENS]
    page_lists = [pool.allocate(n) for n in pages_needed]
    table = paged.PageTable.from_page_lists(page_lists, SEQ_LENS, PAGE_SIZE)
    print(f"\nrequests' lengths     {list(SEQ_LENS)}")
    print(f"page_indptr           {table.page_indptr.tolist()}")
    used = int(table.page_indptr[-1])
    print(
        f"page_indices          {table.page_indices[:used].tolist()} "
        f"(+{table.page_indices.shape[0] - used} padding)"
    )
    print(f"last_page_len         {table.last_page_len.tolist()}")
    print(f"pool pages free       {pool.num_free} of {NUM_POOL_PAGES}")

    # Append every request's tokens (a prefill, one token per row) into the cache.
    dtype = jnp.bfloat16
    cache = paged.new_kv_cache(NUM_POOL_PAGES, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype)
    batch_indices = np.concatenate([np.full(n, b) for b, n in enumerate(SEQ_LENS)]).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in SEQ_LENS]).astype(np.int32)
    total = len(positions)
    k_new = rng.standard_normal((total, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    v_new = rng.standard_normal((total, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    cache = paged.append_kv(
        cache,
        table,
        jnp.asarray(k_new, dtype),
        jnp.asarray(v_new, dtype),
        jnp.asarray(batch_indices),
        jnp.asarray(positions),
    )

    q = jnp.asarray(rng.standard_normal((len(SEQ_LENS), NUM_Q_HEADS, HEAD_DIM)), dtype)
    chosen = resolve_backend(backend)
    decode = jax.jit(
        lambda q, cache, table: paged.decode_attention(
            q, cache, table, return_lse=True, backend=backend
        )
    )
    out, lse = decode(q, cache, table)
    out.block_until_ready()
    start = time.perf_counter()
    out, lse = decode(q, cache, table)
    out.block_until_ready()
    elapsed_us = (time.perf_counter() - start) * 1e6

    # Oracle: the bf16-rounded keys/values each request wrote, in order, attended in float64.
    k_rounded = np.asarray(jnp.asarray(k_new, dtype).astype(jnp.float32), np.float64)
    v_rounded = np.asarray(jnp.asarray(v_new, dtype).astype(jnp.float32), np.float64)
    starts = np.concatenate([[0], np.cumsum(SEQ_LENS)])
    keys = [k_rounded[starts[b] : starts[b + 1]] for b in range(len(SEQ_LENS))]
    values = [v_rounded[starts[b] : starts[b + 1]] for b in range(len(SEQ_LENS))]
    q64 = np.asarray(q.astype(jnp.float32), np.float64)
    expected = dense_attention_float64(q64, keys, values, 1.0 / np.sqrt(HEAD_DIM))
    got = np.asarray(out.astype(jnp.float32), np.float64)
    error = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    empty = [b for b, n in enumerate(SEQ_LENS) if n == 0]

    print(f"\ndecode_attention backend: {chosen}  (requested {backend!r})")
    print(f"output {tuple(out.shape)} {out.dtype}, one call {elapsed_us:.0f} us (host clock)")
    print(f"relative L2 error vs dense float64 attention: {error:.2e} (bfloat16 bound 1e-2)")
    print(
        f"empty request(s) {empty}: output all zero = {bool(np.all(got[empty] == 0))}, "
        f"lse = {np.asarray(lse)[empty, 0].tolist()}"
    )
    ok = error < 1e-2 and bool(np.all(np.isfinite(got)))
    print("OK" if ok else "FAILED")
    return 0 if ok else 1
