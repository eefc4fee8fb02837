"""The world of learners: its initialization, its rendezvous store, and every process group, built from the
process layout in one place (DESIGN.md §5).

The store is created here, not left to torch's env:// rendezvous, so the recipe holds it by a public handle:
the heartbeat (comm/health.py), ADPSGD's shared batch counter and the groups of survivors (LiveGroup) keep
their keys in it under a prefix of their own.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from comm.layout import ProcessLayout


def init_distributed(timeout_s: float | None = None) -> None:
    """deepspeed.init_distributed on the accelerator's backend (NCCL on GPUs, gloo on CPU); a collective that
    waits longer than timeout_s (default: DeepSpeed's, 10 minutes or $DEEPSPEED_TIMEOUT) for a learner fails.

    When the rendezvous address is a loopback one (no hostfile: every learner on this machine), nothing from
    another machine can reach the learners: the store listens on the loopback address only (torch's TCPStore
    would listen on every interface) and gloo talks over the loopback interface. Otherwise gloo talks over the
    interface the route to the rendezvous address leaves from: left to itself, it binds whatever this host's
    name resolves to (Debian's 127.0.1.1, which no other node reaches, or a slow management network).
    $GLOO_SOCKET_IFNAME, where set, wins in both cases.

    On CPU, DeepSpeed would first JIT-compile its shared-memory allreduce op and map a 69 MB /dev/shm buffer per
    learner that it never unlinks: every run leaves them behind in RAM (a few dozen test runs filled 22 GB), the
    compile needs a C++ toolchain, and learners starting together race each other's compile in the shared
    extension cache. The op serves only DeepSpeed's inference_all_reduce, which training never calls, so it is
    marked unavailable here and DeepSpeed uses plain gloo.

    Where a node runs more learners than it has GPUs, they share them and talk gloo (gpus_shared)."""
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
    backend = world_backend(accelerator.communication_backend_name())
    global _store
    if not dist.is_initialized():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if _is_loopback(address):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
            _store = _loopback_store(port, world, rank == 0, timeout)
        else:
            interface = interface_towards(address)
            if interface is not None:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
            _store = dist.TCPStore(address, port, world, rank == 0, timeout)
        dist.init_process_group(backend, store=_store, rank=rank, world_size=world, timeout=timeout)
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)  # takes the process group made above


_collective_timeout = datetime.timedelta(minutes=10)
_store: dist.Store | None = None


def gpus_shared(env=os.environ) -> bool:
    """Whether this node runs more learners than it has GPUs (several learners on one GPU, as a test of the
    multi-learner strategies on a machine with one): they share the GPUs round robin (learner_device) and talk
    gloo, since NCCL refuses two ranks on one GPU."""
    local = int(env.get("LOCAL_SIZE", env.get("LOCAL_WORLD_SIZE", 1)))
    return torch.cuda.is_available() and local > torch.cuda.device_count()


def world_backend(accelerators: str, env=os.environ) -> str:
    """The world's backend: the accelerator's (NCCL on GPUs, gloo on the CPU), gloo where learners share a GPU."""
    return "gloo" if accelerators == "nccl" and gpus_shared(env) else accelerators


def learner_device(env=os.environ) -> int:
    """This learner's accelerator index: its local rank, modulo the GPUs where learners share them."""
    local_rank = int(env.get("LOCAL_RANK", 0))
    return local_rank % torch.cuda.device_count() if gpus_shared(env) else local_rank


def shutdown_distributed() -> None:
    """After a run that ended well, on every learner: leave every process group while the interpreter is still
    whole. Left to the interpreter's exit, gloo's worker threads are torn down with it and a learner may abort
    with "terminate called without an active exception" (pytorch/pytorch#190489; it killed one run of ten here,
    after its last checkpoint; with this alone, still one fresh-clone test run in two at stop 29, so recipe/train.py
    then leaves with os._exit, skipping that teardown). After a failure the groups are left alone: destroying them
    while another learner still waits in a collective can hang (torchtitan calls it only after success, too)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def store(prefix: str) -> dist.Store:
    """The rendezvous store (served by learner 0), seen under `prefix` so that users never clash."""
    if _store is None:
        raise RuntimeError("comm.distributed.init_distributed() has not run in this process")
    return dist.PrefixStore(prefix, _store)


def collective_timeout() -> datetime.timedelta:
    return _collective_timeout


@dataclass(frozen=True)
class ProcessGroups:
    """Every process group a strategy uses, built by every learner in the same order (new_group is collective)
    from the layout and the strategy's two choices: how many consecutive learners average gradients together
    (data_unit: the world for SYNC, 1 for ADPSGD, a node for HYBRID) and who gossips (gossip_ranks)."""

    data: object  # DeepSpeed's data-parallel group: the world (SYNC), a node (HYBRID), the learner (ADPSGD)
    model: object  # the learner alone (DeepSpeed's model-parallel group)
    gossip: object | None  # gloo, for the gossip thread only (DESIGN.md §9.6); None: no gossip

    @classmethod
    def build(cls, layout: ProcessLayout, data_unit: int, gossip_ranks: list[int] | None) -> "ProcessGroups":
        """Every group with train.collective_timeout_s, SYNC's world too: left to DeepSpeed, its clone of the
        world (deepspeed.utils.groups._clone_world_group) took torch's default timeout, 30 minutes on gloo, so a
        frozen learner held SYNC's allreduce that long whatever the setting (until stop 34)."""
        timeout = _collective_timeout
        singles = [dist.new_group([r], timeout=timeout) for r in range(layout.world_size)]
        units = singles if data_unit == 1 else [
            dist.new_group(list(range(u * data_unit, (u + 1) * data_unit)), timeout=timeout)
            for u in range(layout.world_size // data_unit)]
        data, model = units[layout.rank // data_unit], singles[layout.rank]
        gossip = None if gossip_ranks is None else \
            dist.new_group(ranks=gossip_ranks, backend="gloo", timeout=_collective_timeout)
        return cls(data, model, gossip)


class GroupMPU:
    """What DeepSpeed's `mpu` argument needs, over the groups built from the layout (ProcessGroups):
    data-parallel groups of `unit` consecutive ranks (1: every learner alone, ADPSGD; the learners of a node,
    HYBRID); the model-parallel group is the learner alone."""

    def __init__(self, groups: ProcessGroups, rank: int, unit: int):
        self.groups, self.data_rank, self.data_size = groups, rank % unit, unit

    def get_data_parallel_group(self):
        return self.groups.data

    def get_data_parallel_rank(self) -> int:
        return self.data_rank

    def get_data_parallel_world_size(self) -> int:
        return self.data_size

    def get_model_parallel_group(self):
        return self.groups.model

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1


class LiveGroup:
    """A gloo group of some learners, built by them alone (the others may be gone) from the rendezvous store
    under a prefix of its own. Not torch's new_group(..., use_local_synchronization=True): that names a group
    after how many groups this process already has, which differs between learners of different groups (a
    HYBRID leader is in the gossip group, its follower is not), so their rendezvous never met."""

    def __init__(self, ranks: list[int], rank: int, tag: str):
        self.group = dist.ProcessGroupGloo(store(f"live/{tag}/"), ranks.index(rank), len(ranks), _collective_timeout)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self.group.allreduce([tensor], options).wait()

    def barrier(self) -> None:
        self.group.barrier().wait()


def _is_loopback(address: str) -> bool:
    """A loopback address as written (127.0.0.1, ::1, localhost): not a host name that happens to resolve to
    one on this machine (Debian maps its own name to 127.0.1.1), which the other nodes reach by its real address."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def interface_towards(address: str) -> str | None:
    """The name of this machine's network interface that the route to `address` (IPv4) leaves from; None when
    there is none to be found. Connecting a UDP socket only looks the route up: nothing is sent."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            local = probe.getsockname()[0]
    except OSError:
        return None
    return next((name for _, name in socket.if_nameindex() if _ipv4_address(name) == local), None)


def _ipv4_address(interface: str) -> str | None:
    """An interface's IPv4 address (Linux's SIOCGIFADDR), or None."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            answer = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", interface[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(answer[20:24])


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
