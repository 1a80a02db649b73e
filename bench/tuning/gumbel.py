"""Checks and tunes the Gumbel-max kernel on a GPU: ``python -m bench.tuning.gumbel``.

At vocab 128256, float32 logits, batch 256, 128, 64, 32 and 1 (``--batches``):

1. agreement with the reference (``sample_from_logits(backend="reference")``) for the same
   keys: the share of rows whose token differs, with and without ``fast_math`` (only float
   rounding of a near-tie may flip one: the bits are the same, ``lg2.approx`` moves the noise by
   about ``2**-20``);
2. the time of each launch variant (``quads`` x ``chunks a row`` x ``num_warps`` x
   ``fast_math``), the public API on both backends (where ``backend="auto"`` should switch), cold L2 and dispatch amortized (``bench/probes/gumbel.time_arm``), beside
   ``jnp.argmax`` alone (the read floor) and ``jax.random.categorical``.

It prints a line a variant and a table of the best variants last, and writes everything to
``$OUT/gumbel-tuning.json``. The kernel's defaults (``kernels_pallas/gumbel.DEFAULT_LAUNCH``)
come from this table; the committed speed figures from ``python -m bench sampling``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from bench.probes import gumbel as gumbel_probe
from kernels_pallas import rng
from kernels_pallas.gumbel import gumbel_sample
from sampling import api

VOCAB = 128256
CHECK_ROWS = 256
# (quads, chunks a row, num_warps, fast_math) per batch; the first of each is the default.
VARIANTS = {
    256: [(256, 8, 4, True), (512, 4, 8, True), (256, 16, 4, True), (256, 8, 4, False)],
    128: [(256, 8, 4, True), (256, 16, 4, True)],
    64: [(256, 16, 4, True), (256, 32, 4, True)],
    32: [(256, 32, 4, True), (256, 64, 4, True), (512, 16, 4, True), (256, 32, 4, False)],
    1: [(256, 126, 4, True), (128, 251, 2, True), (64, 501, 2, True)],
}


def steps_for(quads: int, chunks: int) -> int:
    return pl.cdiv(pl.cdiv(VOCAB, 4 * quads), chunks)


def check_agreement(fast_math: bool) -> dict:
    """Rows whose kernel token differs from the reference's, over ``CHECK_ROWS`` rows of three
    sets of logits (one key, rows derived in the kernel) at temperatures 1 and 0.7."""
    rows = differ = 0
    for seed in range(3):
        logits = jax.random.normal(jax.random.key(100 + seed), (CHECK_ROWS, VOCAB)) * 3.0
        key = jax.random.key(200 + seed)
        for temperature in (1.0, 0.7):
            expected = api.sample_from_logits(
                key, logits, temperature=temperature, backend="reference"
            )
            tokens = gumbel_sample(
                logits,
                rng.key_words(key),
                jnp.full((1,), temperature, jnp.float32),
                from_logits=True,
                stream=api.EXPONENTIAL_STREAM,
                fast_math=fast_math,
            )
            rows += CHECK_ROWS
            differ += int(np.sum(np.asarray(tokens) != np.asarray(expected)))
            assert bool(((np.asarray(tokens) >= 0) & (np.asarray(tokens) < VOCAB)).all())
    return {"fast_math": fast_math, "rows": rows, "differ": differ}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 128, 64, 32, 1])
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    arguments = parser.parse_args()
    results = {"agreement": [], "timings": []}
    for fast_math in (True, False):
        entry = check_agreement(fast_math)
        print(f"agreement fast_math={fast_math}: {entry['differ']} of {entry['rows']} rows differ")
        results["agreement"].append(entry)
    sys.stdout.flush()
    for batch in arguments.batches:
        sets, key, key0, key1 = gumbel_probe.rotating_logits(batch)
        words = jnp.stack([key0, key1], axis=1)
        arms = gumbel_probe.baseline_arms(key)
        arms["api_reference"] = lambda ops, r, key=key: api.sample_from_logits(
            jax.random.fold_in(key, r), ops[0], backend="reference"
        )
        arms["api_pallas_default"] = lambda ops, r, key=key: api.sample_from_logits(
            jax.random.fold_in(key, r), ops[0], backend="pallas"
        )
        for quads, chunks, warps, fast_math in VARIANTS.get(batch, []):
            name = f"q{quads} c{chunks} w{warps}{'' if fast_math else ' exact-math'}"
            arms[name] = lambda ops, r, q=quads, c=chunks, w=warps, f=fast_math, words=words: (
                gumbel_sample(
                    ops[0],
                    words ^ r.astype(jnp.uint32),
                    jnp.ones((1,), jnp.float32),
                    from_logits=True,
                    stream=api.EXPONENTIAL_STREAM,
                    quads=q,
                    steps=steps_for(q, c),
                    num_warps=w,
                    fast_math=f,
                )
            )
        for name, call in arms.items():
            results["timings"].append(gumbel_probe.time_arm(batch, name, call, sets))
        del sets
    with open(os.path.join(arguments.out, "gumbel-tuning.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\nbest per batch:")
    for batch in arguments.batches:
        rows = [r for r in results["timings"] if r["batch"] == batch and r["us"] is not None]
        for row in sorted(rows, key=lambda r: r["us"])[:6]:
            share = row["ceiling_us"] / row["us"] * 100
            print(f"B={batch:3d} {row['arm']:34s} {row['us']:8.2f} us {share:5.1f}%")


if __name__ == "__main__":
    main()
