"""Probe: one ragged attention launch for a mixed step against the engine's two launches
(issue 18). Written for the H200; not yet run there, so nothing it measures is known.

A mixed step: ``B`` decode rows at ``context`` tokens each, plus one prompt chunk of ``chunk``
tokens after ``prefix`` tokens already in the cache (Llama-3-8B attention: 32 query heads, 8 KV
heads, head_dim 128, page 16, bfloat16, HND pool). Every arm computes the step's attention
output for all ``B + chunk`` new tokens:

- ``two_launches``: what the engine runs today, ``paged.decode_attention`` over the decode rows
  (``[B, H, D]``, with the step's ``paged.plan_decode`` plan) and then over the chunk as
  ``paged.prefill_attention`` calls it (``[1, chunk, H, D]`` against the table ending at the
  chunk's last token; the append that precedes it is left out, as the ragged arm appends
  nothing), both ``backend="auto"``;
- ``decode_only``, ``chunk_only``: its two parts alone (timed, for the sum; checked as part of
  ``two_launches``; not in a dry run);
- ``ragged:<p path>.p<pages_per_step>.s<num_stages>``: the one launch of
  ``kernels_pallas/ragged_attention_mgpu.py`` over ``plan_ragged``'s items (made once on the host,
  as a step's plan would be; no split-KV), p from registers (``reg``) or shared memory
  (``smem``);
- ``ragged-split<N>:...``: the same with split-KV, ``N`` pages an item at most, and the merge
  launch (``run_ragged_plan``); ``--max-pages-per-item N`` sets ``N`` for every variant.

First the ragged arms' outputs are compared with ``two_launches``' (``part_errors``: the
relative error of the decode rows' ``o`` and of the chunk's, each part on its own); an arm with
either above ``TOLERANCE`` is a MISMATCH and not timed, an arm that fails
to compile is reported and left out (if ``two_launches`` fails, the ragged arms are reported
unchecked and not run). Then every arm is timed with the suite's method
(``bench.harness.timing.TimedLoop``: rotating input sets over one pool for a cold L2, dispatch
amortized in one jitted loop, median of repeats), a table is printed, and the rows go to
``--out/ragged_attention_probe.json`` (rewritten after every case, so a run cut short keeps
the cases it finished).

Usage (GPU): ``PYTHONPATH=. python3 -m bench.probes.ragged_attention --out DIR`` (``--cases
32x4096+256@0,32x4096+2048@4096`` for a subset: ``BxCONTEXT+CHUNK@PREFIX``; ``--variants
reg.p1.s4``). ``--dry-run`` runs tiny cases on a CPU (the ragged kernel in Mosaic GPU's
interpret mode, the two launches on their ``"auto"`` backend, which is the reference there): the
checks and code paths, no timing (``tests/test_ragged_attention.py`` runs it).

``--memcheck`` instead runs a small ragged workload to put under NVIDIA's memcheck (interpret
mode cannot show a read outside an array; memcheck on the compiled kernel can), with the
platform allocator so that every array is its own allocation::

    XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false \\
        compute-sanitizer --tool memcheck python3 -m bench.probes.ragged_attention --memcheck

It covers decode rows (one token, a page plus one, more pages than a 4-entry index window),
idle slots, chunks after a prefix and without one, tiles at every offset of their TMA tile
(``G = 2``) and full 64-row tiles (``G = 8``), a pool and ``page_indices`` sized exactly to the
pages in use, the last token's rows at the end of ``q``, padding items, a split plan (partial
states, then the merge), both p paths, one and two pages a step, and a table with page
numbers outside the pool; it exits 1 if a valid
input's result is off (relative error 1e-2 against the reference on the CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import paged
from bench.harness import num_rotating_sets
from bench.harness.timing import TimedLoop
from kernels_pallas.ragged_attention_mgpu import plan_ragged, run_ragged_plan

# (decode rows, their context, chunk, prefix): issue 18's mixed steps.
CASES = (
    (32, 4096, 256, 0),
    (32, 4096, 512, 0),
    (32, 4096, 2048, 0),
    (32, 4096, 256, 4096),
    (32, 4096, 512, 4096),
    (32, 4096, 2048, 4096),
)
DRY_RUN_CASES = ((2, 17, 9, 33),)  # a chunk after a prefix, tiles at an odd offset
SHAPE = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
DRY_RUN_SHAPE = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
# (p path, pages_per_step, num_stages): the register path, the compiled default (the
# shared-memory path, what the interpreter runs, with --variants smem.p1.s4).
VARIANTS = (("reg", 1, 4), ("reg", 2, 3))
# (max_pages_per_item, p path, pages_per_step, num_stages): split-KV plus the merge launch.
# 64 pages (1K keys) a program: a decode row at 4K becomes 4 items.
SPLIT_VARIANTS = ((64, "reg", 1, 4),)
# A dry run's one ragged arm is split (one page an item): the kernel and the merge, the plans
# as operands of the timed program.
DRY_RUN_VARIANTS = ()
DRY_RUN_SPLIT_VARIANTS = ((1, "smem", 1, 4),)
# ||o - two_launches|| / ||two_launches|| of each part (docs/testing.md's bound for 16-bit
# outputs; both sides are rounded to bfloat16, about 2e-3 apart). Relative, per part: at 4K keys
# a decode row's o is of order 0.03 (a softmax over ~1500 effective keys averages the values),
# so an absolute bound of 5e-2 passed a decode arm that dropped 4 pages of every row (12%
# error), and in one norm over the step the chunk's early tokens (o of order 1) hide the rows.
TOLERANCE = 1e-2


def case_name(batch, context, chunk, prefix) -> str:
    return f"{batch}x{context}+{chunk}@{prefix}"


def variant_name(probs_path: str, pages_per_step: int, num_stages: int) -> str:
    return f"{probs_path}.p{pages_per_step}.s{num_stages}"


@dataclasses.dataclass
class MixedStep:
    """One case's rotating inputs: a pool holding ``num_sets`` disjoint sets of pages.

    Per set (leading axis ``num_sets``): ``q [T, H, D]`` (decode rows first, then the chunk);
    the whole step's table (``page_indices``; its ``page_indptr`` and ``last_page_len`` are the
    same for every set, as are the plans); the decode rows' table (the first ``B`` requests of
    it) and the chunk's (its one request).
    """

    batch: int
    chunk: int
    num_sets: int
    queries: jax.Array  # [num_sets, T, H, D]
    k_pages: jax.Array  # [num_pool_pages, KVH, page_size, D]
    v_pages: jax.Array
    page_indptr: np.ndarray  # [B + 2], the step's table
    last_page_len: np.ndarray  # [B + 1]
    page_indices: jax.Array  # [num_sets, nnz]
    chunk_page_indices: jax.Array  # [num_sets, chunk pages]
    qo_indptr: np.ndarray  # [B + 2]
    kv_bytes_per_set: int
    page_size: int

    def table(self, set_index):
        """The step's table of set ``set_index`` (traced index fine)."""
        return paged.PageTable(
            jnp.asarray(self.page_indptr),
            self.page_indices[set_index],
            jnp.asarray(self.last_page_len),
            self.page_size,
        )

    def decode_table(self, set_index):
        return paged.PageTable(
            jnp.asarray(self.page_indptr[: self.batch + 1]),
            self.page_indices[set_index],
            jnp.asarray(self.last_page_len[: self.batch]),
            self.page_size,
        )

    def chunk_table(self, set_index):
        chunk_pages = self.page_indptr[-1] - self.page_indptr[-2]
        return paged.PageTable(
            jnp.asarray([0, chunk_pages], jnp.int32),
            self.chunk_page_indices[set_index],
            jnp.asarray(self.last_page_len[-1:]),
            self.page_size,
        )


def make_mixed_step(
    batch, context, chunk, prefix, *, num_q_heads, num_kv_heads, head_dim, page_size, num_sets=None
) -> MixedStep:
    """Random normal bfloat16 queries and pool (generated on the device), each set's pages a
    random permutation of its own part of the pool."""
    seq_lens = [context] * batch + [prefix + chunk]
    pages_per_set = sum(-(-n // page_size) for n in seq_lens)
    kv_bytes = 2 * sum(seq_lens) * num_kv_heads * head_dim * 2
    num_sets = num_sets or num_rotating_sets(kv_bytes)
    rng = np.random.default_rng(0)
    tables = [
        paged.PageTable.from_seq_lens(
            seq_lens,
            page_size,
            pages=(s * pages_per_set + rng.permutation(pages_per_set)).tolist(),
            num_indices=pages_per_set,
        )
        for s in range(num_sets)
    ]
    page_indptr = np.asarray(tables[0].page_indptr)
    shape = (num_sets * pages_per_set, num_kv_heads, page_size, head_dim)
    keys = jax.random.split(jax.random.key(0), 3)
    num_tokens = batch + chunk
    return MixedStep(
        batch=batch,
        chunk=chunk,
        num_sets=num_sets,
        queries=jax.random.normal(
            keys[0], (num_sets, num_tokens, num_q_heads, head_dim), jnp.bfloat16
        ),
        k_pages=jax.random.normal(keys[1], shape, jnp.bfloat16),
        v_pages=jax.random.normal(keys[2], shape, jnp.bfloat16),
        page_indptr=page_indptr,
        last_page_len=np.asarray(tables[0].last_page_len),
        page_indices=jnp.stack([t.page_indices for t in tables]),
        chunk_page_indices=jnp.stack([t.page_indices[page_indptr[-2] :] for t in tables]),
        qo_indptr=np.asarray([*range(batch + 1), batch + chunk], np.int32),
        kv_bytes_per_set=kv_bytes,
        page_size=page_size,
    )


def arms_for(step: MixedStep, variants, split_variants, interpret: bool, *, parts: bool = True):
    """name -> ``step_fn(set_index, operands) -> o [T, H, D]`` (or a part of it, with
    ``parts``), the operands, and the unsplit ragged plan (plans made once, on the host, from
    set 0's table, as a step's plans are)."""
    num_kv_heads = step.k_pages.shape[1]
    num_q_heads, head_dim = step.queries.shape[-2:]
    sm_scale = head_dim**-0.5
    decode_plan = paged.plan_decode(step.decode_table(0), num_q_heads, num_kv_heads, head_dim)
    plans = {
        max_pages: plan_ragged(
            step.qo_indptr,
            step.page_indptr,
            step.last_page_len,
            page_size=step.page_size,
            group_size=num_q_heads // num_kv_heads,
            max_pages_per_item=max_pages or None,
        )
        for max_pages in {0} | {v[0] for v in split_variants}  # 0: unsplit
    }
    batch = step.batch

    def decode_part(set_index, operands):
        queries, k_pages, v_pages, _, decode_plan, _ = operands
        cache = paged.KVCache(k_pages, v_pages, "HND")
        return paged.decode_attention(
            queries[set_index, :batch],
            cache,
            step.decode_table(set_index),
            sm_scale=sm_scale,
            plan=decode_plan,
            backend="auto",
        )

    def chunk_part(set_index, operands):
        queries, k_pages, v_pages, *_ = operands
        cache = paged.KVCache(k_pages, v_pages, "HND")
        return paged.decode_attention(
            queries[set_index, batch:][None],
            cache,
            step.chunk_table(set_index),
            sm_scale=sm_scale,
            backend="auto",
        )[0]

    def two_launches(set_index, operands):
        return jnp.concatenate([decode_part(set_index, operands), chunk_part(set_index, operands)])

    arms = {"two_launches": two_launches}
    if parts:
        arms.update(decode_only=decode_part, chunk_only=chunk_part)

    def ragged_arm(max_pages, probs_path, pages_per_step, num_stages):
        write_final = plans[max_pages].write_final  # read on the host, static in the program

        def ragged(set_index, operands):
            queries, k_pages, v_pages, page_indices, _, ragged_plans = operands
            return run_ragged_plan(
                queries[set_index],
                k_pages,
                v_pages,
                page_indices[set_index],
                ragged_plans[max_pages],
                batch=batch + 1,
                write_final=write_final,
                sm_scale=sm_scale,
                pages_per_step=pages_per_step,
                num_stages=num_stages,
                probs_in_smem=probs_path == "smem",
                interpret=interpret,
            )

        return ragged

    for variant in variants:
        arms["ragged:" + variant_name(*variant)] = ragged_arm(0, *variant)
    for max_pages, *variant in split_variants:
        arms[f"ragged-split{max_pages}:" + variant_name(*variant)] = ragged_arm(max_pages, *variant)
    operands = (
        step.queries,
        step.k_pages,
        step.v_pages,
        step.page_indices,
        jax.device_put(decode_plan),
        {
            max_pages: type(plan)(*(jnp.asarray(a) for a in plan))
            for max_pages, plan in plans.items()
        },
    )
    return arms, operands, plans[0]


def memcheck_workload(interpret: bool) -> int:
    """The ``--memcheck`` workload (module docstring); returns the exit status."""
    from paged.ragged_attention import ragged_attention_reference

    rng = np.random.default_rng(0)
    page_size, num_kv_heads, head_dim = 16, 2, 64
    new_tokens = [1, 0, 1, 40, 1, 9, 0, 13]
    seq_lens = [1, 5, 17, 40, 100, 70, 0, 13]  # the last request's tokens end q
    num_pages = sum(-(-n // page_size) for n in seq_lens)
    table = paged.PageTable.from_seq_lens(
        seq_lens, page_size, pages=rng.permutation(num_pages).tolist(), num_indices=num_pages
    )
    shape = (num_pages, num_kv_heads, page_size, head_dim)
    k_pages, v_pages = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(2))
    qo_indptr = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32)
    cpu = jax.devices("cpu")[0]  # the reference on the CPU: only the kernel under test on the GPU
    paths = ("smem",) if interpret else ("reg", "smem")
    worst, finite = 0.0, True
    for group in (2, 8):
        q = jnp.asarray(
            rng.standard_normal((int(qo_indptr[-1]), num_kv_heads * group, head_dim)),
            jnp.bfloat16,
        )
        expected, _ = ragged_attention_reference(
            jax.device_put(q, cpu),
            jax.device_put(jnp.asarray(qo_indptr), cpu),
            jax.device_put(paged.KVCache(k_pages, v_pages, "HND"), cpu),
            jax.device_put(table, cpu),
            sm_scale=head_dim**-0.5,
        )
        expected = np.asarray(expected, np.float32)
        plan = plan_ragged(
            qo_indptr,
            np.asarray(table.page_indptr),
            np.asarray(table.last_page_len),
            page_size=page_size,
            group_size=group,
        )
        padded = plan_ragged(
            qo_indptr,
            np.asarray(table.page_indptr),
            np.asarray(table.last_page_len),
            page_size=page_size,
            group_size=group,
            num_work_items=plan.num_work_items + 3,
        )
        split = plan_ragged(  # split-KV, padded: partial states and the merge
            qo_indptr,
            np.asarray(table.page_indptr),
            np.asarray(table.last_page_len),
            page_size=page_size,
            group_size=group,
            num_work_items=plan.num_work_items * 8,
            max_pages_per_item=2,
        )
        bad_indices = np.asarray(table.page_indices).copy()
        bad_indices[0], bad_indices[-1] = 10 * num_pages, -3
        for probs_path in paths:
            for pages_per_step in (1, 2):
                for name, work, indices in (
                    ("plan", plan, table.page_indices),
                    ("padded plan", padded, table.page_indices),
                    ("split plan", split, table.page_indices),
                    ("pages outside the pool", plan, jnp.asarray(bad_indices)),
                ):
                    o = run_ragged_plan(
                        q,
                        k_pages,
                        v_pages,
                        indices,
                        work,
                        batch=len(seq_lens),
                        write_final=work.write_final,
                        sm_scale=head_dim**-0.5,
                        pages_per_step=pages_per_step,
                        index_window=4 if pages_per_step == 1 else None,
                        probs_in_smem=probs_path == "smem",
                        return_lse=pages_per_step == 2,
                        interpret=interpret,
                    )
                    o = np.asarray((o[0] if pages_per_step == 2 else o), np.float32)
                    finite &= bool(np.isfinite(o).all())
                    if name == "pages outside the pool":  # wrong but finite, no bad access
                        continue
                    error = np.linalg.norm(o - expected) / np.linalg.norm(expected)
                    worst = max(worst, float(error))
                    print(
                        f"G={group} {probs_path}.p{pages_per_step} {name}: relative error "
                        f"{error:.2e}",
                        flush=True,
                    )
    print(
        f"device {jax.devices()[0].device_kind}; worst relative error {worst:.2e}; finite {finite}"
    )
    return 0 if worst < 1e-2 and finite else 1


def part_errors(o: np.ndarray, expected: np.ndarray, batch: int) -> dict[str, float]:
    """``||o - expected|| / ||expected||`` over the decode rows (``[:batch]``) and over the
    chunk (``[batch:]``), each on its own (NaN anywhere gives NaN, which fails ``<``)."""
    errors = {}
    for part, rows in (("decode", slice(None, batch)), ("chunk", slice(batch, None))):
        reference = np.asarray(expected[rows], np.float64)
        difference = np.asarray(o[rows], np.float64) - reference
        errors[part] = float(np.linalg.norm(difference) / np.linalg.norm(reference))
    return errors


def first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def parse_variant(name: str) -> tuple[str, int, int]:
    """``"reg.p2.s3"`` -> ``("reg", 2, 3)``: how ``p`` reaches ``p @ V`` (``reg`` or ``smem``),
    pages a step, pipeline stages; ValueError naming the bad text otherwise.

    >>> parse_variant("smem.p1.s4")
    ('smem', 1, 4)
    """
    parts = name.split(".")
    if (
        len(parts) != 3
        or parts[0] not in ("reg", "smem")
        or not (parts[1][:1] == "p" and parts[1][1:].isdigit() and int(parts[1][1:]) >= 1)
        or not (parts[2][:1] == "s" and parts[2][1:].isdigit() and int(parts[2][1:]) >= 1)
    ):
        raise ValueError(
            f"--variants entries must look like reg.p1.s4 or smem.p2.s3 (p pages a step, s "
            f"stages), got {name!r}"
        )
    return parts[0], int(parts[1][1:]), int(parts[2][1:])


def chosen_variants(args) -> tuple[tuple, tuple]:
    """``(variants, split_variants)`` from the defaults, ``--variants`` and
    ``--max-pages-per-item``; the split arms are made from the variants finally chosen, so
    ``--variants reg.p1.s4 --max-pages-per-item 32`` splits exactly ``reg.p1.s4``."""
    variants = DRY_RUN_VARIANTS if args.dry_run else VARIANTS
    split_variants = DRY_RUN_SPLIT_VARIANTS if args.dry_run else SPLIT_VARIANTS
    if args.variants:
        variants = tuple(parse_variant(name) for name in args.variants.split(","))
    if args.max_pages_per_item is not None:
        split_variants = tuple(
            (args.max_pages_per_item, *v) for v in (variants if args.max_pages_per_item else ())
        )
    return variants, split_variants


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for ragged_attention_probe.json")
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny cases interpreted on a CPU, no timing"
    )
    parser.add_argument("--cases", default=None, help="comma-separated BxCONTEXT+CHUNK@PREFIX")
    parser.add_argument("--variants", default=None, help="comma-separated, e.g. reg.p1.s4")
    parser.add_argument(
        "--max-pages-per-item",
        type=int,
        default=None,
        help="split arms: this many pages an item, for every variant (0: no split arms)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("-v", "--verbose", action="store_true", help="print full tracebacks")
    parser.add_argument(
        "--memcheck", action="store_true", help="the compute-sanitizer workload, no timing"
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    interpret = args.dry_run or jax.default_backend() != "gpu"
    if args.memcheck:
        return memcheck_workload(interpret)
    cases = DRY_RUN_CASES if args.dry_run else CASES
    if args.cases:
        cases = tuple(
            tuple(
                int(n) for n in case.replace("x", " ").replace("+", " ").replace("@", " ").split()
            )
            for case in args.cases.split(",")
        )
    variants, split_variants = chosen_variants(args)
    shape = DRY_RUN_SHAPE if args.dry_run else SHAPE
    rows, arm_names, status = [], [], 0
    for case in cases:
        name = case_name(*case)
        step = make_mixed_step(*case, **shape, num_sets=2 if args.dry_run else None)
        arms, operands, plan = arms_for(
            step, variants, split_variants, interpret, parts=not args.dry_run
        )
        arm_names = list(dict.fromkeys(arm_names + list(arms)))
        common = dict(
            case=name,
            num_sets=step.num_sets,
            kv_bytes=step.kv_bytes_per_set,
            ragged_work_items=plan.num_work_items,
        )
        print(
            f"# {name}: {plan.num_work_items} ragged work items, {step.num_sets} sets", flush=True
        )
        loops, expected = {}, None
        for arm, step_fn in arms.items():
            loop = TimedLoop(step_fn, step.num_sets, operands)
            row = dict(common, arm=arm)
            rows.append(row)
            if arm.startswith("ragged") and expected is None:  # two_launches failed: no check
                row.update(status="unchecked", error="two_launches failed: nothing to check")
                print(f"{name:>22} {arm:>20} UNCHECKED (two_launches failed)", flush=True)
                status = 1
                continue
            try:
                o = np.asarray(loop.output(0), np.float32)
            except Exception as error:  # a variant that does not compile is a result
                row.update(status="failed", error=first_line(error))
                print(f"{name:>22} {arm:>20} FAILED {row['error']}", flush=True)
                if args.verbose:
                    traceback.print_exc()
                status = 1
                continue
            if arm == "two_launches":  # runs first: the output the others must match
                expected = o
            if arm.startswith("ragged"):
                errors = part_errors(o, expected, step.batch)
                ok = bool(np.isfinite(o).all()) and max(errors.values()) < TOLERANCE
                row.update(
                    status="ok" if ok else "mismatch",
                    relative_error_o=errors,
                    max_abs_diff_o=float(np.max(np.abs(o - expected))),
                )
                print(
                    f"{name:>22} {arm:>20} relative error of o: decode rows "
                    f"{errors['decode']:.2e}, chunk {errors['chunk']:.2e}"
                    + ("" if ok else "  MISMATCH"),
                    flush=True,
                )
                status |= not ok
            else:
                row.update(status="ok")
            if row["status"] == "ok":
                loops[arm] = (loop, row)
        if not args.dry_run:  # interpreted figures mean nothing
            for arm, (loop, row) in loops.items():
                try:
                    timing = loop.time(
                        repeats=args.repeats, target_seconds=0.25, expected_us_per_call=300.0
                    )
                except Exception as error:
                    row.update(status="failed", error="timing: " + first_line(error))
                    print(f"{name:>22} {arm:>20} timing FAILED {row['error']}", flush=True)
                    continue
                row.update(median_us=timing.median_us, min_us=timing.min_us, max_us=timing.max_us)
                print(
                    f"{name:>22} {arm:>20} {timing.median_us:9.2f} us "
                    f"[{timing.min_us:.2f}, {timing.max_us:.2f}]",
                    flush=True,
                )
        for array in (step.queries, step.k_pages, step.v_pages, step.page_indices):
            array.delete()
        if args.out:  # after every case: a run cut by its timeout keeps the cases it finished
            write_rows(pathlib.Path(args.out), rows, dry_run=args.dry_run)
    print_table(rows, arm_names, dry_run=args.dry_run)
    return status


def write_rows(folder: pathlib.Path, rows, *, dry_run: bool) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    document = dict(
        probe="bench/probes/ragged_attention.py",
        device=jax.devices()[0].device_kind,
        jax_version=jax.__version__,
        dry_run=dry_run,
        rows=rows,
    )
    (folder / "ragged_attention_probe.json").write_text(json.dumps(document, indent=1))


def print_table(rows, arm_names, *, dry_run):
    """Median us per case and arm, then two_launches' time over each ragged arm's."""
    print("\n# median us per call" + (" -- dry run, no figures" if dry_run else ""))
    width = max(len(arm) for arm in arm_names) + 2
    print(f"{'case':<24}" + "".join(f"{arm:>{width}}" for arm in arm_names))
    for case in dict.fromkeys(row["case"] for row in rows):
        cells = []
        for arm in arm_names:
            found = [row for row in rows if row["case"] == case and row["arm"] == arm]
            if not found:
                cells.append("")
            elif found[0]["status"] != "ok":
                cells.append(found[0]["status"])
            elif "median_us" in found[0]:
                cells.append(f"{found[0]['median_us']:.1f}")
            else:
                cells.append("-")
        print(f"{case:<24}" + "".join(f"{cell:>{width}}" for cell in cells))
    if dry_run:
        return
    print("\n# two_launches / ragged (above 1: the one launch is faster)")
    for case in dict.fromkeys(row["case"] for row in rows):
        timed = {
            row["arm"]: row["median_us"]
            for row in rows
            if row["case"] == case and "median_us" in row
        }
        if "two_launches" not in timed:
            continue
        ratios = [
            f"{arm}={timed['two_launches'] / us:.2f}x"
            for arm, us in timed.items()
            if arm.startswith("ragged")
        ]
        print(f"{case:<24} " + " ".join(ratios))


if __name__ == "__main__":
    sys.exit(main())
