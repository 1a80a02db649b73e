"""The ``fused_ops`` suite: fused residual-add RMSNorm and fused RoPE + paged KV append, beside
XLA's fusion of the unfused JAX expressions, in the same run.

Dispatch amortized, median of repeats (``bench.harness``), in a loop of its own
(``ChainedCallsLoop``), because these operations write as many bytes as they read and a call
of the small cases is bound by kernel launches, so anything around a call is timed as if it
were the call:

- Sets in turn, by static index. Each rotating set is arrays of its own, named statically in
  the program (as ``timing.SetsInTurnLoop``): a set sliced out of a stacked pool by a traced
  index is copied into a buffer of its own before a custom call (a Pallas kernel) can read it,
  while XLA's fusion reads the slice in place, which made the norm's public API arm look
  slower than it is (0.92x XLA while the kernel was 1.8x) and put small XLA operations before
  every RoPE kernel. At most ``timing.MAX_UNROLLED_SETS`` sets (the program holds every call):
  the small cases' sets fit in the L2 between visits, and ``bytes_between_visits`` in the JSON
  says so.
- State carried from call to call, as in a model. Each call's outputs are inputs of a later
  call, so nothing is dead and nothing is loop-invariant (XLA would hoist a call on unchanging
  inputs out of the loop), at no cost to any arm: no operation is added to a call. The norm
  carries each set's ``(x, residual)``: ``normed`` becomes the set's next ``x`` and
  ``new_residual`` its next residual, the residual stream of a layer stack whose sublayers are
  the identity. RoPE + append carries the KV pool (each call writes its new slots, in place) and
  q (``q_rotated`` becomes the next q, like a next layer's q; a rotation keeps its size).
- Calls in a chain. Before every call, its set's inputs and the whole carried state pass
  through one ``lax.optimization_barrier``: each call depends on the one before it (so none can
  be hoisted, even one whose own inputs do not change, like RoPE's k and v), and XLA can neither
  fuse one call's output into the next call's kernels (a model's matmul sits between them) nor
  merge independent calls of different sets into one kernel. A barrier emits no code.
- Two rounds an iteration. Writing an output into the buffer of an input of the same call is
  in place only for a kernel that can (a Pallas call with ``input_output_aliases``; a scatter);
  XLA's fused norm reads a whole row before writing it and would need a copy into the loop's
  buffer. So an iteration runs two rounds: the first writes new buffers, the second writes
  back into the loop's buffers, which the first round has finished reading: no arm copies.
  An odd last round runs after the loop.
- The carried state is copied into the loop once per timed program (its initial arrays stay
  live): about 0.3 ms of a 0.1 s program at the largest case, alike for every arm. At the end,
  one element of each carried array joins the checksum, after a barrier.

Cases and arms:

- ``fused_add_rmsnorm B=<tokens> hidden=<H>``, bfloat16, hidden 4096 and 8192, tokens 1, 64 and
  4096 (``--quick``: 4096 tokens; dry run: 5 tokens of 96 and 1 of 128), eps 1e-5. R sets
  of ``[T, H]`` x and residual (R from ``options.unrolled_sets_for`` the bytes of x and
  residual of a set); the weight is one ``[H]`` vector. Bytes = ``norm_bytes``: read x,
  residual, weight; write normed and new_residual. Arms: ``xla_fused``
  (``serving.layers.fused_add_rmsnorm(backend="reference")``, the plain JAX expression as XLA
  fuses it); ``decodelab_kernel`` (``kernels_pallas.norm.fused_add_rmsnorm`` on the arrays);
  ``decodelab`` (the public ``serving.layers.fused_add_rmsnorm(backend="pallas")``: what a model
  gets). ``decodelab_kernel (repeat)``: its noise level.
- ``rope_append B=64``: 32 query heads, 8 KV heads, head_dim 128, bfloat16, HND pool of pages of
  16 (dry run: B=4, 4 and 2 heads, head_dim 16, pages of 4), Llama 3.1 RoPE (theta 500000,
  factor 8). One new token a request (a decode step) at a position drawn in ``[0, 2048)``. The
  rotating sets are the page tables, positions and batch indices: each set's new tokens land in
  pages of their own, so the written pages rotate through the pool (R from
  ``options.unrolled_sets_for`` the bytes a call moves). k and v are one set (0.25 MiB) and q
  is carried, as at a real call site right after the QKV projection, alike for both arms.
  Bytes = ``rope_append_bytes``: read q, k, v, write q_rotated and the new k and v. Arms:
  ``decodelab`` (``paged.rope_append_kv(backend="pallas")``: one Triton kernel a call and
  nothing else), ``jax_unfused`` (``backend="reference"``: rotate q and k, then scatter k and v
  into the pages, as XLA fuses it). ``decodelab (repeat)``: its noise level.

Every Pallas arm's attribution names the Triton kernel found in its lowered program
(``interpret`` where none is compiled); a reference arm says ``xla`` once its program is checked
to call no Triton kernel. Each of our rows records its largest difference from the XLA arm on
one call on set 0 (``max_abs_difference_from_xla``); a difference above
``DISAGREEMENT_TOLERANCE`` is noted.

Targets (issue 6), judged in the notes: ``fused_add_rmsnorm`` at 4096 tokens at 80% or more of
the copy ceiling and at least as fast as ``xla_fused``; ``rope_append`` at least 1.5x
``jax_unfused``.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import paged
from bench.harness import (
    CaseResult,
    CopyCeiling,
    RunOptions,
    TimedLoop,
    checksum_of,
    expected_us,
    repeat_arm,
    report,
)
from bench.suites import SuiteOutput, peers
from kernels_pallas import norm as norm_kernels
from serving import layers

TRITON_CALL_MARKER = "__gpu$xla.gpu.triton"
DTYPE = jnp.bfloat16
EPS = 1e-5
SEED = 6

NORM_HIDDEN = (4096, 8192)
NORM_TOKENS = (1, 64, 4096)
QUICK_NORM_TOKENS = (4096,)
# A dry run's (tokens, hidden) pairs, not a grid: the kernel's masks are runtime values, so
# (5, 96) masks rows (a block of 8 rows) and columns (a block of 128) at once and (1, 128) masks
# neither, one row a block; the other two pairs of the grid mask one of the two, a sub-case.
DRY_RUN_NORM_CASES = ((5, 96), (1, 128))


@dataclasses.dataclass(frozen=True)
class RopeShape:
    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    max_position: int


ROPE_SHAPE = RopeShape(64, 32, 8, 128, 16, 2048)
DRY_RUN_ROPE_SHAPE = RopeShape(4, 4, 2, 16, 4, 20)
ROPE = paged.RopeParams(theta=500000.0, scaling=paged.Llama3Scaling())

# Priors for sizing the first timed program (harness.expected_us); a prior 4x off costs one
# more compilation, not accuracy. XLA's figures are the peers' table of docs/peers.md.
EXPECTED_KERNEL_TBPS, EXPECTED_KERNEL_FLOOR_US = 3.0, 5.0
EXPECTED_XLA_TBPS, EXPECTED_XLA_FLOOR_US = 1.4, 10.0
EXPECTED_ROPE_US = 15.0
# bfloat16 outputs of magnitude up to ~4 (normed rows, rotated heads): a few ulps of 2**-6.
DISAGREEMENT_TOLERANCE = 0.1

# Issue 6's targets.
TARGET_NORM_FRACTION_OF_CEILING = 0.80
TARGET_NORM_TOKENS = 4096
TARGET_ROPE_SPEEDUP = 1.5
PEERS_FOR_RATIO = ("xla_fused", "jax_unfused")

# What the generic header of a report does not say about this suite (module docstring).
METHOD_NOTES = (
    "bytes: fused_add_rmsnorm = read x, residual, weight + write normed, new_residual; "
    "rope_append = read q, k, v + write q_rotated and the new k and v (index arrays not counted)",
    "loop: every set is arrays of its own, named statically (no slice is copied before a "
    "custom call); each call's outputs are carried into a later call (norm: normed and "
    "new_residual become the set's next x and residual; RoPE: the pool and q), and every call's "
    "inputs pass an optimization barrier with the carried state, so calls are chained, none is "
    "hoisted or fused with another, and no arm runs an operation the call itself does not",
    "two rounds a loop iteration, so that no arm needs an in-place write to avoid a copy into "
    "the loop's buffers; the carried state is copied into the loop once per timed program, "
    "alike for every arm",
    "at most 32 sets: for the small cases the sets stay in the L2 between visits "
    "(bytes_between_visits), alike for every arm",
)


def run(options: RunOptions, ceiling: CopyCeiling) -> SuiteOutput:
    """Times every case of the grid (module docstring)."""
    notes: list[str] = list(METHOD_NOTES)
    results: list[CaseResult] = []
    if options.dry_run:
        cases = DRY_RUN_NORM_CASES
    else:
        token_counts = QUICK_NORM_TOKENS if options.quick else NORM_TOKENS
        cases = tuple((tokens, hidden) for hidden in NORM_HIDDEN for tokens in token_counts)
    for tokens, hidden in cases:
        report.print_progress(f"add+RMSNorm tokens={tokens} hidden={hidden}")
        inputs = make_norm_inputs(tokens, hidden, options)
        try:
            results += norm_case_results(inputs, options, ceiling.tbps, notes)
        finally:
            inputs.delete()
            gc.collect()
    shape = DRY_RUN_ROPE_SHAPE if options.dry_run else ROPE_SHAPE
    report.print_progress("RoPE + paged append")
    inputs = make_rope_inputs(shape, options)
    try:
        results += rope_case_results(inputs, options, ceiling.tbps, notes)
    finally:
        inputs.delete()
        gc.collect()
    return SuiteOutput(results=results, notes=notes, peers_for_ratio=PEERS_FOR_RATIO)


# ----------------------------------------------------------------------------------------------
# Shared pieces


class ChainedCallsLoop(TimedLoop):
    """Programs of chained calls over sets visited in turn, a state carried (module docstring).

    ``call(set_index, set_operands, shared, state) -> state``: one call of an arm on set
    ``set_index`` (a Python int), reading the set's arrays, arrays ``shared`` by every set, and
    the carried ``state`` (a pytree of arrays), and returning the new state. Before every call,
    ``(set_operands, shared, state)`` pass one ``lax.optimization_barrier``. A round calls every
    set once, in order; a program of ``iters`` calls (a multiple of R, as ``harness.calls_for``
    sizes them) runs ``iters / R`` rounds, two an iteration of its ``lax.fori_loop`` and an odd
    last one after it. It returns the sum of one element of each array of the final state.

    Args:
      call: as above.
      sets: R pytrees of arrays, one a set.
      shared: a pytree of arrays every call reads.
      state: the initial state (copied into the loop once per program run).
    """

    def __init__(self, call: Callable[..., Any], sets: list, shared: Any, state: Any):
        super().__init__(step=None, num_sets=len(sets), operands=(list(sets), shared, state))
        self.call = call

    def _round(self, sets, shared, state):
        for set_index, set_operands in enumerate(sets):
            set_operands, shared_now, state = lax.optimization_barrier(
                (set_operands, shared, state)
            )
            state = self.call(set_index, set_operands, shared_now, state)
        return state

    def run_rounds(self, operands, rounds: int):
        """The state after ``rounds`` rounds from ``operands``' initial state (traceable)."""
        sets, shared, state = operands
        if rounds // 2:
            state = lax.fori_loop(
                0,
                rounds // 2,
                lambda _, state: self._round(sets, shared, self._round(sets, shared, state)),
                state,
            )
        if rounds % 2:
            state = self._round(sets, shared, state)
        return state

    def program(self, iters: int) -> Callable[[Any], jax.Array]:
        if iters not in self._programs:
            rounds, remainder = divmod(iters, self.num_sets)
            if remainder or rounds < 1:
                raise ValueError(f"iters={iters} is not a positive multiple of {self.num_sets}")

            def loop_program(operands):
                # The barrier keeps the last round whole: a slice of its outputs alone could be
                # narrowed back into it.
                state = lax.optimization_barrier(self.run_rounds(operands, rounds))
                return checksum_of([leaf.reshape(-1)[0] for leaf in jax.tree.leaves(state)])

            self._programs[iters] = jax.jit(loop_program)
        return self._programs[iters]

    def output(self, set_index: int = 0) -> Any:
        """The state after one call on set ``set_index`` from the initial state (untimed)."""
        sets, shared, state = self.operands
        return jax.jit(lambda *operands: self.call(set_index, *operands))(
            sets[set_index], shared, state
        )

    def lowered_text(self, iters: int | None = None) -> str:
        """StableHLO of the program of two rounds: one loop iteration, every call in it."""
        return self.program(iters or 2 * self.num_sets).lower(self.operands).as_text()


def kernel_label(loop: TimedLoop, options: RunOptions, prefix: str) -> str:
    """The Triton kernels starting with ``prefix`` in the loop's program (``interpret`` where
    none is compiled, ``no-triton-kernel-found`` otherwise)."""
    if options.interpret:
        return "interpret"
    names = peers.triton_kernel_names(loop.lowered_text(), prefix)
    return "+".join(names) if names else "no-triton-kernel-found"


def xla_label(loop: TimedLoop) -> str:
    """``xla`` when the loop's program calls no Triton kernel, else the kernels it calls."""
    text = loop.lowered_text()
    if TRITON_CALL_MARKER not in text:
        return "xla"
    return "triton:" + "+".join(peers.triton_kernel_names(text, ""))


def _max_abs_difference(ours, theirs) -> float:
    differences = [
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)), initial=0.0))
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True)
    ]
    return max(differences, default=0.0)


def _verdict(met: bool) -> str:
    return "met" if met else "not met"


def _find(rows: list[CaseResult], case: str, arm: str) -> CaseResult | None:
    return next((row for row in rows if row.case == case and row.arm == arm), None)


@dataclasses.dataclass
class _Arm:
    """A timed row and the loop it was timed with (its repeat runs the same program)."""

    row: CaseResult
    loop: TimedLoop


def _time_arm(options, ceiling_tbps, case, arm, attribution, loop, prior_us, num_bytes, **extra):
    timing = options.time(loop, expected_us_per_call=prior_us, iters=extra.pop("iters", None))
    row = CaseResult.from_timing(case, arm, attribution, timing, num_bytes, ceiling_tbps, **extra)
    return _Arm(row, loop)


def _repeat(options, ceiling_tbps, arm: _Arm, num_bytes: int, carried: tuple[str, ...]):
    first = arm.row
    extra = {key: value for key, value in first.extra.items() if key in carried}
    return _time_arm(
        options,
        ceiling_tbps,
        first.case,
        repeat_arm(first.arm),
        first.attribution,
        arm.loop,
        first.median_us,
        num_bytes,
        iters=first.extra["iters"],
        **extra,
    ).row


# ----------------------------------------------------------------------------------------------
# fused_add_rmsnorm


def norm_bytes(tokens: int, hidden: int, itemsize: int) -> int:
    """Read x, residual (``T x H`` each) and weight (``H``); write normed and new_residual.

    Example:
      >>> norm_bytes(4096, 4096, 2) / 2**20
      128.0078125
    """
    return (4 * tokens * hidden + hidden) * itemsize


@dataclasses.dataclass
class NormInputs:
    """One case's rotating sets.

    Attributes:
      tokens, hidden: each set is ``[tokens, hidden]``.
      num_sets: R.
      x_sets, residual_sets: R bfloat16 ``[tokens, hidden]`` arrays each, set ``s``'s initial
        x and residual.
      weight: bfloat16 ``[hidden]``.
    """

    tokens: int
    hidden: int
    num_sets: int
    x_sets: list[jax.Array]
    residual_sets: list[jax.Array]
    weight: jax.Array

    @property
    def case(self) -> str:
        return f"fused_add_rmsnorm B={self.tokens} hidden={self.hidden}"

    @property
    def bytes_per_call(self) -> int:
        return norm_bytes(self.tokens, self.hidden, jnp.dtype(DTYPE).itemsize)

    def state(self) -> tuple[tuple[jax.Array, jax.Array], ...]:
        """The carried state: every set's ``(x, residual)``."""
        return tuple(zip(self.x_sets, self.residual_sets, strict=True))

    def delete(self) -> None:
        for array in (*self.x_sets, *self.residual_sets, self.weight):
            array.delete()


def make_norm_inputs(tokens: int, hidden: int, options: RunOptions) -> NormInputs:
    """Random sets (activations of magnitude ~1, a residual stream ~4x larger, weights near 1)."""
    num_sets = options.unrolled_sets_for(2 * tokens * hidden * jnp.dtype(DTYPE).itemsize)
    keys = jax.random.split(jax.random.key(SEED + hidden + tokens), 2 * num_sets + 1)
    shape = (tokens, hidden)
    x_sets = [jax.random.normal(key, shape, DTYPE) for key in keys[:num_sets]]
    residual_sets = [
        (4 * jax.random.normal(key, shape, jnp.float32)).astype(DTYPE)
        for key in keys[num_sets : 2 * num_sets]
    ]
    weight = (1 + 0.1 * jax.random.normal(keys[-1], (hidden,), jnp.float32)).astype(DTYPE)
    return NormInputs(tokens, hidden, num_sets, x_sets, residual_sets, weight)


def norm_call(arm: str, x, residual, weight, interpret: bool):
    """One call of ``arm``: ``(normed, new_residual)``."""
    if arm == "decodelab_kernel":
        return norm_kernels.fused_add_rmsnorm(x, residual, weight, EPS, interpret=interpret)
    backend = "reference" if arm == "xla_fused" else "pallas"
    return layers.fused_add_rmsnorm(x, residual, weight, EPS, backend=backend)


def norm_loop(inputs: NormInputs, arm: str, interpret: bool) -> ChainedCallsLoop:
    """Calls of ``arm``, each on its set's carried ``(x, residual)``, whose outputs become the
    set's next ``(x, residual)`` (module docstring)."""

    def call(set_index, set_operands, weight, state):
        del set_operands  # a set is its carried state
        x, residual = state[set_index]
        outputs = tuple(norm_call(arm, x, residual, weight, interpret))
        return (*state[:set_index], outputs, *state[set_index + 1 :])

    return ChainedCallsLoop(call, [()] * inputs.num_sets, inputs.weight, inputs.state())


def norm_outputs_of_set_zero(inputs: NormInputs, arm: str, interpret: bool):
    """Every output element of one call of ``arm`` on set 0 (untimed), to compare arms."""
    call = jax.jit(lambda x, residual, weight: norm_call(arm, x, residual, weight, interpret))
    return call(inputs.x_sets[0], inputs.residual_sets[0], inputs.weight)


NORM_ARMS = (
    ("decodelab_kernel", "kernels_pallas.norm.fused_add_rmsnorm"),
    ("decodelab", "serving.layers.fused_add_rmsnorm(backend=pallas)"),
)


def norm_case_results(
    inputs: NormInputs, options: RunOptions, ceiling_tbps: float, notes: list[str]
) -> list[CaseResult]:
    """The rows of one norm case: ``xla_fused``, our arms, the kernel's repeat; target notes."""
    case, num_bytes = inputs.case, inputs.bytes_per_call
    shape_fields = {"tokens": inputs.tokens, "hidden": inputs.hidden}
    xla_loop = norm_loop(inputs, "xla_fused", options.interpret)
    xla_prior = expected_us(num_bytes, EXPECTED_XLA_TBPS, EXPECTED_XLA_FLOOR_US)
    label = xla_label(xla_loop)
    if label != "xla":
        notes.append(f"{case}: the reference backend's program calls Triton ({label})")
    xla = _time_arm(
        options,
        ceiling_tbps,
        case,
        "xla_fused",
        f"serving.layers.fused_add_rmsnorm(backend=reference):{label}",
        xla_loop,
        xla_prior,
        num_bytes,
        **shape_fields,
    )
    xla_outputs = norm_outputs_of_set_zero(inputs, "xla_fused", options.interpret)
    ours: list[_Arm] = []
    prior = expected_us(num_bytes, EXPECTED_KERNEL_TBPS, EXPECTED_KERNEL_FLOOR_US)
    for arm, call in NORM_ARMS:
        try:
            loop = norm_loop(inputs, arm, options.interpret)
            difference = _max_abs_difference(
                norm_outputs_of_set_zero(inputs, arm, options.interpret), xla_outputs
            )
            timed = _time_arm(
                options,
                ceiling_tbps,
                case,
                arm,
                f"{call}:{kernel_label(loop, options, 'fused_add_rmsnorm')}",
                loop,
                prior,
                num_bytes,
                **shape_fields,
                max_abs_difference_from_xla=difference,
            )
        except Exception as error:  # a kernel that fails to compile must not lose the others
            notes.append(f"{case}: `{arm}` failed: {peers.error_summary(error)}")
            continue
        timed.row.extra["vs_xla_fused"] = xla.row.median_us / timed.row.median_us
        if difference > DISAGREEMENT_TOLERANCE:
            notes.append(f"{case}: `{arm}` differs from `xla_fused` by up to {difference:.3g}")
        ours.append(timed)
    rows = [xla.row] + [arm.row for arm in ours]
    if ours:
        rows.append(_repeat(options, ceiling_tbps, ours[0], num_bytes, ("tokens", "hidden")))
    report.print_results(rows)
    notes += norm_target_notes(inputs.tokens, inputs.hidden, rows)
    return rows


def norm_target_notes(tokens: int, hidden: int, rows: list[CaseResult]) -> list[str]:
    """Issue 6's norm targets at ``TARGET_NORM_TOKENS`` tokens (module docstring)."""
    if tokens != TARGET_NORM_TOKENS:
        return []
    case = f"fused_add_rmsnorm B={tokens} hidden={hidden}"
    xla = _find(rows, case, "xla_fused")
    sentences = []
    for arm in ("decodelab_kernel", "decodelab"):
        row = _find(rows, case, arm)
        if row is None:
            sentences.append(f"`{arm}` not measured")
            continue
        met = row.fraction_of_ceiling >= TARGET_NORM_FRACTION_OF_CEILING
        sentence = (
            f"`{arm}` at {row.fraction_of_ceiling:.1%} of the ceiling (target >= "
            f"{TARGET_NORM_FRACTION_OF_CEILING:.0%}: {_verdict(met)})"
        )
        if xla is not None:
            ratio = xla.median_us / row.median_us
            sentence += f", {ratio:.2f}x `xla_fused` (target >= 1: {_verdict(ratio >= 1)})"
        sentences.append(sentence)
    return [f"target {case}: " + "; ".join(sentences)]


# ----------------------------------------------------------------------------------------------
# RoPE + paged KV append


def rope_append_bytes(shape: RopeShape, itemsize: int) -> int:
    """Read q, k, v; write q_rotated and the new k and v (index arrays not counted).

    Example:
      >>> rope_append_bytes(ROPE_SHAPE, 2) / 2**20
      1.5
    """
    heads = 2 * shape.num_q_heads + 4 * shape.num_kv_heads
    return shape.batch * heads * shape.head_dim * itemsize


@dataclasses.dataclass
class RopeInputs:
    """The rotating sets of the RoPE + append case.

    Attributes:
      shape: the case's sizes.
      num_sets: R.
      q: ``[B, Hq, D]`` bfloat16, the initial q (carried: each call's q_rotated is the next q).
      k, v: ``[B, Hkv, D]`` bfloat16, read by every call.
      sets: R tuples ``(positions [B], batch_indices [B], page_indptr [B + 1], page_indices
        [num_indices], last_page_len [B])``, int32: set r's new tokens and page table.
      cache: the HND pool (carried).
    """

    shape: RopeShape
    num_sets: int
    q: jax.Array
    k: jax.Array
    v: jax.Array
    sets: list[tuple[jax.Array, ...]]
    cache: paged.KVCache

    @property
    def case(self) -> str:
        return f"rope_append B={self.shape.batch}"

    @property
    def bytes_per_call(self) -> int:
        return rope_append_bytes(self.shape, jnp.dtype(DTYPE).itemsize)

    def state(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The carried state: ``(k_pages, v_pages, q)``."""
        return self.cache.k_pages, self.cache.v_pages, self.q

    def delete(self) -> None:
        for array in (*self.state(), self.k, self.v, *jax.tree.leaves(self.sets)):
            array.delete()


def make_rope_inputs(shape: RopeShape, options: RunOptions) -> RopeInputs:
    """Page tables whose new tokens' pages are distinct across every set and request; the
    earlier pages of a request (never touched by an append) are drawn from the whole pool."""
    batch, page_size = shape.batch, shape.page_size
    num_sets = options.unrolled_sets_for(rope_append_bytes(shape, jnp.dtype(DTYPE).itemsize))
    num_pages = num_sets * batch
    rng = np.random.default_rng(SEED)
    positions = rng.integers(0, shape.max_position, size=(num_sets, batch)).astype(np.int32)
    pages_per_request = positions // page_size + 1  # the new token's page is the last one
    last_pages = rng.permutation(num_pages).reshape(num_sets, batch)
    num_indices = int(pages_per_request.sum(axis=1).max())
    sets = []
    for s in range(num_sets):
        page_indptr = np.zeros(batch + 1, np.int32)
        page_indptr[1:] = np.cumsum(pages_per_request[s])
        page_indices = rng.integers(0, num_pages, size=num_indices).astype(np.int32)
        page_indices[page_indptr[1:] - 1] = last_pages[s]
        page_indices[page_indptr[-1] :] = 0  # padding past the table holds 0
        last_page_len = (positions[s] % page_size + 1).astype(np.int32)
        batch_indices = np.arange(batch, dtype=np.int32)
        arrays = (positions[s], batch_indices, page_indptr, page_indices, last_page_len)
        sets.append(tuple(jnp.asarray(array) for array in arrays))
    keys = jax.random.split(jax.random.key(SEED), 5)
    pool_shape = (num_pages, shape.num_kv_heads, page_size, shape.head_dim)
    cache = paged.KVCache(
        jax.random.normal(keys[0], pool_shape, DTYPE),
        jax.random.normal(keys[1], pool_shape, DTYPE),
        "HND",
    )
    q = jax.random.normal(keys[2], (batch, shape.num_q_heads, shape.head_dim), DTYPE)
    kv_shape = (batch, shape.num_kv_heads, shape.head_dim)
    k = jax.random.normal(keys[3], kv_shape, DTYPE)
    v = jax.random.normal(keys[4], kv_shape, DTYPE)
    return RopeInputs(shape, num_sets, q, k, v, sets, cache)


def rope_call(shape: RopeShape, backend: str, set_operands, k, v, state):
    """One call of ``paged.rope_append_kv(backend=backend)`` on a set: the new state
    ``(k_pages, v_pages, q_rotated)``."""
    positions, batch_indices, page_indptr, page_indices, last_page_len = set_operands
    k_pages, v_pages, q = state
    table = paged.PageTable(page_indptr, page_indices, last_page_len, shape.page_size)
    cache = paged.KVCache(k_pages, v_pages, "HND")
    q_rotated, cache = paged.rope_append_kv(
        q, k, v, positions, batch_indices, cache, table, rope=ROPE, backend=backend
    )
    return cache.k_pages, cache.v_pages, q_rotated


def rope_loop(inputs: RopeInputs, backend: str) -> ChainedCallsLoop:
    """Calls of ``paged.rope_append_kv(backend=backend)``, one a set in turn, the pool and q
    carried (module docstring)."""

    def call(set_index, set_operands, shared, state):
        del set_index  # the set's arrays are set_operands
        return rope_call(inputs.shape, backend, set_operands, *shared, state)

    return ChainedCallsLoop(call, inputs.sets, (inputs.k, inputs.v), inputs.state())


def rope_outputs_of_set_zero(inputs: RopeInputs, backend: str):
    """q_rotated and the pool after one call on set 0 (untimed), to compare arms."""
    call = jax.jit(functools.partial(rope_call, inputs.shape, backend))
    k_pages, v_pages, q_rotated = call(inputs.sets[0], inputs.k, inputs.v, inputs.state())
    return q_rotated, k_pages, v_pages


def rope_case_results(
    inputs: RopeInputs, options: RunOptions, ceiling_tbps: float, notes: list[str]
) -> list[CaseResult]:
    """``jax_unfused``, ``decodelab`` and its repeat for the RoPE + append case."""
    case, num_bytes = inputs.case, inputs.bytes_per_call
    reference_loop = rope_loop(inputs, "reference")
    label = xla_label(reference_loop)
    if label != "xla":
        notes.append(f"{case}: the reference backend's program calls Triton ({label})")
    unfused = _time_arm(
        options,
        ceiling_tbps,
        case,
        "jax_unfused",
        f"paged.rope_append_kv(backend=reference):{label}",
        reference_loop,
        EXPECTED_ROPE_US,
        num_bytes,
    )
    rows = [unfused.row]
    try:
        loop = rope_loop(inputs, "pallas")
        difference = _max_abs_difference(
            rope_outputs_of_set_zero(inputs, "pallas"),
            rope_outputs_of_set_zero(inputs, "reference"),
        )
        ours = _time_arm(
            options,
            ceiling_tbps,
            case,
            "decodelab",
            f"paged.rope_append_kv(backend=pallas):{kernel_label(loop, options, 'rope_append')}",
            loop,
            EXPECTED_ROPE_US,
            num_bytes,
            max_abs_difference_from_xla=difference,
        )
    except Exception as error:  # a kernel that fails to compile must not lose the others
        notes.append(f"{case}: `decodelab` failed: {peers.error_summary(error)}")
        ours = None
    if ours is not None:
        speedup = unfused.row.median_us / ours.row.median_us
        ours.row.extra["vs_jax_unfused"] = speedup
        if difference > DISAGREEMENT_TOLERANCE:
            notes.append(
                f"{case}: `decodelab` differs from `jax_unfused` by up to {difference:.3g}"
            )
        rows += [ours.row, _repeat(options, ceiling_tbps, ours, num_bytes, ())]
        notes.append(
            f"target {case}: `decodelab` {speedup:.2f}x `jax_unfused` (target >= "
            f"{TARGET_ROPE_SPEEDUP}x: {_verdict(speedup >= TARGET_ROPE_SPEEDUP)})"
        )
    else:
        notes.append(f"target {case}: `decodelab` not measured")
    report.print_results(rows)
    return rows
