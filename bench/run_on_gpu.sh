#!/usr/bin/env bash
# What one GPU session runs, stage by stage, from the repository root on the GPU host (which has
# jax 0.11.2 and no package registry, hence PYTHONPATH=. and no virtual environment):
#   bash bench/run_on_gpu.sh tests tune memcheck     # check, then sweep parameters
#   bash bench/run_on_gpu.sh decode peers demo        # the committed reports
#   bash bench/run_on_gpu.sh sampling-tests sampling  # the sampling kernels, compiled and timed
#   bash bench/run_on_gpu.sh fused_ops serving-quick      # what the 2026-12-01 session left unmeasured
#   bash bench/run_on_gpu.sh sampling-32 speculative serving-a serving-b
#   timeout -s KILL 560 bash bench/run_on_gpu.sh speculative-quick engine-bf16 serving-single; \
#     bash bench/run_on_gpu.sh pack
#   SAMPLING_BATCH=1 DECODELAB_SAMPLING_CASES=gumbel,top_p bash bench/run_on_gpu.sh sampling-part
#   bash bench/run_on_gpu.sh mgpu-tests; bash bench/run_on_gpu.sh mgpu-sweep  # issue 16, one each
#   bash bench/run_on_gpu.sh mgpu-merge-fold  # issue 16: the merge folded into the decode launch
#   bash bench/run_on_gpu.sh decode-overhead  # issue 16: the small cases' time, split and merge
# (merge a suite's parts into one report with python -m bench.harness.merge_reports)
# Issue 18 (the engine's step, version 2): serving-batch, serving-single, serving-load-a and -b,
# engine-overlap, engine-dispatch (where a step's host time goes), engine-multistep (the same
# with 1, 4 and 8 decode steps a program); one device command each.
# Issues 19 and 21: sparse-tests, quest-scores, quest-select, tune-decode, check-decode.
# Issue 19 (the append keeps Quest's key bounds): append-bounds.
# Issue 20: mla-decode; mla-engine (the MLA model through the engine, latent cache against
# expanded K/V pages: bytes a token, tokens/s, ITL).
# Issue 18 (one ragged launch for a mixed step, prototype): ragged-attention.
# Issue 17: cascade-shared (the shared-level kernel's tests and probe), cascade-crossover,
# cascade-variants, cascade-stages.
# Before any probe of a kernel never yet run on a GPU: kernels-compiled (their gpu-marked tests).
# The stage names are unchanged since bench/ was split into harness/, suites/, tuning/, probes/
# and memcheck/; only the modules they run moved (prefill is now `python -m bench prefill`).
# Each stage has its own timeout, but a chain of stages can outlast one device command (600 s):
# put an outer timeout on the chain and run `pack` after it, as above, so that the archive is
# made even when the chain is killed (the device tool brings back at most 8 files).
# A suite writes its report only when it ends: a stage killed by the 600 s limit of one device
# command leaves nothing, so every stage below fits in one command (the slow ones are split).
# Logs and reports go to $OUT (the device tool's output folder) when it is set. The copy of the
# tree on the GPU host has no .git: pass DECODELAB_COMMIT=$(git rev-parse --short HEAD) so that
# reports name the commit they measured.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
# JAX's persistent compilation cache in an ignored folder of the tree: the device tool keeps
# ignored folders between the commands of one session, so a stage run again (a suite's part cut
# by its timeout, a case re-run with the peers) loads its programs instead of compiling them
# again; a sampling part spends most of its time compiling. It caches executables only: what is
# timed is the same program.
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$PWD/.jax_cache}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0.5}"
out="${OUT:-/tmp/decodelab-gpu}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -c "import jax, torch; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__)"
for stage in "$@"; do
  echo "=== $stage ($(date +%T))"
  case "$stage" in
    tests)
      # The benchmark-shape tests first, then the interpret-mode suite compiled.
      timeout 170 bash -c "python3 -m pytest -q -p no:cacheprovider -m gpu \
          tests/test_paged_decode_kernel.py && python3 -m pytest -q -p no:cacheprovider \
          -m 'not gpu' tests/test_paged_decode_kernel.py" 2>&1 | tee "$out/gpu_tests.log" \
        | grep -E 'passed|failed|Error' ;;
    tune)
      timeout 290 python3 -m bench decode --tune --out "$out" 2>&1 | tee "$out/tune.log" \
        | grep -v '^  tune' ;;
    memcheck)
      XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 \
        compute-sanitizer --tool memcheck python3 -m bench.memcheck.decode 2>&1 \
        | tee "$out/memcheck.log" | tail -n 12 ;;
    memcheck-prefill)  # the prefill kernel under compute-sanitizer (about 1 min)
      XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 \
        compute-sanitizer --tool memcheck python3 -m bench.memcheck.prefill 2>&1 \
        | tee "$out/memcheck_prefill.log" | tail -n 8 ;;
    memcheck-sampling)  # issue 4: every sampling kernel under compute-sanitizer, NaN rows included
      XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 \
        compute-sanitizer --tool memcheck python3 -m bench.memcheck.sampling 2>&1 \
        | tee "$out/memcheck_sampling.log" | tail -n 8 ;;
    sampling-tests)
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_sampling_kernels.py \
        tests/test_rng.py ${SAMPLING_TESTS_FILTER:+-k "$SAMPLING_TESTS_FILTER"} 2>&1 | tee "$out/gpu_sampling_tests.log" | tail -n 5 ;;
    decode)  # the grid and the q_len cases, the Mosaic GPU kernel beside the Triton one (~7 min)
      timeout 500 python3 -m bench decode --out "$out" 2>&1 | tee "$out/decode.log" \
        | grep -v '^  tune' ;;
    peers|sampling)
      timeout 330 python3 -m bench "$stage" --out "$out" 2>&1 | tee "$out/$stage.log" \
        | grep -v '^  tune' ;;
    cascade-path)  # issue 17: cascade_decode_attention(backend="pallas_mgpu") compiled (~1 min)
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cascade_mgpu_path.py \
        2>&1 | tee "$out/gpu_cascade_path_tests.log" | tail -n 3 ;;
    demo)
      python3 -m serving demo 2>&1 | tee "$out/demo.log" ;;
    fused_ops|speculative)
      timeout 500 python3 -m bench "$stage" --out "$out/$stage" 2>&1 | tee "$out/$stage.log" \
        | grep -E '^note|wrote' ;;
    sampling-256)  # batch 256 alone: 3 rotating sets, the reference arms 20 ms a call
      timeout 420 python3 -m bench sampling --batches 256 --out "$out/sampling-256" 2>&1 \
        | tee "$out/sampling-256.log" | grep -E '^note|wrote' ;;
    sampling-gumbel)  # the Gumbel-max cases and the peers at batch 1, 32 and 256 (about 2 min)
      timeout 400 python3 -m bench sampling --gumbel-only --out "$out/sampling-gumbel" 2>&1 \
        | tee "$out/sampling-gumbel.log" | grep -E '^note|wrote' ;;
    sampling-32)  # batch 32 alone: 17 rotating sets a program, about 4 minutes
      timeout 500 python3 -m bench sampling --batches 32 --out "$out/sampling-32" 2>&1 \
        | tee "$out/sampling-32.log" | grep -E '^note|wrote' ;;
    serving-quick)
      timeout 300 python3 -m bench serving --quick --out "$out/serving-quick" 2>&1 \
        | tee "$out/serving-quick.log" | grep -E '^note|wrote' ;;
    speculative-quick)  # the GPU-marked test, then the target case alone (about 40 s)
      timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_speculative.py \
        2>&1 | tee "$out/gpu_speculative_tests.log" | tail -n 3
      timeout 200 python3 -m bench speculative --quick --out "$out/speculative-quick" 2>&1 \
        | tee "$out/speculative-quick.log" | grep -E '^note|wrote' ;;
    engine-bf16)  # greedy parity of the compiled kernels with the reference, bfloat16
      timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/test_engine.py -k bfloat16 \
        2>&1 | tee "$out/engine_bf16.log" | grep -E 'bf16 greedy|passed|failed' ;;
    serving-single|serving-batch|serving-long|serving-shared_prefix)  # one scenario a process
      # Three arms since issue 18 (reference, decodelab-sync, decodelab): 450 s, not 300.
      DECODELAB_SERVING_SCENARIOS="${stage#serving-}" timeout 450 python3 -m bench serving \
        --out "$out/$stage" 2>&1 | tee "$out/$stage.log" \
        | grep -E 'tok/s|^note: .*(faster|target|overlapped)' ;;
    serving-load-a|serving-load-b)  # issue 18: the continuous load, two configurations a process
      configs="512:1,512:8"; [ "$stage" = serving-load-b ] && configs="2048:1,2048:8"
      DECODELAB_SERVING_SCENARIOS=continuous DECODELAB_SERVING_LOAD_CONFIGS="$configs" \
        timeout 550 python3 -m bench serving --out "$out/$stage" 2>&1 | tee "$out/$stage.log" \
        | grep -E '^note: continuous|wrote' ;;
    engine-overlap)  # issue 18: the overlapped loop's tests, compiled kernels (about 2 min)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py -k \
        'overlap or bound or budget' 2>&1 | tee "$out/engine_overlap.log" | tail -n 3 ;;
    prefill)  # the prefill kernel's GPU tests, then one chunk at 16K and 32K (about 90 s)
      timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_paged_prefill_kernel.py \
        2>&1 | tee "$out/gpu_prefill_tests.log" | tail -n 2
      timeout 300 python3 -m bench prefill --out "$out/prefill" 2>&1 \
        | tee "$out/prefill.log" | grep -E '^note|wrote|^B=' ;;
    prefill-sweep)  # the launch sweep at 32K alone (54 launches)
      timeout 560 python3 -m bench prefill --tune --contexts 32768 --out "$out/prefill-sweep" \
        2>&1 | tee "$out/prefill-sweep.log" | grep -E '^note|wrote' ;;
    gumbel-two-level)  # issue 4: what a two-level exponential race would cost (about 60 s)
      timeout 200 python3 -m bench.probes.gumbel_two_level 2>&1 \
        | tee "$out/gumbel_two_level_probe.log" | grep -E '^B=|FAILED' ;;
    tune-gumbel)  # issue 4: the Gumbel kernel's agreement and launch variants (about 3 min)
      timeout 550 python3 -m bench.tuning.gumbel --out "$out" 2>&1 | tee "$out/tune_gumbel.log" \
        | grep -vE '^B=' ;;
    gumbel-variants)  # issue 4: where the Gumbel kernel's time goes (about 3 min)
      timeout 300 python3 -m bench.probes.gumbel_variants --set "${GUMBEL_PROBE_SET:-internals}" 2>&1 \
        | tee "$out/gumbel_variants_probe.log" | grep -E '^B=|FAILED' ;;
    mgpu-tests)  # issue 16: the Mosaic GPU decode kernel compiled, its gpu-marked benchmark
      # shapes, then its interpret-mode tests on both p paths (about 5 min, estimated)
      timeout 560 bash -c "python3 -m pytest -q -p no:cacheprovider -m gpu \
          tests/test_paged_decode_mgpu.py && python3 -m pytest -q -p no:cacheprovider \
          -m 'not gpu' tests/test_paged_decode_mgpu.py" 2>&1 | tee "$out/mgpu_tests.log" \
        | grep -E 'passed|failed|Error' ;;
    mgpu-sweep)  # issue 16: the kernel's variants beside Triton on the standard grid, within a
      # 480 s budget (about 8 min; MGPU_SWEEP_CASES=1x4096,4x1024 for a part)
      timeout 570 python3 -m bench.probes.mgpu_decode --sweep \
          ${MGPU_SWEEP_CASES:+--cases "$MGPU_SWEEP_CASES"} --out "$out" 2>&1 \
        | tee "$out/mgpu_sweep.log" | awk '!/^ +B=/ || /FAILED|MISMATCH|skipped/' ;;
    mgpu-merge-fold)  # issue 16: the folded merge's tests compiled (gpu-marked and the small
      # ragged ones), then the probe's merge arms, separate vs folded at B=1 and 4 (about 4 min,
      # estimated); the probe runs even if a test fails (it checks each arm before timing it)
      timeout -s KILL 560 bash -c "python3 -m pytest -q -p no:cacheprovider -k 'folded or folds' \
          tests/test_paged_decode_mgpu.py; python3 -m bench.probes.mgpu_decode --merge-fold \
          --out '$out/mgpu-merge-fold'" 2>&1 | tee "$out/mgpu_merge_fold.log" \
        | awk '!/^ +B=/ || /FAILED|MISMATCH|skipped/' ;;
    fold-diagnose)  # issue 16: where the folded merge stops (compiling or running): its smallest
      # compiled test alone, Python's stacks dumped every 40 s (pytest's faulthandler_timeout),
      # every phase of the test timestamped (-s, -v); about 2 min at most
      timeout -s KILL 150 python3 -X faulthandler -m pytest -v -s -x -p no:cacheprovider \
          -o faulthandler_timeout=40 -k 'test_folded_merge_on_gpu and 1-4096' \
          tests/test_paged_decode_mgpu.py 2>&1 | tee "$out/fold_diagnose.log" | tail -n 60 ;;
    decode-overhead)  # issue 16: where a small decode call's time goes (the loop's floor, the
      # kernel, the merge, the device trace), and the split and folded merge at B = 1 and 4
      # (75 arms of about 3 s, estimated; no arm starts after 420 s)
      # The folded merge (never yet run compiled) in a process of its own, after the rest.
      timeout 420 python3 -m bench.probes.decode_overhead --trace --budget-s 330 --merge separate \
          --out "$out/decode-overhead" 2>&1 | tee "$out/decode_overhead.log" | grep -vE '^  B='
      timeout -s KILL 150 python3 -m bench.probes.decode_overhead --budget-s 100 --merge folded \
          --pipelines ring.p4.s2 --out "$out/decode-overhead-folded" 2>&1 \
        | tee "$out/decode_overhead_folded.log" | grep -vE '^  B=' ;;
    loop-overhead)  # issue 16: what the timed loop costs a call, under five ways XLA can run it:
      # as is, 8 calls an iteration, command buffers (CUDA graphs) for the body's kernels and
      # custom calls, the same with the whole while loop in one graph, and both with 8 calls an
      # iteration. Small cases and one large; floor, the suite's arm, turn loop, JAX's kernel.
      cb="--xla_gpu_graph_min_graph_size=1 --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
      for config in "base||1" "u8||8" "cb|$cb|1" "cbw|$cb,WHILE,CONDITIONAL|1" "cbw.u8|$cb,WHILE,CONDITIONAL|8"; do
        IFS='|' read -r tag flags unroll <<< "$config"
        XLA_FLAGS="$flags" timeout 115 python3 -m bench.probes.decode_overhead --budget-s 90 \
            --merge separate --grids 264 --arms floor,api.planned,jax --unroll "$unroll" \
            --cases 1x4096,4x1024,4x4096,32x4096 --tag "$tag" --out "$out/loop-overhead" 2>&1 \
          | tee "$out/loop_overhead_$tag.log" | grep -E ' \| ' | sed "s/^/$tag | /"
      done ;;
    mgpu-memcheck)  # issue 16: the Mosaic GPU decode kernel under compute-sanitizer, both pipelines
      XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 300 \
        compute-sanitizer --tool memcheck python3 -m bench.probes.mgpu_decode --memcheck 2>&1 \
        | tee "$out/mgpu_memcheck.log" | tail -n 12 ;;
    pack)  # the device tool brings back at most 8 files: one archive of everything so far
      (cd "$out" && tar czf ../decodelab-gpu.tgz . && rm -rf ./* && mv ../decodelab-gpu.tgz .) ;;
    serving-a)
      DECODELAB_SERVING_SCENARIOS=single,batch,shared_prefix timeout 550 python3 -m bench \
        serving --out "$out/serving-a" 2>&1 | tee "$out/serving-a.log" | grep -E '^note|wrote' ;;
    serving-b)
      DECODELAB_SERVING_SCENARIOS=long timeout 550 python3 -m bench serving \
        --out "$out/serving-b" 2>&1 | tee "$out/serving-b.log" | grep -E '^note|wrote' ;;
    sampling-part)  # one batch, some cases: SAMPLING_BATCH=1 DECODELAB_SAMPLING_CASES=gumbel,top_p
      # The suite keeps <date>-sampling-partial.json current, so a part cut by its timeout keeps
      # the arms it finished; merge the parts with python -m bench.harness.merge_reports.
      part="sampling-${SAMPLING_BATCH:?set SAMPLING_BATCH}-${DECODELAB_SAMPLING_CASES:-all}"
      part="${part//,/_}"
      timeout "${SAMPLING_PART_TIMEOUT:-540}" python3 -m bench sampling --batches "$SAMPLING_BATCH" \
        --out "$out/$part" 2>&1 | tee "$out/$part.log" | grep -E '^\.\.\. .* done in|^note|wrote' ;;
    engine-dispatch)  # issue 18: an engine step's host time under three XLA command-buffer settings
      for setting in "default:" "off:--xla_gpu_enable_command_buffer=" \
          "all:--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"; do
        label="${setting%%:*}"; flags="${setting#*:}"
        XLA_FLAGS="$flags" timeout 170 python3 -m bench.probes.engine_dispatch --label "$label" \
          --out "$out/engine-dispatch" 2>&1 | tee -a "$out/engine_dispatch.log" | grep -vE '^#|^$'
      done ;;
    kernels-compiled)  # every Mosaic GPU kernel not yet run on a GPU, its gpu-marked tests
      # only (compiled against the references at benchmark shapes), one pytest a file so that one
      # file's crash does not hide the others; a first check before any probe times them
      for file in tests/test_paged_decode_mgpu.py tests/test_cascade_shared_mgpu.py \
          tests/test_mla_decode_mgpu.py tests/test_quest_scores_kernel.py; do
        timeout 140 python3 -m pytest -q -p no:cacheprovider -m gpu -x "$file" 2>&1 \
          | tee -a "$out/gpu_kernels_compiled.log" | tail -n 2
      done ;;
    engine-multistep)  # issue 18: wall step / device step with K = 1, 4, 8 decode steps a program
      # ENGINE_MULTISTEP_BATCH=32 for batch 32 (default 4); three runs of at most 180 s each.
      for steps in 1 4 8; do
        timeout 180 python3 -m bench.probes.engine_dispatch --steps-per-program "$steps" \
          --batch "${ENGINE_MULTISTEP_BATCH:-4}" --label "k$steps-b${ENGINE_MULTISTEP_BATCH:-4}" \
          --out "$out/engine-multistep" 2>&1 | tee -a "$out/engine_multistep.log" | grep -vE '^#|^$'
      done ;;
    sparse-tests)  # issue 19: the decode kernel on head-split and one-token-page tables (GPU tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_sparse_decode.py -k pallas -rs \
        2>&1 | tee "$out/gpu_sparse_tests.log" | tail -n 4 ;;
    quest-scores)  # issue 19: the Quest scoring kernel compiled (tests), then checked and timed
      timeout 250 python3 -m pytest -q -p no:cacheprovider tests/test_quest_scores_kernel.py 2>&1 \
        | tee "$out/gpu_quest_tests.log" | tail -n 3
      timeout 250 python3 -m bench.probes.quest_scores --batches 1,8 --context 32768 2>&1 \
        | tee "$out/quest_scores_probe.log" | tail -n 12 ;;
    append-bounds)  # issue 19: the append keeping Quest's bounds: the tests compiled (gpu-marked
      # included: 16 programs racing on each page of a 256-token chunk), then the probe, which
      # checks the fused and two-step paths bit for bit, times them beside the plain append
      # and reads each arm's kernels' device time (350 s at most; the probe writes its JSON after
      # every case). APPEND_BOUNDS_PROBE_ONLY=1 skips the tests; APPEND_BOUNDS_CASES="chunk 1x512"
      # runs some cases (a split run: a previous version took 266 s without the trace and w8 arm).
      if [ -z "${APPEND_BOUNDS_PROBE_ONLY:-}" ]; then
        timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_append_key_bounds.py \
          2>&1 | tee "$out/gpu_append_bounds_tests.log" | tail -n 4
      fi
      timeout 240 python3 -m bench.probes.append_bounds --trace --fused-warps 8 --out "$out" \
        ${APPEND_BOUNDS_CASES:+--cases "$APPEND_BOUNDS_CASES"} 2>&1 \
        | tee "$out/append_bounds_probe.log" | grep -vE ' trace: ' ;;
    cascade-shared)  # issue 17: the shared-level cascade kernel compiled (its tests, the
      # gpu-marked benchmark shapes among them), then the probe's grid against plain decode
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cascade_shared_mgpu.py \
          2>&1 | tee "$out/gpu_cascade_shared_tests.log" | tail -n 5
      # The issue's headline case (at least 10x at 128 x 32K) first, in case the budget ends
      # the grid early; no case starts after 270 s, so the last one has 80 s to finish.
      timeout 350 python3 -m bench.probes.cascade_shared --budget-s 270 --out "$out" \
          --cases 128x32768,32x4096,64x4096,128x4096,32x16384,64x16384,128x16384,32x32768,64x32768 \
          2>&1 | tee "$out/cascade_shared_probe.log" | tail -n 28 ;;
    cascade-planned)  # issue 17: the host-planned cascade path compiled (the gpu-marked tests of
      # the host plan, the shared-level kernel and the public path), then the probe's planned
      # and traced arms over the crossover grid (about 5 min)
      timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cascade_host_plan.py \
          tests/test_cascade_shared_mgpu.py tests/test_cascade_mgpu_path.py \
          tests/test_engine_cascade.py 2>&1 | tee "$out/gpu_cascade_planned_tests.log" | tail -n 4
      timeout 240 python3 -m bench.probes.cascade_shared --budget-s 170 --variants ring.reg.p4.s3 \
          --cases 128x32768,32x4096,16x4096,8x4096,128x1024,32x1024,16x1024 \
          --out "$out/cascade-planned" 2>&1 | tee "$out/cascade_planned.log" | tail -n 30 ;;
    cascade-variants)  # issue 17: the shared level's pipeline at the headline case (128 x 32K,
      # where 10x is asked), then the short prefixes the 2026-12-03 run's budget cut, at the
      # default variant, to re-read the crossover (about 8 min)
      timeout 250 python3 -m bench.probes.cascade_shared --budget-s 200 --cases 128x32768 \
          --variants ring.reg.p4.s3,ring.reg.p8.s2,ring.reg.p4.s4,ring.reg.p2.s4,ring.reg.p4.s2 \
          --out "$out/cascade-variants" 2>&1 | tee "$out/cascade_variants.log" | tail -n 12
      timeout 250 python3 -m bench.probes.cascade_shared --budget-s 200 --variants ring.reg.p4.s3 \
          --cases 32x1024,16x1024,8x4096,4x4096,32x2048,16x2048,128x256,32x256 \
          --out "$out/cascade-short" 2>&1 | tee "$out/cascade_short.log" | tail -n 16 ;;
    cascade-stages)  # issue 17: the shared level's default (p4.s3) against p4.s2, the variant
      # that reached 11.14x at 128 x 32K on an H100 (2026-12-07), over long and short prefixes,
      # before the default changes (about 8 min)
      timeout 540 python3 -m bench.probes.cascade_shared --budget-s 460 \
          --variants ring.reg.p4.s3,ring.reg.p4.s2 \
          --cases 128x32768,32x32768,128x4096,32x4096,128x1024,32x1024 \
          --out "$out/cascade-stages" 2>&1 | tee "$out/cascade_stages.log" | tail -n 16 ;;
    cascade-crossover)  # issue 17: short prefixes, where cascade starts to pay (about 4 min)
      timeout 400 python3 -m bench.probes.cascade_shared --budget-s 330 \
          --cases 32x256,128x256,32x1024,128x1024,32x2048,128x2048 --out "$out/crossover" 2>&1 \
        | tee "$out/cascade_crossover.log" | tail -n 14 ;;
    quest-select)  # issue 19: the Quest selection kernel compiled (tests), then checked and timed
      timeout 250 python3 -m pytest -q -p no:cacheprovider tests/test_quest_select_kernel.py 2>&1 \
        | tee "$out/gpu_quest_select_tests.log" | tail -n 3
      timeout 250 python3 -m bench.probes.quest_select --batches 1,8 --context 32768 2>&1 \
        | tee "$out/quest_select_probe.log" | tail -n 16 ;;
    tune-decode)  # issue 21: python -m bench tune paged_decode, four buckets (about 4 min)
      timeout 560 python3 -m bench tune paged_decode --out "$out/tuned" 2>&1 \
        | tee "$out/tune_decode.log" | tail -n 20 ;;
    check-decode)  # issue 21: the decode suite re-run and compared with the committed report
      timeout 400 python3 -m bench decode --out "$out/check-decode" 2>&1 | tee "$out/check_decode.log" \
        | grep -E '^note|wrote'
      python3 -m bench check decode --measured "$out"/check-decode/*-decode.json 2>&1 \
        | tee -a "$out/check_decode.log" | tail -n 15 ;;
    mla-decode)  # issue 20: the MLA kernel's tests compiled (all, gpu-marked included), then the
      # probe: checked against the reference, timed beside XLA (not yet run; 550 s at most).
      # MLA_PROBE_ONLY=1 skips the tests; MLA_PROBE_ARGS="--cases compute --crossover" runs a part.
      if [ -z "${MLA_PROBE_ONLY:-}" ]; then
        timeout 250 python3 -m pytest -q -p no:cacheprovider tests/test_mla_decode_mgpu.py 2>&1 \
          | tee "$out/gpu_mla_tests.log" | tail -n 4
      fi
      timeout 300 python3 -m bench.probes.mla_decode ${MLA_PROBE_ARGS:-} 2>&1 \
        | tee "$out/mla_decode_probe.log" | grep -E '^H=|^copy|FAILED|MISMATCH' ;;
    mla-engine)  # issue 20: the engine's MLA tests compiled (gpu-marked included: the MLA
      # kernel in the engine against the reference), then the probe: the MLA model through the
      # engine, latent cache against the same weights on expanded K/V pages, B 1/8/32 at 1K and
      # 4K (not yet run; 540 s at most: tests 150, probe 390 with no case started after 300 s;
      # MLA_ENGINE_PROBE_ONLY=1 skips the tests, MLA_ENGINE_ARGS="--batches 1 --contexts 4096"
      # runs a part; the JSON is rewritten after every row)
      if [ -z "${MLA_ENGINE_PROBE_ONLY:-}" ]; then
        timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_engine_mla.py 2>&1 \
          | tee "$out/gpu_engine_mla_tests.log" | tail -n 4
      fi
      timeout 390 python3 -m bench.probes.mla_engine --budget-s 300 --out "$out/mla-engine" \
          ${MLA_ENGINE_ARGS:-} 2>&1 | tee "$out/mla_engine_probe.log" | grep -vE '^$' ;;
    ragged-attention)  # issue 18: the ragged kernel's tests compiled (gpu-marked included), then
      # the probe: one ragged launch against the engine's two (decode + chunk), checked, timed
      # (not yet run; 540 s at most, room for the preamble in a 600 s command; the probe's JSON is rewritten after each case, so a cut run
      # keeps what it finished). RAGGED_PROBE_ONLY=1 skips the tests; RAGGED_PROBE_ARGS=
      # "--cases 32x4096+2048@4096 --variants reg.p1.s4" runs a part.
      if [ -z "${RAGGED_PROBE_ONLY:-}" ]; then
        timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_ragged_attention.py 2>&1 \
          | tee "$out/gpu_ragged_tests.log" | tail -n 4
      fi
      timeout 360 python3 -m bench.probes.ragged_attention --out "$out" ${RAGGED_PROBE_ARGS:-} 2>&1 \
        | tee "$out/ragged_attention_probe.log" | grep -vE '^#|^$' ;;
    *) echo "unknown stage $stage" ;;
  esac
done
echo "=== done ($(date +%T))"
