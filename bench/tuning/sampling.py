"""Checks and tunes the sampling kernels on a GPU: ``python -m bench.tuning.sampling [options]``.

For vocab 128256 and batch 1, 32 and 256 (``--batches``), float32, and each kernel of
``kernels_pallas/sampling.py``:

1. agreement with the reference for the same keys: the fraction of rows whose token differs
   (float32 summation order may flip a near-tie; ``kernels_pallas/dual_pivot.py``), and for the
   renorm and mask kernels the largest difference from the reference's output;
2. the time of each launch variant (``block`` x ``num_warps``), cold L2 and dispatch amortized
   as in ``bench/harness/timing.py``.

It prints one line a variant and a table of the best variants last, and writes everything to
``$OUT/sampling-tuning.json`` (or ``--out``). The committed defaults of the kernels come from
this table; the committed speed figures come from ``python -m bench sampling``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness.timing import TimedLoop, expected_us, num_rotating_sets
from bench.suites import peers
from kernels_pallas import rng
from kernels_pallas.sampling import dual_pivot_sample, filter_rows
from sampling import api
from sampling.reference import DEFAULT_MAX_ROUNDS

VOCAB = 128256
# (block, num_warps, num_stages, prefetch) of the dual-pivot kernel. The 2026-11-30 sweep
# settled block, warps and stages (stages changed nothing); this one asks whether issuing each
# block's loads a block early (row_select.fold_blocks) pays, and at which block.
FILTER_VARIANTS = (
    (8192, 16, 1, False),
    (8192, 16, 1, True),
    (4096, 16, 1, True),
    (4096, 8, 1, True),
    (2048, 8, 1, True),
)
RENORM_BLOCKS = (2048, 4096)
TARGET_SECONDS = 0.1  # per timed program: a tuning sweep trades precision for breadth
FILTERS = {
    "top_p": dict(top_p=0.9),
    "top_k": dict(top_k=50),
    "min_p": dict(min_p=0.1),
    "joint": dict(top_k=50, top_p=0.9),
    "top_k_first": dict(top_k=50, top_p=0.9, order="top_k_first"),
}
CHECK_BATCH = 64  # rows compared with the reference per case


def _params(batch: int, vocab: int, top_k=None, top_p=None, min_p=None, order="joint"):
    return (
        jnp.full((batch,), vocab if top_k is None else top_k, jnp.int32),
        jnp.full((batch,), 1.0 if top_p is None else top_p, jnp.float32),
        jnp.full((batch,), 0.0 if min_p is None else min_p, jnp.float32),
        order,
    )


def check_agreement(probs, logits, keys) -> dict:
    """Mismatch rates against the reference on ``CHECK_BATCH`` rows (per-row keys)."""
    found = {}
    for name, parameters in FILTERS.items():
        sampler = functools.partial(api.filtered_sample, keys, probs, **parameters)
        ours, rounds = sampler(backend="pallas", return_rounds=True)
        theirs, their_rounds = sampler(backend="reference", return_rounds=True)
        found[name] = dict(
            mismatch=float(np.mean(np.asarray(ours) != np.asarray(theirs))),
            rounds_mismatch=float(np.mean(np.asarray(rounds) != np.asarray(their_rounds))),
            rounds_mean=float(np.mean(np.asarray(rounds))),
            rounds_max=int(np.max(np.asarray(rounds))),
        )
    for name, function, values, parameter in (
        ("top_k_renorm", api.top_k_renorm_probs, probs, 50),
        ("top_p_renorm", api.top_p_renorm_probs, probs, 0.9),
        ("top_k_mask", api.top_k_mask_logits, logits, 50),
    ):
        ours = np.asarray(function(values, parameter, backend="pallas"))
        theirs = np.asarray(function(values, parameter, backend="reference"))
        kept_differs = np.mean(
            np.isfinite(ours) & (ours != 0) != (np.isfinite(theirs) & (theirs != 0))
        )
        finite = np.isfinite(ours) & np.isfinite(theirs)
        found[name] = dict(
            kept_set_mismatch=float(kept_differs),
            max_abs_difference=float(np.max(np.abs(ours[finite] - theirs[finite]), initial=0.0)),
        )
    for name, function, values in (
        ("gumbel_logits", api.sample_from_logits, logits),
        ("gumbel_probs", api.sample_from_probs, probs),
    ):
        ours = np.asarray(function(keys, values, backend="pallas"))
        theirs = np.asarray(function(keys, values, backend="reference"))
        found[name] = dict(mismatch=float(np.mean(ours != theirs)))
    return found


def time_variants(batch: int, filters: tuple[str, ...], renorm: bool) -> list[dict]:
    """Times every launch variant of the dual-pivot and renorm kernels at ``batch`` (the Gumbel
    kernel's are ``bench/tuning/gumbel.py``'s)."""
    num_sets = num_rotating_sets(batch * VOCAB * 4)
    logits_sets = peers.random_logits(jax.random.key(batch), (num_sets, batch, VOCAB))
    probs_sets = jax.jit(functools.partial(jax.nn.softmax, axis=-1))(logits_sets)
    keys = jax.random.split(jax.random.key(2), num_sets)
    words = jax.jit(jax.vmap(lambda key: rng.row_keys(key, batch)))(keys)
    bytes_per_call = batch * VOCAB * 4
    rows = []

    def record(kernel, variant, step, floor_us=30.0):
        loop = TimedLoop(step, num_sets, (probs_sets, logits_sets, words))
        try:
            timing = loop.time(
                expected_us_per_call=expected_us(bytes_per_call, 1.0, floor_us),
                repeats=3,
                target_seconds=TARGET_SECONDS,
            )
            row = dict(kernel=kernel, batch=batch, variant=variant, us=timing.median_us)
        except Exception as error:  # a variant that fails to compile is a result
            row = dict(kernel=kernel, batch=batch, variant=variant, error=repr(error)[:300])
        print(json.dumps(row), flush=True)
        rows.append(row)

    for name in filters:
        top_k, top_p, min_p, order = _params(batch, VOCAB, **FILTERS[name])
        for block, warps, stages, prefetch in FILTER_VARIANTS:

            def filtered_step(
                s,
                operands,
                block=block,
                warps=warps,
                stages=stages,
                prefetch=prefetch,
                filters=(top_k, top_p, min_p, order),
            ):
                probs, _, words = operands
                top_k, top_p, min_p, order = filters
                return dual_pivot_sample(
                    probs[s],
                    words[s],
                    top_k,
                    top_p,
                    min_p,
                    order=order,
                    max_rounds=DEFAULT_MAX_ROUNDS,
                    stream=api.ROUND_STREAM,
                    block=block,
                    num_warps=warps,
                    num_stages=stages,
                    prefetch=prefetch,
                )

            record(
                name,
                f"block={block},warps={warps},stages={stages},prefetch={prefetch}",
                filtered_step,
            )
    for mode, parameter in (("top_k_renorm", 50), ("top_p_renorm", 0.9), ("top_k_mask", 50)):
        if not renorm:
            break
        values_index = 1 if mode == "top_k_mask" else 0
        dtype = jnp.float32 if mode == "top_p_renorm" else jnp.int32
        row_parameter = jnp.full((batch,), parameter, dtype)
        for block in RENORM_BLOCKS:

            def filter_step(
                s,
                operands,
                block=block,
                mode=mode,
                values_index=values_index,
                parameter=row_parameter,
            ):
                values = operands[values_index][s]
                return filter_rows(values, parameter, mode=mode, block=block)

            record(mode, f"block={block},warps=4", filter_step)
    for array in (logits_sets, probs_sets, keys, words):
        array.delete()
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tuning.sampling")
    parser.add_argument("--batches", default="1,32,256", help="comma-separated batch sizes")
    parser.add_argument(
        "--filters", default=",".join(FILTERS), help=f"comma-separated, of {list(FILTERS)}"
    )
    parser.add_argument(
        "--renorm", action="store_true", help="also time the renorm and mask kernels"
    )
    parser.add_argument("--skip-check", action="store_true", help="skip the agreement check")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    arguments = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("tuning needs a GPU; this machine has none")
        return 0
    out = arguments.out or pathlib.Path(os.environ.get("OUT", "/tmp"))
    started = time.time()
    logits = peers.random_logits(jax.random.key(99), (CHECK_BATCH, VOCAB))
    probs = jax.nn.softmax(logits, axis=-1)
    keys = jax.random.split(jax.random.key(7), CHECK_BATCH)
    agreement = {} if arguments.skip_check else check_agreement(probs, logits, keys)
    print(json.dumps(agreement, indent=1), flush=True)
    filters = tuple(name for name in arguments.filters.split(",") if name)
    rows = []
    for batch in (int(b) for b in arguments.batches.split(",")):
        rows += time_variants(batch, filters, arguments.renorm)
    (out / "sampling-tuning.json").write_text(
        json.dumps(dict(agreement=agreement, timings=rows), indent=1)
    )
    print(f"\nbest variants ({time.time() - started:.0f} s):")
    best: dict[tuple[str, int], dict] = {}
    for row in rows:
        if "us" in row and (
            (row["kernel"], row["batch"]) not in best
            or row["us"] < best[(row["kernel"], row["batch"])]["us"]
        ):
            best[(row["kernel"], row["batch"])] = row
    for (kernel, batch), row in sorted(best.items()):
        tbps = batch * VOCAB * 4 / row["us"] / 1e6
        print(
            f"  {kernel:14s} B={batch:<4d} {row['us']:9.1f} us  {tbps:5.2f} TB/s  {row['variant']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
