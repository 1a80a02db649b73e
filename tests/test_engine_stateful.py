"""The engine's invariants under random request mixes: a hypothesis state machine over the real
``serving.engine.Engine`` (its jitted programs, its device caches), with tiny random models.

``tests/test_scheduler.py`` checks the scheduler's bookkeeping against a simulated cache; this
module checks what the engine does with it on the device:

- Every step, before it runs (inside ``plan_step``): each page the step writes (prefill chunks,
  the decode row's ``n + 1`` target positions, the draft passes' positions) is the writer's own,
  at the right place in its page list, with reference count 1, and in no table row of another
  request; idle rows read and write only the padding page; a decode row feeds the request's last
  token at ``len(tokens) - 1`` (the cache contract).
- After every step: pool reference counts equal the holders and free + held = total; a shared
  page lies below every holder's cached length; no request's emitted tokens changed (the
  scheduler's token list, the streamed tokens and the final output agree); and the DEVICE caches
  hold the right keys and values at every cached position of every running request (below).
- Both engine loops: synchronous steps, and overlapped ones (``Engine(overlap=True)``, plain
  decoding: each step committed before its tokens are known, stop tokens applied one step
  late); there a running request's last token may be the placeholder of the step in flight,
  and a request may have retired (``max_tokens``) before its last token was streamed.
- Up to four decode steps a program (``Engine(max_steps_per_program=4)``, plain decoding, both
  loops): every step's table row is checked like a single step's, the tokens still in flight
  (up to four placeholders a request) are left out of the cache oracle until resolved, and the
  solo run of the teardown (single steps) must give the same tokens.
- At the end: the engine runs to completion, every accepted request finished once with a valid
  reason and at most ``max_tokens`` tokens (a stop token last exactly when the reason is "stop"),
  the pool is full again, and one request (seeded or greedy) gives the same tokens when run alone
  in a fresh engine (its tokens do not depend on its slot, neighbours or preemptions).

The cache oracle: with ONE decoder layer, the key and value a model writes at position ``p`` are
functions of the token there and ``p`` alone (embedding, norm, projection, RoPE at ``p``; no
attention before them). ``_kv_oracle`` computes them for every (token, position) once, through a
dense prefill of constant rows in a separate pool, so a cache entry is checked against the token
the request really has there: a page written by another request, a rejected draft left behind by
a rewind one entry short, or chunks written at the wrong offset all show up as wrong vectors.

Cost: shapes (pool, page size, slots, vocabulary) are fixed, and the engine's programs are
module-level ``jax.jit`` functions whose static arguments are the (hashable) model configs, so
every engine of every example reuses them: twelve programs in all (measured with the jitted
functions' ``_cache_size()`` after a ci run: three single-step decode programs, for ``n`` in {0,
2} and for ``n = 0`` fed from the device, since every table fits the 16-entry index bucket; two
of several steps, two and four; seven prefill programs, chunks of 1, 2, 4 and 8 tokens). Hypothesis draws only
host-side values (prompts, sampling parameters, the prefill and step budgets, the chunk limit,
the grant interval, seeds).

Shown to fail: each of these breaks, patched in one at a time, was caught (which check fired):
``_finish`` or ``_preempt`` or a rewind's trim skipping a free (reference counts, pool not full);
admission sharing a prefix page still being prefilled (a write to a shared page, a shared page
not computed); a rewind one entry short (the cache contract, the device cache oracle) or one too
far (the cache contract); growth one page short (a table row not the writer's pages); the engine
skipping one-token prefill chunks or the draft's prefill (device cache oracle); keys folded with
the slot or the step number instead of the token count (the solo run); a block of several steps
feeding its first token at every step instead of the one sampled before (device cache oracle,
the solo run).
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import paged
from serving.config import ModelConfig
from serving.engine import Engine
from serving.model import forward_paged, init_params
from serving.requests import Request, SamplingParams
from serving.scheduler import UNRESOLVED_TOKEN, pages_needed

CONFIG = ModelConfig(
    vocab_size=32,
    hidden=32,
    num_layers=1,  # the cache oracle needs exactly one layer (module docstring)
    num_q_heads=2,
    num_kv_heads=1,
    head_dim=16,
    intermediate=64,
)
TARGET = (CONFIG, init_params(CONFIG, jax.random.key(1)))
DRAFT = (CONFIG, init_params(CONFIG, jax.random.key(2)))  # same shapes, other weights
VOCAB = CONFIG.vocab_size

PAGE_SIZE = 2
# 8 usable pages of 2 tokens (page 0 pads) and 3 slots: requests of 2 to 10 prompt tokens and up
# to 6 new ones queue for pages, wait for each other's prefixes and get preempted. The longest
# footprint (prompt + max_tokens - 1 + n = 17 with n = 2) does not fit: submit refuses it.
NUM_PAGES = 9
PARALLEL = 3
USABLE_TOKENS = (NUM_PAGES - 1) * PAGE_SIZE
BASE_PAGES = 3  # shared prompt prefixes: 0 to 3 whole pages of a base sequence
MAX_SUFFIX = 4


def _kv_oracle(params) -> tuple[np.ndarray, np.ndarray]:
    """float32[V, P, Hkv, D] keys and values the one-layer model writes for token ``t`` at
    position ``p < P = USABLE_TOKENS``: row ``t`` of a dense prefill holds ``t`` everywhere."""
    assert CONFIG.num_layers == 1
    pages_per_row = USABLE_TOKENS // PAGE_SIZE
    caches = paged.new_kv_cache(
        VOCAB * pages_per_row + 1, PAGE_SIZE, CONFIG.num_kv_heads, CONFIG.head_dim, jnp.float32
    )
    table = paged.PageTable.from_page_lists(
        [list(range(1 + t * pages_per_row, 1 + (t + 1) * pages_per_row)) for t in range(VOCAB)],
        [USABLE_TOKENS] * VOCAB,
        page_size=PAGE_SIZE,
    )
    tokens = jnp.repeat(jnp.arange(VOCAB, dtype=jnp.int32)[:, None], USABLE_TOKENS, axis=1)
    _, (cache,) = forward_paged(params, CONFIG, tokens, [caches], table, backend="reference")
    # HND pages [N, Hkv, S, D] -> [V, pages_per_row * S = P, Hkv, D]
    unpack = lambda pages: (
        np.asarray(pages)[1:]
        .reshape(VOCAB, pages_per_row, CONFIG.num_kv_heads, PAGE_SIZE, CONFIG.head_dim)
        .transpose(0, 1, 3, 2, 4)
        .reshape(VOCAB, USABLE_TOKENS, CONFIG.num_kv_heads, CONFIG.head_dim)
    )
    return unpack(cache.k_pages), unpack(cache.v_pages)


ORACLE = {"target": _kv_oracle(TARGET[1]), "draft": _kv_oracle(DRAFT[1])}
# Prefill chunks and decode steps compute the same projections with other matmul shapes, so a
# cached entry may differ from the oracle by float32 rounding (1e-7 relative); entries of other
# tokens or positions differ by O(1).
KV_ATOL = 1e-4


def _engine(num_speculative: int, **options) -> Engine:
    return Engine(
        TARGET,
        DRAFT,
        num_pages=NUM_PAGES,
        page_size=PAGE_SIZE,
        parallel=PARALLEL,
        num_speculative=num_speculative,
        backend="reference",
        **options,
    )


# ----------------------------------------------------------------------------------------------
# Checks


def check_pool(scheduler) -> None:
    """Reference counts equal the holders (the padding page held once by the scheduler); free +
    held = total; a shared page lies below each holder's cached length."""
    running = scheduler.running()
    holders = collections.Counter(page for state in running for page in state.pages)
    holders[scheduler.padding_page] += 1
    pool = scheduler.pool
    counts = [pool.ref_count(page) for page in range(pool.num_pages)]
    assert counts == [holders[page] for page in range(pool.num_pages)], "ref counts != holders"
    assert pool.num_free + len(holders) == pool.num_pages, "a page leaked or was double-freed"
    for state in running:
        assert len(set(state.pages)) == len(state.pages)
        for k, page in enumerate(state.pages):
            if holders[page] > 1:
                assert (k + 1) * scheduler.page_size <= state.num_cached, "shared, not computed"


def check_step_writes(scheduler, step, requests) -> None:
    """Run on the plan, before the device runs it: every written page is the writer's alone.
    ``requests``: the submitted requests by id."""
    n, size = scheduler.num_speculative, scheduler.page_size
    pool, padding = scheduler.pool, scheduler.padding_page
    states = {state.request_id: state for state in scheduler.running()}
    reads: dict[object, set[int]] = collections.defaultdict(set)  # request -> pages read
    writes: list[tuple[object, int, int]] = []  # (request, position, page)

    def row_of(table, row, state, length):
        assert table.seq_lens()[row] == length
        pages = table.page_lists()[row]
        assert pages == list(state.pages[: pages_needed(length, size)]), "not the writer's pages"
        return pages

    # Within the prefill budget, but for the grant's chunks (serving/step_decision.py).
    granted = [chunk for chunk in step.prefill if chunk.request_id in step.granted]
    budgeted = [chunk for chunk in step.prefill if chunk.request_id not in step.granted]
    assert sum(len(chunk.token_ids) for chunk in budgeted) <= scheduler.max_prefill_tokens
    assert all(len(chunk.token_ids) <= scheduler.prefill_chunk_size for chunk in granted)
    for chunk in step.prefill:
        state = states[chunk.request_id]
        start, end = chunk.start_position, chunk.start_position + len(chunk.token_ids)
        assert chunk.token_ids.tolist() == list(state.token_ids[start:end])
        assert end <= state.prefill_end
        pages = row_of(chunk.page_table, 0, state, end)
        reads[chunk.request_id].update(pages)
        writes += [(chunk.request_id, p, pages[p // size]) for p in range(start, end)]
    decode = step.decode
    if decode is not None:
        tables = (decode.page_table, *decode.draft_page_tables, *decode.step_page_tables)
        assert len(decode.draft_page_tables) == (n + 1 if n else 0)
        for slot, request_id in enumerate(decode.request_ids):
            if request_id is None:
                assert not decode.active[slot]
                for table in tables:
                    assert set(table.page_lists()[slot]) == {padding}, "an idle row reads a page"
                continue
            state = states[request_id]
            position = int(decode.positions[slot])
            assert decode.active[slot]
            assert position == len(state.token_ids) - 1, "the cache contract is broken"
            assert decode.token_ids[slot] == state.token_ids[-1]
            prompt = requests[request_id].prompt_token_ids
            assert decode.num_generated[slot] == len(state.token_ids) - len(prompt)
            pages = row_of(decode.page_table, slot, state, position + n + 1)
            reads[request_id].update(pages)
            writes += [(request_id, p, pages[p // size]) for p in range(position, position + n + 1)]
            # Draft pass j feeds one token at position + j over a row of position + j + 1.
            for j, table in enumerate(decode.draft_page_tables):
                draft_pages = row_of(table, slot, state, position + j + 1)
                reads[request_id].update(draft_pages)
                writes.append((request_id, position + j, draft_pages[(position + j) // size]))
            # Several steps at once: step k feeds one token at position + k, over its own row.
            for k, table in enumerate(decode.step_page_tables):
                step_pages = row_of(table, slot, state, position + k + 1)
                reads[request_id].update(step_pages)
                writes.append((request_id, position + k, step_pages[(position + k) // size]))
    for request_id, position, page in writes:
        where = f"{request_id!r} writes position {position} on page {page}"
        assert page != padding, f"{where}: the padding page"
        assert page == states[request_id].pages[position // size]
        assert pool.ref_count(page) == 1, f"{where}: a shared page (ref count > 1)"
        for other, pages in reads.items():
            assert other == request_id or page not in pages, f"{where}, read by {other!r}"
        for other, state in states.items():
            assert other == request_id or page not in state.pages, f"{where}, held by {other!r}"


def check_device_caches(engine: Engine) -> None:
    """Every running request's cached positions hold its own tokens' keys and values, in both
    pools (the oracle of the module docstring)."""
    scheduler = engine.scheduler
    pools = {"target": engine.target_caches}
    if engine.num_speculative:
        pools["draft"] = engine.draft_caches
    for name, (cache,) in pools.items():
        assert cache.layout == "HND"
        k_pages, v_pages = np.asarray(cache.k_pages), np.asarray(cache.v_pages)
        oracle_k, oracle_v = ORACLE[name]
        for state in scheduler.running():
            # Overlapped, tokens still on their way are placeholders: checked once resolved.
            positions = np.flatnonzero(np.asarray(state.token_ids[: state.num_cached]) >= 0)
            if not positions.size:
                continue
            pages = np.asarray(state.pages)[positions // PAGE_SIZE]
            tokens = np.asarray(state.token_ids)[positions]
            got_k = k_pages[pages, :, positions % PAGE_SIZE]  # [P, Hkv, D]
            got_v = v_pages[pages, :, positions % PAGE_SIZE]
            for what, got, want in (("k", got_k, oracle_k), ("v", got_v, oracle_v)):
                bad = ~np.all(np.isclose(got, want[tokens, positions], atol=KV_ATOL), axis=(1, 2))
                assert not bad.any(), (
                    f"{name} {what} of {state.request_id!r} (cached {state.num_cached}) is wrong "
                    f"at positions {positions[bad].tolist()} (pages {pages[bad].tolist()})"
                )


def check_finished(request: Request, output) -> None:
    params, tokens = request.params, output.token_ids
    assert output.prompt_token_ids == request.prompt_token_ids
    assert 1 <= len(tokens) <= params.max_tokens
    assert all(0 <= t < VOCAB for t in tokens)
    stops = set(params.stop_token_ids)
    assert not stops & set(tokens[:-1]), "a token after a stop token"
    if output.finish_reason == "stop":
        assert tokens[-1] in stops
    else:
        assert output.finish_reason == "length"
        assert len(tokens) == params.max_tokens and tokens[-1] not in stops


# ----------------------------------------------------------------------------------------------
# The state machine

temperatures = st.sampled_from([0.0, 0.0, 1e-3, 0.7, 1.0, 2.5])
sampling_params = st.builds(
    SamplingParams,
    temperature=temperatures,
    top_k=st.one_of(st.none(), st.integers(1, VOCAB)),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    max_tokens=st.integers(1, 6),
    # A random model's next token is near uniform: three stop tokens of 32 stop about one
    # request in three within its six tokens.
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=3),
)


class EngineMachine(RuleBasedStateMachine):
    """Random submissions and steps on a pool small enough to queue, share and preempt."""

    @initialize(
        num_speculative=st.sampled_from([0, 0, 2]),
        max_prefill_tokens=st.integers(1, 8),
        prefill_chunk_size=st.sampled_from([1, 2, 4, 8]),
        max_batched_tokens=st.one_of(st.none(), st.integers(1, 8)),
        prefill_grant_interval=st.integers(0, 3),
        overlap=st.booleans(),  # overlap applies at n = 0 alone
        max_steps_per_program=st.sampled_from([1, 4]),  # several steps: n = 0 alone
        seed=st.integers(0, 2**31 - 1),
        bases=st.lists(
            st.lists(
                st.integers(0, VOCAB - 1),
                min_size=BASE_PAGES * PAGE_SIZE,
                max_size=BASE_PAGES * PAGE_SIZE,
            ),
            min_size=1,
            max_size=2,
        ),
    )
    def setup(
        self,
        num_speculative,
        max_prefill_tokens,
        prefill_chunk_size,
        max_batched_tokens,
        prefill_grant_interval,
        overlap,
        max_steps_per_program,
        seed,
        bases,
    ):
        self.engine = _engine(
            num_speculative,
            overlap=overlap,
            max_steps_per_program=max_steps_per_program,
            max_prefill_tokens=max_prefill_tokens,
            prefill_chunk_size=prefill_chunk_size,
            max_batched_tokens=max_batched_tokens,
            prefill_grant_interval=prefill_grant_interval,
            seed=seed,
        )
        scheduler = self.engine.scheduler
        plan_step = scheduler.plan_step

        def checked_plan_step(*args):
            step = plan_step(*args)
            check_step_writes(scheduler, step, self.requests)
            return step

        scheduler.plan_step = checked_plan_step  # Engine.step calls it through the instance
        event(
            f"n={num_speculative}, overlapped: {self.engine.overlap}, "
            f"steps a program: {self.engine.max_steps_per_program}"
        )
        self.bases = bases
        self.requests: dict[int, Request] = {}
        self.streamed: dict[int, list[int]] = {}
        self.outputs = {}
        self.next_id = 0
        self.in_step = False

    @rule(
        base=st.integers(0, 1),
        shared_pages=st.integers(0, BASE_PAGES),
        suffix=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=MAX_SUFFIX),
        params=sampling_params,
    )
    def submit(self, base, shared_pages, suffix, params):
        prompt = self.bases[base % len(self.bases)][: shared_pages * PAGE_SIZE] + suffix
        request = Request(self.next_id, prompt, params)
        self.next_id += 1
        if self.engine.scheduler.max_footprint_tokens(request) > USABLE_TOKENS:
            with pytest.raises(ValueError, match="can never fit"):
                self.engine.submit(request)
            event("refused: can never fit")
            return
        self.engine.submit(request)
        self.requests[request.request_id] = request
        self.streamed[request.request_id] = []

    def _step(self):
        self.in_step = True
        output = self.engine.step()
        self.in_step = False
        for request_id, tokens in output.new_token_ids.items():
            assert request_id not in self.outputs
            self.streamed[request_id].extend(tokens)
        for finished in output.finished:
            assert finished.request_id not in self.outputs, "finished twice"
            check_finished(self.requests[finished.request_id], finished)
            assert list(finished.token_ids) == self.streamed[finished.request_id]
            self.outputs[finished.request_id] = finished
        if output.stats.num_decode_steps > 1:
            event(f"{output.stats.num_decode_steps} decode steps in one program")
        n = self.engine.num_speculative
        for request_id, count in output.num_accepted.items():
            assert 0 <= count <= n, (request_id, count)
            event(f"n={n}: accepted {count}")
        self.check_all()

    @rule(steps=st.integers(1, 3))
    def step(self, steps):
        for _ in range(steps):
            self._step()

    def check_all(self):
        scheduler = self.engine.scheduler
        check_pool(scheduler)
        for state in scheduler.running():
            prompt = self.requests[state.request_id].prompt_token_ids
            assert state.token_ids[: len(prompt)] == prompt
            generated = list(state.token_ids[len(prompt) :])
            while self.engine.overlap and generated and generated[-1] == UNRESOLVED_TOKEN:
                generated.pop()  # sampled by the step in flight, streamed by the next
            assert generated == self.streamed[state.request_id], "emitted tokens changed"
        check_device_caches(self.engine)
        unfinished = set(scheduler.waiting()) | {s.request_id for s in scheduler.running()}
        if self.engine.overlap:
            # A request may have retired (max_tokens) with its last token still in flight.
            assert unfinished <= set(self.requests) - set(self.outputs)
        else:
            assert unfinished == set(self.requests) - set(self.outputs)

    @invariant()
    def invariants(self):
        if hasattr(self, "engine") and not self.in_step:
            self.check_all()

    def teardown(self):
        """Runs to completion: every request finishes, the pool is full, and one request's
        tokens are those it gets alone in a fresh engine."""
        if not hasattr(self, "engine") or self.in_step:
            return  # a failure mid-step: its own error is the report
        engine, scheduler = self.engine, self.engine.scheduler
        for _ in range(1000):
            if not engine.has_unfinished:
                break
            self._step()
        assert not engine.has_unfinished, "requests left after 1000 steps"
        assert set(self.outputs) == set(self.requests)
        assert scheduler.pool.num_free == scheduler.usable_pages, "the pool is not full again"
        check_pool(scheduler)
        for name, count in sorted(scheduler.stats.items()):
            if count and name not in ("admitted", "finished"):
                event(name)
        for output in self.outputs.values():
            event(f"finish: {output.finish_reason}")
        # Slot independence for one request whose tokens its own key decides (an explicit
        # seed, or greedy): the most preempted one, the latest among equals. Its prefill
        # chunks and the positions recomputed after preemptions differ between the two runs,
        # so its keys and values may differ by float32 rounding: a token flips only where two
        # logits (greedy) or a uniform and a cumulative probability (sampled) lie within about
        # 1e-6 of each other, a chance of about 1e-5 per token; with derandomized examples a
        # passing run passes every time.
        params = {rid: request.params for rid, request in self.requests.items()}
        eligible = [
            out
            for rid, out in self.outputs.items()
            if params[rid].seed is not None or params[rid].temperature == 0
        ]
        if not eligible:
            return
        probe = max(eligible, key=lambda out: (out.num_preemptions, out.request_id))
        event(f"probe preempted: {probe.num_preemptions > 0}")
        # Another engine seed (irrelevant to this request) and the default prefill budget.
        alone = _engine(engine.num_speculative, seed=(engine.seed + 1) % 2**31)
        (again,) = alone.generate([self.requests[probe.request_id]])
        assert again.token_ids == probe.token_ids, (
            f"request {probe.request_id!r} alone: {again.token_ids}, in the mix: {probe.token_ids}"
        )
        assert alone.scheduler.pool.num_free == alone.scheduler.usable_pages


TestEngineMachine = EngineMachine.TestCase
# Measured on a shared 2-core CPU: the ten programs compile in ~6 s (the first examples), then an
# example of up to 40 rules costs ~65 ms, its steps, per-step checks and the probe's solo run
# included; module setup (models, cache oracles) ~2 s. So 4x the profile's examples: ci (25 ->
# 100) takes ~13 s in all, dev (200 -> 800) about a minute. 40 rules let the queue fill, prefixes
# be shared and requests be preempted (each in ~70% of the examples: --hypothesis-show-statistics).
# The option of four steps a program (2026-12-02) added two programs and made a ci run about 20%
# to 50% longer on the loaded machine (21 s -> 33 s, 43 s -> 51 s, the same load for each pair).
TestEngineMachine.settings = settings(
    max_examples=4 * settings.default.max_examples, stateful_step_count=40, deadline=None
)
