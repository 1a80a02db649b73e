"""The ``serving`` bench suite: its dry run end to end (every scenario kind under both arms, on
the CPU with the tiny model), the JSON's shape, the notes, and the arms' attributions; and the
pieces a GPU run depends on (scenario sizes, the pool, the kill switch's scope).
"""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from bench.__main__ import main
from bench.harness import CASE_FIELDS, RunOptions
from bench.suites import SUITES, serving, serving_load
from kernels_pallas.platform import KILL_SWITCH_VARIABLE

ROW_FIELDS = (
    "tokens_per_s",
    "itl_p50_ms",
    "itl_p99_ms",
    "ttft_ms",
    "ttft_max_ms",
    "host_us_per_step",
    "dispatch_us_per_step",
    "device_wait_us_per_step",
    "fetch_us_per_step",
    "plan_us_per_step",
    "commit_us_per_step",
    "overlap",
    "wall_over_device_step",
    "device_step_us",
    "attention_fraction",
    "sampling_fraction",
    "rest_fraction",
    "host_and_dispatch_fraction",
    "attention_callsite_us",
    "sampling_callsite_us",
    "attention_op_us",
    "sampling_op_us",
    "decode_steps",
    "compiled_steps",
    "num_layers",
    "kill_switch",
)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """Runs ``python -m bench serving --dry-run --out <tmp>`` once; returns (status, stdout,
    markdown, json object)."""
    out_dir = tmp_path_factory.mktemp("serving_dry_run")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(["serving", "--dry-run", "--out", str(out_dir)])
    [markdown_path] = out_dir.glob("*-serving.md")
    [json_path] = out_dir.glob("*-serving.json")
    return status, printed.getvalue(), markdown_path.read_text(), json.loads(json_path.read_text())


def test_dry_run_has_a_row_for_every_scenario_and_arm(dry_run):
    status, _, _, document = dry_run
    assert status == 0
    assert document["suite"] == "serving"
    cases = [(case["case"], case["arm"]) for case in document["cases"]]
    # In a dry run the synchronous arm runs the batch scenario alone (scenarios_of_arm).
    expected = [
        (scenario.case, arm)
        for scenario in serving.DRY_RUN_SCENARIOS
        for arm in serving.ARMS
        if (arm != "decodelab-sync" or scenario.kind == "batch") and arm != "decodelab-nocascade"
    ]
    load = serving.DRY_RUN_LOAD_SCENARIO
    expected += [(load.case(*config), "decodelab") for config in load.configs]
    assert cases == expected
    assert {scenario.kind for scenario in serving.DRY_RUN_SCENARIOS} == {
        scenario.kind for scenario in serving.SCENARIOS
    }


def _standard(cases):
    return [case for case in cases if not case["case"].startswith("continuous")]


def test_dry_run_rows_carry_the_fixed_and_the_serving_fields(dry_run):
    _, _, _, document = dry_run
    for case in _standard(document["cases"]):
        assert list(case)[: len(CASE_FIELDS)] == list(CASE_FIELDS)
        assert set(ROW_FIELDS) <= set(case), sorted(set(ROW_FIELDS) - set(case))
        assert case["min_us"] <= case["median_us"] <= case["max_us"]
        assert case["bytes"] > 0
        assert case["achieved_tbps"] == pytest.approx(case["bytes"] / case["median_us"] / 1e6)
        assert case["tokens_per_s"] > 0
        assert 0 < case["itl_p50_ms"] <= case["itl_p99_ms"]
        assert case["ttft_ms"] > 0 and case["host_us_per_step"] > 0
        assert case["device_step_us"] > 0
        fractions = case["attention_fraction"] + case["sampling_fraction"] + case["rest_fraction"]
        assert fractions == pytest.approx(1.0)
        assert case["compiled_steps"] == 0, case["case"]
        assert case["decode_steps"] > 0
        assert case["kill_switch"] == (case["arm"] == "reference")
        assert case["overlap"] == (case["arm"] != "decodelab-sync")


def test_dry_run_attribution_says_which_backend_ran(dry_run):
    _, _, _, document = dry_run
    for case in _standard(document["cases"]):
        attribution = case["attribution"]
        assert "decode: attention=" in attribution and "decode: sampling=" in attribution
        loop = "synchronous" if case["arm"] == "decodelab-sync" else "overlapped"
        assert attribution.endswith(f"; engine loop={loop}"), attribution
        if case["arm"] == "reference":
            assert "pallas" not in attribution, attribution
        else:  # the dry run forces every kernel (interpreted) in the default arm
            assert "decode: attention=pallas: paged_decode" in attribution, attribution
            assert "decode: sampling=pallas: dual_pivot" in attribution, attribution


def test_dry_run_notes_compare_the_arms_in_every_scenario(dry_run):
    _, printed, markdown, document = dry_run
    notes = document["notes"]
    for scenario in serving.DRY_RUN_SCENARIOS:
        assert any(note.startswith(f"{scenario.case}: the default decodes at") for note in notes), (
            scenario.case
        )
        # The synchronous arm runs the batch scenario alone in a dry run (scenarios_of_arm).
        compared = any(
            note.startswith(f"{scenario.case}: overlapped steps decode at") for note in notes
        )
        assert compared == (scenario.kind == "batch"), scenario.case
    assert any(note.startswith("target (issue 7)") for note in notes)
    assert any("DECODELAB_BACKEND=reference" in note for note in notes)
    assert "not speed figures" in markdown and "DRY RUN" in printed
    assert not any("failed" in note for note in notes), notes
    # The kill switch is restored after the run.
    assert KILL_SWITCH_VARIABLE not in os.environ


def test_dry_run_shares_programs_only_between_arms_under_one_kill_switch():
    """The dry run keeps JAX's caches from ``decodelab-sync`` to ``decodelab`` (the same
    programs) and clears them around the kill switch's arm, as a GPU run clears around each."""
    arms = serving.arms_for(RunOptions(dry_run=True))
    assert [arm.name for arm in arms] == ["reference", "decodelab-sync", "decodelab"]
    clears = [serving.dry_run_clears(arms, index) for index in range(len(arms))]
    assert clears == [
        {"clear_on_entry": True, "clear_on_exit": True},
        {"clear_on_entry": True, "clear_on_exit": False},
        {"clear_on_entry": False, "clear_on_exit": True},
    ]


def test_suite_is_registered():
    assert SUITES["serving"] == "bench.suites.serving"


def test_scenarios_quick_and_selection(monkeypatch):
    full = serving.scenarios_for(RunOptions())
    assert [s.case for s in full] == [
        "single B=1 ctx=512",
        "batch B=4 ctx=512",
        "long B=1 ctx=16384",
        "long B=1 ctx=32768",
        "shared_prefix B=32 ctx=4096",
    ]
    assert serving.scenarios_for(RunOptions(quick=True)) == full[:2]
    monkeypatch.setenv(serving.SCENARIOS_VARIABLE, "long,shared_prefix")
    assert [s.kind for s in serving.scenarios_for(RunOptions())] == [
        "long",
        "long",
        "shared_prefix",
    ]
    monkeypatch.setenv(serving.SCENARIOS_VARIABLE, "nope")
    with pytest.raises(ValueError, match="unknown kinds"):
        serving.scenarios_for(RunOptions())


def test_real_configuration_suits_the_kernels_and_the_pool():
    config = serving.model_config(RunOptions())
    assert config.num_layers == serving.NUM_LAYERS and config.dtype == "bfloat16"
    assert config.vocab_size == 128256 and config.head_dim == 128
    power_of_two = lambda n: n & (n - 1) == 0
    assert power_of_two(serving.PAGE_SIZE) and power_of_two(config.head_dim)
    assert power_of_two(serving.PREFILL_CHUNK)
    for scenario in serving.SCENARIOS:
        # Prefill (all but the last prompt token) is whole chunks: one chunk length compiles.
        assert (scenario.prompt_tokens - 1) % serving.PREFILL_CHUNK in (0, scenario.tail)
        assert scenario.tail == 0 or scenario.tail > 16  # no chunk runs the kernel's short path
    pages = serving.pool_pages(serving.SCENARIOS, serving.PAGE_SIZE, serving.LOAD_SCENARIO)
    # The shared-prefix batch fits even if nothing were shared, and the continuous load with
    # every slot at its longest prompt.
    assert pages > 32 * -(-(4096 + 33 + 64) // serving.PAGE_SIZE)
    load = serving.LOAD_SCENARIO
    assert pages > load.parallel * -(-(8192 + load.new_tokens) // serving.PAGE_SIZE)
    pool_bytes = pages * serving.PAGE_SIZE * 2 * 8 * 128 * 2 * serving.NUM_LAYERS
    assert pool_bytes < 8 << 30


def test_weight_bytes_counts_the_layers_and_lm_head():
    config = serving.model_config(RunOptions())
    per_layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336 + 2 * 4096
    expected = 2 * (4 * per_layer + 4096 + 4096 * 128256 + 4096)
    assert serving.weight_bytes(config, 1) == expected


def test_ablation_restores_what_it_replaced():
    import paged
    import sampling
    import speculative

    originals = (paged.decode_attention, sampling.filtered_sample, speculative.tempered_probs)
    with serving.ablated("no_attention"):
        assert paged.decode_attention is not originals[0]
    with serving.ablated("no_sampling"):
        assert sampling.filtered_sample is not originals[1]
        assert speculative.tempered_probs is not originals[2]
    assert (
        paged.decode_attention,
        sampling.filtered_sample,
        speculative.tempered_probs,
    ) == originals
    with pytest.raises(ValueError, match="unknown variant"), serving.ablated("other"):
        pass


LOAD_FIELDS = (
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "itl_admission_p50_ms",
    "itl_admission_p99_ms",
    "tokens_per_s",
    "requests",
    "granted_chunks",
    "compiled_steps",
    "prefill_chunk_size",
    "prefill_grant_interval",
    "max_batched_tokens",
)


def test_dry_run_runs_the_continuous_load_in_every_configuration(dry_run):
    """Requests arrive while others decode: every configuration's row has its latency figures,
    every request got its tokens, and some steps prefilled while others decoded."""
    _, _, _, document = dry_run
    load = serving.DRY_RUN_LOAD_SCENARIO
    rows = [case for case in document["cases"] if case["case"].startswith("continuous")]
    assert len(rows) == len(load.configs)
    expected_requests = len(load.arrivals(serving.config_lib.TINY_TARGET.vocab_size))
    for row, (chunk, interval) in zip(rows, load.configs, strict=True):
        assert set(LOAD_FIELDS) <= set(row), sorted(set(LOAD_FIELDS) - set(row))
        assert (row["prefill_chunk_size"], row["prefill_grant_interval"]) == (chunk, interval)
        assert row["max_batched_tokens"] == load.parallel + chunk
        assert row["requests"] == expected_requests > 1
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert 0 < row["itl_p50_ms"] <= row["itl_p99_ms"]
        assert row["tokens_per_s"] > 0 and row["prefill_steps"] > 0
        assert row["attribution"].endswith(
            f"engine loop=overlapped; chunk={chunk}; grant={interval}"
        )


def test_load_figures_split_the_gaps_that_a_prefill_step_ended_inside():
    """Two requests' token times and three steps, one of them prefilling: only the gaps that
    contain the end of the prefilling step are admission gaps; TTFT counts from the arrival;
    throughput from the first arrival to the last token."""
    run = serving_load.LoadRun(
        arrival_s={"a": 0.0, "b": 0.5},
        token_s={"a": [1.0, 2.0, 4.0], "b": [3.0, 3.5]},
        steps=[(0.0, 1.0, 0, 0, False), (2.0, 3.2, 16, 1, False), (3.2, 4.0, 0, 0, True)],
    )
    figures = serving_load.load_figures(run)
    assert figures["ttft_p50_ms"] == pytest.approx(1750.0)  # 1.0 and 2.5 s
    # a's 2.0 -> 4.0 and b's 3.0 -> 3.5 contain the prefill's end (3.2); a's 1.0 -> 2.0 not.
    assert figures["itl_admission_p50_ms"] == pytest.approx(1250.0)
    assert figures["itl_p99_ms"] == pytest.approx(1980.0)  # gaps 1.0, 2.0, 0.5
    assert figures["granted_chunks"] == 1 and figures["compiled_steps"] == 1
    assert figures["prefill_steps"] == 1 and figures["tokens_per_s"] == pytest.approx(5 / 4)


def test_load_arrivals_are_seeded_poisson_within_the_duration():
    load = serving.LOAD_SCENARIO
    arrivals = load.arrivals(1000)
    assert arrivals == load.arrivals(1000)
    times = [at for at, _ in arrivals]
    assert times == sorted(times) and 0 < times[0] and times[-1] < load.duration_s
    # Poisson: about rate x duration arrivals (720 here); 4 standard deviations either way.
    expected = load.rate_per_s * load.duration_s
    assert abs(len(arrivals) - expected) < 4 * expected**0.5
    assert {len(prompt) for _, prompt in arrivals} == set(load.prompt_lengths)


def test_load_configurations_can_be_chosen(monkeypatch):
    options = RunOptions(dry_run=False, quick=False)
    monkeypatch.setenv(serving.LOAD_CONFIGS_VARIABLE, "512:1, 2048:8")
    assert serving.load_scenario_for(options).configs == ((512, 1), (2048, 8))
    for bad in ("512", "500:1", "512:-1", "a:b"):
        monkeypatch.setenv(serving.LOAD_CONFIGS_VARIABLE, bad)
        with pytest.raises(ValueError, match="DECODELAB_SERVING_LOAD_CONFIGS entries must be"):
            serving.load_scenario_for(options)
    monkeypatch.delenv(serving.LOAD_CONFIGS_VARIABLE)
    monkeypatch.setenv(serving.SCENARIOS_VARIABLE, "single,batch")
    assert serving.load_scenario_for(options) is None
    monkeypatch.setenv(serving.SCENARIOS_VARIABLE, "continuous")
    assert serving.load_scenario_for(options) is serving.LOAD_SCENARIO
    assert serving.scenarios_for(options) == ()
    assert serving.load_scenario_for(RunOptions(dry_run=False, quick=True)) is None
