"""Public MLA decode over the paged latent cache, with backend selection.

One entry, ``mla_decode_attention``, for the absorbed decode of ``docs/mla.md``: the reference
(``paged.mla_reference.mla_decode_absorbed_reference``) or the Mosaic GPU kernel
(``kernels_pallas/mla_decode_mgpu.py``). Both see the same validation first, so bad input gets
the same error whichever backend would have run.

Why ``backend="auto"`` runs the reference, on a GPU too: the project's rule is that ``"auto"``
picks a kernel only where it was compiled, checked against its reference and measured faster
than it on the H200. The MLA kernel has run only in Mosaic GPU's interpreter and been lowered
for CUDA; it has never run on the H200. ``AUTO_PICKS_MLA_KERNEL`` holds that decision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.platform import BackendChoice, choose_backend, interpret_mode, is_concrete
from paged.mla_cache import LatentCache
from paged.mla_reference import (
    _validate_mla_inputs,
    absorb_query,
    mla_decode_absorbed_reference,
    project_latent_output,
)
from paged.page_table import PageTable
from paged.plan import DecodePlan

# The backends mla_decode_attention takes. "pallas" is the project's generic name for "the
# kernel" (a caller that passes one backend to every layer); here it is the Mosaic GPU kernel.
MLA_BACKENDS = ("auto", "reference", "pallas_mgpu", "pallas")
MLA_KERNEL_NAME = "mla_decode_mgpu"

# Whether backend="auto" runs the Mosaic GPU kernel on a GPU. False until the kernel is checked
# compiled on the H200 (tests/test_mla_decode_mgpu.py's gpu-marked tests) and measured faster
# than the reference there (python -m bench.probes.mla_decode, via bash bench/run_on_gpu.sh
# mla-decode), with the report cited here, as kernels_pallas/platform.AUTO_PICKS_KERNEL cites
# its evidence. Flipping it is the whole change: choose_mla_backend reads nothing else.
AUTO_PICKS_MLA_KERNEL = False

# The longest query run (new tokens a request) the engine verifies on this kernel
# (serving.engine.max_verified_tokens: num_speculative + 1 for an MLA target). The kernel has no
# bound of its own (a request's q_len x H query rows are cut into 64-row tiles, one program
# each; its tests run q_len 1 to 9 interpreted and up to 4 compiled), so this is a choice: the
# decode kernel's MAX_KERNEL_Q_LEN, one --speculative range for every target.
MLA_MAX_KERNEL_Q_LEN = 16
NOT_MEASURED_REASON = "the MLA kernel has not been run and measured faster on the H200 yet"


def choose_mla_backend(backend: str, *, unsupported: str | None = None) -> BackendChoice:
    """Which backend one call of ``mla_decode_attention`` runs, and why.

    The project's one chooser (``kernels_pallas.platform.choose_backend``) decides, so the kill
    switch and the GPU check are its: ``"reference"`` is obeyed; ``"pallas_mgpu"`` (or
    ``"pallas"``) is obeyed where the kernel can run the call and refused with the reason where
    it cannot; ``"auto"`` is the reference under ``DECODELAB_BACKEND=reference``, off a GPU,
    where the kernel cannot run the call, and while ``AUTO_PICKS_MLA_KERNEL`` is False (today:
    always); the kernel otherwise. ``record_backends`` sees the decision with kernel
    ``"mla_decode_mgpu"`` (its operation None: ``AUTO_PICKS_KERNEL`` has no MLA entry yet).

    Args:
      backend: ``"auto"``, ``"reference"``, ``"pallas_mgpu"`` or ``"pallas"`` (the same kernel).
      unsupported: why the kernel cannot run this call, or None if it can.

    Returns:
      ``BackendChoice(backend, reason)``, ``backend`` ``"reference"`` or ``"pallas_mgpu"``.

    Raises:
      ValueError: for an unknown backend or ``DECODELAB_BACKEND`` value, or a kernel backend
        asked for where ``unsupported`` says it cannot run (naming the reason).

    Example:
      >>> choose_mla_backend("auto").backend  # never the kernel while it is unmeasured
      'reference'
    """
    if backend not in MLA_BACKENDS:
        raise ValueError(f"backend must be one of {MLA_BACKENDS}, got {backend!r}")
    if backend != "auto" and backend != "reference" and unsupported:
        raise ValueError(f"backend={backend!r} cannot run mla_decode_attention here: {unsupported}")
    choice = choose_backend(
        None,
        "pallas" if backend == "pallas_mgpu" else backend,
        unsupported=unsupported,
        auto_declines=None if AUTO_PICKS_MLA_KERNEL else NOT_MEASURED_REASON,
        kernel=MLA_KERNEL_NAME,
    )
    if choice.backend == "pallas":
        return BackendChoice("pallas_mgpu", choice.reason)
    return choice


def kernel_unsupported(
    q_nope: jax.Array, cache: LatentCache, page_table: PageTable, plan: DecodePlan | None
) -> str | None:
    """Why the Mosaic GPU kernel cannot run this (validated) call, or None if it can: its sizes
    and dtypes (``kernels_pallas.mla_decode_mgpu.unsupported_reason``: bfloat16 or float16
    pages, ``kv_lora_rank`` 128/256/512, ``qk_rope_head_dim`` 64/128, ``page_size`` 8 to 64, a
    multiple of 8 heads), and a traced table without a plan (its plan is made on the host)."""
    from kernels_pallas.mla_decode_mgpu import unsupported_reason  # see _mla_decode_mgpu

    num_heads = q_nope.shape[-2]
    reason = unsupported_reason(
        cache.dtype, num_heads, cache.kv_lora_rank, cache.qk_rope_head_dim, cache.page_size
    )
    if reason is None and plan is None:
        if not is_concrete(page_table.page_indptr, page_table.last_page_len):
            reason = (
                "a traced page table without a plan: pass plan= "
                "(kernels_pallas.mla_decode_mgpu.plan_mla_decode, made on the host)"
            )
    return reason


def mla_decode_attention(
    q_nope: jax.Array,
    q_rope: jax.Array,
    cache: LatentCache,
    page_table: PageTable,
    w_uk: jax.Array,
    w_uv: jax.Array,
    *,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    plan: DecodePlan | None = None,
    backend: str = "auto",
):
    """Multi-head latent attention (MLA) decode of each request's newest token(s), absorbed.

    Computes ``paged.mla_reference.mla_decode_absorbed_reference``: head ``h``'s logit of a
    cached token is ``softmax_scale * (q_nope[h] . (c @ W_UK[h]) + q_rope[h] . k_rope)``,
    computed as ``(W_UK[h] @ q_nope[h]) . c`` so every head reads the one shared latent stream,
    and the output is ``(sum_t p_t c_t) @ W_UV[h]`` (``docs/mla.md``). The ``L`` new tokens are
    the last ``L`` of each request in ``page_table``, their latents already appended
    (``paged.append_latent``), causal among themselves.

    Backends, chosen when the function is traced (``choose_mla_backend``):

    - ``"reference"``: the absorbed reference, in float32 (float64 for float64 inputs: the one
      to check against in float64).
    - ``"pallas_mgpu"`` (or ``"pallas"``): the Mosaic GPU kernel; the query is absorbed in
      float32 and rounded to the cache's dtype, the kernel computes the latent-space state
      (split requests merged), ``W_UV`` is applied in float32. On a CPU it runs in Mosaic GPU's
      interpreter (slow; for tests). Needs bfloat16 or float16 pages, ``R`` 128/256/512, ``P``
      64/128, ``page_size`` 8 to 64, a multiple of 8 heads, and under ``jit`` a ``plan``.
    - ``"auto"``: the reference, everywhere, for now: the kernel has never run on the H200, and
      ``"auto"`` picks a kernel only where it was measured faster (``AUTO_PICKS_MLA_KERNEL``).
      ``DECODELAB_BACKEND=reference`` (the kill switch) keeps ``"auto"`` on the reference after
      that flips; an explicit ``backend=`` wins over it.

    Args:
      q_nope: ``[B, H, N]`` or ``[B, L, H, N]``: each new token's non-rotary query per head.
      q_rope: ``[B, H, P]`` or ``[B, L, H, P]``: its rotated RoPE query per head.
      cache: the latent pool (``paged.LatentCache``: ``[num_pages, page_size, R]`` latents,
        ``[num_pages, page_size, P]`` RoPE keys).
      page_table: B requests, already covering the new tokens.
      w_uk: ``[H, R, N]``; ``w_uv``: ``[H, R, V]`` (from ``kv_b_proj``, ``docs/mla.md``).
      softmax_scale: a Python float; default ``1 / sqrt(N + P)``
        (``paged.mla_reference.default_softmax_scale``, which takes YaRN's ``mscale`` too).
      return_lse: also return the log-sum-exp.
      plan: for the kernel, a ``DecodePlan`` of this table
        (``kernels_pallas.mla_decode_mgpu.plan_mla_decode``); made here from a concrete
        table when None; ignored by the reference.
      backend: ``"auto"``, ``"reference"``, ``"pallas_mgpu"`` or ``"pallas"``.

    Returns:
      ``out [B, (L,) H, V]`` in float32 (float64 for float64 inputs on the reference), and with
      ``return_lse=True`` also ``lse [B, (L,) H]``, the natural-log log-sum-exp of the scaled
      logits, in the same dtype. A query that sees no key (an empty request) gets ``out = 0``,
      ``lse = -inf``.

    Raises:
      ValueError: on every backend alike, naming the argument and the value, for shapes that do
        not fit together, a bad ``softmax_scale``, ``q_len < 1``, a bad page table or (concrete)
        a request shorter than ``L``; an unknown backend; a kernel backend for a call the kernel
        cannot run (the reason named); a plan made for another table.

    Example:
      >>> from paged import new_latent_cache
      >>> cache = new_latent_cache(4, 8, kv_lora_rank=16, qk_rope_head_dim=4, dtype=jnp.float32)
      >>> table = PageTable.from_seq_lens([9, 3], page_size=8)
      >>> w_uk, w_uv = jnp.ones((2, 16, 8)), jnp.ones((2, 16, 6))
      >>> out, lse = mla_decode_attention(
      ...     jnp.ones((2, 2, 8)), jnp.ones((2, 2, 4)), cache, table, w_uk, w_uv, return_lse=True
      ... )
      >>> out.shape, lse.shape
      ((2, 2, 6), (2, 2))
    """
    if backend not in MLA_BACKENDS:  # before anything is computed
        raise ValueError(f"backend must be one of {MLA_BACKENDS}, got {backend!r}")
    nope, rope, scale = _validate_mla_inputs(
        q_nope, q_rope, cache, page_table, w_uk, w_uv, softmax_scale
    )
    # The reference asks nothing of the kernel (nor imports its module, see _mla_decode_mgpu).
    unsupported = (
        None if backend == "reference" else kernel_unsupported(nope, cache, page_table, plan)
    )
    chosen = choose_mla_backend(backend, unsupported=unsupported).backend
    if chosen == "reference":
        out, lse = mla_decode_absorbed_reference(
            q_nope, q_rope, cache, page_table, w_uk, w_uv, softmax_scale=scale
        )
    else:
        out, lse = _mla_decode_mgpu(nope, rope, cache, page_table, w_uk, w_uv, scale, plan)
        if q_nope.ndim == 3:
            out, lse = out[:, 0], lse[:, 0]
    return (out, lse) if return_lse else out


def _mla_decode_mgpu(nope, rope, cache, page_table, w_uk, w_uv, scale, plan):
    """The kernel backend on validated ``[B, L, H, D]`` queries: ``(out, lse)``, 4-D."""
    # Imported here: Mosaic GPU's Pallas module adds about 0.3 s to ``import paged``, which
    # nothing else there needs yet.
    from kernels_pallas.mla_decode_mgpu import mla_decode_mgpu

    batch, q_len, num_heads = nope.shape[:3]
    if batch == 0:  # no program to launch
        dtype = jnp.promote_types(jnp.float32, w_uv.dtype)
        return (
            jnp.zeros((0, q_len, num_heads, w_uv.shape[2]), dtype),
            jnp.zeros((0, q_len, num_heads), jnp.float32),
        )
    interpret = interpret_mode()
    # The kernel reads one dtype: the absorbed query (float32) is rounded to the cache's.
    q_latent = absorb_query(nope, w_uk).astype(cache.dtype)
    o_latent, lse = mla_decode_mgpu(
        q_latent,
        rope.astype(cache.dtype),
        cache,
        page_table,
        softmax_scale=scale,
        plan=plan,
        probs_in_smem=interpret,  # the interpreter's path; p from registers when compiled
        interpret=interpret,
    )
    return project_latent_output(o_latent, w_uv), lse
