"""The engine's cascade decision, once a decode program: which running requests share leading
pages, and whether their attention reads those pages once per group (cascade) or once per
request (plain decode).

Why the engine can group at all: the scheduler shares a common prompt's full pages between
live requests by reference count (``serving/scheduler.py``, prefix sharing), so every request
admitted with that prompt lists the same physical page numbers at the start of its row.
``paged.plan_cascade`` finds those runs in the step's host table (whole pages only, the same page
number in every member's row; a prompt ending mid-page leaves its partly filled last page, and
everything after, in each request's own level) and builds the two levels
``paged.cascade_decode_attention`` takes.

Modes (``Engine(cascade=...)``):

- ``"auto"`` (default): a group is cascaded only where the crossover admits it
  (``paged.CASCADE_CROSSOVER``, measured on the H200: 16 requests sharing 256 pages of 16
  tokens; ``Engine(cascade_crossover=...)`` replaces it, e.g. for tests), and never where the
  cascade attention would be the per-level Triton path (``cascade_attention_backend`` returns
  ``"pallas"``), which reads a shared page once per request like plain decode and so cannot pay.
- ``"on"``: every group of two or more requests sharing one whole page or more
  (``paged.cascade_plan.ANY_SHARED_PAGE``): tests, and measuring cascade where it does not pay.
- ``"off"``: never.

``DECODELAB_BACKEND=reference`` (the kill switch) turns cascade off in every mode: the decode
program is then the plain reference program it always was.

Which attention runs a cascaded step (``cascade_attention_backend``): on a GPU under the
engine's ``backend="auto"``, the Mosaic GPU path (``backend="pallas_mgpu"``: a group's pages read
once per 64-row query tile) where its kernels take the shapes (``paged.decode.
mgpu_kernel_supports``: bfloat16 or float16, HND pages of 16, ``head_dim`` 64 or 128); this is
the path the crossover was measured on, and as it was measured: without the host plan
(``paged.plan_cascade_levels``), the tiles and work items computed in the program. Elsewhere the
engine's backend as it is: on a CPU the reference (each level by the reference, merged
exactly), with ``backend="pallas"`` the per-level Triton path.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import jax
import numpy as np

import paged
from kernels_pallas.platform import KILL_SWITCH_VARIABLE, on_gpu, resolve_backend
from paged.cascade import MOSAIC_GPU_BACKEND
from paged.cascade_plan import (
    ANY_SHARED_PAGE,
    CascadeCrossover,
    CascadePlanCache,
    levels_without_groups,
)
from paged.decode import mgpu_kernel_supports

CASCADE_MODES = ("auto", "on", "off")


def check_cascade_arguments(mode, crossover) -> None:
    """Raises ``ValueError`` naming ``cascade`` or ``cascade_crossover`` and the bad value."""
    if mode not in CASCADE_MODES:
        raise ValueError(f"cascade must be one of {CASCADE_MODES}, got {mode!r}")
    if crossover is not None and not isinstance(crossover, CascadeCrossover):
        raise ValueError(
            "cascade_crossover must be a paged.CascadeCrossover or None (never chosen by "
            f"'auto'), got {crossover!r}"
        )


def kill_switch_on() -> bool:
    """Whether ``DECODELAB_BACKEND=reference`` is set (a bad value raises, as every op's
    ``choose_backend`` does)."""
    # Through resolve_backend: a few us more a check than kernels_pallas.platform's private
    # helper would cost, but that module stays as every kernel suite's report measured it.
    resolve_backend("auto")  # validates the variable's value
    return os.environ.get(KILL_SWITCH_VARIABLE, "").strip() == "reference"


def cascade_attention_backend(backend: str, q, cache: paged.KVCache) -> str:
    """The ``backend=`` the engine gives ``paged.cascade_decode_attention`` for its own
    ``backend`` (module docstring): ``"pallas_mgpu"`` for ``"auto"`` on a GPU where the Mosaic
    GPU kernels take ``q`` and ``cache``, else ``backend``.

    Called where the program is traced (``serving.model.forward_paged``) and, with abstract
    shapes, on the host (``step_crossover``): both must agree on what runs.

    Args:
      backend: the engine's backend (``"auto"``, ``"reference"`` or ``"pallas"``).
      q: the queries or anything with their shape and dtype (``[B, H, D]`` or ``[B, L, H, D]``).
      cache: a layer's KV pool, or its abstract shape.
    """
    if backend == "auto" and on_gpu() and not kill_switch_on():
        if mgpu_kernel_supports(q, cache) is None:
            return MOSAIC_GPU_BACKEND
    return backend


def step_crossover(
    mode: str, crossover: CascadeCrossover | None, attention_backend: str
) -> tuple[CascadeCrossover | None, str | None]:
    """Which groups a decode program may cascade: ``(crossover, None)``, or ``(None, why
    not)`` when no group may.

    Args:
      mode: the engine's ``cascade`` mode.
      crossover: the engine's ``cascade_crossover`` (what ``"auto"`` admits).
      attention_backend: what ``cascade_attention_backend`` chose for this program.
    """
    if mode == "off":
        return None, "cascade='off'"
    if kill_switch_on():
        return None, f"{KILL_SWITCH_VARIABLE}=reference (the kill switch)"
    if mode == "on":
        return ANY_SHARED_PAGE, None
    if crossover is None:
        return None, "auto: no measured crossover (cascade_crossover=None)"
    if attention_backend == "pallas":
        return None, (
            "auto: backend='pallas' would run the per-level path, which reads a shared page "
            "once per request and cannot pay"
        )
    return crossover, None


def _cannot_pay(crossover: CascadeCrossover, table: paged.PageTable, active) -> bool:
    """Whether no group can pass ``crossover`` in ``table``, from counts alone (cheap: the
    default rule declines every small batch without reading its pages)."""
    if int(np.count_nonzero(active)) < crossover.min_group_size:
        return True
    lengths = np.asarray(table.seq_lens())[np.asarray(active)]
    return int(lengths.max(initial=0)) <= crossover.min_prefix_pages * table.page_size


def empty_levels(table: paged.PageTable, max_groups: int) -> paged.CascadeLevels:
    """Levels of ``plan_cascade``'s shapes with no group (``levels_without_groups``): equal to
    plain decode."""
    return levels_without_groups(table, max_groups)


def plan_step_levels(
    tables,
    active,
    crossover: CascadeCrossover | None,
    *,
    q_len: int = 1,
    cache: CascadePlanCache | None = None,
) -> list[paged.CascadeLevels] | None:
    """The cascade levels of each step of a decode program, or None where no group pays.

    Shapes (why the decode program stays one compiled program a table bucket, whatever the
    groups): the shared level always has ``B // 2`` group rows (every possible group; unused
    rows are empty), ``B`` member entries, and both levels' ``page_indices`` the step table's
    padded length (``paged.bucket_size``, the scheduler's bucket). So the levels add one leaf
    set of fixed shapes to the program's inputs: a table bucket compiles at most two decode
    programs, a plain one and a cascade one, never one per group layout.

    A block of ``K`` steps (``tables`` the scheduler's ``step_page_tables``) keeps its step 0
    groups: nothing changes in a block but each row's length, and a member's shared pages are
    prompt pages below its length from step 0 on. A step whose table yields no group (not
    expected) gets ``empty_levels``, so the ``K`` levels stack.

    Args:
      tables: the program's step tables (host), one for a single step.
      active: bool[B], rows running a request (phantom rows join no group).
      crossover: which groups pay (``step_crossover``), or None: no cascade.
      q_len: new tokens a row (``n + 1`` for a verification step).
      cache: the engine's ``paged.cascade_plan.CascadePlanCache``, through which each table
        is planned (the same levels as ``paged.plan_cascade``, most steps reusing the step
        before's), or None: ``plan_cascade`` itself.

    Returns:
      One ``CascadeLevels`` (host NumPy arrays; read-only where ``cache`` reused them) a step,
      or None.
    """
    if crossover is None or _cannot_pay(crossover, tables[0], active):
        return None
    plan = paged.plan_cascade if cache is None else cache.plan
    max_groups = tables[0].batch_size // 2
    first = plan(tables[0], crossover, q_len=q_len, active=active, max_groups=max_groups)
    if first is None:
        return None
    levels = [first]
    for table in tables[1:]:
        later = plan(table, crossover, q_len=q_len, active=active, max_groups=max_groups)
        levels.append(empty_levels(table, max_groups) if later is None else later)
    return levels


def stack_levels(levels: list[paged.CascadeLevels]) -> paged.CascadeLevels:
    """``K`` steps' levels (one shape) as one ``CascadeLevels`` whose leaves have a leading
    ``[K]`` axis (``programs.decode_steps``'s scan reads step ``k``'s)."""
    return jax.tree.map(lambda *leaves: np.stack(leaves), *levels)


@dataclasses.dataclass
class CascadeStats:
    """What cascade did so far (``Engine.cascade_report()``; counts are decode steps, a block of
    ``K`` steps counting ``K``).

    Attributes:
      mode: the engine's ``cascade`` mode.
      decode_steps: decode steps run.
      cascade_steps: decode steps that ran cascade attention.
      groups: groups cascaded, summed over those steps.
      requests: requests in a cascaded group, summed over those steps.
      largest_group: the most requests one cascaded group held.
      shared_pages: pages the shared levels listed (each read once per group instead of once
        per member), summed over cascaded steps.
      page_reads_saved: per layer, the page reads cascade saved: ``(members - 1) x pages`` of
        every cascaded group, summed over steps.
      last_reason: why the last decode program did not cascade (None if it did, or before
        any).
    """

    mode: str
    decode_steps: int = 0
    cascade_steps: int = 0
    groups: int = 0
    requests: int = 0
    largest_group: int = 0
    shared_pages: int = 0
    page_reads_saved: int = 0
    last_reason: str | None = None

    def record(self, num_steps: int, levels: paged.CascadeLevels | None, reason=None) -> None:
        """Counts a decode program of ``num_steps`` steps, cascaded with ``levels`` (step 0's,
        unstacked) or not (``reason`` says why)."""
        self.decode_steps += num_steps
        if levels is None:
            self.last_reason = reason
            return
        self.last_reason = None
        self.cascade_steps += num_steps
        for level in levels.shared:
            # Python ints of B // 2 + 1 offsets: the same sums as NumPy's, without a dozen
            # small-array calls a decode program (about 20 us of host time on a CPU).
            group_indptr = np.asarray(level.group_indptr).tolist()
            page_indptr = np.asarray(level.group_pages.page_indptr).tolist()
            sizes = [b - a for a, b in itertools.pairwise(group_indptr)]
            pages = [b - a for a, b in itertools.pairwise(page_indptr)]
            used = [(size, count) for size, count in zip(sizes, pages, strict=True) if size > 0]
            self.groups += num_steps * len(used)
            self.requests += num_steps * sum(sizes)
            self.largest_group = max(self.largest_group, max(sizes, default=0))
            self.shared_pages += num_steps * sum(count for _, count in used)
            self.page_reads_saved += num_steps * sum((size - 1) * count for size, count in used)

    def describe(self) -> str:
        """One line for the backend report: when cascade ran, or why not."""
        if self.cascade_steps:
            return (
                f"cascade ({self.cascade_steps} of {self.decode_steps} decode steps; "
                f"{self.groups} groups, {self.requests} requests, largest {self.largest_group}; "
                f"{self.shared_pages} shared pages read once a group, {self.page_reads_saved} "
                "page reads saved a layer)"
            )
        why = self.last_reason or "no group"
        return f"plain (0 of {self.decode_steps} decode steps cascaded: {why})"
