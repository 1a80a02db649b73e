"""Where does the rebuilt Gumbel kernel's time go? A GPU probe of its internals (issue 4).

``python -m bench.probes.gumbel_variants`` times, at vocab 128256 and batch 256 and 32 (float32
logits, cold L2, ``bench/probes/gumbel.time_arm``), variants of ``kernels_pallas/gumbel.py``'s
race that differ in one thing each:

- ``layout``: ``tile`` (the kernel's ``[quads, 4]`` tile, a Philox call's four words on one
  row of it) or ``slices`` (four contiguous slices of ``quads`` columns, word ``w`` of call
  ``q`` on column ``w * quads + q`` of the step: no 2D view, no selects);
- ``noise``: ``full`` (Philox, then ``rng.gumbel``), ``philox_only`` (the Philox bits scaled to a
  float, no logarithm), ``formula_only`` (one multiply as the "generator", then ``rng.gumbel``);
- ``rounds``: Philox rounds, 10 (the standard) or 7 (fewer, for what the rounds cost);
- ``prefetch``: the next step's values loaded before this step's noise is computed;
- ``--set parallelism``: 2 to 8 warps and 256- to 4096-column steps, and ``noise="magic"``
  (``float(u32)`` from two exact mantissa conversions instead of the quarter-rate I2F).

Tokens are not checked (a cost probe; the kernel's own tests check the kernel).
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from bench.probes import gumbel as gumbel_probe
from kernels_pallas import rng
from kernels_pallas.gumbel import _log2_ptx, _mulhilo_ptx
from kernels_pallas.platform import whole_array

VOCAB = 128256


def _bits(words, quad, rounds, noise):
    if noise == "formula_only":
        hashed = quad * np.uint32(0x9E3779B9) ^ words[0]
        return hashed, hashed ^ np.uint32(0x1234567), hashed + words[1], hashed * np.uint32(5)
    k0, k1 = words
    c0, c1, c2, c3 = quad, jnp.zeros_like(quad), jnp.zeros_like(quad), jnp.zeros_like(quad)
    for r in range(rounds):
        if r:
            k0 = k0 + np.uint32(rng.PHILOX_WEYL[0])
            k1 = k1 + np.uint32(rng.PHILOX_WEYL[1])
        high0, low0 = _mulhilo_ptx(c0, rng.PHILOX_MULTIPLIERS[0])
        high2, low2 = _mulhilo_ptx(c2, rng.PHILOX_MULTIPLIERS[1])
        c0, c1, c2, c3 = high2 ^ c1 ^ k0, low2, high0 ^ c3 ^ k1, low0
    return c0, c1, c2, c3


def _magic_float(v):
    """float32(v) for a uint32 v, correctly rounded, by two exact 23-bit conversions through
    the float's mantissa and one multiply-add: no I2F (a quarter-rate instruction)."""
    magic = np.uint32(0x4B000000)  # 2**23 as float32 bits
    high = lax.bitcast_convert_type((v >> 9) | magic, jnp.float32) - np.float32(2.0**23)
    low = lax.bitcast_convert_type((v & np.uint32(0x1FF)) | magic, jnp.float32) - np.float32(
        2.0**23
    )
    return high * np.float32(512.0) + low


def _gumbel_magic(bits):
    t = _magic_float((bits << 1) | np.uint32(1)) * np.float32(2.0**-33)
    lower_tail = bits < np.uint32(0x40000000)
    middle = (bits >= np.uint32(0x40000000)) & (bits < np.uint32(0x80000000))
    x = jnp.where(middle, 1.0 - t, t)
    log2_x = _log2_ptx(x)
    ln2 = np.float32(np.log(2.0))
    from_double_log = -ln2 * _log2_ptx(-log2_x) - np.float32(np.log(np.log(2.0)))
    c0, c1, c2, c3, c4 = rng.GUMBEL_TAIL_COEFFICIENTS
    h = t * ((((c4 * t + c3) * t + c2) * t + c1) * t + c0)
    return jnp.where(lower_tail, -ln2 * log2_x - h, from_double_log)


def _noise(bits, noise):
    if noise == "philox_only":
        return (bits >> 8).astype(jnp.int32).astype(jnp.float32) * np.float32(2.0**-24)
    if noise == "magic":
        return _gumbel_magic(bits)
    return rng.gumbel(bits, log2=_log2_ptx)


def kernel(
    key_ref, values_ref, score_ref, index_ref, *, quads, steps, layout, noise, rounds, prefetch
):
    row, chunk = pl.program_id(0), pl.program_id(1)
    vocab = values_ref.shape[1]
    words = (key_ref[row, 0], key_ref[row, 1])
    width = 4 * quads
    first = chunk * steps * width
    offsets = jnp.arange(width, dtype=jnp.int32)
    small = jnp.arange(quads, dtype=jnp.int32)

    def load(i):
        start = first + i * width
        if layout == "tile":
            return (
                plgpu.load(
                    values_ref.at[row, pl.ds(start, width)],
                    mask=start + offsets < vocab,
                    other=-jnp.inf,
                ),
            )
        return tuple(
            plgpu.load(
                values_ref.at[row, pl.ds(start + w * quads, quads)],
                mask=start + w * quads + small < vocab,
                other=-jnp.inf,
            )
            for w in range(4)
        )

    def compute(i, loaded, best, code):
        start = first + i * width
        quad = (start // 4 + small).astype(jnp.uint32)
        bits = _bits(words, quad, rounds, noise)
        if layout == "tile":
            g = [_noise(b, noise)[:, None] for b in bits]
            lane = jnp.arange(4, dtype=jnp.int32)[None, :]
            g = jnp.where(
                lane < 2, jnp.where(lane == 0, g[0], g[1]), jnp.where(lane == 2, g[2], g[3])
            )
            score = loaded[0].reshape(quads, 4) + g
            better = score > best
            return jnp.where(better, score, best), jnp.where(better, i, code)
        for w in range(4):
            score = loaded[w] + _noise(bits[w], noise)
            better = score > best
            best = jnp.where(better, score, best)
            code = jnp.where(better, i * 4 + w, code)
        return best, code

    shape = (quads, 4) if layout == "tile" else (quads,)
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.int32))
    if prefetch:

        def step(i, carry):
            best, code, loaded = carry
            upcoming = load(i + 1)
            best, code = compute(i, loaded, best, code)
            return best, code, upcoming

        best, code, _ = lax.fori_loop(0, steps, step, (*init, load(0)))
    else:

        def step(i, carry):
            return compute(i, load(i), *carry)

        best, code = lax.fori_loop(0, steps, step, init)
    top = jnp.max(best)
    if layout == "tile":
        columns = first + code * width + offsets.reshape(quads, 4)
    else:
        columns = first + (code // 4) * width + (code % 4) * quads + small
    score_ref[row, chunk] = top
    index_ref[row, chunk] = jnp.min(jnp.where(best == top, columns, 2**30))


@functools.partial(
    jax.jit, static_argnames=("quads", "steps", "warps", "layout", "noise", "rounds", "prefetch")
)
def race(values, words, *, quads, steps, warps, layout, noise, rounds, prefetch):
    batch, vocab = values.shape
    chunks = pl.cdiv(vocab, 4 * quads * steps)
    shapes = (
        jax.ShapeDtypeStruct((batch, chunks), jnp.float32),
        jax.ShapeDtypeStruct((batch, chunks), jnp.int32),
    )
    scores, indices = pl.pallas_call(
        functools.partial(
            kernel,
            quads=quads,
            steps=steps,
            layout=layout,
            noise=noise,
            rounds=rounds,
            prefetch=prefetch,
        ),
        grid=(batch, chunks),
        in_specs=[whole_array(words.shape), whole_array(values.shape)],
        out_specs=(whole_array(shapes[0].shape), whole_array(shapes[1].shape)),
        out_shape=shapes,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        name=f"probe_{layout}_{noise}",
    )(words, values)
    winner = jnp.argmax(scores, axis=1)
    return jnp.take_along_axis(indices, winner[:, None], axis=1)[:, 0]


# The two sets run on 2026-12-01 (docs/benchmark_results/archive/2026-12-01-gumbel-tuning.md):
# (launches per batch as (quads, chunks a row, warps), variants as (layout, noise, rounds,
# prefetch)).
SETS = {
    "internals": (
        {256: [(256, 8, 4), (512, 4, 8)], 32: [(256, 32, 4)]},
        [
            ("tile", "full", 10, False),
            ("slices", "full", 10, False),
            ("tile", "full", 10, True),
            ("slices", "full", 10, True),
            ("tile", "philox_only", 10, False),
            ("slices", "philox_only", 10, False),
            ("tile", "formula_only", 10, False),
            ("slices", "formula_only", 10, False),
            ("slices", "full", 7, True),
            ("tile", "full", 7, True),
        ],
    ),
    "parallelism": (
        {
            256: [(256, 8, 4), (256, 8, 2), (512, 4, 4), (1024, 4, 8), (1024, 2, 4)],
            32: [(256, 32, 4), (256, 32, 2), (512, 16, 4), (128, 64, 2)],
        },
        [("tile", "full", 10, False), ("tile", "magic", 10, False), ("tile", "magic", 7, False)],
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=sorted(SETS), default="internals")
    out = os.environ.get("OUT", "/tmp")
    configs, variants = SETS[parser.parse_args().set]
    results = []
    for batch, launches in configs.items():
        sets, key, key0, key1 = gumbel_probe.rotating_logits(batch)
        words = jnp.stack([key0, key1], axis=1)
        arms = gumbel_probe.baseline_arms(key)
        for quads, chunks, warps in launches:
            steps = pl.cdiv(pl.cdiv(VOCAB, 4 * quads), chunks)
            for layout, noise, rounds, prefetch in variants:
                name = f"q{quads}c{chunks}w{warps} {layout} {noise} r{rounds}"
                name += " pf" if prefetch else ""
                options = dict(
                    quads=quads,
                    steps=steps,
                    warps=warps,
                    layout=layout,
                    noise=noise,
                    rounds=rounds,
                    prefetch=prefetch,
                )
                arms[name] = lambda ops, r, words=words, options=options: race(
                    ops[0], words ^ r.astype(jnp.uint32), **options
                )
        for name, call in arms.items():
            results.append(gumbel_probe.time_arm(batch, name, call, sets))
        del sets
    with open(os.path.join(out, "gumbel_variants_probe.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
