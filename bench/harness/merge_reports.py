"""Merge the reports of one suite run in parts (separate processes) into one report.

Why: a suite writes its report only when its process ends, and one GPU command may run at most
600 s, so a long suite is run as several processes, each on a subset of its cases
(``DECODELAB_SERVING_SCENARIOS``, ``--batches``). This puts their rows back into one report.

What it keeps honest: every row stays exactly as measured (its ``fraction_of_ceiling`` against
the copy ceiling of its own process); parts must be the same suite on the same GPU, driver and
jax version, and a case's arms must all come from one part (they are compared with each other).
Parts may come from different commits (a part re-run after an unrelated change): the merged
``commit`` lists each, and a note says which cases each commit measured. Parts may come from
different days (a case finished in a later GPU session, or an earlier merged report given as a
part): the merged ``date`` is the latest, and a note says which cases each day measured. The
merged report's ceiling is the highest of the parts' (its ``ceiling_detail`` lists each part's),
its command lists each part's,
and notes are kept in order without repeats. A part that is itself a merged report is taken
apart by its notes: its processes are counted, its cases keep the commit and day its notes give
them, and its own "merged from", "commit ... measured" and "measured on" notes give way to the
merged report's; a "target CASE: `ARM` not measured" that another part measured says so (its
verdict is not recomputed: ``--note`` adds it).

Usage:
  python -m bench.harness.merge_reports OUT_DIR part1.json part2.json ... [--note TEXT ...]

``--note`` adds a sentence that no part's run wrote (an explanation found later), marked as
added when merging.

writes ``OUT_DIR/<date>-<suite>.md`` and ``.json`` (the latest date of the parts).
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
from typing import Any

from bench.harness.records import CASE_FIELDS, CaseResult
from bench.harness.report import check_distinguishable, render_markdown

SAME_IN_EVERY_PART = ("suite", "gpu", "driver", "jax_version", "timing_method")


def case_result(case: dict[str, Any]) -> CaseResult:
    """The ``CaseResult`` of one case's JSON object (the inverse of ``CaseResult.to_json``)."""
    fixed = {name: case[name] for name in CASE_FIELDS}
    extra = {key: value for key, value in case.items() if key not in CASE_FIELDS}
    return CaseResult(**fixed, extra=extra)


_MERGED_FROM = re.compile(r"^merged from (\d+) processes \(bench/harness/merge_reports\.py\)")
_NOT_MEASURED = re.compile(r"^target (?P<case>.+): `(?P<arm>[^`]+)` not measured$")
_COMMIT_MEASURED = re.compile(r"^commit (?P<value>\S+) measured: (?P<cases>.+)$")
_DATE_MEASURED = re.compile(r"^measured on (?P<value>\S+): (?P<cases>.+)$")
_ATTRIBUTION = {"commit": _COMMIT_MEASURED, "date": _DATE_MEASURED}


def _value_of_each_case(part: dict[str, Any], field: str) -> dict[str, str]:
    """Case -> the commit (or date) that measured it: the part's own ``field``, or, for a part
    that is itself a merged report (its ``commit`` a list), what its own notes say."""
    values = {case["case"]: part[field] for case in part["cases"]}
    for note in part["notes"]:
        if match := _ATTRIBUTION[field].match(note):
            for case in match["cases"].split(", "):
                if case in values:
                    values[case] = match["value"]
    return values


def _who_measured_what(parts: list[dict[str, Any]], field: str, template: str) -> list[str]:
    """One note a value of ``field`` (a commit, a date), naming the cases it measured, when the
    cases do not all share one value; none when they do."""
    cases_of: dict[str, list[str]] = {}
    for part in parts:
        for case, value in _value_of_each_case(part, field).items():
            cases_of.setdefault(value, []).append(case)
    if len(cases_of) < 2:
        return []
    ordered = sorted(cases_of) if field == "date" else list(cases_of)
    return [template.format(value, ", ".join(cases_of[value])) for value in ordered]


def _processes_of(part: dict[str, Any]) -> int:
    """The processes one part's rows come from: its own merged count, else 1."""
    for note in part["notes"]:
        if match := _MERGED_FROM.match(note):
            return int(match[1])
    return 1


def _carried_note(note: str, measured: set[tuple[str, str]]) -> str | None:
    """A part's note as the merged report keeps it, or None when the merge says it again: a
    part's own "merged from N processes" and "commit/measured on ... measured: cases" (the
    merged report recounts both). A "target CASE: `ARM` not measured" that another part measured
    says so instead, since its verdict is not recomputed here."""
    if _MERGED_FROM.match(note) or _COMMIT_MEASURED.match(note) or _DATE_MEASURED.match(note):
        return None
    match = _NOT_MEASURED.match(note)
    if match is not None and (match["case"], match["arm"]) in measured:
        return (
            f"target {match['case']}: `{match['arm']}` measured in another part; the target's "
            "verdict is not recomputed when merging (a note added when merging gives it)"
        )
    return note


def merge(
    parts: list[dict[str, Any]], added_notes: list[str] = ()
) -> tuple[dict[str, Any], list[CaseResult]]:
    """The merged report object and its rows.

    Raises:
      ValueError: no part, parts that differ in a field of ``SAME_IN_EVERY_PART``, or a case
        present in two parts.
    """
    if not parts:
        raise ValueError("merge needs at least one report")
    for field in SAME_IN_EVERY_PART:
        values = {part[field] for part in parts}
        if len(values) > 1:
            raise ValueError(f"the parts differ in {field}: {sorted(values)}")
    # A case's arms are compared with each other (ratios, shares): they must come from one
    # process, so a case may appear in one part only.
    part_of_case: dict[str, int] = {}
    results: list[CaseResult] = []
    for index, part in enumerate(parts):
        for case in part["cases"]:
            owner = part_of_case.setdefault(case["case"], index)
            if owner != index:
                raise ValueError(f"case {case['case']!r} appears in two parts ({owner}, {index})")
            results.append(case_result(case))
    check_distinguishable(results)
    notes: list[str] = []
    measured = {(result.case, result.arm) for result in results}
    for part in parts:
        for note in part["notes"]:
            carried = _carried_note(note, measured)
            if carried is not None and carried not in notes:
                notes.append(carried)
    ceilings = [part["ceiling_tbps"] for part in parts]
    # A part that is itself a merged report counts the processes it was merged from.
    processes = sum(_processes_of(part) for part in parts)
    # Each case's commit and date (a merged part's own notes say which of its cases had which).
    commits = list(
        dict.fromkeys(v for part in parts for v in _value_of_each_case(part, "commit").values())
    )
    dates = sorted(
        dict.fromkeys(v for part in parts for v in _value_of_each_case(part, "date").values())
    )
    notes += _who_measured_what(parts, "commit", "commit {} measured: {}")
    notes += _who_measured_what(parts, "date", "measured on {}: {}")
    merged = {field: parts[0][field] for field in SAME_IN_EVERY_PART}
    merged |= {
        "date": dates[-1],
        "commit": ", ".join(commits),
        "command": " ; ".join(part["command"] for part in parts),
        "ceiling_tbps": max(ceilings),
        "cases": [result.to_json() for result in results],
        "ceiling_detail": {
            **{f"part_{index}_tbps": ceiling for index, ceiling in enumerate(ceilings, start=1)},
            **{
                f"part_{index}_methods": part.get("ceiling_detail", {})
                for index, part in enumerate(parts, start=1)
            },
        },
        "notes": [
            f"merged from {processes} processes (bench/harness/merge_reports.py); each row's share of "
            "the ceiling is against its own process's copy ceiling (ceiling_detail lists them)",
            *notes,
            *(f"(added when merging) {note}" for note in added_notes),
        ],
    }
    return merged, results


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[-3], file=sys.stderr)
        return 2
    out_dir, rest = pathlib.Path(argv[0]), argv[1:]
    paths, added_notes = [], []
    while rest:
        if rest[0] == "--note" and len(rest) > 1:
            added_notes.append(rest[1])
            rest = rest[2:]
        else:
            paths.append(rest[0])
            rest = rest[1:]
    parts = [json.loads(pathlib.Path(path).read_text()) for path in paths]
    merged, results = merge(parts, added_notes)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{merged['date']}-{merged['suite']}"
    stem.with_suffix(".json").write_text(json.dumps(merged, indent=2) + "\n")
    stem.with_suffix(".md").write_text(render_markdown(merged, results))
    print(f"wrote {stem}.md\n      {stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
