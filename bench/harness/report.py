"""Benchmark reports: the environment, the attribution guard, and the Markdown and JSON files.

A report is ``<out_dir>/YYYY-MM-DD-<suite>.md`` with a ``.json`` beside it holding the raw
figures, in the one shape ``docs/benchmarking.md`` fixes for every suite: top level ``suite``,
``date``, ``gpu``, ``driver``, ``jax_version``, ``commit``, ``command``, ``ceiling_tbps``,
``timing_method``, ``cases`` (plus ``ceiling_detail`` and ``notes``), each case the flat object
of ``CaseResult.to_json``.

Before anything is written, ``check_distinguishable`` makes sure no two arms of a case carry
the same attribution: a comparison of a path with itself is not printed.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import pathlib
import subprocess
from collections.abc import Iterable, Sequence
from typing import Any

import jax

from bench.harness import CaseResult, original_arm

REPOSITORY_ROOT = pathlib.Path(__file__).resolve().parents[2]
DRY_RUN_NOTE = "figures from a dry run on a CPU are not speed figures"
RATIO_EXPLANATION = (
    "`vs <peer>` = peer time / this arm's time: above 1 means this arm is faster than that peer."
)


class IndistinguishableArmsError(ValueError):
    """Two arms of one case could be the same code path; the report is refused."""


def check_distinguishable(results: Iterable[CaseResult]) -> None:
    """Raises unless every arm of every case has its own attribution.

    Each arm records something only it can produce (the kernel it ran, its ``k_splits``); two
    arms of a case with the same attribution may be one path timed twice under two names.
    The exception is an arm timed again in the same run, ``"<arm> (repeat)"``, which measures
    the noise and may share the attribution of ``<arm>`` (and of nothing else).

    Raises:
      IndistinguishableArmsError: for two arms of a case with one attribution, or one arm
        listed twice in a case.

    Example:
      >>> from bench.harness import Timing
      >>> timing = Timing.from_samples([1.0], 1, 2, "jax_loop")
      >>> rows = [CaseResult.from_timing("B=1 ctx=16", arm, "same", timing, 8, 1.0)
      ...         for arm in ("xla_gather", "xla_gather (repeat)")]
      >>> check_distinguishable(rows)  # a repeat may share its arm's attribution
      >>> rows.append(CaseResult.from_timing("B=1 ctx=16", "other", "same", timing, 8, 1.0))
      >>> check_distinguishable(rows)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      bench.harness.report.IndistinguishableArmsError: case 'B=1 ctx=16': arms 'xla_gather' and 'other' ...
    """
    by_case: dict[str, list[CaseResult]] = collections.defaultdict(list)
    for result in results:
        by_case[result.case].append(result)
    for case, rows in by_case.items():
        arms = [row.arm for row in rows]
        duplicated = sorted({arm for arm in arms if arms.count(arm) > 1})
        if duplicated:
            raise IndistinguishableArmsError(f"case {case!r}: arm(s) {duplicated} listed twice")
        for index, first in enumerate(rows):
            for second in rows[index + 1 :]:
                if first.attribution != second.attribution:
                    continue
                if original_arm(first.arm) == original_arm(second.arm):
                    continue  # an arm and its repeat
                raise IndistinguishableArmsError(
                    f"case {case!r}: arms {first.arm!r} and {second.arm!r} have the same "
                    f"attribution {first.attribution!r}"
                )


# ----------------------------------------------------------------------------------------------
# Environment


def _command_output(command: Sequence[str]) -> str | None:
    """stdout of ``command`` run in the repository, or None if it fails or does not exist."""
    try:
        completed = subprocess.run(
            command, cwd=REPOSITORY_ROOT, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return completed.stdout if completed.returncode == 0 else None


def gpu_driver_version() -> str:
    """The NVIDIA driver version from ``nvidia-smi``, or ``"unknown"``."""
    output = _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    lines = (output or "").strip().splitlines()
    return lines[0].strip() if lines else "unknown"


def git_commit() -> str:
    """The commit a report measured: ``DECODELAB_COMMIT`` when whoever sent the tree to a GPU
    host set it (that copy may carry a stale ``.git``, or none), else the short commit of this
    checkout, ``-dirty`` if tracked files changed, else ``"unknown"``. Untracked files (new
    reports) do not count as changes."""
    sent = os.environ.get("DECODELAB_COMMIT", "").strip()
    if sent:
        return sent
    commit = _command_output(["git", "rev-parse", "--short", "HEAD"])
    if commit is None:
        return "unknown"
    changes = _command_output(["git", "status", "--porcelain", "--untracked-files=no"])
    return commit.strip() + ("-dirty" if changes else "")


def environment(device: jax.Device | None = None) -> dict[str, str]:
    """What a report says about where it ran.

    Args:
      device: the device the figures came from (default ``jax.devices()[0]``).

    Returns:
      ``{"gpu", "driver", "jax_version", "commit", "date"}``; ``gpu`` is the device kind
      (``"cpu"`` in a dry run), ``date`` is ISO ``YYYY-MM-DD``.
    """
    device = device if device is not None else jax.devices()[0]
    return {
        "gpu": device.device_kind,
        "driver": gpu_driver_version(),
        "jax_version": jax.__version__,
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
    }


# ----------------------------------------------------------------------------------------------
# Markdown


def case_group(case: str) -> str:
    """The table a case belongs to: its leading method (``"top_p B=32"`` -> ``"top_p"``), or
    ``"attention"`` for cases that start with the batch (``"B=4 ctx=4096"``)."""
    return case.split("B=")[0].strip() or "attention"


def _format_number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def _format_extra_value(value: Any) -> str:
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        return "; ".join(
            ", ".join(f"{key}={_format_number(item[key])}" for key in item) for item in value
        )
    if isinstance(value, list):
        return ", ".join(_format_number(item) for item in value)
    return _format_number(value)


# Bookkeeping every row of a case carries alike; in the JSON, not repeated in the Markdown.
_QUIET_EXTRA = (
    "samples_us",
    "iters",
    "num_sets",
    "bytes_between_visits",
    "timing",
    "vocab",
    "top_p",
    "torch_version",
)


def _ratio_arms(rows: list[CaseResult], peers_for_ratio: Sequence[str] | None) -> list[str]:
    arms = [row.arm for row in rows if original_arm(row.arm) == row.arm]
    if peers_for_ratio is None:
        return arms
    return [arm for arm in peers_for_ratio if arm in arms]


def _case_table(rows: list[CaseResult], peers_for_ratio: Sequence[str] | None) -> list[str]:
    medians = {row.arm: row.median_us for row in rows}
    peers = _ratio_arms(rows, peers_for_ratio)
    header = ["arm", "attribution", "median us", "min us", "max us", "MB", "TB/s", "of ceiling"]
    header += [f"vs {peer}" for peer in peers]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [
            f"`{row.arm}`",
            f"`{row.attribution}`",
            f"{row.median_us:.2f}",
            f"{row.min_us:.2f}",
            f"{row.max_us:.2f}",
            f"{row.bytes / 1e6:.2f}",
            f"{row.achieved_tbps:.3f}",
            f"{row.fraction_of_ceiling:.1%}",
        ]
        cells += [f"{medians[peer] / row.median_us:.2f}x" for peer in peers]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for row in rows:
        shown = {key: value for key, value in row.extra.items() if key not in _QUIET_EXTRA}
        if shown:
            details = "; ".join(f"{key}: {_format_extra_value(v)}" for key, v in shown.items())
            lines.append(f"- `{row.arm}`: {details}")
    for row in rows:
        if original_arm(row.arm) != row.arm and original_arm(row.arm) in medians:
            first = medians[original_arm(row.arm)]
            spread = (row.max_us - row.min_us) / row.median_us
            lines.append(
                f"- noise: `{original_arm(row.arm)}` timed twice, medians differ by "
                f"{abs(row.median_us - first) / first:.1%}; spread of the repeat's samples "
                f"{spread:.1%}. Differences smaller than this are noise."
            )
    lines.append("")
    return lines


def _summary_table(rows: list[CaseResult]) -> list[str]:
    """One line a case, one column an arm: median us and TB/s."""
    arms = list(dict.fromkeys(row.arm for row in rows))
    cases = list(dict.fromkeys(row.case for row in rows))
    cell = {(row.case, row.arm): row for row in rows}
    lines = ["| case | " + " | ".join(f"`{arm}`" for arm in arms) + " |"]
    lines.append("|---|" + "---|" * len(arms))
    for case in cases:
        cells = []
        for arm in arms:
            row = cell.get((case, arm))
            cells.append(
                "" if row is None else f"{row.median_us:.1f} us, {row.achieved_tbps:.2f} TB/s"
            )
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def render_markdown(report: dict[str, Any], results: list[CaseResult], **options) -> str:
    """The Markdown of a report whose JSON object is ``report``; see ``write_report``."""
    peers_for_ratio = options.get("peers_for_ratio")
    dry_run = options.get("dry_run", False)
    title = f"# Benchmark `{report['suite']}`, {report['date']}"
    lines = [title + (" (DRY RUN)" if dry_run else ""), ""]
    if dry_run:
        lines += [f"**Dry run: {DRY_RUN_NOTE}.**", ""]
    detail = report.get("ceiling_detail", {})
    methods = ", ".join(
        f"{key.removesuffix('_tbps')} {value:.3f}"
        for key, value in detail.items()
        if key.endswith("_tbps")
    )
    lines += [
        "| | |",
        "|---|---|",
        f"| GPU | {report['gpu']} |",
        f"| driver | {report['driver']} |",
        f"| jax | {report['jax_version']} |",
        f"| commit | {report['commit']} |",
        f"| command | `{report['command']}` |",
        f"| timing | {report['timing_method']} |",
        f"| copy ceiling | **{report['ceiling_tbps']:.3f} TB/s** (max of: {methods}) |",
        "",
        "Bytes are those the call must move (attention: K and V of the real tokens; sampling: "
        "the float32 logits); TB/s = bytes / median time; of ceiling = TB/s / copy ceiling. "
        + RATIO_EXPLANATION,
        "",
    ]
    if report.get("notes"):
        lines += ["Notes:", ""] + [f"- {note}" for note in report["notes"]] + [""]
    groups: dict[str, list[CaseResult]] = collections.defaultdict(list)
    for result in results:
        groups[case_group(result.case)].append(result)
    for group, rows in groups.items():
        lines += [f"## {group}", "", *_summary_table(rows)]
        by_case: dict[str, list[CaseResult]] = collections.defaultdict(list)
        for row in rows:
            by_case[row.case].append(row)
        for case, case_rows in by_case.items():
            lines += [f"### {case}", "", *_case_table(case_rows, peers_for_ratio)]
    return "\n".join(lines).rstrip() + "\n"


# ----------------------------------------------------------------------------------------------
# Writing


def write_report(
    suite: str,
    results: list[CaseResult],
    *,
    ceiling_tbps: float,
    command: str,
    timing_method: str,
    out_dir: str | pathlib.Path = "docs/benchmark_results",
    notes: Sequence[str] = (),
    peers_for_ratio: Sequence[str] | None = None,
    ceiling_detail: dict[str, Any] | None = None,
    dry_run: bool = False,
    device: jax.Device | None = None,
    name: str | None = None,
) -> tuple[pathlib.Path, pathlib.Path]:
    """Writes ``<out_dir>/YYYY-MM-DD-<name>.md`` and ``.json`` (overwriting a same-day report).

    Args:
      suite: the suite's name.
      results: every row; arms of a case must be distinguishable.
      ceiling_tbps: the copy ceiling measured in this run.
      command: the exact command line.
      timing_method: how the figures were timed (``harness.timing_method_description``).
      out_dir: the directory (created if missing).
      notes: sentences for the report.
      peers_for_ratio: arms every row is compared with (None: every arm of the case).
      ceiling_detail: each copy method's figure (``CopyCeiling.detail()``).
      dry_run: marks the report as a dry run, whose figures are not speed figures.
      device: the device the figures came from (for ``environment``).
      name: the files' name after the date (default: the suite's), e.g. ``sampling-partial``
        for the partial report a long run keeps current (``RunOptions.save_partial``); the
        JSON's ``suite`` stays ``suite``, so ``merge_reports`` accepts it.

    Returns:
      The paths of the Markdown and the JSON file.

    Raises:
      IndistinguishableArmsError: if two arms of a case have the same attribution; nothing is
        written then.
    """
    check_distinguishable(results)
    about = environment(device)
    notes = ([DRY_RUN_NOTE] if dry_run else []) + list(notes)
    report = {
        "suite": suite,
        "date": about["date"],
        "gpu": about["gpu"],
        "driver": about["driver"],
        "jax_version": about["jax_version"],
        "commit": about["commit"],
        "command": command,
        "ceiling_tbps": ceiling_tbps,
        "timing_method": timing_method,
        "cases": [result.to_json() for result in results],
        "ceiling_detail": ceiling_detail or {},
        "notes": notes,
    }
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{about['date']}-{name or suite}"
    json_path = out_dir / f"{stem}.json"
    markdown_path = out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    markdown_path.write_text(
        render_markdown(report, results, peers_for_ratio=peers_for_ratio, dry_run=dry_run)
    )
    return markdown_path, json_path


RESULT_COLUMNS = ("case", "arm", "median", "TB/s", "of ceiling", "attribution")


def _result_line(case: str, arm: str, median: str, tbps: str, fraction: str, attribution: str):
    return f"{case:<24} {arm:<30} {median:>13} {tbps:>10} {fraction:>10}  {attribution}"


def print_progress(message: str) -> None:
    """Prints what a suite is doing now (which case it sets up or times), so that the minutes
    of compiling and timing before a case's rows are not silent."""
    print(f"... {message}", flush=True)


def print_results(results: Sequence[CaseResult]) -> None:
    """Prints a case's rows under a header line, once the rows of the case are complete: rows
    whose arms cannot be told apart are not printed (``check_distinguishable`` raises).

    Example:
      >>> from bench.harness import Timing
      >>> timing = Timing.from_samples([2.0], 1, 2, "jax_loop")
      >>> print_results([CaseResult.from_timing("B=1 ctx=16", "xla_gather", "xla", timing,
      ...                                       4_000_000, 4.0)])  # doctest: +NORMALIZE_WHITESPACE
      case                     arm                                   median       TB/s of ceiling  attribution
      B=1 ctx=16               xla_gather                           2.00 us      2.000      50.0%  xla
    """
    check_distinguishable(results)
    print(_result_line(*RESULT_COLUMNS), flush=True)
    for result in results:
        print(
            _result_line(
                result.case,
                result.arm,
                f"{result.median_us:.2f} us",
                f"{result.achieved_tbps:.3f}",
                f"{result.fraction_of_ceiling:.1%}",
                result.attribution,
            ),
            flush=True,
        )
