"""A small decode workload to run under NVIDIA compute-sanitizer (memcheck) on a GPU.

    XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false \\
        compute-sanitizer --tool memcheck python -m bench.memcheck.decode

The platform allocator gives every array its own allocation, so a read past the end of one is
a read past an allocation that memcheck reports, not a read into a neighbour inside JAX's pool.
The workload covers what could go out of bounds: ragged lengths (empty, one token, a page plus
one), a last page partly filled, chunks ending mid-step, the final request's output rows at the
end of the output array, padding work items, both layouts, split and unsplit plans, and a jitted
call on the device-built default plan. The page pool and ``page_indices`` are sized exactly to
the pages in use, so their last entries are read too.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import paged
from paged.attention_reference import decode_attention_reference


def random_cache(
    rng: np.random.Generator,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    layout: str,
) -> paged.KVCache:
    """A bfloat16 cache of ``num_pages`` pages of standard normal keys and values."""
    shape = (
        (num_pages, num_kv_heads, page_size, head_dim)
        if layout == "HND"
        else (num_pages, page_size, num_kv_heads, head_dim)
    )
    return paged.KVCache(
        jnp.asarray(rng.standard_normal(shape), jnp.bfloat16),
        jnp.asarray(rng.standard_normal(shape), jnp.bfloat16),
        layout,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the workload on ``backend`` (argument 1: ``pallas``, the default, or ``pallas_mgpu``)."""
    argv = sys.argv[1:] if argv is None else argv
    backend = argv[0] if argv else "pallas"
    if backend not in ("pallas", "pallas_mgpu"):
        raise SystemExit(f"backend must be 'pallas' or 'pallas_mgpu', got {backend!r}")
    rng = np.random.default_rng(0)
    lens = [0, 1, 17, 300, 33, 1000]
    page_size, num_kv_heads, group, head_dim = 16, 8, 4, 128
    num_pages = sum(-(-n // page_size) for n in lens)
    # page_indices exactly as long as the pages in use: a read past it is a read past the array.
    table = paged.PageTable.from_seq_lens(
        lens, page_size, pages=rng.permutation(num_pages).tolist(), num_indices=num_pages
    )
    worst = 0.0
    for layout in ("HND", "NHD"):
        cache = random_cache(rng, num_pages, page_size, num_kv_heads, head_dim, layout)
        q = jnp.asarray(
            rng.standard_normal((len(lens), num_kv_heads * group, head_dim)), jnp.bfloat16
        )
        # The Mosaic GPU kernel reads HND pages only; the library's own rule says which.
        refusal = paged.decode.mgpu_kernel_supports(q, cache) if backend == "pallas_mgpu" else None
        if refusal is not None:
            print(f"{layout} skipped: {refusal}", flush=True)
            continue
        # The reference runs on the CPU: under the sanitizer only the kernels under test should
        # run on the GPU (XLA's own GEMM autotuning there is slow enough to time out).
        cpu = jax.devices("cpu")[0]
        expected, _ = decode_attention_reference(
            jax.device_put(q, cpu),
            jax.device_put(cache, cpu),
            jax.device_put(table, cpu),
            sm_scale=head_dim**-0.5,
        )
        for fixed in (None, 3):
            for max_grid in (None, 1):
                if fixed and max_grid:
                    continue
                plan = paged.plan_decode(
                    table,
                    q.shape[1],
                    num_kv_heads,
                    head_dim,
                    fixed_split_pages=fixed,
                    max_grid=max_grid,
                )
                out = paged.decode_attention(q, cache, table, plan=plan, backend=backend)
                out = np.asarray(out.astype(jnp.float32))
                error = np.linalg.norm(out - np.asarray(expected)) / np.linalg.norm(expected)
                worst = max(worst, float(error))
                print(
                    f"{layout} fixed={fixed} max_grid={max_grid} write_final={plan.write_final}"
                    f" relative error {error:.2e}",
                    flush=True,
                )
        # Under jit the table is traced: the device-built default plan, unvalidated.
        traced = jax.jit(lambda q, c, t: paged.decode_attention(q, c, t, backend=backend))
        out = np.asarray(traced(q, cache, table).astype(jnp.float32))
        error = np.linalg.norm(out - np.asarray(expected)) / np.linalg.norm(expected)
        worst = max(worst, float(error))
        print(f"{layout} traced default plan relative error {error:.2e}", flush=True)
    device = jax.devices()[0].device_kind
    print(f"device {device}; backend {backend}; worst relative error {worst:.2e}")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
