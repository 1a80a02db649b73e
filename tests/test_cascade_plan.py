"""The cascade planner (``paged/cascade_plan.py``): shared leading pages found exactly, groups of
one never formed, the new tokens kept in each request's own level, fixed shapes, bad input.

The oracle is the plan a test draws: groups of requests planted with the same prefix pages and
their own fresh pages after, in shuffled rows, plus requests of their own. What the planner must
find follows from the drawing alone (``_expected_groups``), not from anything ``paged``
computes.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import pages_needed

import paged
from paged.cascade_plan import (
    ANY_SHARED_PAGE,
    CascadeCrossover,
    CascadePlanCache,
    SharedPrefixGroup,
    find_shared_prefix_groups,
    plan_cascade,
    summarize_levels,
)

PAGE_SIZE = 4
MAX_ROWS = 8
MAX_PREFIX_PAGES = 3
MAX_OWN_TOKENS = 9


@st.composite
def planted_batches(draw):
    """``(table, planted, q_len)``: ``planted`` is a list of ``(rows, prefix_pages)``, the
    requests that list the same ``prefix_pages`` first (a group of one included), every other
    page of the table listed once. Own suffixes are ragged, empty included; every row but those
    of planted groups has pages of its own only."""
    q_len = draw(st.integers(1, 3))
    num_rows = draw(st.integers(0, MAX_ROWS))
    # Split the rows into planted groups (sizes 1..4) and lone rows (prefix 0).
    sizes = []
    left = num_rows
    while left:
        size = draw(st.integers(1, min(4, left)))
        sizes.append(size)
        left -= size
    fresh = iter(draw(st.permutations(range(200))))
    rows_of_group, prefixes = [], []
    order = draw(st.permutations(range(num_rows)))
    start = 0
    for size in sizes:
        rows_of_group.append(sorted(order[start : start + size]))
        start += size
        prefix_pages = draw(st.integers(0, MAX_PREFIX_PAGES))
        prefixes.append([next(fresh) for _ in range(prefix_pages)])
    page_lists = [None] * num_rows
    seq_lens = [0] * num_rows
    for rows, prefix in zip(rows_of_group, prefixes, strict=True):
        for row in rows:
            own = draw(st.integers(0, MAX_OWN_TOKENS))
            page_lists[row] = prefix + [next(fresh) for _ in range(pages_needed(own, PAGE_SIZE))]
            seq_lens[row] = len(prefix) * PAGE_SIZE + own
    table = paged.PageTable.from_page_lists(
        page_lists, seq_lens, PAGE_SIZE, num_indices=paged.bucket_size(200)
    )
    planted = list(zip(rows_of_group, prefixes, strict=True))
    return table, planted, seq_lens, q_len


def _expected_groups(planted, seq_lens, q_len):
    """What the planner must find: of each planted group, the rows with a whole page and
    ``q_len`` tokens after it; at least two of them; the prefix every one of them can share."""
    expected = []
    for rows, prefix in planted:
        shareable = {r: min(len(prefix), (seq_lens[r] - q_len) // PAGE_SIZE) for r in rows}
        members = [r for r in rows if shareable[r] >= 1]
        if len(members) < 2:
            continue
        pages = min(shareable[r] for r in members)
        expected.append(SharedPrefixGroup(tuple(members), tuple(prefix[:pages])))
    return sorted(expected, key=lambda group: group.requests[0])


@given(planted_batches())
def test_planted_shared_prefixes_are_found_exactly(case):
    table, planted, seq_lens, q_len = case
    groups = find_shared_prefix_groups(table, q_len=q_len)
    assert groups == _expected_groups(planted, seq_lens, q_len)
    assert all(len(group.requests) >= 2 and group.pages for group in groups)


@given(planted_batches())
def test_levels_split_each_row_at_its_groups_prefix(case):
    """Shared level: each group's pages; own level: the rest of each row, holding the ``q_len``
    new tokens; the same split as ``cascade_levels_from_shared_prefix``; fixed shapes."""
    table, planted, seq_lens, q_len = case
    expected = _expected_groups(planted, seq_lens, q_len)
    levels = plan_cascade(table, ANY_SHARED_PAGE, q_len=q_len)
    if not expected:
        assert levels is None
        return
    (shared,) = levels.shared
    batch = len(seq_lens)
    assert shared.num_groups == batch // 2  # padded with empty groups
    assert shared.group_pages.page_indices.shape == table.page_indices.shape
    assert levels.own.page_indices.shape == table.page_indices.shape
    assert shared.group_requests.shape == (batch,)
    rows = table.page_lists()
    got_pages = shared.group_pages.page_lists()[: len(expected)]
    assert got_pages == [list(group.pages) for group in expected]
    assert shared.group_pages.page_lists()[len(expected) :] == [[]] * (
        shared.num_groups - len(expected)
    )
    indptr = np.asarray(shared.group_indptr)
    members = np.asarray(shared.group_requests)
    for g, group in enumerate(expected):
        assert tuple(members[indptr[g] : indptr[g + 1]]) == group.requests
    assert indptr[-1] == sum(len(group.requests) for group in expected)
    skipped = {r: len(group.pages) for group in expected for r in group.requests}
    assert levels.own.page_lists() == [row[skipped.get(b, 0) :] for b, row in enumerate(rows)]
    own_lens = np.asarray(levels.own.seq_lens())
    for b, n in enumerate(seq_lens):
        assert own_lens[b] == n - skipped.get(b, 0) * PAGE_SIZE
        if b in skipped:
            assert own_lens[b] >= q_len  # the new tokens lie in the own level
    library = paged.cascade_levels_from_shared_prefix(
        table,
        [list(group.requests) for group in expected],
        [len(group.pages) * PAGE_SIZE for group in expected],
    )
    assert library.own.page_lists() == levels.own.page_lists()
    paged.validate_cascade_levels(levels, None, batch_size=batch)
    assert summarize_levels(levels) == (
        len(expected),
        len(skipped),
        max(len(group.requests) for group in expected),
        sum(len(group.pages) for group in expected),
    )


def test_a_partly_filled_page_is_never_shared():
    """Two rows that list the same pages, the last one partly filled (possible only in a table
    no engine writes, but a prefix of whole pages is the rule): the partly filled page, and with
    it the page where the new token lies, stays in each row's own level."""
    table = paged.PageTable.from_page_lists([[5, 6, 7], [5, 6, 7]], [10, 10], PAGE_SIZE)
    assert find_shared_prefix_groups(table) == [SharedPrefixGroup((0, 1), (5, 6))]
    # Eight tokens: the second page is full but holds the new token, so only the first is shared.
    table = paged.PageTable.from_page_lists([[5, 6], [5, 6]], [8, 8], PAGE_SIZE)
    assert find_shared_prefix_groups(table) == [SharedPrefixGroup((0, 1), (5,))]
    assert find_shared_prefix_groups(table, q_len=5) == []


def test_inactive_rows_join_no_group():
    """The engine's phantom rows (idle slots on the padding page) are left out by ``active``."""
    table = paged.PageTable.from_page_lists([[1, 2], [1, 3], [1, 4]], [6, 6, 6], PAGE_SIZE)
    assert find_shared_prefix_groups(table)[0].requests == (0, 1, 2)
    active = np.array([True, False, True])
    assert find_shared_prefix_groups(table, active=active)[0].requests == (0, 2)
    active = np.array([True, False, False])
    assert find_shared_prefix_groups(table, active=active) == []


def test_the_crossover_decides_which_groups_pay():
    # Group (0, 1) shares 1 page, group (2, 3, 4) shares 2.
    table = paged.PageTable.from_page_lists(
        [[1, 9], [1, 8], [2, 3, 7], [2, 3, 6], [2, 3, 5]], [6, 6, 10, 10, 10], PAGE_SIZE
    )
    assert plan_cascade(table, None) is None  # not measured: never
    both = plan_cascade(table, ANY_SHARED_PAGE)
    assert both.shared[0].group_pages.page_lists()[:2] == [[1], [2, 3]]
    only_large = plan_cascade(table, CascadeCrossover(min_group_size=3, min_prefix_pages=1))
    assert only_large.shared[0].group_pages.page_lists()[:1] == [[2, 3]]
    assert only_large.own.page_lists()[:2] == [[1, 9], [1, 8]]  # the small group reads its own
    assert plan_cascade(table, CascadeCrossover(min_group_size=2, min_prefix_pages=3)) is None
    # One shared row: the group that saves the most page reads, (3 - 1) x 2 against 1 x 1.
    one = plan_cascade(table, ANY_SHARED_PAGE, max_groups=1)
    assert one.shared[0].group_pages.page_lists() == [[2, 3]]
    assert plan_cascade(table, ANY_SHARED_PAGE, max_groups=0) is None


def test_levels_keep_their_shapes_across_steps():
    """Two steps of one batch size and table bucket, grouped differently, give levels of the
    same shapes: one compiled step runs both."""
    shapes = lambda levels: jax.tree.map(np.shape, levels)
    a = paged.PageTable.from_page_lists(
        [[1, 9], [1, 8], [4], [5]], [6, 6, 2, 2], PAGE_SIZE, num_indices=32
    )
    b = paged.PageTable.from_page_lists(
        [[1, 2, 9], [1, 2, 8], [1, 2, 7, 6], [5]], [10, 10, 15, 2], PAGE_SIZE, num_indices=32
    )
    assert shapes(plan_cascade(a, ANY_SHARED_PAGE)) == shapes(plan_cascade(b, ANY_SHARED_PAGE))


def test_planned_levels_give_plain_decode_attention():
    """The planned levels through ``cascade_decode_attention`` equal plain decode over the rows
    (float32 reference): the planner's split loses and repeats no key."""
    table = paged.PageTable.from_page_lists(
        [[1, 2, 9], [1, 2, 8], [3], [1, 2, 7, 6]], [11, 9, 3, 14], PAGE_SIZE, num_indices=16
    )
    keys = jax.random.split(jax.random.key(0), 3)
    shape = (10, 2, PAGE_SIZE, 16)  # [pages, KV heads, page size, head_dim], HND
    cache = paged.KVCache(jax.random.normal(keys[0], shape), jax.random.normal(keys[1], shape))
    q = jax.random.normal(keys[2], (4, 2, 4, 16))  # two new tokens a request
    levels = plan_cascade(table, ANY_SHARED_PAGE, q_len=2)
    assert summarize_levels(levels).num_requests == 3
    plain = paged.decode_attention(q, cache, table, backend="reference")
    cascade = paged.cascade_decode_attention(q, cache, levels, backend="reference")
    np.testing.assert_allclose(cascade, plain, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# CascadePlanCache: the same levels as plan_cascade, most steps reusing the step before's


def _same_levels(got, expected) -> bool:
    if got is None or expected is None:
        return got is None and expected is None
    got_leaves, got_tree = jax.tree.flatten(got)
    expected_leaves, expected_tree = jax.tree.flatten(expected)
    return got_tree == expected_tree and all(
        a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
        for a, b in zip(got_leaves, expected_leaves, strict=True)
    )


@given(st.lists(planted_batches(), min_size=1, max_size=4), st.integers(1, 3))
def test_the_cache_plans_what_plan_cascade_plans_whatever_the_steps(cases, repeats):
    """Any sequence of tables (each drawn table planned ``repeats`` times in a row, so the
    cache also answers from its last key): the value ``plan_cascade`` gives, every time."""
    cache = CascadePlanCache()
    for table, _, _, q_len in cases:
        for _ in range(repeats):
            got = cache.plan(table, ANY_SHARED_PAGE, q_len=q_len)
            assert _same_levels(got, plan_cascade(table, ANY_SHARED_PAGE, q_len=q_len))
    assert cache.hits >= len(cases) * (repeats - 1)  # a table planned again: from the cache
    assert cache.hits + cache.misses == len(cases) * repeats


def _step(page_lists, seq_lens):
    return paged.PageTable.from_page_lists(page_lists, seq_lens, PAGE_SIZE, num_indices=32)


def _groups_of(levels):
    """``[(requests, pages)]`` of the shared level's used rows."""
    (shared,) = levels.shared
    indptr = np.asarray(shared.group_indptr)
    members = np.asarray(shared.group_requests)
    pages = shared.group_pages.page_lists()
    return [
        (members[indptr[g] : indptr[g + 1]].tolist(), pages[g])
        for g in range(shared.num_groups)
        if indptr[g + 1] > indptr[g]
    ]


def test_the_cache_follows_requests_joining_and_leaving_a_group():
    """Steps of one batch as an engine sees them: a step that only moves each row's length
    within its pages reuses the last step's levels (the same shared level, its own
    ``last_page_len``); a request leaving, a request joining, a row gaining a page and a
    preempted request readmitted on other pages each give new levels, equal to
    ``plan_cascade``'s."""
    cache = CascadePlanCache()
    active = np.ones(4, bool)

    def plan(table, active=active):
        levels = cache.plan(table, ANY_SHARED_PAGE, active=active)
        assert _same_levels(levels, plan_cascade(table, ANY_SHARED_PAGE, active=active))
        return levels

    # Rows 0, 1, 2 share pages 1 and 2; row 3 decodes alone.
    rows = [[1, 2, 5], [1, 2, 6], [1, 2, 7], [3, 8]]
    first = plan(_step(rows, [9, 10, 9, 6]))
    assert _groups_of(first) == [([0, 1, 2], [1, 2])]
    # A token more each, on the same pages: the last step's levels, this step's lengths.
    grown = plan(_step(rows, [10, 11, 10, 7]))
    assert (cache.hits, cache.misses) == (1, 1)
    assert grown.shared is first.shared
    assert grown.own.last_page_len.tolist() == [2, 3, 2, 3]
    # Request 2 finishes: its slot is idle (a phantom row).
    left = plan(_step(rows, [11, 12, 11, 8]), np.array([True, True, False, True]))
    assert _groups_of(left) == [([0, 1], [1, 2])]
    # A request admitted with the same prompt joins in slot 2 (its own page 9), and row 3's
    # request gains a page.
    rows = [[1, 2, 5], [1, 2, 6], [1, 2, 9], [3, 8, 4]]
    joined = plan(_step(rows, [12, 9, 9, 9]))
    assert _groups_of(joined) == [([0, 1, 2], [1, 2])]
    # Row 0's request preempted and readmitted with the same first page but another second
    # page (its prompt's tail re-prefilled): the prefix the group shares shrinks to page 1.
    rows = [[1, 10, 11], [1, 2, 6], [1, 2, 9], [3, 8, 4]]
    readmitted = plan(_step(rows, [9, 10, 10, 10]))
    assert _groups_of(readmitted) == [([0, 1, 2], [1])]
    assert (cache.hits, cache.misses) == (1, 4)


def test_the_cache_follows_the_crossover_and_the_batch_shape():
    """A key is all the levels depend on: the same table under another crossover, another
    ``max_groups`` or ``num_indices``, or another ``q_len`` is planned again."""
    cache = CascadePlanCache()
    table = _step([[1, 2, 5], [1, 2, 6], [3, 4, 7], [3, 4, 8]], [9, 9, 12, 12])
    assert len(_groups_of(cache.plan(table, ANY_SHARED_PAGE))) == 2
    only = CascadeCrossover(min_group_size=2, min_prefix_pages=2)
    assert cache.plan(table, only) is not None
    assert cache.plan(table, CascadeCrossover(min_group_size=3, min_prefix_pages=1)) is None
    assert cache.plan(table, CascadeCrossover(min_group_size=3, min_prefix_pages=1)) is None
    assert cache.hits == 1  # the None was kept too
    assert len(_groups_of(cache.plan(table, ANY_SHARED_PAGE, max_groups=1))) == 1
    wide = cache.plan(table, ANY_SHARED_PAGE, num_indices=64)
    assert wide.own.page_indices.shape == (64,)
    # q_len=2: rows 0 and 1 (9 tokens, one after their two pages) can share one page only;
    # a token more each, on the same pages, and they share both.
    assert _groups_of(cache.plan(table, ANY_SHARED_PAGE, q_len=2))[0] == ([0, 1], [1])
    longer = _step([[1, 2, 5], [1, 2, 6], [3, 4, 7], [3, 4, 8]], [10, 10, 12, 12])
    assert _groups_of(cache.plan(longer, ANY_SHARED_PAGE, q_len=2))[0] == ([0, 1], [1, 2])
    with pytest.raises(ValueError, match="q_len must be an int >= 1, got 0"):
        cache.plan(table, ANY_SHARED_PAGE, q_len=0)


def test_reused_levels_are_read_only():
    """The arrays a later step reuses cannot be changed through an earlier step's levels."""
    cache = CascadePlanCache()
    levels = cache.plan(_step([[1, 2, 5], [1, 2, 6]], [9, 9]), ANY_SHARED_PAGE)
    with pytest.raises(ValueError, match="read-only"):
        levels.shared[0].group_requests[0] = 1
    with pytest.raises(ValueError, match="read-only"):
        levels.own.page_indices[0] = 1
    levels.own.last_page_len[0] = 1  # each step's own: writable, as plan_cascade's


# --------------------------------------------------------------------------------------------
# Bad input


def _table():
    return paged.PageTable.from_page_lists([[1, 2], [1, 3]], [6, 6], PAGE_SIZE)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(q_len=0), ValueError, "q_len must be an int >= 1, got 0"),
        (dict(q_len=True), ValueError, "q_len"),
        (
            dict(active=np.array([True])),
            ValueError,
            r"active must be a bool array of the table's 2",
        ),
        (dict(active=np.array([1, 1])), ValueError, "active"),
        (dict(max_groups=-1), ValueError, "max_groups must be an int >= 0, got -1"),
        (dict(num_indices=1), ValueError, "num_indices=1 is below the 4 pages"),
        (dict(crossover="on"), TypeError, "crossover must be a CascadeCrossover or None, got str"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    crossover = kwargs.pop("crossover", ANY_SHARED_PAGE)
    with pytest.raises(error, match=match):
        plan_cascade(_table(), crossover, **kwargs)
    # Through a cache that just planned the same table with good arguments (q_len=True equals
    # 1, an int active array 1s equals True): the same error, not the kept levels.
    cache = CascadePlanCache()
    assert cache.plan(_table(), ANY_SHARED_PAGE, q_len=1) is not None
    with pytest.raises(error, match=match):
        cache.plan(_table(), crossover, **kwargs)


def test_a_bad_length_is_refused_through_the_cache():
    """A table whose pages are those the cache kept but whose lengths are not valid is refused
    as ``plan_cascade`` refuses it (its lengths are all that a kept key does not cover)."""
    int32 = lambda values: np.array(values, np.int32)
    cache = CascadePlanCache()
    assert cache.plan(_table(), ANY_SHARED_PAGE) is not None
    table = _table()
    for bad in ([2, 9], [0, 2]):  # past the page; none on a row that lists pages
        bad_table = paged.PageTable(table.page_indptr, table.page_indices, int32(bad), PAGE_SIZE)
        with pytest.raises(ValueError, match="last_page_len"):
            plan_cascade(bad_table, ANY_SHARED_PAGE)
        with pytest.raises(ValueError, match="last_page_len"):
            cache.plan(bad_table, ANY_SHARED_PAGE)
    # With q_len=2 a length of 0 and one of 1 give the same key ((0 - 2) // 4 == (1 - 2) // 4):
    # the lengths' own check refuses it.
    one = paged.PageTable(table.page_indptr, table.page_indices, int32([1, 2]), PAGE_SIZE)
    cache.plan(one, ANY_SHARED_PAGE, q_len=2)
    zero = paged.PageTable(table.page_indptr, table.page_indices, int32([0, 2]), PAGE_SIZE)
    with pytest.raises(ValueError, match=r"last_page_len\[0\]=0"):
        cache.plan(zero, ANY_SHARED_PAGE, q_len=2)
    assert cache.hits == 0


def test_a_bad_or_traced_table_is_refused():
    with pytest.raises(TypeError, match="page_table must be a PageTable, got list"):
        find_shared_prefix_groups([[1, 2]])
    int32 = lambda values: np.array(values, np.int32)
    bad = paged.PageTable(int32([0, 2]), int32([1, 2]), int32([9]), PAGE_SIZE)
    with pytest.raises(ValueError, match="last_page_len"):
        find_shared_prefix_groups(bad)

    @jax.jit
    def traced(table):
        return find_shared_prefix_groups(table)

    with pytest.raises(ValueError, match="page_table must be concrete"):
        traced(_table())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(min_group_size=1, min_prefix_pages=1), "min_group_size must be >= 2, got 1"),
        (dict(min_group_size=2, min_prefix_pages=0), "min_prefix_pages must be >= 1, got 0"),
        (dict(min_group_size=2.0, min_prefix_pages=1), "min_group_size must be an int"),
        (dict(min_group_size=2, min_prefix_pages=True), "min_prefix_pages must be an int"),
    ],
)
def test_a_bad_crossover_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CascadeCrossover(**kwargs)


def test_the_committed_crossover_admits_only_cases_measured_to_pay():
    """``CASCADE_CROSSOVER`` against the H200 measurement it was read from
    (``docs/benchmark_results/archive/2026-12-02-cascade-shared-probe.json``): every measured
    case it admits was faster with cascade than with plain decode, and it admits at least the
    headline case (128 requests sharing 32K tokens)."""
    import json
    import pathlib

    from paged.cascade_plan import CASCADE_CROSSOVER

    path = pathlib.Path(__file__).parent.parent / (
        "docs/benchmark_results/archive/2026-12-02-cascade-shared-probe.json"
    )
    summary = json.loads(path.read_text())["summary"]
    page_size = 16
    admitted = [
        row for row in summary if CASCADE_CROSSOVER.pays(row["group"], row["prefix"] // page_size)
    ]
    assert all(row["plain_over_cascade"] > 1.0 for row in admitted), admitted
    assert any(row["group"] == 128 and row["prefix"] == 32768 for row in admitted)
    assert len(summary) >= 10  # the measurement covered both sides of the rule
    declined = [row for row in summary if row not in admitted]
    assert any(row["plain_over_cascade"] < 1.0 for row in declined)
