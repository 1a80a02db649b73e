"""The engine with cascade attention (``Engine(cascade=...)``, ``serving/cascade_step.py``) on
the trained tiny pair, on the CPU.

Cascade changes what attention reads, not what it computes: the shared pages' state and each
row's own state are merged exactly, so greedy float32 tokens with cascade on must equal those
with it off, whatever the batch (samples of one prompt, ragged prompts sharing a prefix that ends
mid-page, a request sharing nothing, requests finishing at different times, speculative
verification, blocks of steps). A wrong level (a page listed twice or not at all, a new token
in a shared level, a member in the wrong group) changes the attention output by far more than
float32 rounding, and the greedy tokens with it; ``test_a_wrong_shared_level_changes_the_tokens``
checks that these comparisons can fail.

Shapes are shared between tests (slots, pool, prompt lengths) so that compiled programs are
reused: the engine's programs are module-level ``jax.jit`` functions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged
from kernels_pallas import platform
from serving import cascade_step, programs
from serving.__main__ import main
from serving.demo import encode_text, load_tiny_pair
from serving.engine import Engine
from serving.model import forward_dense
from serving.requests import Request, SamplingParams

PAGE_SIZE = 16
NUM_PAGES = 32
PARALLEL = 4
# 40 bytes: two whole pages and 8 bytes of a third, so the shared prefix ends mid-page.
PREFIX = "def main(argv):\n    import os, sys\n    a"
assert len(PREFIX) == 40
# Ragged continuations of PREFIX: prompts of 41 to 52 bytes, each other's after 40.
SUFFIXES = ("rgs = 1\n", "", "ll = [x for", "ssert 1\n")
# A prompt sharing no page with PREFIX.
OTHER = "class Foo:\n    def __init__(self):\n"
EVERY_GROUP = paged.CascadeCrossover(min_group_size=2, min_prefix_pages=1)


@pytest.fixture(scope="module")
def pair():
    return load_tiny_pair()


def _engine(pair, *, cascade, num_speculative=0, backend="reference", **options):
    """An engine on the module's pool and slots. Prompts are prefilled a token a chunk (all in
    the first step, within the default budget): cascade is a decode path, and one prefill
    program then serves every prompt length here, where the ragged prompts' power-of-two
    pieces would compile six."""
    target, draft = pair
    options = (
        dict(num_pages=NUM_PAGES, page_size=PAGE_SIZE, parallel=PARALLEL, prefill_chunk_size=1)
        | options
    )
    return Engine(
        target,
        draft,
        num_speculative=num_speculative,
        backend=backend,
        cascade=cascade,
        **options,
    )


def _greedy(request_id, text: str, max_tokens: int) -> Request:
    return Request(
        request_id, encode_text(text), SamplingParams(temperature=0, max_tokens=max_tokens)
    )


def _run(engine, requests) -> list[tuple[int, ...]]:
    outputs = engine.generate(requests)
    scheduler = engine.scheduler
    assert scheduler.pool.num_free == scheduler.usable_pages  # every page back
    return [output.token_ids for output in outputs]


def _ragged_batch() -> list[Request]:
    """Three prompts sharing PREFIX's two whole pages (ragged lengths, the prefix ending
    mid-page), one sharing nothing, finishing at different times: the group shrinks to two,
    then to one (no group: plain decode)."""
    return [
        _greedy("a", PREFIX + SUFFIXES[0], 9),
        _greedy("b", PREFIX + SUFFIXES[1], 3),
        _greedy("c", PREFIX + SUFFIXES[2], 6),
        _greedy("other", OTHER, 5),
    ]


# ----------------------------------------------------------------------------------------------
# Same tokens, cascade on and off


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_samples_of_one_prompt_give_the_same_tokens_with_cascade(pair, temperature):
    """Four samples of one prompt (the CLI's --num-samples): the scheduler shares the prompt's
    whole pages, the engine cascades them, and the tokens are those without cascade: greedy,
    and sampled (each sample its own seed, so the four rows differ; the keys are the same with
    and without cascade, so a token differs only if a uniform draw falls within float32
    rounding of a boundary of the cumulative distribution, about 1e-6 a token)."""
    prompt = encode_text(PREFIX + SUFFIXES[0])
    requests = lambda: [
        Request(i, prompt, SamplingParams(temperature=temperature, seed=i, max_tokens=6))
        for i in range(4)
    ]
    off = _run(_engine(pair, cascade="off"), requests())
    engine = _engine(pair, cascade="on")
    assert _run(engine, requests()) == off
    report = engine.cascade_report()
    assert report.cascade_steps > 0 and report.largest_group == 4, report
    assert engine.backend_report()["decode: cascade"].startswith(
        f"cascade ({report.cascade_steps} of {report.decode_steps} decode steps"
    )


@pytest.mark.parametrize("overlap", [True, False])
def test_a_ragged_mixed_batch_gives_the_same_greedy_tokens_with_cascade(pair, overlap):
    """Ragged prompts sharing a prefix that ends mid-page, a request sharing nothing, and
    requests finishing at different times: the tokens are those without cascade; the last
    steps, where one sharing request is left, decode plainly."""
    off = _run(_engine(pair, cascade="off", overlap=overlap), _ragged_batch())
    engine = _engine(pair, cascade="on", overlap=overlap)
    assert _run(engine, _ragged_batch()) == off
    report = engine.cascade_report()
    assert 0 < report.cascade_steps < report.decode_steps, report
    assert report.largest_group == 3, report  # "other" never joins
    assert report.last_reason.startswith("no group"), report  # "a" decodes alone at the end


def test_only_whole_pages_that_every_member_lists_are_shared(pair, monkeypatch):
    """The levels the engine builds for the ragged batch: one group of the three PREFIX
    requests sharing exactly PREFIX's two whole pages (the third page, where the prefix ends
    mid-page, is each request's own), and each request's own level the rest of its row."""
    seen = []
    real = cascade_step.plan_step_levels

    def spy(tables, active, crossover, **kwargs):
        levels = real(tables, active, crossover, **kwargs)
        seen.append((tables[0], active.copy(), levels))
        return levels

    monkeypatch.setattr(cascade_step, "plan_step_levels", spy)
    engine = _engine(pair, cascade="on")
    _run(engine, _ragged_batch())
    cascaded = [(table, active, levels[0]) for table, active, levels in seen if levels]
    assert cascaded
    for table, active, levels in cascaded:
        (shared,) = levels.shared
        sizes = np.diff(shared.group_indptr)
        members = shared.group_requests[: sizes.sum()].tolist()
        groups = shared.group_pages.page_lists()
        assert [len(pages) for pages, size in zip(groups, sizes, strict=True) if size] == [2]
        rows = table.page_lists()
        for member in members:  # the group's pages are the first two of every member's row
            assert rows[member][:2] == groups[0]
            assert levels.own.page_lists()[member] == rows[member][2:]
        # A non-member's own level is its whole row.
        for row in set(np.flatnonzero(active).tolist()) - set(members):
            assert levels.own.page_lists()[row] == rows[row]
        np.testing.assert_array_equal(
            levels.own.seq_lens() + np.isin(np.arange(PARALLEL), members) * 2 * PAGE_SIZE,
            table.seq_lens(),
        )


@pytest.mark.parametrize("max_steps_per_program", [1, 4])
def test_the_engine_levels_are_planned_afresh_when_a_group_changes(
    pair, monkeypatch, max_steps_per_program
):
    """The engine plans each program's levels through its ``CascadePlanCache``: at every
    program they equal levels planned from scratch from the same tables (no cache), while the
    group shrinks as its requests finish (three members, then two, then none: each layout
    planned afresh), and programs between those changes reuse the levels of the one before
    (in a block, steps reuse the step before's)."""
    seen = []
    real = cascade_step.plan_step_levels

    def spy(tables, active, crossover, **kwargs):
        levels = real(tables, active, crossover, **kwargs)
        fresh = real(tables, active, crossover, q_len=kwargs["q_len"])  # no cache
        seen.append((levels, fresh))
        return levels

    monkeypatch.setattr(cascade_step, "plan_step_levels", spy)
    engine = _engine(pair, cascade="on", max_steps_per_program=max_steps_per_program)
    _run(engine, _ragged_batch())
    sizes = []
    for levels, fresh in seen:
        assert (levels is None) == (fresh is None)
        if levels is not None:
            for step, expected in zip(levels, fresh, strict=True):
                got_leaves, got_tree = jax.tree.flatten(step)
                expected_leaves, expected_tree = jax.tree.flatten(expected)
                assert got_tree == expected_tree
                for got, want in zip(got_leaves, expected_leaves, strict=True):
                    np.testing.assert_array_equal(got, want)
                    assert got.dtype == want.dtype
        sizes.append(0 if levels is None else int(levels[0].shared[0].group_indptr[-1]))
    changes = [size for i, size in enumerate(sizes) if i == 0 or sizes[i - 1] != size]
    assert changes[-3:] == [3, 2, 0], sizes
    plans = engine._cascade_plans
    assert plans.hits > 0 and plans.misses >= 2, (plans.hits, plans.misses)


def test_speculative_verification_cascades_with_the_same_greedy_tokens(pair):
    """Speculative steps: the target's verification of ``n + 1`` tokens attends through the
    levels (the draft's one-token passes stay plain); greedy tokens are unchanged."""
    off = _run(_engine(pair, cascade="off", num_speculative=2), _ragged_batch())
    engine = _engine(pair, cascade="on", num_speculative=2)
    assert _run(engine, _ragged_batch()) == off
    assert engine.cascade_report().cascade_steps > 0


def test_blocks_of_steps_cascade_with_the_same_greedy_tokens(pair):
    """Four decode steps a program: each step's levels stacked, the scan's body cascading."""
    requests = lambda: [_greedy(i, PREFIX + SUFFIXES[3], 9) for i in range(3)]
    off = _run(_engine(pair, cascade="off"), requests())
    engine = _engine(pair, cascade="on", max_steps_per_program=4)
    assert _run(engine, requests()) == off
    report = engine.cascade_report()
    assert report.cascade_steps > 0, report


def test_a_wrong_shared_level_changes_the_tokens(pair, monkeypatch):
    """The comparisons above can fail: levels whose shared pages are dropped (each member then
    attends to its own pages only) give other greedy tokens."""
    real = cascade_step.plan_step_levels

    def without_shared_keys(*args, **kwargs):
        levels = real(*args, **kwargs)
        if levels is None:
            return None
        no_shared = lambda step: cascade_step.empty_levels(step.own, PARALLEL // 2).shared
        return [paged.CascadeLevels(no_shared(step), step.own) for step in levels]

    off = _run(_engine(pair, cascade="off"), _ragged_batch())
    monkeypatch.setattr(cascade_step, "plan_step_levels", without_shared_keys)
    assert _run(_engine(pair, cascade="on"), _ragged_batch()) != off


# ----------------------------------------------------------------------------------------------
# When the engine cascades


def test_auto_falls_back_to_plain_decode_below_the_measured_crossover(pair):
    """``"auto"`` with the measured crossover (16 requests x 256 pages): four requests sharing
    two pages decode plainly; with the crossover lowered they cascade, same tokens."""
    requests = lambda: [_greedy(i, PREFIX + SUFFIXES[0], 6) for i in range(4)]
    engine = _engine(pair, cascade="auto")
    assert engine.cascade_crossover == paged.CASCADE_CROSSOVER
    plain = _run(engine, requests())
    report = engine.cascade_report()
    assert report.cascade_steps == 0 and report.decode_steps > 0, report
    assert "16 or more requests sharing 256 or more whole pages" in report.last_reason
    # The report of a run that never cascaded is a plain run's.
    assert not {"decode: cascade", "decode: cascade attention"} & set(engine.backend_report())
    lowered = _engine(pair, cascade="auto", cascade_crossover=EVERY_GROUP)
    assert _run(lowered, requests()) == plain
    assert lowered.cascade_report().cascade_steps > 0


def test_the_kill_switch_turns_cascade_off(pair, monkeypatch):
    """``DECODELAB_BACKEND=reference``: not even ``"on"`` cascades; the decode program is the
    plain one."""
    monkeypatch.setenv(platform.KILL_SWITCH_VARIABLE, "reference")
    engine = _engine(pair, cascade="on")
    _run(engine, [_greedy(i, PREFIX + SUFFIXES[0], 3) for i in range(4)])
    report = engine.cascade_report()
    assert report.cascade_steps == 0 and "kill switch" in report.last_reason, report
    # As a plain run's: every op the reference (what the serving benchmark's kill switch arm
    # checks), no cascade line.
    assert set(engine.backend_report().values()) == {"reference"}


def test_auto_declines_the_per_level_triton_path():
    """Under ``backend="pallas"`` a cascaded step would read each shared page once per request
    (the per-level path): ``"auto"`` declines it, ``"on"`` does not."""
    crossover, reason = cascade_step.step_crossover("auto", EVERY_GROUP, "pallas")
    assert crossover is None and "cannot pay" in reason
    assert cascade_step.step_crossover("on", None, "pallas")[0] is not None
    assert cascade_step.step_crossover("auto", EVERY_GROUP, "reference") == (EVERY_GROUP, None)
    assert cascade_step.step_crossover("auto", None, "reference")[0] is None
    assert cascade_step.step_crossover("off", EVERY_GROUP, "reference")[0] is None


def test_other_groups_compile_no_new_decode_program(pair):
    """The levels' shapes do not depend on the groups: after a batch of one group of four, a
    batch of two groups of two (same table bucket) compiles no new decode program."""
    first = _engine(pair, cascade="on")
    _run(first, [_greedy(i, PREFIX + SUFFIXES[0], 6) for i in range(4)])
    compiled = programs.decode_step_jit._cache_size()
    second = _engine(pair, cascade="on")
    prompts = (PREFIX + SUFFIXES[0], OTHER) * 2
    _run(second, [_greedy(i, prompt, 6) for i, prompt in enumerate(prompts)])
    report = second.cascade_report()
    assert report.groups > report.cascade_steps, report  # two groups in some step
    assert programs.decode_step_jit._cache_size() == compiled


def test_levels_have_one_shape_whatever_the_groups():
    """The decode program compiles once a table bucket: levels of different group layouts (and
    none) have the same leaf shapes."""
    tables = [
        paged.host_page_table([[1, 2, 3], [1, 2, 4], [5, 6], [7]], [40, 35, 20, 3], PAGE_SIZE),
        paged.host_page_table([[1, 5], [1, 6], [2, 7], [2, 8]], [20, 20, 30, 30], PAGE_SIZE),
    ]
    active = np.ones(PARALLEL, bool)
    shapes = []
    for table in tables:
        (levels,) = cascade_step.plan_step_levels([table], active, EVERY_GROUP)
        shapes.append([leaf.shape for leaf in jax.tree.leaves(levels)])
    empty = cascade_step.empty_levels(tables[0], PARALLEL // 2)
    shapes.append([leaf.shape for leaf in jax.tree.leaves(empty)])
    assert shapes[0] == shapes[1] == shapes[2]


def test_the_report_counts_groups_requests_and_pages():
    """``CascadeStats.record`` on known levels: one group of three sharing two pages, one of two
    sharing one page, over a block of two steps."""
    table = paged.host_page_table(
        [[1, 2, 3], [1, 2, 4], [1, 2, 5], [6, 7], [6, 8], [9]],
        [40, 40, 40, 20, 20, 5],
        PAGE_SIZE,
    )
    (levels,) = cascade_step.plan_step_levels([table], np.ones(6, bool), EVERY_GROUP)
    stats = cascade_step.CascadeStats("on")
    stats.record(2, levels)
    stats.record(1, None, "cascade='off'")
    assert (stats.decode_steps, stats.cascade_steps) == (3, 2)
    assert (stats.groups, stats.requests, stats.largest_group) == (4, 10, 3)
    assert stats.shared_pages == 2 * (2 + 1)
    assert stats.page_reads_saved == 2 * (2 * 2 + 1 * 1)
    assert stats.describe().startswith("cascade (2 of 3 decode steps; 4 groups, 10 requests")


def test_bad_cascade_arguments_are_named(pair):
    target, _ = pair
    with pytest.raises(
        ValueError, match=r"cascade must be one of \('auto', 'on', 'off'\), got 'yes'"
    ):
        Engine(target, num_pages=8, page_size=16, parallel=1, cascade="yes")
    with pytest.raises(ValueError, match=r"cascade_crossover must be a paged\.CascadeCrossover"):
        Engine(target, num_pages=8, page_size=16, parallel=1, cascade_crossover=(16, 256))


# ----------------------------------------------------------------------------------------------
# On the H200: the Mosaic GPU path the crossover was measured on

# A bf16 flip is a near-tie when the float32 model's logits of the two tokens differ by at most
# this much (tests/test_engine.py's bf16 test: measured gaps 0.002 and 0.003; one bf16
# rounding of a logit near 10 is 0.02). The Mosaic GPU cascade path keeps the shared level's
# state in float32 up to the merge and plain decode does not, so bf16 tokens may flip there.
NEAR_TIE_LOGITS = 0.1


def _bf16(pair):
    config, params = pair[0]
    return (
        dataclasses.replace(config, dtype="bfloat16"),
        jax.tree.map(lambda w: jnp.asarray(w, jnp.bfloat16), params),
    )


def _assert_flips_only_at_near_ties(pair, requests, ours, theirs) -> None:
    """Each request's first differing token is a near-tie of the float32 model."""
    config, params = pair[0]
    for request, a, b in zip(requests, ours, theirs, strict=True):
        first = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if first is None:
            continue
        context = jnp.asarray([list(request.prompt_token_ids) + list(b[:first])], jnp.int32)
        logits = np.asarray(forward_dense(params, config, context, backend="reference"))[0, -1]
        assert abs(float(logits[a[first]] - logits[b[first]])) <= NEAR_TIE_LOGITS, request


@pytest.mark.gpu
def test_cascade_runs_the_mosaic_gpu_kernels_on_a_gpu(pair):
    """bf16 on a GPU under ``backend="auto"``: a cascaded step's attention is the Mosaic GPU
    shared-level kernel and the own level's decode kernel, and greedy tokens equal plain
    decode's up to bf16 near-ties."""
    target = _bf16(pair)
    tokens, engines = {}, {}
    for mode in ("off", "on"):
        engine = Engine(
            target, num_pages=NUM_PAGES, page_size=PAGE_SIZE, parallel=PARALLEL, cascade=mode
        )
        tokens[mode] = _run(engine, _ragged_batch())
        engines[mode] = engine
    report = engines["on"].backend_report()
    assert report["decode: cascade attention"] == "pallas: cascade_shared_mgpu, paged_decode_mgpu"
    assert engines["on"].cascade_report().cascade_steps > 0
    _assert_flips_only_at_near_ties(pair, _ragged_batch(), tokens["on"], tokens["off"])


@pytest.mark.gpu
def test_the_per_level_triton_path_gives_the_same_greedy_tokens(pair):
    """``backend="pallas"``, ``cascade="on"`` (float32): each level through the Triton decode
    kernel, merged; the tokens are plain decode's. (Interpreted on a CPU it takes about 20 s,
    too long for this file's budget; it gave the same tokens there too.)"""
    off = _run(_engine(pair, cascade="off", backend="pallas"), _ragged_batch())
    engine = _engine(pair, cascade="on", backend="pallas")
    assert _run(engine, _ragged_batch()) == off
    assert engine.backend_report()["decode: cascade attention"] == "pallas: paged_decode"


@pytest.mark.gpu
def test_auto_cascades_at_the_measured_crossover_on_a_gpu(pair):
    """``"auto"`` with the measured crossover: 16 samples of a 4100-token prompt (256 whole
    pages shared) cascade on the Mosaic GPU path; tokens equal ``"off"``'s up to near-ties."""
    text = (PREFIX + OTHER) * (4100 // len(PREFIX + OTHER) + 1)
    requests = lambda: [_greedy(i, text[:4100], 8) for i in range(16)]
    tokens, engines = {}, {}
    for mode in ("off", "auto"):
        engine = Engine(_bf16(pair), num_pages=320, page_size=16, parallel=16, cascade=mode)
        tokens[mode] = _run(engine, requests())
        engines[mode] = engine
    report = engines["auto"].cascade_report()
    assert report.cascade_steps > 0 and report.largest_group == 16, report
    assert "cascade_shared_mgpu" in engines["auto"].backend_report()["decode: cascade attention"]
    _assert_flips_only_at_near_ties(pair, requests(), tokens["auto"], tokens["off"])


# ----------------------------------------------------------------------------------------------
# The command line


def test_generate_cascade_flag_runs_cascade_for_samples_of_one_prompt(capsys):
    """``--num-samples 3 --cascade on``: the samples share the prompt's pages, cascade runs
    (``--stats`` says so), and the output is ``--cascade off``'s. (Prompts prefilled a token a
    chunk: one compiled prefill program, not one a power-of-two piece; what differs is decode.)"""
    argv = ["generate", "--prompt", PREFIX, "--max-tokens", "4", "--num-samples", "3"]
    argv += ["--temperature", "0", "--parallel", "3", "--stats", "--prefill-chunk-size", "1"]
    printed = {}
    for mode in ("off", "on"):
        assert main([*argv, "--cascade", mode]) == 0
        captured = capsys.readouterr()
        printed[mode] = captured.out
        line = next(x for x in captured.err.splitlines() if x.startswith("decode attention:"))
        assert line.startswith(
            "decode attention: cascade (" if mode == "on" else "decode attention: plain"
        ), line
    assert printed["on"] == printed["off"] and printed["on"].strip()


def test_generate_refuses_a_bad_cascade_mode_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "x", "--cascade", "sometimes"])
    assert exit_info.value.code == 2
    assert "--cascade" in capsys.readouterr().err


def test_the_command_lines_cascade_modes_are_the_engines():
    from serving import __main__ as cli

    assert cli.CASCADE_MODES == cascade_step.CASCADE_MODES
