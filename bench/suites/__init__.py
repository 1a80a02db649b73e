"""The benchmark suites ``python -m bench <suite>`` can run, and the contract each follows.

A suite is a module listed in ``SUITES`` (name -> module path, imported only when run) that
defines::

    def run(options: bench.harness.RunOptions,
            ceiling: bench.harness.CopyCeiling) -> SuiteOutput: ...

- The command line measures the copy ceiling first and hands it over, so every suite's
  fractions use the ceiling of its own run (``ceiling.tbps``).
- ``options`` says ``quick`` (a subset of the grid) or ``dry_run`` (tiny shapes on the CPU,
  every code path, few calls). Time through ``options`` so both modes do the right thing:
  ``options.num_sets_for(bytes_per_set)`` for the rotating sets, ``options.time(TimedLoop(step,
  num_sets, operands), expected_us_per_call=harness.expected_us(bytes, tbps))`` for a JAX arm,
  ``options.time_torch(call, num_sets, options.torch_device)`` for a PyTorch arm, and
  ``interpret=options.interpret`` for Pallas kernels.
- ``run`` returns every measured row as a ``bench.harness.CaseResult`` (case names lead with
  the method for sampling, ``"top_p B=32"``, and are ``"B=<n> ctx=<n>"`` for attention), plus
  notes for the report (an arm that failed, a disagreement between arms). It prints a case's
  rows once the case is complete with ``bench.harness.report.print_results`` (after a
  ``bench.harness.report.print_progress`` line naming the case as it starts, so that minutes of
  setup and compiling are not silent); the command line then
  writes the report. Both refuse rows whose arms cannot be told apart
  (``bench.harness.report.check_distinguishable``).
- ``SuiteOutput.peers_for_ratio`` names the arms each row is compared with in the report
  (None: every arm of the case).

A decode suite that times our kernel beside the peers in the same run builds its inputs with
``bench.harness.attention_inputs.make_attention_setup(..., layouts=("HND", "head_major"))``, times its
own arms, and adds ``bench.suites.peers.peer_attention_results(setup, options, ceiling.tbps)``
for the same setup, then registers itself here: ``"decode": "bench.suites.decode"``.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command line reads SUITES before it may import jax
    from bench.harness import CaseResult

SUITES = {
    "peers": "bench.suites.peers",
    "decode": "bench.suites.decode",
    "sampling": "bench.suites.sampling",
    "fused_ops": "bench.suites.fused_ops",
    "speculative": "bench.suites.speculative",
    "serving": "bench.suites.serving",
    "prefill": "bench.suites.prefill",
}


@dataclasses.dataclass
class SuiteOutput:
    """What a suite's ``run`` returns.

    Attributes:
      results: every measured row.
      notes: sentences for the report (failures, disagreements, skipped arms).
      peers_for_ratio: arms each row is compared with (None: every arm of the case).
    """

    results: list[CaseResult]
    notes: list[str] = dataclasses.field(default_factory=list)
    peers_for_ratio: tuple[str, ...] | None = None


def load_suite(name: str) -> ModuleType:
    """The module of suite ``name``.

    Raises:
      ValueError: for a name not in ``SUITES``.
    """
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; known: {sorted(SUITES)}")
    return importlib.import_module(SUITES[name])
