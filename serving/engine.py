"""The decode engine: the scheduler's steps run on the device, one jitted program a decode step.

``Engine`` owns a target model (and optionally a draft), their paged KV caches and a
``serving.scheduler.Scheduler``. Each ``step()`` asks the scheduler what to run, runs the prefill
chunks (one jitted program a chunk, through both models), then the decode batch as ONE jitted
program, and commits the tokens back. ``generate`` and ``run_until_done`` loop over steps.

One decode step, one program
----------------------------
On the GPU host a jitted call costs about 35 us to dispatch (``shared/benchmarking.md``), more
than a layer's kernels at small batch, so a step is never a chain of small calls. The decode
program holds every layer of the ``n + 1`` draft passes, the target's verification of ``n + 1``
positions, the sampling and the acceptance test. Its shapes are static: ``B = parallel`` rows
always (idle slots are phantom rows on the scheduler's padding page), ``page_indices`` padded to
``paged.bucket_size``, so it compiles once per bucket (and per split-KV plan variant on the
Pallas path, ``paged.plan``), never per sequence length. Prefill chunks have power-of-two
lengths (the scheduler's rule), one program per length and table bucket. The step's host arrays
(tokens, keys, sampling parameters, page tables, plans) travel as one int32 buffer
(``serving/host_inputs.py``): one host-to-device copy a step, not one an array.

Sampling: every request draws from its own key
----------------------------------------------
A request's key is ``jax.random.key(seed)`` for its ``SamplingParams.seed`` (all 64 bits, as
``jax.random.key`` does with x64 on). A request without a seed gets
``fold_in(fold_in(key(engine seed), SEEDLESS_DOMAIN), its submission number)``: a key derived
in a domain of its own, so the k-th seedless request never draws the stream of a request given
``seed=k`` (``fold_in`` keys are Threefry blocks of the engine key, never a ``key(seed)``).
Step keys are ``fold_in(request_key, num_generated)``: the tokens a request has generated so far, not the step number or its slot, so its tokens do
not depend on its neighbours, its slot or when it was admitted. The samplers get ``B`` keys,
row ``b`` its own (``sampling/api.py``).

- Plain decoding (``num_speculative = 0``): the target's logits at the fed token, tempered
  (``softmax(logits / T)``; temperature 0 is one-hot at the lowest-index arg max, the samplers'
  convention), then ``sampling.filtered_sample`` with the row's top-k, top-p and min-p
  (disabled filters: ``top_k = V``, ``top_p = 1``, ``min_p = 0``). Key: the step key.
- Speculative decoding (``n`` drafts): draft pass ``j < n`` draws ``d_{j+1}`` with
  ``speculative.sample_draft`` under the row's own parameters, with key ``fold_in(step key, j +
  1)``, and keeps the ``q`` it drew from; pass ``n`` only writes ``d_n``'s keys and values (the
  scheduler's cache contract). The target runs ``L = n + 1`` tokens (the last token and the
  drafts); ``p = speculative.sampling_distribution`` of its logits with the row's parameters;
  ``speculative.chain_speculative_sampling(step key, q, drafts, p)`` decides.
- Mixed batches (greedy and sampled rows together) need no select: at temperature 0,
  ``sampling_distribution`` and ``sample_draft`` give one-hot ``p`` and ``q`` at the arg max,
  and chain sampling with one-hot distributions accepts a draft exactly when it is the target's
  arg max and otherwise emits the target's arg max (the residual ``max(p - q, 0)`` is ``p``'s
  one-hot): ``chain_greedy_verify``'s semantics, row by row, with no random number mattering.
  ``tests/test_engine.py`` checks that equality on random logits.

Time: host and device apart
---------------------------
``StepStats`` splits a step's wall time into host work (``plan_step``, inputs and split-KV plans,
``commit_step``) and device work (the prefill chunks until their caches are ready; the decode
program from dispatch until its tokens are on the host). A step in which a program was compiled
says so (``compiled``), so benchmarks can drop it.

Which backend ran
-----------------
``backend`` goes to every public op (norms, RoPE + append, attention, samplers, acceptance), each
choosing when traced (``kernels_pallas.platform.choose_backend``). ``backend_report()`` traces
each program again under ``platform.record_backends`` and reports what each op's calls chose:
the Pallas kernels (by name) or the pure-JAX reference.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Hashable, Iterable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import paged
import sampling
import speculative
from kernels_pallas.platform import BACKENDS, record_backends, resolve_backend
from sampling.reference import MIN_TEMPERATURE
from serving import host_inputs
from serving import model as model_lib
from serving.requests import Request, RequestOutput
from serving.scheduler import DecodeBatch, Scheduler, Step

# The one-pass decode kernel of paged.decode_attention takes at most this many new tokens per
# request (``paged.decode.MAX_KERNEL_Q_LEN``: one query tile holds all of them, so one read of the
# keys verifies every draft); it bounds the verification length, num_speculative + 1. Longer
# prefill chunks run the causal prefill kernel (``kernels_pallas/paged_prefill.py``), so on
# backend="pallas" every attention of the engine runs a kernel.
MAX_KERNEL_QUERY_TOKENS = 16

# The op of the step each public function implements (the operations of
# ``kernels_pallas.platform.choose_backend``), for ``backend_report``.
OP_OF_OPERATION = {
    "decode_attention": "attention",
    "rope_append_kv": "rope + kv append",
    "rmsnorm": "rmsnorm",
    "fused_add_rmsnorm": "rmsnorm",
    "sample_from_logits": "sampling",
    "sample_from_probs": "sampling",
    "filtered_sample": "sampling",
    "top_k_renorm_probs": "sampling",
    "top_p_renorm_probs": "sampling",
    "top_k_mask_logits": "sampling",
    "chain_speculative_sampling": "speculative acceptance",
}


# ----------------------------------------------------------------------------------------------
# What a step reports


@dataclasses.dataclass(frozen=True)
class StepStats:
    """Where one step's time went.

    Attributes:
      index: the scheduler's step number.
      num_prefill_chunks, num_prefill_tokens: prompt work run before the decode batch.
      num_decode_rows: requests in the decode batch (its active rows).
      num_emitted: tokens the step added to requests (stop and ``max_tokens`` applied).
      host_s: host work: ``plan_step``, building the program's inputs and the split-KV plans,
        the Python around the decode program's call, ``commit_step``.
      prefill_s: the prefill chunks, dispatched and finished (device time plus dispatch).
      decode_s: the decode program, dispatched until its tokens reached the host; the sum of
        the three parts below.
      compiled: whether a program was compiled during the step (its times include compilation).
      dispatch_s: part of ``decode_s``: the jitted call until it returned (cache lookup,
        argument transfers, launch), before the device is done.
      device_wait_s: part of ``decode_s``: from then until the step's outputs were ready.
      fetch_s: part of ``decode_s``: copying the outputs to the host.
    """

    index: int
    num_prefill_chunks: int
    num_prefill_tokens: int
    num_decode_rows: int
    num_emitted: int
    host_s: float
    prefill_s: float
    decode_s: float
    compiled: bool
    dispatch_s: float = 0.0
    device_wait_s: float = 0.0
    fetch_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.host_s + self.prefill_s + self.decode_s


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What one ``Engine.step`` did.

    Attributes:
      new_token_ids: per request that decoded, the tokens it kept this step (for streaming).
      finished: requests that finished in this step.
      num_accepted: per request that decoded with speculation, drafts accepted (before stop and
        ``max_tokens`` were applied); empty without speculation.
      stats: the step's ``StepStats``.
    """

    new_token_ids: dict[Hashable, tuple[int, ...]]
    finished: tuple[RequestOutput, ...]
    num_accepted: dict[Hashable, int]
    stats: StepStats


@dataclasses.dataclass
class AcceptanceStats:
    """Speculative acceptance counted over verification rows (requests' rows of decode steps).

    ``accepted_at[i]`` rows accepted draft ``i + 1``; ``reached_at[i]`` rows tested it (those
    that accepted drafts ``1..i``). With independent acceptances of rate ``alpha``, a step emits
    ``(1 - alpha^(n + 1)) / (1 - alpha)`` tokens on average (Leviathan et al. 2023).

    Attributes:
      num_speculative: ``n``.
      rows: verification rows counted.
      emitted: tokens emitted by those rows (``num_accepted + 1`` each, before stop tokens and
        ``max_tokens`` cut a row short).
      reached_at, accepted_at: int64[n].
    """

    num_speculative: int
    rows: int = 0
    emitted: int = 0
    reached_at: np.ndarray = None
    accepted_at: np.ndarray = None

    def __post_init__(self):
        if self.reached_at is None:
            self.reached_at = np.zeros(self.num_speculative, np.int64)
        if self.accepted_at is None:
            self.accepted_at = np.zeros(self.num_speculative, np.int64)

    def record(self, num_accepted: np.ndarray) -> None:
        """Counts rows that accepted ``num_accepted`` (int[R]) drafts each."""
        num_accepted = np.asarray(num_accepted, np.int64)
        draft = np.arange(self.num_speculative)
        self.rows += num_accepted.size
        self.emitted += int(np.sum(num_accepted + 1))
        self.reached_at += np.sum(num_accepted[:, None] >= draft[None, :], axis=0)
        self.accepted_at += np.sum(num_accepted[:, None] > draft[None, :], axis=0)

    def rate_at(self) -> np.ndarray:
        """float[n]: acceptance rate of each draft position given that it was tested (NaN if
        never tested)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.accepted_at / self.reached_at

    @property
    def alpha(self) -> float:
        """Acceptances over tests, all positions pooled: the maximum-likelihood rate of
        independent acceptances (NaN before any test)."""
        tested = int(self.reached_at.sum())
        return float(self.accepted_at.sum()) / tested if tested else float("nan")

    @property
    def predicted_tokens_per_step(self) -> float:
        """``(1 - alpha^(n + 1)) / (1 - alpha)``: tokens a row emits per step if acceptances
        were independent with rate ``alpha`` (``n + 1`` at ``alpha = 1``)."""
        alpha, n = self.alpha, self.num_speculative
        if np.isnan(alpha):
            return float("nan")
        if alpha == 1.0:
            return float(n + 1)
        return (1 - alpha ** (n + 1)) / (1 - alpha)

    @property
    def measured_tokens_per_step(self) -> float:
        return self.emitted / self.rows if self.rows else float("nan")


@dataclasses.dataclass
class RequestTiming:
    """When a request was submitted and when each of its tokens reached the host
    (``time.perf_counter`` seconds; tokens of one step share their arrival time)."""

    submitted_s: float
    token_s: list[float] = dataclasses.field(default_factory=list)

    @property
    def time_to_first_token_s(self) -> float:
        return self.token_s[0] - self.submitted_s if self.token_s else float("nan")

    def inter_token_s(self) -> np.ndarray:
        """float[T - 1]: gaps between consecutive tokens."""
        return np.diff(np.asarray(self.token_s, np.float64))


# ----------------------------------------------------------------------------------------------
# The jitted programs


class DecodeInputs(NamedTuple):
    """A decode step's device inputs (a pytree; shapes static per table bucket).

    Attributes:
      token_ids: int32[B], each row's last token.
      key_data: uint32[B, 2], each row's request key (``jax.random.key_data``).
      num_generated: int32[B], tokens each row's request has generated (folded into its key).
      temperature, top_p, min_p: float32[B]; top_k: int32[B] (``V`` when disabled).
      page_table: the target's table, rows covering ``positions + n + 1`` tokens.
      draft_page_tables: ``n + 1`` tables, draft pass ``j``'s rows covering ``positions + j +
        1`` tokens (empty without speculation).
      plan, draft_plans: split-KV plans for the Pallas attention (None on the reference).
    """

    token_ids: jax.Array
    key_data: jax.Array
    num_generated: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    page_table: paged.PageTable
    draft_page_tables: tuple[paged.PageTable, ...]
    plan: paged.DecodePlan | None
    draft_plans: tuple[paged.DecodePlan | None, ...]


class DecodeResult(NamedTuple):
    """A decode step's outputs.

    Attributes:
      token_ids: int32[B, n + 1], row ``b`` emitted ``token_ids[b, :num_accepted[b] + 1]``
        (``-1`` after).
      num_accepted: int32[B] in ``[0, n]`` (0 without speculation).
      draft_token_ids: int32[B, n], the drafts fed to the target.
    """

    token_ids: jax.Array
    num_accepted: jax.Array
    draft_token_ids: jax.Array


def step_keys(key_data: jax.Array, num_generated: jax.Array) -> jax.Array:
    """``fold_in(request_key, num_generated)`` per row: typed keys ``[B]``.

    Args:
      key_data: uint32[B, 2], the requests' keys as ``jax.random.key_data`` gives them.
      num_generated: int32[B].
    """
    keys = jax.random.wrap_key_data(key_data)
    return jax.vmap(jax.random.fold_in)(keys, num_generated)


def tempered_probs(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """``softmax(logits / T)`` per row in float32; rows with ``T`` below the samplers'
    ``MIN_TEMPERATURE`` are one-hot at the lowest-index arg max (greedy).

    Args:
      logits: float[B, V].
      temperature: float32[B].

    Returns:
      float32[B, V].
    """
    logits = logits.astype(jnp.float32)
    greedy = temperature < MIN_TEMPERATURE
    tempered = jax.nn.softmax(logits / jnp.where(greedy, 1.0, temperature)[:, None], axis=-1)
    one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy[:, None], one_hot, tempered)


def decode_step(
    target_params,
    draft_params,
    target_caches,
    draft_caches,
    inputs: DecodeInputs,
    *,
    target_config: model_lib.ModelConfig,
    draft_config: model_lib.ModelConfig | None,
    num_speculative: int,
    backend: str,
) -> tuple[DecodeResult, list[paged.KVCache], list[paged.KVCache] | None]:
    """One decode (or verification) step of ``B`` rows: draft passes, target, sampling, acceptance.

    Args:
      target_params, draft_params: parameter pytrees (``draft_params`` None without a draft).
      target_caches, draft_caches: per-layer ``paged.KVCache`` lists (donated under ``jit``).
      inputs: the ``DecodeInputs``.
      target_config, draft_config: the models (static).
      num_speculative: ``n`` (static); 0 is plain decoding.
      backend: for every op (static).

    Returns:
      ``(DecodeResult, target_caches, draft_caches)``.
    """
    n = num_speculative
    keys = step_keys(inputs.key_data, inputs.num_generated)
    row_params = dict(
        temperature=inputs.temperature, top_k=inputs.top_k, top_p=inputs.top_p, min_p=inputs.min_p
    )
    if n == 0:
        logits, target_caches = model_lib.forward_paged(
            target_params,
            target_config,
            inputs.token_ids[:, None],
            target_caches,
            inputs.page_table,
            plan=inputs.plan,
            backend=backend,
        )
        tokens = sampling.filtered_sample(
            keys,
            tempered_probs(logits[:, 0], inputs.temperature),
            top_k=inputs.top_k,
            top_p=inputs.top_p,
            min_p=inputs.min_p,
            backend=backend,
        )
        batch = tokens.shape[0]
        result = DecodeResult(
            tokens[:, None], jnp.zeros((batch,), jnp.int32), jnp.zeros((batch, 0), jnp.int32)
        )
        return result, target_caches, draft_caches

    fed = inputs.token_ids
    drafts, draft_probs = [], []
    for j in range(n + 1):
        draft_logits, draft_caches = model_lib.forward_paged(
            draft_params,
            draft_config,
            fed[:, None],
            draft_caches,
            inputs.draft_page_tables[j],
            plan=inputs.draft_plans[j],
            backend=backend,
        )
        if j == n:  # the last pass only writes d_n's keys and values
            break
        draft_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, j + 1)
        fed, q = speculative.sample_draft(
            draft_keys, draft_logits[:, 0], **row_params, backend=backend
        )
        drafts.append(fed)
        draft_probs.append(q)
    draft_token_ids = jnp.stack(drafts, axis=1)  # [B, n]
    verified = jnp.concatenate([inputs.token_ids[:, None], draft_token_ids], axis=1)
    target_logits, target_caches = model_lib.forward_paged(
        target_params,
        target_config,
        verified,
        target_caches,
        inputs.page_table,
        plan=inputs.plan,
        backend=backend,
    )
    target_probs = speculative.sampling_distribution(target_logits, **row_params)  # [B, n+1, V]
    token_ids, num_accepted = speculative.chain_speculative_sampling(
        keys, jnp.stack(draft_probs, axis=1), draft_token_ids, target_probs, backend=backend
    )
    return DecodeResult(token_ids, num_accepted, draft_token_ids), target_caches, draft_caches


def prefill_step(
    target_params,
    draft_params,
    target_caches,
    draft_caches,
    token_ids: jax.Array,
    page_table: paged.PageTable,
    *,
    target_config: model_lib.ModelConfig,
    draft_config: model_lib.ModelConfig | None,
    backend: str,
):
    """Writes one prompt chunk's keys and values into both caches (its logits are not needed:
    the scheduler prefills up to, not including, a prompt's last token).

    Args:
      token_ids: int32[1, L], the chunk.
      page_table: one row covering the chunk's end.

    Returns:
      ``(target_caches, draft_caches)``.
    """
    _, target_caches = model_lib.forward_paged(
        target_params, target_config, token_ids, target_caches, page_table, backend=backend
    )
    if draft_config is not None:
        _, draft_caches = model_lib.forward_paged(
            draft_params, draft_config, token_ids, draft_caches, page_table, backend=backend
        )
    return target_caches, draft_caches


def packed_decode_step(
    target_params, draft_params, target_caches, draft_caches, packed_inputs, *, packing, **static
):
    """``decode_step`` on ``DecodeInputs`` packed by ``serving.host_inputs.pack`` into one int32
    buffer: the step's host arrays reach the device in one copy, not twenty."""
    inputs = host_inputs.unpack(packed_inputs, packing)
    return decode_step(target_params, draft_params, target_caches, draft_caches, inputs, **static)


_STATIC = ("target_config", "draft_config", "backend")
_decode_step_jit = jax.jit(
    packed_decode_step,
    static_argnames=(*_STATIC, "num_speculative", "packing"),
    donate_argnames=("target_caches", "draft_caches"),
)
_prefill_step_jit = jax.jit(
    prefill_step, static_argnames=_STATIC, donate_argnames=("target_caches", "draft_caches")
)


def implementation_of(records) -> str:
    """``"pallas: <kernels>"`` for the kernels ``records`` (``platform.BackendRecord``s of one
    op) chose, in order, repeats removed; ``"reference"`` where none chose a kernel; both,
    ``"pallas: <kernels>; reference"``, where calls of one op chose differently."""
    kernels = dict.fromkeys(r.kernel for r in records if r.backend == "pallas")
    if not kernels:
        return "reference"
    implementation = "pallas: " + ", ".join(kernels)
    if any(r.backend == "reference" for r in records):
        implementation += "; reference"
    return implementation


def _abstract(tree):
    """The same pytree with every array replaced by its shape and dtype (for tracing later,
    after the arrays themselves were donated)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


# ----------------------------------------------------------------------------------------------
# The engine


def _check_model(name: str, model) -> tuple[model_lib.ModelConfig, dict]:
    if not (isinstance(model, tuple | list) and len(model) == 2):
        raise ValueError(f"{name} must be a (ModelConfig, params) pair, got {type(model).__name__}")
    config, params = model
    if not isinstance(config, model_lib.ModelConfig):
        raise ValueError(f"{name}[0] must be a serving.model.ModelConfig, got {config!r}")
    model_lib.validate_params(params, config)
    return config, params


class Engine:
    """Continuous-batching decode of a target model, optionally with a draft for speculation.

    Args:
      target: ``(ModelConfig, params)`` of the model whose distribution the outputs follow.
      draft: ``(ModelConfig, params)`` of the draft model, required when ``num_speculative >
        0`` (same vocabulary as the target), else ignored (None).
      num_pages: pages in each KV pool (target and draft pools have this many; page 0 pads).
      page_size: tokens per page (a power of two for the Pallas attention kernel).
      parallel: decode slots, the static batch ``B`` of every decode step.
      num_speculative: drafts per step ``n`` (0: plain decoding); ``n + 1`` is at most 16, the
        decode attention kernel's longest query run (``MAX_KERNEL_QUERY_TOKENS``).
      backend: ``"auto"``, ``"reference"`` or ``"pallas"``, for every op of every program,
        prefill chunks of every length included (chunks longer than 16 tokens run the causal
        prefill attention kernel, shorter ones the decode kernel; ``backend_report`` says which).
      layout: the KV pools' layout, ``"HND"`` or ``"NHD"``.
      max_prefill_tokens, prefill_chunk_size: the scheduler's prefill budget per step and
        longest chunk (a power of two).
      seed: derives the keys of requests submitted without a seed.

    Raises:
      ValueError: naming the argument and the bad value (models that are not pairs, params
        unlike their config, a draft missing or of another vocabulary, ``num_speculative``
        outside ``[0, 15]``, an unknown backend or layout, and whatever ``Scheduler`` refuses).

    Example:
      >>> from serving.model import TINY_DRAFT, init_params
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
        seed: int = 0,
    ):
        self.target_config, self.target_params = _check_model("target", target)
        if isinstance(num_speculative, bool) or not isinstance(num_speculative, int):
            raise ValueError(f"num_speculative must be an integer, got {num_speculative!r}")
        if not 0 <= num_speculative < MAX_KERNEL_QUERY_TOKENS:
            raise ValueError(
                f"num_speculative must be in [0, {MAX_KERNEL_QUERY_TOKENS - 1}] (the target "
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
        self.backend = backend
        self.num_speculative = num_speculative
        self.seed = seed
        self.scheduler = Scheduler(
            num_pages,
            page_size,
            parallel,
            num_speculative=num_speculative,
            max_prefill_tokens=max_prefill_tokens,
            prefill_chunk_size=prefill_chunk_size,
        )
        self.parallel = self.scheduler.parallel
        self.target_caches = model_lib.new_caches(self.target_config, num_pages, page_size, layout)
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
        return self.scheduler.has_unfinished

    # --- one step --------------------------------------------------------------------------

    def step(self) -> StepOutput:
        """Plans, runs and commits one step: prefill chunks, then the decode batch (if any).

        Returns:
          The ``StepOutput`` (tokens kept, finished requests, acceptance, timings).
        """
        compiles_before = self._compile_count()
        host_start = time.perf_counter()
        step = self.scheduler.plan_step()
        host_s = time.perf_counter() - host_start

        prefill_start = time.perf_counter()
        for chunk in step.prefill:
            self._run_prefill_chunk(chunk)
        if step.prefill:  # both models prefill: wait for both, or the draft's lands in decode_s
            jax.block_until_ready((self.target_caches, self.draft_caches))
        prefill_s = time.perf_counter() - prefill_start

        decode_s = 0.0
        self._decode_phases = (0.0, 0.0, 0.0)
        result = None
        if step.decode is not None:
            host_start = time.perf_counter()
            inputs = self._decode_inputs(step.decode)
            host_s += time.perf_counter() - host_start
            decode_start = time.perf_counter()
            result = self._run_decode(inputs)
            decode_wall_s = time.perf_counter() - decode_start
            # decode_s is exactly its three measured parts; the Python around the jitted call
            # (its arguments, the abstract inputs for backend_report) is host work.
            decode_s = sum(self._decode_phases)
            host_s += max(decode_wall_s - decode_s, 0.0)

        host_start = time.perf_counter()
        output, num_accepted = self._commit(step, result)
        now = time.perf_counter()
        host_s += now - host_start
        for request_id, tokens in output.new_token_ids.items():
            self.timings[request_id].token_s.extend([now] * len(tokens))
        self._finished.extend(output.finished)
        for finished in output.finished:
            del self._key_data[finished.request_id]
        stats = StepStats(
            index=step.index,
            num_prefill_chunks=len(step.prefill),
            num_prefill_tokens=sum(len(chunk.token_ids) for chunk in step.prefill),
            num_decode_rows=int(step.decode.active.sum()) if step.decode is not None else 0,
            num_emitted=sum(len(tokens) for tokens in output.new_token_ids.values()),
            host_s=host_s,
            prefill_s=prefill_s,
            decode_s=decode_s,
            compiled=self._compile_count() > compiles_before,
            dispatch_s=self._decode_phases[0],
            device_wait_s=self._decode_phases[1],
            fetch_s=self._decode_phases[2],
        )
        return StepOutput(output.new_token_ids, output.finished, num_accepted, stats)

    def _run_prefill_chunk(self, chunk) -> None:
        length = len(chunk.token_ids)
        args = (
            self.target_params,
            self.draft_params,
            self.target_caches,
            self.draft_caches,
            chunk.token_ids[None, :],
            chunk.page_table,
        )
        # The engine's backend at every chunk length: paged.decode_attention runs chunks of more
        # than MAX_KERNEL_QUERY_TOKENS tokens on its prefill kernel, shorter ones on decode's.
        static = dict(
            target_config=self.target_config, draft_config=self.draft_config, backend=self.backend
        )
        self._traced[f"prefill L={length}"] = ("prefill", self._abstract_args(args), static)
        self.target_caches, self.draft_caches = _prefill_step_jit(*args, **static)

    def _abstract_args(self, args: tuple) -> tuple:
        """``_abstract(args)`` for a program's ``(target_params, draft_params, target_caches,
        draft_caches, *step_inputs)``, reusing the first abstract of the four fixed ones."""
        if self._abstract_state is None:
            self._abstract_state = _abstract(args[:4])
        return (*self._abstract_state, *_abstract(args[4:]))

    def _decode_inputs(self, batch: DecodeBatch) -> DecodeInputs:
        """The step's device inputs from the scheduler's batch (host NumPy; jit transfers)."""
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
        if resolve_backend(self.backend) == "pallas":
            # FlashInfer's plan/run split: plan once on the host, every layer reuses it.
            (plan,) = _plan_tables([table], self.target_config)
            if draft_tables:  # speculating: the draft model's n + 1 tables
                draft_plans = _plan_tables(draft_tables, self.draft_config)
        return DecodeInputs(
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
        )

    def _run_decode(self, inputs: DecodeInputs) -> DecodeResult:
        args = (
            self.target_params,
            self.draft_params,
            self.target_caches,
            self.draft_caches,
            inputs,
        )
        static = dict(
            target_config=self.target_config,
            draft_config=self.draft_config,
            num_speculative=self.num_speculative,
            backend=self.backend,
        )
        self._traced["decode"] = ("decode", self._abstract_args(args), static)
        start = time.perf_counter()
        # One host-to-device copy for all the step's host arrays (serving/host_inputs.py).
        packed, packing = host_inputs.pack(inputs)
        result, self.target_caches, self.draft_caches = _decode_step_jit(
            *args[:4], packed, packing=packing, **static
        )
        dispatched = time.perf_counter()
        jax.block_until_ready(result)  # no extra cost: device_get would wait for it anyway
        ready = time.perf_counter()
        fetched = DecodeResult(*jax.device_get(tuple(result)))
        self._decode_phases = (dispatched - start, ready - dispatched, time.perf_counter() - ready)
        return fetched

    def _commit(self, step: Step, result: DecodeResult | None):
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
        return self.scheduler.commit_step(step, result.token_ids[:, 0]), {}

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
        while self.scheduler.has_unfinished:
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
        return _decode_step_jit._cache_size() + _prefill_step_jit._cache_size()

    def backend_report(self) -> dict[str, str]:
        """Which implementation ran each op of the programs run so far, as each op chose it.

        Traces each program again (``jax.eval_shape``, no compilation) from the shapes it last
        ran with, recording every public function's ``choose_backend`` decision.

        Returns:
          ``{"<program>: <op>": "pallas: <kernel names>" | "reference"}`` for the programs
          ``decode`` and ``prefill`` and their ops: ``rmsnorm``, ``rope + kv append``,
          ``attention``, then ``sampling`` (plain decoding) or ``draft sampling``, ``target
          distribution`` and ``speculative acceptance`` (``implementation_of``). Where prefill
          chunks of different lengths ran different implementations, each is followed by its
          lengths: ``"... (L=1,2,4)"``. Empty before the first step.
        """
        model_ops = ["rmsnorm", "rope + kv append", "attention"]
        found: dict[str, dict[str, list[str]]] = {}  # "<program>: <op>" -> implementation -> L
        for program, (kind, args, static) in sorted(self._traced.items()):
            function = decode_step if kind == "decode" else prefill_step
            with record_backends() as records:
                jax.eval_shape(lambda *a, f=function, s=static: f(*a, **s), *args)
            ops = dict.fromkeys(model_ops, "")
            if kind == "decode" and self.num_speculative:
                # The draft's samplers are the step's only samplers: the target's p comes
                # from speculative.sampling_distribution, plain JAX with no backend choice.
                ops.update({"draft sampling": "sampling", "target distribution": "none"})
                ops["speculative acceptance"] = ""
            elif kind == "decode":
                ops["sampling"] = ""
            for op, recorded_op in ops.items():
                recorded_op = recorded_op or op
                implementation = implementation_of(
                    [r for r in records if OP_OF_OPERATION[r.operation] == recorded_op]
                )
                lengths = found.setdefault(f"{kind}: {op}", {}).setdefault(implementation, [])
                lengths.append(program.removeprefix("prefill L="))
        report = {}
        for key, implementations in found.items():
            if len(implementations) == 1:
                report[key] = next(iter(implementations))
            else:  # prefill chunks of different lengths ran different implementations
                report[key] = "; ".join(
                    f"{implementation} (L={','.join(sorted(lengths, key=int))})"
                    for implementation, lengths in implementations.items()
                )
        return report


# ----------------------------------------------------------------------------------------------
# Helpers


# fold_in tag of the keys of requests without a seed (any constant works; it names the domain).
SEEDLESS_DOMAIN = 0x5EED


def seedless_key_data(engine_seed: int, number: int) -> np.ndarray:
    """uint32[2]: the key of the ``number``-th request submitted without a seed (module
    docstring): ``fold_in(fold_in(key(engine_seed), SEEDLESS_DOMAIN), number)``."""
    key = jax.random.wrap_key_data(jnp.asarray(request_key_data(engine_seed), jnp.uint32))
    key = jax.random.fold_in(jax.random.fold_in(key, SEEDLESS_DOMAIN), number)
    return np.asarray(jax.random.key_data(key), np.uint32)


def request_key_data(seed: int) -> np.ndarray:
    """uint32[2]: ``jax.random.key_data(jax.random.key(seed))`` with all 64 bits of ``seed``
    (JAX without x64 keeps only the low 32 bits of a Python int seed; x64 is on here alone)."""
    with jax.enable_x64(True):
        return np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32)


def _plan_tables(tables, config: model_lib.ModelConfig) -> tuple[paged.DecodePlan, ...]:
    return paged.plan_decode_tables(
        tables, config.num_q_heads, config.num_kv_heads, config.head_dim
    )
