"""The engine's sparse decode: each decode step attends over a selection of every request's pages.

``Engine(sparse=..., sparse_budget=...)`` (``python -m serving generate --sparse quest
--sparse-budget 2048``). With it, the target model's decode steps (one new token a request)
attend through ``paged.sparse_decode_attention`` instead of ``paged.decode_attention``: the
selection becomes a virtual page table over the same pool and the ordinary decode runs on it
(``docs/sparse_decode.md``). Two selections:

- ``"quest"``: ``paged.QuestSelection`` per KV head (Quest's choice under GQA): each page scored
  by the upper bound of its logits from the per-page key bounds (``PageKeyBounds``) kept beside
  every layer's pool, the top pages kept within the budget, the first and the last page always.
- ``"recent"``: ``paged.recent_pages_selection``, the "recent pages only" baseline of the
  quality study (Quest's page count and first-and-last rule, the latest pages in between).

A request keeps ``min(n, token_budget // page_size)`` of its ``n`` pages. The budget must be a
whole number of pages, at least two (the first and last page are always read): a smaller or
ragged one would be rounded by the selection, silently. **A request whose context fits in the
budget selects every one of its pages**, which is dense attention over the same keys (exact up
to float rounding: the virtual table lists the same keys in the same order). Such a request is
not switched to the dense program: a step's rows share one program, and every row of it reads
through its selection; ``SparseStats`` counts the request-steps that read all their pages.

What stays dense: prefill chunks (every prompt token attends to its whole prefix, so the cache
holds the keys and values dense decoding would have written), and the draft model (the engine
refuses sparse with speculation: below).

Quest's key bounds (``BoundedCaches.key_bounds``, one ``PageKeyBounds`` a layer, kept only for
``"quest"``: nothing else reads them)
-----------------------------------------------------------------------------------------------
Each layer's ``paged.rope_append_kv`` (prefill chunks and decode steps alike) is given the
layer's bounds (``key_bounds=``) and widens each written page's bounds by the keys as the pool
now holds them (read back from the pool, so they equal ``paged.page_key_bounds`` of the pool
exactly, whatever rounding the append kernel did). Pages are freed and reused on the host
(``serving/scheduler.py``) without the device being told; instead, **a page's bounds restart
when its first slot is written**: an append into slot 0 of a page resets the page before its
keys are added (``paged.append_page_key_bounds``, the append's reference). Why that is enough,
so that a stale bound is never read:

- A request writes its positions in increasing order, from where its valid keys end, into its
  own private pages (a shared prefix page is full and below every holder's length: never
  written). So the first write into a page a request was given is at slot 0, and every slot a
  live request holds in a page was written after that reset.
- A step scores only pages its table lists, and its table covers exactly the tokens written
  (the new token included, written before the attention of its layer): every listed page has
  had its slot 0 written by its current owner.
- A shared prefix page keeps the bounds its first owner's prefill gave it while any holder
  lives (the registry shares only live pages, whose keys do not change).

Pages freed and not yet reused keep stale bounds; no table lists them. A slot written twice
without its page restarting (a speculative rollback inside a page) would leave the old key
inside the bounds, still a valid bound, only looser; the engine does not speculate with sparse
decode, so it does not happen here. ``tests/test_engine_sparse.py`` compares the kept bounds
with ``paged.page_key_bounds`` of the pool over the live requests after every step: prefill
chunks, decode steps and blocks of them, a shared prefix page, pages freed and reused.

Interactions
------------
- Cascade: exclusive. Cascade splits a step's attention into a shared level and each row's own;
  a selection is per row (per row and head for Quest), which a shared level read once per group
  cannot follow. ``cascade="auto"`` (the default) is off when sparse is on
  (``cascade_report().last_reason`` says so); ``cascade="on"`` with sparse raises.
- Speculative decoding: refused (``num_speculative > 0`` raises). A verification step feeds
  ``n + 1`` tokens a row, and ``paged.sparse_decode_attention`` takes one: in a virtual table the
  causal order among several new tokens would be lost.
- The overlapped loop and blocks of steps (``max_steps_per_program``): unchanged. The bounds are
  device state carried by the programs beside the pools (donated with them, and the carry of a
  block's scan), so no step waits for the host.
- Backends: the engine's ``backend`` goes to ``paged.sparse_decode_attention`` (the decode on
  the virtual table, and Quest's scoring and selection, ``paged.sparse.choose_quest_backend``);
  ``"reference"`` runs every part by the references. The kill switch
  (``DECODELAB_BACKEND=reference``) makes every part the reference, and, unlike cascade, leaves
  sparse decode on: cascade is exact, so turning it off changes nothing but speed, whereas a
  selection changes what the model reads; the switch chooses implementations, not results.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

import paged
from paged.sparse_quest import empty_page_key_bounds
from paged.sparse_recent import recent_pages_selection

SPARSE_MODES = ("quest", "recent")
DEFAULT_SPARSE_BUDGET = 2048


@dataclasses.dataclass(frozen=True)
class SparseDecode:
    """What a sparse decode step selects (hashable: part of a program's static structure).

    Attributes:
      mode: ``"quest"`` or ``"recent"``.
      token_budget: tokens a request reads at most, a whole number of pages (at least two).
    """

    mode: str
    token_budget: int

    def __post_init__(self):
        # Checked here too (not only by check_sparse_arguments): forward_paged takes one
        # directly, and an unknown mode would otherwise run as "recent" without a word.
        if self.mode not in SPARSE_MODES:
            raise ValueError(f"SparseDecode mode must be one of {SPARSE_MODES}, got {self.mode!r}")
        budget = self.token_budget
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"SparseDecode token_budget must be an int >= 1, got {budget!r}")

    @property
    def keeps_bounds(self) -> bool:
        """Whether the selection reads Quest's key bounds (which must then be kept)."""
        return self.mode == "quest"

    def describe(self) -> str:
        return f"{self.mode}, token budget {self.token_budget}"


def check_sparse_arguments(
    sparse, sparse_budget, *, page_size: int, cascade: str, num_speculative: int
) -> SparseDecode | None:
    """The engine's ``SparseDecode`` for ``Engine(sparse=..., sparse_budget=...)``, or None.

    ``sparse_budget`` is checked only with ``sparse`` on (a dense engine ignores it).

    Raises:
      ValueError: naming the argument and the value: ``sparse`` not None, ``"quest"`` or
        ``"recent"``; ``sparse_budget`` not an int, not a multiple of ``page_size`` or below two
        pages; ``cascade="on"`` or ``num_speculative > 0`` with sparse on (module docstring).
    """
    if sparse is None:
        return None
    if sparse not in SPARSE_MODES:
        raise ValueError(f"sparse must be None or one of {SPARSE_MODES}, got {sparse!r}")
    if isinstance(sparse_budget, bool) or not isinstance(sparse_budget, int | np.integer):
        raise ValueError(f"sparse_budget must be an integer (tokens), got {sparse_budget!r}")
    if sparse_budget % page_size:
        raise ValueError(
            f"sparse_budget must be a multiple of page_size={page_size} (whole pages are "
            f"selected), got {sparse_budget}"
        )
    if sparse_budget < 2 * page_size:
        raise ValueError(
            f"sparse_budget must be at least two pages ({2 * page_size} tokens: the first and the "
            f"last page are always read), got {sparse_budget}"
        )
    if cascade == "on":
        raise ValueError(
            f"cascade='on' cannot be combined with sparse={sparse!r}: a shared level read once "
            "per group cannot follow each request's own selection (use cascade='auto' or 'off')"
        )
    if num_speculative:
        raise ValueError(
            f"sparse={sparse!r} cannot be combined with num_speculative={num_speculative}: "
            "sparse decode attends one new token a request, a verification step feeds "
            f"{num_speculative + 1}"
        )
    return SparseDecode(sparse, int(sparse_budget))


@dataclasses.dataclass(frozen=True)
class BoundedCaches:
    """The target model's pools with Quest's key bounds beside them (a pytree).

    ``serving.programs`` takes it wherever it takes the target's list of caches and returns the
    same type: every program (prefill chunks and decode steps) keeps ``key_bounds`` current with
    the keys it writes, and a decode step with ``sparse="quest"`` reads them.

    Attributes:
      caches: one ``paged.KVCache`` a layer (``serving.model.new_caches``).
      key_bounds: one ``paged.PageKeyBounds`` a layer (``new_key_bounds``).
    """

    caches: list
    key_bounds: list


jax.tree_util.register_dataclass(
    BoundedCaches, data_fields=["caches", "key_bounds"], meta_fields=[]
)


def new_key_bounds(caches: list[paged.KVCache]) -> list[paged.PageKeyBounds]:
    """Empty bounds (``kmin = +inf``, ``kmax = -inf``) for each pool of ``caches``, in the
    pools' dtype (min and max are exact in any dtype): ``[num_pages, num_kv_heads, head_dim]``
    twice a layer."""
    return [
        empty_page_key_bounds(cache.num_pages, cache.num_kv_heads, cache.head_dim, cache.dtype)
        for cache in caches
    ]


def sparse_attention(
    q: jax.Array,
    cache: paged.KVCache,
    page_table: paged.PageTable,
    sparse: SparseDecode,
    bounds: paged.PageKeyBounds | None,
    *,
    backend: str,
) -> jax.Array:
    """A decode step's attention over ``sparse``'s selection of each request's pages.

    Args:
      q: ``[B, H, D]``, the rotated queries of each request's new token.
      cache: the layer's pool, the new keys written.
      page_table: the step's table (new tokens included).
      sparse: the mode and budget.
      bounds: the layer's key bounds, current (the new keys included); needed by ``"quest"``.
      backend: the engine's backend.

    Returns:
      ``o [B, H, D]``: attention over exactly the selected keys (``paged.sparse_decode_attention``).
    """
    if sparse.mode == "quest":
        if bounds is None:
            raise ValueError("sparse mode 'quest' needs the layer's key bounds, got None")
        selection = paged.QuestSelection(bounds, sparse.token_budget, per="kv_head")
    else:
        selection = recent_pages_selection(page_table, sparse.token_budget)
    return paged.sparse_decode_attention(q, cache, page_table, selection, backend=backend)


@dataclasses.dataclass
class SparseStats:
    """What sparse decode did so far (``Engine.sparse_report()``; counts are decode steps, a
    block of ``K`` steps counting ``K``).

    Attributes:
      sparse: the engine's ``SparseDecode``.
      decode_steps: decode steps run (every one through the selection).
      requests_selected: request-steps whose context exceeded the budget: they read a
        selection of their pages.
      requests_whole: request-steps whose context fit in the budget: they read every page.
    """

    sparse: SparseDecode
    decode_steps: int = 0
    requests_selected: int = 0
    requests_whole: int = 0

    def record(self, tables, active) -> None:
        """Counts a decode program, one host ``PageTable`` a step (``tables``) over the slots,
        ``active`` (bool ``[B]``) the rows that run a request."""
        active = np.asarray(active)
        for table in tables:
            pages = np.asarray(table.num_pages())[active]
            over = int(np.count_nonzero(pages * table.page_size > self.sparse.token_budget))
            self.decode_steps += 1
            self.requests_selected += over
            self.requests_whole += pages.size - over

    def describe(self) -> str:
        """One line for the backend report and ``--stats``."""
        return (
            f"sparse ({self.sparse.describe()}; {self.decode_steps} decode steps: "
            f"{self.requests_selected} request-steps read a selection of their pages, "
            f"{self.requests_whole} read every page, their context within the budget)"
        )
