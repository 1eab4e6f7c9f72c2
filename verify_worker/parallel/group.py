"""TensorParallel: a rank's place in the tensor-parallel group and the collectives the sharded layers use.
World size 1 makes every collective the identity, so one code path serves TP 1 and TP N."""

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shared.errors import ConfigError


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1

    @property
    def parallel(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks (in place; every rank gets the same result)."""
        if self.parallel:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., world * n], rank order."""
        if not self.parallel:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, -1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank (in place)."""
        if self.parallel:
            dist.broadcast(x, 0)
        return x


@dataclass(frozen=True)
class GroupSettings:
    rank: int
    world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    backend: str = "auto"  # gloo on CPU, nccl on CUDA
    timeout_s: float = 30.0


def backend_for(device: str, backend: str) -> str:
    if backend != "auto":
        return backend
    return "nccl" if str(device).startswith("cuda") else "gloo"


def join_group(settings: GroupSettings, device: str) -> TensorParallel:
    """Join the tensor-parallel group (blocks until every rank has joined or the timeout passes)."""
    if not 0 <= settings.rank < settings.world_size:
        raise ConfigError(f"rank {settings.rank} is outside a world of size {settings.world_size}")
    if settings.world_size == 1:
        return TensorParallel()
    backend = backend_for(device, settings.backend)
    if backend == "nccl" and str(device).startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if backend == "gloo" and settings.master_addr in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: do not depend on the hostname resolving
    dist.init_process_group(
        backend, init_method=f"tcp://{settings.master_addr}:{settings.master_port}", rank=settings.rank,
        world_size=settings.world_size, timeout=timedelta(seconds=settings.timeout_s),
    )
    return TensorParallel(settings.rank, settings.world_size)


def leave_group(tp: TensorParallel, orderly: bool = True) -> None:
    """Tear the group down. orderly: every rank is leaving now, so meet at a barrier first (a rank that tears
    its connections down while a peer still uses them can abort the peer's process)."""
    if not (tp.parallel and dist.is_initialized()):
        return
    if orderly:
        try:
            dist.barrier()
        except RuntimeError:
            pass
    dist.destroy_process_group()
