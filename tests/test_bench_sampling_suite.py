"""The sampling suite of ``python -m bench`` on the CPU: its dry run, partial reports, inputs,
lowering and target notes (apart from ``test_bench.py`` so that the two files, both long, run on
separate test workers)."""

from __future__ import annotations

import contextlib
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import harness
from bench.__main__ import main
from bench.harness import CaseResult, RunOptions, Timing
from bench.suites import peers
from bench.suites import sampling as sampling_suite


def _timing(median_us: float = 1.0) -> Timing:
    return Timing.from_samples([median_us], 1, 2, "jax_loop")


@contextlib.contextmanager
def _compiled_programs_kept_in(directory):
    """JAX's persistent compilation cache in ``directory`` for the body only: a later run of
    the suite's programs (same HLO) loads them instead of compiling them again, which the
    suite's fresh closures would otherwise do. Every program is kept, however fast its
    compile."""
    from jax.experimental.compilation_cache import compilation_cache

    settings = {
        "jax_compilation_cache_dir": str(directory),
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_persistent_cache_min_entry_size_bytes": -1,
    }
    before = {name: getattr(jax.config, name) for name in settings}
    compilation_cache.reset_cache()
    for name, value in settings.items():
        jax.config.update(name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def compiled_programs(tmp_path_factory):
    """One directory of compiled programs for this file's dry runs (``make test`` runs a file's
    tests on one worker, ``--dist loadfile``): the partial-report test runs cases of the full
    dry run, at its batch, and loads their programs rather than compiling them (twice)."""
    return tmp_path_factory.mktemp("compiled_programs")


def test_sampling_dry_run_times_every_decodelab_arm_beside_the_peers(tmp_path, compiled_programs):
    printed = io.StringIO()
    with _compiled_programs_kept_in(compiled_programs), contextlib.redirect_stdout(printed):
        status = main(["sampling", "--dry-run", "--out", str(tmp_path)])
    assert status == 0
    [json_path] = tmp_path.glob("*-sampling.json")
    document = json.loads(json_path.read_text())
    assert document["suite"] == "sampling"
    rows = {(case["case"], case["arm"]): case for case in document["cases"]}
    assert {int(case.split("B=")[1]) for case, _ in rows} == set(sampling_suite.DRY_RUN_BATCHES)
    for batch in sampling_suite.DRY_RUN_BATCHES:
        arms = {arm for case, arm in rows if case == f"gumbel B={batch}"}
        assert {
            "decodelab_reference",
            "decodelab",
            "decodelab_kernel",
            "decodelab (repeat)",
            "jax_categorical",
            "read_only",
        } <= arms
        assert {"jax_sort", "decodelab_reference", "decodelab", "decodelab_kernel"} <= {
            arm for case, arm in rows if case == f"top_p B={batch}"
        }
        for arm in ("decodelab", "decodelab_kernel"):
            row = rows[(f"gumbel B={batch}", arm)]
            assert row["attribution"].endswith(":interpret")
            assert row["same_tokens_as_reference"] == 1.0
        dry_run_methods = [
            method
            for method in sampling_suite.FILTERED_METHODS
            if method.name in sampling_suite.DRY_RUN_KINDS
        ]
        assert {case.split()[0] for case, _ in rows} == set(sampling_suite.DRY_RUN_KINDS)
        for method in dry_run_methods:
            case = f"{method.name} B={batch}"
            assert (case, "decodelab (repeat)") in rows
            for arm in ("decodelab_reference", "decodelab", "decodelab_kernel"):
                row = rows[(case, arm)]
                if arm != "decodelab_kernel":
                    assert row["attribution"].startswith(method.sampler.__name__)
                else:
                    assert row["attribution"].endswith(":interpret")
                if arm != "decodelab_reference":
                    # interpret mode runs the kernel's float operations as written
                    assert row["same_tokens_as_reference"] == 1.0
                assert (
                    1
                    <= row["rounds_mean"]
                    <= row["rounds_max"]
                    <= sampling_suite.DEFAULT_MAX_ROUNDS + 1
                )
                assert row["rounds_rows"] == batch  # every row of the dry run's one set
                assert row["vs_jax_sort_top_p"] > 0
    for case in document["cases"]:
        batch = int(case["case"].split("B=")[1])
        assert case["bytes"] == batch * peers.DRY_RUN_VOCAB * 4
    assert not [note for note in document["notes"] if "failed" in note or "Triton" in note]
    batch = sampling_suite.DRY_RUN_BATCHES[0]
    assert any(note.startswith(f"target gumbel B={batch}") for note in document["notes"])


def test_sampling_part_keeps_a_partial_report_when_the_run_is_cut_short(
    tmp_path, monkeypatch, compiled_programs
):
    """DECODELAB_SAMPLING_CASES runs a part of a batch's cases, a kind outside the dry run's
    defaults too; a run that dies after its first group of arms (here: its repeat row raises,
    as a time limit would strike) leaves those rows in ``<date>-sampling-partial.json``, which
    merge_reports can read; a run that ends replaces the partial files with its report.

    The runs take the joint kind at the dry run's batch, whose programs the dry-run test above
    compiled (``compiled_programs``); the choice of a kind outside ``DRY_RUN_KINDS`` (top_k) is
    checked on ``chosen_kinds``, which decides what a run times."""
    monkeypatch.setenv(sampling_suite.CASES_VARIABLE, "top_k")
    assert "top_k" not in sampling_suite.DRY_RUN_KINDS
    assert sampling_suite.chosen_kinds(RunOptions(dry_run=True)) == ("top_k",)
    monkeypatch.setenv(sampling_suite.CASES_VARIABLE, "joint")
    with _compiled_programs_kept_in(compiled_programs):
        _run_cut_short_then_whole(tmp_path, monkeypatch)


def _run_cut_short_then_whole(out, monkeypatch):
    """The body of the test above, its reports in ``out``."""
    [batch] = sampling_suite.DRY_RUN_BATCHES

    def cut_short(*args, **kwargs):
        raise TimeoutError("cut short")

    with monkeypatch.context() as patch:
        patch.setattr(sampling_suite, "_repeat_row", cut_short)
        with contextlib.redirect_stdout(io.StringIO()), pytest.raises(TimeoutError):
            main(["sampling", "--dry-run", "--batches", str(batch), "--out", str(out)])
    [partial] = out.glob("*-sampling-partial.json")
    document = json.loads(partial.read_text())
    assert document["suite"] == "sampling"
    assert {(case["case"], case["arm"]) for case in document["cases"]} == {
        (f"joint B={batch}", "decodelab_reference"),
        (f"joint B={batch}", "decodelab"),
        (f"joint B={batch}", "decodelab_kernel"),
    }
    assert any(note.startswith("PARTIAL") for note in document["notes"])
    assert not list(out.glob("*-sampling.json"))

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["sampling", "--dry-run", "--batches", str(batch), "--out", str(out)]) == 0
    assert not list(out.glob("*-partial.*"))
    [whole] = out.glob("*-sampling.json")
    cases = {case["case"] for case in json.loads(whole.read_text())["cases"]}
    assert cases == {f"joint B={batch}"}  # no peers: they join the gumbel and top_p cases
    assert f"joint B={batch}: decodelab_kernel done in" in printed.getvalue()


def test_sampling_cases_variable_refuses_an_unknown_kind(monkeypatch):
    monkeypatch.setenv(sampling_suite.CASES_VARIABLE, "top_k,top_q")
    with pytest.raises(
        ValueError, match=r"DECODELAB_SAMPLING_CASES names unknown kinds \['top_q'\]"
    ):
        sampling_suite.chosen_kinds(RunOptions(dry_run=True))


def test_sampling_inputs_are_the_peers_logits_with_a_key_per_set():
    inputs = sampling_suite.make_sampling_inputs(2, 64, 3)
    # The peers' generator with the peers' key for this batch: both arms sample the same logits.
    np.testing.assert_array_equal(
        np.asarray(inputs.logits_sets),
        np.asarray(peers.random_logits(jax.random.key(2), (3, 2, 64))),
    )
    np.testing.assert_allclose(np.asarray(inputs.probs_sets).sum(-1), 1.0, rtol=1e-5)
    row_key_words = np.asarray(inputs.row_key_words).reshape(-1, 2)  # [sets x rows, 2]
    assert len(np.unique(row_key_words, axis=0)) == 3 * 2  # no two rows share a stream
    inputs.delete()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Pallas Triton backend's
def test_sampling_gumbel_arms_lower_to_the_triton_kernel_for_an_h200(
    monkeypatch, verify_triton_modules
):
    """The GPU path of the Gumbel arms at the largest standard case, as far as a CPU can follow
    it: the API (backend="pallas") and raw-kernel programs lower to the Triton kernel for an
    H200, and the reference program to none. Compiling the kernel needs the GPU."""
    from kernels_pallas.gumbel import default_launch

    gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
    h200 = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
    monkeypatch.setitem(gpu_info.registry, jax.devices()[0].device_kind, lambda: h200)
    # The API compiles the kernel when JAX's default backend is a GPU; say it is.
    monkeypatch.setattr(sampling_suite.api, "interpret_mode", lambda: False)
    batch, vocab = 256, peers.VOCAB
    num_sets = harness.num_rotating_sets(batch * vocab * 4)
    key = jax.eval_shape(lambda: jax.random.key(0))
    logits = jax.ShapeDtypeStruct((batch, vocab), jnp.float32)
    words = jax.ShapeDtypeStruct((batch, 2), jnp.uint32)
    inputs = sampling_suite.SamplingInputs(
        batch,
        vocab,
        num_sets,
        [logits] * num_sets,
        [logits] * num_sets,
        [key] * num_sets,
        [words] * num_sets,
    )

    def cuda_text(loop):
        return loop.trace(num_sets).lower(lowering_platforms=("cuda",)).as_text()

    # The kernel's name carries its launch (kernels_pallas/gumbel.py): the default one here.
    launch = default_launch(batch, vocab)
    name = f"gumbel_logits_q{launch['quads']}x{launch['steps']}"
    for loop in (
        sampling_suite.api_gumbel_loop(inputs, "pallas"),
        sampling_suite.kernel_gumbel_loop(inputs, interpret=False),
    ):
        assert peers.triton_kernel_names(cuda_text(loop), "gumbel") == [name]
    reference_text = cuda_text(sampling_suite.api_gumbel_loop(inputs, "reference"))
    assert "__gpu$xla.gpu.triton" not in reference_text


def test_sampling_target_notes_judge_issue_4s_targets():
    def row(case, arm, median_us):  # 8 MB a call on a ceiling of 1 TB/s
        return CaseResult.from_timing(case, arm, arm, _timing(median_us), 8_000_000, 1.0)

    rows = [
        row("gumbel B=256", "decodelab", 10.0),  # 0.8 TB/s: 80% of the ceiling
        row("gumbel B=256", "jax_categorical", 12.0),
        row("top_p B=256", "jax_sort", 1000.0),
        row("top_p B=256", "decodelab", 50.0),  # 20x
        row("top_k B=256", "decodelab", 500.0),  # 2x
        row("min_p B=256", "decodelab_reference", 10.0),  # not the arm the target judges
    ]
    notes = sampling_suite.target_notes(256, rows)
    assert notes[0] == (
        "target gumbel B=256: `decodelab` at 80.0% of the ceiling (target >= 70%: met), "
        "1.20x `jax_categorical` (target > 1: met)"
    )
    assert "20.00x `jax_sort` top-p (target >= 10x: met)" in notes[1]
    assert notes[2].startswith("target top_k B=256") and notes[2].endswith("not met)")
    assert notes[3:] == [
        "target min_p B=256: `decodelab` not measured",
        "target joint B=256: `decodelab` not measured",
    ]
    assert sampling_suite.target_notes(4, rows[2:]) == [
        "target gumbel B=4: `decodelab` not measured"
    ]


# ----------------------------------------------------------------------------------------------
# The fused_ops suite's dry run (fused add + RMSNorm and RoPE + append beside XLA)
