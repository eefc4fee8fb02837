"""The strategy interface: the few hooks the training loop calls around one DeepSpeed engine.

The loop knows nothing else about how learners communicate. SYNC needs almost none of the hooks (DeepSpeed's
own allreduce does the work); ADPSGD and HYBRID use all of them (DESIGN.md section 3).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import signal
import socket
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from comm.layout import ProcessLayout
from comm.link import EmulatedLink


def init_distributed(timeout_s: float | None = None) -> None:
    """deepspeed.init_distributed on the accelerator's backend (NCCL on GPUs, gloo on CPU); a collective that
    waits longer than timeout_s (default: DeepSpeed's, 10 minutes or $DEEPSPEED_TIMEOUT) for a learner fails.

    When the rendezvous address is a loopback one (no hostfile: every learner on this machine), nothing from
    another machine can reach the learners: the store listens on the loopback address only (torch's TCPStore
    would listen on every interface) and gloo talks over the loopback interface.

    On CPU, DeepSpeed would first JIT-compile its shared-memory allreduce op and map a 69 MB /dev/shm buffer per
    learner that it never unlinks: every run leaves them behind in RAM (a few dozen test runs filled 22 GB), the
    compile needs a C++ toolchain, and learners starting together race each other's compile in the shared
    extension cache. The op serves only DeepSpeed's inference_all_reduce, which training never calls, so it is
    marked unavailable here and DeepSpeed uses plain gloo."""
    import deepspeed
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.constants import default_pg_timeout

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    global _collective_timeout
    timeout = _collective_timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None \
        else default_pg_timeout
    backend = accelerator.communication_backend_name()
    if _is_loopback(os.environ.get("MASTER_ADDR", "")) and not dist.is_initialized():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = _loopback_store(int(os.environ["MASTER_PORT"]), world, rank == 0, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)  # takes the process group made above


_collective_timeout = datetime.timedelta(minutes=10)


class LiveGroup:
    """A gloo group of some learners, built by them alone (the others may be gone) from the rendezvous store
    under a prefix of its own. Not torch's new_group(..., use_local_synchronization=True): that names a group
    after how many groups this process already has, which differs between learners of different groups (a
    HYBRID leader is in the gossip group, its follower is not), so their rendezvous never met."""

    def __init__(self, ranks: list[int], rank: int, tag: str):
        store = dist.PrefixStore(f"live/{tag}/", dist.distributed_c10d._get_default_store())
        self.group = dist.ProcessGroupGloo(store, ranks.index(rank), len(ranks), _collective_timeout)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self.group.allreduce([tensor], options).wait()

    def barrier(self) -> None:
        self.group.barrier().wait()


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(address)).is_loopback
    except (OSError, ValueError):
        return False


def _loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return "lo" if "lo" in names else names[0]


def _loopback_store(port: int, world: int, is_master: bool, timeout: datetime.timedelta) -> dist.TCPStore:
    """The rendezvous store, served by learner 0 on 127.0.0.1 only."""
    if not is_master:
        return dist.TCPStore("127.0.0.1", port, world, False, timeout)
    listener = socket.create_server(("127.0.0.1", port))
    return dist.TCPStore("127.0.0.1", port, world, True, timeout, master_listen_fd=listener.detach())


def collective_device() -> torch.device:
    """Tensors for collectives on the default (and DeepSpeed's) groups live here: NCCL takes GPU tensors
    only, gloo CPU ones. The gossip group is always gloo, on CPU copies."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Strategy:
    name = "base"
    # the keys this strategy accepts in the JSON "comm" section, with their defaults. For experiments and
    # fault tests, debug.slowdown {"rank": factor} makes those learners stragglers (each step then takes
    # factor x as long) and debug.die_at_step {"rank": n} SIGKILLs those learners at their n-th micro batch.
    options: dict = {"debug": {}, "link": {}}  # link: an emulated inter-node network (comm/link.py)
    # True: learners draw batches independently from the whole training set and an epoch ends on a global
    # count of utterances, so fast learners do more of the work (DESIGN.md trap 9). False: equal shards.
    independent_sampling = False
    goes_on = False  # True: the others go on without a lost learner (ADPSGD's comm.on_lost_learner)

    def __init__(self, layout: ProcessLayout, options: dict, heartbeat=None):
        """heartbeat: the learner's comm.health.Heartbeat, through which a strategy that goes on without a
        lost learner finds it (None: a lost learner stops the run)."""
        self.layout = layout
        self.heartbeat = heartbeat
        # the learners still in the run and a group of them for the collectives (None: the whole world); only
        # a strategy that goes on without lost learners ever narrows them
        self.live, self.live_group = list(range(layout.world_size)), None  # live_group: LiveGroup | None
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise ValueError(f'"comm" options {unknown} are unknown to strategy {self.name!r}; '
                             f"valid: {sorted(self.options) or 'none'}")
        self.conf = {**self.options, **options}
        unknown = sorted(set(self.conf["debug"]) - {"slowdown", "die_at_step"})
        if unknown:
            raise ValueError(f'"comm.debug" options {unknown} are unknown; valid: die_at_step, slowdown')
        self.link = EmulatedLink(self.conf["link"])
        self.boundary_bytes = 0.0  # bytes this learner sent across a node boundary (counted with a link only)
        self.slowdown = float(self.conf["debug"].get("slowdown", {}).get(str(layout.rank), 1.0))
        if self.slowdown < 1.0:
            raise ValueError(f"comm.debug.slowdown for rank {layout.rank} must be >= 1, got {self.slowdown}")
        self.die_at_step = int(self.conf["debug"].get("die_at_step", {}).get(str(layout.rank), 0))
        self._micro_steps = 0

    def reduce_live(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """All-reduce over the learners still in the run (collective over them); -> the result, on the device
        the collective ran on (the accelerator's for the world, CPU for gloo's group of survivors)."""
        if self.live_group is None:
            tensor = tensor.to(collective_device())
            dist.all_reduce(tensor, op=op)
        else:
            tensor = tensor.cpu()
            self.live_group.all_reduce(tensor, op)
        return tensor

    def barrier_live(self) -> None:
        """A barrier of the learners still in the run."""
        if self.live_group is None:
            dist.barrier()
        else:
            self.live_group.barrier()

    def lost_node_mates(self) -> list[int]:
        """After a collective failed mid-epoch: the lost learners without which this one cannot go on while the
        others can (HYBRID's node mates); [] makes the failure fatal, as it is for SYNC."""
        return []

    def mpu(self):
        """What DeepSpeed treats as its data-parallel group; None means the whole world."""
        return None

    @property
    def data_parallel_size(self) -> int:
        """Learners whose gradients DeepSpeed averages: its train_batch_size counts their micro batches."""
        return self.layout.world_size

    def attach(self, engine) -> None:
        """After deepspeed.initialize: every learner must start from the same weights."""
        self.model_bytes = sum(p.numel() * p.element_size() for p in engine.module.parameters())

    def step_lock_context(self):
        """Held around the optimizer step (ADPSGD: the gossip merge takes the same lock)."""
        return contextlib.nullcontext()

    def after_step(self, engine) -> None:
        """At every optimizer-step boundary."""

    def straggle(self, step_seconds: float) -> None:
        """The debug switches, after every micro batch: slowdown, die_at_step."""
        if self.slowdown > 1.0:
            time.sleep((self.slowdown - 1.0) * step_seconds)
        self._micro_steps += 1
        if self._micro_steps == self.die_at_step:
            os.kill(os.getpid(), signal.SIGKILL)

    def end_epoch(self, engine) -> dict:
        """At the end of an epoch, on every learner (collective); -> statistics for the training log."""
        if not self.link.enabled:
            return {}
        total = self.reduce_live(torch.tensor([self.boundary_bytes], dtype=torch.float64))
        return {"boundary_bytes_emulated_link": total.item()}

    def consensus(self, engine) -> nn.Module:
        """The model to evaluate and checkpoint: the same on every learner."""
        return engine.module

    def close(self) -> None:
        """Stop any background communication without deadlock."""
