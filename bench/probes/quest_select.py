"""Probe: the Quest selection kernel (``kernels_pallas/quest_select.py``) on the H200, checked
against and timed beside the reference ``paged.sparse_quest.quest_selected_pages`` (issue 19).

Cases: B requests of ``--context`` tokens (default 32768), page 16 (2048 pages a request),
``R = 8`` rows (``per="kv_head"``) and ``R = 32`` (``per="query_head"``), a budget of
``--budget`` tokens (default 2048: 128 pages kept). Scores are integers drawn from a small
range, so ties are common, as float32 in the reference's ``[B, R, nnz_padded]`` format. Arms:
``reference`` (the jitted reference: a lexsort a row) and ``kernel.b<block>`` for a few blocks.
The whole public call is timed, with the suite's method (``bench.harness.timing.TimedLoop``):
for the kernel that includes the wrapper's zero padding of the ``[B * R, nnz_padded]`` scores
and the final ownership select, both over the reference format's ``B`` times larger array.
The scores stay in L2 between calls (at most 16 MiB), as they would straight after the scoring
kernel; the call rotates over ``--sets`` copies of the page table's ``indptr`` (equal values),
only so that no call can be hoisted out of the timing loop. Every arm's selection is first
compared with the reference's, bit for bit; an arm that fails to compile is reported and
skipped.

Usage (GPU): ``PYTHONPATH=. python3 -m bench.probes.quest_select`` (``--batches 1,8``).
``--smoke`` runs one tiny case in Pallas interpret mode on a CPU: the checks and the code
paths, no figures.
"""

from __future__ import annotations

import argparse
import math

import jax.numpy as jnp
import numpy as np

from bench.harness.timing import TimedLoop, expected_us
from kernels_pallas.quest_select import quest_selected_pages_pallas
from paged.page_table import PageTable
from paged.sparse_quest import quest_selected_pages

PAGE_SIZE = 16
ROWS = (8, 32)  # KV heads (per="kv_head") and query heads (per="query_head") of a Llama-8B
BLOCKS = (512, 1024, 2048)


def make_case(batch, context, rows, num_sets, *, seed=0):
    """Operands ``(scores [B, R, nnz], indptrs [num_sets, B + 1], indices, last_page_len)``."""
    pages_per_request = math.ceil(context / PAGE_SIZE)
    nnz = batch * pages_per_request
    rng = np.random.default_rng(seed)
    scores = rng.integers(-500, 500, (batch, rows, nnz)).astype(np.float32)
    indptr = np.arange(batch + 1, dtype=np.int32) * pages_per_request
    indptrs = np.tile(indptr, (num_sets, 1))
    indices = np.arange(nnz, dtype=np.int32)
    last = np.full(batch, context - (pages_per_request - 1) * PAGE_SIZE, np.int32)
    return tuple(jnp.asarray(a) for a in (scores, indptrs, indices, last))


def select_step(arm, token_budget, interpret):
    def step(set_index, operands):
        scores, indptrs, indices, last = operands
        table = PageTable(indptrs[set_index], indices, last, PAGE_SIZE)
        if arm == "reference":
            return quest_selected_pages(scores, table, token_budget)
        return quest_selected_pages_pallas(
            scores, table, token_budget, block=arm, interpret=interpret
        )

    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--sets", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="tiny case, interpreted, no timing")
    args = parser.parse_args(argv)
    interpret = args.smoke
    batches = [2] if args.smoke else [int(b) for b in args.batches.split(",")]
    context = 1000 if args.smoke else args.context
    budget = 256 if args.smoke else args.budget
    blocks = (32,) if args.smoke else BLOCKS
    num_sets = 1 if args.smoke else args.sets
    failures = 0
    for batch in batches:
        for rows in (ROWS[0],) if args.smoke else ROWS:
            operands = make_case(batch, context, rows, num_sets)
            reference = None
            for arm in ["reference", *blocks]:
                loop = TimedLoop(select_step(arm, budget, interpret), num_sets, operands)
                label = arm if arm == "reference" else f"kernel.b{arm}"
                name = f"B={batch} R={rows:>2} {label:>14}"
                try:
                    kept = np.asarray(loop.output(0))
                except Exception as error:  # a launch that does not compile is a result
                    print(f"{name} FAILED {str(error).splitlines()[0][:200]}", flush=True)
                    failures += 1
                    continue
                if reference is None:
                    reference = kept
                elif not np.array_equal(kept, reference):
                    print(f"{name} MISMATCH {np.sum(kept != reference)} entries differ")
                    failures += 1
                    continue
                if args.smoke:
                    print(f"{name} ok", flush=True)
                    continue
                scores_bytes = operands[0].size * 4
                timing = loop.time(expected_us_per_call=expected_us(scores_bytes, 1.0))
                print(f"{name} {timing.median_us:9.2f} us", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
