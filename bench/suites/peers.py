"""The ``peers`` suite: what people use today, measured the ``docs/benchmarking.md`` way.

These figures are the yardstick decodelab's kernels are compared with, so they are measured
with the same method in the same run: cold L2 (rotating page tables over one large pool,
rotating logits), dispatch amortized (one jitted loop, or one CUDA graph for PyTorch), median of
repeats, against the copy ceiling measured first.

Paged decode attention (GQA, one query token per request, ``sm_scale = 1/sqrt(D)``, bfloat16
output), on the standard grid; bytes = K and V of the real tokens:

- ``xla_gather``: plain ``jnp``: gather the pages, einsum with float32 accumulation, mask by
  length, softmax, einsum. Also the reference the other arms are checked against.
- ``jax_pallas_paged_attention``: JAX's Pallas ``paged_attention`` (Triton lowering) over the
  head-major pool, at the best ``k_splits`` of a sweep (every figure of the sweep goes to the
  JSON field ``k_splits_sweep``). Its API has no ``sm_scale``, so queries are pre-scaled.
- ``torch_gather_sdpa``: PyTorch ``index_select`` of the pages into dense K and V, then
  ``scaled_dot_product_attention``, in a CUDA graph (only with torch and CUDA).

Sampling at vocab 128256, float32 logits, batch 1, 32 and 256; bytes = ``B x V x 4``:

- ``top_p B=<n>``: ``jax_sort`` (softmax, sort, cumsum, mask at p = 0.9, categorical) and
  ``torch_sort`` (the same in PyTorch, sampling by exponential-noise argmax).
- ``gumbel B=<n>``: ``jax_categorical`` (``jax.random.categorical``) and ``torch_exponential``
  (softmax, then ``argmax(probs / Exp(1) noise)``).
- ``read_only`` in both: summing the set, about the byte floor of reading the logits once.
  Every rotating set is an array of its own, visited by a static index
  (``timing.SetsInTurnLoop``): a set sliced out of a stacked ``[R, B, V]`` array by a traced
  index was copied before each Pallas call (60 us at batch 256, ``bench/probes/slice.py``).

Every arm records an attribution only it produces, and each case ends with its reference arm
timed again (``"<arm> (repeat)"``) so the report shows the noise level.
"""

from __future__ import annotations

import functools
import gc
import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bench.harness import (
    CaseResult,
    CopyCeiling,
    RunOptions,
    SetsInTurnLoop,
    TimedLoop,
    Timing,
    expected_us,
    release_torch_memory,
    repeat_arm,
    report,
    torch_from_jax,
)
from bench.harness.attention_inputs import (
    ATTENTION_GRID,
    DRY_RUN_GRID,
    DRY_RUN_SHAPE,
    QUICK_GRID,
    STANDARD_SHAPE,
    AttentionSetup,
    case_name,
    kv_bytes_per_set,
    make_attention_setup,
)
from bench.suites import SuiteOutput

PEER_ATTENTION_ARMS = ("xla_gather", "jax_pallas_paged_attention", "torch_gather_sdpa")
PEER_ATTENTION_LAYOUT = "head_major"
# Sweep k_splits over powers of two up to this; beyond it every program handles a few pages.
MAX_K_SPLITS = 128
# JAX's default pages_per_compute_block: a partition smaller than one compute block wastes it.
MIN_PAGES_PER_PARTITION = 8
DRY_RUN_K_SPLITS = (1, 2)
# Arms whose output differs from xla_gather's by more than this get a note (bfloat16 outputs
# of magnitude below 1 round by about 0.004; pre-scaled bfloat16 queries add a little).
DISAGREEMENT_TOLERANCE = 0.05

# Priors for sizing the first timed program (harness.expected_us), from docs/peers.md's
# figures for these peers on an H200; a prior 4x off costs one more compilation, not accuracy.
EXPECTED_XLA_GATHER_TBPS = 0.7
EXPECTED_PALLAS_TBPS = 1.0
EXPECTED_SORT_TBPS, EXPECTED_SORT_FLOOR_US = 0.05, 100.0
EXPECTED_CATEGORICAL_TBPS, EXPECTED_CATEGORICAL_FLOOR_US = 0.8, 20.0
EXPECTED_READ_TBPS, EXPECTED_READ_FLOOR_US = 3.0, 5.0

VOCAB = 128256
SAMPLING_BATCHES = (1, 32, 256)
QUICK_SAMPLING_BATCHES = (32,)
DRY_RUN_VOCAB = 1000
DRY_RUN_SAMPLING_BATCHES = (1, 4)
TOP_P = 0.9
# Logits of standard deviation 3 give a softmax with a few dominant tokens and a long tail,
# like a language model's; top-p at 0.9 then keeps a nontrivial set.
LOGITS_SCALE = 3.0


def run(options: RunOptions, ceiling: CopyCeiling) -> SuiteOutput:
    """Measures every peer arm on the grid of ``options`` (see the module docstring)."""
    notes: list[str] = []
    results: list[CaseResult] = []
    shape = DRY_RUN_SHAPE if options.dry_run else STANDARD_SHAPE
    grid = DRY_RUN_GRID if options.dry_run else QUICK_GRID if options.quick else ATTENTION_GRID
    for batch, context in grid:
        num_sets = options.num_sets_for(kv_bytes_per_set(batch, context, **shape))
        report.print_progress(
            f"{case_name(batch, context)}: setting up {num_sets} rotating sets, timing the peers"
        )
        setup = make_attention_setup(
            batch, context, **shape, layouts=(PEER_ATTENTION_LAYOUT,), num_sets=num_sets
        )
        try:
            results += peer_attention_results(setup, options, ceiling.tbps, notes=notes)
        finally:
            gc.collect()  # drops PyTorch views of the pool before its memory is freed
            setup.delete()

    vocab = DRY_RUN_VOCAB if options.dry_run else VOCAB
    if options.dry_run:
        batches = DRY_RUN_SAMPLING_BATCHES
    else:
        batches = QUICK_SAMPLING_BATCHES if options.quick else SAMPLING_BATCHES
    for batch in batches:
        report.print_progress(f"sampling B={batch} vocab={vocab}: timing the peers")
        results += sampling_results(batch, vocab, options, ceiling.tbps, notes=notes)
    if options.torch_device is None:
        needed = "torch" if options.dry_run else "torch with CUDA"
        notes.append(f"PyTorch arms skipped: {needed} is not importable here")
    else:
        import torch

        notes.append(f"PyTorch arms: torch {torch.__version__} on {options.torch_device}")
    return SuiteOutput(results=results, notes=notes)


def error_summary(error: Exception) -> str:
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line[:300]}"


# ----------------------------------------------------------------------------------------------
# Paged decode attention


def gathered_kv(
    k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Every request's keys and values in order, by one gather of its pages:
    ``[KVH, num_pages, page_size, D]`` pools and ``[B, pages_per_sequence]`` tables give
    ``[KVH, B, pages_per_sequence * page_size, D]`` each."""
    num_kv_heads, batch, head_dim = k_pages.shape[0], block_tables.shape[0], k_pages.shape[-1]
    keys = k_pages[:, block_tables].reshape(num_kv_heads, batch, -1, head_dim)
    values = v_pages[:, block_tables].reshape(num_kv_heads, batch, -1, head_dim)
    return keys, values


def xla_gather_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    sm_scale: float,
    output_dtype=None,
) -> jax.Array:
    """GQA decode attention written the obvious way in ``jnp`` (the ``xla_gather`` peer).

    Args:
      q: ``[B, H, D]``.
      k_pages, v_pages: head-major pools ``[KVH, num_pages, page_size, D]``.
      block_tables: int32 ``[B, pages_per_sequence]``.
      seq_lens: int32 ``[B]``; keys past a request's length are masked.
      sm_scale: the logit scale.
      output_dtype: default q's dtype; float32 for a reference.

    Returns:
      ``[B, H, D]``; query head h attends with KV head ``h // (H // KVH)``.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    keys, values = gathered_kv(k_pages, v_pages, block_tables)
    grouped_q = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    logits = jnp.einsum("bkgd,kbtd->bkgt", grouped_q, keys, preferred_element_type=jnp.float32)
    logits = logits * sm_scale
    token_positions = jnp.arange(keys.shape[2], dtype=jnp.int32)
    in_sequence = token_positions[None, :] < seq_lens[:, None]  # [B, tokens]
    logits = jnp.where(in_sequence[:, None, None, :], logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1)
    output = jnp.einsum(
        "bkgt,kbtd->bkgd",
        weights.astype(values.dtype),
        values,
        preferred_element_type=jnp.float32,
    )
    return output.reshape(batch, num_heads, head_dim).astype(output_dtype or q.dtype)


def reference_output(setup: AttentionSetup, set_index: int = 0) -> np.ndarray:
    """float32 ``[B, H, D]`` attention output of one set (``xla_gather_attention`` in float32),
    to check that an arm computes the same function.

    Raises:
      KeyError: if ``setup`` lacks the ``"head_major"`` layout.
    """
    k_pages, v_pages = setup.pool(PEER_ATTENTION_LAYOUT)
    output = jax.jit(xla_gather_attention, static_argnames=("sm_scale", "output_dtype"))(
        setup.queries[set_index],
        k_pages,
        v_pages,
        setup.block_tables[set_index],
        setup.seq_lens,
        sm_scale=setup.sm_scale,
        output_dtype=jnp.float32,
    )
    return np.asarray(output)


def max_abs_difference(output: Any, reference: np.ndarray) -> float:
    """Largest absolute difference between an arm's output and the reference, in float32."""
    return float(np.max(np.abs(np.asarray(output, dtype=np.float32) - reference)))


def _check_agreement(case: str, arm: str, difference: float, notes: list[str] | None) -> None:
    if notes is not None and not difference <= DISAGREEMENT_TOLERANCE:
        notes.append(
            f"{case}: `{arm}` differs from `xla_gather` by {difference:.3g} "
            f"(> {DISAGREEMENT_TOLERANCE}); its figure may not be of the same function"
        )


def peer_attention_results(
    setup: AttentionSetup,
    options: RunOptions,
    ceiling_tbps: float,
    *,
    notes: list[str] | None = None,
    arms: tuple[str, ...] = PEER_ATTENTION_ARMS,
    repeat_reference_arm: bool = True,
) -> list[CaseResult]:
    """Times the peer attention arms on one setup; reusable by any suite in the same run.

    Args:
      setup: from ``make_attention_setup``; must include the ``"head_major"`` layout.
      options: the run's options.
      ceiling_tbps: the copy ceiling of this run.
      notes: a list that failures and disagreements are appended to, or None.
      arms: which of ``PEER_ATTENTION_ARMS`` to run (``torch_gather_sdpa`` runs only where
        torch is available).
      repeat_reference_arm: time ``xla_gather`` (when it is one of ``arms``) again at the end,
        as the noise level.

    Returns:
      One ``CaseResult`` an arm that ran, named ``setup.case``; printed once all are in.
    """
    unknown = set(arms) - set(PEER_ATTENTION_ARMS)
    if unknown:
        raise ValueError(f"unknown peer arms {sorted(unknown)}; known: {PEER_ATTENTION_ARMS}")
    results: list[CaseResult] = []
    reference = reference_output(setup)
    xla_loop = xla_gather_loop(setup)
    xla_expected_us = expected_us(setup.kv_bytes_per_set, EXPECTED_XLA_GATHER_TBPS)
    if "xla_gather" in arms:
        xla_timing = options.time(xla_loop, expected_us_per_call=xla_expected_us)
        results.append(_xla_gather_result(setup, xla_timing, ceiling_tbps, arm="xla_gather"))
    if "jax_pallas_paged_attention" in arms:
        result = _jax_pallas_result(setup, options, ceiling_tbps, reference, notes)
        if result is not None:
            results.append(result)
    if "torch_gather_sdpa" in arms and options.torch_device is not None:
        try:
            results.append(_torch_attention_result(setup, options, ceiling_tbps, reference, notes))
        except Exception as error:  # a missing PyTorch feature must not lose the other arms
            if notes is not None:
                notes.append(f"{setup.case}: `torch_gather_sdpa` failed: {error_summary(error)}")
        release_torch_memory(options.torch_device)
    if repeat_reference_arm and "xla_gather" in arms:
        # The same compiled program as the first timing: only the moment differs.
        timing = options.time(
            xla_loop, expected_us_per_call=xla_expected_us, iters=xla_timing.calls_per_sample
        )
        results.append(
            _xla_gather_result(setup, timing, ceiling_tbps, arm=repeat_arm("xla_gather"))
        )
    report.print_results(results)
    return results


def attention_operands(setup: AttentionSetup, queries: jax.Array) -> tuple[jax.Array, ...]:
    """``(queries, k_pages, v_pages, block_tables, seq_lens)`` of the peers' layout: what an XLA
    gather arm's loop takes (also the decode suite's multi-token XLA arm)."""
    k_pages, v_pages = setup.pool(PEER_ATTENTION_LAYOUT)
    return (queries, k_pages, v_pages, setup.block_tables, setup.seq_lens)


def xla_gather_loop(
    setup: AttentionSetup, queries: jax.Array | None = None, attention=None
) -> TimedLoop:
    """One call = ``attention`` (default ``xla_gather_attention``) of set ``set_index``'s
    queries over the peers' pool; the decode suite passes its causal multi-token variant and
    ``[R, B, L, H, D]`` queries."""
    sm_scale = setup.sm_scale
    attention = attention or xla_gather_attention

    def step(set_index, operands):
        queries, k_pages, v_pages, block_tables, seq_lens = operands
        return attention(
            queries[set_index],
            k_pages,
            v_pages,
            block_tables[set_index],
            seq_lens,
            sm_scale=sm_scale,
        )

    queries = setup.queries if queries is None else queries
    return TimedLoop(step, setup.num_sets, attention_operands(setup, queries))


def _xla_gather_result(
    setup: AttentionSetup, timing: Timing, ceiling_tbps: float, *, arm: str
) -> CaseResult:
    return CaseResult.from_timing(
        setup.case,
        arm,
        "xla:gather+einsum+softmax",
        timing,
        setup.kv_bytes_per_set,
        ceiling_tbps,
    )


def k_splits_candidates(pages_per_sequence: int, *, dry_run: bool) -> list[int]:
    """The ``k_splits`` of JAX's ``paged_attention`` worth timing for one context.

    Powers of two that divide ``pages_per_sequence`` (the kernel requires it) and leave each
    partition at least ``MIN_PAGES_PER_PARTITION`` pages (smaller partitions waste the compute
    block), up to ``MAX_K_SPLITS``; in a dry run only 1 and 2, whatever divides.

    Example:
      >>> k_splits_candidates(256, dry_run=False)  # 4096 tokens of 16
      [1, 2, 4, 8, 16, 32]
      >>> k_splits_candidates(3, dry_run=True)
      [1]
    """
    if dry_run:
        return [k for k in DRY_RUN_K_SPLITS if pages_per_sequence % k == 0]
    smallest_partition = min(MIN_PAGES_PER_PARTITION, pages_per_sequence)
    candidates = []
    k_splits = 1
    while k_splits <= MAX_K_SPLITS:
        if (
            pages_per_sequence % k_splits == 0
            and pages_per_sequence // k_splits >= smallest_partition
        ):
            candidates.append(k_splits)
        k_splits *= 2
    return candidates


def pages_per_compute_block(pages_per_partition: int) -> int:
    """JAX's default 8 pages a compute block, or the largest power of two below it that
    divides the partition (the kernel requires it to divide)."""
    for pages in (8, 4, 2):
        if pages_per_partition % pages == 0:
            return pages
    return 1


def _jax_paged_attention_module():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention
    return paged_attention


def _jax_pallas_loop(setup, scaled_queries, k_splits, options) -> tuple[TimedLoop, int]:
    paged_attention = _jax_paged_attention_module().paged_attention
    compute_block = pages_per_compute_block(setup.pages_per_sequence // k_splits)

    def step(set_index, operands):
        queries, k_pages, v_pages, block_tables, seq_lens = operands
        return paged_attention(
            queries[set_index],
            k_pages,
            v_pages,
            block_tables[set_index],
            seq_lens,
            k_splits=k_splits,
            pages_per_compute_block=compute_block,
            interpret=options.interpret,
        )

    operands = attention_operands(setup, scaled_queries)
    return TimedLoop(step, setup.num_sets, operands), compute_block


def triton_kernel_names(lowered_text: str, prefix: str = "paged_attention") -> list[str]:
    """Names of the Triton kernels starting with ``prefix`` that a lowered program calls.

    A Pallas kernel lowered for a GPU is a ``__gpu$xla.gpu.triton`` custom call whose backend
    config carries ``name = "<the pallas_call's name>"``, with ``=`` sanitized to ``_``.
    """
    if "__gpu$xla.gpu.triton" not in lowered_text:
        return []
    return sorted(set(re.findall(rf'name = "({re.escape(prefix)}[\w.-]*)"', lowered_text)))


def _pallas_attribution(loop: TimedLoop, options: RunOptions, k_splits: int) -> tuple[str, bool]:
    """``(attribution, found)``: on a GPU, the name of the Triton kernel the program calls
    (``found`` False if there is none); in interpret mode no kernel is compiled."""
    if options.interpret:
        return f"jax_pallas(interpret):k_splits={k_splits}", True
    names = triton_kernel_names(loop.lowered_text())
    if names:
        return f"jax_pallas:{names[0]}:k_splits={k_splits}", True
    return f"jax_pallas:k_splits={k_splits}", False


def _jax_pallas_result(
    setup: AttentionSetup,
    options: RunOptions,
    ceiling_tbps: float,
    reference: np.ndarray,
    notes: list[str] | None,
) -> CaseResult | None:
    """Sweeps ``k_splits``, keeps the fastest as the arm; None if no ``k_splits`` compiled."""
    # The API has no sm_scale: scale the queries once, outside the timed loop.
    scaled_queries = (setup.queries * setup.sm_scale).astype(setup.queries.dtype)
    sweep: list[dict[str, Any]] = []
    best = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for k_splits in k_splits_candidates(setup.pages_per_sequence, dry_run=options.dry_run):
            # The fastest k_splits so far is the best prior for the next one.
            prior_us = (
                best[1].median_us
                if best
                else expected_us(setup.kv_bytes_per_set, EXPECTED_PALLAS_TBPS)
            )
            try:
                loop, compute_block = _jax_pallas_loop(setup, scaled_queries, k_splits, options)
                timing = options.time(loop, sweep=True, expected_us_per_call=prior_us)
            except Exception as error:  # a k_splits that fails to compile is recorded
                sweep.append({"k_splits": k_splits, "error": error_summary(error)})
                continue
            sweep.append(
                {
                    "k_splits": k_splits,
                    "pages_per_compute_block": compute_block,
                    "median_us": timing.median_us,
                    "min_us": timing.min_us,
                    "max_us": timing.max_us,
                }
            )
            if best is None or timing.median_us < best[1].median_us:
                best = (k_splits, timing, loop, compute_block)
        if best is None:
            if notes is not None:
                errors = "; ".join(entry["error"] for entry in sweep)
                notes.append(f"{setup.case}: `jax_pallas_paged_attention` failed: {errors}")
            scaled_queries.delete()
            return None
        k_splits, timing, loop, compute_block = best
        attribution, found = _pallas_attribution(loop, options, k_splits)
        output = loop.output(set_index=0)
    if not found and notes is not None:
        notes.append(f"{setup.case}: no Triton `paged_attention` kernel found in the program")
    difference = max_abs_difference(output, reference)
    _check_agreement(setup.case, "jax_pallas_paged_attention", difference, notes)
    result = CaseResult.from_timing(
        setup.case,
        "jax_pallas_paged_attention",
        attribution,
        timing,
        setup.kv_bytes_per_set,
        ceiling_tbps,
        k_splits=k_splits,
        pages_per_compute_block=compute_block,
        max_abs_difference_from_xla_gather=difference,
        k_splits_sweep=sweep,
    )
    scaled_queries.delete()
    return result


def _sdpa_accepts_enable_gqa(torch, device: str) -> bool:
    """Whether this PyTorch's ``scaled_dot_product_attention`` takes ``enable_gqa`` (2.5+)."""
    query = torch.randn(1, 4, 1, 8, device=device)
    key = torch.randn(1, 2, 3, 8, device=device)
    try:
        torch.nn.functional.scaled_dot_product_attention(query, key, key, enable_gqa=True)
    except (TypeError, RuntimeError):
        return False
    return True


def _torch_attention_result(
    setup: AttentionSetup,
    options: RunOptions,
    ceiling_tbps: float,
    reference: np.ndarray,
    notes: list[str] | None,
) -> CaseResult:
    import torch

    device = options.torch_device
    k_pages, v_pages = (torch_from_jax(pages) for pages in setup.pool(PEER_ATTENTION_LAYOUT))
    queries = torch_from_jax(setup.queries)  # [num_sets, B, H, D]
    block_tables = torch_from_jax(setup.block_tables).long()  # [num_sets, B, pages_per_seq]
    num_kv_heads, head_dim = setup.num_kv_heads, setup.head_dim
    group = setup.num_q_heads // num_kv_heads
    batch, context, sm_scale = setup.batch, setup.context, setup.sm_scale
    enable_gqa = _sdpa_accepts_enable_gqa(torch, device)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def gather(pages, set_index):
        # [KVH, B * pages_per_seq, page_size, D] -> [B, KVH, context, D]
        gathered = pages.index_select(1, block_tables[set_index].reshape(-1))
        dense = gathered.view(num_kv_heads, batch, -1, head_dim)[:, :, :context]
        dense = dense.transpose(0, 1)
        return dense if enable_gqa else dense.repeat_interleave(group, dim=1)

    def call(set_index: int):
        query = queries[set_index].unsqueeze(2)  # [B, H, 1, D]
        keys, values = gather(k_pages, set_index), gather(v_pages, set_index)
        # Every request of a case has `context` tokens, so the dense K and V need no mask.
        extra = {"enable_gqa": True} if enable_gqa else {}
        return sdpa(query, keys, values, scale=sm_scale, **extra).squeeze(2)  # [B, H, D]

    difference = max_abs_difference(call(0).float().cpu().numpy(), reference)
    _check_agreement(setup.case, "torch_gather_sdpa", difference, notes)
    timing = options.time_torch(call, setup.num_sets, device)
    gqa_form = "enable_gqa" if enable_gqa else "repeat_interleave"
    return CaseResult.from_timing(
        setup.case,
        "torch_gather_sdpa",
        f"torch:index_select+sdpa({gqa_form})+{timing.method}",
        timing,
        setup.kv_bytes_per_set,
        ceiling_tbps,
        max_abs_difference_from_xla_gather=difference,
        torch_version=torch.__version__,
    )


# ----------------------------------------------------------------------------------------------
# Sampling


def jax_top_p_sample(logits: jax.Array, key: jax.Array, top_p: float) -> jax.Array:
    """Sort-based top-p sampling, the standard way in JAX (the ``jax_sort`` peer).

    Softmax, sort descending, keep the smallest prefix whose mass reaches ``top_p`` (a token is
    kept when the mass before it is below ``top_p``, so the top token always is), then draw
    from the kept tokens with ``jax.random.categorical`` (which needs no renormalization).

    Args:
      logits: float32 ``[B, V]``.
      key: a PRNG key.
      top_p: in ``(0, 1]``.

    Returns:
      int32 ``[B]`` token ids.

    Example:
      >>> logits = jnp.log(jnp.array([[0.6, 0.3, 0.1]]))
      >>> int(jax_top_p_sample(logits, jax.random.key(0), 0.5)[0])  # only token 0 is kept
      0
    """
    probs = jax.nn.softmax(logits, axis=-1)
    vocab_ids = lax.broadcasted_iota(jnp.int32, probs.shape, 1)
    negated_sorted, sorted_ids = lax.sort((-probs, vocab_ids), dimension=1, num_keys=1)
    sorted_probs = -negated_sorted
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    kept_logits = jnp.where(mass_before < top_p, jnp.log(sorted_probs), -jnp.inf)
    choice = jax.random.categorical(key, kept_logits, axis=-1)
    return jnp.take_along_axis(sorted_ids, choice[:, None], axis=-1)[:, 0]


@functools.partial(jax.jit, static_argnames="shape")
def random_logits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Random logits of scale ``LOGITS_SCALE`` (also the sampling suite's, so both sample the
    same rows)."""
    return LOGITS_SCALE * jax.random.normal(key, shape, jnp.float32)


def random_sets(batch: int, vocab: int, num_sets: int) -> list[jax.Array]:
    """``num_sets`` float32 ``[batch, vocab]`` logits arrays, each its own buffer (so a timed
    call reads a set without a slice copy, ``timing.SetsInTurnLoop``); the same values for a
    batch in every suite (seeded by the batch)."""
    stacked = random_logits(jax.random.key(batch), (num_sets, batch, vocab))
    sets = [jnp.array(stacked[index], copy=True) for index in range(num_sets)]
    stacked.delete()
    return sets


def sampling_results(
    batch: int,
    vocab: int,
    options: RunOptions,
    ceiling_tbps: float,
    *,
    notes: list[str] | None = None,
) -> list[CaseResult]:
    """Times the sampling peers at one batch: cases ``top_p B=<n>`` and ``gumbel B=<n>``.

    Args:
      batch, vocab: the logits are float32 ``[batch, vocab]``.
      options: the run's options.
      ceiling_tbps: the copy ceiling of this run.
      notes: a list that failures are appended to, or None.

    Returns:
      The rows of both cases, printed once all are in.
    """
    num_bytes = batch * vocab * 4
    num_sets = options.unrolled_sets_for(num_bytes)
    logits_sets = random_sets(batch, vocab, num_sets)  # R arrays [B, V]
    key = jax.random.key(1)
    top_p_case, gumbel_case = f"top_p B={batch}", f"gumbel B={batch}"
    results: list[CaseResult] = []

    # Each timed call folds the program's round into its key, so no call is loop-invariant.
    def top_p_call(logits, round_index):
        return jax_top_p_sample(logits, jax.random.fold_in(key, round_index), TOP_P)

    def categorical_call(logits, round_index):
        return jax.random.categorical(jax.random.fold_in(key, round_index), logits, axis=-1)

    def read_only_call(logits, round_index):
        # The loop's checksum sums it: one read of the set. The barrier ties the set to the
        # round; without it the sum of a fixed set is loop-invariant and XLA hoists it out of
        # the timed loop (seen on the CPU), timing nothing.
        logits, _ = lax.optimization_barrier((logits, round_index))
        return logits

    def row(case, arm, attribution, timing, **extra):
        result = CaseResult.from_timing(
            case, arm, attribution, timing, num_bytes, ceiling_tbps, vocab=vocab, **extra
        )
        results.append(result)

    def prior(tbps, floor_us):
        return expected_us(num_bytes, tbps, floor_us)

    top_p_attribution = f"xla:softmax+sort+cumsum+categorical(top_p={TOP_P})"
    top_p_loop = SetsInTurnLoop(top_p_call, logits_sets)
    timing = options.time(
        top_p_loop, expected_us_per_call=prior(EXPECTED_SORT_TBPS, EXPECTED_SORT_FLOOR_US)
    )
    row(top_p_case, "jax_sort", top_p_attribution, timing, top_p=TOP_P)
    categorical_loop = SetsInTurnLoop(categorical_call, logits_sets)
    categorical_timing = options.time(
        categorical_loop,
        expected_us_per_call=prior(EXPECTED_CATEGORICAL_TBPS, EXPECTED_CATEGORICAL_FLOOR_US),
    )
    row(gumbel_case, "jax_categorical", "xla:jax.random.categorical", categorical_timing)
    read_loop = SetsInTurnLoop(read_only_call, logits_sets)
    read_timing = options.time(
        read_loop, expected_us_per_call=prior(EXPECTED_READ_TBPS, EXPECTED_READ_FLOOR_US)
    )
    row(top_p_case, "read_only", "xla:sum", read_timing)
    row(gumbel_case, "read_only", "xla:sum", read_timing)

    if options.torch_device is not None:
        try:
            _torch_sampling_rows(logits_sets, num_sets, options, row, top_p_case, gumbel_case)
        except Exception as error:  # a missing PyTorch feature must not lose the other arms
            if notes is not None:
                notes.append(f"sampling B={batch}: PyTorch arms failed: {error_summary(error)}")
        release_torch_memory(options.torch_device)

    timing = options.time(
        categorical_loop,
        expected_us_per_call=categorical_timing.median_us,
        iters=categorical_timing.calls_per_sample,
    )
    row(gumbel_case, repeat_arm("jax_categorical"), "xla:jax.random.categorical", timing)
    for logits in logits_sets:
        logits.delete()
    report.print_results(results)
    return results


def _torch_sampling_rows(logits_sets, num_sets, options, row, top_p_case, gumbel_case) -> None:
    import torch

    device = options.torch_device
    torch_logits = [torch_from_jax(logits) for logits in logits_sets]  # views of the JAX arrays

    def top_p_call(set_index: int):
        probs = torch.softmax(torch_logits[set_index], dim=-1)
        sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        kept = sorted_probs.masked_fill(mass_before >= TOP_P, 0.0)
        # argmax(p / E) with E ~ Exp(1) draws from p normalized (no renormalization needed),
        # without torch.multinomial's host synchronization, which a CUDA graph cannot hold.
        choice = torch.argmax(kept / torch.empty_like(kept).exponential_(), dim=-1, keepdim=True)
        return torch.gather(sorted_ids, -1, choice).squeeze(-1)

    def exponential_call(set_index: int):
        probs = torch.softmax(torch_logits[set_index], dim=-1)
        return torch.argmax(probs / torch.empty_like(probs).exponential_(), dim=-1)

    version = {"torch_version": torch.__version__}
    timing = options.time_torch(top_p_call, num_sets, device)
    attribution = f"torch:softmax+sort+cumsum+exponential_argmax(top_p={TOP_P})+{timing.method}"
    row(top_p_case, "torch_sort", attribution, timing, top_p=TOP_P, **version)
    timing = options.time_torch(exponential_call, num_sets, device)
    attribution = f"torch:softmax+exponential_argmax+{timing.method}"
    row(gumbel_case, "torch_exponential", attribution, timing, **version)
