"""The ``sampling`` suite: decodelab's samplers beside the sampling peers, in the same run.

Vocab 128256, float32, batch 1, 32 and 256 (``--quick``: batch 32; dry run: vocab 1000, batch
4, the kinds of ``DRY_RUN_KINDS``), cold L2, dispatch amortized (``bench.harness``). Inputs
rotate the way ``peers.sampling_results`` rotates them: R sets, each its own ``[B, V]`` array visited by a
static index (``timing.SetsInTurnLoop``: no slice is copied before a Pallas call), R from
``options.unrolled_sets_for(B x V x 4)`` (cold L2, but at most 32 sets: at batch 1 the 16 MB
between visits may leave a set in the L2, a difference of under 0.2 us on a 0.5 MB read), with the very logits the peers draw (same seed, same
scale). Bytes per call = ``B x V x 4``: one read of the float32 rows. Each rotating set has
its own key (split from a fixed seed), so no two sets draw the same noise.

Cases and arms:

- ``gumbel B=<n>``: ``sampling.api.sample_from_logits`` at temperature 1 from the logits, as
  ``decodelab_reference`` (``backend="reference"``, plain XLA) and ``decodelab``
  (``backend="pallas"``: the Gumbel-max kernel through the public API, key to per-row key words
  included); ``decodelab_kernel``: ``kernels_pallas.sampling.gumbel_sample`` alone on per-row key
  words computed outside the loop, what the API costs on top of the kernel.
- ``top_p B=<n>``, ``top_k B=<n>``, ``min_p B=<n>``, ``joint B=<n>``: ``top_p_sample`` (0.9),
  ``top_k_sample`` (50), ``min_p_sample`` (0.1), ``top_k_top_p_sample`` (50 and 0.9,
  ``order="joint"``) on the probabilities ``softmax(logits)`` computed once outside the loop (the
  API samples from probabilities; the ``jax_sort`` peer starts from logits, so its figure
  includes one softmax, a few microseconds against its sort). Arms: ``decodelab`` (the public
  sampler, ``backend="pallas"``: the dual-pivot kernel, key to per-row key words and parameter
  clamping included), ``decodelab_kernel`` (``dual_pivot_sample`` alone on per-row key words
  and parameters prepared outside the loop) and ``decodelab_reference`` (the pure-JAX
  dual-pivot rejection of ``sampling/reference.py``, a baseline). Each row records
  ``rounds_mean`` and ``rounds_max``: the rejection rounds per row over every rotating set,
  from one untimed call with ``return_rounds=True`` of that arm's backend
  (``fallback_rows``: rows decided by the exact fallback at the bound), and
  ``vs_jax_sort_top_p``: the ``jax_sort`` peer's time at this batch over this arm's. The
  reference runs all its rounds whatever the rows need (a decided row is carried unchanged),
  so its time does not follow the rounds; the kernel's does (one pass over the row a round).
- the peers (``peers.sampling_results`` for the same batch): ``jax_sort`` and ``torch_sort`` in
  ``top_p B=<n>``, ``jax_categorical`` and ``torch_exponential`` in ``gumbel B=<n>``, and
  ``read_only`` in both.
- ``decodelab (repeat)`` and ``decodelab_reference (repeat)`` in each filtered case: the arm
  timed again at the end of the batch, its noise level.

Attributions: a Pallas arm names the Triton kernel found in its lowered program (``interpret``
where none is compiled); a reference arm says ``xla`` once its program is checked to call no
Triton kernel. A disagreement between the kernel's and the reference's tokens for the same key
becomes a note (they draw the very same noise, so only float rounding may flip a near-tie).

Long runs: every arm prints when it starts and how many seconds it took; after each group of
arms the rows so far go to ``RunOptions.save_partial`` (``python -m bench`` keeps them in
``<date>-sampling-partial.json``), so a run cut by a time limit keeps what it measured; and
``DECODELAB_SAMPLING_CASES=top_k,min_p`` (kinds of ``CASE_KINDS``) runs a part of a batch's
cases (``chosen_kinds``).

The targets of issue 4, which the notes check at the end of each batch: Gumbel-max from logits
(``decodelab``) at 70% or more of the copy ceiling at batch 256 and faster than
``jax.random.categorical`` at every batch; top-p, top-k, min-p and joint (``decodelab``) at
least 10x faster than the sort-based JAX top-p (``jax_sort``) at batch 32 and 256.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import (
    CaseResult,
    CopyCeiling,
    RunOptions,
    SetsInTurnLoop,
    TimedLoop,
    expected_us,
    repeat_arm,
    report,
)
from bench.suites import SuiteOutput, peers
from kernels_pallas import rng
from kernels_pallas.sampling import dual_pivot_sample, gumbel_sample
from sampling import api
from sampling.reference import DEFAULT_MAX_ROUNDS

TEMPERATURE = 1.0
TOP_K = 50
TOP_P = peers.TOP_P
MIN_P = 0.1
KEY_SEED = 2  # the peers draw their noise from key 1; ours is another stream
GUMBEL_KERNEL_PREFIX = "gumbel"  # the pallas_call names of kernels_pallas/sampling.py
DUAL_PIVOT_KERNEL_PREFIX = "dual_pivot"  # and of kernels_pallas/dual_pivot.py
TRITON_CALL_MARKER = "__gpu$xla.gpu.triton"  # how a Triton kernel appears in a lowered program

# Priors for sizing the first timed program (harness.expected_us): guesses until the kernel
# has run on a GPU; the filtered reference runs all DEFAULT_MAX_ROUNDS rounds of several passes
# over the row each. A prior 4x off costs one more compilation, not accuracy.
EXPECTED_KERNEL_TBPS, EXPECTED_KERNEL_FLOOR_US = 1.5, 10.0
EXPECTED_GUMBEL_REFERENCE_TBPS, EXPECTED_GUMBEL_REFERENCE_FLOOR_US = 0.5, 20.0
EXPECTED_FILTER_REFERENCE_TBPS, EXPECTED_FILTER_REFERENCE_FLOOR_US = 0.02, 300.0

# Issue 4's speed targets.
TARGET_GUMBEL_FRACTION_OF_CEILING = 0.70
TARGET_GUMBEL_FRACTION_BATCH = 256
TARGET_FILTER_SPEEDUP_OVER_SORT = 10.0
TARGET_FILTER_BATCHES = (32, 256)
PEERS_FOR_RATIO = ("jax_sort", "torch_sort", "jax_categorical", "torch_exponential", "read_only")


@dataclasses.dataclass(frozen=True)
class FilteredMethod:
    """One filtered sampler of the public API and the parameters the grid times it with.

    Attributes:
      name: the case's leading method (``"top_p"``, ``"joint"``, ...).
      sampler: the public function, called ``sampler(key, probs, **parameters, ...)``.
      parameters: its filter parameters (keywords of ``sampler``).
    """

    name: str
    sampler: Callable[..., object]
    parameters: dict[str, object]

    def sample(self, key, probs: jax.Array, backend: str, **options):
        """The public sampler on ``backend``."""
        return self.sampler(key, probs, **self.parameters, backend=backend, **options)

    def label(self, backend: str) -> str:
        """``top_k_top_p_sample(top_k=50,top_p=0.9,order=joint,backend=reference)``: the call,
        for attributions."""
        arguments = [f"{name}={value}" for name, value in self.parameters.items()]
        return f"{self.sampler.__name__}({','.join([*arguments, f'backend={backend}'])})"

    def kernel_parameters(self, batch: int, vocab: int):
        """``(top_k, top_p, min_p, order)`` as the kernel takes them, per row."""
        parameters = self.parameters
        return (
            jnp.full((batch,), parameters.get("top_k", vocab), jnp.int32),
            jnp.full((batch,), parameters.get("top_p", 1.0), jnp.float32),
            jnp.full((batch,), parameters.get("min_p", 0.0), jnp.float32),
            parameters.get("order", "joint"),
        )


FILTERED_METHODS = (
    FilteredMethod("top_p", api.top_p_sample, {"top_p": TOP_P}),
    FilteredMethod("top_k", api.top_k_sample, {"top_k": TOP_K}),
    FilteredMethod("min_p", api.min_p_sample, {"min_p": MIN_P}),
    FilteredMethod(
        "joint", api.top_k_top_p_sample, {"top_k": TOP_K, "top_p": TOP_P, "order": "joint"}
    ),
)
CASE_KINDS = ("gumbel", *(method.name for method in FILTERED_METHODS))
DRY_RUN_BATCHES = (max(peers.DRY_RUN_SAMPLING_BATCHES),)
# A dry run's kinds when DECODELAB_SAMPLING_CASES does not choose: the Gumbel arms, top-p (the
# peers' case) and joint (top-k and top-p together). top_k and min_p run the same arms and code
# with other parameters; `make test` skips their interpreted kernels (DECODELAB_SAMPLING_CASES
# runs them in a dry run too).
DRY_RUN_KINDS = ("gumbel", "top_p", "joint")
CASES_VARIABLE = "DECODELAB_SAMPLING_CASES"


def run(options: RunOptions, ceiling: CopyCeiling) -> SuiteOutput:
    """Times decodelab's samplers and the peers at each batch of the grid (module docstring)."""
    notes: list[str] = [
        "filtered samplers (top_p, top_k, min_p, joint) sample from probabilities computed "
        "outside the timed call; `jax_sort` starts from logits"
    ]
    results: list[CaseResult] = []
    vocab = peers.DRY_RUN_VOCAB if options.dry_run else peers.VOCAB
    if options.dry_run:
        # One batch of several rows: batch 1 runs the same code, and every dry-run batch is
        # some twenty interpreted kernels to compile in `make test` (about 45 s on 2 cores).
        batches = DRY_RUN_BATCHES
    else:
        batches = peers.QUICK_SAMPLING_BATCHES if options.quick else peers.SAMPLING_BATCHES
    batches = options.batches or batches
    for batch in batches:
        report.print_progress(f"B={batch} vocab={vocab}: setting up, then timing every sampler")
        inputs = make_sampling_inputs(batch, vocab, options.unrolled_sets_for(batch * vocab * 4))
        try:
            results += batch_results(inputs, options, ceiling.tbps, notes, earlier=results)
        finally:
            gc.collect()
            inputs.delete()
    if options.torch_device is None:
        needed = "torch" if options.dry_run else "torch with CUDA"
        notes.append(f"PyTorch peers skipped: {needed} is not importable here")
    return SuiteOutput(results=results, notes=notes, peers_for_ratio=PEERS_FOR_RATIO)


# ----------------------------------------------------------------------------------------------
# Inputs


@dataclasses.dataclass
class SamplingInputs:
    """The rotating sets of one batch, each set its own arrays (``SetsInTurnLoop``).

    Attributes:
      batch, vocab: each set is ``[batch, vocab]``.
      num_sets: R, the number of rotating sets.
      logits_sets: R float32 ``[B, V]`` arrays, the values the peers draw for this batch.
      probs_sets: R float32 ``[B, V]``, ``softmax`` of each (the filtered samplers' input).
      keys: R typed keys, one for each set.
      row_key_words: R uint32 ``[B, 2]``, ``rng.row_keys(fold_in(keys[r], 0), B)``: the raw
        kernels' input, the words the public API derives in round 0 (``round_key``).
    """

    batch: int
    vocab: int
    num_sets: int
    logits_sets: list[jax.Array]
    probs_sets: list[jax.Array]
    keys: list[jax.Array]
    row_key_words: list[jax.Array]

    @property
    def bytes_per_call(self) -> int:
        """One read of a float32 ``[B, V]`` set."""
        return self.batch * self.vocab * 4

    def delete(self) -> None:
        """Frees the device arrays before the next batch allocates its own."""
        for arrays in (self.logits_sets, self.probs_sets, self.keys, self.row_key_words):
            for array in arrays:
                array.delete()


def round_key(key: jax.Array, round_index) -> jax.Array:
    """The key of one timed call: the set's key folded with the program's round, so that no
    call is loop-invariant (which XLA could hoist out of the timed loop)."""
    return jax.random.fold_in(key, round_index)


def round_words(row_key_words: jax.Array, round_index) -> jax.Array:
    """The raw kernels' counterpart of ``round_key``: round 0 gives the API's own words."""
    return row_key_words ^ jnp.asarray(round_index).astype(jnp.uint32)


def make_sampling_inputs(batch: int, vocab: int, num_sets: int) -> SamplingInputs:
    """Rotating sets with the peers' logits for ``batch`` (``peers.random_sets``)."""
    logits_sets = peers.random_sets(batch, vocab, num_sets)
    softmax = jax.jit(functools.partial(jax.nn.softmax, axis=-1))
    probs_sets = [softmax(logits) for logits in logits_sets]
    keys = list(jax.random.split(jax.random.key(KEY_SEED), num_sets))
    words = jax.jit(lambda key: rng.row_keys(round_key(key, 0), batch))
    row_key_words = [words(key) for key in keys]
    return SamplingInputs(batch, vocab, num_sets, logits_sets, probs_sets, keys, row_key_words)


# ----------------------------------------------------------------------------------------------
# Loops: one call of each arm on one set, in round `round_index` of the timed program


def api_gumbel_loop(inputs: SamplingInputs, backend: str) -> SetsInTurnLoop:
    """One call = ``sample_from_logits(key, logits, temperature=1, backend=backend)``."""

    def call(set_operands, round_index):
        logits, key = set_operands
        return api.sample_from_logits(
            round_key(key, round_index), logits, temperature=TEMPERATURE, backend=backend
        )

    return SetsInTurnLoop(call, list(zip(inputs.logits_sets, inputs.keys, strict=True)))


def kernel_gumbel_loop(inputs: SamplingInputs, interpret: bool) -> SetsInTurnLoop:
    """One call = the raw Gumbel-max kernel from logits on precomputed per-row key words."""
    temperature = jnp.full((inputs.batch,), TEMPERATURE, jnp.float32)

    def call(set_operands, round_index):
        logits, row_key_words = set_operands
        return gumbel_sample(
            logits,
            round_words(row_key_words, round_index),
            temperature,
            from_logits=True,
            stream=api.EXPONENTIAL_STREAM,
            interpret=interpret,
        )

    return SetsInTurnLoop(call, list(zip(inputs.logits_sets, inputs.row_key_words, strict=True)))


def filtered_loop(inputs: SamplingInputs, method: FilteredMethod, backend: str) -> SetsInTurnLoop:
    """One call = the public filtered sampler ``method`` on the probabilities of a set."""

    def call(set_operands, round_index):
        probs, key = set_operands
        return method.sample(round_key(key, round_index), probs, backend)

    return SetsInTurnLoop(call, list(zip(inputs.probs_sets, inputs.keys, strict=True)))


def kernel_filtered_loop(
    inputs: SamplingInputs, method: FilteredMethod, interpret: bool
) -> SetsInTurnLoop:
    """One call = the raw dual-pivot kernel on precomputed per-row key words and parameters."""
    top_k, top_p, min_p, order = method.kernel_parameters(inputs.batch, inputs.vocab)

    def call(set_operands, round_index):
        probs, row_key_words = set_operands
        tokens, _ = dual_pivot_sample(
            probs,
            round_words(row_key_words, round_index),
            top_k,
            top_p,
            min_p,
            order=order,
            max_rounds=DEFAULT_MAX_ROUNDS,
            stream=api.ROUND_STREAM,
            interpret=interpret,
        )
        return tokens

    return SetsInTurnLoop(call, list(zip(inputs.probs_sets, inputs.row_key_words, strict=True)))


def rounds_over_sets(inputs: SamplingInputs, method: FilteredMethod, backend: str) -> np.ndarray:
    """int32 ``[R, B]``: the rejection rounds every row of every set takes (untimed) on
    ``backend``, with the keys of round 0 of the timed calls."""

    @jax.jit
    def rounds_of_set(probs, key):
        _, rounds = method.sample(round_key(key, 0), probs, backend, return_rounds=True)
        return rounds

    return np.stack(
        [
            np.asarray(rounds_of_set(probs, key))
            for probs, key in zip(inputs.probs_sets, inputs.keys, strict=True)
        ]
    )


# ----------------------------------------------------------------------------------------------
# Attribution


def pallas_kernel_names(
    loop: TimedLoop, options: RunOptions, prefix: str = GUMBEL_KERNEL_PREFIX
) -> str:
    """The Triton kernels named ``prefix...`` a loop's program calls (``gumbel_logits_q256x8``),
    ``interpret`` where no kernel is compiled, ``no-triton-kernel-found`` otherwise."""
    if options.interpret:
        return "interpret"
    names = peers.triton_kernel_names(loop.lowered_text(), prefix)
    return "+".join(names) if names else "no-triton-kernel-found"


def xla_only_label(loop: TimedLoop) -> str:
    """``xla`` when the loop's program calls no Triton kernel (the reference backend must not),
    else the kernels it calls, so that a reference arm that is not one shows it."""
    text = loop.lowered_text()
    if TRITON_CALL_MARKER not in text:
        return "xla"
    return "triton:" + "+".join(peers.triton_kernel_names(text, ""))


# ----------------------------------------------------------------------------------------------
# Arms


@contextlib.contextmanager
def _announced(case: str, arm: str):
    """Prints an arm's start and, once it is done, its seconds (building, compiling, checks,
    calibration and the timed repeats together): where a long run spends its time."""
    start = time.perf_counter()
    report.print_progress(f"{case}: {arm}")
    try:
        yield
    finally:
        report.print_progress(f"{case}: {arm} done in {time.perf_counter() - start:.0f} s")


def _timed_row(
    inputs: SamplingInputs,
    options: RunOptions,
    ceiling_tbps: float,
    case: str,
    arm: str,
    attribution: str,
    loop: TimedLoop,
    prior_us: float,
    *,
    iters: int | None = None,
    **extra,
) -> CaseResult:
    timing = options.time(loop, expected_us_per_call=prior_us, iters=iters)
    return CaseResult.from_timing(
        case,
        arm,
        attribution,
        timing,
        inputs.bytes_per_call,
        ceiling_tbps,
        vocab=inputs.vocab,
        **extra,
    )


# The parameters a repeat row states again; loop bookkeeping is its own, checks are not redone.
_CARRIED_TO_REPEAT = ("temperature", "top_k", "top_p", "min_p")


@dataclasses.dataclass
class _Arm:
    """A timed row and the loop it was timed with, which its repeat runs again."""

    row: CaseResult
    loop: TimedLoop


def _same_tokens(first, second) -> float:
    """The fraction of rows on which two arms picked the same token."""
    return float(np.mean(np.asarray(first) == np.asarray(second)))


def gumbel_arms(
    inputs: SamplingInputs, options: RunOptions, ceiling_tbps: float, notes: list[str]
) -> list[_Arm]:
    """``decodelab_reference``, ``decodelab`` and ``decodelab_kernel`` in ``gumbel B=<n>``; a
    Pallas arm that fails is noted, not raised, so the other arms keep their figures."""
    case = f"gumbel B={inputs.batch}"
    num_bytes = inputs.bytes_per_call
    with _announced(case, "decodelab_reference"):
        arms = [_gumbel_reference_arm(inputs, options, ceiling_tbps, notes, case)]
    reference_tokens = arms[0].loop.output(0)
    kernel_prior = expected_us(num_bytes, EXPECTED_KERNEL_TBPS, EXPECTED_KERNEL_FLOOR_US)
    pallas_arms = (
        (
            "decodelab",
            "sample_from_logits(backend=pallas)",
            lambda: api_gumbel_loop(inputs, "pallas"),
        ),
        (
            "decodelab_kernel",
            "gumbel_sample(kernel only)",
            lambda: kernel_gumbel_loop(inputs, options.interpret),
        ),
    )
    arms += _pallas_arms(
        inputs,
        options,
        ceiling_tbps,
        notes,
        case,
        pallas_arms,
        reference_tokens,
        kernel_prior,
        kernel_prefix=GUMBEL_KERNEL_PREFIX,
        why_same="same key, same noise: only float rounding should flip a near-tie",
        extra=lambda: dict(temperature=TEMPERATURE),
    )
    return arms


def _gumbel_reference_arm(
    inputs: SamplingInputs, options: RunOptions, ceiling_tbps: float, notes: list[str], case: str
) -> _Arm:
    """``decodelab_reference`` in ``gumbel B=<n>``: ``sample_from_logits`` on plain XLA."""
    num_bytes = inputs.bytes_per_call
    reference_loop = api_gumbel_loop(inputs, "reference")
    reference_prior = expected_us(
        num_bytes, EXPECTED_GUMBEL_REFERENCE_TBPS, EXPECTED_GUMBEL_REFERENCE_FLOOR_US
    )
    reference_label = xla_only_label(reference_loop)
    if reference_label != "xla":
        notes.append(f"{case}: the reference backend's program calls Triton ({reference_label})")
    reference_row = _timed_row(
        inputs,
        options,
        ceiling_tbps,
        case,
        "decodelab_reference",
        f"sample_from_logits(backend=reference):{reference_label}",
        reference_loop,
        reference_prior,
        temperature=TEMPERATURE,
    )
    return _Arm(reference_row, reference_loop)


def _pallas_arms(
    inputs: SamplingInputs,
    options: RunOptions,
    ceiling_tbps: float,
    notes: list[str],
    case: str,
    pallas_arms,
    reference_tokens,
    prior_us: float,
    *,
    kernel_prefix: str,
    why_same: str,
    extra: Callable[[], dict],
) -> list[_Arm]:
    """Times each ``(arm, call, make_loop)`` of ``pallas_arms``, with the Triton kernels its
    program calls and the share of rows on which it picked the reference's token (set 0). An arm
    that fails is noted, not raised, so the other arms keep their figures; so is an arm whose
    program calls no ``kernel_prefix`` kernel or disagrees with the reference (``why_same`` says
    what alone may flip a token). ``extra()`` gives the row's extra fields (called once an arm
    compiled, so an expensive field is computed only when needed)."""
    timed = []
    extra_fields = None
    for arm, call, make_loop in pallas_arms:
        with _announced(case, arm):
            try:
                loop = make_loop()
                kernels = pallas_kernel_names(loop, options, kernel_prefix)
                same = _same_tokens(loop.output(0), reference_tokens)
                if extra_fields is None:
                    extra_fields = extra()
                row = _timed_row(
                    inputs,
                    options,
                    ceiling_tbps,
                    case,
                    arm,
                    f"{call}:{kernels}",
                    loop,
                    prior_us,
                    same_tokens_as_reference=same,
                    **extra_fields,
                )
            except Exception as error:  # a kernel that fails to compile must not lose the others
                notes.append(f"{case}: `{arm}` failed: {peers.error_summary(error)}")
                continue
        if kernels == "no-triton-kernel-found":
            notes.append(f"{case}: no Triton `{kernel_prefix}` kernel in `{arm}`'s program")
        if same != 1.0:
            notes.append(
                f"{case}: `{arm}` picked the reference's token on {same:.1%} of the rows of "
                f"set 0 ({why_same})"
            )
        timed.append(_Arm(row, loop))
    return timed


def filtered_arms(
    inputs: SamplingInputs,
    method: FilteredMethod,
    options: RunOptions,
    ceiling_tbps: float,
    notes: list[str],
) -> list[_Arm]:
    """``decodelab_reference``, ``decodelab`` and ``decodelab_kernel`` in ``<method> B=<n>``,
    each with the rejection rounds its backend took; a Pallas arm that fails is noted."""
    case = f"{method.name} B={inputs.batch}"
    parameters = {name: value for name, value in method.parameters.items() if name != "order"}

    def rounds_fields(rounds: np.ndarray) -> dict:
        return dict(
            rounds_mean=float(rounds.mean()),
            rounds_max=int(rounds.max()),
            rounds_rows=int(rounds.size),
            fallback_rows=int(np.sum(rounds > DEFAULT_MAX_ROUNDS)),
        )

    reference_loop = filtered_loop(inputs, method, "reference")
    reference_prior = expected_us(
        inputs.bytes_per_call, EXPECTED_FILTER_REFERENCE_TBPS, EXPECTED_FILTER_REFERENCE_FLOOR_US
    )
    with _announced(case, "decodelab_reference"):
        reference_row = _timed_row(
            inputs,
            options,
            ceiling_tbps,
            case,
            "decodelab_reference",
            f"{method.label('reference')}:{xla_only_label(reference_loop)}"
            f":dual_pivot(max_rounds={DEFAULT_MAX_ROUNDS})",
            reference_loop,
            reference_prior,
            **rounds_fields(rounds_over_sets(inputs, method, "reference")),
            **parameters,
        )
    arms = [_Arm(reference_row, reference_loop)]
    reference_tokens = reference_loop.output(0)
    kernel_prior = expected_us(inputs.bytes_per_call, 0.3, EXPECTED_KERNEL_FLOOR_US)
    pallas_arms = (
        ("decodelab", method.label("pallas"), lambda: filtered_loop(inputs, method, "pallas")),
        (
            "decodelab_kernel",
            "dual_pivot_sample(kernel only)",
            lambda: kernel_filtered_loop(inputs, method, options.interpret),
        ),
    )
    arms += _pallas_arms(
        inputs,
        options,
        ceiling_tbps,
        notes,
        case,
        pallas_arms,
        reference_tokens,
        kernel_prior,
        kernel_prefix=DUAL_PIVOT_KERNEL_PREFIX,
        why_same="same uniforms: only float32 summation order should flip a decision",
        extra=lambda: {
            **rounds_fields(rounds_over_sets(inputs, method, "pallas")),
            **parameters,
        },
    )
    return arms


def _repeat_row(
    inputs: SamplingInputs, options: RunOptions, ceiling_tbps: float, arm: _Arm
) -> CaseResult:
    """``arm`` timed again with the same program (same calls per sample): its noise level."""
    first = arm.row
    extra = {key: value for key, value in first.extra.items() if key in _CARRIED_TO_REPEAT}
    with _announced(first.case, repeat_arm(first.arm)):
        return _timed_row(
            inputs,
            options,
            ceiling_tbps,
            first.case,
            repeat_arm(first.arm),
            first.attribution,
            arm.loop,
            first.median_us,
            iters=first.extra["iters"],
            **extra,
        )


def chosen_kinds(options: RunOptions) -> tuple[str, ...]:
    """The case kinds this run times: every kind of ``CASE_KINDS`` (``--gumbel-only``: gumbel),
    filtered by ``DECODELAB_SAMPLING_CASES`` (kinds, comma-separated), which splits a batch that
    does not fit one device command into parts (``bench.harness.merge_reports`` joins them).
    The peers' rows join the ``gumbel`` and ``top_p`` cases, so they run in a part that has
    both (a case's arms must come from one process). A dry run without the variable times
    ``DRY_RUN_KINDS``."""
    kinds = ("gumbel",) if options.gumbel_only else CASE_KINDS
    wanted = os.environ.get(CASES_VARIABLE, "").strip()
    if options.dry_run and not wanted:
        return tuple(kind for kind in kinds if kind in DRY_RUN_KINDS)
    if wanted:
        names = {name.strip() for name in wanted.split(",") if name.strip()}
        unknown = names - set(CASE_KINDS)
        if unknown:
            raise ValueError(
                f"{CASES_VARIABLE} names unknown kinds {sorted(unknown)}; known: {CASE_KINDS}"
            )
        kinds = tuple(kind for kind in kinds if kind in names)
    return kinds


def batch_results(
    inputs: SamplingInputs,
    options: RunOptions,
    ceiling_tbps: float,
    notes: list[str],
    earlier: list[CaseResult] = (),
) -> list[CaseResult]:
    """Every row of one batch: our arms, the peers', then our repeats, and the target notes.
    After each group of arms, every row so far (``earlier`` batches' included) is handed to
    ``options.save_partial``."""
    kinds = chosen_kinds(options)
    done: list[CaseResult] = list(earlier)

    def measured(arms: list[_Arm]) -> list[_Arm]:
        done.extend(arm.row for arm in arms)
        options.save_partial(done)
        return arms

    gumbel = (
        measured(gumbel_arms(inputs, options, ceiling_tbps, notes)) if "gumbel" in kinds else []
    )
    filtered_by_method = [
        measured(filtered_arms(inputs, method, options, ceiling_tbps, notes))
        for method in FILTERED_METHODS
        if method.name in kinds
    ]
    filtered = [arm for arms in filtered_by_method for arm in arms]
    # Each filtered case's noise level: its API arm, or its reference arm where that failed.
    filtered_repeats = [
        next((arm for arm in arms if arm.row.arm == "decodelab"), arms[0])
        for arms in filtered_by_method
    ]
    peer_rows = []
    if "gumbel" in kinds and ("top_p" in kinds or options.gumbel_only):
        peer_rows = peers.sampling_results(
            inputs.batch, inputs.vocab, options, ceiling_tbps, notes=notes
        )
        done.extend(peer_rows)
        options.save_partial(done)
    else:
        notes.append(
            f"B={inputs.batch}: the peers were not run in this part (their rows join the gumbel "
            "and top_p cases, so they run with both)"
        )
    # The API arm is the noise level of its case; where it failed, the reference arm is.
    api_arms = (
        [next((arm for arm in gumbel if arm.row.arm == "decodelab"), gumbel[0])] if gumbel else []
    )
    repeats = [
        _repeat_row(inputs, options, ceiling_tbps, arm) for arm in [*api_arms, *filtered_repeats]
    ]
    ours = [arm.row for arm in gumbel + filtered]
    sort_row = _find(peer_rows, f"top_p B={inputs.batch}", "jax_sort")
    if sort_row is not None:
        for arm in filtered:
            arm.row.extra["vs_jax_sort_top_p"] = sort_row.median_us / arm.row.median_us
    report.print_results(ours + repeats)
    notes += target_notes(
        inputs.batch, ours + peer_rows, filtered=bool(filtered), gumbel=bool(gumbel)
    )
    return ours + peer_rows + repeats


def _find(rows: list[CaseResult], case: str, arm: str) -> CaseResult | None:
    return next((row for row in rows if row.case == case and row.arm == arm), None)


def target_notes(
    batch: int, rows: list[CaseResult], *, filtered: bool = True, gumbel: bool = True
) -> list[str]:
    """Sentences comparing one batch's figures with issue 4's targets (module docstring); the
    filtered samplers' only where they ran (``filtered``), Gumbel-max's likewise (``gumbel``)."""
    notes = []
    gumbel_case = f"gumbel B={batch}"
    ours = _find(rows, gumbel_case, "decodelab")
    categorical = _find(rows, gumbel_case, "jax_categorical")
    if not gumbel:
        pass
    elif ours is None:
        notes.append(f"target {gumbel_case}: `decodelab` not measured")
    else:
        sentence = (
            f"target {gumbel_case}: `decodelab` at {ours.fraction_of_ceiling:.1%} of the ceiling"
        )
        if batch == TARGET_GUMBEL_FRACTION_BATCH:
            met = ours.fraction_of_ceiling >= TARGET_GUMBEL_FRACTION_OF_CEILING
            sentence += f" (target >= {TARGET_GUMBEL_FRACTION_OF_CEILING:.0%}: {_verdict(met)})"
        if categorical is not None:
            speedup = categorical.median_us / ours.median_us
            sentence += f", {speedup:.2f}x `jax_categorical` (target > 1: {_verdict(speedup > 1)})"
        notes.append(sentence)
    sort_row = _find(rows, f"top_p B={batch}", "jax_sort")
    if filtered and batch in TARGET_FILTER_BATCHES and sort_row is not None:
        for method in FILTERED_METHODS:
            filtered = _find(rows, f"{method.name} B={batch}", "decodelab")
            if filtered is None:
                notes.append(f"target {method.name} B={batch}: `decodelab` not measured")
                continue
            speedup = sort_row.median_us / filtered.median_us
            notes.append(
                f"target {method.name} B={batch}: `decodelab` {speedup:.2f}x "
                f"`jax_sort` top-p (target >= {TARGET_FILTER_SPEEDUP_OVER_SORT:.0f}x: "
                f"{_verdict(speedup >= TARGET_FILTER_SPEEDUP_OVER_SORT)})"
            )
    return notes


def _verdict(met: bool) -> str:
    return "met" if met else "not met"
