"""Where does the Gumbel-max kernel's time go? A GPU probe of generator and noise variants.

``python -m bench.probes.gumbel`` times, at vocab 128256 and batch 1, 32 and 256 (float32
logits, cold L2, one set per call passed as its own argument so no slice is copied), a
Gumbel-max race whose noise is made in one of several ways:

- generator ``threefry`` (two words per 20-round Threefry-2x32 block, the noise generator until 2026-12-01),
  ``philox`` (four words per 10-round Philox-4x32 call; ``mul.hi.u32`` by inline PTX) or
  ``hash`` (one multiply: no generator cost, a floor);
- noise ``exact`` (``rng.exponential`` then ``-log``: libdevice ``log1pf`` and two ``logf``),
  ``fast`` (``lg2.approx.f32``, the SFU's logarithm, three a token, plus a short series for the
  lower tail) or ``none`` (the bits scaled to a tiny offset: no logarithm, a floor).

Each program owns ``block`` columns a step, cut into ``lanes`` contiguous slices so that word
``w`` of counter ``i`` feeds column ``w * block / lanes + i``: no register reshuffle. Also timed:
``jnp.argmax`` alone (the read floor) and ``jax.random.categorical``. The figures decide how the
kernel is rebuilt; the tokens are not checked against anything (this is a cost probe).
"""

from __future__ import annotations

import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from bench.harness.timing import num_rotating_sets
from kernels_pallas import rng
from kernels_pallas.platform import whole_array

VOCAB = 128256
LN2 = np.float32(np.log(2.0))
PHILOX_M0, PHILOX_M1 = np.uint32(0xD2511F53), np.uint32(0xCD9E8D57)
PHILOX_W0, PHILOX_W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)


def _asm(instruction: str, *args, dtype):
    shape = args[0].shape
    letter = "r" if dtype == jnp.int32 else "f"
    registers = ", ".join(f"${i}" for i in range(len(args) + 1))
    (out,) = plgpu.elementwise_inline_asm(
        f"{instruction} {registers};",
        args=list(args),
        constraints=f"={letter}" + f",{letter}" * len(args),
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, dtype)],
    )
    return out


def mulhi(a, constant):
    # The Triton lowering types inline-asm results as signless int32: go through int32 bits.
    signed = lax.bitcast_convert_type(a, jnp.int32)
    factor = jnp.full(a.shape, np.int32(np.uint32(constant).view(np.int32)), jnp.int32)
    high = _asm("mul.hi.u32", signed, factor, dtype=jnp.int32)
    return lax.bitcast_convert_type(high, jnp.uint32)


def philox_words(key0, key1, counter):
    """Philox-4x32-10 of counter (counter, stream=0, 0, 0): four uint32 arrays."""
    c0 = counter
    c1 = jnp.zeros_like(counter)
    c2 = jnp.zeros_like(counter)
    c3 = jnp.zeros_like(counter)
    k0, k1 = key0, key1
    for r in range(10):
        hi0 = mulhi(c0, PHILOX_M0)
        lo0 = c0 * PHILOX_M0
        hi1 = mulhi(c2, PHILOX_M1)
        lo1 = c2 * PHILOX_M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        if r < 9:
            k0 = k0 + PHILOX_W0
            k1 = k1 + PHILOX_W1
    return c0, c1, c2, c3


def lg2_approx(x):
    return _asm("lg2.approx.f32", x, dtype=jnp.float32)


def fast_exponential(bits):
    upper = bits >= np.uint32(0x80000000)
    t = ((bits << 1) | np.uint32(1)).astype(jnp.float32) * np.float32(2.0**-33)
    upper_e = -LN2 * lg2_approx(t)
    series = t * (1.0 + t * (0.5 + t * np.float32(1 / 3)))
    mid = -LN2 * lg2_approx(1.0 - t)
    lower_e = jnp.where(t < np.float32(2.0**-7), series, mid)
    return jnp.where(upper, upper_e, lower_e)


def kernel(key0_ref, key1_ref, values_ref, score_ref, index_ref, *, gen, noise, block, steps):
    row = pl.program_id(0)
    chunk = pl.program_id(1)
    vocab = values_ref.shape[1]
    key0, key1 = key0_ref[row], key1_ref[row]
    lanes = {"threefry": 2, "philox": 4, "hash": 1}[gen]
    width = block // lanes

    def step(i, carry):
        best, best_index = carry
        start = (chunk * steps + i) * block
        counter = ((start // lanes) + jnp.arange(width, dtype=jnp.int32)).astype(jnp.uint32)
        if gen == "threefry":
            words = rng.random_bit_pairs((key0, key1), counter, 0)
        elif gen == "philox":
            words = philox_words(jnp.full((width,), key0), jnp.full((width,), key1), counter)
        else:
            words = ((counter * np.uint32(0x9E3779B9)) ^ key0,)
        for lane, bits in enumerate(words):
            columns = start + lane * width + jnp.arange(width, dtype=jnp.int32)
            in_row = columns < vocab
            values = plgpu.load(
                values_ref.at[row, pl.ds(start + lane * width, width)], mask=in_row, other=-jnp.inf
            )
            if noise == "exact":
                score = values - jnp.log(rng.exponential(bits))
            elif noise == "fast":
                score = values - LN2 * lg2_approx(fast_exponential(bits))
            else:
                score = values + (bits >> 8).astype(jnp.int32).astype(jnp.float32) * 2.0**-24
            score = jnp.where(in_row, score, -jnp.inf)
            top = jnp.max(score)
            top_index = jnp.min(jnp.where(score == top, columns, 2**30))
            better = top > best
            best = jnp.where(better, top, best)
            best_index = jnp.where(better, top_index, best_index)
        return best, best_index

    best, best_index = lax.fori_loop(0, steps, step, (jnp.float32(-jnp.inf), jnp.int32(0)))
    score_ref[row, chunk] = best
    index_ref[row, chunk] = best_index


@functools.partial(jax.jit, static_argnames=("gen", "noise", "block", "steps", "warps"))
def race(values, key0, key1, *, gen, noise, block, steps, warps):
    batch, vocab = values.shape
    chunks = pl.cdiv(vocab, block * steps)
    shapes = (
        jax.ShapeDtypeStruct((batch, chunks), jnp.float32),
        jax.ShapeDtypeStruct((batch, chunks), jnp.int32),
    )
    scores, indices = pl.pallas_call(
        functools.partial(kernel, gen=gen, noise=noise, block=block, steps=steps),
        grid=(batch, chunks),
        in_specs=[whole_array(key0.shape), whole_array(key1.shape), whole_array(values.shape)],
        out_specs=(whole_array(shapes[0].shape), whole_array(shapes[1].shape)),
        out_shape=shapes,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        name=f"probe_{gen}_{noise}",
    )(key0, key1, values)
    winner = jnp.argmax(scores, axis=1)
    return jnp.take_along_axis(indices, winner[:, None], axis=1)[:, 0]


def sets_loop(call, operand_sets):
    """Times ``call(operands, round)`` visiting each set with a static index (no slice copy)."""
    from bench.suites.speculative import SetsInTurnLoop

    return SetsInTurnLoop(call, operand_sets)


def philox_known_answer() -> list[str]:
    """Random123's first known answer (counter 0, key 0) through the in-kernel Philox."""

    def body(o0, o1, o2, o3):
        zero = jnp.zeros((16,), jnp.uint32)
        for ref, word in zip((o0, o1, o2, o3), philox_words(zero, zero, zero), strict=True):
            ref[...] = word

    shape = jax.ShapeDtypeStruct((16,), jnp.uint32)
    words = pl.pallas_call(body, out_shape=(shape,) * 4)()
    return [f"{int(w[0]):08x}" for w in words]


def rotating_logits(batch: int):
    """``(sets, key, key0, key1)``: enough ``[batch, VOCAB]`` float32 logit arrays (3 x normal)
    for a cold L2, each its own array (``SetsInTurnLoop``), a key for the XLA arms, and the
    rows' key words for the kernels."""
    num_sets = num_rotating_sets(batch * VOCAB * 4)
    keys = jax.random.split(jax.random.key(0), num_sets + 1)
    sets = [
        (jax.random.normal(keys[s], (batch, VOCAB), jnp.float32) * 3.0,) for s in range(num_sets)
    ]
    words = rng.row_keys(keys[-1], batch)
    return sets, keys[-1], words[:, 0], words[:, 1]


def baseline_arms(key) -> dict:
    """The arms every Gumbel probe is read against: ``jnp.argmax`` alone (the read floor) and
    ``jax.random.categorical``."""
    return {
        "argmax_floor": lambda ops, r: jnp.argmax(ops[0] + r.astype(jnp.float32), axis=1),
        "jax_categorical": lambda ops, r: jax.random.categorical(
            jax.random.fold_in(key, r), ops[0], axis=-1
        ),
    }


def time_arm(batch: int, name: str, call, sets) -> dict:
    """Times one arm over the rotating sets and prints a line; a variant that does not compile
    is a finding too (``us`` None)."""
    try:
        timing = sets_loop(call, sets).time(
            expected_us_per_call=100.0, repeats=3, target_seconds=0.05
        )
        us = timing.median_us
    except Exception as error:
        print(f"B={batch} {name}: FAILED {type(error).__name__}: {str(error)[:300]}")
        us = None
    ceiling_us = batch * VOCAB * 4 / 4.3e12 * 1e6
    if us is not None:
        print(f"B={batch:3d} {name:34s} {us:8.1f} us  {ceiling_us / us * 100:5.1f}% of ceiling")
    sys.stdout.flush()
    return {"batch": batch, "arm": name, "us": us, "ceiling_us": ceiling_us}


def main() -> None:
    out = os.environ.get("OUT", "/tmp")
    answer = philox_known_answer()
    print("philox KAT", answer, "expected ['6627e8d5', 'e169c58d', 'bc57ac4c', '9b00dbd8']")
    results = []
    variants = [
        ("threefry", "exact", 1024, 2, 4),
        ("threefry", "none", 1024, 2, 4),
        ("hash", "exact", 1024, 2, 4),
        ("hash", "none", 1024, 2, 4),
        ("hash", "fast", 1024, 2, 4),
        ("philox", "none", 1024, 2, 4),
        ("philox", "fast", 1024, 2, 4),
        ("philox", "fast", 2048, 2, 8),
        ("philox", "fast", 4096, 1, 8),
        ("philox", "exact", 1024, 2, 4),
        ("threefry", "fast", 1024, 2, 4),
    ]
    for batch in (256, 32, 1):
        sets, key, key0, key1 = rotating_logits(batch)
        arms = baseline_arms(key)
        for gen, noise, block, steps, warps in variants:
            arms[f"{gen}/{noise} b{block}x{steps} w{warps}"] = (
                lambda ops, r, g=gen, n=noise, b=block, s=steps, w=warps, k0=key0, k1=key1: race(
                    ops[0],
                    k0 ^ r.astype(jnp.uint32),
                    k1,
                    gen=g,
                    noise=n,
                    block=b,
                    steps=s,
                    warps=w,
                )
            )
        for name, call in arms.items():
            results.append(time_arm(batch, name, call, sets))
        del sets
    with open(os.path.join(out, "gumbel_probe.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
