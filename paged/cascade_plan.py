"""Cascade planning: which requests of a decode batch share their leading pages, and whether
reading those pages once per group (``paged.cascade_decode_attention``) pays.

The engine's scheduler shares a common prompt's full pages between requests by reference count:
every request admitted with that prompt lists the same page numbers at the start of its row.
The planner reads a step's concrete (host) page table and finds those runs:

- A group is the requests whose first page is one page number; its shared prefix is the longest
  run of identical page numbers at the start of every member's row. Whole pages only: a page is
  shared only if every member also holds at least ``q_len`` tokens after it, so the new tokens
  lie in each request's own level (``cascade_decode_attention``'s contract) and a partly filled
  page, where a request's own tokens follow, is never shared. A group needs two requests; rows
  not ``active`` (the engine's phantom rows on the padding page) join none.
- Nested prefixes (requests sharing page 0, some of them also page 1) become one group with the
  run all of them share: two levels only, though ``CascadeLevels`` would take more.
- ``CascadeCrossover`` says which groups pay (group size, prefix pages); ``CASCADE_CROSSOVER``
  is the rule measured on the H200 (groups of 16 or more sharing 256 pages or more); None would
  mean never chosen automatically (the issue's rule: chosen only where measured to pay).

The levels have fixed shapes for a batch size and a table bucket, so a jitted step compiles once
for them: the shared level has ``max_groups`` rows (``B // 2`` by default; unused rows are empty
groups with no requests), its requests array ``B`` entries, and both levels' ``page_indices``
the table's own padded length (``num_indices``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from kernels_pallas.platform import is_concrete
from paged.cascade import CascadeLevels, SharedLevel
from paged.page_table import PageTable, validate_page_table


@dataclasses.dataclass(frozen=True)
class CascadeCrossover:
    """Where cascade attention starts to pay: a group of at least ``min_group_size`` requests
    sharing at least ``min_prefix_pages`` whole pages.

    The values come from the H200 probe ``bench/probes/cascade_shared.py`` (its last lines say,
    per group size, from which prefix the cascade arm beats plain decode); a rule not read from
    that probe's report is a guess, and ``CASCADE_CROSSOVER`` must not hold one.

    Attributes:
      min_group_size: requests a group needs, ``>= 2`` (a group of one reads its pages once
        either way).
      min_prefix_pages: whole shared pages a group needs, ``>= 1``.

    Raises:
      ValueError: a value that is not an int in range, naming the field.

    Example:
      >>> rule = CascadeCrossover(min_group_size=8, min_prefix_pages=16)
      >>> rule.pays(group_size=32, prefix_pages=64), rule.pays(group_size=4, prefix_pages=64)
      (True, False)
    """

    min_group_size: int
    min_prefix_pages: int

    def __post_init__(self):
        for name, minimum in (("min_group_size", 2), ("min_prefix_pages", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name} must be an int, got {value!r}")
            if value < minimum:
                raise ValueError(f"{name} must be >= {minimum}, got {value}")

    def pays(self, group_size: int, prefix_pages: int) -> bool:
        """Whether a group of ``group_size`` requests sharing ``prefix_pages`` pages is worth a
        shared level."""
        return group_size >= self.min_group_size and prefix_pages >= self.min_prefix_pages


# The measured crossover (CascadeCrossover), or None (not measured: cascade is never chosen
# automatically). Measured on the H200 at 7ca362c (bench/probes/cascade_shared.py,
# docs/benchmark_results/archive/2026-12-02-cascade-shared-probe.md): the Mosaic GPU cascade
# path beat plain decode from 16 requests sharing 4096 tokens (1.07x; 32 x 4096: 1.64x; 128 x
# 32768: 8.2x) and lost in every group of 8 or fewer and at 1024 tokens or less but for 128
# requests (0.37x to 0.79x; 128 x 1024: 1.36x, declined here: two thresholds cannot admit it
# without admitting 32 x 1024 at 0.64x). tests/test_cascade_plan.py checks the rule against that
# JSON: every case it admits paid.
CASCADE_CROSSOVER: CascadeCrossover | None = CascadeCrossover(
    min_group_size=16, min_prefix_pages=256
)

# Any group of two sharing a page: the engine's cascade="on" (tests, and measuring cascade where
# the crossover says it does not pay).
ANY_SHARED_PAGE = CascadeCrossover(min_group_size=2, min_prefix_pages=1)


class SharedPrefixGroup(NamedTuple):
    """Requests of a batch whose rows start with the same pages.

    Attributes:
      requests: the group's batch rows, ascending (at least two).
      pages: the page numbers every member lists first, in order (at least one).
    """

    requests: tuple[int, ...]
    pages: tuple[int, ...]


def find_shared_prefix_groups(
    page_table: PageTable, *, q_len: int = 1, active=None
) -> list[SharedPrefixGroup]:
    """The groups of requests whose rows start with the same pages (module docstring).

    Args:
      page_table: the step's table, concrete (host arrays, e.g. the scheduler's), ``B`` rows.
      q_len: new tokens a request (``L``): a page is shared only if every member holds at
        least ``q_len`` tokens after it.
      active: bool[B], rows that may join a group (None: all).

    Returns:
      The groups, ordered by their first member; groups of one are never formed.

    Raises:
      TypeError: ``page_table`` is not a ``PageTable``.
      ValueError: a traced or invalid ``page_table``, ``q_len`` not an int ``>= 1``,
        ``active`` not a bool array of ``B`` entries (naming the argument).

    Example:
      >>> table = PageTable.from_page_lists(
      ...     [[3, 4, 5], [3, 4, 6], [7], [3, 4, 8]], [40, 33, 5, 35], page_size=16
      ... )
      >>> find_shared_prefix_groups(table)
      [SharedPrefixGroup(requests=(0, 1, 3), pages=(3, 4))]
    """
    rows = _host_rows(page_table)
    return _find_groups(rows, page_table.page_size, _check_q_len(q_len), active)


def _find_groups(rows, page_size: int, q_len: int, active) -> list[SharedPrefixGroup]:
    """``find_shared_prefix_groups`` on ``_host_rows``' arrays (read once a step)."""
    indptr, indices, _ = rows
    shareable = _shareable(rows, page_size, q_len, active)
    return [
        SharedPrefixGroup(tuple(group.requests.tolist()), tuple(group.pages.tolist()))
        for group in _groups(indptr, indices, shareable)
    ]


class _Group(NamedTuple):
    """A ``SharedPrefixGroup`` as arrays (``requests`` ascending rows, ``pages`` int32): the
    planner keeps them so, as Python tuples of a long prefix's pages cost 100 us a step."""

    requests: np.ndarray
    pages: np.ndarray


def _shareable(rows, page_size: int, q_len: int, active) -> np.ndarray:
    """int64[B]: the whole pages each row can share (at least ``q_len`` of its tokens after
    them; 0 for rows not ``active``): all that groups depend on besides the pages."""
    indptr, _, seq_lens = rows
    active = _check_active(active, len(seq_lens))
    # np.minimum and np.maximum in place, not np.clip: the same values without clip's Python
    # wrappers (this runs every decode step of a cascading engine).
    shareable = (seq_lens - q_len) // page_size
    np.minimum(shareable, indptr[1:] - indptr[:-1], out=shareable)
    np.maximum(shareable, 0, out=shareable)
    shareable[~active] = 0
    return shareable


def _groups(indptr: np.ndarray, indices: np.ndarray, shareable: np.ndarray) -> list[_Group]:
    """The groups (module docstring) of rows that can share ``shareable`` pages, ordered by
    their first member."""
    candidates = np.flatnonzero(shareable > 0)
    if candidates.size < 2:
        return []
    first_pages = indices[indptr[candidates]]
    groups = []
    for first_page in np.unique(first_pages):
        members = candidates[first_pages == first_page]
        if members.size < 2:
            continue
        longest = int(shareable[members].min())
        # [members, longest]: each member's first pages; the prefix ends at the first column
        # where any member differs from the first.
        leading = indices[indptr[members][:, None] + np.arange(longest)[None, :]]
        same = np.all(leading == leading[0], axis=0)
        prefix_pages = longest if same.all() else int(np.argmin(same))
        groups.append(_Group(members, leading[0, :prefix_pages]))
    return sorted(groups, key=lambda group: int(group.requests[0]))


def plan_cascade(
    page_table: PageTable,
    crossover: CascadeCrossover | None,
    *,
    q_len: int = 1,
    active=None,
    max_groups: int | None = None,
    num_indices: int | None = None,
) -> CascadeLevels | None:
    """Two cascade levels for a step (the groups ``crossover`` says pay, then each request's own
    pages), or None where no group pays.

    Args:
      page_table: the step's table, concrete (host arrays), ``B`` rows.
      crossover: which groups pay; None: none (``CASCADE_CROSSOVER`` is the measured rule).
      q_len: new tokens a request (``L``); they stay in each request's own level.
      active: bool[B], rows that may join a group (None: all).
      max_groups: rows of the shared level, a static shape (default ``B // 2``, every group
        possible); where more groups pay, those that save the most page reads are kept.
      num_indices: static length of both levels' ``page_indices`` (default the table's own
        padded length, which holds every page either level can list).

    Returns:
      ``CascadeLevels`` of host NumPy arrays (``levels.shared`` one ``SharedLevel``), or None.

    Raises:
      TypeError: ``page_table`` not a ``PageTable``, ``crossover`` not a ``CascadeCrossover``
        or None.
      ValueError: as ``find_shared_prefix_groups``; ``max_groups`` or ``num_indices`` not an
        int ``>= 0``, or ``num_indices`` below the pages the table lists (naming the argument).

    Example:
      >>> table = PageTable.from_page_lists([[3, 4, 5], [3, 4, 6]], [40, 33], page_size=16)
      >>> levels = plan_cascade(table, ANY_SHARED_PAGE)
      >>> levels.shared[0].group_pages.page_lists(), levels.own.page_lists()
      ([[3, 4]], [[5], [6]])
      >>> plan_cascade(table, None) is None
      True
    """
    return _plan(page_table, crossover, q_len, active, max_groups, num_indices, None)


class CascadePlanCache:
    """``plan_cascade`` for the steps of one batch, each step's levels reusing the last step's
    where nothing they depend on changed (the serving engine's cascade decision, once a decode
    step: ``serving/cascade_step.py``).

    Why: a step's groups, shared level and each row's own pages change only when a request
    joins or leaves a group, a row gains a page, or a row's shareable pages change (its
    length crossing a page, a request admitted, finished or preempted); between those steps
    only each row's ``last_page_len`` moves. Planning 32 requests sharing 256 pages from
    scratch cost about 270 us of host time a step on a CPU, most of it rebuilding what the
    step before built.

    Exact by construction, not by invalidation: the cache key is every input the levels depend
    on but the lengths within each row's last page (the page size, ``crossover``, ``q_len``,
    ``max_groups``, ``num_indices``, the table's ``page_indptr`` and listed ``page_indices``,
    ``active``, and ``(last_page_len - q_len) // page_size``, which with ``page_indptr`` fixes
    each row's shareable pages: ``_cache_key``). A step whose key equals the last one's gets the
    last levels with its own ``last_page_len`` in the own level (after checking those lengths,
    the only part of its table not validated with the key); a step whose key differs is planned
    from scratch, validated, and kept. So ``plan`` returns what ``plan_cascade`` returns, value
    for value and error for error, whatever the sequence of tables
    (``tests/test_cascade_plan.py``); a request joining or leaving a group, a row gaining a
    page, a preempted request readmitted on other pages all change the key. The arrays it
    reuses are read-only, so no caller can change a later step's levels through an earlier
    step's. ``hits`` and ``misses`` count the calls it answered from the kept key and those it
    planned (calls it cannot key, without a crossover or with arguments ``plan_cascade``
    refuses, count in neither).

    Example:
      >>> cache = CascadePlanCache()
      >>> table = PageTable.from_page_lists([[3, 4, 5], [3, 4, 6]], [40, 33], page_size=16)
      >>> first = cache.plan(table, ANY_SHARED_PAGE)
      >>> grown = PageTable.from_page_lists([[3, 4, 5], [3, 4, 6]], [41, 34], page_size=16)
      >>> again = cache.plan(grown, ANY_SHARED_PAGE)
      >>> again.shared is first.shared, again.own.seq_lens().tolist()
      (True, [9, 2])
    """

    def __init__(self):
        self._key = None
        self._has_pages = None  # bool[B]: rows of the kept key's table that list a page
        # (shared levels, own page_indptr, own page_indices) of the last key, or None where
        # no group paid.
        self._value = None
        self.hits = 0
        self.misses = 0

    def plan(
        self,
        page_table: PageTable,
        crossover: CascadeCrossover | None,
        *,
        q_len: int = 1,
        active=None,
        max_groups: int | None = None,
        num_indices: int | None = None,
    ) -> CascadeLevels | None:
        """``plan_cascade(page_table, crossover, ...)``, the same value and errors (class
        docstring)."""
        return _plan(page_table, crossover, q_len, active, max_groups, num_indices, self)


def _plan(page_table, crossover, q_len, active, max_groups, num_indices, cache):
    """``plan_cascade``, through ``cache`` (a ``CascadePlanCache``) when one is given."""
    if crossover is not None and not isinstance(crossover, CascadeCrossover):
        raise TypeError(
            f"crossover must be a CascadeCrossover or None, got {type(crossover).__name__}"
        )
    key = None
    if cache is not None:
        key = _cache_key(page_table, crossover, q_len, active, max_groups, num_indices)
        if key is not None and key == cache._key:
            last = np.asarray(page_table.last_page_len)
            # The table's pages are those of a table validated when the key was kept; only
            # its lengths are new (a bad one goes the long way, which names it).
            bad = np.where(cache._has_pages, (last < 1) | (last > page_table.page_size), last != 0)
            if not bad.any():
                cache.hits += 1
                if cache._value is None:
                    return None
                shared, own_indptr, own_indices = cache._value
                return CascadeLevels(shared, _own_table(page_table, own_indptr, own_indices))
    rows = _host_rows(page_table)
    indptr, indices, _ = rows
    shareable = _shareable(rows, page_table.page_size, _check_q_len(q_len), active)
    batch_size = page_table.batch_size
    max_groups = _check_size("max_groups", batch_size // 2 if max_groups is None else max_groups)
    table_size = page_table.page_indices.shape[0]
    num_indices = _check_size("num_indices", table_size if num_indices is None else num_indices)
    listed = int(indptr[-1])
    if num_indices < listed:
        raise ValueError(f"num_indices={num_indices} is below the {listed} pages page_table lists")
    if crossover is None:
        return None
    levels = None
    paying = [g for g in _groups(indptr, indices, shareable) if _pays(crossover, g)]
    if paying and max_groups > 0:
        if len(paying) > max_groups:  # keep the groups that save the most page reads
            saved = lambda g: (len(g.requests) - 1) * len(g.pages)
            kept = set(sorted(range(len(paying)), key=lambda i: -saved(paying[i]))[:max_groups])
            paying = [g for i, g in enumerate(paying) if i in kept]
        levels = _levels_of(page_table, rows, paying, max_groups, num_indices)
    if key is not None:
        cache.misses += 1
        cache._key = key
        cache._has_pages = indptr[1:] > indptr[:-1]
        cache._value = None
        if levels is not None:
            for leaf in [*_leaves(levels.shared), levels.own.page_indptr, levels.own.page_indices]:
                leaf.flags.writeable = False
            cache._value = (levels.shared, levels.own.page_indptr, levels.own.page_indices)
    return levels


def _cache_key(page_table, crossover, q_len, active, max_groups, num_indices):
    """``CascadePlanCache``'s key of a call (its class docstring), read from the arrays as
    given, before any check of the table; None for a call the cache leaves alone (no crossover,
    or arguments ``plan_cascade`` refuses: it raises then, as without a cache).

    Complete: a row's shareable pages (``_shareable``) are ``0`` without pages or when not
    ``active``, else ``num_pages - 1 + (last_page_len - q_len) // page_size`` clipped to
    ``[0, num_pages]``, so ``page_indptr``, ``active`` and ``(last_page_len - q_len) //
    page_size`` fix them; the groups and levels follow from those, the listed pages, the
    crossover and the shapes. The lengths themselves move every step and are not in it."""
    if crossover is None or not isinstance(page_table, PageTable):
        return None
    arrays = (page_table.page_indptr, page_table.page_indices, page_table.last_page_len)
    page_size = page_table.page_size
    if not is_concrete(*arrays) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
        return None
    indptr, indices, last = (np.asarray(array) for array in arrays)
    if (
        indptr.ndim != 1
        or indices.ndim != 1
        or last.ndim != 1
        or indptr.shape[0] != last.shape[0] + 1
        or isinstance(q_len, bool)
        or not isinstance(q_len, (int, np.integer))
        or q_len < 1
    ):
        return None
    batch_size = last.shape[0]
    if active is None:
        active = np.ones(batch_size, bool)
    active = np.asarray(active)
    if active.dtype != np.bool_ or active.shape != (batch_size,):
        return None
    for size in (max_groups, num_indices):
        if size is not None and (
            isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0
        ):
            return None
    return (
        page_size,
        crossover,
        q_len,
        max_groups,
        num_indices,
        indptr.dtype.str,
        indices.dtype.str,
        last.dtype.str,
        indices.shape[0],
        indptr.tobytes(),
        indices[: max(int(indptr[-1]), 0)].tobytes(),
        active.tobytes(),
        ((last - q_len) // page_size).tobytes(),
    )


def _pays(crossover: CascadeCrossover, group: _Group) -> bool:
    return crossover.pays(len(group.requests), len(group.pages))


def _leaves(shared_levels) -> list[np.ndarray]:
    """Every array of ``shared_levels`` (host levels ``_levels_of`` built)."""
    return [
        array
        for level in shared_levels
        for array in (
            level.group_pages.page_indptr,
            level.group_pages.page_indices,
            level.group_pages.last_page_len,
            level.group_indptr,
            level.group_requests,
        )
    ]


def _own_table(page_table: PageTable, own_indptr, own_indices) -> PageTable:
    """The own level: each row's pages after its group's, its last page the row's last page (a
    member keeps ``q_len >= 1`` tokens after the prefix), so the row's ``last_page_len``."""
    return PageTable(
        own_indptr,
        own_indices,
        np.asarray(page_table.last_page_len, np.int32).copy(),
        page_table.page_size,
    )


def levels_without_groups(
    page_table: PageTable, max_groups: int, num_indices: int | None = None
) -> CascadeLevels:
    """``plan_cascade``'s shapes with no group: ``max_groups`` empty shared rows, each request's
    whole row its own level (so equal to plain decode). A block of steps stacks it for a step
    where no group pays.

    Example:
      >>> table = PageTable.from_page_lists([[3, 4], [5]], [20, 7], page_size=16)
      >>> levels = levels_without_groups(table, 1)
      >>> levels.own.page_lists(), levels.shared[0].group_pages.page_lists()
      ([[3, 4], [5]], [[]])
    """
    rows = _host_rows(page_table)
    table_size = page_table.page_indices.shape[0]
    num_indices = _check_size("num_indices", table_size if num_indices is None else num_indices)
    return _levels_of(page_table, rows, [], _check_size("max_groups", max_groups), num_indices)


class CascadeSummary(NamedTuple):
    """What a step's cascade levels share (for reports).

    Attributes:
      num_groups: groups with at least one request.
      num_requests: requests in a group.
      largest_group: requests of the largest group.
      shared_pages: pages the shared level lists (each read once per group).
    """

    num_groups: int
    num_requests: int
    largest_group: int
    shared_pages: int


def summarize_levels(levels: CascadeLevels) -> CascadeSummary:
    """The groups and pages of ``levels``' shared levels (host arrays; a stacked ``[K, ...]``
    set of levels, as ``serving.programs.decode_steps`` takes, is summarized by its first
    step)."""
    num_groups = num_requests = largest = pages = 0
    for level in levels.shared:
        group_indptr = np.asarray(level.group_indptr)
        page_indptr = np.asarray(level.group_pages.page_indptr)
        if group_indptr.ndim == 2:
            group_indptr, page_indptr = group_indptr[0], page_indptr[0]
        sizes = np.diff(group_indptr)
        num_groups += int(np.count_nonzero(sizes))
        num_requests += int(sizes.sum())
        largest = max(largest, int(sizes.max(initial=0)))
        pages += int(page_indptr[-1])
    return CascadeSummary(num_groups, num_requests, largest, pages)


# --------------------------------------------------------------------------------------------


def _levels_of(page_table, rows, groups: list[_Group], max_groups, num_indices) -> CascadeLevels:
    """The two levels of ``groups`` (each member's first ``len(pages)`` pages shared), padded to
    ``max_groups`` shared rows and ``num_indices`` pages a level."""
    page_size = page_table.page_size
    indptr, indices, _ = rows
    batch_size = len(indptr) - 1
    # The shared level: one row a group, then empty rows (no pages, no requests).
    group_sizes = np.zeros(max_groups, np.int32)
    group_page_counts = np.zeros(max_groups, np.int32)
    group_sizes[: len(groups)] = [len(g.requests) for g in groups]
    group_page_counts[: len(groups)] = [len(g.pages) for g in groups]
    group_indptr = np.concatenate([[0], np.cumsum(group_sizes)]).astype(np.int32)
    group_requests = np.zeros(batch_size, np.int32)
    group_page_indptr = np.concatenate([[0], np.cumsum(group_page_counts)]).astype(np.int32)
    group_page_indices = np.zeros(num_indices, np.int32)
    skipped = np.zeros(batch_size, np.int32)
    if groups:
        members = np.concatenate([g.requests for g in groups])
        group_requests[: members.size] = members
        shared_pages = np.concatenate([g.pages for g in groups])
        group_page_indices[: shared_pages.size] = shared_pages
        # Each member skips its group's pages in its own level.
        skipped[members] = np.repeat(group_page_counts[: len(groups)], group_sizes[: len(groups)])
    shared = SharedLevel(
        PageTable(
            group_page_indptr,
            group_page_indices,
            np.where(group_page_counts > 0, page_size, 0).astype(np.int32),
            page_size,
        ),
        group_indptr,
        group_requests,
    )
    # The own level: each row after its group's pages (the whole row outside a group).
    counts = indptr[1:] - indptr[:-1]
    own_counts = counts - skipped
    own_indptr = np.concatenate([[0], np.cumsum(own_counts)]).astype(np.int32)
    # Source position of every own page: its row's start, past the skipped pages.
    source = np.repeat(indptr[:-1] + skipped - own_indptr[:-1], own_counts) + np.arange(
        own_indptr[-1]
    )
    own_indices = np.zeros(num_indices, np.int32)
    own_indices[: own_indptr[-1]] = indices[source]
    return CascadeLevels((shared,), _own_table(page_table, own_indptr, own_indices))


def _host_rows(page_table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(page_indptr, page_indices, seq_lens)`` of a concrete, valid table, as NumPy."""
    if not isinstance(page_table, PageTable):
        raise TypeError(f"page_table must be a PageTable, got {type(page_table).__name__}")
    if not is_concrete(page_table.page_indptr, page_table.page_indices, page_table.last_page_len):
        raise ValueError(
            "page_table must be concrete (host arrays, outside jit): its pages are read"
        )
    validate_page_table(page_table, None)
    indptr = np.asarray(page_table.page_indptr, np.int64)
    return indptr, np.asarray(page_table.page_indices), np.asarray(page_table.seq_lens(), np.int64)


def _check_q_len(q_len) -> int:
    if isinstance(q_len, bool) or not isinstance(q_len, (int, np.integer)) or q_len < 1:
        raise ValueError(f"q_len must be an int >= 1, got {q_len!r}")
    return int(q_len)


def _check_active(active, batch_size: int) -> np.ndarray:
    if active is None:
        return np.ones(batch_size, bool)
    array = np.asarray(active)
    if array.dtype != np.bool_ or array.shape != (batch_size,):
        raise ValueError(
            f"active must be a bool array of the table's {batch_size} rows, got "
            f"{array.dtype}{list(array.shape)}"
        )
    return array


def _check_size(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)
