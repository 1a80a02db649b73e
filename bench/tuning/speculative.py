"""A launch-parameter sweep of the speculative kernel at the target case (B=64, n=4, vocab
128256): ``python -m bench.tuning.speculative`` times ``chain_speculative_sample`` on the suite's
own rotating sets for each (block, warps, prefetch) and prints the table, best first. The suite's
``decodelab`` arm runs the defaults of ``kernels_pallas/spec_accept.py``; this picks them."""

from __future__ import annotations

import jax

from bench.harness import RunOptions, SetsInTurnLoop
from bench.suites import speculative as suite
from kernels_pallas import rng
from kernels_pallas.spec_accept import chain_speculative_sample
from speculative import api, reference

BATCH, NUM_DRAFTS = 64, 4
# (block, warps, prefetch): the 2026-12-01 sweep over block and warps chose 1024 and 4; this
# one asks whether issuing each block's loads a block early (row_select.fold_blocks) pays.
VARIANTS = [
    (1024, 4, False),
    (1024, 4, True),
    (2048, 4, True),
    (2048, 8, True),
    (512, 4, True),
    (4096, 8, True),
]


def main() -> None:
    sets = suite.make_sets(BATCH, NUM_DRAFTS, suite.VOCAB, RunOptions())
    rows = []
    for block, warps, prefetch in VARIANTS:

        def call(set_operands, round_index, block=block, warps=warps, prefetch=prefetch):
            target, draft, tokens, key = set_operands
            words = rng.row_keys(jax.random.fold_in(key, round_index), BATCH)
            return chain_speculative_sample(
                draft,
                tokens,
                target,
                words,
                chunk_size=reference.DEFAULT_CHUNK_SIZE,
                stream=api.SPECULATIVE_STREAM,
                block=block,
                num_warps=warps,
                prefetch=prefetch,
            )

        timing = SetsInTurnLoop(call, sets.operands).time(expected_us_per_call=40.0)
        ceiling_share = sets.expected_bytes / (4.287e12 * timing.median_us * 1e-6)
        rows.append((timing.median_us, block, warps, prefetch, ceiling_share))
        print(
            f"block {block:5d} warps {warps} prefetch {prefetch}: {timing.median_us:7.2f} us",
            flush=True,
        )
    print("best first (us, block, warps, prefetch, share of a 4.287 TB/s ceiling):")
    for row in sorted(rows):
        print(f"  {row[0]:7.2f} us  block {row[1]:5d}  warps {row[2]}  {row[3]!s:5}  {row[4]:.1%}")


if __name__ == "__main__":
    main()
