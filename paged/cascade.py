"""Cascade attention: requests that share a prompt prefix attend to its pages as one group.

When many requests start with the same tokens (a system prompt, few-shot examples, parallel
samples of one prompt), plain paged decode reads the shared pages once per request. Cascade
attention splits each request's keys into *levels*: the shared levels hold pages that a whole
group of requests lists, the last level each request's own pages. Every level gives each
request a partial attention state ``(o, lse)`` over a disjoint part of its keys, and the merge
of ``proofs/merge_states.md`` combines them into attention over all of them, exactly (Theorem 4
there: any partition of the keys, merged in any grouping and order).

The levels (``CascadeLevels``):

- ``shared``: a tuple of ``SharedLevel``s, outermost first. A shared level is a CSR page table
  over *groups* (``group_pages``, one row a group, with the ``PageTable`` conventions) and a CSR
  map from groups to their requests (``group_indptr``, ``group_requests``). A request belongs to
  at most one group of a level; a request in no group of a level has no keys there. Two levels
  (one shared, one own) are the common case; nested prefixes add more (level 0 a prefix shared
  by every request, level 1 prefixes shared by subgroups, ...).
- ``own``: a plain ``PageTable`` over the batch: each request's own pages, where its new tokens
  lie.

A request's keys are the tokens of its groups' pages, level by level, then its own. Every level
starts at slot 0 of its first page, and only its last page may be partly filled (its
``last_page_len``). So a prefix that ends mid-page is split at the page boundary before it: the
shared level holds the whole pages, and the partly filled page (each request's copy-on-write
copy, holding the last prefix tokens and then the request's own) starts the request's own
level. At most ``page_size - 1`` prefix tokens are then read once per request rather than once
per group. A shared level may still end on a partly filled page when its requests store what
follows on other pages (``last_page_len < page_size`` is allowed there, as in FlashInfer's
cascade layout); ``cascade_levels_from_shared_prefix``, which splits plain per-request rows,
never produces one, because a plain row continues on the same page.

New tokens: ``q`` holds each request's last ``L`` tokens, causal among themselves, and they must
lie in the request's own level; then every shared key precedes them, every shared level is
visible to every new token in full, and only the own level needs the causal mask. A request
whose own level is empty (its whole sequence is shared) may still decode one token (``L = 1``):
that token is the last shared one, and it sees every shared key too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.platform import AUTO_PICKS_KERNEL, choose_backend, interpret_mode, is_concrete
from paged.attention_reference import (
    _compute_dtype,
    attention_over_visible_keys,
    decode_attention_reference,
    merge_states,
    token_mask,
)
from paged.decode import (
    MOSAIC_GPU_BACKEND,
    _static_float,
    decode_attention,
    kernel_supports,
    mgpu_kernel_supports,
    validate_decode_inputs,
)
from paged.kv_cache import KVCache
from paged.page_table import (
    PageTable,
    bucket_size,
    check_csr_offsets,
    host_page_table,
    validate_page_table,
)
from paged.plan import DecodePlan, plan_decode

# What backend="auto" runs here follows decode_attention's evidence (kernels_pallas/platform.py):
# every cascade level runs decode_attention's kernels, so the kernel path is faster than the
# reference wherever decode_attention's is. The kernel that reads a shared level once per group
# (backend="pallas_mgpu") is asked for by name only. Its crossover with plain decode is measured
# (docs/benchmark_results/archive/2026-12-02-cascade-shared-probe.md; the rule kept is
# paged.cascade_plan.CASCADE_CROSSOVER, for a planner choosing which groups to cascade), but the
# per-level "pallas" path was not timed against it, so "auto" does not switch between them.
AUTO_PICKS_KERNEL.setdefault("cascade_decode_attention", AUTO_PICKS_KERNEL["decode_attention"])
# backend="pallas_mgpu": the shared levels' pipeline (kernels_pallas/cascade_shared_mgpu.py's
# defaults: the ring, four pages a step, three slots); the probe's sweep (run_on_gpu.sh
# cascade-shared) is to confirm it. The softmax weights go through shared memory when
# interpreted, the only path Mosaic GPU's interpreter runs, and stay in registers compiled.
CASCADE_SHARED_MGPU_LAUNCH = dict(pipeline="ring", pages_per_step=4, num_stages=3)


@dataclasses.dataclass(frozen=True)
class SharedLevel:
    """One shared level: groups of requests, and the pages each group's requests all list.

    Host NumPy arrays are allowed, as for ``PageTable`` (``cascade_levels_from_shared_prefix``
    builds them); a jitted call transfers them.

    Attributes:
      group_pages: a ``PageTable`` with one row a group (``num_groups`` rows): the group's pages
        at this level, in token order; its ``last_page_len`` may be below ``page_size`` (see the
        module docstring).
      group_indptr: int32[num_groups + 1], prefix sums of each group's number of requests.
      group_requests: int32[num_members_padded], each group's requests (batch indices),
        concatenated; entries past ``group_indptr[-1]`` are padding (0, ignored, not validated).

    Example:
      >>> level = SharedLevel(
      ...     group_pages=host_page_table([[7, 2]], [32], page_size=16),
      ...     group_indptr=np.array([0, 2], np.int32),
      ...     group_requests=np.array([0, 2], np.int32),
      ... )
      >>> level.num_groups, level.request_groups(3).tolist()
      (1, [0, -1, 0])
    """

    group_pages: PageTable
    group_indptr: jax.Array | np.ndarray
    group_requests: jax.Array | np.ndarray

    @property
    def num_groups(self) -> int:
        return self.group_pages.batch_size

    def request_groups(self, batch_size: int) -> jax.Array:
        """int32[batch_size]: the group of each request at this level, -1 for none.

        Works under ``jit``: padding entries, and (unchecked there) members outside the batch,
        are dropped; a request listed twice keeps one of its groups.
        """
        num_members = self.group_requests.shape[0]
        member = jnp.arange(num_members, dtype=jnp.int32)
        group_of_member = (
            jnp.searchsorted(jnp.asarray(self.group_indptr), member, side="right") - 1
        ).astype(jnp.int32)
        requests = jnp.asarray(self.group_requests)
        real = (member < self.group_indptr[-1]) & (requests >= 0) & (requests < batch_size)
        target = jnp.where(real, requests, batch_size)  # past the end: dropped
        return jnp.full((batch_size,), -1, jnp.int32).at[target].set(group_of_member, mode="drop")

    def per_request_page_table(
        self, batch_size: int, *, num_indices: int | None = None
    ) -> PageTable:
        """This level as a plain ``PageTable`` over the batch: request ``b``'s row lists its
        group's pages (no pages for a request in no group).

        Decoding over this table reads a group's pages once per request: the fallback where
        reading them once per group does not pay, and the way ``backend="pallas"`` runs a shared
        level (``backend="pallas_mgpu"`` reads them once per 64-row query tile instead).

        Args:
          batch_size: ``B``.
          num_indices: static length of the result's ``page_indices``. Default: the exact
            count's ``bucket_size`` when the level is concrete, else ``B`` times this level's
            ``page_indices`` length (enough for any table, for ``jit``).

        Returns:
          A ``PageTable`` of JAX arrays, ``B`` rows.

        Raises:
          ValueError: a concrete level whose pages for the batch exceed ``num_indices``.
        """
        size_per_request = self.group_pages.page_indices.shape[0]
        if batch_size == 0 or self.num_groups == 0 or size_per_request == 0:
            empty = jnp.zeros((batch_size,), jnp.int32)
            return PageTable(
                page_indptr=jnp.zeros((batch_size + 1,), jnp.int32),
                page_indices=jnp.zeros((num_indices or bucket_size(0),), jnp.int32),
                last_page_len=empty,
                page_size=self.group_pages.page_size,
            )
        group = self.request_groups(batch_size)
        in_group = group >= 0
        safe_group = jnp.where(in_group, group, 0)
        group_page_counts = jnp.asarray(self.group_pages.num_pages())
        counts = jnp.where(in_group, group_page_counts[safe_group], 0)
        indptr = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts)]).astype(jnp.int32)
        if is_concrete(indptr):
            needed = int(indptr[-1])
            if num_indices is None:
                num_indices = bucket_size(needed)
            elif num_indices < needed:
                raise ValueError(
                    f"num_indices={num_indices} is smaller than the {needed} pages the batch's "
                    "rows list at this level"
                )
        elif num_indices is None:
            num_indices = batch_size * size_per_request
        slot = jnp.arange(num_indices, dtype=jnp.int32)
        owner = jnp.clip(jnp.searchsorted(indptr, slot, side="right") - 1, 0, batch_size - 1)
        source = jnp.asarray(self.group_pages.page_indptr)[safe_group[owner]] + slot - indptr[owner]
        source = jnp.clip(source, 0, max(size_per_request - 1, 0))
        pages = jnp.asarray(self.group_pages.page_indices)
        page_indices = jnp.where(slot < indptr[-1], pages[source], 0).astype(jnp.int32)
        group_last = jnp.asarray(self.group_pages.last_page_len)
        last_page_len = jnp.where(in_group, group_last[safe_group], 0).astype(jnp.int32)
        return PageTable(indptr, page_indices, last_page_len, self.group_pages.page_size)


jax.tree_util.register_dataclass(
    SharedLevel,
    data_fields=["group_pages", "group_indptr", "group_requests"],
    meta_fields=[],
)


@dataclasses.dataclass(frozen=True)
class CascadeLevels:
    """A batch's keys split into levels: shared levels (groups' pages), then each request's own.

    A pytree; see the module docstring for what the levels mean and how a prefix that ends
    mid-page is held.

    Attributes:
      shared: the shared levels, outermost first (any number, 0 included).
      own: each request's own pages (``B`` rows), where its new tokens lie.

    Example:
      >>> table = PageTable.from_page_lists([[4, 5], [4, 9]], [20, 18], page_size=16)
      >>> levels = cascade_levels_from_shared_prefix(table, groups=[[0, 1]], prefix_lens=[16])
      >>> levels.shared[0].group_pages.page_lists(), levels.own.page_lists()
      ([[4]], [[5], [9]])
    """

    shared: tuple[SharedLevel, ...]
    own: PageTable

    @property
    def batch_size(self) -> int:
        return self.own.batch_size

    @property
    def page_size(self) -> int:
        return self.own.page_size


jax.tree_util.register_dataclass(CascadeLevels, data_fields=["shared", "own"], meta_fields=[])


# --------------------------------------------------------------------------------------------
# Building levels from plain per-request rows
# --------------------------------------------------------------------------------------------


def cascade_levels_from_shared_prefix(
    page_table: PageTable, groups: Sequence[Sequence[int]], prefix_lens: Sequence[int]
) -> CascadeLevels:
    """Two levels from a plain table: each group's shared prefix, then every request's rest.

    The requests of ``groups[g]`` share their first ``prefix_lens[g]`` tokens. The shared level
    takes the whole pages of that prefix (``prefix_lens[g] // page_size`` of them), after
    checking that every request of the group lists the same page numbers there; each request's
    own level is the rest of its row, from the page where the prefix ends (its copy-on-write copy
    of a partly filled last prefix page, if the prefix ends mid-page). Requests in no group keep
    their whole row as their own level. Host-side: reads the table.

    Args:
      page_table: the batch's plain table (concrete, e.g. the scheduler's host table), ``B`` rows.
      groups: each group's requests (batch indices); a request in at most one group.
      prefix_lens: each group's shared prefix in tokens, at most every member's length.

    Returns:
      ``CascadeLevels`` with one shared level (host NumPy arrays).

    Raises:
      ValueError: a traced table, an invalid table, ``groups`` and ``prefix_lens`` of different
        lengths, an empty group, a request outside the batch or in two groups, a negative
        prefix or one longer than a member's sequence, and a group whose requests do not list
        the same pages for its prefix (naming the group, the requests and the pages).

    Example:
      >>> table = PageTable.from_page_lists([[3, 1, 6], [3, 1, 8]], [40, 35], page_size=16)
      >>> levels = cascade_levels_from_shared_prefix(table, [[0, 1]], prefix_lens=[33])
      >>> levels.shared[0].group_pages.page_lists(), levels.own.page_lists()
      ([[3, 1]], [[6], [8]])
      >>> levels.own.seq_lens().tolist()  # the prefix's 33rd token lies on each own page
      [8, 3]
    """
    return cascade_levels_from_nested_prefixes(page_table, [(groups, prefix_lens)])


def cascade_levels_from_nested_prefixes(
    page_table: PageTable,
    prefix_levels: Sequence[tuple[Sequence[Sequence[int]], Sequence[int]]],
) -> CascadeLevels:
    """Any number of shared levels from a plain table: nested prefixes, outermost first.

    ``prefix_levels[i] = (groups, prefix_lens)``: the requests of ``groups[g]`` share their first
    ``prefix_lens[g]`` tokens (counted from the start of the sequence, so an inner prefix is at
    least as long as the outer one of its requests). Level ``i`` takes the whole pages from where
    the requests' level ``i - 1`` ended up to ``prefix_lens[g] // page_size``; every request of
    a group must reach level ``i`` at the same page and list the same page numbers there. The
    own level is the rest of each row. ``cascade_levels_from_shared_prefix`` is the one-level
    case.

    Args:
      page_table: the batch's plain table (concrete), ``B`` rows.
      prefix_levels: per shared level, its groups and their prefix lengths in tokens.

    Returns:
      ``CascadeLevels`` with ``len(prefix_levels)`` shared levels (host NumPy arrays).

    Raises:
      ValueError: as ``cascade_levels_from_shared_prefix``, naming the level, and for a group
        whose requests reach the level at different pages or whose prefix ends before the
        outer level's.

    Example:
      >>> table = PageTable.from_page_lists(
      ...     [[0, 1, 2], [0, 1, 3], [0, 4, 5]], [48, 40, 33], page_size=16
      ... )
      >>> levels = cascade_levels_from_nested_prefixes(
      ...     table, [([[0, 1, 2]], [16]), ([[0, 1]], [32])]
      ... )
      >>> [level.group_pages.page_lists() for level in levels.shared], levels.own.page_lists()
      ([[[0]], [[1]]], [[2], [3], [4, 5]])
    """
    if not is_concrete(page_table.page_indptr, page_table.page_indices, page_table.last_page_len):
        raise ValueError("page_table must be concrete (outside jit): its pages are read")
    validate_page_table(page_table, None)
    page_size = page_table.page_size
    page_lists = page_table.page_lists()
    seq_lens = [int(n) for n in np.asarray(page_table.seq_lens())]
    # Pages of each request taken by the levels built so far: the next level starts there.
    level_start_page = [0] * len(page_lists)
    shared = []
    for level, (groups, prefix_lens) in enumerate(prefix_levels):
        where = "" if len(prefix_levels) == 1 else f"prefix_levels[{level}]: "
        shared.append(
            _split_off_shared_level(
                page_lists, seq_lens, level_start_page, groups, prefix_lens, page_size, where
            )
        )
    own_lists = [pages[start:] for pages, start in zip(page_lists, level_start_page, strict=True)]
    own_lens = [n - start * page_size for n, start in zip(seq_lens, level_start_page, strict=True)]
    return CascadeLevels(tuple(shared), host_page_table(own_lists, own_lens, page_size))


def _is_index(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _split_off_shared_level(
    page_lists, seq_lens, level_start_page, groups, prefix_lens, page_size, where
) -> SharedLevel:
    """One shared level of ``cascade_levels_from_nested_prefixes``; advances
    ``level_start_page`` (in place) past the pages the level takes."""
    batch_size = len(page_lists)
    if len(groups) != len(prefix_lens):
        raise ValueError(
            f"{where}groups has {len(groups)} groups but prefix_lens has {len(prefix_lens)}"
        )
    group_of_request: dict[int, int] = {}
    group_page_lists, group_requests, group_indptr = [], [], [0]
    for g, (members, prefix_len) in enumerate(zip(groups, prefix_lens, strict=True)):
        members = list(members)
        if not members:
            raise ValueError(f"{where}groups[{g}] is empty: a group needs at least one request")
        for request in members:
            if not _is_index(request) or not 0 <= request < batch_size:
                raise ValueError(
                    f"{where}groups[{g}] lists request {request!r}, outside the batch of "
                    f"{batch_size} requests"
                )
            if request in group_of_request:
                raise ValueError(
                    f"{where}request {request} is in groups[{group_of_request[request]}] and "
                    f"groups[{g}]: a request belongs to at most one group of a level"
                )
            group_of_request[request] = g
        if not _is_index(prefix_len) or prefix_len < 0:
            raise ValueError(f"{where}prefix_lens[{g}] must be an int >= 0, got {prefix_len!r}")
        for request in members:
            if seq_lens[request] < prefix_len:
                raise ValueError(
                    f"{where}prefix_lens[{g}]={prefix_len} exceeds the {seq_lens[request]} "
                    f"tokens of request {request} in page_table"
                )
        first = members[0]
        start_page = level_start_page[first]
        for request in members[1:]:
            if level_start_page[request] != start_page:
                raise ValueError(
                    f"{where}the requests of groups[{g}] reach this level at different pages "
                    f"(request {first} at page {start_page}, request {request} at page "
                    f"{level_start_page[request]}): their outer prefixes differ"
                )
        # Whole pages only: a partly filled last prefix page stays in each request's own level.
        end_page = prefix_len // page_size
        if end_page < start_page:
            raise ValueError(
                f"{where}prefix_lens[{g}]={prefix_len} ends before the {start_page * page_size} "
                f"tokens that the outer levels already hold for request {first}"
            )
        shared_pages = page_lists[first][start_page:end_page]
        for request in members[1:]:
            pages = page_lists[request][start_page:end_page]
            for offset, (page, expected) in enumerate(zip(pages, shared_pages, strict=True)):
                if page != expected:
                    raise ValueError(
                        f"{where}groups[{g}] does not share its prefix: page "
                        f"{start_page + offset} of request {request} is {page} but of request "
                        f"{first} it is {expected} (page_table lists different pages for the "
                        f"first {prefix_len} tokens)"
                    )
        for request in members:
            level_start_page[request] = end_page
        group_page_lists.append(shared_pages)
        group_requests.extend(members)
        group_indptr.append(len(group_requests))
    requests = np.zeros(bucket_size(len(group_requests)), np.int32)
    requests[: len(group_requests)] = group_requests
    group_pages = host_page_table(
        group_page_lists, [len(pages) * page_size for pages in group_page_lists], page_size
    )
    return SharedLevel(group_pages, np.asarray(group_indptr, np.int32), requests)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _renamed(prefix: str, error: ValueError) -> ValueError:
    # validate_page_table names its argument "page_table"; say which level's table it was.
    return ValueError(str(error).replace("page_table", prefix))


def validate_cascade_levels(
    levels: CascadeLevels, num_pool_pages: int | None, *, batch_size: int | None = None
) -> None:
    """Checks the levels' shapes and dtypes always, and their values when they are concrete.

    Args:
      levels: the levels to check.
      num_pool_pages: pages in the KV pool (None skips the range check of page indices).
      batch_size: the batch the levels must describe (``q.shape[0]``), if known.

    Raises:
      TypeError: if ``levels`` is not a ``CascadeLevels`` or a shared level not a
        ``SharedLevel``.
      ValueError: naming the level, the argument and the bad value: an invalid page table,
        page sizes that differ between levels, a ``group_indptr`` of the wrong shape or dtype,
        not starting at 0, decreasing or past ``group_requests``, and (concrete) a request
        outside the batch or in two groups of one level.
    """
    if not isinstance(levels, CascadeLevels):
        raise TypeError(f"levels must be a CascadeLevels, got {type(levels).__name__}")
    if not isinstance(levels.shared, tuple):
        raise TypeError(f"levels.shared must be a tuple, got {type(levels.shared).__name__}")
    try:
        validate_page_table(levels.own, num_pool_pages, batch_size=batch_size)
    except ValueError as error:
        raise _renamed("levels.own", error) from error
    batch_size = levels.own.batch_size
    for i, level in enumerate(levels.shared):
        name = f"levels.shared[{i}]"
        if not isinstance(level, SharedLevel):
            raise TypeError(f"{name} must be a SharedLevel, got {type(level).__name__}")
        if level.group_pages.page_size != levels.own.page_size:
            raise ValueError(
                f"{name}.group_pages.page_size={level.group_pages.page_size} differs from "
                f"levels.own.page_size={levels.own.page_size}"
            )
        try:
            validate_page_table(level.group_pages, num_pool_pages)
        except ValueError as error:
            raise _renamed(f"{name}.group_pages", error) from error
        _validate_groups(name, level, batch_size)


def _validate_groups(name: str, level: SharedLevel, batch_size: int) -> None:
    for field in ("group_indptr", "group_requests"):
        array = getattr(level, field)
        if array.dtype != jnp.int32 or array.ndim != 1:
            raise ValueError(
                f"{name}.{field} must be a 1-D int32 array, got {array.dtype}{list(array.shape)}"
            )
    if level.group_indptr.shape[0] != level.num_groups + 1:
        raise ValueError(
            f"{name}.group_indptr has {level.group_indptr.shape[0]} entries but group_pages has "
            f"{level.num_groups} groups; it needs {level.num_groups + 1}"
        )
    if not is_concrete(level.group_indptr, level.group_requests):
        return
    indptr = np.asarray(level.group_indptr)
    num_members = level.group_requests.shape[0]
    check_csr_offsets(indptr, name, "group_indptr", "group_requests", num_members)
    members = np.asarray(level.group_requests)[: indptr[-1]]
    outside = (members < 0) | (members >= batch_size)
    if np.any(outside):
        i = int(np.argmax(outside))
        raise ValueError(
            f"{name}.group_requests[{i}]={members[i]} is outside the batch of {batch_size} requests"
        )
    values, counts = np.unique(members, return_counts=True)
    if np.any(counts > 1):
        request = int(values[np.argmax(counts > 1)])
        positions = np.flatnonzero(members == request)
        groups = (np.searchsorted(indptr, positions, side="right") - 1).tolist()
        raise ValueError(
            f"{name}.group_requests lists request {request} in groups {groups}: a request "
            "belongs to at most one group of a level"
        )


def _check_new_tokens_lie_in_own_level(levels: CascadeLevels, q_len: int) -> None:
    if not is_concrete(levels.own.page_indptr, levels.own.last_page_len):
        return
    own_lens = np.asarray(levels.own.seq_lens())
    # The new tokens must lie in the own level (every shared key then precedes them); an empty
    # own level may decode its last shared token alone, which sees every shared key too.
    bad = (own_lens < q_len) & ~((own_lens == 0) & (q_len == 1))
    if np.any(bad):
        b = int(np.argmax(bad))
        raise ValueError(
            f"request {b} has {own_lens[b]} tokens in levels.own, fewer than q's q_len={q_len} "
            "new tokens: the new tokens must lie in the request's own level (a shared level is "
            "visible in full to them); move the split point before them"
        )


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


def shared_level_state_reference(
    queries: jax.Array,
    cache: KVCache,
    level: SharedLevel,
    *,
    sm_scale: float,
    logits_soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Each request's partial state over its group's pages at one shared level (reference).

    The level's pages are gathered once; every request then attends to the tokens of its
    group's pages, all of them visible to all of its ``L`` query rows (they precede the new
    tokens). A request in no group gets the empty state.

    Args:
      queries: ``[B, L, H, D]``.
      cache: the KV pool.
      level: the shared level.
      sm_scale, logits_soft_cap: as in ``paged.decode_attention``.

    Returns:
      ``(o [B, L, H, D], lse [B, L, H])`` in the compute dtype (float32, or float64 for float64
      inputs); ``o = 0``, ``lse = -inf`` for a request with no keys at this level.
    """
    dtype = _compute_dtype(queries.dtype)
    batch, q_len, num_heads, head_dim = queries.shape
    num_kv_heads = cache.num_kv_heads
    group_size = num_heads // num_kv_heads
    pages = jnp.asarray(level.group_pages.page_indices)
    num_tokens = pages.shape[0] * cache.page_size
    if batch == 0 or level.num_groups == 0 or num_tokens == 0:
        return (
            jnp.zeros(queries.shape, dtype),
            jnp.full(queries.shape[:-1], -jnp.inf, dtype),
        )
    # [T, KVH, D]: every listed page of the level, token-major, read once for every group.
    k = cache.to_nhd(cache.k_pages[pages]).astype(dtype).reshape(num_tokens, num_kv_heads, -1)
    v = cache.to_nhd(cache.v_pages[pages]).astype(dtype).reshape(num_tokens, num_kv_heads, -1)
    group_tokens = token_mask(level.group_pages).reshape(level.num_groups, num_tokens)
    group = level.request_groups(batch)
    visible = (group >= 0)[:, None] & group_tokens[jnp.maximum(group, 0)]  # [B, T]
    q_grouped = queries.astype(dtype).reshape(batch, q_len, num_kv_heads, group_size, head_dim)

    def attend(request):
        q_b, visible_b = request  # [L, KVH, G, D], bool[T]
        every_row = jnp.broadcast_to(visible_b[None, :], (q_len, num_tokens))
        return attention_over_visible_keys(
            q_b, k, v, every_row, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap
        )

    o, lse = jax.lax.map(attend, (q_grouped, visible))
    return o.reshape(queries.shape), lse.reshape(queries.shape[:-1])


def cascade_decode_attention_reference(
    queries: jax.Array,
    cache: KVCache,
    levels: CascadeLevels,
    *,
    sm_scale: float,
    logits_soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The reference: every level's partial state, merged per request (``merge_states``).

    Args:
      queries: ``[B, L, H, D]``.

    Returns:
      ``(o [B, L, H, D], lse [B, L, H])`` in the compute dtype.
    """
    states = [
        shared_level_state_reference(
            queries, cache, level, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap
        )
        for level in levels.shared
    ]
    # The own level is plain decode: causal among the new tokens, which lie there.
    states.append(
        decode_attention_reference(
            queries, cache, levels.own, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap
        )
    )
    return _merge_levels(states)


# Compiled once per shape: run eagerly, the reference's lax.map bodies would be traced and
# compiled again on every call (they close over the gathered keys).
_cascade_decode_attention_reference_jit = jax.jit(
    cascade_decode_attention_reference, static_argnames=("sm_scale", "logits_soft_cap")
)


def _merge_levels(states):
    o = jnp.stack([state[0] for state in states], axis=2)  # [B, L, levels, H, D]
    lse = jnp.stack([state[1] for state in states], axis=2)  # [B, L, levels, H]
    return merge_states(o, lse)


def fold_new_tokens_into_heads(queries: jax.Array, num_kv_heads: int) -> jax.Array:
    """``[B, L, H, D] -> [B, KVH * L * G, D]``: the ``L`` new tokens as extra query heads.

    At a shared level no new token is masked, so the ``L x G`` rows of a KV head are one
    decode problem of ``L x G`` heads; ordering them KV head first keeps head ``i``'s KV head
    ``i // (L x G)``, the rule ``decode_attention`` applies.
    """
    batch, q_len, num_heads, head_dim = queries.shape
    group_size = num_heads // num_kv_heads
    by_kv_head = queries.reshape(batch, q_len, num_kv_heads, group_size, head_dim)
    return by_kv_head.transpose(0, 2, 1, 3, 4).reshape(batch, num_heads * q_len, head_dim)


def unfold_new_tokens(folded: jax.Array, q_len: int, num_kv_heads: int) -> jax.Array:
    """The inverse of ``fold_new_tokens_into_heads`` for outputs ``[B, KVH * L * G, D]`` and
    log-sum-exps ``[B, KVH * L * G]``: back to ``[B, L, H, D]`` and ``[B, L, H]``."""
    batch, rows = folded.shape[:2]
    trailing = folded.shape[2:]
    group_size = rows // (q_len * num_kv_heads)
    by_kv_head = folded.reshape(batch, num_kv_heads, q_len, group_size, *trailing)
    by_token = jnp.swapaxes(by_kv_head, 1, 2)
    return by_token.reshape(batch, q_len, num_kv_heads * group_size, *trailing)


def _cascade_decode_attention_per_level(queries, cache, levels, sm_scale, logits_soft_cap):
    """``backend="pallas"``, the Triton path: every level through the decode
    kernel, a shared level expanded to one row a request, the states merged by the reference
    merge (XLA fuses it; a few ``[B, L, H, D]`` float32 arrays).

    ``decode_attention`` returns each level's output in q's dtype, so with bfloat16 inputs
    every level's state is rounded to bfloat16 once before the merge (within the bfloat16
    bound); the Mosaic GPU path (``_cascade_decode_attention_mgpu``) hands over the shared
    levels' states in float32."""
    batch, q_len = queries.shape[:2]
    num_kv_heads = cache.num_kv_heads
    options = dict(
        sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, return_lse=True, backend="pallas"
    )
    states = []
    for level in levels.shared:
        table = level.per_request_page_table(batch)
        folded = fold_new_tokens_into_heads(queries, num_kv_heads)
        o, lse = decode_attention(folded, cache, table, **options)
        states.append(
            (
                unfold_new_tokens(o.astype(jnp.float32), q_len, num_kv_heads),
                unfold_new_tokens(lse, q_len, num_kv_heads),
            )
        )
    o, lse = decode_attention(queries, cache, levels.own, **options)
    states.append((o.astype(jnp.float32), lse))
    return _merge_levels(states)


@dataclasses.dataclass(frozen=True)
class CascadePlan:
    """A step's host plan of the ``pallas_mgpu`` cascade path (``plan_cascade_levels``): the
    shared levels' query tiles and work items and the own level's decode plan, computed once
    with NumPy and reused by every layer, so a call runs no planning ops on the device.

    ``shared``: one ``kernels_pallas.cascade_shared_mgpu.SharedLevelPlan`` per shared level
    (None for a level that attends to no key); ``own``: ``paged.plan_decode(levels.own, ...)``.
    Not to be confused with ``paged.cascade_plan.plan_cascade``, which decides which groups
    to cascade at all.
    """

    shared: tuple
    own: DecodePlan


jax.tree_util.register_dataclass(CascadePlan, data_fields=["shared", "own"], meta_fields=[])


def plan_cascade_levels(levels: CascadeLevels, q, cache: KVCache) -> CascadePlan:
    """Plans ``cascade_decode_attention(q, cache, levels, backend="pallas_mgpu")`` on the host.

    Args:
      levels: the step's ``CascadeLevels`` with concrete (host) arrays.
      q: the queries, or anything with their ``shape`` and ``dtype`` (``[B, H, D]`` or
        ``[B, L, H, D]``); only the shape and dtype are read.
      cache: the KV pool (only its shape and dtype are read).

    Returns:
      A ``CascadePlan`` for this batch, head layout and the levels as they are now.

    Raises:
      TypeError: ``levels`` is not a ``CascadeLevels``.
      ValueError: traced levels, or what ``paged.plan_decode`` refuses for the own level.

    Example:
      >>> from paged import new_kv_cache
      >>> cache = new_kv_cache(8, 16, 2, 64, jnp.bfloat16)
      >>> table = PageTable.from_page_lists([[0, 1, 2], [0, 1, 3]], [40, 38], page_size=16)
      >>> levels = cascade_levels_from_shared_prefix(table, [[0, 1]], prefix_lens=[32])
      >>> q = jnp.ones((2, 8, 64), jnp.bfloat16)
      >>> plan = plan_cascade_levels(levels, q, cache)
      >>> len(plan.shared), plan.shared[0].num_tiles
      (1, 1)
    """
    # Imported here: kernels_pallas.cascade_shared_mgpu imports this module (its level types).
    from kernels_pallas import cascade_shared_mgpu

    if not isinstance(levels, CascadeLevels):
        raise TypeError(f"levels must be a CascadeLevels, got {type(levels).__name__}")
    batch, num_q_heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    q_len = q.shape[1] if len(q.shape) == 4 else 1
    interpret = interpret_mode()
    shared = tuple(
        cascade_shared_mgpu.plan_shared_level(
            level,
            batch=batch,
            q_len=q_len,
            num_q_heads=num_q_heads,
            num_kv_heads=cache.num_kv_heads,
            head_dim=head_dim,
            dtype=q.dtype,
            page_size=cache.page_size,
            probs_in_smem=interpret,  # as _cascade_decode_attention_mgpu launches it
            **CASCADE_SHARED_MGPU_LAUNCH,
        )
        for level in levels.shared
    )
    # The plan decode_attention makes itself for a concrete own level, made here once.
    own = plan_decode(levels.own, num_q_heads, cache.num_kv_heads, head_dim)
    return CascadePlan(shared=shared, own=own)


def _check_cascade_plan(plan, levels: CascadeLevels) -> None:
    if not isinstance(plan, CascadePlan):
        raise TypeError(f"plan must be a CascadePlan or None, got {type(plan).__name__}")
    if len(plan.shared) != len(levels.shared):
        raise ValueError(
            f"plan has {len(plan.shared)} shared level plans, levels has "
            f"{len(levels.shared)} shared levels"
        )


def _cascade_decode_attention_mgpu(queries, cache, levels, sm_scale, logits_soft_cap, plan=None):
    """``backend="pallas_mgpu"``: every shared level through the Mosaic GPU shared-level kernel
    (a group's pages read once per 64-row tile of its requests' query rows), the own level
    through the Mosaic GPU decode kernel, the states merged by the reference merge.

    The shared levels' states stay float32 up to the merge; the own level's output is
    ``decode_attention``'s, in q's dtype, so it is rounded once (within the 16-bit bound)."""
    # Imported here: kernels_pallas.cascade_shared_mgpu imports this module (its level types).
    from kernels_pallas import cascade_shared_mgpu

    interpret = interpret_mode()
    states = []
    for index, level in enumerate(levels.shared):
        try:
            states.append(
                cascade_shared_mgpu.shared_level_states_mgpu(
                    queries,
                    cache,
                    level,
                    sm_scale=sm_scale,
                    logits_soft_cap=logits_soft_cap,
                    probs_in_smem=interpret,
                    interpret=interpret,
                    plan=None if plan is None else plan.shared[index],
                    **CASCADE_SHARED_MGPU_LAUNCH,
                )
            )
        except ValueError as error:  # name the plan's field as the caller passed it
            raise ValueError(str(error).replace("plan was", f"plan.shared[{index}] was")) from error
    try:
        o, lse = decode_attention(
            queries,
            cache,
            levels.own,
            sm_scale=sm_scale,
            logits_soft_cap=logits_soft_cap,
            return_lse=True,
            plan=None if plan is None else plan.own,
            backend=MOSAIC_GPU_BACKEND,
        )
    except ValueError as error:
        if plan is None:
            raise
        raise ValueError(f"plan.own does not fit levels.own: {error}") from error
    states.append((o.astype(jnp.float32), lse))
    return _merge_levels(states)


def cascade_decode_attention(
    q: jax.Array,
    cache: KVCache,
    levels: CascadeLevels,
    *,
    sm_scale: float | None = None,
    logits_soft_cap: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    plan: CascadePlan | None = None,
):
    """Decode attention over keys split into cascade levels (shared prefixes, then own pages).

    Equals ``paged.decode_attention`` over each request's whole sequence (its groups' pages,
    level by level, then its own pages): each level gives every request a partial state, and the
    states merge exactly (``proofs/merge_states.md``, Theorem 4). What changes is what is read:
    a shared level's pages belong to a group, so a kernel can read them once for all of the
    group's query rows (the point of cascade attention) rather than once per request.

    ``q`` holds each request's last ``L`` tokens (``[B, H, D]`` for ``L = 1``, or
    ``[B, L, H, D]`` for a verification step), causal among themselves as in
    ``paged.decode_attention``. They must lie in the request's own level (a request whose own
    level is empty may decode one token, its last shared one): every shared level is then
    visible to every new token in full, and only the own level is masked. GQA, both layouts,
    the soft cap and the log-sum-exp (natural log, ``-inf`` for a request with no keys) are
    those of ``paged.decode_attention``.

    Backends, chosen when the function is traced (``kernels_pallas.platform``); every one
    merges the levels' states by the reference merge (``paged.merge_states``):

    - ``"reference"`` computes every level with the reference.
    - ``"pallas"`` (and ``"auto"`` on a GPU) runs every level through
      ``paged.decode_attention``'s Triton kernels: the own level as plain decode, a shared level
      as decode over one row a request (``SharedLevel.per_request_page_table``, the ``L`` new
      tokens folded into query heads), which reads a group's pages once per request, like plain
      decode, and hands over each level's output rounded to q's dtype. The fallback where
      cascade does not pay.
    - ``"pallas_mgpu"``, asked for by name only, runs the Mosaic GPU kernels: a shared level
      through ``kernels_pallas.cascade_shared_mgpu`` (the query rows of a group's requests in
      64-row tiles, 16 requests a tile at ``G = 4``, ``L = 1``; the group's pages read once per
      tile rather than once per request; float32 states), the own level through
      ``paged.decode_attention(backend="pallas_mgpu")``. Interpreted on a CPU. Not chosen by
      ``"auto"`` until its crossover with ``"pallas"`` is measured on the H200; it refuses,
      with a ``ValueError`` naming the reason, what the Mosaic GPU decode kernel refuses (an
      ``NHD`` cache, a page size other than 16, dtypes other than bfloat16 and float16,
      ``head_dim`` other than 64 and 128, more than 8 query heads a KV head, a longer ``L``
      than its tile holds).

    ``DECODELAB_BACKEND=reference`` turns ``"auto"`` into the reference; a kernel asked for by
    name runs under it, as in ``paged.decode_attention``.

    Under ``jit`` the levels' values cannot be checked (``docs/invalid_input.md``): a request
    listed in two groups of a level attends to one of them, members outside the batch are
    ignored, and a request with fewer than ``L`` own tokens still sees every shared key with
    every new token (its earliest new tokens then see keys after them).

    Args:
      q: ``[B, H, D]`` or ``[B, L, H, D]`` queries, in the cache's dtype.
      cache: the KV pool (``HND`` or ``NHD``).
      levels: the batch's ``CascadeLevels`` (``B`` rows in ``levels.own``), e.g. from
        ``cascade_levels_from_shared_prefix``.
      sm_scale: logit scale, a Python float (static); default ``1 / sqrt(D)``.
      logits_soft_cap: optional cap ``> 0``, a Python float (static).
      return_lse: also return the log-sum-exp.
      backend: ``"auto"``, ``"reference"``, ``"pallas"`` or ``"pallas_mgpu"`` (see above).
      plan: the step's ``CascadePlan`` (``plan_cascade_levels``, on the host, once a step), used
        by ``"pallas_mgpu"`` only, which then computes no tile layout, work items or own-level
        plan on the device; other backends check its type and level count and ignore it.

    Returns:
      ``o`` shaped like ``q`` in q's dtype, and with ``return_lse=True`` also ``lse`` float32
      ``[B, H]`` or ``[B, L, H]`` (natural log); a request with no keys at any level gets
      ``o = 0``, ``lse = -inf``.

    Raises:
      TypeError: ``levels`` is not a ``CascadeLevels``, ``plan`` not a ``CascadePlan``.
      ValueError: a plan for another number of levels, or (``"pallas_mgpu"``) another batch,
        head layout or own level, naming ``plan.shared[i]`` or ``plan.own``; what
        ``paged.decode_attention`` refuses for ``q``, the cache and the own
        level (with ``backend="pallas_mgpu"``, the shapes its kernels cannot run); invalid
        shared levels (``validate_cascade_levels``); page sizes that differ from
        the cache's; and (concrete levels) a request whose own level holds fewer than ``L``
        tokens (but for ``L = 1`` and an empty own level).

    Example:
      >>> from paged import new_kv_cache
      >>> cache = new_kv_cache(8, 4, 2, 16, jnp.float32)
      >>> table = PageTable.from_page_lists([[0, 1, 2], [0, 1, 3, 4]], [12, 14], page_size=4)
      >>> levels = cascade_levels_from_shared_prefix(table, [[0, 1]], prefix_lens=[9])
      >>> q = jnp.ones((2, 3, 4, 16))  # three new tokens a request, 4 query heads
      >>> o, lse = cascade_decode_attention(q, cache, levels, return_lse=True)
      >>> o.shape, lse.shape
      ((2, 3, 4, 16), (2, 3, 4))
    """
    logits_soft_cap = _static_float("logits_soft_cap", logits_soft_cap)
    sm_scale = _static_float("sm_scale", sm_scale)
    if not isinstance(levels, CascadeLevels):
        raise TypeError(f"levels must be a CascadeLevels, got {type(levels).__name__}")
    # q, the cache and the own level: exactly what plain decode checks.
    try:
        validate_decode_inputs(q, cache, levels.own, logits_soft_cap)
    except ValueError as error:
        raise _renamed("levels.own", error) from error
    validate_cascade_levels(levels, cache.num_pages, batch_size=q.shape[0])
    if plan is not None:
        _check_cascade_plan(plan, levels)
    queries = q[:, None] if q.ndim == 3 else q  # [B, L, H, D]
    _check_new_tokens_lie_in_own_level(levels, queries.shape[1])
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    mosaic_gpu = backend == MOSAIC_GPU_BACKEND
    if mosaic_gpu:  # asked for by name: the kernels, or an error saying why they cannot run
        # The own level's decode kernel takes fewer shapes than the shared-level kernel (at most
        # 8 query heads a KV head, q_len x G rows in one tile), so its limits are the path's.
        unsupported = mgpu_kernel_supports(q, cache)
        if unsupported:
            raise ValueError(
                f"backend={MOSAIC_GPU_BACKEND!r} cannot run cascade_decode_attention here: "
                f"{unsupported}"
            )
        # An explicit kernel, as decode_attention's "pallas_mgpu": obeyed under the kill switch.
        chosen = choose_backend(
            "cascade_decode_attention", "pallas", kernel="cascade_shared_mgpu"
        ).backend
    else:
        chosen = choose_backend(
            "cascade_decode_attention",
            backend,
            unsupported=kernel_supports(q, cache),
            kernel="paged_decode",
        ).backend
    if chosen == "reference":
        o, lse = _cascade_decode_attention_reference_jit(
            queries, cache, levels, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap
        )
    elif mosaic_gpu:
        o, lse = _cascade_decode_attention_mgpu(
            queries, cache, levels, sm_scale, logits_soft_cap, plan
        )
    else:
        o, lse = _cascade_decode_attention_per_level(
            queries, cache, levels, sm_scale, logits_soft_cap
        )
    o = o.reshape(q.shape).astype(q.dtype)
    lse = lse.reshape(q.shape[:-1]).astype(jnp.float32)
    return (o, lse) if return_lse else o
