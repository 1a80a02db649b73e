"""Tuned parameters of the paged decode kernel and its planner, by shape bucket.

A small data table, not logic. ``python -m bench decode --tune`` measures the candidates on the
GPU; the values below were chosen from its two sweeps of 2026-11-30 on one H200 (jax 0.11.2),
whose figures are in ``docs/benchmark_results/archive/2026-11-30-decode-tuning-1.json`` and
``-2.json``. A later autotuner will write this file.

Launch keys are ``(head_dim, group_rows, write_final, long_chunks)``:

- ``group_rows``: the query-head group padded to the 16-row tensor-core tile.
- ``write_final``: the plan does not split (each program streams a whole request and writes the
  final output) or splits (programs stream chunks and write partial states).
- ``long_chunks``: the plan's chunks hold more than ``LONG_CHUNK_PAGES`` pages. Short chunks
  finish in a few steps, so a smaller step (more programs resident per SM) pays off there.

What the sweep showed (median us, HND bfloat16, 32/8 heads, head_dim 128):

- one pipeline stage beat two or three in every case (Triton's software pipelining of the
  gathered page loads costs shared memory and occupancy here, and gained nothing);
- no split, long requests (B=32 x 4096): 8 pages a step, 4 warps (169.9; 4 pages: 191.2);
- no split, short requests (B=256 x 512): 4 pages a step, 4 warps (160.8; 8 pages: 168.8);
- split (B=1 x 32768, B=4 x 4096): 16 pages a step, 4 warps (60.4 and 36.4 for the kernel and
  merge; 8 pages: 71.2 and 36.9);
- loading the next step's page numbers one step ahead changed nothing measurable at 4 warps
  (within 1%), so the kernel does not do it;
- the planner's 2 programs per SM (FlashInfer's rule, 264 programs) beat 1 and 4 or tied.
"""

from __future__ import annotations

import functools

import jax

from kernels_pallas.paged_decode import dot_rows

H200_NUM_SMS = 132
LONG_CHUNK_PAGES = 32

DEFAULT_KERNEL = {"pages_per_step": 8, "num_warps": 4, "num_stages": 1}
KERNEL_TABLE: dict[tuple[int, int, bool, bool], dict[str, int]] = {
    (128, 16, True, True): {"pages_per_step": 8, "num_warps": 4, "num_stages": 1},
    (128, 16, True, False): {"pages_per_step": 4, "num_warps": 4, "num_stages": 1},
    (128, 16, False, True): {"pages_per_step": 16, "num_warps": 4, "num_stages": 1},
    (128, 16, False, False): {"pages_per_step": 16, "num_warps": 4, "num_stages": 1},
}

# Planner: programs per SM that fill the GPU, the smallest chunk worth splitting off, the
# static number of splits a traced (unplanned) call uses at most, and the most splits a request
# is cut into (0: no cap beyond the grid rule).
DEFAULT_PLANNER = {
    "blocks_per_sm": 2,
    "min_chunk_pages": 8,
    "max_traced_splits": 16,
    "max_splits_per_request": 0,
}
PLANNER_TABLE: dict[tuple[int, int], dict[str, int]] = {}
# The Mosaic GPU kernel (paged_decode_mgpu.py) at one request: measured on the H200
# (bench/probes/decode_overhead.py, 2026-12-02, docs/benchmark_results/2026-11-30-gpu-checks.md,
# "Thirteenth session"), kernel plus separate merge, B=1 x 32768: 16 splits 49.3 us, 33 (the grid
# rule's 264 programs) 56.9 us, 64 splits 64.5 us; B=1 x 4096: 16 splits 18.7 us, 32 splits
# 21.3 us. At B=4 the grid rule's 8 splits were already the fastest of 4, 8 and 16 (a cap of 16
# leaves them). The Triton kernel goes the other way at B=1 x 32768 (16 splits 0.84x the 33 of
# the grid rule, docs/benchmark_results/archive/2026-12-01-decode-80e3fb9.md), so the cap is the
# Mosaic GPU kernel's alone.
MGPU_PLANNER = {"max_splits_per_request": 16}


def group_rows(group_size: int) -> int:
    """The query-head group padded to the 16-row tensor-core tile, as the kernel pads it."""
    return dot_rows(group_size)


def is_long_chunk(chunk_pages: int | None) -> bool:
    """Whether a plan's chunks count as long (``> LONG_CHUNK_PAGES`` pages); an unknown chunk (a
    traced plan) counts as long."""
    return chunk_pages is None or chunk_pages > LONG_CHUNK_PAGES


def kernel_parameters(
    head_dim: int, group_size: int, write_final: bool, long_chunks: bool
) -> dict[str, int]:
    """Launch parameters for a shape bucket (the default where the table has no entry).

    Args:
      head_dim, group_size: the attention shape.
      write_final: whether the plan splits no request.
      long_chunks: whether the plan's chunks are long (``is_long_chunk``).

    Example:
      >>> kernel_parameters(128, 4, True, is_long_chunk(256))
      {'pages_per_step': 8, 'num_warps': 4, 'num_stages': 1}
    """
    key = (head_dim, group_rows(group_size), write_final, long_chunks)
    return {**DEFAULT_KERNEL, **KERNEL_TABLE.get(key, {})}


# Several new tokens a request (speculative verification): the query tile holds q_len x G rows,
# padded (``dot_rows``), so its float32 logits tile is rows x (pages_per_step x page_size). Not
# yet swept on a GPU; until it is, keep that tile no larger than the tuned one-token split
# launch's (16 rows x 16 pages of 16 slots), and give tiles of 128 rows and more 8 warps, so that
# the accumulator (rows x head_dim float32) is not spread over too few registers.
LOGIT_TILE_ELEMENTS = 16 * 16 * 16
MIN_BLOCK_TOKENS = 16  # a tensor-core dot needs at least 16 keys a step
WIDE_TILE_ROWS = 128


def multi_token_parameters(
    launch: dict[str, int], query_rows: int, page_size: int
) -> dict[str, int]:
    """Launch parameters for a query tile of ``query_rows = q_len x G`` rows, from those tuned
    for one new token (``launch``, e.g. a plan's). Unchanged for tiles of 16 rows.

    Example:
      >>> multi_token_parameters({"pages_per_step": 16, "num_warps": 4, "num_stages": 1}, 36, 16)
      {'pages_per_step': 4, 'num_warps': 4, 'num_stages': 1}
    """
    rows = dot_rows(query_rows)
    fitting_pages = max(
        LOGIT_TILE_ELEMENTS // (rows * page_size), -(-MIN_BLOCK_TOKENS // page_size)
    )
    pages_per_step = max(1, min(launch["pages_per_step"], fitting_pages))
    num_warps = max(launch["num_warps"], 8) if rows >= WIDE_TILE_ROWS else launch["num_warps"]
    return {**launch, "pages_per_step": pages_per_step, "num_warps": num_warps}


PLANNED_KERNELS = ("paged_decode", "paged_decode_mgpu")


def planner_parameters(
    head_dim: int, group_size: int, kernel: str = "paged_decode"
) -> dict[str, int]:
    """Planner parameters for a shape bucket and the kernel that will run the plan
    (``"paged_decode"``, the Triton kernel, or ``"paged_decode_mgpu"``, the Mosaic GPU one).

    Example:
      >>> planner_parameters(128, 4, "paged_decode_mgpu")["max_splits_per_request"]
      16
    """
    if kernel not in PLANNED_KERNELS:
        raise ValueError(f"kernel must be one of {PLANNED_KERNELS}, got {kernel!r}")
    params = {**DEFAULT_PLANNER, **PLANNER_TABLE.get((head_dim, group_rows(group_size)), {})}
    return {**params, **MGPU_PLANNER} if kernel == "paged_decode_mgpu" else params


@functools.cache
def num_sms() -> int:
    """Streaming multiprocessors of the default device (the H200's 132 where JAX cannot tell)."""
    device = jax.devices()[0]
    count = getattr(device, "core_count", None)
    return int(count) if device.platform == "gpu" and count else H200_NUM_SMS
