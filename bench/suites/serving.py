"""The ``serving`` suite: the standard serving scenarios through ``serving.Engine``, the kill
switch (every op its pure-JAX reference) against the default (every kernel ``"auto"`` picks), in
the same run (issue 7, "Speed (H200): the standard serving scenarios").

Model: random weights with Llama-3-8B layer shapes (``serving.config.llama3_8b_like``: hidden 4096,
32 query and 8 KV heads of 128, MLP 14336, vocabulary 128256), ``NUM_LAYERS`` = 4 layers instead
of 32, bfloat16; pages of 16 tokens, HND pools; every request samples at temperature 1 with top-k
50 and top-p 0.9 (the standard grid's filters), its own seed, no stop token (so it generates
exactly ``max_tokens``). With 4 layers the step reads 1.75 GB of layer weights and 1.05 GB of
``lm_head``: the output projection and the sampling weigh about 8x more in the step than in the
32-layer model, and attention's share is the share of 4 layers (it scales with the layers, as
the rest of the layers does).

Scenarios (``SCENARIOS``; ``--quick``: the first two):

- ``single B=1 ctx=512``: one request, 128 new tokens.
- ``batch B=4 ctx=512``: four requests at once, 128 new tokens each.
- ``long B=1 ctx=16384`` and ``long B=1 ctx=32768``: one request, 64 new tokens; the cache is
  built by chunked prefill (chunks of 512; the default arm's attention runs them on the causal
  prefill kernel, ``kernels_pallas/paged_prefill.py``, the decode kernel taking runs of at most
  16 queries, ``paged.decode.MAX_KERNEL_Q_LEN``).
- ``shared_prefix B=32 ctx=4096``: 32 requests whose prompts share their first 4096 tokens
  (256 full pages, shared read-only by the scheduler) and differ in a 32-token tail; 64 new
  tokens each.

- ``continuous``: requests arriving while others decode (Poisson, seeded), prompts of 64 to
  8192 tokens, one row per (prefill chunk size, grant interval) under the default arm:
  ``bench/suites/serving_load.py`` (``LOAD_SCENARIO``; not in ``--quick``; its dry run runs
  toy prompts for about a second on the reference backend).

``ctx`` counts the tokens in the cache when decoding starts: a prompt has ``ctx + 1`` tokens
(``ctx + 32 + 1`` with the shared-prefix tail), since the scheduler prefills all but the last
token and the first decode step feeds it. Prefills are then whole chunks of 512, one program a
table bucket, instead of a tail of 9 chunk lengths (256 + 128 + ... + 1), each a compilation.
``max_prefill_tokens`` covers every prompt of a scenario, so all prefill runs in the first step
(the shared-prefix requests after the first wait one step for the prefix's pages) and every
later step is pure decode. One pool size serves every scenario (``pool_pages``, sized for the
largest without counting on sharing), so programs compiled for one scenario serve the next.

Arms, each a fresh engine per scenario, one after the other (``ARMS``):

- ``reference``: ``Engine(backend="auto")`` with ``DECODELAB_BACKEND=reference`` set while the
  engine is built, run, reported and timed: the kill switch turns every ``"auto"`` into the
  pure-JAX reference (``kernels_pallas/platform.py``), the explicit ``backend=`` argument of an
  op included. The engine's programs cache on ``backend="auto"`` like the default's, so the jit
  caches are cleared (``jax.clear_caches``) before each arm: otherwise the second arm would run
  the first arm's compiled programs. (A dry run keeps them from ``decodelab-sync`` to
  ``decodelab``, two arms under the same switch: ``dry_run_clears``.)
- ``decodelab-sync``: the default's kernels with ``Engine(overlap=False)``: the synchronous
  loop (each step's tokens fetched before the next step is planned), the engine's step as it was
  before issue 18, so the overlap's gain is measured in the same run.
- ``decodelab``: the default, ``Engine(backend="auto")`` (steps overlapped: step ``N + 1``
  dispatched before step ``N``'s tokens are fetched; speculative engines step synchronously): on a GPU the paged-decode, norm,
  RoPE + append and dual-pivot sampling kernels (and the acceptance kernel when speculating;
  Gumbel-max runs its kernel from batch ``sampling.api.GUMBEL_KERNEL_MIN_BATCH`` up and XLA's
  reference below); in a dry run on the
  CPU "auto" is the reference, so the dry run passes ``backend="pallas"`` (every kernel,
  interpreted) to exercise the kernel path.
- ``decodelab-nocascade``: the default with ``Engine(cascade="off")``, in the ``shared_prefix``
  scenario only (on a GPU; a dry run skips it): what the engine's cascade attention gains
  where its requests share a prompt, in the same run. The default arm's ``attribution`` says
  whether cascade ran (``decode: cascade`` in the backend report).

``attribution`` is what ``Engine.backend_report()`` reads off the traced programs: the kernel
names each op calls, or ``reference``, and the engine's loop (overlapped or synchronous). Two arms that ran the same code have the same
attribution and the report is refused (``bench.harness.report.check_distinguishable``).

Each (scenario, arm) runs the scenario twice on fresh engines of the same shapes: the first run
compiles every program (prefill chunks, decode steps of each table bucket and split plan), the
second is measured; it is run again (at most ``MAX_MEASURED_RUNS`` runs) while one of its steps
still compiled (``StepStats.compiled``: the first kernel trace of a process may import a module
that registers a JAX option, which changes the tracing context and misses the cache once).
``compiled_steps`` in the JSON counts the measured run's steps that compiled (0 expected; a
note says so otherwise: those figures include compilation).

Figures of a row (``extra``):

- ``tokens_per_s``: tokens emitted by decode-only steps (steps that ran no prefill) over those
  steps' wall time (``StepStats.total_s``: host planning, inputs, the decode program until its
  tokens reach the host, commit).
- ``itl_p50_ms``, ``itl_p99_ms``: inter-token latency, gaps between consecutive tokens of each
  request (``Engine.timings``), all requests pooled.
- ``ttft_ms`` (median over requests) and ``ttft_max_ms``: submission to first token; all
  requests are submitted together, so this includes the prefill of every prompt admitted
  before it.
- ``host_us_per_step``: median ``StepStats.host_s`` of the decode-only steps.
- ``dispatch_us_per_step``, ``device_wait_us_per_step``, ``fetch_us_per_step``: medians of the
  three parts of ``StepStats.decode_s``: the jitted call until it returns, the wait for the
  outputs, their copy to the host.
- ``median_us``, ``min_us``, ``max_us``: a decode-only step's wall time (``total_s``); ``bytes``
  what a decode step must move: every weight once (layers, final norm, ``lm_head``; the
  embedding's ``B`` rows) plus the K and V of every request's context at the middle step;
  ``achieved_tbps`` = bytes / median step.

Where a step's time goes (``attention_fraction``, ``sampling_fraction``, ``rest_fraction`` of the
median wall step; ``device_step_us``; ``host_and_dispatch_fraction`` = wall step minus device
step, a part of the rest). Method, ablation at the call site: the decode step of the middle
decode-only step (its inputs captured from the measured run, the engine's caches as they are)
runs ``N`` times inside one jitted ``lax.fori_loop`` (the engine's ``decode_step``, each step
fed the tokens the previous one sampled and its key folded one step further, so nothing is
loop-invariant; the caches are carried and donated, so the KV writes happen in place), host
clock around the program, median of the repeats: ``device_step_us``. The same loop is compiled
twice more, with ``paged.decode_attention`` replaced by ``o = q`` (same shape and dtype; the
RoPE + append still writes the cache) and with sampling (``tempered_probs`` + the filtered
sampler) replaced by an arg max of the logits (one read of them, so that ``lm_head`` is not
removed as dead code). Attention's time is full minus no-attention, sampling's full minus
no-sampling, the rest what is left of the wall step. The step's weights (2.8 GB) keep the L2
cold between two visits of any KV page.

Splitting a run: ``DECODELAB_SERVING_SCENARIOS=single,batch`` (kinds, comma-separated) runs
only those scenarios; give each part its own ``--out``, as reports of one suite and day share
a file name.

Op level against the call site (``attention_op_us``, ``sampling_op_us``): the same ops alone
at the step's shapes, ``bench.harness`` method (rotating sets for a cold L2, dispatch amortized
in one jitted loop): ``paged.decode_attention`` on a batch of ``B`` requests of the step's mean
context (``bench.harness.attention_inputs``, ``page_indices`` padded to the engine's bucket, the engine's
split plan), and tempered softmax + ``sampling.filtered_sample`` on float32 logits ``[B, V]``.
The notes compare each op's speedup (reference / default) alone with the same op's speedup at
the call site (``attention_callsite_us`` = (full - no-attention) / layers), and the step's.
The sampler's input differs between the two: synthetic logits alone, the model's at the call
site, which with random weights are flatter and take the dual-pivot kernel more rounds
(``bench/probes/rounds.py``); the reference (one sort, then a fixed number of rounds in a
``fori_loop``) costs the same on both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import paged
import sampling
import speculative
from bench.harness import CaseResult, CopyCeiling, RunOptions, TimedLoop, expected_us, report
from bench.harness.attention_inputs import make_attention_setup
from bench.suites import SuiteOutput, serving_load
from kernels_pallas.platform import KILL_SWITCH_VARIABLE, resolve_backend
from serving import config as config_lib
from serving import engine as engine_lib
from serving import keys as keys_lib
from serving import model as model_lib
from serving import programs
from serving.requests import Request, SamplingParams
from serving.step_stats import StepStats

NUM_LAYERS = 4
PAGE_SIZE = 16
PREFILL_CHUNK = 512
TEMPERATURE, TOP_K, TOP_P = 1.0, 50, 0.9
SEED = 7
# The report's arm names; reference first (the ratio's base).
ARMS = ("reference", "decodelab-sync", "decodelab-nocascade", "decodelab")
# Seconds a timed step loop should last (its calls are sized from the engine's step time).
LOOP_TARGET_SECONDS = 0.2
MAX_LOOP_CALLS = 256
# Split a run across commands: a comma-separated list of scenario kinds (``Scenario.kind``).
SCENARIOS_VARIABLE = "DECODELAB_SERVING_SCENARIOS"
# ... and the continuous load's configurations (``load_scenario_for``).
LOAD_CONFIGS_VARIABLE = "DECODELAB_SERVING_LOAD_CONFIGS"
MAX_MEASURED_RUNS = 3
# Priors (TB/s, floor us) for sizing the op-level programs (a prior 4x off costs one more
# compilation): the reference attention reads every padded slot once per request; sort-based
# top-k/top-p is about 0.12 ms a row at vocab 128256 (docs/peers.md).
ATTENTION_PRIOR = {"pallas": (1.0, 10.0), "reference": (0.1, 30.0)}
SAMPLING_PRIOR = {"pallas": (0.5, 20.0), "reference": (0.02, 100.0)}
LOGITS_SCALE = 3.0  # the sampling suites' logits scale for the op-level sampler
# Why the sampler's op-level speedup shrinks at the call site (bench/probes/rounds.py).
SAMPLING_SHRINK_NOTE = (
    "why the sampler's speedup shrinks at the call site: the op-level arm samples synthetic "
    "logits (LOGITS_SCALE x normal), the call site the random-weight model's, which are flatter; "
    "dual-pivot rejection takes more rounds on a flatter row (python -m bench.probes.rounds: "
    "3.54 against 2.06 mean rounds, docs/benchmark_results/archive/2026-12-01-rounds-probe.json), "
    "while the reference (one sort, then a fixed number of rounds in a fori_loop) costs the "
    "same on both"
)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One serving scenario.

    Attributes:
      kind: ``single``, ``batch``, ``long``, ``shared_prefix``.
      num_requests: clients, submitted together; also the engine's ``parallel`` (outside a dry
        run).
      context: the case's nominal context: the prompt length before the one token the
        scheduler leaves to the first decode step, and before a shared-prefix request's own
        ``tail`` (so ``shared_prefix ctx=4096`` caches 4096 + tail tokens).
      new_tokens: ``max_tokens`` of every request.
      shared_prefix: leading tokens every prompt shares (0: independent prompts).
      tail: tokens after the shared prefix, each request its own.
    """

    kind: str
    num_requests: int
    context: int
    new_tokens: int
    shared_prefix: int = 0
    tail: int = 0

    @property
    def case(self) -> str:
        return f"{self.kind} B={self.num_requests} ctx={self.context}"

    @property
    def prompt_tokens(self) -> int:
        return self.context + self.tail + 1

    @property
    def total_prompt_tokens(self) -> int:
        return self.num_requests * self.prompt_tokens


SCENARIOS = (
    Scenario("single", 1, 512, 128),
    Scenario("batch", 4, 512, 128),
    Scenario("long", 1, 16384, 64),
    Scenario("long", 1, 32768, 64),
    Scenario("shared_prefix", 32, 4096, 64, shared_prefix=4096, tail=32),
)
QUICK_SCENARIOS = SCENARIOS[:2]
# Dry run: every kind at toy sizes. One decode batch size (DRY_RUN_PARALLEL) and one page-table
# bucket for all, and prefill chunks longer than the kernel's 16 queries, so that each arm
# compiles each program once (interpreted kernels take seconds each to compile on a CPU).
DRY_RUN_SCENARIOS = (
    Scenario("single", 1, 32, 5),
    Scenario("batch", 2, 32, 5),
    Scenario("long", 1, 64, 4),  # one long prompt (the grid's two differ in size only); 64, as
    # shared_prefix's, so it compiles no program of its own
    Scenario("shared_prefix", 2, 64, 4, shared_prefix=64, tail=32),
)
# Continuous load (bench/suites/serving_load.py): Poisson arrivals while others decode, one row
# per (prefill_chunk_size, prefill_grant_interval). On the GPU: 20 s of arrivals at 16 slots,
# prompts of 64 to 8192 tokens; in a dry run a few seconds of toy prompts on the reference.
LOAD_SCENARIO = serving_load.LoadScenario(
    parallel=16,
    rate_per_s=24.0,
    duration_s=20.0,
    prompt_lengths=(64, 512, 2048, 8192),
    new_tokens=128,
    configs=((512, 1), (512, 8), (2048, 1), (2048, 8)),
    seed=SEED,
)
DRY_RUN_LOAD_SCENARIO = serving_load.LoadScenario(
    parallel=2,
    rate_per_s=30.0,
    duration_s=1.0,
    prompt_lengths=(8, 24, 40),
    new_tokens=6,
    configs=((8, 0), (16, 2)),
    seed=SEED,
)
DRY_RUN_PARALLEL = 2
DRY_RUN_PREFILL_CHUNK = 32
DRY_RUN_OP_CONTEXT = 48  # one op-level shape for every dry-run scenario: one compilation
# Runs of each step-loop variant in a dry run: one, timed with its compilation (a dry run's
# figures are not speed figures; each run of the interpreted kernels costs CPU seconds).
DRY_RUN_UNTIMED_LOOPS = 0
DRY_RUN_TIMED_LOOPS = 1


def scenarios_for(options: RunOptions) -> tuple[Scenario, ...]:
    """The scenarios of this run (module docstring), filtered by ``DECODELAB_SERVING_SCENARIOS``
    when set (e.g. ``single,batch``).

    Raises:
      ValueError: for a kind in the variable that no scenario has.
    """
    if options.dry_run:
        chosen = DRY_RUN_SCENARIOS
    elif options.quick:
        chosen = QUICK_SCENARIOS
    else:
        chosen = SCENARIOS
    wanted = os.environ.get(SCENARIOS_VARIABLE, "").strip()
    if wanted:
        kinds = {kind.strip() for kind in wanted.split(",") if kind.strip()}
        unknown = kinds - {scenario.kind for scenario in SCENARIOS} - {LOAD_SCENARIO.kind}
        if unknown:
            raise ValueError(f"{SCENARIOS_VARIABLE} names unknown kinds {sorted(unknown)}")
        chosen = tuple(scenario for scenario in chosen if scenario.kind in kinds)
    return chosen


def load_scenario_for(options: RunOptions) -> serving_load.LoadScenario | None:
    """The continuous load of this run: in a full run and a dry run (not ``--quick``), unless
    ``DECODELAB_SERVING_SCENARIOS`` leaves out ``continuous``; its configurations chosen by
    ``DECODELAB_SERVING_LOAD_CONFIGS`` when set (``CHUNK:INTERVAL`` pairs, comma-separated, e.g.
    ``512:1,512:8``), to split the load across device commands.

    Raises:
      ValueError: naming the variable and the entry that is not ``CHUNK:INTERVAL`` with a
        power-of-two chunk and an interval >= 0.
    """
    if options.quick and not options.dry_run:
        return None
    wanted = os.environ.get(SCENARIOS_VARIABLE, "").strip()
    if wanted and LOAD_SCENARIO.kind not in {kind.strip() for kind in wanted.split(",")}:
        return None
    scenario = DRY_RUN_LOAD_SCENARIO if options.dry_run else LOAD_SCENARIO
    chosen = os.environ.get(LOAD_CONFIGS_VARIABLE, "").strip()
    if not chosen:
        return scenario
    configs = []
    for entry in chosen.split(","):
        try:
            chunk, interval = (int(part) for part in entry.split(":"))
        except ValueError:
            chunk, interval = 0, -1
        if chunk < 1 or chunk & (chunk - 1) or interval < 0:
            raise ValueError(
                f"{LOAD_CONFIGS_VARIABLE} entries must be CHUNK:INTERVAL (a power-of-two chunk, "
                f"an interval >= 0), got {entry!r}"
            )
        configs.append((chunk, interval))
    return dataclasses.replace(scenario, configs=tuple(configs))


def run_load_rows(model, num_pages: int, options: RunOptions) -> tuple[list, list[str]]:
    """The continuous-load rows (``bench/suites/serving_load.py``): the default arm's engine
    (overlapped, every kernel "auto" picks); in a dry run the reference backend, as interpreted
    kernels would take minutes of CPU for a few seconds of load."""
    scenario = load_scenario_for(options)
    if scenario is None:
        return [], []
    config = model[0]
    backend = "reference" if options.dry_run else "auto"
    rows, notes = [], []

    def make_engine(chunk, budget, interval):
        return engine_lib.Engine(
            model,
            num_pages=num_pages,
            page_size=PAGE_SIZE,
            parallel=scenario.parallel,
            backend=backend,
            max_prefill_tokens=budget,
            prefill_chunk_size=chunk,
            max_batched_tokens=budget,
            prefill_grant_interval=interval,
            seed=SEED,
        )

    for chunk, interval in scenario.configs:
        case = scenario.case(chunk, interval)
        report.print_progress(case)
        try:
            figures, engine = serving_load.run_load_case(
                make_engine, scenario, chunk, interval, config.vocab_size
            )
        except Exception as error:  # one failing configuration must not lose the others
            notes.append(f"{case} failed: {type(error).__name__}: {str(error)[:300]}")
            continue
        loop = "overlapped" if engine.overlap else "synchronous"
        attribution = (
            f"{attribution_of(engine.backend_report())}; engine loop={loop}; "
            f"chunk={chunk}; grant={interval}"
        )
        rows.append(serving_load.load_row(case, "decodelab", attribution, figures))
        if figures["compiled_steps"]:
            notes.append(
                f"{case}: {figures['compiled_steps']} measured step(s) compiled a program; "
                "ITL and TTFT include compilation"
            )
        notes.append(
            f"{case}: {figures['requests']} requests, TTFT p50/p99 "
            f"{figures['ttft_p50_ms']:.1f}/{figures['ttft_p99_ms']:.1f} ms, ITL p50/p99 "
            f"{figures['itl_p50_ms']:.2f}/{figures['itl_p99_ms']:.2f} ms, in admission "
            f"windows {figures['itl_admission_p50_ms']:.2f}/"
            f"{figures['itl_admission_p99_ms']:.2f} ms, {figures['tokens_per_s']:.1f} tokens/s, "
            f"{figures['granted_chunks']} granted chunk(s)"
        )
        engine.target_caches = None
        del engine
        gc.collect()
    return rows, notes


def model_config(options: RunOptions) -> config_lib.ModelConfig:
    """Llama-3-8B layer shapes with ``NUM_LAYERS`` layers; the dry run's tiny target, 1 layer."""
    if options.dry_run:
        return dataclasses.replace(config_lib.TINY_TARGET, num_layers=1)
    return config_lib.llama3_8b_like(NUM_LAYERS, "bfloat16")


def pool_pages(
    scenarios: tuple[Scenario, ...],
    page_size: int,
    load: serving_load.LoadScenario | None = None,
) -> int:
    """One pool size for every scenario: the largest scenario's pages if nothing were shared
    (every request's whole footprint; for the continuous ``load``, every slot holding its
    longest prompt), plus the padding page, rounded up to 1024 pages."""
    needed = max(
        (
            scenario.num_requests * -(-(scenario.prompt_tokens + scenario.new_tokens) // page_size)
            for scenario in scenarios
        ),
        default=0,
    )
    if load is not None:
        longest = max(load.prompt_lengths) + load.new_tokens
        needed = max(needed, load.parallel * -(-longest // page_size))
    return -(-(needed + 1) // 1024) * 1024


# ----------------------------------------------------------------------------------------------
# The arms


@dataclasses.dataclass(frozen=True)
class Arm:
    """An arm: its report name, the engine's ``backend=``, whether the kill switch is set, and
    whether the engine overlaps its steps (``Engine(overlap=...)``), and its ``cascade=``."""

    name: str
    backend: str
    kill_switch: bool
    overlap: bool = True
    cascade: str = "auto"


def scenarios_of_arm(arm: Arm, scenarios, options: RunOptions):
    """The scenarios an arm runs: all of them, except in a dry run, where the synchronous arm
    runs the ``batch`` scenario alone (its code path differs from the default's in the engine's
    loop only, and every interpreted scenario costs CI time)."""
    if options.dry_run and arm.name == "decodelab-sync":
        return tuple(scenario for scenario in scenarios if scenario.kind == "batch")
    if arm.cascade == "off":
        return tuple(scenario for scenario in scenarios if scenario.kind == "shared_prefix")
    return tuple(scenarios)


def arms_for(options: RunOptions) -> tuple[Arm, ...]:
    default_backend = "pallas" if options.interpret else "auto"
    return (
        Arm("reference", "auto", True),
        Arm("decodelab-sync", default_backend, False, overlap=False),
        # A dry run leaves it out: on the CPU the default arm does not cascade either.
        *([] if options.dry_run else [Arm("decodelab-nocascade", "auto", False, cascade="off")]),
        Arm("decodelab", default_backend, False),
    )


@contextlib.contextmanager
def arm_environment(
    arm: Arm, *, clear_on_entry: bool = True, clear_on_exit: bool = True
) -> Iterator[None]:
    """Sets (or clears) the kill switch for the arm's block and clears JAX's caches on entry
    and exit, so that no program compiled under the other arm's switch is reused. A dry run
    skips a clear between two arms under the same switch (``dry_run_clears``)."""
    saved = os.environ.get(KILL_SWITCH_VARIABLE)
    if arm.kill_switch:
        os.environ[KILL_SWITCH_VARIABLE] = "reference"
    else:
        os.environ.pop(KILL_SWITCH_VARIABLE, None)
    if clear_on_entry:
        jax.clear_caches()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(KILL_SWITCH_VARIABLE, None)
        else:
            os.environ[KILL_SWITCH_VARIABLE] = saved
        if clear_on_exit:
            jax.clear_caches()


def dry_run_clears(arms: tuple[Arm, ...], index: int) -> dict[str, bool]:
    """``arm_environment``'s clears for ``arms[index]`` in a dry run: none between two arms
    under the same kill switch (``decodelab-sync`` and ``decodelab``: the same programs, stepped
    differently on the host), as each interpreted kernel takes seconds to compile on a CPU;
    the clears around the kill switch's arm stay."""
    arm = arms[index]
    before = arms[index - 1] if index > 0 else None
    after = arms[index + 1] if index + 1 < len(arms) else None
    return {
        "clear_on_entry": before is None or before.kill_switch != arm.kill_switch,
        "clear_on_exit": after is None or after.kill_switch != arm.kill_switch,
    }


def attribution_of(backends: dict[str, str]) -> str:
    """A one-line summary of ``Engine.backend_report()``: ``program: op=implementation``."""
    return "; ".join(f"{key}={value}" for key, value in sorted(backends.items()))


# ----------------------------------------------------------------------------------------------
# Requests and one engine run


def make_prompts(scenario: Scenario, vocab: int) -> list[list[int]]:
    """Random prompts (the same for both arms): independent ones, or one shared prefix and a
    private tail each."""
    rng = np.random.default_rng(SEED * 1000 + scenario.context + scenario.num_requests)
    if scenario.shared_prefix:
        prefix = rng.integers(0, vocab, scenario.shared_prefix).tolist()
        return [
            prefix + rng.integers(0, vocab, scenario.prompt_tokens - len(prefix)).tolist()
            for _ in range(scenario.num_requests)
        ]
    return [
        rng.integers(0, vocab, scenario.prompt_tokens).tolist()
        for _ in range(scenario.num_requests)
    ]


def make_requests(scenario: Scenario, prompts: list[list[int]], tag: str) -> list[Request]:
    return [
        Request(
            f"{tag}-{index}",
            prompt,
            SamplingParams(
                temperature=TEMPERATURE,
                top_k=TOP_K,
                top_p=TOP_P,
                seed=SEED + index,
                max_tokens=scenario.new_tokens,
            ),
        )
        for index, prompt in enumerate(prompts)
    ]


@dataclasses.dataclass
class MeasuredRun:
    """What one measured engine run left: the engine (its caches), the requests, its steps,
    the decode inputs of every step with all requests decoding, and the steps they belong to."""

    engine: engine_lib.Engine
    requests: list[Request]
    stats: list[StepStats]
    captured: list[tuple[int, programs.DecodeInputs]]


def new_engine(model, scenario: Scenario, arm: Arm, num_pages: int, options: RunOptions):
    parallel = DRY_RUN_PARALLEL if options.dry_run else scenario.num_requests
    chunk = DRY_RUN_PREFILL_CHUNK if options.dry_run else PREFILL_CHUNK
    return engine_lib.Engine(
        model,
        num_pages=num_pages,
        page_size=PAGE_SIZE,
        parallel=parallel,
        backend=arm.backend,
        overlap=arm.overlap,
        cascade=arm.cascade,
        max_prefill_tokens=max(chunk, scenario.total_prompt_tokens),
        prefill_chunk_size=chunk,
        seed=SEED,
    )


def measured_run(model, scenario, arm, num_pages, options, prompts) -> MeasuredRun:
    """The measured run, run again (at most ``MAX_MEASURED_RUNS`` runs) while one of its steps
    compiled (module docstring)."""
    for attempt in range(MAX_MEASURED_RUNS):
        engine = new_engine(model, scenario, arm, num_pages, options)
        run = run_engine(engine, make_requests(scenario, prompts, f"run{attempt}"), capture=True)
        if not any(s.compiled for s in run.stats) or attempt == MAX_MEASURED_RUNS - 1:
            return run
        engine = run = None
        gc.collect()
    raise AssertionError("unreachable")


def run_engine(engine, requests: list[Request], capture: bool) -> MeasuredRun:
    """Submits ``requests`` together and steps until all finish; with ``capture``, keeps the
    decode inputs of steps in which every request decodes (an overlapped step's rows feed
    their last token from the device: -1 in the captured inputs, see ``_decode_loop``)."""
    captured: list[tuple[int, programs.DecodeInputs]] = []
    stats: list[StepStats] = []
    decode_inputs = engine._decode_inputs

    def recording_decode_inputs(batch):
        inputs = decode_inputs(batch)
        captured.append((len(stats), inputs))
        return inputs

    if capture:
        engine._decode_inputs = recording_decode_inputs
    for request in requests:
        engine.submit(request)
    while engine.has_unfinished:
        stats.append(engine.step().stats)
    if capture:
        del engine._decode_inputs  # the method again
    full = [(i, inputs) for i, inputs in captured if stats[i].num_decode_rows == len(requests)]
    return MeasuredRun(engine, requests, stats, full)


# ----------------------------------------------------------------------------------------------
# The step loop (ablation at the call site)


@contextlib.contextmanager
def ablated(variant: str) -> Iterator[None]:
    """While tracing: ``no_attention`` makes ``paged.decode_attention`` and
    ``paged.cascade_decode_attention`` (the engine's cascade steps) return their query;
    ``no_sampling`` makes sampling an arg max of the logits; ``full`` changes nothing."""
    if variant == "full":
        yield
        return
    if variant == "no_attention":
        targets = [
            (paged, "decode_attention", lambda q, cache, table, **_: q),
            (paged, "cascade_decode_attention", lambda q, cache, levels, **_: q),
        ]
    elif variant == "no_sampling":
        targets = [
            (speculative, "tempered_probs", lambda logits, temperature: logits),
            (
                sampling,
                "filtered_sample",
                lambda key, probs, **_: jnp.argmax(probs, axis=-1).astype(jnp.int32),
            ),
        ]
    else:
        raise ValueError(f"unknown variant {variant!r}")
    saved = [(module, name, getattr(module, name)) for module, name, _ in targets]
    try:
        for module, name, replacement in targets:
            setattr(module, name, replacement)
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def _decode_loop(params, caches, inputs, *, config, backend, variant, num_calls):
    """``num_calls`` decode steps in one ``fori_loop``, each fed the previous step's tokens;
    returns the caches and a checksum of every token."""
    with ablated(variant):

        def body(call_index, carry):
            caches, tokens, checksum = carry
            step_inputs = inputs._replace(
                token_ids=tokens, num_generated=inputs.num_generated + call_index
            )
            result, caches, _ = programs.decode_step(
                params,
                None,
                caches,
                None,
                step_inputs,
                target_config=config,
                draft_config=None,
                num_speculative=0,
                backend=backend,
            )
            tokens = result.token_ids[:, 0]
            return caches, tokens, checksum + jnp.sum(tokens.astype(jnp.float32))

        # An overlapped step's captured tokens are -1 (fed from the device): any token will do.
        carry = (caches, jnp.maximum(jnp.asarray(inputs.token_ids), 0), jnp.float32(0))
        caches, _, checksum = lax.fori_loop(0, num_calls, body, carry)
    return caches, checksum


_decode_loop_jit = jax.jit(
    _decode_loop,
    static_argnames=("config", "backend", "variant", "num_calls"),
    donate_argnames=("caches",),
)


def time_step_variants(
    run: MeasuredRun, step_s: float, options: RunOptions
) -> dict[str, list[float]]:
    """Per-step device microseconds of each variant (``repeats`` samples), on the middle
    captured step's inputs and the engine's caches (carried from program to program)."""
    engine = run.engine
    _, inputs = run.captured[len(run.captured) // 2]
    inputs = jax.device_put(inputs)
    if options.dry_run:
        # One run, its compilation timed with it: a dry run's figures are not speed figures,
        # and every run of an interpreted kernel costs CPU seconds.
        num_calls = options.dry_run_calls
        untimed, timed = DRY_RUN_UNTIMED_LOOPS, DRY_RUN_TIMED_LOOPS
    else:
        num_calls = int(min(MAX_LOOP_CALLS, max(4, round(LOOP_TARGET_SECONDS / step_s))))
        untimed, timed = 2, options.repeats
    caches = engine.target_caches
    engine.target_caches = None  # donated to the loops below
    static = dict(config=engine.target_config, backend=engine.backend, num_calls=num_calls)
    samples: dict[str, list[float]] = {}
    for variant in ("full", "no_attention", "no_sampling"):
        times = []
        for repeat in range(untimed + timed):  # untimed runs: compilation, fast path
            begin = time.perf_counter()
            caches, checksum = _decode_loop_jit(
                engine.target_params, caches, inputs, variant=variant, **static
            )
            checksum.block_until_ready()
            if repeat >= untimed:
                times.append((time.perf_counter() - begin) / num_calls * 1e6)
        samples[variant] = times
    engine.target_caches = caches
    samples["num_calls"] = [num_calls]
    return samples


# ----------------------------------------------------------------------------------------------
# The ops alone at the step's shapes


def attention_op_us(
    config, batch: int, context: int, bucket: int, backend: str, options: RunOptions
) -> float:
    """``paged.decode_attention`` alone: ``B`` requests of ``context`` tokens, rotating sets,
    ``page_indices`` padded to ``bucket`` entries as the engine pads them."""
    shape = dict(
        num_q_heads=config.num_q_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        page_size=PAGE_SIZE,
    )
    kv_bytes = 2 * batch * context * config.num_kv_heads * config.head_dim * 2
    setup = make_attention_setup(
        batch,
        context,
        **shape,
        dtype=config.jnp_dtype,
        num_sets=options.num_sets_for(kv_bytes),
    )
    try:
        nnz = setup.page_indices.shape[1]
        padded = jnp.pad(setup.page_indices, ((0, 0), (0, max(bucket, nnz) - nnz)))

        def table(page_indptr, page_indices, last_page_len, set_index):
            return paged.PageTable(
                page_indptr=page_indptr[set_index],
                page_indices=page_indices[set_index],
                last_page_len=last_page_len[set_index],
                page_size=PAGE_SIZE,
            )

        plan = None
        if resolve_backend(backend) == "pallas":
            first = table(setup.page_indptr, padded, setup.last_page_len, 0)
            plan = jax.device_put(  # on the device once, not copied by every timed program
                paged.plan_decode(first, config.num_q_heads, config.num_kv_heads, config.head_dim)
            )

        def step(set_index, operands):
            queries, k_pages, v_pages, page_indptr, page_indices, last_page_len, plan = operands
            return paged.decode_attention(
                queries[set_index],
                paged.KVCache(k_pages, v_pages, "HND"),
                table(page_indptr, page_indices, last_page_len, set_index),
                plan=plan,
                backend=backend,
            )

        k_pages, v_pages = setup.pool("HND")
        operands = (
            setup.queries,
            k_pages,
            v_pages,
            setup.page_indptr,
            padded,
            setup.last_page_len,
            plan,
        )
        loop = TimedLoop(step, setup.num_sets, operands)
        prior = expected_us(kv_bytes, *ATTENTION_PRIOR[resolve_backend(backend)])
        timing = options.time(loop, expected_us_per_call=prior)
        return timing.median_us
    finally:
        setup.delete()
        gc.collect()


def sampling_op_us(vocab: int, batch: int, backend: str, options: RunOptions) -> float:
    """Tempered softmax + ``sampling.filtered_sample`` (the engine's parameters) alone on
    float32 logits ``[B, V]``, rotating sets."""
    num_sets = options.num_sets_for(batch * vocab * 4)
    logits = LOGITS_SCALE * jax.random.normal(
        jax.random.key(SEED), (num_sets, batch, vocab), jnp.float32
    )
    keys = jax.random.key_data(jax.random.split(jax.random.key(SEED + 1), batch))
    temperature = jnp.full((batch,), TEMPERATURE, jnp.float32)
    top_k = jnp.full((batch,), TOP_K, jnp.int32)
    top_p = jnp.full((batch,), TOP_P, jnp.float32)
    min_p = jnp.zeros((batch,), jnp.float32)

    def step(set_index, operands):
        logits, key_data, temperature, top_k, top_p, min_p = operands
        keys = keys_lib.step_keys(key_data, jnp.full((batch,), set_index, jnp.int32))
        probs = speculative.tempered_probs(logits[set_index].astype(jnp.float32), temperature)
        return sampling.filtered_sample(
            keys, probs, top_k=top_k, top_p=top_p, min_p=min_p, backend=backend
        )

    operands = (logits, keys, temperature, top_k, top_p, min_p)
    try:
        loop = TimedLoop(step, num_sets, operands)
        prior = expected_us(batch * vocab * 4, *SAMPLING_PRIOR[resolve_backend(backend)])
        timing = options.time(loop, expected_us_per_call=prior)
        return timing.median_us
    finally:
        logits.delete()
        gc.collect()


# ----------------------------------------------------------------------------------------------
# Figures of a run


def weight_bytes(config: config_lib.ModelConfig, batch: int) -> int:
    """Bytes of the weights a decode step reads once: every layer, the final norm and
    ``lm_head``; of the embedding only the ``B`` rows fed."""
    shapes = model_lib.param_shapes(config)
    itemsize = config.jnp_dtype.itemsize
    total = 0
    for layer in shapes["layers"]:
        total += sum(math.prod(shape) for shape in layer.values())
    total += math.prod(shapes["final_norm"]) + math.prod(shapes["lm_head"])
    total += batch * config.hidden
    return total * itemsize


def kv_bytes(config: config_lib.ModelConfig, context_tokens: int) -> int:
    """K and V bytes of ``context_tokens`` tokens in every layer."""
    per_token = 2 * config.num_kv_heads * config.head_dim * config.jnp_dtype.itemsize
    return context_tokens * per_token * config.num_layers


def _percentile_ms(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q) * 1e3) if values.size else float("nan")


def request_figures(engine, requests: list[Request]) -> dict[str, float]:
    timings = [engine.timings[request.request_id] for request in requests]
    gaps = np.concatenate([timing.inter_token_s() for timing in timings])
    ttfts = [timing.time_to_first_token_s for timing in timings]
    return {
        "itl_p50_ms": _percentile_ms(gaps, 50),
        "itl_p99_ms": _percentile_ms(gaps, 99),
        "ttft_ms": statistics.median(ttfts) * 1e3,
        "ttft_max_ms": max(ttfts) * 1e3,
    }


def run_case(
    model, scenario: Scenario, arm: Arm, num_pages: int, options: RunOptions, ops: dict
) -> tuple[CaseResult, list[str]]:
    """Both runs of one (scenario, arm) and its timings; returns the row and its notes."""
    config = model[0]
    notes: list[str] = []
    prompts = make_prompts(scenario, config.vocab_size)
    # The warm-up run: every program of the scenario is compiled here.
    warm = new_engine(model, scenario, arm, num_pages, options)
    run_engine(warm, make_requests(scenario, prompts, "warm"), capture=False)
    del warm
    gc.collect()

    run = measured_run(model, scenario, arm, num_pages, options, prompts)
    engine, requests = run.engine, run.requests
    backends = engine.backend_report()
    decode_steps = [s for s in run.stats if s.num_prefill_chunks == 0 and s.num_decode_rows]
    compiled = sum(s.compiled for s in run.stats)
    if compiled:
        notes.append(
            f"{scenario.case} `{arm.name}`: {compiled} measured step(s) compiled a program; "
            "their times include compilation"
        )
    timed_steps = [s for s in decode_steps if not s.compiled] or decode_steps
    wall = [s.total_s for s in timed_steps]
    step_s = statistics.median(wall)
    tokens_per_s = sum(s.num_emitted for s in timed_steps) / sum(wall)
    figures = request_figures(engine, requests)

    # Where the step's time goes: the step loop and its ablations.
    _, middle_inputs = run.captured[len(run.captured) // 2]
    table = middle_inputs.page_table
    counts = np.diff(np.asarray(table.page_indptr))
    lengths = np.where(counts > 0, PAGE_SIZE * (counts - 1) + np.asarray(table.last_page_len), 0)[
        : scenario.num_requests
    ]
    bucket = int(np.asarray(table.page_indices).shape[0])
    samples = time_step_variants(run, step_s, options)
    device = {key: statistics.median(value) for key, value in samples.items()}
    full_us = device["full"]
    attention_us = max(0.0, full_us - device["no_attention"])
    sampling_us = max(0.0, full_us - device["no_sampling"])
    step_us = step_s * 1e6
    num_bytes = weight_bytes(config, scenario.num_requests) + kv_bytes(config, int(lengths.sum()))

    # The same ops alone at the step's shapes (memoized: dry-run scenarios share one shape,
    # and in a dry run the two arms under one kill switch share one timing, as they run the
    # same ops: each interpreted op costs seconds of CPU to compile and run).
    context = DRY_RUN_OP_CONTEXT if options.dry_run else max(1, round(float(lengths.mean())))
    op_batch = DRY_RUN_PARALLEL if options.dry_run else scenario.num_requests
    op_arm = (arm.backend, arm.kill_switch) if options.dry_run else arm.name
    key = ("attention", op_arm, op_batch, context, bucket)
    if key not in ops:
        ops[key] = attention_op_us(config, op_batch, context, bucket, arm.backend, options)
    attention_op = ops[key]
    key = ("sampling", op_arm, op_batch)
    if key not in ops:
        ops[key] = sampling_op_us(config.vocab_size, op_batch, arm.backend, options)
    sampling_op = ops[key]

    shared = int(engine.scheduler.stats.get("shared_prefix_pages", 0))
    extra: dict[str, Any] = {
        "tokens_per_s": tokens_per_s,
        **figures,
        "host_us_per_step": statistics.median(s.host_s for s in timed_steps) * 1e6,
        # decode_s in three parts (StepStats): is a wall step longer than the device step
        # because of the call, the device, or the copy back?
        "dispatch_us_per_step": statistics.median(s.dispatch_s for s in timed_steps) * 1e6,
        "device_wait_us_per_step": statistics.median(s.device_wait_s for s in timed_steps) * 1e6,
        "fetch_us_per_step": statistics.median(s.fetch_s for s in timed_steps) * 1e6,
        # Host work of a step apart (issue 18): planning (plan_step, inputs, split-KV plans)
        # and committing; with the overlap both run while the device runs the previous step.
        "plan_us_per_step": statistics.median(s.plan_s for s in timed_steps) * 1e6,
        "commit_us_per_step": statistics.median(s.commit_s for s in timed_steps) * 1e6,
        "overlap": engine.overlap,
        # The client-visible step over the device step (issue 18's target: within 1.15x).
        "wall_over_device_step": step_s * 1e6 / full_us,
        "device_step_us": full_us,
        "attention_fraction": attention_us / step_us,
        "sampling_fraction": sampling_us / step_us,
        "rest_fraction": 1.0 - (attention_us + sampling_us) / step_us,
        "host_and_dispatch_fraction": max(0.0, step_us - full_us) / step_us,
        "attention_callsite_us": attention_us / config.num_layers,
        "sampling_callsite_us": sampling_us,
        "attention_op_us": attention_op,
        "sampling_op_us": sampling_op,
        "step_no_attention_us": device["no_attention"],
        "step_no_sampling_us": device["no_sampling"],
        "step_loop_samples_us": samples["full"],
        "step_loop_calls": samples["num_calls"][0],
        "decode_steps": len(timed_steps),
        "compiled_steps": compiled,
        "num_layers": config.num_layers,
        "prompt_tokens": scenario.prompt_tokens,
        "new_tokens": scenario.new_tokens,
        "num_requests": scenario.num_requests,
        "parallel": engine.parallel,
        "shared_prefix_pages": shared,
        "kill_switch": arm.kill_switch,
        "engine_backend": arm.backend,
        "samples_us": [s * 1e6 for s in wall],
    }
    if scenario.shared_prefix and not shared:
        notes.append(f"{scenario.case} `{arm.name}`: no prefix page was shared")
    if arm.kill_switch:
        ran = {op: impl for op, impl in backends.items() if impl != "reference"}
        if ran:
            notes.append(f"{scenario.case}: the kill switch did not reach {sorted(ran)}")
    elif backends.get("decode: attention", "reference") == "reference":
        notes.append(f"{scenario.case}: the default ran no attention kernel in decode")
    loop = "overlapped" if engine.overlap else "synchronous"
    row = CaseResult(
        case=scenario.case,
        arm=arm.name,
        attribution=f"{attribution_of(backends)}; engine loop={loop}",
        median_us=step_us,
        min_us=min(wall) * 1e6,
        max_us=max(wall) * 1e6,
        bytes=int(num_bytes),
        achieved_tbps=num_bytes / step_s / 1e12,
        fraction_of_ceiling=0.0,  # set by the caller, who knows the ceiling
        extra=extra,
    )
    engine.target_caches = None
    del engine, run
    gc.collect()
    return row, notes


# ----------------------------------------------------------------------------------------------
# Notes comparing the arms


def overlap_notes(rows: list[CaseResult]) -> list[str]:
    """Per scenario: the overlapped default against the synchronous loop (``decodelab-sync``):
    tokens/s, and the client-visible step over the device step (issue 18: within 1.15x)."""
    notes = []
    by_case: dict[str, dict[str, CaseResult]] = {}
    for row in rows:
        by_case.setdefault(row.case, {})[row.arm] = row
    for case, arms in by_case.items():
        overlapped, synchronous = arms.get("decodelab"), arms.get("decodelab-sync")
        if overlapped is None or synchronous is None:
            continue
        speedup = overlapped.extra["tokens_per_s"] / synchronous.extra["tokens_per_s"]
        ratio = overlapped.extra["wall_over_device_step"]
        notes.append(
            f"{case}: overlapped steps decode at {speedup:.2f}x the synchronous loop's tokens/s "
            f"({overlapped.extra['tokens_per_s']:.1f} vs "
            f"{synchronous.extra['tokens_per_s']:.1f}); wall step / device step "
            f"{ratio:.2f} (synchronous {synchronous.extra['wall_over_device_step']:.2f}; "
            f"issue 18's target 1.15: {'met' if ratio <= 1.15 else 'not met'}); host per step: "
            f"plan {overlapped.extra['plan_us_per_step']:.0f} us, dispatch "
            f"{overlapped.extra['dispatch_us_per_step']:.0f} us, commit "
            f"{overlapped.extra['commit_us_per_step']:.0f} us"
        )
    return notes


def comparison_notes(rows: list[CaseResult]) -> list[str]:
    """Per scenario: whether the default beats the reference (tokens/s, ITL, TTFT), and where an
    op's speedup alone shrinks at the call site; then issue 7's target over every scenario."""
    notes = []
    by_case: dict[str, dict[str, CaseResult]] = {}
    for row in rows:
        by_case.setdefault(row.case, {})[row.arm] = row
    verdicts = []
    for case, arms in by_case.items():
        ours, theirs = arms.get("decodelab"), arms.get("reference")
        if ours is None or theirs is None:
            notes.append(f"{case}: only {sorted(arms)} measured, no comparison")
            verdicts.append((case, None))
            continue
        speedup = ours.extra["tokens_per_s"] / theirs.extra["tokens_per_s"]
        faster = speedup > 1.0
        verdicts.append((case, faster))
        notes.append(
            f"{case}: the default decodes at {speedup:.2f}x the reference's tokens/s "
            f"({ours.extra['tokens_per_s']:.1f} vs {theirs.extra['tokens_per_s']:.1f}; "
            f"{'faster' if faster else 'NOT faster'}); ITL p50 "
            f"{theirs.extra['itl_p50_ms'] / ours.extra['itl_p50_ms']:.2f}x, p99 "
            f"{theirs.extra['itl_p99_ms'] / ours.extra['itl_p99_ms']:.2f}x, TTFT "
            f"{theirs.extra['ttft_ms'] / ours.extra['ttft_ms']:.2f}x (prefill chunks over 16 "
            "tokens run the prefill attention kernel in the default arm)"
        )
        for op in ("attention", "sampling"):
            op_speedup = _ratio(theirs.extra[f"{op}_op_us"], ours.extra[f"{op}_op_us"])
            site_speedup = _ratio(
                theirs.extra[f"{op}_callsite_us"], ours.extra[f"{op}_callsite_us"]
            )
            ours.extra[f"{op}_op_speedup"] = op_speedup
            ours.extra[f"{op}_callsite_speedup"] = site_speedup
            if op_speedup > 1.0 and site_speedup < op_speedup:
                notes.append(
                    f"{case}: {op} alone is {op_speedup:.2f}x faster in the default, "
                    f"{site_speedup:.2f}x at the call site (the step with it removed, "
                    f"{(1 - site_speedup / op_speedup):.0%} of the op-level speedup lost); "
                    f"the whole step {speedup:.2f}x, as {op} is "
                    f"{theirs.extra[f'{op}_fraction']:.0%} of the reference's step"
                )
        ours.extra["vs_reference_tokens_per_s"] = speedup
    if not verdicts:  # only the continuous load ran
        return notes
    measured = [faster for _, faster in verdicts if faster is not None]
    slower = [case for case, faster in verdicts if faster is False]
    met = bool(measured) and all(measured) and len(measured) == len(verdicts)
    notes.append(
        "target (issue 7) the default faster in every scenario: "
        + ("met" if met else "not met")
        + (f" (not faster: {', '.join(slower)})" if slower else "")
    )
    return notes


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else float("inf")


# ----------------------------------------------------------------------------------------------
# The suite


def run(options: RunOptions, ceiling: CopyCeiling) -> SuiteOutput:
    """Runs every scenario under each arm (module docstring)."""
    scenarios = scenarios_for(options)
    config = model_config(options)
    params = model_lib.init_params(config, jax.random.key(SEED))
    model = (config, params)
    num_pages = pool_pages(scenarios, PAGE_SIZE, load_scenario_for(options))
    notes = [
        f"model: random weights, {config.num_layers} layers (Llama 3 8B has 32) of hidden "
        f"{config.hidden}, "
        f"{config.num_q_heads}/{config.num_kv_heads} heads of {config.head_dim}, MLP "
        f"{config.intermediate}, vocabulary {config.vocab_size}, {config.dtype}; pages of "
        f"{PAGE_SIZE}, a pool of {num_pages} pages; sampling temperature {TEMPERATURE}, top-k "
        f"{TOP_K}, top-p {TOP_P}",
        "median_us: wall time of a decode-only step (host + decode program until its tokens "
        "reach the host); bytes: every weight once + the K and V of every request's context; "
        "fractions: attention and sampling from ablations of the step (module docstring of "
        "bench/suites/serving.py), the rest is what is left of the wall step",
        "timing: tokens/s, ITL, TTFT and the rows' step times are the host clock around the "
        "engine's steps (what a client sees, after a warm-up run that compiled every program); "
        "device_step_us and the ablations are N decode steps in one jitted fori_loop, host "
        "clock around the program, median of the repeats; attention_op_us and sampling_op_us "
        "follow the timing method above",
        "arms: `reference` = DECODELAB_BACKEND=reference (the kill switch), `decodelab` = "
        f"the default (Engine backend={arms_for(options)[-1].backend!r}), "
        "`decodelab-nocascade` = the default with Engine(cascade='off') (shared_prefix only)",
    ]
    notes.append(SAMPLING_SHRINK_NOTE)
    for variable in (SCENARIOS_VARIABLE, LOAD_CONFIGS_VARIABLE):
        chosen = os.environ.get(variable, "").strip()
        if chosen:  # the command line alone does not say which scenarios ran
            notes.append(f"scenarios chosen by {variable}={chosen}")
    rows: list[CaseResult] = []
    ops: dict = {}
    arms = arms_for(options)
    for index, arm in enumerate(arms):
        clears = dry_run_clears(arms, index) if options.dry_run else {}
        with arm_environment(arm, **clears):
            for scenario in scenarios_of_arm(arm, scenarios, options):
                report.print_progress(f"{scenario.case}, arm {arm.name}")
                try:
                    row, case_notes = run_case(model, scenario, arm, num_pages, options, ops)
                except Exception as error:  # one failing case must not lose the others
                    notes.append(
                        f"{scenario.case} `{arm.name}` failed: {type(error).__name__}: "
                        f"{str(error)[:300]}"
                    )
                    continue
                row.fraction_of_ceiling = row.achieved_tbps / ceiling.tbps
                rows.append(row)
                notes += case_notes
                _print_row(row)
    order = {scenario.case: index for index, scenario in enumerate(scenarios)}
    rows.sort(key=lambda row: (order[row.case], ARMS.index(row.arm)))
    notes += comparison_notes(rows)
    notes += overlap_notes(rows)
    load_rows, load_notes = run_load_rows(model, num_pages, options)
    rows += load_rows
    notes += load_notes
    return SuiteOutput(results=rows, notes=notes, peers_for_ratio=("reference",))


def _print_row(row: CaseResult) -> None:
    extra = row.extra
    print(
        f"{row.case:<30} {row.arm:<10} {extra['tokens_per_s']:9.1f} tok/s  ITL p50 "
        f"{extra['itl_p50_ms']:7.2f} ms p99 {extra['itl_p99_ms']:7.2f} ms  TTFT "
        f"{extra['ttft_ms']:8.1f} ms  host {extra['host_us_per_step']:7.1f} us  attention "
        f"{extra['attention_fraction']:.0%} sampling {extra['sampling_fraction']:.0%} rest "
        f"{extra['rest_fraction']:.0%}",
        flush=True,
    )
