"""Every ``python -m bench tune`` target besides ``paged_decode`` (``test_bench_tune.py``), on
the CPU: a dry run of each times its kernel's real programs (interpreted, tiny shapes) through
both selection stages and writes a table with the target's bucket key and a launch the kernel
accepts; a ``--buckets`` naming other dimensions is refused. A fake factor on one candidate
makes the decision certain (interpreted timings on a CPU are noise)."""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.__main__ import main as bench_main
from bench.harness import RunOptions
from bench.tuning import tune
from kernels_pallas.tuning_tables import load_table


@dataclasses.dataclass(frozen=True)
class DryRun:
    """What one target's dry run must do: ``buckets`` as given on the command line, the key
    written, the candidate made fast and its launch."""

    kernel: str
    buckets: str
    key: str
    fast: str
    launch: dict[str, int]
    other_dimension: str  # a --buckets naming these dimensions is refused


DRY_RUNS = [
    DryRun(
        "merge_states",
        "batch=1,splits=3",
        "head_dim=32,partial_rows=2,num_kv_heads=2,batch=1,splits=4",
        "i4_w4",
        {"items_per_step": 4, "num_warps": 4},
        "context=4096",
    ),
    DryRun(
        "gumbel",
        "batch=1",
        "vocab=1000,batch=1",
        "q256x1_w8_s1",
        {"quads": 256, "steps": 1, "num_warps": 8, "num_stages": 1},
        "vocab=1000",
    ),
    DryRun(
        "dual_pivot",
        "batch=1",
        "vocab=1000,batch=1",
        "b512_w2_s1",
        {"block": 512, "num_warps": 2, "num_stages": 1},
        "batch=1,vocab=1000",
    ),
    DryRun(
        "paged_prefill",
        "chunk=10,context=50",
        "head_dim=32,group_rows=4,page_size=16,chunk=16,context=64",
        "q4_p1_w4_s1",
        {"block_q": 4, "pages_per_step": 1, "num_warps": 4, "num_stages": 1},
        "batch=1,context=64",
    ),
    DryRun(
        "spec_accept",
        "batch=1,drafts=1",
        "vocab=1000,batch=1,drafts=1",
        "b256_w2_s1",
        {"block": 256, "num_warps": 2, "num_stages": 1},
        "batch=1",
    ),
    DryRun(
        "norm",
        "hidden=100,tokens=3",
        "hidden=128,tokens=4",
        "w2",
        {"num_warps": 2},
        "tokens=4",
    ),
    DryRun(
        "rope_append",
        "tokens=3",
        "num_q_heads=4,num_kv_heads=2,head_dim=16,tokens=4",
        "w2",
        {"num_warps": 2},
        "batch=4",
    ),
]


def _target(kernel):
    return importlib.import_module(tune.TARGETS[kernel])


@pytest.mark.parametrize("case", DRY_RUNS, ids=lambda case: case.kernel)
def test_dry_run_tunes_the_kernel_end_to_end(case, tmp_path, capsys):
    runs: dict[str, int] = {}

    def measure_for(session):
        real = tune.HarnessMeasure(
            session.loop_for, RunOptions(dry_run=True), session.expected_us_per_call
        )

        def measure(candidate):
            runs[candidate.name] = runs.get(candidate.name, 0) + 1
            return real(candidate) * (0.01 if candidate.name == case.fast else 1.0)

        return measure

    arguments = [case.kernel, "--dry-run", "--out", str(tmp_path), "--buckets", case.buckets]
    assert tune.main(arguments, measure_for=measure_for) == 0
    printed = capsys.readouterr().out
    assert f"{case.key}: KEPT  {case.fast}" in printed
    # The default and the fast candidate, 2 screening samples each and 2 ABBA blocks (2 + 2).
    assert sorted(runs.values()) == [6, 6] and case.fast in runs

    target = _target(case.kernel)
    table = load_table(case.kernel, "cpu", jax.__version__, target.KERNEL_VERSION, tmp_path)
    assert table["dimensions"] == list(target.DIMENSIONS)
    assert table["bucketed"] == list(target.BUCKETED)
    assert table["entries"] == {case.key: case.launch}
    assert set(case.launch) == set(target.PARAMETERS)
    assert table["provenance"]["decisions"][case.key]["kept"]


@pytest.mark.parametrize("case", DRY_RUNS, ids=lambda case: case.kernel)
def test_buckets_of_other_dimensions_are_refused(case, tmp_path, capsys):
    arguments = ["tune", case.kernel, "--dry-run", "--out", str(tmp_path)]
    assert bench_main([*arguments, "--buckets", case.other_dimension]) == 2
    names = sorted(item.split("=")[0] for item in case.other_dimension.split(","))
    expected = f"--buckets of {case.kernel} name {list(_target(case.kernel).BUCKETED)}"
    assert f"{expected}, got {names}" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("kernel", [case.kernel for case in DRY_RUNS])
def test_standard_buckets_are_powers_of_two_of_the_target_dimensions(kernel):
    target = _target(kernel)
    buckets = target.default_buckets(dry_run=False)
    assert buckets
    for bucket in buckets:
        assert sorted(bucket) == sorted(target.BUCKETED)
        assert all(value >= 1 and value & (value - 1) == 0 for value in bucket.values())


def test_merge_states_standard_buckets_are_the_split_decode_cases():
    """The decode grid splits B=1 at 4096 (32 items) and 32768 (33: the 64 bucket) tokens, and
    B=4 into 8 items; every other case runs unsplit and merges nothing."""
    target = _target("merge_states")
    assert target.default_buckets(dry_run=False) == [
        {"batch": 1, "splits": 32},
        {"batch": 1, "splits": 64},
        {"batch": 4, "splits": 8},
    ]


def test_merge_states_timed_call_merges_its_own_set():
    """Set 1 of the pool merges items 4..7 (not set 0's): the rotating merge_indptr points the
    kernel at the set's own range of the pool."""
    target = _target("merge_states")
    with target.bucket_session({"batch": 1, "splits": 4}, RunOptions(dry_run=True)) as session:
        loop = session.loop_for(session.default)
        o, lse = loop.output(1)
        partial_o, partial_lse, _ = (np.asarray(array, np.float64) for array in loop.operands)
    items = slice(4, 8)
    weights = np.exp(partial_lse[items] - partial_lse[items].max(axis=0))  # [S, KVH, P]
    expected_o = (weights[..., None] * partial_o[items]).sum(0) / weights.sum(0)[..., None]
    expected_lse = partial_lse[items].max(axis=0) + np.log(weights.sum(0))
    # [B, H, D]: head h is KV head h // G, row h % G of its partials (G = 2 = P here).
    np.testing.assert_allclose(
        np.asarray(o, np.float64).reshape(expected_o.shape), expected_o, rtol=1e-2, atol=1e-2
    )
    np.testing.assert_allclose(np.asarray(lse).reshape(expected_lse.shape), expected_lse, rtol=1e-5)


def test_gumbel_candidates_include_the_default_and_cover_the_row():
    target = _target("gumbel")
    from kernels_pallas.gumbel import default_launch

    for batch in (1, 32, 256):
        launches = target.sweep(batch, 128256)
        assert default_launch(batch, 128256) in launches
        assert len({target.launch_name(launch) for launch in launches}) == len(launches)
        for launch in launches:
            # Every chunk holds at least one step: no program reads only padding.
            steps_per_row = -(-128256 // (4 * launch["quads"]))
            assert launch["steps"] <= steps_per_row


@pytest.mark.parametrize(
    ("kernel", "bucket", "message"),
    [
        ("norm", {"hidden": 32768, "tokens": 1}, "hidden must be <= 16384, got 32768"),
        ("paged_prefill", {"chunk": 64, "context": 32}, r"chunk \(64\) exceeds its context \(32\)"),
        ("merge_states", {"batch": 1}, r"names \['batch', 'splits'\], got \['batch'\]"),
    ],
)
def test_bucket_sessions_refuse_shapes_the_kernel_cannot_run(kernel, bucket, message):
    with pytest.raises(ValueError, match=message):
        with _target(kernel).bucket_session(bucket, RunOptions(dry_run=True)):
            pass


def _one_round(loop):
    """The carried state after one round of a ``ChainedCallsLoop`` (every set called once)."""
    return jax.jit(lambda operands: loop.run_rounds(operands, 1))(loop.operands)


def test_rope_append_timed_call_is_the_suites_call():
    """The tuned call passes the kernel what ``paged.rope_append_kv`` passes it: one round
    leaves the same pool and q as the suite's loop on the reference backend."""
    from bench.suites import fused_ops

    options = RunOptions(dry_run=True)
    target = _target("rope_append")
    with target.bucket_session({"tokens": 4}, options) as session:
        ours = _one_round(session.loop_for(session.default))
    inputs = fused_ops.make_rope_inputs(fused_ops.DRY_RUN_ROPE_SHAPE, options)
    expected = _one_round(fused_ops.rope_loop(inputs, "reference"))
    for got, want in zip(ours, expected, strict=True):
        np.testing.assert_allclose(
            np.asarray(got, np.float32),
            np.asarray(want, np.float32),
            atol=fused_ops.DISAGREEMENT_TOLERANCE,
        )


def test_norm_timed_call_is_the_suites_call():
    from bench.suites import fused_ops

    options = RunOptions(dry_run=True)
    target = _target("norm")
    with target.bucket_session({"hidden": 128, "tokens": 4}, options) as session:
        ours = _one_round(session.loop_for(session.candidates[0]))
    inputs = fused_ops.make_norm_inputs(4, 128, options)
    expected = _one_round(fused_ops.norm_loop(inputs, "xla_fused", interpret=True))
    for got, want in zip(jax.tree.leaves(ours), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(
            np.asarray(got, np.float32),
            np.asarray(want, np.float32),
            atol=fused_ops.DISAGREEMENT_TOLERANCE,
        )


def _shaped(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _traced_sweeps():
    """``(kernel, launch, trace)`` for every launch a GPU run tries: ``trace()`` traces the
    kernel with it at a standard shape (``jax.eval_shape``: the kernel's own checks and its
    body's tracing run, nothing is compiled or computed)."""
    from bench.suites import peers
    from bench.suites import prefill as prefill_suite
    from kernels_pallas.dual_pivot import dual_pivot_sample
    from kernels_pallas.gumbel import gumbel_sample
    from kernels_pallas.merge_states import merge_partial_states
    from kernels_pallas.paged_prefill import paged_prefill
    from kernels_pallas.spec_accept import chain_speculative_sample

    vocab, u32, i32 = peers.VOCAB, jnp.uint32, jnp.int32
    for batch in peers.SAMPLING_BATCHES:
        for launch in _target("gumbel").sweep(batch, vocab):
            yield (
                "gumbel",
                launch,
                lambda launch=launch, batch=batch: jax.eval_shape(
                    lambda x, w, t: gumbel_sample(
                        x, w, t, from_logits=True, stream=0, fast_math=False, **launch
                    ),
                    _shaped((batch, vocab)),
                    _shaped((batch, 2), u32),
                    _shaped((batch,)),
                ),
            )
    for launch in _target("dual_pivot").SWEEP:
        yield (
            "dual_pivot",
            launch,
            lambda launch=launch: jax.eval_shape(
                lambda p, w, k, tp, mp: dual_pivot_sample(
                    p, w, k, tp, mp, order="joint", max_rounds=8, stream=0, **launch
                ),
                _shaped((4, vocab)),
                _shaped((4, 2), u32),
                _shaped((4,), i32),
                _shaped((4,)),
                _shaped((4,)),
            ),
        )
    for launch in _target("spec_accept").SWEEP:
        yield (
            "spec_accept",
            launch,
            lambda launch=launch: jax.eval_shape(
                lambda d, ids, t, w: chain_speculative_sample(
                    d, ids, t, w, chunk_size=8192, stream=0, **launch
                ),
                _shaped((4, 4, vocab)),
                _shaped((4, 4), i32),
                _shaped((4, 5, vocab)),
                _shaped((4, 2), u32),
            ),
        )
    shape = prefill_suite.STANDARD_SHAPE
    heads, kv_heads, head_dim = shape["num_q_heads"], shape["num_kv_heads"], shape["head_dim"]
    pool = _shaped((1025, kv_heads, shape["page_size"], head_dim), jnp.bfloat16)
    for launch in prefill_suite.SWEEP:
        yield (
            "paged_prefill",
            launch,
            lambda launch=launch: jax.eval_shape(
                lambda q, k, v, indices, indptr, last: paged_prefill(
                    q,
                    k,
                    v,
                    indices,
                    indptr,
                    last,
                    layout="HND",
                    sm_scale=0.1,
                    logits_soft_cap=None,
                    **launch,
                ),
                _shaped((1, 512, heads, head_dim), jnp.bfloat16),
                pool,
                pool,
                _shaped((1024,), i32),
                _shaped((2,), i32),
                _shaped((1,), i32),
            ),
        )
    for launch in _target("merge_states").SWEEP:
        yield (
            "merge_states",
            launch,
            lambda launch=launch: jax.eval_shape(
                lambda o, lse, indptr: merge_partial_states(
                    o, lse, indptr, num_q_heads=heads, out_dtype=jnp.bfloat16, **launch
                ),
                _shaped((64, kv_heads, 4, head_dim)),
                _shaped((64, kv_heads, 4)),
                _shaped((2,), i32),
            ),
        )


def test_every_gpu_launch_passes_its_kernels_checks():
    """A launch the kernel refuses (a block that is not a power of two, ...) would only show as
    an error in a GPU run's decision; here it fails on the CPU first."""
    traced = {}
    for kernel, launch, trace in _traced_sweeps():
        assert sorted(launch) == sorted(_target(kernel).PARAMETERS), (kernel, launch)
        trace()
        traced[kernel] = traced.get(kernel, 0) + 1
    assert traced == {
        "gumbel": sum(len(_target("gumbel").sweep(b, 128256)) for b in (1, 32, 256)),
        "dual_pivot": 10,
        "spec_accept": 11,
        "paged_prefill": 54,
        "merge_states": 18,
    }
