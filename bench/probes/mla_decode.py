"""Probe: the Mosaic GPU MLA absorbed-decode kernel (``kernels_pallas/mla_decode_mgpu.py``) on
the H200, checked against the reference and timed beside XLA (issue 20).

Cases (DeepSeek sizes: latent R = 512, RoPE key P = 64, page 16, bfloat16; every request of
the case's context; pages scattered over a pool that holds ``num_sets`` rotating tables, enough
that the sets exceed the L2 four times, so every call reads from HBM):

- memory bound: 16 heads, ``q_len`` 1, B = 1, 16, 64, 128 at 4K and 32K context. Figure: the
  latent bytes read (``B x context x (R + P) x 2``) a second, as a fraction of the copy ceiling
  measured in the same run (``bench.harness.ceiling``; the issue asks at least 80%).
- compute bound: 128 heads, ``q_len`` 2 and 4, B = 64 at 4K. Figure: useful TFLOP/s
  (``2 x B x q_len x H x context x (2R + P)``: logits and output, no padding or duplicated
  work counted) against the bfloat16 dense peak, 989 (the issue asks at least 40%).
- ``--crossover`` adds H x q_len = 16 x 2, 16 x 4, 64 x 1, 128 x 1 at B = 64, 4K, both
  figures printed,
  to place the change of regime (expected near ``H x q_len`` = 120, ``docs/mla.md``).

Arms: ``kernel`` (``mla_decode_mgpu`` with its default path: transposed for ``H x q_len <=
32``, the 64-row tile with ``p`` from registers otherwise; the split plan of
``plan_mla_decode`` and the merge when it splits; the whole call is timed), ``kernel.tile``
(the 64-row tile path where the default is the transposed one) and ``xla`` (the
absorbed formulation written for XLA in bfloat16 with float32 accumulation and softmax: the
request's pages gathered, two einsums and a softmax; the jitted float32 reference
``mla_latent_attention_state``, a ``lax.map`` over requests, is far slower and not a fair
peer). If the kernel arm fails, ``kernel.psmem.s1`` (the tile path with ``p`` through shared
memory and one ring slot) is tried in its place. Every arm is first checked: the kernel's
against the float32 reference on the case's first request (``||o - ref|| / ||ref||`` below
1e-2, LSE within 2e-2), the XLA arm against the kernel; an arm that fails to compile or
disagrees is reported and not timed. Timing is the
suite's (``bench.harness.timing.TimedLoop``).

Usage (GPU): ``PYTHONPATH=. python3 -m bench.probes.mla_decode`` (``--cases mem,compute``,
``--crossover``, ``--no-xla``; ``MLA_PROBE_ARGS`` in ``bench/run_on_gpu.sh``). ``--smoke``
runs one tiny case (a 128-wide latent) in Mosaic GPU's interpret mode on a CPU (``p``
through shared memory): the checks and the code paths, no figures.
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness.ceiling import measure_copy_ceiling
from bench.harness.timing import TimedLoop, expected_us, num_rotating_sets
from kernels_pallas.mla_decode_mgpu import (
    TRANSPOSED_MAX_ROWS,
    mla_decode_mgpu,
    plan_mla_decode,
)
from paged.mla_cache import LatentCache
from paged.mla_reference import default_softmax_scale, mla_latent_attention_state
from paged.page_table import PageTable

PAGE_SIZE = 16
KV_LORA_RANK, ROPE_DIM = 512, 64
SOFTMAX_SCALE = default_softmax_scale(128, 64)
H200_BF16_PEAK_TFLOPS = 989.0
TOLERANCE = 1e-2
# (num_heads, q_len, batch, context)
MEMORY_CASES = tuple((16, 1, b, c) for c in (4096, 32768) for b in (1, 16, 64, 128))
COMPUTE_CASES = ((128, 2, 64, 4096), (128, 4, 64, 4096))
CROSSOVER_CASES = tuple((h, q, 64, 4096) for h, q in ((16, 2), (16, 4), (64, 1), (128, 1)))
# The 64-row tile path where the kernel's default is the transposed one (L x H <= 32).
TILE_ARM = "kernel.tile"
# Tried when the default arm fails to compile or run: the tile path with p through shared
# memory, whose extra 16 KiB leave room for one ring slot only.
FALLBACK_ARM = "kernel.psmem.s1"
# Two tokens x 16 heads: the causal rule, and both paths (transposed, the default, and tile).
SMOKE_CASES = ((16, 2, 1, 70),)


def make_case(num_heads, q_len, batch, context, *, max_sets=64, seed=0, kv_lora_rank=KV_LORA_RANK):
    """Operands ``(q_latent, q_rope, latent_pages, rope_key_pages, indices [num_sets, nnz],
    indptr, last_page_len)``, the number of sets, and the cache bytes a set reads."""
    pages_per_request = math.ceil(context / PAGE_SIZE)
    nnz = batch * pages_per_request
    bytes_per_set = batch * context * (kv_lora_rank + ROPE_DIM) * 2
    # At least two sets, as the suites rotate; ``max_sets=1`` (the interpreted smoke run, which
    # times nothing) caps it at one.
    num_sets = num_rotating_sets(bytes_per_set, max_sets=max_sets)
    num_pages = num_sets * nnz
    key = jax.random.key(seed)
    keys = jax.random.split(key, 4)
    latent = jax.random.normal(keys[0], (num_pages, PAGE_SIZE, kv_lora_rank), jnp.bfloat16)
    rope_key = jax.random.normal(keys[1], (num_pages, PAGE_SIZE, ROPE_DIM), jnp.bfloat16)
    # Query scale: logits spread over a few units, as a trained model's do.
    q_latent = jax.random.normal(keys[2], (batch, q_len, num_heads, kv_lora_rank), jnp.float32)
    q_latent = (q_latent * (2.0 / math.sqrt(kv_lora_rank) / SOFTMAX_SCALE)).astype(jnp.bfloat16)
    q_rope = jax.random.normal(keys[3], (batch, q_len, num_heads, ROPE_DIM), jnp.bfloat16)
    rng = np.random.default_rng(seed)
    indices = rng.permutation(num_pages).astype(np.int32).reshape(num_sets, nnz)
    indptr = np.arange(batch + 1, dtype=np.int32) * pages_per_request
    last = np.full(batch, context - (pages_per_request - 1) * PAGE_SIZE, np.int32)
    operands = (q_latent, q_rope, latent, rope_key, jnp.asarray(indices), indptr, last)
    return operands, num_sets, bytes_per_set


def xla_absorbed(q_latent, q_rope, cache, table, pages_per_request):
    """The absorbed formulation for XLA, every request ``pages_per_request`` pages: gather,
    ``q_latent . c + q_rope . k_rope`` (bfloat16 products, float32 sums), float32 softmax with
    the new tokens' causal rule, ``p @ c``. Returns ``(o [B, L, H, R] float32, lse [B, L, H])``."""
    batch, q_len = q_latent.shape[:2]
    pages = table.page_indices[: batch * pages_per_request].reshape(batch, pages_per_request)
    latent = cache.latent_pages[pages].reshape(batch, -1, cache.kv_lora_rank)  # [B, T, R]
    rope_key = cache.rope_key_pages[pages].reshape(batch, -1, ROPE_DIM)
    logits = jnp.einsum("blhr,btr->blht", q_latent, latent, preferred_element_type=jnp.float32)
    logits += jnp.einsum("blhp,btp->blht", q_rope, rope_key, preferred_element_type=jnp.float32)
    logits *= SOFTMAX_SCALE
    seq_len = (pages_per_request - 1) * PAGE_SIZE + table.last_page_len  # [B]
    position = jnp.arange(latent.shape[1])
    limit = seq_len[:, None] - q_len + jnp.arange(q_len)[None, :]  # [B, L], inclusive
    visible = position[None, None, :] <= limit[:, :, None]  # [B, L, T]
    logits = jnp.where(visible[:, :, None, :], logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.exp(logits - lse[..., None]).astype(latent.dtype)
    o = jnp.einsum("blht,btr->blhr", probs, latent, preferred_element_type=jnp.float32)
    return o, lse


def decode_step(arm, plan, pages_per_request, interpret):
    def step(set_index, operands):
        q_latent, q_rope, latent, rope_key, indices, indptr, last = operands
        table = PageTable(jnp.asarray(indptr), indices[set_index], jnp.asarray(last), PAGE_SIZE)
        cache = LatentCache(latent, rope_key)
        if arm == "xla":
            return xla_absorbed(q_latent, q_rope, cache, table, pages_per_request)
        fallback = arm == FALLBACK_ARM
        return mla_decode_mgpu(
            q_latent,
            q_rope,
            cache,
            table,
            softmax_scale=SOFTMAX_SCALE,
            plan=plan,
            num_stages=1 if fallback else 2,
            probs_in_smem=interpret or fallback,
            transposed=False if arm in (TILE_ARM, FALLBACK_ARM) else None,
            interpret=interpret,
        )

    return step


def check_against_reference(o, lse, operands):
    """The kernel's first request against the float32 reference: relative error of o, largest
    LSE difference."""
    q_latent, q_rope, latent, rope_key, indices, indptr, last = operands
    pages = np.asarray(indices[0])[indptr[0] : indptr[1]]
    table = PageTable.from_page_lists(
        [pages.tolist()], seq_lens=[int((len(pages) - 1) * PAGE_SIZE + last[0])], page_size=16
    )
    ref_o, ref_lse = mla_latent_attention_state(
        q_latent[:1].astype(jnp.float32),
        q_rope[:1].astype(jnp.float32),
        LatentCache(latent, rope_key),
        table,
        softmax_scale=SOFTMAX_SCALE,
    )
    ref_o, ref_lse = np.asarray(ref_o, np.float64), np.asarray(ref_lse, np.float64)
    error = np.linalg.norm(np.asarray(o[:1], np.float64) - ref_o) / np.linalg.norm(ref_o)
    lse_difference = float(np.abs(np.asarray(lse[:1]) - ref_lse).max())
    return float(error), lse_difference


def run_case(case, *, interpret, with_xla, ceiling_tbps):
    num_heads, q_len, batch, context = case
    # The smoke run's latent is 128 wide (the interpreter's time grows with it); the paths
    # and checks are the same.
    operands, num_sets, bytes_per_set = make_case(
        num_heads,
        q_len,
        batch,
        context,
        max_sets=1 if interpret else 64,
        kv_lora_rank=128 if interpret else KV_LORA_RANK,
    )
    pages_per_request = math.ceil(context / PAGE_SIZE)
    host_table = PageTable.from_seq_lens([context] * batch, page_size=PAGE_SIZE)
    plan = plan_mla_decode(host_table, num_heads, q_len)
    flops = 2 * batch * q_len * num_heads * context * (2 * KV_LORA_RANK + ROPE_DIM)
    name = f"H={num_heads:3d} L={q_len} B={batch:3d} ctx={context:5d}"
    splits = int(plan.num_work_items) // max(batch, 1)
    kernel_output = None
    failures = 0
    arms = ["kernel"] + ([TILE_ARM] if q_len * num_heads <= TRANSPOSED_MAX_ROWS else [])
    arms += ["xla"] if with_xla else []
    for arm in arms:
        loop = TimedLoop(decode_step(arm, plan, pages_per_request, interpret), num_sets, operands)
        label = f"{name} {arm:>15}"
        try:
            o, lse = loop.output(0)
            o, lse = np.asarray(o), np.asarray(lse)
        except Exception as error:  # a failure to compile or run is a result; go on
            print(f"{label} FAILED {str(error).splitlines()[0][:300]}", flush=True)
            failures += 1
            if arm == "kernel" and not interpret:
                arms.insert(arms.index(arm) + 1, FALLBACK_ARM)  # does the other p path run?
            continue
        if arm.startswith("kernel"):
            error, lse_difference = check_against_reference(o, lse, operands)
            ok = np.all(np.isfinite(o)) and error < TOLERANCE and lse_difference < 2e-2
            kernel_output = (o, lse)
            check = f"vs reference: o {error:.2e}, lse {lse_difference:.2e}"
        else:
            if kernel_output is None:
                ok, check = True, "unchecked (kernel failed)"
            else:
                ref = kernel_output[0]
                error = float(np.linalg.norm(o - ref) / np.linalg.norm(ref))
                ok = error < TOLERANCE
                check = f"vs kernel: o {error:.2e}"
        if not ok:
            print(f"{label} MISMATCH {check}", flush=True)
            failures += 1
            continue
        if interpret:
            print(f"{label} ok ({check})", flush=True)
            continue
        timing = loop.time(expected_us_per_call=expected_us(bytes_per_set, 2.0))
        tbps = bytes_per_set / timing.median_us / 1e6
        tflops = flops / timing.median_us / 1e6
        print(
            f"{label} {timing.median_us:9.2f} us  {tbps:5.2f} TB/s "
            f"({100 * tbps / ceiling_tbps:5.1f}% of the {ceiling_tbps:.2f} ceiling)  "
            f"{tflops:6.1f} TFLOP/s ({100 * tflops / H200_BF16_PEAK_TFLOPS:4.1f}% of 989)  "
            f"work items {int(plan.num_work_items)} ({splits}/request)  {num_sets} sets  "
            f"[{check}]",
            flush=True,
        )
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="mem,compute", help="mem, compute (comma-separated)")
    parser.add_argument("--crossover", action="store_true", help="add the crossover cases")
    parser.add_argument("--no-xla", action="store_true", help="time the kernel only")
    parser.add_argument("--smoke", action="store_true", help="tiny cases, interpreted, no timing")
    args = parser.parse_args(argv)
    if args.smoke:
        cases = SMOKE_CASES
        ceiling_tbps = 1.0
    else:
        groups = {"mem": MEMORY_CASES, "compute": COMPUTE_CASES}
        cases = [c for g in args.cases.split(",") for c in groups[g]]
        if args.crossover:
            cases += list(CROSSOVER_CASES)
        start = time.perf_counter()
        ceiling = measure_copy_ceiling()
        ceiling_tbps = ceiling.tbps
        print(
            f"copy ceiling {ceiling_tbps:.2f} TB/s {ceiling.by_method} "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    failures = 0
    for case in cases:
        failures += run_case(
            case, interpret=args.smoke, with_xla=not args.no_xla, ceiling_tbps=ceiling_tbps
        )
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
