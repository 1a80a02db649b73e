"""The host-side scheduler of the serving engine: admission, pages, prefix sharing, rewinds.

Pure Python and NumPy, no model. The engine asks ``plan_step()`` what to run, runs it (prefill
chunks, then one decode or verification step), and reports the tokens back through
``commit_step()``. Everything a step writes is decided here; the device only sees the tokens,
positions and page tables of the ``Step``.

The life of a request
---------------------
``submit`` queues it. Admission gives it a slot and pages, and the prompt is prefilled chunk by
chunk up to, but not including, its last token: the cache is filled to ``len(tokens) - 1``.
Every decode step then feeds exactly the last token (plus ``n`` drafts when speculating) and
samples what follows, so the first generated token comes out of the same decode batch as every
other, in the same host step as the prompt's last chunk, and a preempted request is recomputed
along the same path (its generated tokens are part of what it prefills). A request is finished
by a stop token or ``max_tokens``; its pages are then freed and its slot reused.

The cache contract (both caches, every step)
--------------------------------------------
A request's cache holds valid keys and values for positions ``[0, cached)`` and its token list
has ``cached + 1`` entries between steps: the last token is the one the next step feeds. A
decode step writes positions ``cached .. cached + n`` (the last token, then drafts ``d_1..d_n``)
and ``commit_step`` rewinds to ``cached + 1 + num_accepted``: the fed token and the accepted
drafts; the rejected drafts' entries are dropped and the emitted correction (or bonus) token
becomes the new last token, fed next step. Pages past the new length are freed at once.

Speculative decoding: the draft cache mirrors the target
--------------------------------------------------------
The draft model's KV pool has the same number of pages as the target's (smaller pages in bytes:
fewer layers and heads), and a request's draft pages are its target pages, by index. The draft
proposes ``d_1..d_n`` in ``n`` one-token passes and runs one more pass to write ``d_n`` (its
logits are discarded), so both caches write the same ``n + 1`` positions and rewind to the same
length: one allocation, one rewind, no case where the draft lags. The extra draft pass costs
``1/n`` of the draft's work; the alternative (a draft one token behind after full acceptance,
catching up with a two-token pass) needs per-row query lengths and invites exactly the
off-by-one the tests hunt. ``DecodeBatch.draft_page_tables[j]`` is draft pass ``j``'s table.

Pages and the pool
------------------
- ``PagePool`` page 0 is the padding page, held by the scheduler for good: idle slots of the
  static decode batch are phantom one-token requests on it, so every row of a jitted step has a
  valid table and their writes land where no request reads.
- Admission reserves pages for the whole prefill and the first decode step's ``n + 1`` writes;
  growth before each decode step adds what the step writes, for running requests oldest first.
- Exhaustion mid-generation: the newest running request is preempted (its pages freed, it goes
  back to the front of the queue, its tokens kept, to be recomputed later), until the older
  ones fit. No admission happens in a step that preempted, so a request is not readmitted into
  the shortage that just evicted it.
- Admission is strictly FIFO (the head of the queue blocks the rest), so every running request
  is older than every waiting one. The oldest running request is never preempted while
  another runs, and alone it always fits (``submit`` refuses a request whose largest footprint,
  ``prompt + max_tokens - 1 + n`` tokens, exceeds the usable pool), so it progresses every step
  and every request finishes.

Prefix sharing (among live requests only)
-----------------------------------------
Full pages inside a request's prefill range are registered under a key ``(parent page,
tokens of this page)``: the parent is the page registered for everything before, so a key
names its whole prefix exactly (no hash collisions) and a page is reused only when the entire
prefix matches. A newcomer shares (``PagePool.share``) the longest chain of registered pages
whose keys and values are computed; if the chain continues into a page still being prefilled
by another request, the newcomer waits at the head of the queue for a step or two rather than
recompute it. Shared pages are read-only: only positions ``>= cached`` are ever written, and a
shared page lies below every holder's ``cached``. The last, partially filled page and every
page past the prefill range are always private (so nothing is copied on write). A page leaves
the registry when its last holder frees it: no cache outlives its requests, so no eviction
policy is needed. Both models prefill each chunk, so a shared page is valid in both pools.

What a step prefills
--------------------
``serving/step_decision.py`` decides, as a pure function of a state the scheduler carries from
step to step: every decoding row runs, then prefill chunks fill what is left of the budget
(``max_batched_tokens`` minus the decode rows' ``n + 1`` tokens each, at most
``max_prefill_tokens``), oldest prefill first, and a prefill that got no chunk for
``prefill_grant_interval`` steps gets one chunk beyond the budget (``Step.granted``). Admission
comes first, so a request admitted in a step may prefill in it.

Committing before the tokens are known (overlapped steps)
---------------------------------------------------------
With plain decoding the engine may commit a step before its tokens reach the host
(``commit_step_unresolved``): each row emitted exactly one token, so lengths, pages and
``max_tokens`` finishes are known; the token itself is ``UNRESOLVED_TOKEN`` in the request's list
(the next decode batch feeds -1 there, and the engine takes the token from the device) until
``resolve_step`` brings it, after the next step was planned. Stop tokens apply there, one step
late: the request finishes (from the running set, or from the queue if the plan in between
preempted it), its token of the step planned meanwhile is discarded, and a request that a later
plan still holds is skipped when that plan commits. A preempted request is readmitted only with
its tokens known (``resolve_step`` runs before the next plan).

Several decode steps at once
----------------------------
``plan_step(max_decode_steps=K)`` lets a decode batch run ``K`` plain decode steps back to back
(``DecodeBatch.num_steps``; the engine runs them as one program, each step feeding the tokens
of the one before on the device) when nothing can change between them: no speculation, no
prefill chunk in the step and no request still prefilling, no waiting request while a slot is
free (it could be admitted as soon as pages allow), and every row at least ``K`` tokens from its
``max_tokens``. The pages of all ``K`` writes are reserved at plan time, fewer steps taken when
the pool cannot hold them (never a preemption for it). ``K`` is the largest power of two that
fits, so the engine compiles few programs. Only a stop token can end a row early, and it cannot
be known ahead: committing drops the row's tokens after it, and its pages are freed as after a
single step. The engine may run fewer steps than planned; committing those frees the pages
reserved for the rest. Outputs are those of ``K`` single steps: a request's keys, positions
and pages are the same. Since nobody prefills during a block, the fairness grant's bound (a
parked prefill gets a chunk at least once every ``N + 1`` steps) counts single steps as it
did: every plan while a prefill is parked is one step (the state machine of
``tests/test_scheduler.py`` checks both). What waits is a request queued for a slot: a stop
token inside a block frees its slot at the block's end (overlapped, after the next block:
``serving/engine.py``).

Static shapes for ``jit``
-------------------------
The decode batch always has ``parallel`` rows; ``page_indices`` is padded to
``paged.bucket_size``; prefill chunks have power-of-two lengths (a remainder of 37 tokens runs
as 32 + 4 + 1), so a model compiles at most ``log2(prefill_chunk_size) + 1`` prefill programs.

Host time (64 decoding slots, pages of 16, medians over 300 steps on a shared 2-core CPU):
``plan_step`` 56 us and ``commit_step`` 64 us at ``n = 0``; 142 + 98 us at ``n = 4`` (five
tables) with 512-token contexts, 223 + 101 us with 4096-token ones.

Example:
  >>> from serving.requests import Request, SamplingParams
  >>> scheduler = Scheduler(num_pages=8, page_size=4, parallel=2)
  >>> scheduler.submit(Request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=2)))
  >>> step = scheduler.plan_step()
  >>> [(c.start_position, c.token_ids.tolist()) for c in step.prefill]  # all but the last token
  [(0, [5, 6, 7, 8])]
  >>> step.decode.token_ids.tolist(), step.decode.positions.tolist()  # slot 1 is idle
  ([9, 0], [4, 0])
  >>> scheduler.commit_step(step, token_ids=[[3], [0]]).new_token_ids
  {'a': (3,)}
  >>> step = scheduler.plan_step()
  >>> scheduler.commit_step(step, token_ids=[[4], [0]]).finished[0].token_ids
  (3, 4)
  >>> scheduler.pool.num_free  # everything but the padding page
  7
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
from collections.abc import Hashable, Sequence

import numpy as np

import paged
from serving.requests import Request, RequestOutput, SamplingParams
from serving.step_decision import (
    DEFAULT_PREFILL_GRANT_INTERVAL,
    StepBudget,
    StepState,
    decide_step,
)
from serving.step_stats import StepOutput

# The registry key of a prefix's first page has no parent page.
_NO_PARENT = -1
# The placeholder of a token sampled on the device but not yet on the host (overlapped steps,
# ``Scheduler.commit_step_unresolved``); a decode batch feeding it takes it from the device.
UNRESOLVED_TOKEN = -1
# Decode batches of up to this many slots build their tables row by row (Scheduler._slot_table).
PYTHON_TABLE_MAX_ROWS = 8


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens: ``ceil(num_tokens / page_size)``."""
    return -(-num_tokens // page_size)


# ----------------------------------------------------------------------------------------------
# What a step hands to the engine


@dataclasses.dataclass(frozen=True)
class PromptChunk:
    """Prompt tokens written into one request's cache (both caches when speculating).

    One request's chunk with its tokens, as the engine runs it; ``paged.PrefillChunk`` (from
    ``paged.prefill_chunks``) is the bare position range and table of a batch's chunk.

    Attributes:
      request_id, slot: whose cache.
      token_ids: int32[L], ``L`` a power of two: the tokens at positions
        ``start_position .. start_position + L - 1``.
      start_position: first position written.
      page_table: one row covering ``start_position + L`` tokens (the chunk included, as
        ``serving.model.forward_paged`` expects); ``page_indices`` padded to a bucket.
    """

    request_id: Hashable
    slot: int
    token_ids: np.ndarray
    start_position: int
    page_table: paged.PageTable


@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """One decode (or verification) step over all ``B = parallel`` slots.

    Row ``b`` feeds ``token_ids[b]`` at ``positions[b]`` and, when speculating, the ``n``
    drafted tokens at ``positions[b] + 1 .. positions[b] + n``. A row not ``active`` (its slot
    idle, or its request still prefilling) is a phantom request at position 0 on the padding
    page: run it like the others and ignore its outputs.

    Attributes:
      request_ids: per slot, the request decoding there, or None.
      params: per slot, its sampling parameters, or None.
      active: bool[B].
      token_ids: int32[B], each request's last token.
      positions: int32[B], where it is written: the request's cached length.
      num_generated: int32[B], tokens generated so far (for ``fold_in(request_key, step)``).
      num_speculative: ``n``, drafts per request (0: plain decode).
      page_table: every row covering ``positions + n + 1`` tokens: the target's table for this
        step (the ``n + 1`` new tokens included).
      draft_page_tables: ``n + 1`` tables when speculating, else empty: draft pass ``j`` feeds
        one token at ``positions + j`` (the last token, then ``d_j``) over rows covering
        ``positions + j + 1`` tokens; pass ``n`` only writes ``d_n``. All share
        ``page_table``'s padded size, and the last one is ``page_table``.
      num_steps: ``K``, plain decode steps the batch runs back to back (1 unless
        ``plan_step(max_decode_steps=...)`` found ``K`` steps in which nothing changes: module
        docstring); step ``k`` feeds the token step ``k - 1`` sampled, at ``positions + k``.
      step_page_tables: when ``num_steps > 1``, each step's table: step ``k``'s active rows
        cover ``positions + k + 1`` tokens, idle rows 1 (the padding page); all share one
        padded size, and the first is ``page_table``. Empty when ``num_steps == 1``.
    """

    request_ids: tuple[Hashable | None, ...]
    params: tuple[SamplingParams | None, ...]
    active: np.ndarray
    token_ids: np.ndarray
    positions: np.ndarray
    num_generated: np.ndarray
    num_speculative: int
    page_table: paged.PageTable
    draft_page_tables: tuple[paged.PageTable, ...]
    num_steps: int = 1
    step_page_tables: tuple[paged.PageTable, ...] = ()


@dataclasses.dataclass(frozen=True)
class Step:
    """What to run now: the prefill chunks in order, then the decode batch (if any row decodes).

    Attributes:
      index: the step's number.
      prefill: chunks to run first; a request may have several, in position order.
      decode: the decode batch, or None when no request is ready to decode.
      admitted, preempted: requests that entered and left the running set in this plan.
      granted: requests whose chunks the fairness grant gave beyond the step's prefill budget
        (``serving/step_decision.py``).
    """

    index: int
    prefill: tuple[PromptChunk, ...]
    decode: DecodeBatch | None
    admitted: tuple[Hashable, ...]
    preempted: tuple[Hashable, ...]
    granted: tuple[Hashable, ...] = ()


@dataclasses.dataclass(frozen=True)
class RunningState:
    """A running request as the scheduler sees it (for tests, reports and debugging).

    Attributes:
      request_id, slot: the request and its slot.
      token_ids: prompt and generated tokens.
      num_cached: positions with valid keys and values, in both caches.
      prefill_end: where prefill stops (``len(token_ids) - 1`` at admission).
      pages: its pages in token order (shared prefix pages first).
    """

    request_id: Hashable
    slot: int
    token_ids: tuple[int, ...]
    num_cached: int
    prefill_end: int
    pages: tuple[int, ...]


# ----------------------------------------------------------------------------------------------
# The scheduler


@dataclasses.dataclass(eq=False)
class _Live:
    """A request not yet finished (waiting or running); mutable bookkeeping."""

    request: Request
    tokens: list[int]
    stop_token_ids: frozenset[int]
    slot: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    cached: int = 0
    prefill_end: int = 0
    # (page number k in the request, page) of its registered prefix pages not yet computed,
    # in k order: they become shareable when prefill passes their end.
    pending: collections.deque = dataclasses.field(default_factory=collections.deque)
    num_preemptions: int = 0
    # Overlapped steps (commit_step_unresolved): the provisional finish of a request retired
    # before its last token reached the host, and whether its output was given.
    provisional_reason: str | None = None
    done: bool = False

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt_token_ids)

    @property
    def prefilling(self) -> bool:
        return self.cached < self.prefill_end


@dataclasses.dataclass
class _Plan:
    """The outstanding step and what committing it changes."""

    step: Step
    prefill_ends: list[tuple[_Live, int]]
    decode_rows: list[tuple[int, _Live]]


class Scheduler:
    """Continuous batching over ``parallel`` slots and a ``PagePool`` of ``num_pages`` pages.

    Args:
      num_pages: pages in the KV pool (the device pools, target and draft, have this many).
        Page 0 is the padding page; the rest serve requests.
      page_size: tokens per page.
      parallel: slots, the decode batch size ``B``.
      num_speculative: drafts per request per step, ``n >= 0`` (0: plain decoding).
      max_prefill_tokens: prompt tokens prefilled per step at most, over all requests (bounds
        how long decoding requests wait behind a long prompt).
      prefill_chunk_size: the longest chunk, a power of two.
      max_batched_tokens: tokens a step carries at most, decode rows (``n + 1`` each) first,
        then prefill chunks; None: no limit beyond ``max_prefill_tokens``.
      prefill_grant_interval: ``N``: a prefilling request that got no chunk for ``N`` steps gets
        one (``prefill_chunk_size`` tokens) in the next, beyond the budget
        (``serving/step_decision.py``).

    Raises:
      ValueError: naming the argument and the bad value.

    Example: see the module docstring.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        parallel: int,
        *,
        num_speculative: int = 0,
        max_prefill_tokens: int = 512,
        prefill_chunk_size: int = 512,
        max_batched_tokens: int | None = None,
        prefill_grant_interval: int = DEFAULT_PREFILL_GRANT_INTERVAL,
    ):
        for name, value, low in (
            ("num_pages", num_pages, 2),
            ("page_size", page_size, 1),
            ("parallel", parallel, 1),
            ("num_speculative", num_speculative, 0),
            ("max_prefill_tokens", max_prefill_tokens, 1),
            ("prefill_chunk_size", prefill_chunk_size, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if prefill_chunk_size & (prefill_chunk_size - 1):
            raise ValueError(f"prefill_chunk_size must be a power of two, got {prefill_chunk_size}")
        self.page_size = int(page_size)
        self.parallel = int(parallel)
        self.num_speculative = int(num_speculative)
        self.max_prefill_tokens = int(max_prefill_tokens)
        self.prefill_chunk_size = int(prefill_chunk_size)
        self.budget = StepBudget(
            max_batched_tokens=max_batched_tokens,
            max_prefill_tokens=self.max_prefill_tokens,
            prefill_chunk_size=self.prefill_chunk_size,
            prefill_grant_interval=prefill_grant_interval,
        )
        # The last decision's state: the grant counters travel from one decide_step to the next
        # here, and nowhere else.
        self._decision = StepState(self.budget, decode_tokens=0, prefills=())
        self.pool = paged.PagePool(int(num_pages))
        (self.padding_page,) = self.pool.allocate(1)
        # Counts for reports: admitted, preempted, finished, shared_prefix_pages,
        # waits_for_pages and waits_for_prefix (steps in which the queue's head waited).
        self.stats = collections.Counter()

        self._waiting: collections.deque[_Live] = collections.deque()  # by arrival
        self._running: list[_Live] = []  # by arrival; all older than every waiting request
        self._by_id: dict[Hashable, _Live] = {}
        self._free_slots = list(range(self.parallel))  # a heap: lowest slot first
        self._steps = itertools.count()
        self._plan: _Plan | None = None
        # Steps committed before their tokens reached the host: step index -> ([(slot, request,
        # index of its first unresolved token)], tokens a row), until resolve_step.
        self._unresolved: dict[int, tuple[list[tuple[int, _Live, int]], int]] = {}
        # The prefix registry: key -> page, page -> key, and registered pages not yet computed.
        self._prefix_page: dict[tuple[int, tuple[int, ...]], int] = {}
        self._page_key: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._pending_pages: set[int] = set()
        # Every slot's pages as a [parallel, width] grid, kept in step with the requests' page
        # lists, so that a decode batch's tables are a few vectorized NumPy operations rather
        # than a Python walk over every page of every request (5 ms at 64 x 4K tokens).
        # Entries past a request's pages are stale and never read.
        self._slot_pages = np.zeros(
            (self.parallel, max(16, pages_needed(self.num_speculative + 1, self.page_size))),
            np.int32,
        )

    # --- queries ---------------------------------------------------------------------------

    @property
    def usable_pages(self) -> int:
        """Pages that requests can hold (all but the padding page)."""
        return self.pool.num_pages - 1

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_unfinished(self) -> bool:
        """Whether any submitted request has not finished."""
        return bool(self._by_id)

    def running(self) -> tuple[RunningState, ...]:
        """The running requests, oldest first."""
        return tuple(
            RunningState(
                live.request.request_id,
                live.slot,
                tuple(live.tokens),
                live.cached,
                live.prefill_end,
                tuple(live.pages),
            )
            for live in self._running
        )

    def waiting(self) -> tuple[Hashable, ...]:
        """The waiting requests' ids, in admission order."""
        return tuple(live.request.request_id for live in self._waiting)

    def max_footprint_tokens(self, request: Request) -> int:
        """The most positions ``request`` can ever hold pages for: ``prompt + max_tokens - 1 +
        n`` (a running request has generated at most ``max_tokens - 1`` tokens, and a step
        writes ``n + 1`` positions from its last token on)."""
        prompt = len(request.prompt_token_ids)
        return prompt + request.params.max_tokens - 1 + self.num_speculative

    # --- submission ------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queues ``request`` (admitted by a later ``plan_step``, in submission order).

        Raises:
          ValueError: not a ``Request``; its id already names an unfinished request; or it can
            never fit: its largest footprint needs more pages than the pool has to give.
        """
        if not isinstance(request, Request):
            raise ValueError(f"request must be a serving.requests.Request, got {request!r}")
        if request.request_id in self._by_id:
            raise ValueError(f"request_id {request.request_id!r} is already queued or running")
        footprint = self.max_footprint_tokens(request)
        needed = pages_needed(footprint, self.page_size)
        if needed > self.usable_pages:
            raise ValueError(
                f"request {request.request_id!r} can never fit: its prompt of "
                f"{len(request.prompt_token_ids)} tokens, max_tokens={request.params.max_tokens} "
                f"and {self.num_speculative} speculative tokens need up to {footprint} positions, "
                f"{needed} pages of {self.page_size}, but the pool has {self.usable_pages} "
                "usable pages"
            )
        live = _Live(
            request=request,
            tokens=list(request.prompt_token_ids),
            stop_token_ids=frozenset(request.params.stop_token_ids),
        )
        self._by_id[request.request_id] = live
        self._waiting.append(live)

    # --- planning --------------------------------------------------------------------------

    def plan_step(self, max_decode_steps: int = 1) -> Step:
        """Decides the next step: growth (preempting if the pool runs dry), prefill chunks,
        admissions, and the decode batch.

        Args:
          max_decode_steps: the most plain decode steps the decode batch may run at once, a
            power of two (``DecodeBatch.num_steps``; module docstring): the batch gets the
            largest power of two up to it for which nothing can change, 1 when something can.

        Returns:
          The ``Step``. Run it, then call ``commit_step`` with it before planning again.

        Raises:
          RuntimeError: if the previous step was not committed.
          ValueError: ``max_decode_steps`` not a power of two >= 1.
        """
        if self._plan is not None:
            raise RuntimeError("commit_step the previous step before planning another")
        if (
            isinstance(max_decode_steps, bool)
            or not isinstance(max_decode_steps, int | np.integer)
            or max_decode_steps < 1
            or max_decode_steps & (max_decode_steps - 1)
        ):
            raise ValueError(
                f"max_decode_steps must be a power of two >= 1, got {max_decode_steps!r}"
            )
        preempted = self._grow_running()
        admitted = []
        if not preempted:
            while self._waiting and self._free_slots:
                live = self._admit_head()
                if live is None:
                    break
                admitted.append(live.request.request_id)
        # Decodes first, then prefill within the budget, and the grant (step_decision.py).
        n = self.num_speculative
        prefilling = [live for live in self._running if live.prefilling]
        state = dataclasses.replace(
            self._decision,
            decode_tokens=(len(self._running) - len(prefilling)) * (n + 1),
            prefills=tuple(
                (live.request.request_id, live.prefill_end - live.cached) for live in prefilling
            ),
        )
        decision, self._decision = decide_step(state)
        chunks: list[PromptChunk] = []
        prefill_ends: list[tuple[_Live, int]] = []
        for live, (_, tokens) in zip(prefilling, decision.prefill_tokens, strict=True):
            if tokens:
                self._plan_prefill(live, tokens, chunks, prefill_ends)
        # Rows ready to decode: those past prefill, and those whose prefill ends in this step.
        ends = {id(live): end for live, end in prefill_ends}
        rows = [
            (live.slot, live)
            for live in self._running
            if ends.get(id(live), live.cached) >= live.prefill_end
        ]
        num_steps = 1
        if rows and max_decode_steps > 1 and not chunks:
            num_steps = self._reserve_steps_ahead(rows, int(max_decode_steps))
        step = Step(
            index=next(self._steps),
            prefill=tuple(chunks),
            decode=self._decode_batch(rows, ends, num_steps) if rows else None,
            admitted=tuple(admitted),
            preempted=tuple(preempted),
            granted=decision.granted,
        )
        self._plan = _Plan(step, prefill_ends, rows)
        return step

    def _grow_running(self) -> list[Hashable]:
        """Gives every decoding request the pages its next ``n + 1`` writes need, oldest first,
        preempting the newest running request while the pool is short. Returns who was
        preempted."""
        preempted = []
        index = 0
        while index < len(self._running):
            live = self._running[index]
            index += 1
            if live.prefilling:  # admission reserved its pages up to its first decode step
                continue
            missing = pages_needed(live.cached + 1 + self.num_speculative, self.page_size)
            missing -= len(live.pages)
            while missing > self.pool.num_free and self._running[-1] is not live:
                victim = self._running[-1]
                self._preempt(victim)
                preempted.append(victim.request.request_id)
            if missing > self.pool.num_free:
                # Only the newest is left short: it yields. (The oldest alone always fits.)
                self._preempt(live)
                preempted.append(live.request.request_id)
                break
            if missing > 0:
                grown = self.pool.allocate(missing)
                self._set_slot_pages(live.slot, len(live.pages), grown)
                live.pages.extend(grown)
        return preempted

    def _reserve_steps_ahead(self, rows: list[tuple[int, _Live]], max_steps: int) -> int:
        """How many decode steps the batch of ``rows`` can run with nothing changing between
        them, ``K`` (a power of two up to ``max_steps``), with the pages of their ``K`` writes
        reserved now; 1 (nothing reserved beyond ``_grow_running``'s) when something can
        change: speculation, a request still prefilling, a waiting request with a free slot
        (admissible as soon as pages allow), or no ``K > 1`` that every row's ``max_tokens``
        and the free pages allow. A row reaching ``max_tokens`` exactly at step ``K`` is fine:
        it finishes when the batch commits, as it would after ``K`` single steps."""
        if self.num_speculative or len(rows) != len(self._running):
            return 1
        if self._waiting and self._free_slots:
            return 1
        remaining = min(live.request.params.max_tokens - live.num_generated for _, live in rows)
        steps = 1 << (min(max_steps, remaining).bit_length() - 1)

        def missing(live: _Live, steps: int) -> int:
            return max(pages_needed(live.cached + steps, self.page_size) - len(live.pages), 0)

        while steps > 1 and sum(missing(live, steps) for _, live in rows) > self.pool.num_free:
            steps //= 2  # the pool cannot hold them: fewer steps, never a preemption
        if steps > 1:
            for _, live in rows:
                grown = self.pool.allocate(missing(live, steps))
                self._set_slot_pages(live.slot, len(live.pages), grown)
                live.pages.extend(grown)
        return steps

    def _preempt(self, live: _Live) -> None:
        """Sends the newest running request back to the queue's front, freeing its pages; it
        keeps its tokens and will prefill them again."""
        assert self._running[-1] is live
        self._running.pop()
        self._release(live.pages)
        live.pages, live.cached, live.prefill_end = [], 0, 0
        live.pending.clear()
        heapq.heappush(self._free_slots, live.slot)
        live.slot = -1
        live.num_preemptions += 1
        self.stats["preempted"] += 1
        # Older than every waiting request (FIFO), so it goes first.
        self._waiting.appendleft(live)

    def _admit_head(self) -> _Live | None:
        """Admits the head of the queue if its prefix is not being computed elsewhere and the
        pool has its pages; returns it, or None (nothing changes then)."""
        live = self._waiting[0]
        # A preempted request is readmitted only once its tokens are known (resolve_step runs
        # before the next plan, and a step that preempts admits nobody).
        assert UNRESOLVED_TOKEN not in live.tokens, "readmitting a request with unknown tokens"
        num_full = (len(live.tokens) - 1) // self.page_size  # full pages inside the prefill
        shared: list[int] = []
        parent = _NO_PARENT
        for k in range(num_full):
            key = (parent, tuple(live.tokens[k * self.page_size : (k + 1) * self.page_size]))
            page = self._prefix_page.get(key)
            if page is None:
                break
            if page in self._pending_pages:
                # Another request is prefilling this prefix: share it once it is computed.
                self.stats["waits_for_prefix"] += 1
                return None
            shared.append(page)
            parent = page
        total = pages_needed(len(live.tokens) + self.num_speculative, self.page_size)
        if total - len(shared) > self.pool.num_free:
            self.stats["waits_for_pages"] += 1
            return None
        self._waiting.popleft()
        self.pool.share(shared)
        live.pages = shared + self.pool.allocate(total - len(shared))
        live.cached = len(shared) * self.page_size
        live.prefill_end = len(live.tokens) - 1
        for k in range(len(shared), num_full):
            key = (parent, tuple(live.tokens[k * self.page_size : (k + 1) * self.page_size]))
            page = live.pages[k]
            self._prefix_page[key] = page
            self._page_key[page] = key
            self._pending_pages.add(page)
            live.pending.append((k, page))
            parent = page
        live.slot = heapq.heappop(self._free_slots)
        self._set_slot_pages(live.slot, 0, live.pages)
        self._running.append(live)  # newer than every running request: order kept
        self.stats["admitted"] += 1
        self.stats["shared_prefix_pages"] += len(shared)
        return live

    def _plan_prefill(
        self,
        live: _Live,
        budget: int,
        chunks: list[PromptChunk],
        prefill_ends: list[tuple[_Live, int]],
    ) -> int:
        """Appends the request's chunks for this step (power-of-two lengths, within
        ``budget``) and its cached length after them; returns the budget left."""
        start = live.cached
        while start < live.prefill_end and budget > 0:
            length = min(live.prefill_end - start, budget, self.prefill_chunk_size)
            length = 1 << (length.bit_length() - 1)  # the largest power of two that fits
            end = start + length
            pages = live.pages[: pages_needed(end, self.page_size)]
            chunks.append(
                PromptChunk(
                    request_id=live.request.request_id,
                    slot=live.slot,
                    token_ids=np.asarray(live.tokens[start:end], np.int32),
                    start_position=start,
                    page_table=paged.host_page_table([pages], [end], self.page_size),
                )
            )
            budget -= length
            start = end
        if start > live.cached:
            prefill_ends.append((live, start))
        return budget

    def _decode_batch(
        self, rows: list[tuple[int, _Live]], ends: dict[int, int], num_steps: int = 1
    ) -> DecodeBatch:
        n = self.num_speculative
        request_ids: list[Hashable | None] = [None] * self.parallel
        params: list[SamplingParams | None] = [None] * self.parallel
        active = np.zeros(self.parallel, bool)
        token_ids = np.zeros(self.parallel, np.int32)
        positions = np.zeros(self.parallel, np.int32)
        num_generated = np.zeros(self.parallel, np.int32)
        for slot, live in rows:
            request_ids[slot] = live.request.request_id
            params[slot] = live.request.params
            active[slot] = True
            token_ids[slot] = live.tokens[-1]
            # The cache's length after this step's prefill: where the last token goes.
            positions[slot] = ends.get(id(live), live.cached)
            num_generated[slot] = live.num_generated
        draft_tables = step_tables = ()
        if num_steps > 1:  # n = 0; idle rows stay one token on the padding page
            last = self._slot_table(np.where(active, positions + num_steps, 1), active)
            size = last.page_indices.shape[0]
            step_tables = (
                *(
                    self._slot_table(np.where(active, positions + k + 1, 1), active, size)
                    for k in range(num_steps - 1)
                ),
                last,
            )
            table = step_tables[0]
        else:
            table = self._slot_table(positions + (n + 1), active)
        if n:
            size = table.page_indices.shape[0]
            passes = [self._slot_table(positions + (j + 1), active, size) for j in range(n)]
            draft_tables = (*passes, table)
        return DecodeBatch(
            request_ids=tuple(request_ids),
            params=tuple(params),
            active=active,
            token_ids=token_ids,
            positions=positions,
            num_generated=num_generated,
            num_speculative=n,
            page_table=table,
            draft_page_tables=draft_tables,
            num_steps=num_steps,
            step_page_tables=step_tables,
        )

    def _slot_table(
        self, seq_lens: np.ndarray, active: np.ndarray, num_indices: int | None = None
    ) -> paged.PageTable:
        """The CSR table (host NumPy arrays) of every slot over ``seq_lens`` tokens, from the
        slot grid; inactive rows (idle, or still prefilling) read the padding page."""
        page_size = self.page_size
        # One table a plain step, planned while the device runs the previous one (issue 18):
        # a few rows are cheaper row by row in Python ints (~10 us against ~20 us for the NumPy
        # form's dozen calls on a CPU), many in NumPy. Both build the same table.
        if self.parallel <= PYTHON_TABLE_MAX_ROWS:
            lengths = seq_lens.tolist()
            counts = [-(-length // page_size) for length in lengths]
            indptr = np.array([0, *itertools.accumulate(counts)], np.int32)
            nnz = int(indptr[-1])
            size = paged.bucket_size(nnz) if num_indices is None else num_indices
            indices = np.zeros(size, np.int32)
            start = 0
            for slot, (count, live) in enumerate(zip(counts, active.tolist(), strict=True)):
                pages = self._slot_pages[slot, :count] if live else self.padding_page
                indices[start : start + count] = pages
                start += count
            last = np.array([(length - 1) % page_size + 1 for length in lengths], np.int32)
            return paged.PageTable(indptr, indices, last, page_size)
        counts = -(-seq_lens // page_size)
        indptr = np.zeros(self.parallel + 1, np.int32)
        np.cumsum(counts, out=indptr[1:])
        nnz = int(indptr[-1])
        indices = np.zeros(paged.bucket_size(nnz) if num_indices is None else num_indices, np.int32)
        width = int(counts.max())
        # Row-major boolean selection keeps each row's pages in order, rows in slot order.
        indices[:nnz] = self._slot_pages[:, :width][np.arange(width) < counts[:, None]]
        if not active.all():  # the padding mask only where a row needs it
            indices[:nnz][np.repeat(~active, counts)] = self.padding_page
        # The last page's tokens, s - page_size * (counts - 1), in one pass (also for s = 0).
        last = ((seq_lens - 1) % page_size + 1).astype(np.int32, copy=False)
        return paged.PageTable(indptr, indices, last, page_size)

    def _set_slot_pages(self, slot: int, start: int, pages: Sequence[int]) -> None:
        """Writes ``pages`` into the slot's grid row from column ``start``, widening the grid
        (doubling) when a request outgrows it."""
        end = start + len(pages)
        width = self._slot_pages.shape[1]
        if end > width:
            grown = np.zeros((self.parallel, max(end, 2 * width)), np.int32)
            grown[:, :width] = self._slot_pages
            self._slot_pages = grown
        self._slot_pages[slot, start:end] = pages

    # --- committing ------------------------------------------------------------------------

    def commit_step(
        self,
        step: Step,
        token_ids=None,
        num_accepted=None,
        *,
        draft_token_ids=None,
    ) -> StepOutput:
        """Records what ``step`` produced: prefill progress, emitted tokens, rewinds, finishes.

        Row ``b`` of the decode batch emitted ``token_ids[b, :num_accepted[b] + 1]``: its
        accepted drafts, then the correction or bonus token (``chain_speculative_sampling``'s
        outputs as they come). Both caches are rewound to ``positions[b] + 1 +
        num_accepted[b]``; tokens after a stop token, or past ``max_tokens``, are discarded and
        the request finishes, freeing its pages. A batch of ``K`` plain decode steps
        (``DecodeBatch.num_steps``) is committed with ``token_ids[b, k]`` the token of step
        ``k``, for the ``K' <= K`` steps run: each row emitted all ``K'`` (up to a stop token),
        and the pages reserved for steps not run are freed. Validated first: on error nothing
        changes.

        Args:
          step: the step returned by the last ``plan_step``.
          token_ids: int ``[B, n + 1]`` (or ``[B]`` when ``n = 0``) per slot; idle rows and
            entries past ``num_accepted + 1`` are ignored (-1 padding is fine). A batch of
            ``K`` plain steps: ``[B, K']``, ``1 <= K' <= K``. None when the step has no decode
            batch.
          num_accepted: int ``[B]`` in ``[0, n]``; None means all zero (plain decoding), and
            must be None for ``K' > 1`` plain steps.
          draft_token_ids: optional int ``[B, n]``, the drafts fed: checked to agree with the
            accepted tokens, to catch an engine that mixes up its rows.

        Returns:
          The ``StepOutput``: its ``new_token_ids`` and ``finished`` (the engine adds the rest).

        Raises:
          ValueError: a step other than the outstanding one; shapes unlike the above (more
            steps than planned included); a count outside ``[0, n]``; an emitted token id < 0;
            accepted tokens unlike the drafts.
        """
        plan = self._plan
        if plan is None or step is not plan.step:
            raise ValueError("step is not the outstanding step of this scheduler")
        emitted = self._check_outputs(plan, token_ids, num_accepted, draft_token_ids)
        self._plan = None
        self._commit_prefill(plan)
        new_token_ids, finished = {}, []
        for (_, live), tokens in zip(plan.decode_rows, emitted, strict=True):
            # Both caches hold the fed last token and the accepted drafts, nothing after.
            live.cached = self._accepted_length(live.cached, len(tokens) - 1)
            kept, reason = self._append_tokens(live, tokens)
            new_token_ids[live.request.request_id] = kept
            if reason is None:
                self._trim_pages(live)
            else:
                finished.append(self._finish(live, reason))
        return StepOutput(new_token_ids, tuple(finished))

    def _commit_prefill(self, plan: _Plan) -> None:
        for live, end in plan.prefill_ends:
            live.cached = end
            while live.pending and (live.pending[0][0] + 1) * self.page_size <= end:
                self._pending_pages.discard(live.pending.popleft()[1])

    def _trim_pages(self, live: _Live) -> None:
        """Frees the request's pages past its cached length (a rewind's leftovers)."""
        keep = pages_needed(live.cached, self.page_size)
        if keep < len(live.pages):
            self._release(live.pages[keep:])
            del live.pages[keep:]

    # --- committing before the tokens are known (overlapped steps, n = 0) -------------------

    def commit_step_unresolved(self, step: Step, num_steps: int | None = None) -> None:
        """Commits ``step`` before its tokens reach the host (plain decoding only).

        Each decode row emitted exactly one token a step (``n = 0``), so everything but the
        tokens' values is known: the cache grows by one a step, the token list gets
        ``UNRESOLVED_TOKEN`` in each token's place (the next step feeds the last from the
        device: ``DecodeBatch.token_ids`` is -1 there), and a request that reached
        ``max_tokens`` retires now (pages and slot freed; a later step on the device may still
        write its pages, but it runs before any step that reuses them). Stop tokens can only be
        applied when the tokens are known: ``resolve_step`` does it, one step late; the
        request's row in the step planned meanwhile is wasted and its token discarded. Rows of
        requests that such a stop finished after ``step`` was planned are skipped.

        Args:
          step: the outstanding step.
          num_steps: the decode steps run, 1 to ``step.decode.num_steps`` (None: all of them);
            pages reserved for the steps not run are freed.

        Raises:
          ValueError: a step other than the outstanding one, a speculative scheduler (the
            number of tokens a speculative row emits is only known with them), or
            ``num_steps`` outside the range above.
        """
        plan = self._plan
        if plan is None or step is not plan.step:
            raise ValueError("step is not the outstanding step of this scheduler")
        if self.num_speculative:
            raise ValueError(
                f"commit_step_unresolved needs plain decoding; num_speculative is "
                f"{self.num_speculative} (a row's token count is known only with its tokens)"
            )
        planned = step.decode.num_steps if step.decode is not None else 1
        count = planned if num_steps is None else num_steps
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= planned:
            raise ValueError(f"num_steps must be an integer in [1, {planned}], got {num_steps!r}")
        self._plan = None
        self._commit_prefill(plan)
        rows = []
        for slot, live in plan.decode_rows:
            if live.done:  # a stop token resolved after this step was planned
                continue
            live.cached = self._accepted_length(live.cached, count - 1)
            rows.append((slot, live, len(live.tokens)))  # where its first new token goes
            live.tokens.extend([UNRESOLVED_TOKEN] * count)
            if live.num_generated >= live.request.params.max_tokens:
                live.provisional_reason = "length"
                self._retire(live)
            else:
                self._trim_pages(live)
        # Even empty: the engine resolves every step.
        self._unresolved[step.index] = (rows, count)

    def resolve_step(self, step: Step, token_ids) -> StepOutput:
        """The tokens of a step committed by ``commit_step_unresolved``: they replace the
        placeholders, and stop tokens finish their requests now (one step late: later tokens
        of such a request are discarded; its pages and slot are freed).

        Args:
          step: the step, as ``plan_step`` returned it.
          token_ids: int ``[B, K]`` (or ``[B]`` when ``K = 1``), the tokens each slot sampled
            in the ``K`` decode steps committed.

        Returns:
          The ``StepOutput`` of ``step``: tokens kept and requests finished.

        Raises:
          ValueError: a step with nothing to resolve, or tokens of the wrong shape or < 0.
        """
        entry = self._unresolved.get(step.index)
        if entry is None:
            raise ValueError(f"step {step.index} has no unresolved tokens")
        rows, count = entry
        tokens = np.asarray(token_ids)
        if tokens.ndim == 1 and count == 1:
            tokens = tokens[:, None]
        if tokens.shape != (self.parallel, count) or not np.issubdtype(tokens.dtype, np.integer):
            expected = f"[{self.parallel}]" if count == 1 else f"[{self.parallel}, {count}]"
            raise ValueError(
                f"token_ids must be integers of shape {expected}, got "
                f"{tokens.dtype}{list(tokens.shape)}"
            )
        for slot, live, _ in rows:
            for offset in range(count):
                if not live.done and tokens[slot, offset] < 0:
                    where = f"{slot}" if count == 1 else f"{slot}, {offset}"
                    raise ValueError(f"token_ids[{where}]={tokens[slot, offset]} is not a token id")
        del self._unresolved[step.index]
        new_token_ids, finished = {}, []
        for slot, live, index in rows:
            if live.done:
                continue
            kept, stopped = [], False
            for offset, token in enumerate(tokens[slot].tolist()):
                live.tokens[index + offset] = token
                kept.append(token)
                if token in live.stop_token_ids:
                    stopped = True
                    break
            new_token_ids[live.request.request_id] = tuple(kept)
            if stopped:
                del live.tokens[index + len(kept) :]  # whatever later steps added is discarded
                if live.provisional_reason is None:
                    if live in self._running:
                        self._retire(live)
                    else:  # preempted after this step: it waits to be recomputed
                        self._waiting.remove(live)
                finished.append(self._output(live, "stop"))
            elif live.provisional_reason is not None and index + count == len(live.tokens):
                finished.append(self._output(live, live.provisional_reason))
        return StepOutput(new_token_ids, tuple(finished))

    @property
    def num_unresolved_steps(self) -> int:
        """Steps committed whose tokens ``resolve_step`` has not yet received."""
        return len(self._unresolved)

    @staticmethod
    def _accepted_length(position: int, num_accepted: int) -> int:
        """The rewind rule in one place: the token fed at ``position`` and the ``num_accepted``
        drafts after it are valid. (The tests replace it by one off by one either way, and
        check that they notice.)"""
        return position + 1 + num_accepted

    def _check_step_tokens(self, step: Step, token_ids, name: str) -> np.ndarray:
        """``token_ids`` as integers ``[B, width]``: ``n + 1`` wide when speculating, else the
        steps run, 1 to the batch's ``num_steps`` (the engine may run fewer steps than planned:
        the pages reserved for the rest are freed at commit); ``[B]`` means one step."""
        n, batch = self.num_speculative, self.parallel
        tokens = np.asarray(token_ids)
        if tokens.ndim == 1 and n == 0:
            tokens = tokens[:, None]
        widths = (n + 1,) if n else range(1, step.decode.num_steps + 1)
        if (
            tokens.ndim != 2
            or tokens.shape[0] != batch
            or tokens.shape[1] not in widths
            or not np.issubdtype(tokens.dtype, np.integer)
        ):
            width = n + 1 if n else step.decode.num_steps
            expected = f"[{batch}, {width}]" if width == 1 or n else f"[{batch}, 1..{width}]"
            raise ValueError(
                f"{name} must be integers of shape {expected}, got "
                f"{tokens.dtype}{list(tokens.shape)}"
            )
        return tokens

    def _check_outputs(self, plan, token_ids, num_accepted, draft_token_ids) -> list[list[int]]:
        """Each decode row's emitted tokens, after checking the arrays (nothing changes)."""
        if plan.step.decode is None:
            if token_ids is not None or num_accepted is not None or draft_token_ids is not None:
                raise ValueError("this step has no decode batch: pass no token_ids")
            return []
        n, batch = self.num_speculative, self.parallel
        if token_ids is None:
            raise ValueError("token_ids is required: this step has a decode batch")
        tokens = self._check_step_tokens(plan.step, token_ids, "token_ids")
        if n == 0 and tokens.shape[1] > 1:  # several plain steps: each row kept every token
            if num_accepted is not None:
                raise ValueError(
                    f"num_accepted must be None for {tokens.shape[1]} plain decode steps, got "
                    f"{num_accepted!r}"
                )
            num_accepted = np.full(batch, tokens.shape[1] - 1)
        accepted = np.zeros(batch, np.int64) if num_accepted is None else np.asarray(num_accepted)
        if accepted.shape != (batch,) or not np.issubdtype(accepted.dtype, np.integer):
            raise ValueError(
                f"num_accepted must be integers of shape [{batch}], got "
                f"{accepted.dtype}{list(accepted.shape)}"
            )
        drafts = None
        if draft_token_ids is not None:
            drafts = np.asarray(draft_token_ids)
            if drafts.shape != (batch, n):
                raise ValueError(
                    f"draft_token_ids must have shape [{batch}, {n}], got {list(drafts.shape)}"
                )
        emitted = []
        most = n if n else tokens.shape[1] - 1
        for slot, live in plan.decode_rows:
            count = int(accepted[slot])
            if not 0 <= count <= most:
                raise ValueError(f"num_accepted[{slot}]={count} is outside [0, {most}]")
            row = tokens[slot, : count + 1].tolist()
            if min(row) < 0:
                raise ValueError(
                    f"token_ids[{slot}] emits {row} for request {live.request.request_id!r}: "
                    "a token id < 0"
                )
            if drafts is not None and row[:count] != drafts[slot, :count].tolist():
                raise ValueError(
                    f"token_ids[{slot}, :{count}]={row[:count]} are not the accepted drafts "
                    f"{drafts[slot, :count].tolist()}"
                )
            emitted.append(row)
        return emitted

    def _append_tokens(self, live: _Live, tokens: list[int]):
        """Appends emitted tokens up to a stop token or ``max_tokens``; returns the kept tokens
        and the finish reason (None while it runs on)."""
        max_tokens = live.request.params.max_tokens
        kept = []
        for token in tokens:
            live.tokens.append(token)
            kept.append(token)
            if token in live.stop_token_ids:
                return tuple(kept), "stop"
            if live.num_generated >= max_tokens:
                return tuple(kept), "length"
        return tuple(kept), None

    def _finish(self, live: _Live, reason) -> RequestOutput:
        self._retire(live)
        return self._output(live, reason)

    def _retire(self, live: _Live) -> None:
        """Takes a finished request out of the running set: its pages and slot are free."""
        self._running.remove(live)
        self._release(live.pages)
        live.pages = []
        heapq.heappush(self._free_slots, live.slot)
        live.slot = -1

    def _output(self, live: _Live, reason) -> RequestOutput:
        """The finished request's output; its id is free from now on."""
        live.done = True
        del self._by_id[live.request.request_id]
        self.stats["finished"] += 1
        prompt = live.request.prompt_token_ids
        return RequestOutput(
            request_id=live.request.request_id,
            prompt_token_ids=prompt,
            token_ids=tuple(live.tokens[len(prompt) :]),
            finish_reason=reason,
            num_preemptions=live.num_preemptions,
        )

    def _release(self, pages: Sequence[int]) -> None:
        """Drops one reference to each page; a prefix page nobody holds leaves the registry."""
        self.pool.free(pages)
        for page in pages:
            if self.pool.ref_count(page) == 0:
                key = self._page_key.pop(page, None)
                if key is not None:
                    del self._prefix_page[key]
                    self._pending_pages.discard(page)
