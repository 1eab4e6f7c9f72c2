"""dflash-serve: the gateway, verify worker and draft worker as three local processes (the verify worker as
--tp processes, one per tensor-parallel rank, rank 0 owning its sockets).

Each child's command line names its role; its settings, made from dflash-serve's, reach it as JSON in
$DFLASH_SETTINGS. On a CPU the launcher reads the host's memory once, before any child starts, and hands the
figure to the verify worker's memory plan (--cpu-memory-gb). The launcher waits for each child's ready line,
prints one line of its own, restarts a drafter that dies, and exits non-zero (after the gateway has failed the
open streams) when the verify worker or the gateway dies, so a supervisor can restart the service. A child that
dies before it is ready is reported with its cause: its exit status or signal, an OOM kill named as such, its
peak memory and what its plan asked, and the last lines of its log (children's stderr passes through the
launcher). SIGTERM drains: the gateway refuses new connections and lets the requests in flight finish
(--shutdown-timeout), then every child stops. Ctrl-C reaches every child of the terminal's process group at
once and stops them now. Children also die with the launcher (PR_SET_PDEATHSIG), so none is orphaned.
"""

import argparse
import collections
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

from gateway.child_exit import ChildExit, describe_exit
from shared.host_memory import oom_kill_count, read_host_memory
from shared.role import READY_PREFIX, parse_memory_line
from shared.settings.commands import DraftCommand, GatewayCommand, ServeCommand, VerifyCommand
from shared.settings.options import SETTINGS_ENV, environment_defaults, overlay, parse_command, to_json
from shared.settings.options import build_parser as settings_parser
from shared.settings.topics import ChannelSettings

BROKEN_GROUP_GRACE_S = 2.0  # after a rank failed: the survivors' group is broken, they have nothing to drain
LOG_TAIL_LINES = 12  # a child's last log lines, repeated when it dies before it is ready
GB = 10**9  # --cpu-memory-gb's unit
MODULES = {"verify": "verify_worker.server", "draft": "draft_worker.server", "gateway": "gateway.main"}


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _pass_on(line: str) -> None:
    """A child's line onto our stderr; a closed stderr drops it (the child's pipe is still drained)."""
    try:
        sys.stderr.write(line)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


class Child:
    """One child process: its role and the settings the launcher hands it ($DFLASH_SETTINGS, private to the user,
    unlike a command line: the API key travels in it)."""

    def __init__(self, role: str, settings, env: dict):
        self.role, self.settings, self.env = role, settings, env
        self.process: subprocess.Popen | None = None
        self.ready = threading.Event()
        self.restarts = 0
        self.log_tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self.memory: tuple[int, int] | None = None  # (asked, given) in bytes, where its memory plan announced them
        self.peak_rss: int | None = None  # bytes, once it has exited (the kernel's count for the child)
        self.log_reader: threading.Thread | None = None

    def start(self) -> None:
        self.ready.clear()
        command = [sys.executable, "-m", MODULES[self.role], "--role", self.role]
        parallel = getattr(self.settings, "parallel", None)
        if parallel is not None and parallel.world_size > 1:
            command += ["--rank", str(parallel.rank)]  # for ps and the process tools; the same as its settings'
        env = {**self.env, SETTINGS_ENV: to_json(self.settings)}
        self.log_tail.clear()
        self.memory = self.peak_rss = None
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                        errors="replace", preexec_fn=_die_with_parent)
        threading.Thread(target=self._read, args=(self.process,), daemon=True).start()
        self.log_reader = threading.Thread(target=self._read_log, args=(self.process,), daemon=True)
        self.log_reader.start()

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            memory = parse_memory_line(line)
            if line.startswith(f"{READY_PREFIX} {self.role}"):
                self.ready.set()
            elif memory is not None:
                self.memory = memory
            else:
                _pass_on(line)

    def _read_log(self, process: subprocess.Popen) -> None:
        """Its stderr through to ours, the last lines kept."""
        for line in process.stderr:
            self.log_tail.append(line.rstrip("\n"))
            _pass_on(line)

    def exited(self) -> int | None:
        """Its exit status (a negative signal number where a signal ended it), or None while it runs; reaped here
        with wait4, which also gives the child's peak resident memory."""
        process = self.process
        if process is None or process.returncode is not None:
            return None if process is None else process.returncode
        try:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        except ChildProcessError:
            return process.poll()
        if pid == 0:
            return None
        process.returncode = os.waitstatus_to_exitcode(status)
        self.peak_rss = usage.ru_maxrss * 1024  # kB on Linux
        return process.returncode

    def exit_report(self, name: str, oom_kills_before: int | None) -> ChildExit:
        """What ended it (an exited child: exited() has returned its status); name: its key (verify.1, draft)."""
        if self.log_reader is not None:
            self.log_reader.join(2.0)  # its stderr read to the end, so that its last lines are its last
        after = oom_kill_count()
        oom = None if oom_kills_before is None or after is None else after > oom_kills_before
        status = self.process.returncode if self.process is not None else None
        return ChildExit(name, status, oom, self.peak_rss, self.memory, tuple(self.log_tail))

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM (and SIGCONT, so that a stopped child takes it), then SIGKILL after grace_s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        self.process.send_signal(signal.SIGCONT)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def build_parser(environ=None) -> argparse.ArgumentParser:
    return settings_parser(ServeCommand, "dflash-serve", __doc__, environ)


def parse_args(argv) -> ServeCommand:
    """dflash-serve's settings (shared.settings: ServeCommand); a bad value or combination exits 2."""
    return parse_command(ServeCommand, build_parser(), argv)[0]


def _with_demo_pair(settings: ServeCommand) -> ServeCommand:
    """Without --target: the embedded demo pair (its drafter unless --draft names another), named dflash-demo."""
    if settings.model.target is not None:
        return settings
    from shared.demo_models import default_pair

    pair = default_pair(settings.model.draft)
    print(f"dflash-serve: no --target given: serving {pair.label}", file=sys.stderr)
    name = settings.http.served_model_name or ("dflash-demo" if pair.embedded else "dflash-random-demo")
    return replace(settings, model=replace(settings.model, target=str(pair.target), draft=str(pair.draft)),
                   http=replace(settings.http, served_model_name=name))


def with_host_memory(settings: ServeCommand) -> ServeCommand:
    """On a CPU without --cpu-memory-gb: the host's memory read now, once, before any role starts (so that no
    role's plan counts what another has loaded meanwhile), and given to the verify worker's plan."""
    engine = settings.engine
    if not settings.model.device.startswith("cpu") or engine.cpu_memory_gb is not None:
        return settings
    found = read_host_memory()
    if found is None:
        return settings
    print(f"dflash-serve: the roles may use {found.available / 2**30:.1f} GiB of memory together: {found.source} "
          f"(--cpu-memory-gb sets it)", file=sys.stderr)
    return replace(settings, engine=replace(engine, cpu_memory_gb=found.available / GB))


def build_children(settings: ServeCommand) -> dict[str, Child]:
    """Each child's settings, made from dflash-serve's: the addresses from --zmq-base-port, the metrics ports
    from --metrics-base-port, the gateway's queue from --max-running + --max-waiting; what dflash-serve does not
    set comes from the environment, as the child would read it itself."""
    settings = _with_demo_pair(settings)
    model, serve, engine = settings.model, settings.serve, settings.engine
    if model.no_draft or not model.draft:
        model = replace(model, draft=None, no_draft=True)
    base = serve.zmq_base_port
    channels = ChannelSettings(requests_addr=f"tcp://127.0.0.1:{base}", events_addr=f"tcp://127.0.0.1:{base + 1}",
                               draft_addr=f"tcp://127.0.0.1:{base + 2}")
    kind = settings.transport.feature_transport
    pair_addr = f"127.0.0.1:{serve.feature_pair_port or base + 4}" if kind == "pair" else None
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.pop(SETTINGS_ENV, None)
    own = environment_defaults(VerifyCommand, env)
    parallel = replace(own.parallel, world_size=settings.parallel.world_size, rank=0,
                       master_port=serve.tp_master_port or base + 3,
                       collective_timeout=settings.parallel.collective_timeout)
    verify = replace(own, model=model, engine=engine, channels=channels, threads=settings.verify_threads,
                     parallel=parallel,
                     speculation=overlay(own.speculation, settings.speculation, ServeCommand, "speculation"),
                     transport=replace(own.transport, feature_transport=kind, feature_pair_addr=pair_addr),
                     metrics=replace(own.metrics, metrics_port=serve.metrics_base_port,
                                     metrics_host=settings.metrics.metrics_host))
    children = {"verify": Child("verify", verify, env)}
    for rank in range(1, parallel.world_size):  # rank 0 reports the metrics for the worker
        follower = replace(verify, metrics=replace(verify.metrics, metrics_port=0),
                           parallel=replace(parallel, rank=rank))
        children[f"verify.{rank}"] = Child("verify", follower, env)
    if model.draft and settings.speculation.draft_placement == "worker":
        own = environment_defaults(DraftCommand, env)
        children["draft"] = Child("draft", replace(
            own, model=model, channels=channels, threads=settings.draft_threads,
            speculation=overlay(own.speculation, settings.speculation, ServeCommand, "speculation"),
            worker=replace(own.worker, max_requests=engine.max_running),
            transport=replace(own.transport, feature_transport=kind, feature_pair_addr=pair_addr),
            metrics=replace(own.metrics, metrics_port=serve.metrics_base_port + 1,
                            metrics_host=settings.metrics.metrics_host)), env)
    own = environment_defaults(GatewayCommand, env)
    http = replace(overlay(own.http, settings.http, ServeCommand, "http"),
                   max_pending=engine.max_running + engine.max_waiting)
    children["gateway"] = Child("gateway", replace(own, model=model, http=http, channels=channels), env)
    return children


class Launcher:
    def __init__(self, settings: ServeCommand, children: dict[str, Child]):
        self.settings, self.children = settings, children
        self.http = children["gateway"].settings.http
        self.stopping = False
        self.oom_kills_before = oom_kill_count()  # an OOM kill of a child shows as this count rising

    def verify_ranks(self) -> list[str]:
        return [key for key in self.children if key.split(".")[0] == "verify"]

    def stop_all(self, rank_grace_s: float = 10.0) -> None:
        """The gateway first (it drains the requests in flight while the workers still serve them), then the
        verify ranks (each killed if it has not exited rank_grace_s after SIGTERM) and the drafter."""
        for key in ("gateway", *self.verify_ranks(), "draft"):
            if key in self.children:
                grace = {"gateway": self.http.shutdown_timeout + 5, "draft": 10.0}.get(key, rank_grace_s)
                self.children[key].stop(grace)

    def _wait_ready(self, roles: list[str]) -> str | None:
        """None when every role reported ready; otherwise why not: the dead role's message, a timeout's, or
        "interrupted"."""
        deadline = time.monotonic() + self.settings.serve.ready_timeout
        pending = roles
        while time.monotonic() < deadline and not self.stopping:
            pending = [r for r in roles if not self.children[r].ready.is_set()]
            if not pending:
                return None
            for role in pending:
                if self.children[role].exited() is not None:
                    return describe_exit(self.children[role].exit_report(role, self.oom_kills_before))
            time.sleep(0.05)
        if self.stopping:
            return "interrupted"
        return (f"the {', '.join(pending)} role did not become ready within --ready-timeout "
                f"{self.settings.serve.ready_timeout:g} s")

    def _gateway_sees_verify_down(self, timeout_s: float = 10.0) -> None:
        url = f"http://{self.http.host}:{self.http.port}/ready"
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
                print(f"dflash-serve: error: {failed}", file=sys.stderr, flush=True)
            self.stop_all()
            return 0 if failed == "interrupted" else 2
        verify = self.children["verify"].settings
        local = verify.drafting and "draft" not in self.children
        drafter = (self.settings.model.draft or "demo drafter") if verify.drafting else "none"
        metrics_port = verify.metrics.metrics_port
        draft_metrics = f", draft :{metrics_port + 1}" if "draft" in self.children else ""
        print(f"dflash-serve ready: http://{self.http.host}:{self.http.port} (drafter: {drafter}"
              f"{' in the verify worker' if local else ''}; metrics: gateway /metrics, verify "
              f":{metrics_port}{draft_metrics})", flush=True)
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
                ended = self.children[dead[0]].exit_report(dead[0], self.oom_kills_before)
                print(f"dflash-serve: {describe_exit(replace(ended, log_tail=()), 'while serving')}"
                      "; stopping", file=sys.stderr, flush=True)
                self._gateway_sees_verify_down()
                time.sleep(3.0)  # clients keep getting clear 503s (not refused connections) for a moment
                self.stop_all(rank_grace_s=BROKEN_GROUP_GRACE_S)
                return 1
            if self.children["gateway"].exited() is not None and not self.stopping:
                print("dflash-serve: the gateway exited; stopping", file=sys.stderr, flush=True)
                self.stop_all()
                return 1
        self.stop_all()
        return 0


def show_plan(verify: Child) -> int:
    """--plan: the verify worker's memory plan (verify_worker/memory_plan.py, run with the settings its worker
    would get); its exit status: 0 fits, 1 does not, 2 a bad setting or config."""
    env = {**verify.env, SETTINGS_ENV: to_json(verify.settings)}
    return subprocess.run([sys.executable, "-m", "verify_worker.memory_plan"], env=env).returncode


def main(argv=None) -> int:
    settings = parse_args(argv)
    for path in (settings.model.target, settings.model.draft):
        if path is not None and not Path(path).is_dir():
            print(f"dflash-serve: error: checkpoint folder {path!r} does not exist", file=sys.stderr)
            return 2
    children = build_children(with_host_memory(settings))
    if settings.serve.plan:
        return show_plan(children["verify"])
    launcher = Launcher(settings, children)

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
