"""``bench.harness.merge_reports``: a suite run in parts becomes one report, rows unchanged."""

from __future__ import annotations

import json

import pytest

from bench.harness import merge_reports


def _part(cases, *, ceiling=4.2, commit="abc1234", notes=("shared note",)):
    return {
        "suite": "serving",
        "date": "2026-12-01",
        "gpu": "NVIDIA H200",
        "driver": "580",
        "jax_version": "0.11.2",
        "commit": commit,
        "command": f"python -m bench serving # {cases}",
        "ceiling_tbps": ceiling,
        "timing_method": "host clock",
        "cases": [
            {
                "case": case,
                "arm": arm,
                "attribution": f"{arm}-{case}",
                "median_us": 10.0,
                "min_us": 9.0,
                "max_us": 11.0,
                "bytes": 1000,
                "achieved_tbps": 1e-4,
                "fraction_of_ceiling": 1e-4 / ceiling,
                "tokens_per_s": 123.0,
            }
            for case in cases
            for arm in ("reference", "decodelab")
        ],
        "ceiling_detail": {},
        "notes": [*notes, f"note of {cases}"],
    }


def test_merge_keeps_every_row_as_measured(tmp_path):
    first, second = _part(["single B=1"], ceiling=4.1), _part(["batch B=4"], ceiling=4.3)
    paths = []
    for index, part in enumerate((first, second)):
        paths.append(tmp_path / f"part{index}.json")
        paths[-1].write_text(json.dumps(part))
    assert merge_reports.main([str(tmp_path / "out"), *map(str, paths)]) == 0
    merged = json.loads((tmp_path / "out" / "2026-12-01-serving.json").read_text())
    assert merged["cases"] == first["cases"] + second["cases"]
    assert merged["ceiling_tbps"] == 4.3
    assert merged["ceiling_detail"]["part_1_tbps"] == 4.1
    assert merged["ceiling_detail"]["part_2_tbps"] == 4.3
    assert merged["notes"].count("shared note") == 1
    assert "note of ['batch B=4']" in merged["notes"]
    markdown = (tmp_path / "out" / "2026-12-01-serving.md").read_text()
    assert "### single B=1" in markdown and "### batch B=4" in markdown


def test_merge_refuses_mismatched_or_repeated_parts():
    other_gpu = _part(["b B=1"]) | {"gpu": "NVIDIA H100"}
    with pytest.raises(ValueError, match="gpu"):
        merge_reports.merge([_part(["a B=1"]), other_gpu])
    with pytest.raises(ValueError, match="appears in two parts"):
        merge_reports.merge([_part(["a B=1"]), _part(["a B=1"])])
    one_arm = _part(["a B=1"])
    one_arm["cases"] = one_arm["cases"][:1]
    other_arm = _part(["a B=1"])
    other_arm["cases"] = other_arm["cases"][1:]
    with pytest.raises(ValueError, match="appears in two parts"):  # arms from two processes
        merge_reports.merge([one_arm, other_arm])
    with pytest.raises(ValueError, match="at least one"):
        merge_reports.merge([])


def test_parts_of_different_commits_say_which_measured_what():
    merged, _ = merge_reports.merge([_part(["a B=1"]), _part(["b B=1"], commit="def5678")])
    assert merged["commit"] == "abc1234, def5678"
    assert "commit abc1234 measured: a B=1" in merged["notes"]
    assert "commit def5678 measured: b B=1" in merged["notes"]


def test_notes_added_when_merging_are_marked(tmp_path):
    path = tmp_path / "part.json"
    path.write_text(json.dumps(_part(["a B=1"])))
    merge_reports.main([str(tmp_path / "out"), str(path), "--note", "found later"])
    merged = json.loads((tmp_path / "out" / "2026-12-01-serving.json").read_text())
    assert merged["notes"][-1] == "(added when merging) found later"


def test_parts_of_different_days_take_the_latest_date_and_say_which_measured_what():
    later = _part(["b B=1"]) | {"date": "2026-12-03"}
    merged, _ = merge_reports.merge([_part(["a B=1"]), later])
    assert merged["date"] == "2026-12-03"
    assert "measured on 2026-12-01: a B=1" in merged["notes"]
    assert "measured on 2026-12-03: b B=1" in merged["notes"]
    same_day, _ = merge_reports.merge([_part(["a B=1"]), _part(["b B=1"])])
    assert same_day["date"] == "2026-12-01"
    assert not any(note.startswith("measured on") for note in same_day["notes"])


def test_notes_a_later_part_made_untrue_are_replaced():
    """A part that says a target's arm was not measured, merged with the part that measured it,
    says instead that it was measured elsewhere (its verdict not recomputed); a 'not measured'
    about an arm still missing stays; a part's own 'merged from N processes' gives way to the
    merged report's count."""
    first = _part(
        ["single B=1"],
        notes=(
            "target batch B=4: `decodelab` not measured",
            "target long B=8: `decodelab` not measured",
            "merged from 6 processes (bench/harness/merge_reports.py); each row's share ...",
        ),
    )
    merged, _ = merge_reports.merge([first, _part(["batch B=4"], commit="def5678")])
    assert "target batch B=4: `decodelab` not measured" not in merged["notes"]
    assert any(
        n.startswith("target batch B=4: `decodelab` measured in another part")
        for n in merged["notes"]
    )
    assert "target long B=8: `decodelab` not measured" in merged["notes"]
    assert [n for n in merged["notes"] if n.startswith("merged from")] == [
        merged["notes"][0]
    ] and merged["notes"][0].startswith("merged from 7 processes")  # 6 + 1


def test_a_merged_part_keeps_each_cases_commit_and_day():
    """Merging a merged report (a at commit c1 on 11-30, b at c2 on 12-01) with a new part (c at
    c3 on 12-02) credits each case to its own commit and day, not the merged part's latest."""
    a = dict(_part(["a B=1"], commit="c1"), date="2026-11-30")
    b = dict(_part(["b B=1"], commit="c2"), date="2026-12-01")
    inner, _ = merge_reports.merge([a, b])
    c = dict(_part(["c B=1"], commit="c3"), date="2026-12-02")
    merged, _ = merge_reports.merge([inner, c])
    notes = merged["notes"]
    assert "commit c1 measured: a B=1" in notes
    assert "commit c2 measured: b B=1" in notes
    assert "commit c3 measured: c B=1" in notes
    assert "measured on 2026-11-30: a B=1" in notes
    assert "measured on 2026-12-01: b B=1" in notes
    assert "measured on 2026-12-02: c B=1" in notes
    assert not any(n.startswith("commit c1, c2") for n in notes)
    assert merged["commit"] == "c1, c2, c3" and merged["date"] == "2026-12-02"
    assert merged["notes"][0].startswith("merged from 3 processes")
