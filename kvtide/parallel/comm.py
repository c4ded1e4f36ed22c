"""The few torch.distributed operations the pipeline needs, in one place (gloo on CPU, NCCL on CUDA).

Activations go shard to shard with point-to-point messages whose sizes both sides know in advance (no size
headers); sends are asynchronous (``isend``) and kept alive until ``flush``, so a shard never waits for its
downstream (the pipeline is a chain: no cycle, no deadlock). Small control data (commands, plans, statuses)
goes through object collectives.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Message tags (gloo matches on them; NCCL ignores tags, which is fine: both sides post in the same order).
TAG_FORWARD = 1  # plain prefill / decode activations
TAG_PREFIX = 2  # last-layer replay rows for a downstream shard without a usable boundary activation
TAG_SUFFIX = 3  # suffix rows after a restoration

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}  # NVLink multicast off in every process we start


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init(rank: int, world: int, port: int, device: torch.device, timeout_s: float) -> None:
    """Join the process group: NCCL when the shard lives on a GPU, gloo otherwise."""
    os.environ.update(NCCL_ENV)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(device)
        kw["device_id"] = device
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kw)


class Link:
    """This shard's view of the chain: receive from rank-1, send to rank+1, collectives over all."""

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device
        self._pending: list[tuple[Any, torch.Tensor]] = []
        # Object collectives run on a gloo group of their own, next to the point-to-point group (NCCL, or gloo on
        # CPU): a collective issued from another thread (shard 0's status exchange while it replays) then never
        # interleaves with the activations' sends and receives.
        self._cpu_group = dist.new_group(backend="gloo")

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1

    # ---- point to point ------------------------------------------------------------------------------
    def send_next(self, t: torch.Tensor, tag: int) -> None:
        t = t.contiguous()
        if t.numel():
            self._pending.append((dist.isend(t, self.rank + 1, tag=tag), t))

    def recv_prev(self, rows: int, width: int, dtype: torch.dtype, tag: int) -> torch.Tensor:
        t = torch.empty(rows, width, dtype=dtype, device=self.device)
        if rows:
            dist.recv(t, self.rank - 1, tag=tag)
        return t

    def flush(self) -> None:
        """Wait until every message sent so far has left (buffers may be reused afterwards)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    # ---- collectives -----------------------------------------------------------------------------------
    def broadcast_obj(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self._cpu_group)
        return box[0]

    def all_gather_obj(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self._cpu_group)
        return out

    def gather_obj(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self._cpu_group)
        return out

    def all_reduce_ints(self, values: list[int], op: str) -> list[int]:
        """Elementwise min or max over ranks."""
        if not values:
            return []
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX, group=self._cpu_group)
        return t.tolist()

    def broadcast_tokens(self, tokens: list[int] | None, n: int) -> list[int]:
        """The last shard samples; every shard needs the tokens (next embeddings, stored records)."""
        t = torch.tensor(tokens if self.last else [0] * n, dtype=torch.int64)
        if n:
            dist.broadcast(t, src=self.world - 1, group=self._cpu_group)
        return t.tolist()
