"""Speed regression check: ``python -m bench check <suite> [--against REPORT] [--measured REPORT]``.

Compares a freshly measured report of a suite with the committed one, case by case, and fails
on a slowdown beyond the measured noise. Run it before landing a kernel change.

- ``--measured NEW.json``: compare two report files, offline (no GPU needed).
- without ``--measured``, on a GPU: runs ``python -m bench <suite> --out <temporary directory>``
  first, then compares its report.
- ``--against``: the committed report (default: the newest
  ``docs/benchmark_results/YYYY-MM-DD-<suite>.json``).
- ``--arms``: the arms compared (default: decodelab's own, every arm named ``decodelab...``;
  the peers are not ours to keep fast).

The rule, per (case, arm) present in the committed report:

- ``noise`` = the largest of: the relative spread ``(max - min) / median`` of the committed
  samples and of the new ones; the relative difference between the case's ``"<arm> (repeat)"``
  row and its first timing, in either report (the repeat is the same program timed again in the
  same run, so it sees what the within-run spread does not); and ``--tolerance`` (default 2%),
  a floor for what neither sees: two runs in two processes differ by more than the samples of
  one run do (decode 2026-12-01, B=1 ctx=4096: samples within 0.05%, the repeat 0.8% away).
- slower: the new run's FASTEST sample is slower than the committed run's SLOWEST sample by
  more than ``noise`` (``new_min > old_max * (1 + noise)``): every new sample is beyond every
  committed sample and the gap exceeds the noise. A 10% slowdown of a kernel whose runs agree
  within 2% fails; a difference inside the spread of either run passes.
- faster (the committed figure is stale, not a failure): ``new_max < old_min * (1 - noise)``.
- missing: the case or arm is absent from the new report; the check cannot vouch for it and
  fails.

Exit status: 0 if nothing is slower or missing, 1 if something is (each named on its own line),
2 for bad arguments (unreadable files, reports of another suite or GPU, no GPU to measure on).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from bench.harness.records import REPEAT_SUFFIX, original_arm

REPOSITORY_ROOT = pathlib.Path(__file__).resolve().parents[1]
REPORTS_DIRECTORY = REPOSITORY_ROOT / "docs" / "benchmark_results"
DEFAULT_TOLERANCE = 0.02
DEFAULT_ARM_PREFIX = "decodelab"
_DATED_REPORT = re.compile(r"\d{4}-\d{2}-\d{2}-(?P<name>.+)\.json\Z")


class ReportError(ValueError):
    """A report that cannot be compared (unreadable, another suite, another GPU)."""


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One (case, arm) of the committed report against the new run.

    Attributes:
      verdict: ``"slower"``, ``"faster"``, ``"same"`` (within noise) or ``"missing"``.
      old_us, new_us: ``(min, median, max)`` of each run (``new_us`` None when missing).
      noise: the relative noise the rule allowed.
    """

    case: str
    arm: str
    verdict: str
    old_us: tuple[float, float, float]
    new_us: tuple[float, float, float] | None
    noise: float

    def line(self) -> str:
        old_min, old_median, old_max = self.old_us
        where = f"{self.case} / {self.arm}"
        if self.new_us is None:
            return f"MISSING  {where}: in the committed report, not in the new run"
        new_min, new_median, new_max = self.new_us
        change = new_median / old_median - 1
        label = {"slower": "SLOWER ", "faster": "faster ", "same": "ok     "}[self.verdict]
        return (
            f"{label}  {where}: median {old_median:.2f} -> {new_median:.2f} us ({change:+.1%}); "
            f"committed {old_min:.2f}..{old_max:.2f}, new {new_min:.2f}..{new_max:.2f}, "
            f"noise {self.noise:.1%}"
        )


def load_report(path: str | pathlib.Path) -> dict[str, Any]:
    """A report's JSON object (``docs/benchmarking.md``'s shape).

    Raises:
      ReportError: if the file cannot be read, is not JSON, or lacks ``suite``, ``gpu`` or a
        ``cases`` list whose entries have ``case``, ``arm``, ``median_us``, ``min_us``,
        ``max_us``.
    """
    path = pathlib.Path(path)
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ReportError(f"cannot read report {path}: {error}") from None
    if not isinstance(report, dict) or not isinstance(report.get("cases"), list):
        raise ReportError(f"{path} is not a benchmark report (no 'cases' list)")
    for field in ("suite", "gpu"):
        if field not in report:
            raise ReportError(f"{path} is not a benchmark report (no {field!r})")
    for position, case in enumerate(report["cases"]):
        missing = [
            key for key in ("case", "arm", "median_us", "min_us", "max_us") if key not in case
        ]
        if missing:
            raise ReportError(f"{path}: case {position} lacks {missing}")
    return report


def _rows(report: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(row["case"], row["arm"]): row for row in report["cases"]}


def _range(row: dict[str, Any]) -> tuple[float, float, float]:
    samples = row.get("samples_us") or [row["min_us"], row["max_us"]]
    return min(samples), float(row["median_us"]), max(samples)


def _spread(row: dict[str, Any]) -> float:
    low, median, high = _range(row)
    return (high - low) / median


def _repeat_difference(rows: dict[tuple[str, str], dict[str, Any]], case: str) -> float:
    """The largest relative difference between an arm and its repeat in ``case`` (0 if none)."""
    differences = [0.0]
    for (row_case, arm), row in rows.items():
        if row_case == case and arm.endswith(REPEAT_SUFFIX):
            first = rows.get((case, original_arm(arm)))
            if first is not None:
                differences.append(abs(row["median_us"] / first["median_us"] - 1))
    return max(differences)


def compare_reports(
    committed: dict[str, Any],
    measured: dict[str, Any],
    *,
    arms: Sequence[str] | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> list[Comparison]:
    """Every (case, arm) of ``committed`` whose arm is compared, judged by the module's rule.

    Args:
      committed, measured: report objects (``load_report``).
      arms: arm names to compare; None: those starting with ``decodelab``. Repeat rows
        (``"<arm> (repeat)"``) are never compared themselves: they set the noise.
      tolerance: the noise floor, in [0, 1).

    Raises:
      ReportError: if the reports are of different suites or GPUs (figures of another machine
        say nothing about a regression).
      ValueError: for a tolerance outside [0, 1).
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
    if committed["suite"] != measured["suite"]:
        raise ReportError(
            f"reports of different suites: committed {committed['suite']!r}, "
            f"measured {measured['suite']!r}"
        )
    if committed["gpu"] != measured["gpu"]:
        raise ReportError(
            f"reports of different GPUs: committed {committed['gpu']!r}, "
            f"measured {measured['gpu']!r}; compare runs of one GPU model"
        )
    old_rows, new_rows = _rows(committed), _rows(measured)
    comparisons = []
    for (case, arm), old in old_rows.items():
        if arm.endswith(REPEAT_SUFFIX):
            continue
        if arms is None and not arm.startswith(DEFAULT_ARM_PREFIX):
            continue
        if arms is not None and arm not in arms:
            continue
        new = new_rows.get((case, arm))
        old_range = _range(old)
        if new is None:
            comparisons.append(Comparison(case, arm, "missing", old_range, None, tolerance))
            continue
        new_range = _range(new)
        noise = max(
            tolerance,
            _spread(old),
            _spread(new),
            _repeat_difference(old_rows, case),
            _repeat_difference(new_rows, case),
        )
        if new_range[0] > old_range[2] * (1 + noise):
            verdict = "slower"
        elif new_range[2] < old_range[0] * (1 - noise):
            verdict = "faster"
        else:
            verdict = "same"
        comparisons.append(Comparison(case, arm, verdict, old_range, new_range, noise))
    return comparisons


def newest_committed_report(suite: str, directory: pathlib.Path = REPORTS_DIRECTORY):
    """The newest ``YYYY-MM-DD-<suite>.json`` in ``directory`` (not partial reports).

    Raises:
      ReportError: if there is none.
    """
    reports = sorted(
        path
        for path in directory.glob(f"*-{suite}.json")
        if (match := _DATED_REPORT.match(path.name)) and match["name"] == suite
    )
    if not reports:
        raise ReportError(f"no committed report of suite {suite!r} in {directory}")
    return reports[-1]


def print_comparisons(comparisons: Sequence[Comparison], measured: dict[str, Any]) -> int:
    """Prints one line per comparison, failures first, and a summary; returns the exit status
    (1 if anything is slower or missing, else 0)."""
    order = {"slower": 0, "missing": 1, "faster": 2, "same": 3}
    for comparison in sorted(comparisons, key=lambda c: order[c.verdict]):
        print(comparison.line())
    compared = {(c.case, c.arm) for c in comparisons}
    new_only = sorted(
        (case, arm)
        for case, arm in _rows(measured)
        if (case, arm) not in compared and not arm.endswith(REPEAT_SUFFIX)
    )
    counts = {verdict: sum(c.verdict == verdict for c in comparisons) for verdict in order}
    print(
        f"{len(comparisons)} compared: {counts['slower']} slower beyond noise, "
        f"{counts['missing']} missing, {counts['faster']} faster beyond noise (committed figure "
        f"stale), {counts['same']} within noise; {len(new_only)} row(s) of the new run not compared"
    )
    if not comparisons:
        print("nothing compared: no arm of the committed report matched --arms")
        return 1
    return 1 if counts["slower"] or counts["missing"] else 0


def parse_arguments(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench check",
        description="fail on a slowdown beyond noise against a suite's committed report "
        "(the rule: bench/check.py, docs/tuning.md)",
    )
    parser.add_argument("suite", help="the suite whose report is compared (decode, sampling, ...)")
    parser.add_argument("--against", type=pathlib.Path, default=None, help="committed report")
    parser.add_argument(
        "--measured",
        type=pathlib.Path,
        default=None,
        help="a new report of the same suite (default: run the suite now, on a GPU)",
    )
    parser.add_argument(
        "--arms", default=None, help="comma-separated arms to compare (default: decodelab*)"
    )
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, help="noise floor")
    return parser.parse_args(list(argv))


def _measure_now(suite: str) -> pathlib.Path | None:
    """Runs the suite on the GPU into a temporary directory; its JSON report, or None (no GPU,
    or the run wrote nothing)."""
    import jax

    from bench.__main__ import NO_GPU_MESSAGE
    from bench.__main__ import main as run_suite

    if jax.default_backend() != "gpu":
        print(f"{NO_GPU_MESSAGE}; pass --measured NEW.json to compare a report", file=sys.stderr)
        return None
    out_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"bench-check-{suite}-"))
    if run_suite([suite, "--out", str(out_dir)]) != 0:
        return None
    reports = sorted(out_dir.glob(f"*-{suite}.json"))
    return reports[-1] if reports else None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench check``; returns the exit status (module docstring)."""
    arguments = parse_arguments(sys.argv[1:] if argv is None else argv)
    arms = None if arguments.arms is None else [a for a in arguments.arms.split(",") if a]
    try:
        against = arguments.against or newest_committed_report(arguments.suite)
        committed = load_report(against)
        if committed["suite"] != arguments.suite:
            raise ReportError(f"{against} is a report of suite {committed['suite']!r}")
        measured_path = arguments.measured or _measure_now(arguments.suite)
        if measured_path is None:
            return 2
        measured = load_report(measured_path)
        comparisons = compare_reports(committed, measured, arms=arms, tolerance=arguments.tolerance)
    except (ReportError, ValueError) as error:
        print(f"check refused: {error}", file=sys.stderr)
        return 2
    print(f"check {arguments.suite}: {measured_path} against {against}")
    if arms:
        repeats = [arm for arm in arms if arm.endswith(REPEAT_SUFFIX)]
        if repeats:
            print(f"note: repeat rows {repeats} are never compared; they set the noise")
    return print_comparisons(comparisons, measured)


if __name__ == "__main__":
    sys.exit(main())
