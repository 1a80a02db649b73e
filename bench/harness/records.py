"""``CaseResult``: one row of a report, with exactly the JSON fields of ``docs/benchmarking.md``
(``CASE_FIELDS``), and the naming of an arm timed a second time in the same run
(``repeat_arm`` / ``original_arm``, its noise level, method point 5).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from bench.harness.timing import Timing

REPEAT_SUFFIX = " (repeat)"


CASE_FIELDS = (
    "case",
    "arm",
    "attribution",
    "median_us",
    "min_us",
    "max_us",
    "bytes",
    "achieved_tbps",
    "fraction_of_ceiling",
)


@dataclasses.dataclass
class CaseResult:
    """One arm of one case: a row of a report, with the JSON fields of ``docs/benchmarking.md``.

    Attributes:
      case: what was measured, batch as ``B=<n>``: ``"B=4 ctx=4096"``, ``"top_p B=32"``.
      arm: which implementation (``"xla_gather"``, ``"decodelab"``, ...); an arm timed a second
        time in the same run is named ``"<arm> (repeat)"``.
      attribution: something only this arm produces (the kernel it ran, its ``k_splits``).
      median_us, min_us, max_us: per-call time over the repeats.
      bytes: bytes the call must move (attention: K and V of the real tokens; sampling: the
        float32 logits).
      achieved_tbps: ``bytes / median time``, in 1e12 bytes per second.
      fraction_of_ceiling: ``achieved_tbps / ceiling``.
      extra: suite-specific fields (``k_splits``, ``splits``, ``rounds``, ``iters``, ...),
        flattened into the case's JSON object.

    Example:
      >>> timing = Timing.from_samples([2.0, 1.0, 3.0], 10, 2, "jax_loop")
      >>> row = CaseResult.from_timing("B=1 ctx=16", "xla_gather", "xla", timing, 4_000_000, 4.0)
      >>> row.median_us, row.achieved_tbps, row.fraction_of_ceiling
      (2.0, 2.0, 0.5)
    """

    case: str
    arm: str
    attribution: str
    median_us: float
    min_us: float
    max_us: float
    bytes: int
    achieved_tbps: float
    fraction_of_ceiling: float
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_timing(
        cls,
        case: str,
        arm: str,
        attribution: str,
        timing: Timing,
        num_bytes: int,
        ceiling_tbps: float,
        **extra: Any,
    ) -> CaseResult:
        """A row from a ``Timing``; the repeats' samples and the loop's shape go to ``extra``."""
        achieved_tbps = num_bytes / (timing.median_us * 1e-6) / 1e12
        loop_fields = {
            "iters": timing.calls_per_sample,
            "num_sets": timing.num_sets,
            "bytes_between_visits": (timing.num_sets - 1) * num_bytes,
            "timing": timing.method,
            "samples_us": list(timing.samples_us),
        }
        return cls(
            case=case,
            arm=arm,
            attribution=attribution,
            median_us=timing.median_us,
            min_us=timing.min_us,
            max_us=timing.max_us,
            bytes=int(num_bytes),
            achieved_tbps=achieved_tbps,
            fraction_of_ceiling=achieved_tbps / ceiling_tbps,
            extra={**loop_fields, **extra},
        )

    def to_json(self) -> dict[str, Any]:
        """The flat JSON object of this case: the fixed fields, then ``extra``.

        Raises:
          ValueError: if an ``extra`` key would overwrite a fixed field.
        """
        clashes = set(self.extra) & set(CASE_FIELDS)
        if clashes:
            raise ValueError(f"extra fields {sorted(clashes)} clash with the fixed case fields")
        fixed = {name: getattr(self, name) for name in CASE_FIELDS}
        return {**fixed, **self.extra}


def repeat_arm(arm: str) -> str:
    """The name of ``arm`` timed a second time in the same run (its noise level)."""
    return arm + REPEAT_SUFFIX


def original_arm(arm: str) -> str:
    """``"x (repeat)"`` -> ``"x"``; any other name is returned unchanged."""
    return arm.removesuffix(REPEAT_SUFFIX)
