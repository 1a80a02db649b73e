"""Public decode attention over the paged KV cache, with backend selection."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import paged_decode_mgpu as mgpu
from kernels_pallas import paged_decode_tuning as tuning
from kernels_pallas.merge_states import merge_partial_states
from kernels_pallas.paged_decode import paged_decode, token_major
from kernels_pallas.paged_prefill import launch_parameters as prefill_launch_parameters
from kernels_pallas.paged_prefill import paged_prefill
from kernels_pallas.platform import choose_backend, interpret_mode, is_concrete
from paged.attention_reference import decode_attention_reference
from paged.kv_cache import KVCache, validate_kv_cache
from paged.page_table import PageTable, validate_page_table
from paged.plan import DecodePlan, plan_decode, traced_default_plan, validate_plan


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# The longest run of new tokens per request the one-pass decode kernel takes (its query tile holds
# all q_len x group rows of a KV head, and one read of the keys serves them all: decode and
# speculative verification). Longer runs (prompt chunks) go to the prefill kernel
# (``kernels_pallas/paged_prefill.py``), which tiles the queries into blocks.
MAX_KERNEL_Q_LEN = 16
# The smallest head_dim the kernels take: the inner dimension of a Triton dot is at least 16.
MIN_KERNEL_HEAD_DIM = 16
# backend="pallas_mgpu": the Mosaic GPU decode kernel (kernels_pallas/paged_decode_mgpu.py) by
# name; "auto" runs it on a GPU for the shapes it takes (AUTO_PICKS_MOSAIC_GPU_DECODE below).
MOSAIC_GPU_BACKEND = "pallas_mgpu"
# Its pipeline where this path calls it: the launch sweep's fastest arm on all ten cases of the
# standard grid (docs/benchmark_results/archive/2026-12-02-mgpu-decode-sweep.md: the ring, four
# pages a step, two slots; 1.005x to 1.31x the Triton kernel, 138.4 us at B=32 x 4096).
MGPU_LAUNCH_PARAMETERS = dict(pipeline="ring", pages_per_step=4, num_stages=2)
# What "auto" runs on a GPU for decode shapes the Mosaic GPU kernel takes (mgpu_kernel_supports):
# True since that sweep found its launch as fast as the Triton kernel or faster on every case of
# the standard grid; False keeps the Triton kernel (the fallback for every other shape).
AUTO_PICKS_MOSAIC_GPU_DECODE = True
# How a split plan's partial states are merged on this path: "separate" (merge_partial_states,
# a second launch) or "folded" (in the decode launch: the last item of a request to finish
# merges, paged_decode_mgpu's merge="folded"). "separate": bench/probes/mgpu_decode.py's merge
# arms (run_on_gpu.sh mgpu-merge-fold) measured the folded merge at 0.92x to 1.00x the separate
# one at B=1 and 4 x 4K and 32K on an H100 on 2026-12-07 (with branch fold-uniform's kernel;
# docs/benchmark_results/archive/2026-12-07-mgpu-merge-fold-probe-h100.json).
MGPU_MERGE = "separate"


def kernel_name_for(q: jax.Array) -> str:
    """Which Pallas kernel ``decode_attention`` runs for ``q``: ``"paged_decode"`` for up to
    ``MAX_KERNEL_Q_LEN`` new tokens a request, ``"paged_prefill"`` beyond."""
    q_len = q.shape[1] if q.ndim == 4 else 1
    return "paged_decode" if q_len <= MAX_KERNEL_Q_LEN else "paged_prefill"


def kernel_supports(q: jax.Array, cache: KVCache) -> str | None:
    """Why the Pallas kernels cannot run these shapes, or None if they can.

    Triton tiles must have power-of-two sides: ``head_dim`` and ``page_size`` (the group size is
    padded in registers, so any group works), and ``head_dim`` is the inner dimension of the
    ``q . k`` dot, at least 16 for a tensor-core tile; float64 (x64 mode) stays on the
    reference, the kernels compute in 32 bits. Any ``q_len`` runs: up to
    ``MAX_KERNEL_Q_LEN`` on the decode kernel, beyond on the prefill kernel (``kernel_name_for``).
    """
    if jnp.dtype(q.dtype).itemsize > 4:
        return f"dtype {q.dtype}: the kernels compute in 32 bits"
    if not _is_power_of_two(q.shape[-1]):
        return f"head_dim={q.shape[-1]} is not a power of two"
    if q.shape[-1] < MIN_KERNEL_HEAD_DIM:
        return f"head_dim={q.shape[-1]} is below the kernels' minimum of {MIN_KERNEL_HEAD_DIM}"
    if not _is_power_of_two(cache.page_size):
        return f"page_size={cache.page_size} is not a power of two"
    return None


def mgpu_kernel_supports(q: jax.Array, cache: KVCache) -> str | None:
    """Why the Mosaic GPU decode kernel (``backend="pallas_mgpu"``) cannot run these shapes, or
    None if it can: the HND layout (a page of one KV head is one TMA box), pages of 16 tokens,
    bfloat16 or float16, ``head_dim`` 64 or 128, at most 8 query heads a KV head, and the
    ``q_len x G`` rows of a KV head in one 64-row tile, ``q_len`` at most
    ``MAX_KERNEL_Q_LEN`` (longer runs are prompt chunks, the Triton prefill kernel's)."""
    if cache.layout != "HND":
        return f"layout {cache.layout}: the Mosaic GPU kernel reads HND pages (one TMA box a page)"
    if cache.page_size != mgpu.PAGE_SIZE:
        return f"page_size={cache.page_size}: the Mosaic GPU kernel takes {mgpu.PAGE_SIZE}"
    if not any(q.dtype == d for d in mgpu.SUPPORTED_DTYPES):
        return f"dtype {q.dtype}: the Mosaic GPU kernel takes bfloat16 or float16"
    if q.shape[-1] not in mgpu.SUPPORTED_HEAD_DIMS:
        return f"head_dim={q.shape[-1]}: the Mosaic GPU kernel takes {mgpu.SUPPORTED_HEAD_DIMS}"
    group_size = q.shape[-2] // cache.num_kv_heads
    if group_size > mgpu.MAX_GROUP:
        return f"{group_size} query heads a KV head: the Mosaic GPU kernel takes {mgpu.MAX_GROUP}"
    q_len = q.shape[1] if q.ndim == 4 else 1
    longest = min(MAX_KERNEL_Q_LEN, mgpu.max_query_len(group_size))
    if q_len > longest:
        return f"q_len={q_len}: the Mosaic GPU kernel takes {longest} at a group of {group_size}"
    return None


def decode_kernel_for(q: jax.Array, cache: KVCache, backend: str) -> str:
    """The kernel a kernel backend runs for ``q``: ``"paged_prefill"`` for more than
    ``MAX_KERNEL_Q_LEN`` new tokens a request; else ``"paged_decode_mgpu"`` (the Mosaic GPU
    kernel) when asked for by name, or under ``"auto"`` where it takes the shapes and
    ``AUTO_PICKS_MOSAIC_GPU_DECODE`` is on; else ``"paged_decode"`` (the Triton kernel).

    Example:
      >>> from paged.kv_cache import new_kv_cache
      >>> cache = new_kv_cache(4, 16, 2, 128, jnp.bfloat16)  # HND pages of 16 tokens
      >>> decode_kernel_for(jnp.zeros((1, 8, 128), jnp.bfloat16), cache, "auto")
      'paged_decode_mgpu'
      >>> decode_kernel_for(jnp.zeros((1, 8, 128), jnp.float32), cache, "auto")  # float32
      'paged_decode'
    """
    kernel = kernel_name_for(q)
    if kernel == "paged_prefill":
        return kernel
    if backend == MOSAIC_GPU_BACKEND:
        return "paged_decode_mgpu"
    if (
        backend == "auto"
        and AUTO_PICKS_MOSAIC_GPU_DECODE
        and mgpu_kernel_supports(q, cache) is None
    ):
        return "paged_decode_mgpu"
    return kernel


def mgpu_decode_launch_parameters(interpret: bool) -> dict:
    """The Mosaic GPU kernel's static parameters where ``decode_attention`` calls it:
    ``MGPU_LAUNCH_PARAMETERS``, with the softmax weights fed to ``p @ V`` from registers when
    compiled and through shared memory when interpreted (the only path Mosaic GPU's
    interpreter runs).

    Example:
      >>> mgpu_decode_launch_parameters(interpret=False)
      {'pipeline': 'ring', 'pages_per_step': 4, 'num_stages': 2, 'probs_in_smem': False}
    """
    return dict(MGPU_LAUNCH_PARAMETERS, probs_in_smem=interpret)


def _static_float(name: str, value) -> float | None:
    if value is None:
        return None
    if isinstance(value, jax.core.Tracer):
        raise ValueError(f"{name} must be a Python float, not a traced value (it is static)")
    return float(value)


def validate_decode_inputs(
    q: jax.Array, cache: KVCache, page_table: PageTable, logits_soft_cap: float | None
) -> None:
    """Shape, dtype and (concrete) page-table checks shared by every backend."""
    validate_kv_cache(cache)
    if q.ndim not in (3, 4):
        raise ValueError(
            "q must have shape [batch, num_q_heads, head_dim] or "
            f"[batch, q_len, num_q_heads, head_dim], got {q.shape}"
        )
    batch, *_, num_heads, head_dim = q.shape
    q_len = q.shape[1] if q.ndim == 4 else 1
    if q_len < 1:
        raise ValueError(f"q's q_len (axis 1 of {q.shape}) must be >= 1, got {q_len}")
    if head_dim != cache.head_dim:
        raise ValueError(f"q has head_dim {head_dim} but the cache has {cache.head_dim}")
    if num_heads % cache.num_kv_heads:
        raise ValueError(
            f"q's num_q_heads={num_heads} is not a multiple of the cache's "
            f"num_kv_heads={cache.num_kv_heads}"
        )
    if q.dtype != cache.dtype:
        raise ValueError(f"q dtype {q.dtype} differs from the cache dtype {cache.dtype}")
    if page_table.page_size != cache.page_size:
        raise ValueError(
            f"page_table.page_size={page_table.page_size} differs from the cache's "
            f"page_size={cache.page_size}"
        )
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap}")
    validate_page_table(page_table, cache.num_pages, batch_size=batch)
    if q_len > 1 and is_concrete(page_table.page_indptr, page_table.last_page_len):
        seq_lens = np.asarray(page_table.seq_lens())
        short = (seq_lens > 0) & (seq_lens < q_len)
        if np.any(short):
            b = int(np.argmax(short))
            raise ValueError(
                f"request {b} has seq_len {seq_lens[b]} in page_table, fewer than q's "
                f"q_len={q_len} new tokens (whose keys must already be in the cache)"
            )


def decode_attention(
    q: jax.Array,
    cache: KVCache,
    page_table: PageTable,
    *,
    sm_scale: float | None = None,
    logits_soft_cap: float | None = None,
    return_lse: bool = False,
    plan: DecodePlan | None = None,
    backend: str = "auto",
):
    """Grouped-query decode attention of each request's newest token(s) over its paged keys.

    ``q`` holds one new token per request (``[B, H, D]``) or ``L`` of them (``[B, L, H, D]``,
    ``L`` static: a speculative step verifying ``L - 1`` drafts, or a chunk of a prompt). The new
    tokens are the last ``L`` of each request's sequence in ``page_table``, their keys and values
    already appended, and attention among them is causal: query ``l`` of request ``b`` attends to
    the keys at positions ``< seq_len[b] - L + l + 1``. With ``L = 1`` this is plain decode.

    Query head ``h`` attends with KV head ``h // (H // num_kv_heads)``. Logits are
    ``(q . k) * sm_scale``, soft-capped as ``cap * tanh(s / cap)`` when ``logits_soft_cap`` is
    given; accumulation is in float32.

    Backends, chosen when the function is traced (``kernels_pallas.platform``): ``"auto"`` is
    a fused Pallas kernel on a GPU and the reference elsewhere, unless
    ``DECODELAB_BACKEND=reference``; an explicit ``backend=`` wins (``"pallas"`` on a CPU runs the
    kernel in interpret mode). On a GPU, ``"auto"`` runs the Mosaic GPU decode kernel
    (``kernels_pallas/paged_decode_mgpu.py``, the same plan and merge) for the shapes it takes
    (``mgpu_kernel_supports``: HND pages of 16 tokens, bfloat16 or float16, ``head_dim`` 64 or
    128), measured as fast as the Triton kernel or faster on the whole standard grid
    (``decode_kernel_for`` says which kernel runs); ``"pallas_mgpu"`` asks for it by name,
    ``"pallas"`` for the Triton kernels. Two Triton kernels, chosen by ``L``
    (``kernel_name_for``): up to ``MAX_KERNEL_Q_LEN`` new tokens a request (decode, speculative
    verification) the split-KV decode kernel (``kernels_pallas/paged_decode.py``), whose one
    query tile holds all ``L x G`` rows of a KV head; longer runs (prompt chunks) the causal
    prefill kernel (``kernels_pallas/paged_prefill.py``), which tiles the new tokens into query
    blocks and stops each block's key loop at its causal bound. Both need power-of-two
    ``head_dim`` (at least 16) and ``page_size``; ``"auto"`` falls back to the reference for
    other shapes. Both read pages in place in either layout; nothing is converted on the hot
    path.

    Split-KV: the decode kernel follows a ``DecodePlan``. Pass the one ``paged.plan_decode`` made
    for this step (on the host, once, reused by every layer). Without one, a plan is made here
    when the table is concrete, and under ``jit`` a static default split is used
    (``paged.plan.traced_default_plan``). A plan does not depend on ``L``. The prefill kernel
    needs no plan (its query blocks fill the GPU without splitting the keys): a plan passed with
    a long run is checked against the table, then not used.

    Invalid input under ``jit`` (``docs/invalid_input.md``): the table's values cannot be
    checked there, and none ever makes a read outside the pool. A page index outside the pool
    reads a page of the pool: the kernels clamp it into ``[0, num_pages)``, the reference
    follows JAX indexing (a negative index counts from the end, then clamps). The result is
    attention over the wrong keys. A ``last_page_len`` above ``page_size`` reads the whole page,
    one of 0 or less leaves the last page out. A request whose ``page_indptr`` decreases has no
    keys, and a stale plan attends over its own page ranges. Call once outside ``jit`` to
    check the inputs.

    Args:
      q: ``[B, H, D]`` or ``[B, L, H, D]`` queries, in the cache's dtype.
      cache: the KV pool (``HND`` or ``NHD``).
      page_table: ``B`` requests' pages, including the new tokens' keys.
      sm_scale: logit scale, a Python float (static); default ``1 / sqrt(D)``.
      logits_soft_cap: optional cap ``> 0``, a Python float (static).
      return_lse: also return the log-sum-exp.
      plan: the step's ``DecodePlan`` (Pallas decode kernel only; ignored by the reference, and
        for ``L > MAX_KERNEL_Q_LEN`` only validated).
      backend: ``"auto"``, ``"reference"``, ``"pallas"``, or ``"pallas_mgpu"``: the Mosaic GPU
        decode kernel (``kernels_pallas/paged_decode_mgpu.py``, interpreted on a CPU) in place
        of the Triton one, by name (``"auto"`` picks it on a GPU where it takes the shapes),
        for HND pages of 16 tokens, bfloat16 or float16, ``head_dim`` 64
        or 128, groups up to 8 and ``L <= 16`` (``mgpu_kernel_supports``); same plan, same
        merge, its pipeline ``MGPU_LAUNCH_PARAMETERS``.

    Returns:
      ``o`` shaped like ``q`` (``[B, H, D]`` or ``[B, L, H, D]``) in q's dtype, and with
      ``return_lse=True`` also ``lse`` float32 ``[B, H]`` or ``[B, L, H]`` (natural log). An
      empty request (no pages) gets ``o = 0`` and ``lse = -inf`` for every query. Under ``jit``
      a request shorter than ``L`` cannot be rejected: its queries at negative positions see no
      keys (positions before 0 do not exist) and get ``o = 0``, ``lse = -inf``; the others attend
      causally as above.

    Raises:
      ValueError: for mismatched shapes or dtypes, head counts that do not divide, ``L < 1``, a
        traced ``sm_scale`` or cap, shapes the kernel cannot run with ``backend="pallas"`` (or
        ``"pallas_mgpu"``), a plan made for another batch, and (concrete inputs) page-table
        invariants (indices outside the pool, ``page_indptr`` not starting at 0 or decreasing,
        ``last_page_len`` out of range), a non-empty request shorter than ``L``, and a plan
        that does not match the table (a stale plan).

    Example:
      >>> from paged import new_kv_cache
      >>> cache = new_kv_cache(4, 16, 2, 8, jnp.float32)
      >>> table = PageTable.from_seq_lens([20, 3], page_size=16)
      >>> o, lse = decode_attention(jnp.ones((2, 4, 8)), cache, table, return_lse=True)
      >>> o.shape, lse.shape
      ((2, 4, 8), (2, 4))
      >>> o, lse = decode_attention(jnp.ones((2, 3, 4, 8)), cache, table, return_lse=True)
      >>> o.shape, lse.shape  # three new tokens per request, causal among themselves
      ((2, 3, 4, 8), (2, 3, 4))
    """
    logits_soft_cap = _static_float("logits_soft_cap", logits_soft_cap)
    sm_scale = _static_float("sm_scale", sm_scale)
    validate_decode_inputs(q, cache, page_table, logits_soft_cap)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    mosaic_gpu = backend == MOSAIC_GPU_BACKEND
    if mosaic_gpu:  # asked for by name: the kernel, or an error saying why it cannot run
        unsupported = mgpu_kernel_supports(q, cache)
        if unsupported:
            raise ValueError(
                f"backend={MOSAIC_GPU_BACKEND!r} cannot run decode_attention here: {unsupported}"
            )
        chosen = choose_backend("decode_attention", "pallas", kernel="paged_decode_mgpu").backend
    else:
        kernel = decode_kernel_for(q, cache, backend)
        chosen = choose_backend(
            "decode_attention", backend, unsupported=kernel_supports(q, cache), kernel=kernel
        ).backend
        # "auto" on a GPU, for shapes the Mosaic GPU kernel takes: that kernel (the kill switch
        # and an explicit "pallas" still give the reference and the Triton kernel).
        mosaic_gpu = chosen != "reference" and kernel == "paged_decode_mgpu"
    if chosen == "reference":
        o, lse = decode_attention_reference(
            q, cache, page_table, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap
        )
    elif kernel_name_for(q) == "paged_prefill":
        if plan is not None:  # unused here, but a plan for another table is still a caller bug
            validate_plan(plan, page_table)
        o, lse = _prefill_attention_pallas(q, cache, page_table, sm_scale, logits_soft_cap)
    else:
        o, lse = _decode_attention_pallas(
            q, cache, page_table, sm_scale, logits_soft_cap, plan, mosaic_gpu=mosaic_gpu
        )
    o = o.astype(q.dtype)
    lse = lse.astype(jnp.float32)
    return (o, lse) if return_lse else o


def _prefill_attention_pallas(q, cache, page_table, sm_scale, logits_soft_cap):
    """Long query runs (``L > MAX_KERNEL_Q_LEN``): the causal prefill kernel, no plan."""
    if q.shape[0] == 0:  # no program to launch
        return jnp.zeros(q.shape, q.dtype), jnp.zeros(q.shape[:-1], jnp.float32)
    group_size = q.shape[2] // cache.num_kv_heads
    params = prefill_launch_parameters(q.shape[-1], group_size, cache.page_size)
    return paged_prefill(
        q,
        cache.k_pages,
        cache.v_pages,
        page_table.page_indices,
        page_table.page_indptr,
        page_table.last_page_len,
        layout=cache.layout,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        interpret=interpret_mode(),
        **params,
    )


def decode_launch_parameters(
    plan: DecodePlan,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    *,
    q_len: int = 1,
) -> dict[str, int]:
    """The decode kernel's launch parameters for one call: the tuned ones for the plan's split
    (``plan.write_final``, ``plan.long_chunks``) and the attention shape
    (``kernels_pallas/paged_decode_tuning.py``), refitted for a taller query tile when a request
    brings ``q_len > 1`` new tokens (plans are made per step, not per ``q_len``).

    Example:
      >>> plan = plan_decode(PageTable.from_seq_lens([4096], page_size=16), 32, 8, 128)
      >>> decode_launch_parameters(plan, 32, 8, 128, 16)
      {'pages_per_step': 16, 'num_warps': 4, 'num_stages': 1}
    """
    group_size = num_q_heads // num_kv_heads
    params = tuning.kernel_parameters(head_dim, group_size, plan.write_final, plan.long_chunks)
    if q_len > 1:
        params = tuning.multi_token_parameters(params, q_len * group_size, page_size)
    return params


def _decode_attention_pallas(
    q, cache, page_table, sm_scale, logits_soft_cap, plan, *, mosaic_gpu=False
):
    """The split-KV decode kernel (Triton, or Mosaic GPU with ``mosaic_gpu``) over the plan's
    work items, then the merge of a split plan's partial states; ``(o, lse)`` shaped like q."""
    batch, num_q_heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    q_len = q.shape[1] if q.ndim == 4 else 1
    num_kv_heads = cache.num_kv_heads
    if batch == 0:  # no program to launch
        return jnp.zeros(q.shape, q.dtype), jnp.zeros(q.shape[:-1], jnp.float32)
    if plan is None:
        if is_concrete(page_table.page_indptr, page_table.last_page_len):
            plan = plan_decode(page_table, num_q_heads, num_kv_heads, head_dim)
        else:
            plan = traced_default_plan(page_table, num_q_heads, num_kv_heads, head_dim)
    validate_plan(plan, page_table)
    interpret = interpret_mode()
    if mosaic_gpu:
        o, lse = mgpu.paged_decode_mgpu(
            q,
            cache.k_pages,
            cache.v_pages,
            page_table.page_indices,
            plan.work_request,
            plan.work_page_start,
            plan.work_page_end,
            plan.work_last_page_len,
            page_indptr=page_table.page_indptr if q_len > 1 else None,
            last_page_len=page_table.last_page_len if q_len > 1 else None,
            sm_scale=sm_scale,
            logits_soft_cap=logits_soft_cap,
            write_final=plan.write_final,
            merge=MGPU_MERGE,
            merge_indptr=plan.merge_indptr if MGPU_MERGE == "folded" else None,
            interpret=interpret,
            **mgpu_decode_launch_parameters(interpret),
        )
        if MGPU_MERGE == "folded":  # merged in the launch: final (o, lse) in q's shape
            return o, lse
        return _merge_split(o, lse, plan, q, num_kv_heads, interpret)
    params = decode_launch_parameters(
        plan, num_q_heads, num_kv_heads, head_dim, cache.page_size, q_len=q_len
    )
    o, lse = paged_decode(
        q,
        cache.k_pages,
        cache.v_pages,
        page_table.page_indices,
        plan.work_request,
        plan.work_page_start,
        plan.work_page_end,
        plan.work_last_page_len,
        page_indptr=page_table.page_indptr,
        last_page_len=page_table.last_page_len,
        layout=cache.layout,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        write_final=plan.write_final,
        interpret=interpret,
        **params,
    )
    return _merge_split(o, lse, plan, q, num_kv_heads, interpret)


def _merge_split(o, lse, plan, q, num_kv_heads, interpret):
    """A final plan's kernel outputs as they are; a split plan's partial states merged, in q's
    shape (both decode kernels write the same partial-state layout)."""
    q_len = q.shape[1] if q.ndim == 4 else 1
    num_q_heads = q.shape[-2]
    if plan.write_final:
        return o, lse
    # The merge sees each KV head's q_len x G rows as one group of "heads" (the kernel's row
    # order); token_major puts them back in q's order.
    o, lse = merge_partial_states(
        o,
        lse,
        plan.merge_indptr,
        num_q_heads=q_len * num_q_heads,
        out_dtype=q.dtype,
        interpret=interpret,
    )
    o = token_major(o, q_len, num_kv_heads)
    lse = token_major(lse, q_len, num_kv_heads)
    return o.reshape(q.shape), lse.reshape(q.shape[:-1])
