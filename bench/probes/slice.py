"""Does slicing a rotating set out of a stacked array cost a copy before a Pallas call?

``python -m bench.probes.slice`` times, at vocab 128256 and batch 256, the Gumbel kernel and the
dual-pivot kernel (top-p 0.9) two ways: on ``sets[i]`` sliced inside the timed loop (how
``bench/suites/sampling.py`` feeds them) and on one unsliced ``[B, V]`` array (131 MB, twice
the L2, so mostly cold anyway). A difference near the time of a ``B x V`` copy (about 62 us)
means the suite's kernel figures include XLA materializing the slice for the custom call.

Result (H200, 2026-11-30, commit d55ddd6): Gumbel 237.7 us sliced against 178.0 us unsliced,
dual-pivot top-p 226.1 against 169.4 us: the copy is real, and the suites now give each set its
own arrays (``bench.harness.timing.SetsInTurnLoop``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from bench.harness.timing import TimedLoop
from bench.suites import peers
from kernels_pallas import rng
from kernels_pallas.sampling import dual_pivot_sample, gumbel_sample
from sampling import api

BATCH, VOCAB, NUM_SETS = 256, 128256, 4


def main() -> None:
    logits_sets = peers.random_logits(jax.random.key(1), (NUM_SETS, BATCH, VOCAB))
    probs_sets = jax.jit(functools.partial(jax.nn.softmax, axis=-1))(logits_sets)
    words = rng.row_keys(jax.random.key(2), BATCH)
    ones = jnp.ones((BATCH,), jnp.float32)
    k = jnp.full((BATCH,), VOCAB, jnp.int32)
    p = jnp.full((BATCH,), 0.9, jnp.float32)
    m = jnp.zeros((BATCH,), jnp.float32)

    def gumbel(values):
        return gumbel_sample(values, words, ones, from_logits=True, stream=0)

    def top_p(values):
        return dual_pivot_sample(values, words, k, p, m, order="joint", max_rounds=32, stream=1)[0]

    for name, kernel, sets in (("gumbel", gumbel, logits_sets), ("top_p", top_p, probs_sets)):
        sliced = TimedLoop(lambda s, ops, kernel=kernel: kernel(ops[s]), NUM_SETS, sets)
        whole = TimedLoop(lambda s, ops, kernel=kernel: kernel(ops), 1, sets[0])
        for label, loop in (("sliced", sliced), ("unsliced", whole)):
            timing = loop.time(expected_us_per_call=200.0, repeats=3, target_seconds=0.1)
            print(f"{name:8s} {label:9s} {timing.median_us:8.1f} us", flush=True)
    print("api:", api.ROUND_STREAM)


if __name__ == "__main__":
    main()
