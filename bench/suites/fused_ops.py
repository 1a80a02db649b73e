"""The ``fused_ops`` suite: fused residual-add RMSNorm and fused RoPE + paged KV append, beside
XLA's fusion of the unfused JAX expressions, in the same run.

Cold L2 and dispatch amortized (``bench/harness.py``). Two differences from the attention and
sampling suites, both because these operations write as many bytes as they read:

- Digest, not checksum. ``checksum_of`` sums every output element; here that would add a read
  of outputs as large as the inputs, which XLA may fuse into its own kernel for free while a
  custom call pays it in full. Instead every arm passes its outputs through
  ``lax.optimization_barrier`` (so they are written to memory in full, as a model's layer
  writes them; nothing can be narrowed away) and returns one row of each: the digest.
- In-place state. RoPE + append updates the KV pool; a pool that a timed call reads but does
  not own would be copied whole before every call. That loop (``CarriedLoop``) carries the pool
  from call to call, as a serving loop does, so each arm writes only its new slots. The pool is
  copied once into the loop's carry per timed program (0.7 GB read and written: about 0.3 ms,
  0.3% of a 0.1 s program), alike for both arms.

Cases and arms:

- ``fused_add_rmsnorm B=<tokens> hidden=<H>``, bfloat16, hidden 4096 and 8192, tokens 1, 64 and
  4096 (``--quick``: 4096 tokens; dry run: hidden 96 and 128, tokens 1 and 5), eps 1e-5. The
  rotating sets are consecutive ``[T, H]`` windows of one ``[R T, H]`` pool of x and one of
  residual (R from ``options.num_sets_for`` the bytes of x and residual of a set); the weight
  is one ``[H]`` vector. Bytes = ``norm_bytes``: read x, residual, weight; write normed and
  new_residual. Arms: ``xla_fused`` (``serving.layers.fused_add_rmsnorm(backend="reference")``,
  the plain JAX expression, on the set's window sliced out of the pool: XLA fuses the slice into
  its kernels); ``decodelab_kernel`` (``kernels_pallas.norm.fused_add_rmsnorm`` reading the
  set's window in place through ``row_offset``: the kernel's figure); ``decodelab`` (the public
  ``serving.layers.fused_add_rmsnorm(backend="pallas")`` on the sliced window: a custom call
  cannot read a slice in place, so XLA copies x's and residual's windows first, which a model's
  layer, whose inputs are fresh activations, does not pay; it is reported so the cost of that
  is visible, and is not the kernel's figure). ``decodelab_kernel (repeat)``: its noise level.
- ``rope_append B=64``: 32 query heads, 8 KV heads, head_dim 128, bfloat16, HND pool of pages of
  16 (dry run: B=4, 4 and 2 heads, head_dim 16, pages of 4), Llama 3.1 RoPE (theta 500000,
  factor 8). One new token a request (a decode step) at a position drawn in ``[0, 2048)``. The
  rotating sets are the page tables and positions: each set's new tokens land in pages of their
  own, so the written pages rotate through the pool (R from ``options.num_sets_for`` the bytes a
  call writes). q, k and v are one set (0.75 MiB), as at a real call site right after the QKV
  projection, read alike by both arms. Bytes = ``rope_append_bytes``: read q, k, v, write
  q_rotated and the new k and v. Arms: ``decodelab`` (``paged.rope_append_kv(backend=
  "pallas")``), ``jax_unfused`` (``backend="reference"``: rotate q and k, then scatter k and v
  into the pages, as XLA fuses it). ``decodelab (repeat)``: its noise level.

Every Pallas arm's attribution names the Triton kernel found in its lowered program
(``interpret`` where none is compiled); a reference arm says ``xla`` once its program is checked
to call no Triton kernel. Each of our rows records its largest difference from the XLA arm on
set 0 (``max_abs_difference_from_xla``); a difference above ``DISAGREEMENT_TOLERANCE`` is noted.

Targets (issue 6), judged in the notes: ``fused_add_rmsnorm`` at 4096 tokens at 80% or more of
the copy ceiling and at least as fast as ``xla_fused``; ``rope_append`` at least 1.5x
``jax_unfused``.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import paged
from bench import report
from bench.harness import (
    CaseResult,
    CopyCeiling,
    RunOptions,
    TimedLoop,
    checksum_of,
    expected_us,
    repeat_arm,
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
DRY_RUN_NORM_HIDDEN = (96, 128)
DRY_RUN_NORM_TOKENS = (1, 5)


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
# more compilation, not accuracy. XLA's figures are the peers' table of benchmarking.md.
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
    "every arm's outputs pass an optimization barrier (written in full) and one row of each is "
    "folded into the checksum, so no arm pays a read of all its outputs",
    "fused_add_rmsnorm: `decodelab_kernel` reads its set's rows in place (row_offset); "
    "`decodelab` (public API) gets the rows sliced out of the rotating pool, which XLA copies "
    "for a custom call and a model's layer would not: the kernel's figure is `decodelab_kernel`",
    "rope_append: one L2-resident set of q, k, v (as right after the QKV projection) for both "
    "arms; page tables and positions rotate, so the written pages rotate through the pool; the "
    "pool is carried from call to call and copied once per timed program, alike for both arms",
)


def run(options: RunOptions, ceiling: CopyCeiling) -> SuiteOutput:
    """Times every case of the grid (module docstring)."""
    notes: list[str] = list(METHOD_NOTES)
    results: list[CaseResult] = []
    if options.dry_run:
        hidden_sizes, token_counts = DRY_RUN_NORM_HIDDEN, DRY_RUN_NORM_TOKENS
    else:
        hidden_sizes = NORM_HIDDEN
        token_counts = QUICK_NORM_TOKENS if options.quick else NORM_TOKENS
    for hidden in hidden_sizes:
        for tokens in token_counts:
            inputs = make_norm_inputs(tokens, hidden, options)
            try:
                results += norm_case_results(inputs, options, ceiling.tbps, notes)
            finally:
                inputs.delete()
                gc.collect()
    shape = DRY_RUN_ROPE_SHAPE if options.dry_run else ROPE_SHAPE
    inputs = make_rope_inputs(shape, options)
    try:
        results += rope_case_results(inputs, options, ceiling.tbps, notes)
    finally:
        inputs.delete()
        gc.collect()
    return SuiteOutput(results=results, notes=notes, peers_for_ratio=PEERS_FOR_RATIO)


# ----------------------------------------------------------------------------------------------
# Shared pieces


def digest(*outputs: jax.Array) -> tuple[jax.Array, ...]:
    """The last row of each output, after a barrier that makes every output exist in full."""
    outputs = lax.optimization_barrier(outputs)
    return tuple(output[-1] for output in outputs)


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
      x_pool, residual_pool: bfloat16 ``[R x tokens, hidden]``; set ``s`` is rows
        ``[s T, (s + 1) T)``.
      weight: bfloat16 ``[hidden]``.
    """

    tokens: int
    hidden: int
    num_sets: int
    x_pool: jax.Array
    residual_pool: jax.Array
    weight: jax.Array

    @property
    def case(self) -> str:
        return f"fused_add_rmsnorm B={self.tokens} hidden={self.hidden}"

    @property
    def bytes_per_call(self) -> int:
        return norm_bytes(self.tokens, self.hidden, jnp.dtype(DTYPE).itemsize)

    def operands(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        return self.x_pool, self.residual_pool, self.weight

    def delete(self) -> None:
        for array in self.operands():
            array.delete()


def make_norm_inputs(tokens: int, hidden: int, options: RunOptions) -> NormInputs:
    """Random pools (activations of magnitude ~1, a residual stream ~4x larger, weights near 1)."""
    num_sets = options.num_sets_for(2 * tokens * hidden * jnp.dtype(DTYPE).itemsize)
    keys = jax.random.split(jax.random.key(SEED + hidden + tokens), 3)
    shape = (num_sets * tokens, hidden)
    x_pool = jax.random.normal(keys[0], shape, DTYPE)
    residual_pool = (4 * jax.random.normal(keys[1], shape, jnp.float32)).astype(DTYPE)
    weight = (1 + 0.1 * jax.random.normal(keys[2], (hidden,), jnp.float32)).astype(DTYPE)
    return NormInputs(tokens, hidden, num_sets, x_pool, residual_pool, weight)


def _window(pool: jax.Array, set_index, tokens: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(pool, set_index * tokens, tokens)


def norm_loop(inputs: NormInputs, arm: str, interpret: bool) -> TimedLoop:
    """One call of ``arm`` on set ``set_index`` (module docstring), returning its digest."""
    tokens = inputs.tokens

    def step(set_index, operands):
        x_pool, residual_pool, weight = operands
        if arm == "decodelab_kernel":
            outputs = norm_kernels.fused_add_rmsnorm(
                x_pool,
                residual_pool,
                weight,
                EPS,
                row_offset=set_index * tokens,
                num_rows=tokens,
                interpret=interpret,
            )
        else:
            backend = "reference" if arm == "xla_fused" else "pallas"
            outputs = layers.fused_add_rmsnorm(
                _window(x_pool, set_index, tokens),
                _window(residual_pool, set_index, tokens),
                weight,
                EPS,
                backend=backend,
            )
        return digest(*outputs)

    return TimedLoop(step, inputs.num_sets, inputs.operands())


def norm_outputs_of_set_zero(inputs: NormInputs, arm: str, interpret: bool):
    """Every output element of ``arm`` on set 0 (untimed), to compare arms."""

    def call(x_pool, residual_pool, weight):
        if arm == "decodelab_kernel":
            return norm_kernels.fused_add_rmsnorm(
                x_pool,
                residual_pool,
                weight,
                EPS,
                row_offset=0,
                num_rows=inputs.tokens,
                interpret=interpret,
            )
        backend = "reference" if arm == "xla_fused" else "pallas"
        x, residual = x_pool[: inputs.tokens], residual_pool[: inputs.tokens]
        return layers.fused_add_rmsnorm(x, residual, weight, EPS, backend=backend)

    return jax.jit(call)(*inputs.operands())


NORM_ARMS = (
    ("decodelab_kernel", "kernels_pallas.norm.fused_add_rmsnorm(row_offset)"),
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


class CarriedLoop(TimedLoop):
    """A ``TimedLoop`` whose step also updates a state carried from call to call (the KV pool).

    ``step(set_index, operands, state) -> (result, state)``. The program is
    ``lax.fori_loop(0, iters, body, (checksum, state))`` with the same rotation and checksum as
    ``TimedLoop``; the final state's first element joins the checksum, so no update is dead. The
    state passed in is copied into the loop's carry once per program run.
    """

    def __init__(self, step: Callable[..., Any], num_sets: int, operands: Any, state: Any):
        super().__init__(step, num_sets, (operands, state))
        self._carried_programs: dict[int, Callable[[Any], jax.Array]] = {}

    def _call_step(self, set_index, operands):
        inputs, state = operands
        result, _ = self.step(set_index, inputs, state)
        return result

    def program(self, iters: int) -> Callable[[Any], jax.Array]:
        if iters not in self._carried_programs:
            num_sets = self.num_sets

            def loop_program(operands):
                inputs, state = operands

                def body(call_index, carry):
                    checksum, state = carry
                    set_index = lax.rem(call_index, jnp.int32(num_sets))
                    result, state = self.step(set_index, inputs, state)
                    return checksum + checksum_of(result), state

                checksum, state = lax.fori_loop(0, iters, body, (jnp.float32(0), state))
                first_elements = [leaf.reshape(-1)[0] for leaf in jax.tree.leaves(state)]
                return checksum + checksum_of(first_elements)

            self._carried_programs[iters] = jax.jit(loop_program)
        return self._carried_programs[iters]


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
      q, k, v: one set of new tokens, ``[B, Hq, D]`` and ``[B, Hkv, D]`` bfloat16.
      positions: int32 ``[R, B]``, request b's new token's position in set r.
      page_indptr, page_indices, last_page_len: ``[R, ...]``, set r's page table.
      cache: the HND pool (the loop's carried state).
    """

    shape: RopeShape
    num_sets: int
    q: jax.Array
    k: jax.Array
    v: jax.Array
    positions: jax.Array
    page_indptr: jax.Array
    page_indices: jax.Array
    last_page_len: jax.Array
    cache: paged.KVCache

    @property
    def case(self) -> str:
        return f"rope_append B={self.shape.batch}"

    @property
    def bytes_per_call(self) -> int:
        return rope_append_bytes(self.shape, jnp.dtype(DTYPE).itemsize)

    def operands(self):
        return (
            self.q,
            self.k,
            self.v,
            self.positions,
            self.page_indptr,
            self.page_indices,
            self.last_page_len,
        )

    def delete(self) -> None:
        for array in (*self.operands(), self.cache.k_pages, self.cache.v_pages):
            array.delete()


def make_rope_inputs(shape: RopeShape, options: RunOptions) -> RopeInputs:
    """Page tables whose new tokens' pages are distinct across every set and request; the
    earlier pages of a request (never touched by an append) are drawn from the whole pool."""
    batch, page_size = shape.batch, shape.page_size
    num_sets = options.num_sets_for(rope_append_bytes(shape, jnp.dtype(DTYPE).itemsize))
    num_pages = num_sets * batch
    rng = np.random.default_rng(SEED)
    positions = rng.integers(0, shape.max_position, size=(num_sets, batch))
    pages_per_request = positions // page_size + 1  # the new token's page is the last one
    last_pages = rng.permutation(num_pages).reshape(num_sets, batch)
    num_indices = int(pages_per_request.sum(axis=1).max())
    page_indptr = np.zeros((num_sets, batch + 1), np.int32)
    page_indptr[:, 1:] = np.cumsum(pages_per_request, axis=1)
    page_indices = rng.integers(0, num_pages, size=(num_sets, num_indices)).astype(np.int32)
    for s in range(num_sets):
        page_indices[s, page_indptr[s, 1:] - 1] = last_pages[s]
        page_indices[s, page_indptr[s, -1] :] = 0  # padding past the table holds 0
    last_page_len = (positions % page_size + 1).astype(np.int32)
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
    return RopeInputs(
        shape,
        num_sets,
        q,
        k,
        v,
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(page_indptr),
        jnp.asarray(page_indices),
        jnp.asarray(last_page_len),
        cache,
    )


def _rope_call(inputs: RopeInputs, backend: str, set_index, operands, cache):
    q, k, v, positions, page_indptr, page_indices, last_page_len = operands
    table = paged.PageTable(
        page_indptr[set_index],
        page_indices[set_index],
        last_page_len[set_index],
        inputs.shape.page_size,
    )
    batch_indices = jnp.arange(inputs.shape.batch, dtype=jnp.int32)
    return paged.rope_append_kv(
        q, k, v, positions[set_index], batch_indices, cache, table, rope=ROPE, backend=backend
    )


def rope_loop(inputs: RopeInputs, backend: str) -> CarriedLoop:
    """One call = ``paged.rope_append_kv(backend=backend)`` on set ``set_index``, the pool
    carried."""

    def step(set_index, operands, cache):
        q_rotated, cache = _rope_call(inputs, backend, set_index, operands, cache)
        return digest(q_rotated), cache

    return CarriedLoop(step, inputs.num_sets, inputs.operands(), inputs.cache)


def rope_outputs_of_set_zero(inputs: RopeInputs, backend: str):
    """q_rotated and the pool after one call on set 0 (untimed), to compare arms."""
    call = jax.jit(lambda operands, cache: _rope_call(inputs, backend, 0, operands, cache))
    q_rotated, cache = call(inputs.operands(), inputs.cache)
    return q_rotated, cache.k_pages, cache.v_pages


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
