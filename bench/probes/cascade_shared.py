"""Probe: cascade attention with the Mosaic GPU shared-level kernel against plain decode, on the
H200 (issue 17).

A case is one group of ``B`` requests sharing a ``prefix``-token prompt, each with its own
``suffix`` tokens after it (256 by default), one new token a request (``--q-len`` for more),
32 query heads, 8 KV heads, head_dim 128, page 16, bfloat16. Arms, each a whole decode step's
attention for the batch:

- ``plain``: ``paged.decode_attention(backend="auto")`` (on the H200 the Mosaic GPU decode
  kernel; interpreted, the Triton one) over each request's whole row (prefix
  pages then its own), with ``paged.plan_decode``'s plan: what the project runs today. The
  prefix pages are the same pool pages for every request, so the L2 serves part of the
  repeated reads; the figure is what a user gets, not a cold-cache worst case.
- ``cascade:<variant>``: ``kernels_pallas.cascade_shared_mgpu.shared_level_states_mgpu`` for the
  shared level (the pipeline of ``<variant>``, e.g. ``ring.reg.p4.s3``: the ring, p from
  registers, 4 pages a step, 3 slots; ``emit.reg.p2.s3``: ``emit_pipeline``), plus the own
  level through ``paged.decode_attention`` (the plain arm's backend) with its plan, plus
  ``paged.merge_states`` of the two states: the cascade path as ``paged/cascade.py`` would run
  it with this kernel wired in, the shared level with its host plan
  (``plan_shared_level``, made once a case outside the timed loop). ``VARIANTS`` by default; where none passes its check (the ring
  has not yet run compiled), ``FALLBACK_VARIANT``, the pipeline that has.
- ``cascade-traced:<first variant>``: the same without the host plan (the tile layout and
  work items computed on the device in every call), so the plan's gain shows; checked
  against plain decode as the cascade arms, not counted as one in the summary.
- with ``--parts``, ``shared:<variant>`` and ``own``: the two halves alone, where the time goes.

First every arm runs once: a cascade arm further than ``MAX_DIFFERENCE`` from the plain arm
(largest absolute difference of ``o`` and of the LSE, printed) is a MISMATCH and is not timed,
an arm that fails to compile or run is reported with its error, never stopping the probe; the
first case's first passing cascade arm (that same output) is also checked against the float32
reference (``paged.cascade.cascade_decode_attention_reference``; the shared level alone
against its reference is ``tests/test_cascade_shared_mgpu.py``'s gpu-marked test, at these
shapes and launches). Then every arm is timed with the
suite's method (``bench.harness.timing.TimedLoop``: rotating input sets, each its own pages of
one pool, for a cold L2 between visits; dispatch amortized in one jitted loop; median of
repeats). No case starts after ``--budget-s`` (460 s by default), and the rows go to
``--out/cascade_shared_probe.json`` after every case. The table gives each arm's time and the
plain time over the best cascade arm's (above 1: cascade pays); the last lines say, per group
size, from which prefix cascade pays.

Usage (GPU): ``PYTHONPATH=. python3 -m bench.probes.cascade_shared --out DIR`` (``--cases
32x4096,128x32768`` for a part; ``--variants ring.reg.p4.s3``; ``--crossover`` adds short
prefixes, 256 to 2048 tokens, after the issue's grid; ``--q-len 3`` a verification step).
``--smoke`` runs one tiny case in Mosaic GPU's interpret mode on a CPU: the checks and the code
paths (the plain and cascade arms, one timed loop), no figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import time
import traceback
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import paged
from bench.harness.timing import TimedLoop, num_rotating_sets
from kernels_pallas.cascade_shared_mgpu import plan_shared_level, shared_level_states_mgpu
from paged.cascade import (
    CascadeLevels,
    SharedLevel,
    cascade_decode_attention_reference,
    cascade_levels_from_shared_prefix,
)

# (requests in the group, prefix tokens): the grid.
CASES = tuple((group, prefix) for prefix in (4096, 16384, 32768) for group in (32, 64, 128))
CROSSOVER_CASES = tuple((group, prefix) for prefix in (256, 1024, 2048) for group in (32, 128))
SUFFIX_TOKENS = 256
SHAPE = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
SMOKE_CASE = (3, 32)
SMOKE_SUFFIX_TOKENS = 5
SMOKE_SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_dim=64)
PAGE_SIZE = 16
# The ring at one program an SM (3 slots of 4 pages, 115 KiB) and at two (2 slots, 83 KiB: the
# split doubles). Where neither passes its check (the ring has not yet run compiled), the case
# runs FALLBACK_VARIANT: emit_pipeline at the decode path's launch, which has (issue 16).
VARIANTS = ("ring.reg.p4.s3", "ring.reg.p4.s2")
FALLBACK_VARIANT = "emit.reg.p2.s3"
SMOKE_VARIANTS = ("ring.smem.p2.s2", "emit.smem.p1.s2")
MAX_DIFFERENCE = 5e-2  # of o against plain decode's (bfloat16 outputs of order 1)
BUDGET_SECONDS = 460.0


class Variant(NamedTuple):
    pipeline: str
    probs_in_smem: bool
    pages_per_step: int
    num_stages: int

    @classmethod
    def parse(cls, name: str) -> Variant:
        """``<ring|emit>.<reg|smem>.p<pages a step>.s<stages>``."""
        try:
            pipeline, probs, pages, stages = name.split(".")
            if pipeline not in ("ring", "emit") or probs not in ("reg", "smem"):
                raise ValueError
            return cls(pipeline, probs == "smem", int(pages[1:]), int(stages[1:]))
        except ValueError:
            raise ValueError(
                f"variant {name!r} must read <ring|emit>.<reg|smem>.p<N>.s<N>"
            ) from None

    def launch(self) -> dict:
        return dict(
            pipeline=self.pipeline,
            probs_in_smem=self.probs_in_smem,
            pages_per_step=self.pages_per_step,
            num_stages=self.num_stages,
        )


class Case(NamedTuple):
    """One case's rotating inputs: every set its own pages of one pool; the tables' offsets
    are the same in every set, only the page numbers differ (so they stay concrete, and the
    shared-level kernel's tiles and split are those of a concrete level)."""

    name: str
    num_sets: int
    bytes_per_set: int
    queries: jax.Array  # [S, B, L, H, D]
    k_pages: jax.Array  # [num_pages, KVH, 16, D]
    v_pages: jax.Array
    plain: paged.PageTable  # page_indices [S, n]; the rest of set 0
    shared: SharedLevel  # group_pages.page_indices [S, n]
    own: paged.PageTable  # page_indices [S, n]
    plain_plan: object
    own_plan: object


@functools.partial(jax.jit, static_argnums=(1, 2))
def _random_inputs(key, pool_shape, q_shape):
    """Standard normal K and V pools and queries, bfloat16, generated on the device in one
    program."""
    key_k, key_v, key_q = jax.random.split(key, 3)
    return (
        jax.random.normal(key_k, pool_shape, jnp.bfloat16),
        jax.random.normal(key_v, pool_shape, jnp.bfloat16),
        jax.random.normal(key_q, q_shape, jnp.bfloat16),
    )


def make_case(group, prefix, *, suffix, q_len, shape, num_sets=None, seed=0) -> Case:
    num_q_heads, num_kv_heads, head_dim = (
        shape["num_q_heads"],
        shape["num_kv_heads"],
        shape["head_dim"],
    )
    prefix_pages = prefix // PAGE_SIZE
    own_pages = -(-suffix // PAGE_SIZE)
    pages_per_set = prefix_pages + group * own_pages
    page_bytes = 2 * num_kv_heads * PAGE_SIZE * head_dim * 2  # K and V, bfloat16
    bytes_per_set = pages_per_set * page_bytes
    if num_sets is None:
        num_sets = num_rotating_sets(bytes_per_set)
    rng = np.random.default_rng(seed)
    order = rng.permutation(num_sets * pages_per_set).astype(np.int32)
    lens = [prefix + suffix] * group
    plain_indices, shared_indices, own_indices = [], [], []
    levels = table = None
    for s in range(num_sets):
        pages = order[s * pages_per_set : (s + 1) * pages_per_set]
        shared_pages = pages[:prefix_pages].tolist()
        own = pages[prefix_pages:].reshape(group, own_pages).tolist()
        table = paged.PageTable.from_page_lists(
            [shared_pages + row for row in own], lens, PAGE_SIZE
        )
        levels = cascade_levels_from_shared_prefix(table, [list(range(group))], [prefix])
        plain_indices.append(np.asarray(table.page_indices))
        shared_indices.append(np.asarray(levels.shared[0].group_pages.page_indices))
        own_indices.append(np.asarray(levels.own.page_indices))
    level = levels.shared[0]
    pool_shape = (num_sets * pages_per_set, num_kv_heads, PAGE_SIZE, head_dim)
    q_shape = (num_sets, group, q_len, num_q_heads, head_dim)
    k_pages, v_pages, queries = _random_inputs(jax.random.key(seed), pool_shape, q_shape)
    plain = paged.PageTable(
        table.page_indptr, jnp.asarray(np.stack(plain_indices)), table.last_page_len, PAGE_SIZE
    )
    shared = SharedLevel(
        group_pages=paged.PageTable(
            level.group_pages.page_indptr,
            jnp.asarray(np.stack(shared_indices)),
            level.group_pages.last_page_len,
            PAGE_SIZE,
        ),
        group_indptr=level.group_indptr,
        group_requests=level.group_requests,
    )
    own = paged.PageTable(
        levels.own.page_indptr,
        jnp.asarray(np.stack(own_indices)),
        levels.own.last_page_len,
        PAGE_SIZE,
    )
    plain_plan = paged.plan_decode(table, num_q_heads, num_kv_heads, head_dim)
    own_plan = paged.plan_decode(levels.own, num_q_heads, num_kv_heads, head_dim)
    return Case(
        name=f"B={group} prefix={prefix} suffix={suffix}" + (f" L={q_len}" if q_len > 1 else ""),
        num_sets=num_sets,
        bytes_per_set=bytes_per_set,
        queries=queries,
        k_pages=k_pages,
        v_pages=v_pages,
        plain=plain,
        shared=shared,
        own=own,
        plain_plan=plain_plan,
        own_plan=own_plan,
    )


def operands_of(case: Case) -> tuple:
    """What a timed loop passes its steps as arguments (arrays a step closes over would be
    embedded in its program as constants): queries, the pool, every set's page numbers."""
    return (
        case.queries,
        case.k_pages,
        case.v_pages,
        case.plain.page_indices,
        case.shared.group_pages.page_indices,
        case.own.page_indices,
    )


def _set_tables(case: Case, set_index, operands):
    """The set's plain table, shared level and own level: the set's page numbers (from
    ``operands``, traced in a timed loop) and the case's offsets (concrete)."""
    plain_indices, shared_indices, own_indices = operands[3:]
    plain = paged.PageTable(
        case.plain.page_indptr,
        plain_indices[set_index],
        case.plain.last_page_len,
        PAGE_SIZE,
    )
    shared = SharedLevel(
        group_pages=paged.PageTable(
            case.shared.group_pages.page_indptr,
            shared_indices[set_index],
            case.shared.group_pages.last_page_len,
            PAGE_SIZE,
        ),
        group_indptr=case.shared.group_indptr,
        group_requests=case.shared.group_requests,
    )
    own = paged.PageTable(
        case.own.page_indptr, own_indices[set_index], case.own.last_page_len, PAGE_SIZE
    )
    return plain, shared, own


def arm_steps(case: Case, variants, interpret: bool, *, parts: bool = True) -> dict:
    """name -> ``step(set_index, operands) -> (o [B, L, H, D], lse [B, L, H])`` (``shared:``
    and ``own`` arms, left out without ``parts``, return their partial state)."""
    sm_scale = 1.0 / np.sqrt(case.queries.shape[-1])
    # The plain arm and the own level run what backend="auto" runs on a GPU (the Mosaic GPU
    # decode kernel for these shapes since 2026-12-02); interpreted, the Triton kernel, whose
    # interpreter is the faster of the two on a CPU.
    decode = dict(sm_scale=sm_scale, return_lse=True, backend="pallas" if interpret else "auto")

    def plain_step(set_index, operands):
        queries, k_pages, v_pages = operands[:3]
        plain, _, _ = _set_tables(case, set_index, operands)
        return paged.decode_attention(
            queries[set_index],
            paged.KVCache(k_pages, v_pages, "HND"),
            plain,
            plan=case.plain_plan,
            **decode,
        )

    def own_step(set_index, operands):
        queries, k_pages, v_pages = operands[:3]
        _, _, own = _set_tables(case, set_index, operands)
        return paged.decode_attention(
            queries[set_index],
            paged.KVCache(k_pages, v_pages, "HND"),
            own,
            plan=case.own_plan,
            **decode,
        )

    def shared_plan(variant):
        # On the host, once a case and variant (outside the timed loop, as the plain arm's
        # plan_decode): the offsets are the same in every set, only page numbers rotate.
        _, shared, _ = _set_tables(case, 0, operands_of(case))
        batch, q_len, num_q_heads, head_dim = case.queries.shape[1:]
        return plan_shared_level(
            shared,
            batch=batch,
            q_len=q_len,
            num_q_heads=num_q_heads,
            num_kv_heads=case.k_pages.shape[1],
            head_dim=head_dim,
            dtype=case.queries.dtype,
            **variant.launch(),
        )

    def shared_step(set_index, operands, variant, plan=None):
        queries, k_pages, v_pages = operands[:3]
        _, shared, _ = _set_tables(case, set_index, operands)
        return shared_level_states_mgpu(
            queries[set_index],
            paged.KVCache(k_pages, v_pages, "HND"),
            shared,
            sm_scale=sm_scale,
            interpret=interpret,
            plan=plan,
            **variant.launch(),
        )

    def cascade_step(set_index, operands, variant, plan=None):
        shared_o, shared_lse = shared_step(set_index, operands, variant, plan)
        own_o, own_lse = own_step(set_index, operands)
        o, lse = paged.merge_states(
            jnp.stack([shared_o, own_o.astype(jnp.float32)], axis=2),
            jnp.stack([shared_lse, own_lse], axis=2),
        )
        return o.astype(case.queries.dtype), lse

    arms = {"plain": plain_step}
    for name in variants:
        variant = Variant.parse(name)
        plan = shared_plan(variant)
        arms[f"cascade:{name}"] = lambda i, ops, v=variant, p=plan: cascade_step(i, ops, v, p)
    first = Variant.parse(variants[0])
    first_plan = shared_plan(first)
    # The tile layout and work items computed on the device in the call, as without a plan.
    arms[f"cascade-traced:{variants[0]}"] = lambda i, ops: cascade_step(i, ops, first)
    if parts:
        arms[f"shared:{variants[0]}"] = lambda i, ops: shared_step(i, ops, first, first_plan)
        arms["own"] = own_step
    return arms


def check_against_reference(case: Case, o, lse) -> float:
    """Relative error of a cascade arm's output on set 0 (``o [B, L, H, D]``, ``lse [B, L,
    H]``, as ``check_arm`` ran it) against the float32 reference of the whole attention
    (``paged.cascade.cascade_decode_attention_reference``, tested equal to plain decode's; it
    gathers the prefix once, where plain decode's reference would gather it once a request,
    35 GB at 128 x 32K): the shared level, the own level and their merge together, without
    running the kernel again. Raises if it is 1e-2 or more, or the LSE is 1e-2 or more off,
    or anything is not finite."""
    _, shared, own = _set_tables(case, 0, operands_of(case))
    levels = CascadeLevels(shared=(shared,), own=own)
    f32 = paged.KVCache(case.k_pages.astype(jnp.float32), case.v_pages.astype(jnp.float32), "HND")
    ref_o, ref_lse = jax.jit(
        lambda q, c, levels: cascade_decode_attention_reference(
            q, c, levels, sm_scale=1.0 / np.sqrt(q.shape[-1])
        )
    )(case.queries[0].astype(jnp.float32), f32, levels)
    o, ref_o = np.asarray(o, np.float64), np.asarray(ref_o, np.float64)
    error = float(np.linalg.norm(o - ref_o) / np.linalg.norm(ref_o))
    lse_diff = float(np.max(np.abs(np.asarray(lse) - np.asarray(ref_lse))))
    if not (np.isfinite(o).all() and error < 1e-2 and lse_diff < 1e-2):
        raise AssertionError(
            f"cascade off the float32 reference: relative error {error:.3g}, "
            f"max|lse - ref| {lse_diff:.3g}"
        )
    return error


def first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for cascade_shared_probe.json")
    parser.add_argument("--smoke", action="store_true", help="one tiny interpreted case")
    parser.add_argument("--cases", default=None, help="comma-separated BxPREFIX")
    parser.add_argument("--crossover", action="store_true", help="add prefixes 256 to 2048")
    parser.add_argument("--variants", default=None, help="comma-separated, e.g. ring.reg.p4.s3")
    parser.add_argument("--suffix", type=int, default=None, help=f"default {SUFFIX_TOKENS}")
    parser.add_argument("--q-len", type=int, default=1, help="new tokens a request")
    parser.add_argument(
        "--parts", action="store_true", help="also time the shared level and the own level alone"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=BUDGET_SECONDS)
    parser.add_argument("-v", "--verbose", action="store_true", help="full tracebacks")
    args = parser.parse_args(argv)
    interpret = args.smoke or jax.default_backend() != "gpu"
    started = time.monotonic()
    if args.smoke:
        cases, shape = (SMOKE_CASE,), SMOKE_SHAPE
        suffix = args.suffix or SMOKE_SUFFIX_TOKENS
        variants = SMOKE_VARIANTS
    else:
        cases, shape = CASES + (CROSSOVER_CASES if args.crossover else ()), SHAPE
        suffix = args.suffix or SUFFIX_TOKENS
        variants = VARIANTS
    if args.cases:
        cases = tuple(tuple(int(n) for n in c.split("x")) for c in args.cases.split(","))
    for group, prefix in cases:
        # make_case gives the prefix whole pages (a prefix ending mid-page would need each
        # request's copy of its last page): a bad case stops the probe before any work.
        if group < 1 or prefix < PAGE_SIZE or prefix % PAGE_SIZE:
            raise ValueError(
                f"case {group}x{prefix}: the group must hold a request and the prefix be a "
                f"positive multiple of {PAGE_SIZE} tokens"
            )
    if args.variants:
        variants = tuple(args.variants.split(","))
    for name in variants:
        Variant.parse(name)  # a bad name stops the probe before any work

    def out_of_time() -> bool:
        return time.monotonic() - started > args.budget_s

    rows = []
    reference_checked = False

    def write_report():
        # After every case, so that a run cut by its timeout keeps the cases it finished.
        if not args.out:
            return
        folder = pathlib.Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        document = dict(
            probe="bench/probes/cascade_shared.py",
            device=jax.devices()[0].device_kind,
            jax_version=jax.__version__,
            smoke=args.smoke,
            shape=shape,
            suffix=suffix,
            q_len=args.q_len,
            repeats=args.repeats,
            elapsed_s=time.monotonic() - started,
            rows=rows,
            summary=summarize(rows),
        )
        (folder / "cascade_shared_probe.json").write_text(json.dumps(document, indent=1))

    for group, prefix in cases:
        if out_of_time():
            rows.append(dict(case=f"B={group} prefix={prefix}", arm="*", status="skipped"))
            print(f"B={group} prefix={prefix}: skipped (time budget)", flush=True)
            continue
        case = make_case(
            group,
            prefix,
            suffix=suffix,
            q_len=args.q_len,
            shape=shape,
            num_sets=2 if args.smoke else None,
        )
        print(
            f"# {case.name}: {case.num_sets} sets of {case.bytes_per_set / 2**20:.0f} MiB",
            flush=True,
        )
        operands = operands_of(case)
        checked = dict(plain_out=None, loops={}, outputs={})

        def check_arm(
            arm, step, group=group, prefix=prefix, case=case, operands=operands, checked=checked
        ):
            """Runs the arm once; keeps it for timing if its output is finite and, for a
            cascade arm, within MAX_DIFFERENCE of plain decode's."""
            loop = TimedLoop(step, case.num_sets, operands)
            row = dict(case=case.name, group=group, prefix=prefix, suffix=suffix, arm=arm)
            rows.append(row)
            try:
                o, lse = loop.output(0)
                o, lse = np.asarray(o, np.float32), np.asarray(lse, np.float32)
            except Exception as failure:
                row.update(status="failed", error=first_line(failure))
                print(f"{case.name:>30} {arm:>24} FAILED {row['error']}", flush=True)
                if args.verbose:
                    traceback.print_exc()
                return
            ok = bool(np.isfinite(o).all())
            if arm == "plain":
                checked["plain_out"] = (o, lse)
            elif arm.startswith(("cascade:", "cascade-traced:")) and checked["plain_out"]:
                plain_o, plain_lse = checked["plain_out"]
                o_diff = float(np.max(np.abs(o - plain_o)))
                lse_diff = float(np.max(np.abs(lse - plain_lse)))
                ok = ok and o_diff <= MAX_DIFFERENCE and lse_diff <= MAX_DIFFERENCE
                row.update(max_abs_diff_o=o_diff, max_abs_diff_lse=lse_diff)
                print(
                    f"{case.name:>30} {arm:>24} max|o - plain| = {o_diff:.3g}  "
                    f"max|lse - plain| = {lse_diff:.3g}" + ("" if ok else "  MISMATCH"),
                    flush=True,
                )
            row.update(status="ok" if ok else "mismatch")
            if ok:
                checked["loops"][arm] = (loop, row)
                checked["outputs"][arm] = (o, lse)

        for arm, step in arm_steps(case, variants, interpret, parts=args.parts).items():
            check_arm(arm, step)
        passed = [arm for arm in checked["loops"] if arm.startswith("cascade:")]
        if not passed and not args.smoke and FALLBACK_VARIANT not in variants:
            # No variant ran (the ring has not yet run compiled): the pipeline that has.
            print(f"# no cascade arm passed: trying {FALLBACK_VARIANT}", flush=True)
            fallback = arm_steps(case, (FALLBACK_VARIANT,), interpret, parts=False)
            check_arm(f"cascade:{FALLBACK_VARIANT}", fallback[f"cascade:{FALLBACK_VARIANT}"])
            passed = [arm for arm in checked["loops"] if arm.startswith("cascade:")]
        if not reference_checked and passed:
            try:
                relative = check_against_reference(case, *checked["outputs"][passed[0]])
                print(f"# {passed[0]} vs float32 reference: {relative:.2e} relative", flush=True)
            except Exception as error:
                print(f"# {passed[0]} vs reference FAILED: {first_line(error)}", flush=True)
                if args.verbose:
                    traceback.print_exc()
                rows.append(
                    dict(
                        case=case.name,
                        arm="reference-check",
                        status="failed",
                        error=first_line(error),
                    )
                )
            reference_checked = True
        loops = checked["loops"]
        if args.smoke:  # the timed loop's code path once (each arm's loop is a compilation)
            loops = dict([(arm, loops[arm]) for arm in passed][:1])
        for arm, (loop, row) in loops.items():
            if out_of_time():
                row.update(status="skipped", error="time budget spent")
                continue
            try:
                timing = loop.time(
                    iters=2 if args.smoke else None,
                    repeats=1 if args.smoke else args.repeats,
                    target_seconds=0.2,
                    expected_us_per_call=200.0,
                )
            except Exception as error:
                row.update(status="failed", error="timing: " + first_line(error))
                print(f"{case.name:>30} {arm:>24} timing FAILED {row['error']}", flush=True)
                continue
            if args.smoke:
                continue
            row.update(median_us=timing.median_us, min_us=timing.min_us, max_us=timing.max_us)
            print(f"{case.name:>30} {arm:>24} {timing.median_us:10.1f} us", flush=True)
        del case, operands, loops, checked
        write_report()
    summary = summarize(rows)
    write_report()
    print_summary(summary, smoke=args.smoke)
    print(f"\n# {time.monotonic() - started:.0f} s")
    return 0


def summarize(rows) -> list[dict]:
    """Per case: plain's time, the best cascade arm and its time, plain over cascade."""
    by_case: dict[str, dict] = {}
    for row in rows:
        if "median_us" in row:
            by_case.setdefault(row["case"], dict(group=row["group"], prefix=row["prefix"]))[
                row["arm"]
            ] = row["median_us"]
    summary = []
    for name, times in by_case.items():
        cascades = {arm: t for arm, t in times.items() if arm.startswith("cascade:")}
        entry = dict(case=name, group=times["group"], prefix=times["prefix"])
        entry["plain_us"] = times.get("plain")
        entry["shared_us"] = next((t for a, t in times.items() if a.startswith("shared:")), None)
        entry["own_us"] = times.get("own")
        if cascades:
            best = min(cascades, key=cascades.get)
            entry.update(best_cascade=best, cascade_us=cascades[best])
            if entry["plain_us"]:
                entry["plain_over_cascade"] = entry["plain_us"] / cascades[best]
        summary.append(entry)
    return summary


def print_summary(summary, *, smoke: bool) -> None:
    if smoke:
        print("\n# smoke run, no figures")
        return
    print(
        f"\n{'case':>30} {'plain us':>10} {'cascade us':>11} {'ratio':>7}  best arm"
        f"  (shared us, own us)"
    )
    for entry in summary:
        ratio = entry.get("plain_over_cascade")
        print(
            f"{entry['case']:>30} {entry['plain_us'] or float('nan'):10.1f} "
            f"{entry.get('cascade_us', float('nan')):11.1f} "
            f"{ratio if ratio else float('nan'):7.2f}  {entry.get('best_cascade', '-')}"
            f"  ({entry['shared_us'] or float('nan'):.1f}, {entry['own_us'] or float('nan'):.1f})"
        )
    # Where cascade starts to pay: per group size, the shortest prefix measured with a ratio
    # above 1 whose longer prefixes all pay too.
    for group in sorted({e["group"] for e in summary}):
        measured = sorted(
            (e["prefix"], e.get("plain_over_cascade")) for e in summary if e["group"] == group
        )
        paying = [p for p, r in measured if r and r > 1.0]
        losing = [p for p, r in measured if r and r <= 1.0]
        start = next(
            (p for p, _ in measured if all(r and r > 1.0 for q, r in measured if q >= p)), None
        )
        print(
            f"# B={group}: cascade pays from prefix {start} (paying {paying}, not {losing})"
            if start is not None
            else f"# B={group}: cascade does not pay at any measured prefix ({losing})"
        )


if __name__ == "__main__":
    raise SystemExit(main())
