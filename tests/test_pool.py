"""The host-side page pool: unit tests, and a stateful test of pool + share + append + free.

The stateful test drives a small real ``KVCache`` through ``paged.append_kv`` while a model of the
requests says which tokens each one has written. Every request copies a shared, partially filled
last page before writing into it (copy-on-write, ``design.md``); the invariants check that the
pool's bookkeeping matches the model and that no write ever lands in a page another request
reads.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from strategies import pages_needed

import paged

# --------------------------------------------------------------------------------------------
# Unit tests
# --------------------------------------------------------------------------------------------


def test_a_new_pool_is_all_free():
    pool = paged.PagePool(5)
    assert pool.num_pages == 5 and pool.num_free == 5
    assert [pool.ref_count(p) for p in range(5)] == [0] * 5


def test_allocate_hands_out_the_lowest_free_pages_first():
    pool = paged.PagePool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(0) == []
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.num_free == 1
    assert [pool.ref_count(p) for p in range(6)] == [1, 1, 1, 1, 1, 0]


def test_freed_pages_are_reused():
    pool = paged.PagePool(4)
    first = pool.allocate(3)
    pool.free([first[1]])
    assert pool.allocate(2) == [first[1], 3]
    assert pool.num_free == 0


def test_exhausting_the_pool_raises_and_takes_nothing():
    pool = paged.PagePool(3)
    pool.allocate(2)
    with pytest.raises(
        paged.PoolExhaustedError, match=re.escape("cannot allocate 2 pages: only 1 of 3")
    ):
        pool.allocate(2)
    assert pool.num_free == 1
    assert issubclass(paged.PoolExhaustedError, ValueError)
    assert pool.allocate(1) == [2]


def test_share_adds_a_holder_and_the_last_free_releases_the_page():
    pool = paged.PagePool(4)
    pages = pool.allocate(2)
    pool.share(pages)
    pool.share(pages[:1])
    assert [pool.ref_count(p) for p in pages] == [3, 2]
    pool.free(pages)
    assert pool.num_free == 2 and [pool.ref_count(p) for p in pages] == [2, 1]
    pool.free(pages)
    assert pool.num_free == 3 and [pool.ref_count(p) for p in pages] == [1, 0]
    pool.free(pages[:1])
    assert pool.num_free == 4


def test_one_free_call_may_drop_several_references_to_a_page():
    pool = paged.PagePool(2)
    (page,) = pool.allocate(1)
    pool.share([page])
    pool.free([page, page])
    assert pool.ref_count(page) == 0 and pool.num_free == 2


def test_double_free_raises_and_frees_nothing():
    pool = paged.PagePool(4)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(ValueError, match=re.escape(f"cannot free page {a}: it has 0 holder(s)")):
        pool.free([b, a])
    assert pool.ref_count(b) == 1, "a failed free must not drop any reference"
    with pytest.raises(ValueError, match=re.escape(f"cannot free page {b}: it has 1 holder(s)")):
        pool.free([b, b])
    assert pool.ref_count(b) == 1 and pool.num_free == 3


def test_sharing_a_free_page_raises_and_shares_nothing():
    pool = paged.PagePool(4)
    (held,) = pool.allocate(1)
    with pytest.raises(ValueError, match=re.escape("cannot share page 3: nobody holds it")):
        pool.share([held, 3])
    assert pool.ref_count(held) == 1


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda pool: pool.free([4]), "page 4 is outside the pool of 4 pages"),
        (lambda pool: pool.free([-1]), "page -1 is outside the pool of 4 pages"),
        (lambda pool: pool.share([7]), "page 7 is outside the pool of 4 pages"),
        (lambda pool: pool.ref_count(4), "page 4 is outside the pool of 4 pages"),
        (lambda pool: pool.allocate(-1), "n must be >= 0, got -1"),
    ],
)
def test_bad_arguments_raise_naming_the_value(call, message):
    pool = paged.PagePool(4)
    pool.allocate(1)
    with pytest.raises(ValueError, match=re.escape(message)):
        call(pool)
    assert pool.num_free == 3


def test_a_pool_needs_at_least_one_page():
    with pytest.raises(ValueError, match=re.escape("num_pages must be >= 1, got 0")):
        paged.PagePool(0)


# --------------------------------------------------------------------------------------------
# Stateful: pool + share (fork) + append (with copy-on-write) + free
# --------------------------------------------------------------------------------------------

NUM_POOL_PAGES, PAGE_SIZE, HEAD_DIM = 12, 2, 2


@dataclasses.dataclass
class Request:
    """The model of one request: its pages in token order and the value of each of its tokens.

    Token values are unique across the whole run, so a value found in the wrong place, or a value
    overwritten, is caught.
    """

    pages: list[int]
    tokens: list[float]


class PoolMachine(RuleBasedStateMachine):
    """Requests start, fork a prefix of another request (sharing its pages), append tokens one at
    a time, and finish, in any order hypothesis likes.

    Pool rules a serving engine follows, which this machine follows too: a new token at a page
    boundary gets a freshly allocated page; a new token inside a last page that another request
    also holds first copies that page to a private one (copy-on-write) and drops its reference to
    the shared one.
    """

    layout = "HND"

    def __init__(self):
        super().__init__()
        self.pool = paged.PagePool(NUM_POOL_PAGES)
        self.cache = paged.new_kv_cache(
            NUM_POOL_PAGES, PAGE_SIZE, 1, HEAD_DIM, jnp.float32, self.layout
        )
        self.live: dict[int, Request] = {}
        self.finished_page_lists: list[list[int]] = []
        self.next_request_id = 0
        self.next_token_value = 1.0  # 0 is what a fresh pool holds

    # --- the model ---------------------------------------------------------------------------

    def model_ref_counts(self) -> Counter:
        return Counter(page for request in self.live.values() for page in request.pages)

    def _new_request(self, pages, tokens) -> int:
        request_id = self.next_request_id
        self.next_request_id += 1
        self.live[request_id] = Request(list(pages), list(tokens))
        return request_id

    def _allocate(self, n: int) -> list[int] | None:
        """``pool.allocate(n)``, checking that it hands out only pages nobody holds; ``None``
        (and nothing taken) when the pool is exhausted."""
        held_before = self.model_ref_counts()
        free_before = self.pool.num_free
        if n > free_before:
            with pytest.raises(paged.PoolExhaustedError):
                self.pool.allocate(n)
            assert self.pool.num_free == free_before
            event("pool exhausted")
            return None
        pages = self.pool.allocate(n)
        assert len(set(pages)) == n
        for page in pages:
            assert held_before[page] == 0, f"page {page} handed out while still held"
        return pages

    def _page_contents(self) -> np.ndarray:
        """The cache as ``[num_pages, page_size, 2 (k, v), head_dim]`` host values."""
        k = np.asarray(self.cache.to_nhd(self.cache.k_pages))[:, :, 0]
        v = np.asarray(self.cache.to_nhd(self.cache.v_pages))[:, :, 0]
        return np.stack([k, v], axis=2)

    def _write_token(self, request_id: int) -> None:
        """Appends one token to the request through ``paged.append_kv`` and checks that nothing
        but the one target slot changed."""
        request = self.live[request_id]
        position = len(request.tokens)
        page = request.pages[position // PAGE_SIZE]
        assert self.model_ref_counts()[page] == 1, "a write to a page another request reads"
        assert self.pool.ref_count(page) == 1, "the pool thinks this page is shared"

        value = self.next_token_value
        self.next_token_value += 1.0
        # A one-request table covering the new token (a prompt's later pages are already held),
        # padded to the pool size so that every append has the same shapes.
        table = paged.PageTable.from_page_lists(
            [request.pages[: pages_needed(position + 1, PAGE_SIZE)]],
            [position + 1],
            PAGE_SIZE,
            num_indices=NUM_POOL_PAGES,
        )
        before = self._page_contents()
        token_k = jnp.full((1, 1, HEAD_DIM), value, jnp.float32)
        self.cache = paged.append_kv(
            self.cache,
            table,
            token_k,
            -token_k,  # v differs from k, so a k/v mix-up shows
            jnp.zeros(1, jnp.int32),
            jnp.asarray([position], jnp.int32),
        )
        after = self._page_contents()
        changed = {(int(p), int(s)) for p, s, *_ in np.argwhere(before != after)}
        assert changed <= {(page, position % PAGE_SIZE)}, f"append wrote to {changed}"
        assert (after[page, position % PAGE_SIZE, 0] == value).all()
        assert (after[page, position % PAGE_SIZE, 1] == -value).all()
        request.tokens.append(value)

    def _copy_on_write(self, request_id: int) -> bool:
        """Gives the request a private copy of its shared, partially filled last page; False if
        the pool has no page for the copy."""
        request = self.live[request_id]
        shared = request.pages[-1]
        fresh = self._allocate(1)
        if fresh is None:
            return False
        (copy,) = fresh
        self.cache = paged.KVCache(
            self.cache.k_pages.at[copy].set(self.cache.k_pages[shared]),
            self.cache.v_pages.at[copy].set(self.cache.v_pages[shared]),
            self.layout,
        )
        self.pool.free([shared])
        request.pages[-1] = copy
        event("copy-on-write of a shared last page")
        return True

    # --- rules -------------------------------------------------------------------------------

    def _draw_live_request(self, data) -> int:
        return data.draw(st.sampled_from(sorted(self.live)), label="request")

    @initialize(prompt_len=st.integers(1, 5))
    def first_request(self, prompt_len):
        """Every run starts with one request, so fork, append and finish have work at once."""
        self.start(prompt_len)

    @rule(prompt_len=st.integers(0, 5))
    def start(self, prompt_len):
        """A new request with a prompt of ``prompt_len`` tokens, written one by one."""
        pages = self._allocate(pages_needed(prompt_len, PAGE_SIZE))
        if pages is None:
            return
        request_id = self._new_request(pages, [])
        for _ in range(prompt_len):
            self._write_token(request_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        """A new request that shares the first ``prefix_len`` tokens of a live one (all of its
        pages covering them, the last possibly partial) without copying anything."""
        source = self.live[self._draw_live_request(data)]
        prefix_len = data.draw(st.integers(0, len(source.tokens)), label="prefix_len")
        shared = source.pages[: pages_needed(prefix_len, PAGE_SIZE)]
        self.pool.share(shared)
        if prefix_len % PAGE_SIZE:
            event("fork sharing a partially filled page")
        self._new_request(shared, source.tokens[:prefix_len])

    @precondition(lambda self: self.live)
    @rule(data=st.data(), count=st.integers(1, 3))
    def append(self, data, count):
        """``count`` new tokens at the end of a live request: a fresh page at a page boundary,
        copy-on-write inside a shared page, a plain write otherwise."""
        request_id = self._draw_live_request(data)
        request = self.live[request_id]
        for _ in range(count):
            position = len(request.tokens)
            if position % PAGE_SIZE == 0:
                fresh = self._allocate(1)
                if fresh is None:
                    return
                request.pages.extend(fresh)
            elif self.pool.ref_count(request.pages[-1]) > 1 and not self._copy_on_write(request_id):
                return
            self._write_token(request_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        """A live request lets go of all its pages."""
        request = self.live.pop(self._draw_live_request(data))
        self.pool.free(request.pages)
        self.finished_page_lists.append(request.pages)

    @precondition(lambda self: self.finished_page_lists)
    @rule(data=st.data())
    def free_again(self, data):
        """Freeing a finished request's pages a second time is refused, changing nothing, when
        any of them now has fewer holders than the call would drop. (When all of them have been
        handed out again, the pool cannot tell a stale free from a real one, so it is not tried.)
        """
        pages = data.draw(st.sampled_from(self.finished_page_lists), label="stale pages")
        held = self.model_ref_counts()
        if all(held[page] >= count for page, count in Counter(pages).items()):
            return
        counts_before = [self.pool.ref_count(p) for p in range(NUM_POOL_PAGES)]
        event("stale free refused")
        with pytest.raises(ValueError, match="cannot free page"):
            self.pool.free(pages)
        assert [self.pool.ref_count(p) for p in range(NUM_POOL_PAGES)] == counts_before

    # --- invariants --------------------------------------------------------------------------

    @invariant()
    def reference_counts_match_the_model(self):
        held = self.model_ref_counts()
        assert [self.pool.ref_count(p) for p in range(NUM_POOL_PAGES)] == [
            held[p] for p in range(NUM_POOL_PAGES)
        ]

    @invariant()
    def no_page_is_leaked(self):
        """Every page is either free or held by a live request, never both, never neither."""
        held_pages = set(self.model_ref_counts())
        assert self.pool.num_free + len(held_pages) == NUM_POOL_PAGES

    @invariant()
    def no_held_page_is_free(self):
        """The free list holds exactly the pages nobody holds. Probed through the public API:
        take every free page, check none is held, and give them back in reverse order, which
        restores the free list (a stack) exactly as it was."""
        everything_free = self.pool.allocate(self.pool.num_free)
        held = self.model_ref_counts()
        assert not [page for page in everything_free if held[page]], "a held page was free"
        assert sorted(everything_free) == sorted(p for p in range(NUM_POOL_PAGES) if not held[p])
        self.pool.free(reversed(everything_free))

    @invariant()
    def every_request_reads_what_it_wrote(self):
        """Each live request's tokens, read through its page list, are the values it wrote (or
        inherited at a fork): no other request's write has reached them."""
        contents = self._page_contents()
        for request in self.live.values():
            assert len(request.pages) == pages_needed(len(request.tokens), PAGE_SIZE)
            for position, value in enumerate(request.tokens):
                page, slot = request.pages[position // PAGE_SIZE], position % PAGE_SIZE
                assert (contents[page, slot, 0] == value).all()
                assert (contents[page, slot, 1] == -value).all()


class NhdPoolMachine(PoolMachine):
    """The same machine over an ``NHD`` cache, so appends are checked in both layouts."""

    layout = "NHD"


# Modest in ci (25 examples of at most 30 steps); the dev profile multiplies the examples.
STATE_MACHINE_SETTINGS = settings(
    max_examples=settings.default.max_examples, stateful_step_count=30
)
TestPoolMachineHND = PoolMachine.TestCase
TestPoolMachineHND.settings = STATE_MACHINE_SETTINGS
TestPoolMachineNHD = NhdPoolMachine.TestCase
TestPoolMachineNHD.settings = STATE_MACHINE_SETTINGS
