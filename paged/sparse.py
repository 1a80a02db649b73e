"""Sparse decode attention: a selection becomes a page table, and the ordinary decode runs on it.

One public entry, ``sparse_decode_attention``, for three kinds of selection
(``docs/sparse_decode.md``):

- ``QuestSelection`` (``paged/sparse_quest.py``): top pages per (request, head) by Quest's key
  bounds, first and last page always kept; a table of ``B * R`` rows over a head-split view.
- ``TokenSelection`` (``paged/sparse_tokens.py``): chosen token positions per request (e.g. the
  lightning indexer's top-k, ``paged/sparse_indexer.py``); a table of page size 1 over a
  token view of the pool.
- ``BlockSelection`` (``paged/sparse_blocks.py``): a BSR block mask with blocks of one page; a
  table over the pool itself.

Every kind ends in ``paged.decode_attention`` on the virtual table, so the backends, the kill
switch ``DECODELAB_BACKEND=reference`` and the Pallas decode kernel are the existing ones,
unchanged; ``backend="reference"`` is the float64-checkable reference.

Quest's own two steps, scoring the pages and keeping the top ones, follow ``backend`` too
(``choose_quest_backend``): the references ``quest_page_scores`` and ``quest_selected_pages``,
or their kernels ``kernels_pallas/quest_scores.py`` (Mosaic GPU) and
``kernels_pallas/quest_select.py`` (Triton lowering). ``"auto"`` keeps the references, on a GPU
too, while ``AUTO_PICKS_QUEST_KERNELS`` is False: the project's rule is that ``"auto"`` picks a
kernel only once it was compiled, checked and measured faster than its reference on the H200,
and neither of these two is measured yet (the scoring kernel's compiled tests pass there).
"""

from __future__ import annotations

import jax

from kernels_pallas.platform import BACKENDS, BackendChoice, choose_backend, interpret_mode
from paged.decode import _static_float, decode_attention, validate_decode_inputs
from paged.kv_cache import KVCache
from paged.page_table import PageTable
from paged.sparse_blocks import BlockSelection, block_page_table
from paged.sparse_quest import (
    QuestSelection,
    _check_bounds,
    _check_query,
    check_token_budget,
    head_split_cache,
    head_split_page_table,
    quest_page_scores,
    quest_selected_pages,
)
from paged.sparse_tokens import TokenSelection, token_page_table, token_view_cache

Selection = QuestSelection | TokenSelection | BlockSelection

# Whether backend="auto" runs Quest's scoring and selection kernels on a GPU. False until both are
# measured faster than their references on the H200 (bench/probes/quest_scores.py and
# bench/probes/quest_select.py, each checks and times its kernel beside the reference), with the
# report cited here, as kernels_pallas/platform.AUTO_PICKS_KERNEL cites its evidence. Flipping it
# is the whole change: choose_quest_backend reads nothing else. (AUTO_PICKS_KERNEL has no entry
# for these operations; adding one there would make every committed benchmark report stale.)
AUTO_PICKS_QUEST_KERNELS = False
QUEST_NOT_MEASURED_REASON = (
    "Quest's scoring and selection kernels are not yet measured faster on the H200"
)
QUEST_SCORES_KERNEL = "quest_scores"  # the names their pallas calls start with
QUEST_SELECT_KERNEL = "quest_select"


def choose_quest_backend(
    backend: str, *, kernel: str, unsupported: str | None = None
) -> BackendChoice:
    """Which backend one of Quest's steps (scoring or selection) runs in ``sparse_page_table``.

    The project's one chooser (``kernels_pallas.platform.choose_backend``) decides, so the kill
    switch and the GPU check are its: ``"reference"`` is obeyed; ``"pallas"`` is obeyed where the
    kernel can run the call and refused with the reason where it cannot (the explicit backend
    wins over ``DECODELAB_BACKEND``, as everywhere); ``"auto"`` is the reference under the kill
    switch, off a GPU, where the kernel cannot run the call, and while
    ``AUTO_PICKS_QUEST_KERNELS`` is False (today: always). ``record_backends`` sees the decision
    with ``kernel`` (``"quest_scores"`` or ``"quest_select"``) and operation None:
    ``AUTO_PICKS_KERNEL`` has no Quest entry yet.

    Args:
      backend: ``"auto"``, ``"reference"`` or ``"pallas"``.
      kernel: ``QUEST_SCORES_KERNEL`` or ``QUEST_SELECT_KERNEL``, for the record and errors.
      unsupported: why the kernel cannot run this call, or None if it can.

    Returns:
      ``BackendChoice(backend, reason)``, ``backend`` ``"reference"`` or ``"pallas"``.

    Raises:
      ValueError: an unknown backend or ``DECODELAB_BACKEND`` value, or ``"pallas"`` asked for
        where ``unsupported`` says the kernel cannot run (naming the kernel and the reason).

    Example:
      >>> choose_quest_backend("auto", kernel=QUEST_SCORES_KERNEL).backend  # not yet measured
      'reference'
    """
    if backend == "pallas" and unsupported:
        raise ValueError(f"backend='pallas' cannot run Quest's {kernel} kernel here: {unsupported}")
    return choose_backend(
        None,
        backend,
        unsupported=unsupported,
        auto_declines=None if AUTO_PICKS_QUEST_KERNELS else QUEST_NOT_MEASURED_REASON,
        kernel=kernel,
    )


def quest_scores_unsupported(q: jax.Array, selection: QuestSelection) -> str | None:
    """Why the scoring kernel cannot score ``q`` against ``selection.bounds``, or None if it
    can: float64 inputs, a ``head_dim`` outside ``SUPPORTED_HEAD_DIMS`` (64, 128, 256), more
    than ``MAX_GROUP`` query heads a KV head, an empty pool
    (``kernels_pallas.quest_scores.validate_quest_scores_arguments`` at its default launch).
    The shapes must already fit together (the reference's checks), which they do here."""
    # Imported here, as paged/mla_decode.py imports its kernel: ``import paged`` and the
    # reference path need none of the kernel modules.
    from kernels_pallas.quest_scores import (
        MAX_PAGES_PER_ITEM,
        validate_quest_scores_arguments,
    )

    try:
        validate_quest_scores_arguments(q, selection.bounds, MAX_PAGES_PER_ITEM, num_stages=2)
    except ValueError as refusal:
        return str(refusal)
    return None


def quest_selected_rows(
    q: jax.Array, page_table: PageTable, selection: QuestSelection, backend: str
) -> jax.Array:
    """Quest's selection, bool ``[B, R, nnz_padded]`` (``quest_selected_pages``'s output), by the
    references or the kernels as ``backend`` resolves (``choose_quest_backend``), each step
    decided and recorded on its own."""
    check_token_budget(selection.token_budget)
    # The reference's shape checks first, so bad input gets the same error on every backend.
    _check_bounds(selection.bounds)
    _check_query(q, *selection.bounds.kmin.shape[1:])
    scores_unsupported = None if backend == "reference" else quest_scores_unsupported(q, selection)
    scoring = choose_quest_backend(
        backend, kernel=QUEST_SCORES_KERNEL, unsupported=scores_unsupported
    )
    if scoring.backend == "pallas":
        from kernels_pallas.quest_scores import quest_page_scores_pallas  # see above

        scores = quest_page_scores_pallas(
            q, selection.bounds, page_table, per=selection.per, interpret=interpret_mode()
        )
    else:
        scores = quest_page_scores(q, selection.bounds, page_table, per=selection.per)
    # The selection kernel ranks float32 (or narrower) scores; the reference's float64 scores
    # (float64 inputs under x64) are beyond it.
    select_unsupported = (
        f"scores of dtype {scores.dtype}: the kernel ranks float32"
        if backend != "reference" and scores.dtype.itemsize > 4
        else None
    )
    selecting = choose_quest_backend(
        backend, kernel=QUEST_SELECT_KERNEL, unsupported=select_unsupported
    )
    if selecting.backend == "pallas":
        from kernels_pallas.quest_select import quest_selected_pages_pallas

        return quest_selected_pages_pallas(
            scores, page_table, selection.token_budget, interpret=interpret_mode()
        )
    return quest_selected_pages(scores, page_table, selection.token_budget)


def sparse_page_table(
    q: jax.Array,
    cache: KVCache,
    page_table: PageTable,
    selection: Selection,
    *,
    backend: str = "auto",
) -> tuple[jax.Array, KVCache, PageTable]:
    """The dense decode problem a sparse one is: ``(q', cache', table')``.

    ``decode_attention(q', cache', table')`` attends over exactly the selected keys; its output
    ``[B', H', D]`` reshapes to ``q``'s ``[B, H, D]`` (rows of a Quest table are (request, head)
    pairs in row-major order).

    ``backend`` matters only to a ``QuestSelection``, whose scoring and selection it picks
    (``choose_quest_backend``): ``"reference"`` runs ``quest_page_scores`` and
    ``quest_selected_pages``; ``"pallas"`` their kernels (``quest_page_scores_pallas``, Mosaic
    GPU, and ``quest_selected_pages_pallas``, Triton lowering; interpreted off a GPU), which
    select the same pages up to the scoring kernel's summation order (``kernels_pallas/
    quest_scores.py``, "Numerics": two pages whose scores differ by less than that rounding may
    swap); ``"auto"`` the references, also on a GPU, until the kernels are measured there
    (``AUTO_PICKS_QUEST_KERNELS``). Token and block selections compute nothing to choose.

    Raises:
      TypeError: an unknown kind of selection.
      ValueError: as each kind's validation; an unknown backend; ``backend="pallas"`` with a
        Quest selection the kernels cannot run (float64, a ``head_dim`` other than 64, 128 or
        256, more than 256 query heads a KV head), naming the reason.
    """
    if backend not in BACKENDS:  # for every kind, before anything is computed
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(selection, QuestSelection):
        selected = quest_selected_rows(q, page_table, selection, backend)
        table = head_split_page_table(page_table, selected, cache.num_kv_heads)
        batch, num_heads, head_dim = q.shape
        rows = selected.shape[1]  # KV heads or query heads
        return q.reshape(batch * rows, num_heads // rows, head_dim), head_split_cache(cache), table
    if isinstance(selection, TokenSelection):
        return q, token_view_cache(cache), token_page_table(page_table, selection)
    if isinstance(selection, BlockSelection):
        return q, cache, block_page_table(page_table, selection)
    raise TypeError(
        "selection must be a QuestSelection, TokenSelection or BlockSelection, got "
        f"{type(selection).__name__}"
    )


def sparse_decode_attention(
    q: jax.Array,
    cache: KVCache,
    page_table: PageTable,
    selection: Selection,
    *,
    sm_scale: float | None = None,
    logits_soft_cap: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
):
    """Decode attention of each request's new token over a selected subset of its keys.

    The selection turns into a virtual page table (``sparse_page_table``) and
    ``paged.decode_attention`` runs over it: ``backend`` (``"auto"``, ``"reference"`` or
    ``"pallas"``), the kill switch and the kernel are decode's own, chosen when traced. The
    result equals dense attention restricted to exactly the selected keys: selecting every page
    (or token) gives dense decode, output and LSE.

    A ``QuestSelection``'s scoring and selection follow the same ``backend``
    (``sparse_page_table``): the references under ``"reference"``, the kill switch and
    ``"auto"`` (which does not pick these two kernels yet, not having measured them on the
    H200), the Quest kernels under ``"pallas"``. So ``"auto"`` on a GPU selects pages with the
    references and attends with the decode kernel.

    Only plain decode (one new token a request): with ``L > 1`` new tokens the causal order
    among them would be lost in a virtual table.

    Args:
      q: ``[B, H, D]`` in the cache's dtype.
      cache: the KV pool (``HND`` or ``NHD``).
      page_table: the requests' full tables (including the new token).
      selection: ``QuestSelection``, ``TokenSelection`` or ``BlockSelection``.
      sm_scale, logits_soft_cap, return_lse: as in ``paged.decode_attention``.
      backend: ``"auto"``, ``"reference"`` or ``"pallas"`` (for the decode and, with a
        ``QuestSelection``, its scoring and selection).

    Returns:
      ``o [B, H, D]`` in ``q``'s dtype, and with ``return_lse=True`` also ``lse`` float32
      ``[B, H]`` over the selected keys. A request that selects nothing (an empty request) gets
      ``o = 0``, ``lse = -inf``.

    Raises:
      TypeError: an unknown selection kind, a non-int ``token_budget``.
      ValueError: ``q`` not ``[B, H, D]``, what ``paged.decode_attention`` refuses, and each
        selection's own checks (budget < 1, positions or blocks outside a request, unsorted or
        repeated positions or blocks, shapes that do not match the batch); ``"pallas"`` with a
        Quest selection its kernels cannot run (the reason named).

    Example:
      >>> import jax.numpy as jnp
      >>> from paged import PageTable, new_kv_cache
      >>> from paged.sparse_tokens import TokenSelection
      >>> cache = new_kv_cache(4, 4, 2, 8, jnp.float32, layout="NHD")
      >>> table = PageTable.from_seq_lens([7], page_size=4)
      >>> chosen = TokenSelection(jnp.array([[0, 6]], jnp.int32), jnp.array([2], jnp.int32))
      >>> o, lse = sparse_decode_attention(
      ...     jnp.ones((1, 4, 8)), cache, table, chosen, return_lse=True, backend="reference")
      >>> o.shape, round(float(lse[0, 0]), 4)  # two zero keys: lse = log 2
      ((1, 4, 8), 0.6931)
    """
    logits_soft_cap = _static_float("logits_soft_cap", logits_soft_cap)
    sm_scale = _static_float("sm_scale", sm_scale)
    if q.ndim != 3:
        raise ValueError(
            f"q must have shape [batch, num_q_heads, head_dim] (one new token a request), "
            f"got {q.shape}"
        )
    validate_decode_inputs(q, cache, page_table, logits_soft_cap)
    q_view, cache_view, table = sparse_page_table(q, cache, page_table, selection, backend=backend)
    o, lse = decode_attention(
        q_view,
        cache_view,
        table,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        return_lse=True,
        backend=backend,
    )
    o = o.reshape(q.shape)
    lse = lse.reshape(q.shape[:-1])
    return (o, lse) if return_lse else o
