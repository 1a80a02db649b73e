"""The serving scheduler's bookkeeping, checked against a shadow engine that simulates the caches.

``ShadowEngine`` plays the engine without a model. It keeps, for each pool (target and draft),
what every page slot holds: the tuple of tokens whose keys and values were computed there,
built the way a model builds them (the token fed at position ``p`` on top of whatever the cache
holds at ``p - 1``). So a cache position is valid exactly when its tuple equals the request's
true prefix, and a rewind off by one in either direction leaves a wrong tuple behind (too long:
a rejected draft's entry stays; too short: the next step writes the last token one position
early), which the checks below find; ``test_off_by_one_rewinds_are_caught`` makes sure they do.

Checked on every step: each write goes to a page with reference count 1 that belongs to the
writing request and to no other; every position a step reads holds the request's true prefix;
the tables cover exactly the lengths the step needs; idle rows only touch the padding page.
Checked between steps (the state machine's invariants): reference counts equal the holders,
no page leaked, shared pages lie below every holder's cached length, slots and FIFO order.

Decode batches of several steps (``plan_step(max_decode_steps=K)``) run in the shadow step by
step, each step feeding the token sampled before over its own table, all ``K`` steps or (as an
engine whose kernel plans change variant) fewer; checked besides: nothing could change inside
the block (no prefill, no admissible waiting request, no ``max_tokens`` finish before its end).
Shown to fail: dropping the ``max_tokens`` bound on ``K`` (a finish is due), or reserving no
pages for the block's later steps (a table row is not the writer's pages). The shadow commits
synchronously; blocks under the overlapped protocol (``commit_step_unresolved``, then
``resolve_step`` a block late) run at random in
``test_blocks_in_both_protocols_keep_pages_and_tokens_consistent``.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import paged
from serving.requests import Request, RequestOutput, SamplingParams
from serving.scheduler import UNRESOLVED_TOKEN, Scheduler, pages_needed
from serving.step_decision import prefill_budget

VOCAB = 6  # small, so prompts share prefixes and drafts hit stop tokens often
STOP_TOKENS = (0,)  # the random protocol runs' stop token: one sampled token in six


# ----------------------------------------------------------------------------------------------
# The shadow engine


class ShadowEngine:
    """Runs a scheduler's steps against simulated caches and checks every read and write.

    ``check_contract`` also asserts the cache contract directly (a decode row feeds the last
    token at ``len(tokens) - 1``); off, only the simulated cache contents can catch a bad
    rewind.
    """

    def __init__(
        self, scheduler: Scheduler, *, check_contract: bool = True, max_decode_steps: int = 1
    ):
        self.scheduler = scheduler
        self.max_decode_steps = max_decode_steps
        self.page_size = scheduler.page_size
        self.check_contract = check_contract
        self.caches = ("target", "draft") if scheduler.num_speculative else ("target",)
        self.kv: dict[str, dict[tuple[int, int], tuple | None]] = {c: {} for c in self.caches}
        self.requests: dict[object, Request] = {}
        self.generated: dict[object, list[int]] = {}
        self.outputs: dict[object, RequestOutput] = {}
        # Steps each prefilling request has gone without a chunk (the grant bounds it).
        self.parked: dict[object, int] = {}
        # Decode batches of several steps, by the steps planned and run (for events).
        self.blocks: collections.Counter = collections.Counter()

    # --- requests ------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        self.scheduler.submit(request)
        self.requests[request.request_id] = request
        self.generated[request.request_id] = []

    def unfinished(self) -> set:
        return set(self.requests) - set(self.outputs)

    # --- the simulated caches ------------------------------------------------------------

    def _slot(self, pages, position):
        return pages[position // self.page_size], position % self.page_size

    def _read(self, cache, pages, position):
        if position // self.page_size >= len(pages):
            return "beyond the request's pages"
        return self.kv[cache].get(self._slot(pages, position))

    def _write(self, cache, states, request_id, pages, position, token):
        """What a model does at ``position``: keys and values of ``token`` over the cache's
        prefix. Only the writing request may hold the page."""
        page, slot = self._slot(pages, position)
        state = states[request_id]
        assert page == state.pages[position // self.page_size], "table disagrees with pages"
        assert page != self.scheduler.padding_page, "a request writes the padding page"
        assert self.scheduler.pool.ref_count(page) == 1, f"write to shared page {page}"
        for other in states.values():
            if other.request_id != request_id:
                assert page not in other.pages, f"write to page {page} of {other.request_id!r}"
        before = self._read(cache, pages, position - 1) if position else ()
        self.kv[cache][(page, slot)] = None if before is None else (*before, token)

    def check_prefix(self, cache, pages, tokens, length, what=""):
        """Positions ``[0, length)`` hold the keys and values of ``tokens``' prefixes."""
        for position in range(length):
            held = self._read(cache, pages, position)
            assert held == tuple(tokens[: position + 1]), (
                f"{cache} cache {what} position {position} holds {held}, not the prefix "
                f"{tuple(tokens[: position + 1])}"
            )

    def check_caches(self) -> None:
        """Between steps: every running request's cache holds its true prefix up to its
        cached length, and it holds exactly the pages it needs."""
        n = self.scheduler.num_speculative
        for state in self.scheduler.running():
            for cache in self.caches:
                self.check_prefix(cache, state.pages, state.token_ids, state.num_cached)
            if state.num_cached < state.prefill_end:  # reserved up to its first decode step
                want = pages_needed(state.prefill_end + 1 + n, self.page_size)
            else:
                want = pages_needed(state.num_cached, self.page_size)
                if self.check_contract:
                    assert state.num_cached == len(state.token_ids) - 1
            assert len(state.pages) == want, f"{state.request_id!r} holds {len(state.pages)}"

    # --- one step ----------------------------------------------------------------------------

    def _check_row(self, table: paged.PageTable, row: int, pages, length: int) -> None:
        assert table.seq_lens()[row] == length
        assert table.page_lists()[row] == list(pages[: pages_needed(length, self.page_size)])

    def check_prefill_decision(self, step, states, prefilled) -> None:
        """The step's prefill keeps the budget (decode rows first, ``n + 1`` tokens each), beyond
        it only one granted chunk a granted request, and no prefilling request goes more than
        ``prefill_grant_interval`` steps in a row without a chunk (the fairness grant)."""
        scheduler = self.scheduler
        budget = scheduler.budget
        n = scheduler.num_speculative
        prefilling = {rid for rid, s in states.items() if s.num_cached < s.prefill_end}
        decode_tokens = (len(states) - len(prefilling)) * (n + 1)
        within = sum(tokens for rid, tokens in prefilled.items() if rid not in step.granted)
        assert within <= prefill_budget(budget, decode_tokens)
        for rid in step.granted:
            assert rid in prefilling and 1 <= prefilled[rid] <= budget.prefill_chunk_size
        for rid in prefilling:
            self.parked[rid] = 0 if prefilled[rid] else self.parked.get(rid, 0) + 1
            assert self.parked[rid] <= budget.prefill_grant_interval, f"{rid!r} starves"
        for rid in set(self.parked) - prefilling:
            del self.parked[rid]

    def run(self, step, rng: np.random.Generator, accept=None):
        """Runs ``step``; returns ``commit_step``'s arguments. ``accept`` fixes the accepted
        counts per slot (default: random, 0 and n often)."""
        scheduler, n = self.scheduler, self.scheduler.num_speculative
        states = {state.request_id: state for state in scheduler.running()}
        cached = {rid: state.num_cached for rid, state in states.items()}
        prefilled = collections.Counter()
        for chunk in step.prefill:
            state = states[chunk.request_id]
            length = len(chunk.token_ids)
            assert length & (length - 1) == 0 and length <= scheduler.prefill_chunk_size
            assert chunk.start_position == cached[chunk.request_id], "chunks out of order"
            end = chunk.start_position + length
            assert end <= state.prefill_end
            assert chunk.token_ids.tolist() == list(state.token_ids[chunk.start_position : end])
            self._check_row(chunk.page_table, 0, state.pages, end)
            for cache in self.caches:
                self.check_prefix(cache, state.pages, state.token_ids, chunk.start_position)
                for position in range(chunk.start_position, end):
                    token = state.token_ids[position]
                    self._write(cache, states, chunk.request_id, state.pages, position, token)
            cached[chunk.request_id] = end
            prefilled[chunk.request_id] += length
        self.check_prefill_decision(step, states, prefilled)

        decode = step.decode
        if decode is None:
            assert all(cached[r] < s.prefill_end for r, s in states.items())
            return None, None, None
        batch = scheduler.parallel
        drafts = rng.integers(0, VOCAB, size=(batch, n))
        token_ids = np.full((batch, n + 1), -1)
        accepted = np.zeros(batch, np.int64)
        assert decode.num_speculative == n and len(decode.draft_page_tables) == (n + 1 if n else 0)
        if decode.num_steps > 1:
            return self._run_steps(decode, states, cached, rng)
        for slot in range(batch):
            request_id = decode.request_ids[slot]
            if request_id is None:
                assert not decode.active[slot]
                for j, table in enumerate((*decode.draft_page_tables, decode.page_table)):
                    length = n + 1 if j == len(decode.draft_page_tables) else j + 1
                    assert table.seq_lens()[slot] == length
                    assert set(table.page_lists()[slot]) == {scheduler.padding_page}
                continue
            state = states[request_id]
            position = int(decode.positions[slot])
            assert decode.active[slot] and cached[request_id] >= state.prefill_end
            assert position == cached[request_id], "decode position is not the cached length"
            assert decode.token_ids[slot] == state.token_ids[-1]
            assert decode.num_generated[slot] == len(self.generated[request_id])
            assert decode.params[slot] == self.requests[request_id].params
            if self.check_contract:
                assert position == len(state.token_ids) - 1, "the cache contract is broken"
            fed = [state.token_ids[-1], *drafts[slot].tolist()]
            # Draft passes: j feeds fed[j] at position + j over a table of position + j + 1.
            for j, table in enumerate(decode.draft_page_tables):
                self._check_row(table, slot, state.pages, position + j + 1)
                self._write("draft", states, request_id, state.pages, position + j, fed[j])
            # Target: the n + 1 new tokens at once, reading the committed prefix below.
            self._check_row(decode.page_table, slot, state.pages, position + n + 1)
            self.check_prefix("target", state.pages, state.token_ids, position, "read")
            for j in range(n + 1):
                self._write("target", states, request_id, state.pages, position + j, fed[j])
            # What the model conditions on when it predicts the next token: exactly the
            # request's tokens (this alone exposes a cache one entry too short).
            for cache in self.caches:
                held = self._read(cache, state.pages, position)
                assert held == tuple(state.token_ids), f"{cache} conditions on {held}"
            count = int(
                rng.choice([0, n, rng.integers(0, n + 1)]) if accept is None else accept[slot]
            )
            # The correction differs from the rejected draft, as in chain speculative sampling.
            correction = int(rng.integers(0, VOCAB))
            if count < n and correction == drafts[slot, count]:
                correction = (correction + 1) % VOCAB
            token_ids[slot, : count + 1] = [*drafts[slot, :count].tolist(), correction]
            accepted[slot] = count
        return token_ids, accepted, drafts

    def _run_steps(self, decode, states, cached, rng):
        """A batch of ``K`` plain decode steps: step ``k`` feeds the token step ``k - 1``
        sampled, at ``position + k``, over its own table. Runs all ``K`` or, now and then,
        fewer (as the engine does when the steps' kernel plans change variant)."""
        scheduler, batch, steps = self.scheduler, self.scheduler.parallel, decode.num_steps
        # Nothing may change inside the block: no speculation, nobody prefilling, no waiting
        # request with a free slot, no max_tokens finish before its last step.
        assert scheduler.num_speculative == 0
        assert all(cached[rid] >= state.prefill_end for rid, state in states.items())
        assert not scheduler.waiting() or len(states) == batch
        assert len(decode.step_page_tables) == steps and steps & (steps - 1) == 0
        assert decode.step_page_tables[0] is decode.page_table
        assert len({table.page_indices.shape for table in decode.step_page_tables}) == 1
        run = steps if rng.random() < 0.75 else int(rng.integers(1, steps))
        self.blocks[steps, run] += 1
        token_ids = rng.integers(0, VOCAB, size=(batch, run))
        for slot in range(batch):
            request_id = decode.request_ids[slot]
            if request_id is None:
                for table in decode.step_page_tables:
                    assert table.seq_lens()[slot] == 1
                    assert table.page_lists()[slot] == [scheduler.padding_page]
                continue
            state = states[request_id]
            position = int(decode.positions[slot])
            assert decode.active[slot] and position == cached[request_id]
            assert decode.token_ids[slot] == state.token_ids[-1]
            assert decode.num_generated[slot] == len(self.generated[request_id])
            max_tokens = self.requests[request_id].params.max_tokens
            assert len(self.generated[request_id]) + steps <= max_tokens, "a finish is due"
            if self.check_contract:
                assert position == len(state.token_ids) - 1, "the cache contract is broken"
            self.check_prefix("target", state.pages, state.token_ids, position, "read")
            for k, table in enumerate(decode.step_page_tables):  # reserved for every step
                self._check_row(table, slot, state.pages, position + k + 1)
            fed = [state.token_ids[-1], *token_ids[slot, : run - 1].tolist()]
            for k in range(run):
                self._write("target", states, request_id, state.pages, position + k, fed[k])
        return token_ids, None, None

    def commit(self, step, token_ids, accepted, drafts):
        """Commits and checks what was kept against the shadow's own stop rule."""
        n = self.scheduler.num_speculative
        if step.decode is None:
            output = self.scheduler.commit_step(step)
        else:
            output = self.scheduler.commit_step(
                step, token_ids, accepted if n else None, draft_token_ids=drafts
            )
        expected_rows = {
            rid for rid in (step.decode.request_ids if step.decode else ()) if rid is not None
        }
        assert set(output.new_token_ids) == expected_rows
        finished = {out.request_id: out for out in output.finished}
        for slot, rid in enumerate(step.decode.request_ids if step.decode else ()):
            if rid is None:
                continue
            params = self.requests[rid].params
            # Several plain steps (accepted None): every step's token, up to the shadow's stops.
            width = token_ids.shape[1] if accepted is None else accepted[slot] + 1
            emitted = token_ids[slot, :width].tolist()
            kept, reason = [], None
            for token in emitted:
                kept.append(token)
                if token in params.stop_token_ids:
                    reason = "stop"
                    break
                if len(self.generated[rid]) + len(kept) == params.max_tokens:
                    reason = "length"
                    break
            assert output.new_token_ids[rid] == tuple(kept)
            self.generated[rid].extend(kept)
            if reason is None:
                assert rid not in finished
            else:
                out = finished.pop(rid)
                assert out.finish_reason == reason
                assert out.token_ids == tuple(self.generated[rid])
                assert out.prompt_token_ids == self.requests[rid].prompt_token_ids
                self.outputs[rid] = out
        assert not finished, f"finished without decoding: {sorted(finished)}"
        self.check_caches()
        return output

    def step(self, rng, accept=None):
        step = self.scheduler.plan_step(self.max_decode_steps)
        output = self.commit(step, *self.run(step, rng, accept))
        return step, output

    def drain(self, rng, max_steps: int = 5000) -> None:
        """Steps until every request has finished."""
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished:
                break
            self.step(rng)
        assert not self.scheduler.has_unfinished, "requests left after max_steps"
        assert not self.unfinished()
        assert self.scheduler.pool.num_free == self.scheduler.usable_pages, "pages leaked"


def check_pool(scheduler: Scheduler) -> None:
    """Reference counts equal the holders (the padding page held once by the scheduler); every
    page is free or held, never both; a shared page lies below each holder's cached length."""
    running = scheduler.running()
    holders = collections.Counter(page for state in running for page in state.pages)
    holders[scheduler.padding_page] += 1
    pool = scheduler.pool
    assert [pool.ref_count(p) for p in range(pool.num_pages)] == [
        holders[p] for p in range(pool.num_pages)
    ]
    assert pool.num_free + len(holders) == pool.num_pages
    for state in running:
        assert len(set(state.pages)) == len(state.pages)
        for k, page in enumerate(state.pages):
            if holders[page] > 1:
                assert (k + 1) * scheduler.page_size <= state.num_cached, "shared, not computed"


def request(request_id, prompt, max_tokens=8, stop=(), **params) -> Request:
    return Request(
        request_id, prompt, SamplingParams(max_tokens=max_tokens, stop_token_ids=stop, **params)
    )


# ----------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.5, "temperature must be finite and >= 0"),
        ("temperature", float("inf"), "temperature must be finite"),
        ("temperature", float("nan"), "temperature must not be NaN"),
        ("temperature", "hot", "temperature must be a number"),
        ("top_k", 0, "top_k must be >= 1"),
        ("top_k", 2.5, "top_k must be an integer"),
        ("top_k", True, "top_k must be an integer"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
        ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
        ("min_p", -0.1, r"min_p must be in \[0, 1\]"),
        ("min_p", 1.01, r"min_p must be in \[0, 1\]"),
        ("seed", -1, r"seed must be in \[0, 2\*\*63\)"),
        ("seed", 2**63, r"seed must be in"),
        ("max_tokens", 0, "max_tokens must be >= 1"),
        ("max_tokens", 3.0, "max_tokens must be an integer"),
        ("stop_token_ids", [1, -2], r"stop_token_ids\[1\] must be a token id >= 0, got -2"),
        ("stop_token_ids", 5, "stop_token_ids must be a sequence"),
        ("stop_token_ids", "ab", "stop_token_ids must be a sequence"),
    ],
)
def test_sampling_params_reject_bad_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_sampling_params_normalise_their_values():
    params = SamplingParams(temperature=0, top_k=np.int64(5), stop_token_ids=[np.int32(2), 3])
    assert params == SamplingParams(temperature=0.0, top_k=5, stop_token_ids=(2, 3))
    assert type(params.top_k) is int and params.stop_token_ids == (2, 3)
    hash(params)  # frozen and made of plain values: usable as a key


@pytest.mark.parametrize(
    ("request_id", "prompt", "params", "message"),
    [
        ("a", [], SamplingParams(), "prompt_token_ids must hold at least one token"),
        ("a", [1, -1], SamplingParams(), r"prompt_token_ids\[1\] must be a token id >= 0"),
        ("a", [1, 2.0], SamplingParams(), r"prompt_token_ids\[1\] must be an integer"),
        (["unhashable"], [1], SamplingParams(), "request_id must be hashable"),
        ("a", [1], {"max_tokens": 3}, "params must be a SamplingParams"),
    ],
)
def test_requests_reject_bad_values(request_id, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        Request(request_id, prompt, params)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_pages": 1}, "num_pages must be an integer >= 2, got 1"),
        ({"page_size": 0}, "page_size must be an integer >= 1"),
        ({"parallel": 0}, "parallel must be an integer >= 1"),
        ({"num_speculative": -1}, "num_speculative must be an integer >= 0"),
        ({"max_prefill_tokens": 0}, "max_prefill_tokens must be an integer >= 1"),
        ({"prefill_chunk_size": 6}, "prefill_chunk_size must be a power of two, got 6"),
        ({"parallel": 2.0}, "parallel must be an integer"),
    ],
)
def test_scheduler_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Scheduler(**{"num_pages": 8, "page_size": 4, "parallel": 2, **kwargs})


def test_a_request_that_can_never_fit_is_refused_at_submit():
    # 4 usable pages of 4 tokens; n = 2. Footprint = prompt + max_tokens - 1 + n.
    scheduler = Scheduler(num_pages=5, page_size=4, parallel=2, num_speculative=2)
    with pytest.raises(
        ValueError,
        match=r"'big' can never fit: .* need up to 17 positions, 5 pages of 4, but the pool has 4",
    ):
        scheduler.submit(request("big", [1] * 10, max_tokens=6))
    assert scheduler.num_waiting == 0 and not scheduler.has_unfinished
    # 16 positions fit exactly, and the request runs to its end alone.
    engine = ShadowEngine(scheduler)
    engine.submit(request("fits", [1] * 10, max_tokens=5))
    engine.drain(np.random.default_rng(0))
    assert len(engine.outputs["fits"].token_ids) == 5


def test_submit_rejects_duplicates_and_non_requests():
    scheduler = Scheduler(num_pages=8, page_size=4, parallel=2)
    scheduler.submit(request("a", [1, 2]))
    with pytest.raises(ValueError, match="request_id 'a' is already queued or running"):
        scheduler.submit(request("a", [3]))
    with pytest.raises(ValueError, match=r"request must be a serving\.requests\.Request"):
        scheduler.submit(("b", [1, 2]))


def test_steps_must_be_committed_in_order_and_bad_outputs_change_nothing():
    scheduler = Scheduler(num_pages=8, page_size=4, parallel=2, num_speculative=2)
    scheduler.submit(request("a", [1, 2, 3]))
    step = scheduler.plan_step()
    with pytest.raises(RuntimeError, match="commit_step the previous step"):
        scheduler.plan_step()
    good = np.array([[4, 5, 0], [0, 0, 0]])
    bad_calls = [
        (
            {"token_ids": good[:, :2], "num_accepted": [0, 0]},
            r"token_ids must be integers of shape \[2, 3\]",
        ),
        ({"token_ids": good.astype(float), "num_accepted": [0, 0]}, "token_ids must be integers"),
        ({"token_ids": good, "num_accepted": [3, 0]}, r"num_accepted\[0\]=3 is outside \[0, 2\]"),
        ({"token_ids": good, "num_accepted": [0]}, r"num_accepted must be integers of shape \[2\]"),
        ({"token_ids": [[4, -1, -1], [0, 0, 0]], "num_accepted": [1, 0]}, "a token id < 0"),
        ({"num_accepted": [0, 0]}, "token_ids is required"),
        (
            {"token_ids": good, "num_accepted": [1, 0], "draft_token_ids": [[7, 7], [0, 0]]},
            "are not the accepted drafts",
        ),
    ]
    before = scheduler.running()
    for kwargs, message in bad_calls:
        with pytest.raises(ValueError, match=message):
            scheduler.commit_step(step, **kwargs)
        assert scheduler.running() == before
    with pytest.raises(ValueError, match="not the outstanding step"):
        scheduler.commit_step(dataclasses.replace(step), token_ids=good, num_accepted=[0, 0])
    output = scheduler.commit_step(step, good, [1, 0], draft_token_ids=[[4, 9], [0, 0]])
    assert output.new_token_ids == {"a": (4, 5)}
    empty = Scheduler(num_pages=8, page_size=4, parallel=1)
    idle = empty.plan_step()
    assert idle.decode is None and idle.prefill == ()
    with pytest.raises(ValueError, match="this step has no decode batch"):
        empty.commit_step(idle, token_ids=[[1]])
    empty.commit_step(idle)


# ----------------------------------------------------------------------------------------------
# Rewinds: exact lengths, both caches


def speculative_scheduler(**kwargs) -> tuple[Scheduler, ShadowEngine]:
    scheduler = Scheduler(
        **{"num_pages": 16, "page_size": 4, "parallel": 2, "num_speculative": 3, **kwargs}
    )
    return scheduler, ShadowEngine(scheduler)


def test_rewind_after_accepting_no_draft():
    scheduler, engine = speculative_scheduler()
    engine.submit(request("a", [1, 2, 3, 4, 5, 0], max_tokens=20))
    step, _ = engine.step(np.random.default_rng(0), accept=[0, 0])
    # Prefill wrote positions 0..4 (chunks 4 + 1); the step wrote 5..8, kept 5 and the correction.
    assert [len(c.token_ids) for c in step.prefill] == [4, 1]
    assert step.decode.positions[0] == 5 and step.decode.page_table.seq_lens()[0] == 9
    (state,) = scheduler.running()
    assert state.num_cached == 6 and len(state.token_ids) == 7
    assert len(state.pages) == 2  # the page of positions 8..11 was freed
    step, _ = engine.step(np.random.default_rng(1), accept=[0, 0])
    assert step.decode.positions[0] == 6
    assert [t.seq_lens()[0] for t in step.decode.draft_page_tables] == [7, 8, 9, 10]


def test_rewind_after_accepting_every_draft():
    scheduler, engine = speculative_scheduler()
    engine.submit(request("a", [1, 2, 3, 4, 5, 0], max_tokens=20))
    engine.step(np.random.default_rng(0), accept=[3, 0])
    (state,) = scheduler.running()
    # The fed token and three drafts are valid in both caches (the draft wrote d_3 too); the
    # bonus token is the next one fed.
    assert state.num_cached == 9 and len(state.token_ids) == 10
    assert len(state.pages) == 3
    step, _ = engine.step(np.random.default_rng(1), accept=[3, 0])
    assert step.decode.positions[0] == 9
    assert step.decode.draft_page_tables[0].seq_lens()[0] == 10  # the drafter is not starved


def test_a_stop_token_in_the_middle_discards_what_follows():
    scheduler, engine = speculative_scheduler()
    engine.submit(request("a", [1, 2, 3], max_tokens=20, stop=(5,)))
    step = scheduler.plan_step()
    engine.run(step, np.random.default_rng(0))
    output = scheduler.commit_step(
        step,
        [[1, 5, 2, 3], [-1, -1, -1, -1]],
        [3, 0],
        draft_token_ids=[[1, 5, 2], [0, 0, 0]],
    )
    assert output.new_token_ids == {"a": (1, 5)}
    (finished,) = output.finished
    assert finished.token_ids == (1, 5) and finished.finish_reason == "stop"
    assert scheduler.pool.num_free == scheduler.usable_pages and scheduler.num_running == 0


def test_max_tokens_cuts_a_speculative_step_short():
    scheduler, engine = speculative_scheduler()
    engine.submit(request("a", [1, 2, 3], max_tokens=2))
    step = scheduler.plan_step()
    engine.run(step, np.random.default_rng(0))
    output = scheduler.commit_step(step, [[3, 3, 3, 4], [0, 0, 0, 0]], [3, 0])
    assert output.finished[0].token_ids == (3, 3)
    assert output.finished[0].finish_reason == "length"


class _RewindTooFar(Scheduler):
    @staticmethod
    def _accepted_length(position, num_accepted):
        return position + num_accepted  # drops the fed token's entry: the drafter restarts early


class _RewindTooLittle(Scheduler):
    @staticmethod
    def _accepted_length(position, num_accepted):
        return position + 2 + num_accepted  # keeps a rejected draft's entry


@pytest.mark.parametrize("broken", [_RewindTooFar, _RewindTooLittle])
@pytest.mark.parametrize("check_contract", [True, False])
@pytest.mark.parametrize("accept", [0, 1, 3])
def test_off_by_one_rewinds_are_caught(broken, check_contract, accept):
    """A rewind one entry too far or too short fails the shadow's checks, for any accepted
    count, and even without the direct check of the cache contract (the simulated contents
    alone show it)."""
    for cls, should_fail in ((Scheduler, False), (broken, True)):
        scheduler = cls(num_pages=16, page_size=4, parallel=1, num_speculative=3)
        engine = ShadowEngine(scheduler, check_contract=check_contract)
        engine.submit(request("a", [1, 2, 3, 4, 5], max_tokens=12))
        rng = np.random.default_rng(accept)
        try:
            for _ in range(3):
                if scheduler.has_unfinished:
                    engine.step(rng, accept=[accept])
        except AssertionError:
            assert should_fail
            continue
        assert not should_fail, f"{cls.__name__} went unnoticed"


# ----------------------------------------------------------------------------------------------
# Exhaustion, preemption, prefix sharing, chunks


def test_an_exhausted_pool_queues_requests_instead_of_failing():
    # 6 usable pages of 2 tokens: each request needs 3 pages at admission (prompt 5, n = 0).
    scheduler = Scheduler(num_pages=7, page_size=2, parallel=4)
    engine = ShadowEngine(scheduler)
    for i in range(4):
        engine.submit(request(i, [i, 1, 2, 3, 4], max_tokens=2))
    step, _ = engine.step(np.random.default_rng(0))
    assert step.admitted == (0, 1) and scheduler.waiting() == (2, 3)
    engine.drain(np.random.default_rng(1))
    assert sorted(engine.outputs) == [0, 1, 2, 3]


def test_growth_preempts_the_newest_request_which_is_recomputed_later():
    # 5 usable pages of 2 tokens; two requests of 3 prompt tokens take 2 pages each. When both
    # need a third page, the newer one yields.
    scheduler = Scheduler(num_pages=6, page_size=2, parallel=2)
    engine = ShadowEngine(scheduler)
    engine.submit(request("old", [1, 2, 3], max_tokens=6))
    engine.submit(request("new", [2, 3, 4], max_tokens=6))
    rng = np.random.default_rng(0)
    preempted = []
    while scheduler.has_unfinished:
        step, _ = engine.step(rng)
        preempted += step.preempted
        check_pool(scheduler)
    assert preempted and set(preempted) == {"new"}
    assert engine.outputs["new"].num_preemptions == len(preempted)
    assert engine.outputs["old"].num_preemptions == 0
    assert all(len(out.token_ids) == 6 for out in engine.outputs.values())


def test_full_prefix_pages_are_shared_once_computed_and_the_rest_is_private():
    scheduler = Scheduler(num_pages=24, page_size=4, parallel=4, num_speculative=1)
    engine = ShadowEngine(scheduler)
    prompt = [1, 2, 3, 4, 5, 0, 1, 2, 3, 4]  # 10 tokens: prefill 9, full pages 0..3 and 4..7
    engine.submit(request("a", prompt, max_tokens=4))
    engine.submit(request("b", prompt, max_tokens=4))  # same prompt
    engine.submit(request("c", [*prompt[:9], 5], max_tokens=4))  # differs in the last page
    engine.submit(request("d", [9 % VOCAB, *prompt[1:]], max_tokens=4))  # differs at token 0
    rng = np.random.default_rng(0)
    step, _ = engine.step(rng)
    # b waits one step for a's prefill of the shared pages, and d waits behind it (FIFO).
    assert step.admitted == ("a",) and scheduler.waiting() == ("b", "c", "d")
    step, _ = engine.step(rng)
    assert step.admitted == ("b", "c", "d")
    pages = {state.request_id: state.pages for state in scheduler.running()}
    assert pages["b"][:2] == pages["a"][:2] == pages["c"][:2]
    private = [set(pages[name][2:]) for name in "abc"]
    assert all(private) and not (
        private[0] & private[1] or private[0] & private[2] or private[1] & private[2]
    )
    assert not set(pages["d"]) & set(pages["a"])
    # b and c start at position 8 (no re-prefill of the shared part); d prefills from 0.
    starts = [(c.request_id, c.start_position) for c in step.prefill]
    assert starts == [("b", 8), ("c", 8), ("d", 0), ("d", 8)]
    assert scheduler.stats["shared_prefix_pages"] == 4
    check_pool(scheduler)
    engine.drain(rng)


def test_the_page_holding_the_last_prompt_token_is_never_shared():
    # 8 tokens, pages of 4: position 7 (the last token) is written by the first decode step, so
    # only page 0 is a shareable prefix page.
    scheduler = Scheduler(num_pages=16, page_size=4, parallel=2)
    engine = ShadowEngine(scheduler)
    prompt = [1, 2, 3, 4, 5, 0, 1, 2]
    engine.submit(request("a", prompt, max_tokens=3))
    rng = np.random.default_rng(0)
    engine.step(rng)
    engine.submit(request("b", prompt, max_tokens=3))
    engine.step(rng)
    pages = {state.request_id: state.pages for state in scheduler.running()}
    assert pages["a"][0] == pages["b"][0] and pages["a"][1] != pages["b"][1]
    engine.drain(rng)


def test_prefix_pages_are_shared_only_among_live_requests():
    scheduler = Scheduler(num_pages=16, page_size=2, parallel=2)
    engine = ShadowEngine(scheduler)
    prompt = [1, 2, 3, 4, 5]
    engine.submit(request("a", prompt, max_tokens=1))
    engine.drain(np.random.default_rng(0))
    engine.submit(request("b", prompt, max_tokens=1))
    engine.drain(np.random.default_rng(1))
    assert scheduler.stats["shared_prefix_pages"] == 0  # a's pages left with a


def test_prefill_chunks_are_powers_of_two_within_the_step_budget():
    scheduler = Scheduler(
        num_pages=64, page_size=4, parallel=2, max_prefill_tokens=12, prefill_chunk_size=8
    )
    engine = ShadowEngine(scheduler)
    engine.submit(request("a", list(np.arange(38) % VOCAB), max_tokens=1))  # 37 to prefill
    rng = np.random.default_rng(0)
    lengths = []
    while scheduler.has_unfinished:
        step, _ = engine.step(rng)
        lengths.append([len(c.token_ids) for c in step.prefill])
        assert sum(lengths[-1]) <= 12
    assert lengths == [[8, 4], [8, 4], [8, 4], [1]]


def test_long_requests_and_every_table_passes_paged_validation():
    """Requests of more pages than the slot grid starts with (16 columns), and every table of a
    step accepted by ``paged.validate_page_table``."""
    scheduler = Scheduler(num_pages=128, page_size=1, parallel=3, num_speculative=2)
    engine = ShadowEngine(scheduler)
    for i in range(3):
        engine.submit(request(i, [i % VOCAB] * (20 + 10 * i), max_tokens=6))
    rng = np.random.default_rng(0)
    while scheduler.has_unfinished:
        step, _ = engine.step(rng)
        tables = [chunk.page_table for chunk in step.prefill]
        if step.decode is not None:
            tables += [step.decode.page_table, *step.decode.draft_page_tables]
        for table in tables:
            assert table.on_host  # host arrays, transferred with the step's other inputs
            paged.validate_page_table(table, scheduler.pool.num_pages)
    assert sorted(engine.outputs) == [0, 1, 2]


def test_host_page_tables_are_valid_paged_page_tables():
    table = paged.host_page_table([[3, 1, 7], [2], [0, 0]], np.array([9, 4, 1]), page_size=4)
    assert table.on_host
    paged.validate_page_table(table, num_pool_pages=8)
    expected = paged.PageTable.from_page_lists([[3, 1, 7], [2], [0]], [9, 4, 1], page_size=4)
    for name in ("page_indptr", "page_indices", "last_page_len"):
        np.testing.assert_array_equal(getattr(table, name), getattr(expected, name))
    assert table.seq_lens().tolist() == [9, 4, 1] and table.page_lists()[0] == [3, 1, 7]
    assert isinstance(table.seq_lens(), np.ndarray)  # a host table stays off the device


@given(
    parallel=st.integers(1, 12),
    page_size=st.sampled_from([1, 4, 16]),
    fixed_size=st.booleans(),
    data=st.data(),
)
def test_slot_tables_row_by_row_and_in_numpy_agree(parallel, page_size, fixed_size, data):
    """``Scheduler._slot_table`` builds a few slots' table row by row in Python ints and many
    slots' in NumPy (a speed choice, ``PYTHON_TABLE_MAX_ROWS``): both give each active row the
    first ``ceil(s / page_size)`` pages of its grid row, an idle row as many padding pages, and
    ``s - page_size * (pages - 1)`` tokens in the last page, with or without a fixed size."""
    from serving import scheduler as scheduler_module

    scheduler = Scheduler(num_pages=64, page_size=page_size, parallel=parallel)
    width = scheduler._slot_pages.shape[1]
    pages = st.lists(st.integers(1, 63), min_size=width, max_size=width)
    grid = data.draw(st.lists(pages, min_size=parallel, max_size=parallel))
    scheduler._slot_pages = np.array(grid, np.int32)
    lengths = data.draw(
        st.lists(st.integers(0, width * page_size), min_size=parallel, max_size=parallel)
    )
    live = data.draw(st.lists(st.booleans(), min_size=parallel, max_size=parallel))
    counts = [-(-n // page_size) for n in lengths]
    size = paged.bucket_size(sum(counts)) * 2 if fixed_size else None
    tables = []
    for threshold in (0, parallel):  # NumPy, then row by row
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(scheduler_module, "PYTHON_TABLE_MAX_ROWS", threshold)
            tables.append(scheduler._slot_table(np.array(lengths, np.int32), np.array(live), size))
    expected_pages = [
        row[:count] if active else [scheduler.padding_page] * count
        for row, count, active in zip(grid, counts, live, strict=True)
    ]
    expected_last = [n - page_size * (c - 1) for n, c in zip(lengths, counts, strict=True)]
    for table in tables:
        assert table.page_lists() == expected_pages
        assert table.page_indices.shape == (size or paged.bucket_size(sum(counts)),)
        assert table.last_page_len.tolist() == expected_last
    for name in ("page_indptr", "page_indices", "last_page_len"):
        numpy_form, python_form = (getattr(table, name) for table in tables)
        assert numpy_form.dtype == python_form.dtype == np.int32
        np.testing.assert_array_equal(numpy_form, python_form)


@pytest.mark.parametrize(
    "page_lists,seq_lens,page_size,num_indices,match",
    [
        (
            [[3]],
            [5],
            4,
            None,
            r"row 0 has seq_len 5, which needs 2 pages of 4, but page_lists\[0\] has 1",
        ),
        ([[3]], [-1], 4, None, r"seq_lens\[0\] must be >= 0, got -1"),
        ([[3]], [1], 0, None, r"page_size must be >= 1, got 0"),
        ([[3], [4]], [1], 4, None, r"page_lists has 2 rows but seq_lens has 1"),
        ([[3, 4]], [8], 4, 1, r"num_indices=1 is smaller than the 2 pages"),
    ],
)
def test_host_page_table_refuses_bad_input(page_lists, seq_lens, page_size, num_indices, match):
    with pytest.raises(ValueError, match=match):
        paged.host_page_table(page_lists, seq_lens, page_size, num_indices=num_indices)


# ----------------------------------------------------------------------------------------------
# The state machine: random request mixes


class SchedulerMachine(RuleBasedStateMachine):
    """Random submissions (shared prefixes, stop tokens, prompts that can never fit) and random
    speculative outcomes, on pools tiny enough to queue and preempt."""

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        pool_tokens=st.integers(6, 24),
        parallel=st.integers(1, 4),
        num_speculative=st.sampled_from([0, 0, 1, 2, 3]),  # several steps at once: n = 0
        max_prefill_tokens=st.integers(1, 8),
        prefill_chunk_size=st.sampled_from([1, 2, 4]),
        # Budgets from none to below one decode row: prefills often get nothing but the grant.
        max_batched_tokens=st.one_of(st.none(), st.integers(1, 12)),
        prefill_grant_interval=st.integers(0, 3),
        max_decode_steps=st.sampled_from([1, 2, 4, 8]),
        bases=st.lists(
            st.lists(st.integers(0, VOCAB - 1), min_size=8, max_size=8), min_size=1, max_size=2
        ),
    )
    def setup(
        self,
        page_size,
        pool_tokens,
        parallel,
        num_speculative,
        max_prefill_tokens,
        prefill_chunk_size,
        max_batched_tokens,
        prefill_grant_interval,
        max_decode_steps,
        bases,
    ):
        # Pools of 6 to 24 tokens (plus the padding page) whatever the page size: requests of up to
        # 12 prompt and 8 new tokens queue, wait and get preempted.
        self.scheduler = Scheduler(
            pool_tokens // page_size + 1,
            page_size,
            parallel,
            num_speculative=num_speculative,
            max_prefill_tokens=max_prefill_tokens,
            prefill_chunk_size=prefill_chunk_size,
            max_batched_tokens=max_batched_tokens,
            prefill_grant_interval=prefill_grant_interval,
        )
        self.engine = ShadowEngine(self.scheduler, max_decode_steps=max_decode_steps)
        self.bases = bases
        self.next_id = 0

    @rule(
        base=st.integers(0, 1),
        shared=st.integers(0, 8),
        suffix=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4),
        max_tokens=st.integers(1, 8),
        stop=st.lists(st.integers(0, VOCAB - 1), max_size=2),
    )
    def submit(self, base, shared, suffix, max_tokens, stop):
        prompt = self.bases[base % len(self.bases)][:shared] + suffix
        new = request(self.next_id, prompt, max_tokens=max_tokens, stop=stop)
        self.next_id += 1
        if (
            self.scheduler.max_footprint_tokens(new)
            > self.scheduler.usable_pages * self.scheduler.page_size
        ):
            with pytest.raises(ValueError, match="can never fit"):
                self.scheduler.submit(new)
            return
        self.engine.submit(new)

    @rule(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 4))
    def step(self, seed, steps):
        rng = np.random.default_rng(seed)
        for _ in range(steps):
            step, _ = self.engine.step(rng)
            check_pool(self.scheduler)
            if step.decode is not None and self.scheduler.num_speculative:
                event("speculative step")
            if step.granted:
                event("a prefill chunk granted beyond the budget")

    @invariant()
    def pool_matches_the_holders(self):
        check_pool(self.scheduler)

    @invariant()
    def slots_and_fifo_order(self):
        running = self.scheduler.running()
        slots = [state.slot for state in running]
        assert len(set(slots)) == len(slots) and all(
            0 <= s < self.scheduler.parallel for s in slots
        )
        waiting = self.scheduler.waiting()
        if running and waiting:
            assert max(state.request_id for state in running) < min(waiting), "not FIFO"

    def teardown(self):
        """Every request finishes and the pool returns to full."""
        if hasattr(self, "engine"):
            self.engine.drain(np.random.default_rng(0))
            check_pool(self.scheduler)
            for name, count in sorted(self.scheduler.stats.items()):
                if count and name not in ("admitted", "finished"):
                    event(name)
            event(f"finished {min(self.scheduler.stats['finished'], 5)}+ requests")
            for steps, run in self.engine.blocks:
                event(
                    f"{steps} decode steps planned at once, {'all' if run == steps else 'fewer'} run"
                )
            event(f"rejected {min(self.next_id - len(self.engine.requests), 3)}+")


TestSchedulerMachine = SchedulerMachine.TestCase
# A run takes milliseconds, so ci affords 8x its default examples (about 5 s in all).
TestSchedulerMachine.settings = settings(
    max_examples=8 * settings.default.max_examples, stateful_step_count=40
)


# ----------------------------------------------------------------------------------------------
# Committing before the tokens are known (the engine's overlapped steps)


def test_a_stop_token_resolved_one_step_late_finishes_a_preempted_request():
    """Two requests decode overlapped: each step is committed before its tokens are known, and
    resolved after the next step is planned. The plan of step 3 preempts "b" (the pool runs
    dry) while its token of step 2 is still unknown; that token is a stop token, so "b"
    finishes from the queue, its tokens cut after the stop; "a" finishes by max_tokens, its
    output given when its last token is resolved; every page comes back."""
    scheduler = Scheduler(num_pages=5, page_size=2, parallel=2)
    scheduler.submit(request("a", [1, 2], max_tokens=6))
    scheduler.submit(request("b", [3, 4], max_tokens=6, stop=[5]))
    previous, outputs, streamed = None, {}, collections.defaultdict(list)
    for index in range(10):
        step = scheduler.plan_step()
        if index == 3:
            assert step.preempted == ("b",) and scheduler.waiting() == ("b",)
        if step.decode is not None:  # the unknown token is fed from the device: -1 here
            fed = step.decode.token_ids[step.decode.active].tolist()
            assert index == 0 or set(fed) == {UNRESOLVED_TOKEN}
        if previous is not None:
            tokens = np.array([0, 5 if index == 3 else 0])
            output = scheduler.resolve_step(previous, tokens)
            for rid, kept in output.new_token_ids.items():
                streamed[rid].extend(kept)
            outputs.update((out.request_id, out) for out in output.finished)
        if step.decode is not None:
            scheduler.commit_step_unresolved(step)
            previous = step
        else:
            scheduler.commit_step(step)
            previous = None
        if not scheduler.has_unfinished:
            break
    assert outputs["b"].token_ids == (0, 0, 5) and outputs["b"].finish_reason == "stop"
    assert outputs["b"].num_preemptions == 1
    assert outputs["a"].token_ids == (0,) * 6 and outputs["a"].finish_reason == "length"
    assert streamed == {"a": [0] * 6, "b": [0, 0, 5]}
    assert scheduler.pool.num_free == scheduler.usable_pages and scheduler.num_unresolved_steps == 0


def test_unresolved_commits_refuse_what_they_cannot_do():
    speculative = Scheduler(num_pages=8, page_size=2, parallel=1, num_speculative=2)
    speculative.submit(request("a", [1, 2]))
    with pytest.raises(ValueError, match="needs plain decoding; num_speculative is 2"):
        speculative.commit_step_unresolved(speculative.plan_step())
    scheduler = Scheduler(num_pages=8, page_size=2, parallel=2)
    scheduler.submit(request("a", [1, 2]))
    step = scheduler.plan_step()
    with pytest.raises(ValueError, match="has no unresolved tokens"):
        scheduler.resolve_step(step, [1, 0])
    scheduler.commit_step_unresolved(step)
    with pytest.raises(ValueError, match=r"token_ids must be integers of shape \[2\]"):
        scheduler.resolve_step(step, [1, 0, 0])
    with pytest.raises(ValueError, match=r"token_ids\[0\]=-1 is not a token id"):
        scheduler.resolve_step(step, [-1, 0])
    assert scheduler.resolve_step(step, [[4], [0]]).new_token_ids == {"a": (4,)}


# ----------------------------------------------------------------------------------------------
# Several decode steps in one batch (plan_step(max_decode_steps=K))


def _decode_only(scheduler, max_decode_steps=4):
    """Plans with up to ``max_decode_steps`` steps; returns the step and its decode batch."""
    step = scheduler.plan_step(max_decode_steps)
    return step, step.decode


def test_several_decode_steps_are_planned_only_when_nothing_changes():
    """A batch runs K > 1 steps only with no prefill, no admissible waiting request and no
    max_tokens finish before its last step; K is the largest power of two that fits, its
    pages reserved, each step's table one token longer; a short pool gives fewer steps."""
    scheduler = Scheduler(num_pages=9, page_size=2, parallel=2)  # 8 usable pages
    scheduler.submit(request("a", [1, 2, 3], max_tokens=7))
    step, decode = _decode_only(scheduler)
    assert step.prefill and decode.num_steps == 1  # a prefill chunk in the step
    scheduler.commit_step(step, [[4], [0]])
    step, decode = _decode_only(scheduler)
    assert decode.num_steps == 4 and decode.step_page_tables[0] is decode.page_table
    assert [table.seq_lens().tolist() for table in decode.step_page_tables] == [
        [4, 1],
        [5, 1],
        [6, 1],
        [7, 1],
    ]
    (state,) = scheduler.running()
    assert len(state.pages) == pages_needed(7, 2)  # every write's page, reserved now
    output = scheduler.commit_step(step, [[5, 6, 7, 8], [0, 0, 0, 0]])
    assert output.new_token_ids == {"a": (5, 6, 7, 8)}
    (state,) = scheduler.running()
    assert state.num_cached == 7 and state.token_ids[-1] == 8 and len(state.pages) == 4
    # Two tokens to max_tokens: two steps, not four.
    step, decode = _decode_only(scheduler)
    assert decode.num_steps == 2
    output = scheduler.commit_step(step, [[1, 2], [0, 0]])
    assert output.finished[0].token_ids == (4, 5, 6, 7, 8, 1, 2)

    # A waiting request with a free slot: single steps until it is admitted.
    scheduler = Scheduler(num_pages=5, page_size=2, parallel=2)  # 4 usable pages
    scheduler.submit(request("a", [1, 2], max_tokens=4))
    step, _ = _decode_only(scheduler)
    scheduler.commit_step(step, [[3], [0]])  # "a" holds 2 of the 4 pages
    scheduler.submit(request("b", [1, 2, 3, 4, 5], max_tokens=2))  # needs 3: waits for pages
    step, decode = _decode_only(scheduler)
    assert scheduler.waiting() == ("b",) and decode.num_steps == 1
    scheduler.commit_step(step, [[3], [0]])

    # A pool too short for four steps' pages gives two (never a preemption).
    scheduler = Scheduler(num_pages=4, page_size=2, parallel=1)  # 3 usable pages
    scheduler.submit(request("a", [1], max_tokens=6))
    step, decode = _decode_only(scheduler)
    assert decode.num_steps == 4  # positions 0..3: two pages
    scheduler.commit_step(step, [[2, 2, 2, 2]])
    step, decode = _decode_only(scheduler)  # 2 tokens left: 2 steps
    assert decode.num_steps == 2 and not step.preempted
    scheduler.commit_step(step, [[2, 2]])
    assert scheduler.pool.num_free == scheduler.usable_pages

    scheduler = Scheduler(num_pages=4, page_size=2, parallel=1)
    scheduler.submit(request("a", [1, 2, 3], max_tokens=4))
    step, decode = _decode_only(scheduler)  # prefill: 1 step, cached 2, pages for 3 tokens
    scheduler.commit_step(step, [[2]])
    step, decode = _decode_only(scheduler)  # 3 tokens left, 3 pages: positions 3, 4 fit
    assert decode.num_steps == 2
    for bad in (3, 0, True, 2.0):
        scheduler = Scheduler(num_pages=4, page_size=2, parallel=1)
        with pytest.raises(ValueError, match="max_decode_steps must be a power of two"):
            scheduler.plan_step(bad)


def test_several_steps_stop_early_or_run_fewer_and_free_their_pages():
    """Committing a batch of K steps: a stop token ends the row there (later tokens dropped,
    pages freed); committing fewer steps than planned frees the pages reserved for the rest;
    token arrays of other shapes, or negative tokens, are refused and change nothing."""
    scheduler = Scheduler(num_pages=9, page_size=2, parallel=2)
    scheduler.submit(request("a", [1], max_tokens=8, stop=[5]))
    scheduler.submit(request("b", [1], max_tokens=8))
    step, decode = _decode_only(scheduler)
    assert decode.num_steps == 4
    for bad in ([[1] * 5, [1] * 5], [[1, 2, 3, 4]], [[-1, 2, 3, 4], [1, 2, 3, 4]]):
        with pytest.raises(ValueError, match="token_ids"):
            scheduler.commit_step(step, bad)
    with pytest.raises(ValueError, match="num_accepted must be None"):
        scheduler.commit_step(step, [[1, 2, 3, 4]] * 2, [0, 0])
    output = scheduler.commit_step(step, [[3, 5], [3, 3]])  # two steps of the four run
    assert output.new_token_ids == {"a": (3, 5), "b": (3, 3)}
    assert [out.finish_reason for out in output.finished] == ["stop"]
    (state,) = scheduler.running()
    assert state.num_cached == 2 and len(state.pages) == 1
    assert scheduler.pool.num_free == scheduler.usable_pages - 1


def test_several_steps_committed_unresolved_are_resolved_with_their_tokens():
    """Overlapped: a batch of K steps is committed with K placeholders a row, the next batch
    feeds the last one from the device (-1 here), and resolving takes [B, K] tokens: a stop
    token in the middle ends the request (the next batch's row is wasted), its pages come
    back; committing fewer steps than planned, or resolving the wrong width, is refused."""
    scheduler = Scheduler(num_pages=9, page_size=2, parallel=2)
    scheduler.submit(request("a", [1], max_tokens=8, stop=[5]))
    scheduler.submit(request("b", [1], max_tokens=8))
    step, decode = _decode_only(scheduler)
    assert decode.num_steps == 4
    with pytest.raises(ValueError, match=r"num_steps must be an integer in \[1, 4\]"):
        scheduler.commit_step_unresolved(step, 5)
    scheduler.commit_step_unresolved(step)
    assert [state.token_ids[1:] for state in scheduler.running()] == [(UNRESOLVED_TOKEN,) * 4] * 2
    following, decode = _decode_only(scheduler)
    assert decode.num_steps == 4 and decode.token_ids.tolist() == [UNRESOLVED_TOKEN] * 2
    with pytest.raises(ValueError, match=r"token_ids must be integers of shape \[2, 4\]"):
        scheduler.resolve_step(step, [3, 3])
    with pytest.raises(ValueError, match=r"token_ids\[1, 2\]=-1 is not a token id"):
        scheduler.resolve_step(step, [[3, 3, 3, 3], [3, 3, -1, 3]])
    output = scheduler.resolve_step(step, [[3, 5, 4, 4], [3, 3, 3, 3]])
    assert output.new_token_ids == {"a": (3, 5), "b": (3, 3, 3, 3)}
    assert [(out.request_id, out.token_ids) for out in output.finished] == [("a", (3, 5))]
    scheduler.commit_step_unresolved(following, 2)  # ran two of its four steps
    (state,) = scheduler.running()  # the page reserved for the last two steps is back
    assert state.num_cached == 6 and len(state.pages) == 3
    output = scheduler.resolve_step(following, [[9, 9], [2, 2]])
    assert output.new_token_ids == {"b": (2, 2)}  # "a"'s row is skipped
    assert scheduler.pool.num_free == scheduler.usable_pages - 3


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("max_decode_steps", [1, 4])
def test_a_slot_freed_by_a_stop_inside_a_block_is_admitted_to_after_the_blocks_planned(
    max_decode_steps, overlap
):
    """The price of blocks for arrivals. One slot, "a" decoding, "b" arriving while it runs
    (no free slot: blocks go on). "a"'s stop token is the first step of a block; "b" is
    admitted by the first plan after the scheduler learns of the stop. Synchronous: the rest of
    that block is wasted, ``K - 1`` steps. Overlapped: the stop is resolved after the next
    block was planned and dispatched, so that block is wasted too: ``2K - 1`` steps, against 1
    with single steps (the engine docstring's bound)."""
    steps = max_decode_steps
    scheduler = Scheduler(num_pages=17, page_size=2, parallel=1)
    scheduler.submit(request("a", [1], max_tokens=30, stop=[5]))
    previous, planned, stop_at = None, [], 2
    for index in range(12):
        step = scheduler.plan_step(steps)
        if step.admitted == ("b",):
            break
        if index == 1:
            scheduler.submit(request("b", [1], max_tokens=2))
        planned.append(step.decode.num_steps)
        tokens = np.full((1, step.decode.num_steps), 3)
        if index == stop_at:
            tokens[0, 0] = 5
        if overlap:
            if previous is not None:
                scheduler.resolve_step(*previous)
            scheduler.commit_step_unresolved(step)
            previous = (step, tokens)
        else:
            scheduler.commit_step(step, tokens)
    assert planned[0] == steps  # "a" alone, nothing waiting: a block from the start
    assert set(planned) == {steps}  # "b" waits for a slot: blocks go on
    wasted = sum(planned[stop_at:]) - 1  # device steps after the stop, before "b" runs
    assert wasted == (2 * steps - 1 if overlap else steps - 1)


def _check_block_writes(scheduler: Scheduler, decode) -> None:
    """Every position a batch's steps write lies on a page its request holds alone, at the
    right place in its page list; idle rows touch only the padding page."""
    states = {state.request_id: state for state in scheduler.running()}
    tables = decode.step_page_tables or (decode.page_table,)
    for slot, request_id in enumerate(decode.request_ids):
        if request_id is None:
            assert all(t.page_lists()[slot] == [scheduler.padding_page] for t in tables)
            continue
        state, position = states[request_id], int(decode.positions[slot])
        for k, table in enumerate(tables):
            pages = table.page_lists()[slot]
            assert pages == list(state.pages[: len(pages)]), "not the writer's pages"
            page = pages[(position + k) // scheduler.page_size]
            assert scheduler.pool.ref_count(page) == 1, f"{request_id!r} writes shared {page}"


@settings(max_examples=4 * settings.default.max_examples, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), overlap=st.booleans())
def test_blocks_in_both_protocols_keep_pages_and_tokens_consistent(seed, overlap):
    """A random run of the engine's two protocols with blocks of up to 8 steps: synchronous
    (``commit_step``) or overlapped (``commit_step_unresolved``, then ``resolve_step`` after the
    next plan, so a stop inside a block is learnt a block late, by then maybe preempted or
    planned into the next block). Arrivals sharing prefixes, a pool small enough to preempt,
    stop tokens anywhere in a block, and now and then fewer steps run than planned. Checked
    every step: each written page is its writer's alone, reference counts equal the holders,
    a decoding request holds the pages its length needs and no more; each finished request was
    streamed exactly its tokens, once, with a consistent reason; at the end everything finished
    and every page came back. (Shown to fail: ``resolve_step`` not retiring a stopped request
    (requests left, pages held); ``commit_step_unresolved`` not freeing the pages reserved for
    steps not run (more pages than the length needs).)"""
    rng = np.random.default_rng(seed)
    page_size = int(rng.choice([1, 2, 4]))
    scheduler = Scheduler(
        num_pages=int(rng.integers(6, 20)) // page_size + 2,
        page_size=page_size,
        parallel=int(rng.integers(1, 4)),
        max_prefill_tokens=int(rng.integers(1, 8)),
        prefill_chunk_size=int(rng.choice([1, 2, 4])),
    )
    max_steps = int(rng.choice([2, 4, 8]))
    base = rng.integers(0, VOCAB, size=8).tolist()
    params, streamed, finished = {}, collections.defaultdict(list), {}
    in_flight = None

    def take(output):
        for rid, tokens in output.new_token_ids.items():
            assert rid not in finished
            streamed[rid].extend(tokens)
        for out in output.finished:
            assert out.request_id not in finished, "finished twice"
            finished[out.request_id] = out
            assert list(out.token_ids) == streamed[out.request_id]
            assert len(out.token_ids) <= params[out.request_id].max_tokens
            assert (out.finish_reason == "stop") == (out.token_ids[-1] in STOP_TOKENS)
            if out.finish_reason == "length":
                assert len(out.token_ids) == params[out.request_id].max_tokens

    for index in range(400):
        if index < 150 and rng.random() < 0.3:
            prompt = base[: int(rng.integers(0, 9))] + rng.integers(0, VOCAB, size=2).tolist()
            new = request(index, prompt, max_tokens=int(rng.integers(1, 10)), stop=STOP_TOKENS)
            if scheduler.max_footprint_tokens(new) <= scheduler.usable_pages * page_size:
                scheduler.submit(new)
                params[index] = new.params
        if index >= 150 and not scheduler.has_unfinished and in_flight is None:
            break
        step = scheduler.plan_step(max_steps)
        decode, run = step.decode, 0
        if decode is not None:
            _check_block_writes(scheduler, decode)
            run = decode.num_steps
            if rng.random() < 0.25:
                run = int(rng.integers(1, decode.num_steps + 1))
            event(
                f"{decode.num_steps} steps planned"
                + (", fewer run" if run < decode.num_steps else "")
            )
            tokens = rng.integers(0, VOCAB, size=(scheduler.parallel, run))
        if not overlap:
            take(scheduler.commit_step(step, tokens if decode is not None else None))
        else:
            if in_flight is not None:
                take(scheduler.resolve_step(*in_flight))
            in_flight = None
            if decode is not None:
                scheduler.commit_step_unresolved(step, run)
                in_flight = (step, tokens)
            else:
                take(scheduler.commit_step(step))
        check_pool(scheduler)
        for state in scheduler.running():  # a decoding request holds what its length needs
            if state.num_cached >= state.prefill_end:
                assert len(state.pages) == pages_needed(state.num_cached, page_size), state
    assert in_flight is None and not scheduler.has_unfinished
    for name in ("preempted", "shared_prefix_pages"):
        if scheduler.stats[name]:
            event(name)
    if any(len(out.token_ids) > 1 and out.finish_reason == "stop" for out in finished.values()):
        event("a stop after the first token")
    assert set(finished) == set(params)
    assert scheduler.pool.num_free == scheduler.usable_pages
    assert scheduler.num_unresolved_steps == 0
