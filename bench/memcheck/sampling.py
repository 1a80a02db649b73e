"""A small sampling workload to run under NVIDIA compute-sanitizer (memcheck) on a GPU.

    XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false \\
        compute-sanitizer --tool memcheck python -m bench.memcheck.sampling

The platform allocator gives every array its own allocation, so a read past a row's end is a
read past an allocation that memcheck reports. Every kernel of ``kernels_pallas/sampling.py``
runs compiled on rows that stress its bounds: a vocabulary that is not a multiple of the block
(the last block masked), a row of NaN, a row of zeros, a row with one positive token, exact ties,
and, for the dual-pivot kernel, ``max_rounds=0`` (every row through the fallback) beside the
default. Each result is checked to be a token inside the row (or a finite renormalized row for
rows with mass); the exit status is 1 if one is not.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import rng
from kernels_pallas.sampling import dual_pivot_sample, filter_rows, gumbel_sample
from sampling import api

VOCAB = 3001  # not a multiple of any block: the last block is masked


def stress_rows() -> np.ndarray:
    """float32 ``[6, VOCAB]`` probabilities: normal, NaN, zeros, one token, ties, tiny."""
    generator = np.random.default_rng(0)
    logits = generator.standard_normal((6, VOCAB)) * 3
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    probs[1] = np.nan
    probs[2] = 0.0
    probs[3] = 0.0
    probs[3, VOCAB - 1] = 1.0  # the only token is the row's last column
    probs[4] = 1.0 / VOCAB  # every token tied
    probs[5] = np.float32(1e-30)
    return probs.astype(np.float32)


def main() -> int:
    probs = jnp.asarray(stress_rows())
    logits = jnp.log(probs)
    batch = probs.shape[0]
    words = rng.row_keys(jax.random.key(0), batch)
    failures = []

    def check_tokens(name, tokens):
        tokens = np.asarray(tokens)
        ok = bool(((tokens >= 0) & (tokens < VOCAB)).all())
        print(f"{name}: tokens {tokens.tolist()} {'ok' if ok else 'OUT OF RANGE'}")
        if not ok:
            failures.append(name)

    for from_logits, values in ((True, logits), (False, probs)):
        # One chunk a row (the token written by the kernel), several chunks merged by XLA,
        # one key (row keys derived in the kernel) and per-row keys.
        for quads, steps, key_words in (
            (256, 3, words),
            (64, 2, rng.key_words(jax.random.key(0))),
            (64, 3, words),
        ):
            check_tokens(
                f"gumbel from_logits={from_logits} q{quads}x{steps} keys{list(key_words.shape)}",
                gumbel_sample(
                    values,
                    key_words,
                    jnp.ones((1,), jnp.float32),
                    from_logits=from_logits,
                    stream=api.EXPONENTIAL_STREAM,
                    quads=quads,
                    steps=steps,
                ),
            )
    parameters = (
        jnp.array([50, 1, VOCAB, 7, 3, VOCAB], jnp.int32),
        jnp.array([0.9, 1.0, 0.5, 0.3, 0.5, 1.0], jnp.float32),
        jnp.array([0.0, 0.1, 0.0, 0.2, 0.0, 0.5], jnp.float32),
    )
    for order in ("joint", "top_k_first"):
        for max_rounds in (32, 0):
            for block, warps in ((8192, 16), (1024, 4)):
                tokens, rounds = dual_pivot_sample(
                    probs,
                    words,
                    *parameters,
                    order=order,
                    max_rounds=max_rounds,
                    stream=api.ROUND_STREAM,
                    block=block,
                    num_warps=warps,
                )
                check_tokens(
                    f"dual_pivot {order} max_rounds={max_rounds} block={block} "
                    f"rounds={np.asarray(rounds).tolist()}",
                    tokens,
                )
    for mode, values, parameter in (
        ("top_k_renorm", probs, parameters[0]),
        ("top_p_renorm", probs, parameters[1]),
        ("top_k_mask", logits, parameters[0]),
    ):
        for block in (2048, 512):
            out = np.asarray(filter_rows(values, parameter, mode=mode, block=block))
            # Rows 0, 4 and 5 have positive finite mass: their output must be finite somewhere.
            ok = all(np.isfinite(out[row]).any() for row in (0, 4, 5))
            print(f"{mode} block={block}: {'ok' if ok else 'NOT FINITE'}")
            if not ok:
                failures.append(mode)
    print("FAILURES: " + ", ".join(failures) if failures else "all results in range")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
