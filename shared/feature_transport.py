"""How the context features (tapped target hidden states) travel from verify rank 0 to the draft worker.

Two transports behind one pair of calls, chosen by config (`--feature-transport`):
- frames (default): the tensor rides in the ZeroMQ draft message as a raw frame (host memory).
- pair: a two-rank torch.distributed group, verify rank 0 = rank 0, draft worker = rank 1 (NCCL when the
  tensors live on CUDA devices, gloo otherwise, the same code either way); the ZeroMQ message carries only
  the dtype and shape. The group is built per session: the verify side opens a new session whenever the
  drafter (re)connects, so a restarted drafter gets a fresh group. A rendezvous or send that does not
  complete within the timeout raises TransportError, which the caller treats like a drafter timeout.
"""

import os
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shared.errors import DFlashError
from shared.tensor_frames import TORCH_DTYPES, WIRE_NAMES, from_raw, to_raw
from shared.wire import RawTensor


class TransportError(DFlashError):
    pass


@dataclass
class Outgoing:
    """What the draft message carries for one features tensor."""

    frames: RawTensor | None  # the tensor itself (frames transport) or None (pair)
    session: str  # "" for frames
    dtype: str
    shape: list[int]


def parse_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise DFlashError(f"feature pair address {address!r} is not HOST:PORT")
    return host, int(port)


def pair_backend(device: str, backend: str = "auto") -> str:
    if backend != "auto":
        return backend
    return "nccl" if str(device).startswith("cuda") else "gloo"


class FrameTransport:
    name = "frames"

    def outgoing(self, features: torch.Tensor) -> Outgoing:
        raw = to_raw(features)
        return Outgoing(raw, "", raw.dtype, list(raw.shape))

    def push(self, features: torch.Tensor, outgoing: Outgoing) -> None:
        """Nothing to do: the tensor went with the message."""

    def pull(self, frames: RawTensor | None, session: str, dtype: str, shape: list[int]) -> torch.Tensor:
        if frames is None:
            raise TransportError("this draft worker reads features from message frames, but none came "
                                 "(is the verify worker configured with --feature-transport pair?)")
        return from_raw(frames)

    def reset(self) -> None:
        pass


class PairTransport:
    """One end of the verify rank 0 <-> draft worker tensor pair. The verify end hosts the rendezvous store."""

    name = "pair"

    def __init__(self, address: str, sender: bool, device: str = "cpu", backend: str = "auto",
                 timeout_s: float = 5.0):
        self.host, self.port = parse_host_port(address)
        if self.host in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: do not depend on the hostname resolving
        self.sender, self.device, self.timeout_s = sender, torch.device(device), timeout_s
        self.backend = pair_backend(device, backend)
        # where the tensor sits while it travels: NCCL moves device memory, gloo host memory only
        self.staging = self.device if self.backend == "nccl" else torch.device("cpu")
        self.store: dist.TCPStore | None = None
        self.session, self.group = "", None
        if sender:
            self._store()  # the verify end hosts the rendezvous: up before any drafter connects

    # ------------------------------------------------------------------ groups
    def _store(self) -> "dist.TCPStore":
        if self.store is None:
            try:
                self.store = dist.TCPStore(self.host, self.port, 2, is_master=self.sender,
                                           timeout=timedelta(seconds=self.timeout_s), wait_for_workers=False)
            except (RuntimeError, OSError) as exc:
                raise TransportError(f"feature pair store at {self.host}:{self.port}: {exc}") from None
        return self.store

    def _group(self, session: str):
        if self.group is not None and session == self.session:
            return self.group
        store = dist.PrefixStore(f"dflash-features/{session}", self._store())
        rank, timeout = (0 if self.sender else 1), timedelta(seconds=self.timeout_s)
        try:
            if self.backend == "nccl":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                group = dist.ProcessGroupNCCL(store, rank, 2, options)
            else:
                group = dist.ProcessGroupGloo(store, rank, 2, timeout=timeout)
        except (RuntimeError, OSError) as exc:
            raise TransportError(f"feature pair rendezvous ({session}) failed: {exc}") from None
        self.session, self.group = session, group
        return group

    def reset(self) -> None:
        """Drop the group: the next call opens a new session (after a timeout or a drafter restart)."""
        self.session, self.group = "", None

    # ------------------------------------------------------------------ verify end
    def outgoing(self, features: torch.Tensor) -> Outgoing:
        if features.dtype not in WIRE_NAMES:
            raise TransportError(f"features of dtype {features.dtype} cannot travel")
        if not self.session:
            self.session = uuid.uuid4().hex[:12]
        return Outgoing(None, self.session, WIRE_NAMES[features.dtype], list(features.shape))

    def push(self, features: torch.Tensor, outgoing: Outgoing) -> None:
        """After the message went out: join the session's group (first time) and send the tensor."""
        if not features.numel():
            return
        group = self._group(outgoing.session)
        try:
            group.send([features.to(self.staging).contiguous()], 1, 0).wait()
        except RuntimeError as exc:
            self.reset()
            raise TransportError(f"feature pair send failed: {exc}") from None

    # ------------------------------------------------------------------ draft end
    def pull(self, frames: RawTensor | None, session: str, dtype: str, shape: list[int]) -> torch.Tensor:
        if not session:
            if frames is None:
                raise TransportError("a draft call came with neither feature frames nor a pair session")
            return from_raw(frames)  # a verify worker on frames still works with a pair-configured drafter
        if dtype not in TORCH_DTYPES:
            raise TransportError(f"feature dtype {dtype!r} is not known")
        tensor = torch.empty(shape, dtype=TORCH_DTYPES[dtype], device=self.staging)  # the drafter moves it
        if not tensor.numel():
            return tensor
        group = self._group(session)
        try:
            group.recv([tensor], 0, 0).wait()
        except RuntimeError as exc:
            self.reset()
            raise TransportError(f"feature pair receive failed: {exc}") from None
        return tensor


def make_transport(kind: str, address: str | None, sender: bool, device: str, backend: str = "auto",
                   timeout_s: float = 5.0):
    if kind == "frames":
        return FrameTransport()
    if kind != "pair":
        raise DFlashError(f"unknown feature transport {kind!r} (frames or pair)")
    if not address:
        raise DFlashError("--feature-transport pair needs --feature-pair-addr HOST:PORT")
    return PairTransport(address, sender, device, backend, timeout_s)
