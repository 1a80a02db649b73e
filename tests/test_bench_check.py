"""The speed regression check (``python -m bench check``, ``bench/check.py``) on synthetic
reports, offline: a 10% slowdown beyond noise fails and names the case, noise-level differences
pass, a missing case is reported and fails, reports of another suite or GPU are refused."""

from __future__ import annotations

import copy
import json
import pathlib

import pytest

from bench import check
from bench.__main__ import main as bench_main

REPOSITORY_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _row(case, arm, samples):
    ordered = sorted(samples)
    return {
        "case": case,
        "arm": arm,
        "attribution": arm,
        "median_us": ordered[len(ordered) // 2],
        "min_us": ordered[0],
        "max_us": ordered[-1],
        "samples_us": list(samples),
    }


def _scaled(samples, factor):
    return [value * factor for value in samples]


# Spreads like the committed decode report's: samples within ~0.3%, a repeat ~0.8% away.
FAST = [22.35, 22.36, 22.34, 22.37, 22.36]
SLOW = [58.61, 58.68, 58.87, 58.68, 58.62]


def _report(factor_fast=1.0, factor_slow=1.0, gpu="NVIDIA H200", suite="decode"):
    return {
        "suite": suite,
        "gpu": gpu,
        "jax_version": "0.11.2",
        "cases": [
            _row("B=1 ctx=4096", "decodelab", _scaled(FAST, factor_fast)),
            _row("B=1 ctx=4096", "xla_gather", [23.9, 23.95, 24.0, 23.97, 23.93]),
            _row("B=1 ctx=4096", "decodelab (repeat)", _scaled(FAST, factor_fast * 0.992)),
            _row("B=1 ctx=32768", "decodelab", _scaled(SLOW, factor_slow)),
            _row("B=1 ctx=32768", "decodelab_kernel", _scaled(SLOW, factor_slow * 0.95)),
        ],
    }


def _verdicts(comparisons):
    return {(c.case, c.arm): c.verdict for c in comparisons}


def test_a_ten_percent_slowdown_beyond_noise_fails_and_names_the_case():
    comparisons = check.compare_reports(_report(), _report(factor_slow=1.10))
    assert _verdicts(comparisons) == {
        ("B=1 ctx=4096", "decodelab"): "same",
        ("B=1 ctx=32768", "decodelab"): "slower",
        ("B=1 ctx=32768", "decodelab_kernel"): "slower",
    }
    slower = next(c for c in comparisons if c.verdict == "slower")
    assert slower.line().startswith("SLOWER   B=1 ctx=32768 / decodelab: median 58.68 -> 64.55")


def test_noise_level_differences_pass():
    for factor in (0.99, 1.0, 1.01, 1.015):
        comparisons = check.compare_reports(_report(), _report(factor, factor))
        assert set(_verdicts(comparisons).values()) == {"same"}, factor


def test_the_noise_is_the_largest_of_spreads_repeat_and_floor():
    comparisons = check.compare_reports(_report(), _report(), tolerance=0.0)
    noise = {(c.case, c.arm): c.noise for c in comparisons}
    # B=1 ctx=4096 has a repeat 0.8% from its first timing; B=1 ctx=32768 only its samples.
    assert noise[("B=1 ctx=4096", "decodelab")] == pytest.approx(0.008, abs=1e-9)
    assert noise[("B=1 ctx=32768", "decodelab")] == pytest.approx((58.87 - 58.61) / 58.68)
    # With a 0% floor, 3% slower than samples that agree within 0.5% is beyond noise ...
    assert _verdicts(check.compare_reports(_report(), _report(1.03, 1.03), tolerance=0.0)) == {
        ("B=1 ctx=4096", "decodelab"): "slower",
        ("B=1 ctx=32768", "decodelab"): "slower",
        ("B=1 ctx=32768", "decodelab_kernel"): "slower",
    }
    # ... and a noisy new run widens the allowance: one sample 6% slow makes the spread 6%.
    noisy = _report(1.03, 1.03)
    noisy["cases"][0]["samples_us"][0] *= 1.06
    noisy["cases"][0]["max_us"] = max(noisy["cases"][0]["samples_us"])
    assert _verdicts(check.compare_reports(_report(), noisy))[("B=1 ctx=4096", "decodelab")] == (
        "same"
    )


def test_faster_beyond_noise_is_reported_but_passes(capsys):
    comparisons = check.compare_reports(_report(), _report(0.8, 1.0))
    assert _verdicts(comparisons)[("B=1 ctx=4096", "decodelab")] == "faster"
    assert check.print_comparisons(comparisons, _report(0.8, 1.0)) == 0
    assert "committed figure stale" in capsys.readouterr().out


def test_a_missing_case_is_reported_and_fails(capsys):
    measured = _report()
    measured["cases"] = [row for row in measured["cases"] if row["case"] != "B=1 ctx=32768"]
    comparisons = check.compare_reports(_report(), measured)
    assert _verdicts(comparisons)[("B=1 ctx=32768", "decodelab_kernel")] == "missing"
    assert check.print_comparisons(comparisons, measured) == 1
    printed = capsys.readouterr().out
    assert (
        "MISSING  B=1 ctx=32768 / decodelab: in the committed report, not in the new run" in printed
    )
    assert "2 missing" in printed


def test_arms_selects_what_is_compared():
    comparisons = check.compare_reports(_report(), _report(), arms=["xla_gather"])
    assert _verdicts(comparisons) == {("B=1 ctx=4096", "xla_gather"): "same"}


def test_reports_of_another_suite_or_gpu_are_refused():
    with pytest.raises(check.ReportError, match="different GPUs"):
        check.compare_reports(_report(), _report(gpu="NVIDIA H100 80GB HBM3"))
    with pytest.raises(check.ReportError, match="different suites"):
        check.compare_reports(_report(), _report(suite="sampling"))
    with pytest.raises(ValueError, match="tolerance must be in"):
        check.compare_reports(_report(), _report(), tolerance=-0.1)


def _write(path, report):
    path.write_text(json.dumps(report))
    return str(path)


def test_command_line_exit_status_and_output(tmp_path, capsys):
    committed = _write(tmp_path / "old.json", _report())
    same = _write(tmp_path / "same.json", _report(1.005, 0.995))
    slower = _write(tmp_path / "slower.json", _report(1.0, 1.10))
    assert bench_main(["check", "decode", "--against", committed, "--measured", same]) == 0
    assert "3 compared: 0 slower" in capsys.readouterr().out
    assert bench_main(["check", "decode", "--against", committed, "--measured", slower]) == 1
    printed = capsys.readouterr().out
    assert printed.splitlines()[1].startswith("SLOWER   B=1 ctx=32768 / decodelab")
    assert "2 slower beyond noise" in printed


def test_command_line_refuses_bad_reports(tmp_path, capsys):
    committed = _write(tmp_path / "old.json", _report())
    other_gpu = _write(tmp_path / "other.json", _report(gpu="cpu"))
    assert bench_main(["check", "decode", "--against", committed, "--measured", other_gpu]) == 2
    assert "different GPUs" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"suite": "decode", "gpu": "x", "cases": [{"case": "a"}]}))
    assert bench_main(["check", "decode", "--against", committed, "--measured", str(broken)]) == 2
    assert "lacks ['arm', 'median_us', 'min_us', 'max_us']" in capsys.readouterr().err
    assert bench_main(["check", "sampling", "--against", committed, "--measured", committed]) == 2
    assert "is a report of suite 'decode'" in capsys.readouterr().err


def test_without_a_gpu_and_without_measured_it_refuses(tmp_path, capsys):
    committed = _write(tmp_path / "old.json", _report())
    assert bench_main(["check", "decode", "--against", committed]) == 2
    assert "--measured" in capsys.readouterr().err


def test_the_newest_committed_report_is_the_default():
    newest = check.newest_committed_report("decode")
    assert newest.name == "2026-12-02-decode.json"
    # The committed report compared with itself passes: every figure within its own noise.
    report = check.load_report(newest)
    comparisons = check.compare_reports(report, copy.deepcopy(report))
    assert comparisons and {c.verdict for c in comparisons} == {"same"}
    with pytest.raises(check.ReportError, match="no committed report of suite 'nothing'"):
        check.newest_committed_report("nothing")
