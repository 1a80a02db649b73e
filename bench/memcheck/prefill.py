"""A small prefill workload to run under NVIDIA compute-sanitizer (memcheck) on a GPU.

    XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false \\
        compute-sanitizer --tool memcheck python -m bench.memcheck.prefill

Runs of more than 16 new tokens go to the prefill kernel (``kernels_pallas/paged_prefill.py``)
through ``paged.decode_attention``. Interpret mode cannot show an out-of-bounds access; here
every array has its own allocation (the platform allocator), so a read past one is reported.
The workload covers what could go out of bounds: a prompt exactly as long as its run (no
prefix), runs that end mid-page and on a page boundary, a run not a multiple of the query
block (the last block masked), both layouts, and ``page_indices`` sized exactly to the pages in
use. The outputs are compared with the reference on the CPU.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import paged
from bench.memcheck.decode import random_cache
from paged.attention_reference import decode_attention_reference


def main() -> int:
    rng = np.random.default_rng(0)
    new_tokens = 40  # > 16: the prefill kernel; not a multiple of its 16-token query blocks
    lens = [40, 41, 64, 300, 1000]  # every request's last 40 tokens are the new ones
    page_size, num_kv_heads, group, head_dim = 16, 8, 4, 128
    num_pages = sum(-(-n // page_size) for n in lens)
    table = paged.PageTable.from_seq_lens(
        lens, page_size, pages=rng.permutation(num_pages).tolist(), num_indices=num_pages
    )
    cpu = jax.devices("cpu")[0]
    worst = 0.0
    for layout in ("HND", "NHD"):
        cache = random_cache(rng, num_pages, page_size, num_kv_heads, head_dim, layout)
        q = jnp.asarray(
            rng.standard_normal((len(lens), new_tokens, num_kv_heads * group, head_dim)),
            jnp.bfloat16,
        )
        expected, _ = decode_attention_reference(
            jax.device_put(q, cpu),
            jax.device_put(cache, cpu),
            jax.device_put(table, cpu),
            sm_scale=head_dim**-0.5,
        )
        for soft_cap in (None, 30.0):
            if soft_cap is not None:
                expected, _ = decode_attention_reference(
                    jax.device_put(q, cpu),
                    jax.device_put(cache, cpu),
                    jax.device_put(table, cpu),
                    sm_scale=head_dim**-0.5,
                    logits_soft_cap=soft_cap,
                )
            out = paged.decode_attention(
                q, cache, table, logits_soft_cap=soft_cap, backend="pallas"
            )
            out = np.asarray(out.astype(jnp.float32))
            error = np.linalg.norm(out - np.asarray(expected)) / np.linalg.norm(expected)
            worst = max(worst, float(error))
            print(f"{layout} soft_cap={soft_cap} relative error {error:.2e}", flush=True)
    print(f"device {jax.devices()[0].device_kind}; worst relative error {worst:.2e}")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
