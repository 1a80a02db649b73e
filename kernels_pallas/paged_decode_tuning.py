"""Tuned parameters of the paged decode kernel and its planner, by shape bucket.

A small data table, not logic: the benchmark (``python -m bench decode --tune``) measures the
candidates on the GPU and the chosen values are recorded here with the report that chose them.
A later autotuner will write this file.

Kernel keys are ``(head_dim, group_rows, dtype_name, write_final)``: ``group_rows`` is the
query-head group padded to the 16-row tensor-core tile (``max(16, next_pow2(num_q_heads /
num_kv_heads))``), and ``write_final`` separates plans that split (short chunks, partials) from
plans that do not (whole requests, final outputs), which favour different step sizes.
"""

from __future__ import annotations

import functools

import jax

H200_NUM_SMS = 132

# Kernel launch parameters: pages loaded per loop step, warps per program, pipeline depth.
DEFAULT_KERNEL = {
    "pages_per_step": 8, "num_warps": 4, "num_stages": 1, "prefetch_page_indices": True,
}
KERNEL_TABLE: dict[tuple[int, int, str, bool], dict[str, int]] = {}

# Planner: programs per SM that fill the GPU, the smallest chunk worth splitting off, and the
# static number of splits a traced (unplanned) call uses at most.
DEFAULT_PLANNER = {"blocks_per_sm": 2, "min_chunk_pages": 8, "max_traced_splits": 16}
PLANNER_TABLE: dict[tuple[int, int], dict[str, int]] = {}


def group_rows(group_size: int) -> int:
    rows = 16
    while rows < group_size:
        rows *= 2
    return rows


def kernel_parameters(head_dim: int, group_size: int, dtype, write_final: bool) -> dict[str, int]:
    """Launch parameters for a shape bucket (the default where the table has no entry)."""
    key = (head_dim, group_rows(group_size), jax.numpy.dtype(dtype).name, write_final)
    return {**DEFAULT_KERNEL, **KERNEL_TABLE.get(key, {})}


def planner_parameters(head_dim: int, group_size: int) -> dict[str, int]:
    """Planner parameters for a shape bucket."""
    return {**DEFAULT_PLANNER, **PLANNER_TABLE.get((head_dim, group_rows(group_size)), {})}


@functools.cache
def num_sms() -> int:
    """Streaming multiprocessors of the default device (the H200's 132 where JAX cannot tell)."""
    device = jax.devices()[0]
    count = getattr(device, "core_count", None)
    return int(count) if device.platform == "gpu" and count else H200_NUM_SMS
