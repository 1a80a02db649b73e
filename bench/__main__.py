"""Command line: ``python -m bench <suite> [--quick] [--tune] [--dry-run] [--out DIR]``, and two
subcommands with their own options: ``python -m bench tune <kernel> ...`` (the autotuner,
``bench/tuning/tune.py``) and ``python -m bench check <suite> ...`` (the speed regression check,
``bench/check.py``).

- ``python -m bench peers`` on a GPU: measures the copy ceiling, runs the suite on the
  standard grid, prints which case it is setting up and, once a case is done, its rows under a
  header, and writes ``docs/benchmark_results/YYYY-MM-DD-<suite>.md`` and ``.json``.
- ``--quick``: a subset of the grid, for a fast look.
- ``--tune``: suites with tunable kernels (``decode``, ``prefill``) also sweep their launch
  parameters.
- ``--dry-run``: every code path on the CPU with tiny shapes and a few calls (Pallas kernels
  interpreted, PyTorch arms eager on the CPU when torch is installed); the report goes to
  ``--out`` or a fresh temporary directory, never to ``docs/benchmark_results``, and says that
  its figures are not speed figures.
- A suite that calls ``RunOptions.save_partial`` (``sampling``) keeps
  ``<date>-<suite>-partial.md`` and ``.json`` current while it runs, so that a run cut short
  (one device command may last 600 s) still leaves the rows it measured; the whole report
  replaces them when the run ends.
- Without a GPU and without ``--dry-run``: says so, prints no figure, writes nothing, exits 0.

Exit status: 0 on success (and on the no-GPU message), 1 when the report was refused because
two arms of a case could not be told apart, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import shlex
import sys
import tempfile

from bench.suites import SUITES

NO_GPU_MESSAGE = (
    "speed figures need a GPU; this machine has none (use --dry-run to exercise the code paths)"
)
REPOSITORY_ROOT = pathlib.Path(__file__).resolve().parents[1]
REPORTS_DIRECTORY = REPOSITORY_ROOT / "docs" / "benchmark_results"
# The dry run's copy "ceiling": 1 MiB, enough to run the code, not to measure anything.
DRY_RUN_COPY_BYTES = 1 << 20
PARTIAL_NOTE = (
    "PARTIAL: written while the run was still going, with the rows measured so far (the run "
    "may have been cut short, e.g. by a time limit); each case's arms are complete and were timed "
    "in this one process; the run's whole report, if it ends, replaces this file"
)
DRY_RUN_REPEATS = 3


def _tune(argv: list[str]) -> int:
    from bench.tuning import tune

    return tune.main(argv)


def _check(argv: list[str]) -> int:
    from bench import check

    return check.main(argv)


# Words that are not suites: ``python -m bench tune ...`` and ``python -m bench check ...``.
SUBCOMMANDS = {"tune": _tune, "check": _check}


def positive_integers(text: str) -> tuple[int, ...]:
    """``"256,32"`` -> ``(256, 32)``, for ``--batches`` and ``--contexts``.

    Raises:
      argparse.ArgumentTypeError: for an empty item, a non-integer or a value below 1.
    """
    values = []
    for item in text.split(","):
        try:
            value = int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated positive integers, got {text!r}"
            ) from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected positive integers, got {value} in {text!r}")
        values.append(value)
    return tuple(values)


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="decodelab benchmarks: times each suite's arms on a GPU and writes a report "
        "to docs/benchmark_results/ (the method: docs/benchmarking.md)",
        epilog="Subcommands: python -m bench tune <kernel> --help (autotuner), python -m bench "
        "check <suite> --help (speed regression check). "
        "Tuners, probes and memcheck workloads run on their own: python -m "
        "bench.tuning.<name>, bench.probes.<name>, bench.memcheck.<name>; "
        "python -m bench.harness.merge_reports merges a suite run in parts.",
    )
    parser.add_argument("suite", choices=sorted(SUITES), help="which suite to run")
    parser.add_argument("--quick", action="store_true", help="a subset of the grid")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny shapes on the CPU to exercise every code path; figures are not speed figures",
    )
    parser.add_argument(
        "--tune",
        action="store_true",
        help="also sweep kernel launch parameters where the suite has them (decode, prefill), "
        "and report the best",
    )
    parser.add_argument(
        "--batches",
        type=positive_integers,
        default=None,
        help="comma-separated batch sizes to run instead of the grid's (suites with a batch "
        "grid: sampling), e.g. 256,32",
    )
    parser.add_argument(
        "--contexts",
        type=positive_integers,
        default=None,
        help="comma-separated context lengths to run instead of the grid's (suites with a "
        "context grid: prefill), e.g. 32768",
    )
    parser.add_argument(
        "--gumbel-only",
        action="store_true",
        help="sampling suite: only the Gumbel-max cases and the peers, not the filtered samplers",
    )
    parser.add_argument(
        "--q-len-only",
        action="store_true",
        help="decode suite: only the multi-token (q_len) cases, not the one-token grid and peers",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="report directory (default docs/benchmark_results; a temporary one in a dry run)",
    )
    return parser.parse_args(argv)


def _prepare_jax_platform(dry_run: bool) -> None:
    """A dry run uses the CPU even on a GPU machine. Set before JAX starts; once JAX runs in
    this process (tests calling ``main``), the CPU device is chosen with ``default_device``."""
    if dry_run and "jax" not in sys.modules:
        os.environ["JAX_PLATFORMS"] = "cpu"


def _report_directory(out: pathlib.Path | None, dry_run: bool) -> pathlib.Path:
    if not dry_run:
        return out or REPORTS_DIRECTORY
    if out is None:
        return pathlib.Path(tempfile.mkdtemp(prefix="bench-dry-run-"))
    if out.resolve() == REPORTS_DIRECTORY.resolve():
        raise SystemExit(f"a dry run never writes to {REPORTS_DIRECTORY}; pick another --out")
    return out


def main(argv: list[str] | None = None) -> int:
    """Runs ``python -m bench`` with ``argv`` (default ``sys.argv[1:]``); returns the exit
    status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    arguments = parse_arguments(argv)
    _prepare_jax_platform(arguments.dry_run)

    import jax

    from bench import harness
    from bench.harness import report
    from bench.suites import load_suite

    suite = load_suite(arguments.suite)
    if arguments.dry_run:
        device = jax.devices("cpu")[0]
    elif jax.default_backend() != "gpu":
        print(NO_GPU_MESSAGE)
        return 0
    else:
        device = jax.devices()[0]
    out_dir = _report_directory(arguments.out, arguments.dry_run)
    repeats = DRY_RUN_REPEATS if arguments.dry_run else harness.DEFAULT_REPEATS
    options = harness.RunOptions(
        quick=arguments.quick,
        dry_run=arguments.dry_run,
        repeats=repeats,
        tune=arguments.tune,
        batches=arguments.batches,
        q_len_only=arguments.q_len_only,
        gumbel_only=arguments.gumbel_only,
        contexts=arguments.contexts,
    )
    command = shlex.join(["python", "-m", "bench", *argv])
    report_arguments = dict(
        command=command,
        timing_method=harness.timing_method_description(repeats),
        out_dir=out_dir,
        dry_run=arguments.dry_run,
        device=device,
    )
    partial_name = f"{arguments.suite}-partial"
    ceiling = None

    def write_partial(rows):
        """Keeps the rows measured so far in ``<date>-<suite>-partial.md`` and ``.json``."""
        report.write_report(
            arguments.suite,
            rows,
            ceiling_tbps=ceiling.tbps,
            notes=[PARTIAL_NOTE],
            ceiling_detail=ceiling.detail(),
            name=partial_name,
            **report_arguments,
        )

    options = dataclasses.replace(options, checkpoint=write_partial)

    if arguments.dry_run:
        print(f"DRY RUN: {report.DRY_RUN_NOTE}.", flush=True)
    print(f"suite {arguments.suite} on {device.device_kind}: {command}", flush=True)
    report.print_progress("measuring the copy ceiling")
    with jax.default_device(device):
        if arguments.dry_run:
            ceiling = harness.measure_copy_ceiling(
                DRY_RUN_COPY_BYTES, repeats=repeats, iters=options.dry_run_calls, use_torch=False
            )
        else:
            ceiling = harness.measure_copy_ceiling(repeats=repeats)
        methods = ", ".join(f"{name} {tbps:.3f}" for name, tbps in ceiling.by_method.items())
        print(f"copy ceiling {ceiling.tbps:.3f} TB/s ({methods})", flush=True)
        output = suite.run(options, ceiling)
    try:
        markdown_path, json_path = report.write_report(
            arguments.suite,
            output.results,
            ceiling_tbps=ceiling.tbps,
            notes=output.notes,
            peers_for_ratio=output.peers_for_ratio,
            ceiling_detail=ceiling.detail(),
            **report_arguments,
        )
    except report.IndistinguishableArmsError as error:
        print(f"report refused: {error}", file=sys.stderr)
        return 1
    # The whole report replaces the partial one.
    for partial in out_dir.glob(f"*-{partial_name}.*"):
        partial.unlink()
    for note in output.notes:
        print(f"note: {note}")
    print(f"wrote {markdown_path}\n      {json_path}")
    if arguments.dry_run:
        print(f"DRY RUN: {report.DRY_RUN_NOTE}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
