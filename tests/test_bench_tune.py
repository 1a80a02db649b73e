"""``python -m bench tune`` (``bench/tuning/tune.py``) on the CPU: a dry run that times the
decode kernel's real programs (interpreted, tiny shapes) through both selection stages and
writes a table that ``kernels_pallas.tuning_tables`` loads; the table file's merging; the
command line's refusals. Speed decisions themselves are tested in ``test_autotune.py``."""

from __future__ import annotations

import argparse

import jax
import pytest

from bench.__main__ import main as bench_main
from bench.harness import RunOptions
from bench.tuning import paged_decode_target, tune
from kernels_pallas.tuning_tables import (
    TUNED_DIRECTORY,
    bucket_key,
    load_table,
    lookup,
    read_tables,
)

BUCKET = "head_dim=32,group_rows=16,batch=1,context=64"
FAST_LAUNCH = "p4_w4_s1"


def test_dry_run_tunes_the_decode_kernel_end_to_end(tmp_path, capsys):
    """Every sample runs the candidate's real timed program; the fake factor only makes the
    decision certain (interpreted timings on a CPU are noise), so both stages and the table
    writing are exercised."""
    runs: dict[str, int] = {}

    def measure_for(session):
        real = tune.HarnessMeasure(
            session.loop_for, RunOptions(dry_run=True), session.expected_us_per_call
        )

        def measure(candidate):
            runs[candidate.name] = runs.get(candidate.name, 0) + 1
            factor = 0.01 if candidate.name == FAST_LAUNCH else 1.0
            return real(candidate) * factor

        return measure

    status = tune.main(
        ["paged_decode", "--dry-run", "--out", str(tmp_path), "--buckets", "batch=1,context=50"],
        measure_for=measure_for,
    )
    assert status == 0
    printed = capsys.readouterr().out
    assert f"{BUCKET}: KEPT  {FAST_LAUNCH}" in printed
    # Stage 1: 2 samples each; stage 2: 2 ABBA blocks of 2 + 2.
    assert runs == {"p8_w4_s1": 2 + 4, FAST_LAUNCH: 2 + 4}

    table = load_table("paged_decode", "cpu", jax.__version__, 1, directory=tmp_path)
    assert table["entries"] == {BUCKET: {"pages_per_step": 4, "num_warps": 4, "num_stages": 1}}
    decision = table["provenance"]["decisions"][BUCKET]
    assert decision["kept"] and decision["confirmations"][0]["wins"] == 2
    assert table["provenance"]["dry_run"] is True
    # A kernel would find it for a shape of the same bucket and, nearest, for another.
    dims = {"head_dim": 32, "group_rows": 16, "batch": 2, "context": 40}
    key = bucket_key(dims, paged_decode_target.BUCKETED)
    defaults = {"pages_per_step": 8, "num_warps": 4, "num_stages": 1}
    assert lookup(table, key, defaults)["pages_per_step"] == 4


def _table(device_kind, entries):
    return tune.table_document(
        paged_decode_target,
        entries,
        {},
        device_kind=device_kind,
        jax_version="0.11.2",
        provenance={"command": "test"},
    )


def test_write_table_replaces_only_the_same_device_and_versions(tmp_path):
    launch = {"pages_per_step": 8, "num_warps": 4, "num_stages": 1}
    key = "head_dim=128,group_rows=16,batch=4,context=4096"
    tune.write_table(_table("NVIDIA H200", {key: launch}), tmp_path)
    tune.write_table(_table("NVIDIA H100 80GB HBM3", {key: launch}), tmp_path)
    tune.write_table(_table("NVIDIA H200", {key: {**launch, "pages_per_step": 16}}), tmp_path)
    tables = read_tables(tmp_path / "paged_decode.json")
    assert [t["device_kind"] for t in tables] == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    assert tables[1]["entries"][key]["pages_per_step"] == 16


def test_table_document_refuses_bad_launches():
    with pytest.raises(ValueError, match="num_warps must be a positive integer, got 0"):
        _table("NVIDIA H200", {"head_dim=128,group_rows=16,batch=4,context=4096": {"num_warps": 0}})


def test_parse_buckets():
    assert tune.parse_buckets("batch=1,context=32768; batch=4,context=4096") == [
        {"batch": 1, "context": 32768},
        {"batch": 4, "context": 4096},
    ]
    for text, message in [("batch=0,context=1", "must be >= 1"), ("batch", "bucket key")]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            tune.parse_buckets(text)


def test_command_line_refusals(tmp_path, capsys):
    assert bench_main(["tune", "paged_decode"]) == 0  # no GPU here: says so, writes nothing
    assert tune.NO_GPU_MESSAGE in capsys.readouterr().out
    out = ["--out", str(tmp_path)]
    assert bench_main(["tune", "paged_decode", "--dry-run", "--buckets", "batch=4", *out]) == 2
    assert "name ['batch', 'context'], got ['batch']" in capsys.readouterr().err
    assert (
        bench_main(["tune", "paged_decode", "--dry-run", "--rounds", "1", "--alpha", "0.1", *out])
        == 2
    )
    assert "rounds=1 cannot reach alpha=0.1" in capsys.readouterr().err
    assert bench_main(["tune", "paged_decode", "--dry-run", "--top", "0", *out]) == 2
    assert "top must be >= 1, got 0" in capsys.readouterr().err
    assert bench_main(["tune", "paged_decode", "--dry-run", "--min-gain", "1.5", *out]) == 2
    assert "min_gain must be in [0, 1), got 1.5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_main(["tune", "no_such_kernel"])
    assert not list(tmp_path.iterdir())
    with pytest.raises(SystemExit, match="never writes to"):
        tune._table_directory(TUNED_DIRECTORY, dry_run=True)
