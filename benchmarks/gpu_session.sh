#!/usr/bin/env bash
# Everything a lent GPU is for, in one command (a lease is short): the CUDA kernels built and tested
# (benchmarks/gpu_kernels.py), the CUDA-graph step's test, then the target step on a Qwen3-8B-shaped random target,
# eager against graphed and compiled (benchmarks/gpu_target_step.py). Logs go to $OUT (else ./gpu-logs).
#     bash benchmarks/gpu_session.sh
set -u
out=${OUT:-gpu-logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 DFLASH_KERNEL_CACHE=${DFLASH_KERNEL_CACHE:-/tmp/dflash-kernels}
python=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"
$python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
timeout 150 $python benchmarks/gpu_kernels.py --rounds 20 >"$out/kernels.log" 2>&1
echo "gpu_kernels.py: exit $?"; grep -v "^\.\|^$" "$out/kernels.log" | tail -40
timeout 60 $python -m pytest -q -x tests/test_step_host_facts.py >"$out/host_facts.log" 2>&1
echo "test_step_host_facts.py: exit $?"; tail -5 "$out/host_facts.log"
timeout ${STEP_TIMEOUT:-300} $python benchmarks/gpu_target_step.py --compile --compile-budget-s ${COMPILE_BUDGET:-120} \
    >"$out/target_step.log" 2>&1
echo "gpu_target_step.py: exit $?"; tail -30 "$out/target_step.log"
