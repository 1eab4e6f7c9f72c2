"""Starts a real dflash-serve (three processes) on loopback with tiny random checkpoints, for end-to-end tests."""

import contextlib
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from conftest import tiny_draft_config, write_hf_checkpoint
from greedy_check import assert_same_or_near_tie
from processes import child_pid, stop_process
from tokenizers import Tokenizer

from draft_worker.draft_checkpoint import random_drafter, save_drafter
from shared.byte_tokenizer import END_OF_TEXT, write_byte_tokenizer
from verify_worker.target_loader import load_target

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def write_server_models(root: Path, dtype=None) -> tuple[Path, Path]:
    """A tiny random Qwen3 target (float32, or `dtype`) with a byte tokenizer, and a DFlash drafter for it."""
    target, draft = root / "target", root / "draft"
    write_hf_checkpoint(target, "qwen3", seed=7, dtype=dtype, vocab_size=258, max_position_embeddings=512)
    write_byte_tokenizer(target)
    (target / "tokenizer_config.json").write_text(json.dumps({"eos_token": END_OF_TEXT, "chat_template": CHAT_TEMPLATE}))
    save_drafter(random_drafter(tiny_draft_config(vocab=258, block_size=4), seed=3, std=0.2), draft)
    return target, draft


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel hands out for outgoing connections (ZeroMQ, HTTP clients, gloo): a block chosen in it
    can be taken by one of them between the check and the servers' bind (a TP test failed once with EADDRINUSE)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port_block(count: int) -> int:
    low, high = _ephemeral_ports()
    ranges = [(lo, hi - count) for lo, hi in ((10000, low), (high + 1, 65535)) if hi - count > lo]
    for _ in range(200):
        lo, hi = random.choice(ranges) if ranges else (20000, 60000)
        base = random.randint(lo, hi)
        if all(_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no free port block")


class Server:
    def __init__(self, target: Path, draft: Path | None, *extra: str, log_dir: Path):
        self.target, self._reference = target, None
        base = free_port_block(8)
        self.port, self.zmq_base, self.metrics_base = base, base + 1, base + 4
        command = [sys.executable, "-m", "gateway.launcher", "--target", str(target), "--port", str(self.port),
                   "--zmq-base-port", str(self.zmq_base), "--metrics-base-port", str(self.metrics_base),
                   "--served-model-name", "tiny", "--verify-threads", "1", "--draft-threads", "1",
                   "--tp-master-port", str(base + 6), "--feature-pair-port", str(base + 7), *extra]
        command += ["--draft", str(draft)] if draft else ["--no-draft"]
        self.stderr_path = log_dir / f"serve-{self.port}.log"
        self.stderr = open(self.stderr_path, "w")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        line = self.process.stdout.readline()
        if not line.startswith("dflash-serve ready"):
            self.stop()
            raise RuntimeError(f"server did not start: {line!r}\n{self.stderr_path.read_text()[-3000:]}")
        self.url = f"http://127.0.0.1:{self.port}"

    def child_pid(self, role: str, rank: int = 0) -> int:
        return child_pid(self.process.pid, role, rank)

    def reference(self) -> tuple:
        """(TargetModel, Tokenizer) of this server's target, loaded here (once) for reference computations."""
        if self._reference is None:
            self._reference = load_target(self.target), Tokenizer.from_file(str(self.target / "tokenizer.json"))
        return self._reference

    def assert_same_or_near_tie(self, prompt: str, got: list[int], want: list[int]) -> None:
        """Two greedy outputs of this server for a text prompt are equal, or first differ at a near-tie of the
        target (float32 rows of a verify block and of a one-token step differ by rounding)."""
        target, tokenizer = self.reference()
        assert_same_or_near_tie(target, tokenizer.encode(prompt, add_special_tokens=False).ids, got, want)

    def metrics(self, role: str) -> str:
        url = f"{self.url}/metrics" if role == "gateway" else \
            f"http://127.0.0.1:{self.metrics_base + (0 if role == 'verify' else 1)}/metrics"
        return httpx.get(url, timeout=10).text

    def wait_ready(self, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            response = httpx.get(f"{self.url}/ready", timeout=5)
            if response.status_code == 200:
                return response.json()
            time.sleep(0.2)
        raise TimeoutError(httpx.get(f"{self.url}/ready", timeout=5).json())

    def stop(self) -> int:
        code = stop_process(self.process, 30)
        self.stderr.close()
        return code


def serving(root: Path, *extra: str):
    """For a fixture (`yield from serving(...)`): dflash-serve on tiny models written under root, ready; it must
    exit 0 when stopped afterwards."""
    target, draft = write_server_models(root)
    server = Server(target, draft, *extra, log_dir=root)
    server.wait_ready()
    yield server
    assert server.stop() == 0


def metric_value(text: str, name: str, labels: dict | None = None) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total += sample.value
    return total


@contextlib.contextmanager
def demo_server(log: Path, *flags: str):
    """dflash-serve on the embedded demo pair with its default flags (only its ports set, and `flags`), its
    stderr in `log`: yields its URL once it says it is ready."""
    base = free_port_block(8)
    command = [sys.executable, "-m", "gateway.launcher", "--port", str(base), "--zmq-base-port", str(base + 1),
               "--metrics-base-port", str(base + 4), "--tp-master-port", str(base + 6), "--feature-pair-port",
               str(base + 7), *flags]
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
        try:
            if not process.stdout.readline().startswith("dflash-serve ready"):
                raise RuntimeError(f"dflash-serve did not start: {log.read_text()[-3000:]}")
            yield f"http://127.0.0.1:{base}"
        finally:
            stop_process(process, 30)
