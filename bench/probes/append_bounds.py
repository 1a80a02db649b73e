"""Probe: the RoPE + append kernel keeping Quest's key bounds (issue 19), checked and timed.

Three ways to run ``paged.rope_append_kv`` on the Pallas backend, at the ``fused_ops`` suite's
model shape (32 query and 8 KV heads, head_dim 128, pages of 16, bfloat16 pools, Llama 3.1's
RoPE; ``bench/suites/fused_ops.py``):

- ``plain``: no bounds (the suite's ``decodelab`` arm), the floor;
- ``fused``: ``key_bounds_path="fused"``: one XLA scatter restarts the pages the call opens, then
  the kernel writes k and v and widens the float32 bounds with atomic min/max in its launch;
- ``two_step``: ``key_bounds_path="two_step"``: the plain kernel, then XLA's update
  (``paged.append_page_key_bounds``: restart, read the written keys back, two scatters), the
  engine's flow and what ``"auto"`` runs while ``paged.rope_append.AUTO_FUSES_KEY_BOUNDS`` is
  False;
- ``fused.w<N>`` with ``--fused-warps N``: the fused path launched with N warps (default 4).

Cases: ``decode B=64`` and ``decode B=8`` (one new token a request at a random position, so a
sixteenth of the tokens open a page) and ``chunk 1x512`` (one request's first 512 tokens: 32
pages opened, 16 programs racing on each). Before timing, each arm's first call (set 0, from the
same state) is checked bit for bit: pools and rotated q equal the plain arm's, bounds equal
``paged.append_page_key_bounds`` applied to the plain arm's pool (the reference composition).

Timing: the suite's method, ``ChainedCallsLoop`` (pools, q and bounds carried from call to call,
so the kernel writes them in place; the sets' tables rotate, ``timing.unrolled_num_sets`` of
them, every new token's page distinct across sets). ``extra us`` is an arm's median minus the
plain arm's: what keeping the bounds costs. ``--trace`` also reads each arm's per-kernel device
time from a profiler trace (``bench.harness.device_trace``): where the fused path's time goes
(the restart's scatter or the atomics).

Usage (GPU): ``PYTHONPATH=. python3 -m bench.probes.append_bounds --out DIR [--trace]
[--fused-warps 8] [--cases "decode B=64,chunk 1x512"]``; writes ``DIR/append_bounds.json``
after every case. ``--smoke`` runs tiny cases interpreted
on a CPU: the checks and the code paths, no figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

import paged
from bench.harness.ceiling import measure_copy_ceiling
from bench.harness.device_trace import trace_device_time
from bench.harness.timing import expected_us, unrolled_num_sets
from bench.suites.fused_ops import DTYPE, ROPE, ROPE_SHAPE, ChainedCallsLoop
from paged.rope_append import rope_append_pallas
from paged.sparse_quest import PageKeyBounds, append_page_key_bounds

SEED = 19
# Priors of a call's time (us), so the first timed program is sized right and no second one is
# compiled (harness.timing): the H100 figures of a previous version of the fused path
# (paged/rope_append.py, AUTO_FUSES_KEY_BOUNDS). Unknown arms start from the byte bound.
PRIOR_US = {
    ("decode", "plain"): 5.0,
    ("decode", "fused"): 30.0,
    ("decode", "two_step"): 11.0,
    ("chunk", "plain"): 6.0,
    ("chunk", "fused"): 40.0,
    ("chunk", "two_step"): 59.0,
}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int  # requests
    tokens_per_request: int  # new tokens a request (decode: 1, a chunk: its length)
    max_position: int  # decode: positions drawn below it; a chunk starts at 0


CASES = (
    Case("decode B=64", 64, 1, ROPE_SHAPE.max_position),
    Case("decode B=8", 8, 1, ROPE_SHAPE.max_position),
    Case("chunk 1x512", 1, 512, 0),
)
SMOKE_CASES = (Case("decode B=4", 4, 1, 20), Case("chunk 1x12", 1, 12, 0))
SMOKE_SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4)


def model_shape(smoke: bool) -> dict:
    if smoke:
        return SMOKE_SHAPE
    shape = ROPE_SHAPE
    return dict(
        num_q_heads=shape.num_q_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        page_size=shape.page_size,
    )


def bytes_per_call(case: Case, shape: dict) -> int:
    """Read q, k, v, write q_rotated and the new k and v (bfloat16), and read and write both
    bounds (float32) of every page the call writes."""
    tokens = case.batch * case.tokens_per_request
    heads = 2 * shape["num_q_heads"] + 4 * shape["num_kv_heads"]
    pages = case.batch * -(-case.tokens_per_request // shape["page_size"])
    bounds = pages * shape["num_kv_heads"] * shape["head_dim"] * 4 * 4
    return tokens * heads * shape["head_dim"] * jnp.dtype(DTYPE).itemsize + bounds


def make_sets(case: Case, shape: dict, num_sets: int, rng):
    """``num_sets`` tables and token lists, ``(positions, batch_indices, page_indptr,
    page_indices, last_page_len)`` int32 each, and the pool's page count. The pages new tokens
    go to are distinct across every set and request; earlier pages come from the whole pool."""
    page_size = shape["page_size"]
    new_pages = -(-case.tokens_per_request // page_size)
    num_pages = num_sets * case.batch * new_pages
    fresh = rng.permutation(num_pages).reshape(num_sets, case.batch, new_pages)
    sets = []
    for s in range(num_sets):
        if case.tokens_per_request == 1:
            starts = rng.integers(0, case.max_position, case.batch)
        else:
            starts = np.zeros(case.batch, np.int64)
        lengths = starts + case.tokens_per_request
        page_lists = []
        for b in range(case.batch):
            earlier = starts[b] // page_size  # pages before the first new token's
            page_lists.append([*rng.integers(0, num_pages, earlier), *fresh[s, b]])
        table = paged.host_page_table(page_lists, lengths, page_size)
        positions = np.concatenate([np.arange(a, a + case.tokens_per_request) for a in starts])
        batch = np.repeat(np.arange(case.batch), case.tokens_per_request)
        arrays = (positions, batch, table.page_indptr, table.page_indices, table.last_page_len)
        sets.append(tuple(jnp.asarray(np.asarray(a, np.int32)) for a in arrays))
    return sets, num_pages


def arm_call(arm: str, page_size: int, warps: int | None = None):
    """``call(set_index, set_operands, shared, state) -> state`` for ``ChainedCallsLoop``:
    the state ``(k_pages, v_pages, q, kmin, kmax)`` carried (the plain arm passes the bounds
    through)."""

    def call(set_index, set_operands, shared, state):
        del set_index
        positions, batch, indptr, indices, last = set_operands
        k, v = shared
        k_pages, v_pages, q, kmin, kmax = state
        table = paged.PageTable(indptr, indices, last, page_size)
        cache = paged.KVCache(k_pages, v_pages, "HND")
        bounds = PageKeyBounds(kmin, kmax)
        if arm == "plain":
            q, cache = paged.rope_append_kv(
                q, k, v, positions, batch, cache, table, rope=ROPE, backend="pallas"
            )
        elif warps is not None:
            q, cache, bounds = rope_append_pallas(
                q, k, v, positions, batch, cache, table, rope=ROPE, key_bounds=bounds,
                num_warps=warps,
            )  # fmt: skip
        else:
            q, cache, bounds = paged.rope_append_kv(
                q, k, v, positions, batch, cache, table, rope=ROPE, backend="pallas",
                key_bounds=bounds, key_bounds_path=arm,
            )  # fmt: skip
        return (cache.k_pages, cache.v_pages, q, *bounds)

    return call


def reference_bounds(plain_state, initial_state, set_operands, page_size):
    """``append_page_key_bounds`` on the plain arm's pool: what every arm's bounds must be."""
    positions, batch, indptr, indices, last = set_operands
    table = paged.PageTable(indptr, indices, last, page_size)
    cache = paged.KVCache(plain_state[0], plain_state[1], "HND")
    bounds = PageKeyBounds(*initial_state[3:])
    return tuple(jax.jit(append_page_key_bounds)(bounds, cache, table, batch, positions))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for append_bounds.json")
    parser.add_argument("--smoke", action="store_true", help="tiny cases, interpreted, no timing")
    parser.add_argument("--trace", action="store_true", help="also read device time (profiler)")
    parser.add_argument("--fused-warps", type=int, default=None, help="a fused arm at N warps")
    parser.add_argument("--cases", default=None, help="comma-separated case names (default all)")
    args = parser.parse_args(argv)
    shape = model_shape(args.smoke)
    cases = SMOKE_CASES if args.smoke else CASES
    if args.cases:
        cases = [c for c in cases if c.name in args.cases.split(",")]
    arms = [("plain", None), ("fused", None), ("two_step", None)]
    if args.fused_warps:
        arms.append((f"fused.w{args.fused_warps}", args.fused_warps))
    document = {"device": jax.devices()[0].device_kind, "smoke": args.smoke, "rows": []}
    if not args.smoke:
        start = time.perf_counter()
        ceiling = measure_copy_ceiling()
        document["copy_ceiling_tbps"] = ceiling.tbps
        print(
            f"{document['device']}: copy ceiling {ceiling.tbps:.2f} TB/s {ceiling.by_method} "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    failures = 0
    rng = np.random.default_rng(SEED)
    for case in cases:
        num_bytes = bytes_per_call(case, shape)
        num_sets = 1 if args.smoke else unrolled_num_sets(num_bytes)
        sets, num_pages = make_sets(case, shape, num_sets, rng)
        hq, hkv, d = shape["num_q_heads"], shape["num_kv_heads"], shape["head_dim"]
        tokens = case.batch * case.tokens_per_request
        keys = jax.random.split(jax.random.key(SEED), 6)
        pool_shape = (num_pages, hkv, shape["page_size"], d)
        kmin = jax.random.normal(keys[3], (num_pages, hkv, d), jnp.float32) - 4.0
        state = (
            jax.random.normal(keys[0], pool_shape, DTYPE),
            jax.random.normal(keys[1], pool_shape, DTYPE),
            jax.random.normal(keys[2], (tokens, hq, d), DTYPE),
            kmin,  # stale bounds, narrower than new keys in some elements, wider in others
            kmin + 8.0,
        )
        shared = tuple(jax.random.normal(key, (tokens, hkv, d), DTYPE) for key in keys[4:])
        page_size = shape["page_size"]
        between = (num_sets - 1) * num_bytes / 2**20
        print(f"{case.name:>12}: {num_sets} sets, {between:.1f} MiB between visits", flush=True)
        plain_state = expected_bounds = None  # per case: a failed plain arm checks nothing
        rows = []
        for arm, warps in arms:
            loop = ChainedCallsLoop(arm_call(arm, page_size, warps), sets, shared, state)
            name = f"{case.name:>12} {arm:>10}"
            try:
                out = jax.jit(arm_call(arm, page_size, warps))(0, sets[0], shared, state)
                out = jax.block_until_ready(out)
            except Exception as error:  # an arm that fails to compile is a result
                print(f"{name} FAILED {str(error).splitlines()[0][:200]}", flush=True)
                failures += 1
                continue
            if arm == "plain":
                plain_state = out
                expected_bounds = reference_bounds(out, state, sets[0], page_size)
                check = "floor"
            else:
                same_pool = plain_state is not None and all(
                    np.array_equal(np.asarray(a), np.asarray(b))
                    for a, b in zip(out[:3], plain_state[:3], strict=True)
                )
                same_bounds = expected_bounds is not None and all(
                    np.array_equal(np.asarray(a), np.asarray(b))
                    for a, b in zip(out[3:], expected_bounds, strict=True)
                )
                check = "ok" if same_pool and same_bounds else "MISMATCH"
                print(
                    f"{name} {check}: pools and q equal plain's: {same_pool}, bounds equal the "
                    f"reference's: {same_bounds} (bit for bit)",
                    flush=True,
                )
                if check != "ok":
                    failures += 1
                    continue
            row = {"case": case.name, "arm": arm, "check": check, "num_sets": num_sets}
            row["bytes_per_call"] = num_bytes
            if not args.smoke:
                prior = PRIOR_US.get((case.name.split()[0], arm.split(".")[0]))
                timing = loop.time(expected_us_per_call=prior or expected_us(num_bytes, 2.0, 5.0))
                row.update(
                    median_us=timing.median_us,
                    min_us=timing.min_us,
                    max_us=timing.max_us,
                    iters=timing.calls_per_sample,
                )
                print(f"{name} {timing.median_us:9.2f} us ({row['iters']} calls)", flush=True)
                if args.trace:  # the timed program again (compiled already), under the profiler
                    row["trace"] = trace_device_time(loop, timing.calls_per_sample)
                    print(f"{name} trace: {json.dumps(row['trace'])[:500]}", flush=True)
            rows.append(row)
        plain = next((r for r in rows if r["arm"] == "plain" and "median_us" in r), None)
        for row in rows:
            if plain is not None and "median_us" in row:
                row["extra_us"] = row["median_us"] - plain["median_us"]
        document["rows"] += rows
        document["failures"] = failures
        write(document, args.out)  # after every case: a run cut by its timeout keeps the rest
        for array in (*state, *shared, *jax.tree.leaves(sets)):
            array.delete()
    document["failures"] = failures
    timed = [r for r in document["rows"] if "median_us" in r]
    if timed:
        print(f"\n{'case':>12} {'arm':>10} {'median us':>10} {'extra us':>9}")
        for r in timed:
            print(f"{r['case']:>12} {r['arm']:>10} {r['median_us']:10.2f} {r['extra_us']:9.2f}")
    print(f"failures: {failures}", flush=True)
    write(document, args.out)
    return 1 if failures else 0


def write(document: dict, out: str | None) -> None:
    if out:
        folder = pathlib.Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "append_bounds.json").write_text(json.dumps(document, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
