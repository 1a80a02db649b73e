"""Probe: the MLA model through the engine, latent cache against the same model on expanded
K/V pages (issue 20's engine line).

Issue 20 asks for "tokens/s and ITL of the MLA model against the same model with its latent
expanded to plain GQA K/V pages (bytes of cache per token, and speed)". Both arms run the same
weights (``serving.mla_model.init_mla_model_params``) through ``serving.engine.Engine``:

- ``latent``: ``MLAModelConfig``, one ``paged.LatentCache`` a layer (``R + P`` values a token),
  decode absorbed (``paged.mla_decode_attention``), long prefill chunks un-absorbed;
- ``expanded``: ``serving.mla_expanded.ExpandedMLAConfig``, one ``paged.KVCache`` a layer with
  one KV head a query head, keys ``[latent @ W_UK[h]; k_rope]`` and values ``latent @ W_UV[h]``
  zero-padded to a power-of-two head width (256 at DeepSeek's sizes), read by the project's
  decode attention (the decode kernels on a GPU).

Each arm is also named by its engine backend: ``auto`` (on a GPU today the latent arm's
attention is XLA's absorbed reference, since ``paged.mla_decode.AUTO_PICKS_MLA_KERNEL`` is
False, and the expanded arm's the decode kernel), or ``pallas`` (every op a Pallas kernel: the
latent arm's attention the Mosaic GPU MLA kernel with the engine's plans; the norms and
samplers change with it, so compare ``latent/pallas`` with ``expanded/pallas``).

For each case (batch ``B`` of requests with ``context`` prompt tokens each, ``new_tokens``
greedy tokens) and arm, one engine runs a warm-up round (which compiles) and a measured round;
a row holds:

- ``cache_bytes_per_token``: the whole model's cache a token as stored (latent: ``layers
  (R + P) 2``; expanded: ``layers 2 H D 2``, padded), and ``expanded_unpadded_bytes_per_token``
  (``layers H (N + P + V) 2``, what the table in ``docs/mla.md`` counts);
- ``step_ms``: median wall time of a decode step of the measured round (steps that decode
  every request, prefill none, compiled nothing), the ITL a client sees at one token a step;
- ``tokens_per_s``: ``B`` tokens a step over the mean of those steps;
- ``itl_ms_p50`` / ``itl_ms_p90``: the requests' inter-token gaps from the engine's
  ``RequestTiming`` (the same steps seen from the requests, overlapped loop included).

Model: DeepSeek-V2-Lite's attention (``serving.mla_config.deepseek_v2_lite_like``: hidden 2048,
16 heads, latent 512, RoPE 64) in ``--layers`` layers with a dense SwiGLU MLP of
``--intermediate`` and a byte vocabulary (the checkpoint's MoE and 102400 tokens are not what
the cache comparison is about; both arms pay them alike), bfloat16, random weights.

Usage: ``PYTHONPATH=. python3 -m bench.probes.mla_engine --out DIR`` on the GPU
(``bash bench/run_on_gpu.sh mla-engine``); ``--tiny`` runs ``MLA_TEST`` at small cases on a CPU
(the code paths and the byte counts, no figures; ``tests/test_bench_probes.py`` runs it). The
JSON is rewritten after every row, so a run cut by its budget keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import jax
import numpy as np

from bench.probes.engine_dispatch import run_requests  # submit all, step to the end
from serving.engine import Engine
from serving.mla_config import MLA_TEST, MLAModelConfig, cache_bytes_per_token
from serving.mla_config import deepseek_v2_lite_like as lite_attention
from serving.mla_expanded import ExpandedMLAConfig
from serving.mla_model import init_mla_model_params
from serving.requests import Request, SamplingParams

PAGE_SIZE = 16
SEED = 7
ARMS = ("latent/auto", "latent/pallas", "expanded/auto")
ALL_ARMS = (*ARMS, "expanded/pallas", "latent/reference", "expanded/reference")


def model_config(args) -> MLAModelConfig:
    if args.tiny:
        return MLA_TEST
    attention = lite_attention(num_layers=args.layers, dtype="bfloat16")
    return MLAModelConfig(attention=attention, vocab_size=256, intermediate=args.intermediate)


def cache_bytes(config: MLAModelConfig) -> dict:
    """The whole model's cache bytes a token in each layout."""
    return {
        "latent": cache_bytes_per_token(config, "latent"),
        "expanded": ExpandedMLAConfig(config).bytes_per_token,
        "expanded_unpadded": cache_bytes_per_token(config, "expanded"),
    }


def requests_for(batch: int, context: int, new_tokens: int, tag: str) -> list[Request]:
    rng = np.random.default_rng(SEED)
    return [
        Request(
            f"{tag}-{i}",
            rng.integers(0, 256, size=context + 1).tolist(),
            SamplingParams(temperature=0.0, max_tokens=new_tokens),
        )
        for i in range(batch)
    ]


def arm_row(config: MLAModelConfig, params, arm: str, batch: int, context: int, args) -> dict:
    """One arm at one case: a warm-up round, then the measured round's figures."""
    layout, backend = arm.split("/")
    target = config if layout == "latent" else ExpandedMLAConfig(config)
    new_tokens = args.new_tokens
    pages = batch * -(-(context + 1 + new_tokens) // PAGE_SIZE) + 1
    engine = Engine(
        (target, params),
        num_pages=pages,
        page_size=PAGE_SIZE,
        parallel=batch,
        backend=backend,
        max_prefill_tokens=args.chunk,
        prefill_chunk_size=args.chunk,
        seed=SEED,
    )
    start = time.perf_counter()
    run_requests(engine, requests_for(batch, context, new_tokens, "warm"))
    warm_s = time.perf_counter() - start
    measured = requests_for(batch, context, new_tokens, "run")
    stats = run_requests(engine, measured)
    steps = [
        s.host_s + s.prefill_s + s.decode_s
        for s in stats
        if s.num_decode_rows == batch and not s.num_prefill_chunks and not s.compiled
    ]
    gaps = np.concatenate(
        [engine.timings[r.request_id].inter_token_s() for r in measured] or [np.zeros(0)]
    )
    nan = float("nan")
    report = engine.backend_report()
    return {
        "arm": arm,
        "batch": batch,
        "context": context,
        "new_tokens": new_tokens,
        "cache_bytes_per_token": cache_bytes(config)[layout],
        "steps": len(steps),
        "step_ms": statistics.median(steps) * 1e3 if steps else nan,
        "tokens_per_s": batch / statistics.fmean(steps) if steps else nan,
        "itl_ms_p50": float(np.percentile(gaps, 50)) * 1e3 if gaps.size else nan,
        "itl_ms_p90": float(np.percentile(gaps, 90)) * 1e3 if gaps.size else nan,
        "warm_round_s": warm_s,
        "decode_attention": report.get("decode: attention", ""),
    }


def parse_ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"a comma-separated list of ints >= 1, got {text!r}")
    return values


def parse_arms(text: str) -> list[str]:
    arms = [a for a in text.split(",") if a]
    bad = [a for a in arms if a not in ALL_ARMS]
    if not arms or bad:
        raise argparse.ArgumentTypeError(f"arms from {ALL_ARMS}, got {text!r}")
    return arms


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=parse_ints, default=[1, 8, 32])
    parser.add_argument("--contexts", type=parse_ints, default=[1024, 4096])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk size (power of 2)")
    parser.add_argument(
        "--arms", type=parse_arms, default=None, help=f"comma-separated, default {','.join(ARMS)}"
    )
    parser.add_argument(
        "--budget-s", type=float, default=450.0, help="start no case after this many seconds"
    )
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument(
        "--tiny", action="store_true", help="MLA_TEST at small cases on the reference (a CPU)"
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.batches, args.contexts, args.new_tokens, args.chunk = [2], [12], 4, 8
        args.arms = args.arms or ["latent/reference", "expanded/reference"]
    args.arms = args.arms or list(ARMS)
    config = model_config(args)
    params = init_mla_model_params(config, jax.random.key(SEED))
    sizes = cache_bytes(config)
    print(
        f"# MLA engine probe: {config.num_layers} layers, H={config.attention.num_heads}, "
        f"R={config.attention.kv_lora_rank}, P={config.attention.qk_rope_head_dim}, "
        f"{config.attention.dtype}; cache bytes a token: latent {sizes['latent']}, expanded "
        f"{sizes['expanded']} as stored (head_dim {ExpandedMLAConfig(config).head_dim}), "
        f"{sizes['expanded_unpadded']} unpadded ({jax.devices()[0].device_kind}; commit "
        f"{os.environ.get('DECODELAB_COMMIT', 'unknown')})"
    )
    rows, failures, start = [], 0, time.perf_counter()
    for context in args.contexts:
        for batch in args.batches:
            if time.perf_counter() - start > args.budget_s:
                print(f"skipped B={batch} context={context}: past --budget-s {args.budget_s}")
                continue
            for arm in args.arms:
                try:
                    row = arm_row(config, params, arm, batch, context, args)
                except Exception as error:  # refused or failed (a kernel that does not
                    # compile for these shapes): say so and go on, the other arms still count
                    print(f"B={batch:3d} ctx={context:6d} {arm:>18}: failed: {error!r:.300}")
                    failures += 1
                    continue
                rows.append(row)
                print(
                    f"B={batch:3d} ctx={context:6d} {arm:>18}: {row['cache_bytes_per_token']:7d} "
                    f"B/token, step {row['step_ms']:8.3f} ms, {row['tokens_per_s']:9.1f} tok/s, "
                    f"ITL p50 {row['itl_ms_p50']:8.3f} p90 {row['itl_ms_p90']:8.3f} ms "
                    f"({row['steps']} steps; attention {row['decode_attention']})",
                    flush=True,
                )
                if args.out is not None:
                    args.out.mkdir(parents=True, exist_ok=True)
                    summary = {"cache_bytes_per_token": sizes, "rows": rows}
                    (args.out / "mla_engine.json").write_text(json.dumps(summary, indent=1))
    print(f"failures: {failures}")
    return 1 if failures else 0  # a failed arm fails the stage, as the other probes do


if __name__ == "__main__":
    sys.exit(main())
