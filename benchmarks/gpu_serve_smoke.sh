#!/usr/bin/env bash
# The served stack on a GPU (never run there yet): dflash-serve --device cuda on the embedded demo pair (gateway,
# draft worker and verify worker, both on the GPU), a greedy and a sampled completion, then dflash-bench at
# concurrency 1 and 16 (speculative against plain waves, greedy outputs compared); on CUDA then the same with
# --batch-invariant (greedy mismatches must be 0 there) and with --cuda-graphs; then a tiny FP8 GLM-5.2-family pair
# where gpu_wheels.sh wrote one, with --cuda-graphs on CUDA (greedy mismatches must be 0: the GLM kernels are
# row-invariant; the log says whether the graphs were captured). Needs fastapi, uvicorn and pyzmq (benchmarks/gpu_wheels.sh; gpu_session.sh installs them). Logs
# under $1 (default gpu-logs).
set -u
out=${1:-gpu-logs}
mkdir -p "$out"
python=${PYTHON:-python3}
port=${PORT:-8000}
device=${DEVICE:-cuda}  # DEVICE=cpu: the same script on this machine, to check it
get() { $python -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('$1', timeout=5).read().decode())"; }
post() { $python -c "import sys, urllib.request; print(urllib.request.urlopen(urllib.request.Request('$1', data=sys.argv[1].encode(), headers={'content-type': 'application/json'}), timeout=60).read().decode()[:600])" "$2"; }
serve() {  # $1: extra dflash-serve flags; $2: a label for the logs
    $python -m gateway.launcher --device "$device" --port "$port" $1 >"$out/serve_server$2.log" 2>&1 &
    server=$!
    ready=0
    for _ in $(seq 1 240); do
        if get "http://127.0.0.1:$port/ready" >/dev/null 2>&1; then ready=1; break; fi
        kill -0 $server 2>/dev/null || break
        sleep 1
    done
    if [ $ready = 0 ]; then
        echo "dflash-serve --device $device $1 did not become ready:"; tail -30 "$out/serve_server$2.log"
    else
        echo "dflash-serve --device $device $1: ready"
        for body in '{"prompt": "def fib(n):", "max_tokens": 48, "temperature": 0}' \
                    '{"prompt": "def fib(n):", "max_tokens": 48, "temperature": 1, "top_p": 0.95}'; do
            post "http://127.0.0.1:$port/v1/completions" "$body"
        done
        for concurrency in 1 16; do
            timeout 150 $python -m client.bench --url "http://127.0.0.1:$port" --block-sizes 8 \
                --concurrency $concurrency --num-prompts 16 --max-tokens 64 --rounds 1 \
                --out "/tmp/bench$2_c$concurrency.json" 2>&1 | grep -E "^dflash|greedy_mismatches|Error|error" | head -12
        done
        grep -iE "error|traceback|captured (a )?CUDA graph" "$out/serve_server$2.log" | head -12
    fi
    kill $server 2>/dev/null; wait $server 2>/dev/null
}
serve "" ""
[ "$device" = cuda ] && serve "--batch-invariant" "_rows"
[ "$device" = cuda ] && serve "--cuda-graphs" "_graphs"
glm=.whl/checkpoints/glm_serve  # a tiny FP8 GLM-5.2-family pair (benchmarks/gpu_wheels.sh): the GLM backend served,
graphs=""; [ "$device" = cuda ] && graphs="--cuda-graphs"  # its decode steps from CUDA graphs (eager if a capture fails)
[ -d "$glm" ] && serve "--target $glm/target --draft $glm/draft $graphs" "_glm"
