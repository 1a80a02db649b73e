"""The engine with sparse decode (``Engine(sparse=..., sparse_budget=...)``,
``serving/sparse_step.py``) on the trained tiny target, on the CPU.

- A budget covering every context selects every page: greedy float32 tokens equal dense
  decoding's (both selections).
- A small budget: every decode step's selection, as the engine computes it, holds each
  request's first and last page and exactly ``min(n, budget pages)`` pages; Quest's selection
  reads its own layer's bounds, equal to the pool's on every listed page; the tokens are dense
  decoding's while the contexts fit the budget and not after; requests run to their
  ``max_tokens`` and every page comes back.
- Quest's key bounds the engine keeps equal the bounds recomputed from the pool over the live
  requests after every step: prefill chunks (one starting mid-page), decode steps and blocks of
  steps, a prefix page shared by two requests, pages freed and reused by a later request; and
  a block of steps decodes sparsely, as single steps do.
- Bad arguments name themselves; the command line's flags run the same engine; the kill
  switch runs every part by the reference and leaves sparse decode on.

Shapes are shared between tests (slots, pool, prompt lengths) so that compiled programs are
reused: the engine's programs are module-level ``jax.jit`` functions. The pool is the one the
command line sizes for ``PROMPTS`` and ``MAX_TOKENS`` (``NUM_PAGES``), so its test reuses them
too. 47 to 69 s on the shared 2-core CPU under a load of 4 (one core's worth), most of it
compiling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged
import paged.sparse as paged_sparse
from kernels_pallas import platform
from serving import model as model_lib
from serving import sparse_step
from serving.__main__ import main
from serving.demo import decode_tokens, encode_text, load_tiny_pair
from serving.engine import Engine
from serving.model import forward_paged, new_caches
from serving.requests import Request, SamplingParams
from serving.scheduler import pages_needed

PAGE_SIZE = 16
PARALLEL = 2
MAX_TOKENS = 43
# Two prompts of 21 bytes: a whole page and 5 bytes of a second. Prefill (20 tokens) runs as
# chunks of 16 and 4: two prefill programs for each kind of target state and backend.
PROMPTS = ("def main(argv):\n    i", "class Foo(object):\n  ")
assert all(len(prompt) == 21 for prompt in PROMPTS)
# What `python -m serving generate` sizes for PROMPTS on PARALLEL slots: no preemption.
NUM_PAGES = PARALLEL * pages_needed(21 + MAX_TOKENS, PAGE_SIZE) + 1
# Contexts reach 63 tokens, 4 pages: this budget covers them, SMALL_BUDGET does not.
COVERING_BUDGET = 4 * PAGE_SIZE
SMALL_BUDGET = 3 * PAGE_SIZE
# Generated token j is decoded with a context of len(prompt) + j tokens: the first
# WHOLE_TOKENS fit SMALL_BUDGET, so every page is read and they are dense decoding's.
WHOLE_TOKENS = SMALL_BUDGET - len(PROMPTS[0]) + 1
MODES = sparse_step.SPARSE_MODES


@pytest.fixture(scope="module")
def target():
    return load_tiny_pair()[0]


def _engine(target, *, backend="reference", **options):
    options = dict(num_pages=NUM_PAGES, page_size=PAGE_SIZE, parallel=PARALLEL) | options
    return Engine(target, backend=backend, **options)


def _requests(prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[Request]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [Request(i, encode_text(prompt), params) for i, prompt in enumerate(prompts)]


def _run(engine, requests) -> list[tuple[int, ...]]:
    outputs = engine.generate(requests)
    scheduler = engine.scheduler
    assert scheduler.pool.num_free == scheduler.usable_pages  # every page back
    assert [len(output.token_ids) for output in outputs] == [r.params.max_tokens for r in requests]
    return [output.token_ids for output in outputs]


@pytest.fixture(scope="module")
def dense_tokens(target):
    return _run(_engine(target), _requests())


def _record(seen, *arrays):
    """A ``jax.debug.callback`` that keeps the values of ``arrays`` (each call, NumPy)."""
    jax.debug.callback(lambda *values: seen.append([np.asarray(v) for v in values]), *arrays)


@pytest.fixture(scope="module")
def quest_run(target):
    """Quest at ``SMALL_BUDGET``: ``(tokens, selections, engine, reads)``, the selections those
    that every layer of every decode step computed (``paged.sparse.quest_selected_rows``, spied
    inside the program: each call records the step's ``page_indptr`` and its bool ``[B, KVH,
    nnz]`` selection), and ``reads`` one bool a layer and step: whether the key bounds its
    selection read equal, on every page the step lists, ``paged.page_key_bounds`` of the pool
    that layer attends (its own layer's bounds, the new keys included: no stale bound read).
    The spies must be in when the decode program is traced: this fixture is the first run of it
    in this file (a test that found it compiled would see no selection and fail, not pass)."""
    seen, reads = [], []
    real = paged_sparse.quest_selected_rows
    real_attention = model_lib.sparse_attention

    def spy(q, page_table, selection, backend):
        selected = real(q, page_table, selection, backend)
        _record(seen, page_table.page_indptr, selected)
        return selected

    def read_spy(q, cache, page_table, sparse, bounds, *, backend):
        pool = paged.page_key_bounds(cache, page_table)
        pages = page_table.page_indices  # the entries past page_indptr[-1] are padding
        listed = (jnp.arange(pages.shape[0]) < page_table.page_indptr[-1])[:, None, None]
        same_min = jnp.all(~listed | (bounds.kmin[pages] == pool.kmin[pages]))
        same_max = jnp.all(~listed | (bounds.kmax[pages] == pool.kmax[pages]))
        _record(reads, same_min & same_max)
        return real_attention(q, cache, page_table, sparse, bounds, backend=backend)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paged_sparse, "quest_selected_rows", spy)
        patch.setattr(model_lib, "sparse_attention", read_spy)
        engine = _engine(target, sparse="quest", sparse_budget=SMALL_BUDGET)
        tokens = _run(engine, _requests())
        jax.effects_barrier()
    return tokens, seen, engine, reads


@pytest.fixture(scope="module")
def quest_small_budget_tokens(quest_run):
    return quest_run[0]


# ----------------------------------------------------------------------------------------------
# What sparse decode reads


def test_a_budget_covering_every_context_decodes_as_dense(target, dense_tokens):
    """Every request's context fits the budget: each selects all its pages, which is dense
    attention over the same keys in the same order, so greedy float32 tokens equal dense
    decoding's (a flip would need two logits within float32 rounding; measured: none). (The
    recent pages' selection is checked the same way in the next test, on its first tokens.)"""
    engine = _engine(target, sparse="quest", sparse_budget=COVERING_BUDGET)
    assert _run(engine, _requests()) == dense_tokens
    report = engine.sparse_report()
    assert report.decode_steps > 0 and report.requests_selected == 0, report
    assert report.requests_whole == PARALLEL * MAX_TOKENS, report
    assert engine.backend_report()["decode: sparse"] == report.describe()
    # cascade="auto" (the default) is off beside sparse decode, and says why.
    assert "sparse decode and cascade are exclusive" in engine.cascade_report().last_reason


@pytest.mark.parametrize("mode", MODES)
def test_a_small_budget_reads_the_first_and_last_page_of_every_request(
    target, dense_tokens, quest_run, monkeypatch, mode
):
    """Budget of 3 pages, contexts up to 4: the selection every layer of every decode step
    computes (spied inside the program) keeps each request's first and last page and
    ``min(n, 3)`` pages in all (Quest: for each KV head). The requests run to ``max_tokens``
    and return every page (``_run``), and their tokens are dense decoding's as long as their
    context fits the budget (after that they may differ, and do on this model)."""
    if mode == "quest":
        tokens, seen, engine, reads = quest_run
        # Every layer of every step read its own layer's bounds, current on every listed page.
        assert len(reads) == engine.target_config.num_layers * engine.sparse_report().decode_steps
        assert all(bool(read[0]) for read in reads)
    else:
        seen = []
        real = sparse_step.recent_pages_selection

        def spy(page_table, token_budget):
            chosen = real(page_table, token_budget)
            _record(seen, page_table.page_indptr, chosen.block_indptr, chosen.block_indices)
            return chosen

        monkeypatch.setattr(sparse_step, "recent_pages_selection", spy)
        engine = _engine(target, sparse=mode, sparse_budget=SMALL_BUDGET)
        tokens = _run(engine, _requests())
        jax.effects_barrier()
    assert [t[:WHOLE_TOKENS] for t in tokens] == [t[:WHOLE_TOKENS] for t in dense_tokens]
    # Past the budget the selection changes what the model reads: an engine that computed the
    # selection but attended densely would give dense decoding's tokens here.
    assert tokens != dense_tokens
    layers = engine.target_config.num_layers
    assert len(seen) == layers * engine.sparse_report().decode_steps
    budget_pages = SMALL_BUDGET // PAGE_SIZE
    widths = set()
    for indptr, *selection in seen:
        for b in range(PARALLEL):
            start, end = int(indptr[b]), int(indptr[b + 1])
            n = end - start
            if mode == "quest":  # per KV head: the kept pages' places in the request
                kept = [np.flatnonzero(row[start:end]).tolist() for row in selection[0][b]]
            else:
                block_indptr, blocks = selection
                kept = [blocks[block_indptr[b] : block_indptr[b + 1]].tolist()]
            for pages in kept:
                assert pages[0] == 0 and pages[-1] == n - 1, (n, pages)
                assert len(pages) == min(n, budget_pages), (n, pages)
            widths.add(n)
    assert max(widths) > budget_pages  # some steps did select
    assert engine.sparse_report().requests_selected > 0


# ----------------------------------------------------------------------------------------------
# Quest's key bounds


def _live_table(engine) -> paged.PageTable:
    """The running requests' pages over their cached tokens (host)."""
    running = engine.scheduler.running()
    lengths = [state.num_cached for state in running]
    pages = [
        list(state.pages[: pages_needed(length, PAGE_SIZE)])
        for state, length in zip(running, lengths, strict=True)
    ]
    return paged.host_page_table(pages, lengths, PAGE_SIZE)


def _assert_kept_bounds_are_the_pools(engine) -> set[int]:
    """Each layer's kept bounds equal ``paged.page_key_bounds`` recomputed from its pool over
    the live requests' cached tokens, on every page they hold; returns those pages."""
    table = _live_table(engine)
    live = sorted(set(np.asarray(table.page_indices)[: int(table.page_indptr[-1])].tolist()))
    if not live:
        return set()
    for cache, kept in zip(engine.target_caches, engine.target_key_bounds, strict=True):
        want = paged.page_key_bounds(cache, table)
        np.testing.assert_array_equal(np.asarray(kept.kmin)[live], np.asarray(want.kmin)[live])
        np.testing.assert_array_equal(np.asarray(kept.kmax)[live], np.asarray(want.kmax)[live])
        assert np.all(np.isfinite(np.asarray(want.kmin)[live]))  # every live page has keys
    return set(live)


def test_kept_key_bounds_equal_the_bounds_of_the_pool(target, quest_small_budget_tokens):
    """After every step: two samples of one prompt (sharing its whole first page; prefilled in
    chunks of at most 8 tokens, so one starts mid-page), decoded; then a later request given
    their freed pages, whose bounds must have forgotten the old keys. The later one runs alone,
    in blocks of two steps (the bounds in the scan's carry): its tokens are those of single
    steps (``quest_small_budget_tokens``), which on this model differ from dense decoding's
    from the 37th on, so a block that decoded densely would show."""
    engine = _engine(
        target,
        sparse="quest",
        sparse_budget=SMALL_BUDGET,
        max_prefill_tokens=8,
        max_steps_per_program=2,
    )
    for request in _requests((PROMPTS[0], PROMPTS[0]), max_tokens=8):
        engine.submit(request)
    earlier_pages = set()
    while engine.has_unfinished:
        engine.step()
        earlier_pages |= _assert_kept_bounds_are_the_pools(engine)
    assert engine.scheduler.stats["shared_prefix_pages"] > 0
    later = Request("later", encode_text(PROMPTS[1]), SamplingParams(0.0, max_tokens=MAX_TOKENS))
    engine.submit(later)
    reused, blocks, tokens = set(), 0, []
    while engine.has_unfinished:
        output = engine.step()
        blocks += output.stats.num_decode_steps > 1
        tokens += output.new_token_ids.get("later", ())
        reused |= _assert_kept_bounds_are_the_pools(engine) & earlier_pages
    assert reused  # the later request wrote into pages the first ones had written
    assert blocks and engine.scheduler.pool.num_free == engine.scheduler.usable_pages
    assert tuple(tokens) == quest_small_budget_tokens[1]


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_a_page_restarts_when_its_first_slot_is_written(layout):
    """``paged.append_page_key_bounds`` (what the engine's append keeps) on a page holding an
    old owner's bounds: a write into its slot 0 forgets them (the bounds are the new keys', as
    the pool holds them, per KV head); a write into a later slot widens them. Plain ``update_page_key_bounds`` keeps the old keys: what a
    reused page would show without the restart."""
    cache = paged.new_kv_cache(3, 4, 2, 2, jnp.float32, layout)
    stale = paged.PageKeyBounds(jnp.full((3, 2, 2), -9.0), jnp.full((3, 2, 2), 9.0))
    table = paged.PageTable.from_page_lists([[2]], seq_lens=[2], page_size=4)
    keys = jnp.array([[[1.0, -1.0], [5.0, 6.0]], [[2.0, 3.0], [4.0, 7.0]]])  # [token, head, D]
    batch, positions = jnp.zeros(2, jnp.int32), jnp.arange(2, dtype=jnp.int32)
    cache = paged.append_kv(cache, table, keys, keys, batch, positions)
    restarted = paged.append_page_key_bounds(stale, cache, table, batch, positions)
    assert restarted.kmin[2].tolist() == [[1.0, -1.0], [4.0, 6.0]]
    assert restarted.kmax[2].tolist() == [[2.0, 3.0], [5.0, 7.0]]
    recomputed = paged.page_key_bounds(cache, table)
    np.testing.assert_array_equal(restarted.kmin[2], recomputed.kmin[2])
    assert restarted.kmin[1].tolist() == [[-9.0, -9.0]] * 2  # pages not written keep theirs
    widened = paged.append_page_key_bounds(stale, cache, table, batch[1:], positions[1:])
    assert widened.kmin[2].tolist() == [[-9.0, -9.0]] * 2  # slot 1 alone: no restart
    kept_old = paged.update_page_key_bounds(stale, table, keys, batch, positions)
    assert kept_old.kmin[2].tolist() == [[-9.0, -9.0]] * 2


# ----------------------------------------------------------------------------------------------
# Backends


def test_the_kill_switch_runs_sparse_decode_by_the_reference(
    target, quest_small_budget_tokens, monkeypatch
):
    """``DECODELAB_BACKEND=reference`` with ``backend="auto"``: sparse decode stays on (it
    changes what the model reads, the switch only how), every op is the reference, and the
    tokens are ``backend="reference"``'s."""
    monkeypatch.setenv(platform.KILL_SWITCH_VARIABLE, "reference")
    engine = _engine(target, backend="auto", sparse="quest", sparse_budget=SMALL_BUDGET)
    assert _run(engine, _requests()) == quest_small_budget_tokens
    report = engine.backend_report()
    sparse_line = report.pop("decode: sparse")
    assert sparse_line.startswith(f"sparse (quest, token budget {SMALL_BUDGET};"), sparse_line
    assert engine.sparse_report().requests_selected > 0
    assert set(report.values()) == {"reference"}, report
    assert "decode: sparse selection" in report


# ----------------------------------------------------------------------------------------------
# Arguments


def test_bad_sparse_arguments_are_named(target):
    config, params = target
    build = lambda **options: Engine(
        target, num_pages=8, page_size=PAGE_SIZE, parallel=1, **options
    )
    with pytest.raises(ValueError, match=r"sparse must be None or one of \('quest', 'recent'\), "):
        build(sparse="top_k")
    with pytest.raises(ValueError, match=r"sparse_budget must be an integer .*got '2048'"):
        build(sparse="quest", sparse_budget="2048")
    with pytest.raises(ValueError, match=r"sparse_budget must be a multiple of page_size=16 .*100"):
        build(sparse="quest", sparse_budget=100)
    with pytest.raises(ValueError, match=r"sparse_budget must be at least two pages \(32 .*16"):
        build(sparse="recent", sparse_budget=16)
    with pytest.raises(ValueError, match="cascade='on' cannot be combined with sparse='quest'"):
        build(sparse="quest", cascade="on")
    draft = load_tiny_pair()[1]
    with pytest.raises(
        ValueError, match="sparse='quest' cannot be combined with num_speculative=2"
    ):
        Engine(
            target,
            draft,
            num_pages=8,
            page_size=PAGE_SIZE,
            parallel=1,
            num_speculative=2,
            sparse="quest",
        )
    build(sparse_budget=100)  # ignored without sparse
    # The model refuses sparse attention for several new tokens (a prefill chunk), and Quest
    # without bounds.
    caches = new_caches(config, num_pages=4, page_size=PAGE_SIZE)
    table = paged.PageTable.from_seq_lens([3], page_size=PAGE_SIZE)
    quest = sparse_step.SparseDecode("quest", SMALL_BUDGET)
    tokens = jnp.array([[10, 11, 12]])
    with pytest.raises(ValueError, match="sparse decode attends one new token a request, got L=3"):
        forward_paged(params, config, tokens, caches, table, sparse=quest)
    with pytest.raises(ValueError, match="sparse mode 'quest' reads key bounds"):
        forward_paged(params, config, tokens[:, :1], caches, table, sparse=quest)
    with pytest.raises(ValueError, match=r"SparseDecode mode must be one of .*got 'top_k'"):
        sparse_step.SparseDecode("top_k", SMALL_BUDGET)
    with pytest.raises(ValueError, match=r"SparseDecode token_budget must be an int >= 1, got 0"):
        sparse_step.SparseDecode("recent", 0)


# ----------------------------------------------------------------------------------------------
# The command line


def test_generate_sparse_flags_run_the_sparse_engine(quest_small_budget_tokens, capsys):
    """``--sparse quest --sparse-budget 32``: the engine of the tests above (same slots, pool
    and programs), the same text, and ``--stats`` says what sparse decode did."""
    argv = ["generate", "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--stats"]
    argv += ["--parallel", str(PARALLEL), "--backend", "reference"]
    argv += ["--sparse", "quest", "--sparse-budget", str(SMALL_BUDGET)]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    assert main(argv) == 0
    captured = capsys.readouterr()
    for tokens in quest_small_budget_tokens:
        assert decode_tokens(tokens) in captured.out
    line = next(x for x in captured.err.splitlines() if x.startswith("decode attention:"))
    assert line.startswith(f"decode attention: sparse (quest, token budget {SMALL_BUDGET};"), line


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sparse-budget", "64"], "--sparse-budget 64 needs --sparse"),
        (["--sparse", "quest", "--sparse-budget", "40"], "--sparse-budget must be a multiple"),
        (["--sparse", "recent", "--sparse-budget", "16"], "at least two pages (32"),
        (
            ["--sparse", "quest", "--speculative", "2"],
            "--sparse quest cannot be combined with --speculative 2",
        ),
        (
            ["--sparse", "quest", "--cascade", "on"],
            "--sparse quest cannot be combined with --cascade on",
        ),
    ],
)
def test_generate_refuses_bad_sparse_flags_naming_them(flags, message, capsys):
    assert main(["generate", "--prompt", "x", *flags]) == 2  # before anything is loaded
    assert message in capsys.readouterr().err


def test_generate_refuses_an_unknown_sparse_mode(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "x", "--sparse", "dense"])
    assert exit_info.value.code == 2
    assert "--sparse" in capsys.readouterr().err


def test_the_command_lines_sparse_modes_are_the_engines():
    from serving import __main__ as cli

    assert cli.SPARSE_MODES == sparse_step.SPARSE_MODES
    assert cli.DEFAULT_SPARSE_BUDGET == sparse_step.DEFAULT_SPARSE_BUDGET


# ----------------------------------------------------------------------------------------------
# The pieces


def test_the_report_counts_requests_over_the_budget():
    """``SparseStats.record`` over a block of two steps: rows of 3 and 2 pages against a budget
    of 2 pages, an idle row not counted."""
    tables = [
        paged.host_page_table([[1, 2, 3], [4, 5], [0]], [40, 32, 1], PAGE_SIZE),
        paged.host_page_table([[1, 2, 3], [4, 5, 6]], [41, 33], PAGE_SIZE),
    ]
    stats = sparse_step.SparseStats(sparse_step.SparseDecode("recent", 2 * PAGE_SIZE))
    stats.record(tables[:1], np.array([True, True, False]))
    stats.record(tables[1:], np.array([True, True]))
    assert (stats.decode_steps, stats.requests_selected, stats.requests_whole) == (2, 3, 1)
    assert stats.describe().startswith("sparse (recent, token budget 32; 2 decode steps: 3 ")


# ----------------------------------------------------------------------------------------------
# On a GPU


@pytest.mark.gpu
def test_sparse_decode_runs_the_decode_kernel_on_a_gpu(target, dense_tokens):
    """``backend="auto"`` on a GPU: Quest's virtual table is attended by the Pallas decode
    kernel (the selection by the references, ``AUTO_PICKS_QUEST_KERNELS`` being False), and with
    a covering budget the greedy float32 tokens are dense decoding's (the reference's): a flip
    would need two logits within float32 rounding, as in ``tests/test_engine.py``'s parity."""
    engine = _engine(target, backend="auto", sparse="quest", sparse_budget=COVERING_BUDGET)
    assert _run(engine, _requests()) == dense_tokens
    report = engine.backend_report()
    assert report["decode: attention"].startswith("pallas: paged_decode"), report
    assert report["decode: sparse selection"] == "reference", report
