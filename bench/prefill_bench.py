"""One prompt chunk's attention: the causal prefill kernel against the reference, and a launch sweep.

``PYTHONPATH=. python -m bench.prefill_bench`` on a GPU times, for one 512-token chunk at the end
of a 16K- and a 32K-token sequence (the chunk's tokens are the last 512; the other keys are the
prompt's earlier chunks, already in the cache), Llama-3-8B attention shapes (32 query heads, 8
KV heads, head_dim 128, pages of 16, bfloat16, HND pool, B=1):

- ``reference``: ``paged.decode_attention(..., backend="reference")``, what a prompt chunk ran
  before the prefill kernel existed (it gathers every page of the table, per chunk);
- ``decodelab``: ``paged.decode_attention(..., backend="pallas")``, the public API, which runs
  ``kernels_pallas.paged_prefill`` with ``launch_parameters``' defaults (plus the two small
  copies that put q in the kernel's row order and the output back);
- ``kernel``: the raw ``paged_prefill`` for each launch of the sweep (``SWEEP``: query blocks
  of 16, 32, 64 tokens = 64, 128, 256 rows at G = 4; 2, 4, 8 pages a step; 4 or 8 warps; 1, 2
  or 3 pipeline stages). A launch Triton cannot compile (too much shared memory) is recorded as
  failed and skipped.

Figures: microseconds per chunk (median of the repeats, min and max kept), achieved TFLOP/s
(``paged_prefill.prefill_flops``: ``4 x H x D`` per visible (query, key) pair, 135 GFLOP at 16K,
271 at 32K) and that as a fraction of the H200's nominal dense bfloat16 peak, 989 TFLOP/s. The
KV bytes of the chunk's sequence (64 MiB at 16K) are recorded too: at these shapes they are a
floor of ~16 us against a compute floor of ~137 us, so the kernel is compute-bound.

Method (``benchmarking.md``, ``bench/timing.py``): each arm is ``N`` calls inside one jitted
``lax.fori_loop``, each result folded into a carried checksum, the host clock around the
program, median of the repeats; the page tables of ``num_rotating_sets`` disjoint page sets are
rotated over one pool so that 4x the L2 lies between two visits of a set (cold L2); the query is
one random array. The reference takes about a second a call, so it gets 3 repeats. Each arm's
attribution is the Triton kernel its program calls (read from the lowered program), so the arms
cannot be confused; the API's output is checked against the reference's.

It prints one line per timed arm as it goes, then a table last (best launch first), and writes
``prefill_bench.json`` under ``--out`` (default ``$OUT`` if set, else a fresh temporary
directory). ``--smoke`` runs tiny shapes on the CPU in interpret mode (every code path, no speed
figure); ``--no-sweep`` times the reference and the API only (about 40 s on an H200; its
figures: ``docs/benchmark_results/2026-12-01-prefill.md``). Each launch of the
sweep adds a Triton compilation and about half a second of timing; where one command is
limited in time, sweep one context a run (``--contexts 16384`` then ``--contexts 32768``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import pathlib
import shlex
import sys
import tempfile
import time
from typing import Any

H200_DENSE_BF16_TFLOPS = 989.0
CONTEXTS = (16384, 32768)
CHUNK = 512
STANDARD = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
SMOKE_CONTEXTS = (80,)
SMOKE_CHUNK = 40
SMOKE = dict(num_q_heads=8, num_kv_heads=2, head_dim=32, page_size=16)
SWEEP = [
    {"block_q": block_q, "pages_per_step": pages, "num_warps": warps, "num_stages": stages}
    for block_q, pages, warps, stages in itertools.product(
        (16, 32, 64), (2, 4, 8), (4, 8), (1, 2, 3)
    )
]
SMOKE_SWEEP = [
    {"block_q": 16, "pages_per_step": 2, "num_warps": 4, "num_stages": 1},
    {"block_q": 4, "pages_per_step": 1, "num_warps": 4, "num_stages": 2},
]
REFERENCE_REPEATS = 3
# Priors for sizing the first timed program (bench.timing.expected_us): a second-long program
# of the reference at ~0.5 TFLOP/s, the kernel at ~300.
REFERENCE_PRIOR_TFLOPS = 0.5
KERNEL_PRIOR_TFLOPS = 300.0
# Relative error of the API's bfloat16 output against the reference's (the bfloat16 bound of
# docs/testing.md; the first H200 run measured about 2e-3).
DISAGREEMENT_TOLERANCE = 1e-2


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.prefill_bench",
        description="one prompt chunk's attention: prefill kernel vs reference, launch sweep",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, interpreted")
    parser.add_argument("--no-sweep", action="store_true", help="time reference and API only")
    parser.add_argument(
        "--contexts",
        type=lambda text: tuple(int(c) for c in text.split(",")),
        default=None,
        help=f"comma-separated sequence lengths (default {','.join(map(str, CONTEXTS))})",
    )
    parser.add_argument(
        "--sweep-contexts",
        type=lambda text: tuple(int(c) for c in text.split(",")),
        default=None,
        help="contexts at which to sweep the launch parameters (default: every context)",
    )
    parser.add_argument("--out", type=pathlib.Path, default=None, help="directory of the JSON")
    return parser.parse_args(argv)


@dataclasses.dataclass
class Inputs:
    """One case's inputs: a query, one pool, and the page tables of the rotating sets.

    Attributes:
      q: ``[1, chunk, H, D]`` bfloat16 (float32 in a smoke run).
      k_pages, v_pages: ``[num_pages, KVH, page_size, D]``; page 0 unused.
      page_indptr, last_page_len: the one request's table arrays, the same for every set.
      page_indices: ``[num_sets, pages_per_set]``: each set's pages, disjoint, scattered.
    """

    context: int
    chunk: int
    shape: dict[str, int]
    num_sets: int
    q: Any
    k_pages: Any
    v_pages: Any
    page_indptr: Any
    page_indices: Any
    last_page_len: Any

    @property
    def sm_scale(self) -> float:
        return self.shape["head_dim"] ** -0.5

    def operands(self):
        return (
            self.q,
            self.k_pages,
            self.v_pages,
            self.page_indptr,
            self.page_indices,
            self.last_page_len,
        )

    def delete(self) -> None:
        for array in self.operands():
            array.delete()


def make_inputs(context: int, chunk: int, shape: dict[str, int], options, dtype) -> Inputs:
    """Random normal query and pool, generated on the device; pages of each set a random
    permutation scattered over the pool (page 0 left out)."""
    import jax
    import jax.numpy as jnp

    page_size, num_kv_heads, head_dim = shape["page_size"], shape["num_kv_heads"], shape["head_dim"]
    kv_bytes = 2 * context * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize
    num_sets = options.num_sets_for(kv_bytes)
    pages_per_set = -(-context // page_size)
    num_pages = 1 + num_sets * pages_per_set
    key_q, key_k, key_v, key_perm = jax.random.split(jax.random.key(context), 4)
    pool_shape = (num_pages, num_kv_heads, page_size, head_dim)
    permutation = 1 + jax.random.permutation(key_perm, num_pages - 1).astype(jnp.int32)
    last = context - (pages_per_set - 1) * page_size
    return Inputs(
        context=context,
        chunk=chunk,
        shape=shape,
        num_sets=num_sets,
        q=jax.random.normal(key_q, (1, chunk, shape["num_q_heads"], head_dim), dtype),
        k_pages=jax.random.normal(key_k, pool_shape, dtype),
        v_pages=jax.random.normal(key_v, pool_shape, dtype),
        page_indptr=jnp.asarray([0, pages_per_set], jnp.int32),
        page_indices=permutation.reshape(num_sets, pages_per_set),
        last_page_len=jnp.asarray([last], jnp.int32),
    )


def _table(page_indptr, page_indices, last_page_len, set_index, page_size):
    import paged

    return paged.PageTable(page_indptr, page_indices[set_index], last_page_len, page_size)


def api_loop(inputs: Inputs, backend: str):
    """One call = ``paged.decode_attention`` of the chunk on rotating set ``set_index``."""
    import paged
    from bench.timing import TimedLoop

    def step(set_index, operands):
        q, k_pages, v_pages, page_indptr, page_indices, last_page_len = operands
        table = _table(
            page_indptr, page_indices, last_page_len, set_index, inputs.shape["page_size"]
        )
        cache = paged.KVCache(k_pages, v_pages, "HND")
        return paged.decode_attention(q, cache, table, backend=backend)

    return TimedLoop(step, inputs.num_sets, inputs.operands())


def kernel_loop(inputs: Inputs, launch: dict[str, int], interpret: bool):
    """One call = the raw prefill kernel with ``launch`` on rotating set ``set_index``."""
    from bench.timing import TimedLoop
    from kernels_pallas.paged_prefill import paged_prefill

    def step(set_index, operands):
        q, k_pages, v_pages, page_indptr, page_indices, last_page_len = operands
        return paged_prefill(
            q,
            k_pages,
            v_pages,
            page_indices[set_index],
            page_indptr,
            last_page_len,
            layout="HND",
            sm_scale=inputs.sm_scale,
            logits_soft_cap=None,
            interpret=interpret,
            **launch,
        )

    return TimedLoop(step, inputs.num_sets, inputs.operands())


def attribution(loop, options, fallback: str) -> str:
    """The Triton prefill kernel a loop's program calls (``fallback`` where it calls none:
    the reference; ``interpret`` where nothing is compiled)."""
    from bench.suites import peers

    if options.interpret:
        return "interpret"
    names = peers.triton_kernel_names(loop.lowered_text(), "paged_prefill")
    return "+".join(names) if names else fallback


def timed_row(
    inputs: Inputs, loop, options, *, arm: str, fallback: str, prior_tflops: float, **extra
):
    """Times ``loop`` and returns the JSON row of one arm."""
    from bench.timing import expected_us
    from kernels_pallas.paged_prefill import prefill_flops

    shape = inputs.shape
    flops = prefill_flops([inputs.context], inputs.chunk, shape["num_q_heads"], shape["head_dim"])
    kv_bytes = (
        2 * inputs.context * shape["num_kv_heads"] * shape["head_dim"] * inputs.q.dtype.itemsize
    )
    prior = expected_us(flops, prior_tflops)  # "bytes" at "TB/s": FLOPs at TFLOP/s, same units
    timing = options.time(loop, expected_us_per_call=prior, sweep=arm == "kernel")
    achieved = flops / (timing.median_us * 1e-6) / 1e12
    row = {
        "case": f"B=1 ctx={inputs.context} q_len={inputs.chunk}",
        "arm": arm,
        "attribution": attribution(loop, options, fallback),
        "median_us": timing.median_us,
        "min_us": timing.min_us,
        "max_us": timing.max_us,
        "flops": flops,
        "achieved_tflops": achieved,
        "fraction_of_peak": achieved / H200_DENSE_BF16_TFLOPS,
        "bytes": kv_bytes,
        "achieved_tbps": kv_bytes / (timing.median_us * 1e-6) / 1e12,
        "iters": timing.calls_per_sample,
        "num_sets": timing.num_sets,
        "samples_us": list(timing.samples_us),
        **extra,
    }
    print(
        f"{row['case']:28s} {arm:10s} {timing.median_us:12.1f} us {achieved:8.1f} TFLOP/s "
        f"{row['fraction_of_peak']:6.1%}  {row['attribution']}",
        flush=True,
    )
    return row


def run_case(context: int, chunk: int, shape, options, *, sweep: list[dict[str, int]], dtype):
    """Every arm of one context; returns ``(rows, notes)``."""
    import dataclasses as dc
    import gc

    import numpy as np

    from kernels_pallas.paged_prefill import launch_parameters

    rows, notes = [], []
    inputs = make_inputs(context, chunk, shape, options, dtype)
    try:
        reference_options = dc.replace(options, repeats=min(options.repeats, REFERENCE_REPEATS))
        reference = api_loop(inputs, "reference")
        rows.append(
            timed_row(
                inputs,
                reference,
                reference_options,
                arm="reference",
                fallback="paged.decode_attention(reference): gather + masked softmax",
                prior_tflops=REFERENCE_PRIOR_TFLOPS,
            )
        )
        api = api_loop(inputs, "pallas")
        default = launch_parameters(
            shape["head_dim"], shape["num_q_heads"] // shape["num_kv_heads"], shape["page_size"]
        )
        row = timed_row(
            inputs,
            api,
            options,
            arm="decodelab",
            fallback="no-triton-kernel-found",
            prior_tflops=KERNEL_PRIOR_TFLOPS,
            **default,
        )
        expected = np.asarray(reference.output(0), np.float32)
        got = np.asarray(api.output(0), np.float32)
        error = float(np.linalg.norm(got - expected) / np.linalg.norm(expected))
        row["relative_error_vs_reference"] = error
        if not error < DISAGREEMENT_TOLERANCE:
            notes.append(f"ctx={context}: the API differs from the reference by {error:.3g}")
        rows.append(row)
        del reference, api
        gc.collect()
        for launch in sweep:
            try:
                rows.append(
                    timed_row(
                        inputs,
                        kernel_loop(inputs, launch, options.interpret),
                        options,
                        arm="kernel",
                        fallback="no-triton-kernel-found",
                        prior_tflops=KERNEL_PRIOR_TFLOPS,
                        **launch,
                    )
                )
            except Exception as error:  # a launch Triton cannot build (shared memory): record it
                message = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
                print(f"ctx={context} launch {launch} failed: {message}", flush=True)
                notes.append(f"ctx={context}: launch {launch} failed ({message})")
            gc.collect()
    finally:
        inputs.delete()
    return rows, notes


def format_table(rows: list[dict[str, Any]]) -> str:
    """The summary: per case, the reference, the API, then the sweep's launches best first."""
    lines = [
        f"{'case':28s} {'arm':10s} {'block_q':>7s} {'pages':>5s} {'warps':>5s} {'stages':>6s} "
        f"{'us/chunk':>12s} {'TFLOP/s':>8s} {'% of 989':>8s}"
    ]
    for case in dict.fromkeys(row["case"] for row in rows):
        in_case = [row for row in rows if row["case"] == case]
        fixed = [row for row in in_case if row["arm"] != "kernel"]
        swept = sorted(
            (row for row in in_case if row["arm"] == "kernel"), key=lambda r: r["median_us"]
        )
        for row in fixed + swept:
            launch = [
                str(row.get(name, "-"))
                for name in ("block_q", "pages_per_step", "num_warps", "num_stages")
            ]
            lines.append(
                f"{case:28s} {row['arm']:10s} {launch[0]:>7s} {launch[1]:>5s} {launch[2]:>5s} "
                f"{launch[3]:>6s} {row['median_us']:12.1f} {row['achieved_tflops']:8.1f} "
                f"{row['fraction_of_peak']:8.1%}"
            )
        reference = next((r for r in fixed if r["arm"] == "reference"), None)
        api = next((r for r in fixed if r["arm"] == "decodelab"), None)
        if reference and api:
            lines.append(
                f"{case:28s} decodelab vs reference: {reference['median_us'] / api['median_us']:.1f}x"
            )
    return "\n".join(lines)


def render_markdown(document: dict) -> str:
    """The report of one run as markdown: the environment, the table, the notes (every figure
    comes from ``document``, the JSON the run wrote)."""
    shape = document["shape"]
    lines = [
        f"# prefill: one prompt chunk's attention ({document['date']})",
        "",
        f"- GPU: {document['gpu']}, driver {document['driver']}, jax {document['jax_version']}",
        f"- commit: {document['commit']}",
        f"- command: `{document['command']}`",
        f"- timing: {document['timing_method']}",
        f"- shape: B=1, {shape['num_q_heads']}/{shape['num_kv_heads']} heads of "
        f"{shape['head_dim']}, pages of {shape['page_size']} ({shape['layout']}), "
        f"{shape['dtype']}, a chunk of {shape['chunk']} new tokens after the context",
        f"- floor: the chunk's causal FLOPs over a {document['peak_tflops']:.0f} TFLOP/s dense "
        "bfloat16 tensor peak (nominal); prefill of a long chunk is compute bound",
        "",
        "```",
        format_table(document["cases"]),
        "```",
    ]
    if document.get("smoke"):
        lines += ["", "SMOKE RUN: interpreted on the CPU; these are not speed figures."]
    if document["notes"]:
        lines += ["", "Notes:", ""] + [f"- {note}" for note in document["notes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--render"]:  # markdown from a JSON an earlier run wrote
        path = pathlib.Path(argv[1])
        document = json.loads(path.read_text())
        path.with_suffix(".md").write_text(render_markdown(document))
        print(f"wrote {path.with_suffix('.md')}")
        return 0
    arguments = parse_arguments(argv)
    if arguments.smoke and "jax" not in sys.modules:
        os.environ["JAX_PLATFORMS"] = "cpu"

    import jax
    import jax.numpy as jnp

    from bench import report
    from bench.options import RunOptions
    from bench.timing import timing_method_description

    if arguments.smoke:
        device = jax.devices("cpu")[0]
    elif jax.default_backend() != "gpu":
        print("speed figures need a GPU; this machine has none (use --smoke to exercise the code)")
        return 0
    else:
        device = jax.devices()[0]
    options = RunOptions(dry_run=arguments.smoke, repeats=2 if arguments.smoke else 5)
    shape = SMOKE if arguments.smoke else STANDARD
    chunk = SMOKE_CHUNK if arguments.smoke else CHUNK
    contexts = arguments.contexts or (SMOKE_CONTEXTS if arguments.smoke else CONTEXTS)
    sweep_contexts = contexts if arguments.sweep_contexts is None else arguments.sweep_contexts
    full_sweep = SMOKE_SWEEP if arguments.smoke else SWEEP
    dtype = jnp.float32 if arguments.smoke else jnp.bfloat16
    command = shlex.join(["python", "-m", "bench.prefill_bench", *argv])
    print(f"prefill_bench on {device.device_kind}: {command}", flush=True)
    rows, notes = [], []
    started = time.perf_counter()
    with jax.default_device(device):
        for context in contexts:
            sweep = [] if arguments.no_sweep or context not in sweep_contexts else full_sweep
            case_rows, case_notes = run_case(
                context, chunk, shape, options, sweep=sweep, dtype=dtype
            )
            rows += case_rows
            notes += case_notes
    document = {
        "suite": "prefill",
        **report.environment(device),
        "command": command,
        "timing_method": timing_method_description(options.repeats)
        + f"; the reference arm: {REFERENCE_REPEATS} repeats",
        "peak_tflops": H200_DENSE_BF16_TFLOPS,
        "smoke": arguments.smoke,
        "shape": {**shape, "chunk": chunk, "dtype": jnp.dtype(dtype).name, "layout": "HND"},
        "seconds": time.perf_counter() - started,
        "notes": notes,
        "cases": rows,
    }
    out_dir = arguments.out or pathlib.Path(
        os.environ.get("OUT") or tempfile.mkdtemp(prefix="prefill-bench-")
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "prefill_bench.json"
    path.write_text(json.dumps(document, indent=1) + "\n")
    path.with_suffix(".md").write_text(render_markdown(document))
    for note in notes:
        print(f"note: {note}")
    if arguments.smoke:
        print("SMOKE RUN: interpreted on the CPU; these are not speed figures.")
    print(f"wrote {path} and its .md")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
