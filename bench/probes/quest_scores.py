"""Probe: the Quest scoring kernel (``kernels_pallas/quest_scores.py``) on the H200, checked
against and timed beside the reference ``paged.sparse_quest.quest_page_scores`` (issue 19).

Cases: B requests of ``--context`` tokens (default 32768), page 16, 32 query and 8 KV heads,
head_dim 128, float32 bounds; pages scattered over a pool that holds ``num_sets`` rotating
tables (enough sets that their bounds exceed the L2 four times, so every call reads from HBM).
Arms: ``reference`` (the jitted reference) and ``kernel.i<pages_per_item>.s<num_stages>`` for a
few launches, each for ``per="kv_head"`` and ``per="query_head"``; the whole public call is
timed (the kernel plus the wrapper's work list and ``-inf`` placement), with the suite's method
(``bench.harness.timing.TimedLoop``). Every arm's scores are first compared with the
reference's (same ``-inf`` entries, largest difference relative to the largest finite score);
an arm that fails to compile is reported and skipped. The bandwidth column divides the bounds'
bytes, ``2 x nnz x KVH x D x 4``, by the time, and gives it as a share of the copy ceiling
measured at the start of the same run (``bench.harness.ceiling``), so on whichever GPU runs it.
(Before 2026-12-07 the share was of a fixed 4.8 TB/s, the H200's nominal bandwidth, even on an
H100.)

Usage (GPU): ``PYTHONPATH=. python3 -m bench.probes.quest_scores`` (``--batches 1,8``,
``--context 32768``). ``--smoke`` runs one tiny case in Mosaic GPU's interpret mode on a CPU:
the checks and the code paths, no figures.
"""

from __future__ import annotations

import argparse
import math
import time

import jax.numpy as jnp
import numpy as np

from bench.harness.ceiling import measure_copy_ceiling
from bench.harness.timing import TimedLoop, expected_us, num_rotating_sets
from kernels_pallas.quest_scores import quest_page_scores_pallas
from paged.page_table import PageTable
from paged.sparse_quest import PageKeyBounds, quest_page_scores

PAGE_SIZE = 16
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
# (pages_per_item, num_stages, row_padding); padded rows run interpreted only (their TMA
# destinations lie off 128 bytes: kernels_pallas/quest_scores.py), so every launch here has 0.
LAUNCHES = ((64, 2, 0), (128, 2, 0), (192, 2, 0), (128, 3, 0), (192, 1, 0))
MAX_RELATIVE_DIFFERENCE = 1e-5


def make_case(batch, context, *, max_sets=64, seed=0):
    """Operands ``(q, kmin, kmax, indices [num_sets, nnz], indptr, last_page_len)``."""
    pages_per_request = math.ceil(context / PAGE_SIZE)
    nnz = batch * pages_per_request
    bytes_per_set = 2 * nnz * NUM_KV_HEADS * HEAD_DIM * 4
    # At least two sets, as the suites rotate; ``max_sets=1`` (the interpreted smoke run, which
    # times nothing) caps it at one.
    num_sets = num_rotating_sets(bytes_per_set, max_sets=max_sets)
    num_pages = num_sets * nnz
    rng = np.random.default_rng(seed)
    kmin = rng.standard_normal((num_pages, NUM_KV_HEADS, HEAD_DIM), np.float32)
    kmax = kmin + np.abs(rng.standard_normal(kmin.shape, np.float32))
    indices = rng.permutation(num_pages).astype(np.int32).reshape(num_sets, nnz)
    indptr = np.arange(batch + 1, dtype=np.int32) * pages_per_request
    last = np.full(batch, context - (pages_per_request - 1) * PAGE_SIZE, np.int32)
    q = rng.standard_normal((batch, NUM_Q_HEADS, HEAD_DIM), np.float32)
    operands = tuple(jnp.asarray(a) for a in (q, kmin, kmax, indices, indptr, last))
    return operands, num_sets, bytes_per_set


def scores_step(arm, per, interpret):
    def step(set_index, operands):
        q, kmin, kmax, indices, indptr, last = operands
        table = PageTable(indptr, indices[set_index], last, PAGE_SIZE)
        bounds = PageKeyBounds(kmin, kmax)
        if arm == "reference":
            return quest_page_scores(q, bounds, table, per=per)
        pages_per_item, num_stages, row_padding = arm
        return quest_page_scores_pallas(
            q,
            bounds,
            table,
            per=per,
            pages_per_item=pages_per_item,
            num_stages=num_stages,
            row_padding=row_padding,
            interpret=interpret,
        )

    return step


def arm_name(arm):
    return arm if arm == "reference" else f"kernel.i{arm[0]}.s{arm[1]}.r{arm[2]}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--smoke", action="store_true", help="tiny case, interpreted, no timing")
    args = parser.parse_args(argv)
    interpret = args.smoke
    batches = [2] if args.smoke else [int(b) for b in args.batches.split(",")]
    context = 1000 if args.smoke else args.context
    launches = LAUNCHES[:1] if args.smoke else LAUNCHES
    if not args.smoke:
        start = time.perf_counter()
        ceiling = measure_copy_ceiling()
        print(
            f"copy ceiling {ceiling.tbps:.2f} TB/s {ceiling.by_method} "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    failures = 0
    for batch in batches:
        operands, num_sets, bytes_per_set = make_case(
            batch, context, max_sets=1 if args.smoke else 64
        )
        for per in ("kv_head", "query_head"):
            reference = None
            for arm in ["reference", *launches]:
                loop = TimedLoop(scores_step(arm, per, interpret), num_sets, operands)
                name = f"B={batch} {per:>10} {arm_name(arm):>18}"
                try:
                    scores = np.asarray(loop.output(0))
                except Exception as error:  # a launch that does not compile is a result
                    print(f"{name} FAILED {str(error).splitlines()[0][:200]}", flush=True)
                    failures += 1
                    continue
                if reference is None:
                    reference = scores
                else:
                    finite = np.isfinite(reference)
                    same_inf = np.array_equal(np.isneginf(scores), np.isneginf(reference))
                    scale = np.abs(reference[finite]).max(initial=1.0)
                    difference = np.abs(scores[finite] - reference[finite]).max(initial=0.0)
                    if not same_inf or difference > MAX_RELATIVE_DIFFERENCE * scale:
                        print(f"{name} MISMATCH -inf same: {same_inf}, diff {difference:.3g}")
                        failures += 1
                        continue
                if args.smoke:
                    print(f"{name} ok", flush=True)
                    continue
                timing = loop.time(expected_us_per_call=expected_us(bytes_per_set, 2.0))
                tbps = bytes_per_set / timing.median_us / 1e6
                print(
                    f"{name} {timing.median_us:9.2f} us  {tbps:5.2f} TB/s "
                    f"({100 * tbps / ceiling.tbps:4.1f}% of the {ceiling.tbps:.2f} ceiling)  "
                    f"{num_sets} sets",
                    flush=True,
                )
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
