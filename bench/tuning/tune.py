"""Autotuner command line: ``python -m bench tune <kernel> [--buckets ...] [--dry-run] [--out DIR]``.

For each shape bucket of the kernel, times its candidate launches against today's default with
the harness's cold-L2, dispatch-amortized programs and keeps a candidate only when
``bench.tuning.autotune.select`` finds it faster beyond the noise. Writes the kernel's table
(``kernels_pallas/tuning_tables.py``'s format) with every bucket's chosen launch (the default
where nothing was kept) and, under ``provenance``, the command, commit and each bucket's
decision record.

- ``--buckets "batch=1,context=32768;batch=4,context=4096"``: the buckets to tune (each value
  rounded up to its power-of-two bucket, and measured at that size); default: the kernel's own
  list (``TARGETS[kernel].default_buckets``).
- On a GPU the table goes to ``kernels_pallas/tuned/<kernel>.json`` (or ``--out``), replacing the
  table of this device, jax version and kernel version and keeping the others.
- ``--dry-run``: tiny shapes on the CPU, Pallas in interpret mode, a few samples and rounds
  (``DRY_RUN_SELECTION``): every code path, no meaningful decision; the table goes to ``--out``
  or a temporary directory, never to ``kernels_pallas/tuned``.
- Without a GPU and without ``--dry-run``: says so, writes nothing, exits 0.

Kernels covered (``TARGETS``): ``paged_decode``, ``merge_states``, ``gumbel``, ``dual_pivot``,
``paged_prefill``, ``spec_accept``, ``norm``, ``rope_append``, each in
``bench/tuning/<kernel>_target.py`` (``docs/tuning.md`` has their keys). A target module
provides ``KERNEL``, ``KERNEL_VERSION``, ``DIMENSIONS``, ``BUCKETED``, ``PARAMETERS``,
``default_buckets(dry_run)`` and ``bucket_session(bucket, options)`` (a context manager
yielding a ``BucketSession``).

Exit status: 0 on success, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import pathlib
import shlex
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from bench.tuning.autotune import (
    DEFAULT_ALPHA,
    DEFAULT_ROUNDS,
    DEFAULT_STAGE1_SAMPLES,
    DEFAULT_TOP,
    Candidate,
)

TARGETS = {
    "paged_decode": "bench.tuning.paged_decode_target",
    "merge_states": "bench.tuning.merge_states_target",
    "gumbel": "bench.tuning.gumbel_target",
    "dual_pivot": "bench.tuning.dual_pivot_target",
    "paged_prefill": "bench.tuning.paged_prefill_target",
    "spec_accept": "bench.tuning.spec_accept_target",
    "norm": "bench.tuning.norm_target",
    "rope_append": "bench.tuning.rope_append_target",
}
NO_GPU_MESSAGE = (
    "tuning needs a GPU; this machine has none (use --dry-run to exercise the code paths)"
)
# A dry run's selection: enough to run both stages, not to decide anything.
DRY_RUN_SELECTION = dict(stage1_samples=2, rounds=2, alpha=0.5, top=1)


def parse_buckets(text: str) -> list[dict[str, int]]:
    """``"batch=1,context=32768;batch=4,context=4096"`` -> a list of dimension dicts.

    Raises:
      argparse.ArgumentTypeError: for an item that is not ``name=positive integer``.
    """
    from kernels_pallas.tuning_tables import parse_key

    buckets = []
    for item in text.split(";"):
        try:
            key = parse_key(item.strip())
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        bad = [f"{name}={value}" for name, value in key if value < 1]
        if bad:
            raise argparse.ArgumentTypeError(f"bucket values must be >= 1, got {bad} in {text!r}")
        buckets.append(dict(key))
    return buckets


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench tune",
        description="time a kernel's launch candidates per shape bucket and keep a candidate "
        "only when it beats the default beyond noise (docs/tuning.md)",
    )
    parser.add_argument("kernel", choices=sorted(TARGETS), help="which kernel to tune")
    parser.add_argument(
        "--buckets", type=parse_buckets, default=None, help='e.g. "batch=4,context=4096;..."'
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="table directory")
    parser.add_argument("--top", type=int, default=None, help=f"finalists (default {DEFAULT_TOP})")
    parser.add_argument(
        "--rounds", type=int, default=None, help=f"ABBA blocks a finalist ({DEFAULT_ROUNDS})"
    )
    parser.add_argument(
        "--stage1-samples",
        type=int,
        default=None,
        help=f"screening samples a launch ({DEFAULT_STAGE1_SAMPLES})",
    )
    parser.add_argument(
        "--alpha", type=float, default=None, help=f"false-keep chance ({DEFAULT_ALPHA})"
    )
    parser.add_argument("--min-gain", type=float, default=0.0, help="smallest gain kept")
    return parser.parse_args(argv)


def selection_arguments(arguments: argparse.Namespace) -> dict[str, Any]:
    """``select``'s keyword arguments: the command line's, else the dry run's or the
    defaults."""
    chosen = dict(DRY_RUN_SELECTION) if arguments.dry_run else {}
    for name in ("top", "rounds", "stage1_samples", "alpha"):
        if getattr(arguments, name) is not None:
            chosen[name] = getattr(arguments, name)
    chosen["min_gain"] = arguments.min_gain
    return chosen


class HarnessMeasure:
    """``measure(candidate)`` for ``autotune.select``: one run of the candidate's timed
    program, in microseconds per call.

    A candidate's first call compiles its program and sizes it (``TimedLoop.time`` with one
    repeat: about ``options.sweep_target_seconds`` a program, or ``options.dry_run_calls``
    calls in a dry run); every later call runs that same program once. One program per
    candidate, so the ABBA blocks alternate between already compiled programs.
    """

    def __init__(self, loop_for: Callable, options, expected_us_per_call: float):
        self.loop_for = loop_for
        self.options = options
        self.expected_us_per_call = expected_us_per_call
        self.prepared: dict[str, tuple[Any, int]] = {}

    def __call__(self, candidate: Candidate) -> float:
        if candidate.name not in self.prepared:
            loop = self.loop_for(candidate)
            timing = loop.time(
                iters=self.options.dry_run_calls if self.options.dry_run else None,
                repeats=1,
                target_seconds=self.options.sweep_target_seconds,
                expected_us_per_call=self.expected_us_per_call,
            )
            self.prepared[candidate.name] = (loop, timing.calls_per_sample)
        loop, iters = self.prepared[candidate.name]
        return loop.run(iters) / iters * 1e6


def tune_kernel(
    target, buckets: list[dict[str, int]], options, selection: dict[str, Any], measure_for=None
) -> tuple[dict[str, dict[str, int]], dict[str, Any]]:
    """Runs the selection on every bucket.

    Args:
      target: the kernel's target module.
      buckets: bucketed dimensions of each bucket (rounded up to powers of two here).
      options: the harness's ``RunOptions``.
      selection: ``select``'s keyword arguments.
      measure_for: ``measure_for(session) -> measure`` (default ``HarnessMeasure``; a test may
        inject a fake timer).

    Returns:
      ``(entries, decisions)``: bucket key string -> chosen launch, and -> decision record.
    """
    from bench.harness import report
    from bench.tuning.autotune import select
    from kernels_pallas.tuning_tables import bucket_key, format_key, next_power_of_two

    entries, decisions = {}, {}
    for bucket in buckets:
        rounded = {name: next_power_of_two(value) for name, value in bucket.items()}
        with target.bucket_session(rounded, options) as session:
            key = format_key(bucket_key(session.dims, target.BUCKETED))
            report.print_progress(
                f"{target.KERNEL} {key}: {session.description}; default {session.default.name}, "
                f"{len(session.candidates)} candidate(s)"
            )
            measure = (
                measure_for(session)
                if measure_for is not None
                else HarnessMeasure(session.loop_for, options, session.expected_us_per_call)
            )
            decision = select(session.candidates, session.default, measure, **selection)
        entries[key] = dict(decision.chosen.parameters)
        decisions[key] = decision.to_json()
        spread = ""
        if decision.ratio_range:
            spread = f" (block ratios {decision.ratio_range[0]:.3f}..{decision.ratio_range[1]:.3f})"
        print(
            f"{key}: {'KEPT ' if decision.kept else 'default'} {decision.chosen.name}{spread}: "
            f"{decision.reason}",
            flush=True,
        )
    return entries, decisions


def table_document(target, entries, decisions, *, device_kind, jax_version, provenance):
    """The table object of one run (``kernels_pallas/tuning_tables.py``'s format), validated."""
    from kernels_pallas.tuning_tables import validate_table

    return validate_table(
        {
            "kernel": target.KERNEL,
            "kernel_version": target.KERNEL_VERSION,
            "device_kind": device_kind,
            "jax_version": jax_version,
            "dimensions": list(target.DIMENSIONS),
            "bucketed": list(target.BUCKETED),
            "parameters": list(target.PARAMETERS),
            "entries": entries,
            "provenance": {**provenance, "decisions": decisions},
        }
    )


def write_table(table: dict[str, Any], directory: pathlib.Path) -> pathlib.Path:
    """Writes ``table`` into ``<directory>/<kernel>.json``, replacing the table of the same
    device, jax version and kernel version and keeping the others (sorted by identity)."""
    from kernels_pallas.tuning_tables import read_tables, table_path

    path = table_path(table["kernel"], directory)
    identity = (table["device_kind"], table["jax_version"], table["kernel_version"])
    tables = read_tables(path) if path.exists() else []
    tables = [
        t for t in tables if (t["device_kind"], t["jax_version"], t["kernel_version"]) != identity
    ]
    tables.append(table)
    tables.sort(key=lambda t: (t["device_kind"], t["jax_version"], str(t["kernel_version"])))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(tables, indent=2) + "\n")
    return path


def _table_directory(out: pathlib.Path | None, dry_run: bool) -> pathlib.Path:
    from kernels_pallas.tuning_tables import TUNED_DIRECTORY

    if not dry_run:
        return out or TUNED_DIRECTORY
    if out is None:
        return pathlib.Path(tempfile.mkdtemp(prefix="bench-tune-dry-run-"))
    if out.resolve() == TUNED_DIRECTORY.resolve():
        raise SystemExit(f"a dry run never writes to {TUNED_DIRECTORY}; pick another --out")
    return out


def _check_selection(selection: dict[str, Any]) -> None:
    """Raises ``ValueError`` for selection arguments ``select`` would refuse, before any bucket
    is set up and compiled."""
    from bench.tuning.autotune import required_wins

    for name in ("top", "stage1_samples"):
        if selection.get(name, 1) < 1:
            raise ValueError(f"{name} must be >= 1, got {selection[name]}")
    if not 0 <= selection["min_gain"] < 1:
        raise ValueError(f"min_gain must be in [0, 1), got {selection['min_gain']}")
    required_wins(selection.get("rounds", DEFAULT_ROUNDS), selection.get("alpha", DEFAULT_ALPHA))


def main(argv: list[str] | None = None, measure_for=None) -> int:
    """``python -m bench tune``; returns the exit status. ``measure_for``: see
    ``tune_kernel``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    arguments = parse_arguments(argv)
    if arguments.dry_run and "jax" not in sys.modules:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    from bench.harness import RunOptions, report

    selection = selection_arguments(arguments)
    if arguments.dry_run:
        device = jax.devices("cpu")[0]
    elif jax.default_backend() != "gpu":
        print(NO_GPU_MESSAGE)
        return 0
    else:
        device = jax.devices()[0]
    target = importlib.import_module(TARGETS[arguments.kernel])
    buckets = arguments.buckets or target.default_buckets(arguments.dry_run)
    unknown = [sorted(b) for b in buckets if sorted(b) != sorted(target.BUCKETED)]
    if unknown:
        print(
            f"--buckets of {arguments.kernel} name {list(target.BUCKETED)}, got {unknown[0]}",
            file=sys.stderr,
        )
        return 2
    directory = _table_directory(arguments.out, arguments.dry_run)
    options = RunOptions(dry_run=arguments.dry_run)
    command = shlex.join(["python", "-m", "bench", "tune", *argv])
    print(f"tune {arguments.kernel} on {device.device_kind}: {command}", flush=True)
    try:
        _check_selection(selection)
    except ValueError as error:
        print(f"bad selection arguments: {error}", file=sys.stderr)
        return 2
    with jax.default_device(device):
        entries, decisions = tune_kernel(target, buckets, options, selection, measure_for)
    provenance = {
        "command": command,
        "date": datetime.date.today().isoformat(),
        "commit": report.git_commit(),
        "dry_run": arguments.dry_run,
        "selection": selection,
    }
    table = table_document(
        target,
        entries,
        decisions,
        device_kind=device.device_kind,
        jax_version=jax.__version__,
        provenance=provenance,
    )
    path = write_table(table, directory)
    kept = sum(decision["kept"] for decision in decisions.values())
    print(f"{kept} of {len(decisions)} bucket(s) kept a tuned launch; wrote {path}")
    if arguments.dry_run:
        print("DRY RUN: figures from a CPU in interpret mode decide nothing.")
    return 0
