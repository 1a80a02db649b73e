"""``bench.probes`` on the CPU: each probe builds its variants and runs a smoke case (apart from
``test_bench.py`` so that the two files, both long, run on separate test workers)."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Pallas Triton backend's
def test_two_level_race_probe_draws_the_softmax_and_lowers_for_an_h200(
    monkeypatch, verify_triton_modules
):
    """``bench/probes/gumbel_two_level.py`` (a cost probe for issue 4): its two kernels,
    interpreted, draw ``softmax(logits)`` (calibrated check, 16 blocks of 32 tokens with a
    masked tail), and lower to Triton modules an H200 accepts at the probe's shapes."""
    import functools

    from bench.probes import gumbel_two_level as probe
    from tests.test_sampling_api import assert_distributed_as

    vocab, draws = 500, 20_000  # 16 blocks of 32, the last one partial; the bound scales
    logits = jax.random.normal(jax.random.key(3), (vocab,)) * 2.0
    logits = logits.at[:70].set(-jnp.inf)  # masked tokens, two whole blocks among them
    tokens = probe.interpreted_draws(logits, draws, 4)
    assert_distributed_as(tokens, np.asarray(jax.nn.softmax(logits)))

    gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
    h200 = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
    monkeypatch.setitem(gpu_info.registry, jax.devices()[0].device_kind, lambda: h200)
    batch = 4
    for block, per_program, warps, pick_warps in probe.VARIANTS:
        text = (
            jax.jit(
                functools.partial(
                    probe.two_level_race,
                    block=block,
                    blocks_per_program=per_program,
                    warps=warps,
                    pick_warps=pick_warps,
                )
            )
            .trace(
                jax.ShapeDtypeStruct((batch, probe.VOCAB), jnp.float32),
                jax.ShapeDtypeStruct((batch,), jnp.uint32),
                jax.ShapeDtypeStruct((batch,), jnp.uint32),
            )
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
        assert f"two_level_pick_b{block}" in text


def test_decode_clamps_probe_builds_its_variants_and_runs_a_smoke_case(tmp_path, capsys):
    """The probe's text substitutions still match the kernel (each asserts its anchor), and one
    tiny interpreted case runs through the variant arms. The current kernel and merge stand in
    for the earlier commits' sources, which live in git, not in the tree."""
    from bench.probes import decode_clamps

    kernels = pathlib.Path(decode_clamps.kernel_module.__file__).parent
    for commit in ("old", "head"):
        for name in ("paged_decode", "merge_states"):
            (tmp_path / f"{commit}_{name}.py").write_text((kernels / f"{name}.py").read_text())
    arms = "kernel:fixed,kernel:fixed_tokensteps,kernel:fixed_clips"
    assert decode_clamps.main(["--smoke", "--sources", str(tmp_path), "--arms", arms]) == 0
    printed = capsys.readouterr().out
    for arm in arms.split(","):
        assert f"{arm} max|o - first arm| = 0" in printed


def test_mgpu_decode_probe_runs_a_smoke_case(tmp_path, capsys):
    """``bench/probes/mgpu_decode.py`` (issue 16): one tiny case in Mosaic GPU's interpret mode
    through the check, timing and report code; the interpretable arms agree with the Triton
    kernel, and an arm that cannot run (the register path, interpreted) is reported, not fatal.
    The public path's arms (``--api``) too, its Mosaic GPU one on the ring."""
    from bench.probes import mgpu_decode
    from paged import decode as decode_module

    launch = dict(decode_module.MGPU_LAUNCH_PARAMETERS)
    try:
        arguments = ["--smoke", "--variants", "smem.p1.s4,reg.p1.s4", "--api"]
        arguments += ["--api-variant", "ring.smem.p2.s2", "--out", str(tmp_path)]
        assert mgpu_decode.main(arguments) == 0
    finally:  # the probe sets the public path's pipeline for its process
        decode_module.MGPU_LAUNCH_PARAMETERS = launch
    printed = capsys.readouterr().out
    document = json.loads((tmp_path / "mgpu_decode_probe.json").read_text())
    by_arm = {row["arm"]: row for row in document["rows"]}
    assert by_arm["mgpu:reg.p1.s4"]["status"] == "failed"
    assert "needs probs_in_smem=True" in by_arm["mgpu:reg.p1.s4"]["error"]
    assert by_arm["mgpu:smem.p1.s4"]["programs_per_sm"] >= 1
    for arm in ("mgpu:smem.p1.s4", "api:pallas", "api:pallas_mgpu"):
        assert by_arm[arm]["status"] == "ok"
        assert by_arm[arm]["max_abs_diff_o"] <= mgpu_decode.MAX_DIFFERENCE
    assert by_arm["api:pallas"]["max_abs_diff_o"] == 0  # the Triton arm, through the API
    assert document["api_launch_parameters"]["pipeline"] == "ring"
    assert "smoke run, no figures" in printed


def test_mgpu_decode_sweep_reports_refused_and_skipped_arms(tmp_path, capsys):
    """The probe's ``--sweep`` (issue 16), its smoke form: the ring arm runs and agrees with the
    Triton kernel; a ring over the shared-memory limit is reported with the refusal, not fatal;
    with no time budget left every arm is reported as skipped, its case listed for a rerun."""
    from bench.probes import mgpu_decode

    assert mgpu_decode.main(["--sweep", "--smoke", "--out", str(tmp_path)]) == 0
    document = json.loads((tmp_path / "mgpu_decode_probe.json").read_text())
    assert document["sweep"] and document["repeats"] == 3
    by_arm = {row["arm"]: row for row in document["rows"]}
    assert by_arm["mgpu:ring.smem.p4.s2"]["status"] == "ok"
    assert by_arm["mgpu:ring.smem.p4.s2"]["max_abs_diff_o"] <= mgpu_decode.MAX_DIFFERENCE
    assert by_arm["mgpu:ring.smem.p4.s2"]["smem_bytes"] < 227 * 1024
    assert by_arm["mgpu:ring.smem.p4.s2"]["waves"] > 0
    assert by_arm["mgpu:ring.smem.p8.s8"]["status"] == "failed"
    assert "KiB of shared memory a program" in by_arm["mgpu:ring.smem.p8.s8"]["error"]
    capsys.readouterr()

    assert mgpu_decode.main(["--sweep", "--smoke", "--budget-s", "0"]) == 0
    printed = capsys.readouterr().out
    assert "skipped (time budget)" in printed and "skipped: ['B=2" in printed


def test_mgpu_decode_variant_names_round_trip():
    """Sweep variant names parse back to their configuration; a malformed one is refused with
    its text."""
    from bench.probes import mgpu_decode

    for variant in mgpu_decode.SWEEP_VARIANTS + mgpu_decode.VARIANTS:
        assert mgpu_decode.parse_variant(variant.name) == variant
    assert mgpu_decode.parse_variant("ring.reg.p4.s3").pipeline == "ring"
    with pytest.raises(ValueError, match=r"'ring\.p4\.s3' is not"):
        mgpu_decode.parse_variant("ring.p4.s3")


def test_mgpu_decode_probe_memcheck_workload_runs_interpreted(capsys):
    """The probe's compute-sanitizer workload (``--memcheck``), its small form interpreted: the
    kernel agrees with the reference on every arm, and page numbers outside the pool give a
    finite output."""
    from bench.probes import mgpu_decode

    assert mgpu_decode.main(["--memcheck", "--smoke"]) == 0
    printed = capsys.readouterr().out
    assert "q_len=5" in printed and "finite output True" in printed
    assert "ring.smem.p4" in printed


def test_engine_dispatch_probe_runs_a_smoke_case(tmp_path, capsys):
    """The probe of an engine step's host time runs both loops and the program alone, and
    writes one row a loop (figures on a CPU mean nothing; the code paths do); with
    ``--steps-per-program 4`` too."""
    from bench.probes import engine_dispatch

    assert engine_dispatch.main(["--smoke", "--label", "smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "engine_dispatch_smoke.json").read_text())
    assert [row["loop"] for row in rows] == ["overlapped", "synchronous"]
    for row in rows:
        assert row["steps"] > 0 and row["dispatch_us"] > 0 and row["wall_step_us"] > 0
    assert rows[0]["call_us"] > 0 and rows[0]["calls"] == 3
    assert "program alone" in capsys.readouterr().out
    # Several steps a program: the rows count programs and steps, and the block runs alone.
    argv = ["--smoke", "--steps-per-program", "4", "--label", "k4", "--out", str(tmp_path)]
    assert engine_dispatch.main(argv) == 0
    rows = json.loads((tmp_path / "engine_dispatch_k4.json").read_text())
    for row in rows:
        assert row["steps_per_program_max"] == 4 and row["decode_steps"] > row["steps"] > 0
    assert rows[0]["block_steps"] > 1 and rows[0]["block_device_us_per_step"] > 0


def test_mla_engine_probe_runs_its_tiny_case(tmp_path, capsys):
    """The MLA engine probe (issue 20) on a CPU: both layouts of ``MLA_TEST`` through the
    engine, a row each with the cache bytes a token (latent ``2 x (32 + 8) x 4``; expanded
    ``2 x 2 x 4 heads x 32 x 4`` padded, ``2 x 4 x 36 x 4`` unpadded) and steps timed (figures
    on a CPU mean nothing; the code paths do)."""
    from bench.probes import mla_engine

    assert mla_engine.main(["--tiny", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "mla_engine.json").read_text())
    assert report["cache_bytes_per_token"] == {
        "latent": 320,
        "expanded": 2048,
        "expanded_unpadded": 1152,
    }
    rows = report["rows"]
    assert [row["arm"] for row in rows] == ["latent/reference", "expanded/reference"]
    for row in rows:
        assert row["steps"] > 0 and row["tokens_per_s"] > 0 and row["itl_ms_p50"] > 0
    assert "B/token" in capsys.readouterr().out


def test_device_time_is_read_from_a_perfetto_trace(tmp_path):
    """``bench.harness.device_trace`` (the decode suite's device figures, the
    ``decode_overhead`` probe's ``--trace``) on a hand-made trace: device kernels summed per
    name and call, host events ignored, the span from the first kernel's start to the last
    one's end."""
    import gzip

    from bench.harness.device_trace import device_time_from_trace

    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "tid": 1, "name": "PjitFunction", "ts": 0.0, "dur": 500.0},
    ]
    for call in range(2):  # two calls: a decode kernel of 10 us and a merge of 3 us each
        start = 100.0 + 20.0 * call
        events.append({"ph": "X", "pid": 2, "tid": 7, "name": "decode", "ts": start, "dur": 10.0})
        events.append(
            {"ph": "X", "pid": 2, "tid": 7, "name": "merge", "ts": start + 12, "dur": 3.0}
        )
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as handle:
        json.dump({"traceEvents": events}, handle)
    result = device_time_from_trace(str(tmp_path), calls=2)
    assert result["busy_us_per_call"] == {"decode": 10.0, "merge": 3.0}
    assert result["total_busy_us_per_call"] == 13.0
    assert result["span_us_per_call"] == (135.0 - 100.0) / 2
    assert result["processes"] == ["/device:GPU:0"]
    assert "error" in device_time_from_trace(str(tmp_path / "none"), 1)


def test_decode_overhead_probe_builds_its_arms_and_skips_past_its_budget(tmp_path, capsys):
    """With no budget left every arm is reported as skipped, none is run (the arms themselves
    ran interpreted when the probe was written; on the CPU each takes seconds)."""
    from bench.probes import decode_overhead

    assert decode_overhead.main(["--smoke", "--budget-s", "0", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "decode_overhead_probe.json").read_text())
    arms = [row["arm"] for row in rows]
    assert arms[:3] == ["floor", "api", "api.turn"]
    assert {"kernel:ring.p2.s2@32", "split:ring.p2.s2@32", "folded:ring.p2.s2@32"} <= set(arms)
    assert all(row.get("skipped") == "budget" for row in rows)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Pallas Triton backend's
def test_append_bounds_probe_runs_a_smoke_case(tmp_path, capsys):
    """``bench/probes/append_bounds.py`` (issue 19) interpreted on one tiny chunk (three tokens
    a page, so programs of one launch widen the same page): every arm, the ``--fused-warps`` one
    included, passes its bit-for-bit checks against the plain arm and the reference bounds, and
    the JSON has a row an arm."""
    from bench.probes import append_bounds

    argv = ["--smoke", "--cases", "chunk 1x12", "--fused-warps", "2", "--out", str(tmp_path)]
    assert append_bounds.main(argv) == 0
    document = json.loads((tmp_path / "append_bounds.json").read_text())
    assert [row["arm"] for row in document["rows"]] == ["plain", "fused", "two_step", "fused.w2"]
    assert [row["check"] for row in document["rows"]] == ["floor", "ok", "ok", "ok"]
    assert document["failures"] == 0 and "failures: 0" in capsys.readouterr().out
