"""Where a command writes what it measured: the committed folder, or a scratch one for a dry run.

``python -m bench <suite>`` writes reports to ``docs/benchmark_results/`` and
``python -m bench tune <kernel>`` writes tables to ``kernels_pallas/tuned/``; both are committed
and read by people and code. A dry run (tiny shapes, on a CPU) measures nothing, so it must never
land there: it writes to ``--out`` or a fresh temporary folder, and refuses ``--out`` pointing at
the committed folder.
"""

from __future__ import annotations

import pathlib
import tempfile


def output_directory(
    out: pathlib.Path | None, dry_run: bool, committed: pathlib.Path, scratch_prefix: str
) -> pathlib.Path:
    """The folder a run writes to: ``out`` if given, else ``committed`` (a real run) or a new
    temporary folder named ``scratch_prefix...`` (a dry run).

    Raises:
      SystemExit: a dry run given ``out`` equal to ``committed``.
    """
    if not dry_run:
        return out or committed
    if out is None:
        return pathlib.Path(tempfile.mkdtemp(prefix=scratch_prefix))
    if out.resolve() == committed.resolve():
        raise SystemExit(f"a dry run never writes to {committed}; pick another --out")
    return out
