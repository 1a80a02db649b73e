"""Why the dual-pivot sampler's speedup shrinks at the serving call site: its input.

The serving suite (``bench/suites/serving.py``) times the sampler twice: alone, on synthetic
logits (``LOGITS_SCALE`` x standard normal, the sampling suite's inputs), and at the call site,
on the logits of the benchmark's random-weight model. Dual-pivot rejection takes more rounds the
flatter the distribution is (each round rejects what lies outside the kept set; with top-k 50 on
a flat row of 128256 tokens almost all the mass is outside). The reference costs the same
whatever the distribution: one sort, then ``max_rounds`` rounds in a ``fori_loop`` whatever
round decided. So if the model's logits are flatter than the synthetic ones,
the kernel's op-level speedup shrinks at the call site while the reference's cost does not move.

This probe counts the rounds on both inputs with the reference's own round logic (exact, no
timing; it runs on a CPU in about a minute): the model is ``serving.config.llama3_8b_like`` with
the suite's layer count, dtype and seed, fed random prompts; the sampler gets the suite's
temperature, top-k and top-p.

Usage: ``python -m bench.probes.rounds [--out FILE.json]``; prints one line per input.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import sampling
import speculative
from bench.suites import serving as serving_suite
from serving import config as config_lib
from serving import model as model_lib

BATCH, PROMPT_TOKENS, LAST_POSITIONS = 4, 64, 16  # 64 rows of model logits
NUM_KEYS = 16  # draws per row


def rounds_on(logits: np.ndarray) -> dict:
    """Rounds of ``sampling.filtered_sample`` (reference backend, the suite's filters) over
    ``NUM_KEYS`` keys for each row of ``logits[R, V]``, and the rows' shape."""
    rows = jnp.asarray(logits, jnp.float32)
    temperature = jnp.full((rows.shape[0],), serving_suite.TEMPERATURE, jnp.float32)
    probs = speculative.tempered_probs(rows, temperature)
    # probs is an argument, not a closed-over constant: XLA would fold a 32 MB constant.
    draw = jax.jit(
        lambda key, probs: sampling.filtered_sample(
            key,
            probs,
            top_k=serving_suite.TOP_K,
            top_p=serving_suite.TOP_P,
            return_rounds=True,
            backend="reference",
        )[1]
    )
    rounds = np.concatenate(
        [np.asarray(draw(jax.random.key(100 + s), probs)) for s in range(NUM_KEYS)]
    )
    ordered = -np.sort(-np.asarray(probs, np.float64), axis=-1)
    return {
        "logit_std": float(np.std(logits)),
        "rounds_mean": float(rounds.mean()),
        "rounds_max": int(rounds.max()),
        "max_prob_median": float(np.median(ordered[:, 0])),
        "top_k_mass_median": float(np.median(ordered[:, : serving_suite.TOP_K].sum(-1))),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.rounds", description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    config = config_lib.llama3_8b_like(serving_suite.NUM_LAYERS, "bfloat16")
    params = model_lib.init_params(config, jax.random.key(serving_suite.SEED))
    prompts = np.random.default_rng(0).integers(0, config.vocab_size, (BATCH, PROMPT_TOKENS))
    logits = model_lib.forward_dense(params, config, jnp.asarray(prompts, jnp.int32))
    model_rows = np.asarray(logits[:, -LAST_POSITIONS:, :]).reshape(-1, config.vocab_size)
    del params, logits
    synthetic = serving_suite.LOGITS_SCALE * np.asarray(
        jax.random.normal(jax.random.key(serving_suite.SEED), model_rows.shape, jnp.float32)
    )
    results = {
        "model_logits": rounds_on(model_rows),
        "op_level_synthetic_logits": rounds_on(synthetic),
        "filters": {"temperature": serving_suite.TEMPERATURE, "top_k": serving_suite.TOP_K},
        "rows": int(model_rows.shape[0]),
        "keys_per_row": NUM_KEYS,
    }
    results["filters"]["top_p"] = serving_suite.TOP_P
    for name in ("model_logits", "op_level_synthetic_logits"):
        row = results[name]
        print(
            f"{name}: logit std {row['logit_std']:.3f}, rounds mean {row['rounds_mean']:.3f} "
            f"max {row['rounds_max']}, max prob median {row['max_prob_median']:.2e}, "
            f"top-{serving_suite.TOP_K} mass median {row['top_k_mass_median']:.4f}"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
