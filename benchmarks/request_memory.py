"""What an oversized request costs the gateway, against a real dflash-serve with its DEFAULT flags (the embedded
demo pair unless --serve-args names a target): for each body kind and size, the HTTP status, the time to the
answer, the gateway's resident memory after the answer and its peak during it, and whether a greedy stream
running beside it ended identical to the same request served alone.

    python benchmarks/request_memory.py                         # 1, 20, 90 and 500 MB; text, token ids, chat
    python benchmarks/request_memory.py --sizes-mb 1,20 --kinds text --chunked

Bodies are sent on a raw socket, the body from a second thread while the answer is read, so the time to the
answer does not include sending a body the server refuses before reading; --chunked sends them with
Transfer-Encoding: chunked (no Content-Length: the server learns the size only while reading).
"""

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the test suite's helpers: process lookup

from processes import child_pid, resident_kb, stop_process  # noqa: E402

MB = 10**6
CHUNK = 1 << 20


def body_of(kind: str, size: int) -> bytes:
    """A JSON body of about `size` bytes whose bulk is one prompt: text, token ids or one chat message."""
    if kind == "text":
        head, tail, unit = b'{"prompt": "', b'", "max_tokens": 8, "temperature": 0}', b"ab "
    elif kind == "ids":
        head, tail, unit = b'{"prompt": [', b'17], "max_tokens": 8, "temperature": 0}', b"17, "
    elif kind == "chat":
        head, tail = b'{"messages": [{"role": "user", "content": "', b'"}], "max_tokens": 8, "temperature": 0}'
        unit = b"ab "
    else:
        raise ValueError(kind)
    return head + unit * max(1, (size - len(head) - len(tail)) // len(unit)) + tail


class PeakRss(threading.Thread):
    """Samples a process's resident memory every 10 ms until stopped; .peak in kB."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.stopped = pid, resident_kb(pid), threading.Event()

    def run(self):
        while not self.stopped.wait(0.01):
            self.peak = max(self.peak, resident_kb(self.pid))

    def stop(self) -> int:
        self.stopped.set()
        self.join()
        return self.peak


def post_raw(port: int, path: str, body: bytes, chunked: bool, timeout: float = 600) -> tuple[int, bytes, float, str]:
    """(status, response body, seconds to the whole answer, how the body's sending ended)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % len(body)
    head = b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n%s\r\n\r\n" % (
        path.encode(), framing)
    sent = {"outcome": "sending"}
    started = time.monotonic()

    def send():
        try:
            sock.sendall(head)
            view = memoryview(body)
            for start in range(0, len(body), CHUNK):
                piece = view[start:start + CHUNK]
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
            sent["outcome"] = f"whole body sent in {time.monotonic() - started:.2f} s"
        except OSError as exc:
            sent["outcome"] = f"send stopped: {type(exc).__name__}"

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(65536)
        if not piece:
            raise ConnectionError(f"closed before an answer ({sent['outcome']})")
        data += piece
    header, rest = data.split(b"\r\n\r\n", 1)
    status = int(header.split(b" ", 2)[1])
    length = next(int(line.split(b":", 1)[1]) for line in header.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        piece = sock.recv(65536)
        if not piece:
            break
        rest += piece
    elapsed = time.monotonic() - started
    sender.join(timeout)
    sock.close()
    return status, rest[:length], elapsed, sent["outcome"]


def stream_tokens(url: str, model: str, prompt: str, max_tokens: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True}
    tokens = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    raise RuntimeError(chunk["error"])
                tokens += chunk["choices"][0].get("token_ids", []) if chunk.get("choices") else []
    return tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", default="1,20,90,500")
    parser.add_argument("--kinds", default="text,ids,chat")
    parser.add_argument("--chunked", action="store_true", help="send bodies with Transfer-Encoding: chunked")
    parser.add_argument("--port", type=int, default=18300)
    parser.add_argument("--victim-tokens", type=int, default=300)
    parser.add_argument("--serve-args", default="", help="more dflash-serve flags, as one string")
    args = parser.parse_args()
    port = args.port
    command = [sys.executable, "-m", "gateway.launcher", "--port", str(port), "--zmq-base-port", str(port + 1),
               "--metrics-base-port", str(port + 4), "--tp-master-port", str(port + 6), "--feature-pair-port",
               str(port + 7), *args.serve_args.split()]
    log = open(ROOT / f"request_memory_{port}.log", "w")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
    try:
        if not process.stdout.readline().startswith("dflash-serve ready"):
            raise SystemExit(f"dflash-serve did not start (see {log.name})")
        url = f"http://127.0.0.1:{port}"
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        gateway = child_pid(process.pid, "gateway")
        victim_prompt = "def parse(text):\n"
        alone = stream_tokens(url, model, victim_prompt, args.victim_tokens)
        for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})):
            httpx.post(url + path, json={"model": model, **body}, timeout=60).raise_for_status()  # warm-up
        time.sleep(0.5)
        idle = resident_kb(gateway)
        print(f"gateway idle RSS after warm-up: {idle / 1024:.1f} MiB; framing: "
              f"{'chunked' if args.chunked else 'Content-Length'}")
        print("| body | size | status | answer (s) | RSS after (MiB) | over idle (MiB) | peak over idle (MiB) | "
              "body sending | victim | error message |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for kind in args.kinds.split(","):
            for size_mb in (float(s) for s in args.sizes_mb.split(",")):
                body = body_of(kind, int(size_mb * MB))
                path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
                victim = {}
                runner = threading.Thread(target=lambda: victim.update(
                    tokens=stream_tokens(url, model, victim_prompt, args.victim_tokens)))
                peak = PeakRss(gateway)
                peak.start()
                runner.start()
                status, answer, elapsed, sending = post_raw(port, path, body, args.chunked)
                runner.join(300)
                top = peak.stop()
                del body
                time.sleep(0.5)
                after = resident_kb(gateway)
                try:
                    message = json.loads(answer)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = answer[:80].decode(errors="replace")
                same = "identical" if victim.get("tokens") == alone else "DIFFERS"
                print(f"| {kind} | {size_mb:g} MB | {status} | {elapsed:.3f} | {after / 1024:.1f} | "
                      f"{(after - idle) / 1024:+.1f} | {(top - idle) / 1024:+.1f} | {sending} | {same} | "
                      f"{message[:110]} |", flush=True)
    finally:
        stop_process(process, 30)
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
