"""What only a GPU run would show, checked on the CPU: the strategies' hooks with the weights on another device
than the code might assume (the meta device, where a CPU tensor meeting the weights fails as it would on a GPU),
ADPSGD's whole accumulation windows, and the settings a GPU or a cluster needs (bf16 reductions in fp32, gloo's
interface, learners sharing a GPU)."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from comm import ProcessLayout, build_strategy
from comm.staging import add_flat
from comm.staging import Staging


def meta_weights() -> list[torch.Tensor]:
    return [torch.nn.Parameter(torch.empty(5, 3, device="meta")), torch.nn.Parameter(torch.empty(7, device="meta"))]


def test_localsgd_steps_with_its_weights_on_another_device():
    strategy = build_strategy({"strategy": "localsgd", "period": 4, "warmup_steps": 10},
                              ProcessLayout(world_size=2, local_size=2))
    strategy.weights = SimpleNamespace(masters=meta_weights())
    # in its warm-up the averager only counts: nothing leaves the device, no process group is needed
    strategy.averager = PeriodicModelAverager(4, 10, process_group=object())
    strategy.after_step(engine=None)  # was: "attempting to assign a gradient with device type 'cpu' ... 'meta'"
    assert strategy.averager.step == 1


def test_gossip_staging_and_merges_stay_on_the_weights_device():
    weights = meta_weights()
    staging = Staging(weights)
    staging.capture()  # the part under the step lock: a copy on the weights' own device
    assert staging.flat.device == weights[0].device
    staging.add(torch.zeros(22))  # ADPSGD's merge: a host delta added on the device
    add_flat(weights, torch.zeros(22))  # HYBRID's merge
    assert all(w.device.type == "meta" for w in weights)


def test_the_staging_copies_and_merges_exactly_on_the_cpu():
    weights = [torch.randn(5, 3), torch.randn(7).to(torch.bfloat16)]  # a frozen bf16 parameter stays bf16
    staging = Staging(weights)
    staging.capture()
    snapshot = staging.to_host().clone()
    torch.testing.assert_close(snapshot, torch.cat([w.float().flatten() for w in weights]))
    staging.add(torch.ones(22))
    torch.testing.assert_close(torch.cat([w.float().flatten() for w in weights]), snapshot + 1, atol=0.07, rtol=0)
    assert weights[1].dtype == torch.bfloat16


class FakeStore:
    """The rendezvous store's atomic counter, in one process."""

    def __init__(self):
        self.counts, self.lock = {}, threading.Lock()

    def add(self, key, n):
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + n
            return self.counts[key]


@pytest.mark.parametrize("sampling", ["shared", "independent"])
def test_adpsgd_deals_whole_accumulation_windows(monkeypatch, sampling):
    from comm import adpsgd
    from recipe.lib.dataset import BucketBatchSampler

    monkeypatch.setattr(adpsgd, "store", lambda prefix, fake=FakeStore(): fake)
    lengths = np.arange(100, 100 + 83)  # 83 utterances, micro batch 4: 21 micro batches, 10 steps of 2 and one left
    learners = [build_strategy({"strategy": "adpsgd", "sampling": sampling},
                               ProcessLayout(rank=r, world_size=2, local_rank=r, local_size=2)) for r in range(2)]
    deals = [s.batches(BucketBatchSampler(lengths, 4, s.layout.rank, 2, seed=0), 1, 2) for s in learners]
    taken, done = [[], []], [False, False]
    order = [0, 0, 1, 0, 1, 1, 1, 0] * 10  # the learners ask in an uneven order, a micro batch at a time
    for rank in order:
        if not done[rank]:
            item = next(deals[rank], None)
            done[rank] = item is None
            if item is not None:
                taken[rank].append(item)
    assert all(done)
    assert all(len(t) % 2 == 0 and len(t) > 0 for t in taken), [len(t) for t in taken]  # whole steps only
    progress = [p for t in taken for _, p in t]
    assert max(progress) == pytest.approx(1.0, abs=0.05) and all(0 < p <= 1 for p in progress)
    if sampling == "shared":  # every utterance of the epoch's 10 whole steps once
        seen = np.concatenate([b for t in taken for b, _ in t])
        shuffle = BucketBatchSampler(lengths, 4, seed=0).epoch_batches(1)
        assert sorted(seen.tolist()) == sorted(np.concatenate(shuffle[:20]).tolist())


def test_bf16_gradients_are_reduced_in_fp32_unless_the_json_says_otherwise(tmp_path):
    from recipe.lib.ds_config import load_ds_config

    def load(extra: dict) -> dict:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "comm": {"strategy": "sync"}, **extra}))
        return load_ds_config(path)[0]

    assert load({"bf16": {"enabled": True}})["communication_data_type"] == "fp32"
    assert load({"bf16": {"enabled": True}, "communication_data_type": "bf16"})["communication_data_type"] == "bf16"
    assert "communication_data_type" not in load({})


def test_gloo_talks_over_the_interface_towards_the_rendezvous():
    import socket

    from comm.distributed import _ipv4_address, interface_towards

    assert interface_towards("127.0.0.1") == "lo"
    assert interface_towards("no-such-host.invalid") is None
    for _, name in socket.if_nameindex():  # this machine's own addresses: each reached through its interface
        address = _ipv4_address(name)
        if address is not None and not address.startswith("127."):
            assert interface_towards(address) == name


@pytest.mark.parametrize("gpus, local_rank, backend, device", [
    (0, 1, "gloo", 1),  # the CPU: gloo, DeepSpeed's own device choice
    (2, 1, "nccl", 1),  # a GPU per learner: NCCL, the learner's own
    (1, 1, "gloo", 0),  # two learners on one GPU: they share it and talk gloo
])
def test_learners_share_the_gpus_where_a_node_has_fewer_than_learners(monkeypatch, gpus, local_rank, backend,
                                                                      device):
    from comm.distributed import learner_device, world_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    env = {"LOCAL_RANK": str(local_rank), "LOCAL_SIZE": "2"}
    assert world_backend("nccl" if gpus else "gloo", env) == backend
    assert learner_device(env) == device
