"""Shared test configuration: hypothesis profiles, float64 references, kernel execution mode.

- Hypothesis profiles: ``ci`` (derandomized, bounded, no deadline; ``make test`` selects it via
  ``HYPOTHESIS_PROFILE=ci``) and ``dev`` (more examples, for local work). Default: ``dev`` unless
  ``CI`` is set.
- ``float64``: a fixture (and context manager ``enable_x64``) that turns on JAX's x64 mode for the
  body of one test only, so float64 references never leak x64 into other tests.
- ``interpret``: Pallas kernels run with ``interpret=True`` on a CPU and compiled on a GPU.
- ``verify_triton_modules``: Triton modules lowered in the test go through the MLIR verifier,
  as the GPU host's parser will.
- CPU computations run without async dispatch (see the comment at the import; it avoids a
  deadlock of Mosaic GPU's interpreter on a two-core machine).
- On a CPU, XLA compiles without its expensive optimizations (``jax_disable_most_optimizations``),
  the suite being compile-bound there, except in modules that set ``CPU_PROGRAMS_OPTIMIZED``.
- Every test module ends with JAX's compilation caches emptied (``_release_compiled_programs``),
  so one long-lived pytest-xdist worker never holds the whole suite's compiled programs at once.
"""

from __future__ import annotations

import contextlib
import gc
import os

import jax
import pytest
from hypothesis import HealthCheck, settings

# CPU computations run inline on the calling thread, not dispatched to XLA's CPU worker pool.
# Mosaic GPU's interpreter runs a kernel of several warpgroups (the MLA kernel's producer and
# consumers) as one jitted computation a warpgroup, each from its own Python thread, meeting at
# barriers inside host callbacks. Dispatched asynchronously, every waiting callback holds one of
# the pool's workers (as many as cores: two in CI), and a warpgroup whose computation cannot get
# a worker never reaches the barrier: a run on two cores stalled for good in
# tests/test_mla_decode_entry.py (all threads' stacks, from faulthandler_timeout). Inline, each
# warpgroup's computation waits on its own Python thread. Set before the CPU client exists.
jax.config.update("jax_cpu_enable_async_dispatch", False)

# Importing ``jax.experimental.pallas.fuser`` registers a value of JAX's tracing context, and the
# first interpreted Pallas kernel of a process imports it lazily: without this import that first
# kernel is keyed without the value and compiled a second time by the next call with the same
# shapes (about 5 s in tests/test_sampling_kernels.py). Imported once here for every module.
import jax.experimental.pallas.fuser  # noqa: E402

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=25,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

ON_GPU = jax.default_backend() == "gpu"

# On a CPU most of the suite's time goes to XLA compiling programs that then run for milliseconds
# (interpret-mode kernels, one program a hypothesis shape): for those modules LLVM's optimizations
# cost more than they save, and the tests check values, not speed. A module whose programs run
# long (thousands of draws for a calibrated statistic, a 4096-token prefill, a benchmark's dry
# run) sets ``CPU_PROGRAMS_OPTIMIZED = True`` and keeps XLA's optimizations: measured on the whole
# suite (2026-12-07), the calibrated sampler tests ran 25x longer without them. The choice is
# made a module at a time because JAX's compilation caches are emptied between modules (below),
# so a module's jitted functions compile afresh under its own choice (a compiled executable that
# library code keeps itself would survive, but only its speed depends on the choice). Not on a GPU,
# where the compiled programs are what the gpu-marked tests exist to check.
OPTIMIZED_MODULE_FLAG = "CPU_PROGRAMS_OPTIMIZED"


def _compile_unoptimized(unoptimized: bool) -> None:
    jax.config.update("jax_disable_most_optimizations", unoptimized and not ON_GPU)


_compile_unoptimized(True)  # the default between modules, doctests included (notebooks run in
# kernels of their own, with XLA's defaults)

# Each program XLA compiles for the CPU is JIT-linked into about three memory mappings, and JAX
# keeps every compiled program until its caches are cleared. One xdist worker runs half the suite
# (tens of thousands of programs: hypothesis shapes, interpret-mode kernels), and once a process
# reaches Linux's vm.max_map_count (65530 by default) LLVM's next allocation fails and the worker
# dies inside backend_compile_and_load (SIGSEGV or SIGABRT, no Python error). Clearing the caches
# after each module bounds the count by the largest module's; the guard below fails a module that
# alone comes within MAP_COUNT_ALARM of the limit, before it can take a worker down.
MAP_COUNT_ALARM = 0.5


def _memory_mappings() -> int | None:
    """The number of memory mappings this process holds (Linux), else None."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


def _map_count_limit() -> int | None:
    try:
        with open("/proc/sys/vm/max_map_count") as limit:
            return int(limit.read())
    except (OSError, ValueError):
        return None


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
    """Per test module: compile its programs optimized or not (``CPU_PROGRAMS_OPTIMIZED``); after
    it, fail if it alone used most of the mapping budget, then free every compiled program it left
    in JAX's caches (and the executables' JIT mappings with them)."""
    _compile_unoptimized(not getattr(request.module, OPTIMIZED_MODULE_FLAG, False))
    yield
    used, limit = _memory_mappings(), _map_count_limit()
    jax.clear_caches()
    _compile_unoptimized(True)
    gc.collect()
    if used is not None and limit is not None and used > MAP_COUNT_ALARM * limit:
        pytest.fail(
            f"this module left {used} memory mappings (vm.max_map_count is {limit}); XLA's CPU "
            "JIT crashes the process at the limit: split the module or shrink its shapes"
        )


@contextlib.contextmanager
def enable_x64():
    """Float64 inside the block only (``jax.enable_x64`` is thread-local and restored after)."""
    with jax.enable_x64(True):
        yield


@pytest.fixture
def float64():
    """Runs the test body with x64 enabled, restoring the previous mode afterwards."""
    with enable_x64():
        yield


@pytest.fixture
def interpret() -> bool:
    """Whether Pallas kernels must be interpreted here (no GPU)."""
    return not ON_GPU


@pytest.fixture
def verify_triton_modules(monkeypatch):
    """Every Triton module a Pallas call lowers to in the test is run through the MLIR verifier.

    Lowering for ``cuda`` on a CPU builds the Triton module but does not verify it; the GPU host
    does, when it parses the module, and refuses what the verifier refuses (for example an
    ``scf.for`` whose bounds differ in type). With this fixture a CPU test fails there too."""
    # Private JAX modules: if a JAX version moves them, the tests that use this skip, not fail.
    lowering = pytest.importorskip("jax._src.pallas.triton.lowering")
    pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")  # the caller
    original = lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kwargs):
        result = original(*args, **kwargs)
        result.module.operation.verify()  # raises MLIRError naming the bad op
        return result

    # pallas_call_registration calls it as lowering.lower_jaxpr_to_triton_module (one module).
    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    return lower_and_verify


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
