"""dflash-serve: the gateway, verify worker and draft worker as three local processes (the verify worker as
--tp processes, one per tensor-parallel rank, rank 0 owning its sockets).

Each child's command line names its role. The launcher waits for each child's ready line, prints one line of
its own, restarts a drafter that dies, and exits non-zero (after the gateway has failed the open streams)
when the verify worker or the gateway dies, so a supervisor can restart the service. SIGTERM drains: the
gateway refuses new connections and lets the requests in flight finish (--shutdown-timeout), then every child
stops. Ctrl-C reaches every child of the terminal's process group at once and stops them now. Children also die
with the launcher (PR_SET_PDEATHSIG), so none is orphaned.
"""

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from gateway.body_limit import MAX_BODY_HELP, positive_mb
from shared.role import READY_PREFIX

MODULES = {"verify": "verify_worker.server", "draft": "draft_worker.server", "gateway": "gateway.main"}


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Child:
    def __init__(self, role: str, argv: list[str], env: dict):
        self.role, self.argv, self.env = role, argv, env
        self.process: subprocess.Popen | None = None
        self.ready = threading.Event()
        self.restarts = 0

    def start(self) -> None:
        self.ready.clear()
        command = [sys.executable, "-m", MODULES[self.role], "--role", self.role, *self.argv]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=None, text=True, env=self.env,
                                        preexec_fn=_die_with_parent)
        threading.Thread(target=self._read, args=(self.process,), daemon=True).start()

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            if line.startswith(f"{READY_PREFIX} {self.role}"):
                self.ready.set()
            else:
                sys.stderr.write(line)

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def stop(self, grace_s: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="target checkpoint folder (default: the embedded demo pair)")
    parser.add_argument("--draft", help="drafter checkpoint folder (default: the demo drafter with the demo target)")
    parser.add_argument("--no-draft", action="store_true", help="serve without a drafter (plain decoding)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI API")
    parser.add_argument("--served-model-name", help="the model name clients send (default: the target folder's "
                        "name; dflash-demo for the demo pair)")
    parser.add_argument("--api-key", default=os.environ.get("DFLASH_API_KEY"),
                        help="require Authorization: Bearer KEY on the API (default: $DFLASH_API_KEY, else none)")
    parser.add_argument("--block-size", type=int, help="the drafter's block: draft tokens per step + 1 (default: "
                        "the drafter's config)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the verify worker (processes)")
    parser.add_argument("--tp-master-port", type=int,
                        help="port of the tensor-parallel group's rendezvous (default: --zmq-base-port + 3)")
    parser.add_argument("--tp-timeout", type=float, default=30.0,
                        help="seconds a tensor-parallel collective may wait before the verify worker fails")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both workers)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and activations of both workers: float32, bfloat16, float16, or auto (the "
                             "checkpoint's dtype; on CPU float32 where the C++ kernels run, a bfloat16 "
                             "checkpoint's projections in bfloat16 on AMX, else bfloat16 only where it is native, "
                             "else float32)")
    parser.add_argument("--max-running", type=int, default=64,
                        help="requests holding a KV-cache slot at once (the batch's cap; lowered to fit --kv-cache-budget-mb)")
    parser.add_argument("--max-waiting", type=int, default=64, help="requests queued for a slot; more get 429")
    parser.add_argument("--max-model-len", type=int, help="the context: prompt plus output tokens (default: the "
                        "target's max_position_embeddings)")
    parser.add_argument("--max-prefill-tokens", type=int, default=512, help="prompt tokens prefilled per step")
    parser.add_argument("--kv-cache-budget-mb", type=float,
                        help="cap on the memory requests hold in the verify worker (its KV cache and the feature rows "
                             "kept for the drafter)")
    parser.add_argument("--zmq-base-port", type=int, default=5555,
                        help="ports N (requests), N+1 (token events), N+2 (draft calls) on 127.0.0.1")
    parser.add_argument("--metrics-base-port", type=int, default=9101,
                        help="Prometheus ports: N (verify worker), N+1 (draft worker); the gateway serves /metrics")
    parser.add_argument("--verify-threads", type=int, default=0, help="the verify worker's PyTorch threads (0: half "
                                                                          "the cores)")
    parser.add_argument("--verify-kernel-threads", type=int, default=0,
                        help="threads of the verify worker's C++ CPU layer stack (0: every core it may use)")
    parser.add_argument("--draft-threads", type=int, default=0, help="the draft worker's PyTorch threads (0: a "
                                                                        "quarter of the cores)")
    parser.add_argument("--draft-kernel-threads", type=int, default=0,
                        help="threads of the drafter's C++ CPU projections (0: every core it may use)")
    parser.add_argument("--draft-timeout", type=float, default=5.0,
                        help="the longest wait for a draft (a fresh drafter waits it until 4 calls are answered); "
                             "other calls wait 8x their recent median plus their extra context rows at the measured "
                             "cost of a row, at least 0.25 s (the verify worker's --draft-deadline-floor); a drafter "
                             "that closes its connection is noticed at once")
    parser.add_argument("--stall-timeout", type=float, default=300.0,
                        help="a verify worker whose loop makes no progress for this long is hung: it exits (0 = never)")
    parser.add_argument("--spec-policy", choices=["always", "adaptive"], default="adaptive",
                        help="adaptive (default): the verify worker decodes plainly while drafting is expected not to "
                             "pay at the batch size (a drafted step after 8 plain ones, and rarer where such probes "
                             "would cost over 5%% of the time, re-measures it; steps with a seeded sampled request "
                             "always draft); always: every step drafts")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="on a GPU, the verify worker computes each row of a step independently of the batch "
                             "(cuda_ext's row GEMM, norm and attention), for greedy speculative output equal to plain "
                             "decoding (--device cuda, bfloat16, --tp 1, a Qwen3/Llama target; not yet run on a GPU)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="the verify worker replays its decode steps from CUDA graphs, one per shape bucket, "
                             "captured at start-up (--device cuda, tensor parallelism 1, a Qwen3/Llama target)")
    parser.add_argument("--draft-placement", choices=["worker", "local"], default="worker",
                        help="worker: a draft worker process (the default); local: the drafter runs inside the "
                             "verify worker (no draft call between processes, no separate restart)")
    parser.add_argument("--draft-sampling", choices=["dense", "sparse", "greedy"], default="dense",
                        help="how the drafter proposes for sampled requests (all three are lossless)")
    parser.add_argument("--feature-transport", choices=["frames", "pair"], default="frames",
                        help="how hidden states reach the drafter: ZeroMQ frames, or a torch.distributed pair "
                             "(NCCL when both workers run on CUDA)")
    parser.add_argument("--feature-pair-port", type=int,
                        help="rendezvous port of the feature pair (default: --zmq-base-port + 4)")
    parser.add_argument("--ready-timeout", type=float, default=600.0,
                        help="seconds the processes together may take to load and report ready")
    parser.add_argument("--max-body-mb", type=positive_mb, default=None, help=MAX_BODY_HELP)
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds the gateway lets requests in flight finish (new connections are "
                             "refused meanwhile) before the workers stop; Ctrl-C stops at once")
    return parser


def parse_args(argv):
    return build_parser().parse_args(argv)


def build_children(args) -> dict[str, Child]:
    target, draft = args.target, args.draft
    if target is None:
        from shared.demo_models import default_pair

        pair = default_pair(draft)
        target, draft = str(pair.target), str(pair.draft)
        args.served_model_name = args.served_model_name or ("dflash-demo" if pair.embedded else "dflash-random-demo")
        print(f"dflash-serve: no --target given: serving {pair.label}", file=sys.stderr)
    if args.no_draft:
        draft = None
    base = args.zmq_base_port
    requests, events, drafts = (f"tcp://127.0.0.1:{base + i}" for i in range(3))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    common = ["--requests-addr", requests, "--events-addr", events]
    verify = ["--target", target, *common, "--draft-addr", drafts, "--metrics-port", str(args.metrics_base_port),
              "--max-running", str(args.max_running), "--max-waiting", str(args.max_waiting), "--device", args.device,
              "--dtype", args.dtype, "--threads", str(args.verify_threads),
              "--kernel-threads", str(args.verify_kernel_threads), "--draft-timeout", str(args.draft_timeout),
              "--stall-timeout", str(args.stall_timeout), "--spec-policy", args.spec_policy]
    gateway = ["--target", target, *common, "--host", args.host, "--port", str(args.port),
               "--max-pending", str(args.max_running + args.max_waiting), "--shutdown-timeout",
               str(args.shutdown_timeout)]
    verify += ["--max-prefill-tokens", str(args.max_prefill_tokens)] + (["--cuda-graphs"] if args.cuda_graphs else [])
    verify += ["--batch-invariant"] if args.batch_invariant else []
    for flag, value in (("--max-model-len", args.max_model_len), ("--block-size", args.block_size),
                        ("--kv-cache-budget-mb", args.kv_cache_budget_mb)):
        if value is not None:
            verify += [flag, str(value)]
    if args.max_model_len is not None:
        gateway += ["--max-model-len", str(args.max_model_len)]
    if args.served_model_name:
        gateway += ["--served-model-name", args.served_model_name]
    if args.max_body_mb is not None:
        gateway += ["--max-body-mb", repr(args.max_body_mb)]
    if args.api_key:
        env["DFLASH_API_KEY"] = args.api_key
    if args.feature_transport == "pair":
        pair = ["--feature-transport", "pair", "--feature-pair-addr",
                f"127.0.0.1:{args.feature_pair_port or base + 4}"]
        verify += pair
    children = {}
    if draft and args.draft_placement == "local":
        verify += ["--draft", draft, "--draft-placement", "local", "--draft-sampling", args.draft_sampling]
    elif draft:
        verify += ["--draft", draft]
        draft_argv = ["--target", target, "--draft", draft, "--draft-addr", drafts, "--metrics-port",
                      str(args.metrics_base_port + 1), "--max-requests", str(args.max_running), "--device",
                      args.device, "--dtype", args.dtype, "--threads", str(args.draft_threads),
                      "--kernel-threads", str(args.draft_kernel_threads), "--draft-sampling",
                      args.draft_sampling]
        if args.block_size is not None:
            draft_argv += ["--block-size", str(args.block_size)]
        if args.feature_transport == "pair":
            draft_argv += pair
        if args.max_model_len is not None:
            draft_argv += ["--max-model-len", str(args.max_model_len)]
        children["draft"] = Child("draft", draft_argv, env)
    else:
        verify.append("--no-draft")
        gateway.append("--no-draft")
    children["verify"] = Child("verify", verify, env)
    if args.tp > 1:
        master = ["--world-size", str(args.tp), "--master-port", str(args.tp_master_port or base + 3),
                  "--collective-timeout", str(args.tp_timeout)]
        for rank in range(1, args.tp):
            follower = list(verify)
            follower[follower.index("--metrics-port") + 1] = "0"  # rank 0 reports for the worker
            children[f"verify.{rank}"] = Child("verify", [*follower, *master, "--rank", str(rank)], env)
        children["verify"].argv = [*verify, *master, "--rank", "0"]
    children["gateway"] = Child("gateway", gateway, env)
    return children


class Launcher:
    def __init__(self, args, children: dict[str, Child]):
        self.args, self.children = args, children
        self.stopping = False

    def verify_ranks(self) -> list[str]:
        return [key for key in self.children if key.split(".")[0] == "verify"]

    def stop_all(self) -> None:
        """The gateway first (it drains the requests in flight while the workers still serve them), then the
        verify ranks and the drafter."""
        for key in ("gateway", *self.verify_ranks(), "draft"):
            if key in self.children:
                self.children[key].stop(self.args.shutdown_timeout + 5 if key == "gateway" else 10.0)

    def _wait_ready(self, roles: list[str]) -> str | None:
        """None when every role reported ready; otherwise the role that failed."""
        deadline = time.monotonic() + self.args.ready_timeout
        while time.monotonic() < deadline and not self.stopping:
            pending = [r for r in roles if not self.children[r].ready.is_set()]
            if not pending:
                return None
            for role in pending:
                if self.children[role].exited() is not None:
                    return role
            time.sleep(0.05)
        return "timeout" if not self.stopping else "interrupted"

    def _gateway_sees_verify_down(self, timeout_s: float = 10.0) -> None:
        url = f"http://{self.args.host}:{self.args.port}/ready"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(url, timeout=1)
            except Exception as exc:  # 503 (HTTPError) is what we wait for; a dead gateway ends the wait too
                if getattr(exc, "code", None) == 503 or self.children["gateway"].exited() is not None:
                    return
            time.sleep(0.2)

    def run(self) -> int:
        workers = [r for r in ("draft", *self.verify_ranks()) if r in self.children]
        for role in workers:
            self.children[role].start()
        failed = self._wait_ready(workers)
        if failed is None:
            self.children["gateway"].start()
            failed = self._wait_ready(["gateway"])
        if failed is not None:
            if failed != "interrupted":
                print(f"dflash-serve: error: the {failed} role did not become ready", file=sys.stderr)
            self.stop_all()
            return 0 if failed == "interrupted" else 2
        local = self.args.draft_placement == "local" and "draft" not in self.children and not self.args.no_draft
        drafter = self.args.draft or ("demo drafter" if "draft" in self.children or local else "none")
        draft_metrics = "" if local or "draft" not in self.children else f", draft :{self.args.metrics_base_port + 1}"
        print(f"dflash-serve ready: http://{self.args.host}:{self.args.port} (drafter: {drafter}"
              f"{' in the verify worker' if local else ''}; metrics: gateway /metrics, verify "
              f":{self.args.metrics_base_port}{draft_metrics})", flush=True)
        return self._supervise()

    def _supervise(self) -> int:
        while not self.stopping:
            time.sleep(0.2)
            draft = self.children.get("draft")
            if draft is not None and draft.exited() is not None and not self.stopping:
                draft.restarts += 1
                print(f"dflash-serve: the draft worker exited (code {draft.exited()}); restart #{draft.restarts}",
                      file=sys.stderr, flush=True)
                time.sleep(min(5.0, 0.5 * draft.restarts))
                draft.start()
            dead = [key for key in self.verify_ranks() if self.children[key].exited() is not None]
            if dead and not self.stopping:
                print(f"dflash-serve: the verify worker ({dead[0]}) exited (code {self.children[dead[0]].exited()})"
                      "; stopping", file=sys.stderr, flush=True)
                self._gateway_sees_verify_down()
                time.sleep(3.0)  # clients keep getting clear 503s (not refused connections) for a moment
                self.stop_all()
                return 1
            if self.children["gateway"].exited() is not None and not self.stopping:
                print("dflash-serve: the gateway exited; stopping", file=sys.stderr, flush=True)
                self.stop_all()
                return 1
        self.stop_all()
        return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.tp < 1:
        print(f"dflash-serve: error: --tp must be >= 1, got {args.tp}", file=sys.stderr)
        return 2
    if args.tp > 1 and args.draft_placement == "local":
        print("dflash-serve: error: --draft-placement local needs --tp 1 (the drafter needs the whole lm_head)",
              file=sys.stderr)
        return 2
    if args.batch_invariant and (not str(args.device).startswith("cuda") or args.tp > 1):
        print("dflash-serve: error: --batch-invariant needs --device cuda and --tp 1 (on CPU the default path, the C++ "
              "kernels, is row-invariant already; at TP > 1 an all-reduce's order depends on the message size)",
              file=sys.stderr)
        return 2
    for path in (args.target, args.draft):
        if path is not None and not Path(path).is_dir():
            print(f"dflash-serve: error: checkpoint folder {path!r} does not exist", file=sys.stderr)
            return 2
    launcher = Launcher(args, build_children(args))

    def on_signal(_signum, _frame):
        launcher.stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        return launcher.run()
    finally:
        launcher.stop_all()


if __name__ == "__main__":
    sys.exit(main())
