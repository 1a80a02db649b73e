"""The decode engine: the scheduler's steps run on the device, one jitted program a decode batch.

``Engine`` owns a target model (and optionally a draft), their paged KV caches and a
``serving.scheduler.Scheduler``. Each ``step()`` asks the scheduler what to run, runs the prefill
chunks (one jitted program a chunk, through both models), then the decode batch as ONE jitted
program (one decode step, or a block of several: below), and commits the tokens back.
``generate`` and ``run_until_done`` loop over steps.

The host out of the critical path (``overlap=True``, plain decoding)
-------------------------------------------------------------------
JAX dispatches asynchronously, so the host can plan and dispatch step ``N + 1`` while the device
still runs step ``N``, if nothing step ``N + 1`` needs must first come back to the host. With
one token a row, everything but the tokens' values is known ahead: positions, lengths, pages,
keys (``fold_in(request key, tokens generated)``) and ``max_tokens`` finishes all follow from
the count. So the scheduler commits step ``N`` before its tokens are known
(``Scheduler.commit_step_unresolved``: a placeholder token), step ``N + 1`` feeds those rows'
last tokens straight from step ``N``'s device output, and step ``N``'s tokens are fetched after
step ``N + 1`` is dispatched (their copy started at once), then resolved
(``Scheduler.resolve_step``): stop tokens apply there, one step late; the row the finished
request had in step ``N + 1`` is wasted and its token discarded, its pages and slot freed (the
device runs step ``N + 1`` before any later step that reuses them). Every request's keys,
positions and tokens are those of the synchronous loop, so the outputs are the same
(``tests/test_engine.py``, and the state machine of ``tests/test_engine_stateful.py`` runs both
loops). A speculative step's token count is only known with its tokens, so a speculative
engine steps synchronously.

Several decode steps in one program (``max_steps_per_program=K``, plain decoding)
-------------------------------------------------------------------------------
Overlapping hides the host only while the host's plan and dispatch of a step take less than the
device's step; at small batch on the H200 they took longer (issue 18). Where nothing can change
between steps (no prefill, no admissible waiting request, no ``max_tokens`` finish due, pages
for every write reserved ahead: ``Scheduler.plan_step(max_decode_steps=K)``), the engine runs
up to ``K`` decode steps as one jitted program (``programs.decode_steps``: a scan whose body is
the single step, each step feeding the tokens of the one before on the device), planned,
dispatched and committed once. A stop token cannot be known ahead: the row runs on to the
block's end, and committing discards its tokens after the stop and frees its pages, as the
overlapped loop does with the step after a stop. Keys, positions and pages are those of single
steps, so the outputs are the same as with ``K = 1`` (``tests/test_engine.py``; the keys
themselves: ``tests/test_engine_streams.py``; the state machine of
``tests/test_engine_stateful.py`` runs both). Both loops run blocks (overlapped, a
block's last tokens feed the next program); a speculative engine keeps single steps.

The price is paid by arrivals and by time measurements:

- A request waiting for a slot waits for the block in which a stop token frees it to end: up
  to ``K - 1`` device steps after the stop, synchronously (against none with single steps).
  Overlapped, the stop is known only after the next block was planned and dispatched, which is
  wasted too: up to ``2K - 1`` steps after the stop (against 1). A request arriving while a
  block runs, to a free slot, waits for the block's end on the device (either loop): up to
  ``K - 1`` steps longer. Prefills are not delayed: a block is planned only when no request
  is prefilling, so the fairness grant's bound (``serving/step_decision.py``) counts single
  steps as before. ``tests/test_scheduler.py`` checks the stop's bound,
  ``tests/test_engine.py`` the grant's with blocks.
- The tokens of a block reach the host together: ``RequestTiming`` gives them one arrival
  time, so inter-token gaps are ``K - 1`` zeros a block and one gap of the block's time (what a
  streaming client sees; the median gap is then 0 for ``K >= 3``, and the mean is the useful
  figure). ``StepStats`` describes a program: ``num_decode_steps`` says how many steps.

Requests sharing a prompt: cascade attention (``cascade="auto" | "on" | "off"``)
-------------------------------------------------------------------------------
The scheduler's prefix sharing gives every request admitted with a common prompt the same
physical pages for the prompt's full pages. Before each decode program the engine looks for
them in the step's host table (``serving/cascade_step.py``: ``paged.plan_cascade``): running
requests whose rows start with the same page numbers form a group, its shared prefix the whole
pages all of them list (a prompt ending mid-page leaves its last, partly filled page to each
request's own level). Where a group is worth it (``"auto"``: the crossover measured on the H200,
``paged.CASCADE_CROSSOVER``, 16 requests sharing 256 pages, on the Mosaic GPU path it was
measured on; ``"on"``: any group of two sharing a page), the program's attention runs
``paged.cascade_decode_attention`` over two levels, the group's pages read once per group and
each row's own pages once per row, merged exactly; otherwise plain decode. The levels are
inputs of fixed shapes (``B // 2`` group rows, the table's bucket of page indices), so the
decode program stays one jitted program: a table bucket compiles a plain and at most one
cascade variant. Between a group's changes (a request joining or leaving it, a row gaining a
page) a program's levels are the last program's with each row's new length
(``paged.CascadePlanCache``, keyed on all they depend on, so the same levels as planning afresh).
Speculative verification steps attend through the levels too (``q_len = n + 1``); the draft's
passes stay plain. ``DECODELAB_BACKEND=reference`` turns cascade off.
``cascade_report()`` counts what it did; ``backend_report()`` says when it ran.

Sparse decode (``sparse="quest" | "recent"``, ``sparse_budget=2048``)
--------------------------------------------------------------------
The target's decode steps attend over a selection of each request's pages within a token
budget (``serving/sparse_step.py``, ``paged.sparse_decode_attention``): ``"quest"`` the top
pages by Quest's bound on their logits, from the per-page key bounds the engine keeps beside
every target pool (``target_key_bounds``: updated by every prefill chunk and decode step, a page
restarting when its first slot is written, so a freed and reused page forgets its previous
owner); ``"recent"`` the first page and the latest ones. Both always read a request's first and
last page; a request whose context fits the budget reads every page (dense attention over the
same keys). Prefill chunks attend densely. Sparse decode excludes cascade (``"auto"`` is then
off, ``"on"`` raises) and speculation (raises); the overlapped loop and blocks of steps run as
they do densely. The kill switch makes every part of it the reference, and leaves it on.
``sparse_report()`` counts what it did; ``backend_report()`` says that it ran and what
implemented the selection.

Where each part lives:

- ``serving/programs.py``: the jitted decode and prefill programs, and how they sample;
- ``serving/keys.py``: each request's key and each step's stream;
- ``serving/step_stats.py``: what a step reports (``StepOutput``, ``StepStats``), acceptance
  counts and request timings;
- ``serving/backend_report.py``: which backend each op of the programs ran;
- ``serving/cascade_step.py``: which requests a decode program groups, and when it cascades;
- ``serving/sparse_step.py``: sparse decode's selection, the key bounds, and their report.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Hashable, Iterable

import jax
import numpy as np

import paged
from kernels_pallas.platform import BACKENDS, resolve_backend
from paged.cascade_plan import CASCADE_CROSSOVER, CascadeCrossover
from paged.decode import MAX_KERNEL_Q_LEN
from paged.mla_decode import MLA_MAX_KERNEL_Q_LEN, choose_mla_backend
from serving import cascade_step, host_inputs, programs, sparse_step
from serving import model as model_lib
from serving.backend_report import backend_report
from serving.config import ModelConfig
from serving.keys import request_key_data, seedless_key_data
from serving.mla_config import MLAModelConfig
from serving.mla_expanded import ExpandedMLAConfig, new_expanded_mla_caches
from serving.mla_model import (
    choose_attention_form,
    new_mla_caches,
    validate_mla_model_params,
)
from serving.requests import Request, RequestOutput
from serving.scheduler import DecodeBatch, Scheduler, Step
from serving.step_decision import DEFAULT_PREFILL_GRANT_INTERVAL
from serving.step_stats import AcceptanceStats, RequestTiming, StepOutput, StepStats

# The most decode steps one program runs (Engine(max_steps_per_program=...)): each power of two
# up to it may compile a program, and a block delays an arrival's admission by up to K steps.
MAX_STEPS_PER_PROGRAM = 32


def _check_model(name: str, model, *, mla: bool = False) -> tuple[ModelConfig, dict]:
    """``(config, params)`` of ``model`` checked; ``mla``: an ``MLAModelConfig`` is allowed
    (the target's case; a draft must be Llama-style)."""
    if not (isinstance(model, tuple | list) and len(model) == 2):
        raise ValueError(f"{name} must be a (ModelConfig, params) pair, got {type(model).__name__}")
    config, params = model
    if isinstance(config, MLAModelConfig | ExpandedMLAConfig):
        if not mla:
            kind = type(config).__name__
            raise ValueError(
                f"{name}[0] is an {kind}, but an MLA {name} is not supported: the "
                f"{name} must be a serving.config.ModelConfig (Llama-style; an MLA model can "
                f"be the target), got {config!r}"
            )
        model = config.model if isinstance(config, ExpandedMLAConfig) else config
        validate_mla_model_params(params, model)
        return config, params
    if not isinstance(config, ModelConfig):
        also = " or a serving.mla_config.MLAModelConfig" if mla else ""
        raise ValueError(f"{name}[0] must be a serving.config.ModelConfig{also}, got {config!r}")
    model_lib.validate_params(params, config)
    return config, params


def max_verified_tokens(config: ModelConfig | MLAModelConfig) -> int:
    """The most tokens a row the target may verify in one step (``num_speculative + 1``): the
    longest query run of the target's decode attention kernel, ``paged.decode.MAX_KERNEL_Q_LEN``
    for a Llama-style target (and an ``ExpandedMLAConfig``, whose K/V pages that kernel reads),
    ``paged.mla_decode.MLA_MAX_KERNEL_Q_LEN`` for an MLA one (a chosen limit, the decode
    kernel's: the MLA kernel has none of its own; its tests reach ``q_len`` 9).

    Example:
      >>> from serving.mla_config import MLA_TINY
      >>> max_verified_tokens(MLA_TINY)
      16
    """
    return MLA_MAX_KERNEL_Q_LEN if isinstance(config, MLAModelConfig) else MAX_KERNEL_Q_LEN


class Engine:
    """Continuous-batching decode of a target model, optionally with a draft for speculation.

    Args:
      target: ``(ModelConfig, params)`` of the model whose distribution the outputs follow, or
        ``(MLAModelConfig, params)`` of an MLA model (``serving/mla_model.py``: latent caches,
        the MLA kernel's plans on the Pallas backend; no cascade, no sparse decode;
        ``docs/mla.md``), or ``(ExpandedMLAConfig, params)`` of the same on expanded K/V
        pages (``serving/mla_expanded.py``, the benchmarks' baseline).
      draft: ``(ModelConfig, params)`` of the draft model, required when ``num_speculative >
        0`` (same vocabulary as the target; Llama-style, whatever the target), else ignored
        (None).
      num_pages: pages in each KV pool (target and draft pools have this many; page 0 pads).
      page_size: tokens per page (a power of two for the Pallas attention kernel).
      parallel: decode slots, the static batch ``B`` of every decode step.
      num_speculative: drafts per step ``n`` (0: plain decoding); ``n + 1`` is at most
        ``max_verified_tokens(target config)``, 16: the target's decode attention kernel's
        longest query run (``paged.decode.MAX_KERNEL_Q_LEN``, or for an MLA target
        ``paged.mla_decode.MLA_MAX_KERNEL_Q_LEN``).
      backend: ``"auto"``, ``"reference"`` or ``"pallas"``, for every op of every program,
        prefill chunks of every length included (chunks longer than 16 tokens run the causal
        prefill attention kernel, shorter ones the decode kernel; ``backend_report`` says which).
      layout: the KV pools' layout, ``"HND"`` or ``"NHD"``.
      max_prefill_tokens, prefill_chunk_size: the scheduler's prefill budget per step and
        longest chunk (a power of two).
      max_batched_tokens: tokens a step carries at most, decode rows first, then prefill
        chunks (None: no limit beyond ``max_prefill_tokens``).
      prefill_grant_interval: a prefill that got no chunk for this many steps gets one
        (``serving/step_decision.py``).
      seed: derives the keys of requests submitted without a seed.
      overlap: keep the host out of the device's way (plain decoding; a speculative engine
        steps synchronously whatever this says): step ``N + 1`` is dispatched before step
        ``N``'s tokens are fetched, its rows feeding step ``N``'s tokens from the device, and
        stop tokens are applied one program late (a step, or a block of steps: module
        docstring). False: the synchronous loop, each step's tokens fetched before the next
        is planned. Outputs are the same either way.
      max_steps_per_program: ``K``, a power of two in ``[1, MAX_STEPS_PER_PROGRAM]``: plain
        decode steps run as one program where nothing changes between them (module
        docstring; a speculative engine runs single steps whatever this says). Outputs are
        the same for every ``K``; each ``K`` used compiles its own program. 1 (the default):
        one program a step.
      cascade: ``"auto"``, ``"on"`` or ``"off"``: whether running requests that share leading
        pages (a common prompt) attend to them as a group, each shared page read once per
        group (module docstring, ``serving/cascade_step.py``). ``"auto"`` only for groups
        ``cascade_crossover`` admits; ``"on"`` for every group of two or more sharing a whole
        page. ``DECODELAB_BACKEND=reference`` turns it off. Outputs are the same either way
        (within float rounding: the levels' states are merged exactly).
      cascade_crossover: which groups ``"auto"`` cascades (default the measured
        ``paged.CASCADE_CROSSOVER``; None: none).
      sparse: None (dense decode), ``"quest"`` or ``"recent"``: the target's decode steps
        attend over a selection of each request's pages (module docstring,
        ``serving/sparse_step.py``): Quest's top pages per KV head, or the latest pages; the
        first and last page always. Changes the outputs (unless every context fits the
        budget). Not with ``num_speculative > 0`` or ``cascade="on"``; turns ``"auto"``
        cascade off.
      sparse_budget: tokens a request reads a decode step with ``sparse`` on: a multiple of
        ``page_size``, at least two pages (ignored without ``sparse``).

    Raises:
      ValueError: naming the argument and the bad value (models that are not pairs, params
        unlike their config, a draft missing or of another vocabulary, ``num_speculative``
        outside ``[0, 15]``, an unknown backend or layout, ``max_steps_per_program`` not a power
        of two in range, a ``cascade`` mode not in ``("auto", "on", "off")`` or a
        ``cascade_crossover`` that is not a ``paged.CascadeCrossover``, a ``sparse`` mode not in
        ``(None, "quest", "recent")``, a ``sparse_budget`` that is not a whole number of pages
        (two or more), ``sparse`` with ``num_speculative > 0`` or ``cascade="on"``; with an MLA
        target ``cascade="on"``, ``sparse``, an MLA draft, and ``backend="pallas"`` where the
        MLA kernel cannot run the model (the reason named); and whatever ``Scheduler``
        refuses).

    Example:
      >>> from serving.config import TINY_DRAFT
      >>> from serving.model import init_params
      >>> from serving.requests import SamplingParams
      >>> pair = (TINY_DRAFT, init_params(TINY_DRAFT, jax.random.key(0)))
      >>> engine = Engine(pair, num_pages=8, page_size=16, parallel=2, backend="reference")
      >>> request = Request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3))
      >>> [len(out.token_ids) for out in engine.generate([request])]
      [3]
      >>> engine.scheduler.pool.num_free  # every page back but the padding page
      7
    """

    def __init__(
        self,
        target,
        draft=None,
        *,
        num_pages: int,
        page_size: int,
        parallel: int,
        num_speculative: int = 0,
        backend: str = "auto",
        layout: str = "HND",
        max_prefill_tokens: int = 512,
        prefill_chunk_size: int = 512,
        max_batched_tokens: int | None = None,
        prefill_grant_interval: int = DEFAULT_PREFILL_GRANT_INTERVAL,
        seed: int = 0,
        overlap: bool = True,
        max_steps_per_program: int = 1,
        cascade: str = "auto",
        cascade_crossover: CascadeCrossover | None = CASCADE_CROSSOVER,
        sparse: str | None = None,
        sparse_budget: int = sparse_step.DEFAULT_SPARSE_BUDGET,
    ):
        self.target_config, self.target_params = _check_model("target", target, mla=True)
        # An MLA target (serving/mla_model.py): latent caches, forward_paged_mla in the
        # programs, the MLA kernel's plans; no cascade, no sparse decode (refused below). An
        # ExpandedMLAConfig (serving/mla_expanded.py, the benchmarks' baseline) has KV caches
        # and the decode kernel's plans, and the same refusals.
        self.mla = isinstance(self.target_config, MLAModelConfig)
        self.mla_family = self.mla or isinstance(self.target_config, ExpandedMLAConfig)
        self.max_verified_tokens = max_verified_tokens(self.target_config)
        if isinstance(num_speculative, bool) or not isinstance(num_speculative, int):
            raise ValueError(f"num_speculative must be an integer, got {num_speculative!r}")
        if not 0 <= num_speculative < self.max_verified_tokens:
            raise ValueError(
                f"num_speculative must be in [0, {self.max_verified_tokens - 1}] (the target "
                f"verifies n + 1 tokens a row), got {num_speculative}"
            )
        self.draft_config, self.draft_params = None, None
        if num_speculative:
            if draft is None:
                raise ValueError(f"num_speculative={num_speculative} needs a draft model, got None")
            self.draft_config, self.draft_params = _check_model("draft", draft)
            if self.draft_config.vocab_size != self.target_config.vocab_size:
                raise ValueError(
                    f"the draft's vocab_size={self.draft_config.vocab_size} differs from the "
                    f"target's {self.target_config.vocab_size}"
                )
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        resolve_backend(backend)  # validates the kill switch's value now, not mid-run
        if layout not in ("HND", "NHD"):
            raise ValueError(f"layout must be 'HND' or 'NHD', got {layout!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
            raise ValueError(f"seed must be an integer in [0, 2**31), got {seed!r}")
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be True or False, got {overlap!r}")
        steps = max_steps_per_program
        if (
            isinstance(steps, bool)
            or not isinstance(steps, int)
            or not 1 <= steps <= MAX_STEPS_PER_PROGRAM
            or steps & (steps - 1)
        ):
            raise ValueError(
                f"max_steps_per_program must be a power of two in [1, {MAX_STEPS_PER_PROGRAM}], "
                f"got {max_steps_per_program!r}"
            )
        cascade_step.check_cascade_arguments(cascade, cascade_crossover)
        if self.mla_family and cascade == "on":
            raise ValueError(
                "cascade='on' is not supported with an MLA target: cascade attention runs over "
                "KV-cache pages, the latent cache has no cascade path (use 'auto' or 'off', "
                "which decode plainly)"
            )
        if self.mla_family and sparse is not None:
            raise ValueError(
                f"sparse={sparse!r} is not supported with an MLA target: sparse decode selects "
                "KV-cache pages by their key bounds, the latent cache keeps none (use None)"
            )
        self.cascade = cascade
        self.cascade_crossover = cascade_crossover
        self._cascade_stats = cascade_step.CascadeStats(cascade)
        # Each decode program's levels reuse the last one's where its groups and pages did not
        # change (exact: paged.cascade_plan.CascadePlanCache keys on all they depend on).
        self._cascade_plans = cascade_step.CascadePlanCache()
        # Speculative rows emit a varying number of tokens a step: one step a program.
        self.max_steps_per_program = 1 if num_speculative else steps
        self.backend = backend
        self.num_speculative = num_speculative
        # Overlapped steps need each row's token count before its tokens: plain decoding only.
        self.overlap = overlap and num_speculative == 0
        self.seed = seed
        self.scheduler = Scheduler(
            num_pages,
            page_size,
            parallel,
            num_speculative=num_speculative,
            max_prefill_tokens=max_prefill_tokens,
            prefill_chunk_size=prefill_chunk_size,
            max_batched_tokens=max_batched_tokens,
            prefill_grant_interval=prefill_grant_interval,
        )
        self.parallel = self.scheduler.parallel
        # Checked once the scheduler has checked page_size, which the budget is counted in.
        self.sparse = sparse_step.check_sparse_arguments(
            sparse,
            sparse_budget,
            page_size=self.scheduler.page_size,
            cascade=cascade,
            num_speculative=num_speculative,
        )
        self._sparse_stats = None if self.sparse is None else sparse_step.SparseStats(self.sparse)
        # Why the MLA kernel cannot run the target's attention (None if it can), for the
        # choice each step makes (_target_kernel_plans); "pallas" where it cannot is refused.
        self._mla_unsupported = None
        if self.mla:
            self._mla_unsupported = _check_mla_backend(
                backend, self.target_config, self.scheduler.page_size
            )
            self.target_caches = new_mla_caches(self.target_config, num_pages, page_size)
        elif self.mla_family:
            self.target_caches = new_expanded_mla_caches(
                self.target_config, num_pages, page_size, layout
            )
        else:
            self.target_caches = model_lib.new_caches(
                self.target_config, num_pages, page_size, layout
            )
        # Quest's key bounds of each target pool (serving/sparse_step.py), or None.
        self.target_key_bounds = (
            sparse_step.new_key_bounds(self.target_caches)
            if self.sparse is not None and self.sparse.keeps_bounds
            else None
        )
        self.draft_caches = (
            model_lib.new_caches(self.draft_config, num_pages, page_size, layout)
            if num_speculative
            else None
        )
        self.acceptance = AcceptanceStats(num_speculative)
        # Every submitted request's timing, kept after it finishes (benchmarks read them).
        self.timings: dict[Hashable, RequestTiming] = {}
        self._key_data: dict[Hashable, np.ndarray] = {}
        self._submitted = itertools.count()
        self._finished: list[RequestOutput] = []
        # Abstract inputs of the programs last run, for backend_report (by chunk length).
        self._traced: dict[str, tuple] = {}
        # The abstract model and caches for backend_report, taken once: their shapes never change,
        # and abstracting every leaf each step cost about 150 us of host time on a CPU.
        self._abstract_state: tuple | None = None
        # (dispatch, device wait, fetch) seconds of the last decode program (StepStats).
        self._decode_phases = (0.0, 0.0, 0.0)
        # Overlapped steps: the last step dispatched whose tokens are not yet on the host, its
        # tokens on the device (int32[B, K]), the decode steps it ran (K), and its last tokens
        # (int32[B, 1]), which the next step's rows read there.
        self._in_flight: tuple[Step, jax.Array, int, jax.Array] | None = None
        self._no_previous_tokens = None  # int32[B, 1] zeros on the device, made once
        # The target's decode queries and one layer's pool, abstract: what the cascade attention
        # backend is chosen from on the host (cascade_step.cascade_attention_backend).
        # (None for an MLA target, which never cascades.)
        config = self.target_config
        q_len = num_speculative + 1
        self._abstract_query = self._abstract_cache = None
        if not self.mla_family:
            self._abstract_query = jax.ShapeDtypeStruct(
                (self.parallel, config.num_q_heads, config.head_dim)
                if q_len == 1
                else (self.parallel, q_len, config.num_q_heads, config.head_dim),
                config.jnp_dtype,
            )
            self._abstract_cache = programs.abstract(self.target_caches[0])

    # --- requests --------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queues ``request``; it runs in later steps.

        Raises:
          ValueError: whatever ``Scheduler.submit`` refuses (a duplicate id, a request that can
            never fit the pool), a prompt token outside the vocabulary.
        """
        vocab = self.target_config.vocab_size
        if isinstance(request, Request):
            bad = [t for t in request.prompt_token_ids if t >= vocab]
            if bad:
                raise ValueError(
                    f"request {request.request_id!r} has prompt token {bad[0]} outside the "
                    f"vocabulary [0, {vocab})"
                )
            if request.params.top_k is not None and request.params.top_k > vocab:
                raise ValueError(
                    f"request {request.request_id!r} has top_k={request.params.top_k} above "
                    f"the vocabulary size {vocab}"
                )
        self.scheduler.submit(request)
        number = next(self._submitted)
        seed = request.params.seed
        if seed is None:
            key_data = seedless_key_data(self.seed, number)
        else:
            key_data = request_key_data(seed)
        self._key_data[request.request_id] = key_data
        self.timings[request.request_id] = RequestTiming(time.perf_counter())

    @property
    def has_unfinished(self) -> bool:
        """Whether a submitted request has not finished (overlapped: or a step's tokens are
        still on their way)."""
        return self.scheduler.has_unfinished or self._in_flight is not None

    # --- one step --------------------------------------------------------------------------

    def step(self) -> StepOutput:
        """Plans, runs and commits one step: prefill chunks, then the decode batch (if any),
        one decode step or a block of up to ``max_steps_per_program`` (module docstring).

        Overlapped (``overlap=True``, plain decoding): the step is planned and dispatched,
        then the PREVIOUS step's tokens are fetched (the device already has this one queued
        behind it) and committed; the returned tokens and finishes are the previous step's.

        Returns:
          The ``StepOutput`` (tokens kept, finished requests, acceptance, timings).
        """
        if self.overlap:
            return self._step_overlapped()
        compiles_before = self._compile_count()
        host_start = time.perf_counter()
        step = self.scheduler.plan_step(self.max_steps_per_program)
        host_s = time.perf_counter() - host_start

        prefill_start = time.perf_counter()
        for chunk in step.prefill:
            self._run_prefill_chunk(chunk)
        if step.prefill:  # both models prefill: wait for both, or the draft's lands in decode_s
            jax.block_until_ready((self.target_caches, self.target_key_bounds, self.draft_caches))
        prefill_s = time.perf_counter() - prefill_start

        decode_s = 0.0
        self._decode_phases = (0.0, 0.0, 0.0)
        result = None
        plan_s = host_s
        num_steps = 0
        if step.decode is not None:
            host_start = time.perf_counter()
            inputs = self._decode_inputs(step.decode)
            num_steps = programs.num_steps(inputs)
            plan_s += time.perf_counter() - host_start
            host_s += time.perf_counter() - host_start
            decode_start = time.perf_counter()
            result = self._run_decode(inputs, num_steps)
            decode_wall_s = time.perf_counter() - decode_start
            # decode_s is exactly its three measured parts; the Python around the jitted call
            # (its arguments, the abstract inputs for backend_report) is host work.
            decode_s = sum(self._decode_phases)
            host_s += max(decode_wall_s - decode_s, 0.0)

        host_start = time.perf_counter()
        output, num_accepted = self._commit(step, result)
        now = time.perf_counter()
        commit_s = now - host_start
        host_s += commit_s
        self._record_output(output, now)
        stats = StepStats(
            index=step.index,
            num_prefill_chunks=len(step.prefill),
            num_prefill_tokens=sum(len(chunk.token_ids) for chunk in step.prefill),
            num_granted=len(step.granted),
            num_decode_rows=int(step.decode.active.sum()) if step.decode is not None else 0,
            num_emitted=sum(len(tokens) for tokens in output.new_token_ids.values()),
            num_decode_steps=num_steps,
            host_s=host_s,
            prefill_s=prefill_s,
            decode_s=decode_s,
            compiled=self._compile_count() > compiles_before,
            dispatch_s=self._decode_phases[0],
            device_wait_s=self._decode_phases[1],
            fetch_s=self._decode_phases[2],
            plan_s=plan_s,
            commit_s=commit_s,
        )
        return StepOutput(output.new_token_ids, output.finished, num_accepted, stats)

    def _step_overlapped(self) -> StepOutput:
        """One overlapped step (``step``'s docstring): plan and dispatch step N, then fetch
        and commit step N - 1's tokens."""
        compiles_before = self._compile_count()
        start = time.perf_counter()
        step = self.scheduler.plan_step(self.max_steps_per_program)
        inputs, num_steps = None, 0
        if step.decode is not None:
            inputs = self._decode_inputs(step.decode)
            num_steps = programs.num_steps(inputs)
        planned = time.perf_counter()
        for chunk in step.prefill:  # dispatched, not awaited: the device runs them in order
            self._run_prefill_chunk(chunk)
        prefilled = time.perf_counter()
        tokens_on_device = last_on_device = None
        if inputs is not None:
            tokens_on_device, last_on_device = self._dispatch_decode(inputs, num_steps)
        dispatched = time.perf_counter()

        output, wait_s, fetch_s = StepOutput({}, ()), 0.0, 0.0
        if self._in_flight is not None:  # step N - 1: on the device before this one
            previous_step, previous_tokens, _, _ = self._in_flight
            jax.block_until_ready(previous_tokens)
            ready = time.perf_counter()
            tokens = np.asarray(jax.device_get(previous_tokens))
            fetched = time.perf_counter()
            wait_s, fetch_s = ready - dispatched, fetched - ready
            output = self.scheduler.resolve_step(previous_step, tokens)
        resolved = time.perf_counter()
        if step.decode is not None:
            self.scheduler.commit_step_unresolved(step, num_steps)
            self._in_flight = (step, tokens_on_device, num_steps, last_on_device)
        else:
            self.scheduler.commit_step(step)
            self._in_flight = None
        now = time.perf_counter()
        self._record_output(output, now)
        stats = StepStats(
            index=step.index,
            num_prefill_chunks=len(step.prefill),
            num_prefill_tokens=sum(len(chunk.token_ids) for chunk in step.prefill),
            num_granted=len(step.granted),
            num_decode_rows=int(step.decode.active.sum()) if step.decode is not None else 0,
            num_emitted=sum(len(tokens) for tokens in output.new_token_ids.values()),
            num_decode_steps=num_steps,
            host_s=(planned - start) + (now - resolved) + (time.perf_counter() - now),
            prefill_s=prefilled - planned,
            decode_s=(dispatched - prefilled) + wait_s + fetch_s,
            compiled=self._compile_count() > compiles_before,
            dispatch_s=dispatched - prefilled,
            device_wait_s=wait_s,
            fetch_s=fetch_s,
            plan_s=planned - start,
            commit_s=now - resolved,
            overlapped=True,
        )
        return StepOutput(output.new_token_ids, output.finished, {}, stats)

    def _record_output(self, output: StepOutput, now: float) -> None:
        """Token arrival times, finished requests kept for ``run_until_done``, keys dropped."""
        for request_id, tokens in output.new_token_ids.items():
            self.timings[request_id].token_s.extend([now] * len(tokens))
        self._finished.extend(output.finished)
        for finished in output.finished:
            del self._key_data[finished.request_id]

    def _dispatch_decode(
        self, inputs: programs.DecodeInputs, num_steps: int
    ) -> tuple[jax.Array, jax.Array]:
        """Dispatches the decode program (``num_steps`` steps) without waiting for it; rows
        whose token is the scheduler's placeholder feed the previous program's last tokens from
        the device. Returns its tokens (int32[B, K], on the device; their copy to the host is
        started) and its last tokens (int32[B, 1], for the next program)."""
        args = (self.target_params, self.draft_params, self._target_state(), self.draft_caches)
        previous = self._in_flight[3] if self._in_flight is not None else self._previous_zeros()
        result, last = self._call_decode(args, inputs, num_steps, previous)
        result.token_ids.copy_to_host_async()  # the fetch after the next dispatch finds it ready
        return result.token_ids, last

    def _call_decode(self, args: tuple, inputs, num_steps: int, previous=None):
        """Calls the jitted decode program of ``num_steps`` steps on ``args`` (params and
        caches) and ``inputs``, keeping the caches it returns; returns its ``DecodeResult``
        and its last tokens (int32[B, 1])."""
        static = dict(
            target_config=self.target_config,
            draft_config=self.draft_config,
            backend=self.backend,
        )
        if self.sparse is not None:  # absent otherwise: a dense engine's calls are as they were
            static = static | dict(sparse=self.sparse)
        # backend_report traces one step: a block's body is that step (its first step's table).
        first = inputs if num_steps == 1 else programs.first_step(inputs)
        static_step = static | dict(num_speculative=self.num_speculative)
        # "decode": what a plain step runs (a cascaded step's other ops are the same);
        # "decode cascade": what the last cascaded step's attention ran.
        plain = first._replace(cascade=None)
        self._traced["decode"] = ("decode", self._abstract_args((*args, plain)), static_step)
        if first.cascade is not None:
            self._traced["decode cascade"] = (
                "decode_cascade",
                self._abstract_args((*args, first)),
                static_step,
            )
        # One host-to-device copy for all the step's host arrays (serving/host_inputs.py).
        packed, packing = host_inputs.pack(inputs)
        extra = () if previous is None else (previous,)
        if num_steps == 1:
            result, target_state, self.draft_caches = programs.decode_step_jit(
                *args,
                packed,
                *extra,
                packing=packing,
                num_speculative=self.num_speculative,
                **static,
            )
            self._keep_target_state(target_state)
            return result, result.token_ids  # int32[B, 1] without speculation (overlap's case)
        # Always with previous tokens (zeros in the synchronous loop, whose inputs hold no
        # placeholder): one compiled program a K for both loops.
        previous = self._previous_zeros() if previous is None else previous
        result, last, target_state, self.draft_caches = programs.decode_steps_jit(
            *args, packed, previous, packing=packing, **static
        )
        self._keep_target_state(target_state)
        return result, last

    def _target_state(self):
        """The target's state as the programs take it: its caches, or where Quest's key
        bounds are kept a ``BoundedCaches`` of the caches and their bounds."""
        if self.target_key_bounds is None:
            return self.target_caches
        return sparse_step.BoundedCaches(self.target_caches, self.target_key_bounds)

    def _keep_target_state(self, state) -> None:
        """Keeps what a program returned for ``_target_state()`` (the old arrays were donated)."""
        if self.target_key_bounds is None:
            self.target_caches = state
        else:
            self.target_caches, self.target_key_bounds = state.caches, state.key_bounds

    def _previous_zeros(self) -> jax.Array:
        """int32[B, 1] zeros on the device (made once): the previous tokens of a program that
        feeds none from the device."""
        if self._no_previous_tokens is None:
            self._no_previous_tokens = jax.numpy.zeros((self.parallel, 1), jax.numpy.int32)
        return self._no_previous_tokens

    def _run_prefill_chunk(self, chunk) -> None:
        length = len(chunk.token_ids)
        args = (
            self.target_params,
            self.draft_params,
            self._target_state(),
            self.draft_caches,
            chunk.token_ids[None, :],
            chunk.page_table,
        )
        if self.mla:
            # The MLA kernel's plan where it runs the chunk (absorbed, on the kernels'
            # backend): under jit it needs one, made here on the host; otherwise None.
            absorbed = choose_attention_form("auto", self.target_config, length) == "absorbed"
            plan = None
            if absorbed and self._target_kernel_plans():
                (plan,) = self._target_plans([chunk.page_table], length)
            args = (*args, plan)
        # The engine's backend at every chunk length: paged.decode_attention runs chunks of more
        # than MAX_KERNEL_Q_LEN tokens on its prefill kernel, shorter ones on decode's.
        static = dict(
            target_config=self.target_config, draft_config=self.draft_config, backend=self.backend
        )
        self._traced[f"prefill L={length}"] = ("prefill", self._abstract_args(args), static)
        target_state, self.draft_caches = programs.prefill_step_jit(*args, **static)
        self._keep_target_state(target_state)

    def _abstract_args(self, args: tuple) -> tuple:
        """A program's ``(target_params, draft_params, target_caches, draft_caches,
        *step_inputs)`` for ``backend_report``: the four fixed ones abstracted once (the caches
        are donated, so their arrays do not outlive the step), the step's own inputs kept as
        they are (host NumPy arrays, which ``jax.eval_shape`` reads by shape): abstracting them
        every step cost about 80 us of host time a step on a CPU, for a report read once."""
        if self._abstract_state is None:
            self._abstract_state = programs.abstract(args[:4])
        return (*self._abstract_state, *args[4:])

    def _decode_inputs(self, batch: DecodeBatch) -> programs.DecodeInputs:
        """The decode program's device inputs from the scheduler's batch (host NumPy; jit
        transfers), for ``K`` decode steps (``programs.num_steps``): the batch's
        ``num_steps``, or fewer where the Pallas plans of its steps stop sharing a compiled
        variant (then the largest power of two of steps that do; committing frees the rest's
        pages). With ``K > 1`` the table and plan leaves have a leading ``[K]`` axis
        (``programs.stack_steps``)."""
        vocab = self.target_config.vocab_size
        rows = batch.params  # None for an idle row: greedy, no filter, ignored anyway
        temperature = np.array([p.temperature if p else 0.0 for p in rows], np.float32)
        top_k = np.array([(p.top_k or vocab) if p else vocab for p in rows], np.int32)
        top_p = np.array([p.top_p if p else 1.0 for p in rows], np.float32)
        min_p = np.array([p.min_p if p else 0.0 for p in rows], np.float32)
        key_data = np.zeros((self.parallel, 2), np.uint32)
        for slot, request_id in enumerate(batch.request_ids):
            if request_id is not None:
                key_data[slot] = self._key_data[request_id]
        table, draft_tables = batch.page_table, batch.draft_page_tables
        plan, draft_plans = None, (None,) * len(draft_tables)
        pallas = resolve_backend(self.backend) == "pallas"
        num_steps = batch.num_steps
        tables = batch.step_page_tables if num_steps > 1 else (table,)
        levels, reason = self._cascade_levels(tables, batch.active)
        # A cascaded step attends through its levels, a sparse one through a virtual table:
        # neither runs the kernel on the whole table, so neither needs its split-KV plan.
        kernel = self._target_kernel_plans() if self.mla else pallas
        plan_target = kernel and levels is None and self.sparse is None
        q_len = self.num_speculative + 1
        cascade = None
        if num_steps > 1:
            plans = self._target_plans(tables, q_len) if plan_target else (None,) * num_steps
            num_steps = _steps_of_one_variant(plans)
            if num_steps > 1:
                table, plan = programs.stack_steps(tables[:num_steps], plans[:num_steps])
                if levels is not None:
                    cascade = cascade_step.stack_levels(levels[:num_steps])
            else:
                table, plan = tables[0], plans[0]
                cascade = None if levels is None else levels[0]
        else:
            if plan_target:
                # FlashInfer's plan/run split: plan once on the host, every layer reuses it.
                (plan,) = self._target_plans([table], q_len)
            if pallas and draft_tables:  # speculating: the draft model's n + 1 tables
                draft_plans = _plan_tables(draft_tables, self.draft_config)
            cascade = None if levels is None else levels[0]
        self._cascade_stats.record(num_steps, None if levels is None else levels[0], reason)
        if self._sparse_stats is not None:
            self._sparse_stats.record(tables[:num_steps], batch.active)
        return programs.DecodeInputs(
            token_ids=batch.token_ids,
            key_data=key_data,
            num_generated=batch.num_generated,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            page_table=table,
            draft_page_tables=draft_tables,
            plan=plan,
            draft_plans=draft_plans,
            cascade=cascade,
        )

    def _target_kernel_plans(self) -> bool:
        """Whether the MLA target's absorbed attention runs the Mosaic GPU MLA kernel, which
        takes a plan made on the host (``paged.mla_decode.choose_mla_backend``'s choice, the one
        ``paged.mla_decode_attention`` makes when the program is traced)."""
        choice = choose_mla_backend(self.backend, unsupported=self._mla_unsupported)
        return choice.backend == "pallas_mgpu"

    def _target_plans(self, tables, q_len: int) -> tuple[paged.DecodePlan, ...]:
        """The target's split-KV plans for ``tables`` (host), ``q_len`` new tokens a row: the
        MLA kernel's (``plan_mla_decode``) for an MLA target, the decode kernel's otherwise."""
        if not self.mla:
            return _plan_tables(tables, self.target_config)
        from kernels_pallas.mla_decode_mgpu import plan_mla_decode  # Mosaic GPU: imported late

        heads = self.target_config.attention.num_heads
        return tuple(plan_mla_decode(table, heads, q_len) for table in tables)

    def _cascade_levels(self, tables, active) -> tuple[list | None, str | None]:
        """The cascade levels of each step of a decode program (``tables``, host), or None;
        and why not (None when cascaded)."""
        if self.mla_family:
            return None, (
                "an MLA target: cascade attention runs over KV-cache pages, the latent cache "
                "has no cascade path"
            )
        if self.sparse is not None:
            return None, (
                f"sparse={self.sparse.mode!r}: sparse decode and cascade are exclusive "
                "(serving/sparse_step.py)"
            )
        attention = self.backend
        if self.cascade == "auto":  # only "auto" asks whether the attention could pay
            attention = cascade_step.cascade_attention_backend(
                self.backend, self._abstract_query, self._abstract_cache
            )
        crossover, reason = cascade_step.step_crossover(
            self.cascade, self.cascade_crossover, attention
        )
        if crossover is None:
            return None, reason
        levels = cascade_step.plan_step_levels(
            tables, active, crossover, q_len=self.num_speculative + 1, cache=self._cascade_plans
        )
        if levels is None:
            return None, (
                f"no group of {crossover.min_group_size} or more requests sharing "
                f"{crossover.min_prefix_pages} or more whole pages"
            )
        return levels, None

    def _run_decode(self, inputs: programs.DecodeInputs, num_steps: int) -> programs.DecodeResult:
        args = (self.target_params, self.draft_params, self._target_state(), self.draft_caches)
        start = time.perf_counter()
        result, _ = self._call_decode(args, inputs, num_steps)
        dispatched = time.perf_counter()
        jax.block_until_ready(result)  # no extra cost: device_get would wait for it anyway
        ready = time.perf_counter()
        fetched = programs.DecodeResult(*jax.device_get(tuple(result)))
        self._decode_phases = (dispatched - start, ready - dispatched, time.perf_counter() - ready)
        return fetched

    def _commit(self, step: Step, result: programs.DecodeResult | None):
        if result is None:
            return self.scheduler.commit_step(step), {}
        batch = step.decode
        if self.num_speculative:
            output = self.scheduler.commit_step(
                step,
                result.token_ids,
                result.num_accepted,
                draft_token_ids=result.draft_token_ids,
            )
            self.acceptance.record(result.num_accepted[batch.active])
            num_accepted = {
                request_id: int(result.num_accepted[slot])
                for slot, request_id in enumerate(batch.request_ids)
                if batch.active[slot]
            }
            return output, num_accepted
        # int32[B, K]: every step's token of every row (the scheduler applies stops).
        return self.scheduler.commit_step(step, result.token_ids), {}

    # --- loops -----------------------------------------------------------------------------

    def run_until_done(
        self, progress_callback: Callable[[StepOutput], None] | None = None
    ) -> list[RequestOutput]:
        """Steps until every submitted request has finished.

        Args:
          progress_callback: called with each ``StepOutput`` (for progress displays).

        Returns:
          The requests finished since the last call, in the order they finished.
        """
        while self.has_unfinished:
            output = self.step()
            if progress_callback is not None:
                progress_callback(output)
        finished, self._finished = self._finished, []
        return finished

    def generate(
        self,
        requests: Iterable[Request],
        progress_callback: Callable[[StepOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Submits ``requests``, runs until all submitted requests finish, and returns the
        outputs of ``requests`` in their order.

        Raises:
          ValueError: whatever ``submit`` refuses (nothing is run then; requests submitted
            before the bad one stay queued).
        """
        requests = list(requests)
        for request in requests:
            self.submit(request)
        by_id = {out.request_id: out for out in self.run_until_done(progress_callback)}
        return [by_id[request.request_id] for request in requests]

    # --- reports ---------------------------------------------------------------------------

    def _compile_count(self) -> int:
        return (
            programs.decode_step_jit._cache_size()
            + programs.decode_steps_jit._cache_size()
            + programs.prefill_step_jit._cache_size()
        )

    def backend_report(self) -> dict[str, str]:
        """Which implementation ran each op of the programs run so far, as each op chose it
        (``serving.backend_report.backend_report``: traced again from the shapes each program
        last ran with, no compilation).

        Returns:
          ``{"<program>: <op>": "pallas: <kernel names>" | "reference"}``; empty before the
          first step. Once cascade ran, ``"decode: cascade"`` says in how many decode steps
          and with which groups (``CascadeStats.describe``) and ``"decode: cascade attention"``
          what its attention ran (``"decode: attention"`` is plain steps'); absent while it
          has not (why not: ``cascade_report().last_reason``), so a plain run's report, the
          kill switch's included, is what it was. With ``sparse`` on, ``"decode: sparse"`` says
          which selection and budget, in how many decode steps and for how many requests it
          selected (``SparseStats.describe``), ``"decode: sparse selection"`` what computed the
          selection, and ``"decode: attention"`` what attended over the virtual table.
        """
        stats = self._cascade_stats
        cascade = stats.describe() if stats.cascade_steps else None
        sparse = self._sparse_stats.describe() if self._sparse_stats is not None else None
        return backend_report(self._traced, self.num_speculative, cascade=cascade, sparse=sparse)

    def sparse_report(self) -> sparse_step.SparseStats | None:
        """What sparse decode did so far (a copy; None for a dense engine): decode steps,
        request-steps that read a selection of their pages and those whose context fit the
        budget (``serving.sparse_step.SparseStats``)."""
        stats = self._sparse_stats
        return None if stats is None else dataclasses.replace(stats)

    def cascade_report(self) -> cascade_step.CascadeStats:
        """What cascade attention did so far (a copy): decode steps with cascade, groups,
        requests covered, shared pages read once a group, page reads saved
        (``serving.cascade_step.CascadeStats``)."""
        return dataclasses.replace(self._cascade_stats)


def _steps_of_one_variant(plans) -> int:
    """The largest power of two ``K`` such that the first ``K`` plans share their static fields
    (one compiled program runs them; None plans, the reference's, always do)."""
    if plans[0] is None:
        return len(plans)
    variant = (plans[0].write_final, plans[0].long_chunks)
    same = 1
    while same < len(plans) and (plans[same].write_final, plans[same].long_chunks) == variant:
        same += 1
    return 1 << (same.bit_length() - 1)


def _check_mla_backend(backend: str, config: MLAModelConfig, page_size: int) -> str | None:
    """Why the MLA kernel cannot run the MLA target's absorbed attention (None if it can);
    ``backend="pallas"`` where it cannot is refused now, not when the first program traces.

    Raises:
      ValueError: ``backend='pallas'`` with sizes or a dtype the kernel does not take (named).
    """
    if backend == "reference":
        return None
    from kernels_pallas.mla_decode_mgpu import unsupported_reason  # Mosaic GPU: imported late

    sizes = config.attention
    reason = unsupported_reason(
        config.jnp_dtype, sizes.num_heads, sizes.kv_lora_rank, sizes.qk_rope_head_dim, page_size
    )
    if backend == "pallas" and reason is not None:
        raise ValueError(
            f"backend='pallas' cannot run the MLA target's attention on the MLA kernel: {reason} "
            "(backend='reference' or 'auto' runs its reference)"
        )
    return reason


def _plan_tables(tables, config: ModelConfig) -> tuple[paged.DecodePlan, ...]:
    return paged.plan_decode_tables(
        tables, config.num_q_heads, config.num_kv_heads, config.head_dim
    )
