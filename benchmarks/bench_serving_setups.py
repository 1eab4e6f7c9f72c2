"""Side-by-side serving setups: start dflash-serve with each setup's flags in turn, run dflash-bench against
it, and print tokens/s, acceptance and the per-step phase times (draft, transfer, verify) of each.

    python benchmarks/bench_serving_setups.py                       # TP 1, TP 2, TP 2 + feature pair
    python benchmarks/bench_serving_setups.py --setups "tp1=--tp 1" "pair=--feature-transport pair" \\
        --bench-args "--block-sizes 8 --concurrency 1 --num-prompts 8 --max-tokens 96 --rounds 2"
    python benchmarks/bench_serving_setups.py --together \\
        --setups "dflash=--draft models/demo/draft" "dflash2=--draft models/demo/draft2"
    cd /tmp && python /path/to/bench_serving_setups.py --together --setups "now=" "before=PYTHONPATH=/tmp/before"

By default each setup runs alone on the machine (a server at a time), and within it dflash-bench alternates
speculative and plain waves, so the ratios inside one setup are measured side by side; across setups, compare
medians. --together starts every setup's server at once (idle servers cost next to nothing) and runs ONE
dflash-bench over all of them, wave after wave, so the setups are measured side by side too (use it to compare
drafters; not for TP, whose extra processes would share the cores with the other servers' work).
Leading VAR=value words of a setup set its server's environment: with PYTHONPATH naming another checkout (a git
worktree of an earlier commit) and the command run outside the repository, two versions of the code are
measured side by side.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_SETUPS = ["tp1=--tp 1", "tp2=--tp 2", "tp2+pair=--tp 2 --feature-transport pair"]


def setup_env(flags: list[str]) -> tuple[dict, list[str]]:
    """A setup's leading NAME=value words set its server's environment, as in a shell: ("DFLASH_KERNELS=host
    --draft-placement local") -> ({"DFLASH_KERNELS": "host"}, ["--draft-placement", "local"])."""
    env = {}
    while flags and not flags[0].startswith("-") and "=" in flags[0]:
        name, _, value = flags.pop(0).partition("=")
        env[name] = value
    return env, flags


def serve(setup: str, serve_args: str, port: int, zmq_base: int, metrics_base: int) -> subprocess.Popen:
    """Start dflash-serve with a setup's flags (after --setups' NAME=) and the --serve-args of every setup."""
    env, flags = setup_env(shlex.split(setup))
    flags = [*shlex.split(serve_args), *flags]
    command = [sys.executable, "-m", "gateway.launcher", "--port", str(port), "--zmq-base-port", str(zmq_base),
               "--metrics-base-port", str(metrics_base), *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
    line = process.stdout.readline()
    if not line.startswith("dflash-serve ready"):
        process.terminate()
        raise SystemExit(f"dflash-serve {' '.join(flags)} did not start: {line!r}")
    return process


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setups", nargs="+", default=DEFAULT_SETUPS,
                        help="NAME=dflash-serve flags, after any VAR=value words for its environment")
    parser.add_argument("--serve-args", default="", help="flags added to every setup (e.g. --target/--draft)")
    parser.add_argument("--bench-args", default="--block-sizes 8 --concurrency 1 --num-prompts 8 "
                                                 "--max-tokens 96 --rounds 2")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--out", default="bench_out/setups")
    parser.add_argument("--together", action="store_true", help="all servers at once, one dflash-bench over all")
    args = parser.parse_args(argv)
    if any(_names_out(token) for token in shlex.split(args.bench_args)):
        parser.error("--bench-args must not set --out: this script's own --out names the output folder")
    rows = together(args) if args.together else one_by_one(args)
    print_table(rows)
    return 0


def _names_out(token: str) -> bool:
    """Whether a dflash-bench argument sets --out (argparse also takes --out=X and unique prefixes like --ou)."""
    flag = token.split("=", 1)[0]
    return len(flag) > 2 and "--out".startswith(flag)


def together(args) -> dict:
    names, processes, urls, metrics = [], [], [], []
    try:
        for i, setup in enumerate(args.setups):
            name, _, flags = setup.partition("=")
            port = args.port + 100 * i
            processes.append(serve(flags, args.serve_args, port, port + 10, port + 20))
            names.append(name)
            urls.append(f"http://127.0.0.1:{port}")
            metrics.append(f"http://127.0.0.1:{port + 20}/metrics")
        out = Path(args.out) / "together"
        subprocess.run([sys.executable, "-m", "client.bench", "--url", ",".join(urls), "--metrics-url",
                        ",".join(metrics), "--labels", ",".join(names), "--out", str(out),
                        *shlex.split(args.bench_args)], check=True, stdout=subprocess.DEVNULL)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(60)
    report = json.loads((out / "bench.json").read_text())
    return {name: {"by_block_size": report["by_server"][name] if "by_server" in report else report["by_block_size"]}
            for name in names}


def one_by_one(args) -> dict:
    rows = {}
    for setup in args.setups:
        name, _, flags = setup.partition("=")
        zmq_base, metrics_base = args.port + 10, args.port + 20
        process = serve(flags, args.serve_args, args.port, zmq_base, metrics_base)
        try:
            out = Path(args.out) / name
            subprocess.run([sys.executable, "-m", "client.bench", "--url", f"http://127.0.0.1:{args.port}",
                            "--metrics-url", f"http://127.0.0.1:{metrics_base}/metrics", "--out", str(out),
                            *shlex.split(args.bench_args)], check=True, stdout=subprocess.DEVNULL)
            rows[name] = json.loads((out / "bench.json").read_text())
        finally:
            process.terminate()
            process.wait(60)
            time.sleep(1.0)
    return rows


def print_table(rows: dict) -> None:
    print(f"{'setup':<12} {'block':>5} {'conc':>4} {'accept':>6} {'spec tok/s':>10} {'plain tok/s':>11} "
          f"{'speedup':>7}  step ms by phase (speculative)")
    for name, report in rows.items():
        for block, entry in report["by_block_size"].items():
            for concurrency, r in entry["by_concurrency"].items():
                spec, plain = r["speculative"], r["plain"]
                phases = " ".join(f"{k} {v:.2f}" for k, v in sorted(r["speculative_step_ms_by_phase"].items()))
                print(f"{name:<12} {block:>5} {concurrency:>4} {spec['acceptance_length']:>6.2f} "
                      f"{spec['tokens_per_second_aggregate']:>10.1f} {plain['tokens_per_second_aggregate']:>11.1f} "
                      f"{r['speedup_aggregate']:>6.2f}x  {phases}")


if __name__ == "__main__":
    sys.exit(main())
