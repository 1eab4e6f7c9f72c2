#!/usr/bin/env bash
# Everything a lent GPU is for, in one command (a lease is short): the CUDA kernels built and tested
# (benchmarks/gpu_kernels.py), the host-facts / CUDA-graph step's tests and the engine's on the device, then the
# target step on a Qwen3-8B-shaped random target, eager against graphed and compiled, with the row checks greedy
# identity relies on (benchmarks/gpu_target_step.py), the same for the target as --batch-invariant packs it
# (cuda_ext's row GEMM: tests/test_row_gemm.py first), then, where .whl/ travelled (benchmarks/gpu_wheels.sh), the
# GLM families' CUDA kernels on tiny checkpoints, the GLM slices' step table and the replay drafter's speedups
# (benchmarks/gpu_glm_step.py; about 60 GB of GPU memory) and the served stack on the GPU
# (benchmarks/gpu_serve_smoke.sh). Logs go to $OUT (else ./gpu-logs). About 8-12 minutes on an H200 with the smoke
# before the GLM parts were added (2026-12-04: 194 s for the first version of this script, the machine's start not
# counted; the GLM parts have never run): run it with timeout_s 600; ROWS_TIMEOUT / STEP_TIMEOUT / KDA_TIMEOUT /
# GROUPED_TIMEOUT / GLM_STEP_TIMEOUT / GLM_FP8_TIMEOUT / LOAD_TIMEOUT / SERVE_TIMEOUT lower where time is short
# (torch.compile only with COMPILE_BUDGET=seconds); ONLY=glm runs the GLM parts alone (they need .whl); ONLY=fp8
# runs the FP8 slices (W8A16, W8A8) and the FP8 slice checkpoint's load, a second call of about 8 minutes.
#     bash benchmarks/gpu_wheels.sh            # here, first; then on the device, with carry [".whl"]:
#     bash benchmarks/gpu_session.sh
set -u
out=${OUT:-gpu-logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 DFLASH_KERNEL_CACHE=${DFLASH_KERNEL_CACHE:-/tmp/dflash-kernels}
python=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"
$python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
if [ "${ONLY:-all}" = all ]; then  # ONLY=glm: the GLM parts alone (below), where the lease is short
timeout 150 $python benchmarks/gpu_kernels.py --rounds 20 >"$out/kernels.log" 2>&1
echo "gpu_kernels.py: exit $?"; grep -v "^\.\|^$" "$out/kernels.log" | tail -40
timeout 150 $python -m pytest -q tests/test_row_gemm.py tests/test_row_attention.py tests/test_step_host_facts.py \
    tests/test_engine_on_devices.py tests/test_step_buckets.py >"$out/engine.log" 2>&1
echo "test_row_gemm.py, test_row_attention.py, test_step_host_facts.py, test_engine_on_devices.py, test_step_buckets.py: exit $?"
grep -E "^(FAILED|ERROR)|passed|failed" "$out/engine.log" | tail -12
timeout ${ROWS_TIMEOUT:-150} $python benchmarks/gpu_target_step.py --batch-invariant --rounds 20 \
    >"$out/target_step_rows.log" 2>&1
echo "gpu_target_step.py --batch-invariant: exit $?"; tail -20 "$out/target_step_rows.log"
compile=""; [ "${COMPILE_BUDGET:-0}" != 0 ] && compile="--compile --compile-budget-s $COMPILE_BUDGET"
timeout ${STEP_TIMEOUT:-200} $python benchmarks/gpu_target_step.py --gemm-sweep --rounds 20 $compile \
    >"$out/target_step.log" 2>&1
echo "gpu_target_step.py: exit $?"; grep -v "^W[0-9]" "$out/target_step.log" | tail -45
fi
if [ -d .whl ]; then  # serving's packages the image lacks and fla-core (benchmarks/gpu_wheels.sh, carried as .whl)
    $python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
    only=${ONLY:-all}
    if [ "$only" != fp8 ]; then
    # the GLM families' CUDA kernels on the tiny checkpoints gpu_wheels.sh wrote: fla's KDA recurrence (block ==
    # one-token steps bit for bit) and cuda_ext/grouped_rows for the experts (a row's bits wherever it sits), each
    # family's greedy speculative == plain on them
    PYTHONPATH=${PYTHONPATH:-}:$PWD/tests DFLASH_KDA_DEVICE=cuda timeout ${KDA_TIMEOUT:-120} \
        $python tests/kda_fla_interpreted.py .whl/checkpoints/glm5 >"$out/kda.log" 2>&1
    echo "kda_fla_interpreted.py on cuda: exit $?"; tail -3 "$out/kda.log"
    PYTHONPATH=${PYTHONPATH:-}:$PWD/tests DFLASH_GROUPED_DEVICE=cuda timeout ${GROUPED_TIMEOUT:-120} \
        $python tests/glm_kernels_interpreted.py .whl/checkpoints/glm .whl/checkpoints/glm_fp8 >"$out/grouped.log" 2>&1
    echo "glm_kernels_interpreted.py on cuda: exit $?"; tail -3 "$out/grouped.log"
    # the GLM slices' step table (time, bytes, bandwidth) and the replay drafter's speedups, Qwen3-8B-shaped too
    timeout ${GLM_STEP_TIMEOUT:-300} $python benchmarks/gpu_glm_step.py --rounds 10 >"$out/glm_step.log" 2>&1
    echo "gpu_glm_step.py: exit $?"; grep -v "Warning\|warn" "$out/glm_step.log" | tail -40
    fi
    if [ "$only" = fp8 ]; then  # a call of its own: the runs above and these do not fit one 600 s call together
    # the same slices with FP8 experts and projections (W8A16, as an FP8 checkpoint loads; then W8A8, FP8
    # activations too): step times against the table above, greedy speculative == plain on them
    timeout ${GLM_FP8_TIMEOUT:-180} $python benchmarks/gpu_glm_step.py --fp8 --rounds 10 --qwen none \
        --acceptances 5 >"$out/glm_step_fp8.log" 2>&1
    echo "gpu_glm_step.py --fp8: exit $?"; grep -v "Warning\|warn" "$out/glm_step_fp8.log" | tail -30
    timeout ${GLM_FP8_TIMEOUT:-180} $python benchmarks/gpu_glm_step.py --fp8 w8a8 --rounds 10 --qwen none \
        --acceptances 5 --prompts 4 --speedup-batches 1 >"$out/glm_step_w8a8.log" 2>&1
    echo "gpu_glm_step.py --fp8 w8a8: exit $?"; grep -v "Warning\|warn" "$out/glm_step_w8a8.log" | tail -30
    # an FP8 slice checkpoint loaded straight to the GPU: host memory, load time, the plan against the allocation
    timeout ${LOAD_TIMEOUT:-120} $python benchmarks/load_memory.py --device cuda --experts 64 >"$out/load.log" 2>&1
    echo "load_memory.py: exit $?"; tail -4 "$out/load.log"
    fi
    if [ "$only" = all ]; then
        timeout ${SERVE_TIMEOUT:-300} bash benchmarks/gpu_serve_smoke.sh "$out" >"$out/serve.log" 2>&1
        echo "gpu_serve_smoke.sh: exit $?"; tail -45 "$out/serve.log"
    fi
else
    echo "no .whl/: the GLM kernel checks and the served smoke were skipped (run benchmarks/gpu_wheels.sh here, carry .whl)"
fi
