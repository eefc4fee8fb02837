"""A scaling model of SYNC, ADPSGD, HYBRID and LOCALSGD: step and epoch time from compute, link and stragglers.

This machine has 2 cores; the paper used 16 to 64 GPUs. The model says what the strategies' costs add up to
at any size, from figures a user can measure or look up:

  compute     t_c = frames per step / frames per second of one learner (times its slowdown, see below)
  ring        allreduce of M bytes over n learners: 2 (n - 1) phases, each moving M / n bytes on every link
              of the ring:  2 (n - 1) (latency + M / (n * bandwidth)); the slowest link of the ring sets the pace
  exchange    one gossip exchange of M bytes each way at once (full duplex): latency + M / bandwidth,
              plus staging through host memory where the learner's weights are on a GPU
  SYNC        step = E[max over all learners of t_c] + ring(M, W, inter-node link when nodes > 1)
  ADPSGD      step of learner i = t_c,i + merge (the compute thread adds the received delta; the exchange
              itself runs beside the compute on the gossip thread). Learners step at their own pace, so
              the aggregate rate is the sum of the learners' rates. Rounds per step = min(1 / period,
              step / exchange): a slow link means fewer rounds (weaker mixing), not slower steps.
  HYBRID      node step = E[max over the node's learners of t_c] + ring(M, G, intra-node link)
              + merge + the leader's broadcast of the delta to the node when a round completed; nodes gossip
              like ADPSGD learners over the inter-node link
  LOCALSGD    learners step alone and allreduce the weights every `average_period` steps, which every learner
              waits for: step = (E[max over learners of the sum of their t_c over the period] + ring(M, W)) /
              average_period. The slowest learner still sets the pace, but a step's jitter averages out over
              the period, and the ring is paid once per period (the synchronous warm-up steps are left out)
  epoch       frames per epoch / aggregate frames/s; all but SYNC add one consensus allreduce

Stragglers: learner i's compute time is t_c x slow_i x a per-step factor drawn from a log-normal of mean 1
(jitter sigma: uneven batches, a noisy machine); E[max] is estimated by sampling with a fixed seed.

CPU learners sharing one host (Cluster.host_cores set, as on the machine the model is calibrated on): t_c is
measured with as many learners on the host as modelled, so the sharing of cores is in it. Two things change:
  - communication runs on the cores that compute: the gossip exchange no longer hides behind the compute
    (rounds per step = 1 / period, and step += share x (exchange + merge), share = learners x threads / cores
    when above 1);
  - with more learners than cores, a learner that waits in the allreduce gives its core to the others, so
    the per-step jitter costs no waiting (persistent slowdowns still do).
Everything here is a model: what it leaves out is listed in BENCHMARKS.md next to its calibration on this
machine and its check against the paper.

    python -m recipe.tools.simulate paper                  # the paper's runs, with every assumed figure printed
    python -m recipe.tools.simulate project [--out DIR]    # 8..512 learners per strategy, P100/V100/H200 figures
    python -m recipe.tools.simulate project --gpu-check OUT/gpu_check.json   # the H200 rate as measured there
    python -m recipe.tools.calibrate [--work DIR]         # measure here, predict 1, 2, 4 learners, compare
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

STRATEGIES = ("sync", "adpsgd", "hybrid", "localsgd")


@dataclass(frozen=True)
class Link:
    bandwidth_gbps: float  # one direction, Gbit/s
    latency_us: float

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.latency_us * 1e-6 + nbytes * 8 / (self.bandwidth_gbps * 1e9)


@dataclass(frozen=True)
class Cluster:
    learners: int
    per_node: int  # learners per node (G)
    frames_per_s: float  # one learner's training throughput, compute only
    intra: Link
    inter: Link
    staging: Link | None = None  # GPU <-> host copies of the weights for gossip (None: weights on the CPU)
    merge_s: float = 0.0  # compute-thread cost of adding a received delta
    slow: dict[int, float] = field(default_factory=dict)  # persistent slowdown factor of some learners
    jitter: float = 0.0  # sigma of the per-step log-normal factor on every learner's compute time
    host_cores: int | None = None  # CPU learners sharing a host of this many cores; None: a processor each
    threads: int = 1  # compute threads per learner (host_cores only)

    @property
    def share(self) -> float:
        """How many compute threads each core of a shared host runs (1 where nothing is oversubscribed)."""
        return max(1.0, self.learners * self.threads / self.host_cores) if self.host_cores else 1.0

    @property
    def nodes(self) -> int:
        return self.learners // self.per_node

    def __post_init__(self):
        if self.learners < 1 or self.per_node < 1 or self.learners % self.per_node:
            raise ValueError(f"learners={self.learners} do not split into nodes of per_node={self.per_node}")


@dataclass(frozen=True)
class Workload:
    params: int
    frames_per_step: float  # per learner per optimizer step
    frames_per_epoch: float
    epochs: int = 1
    bytes_per_param: int = 4  # on the wire
    period: int = 1  # gossip: optimizer steps between rounds
    average_period: int = 4  # LOCALSGD: optimizer steps between weight averages (ds_configs/localsgd.json)

    @property
    def model_bytes(self) -> float:
        return self.params * self.bytes_per_param


@dataclass(frozen=True)
class Estimate:
    strategy: str
    step_s: float  # mean optimizer-step time of a learner
    frames_per_s: float  # all learners together
    epoch_s: float
    rounds_per_step: float  # gossip rounds a learner (HYBRID: a node) completes per step
    epochs: int

    @property
    def total_h(self) -> float:
        return self.epoch_s * self.epochs / 3600


def ring_allreduce_s(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.seconds(nbytes / n)


def exchange_s(nbytes: float, link: Link, staging: Link | None) -> float:
    """One gossip exchange: both directions at once on the link, plus device -> host -> device staging."""
    return link.seconds(nbytes) + (2 * staging.seconds(nbytes) if staging else 0.0)


def compute_factors(cluster: Cluster, samples: int, seed: int) -> np.ndarray:
    """[samples, learners] multipliers of t_c: persistent slowdowns x per-step jitter (mean 1)."""
    slow = np.array([cluster.slow.get(i, 1.0) for i in range(cluster.learners)])
    if cluster.jitter == 0:
        return np.broadcast_to(slow, (1, cluster.learners))
    z = np.random.default_rng(seed).standard_normal((samples, cluster.learners))
    return slow * np.exp(cluster.jitter * z - cluster.jitter ** 2 / 2)


def estimate(strategy: str, cluster: Cluster, work: Workload, samples: int = 4000, seed: int = 0) -> Estimate:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    t_c = work.frames_per_step / cluster.frames_per_s
    if cluster.share > 1:  # a waiting learner's core goes to the others: uneven steps cost no waiting
        cluster = replace(cluster, jitter=0.0)
    factors = compute_factors(cluster, samples, seed) * t_c  # [samples, learners] compute seconds
    m, w, g = work.model_bytes, cluster.learners, cluster.per_node
    gossip_link = cluster.inter if cluster.nodes > 1 else cluster.intra
    consensus = ring_allreduce_s(m, w, gossip_link)

    def gossip(exchange: float, step: float) -> tuple[float, float]:
        """-> (seconds a round adds to a step, rounds per step): on a shared host the exchange takes the
        compute's cores; elsewhere it overlaps, and a slow link means fewer rounds, not slower steps."""
        if cluster.host_cores:
            return cluster.share * (exchange + cluster.merge_s) / work.period, 1 / work.period
        return cluster.merge_s, min(1 / work.period, (step + cluster.merge_s) / exchange)

    if strategy == "sync":
        step = float(factors.max(axis=1).mean()) + ring_allreduce_s(m, w, gossip_link)
        rate, rounds = w * work.frames_per_step / step, 0.0
        consensus = 0.0
    elif strategy == "adpsgd":
        compute = factors.mean(axis=0)  # each learner at its own pace
        added, rounds = gossip(exchange_s(m, gossip_link, cluster.staging), float(compute.mean()))
        steps = compute + added
        rate = float((work.frames_per_step / steps).sum())
        step = float(steps.mean())
    elif strategy == "localsgd":
        h = work.average_period
        per_step = np.repeat(factors, h, axis=0) if factors.shape[0] == 1 else factors  # no jitter: one row
        periods = per_step[: per_step.shape[0] // h * h].reshape(-1, h, w).sum(axis=1)  # [periods, learners]
        step = (float(periods.max(axis=1).mean()) + ring_allreduce_s(m, w, gossip_link)) / h
        rate, rounds = w * work.frames_per_step / step, 1 / h
    else:
        if cluster.nodes < 2:
            raise ValueError("hybrid needs at least 2 nodes")
        node_compute = factors.reshape(factors.shape[0], cluster.nodes, g).max(axis=2).mean(axis=0)
        base = node_compute + ring_allreduce_s(m, g, cluster.intra)
        added, rounds = gossip(exchange_s(m, cluster.inter, cluster.staging), float(base.mean()))
        base = base + added
        broadcast = rounds * cluster.intra.seconds(m) if g > 1 else 0.0  # leader -> node, per step on average
        steps = base + broadcast
        rate = float((g * work.frames_per_step / steps).sum())
        step = float(steps.mean())
    epoch = work.frames_per_epoch / rate + consensus
    return Estimate(strategy, step, rate, epoch, rounds, work.epochs)


# --- the paper's systems, every figure an assumption with its source --------------------------------------

PAPER_MODEL = dict(params=43_000_000, frames_per_step=128 * 21, frames_per_epoch=2000 * 3600 * 100, epochs=16)
PAPER_ASSUMPTIONS = [
    ("model", "43M parameters, fp32 on the wire (172 MB)", "DESIGN.md §1 (the paper's LSTM)"),
    ("data", "2000 h x 100 frames/s = 720M frames per epoch", "issue 6; SWB2000 at 10 ms frames"),
    ("epochs", "16", "ASSUMED (not in the abstract; the schedule anneals after about epoch 10)"),
    ("batch", "128 chunks of 21 frames per learner per step (2,688 frames)", "ASSUMED; 21-frame chunks: paper"),
    ("P100 compute", "16 epochs x 720M frames in one week on one GPU = 19,048 frames/s",
     "'one week' single-GPU: IBM Research blog, Oct 2019; ASSUMED to be a P100"),
    ("V100 compute", "P100 x 15.7 / 9.3 TFLOP/s (fp32 peaks) = 32,155 frames/s", "NVIDIA datasheets; ASSUMED ratio"),
    ("H200 compute", "V100 x 990 / 125 (dense bf16 vs fp16 tensor peaks) x 0.5 = 127,000 frames/s",
     "issue 6 (990 TFLOP/s); ASSUMED: an LSTM reaches half the V100's fraction of peak"),
    ("intra-node", "NVLink: 20 GB/s (160 Gbit/s), 10 us (P100); 50 GB/s, 10 us (V100); 450 GB/s, 5 us (H200)",
     "ASSUMED from NVLink 1/2/4 per-direction peaks, derated"),
    ("inter-node", "InfiniBand EDR 100 Gbit/s, effective 80 Gbit/s, 5 us (P100, V100); 400 Gbit/s NDR (H200)",
     "ASSUMED"),
    ("staging", "PCIe gen3 x16, 12 GB/s (P100, V100); gen5 50 GB/s (H200); weights cross it twice per exchange",
     "ASSUMED; the gossip thread exchanges host copies (comm/gossip.py)"),
    ("merge", "one host -> device copy of the delta per round", "this recipe's design"),
    ("learners per node", "4 (P100, V100), 8 (H200)", "ASSUMED (IBM Minsky / AC922 class nodes; HGX H200)"),
]


def gpu_cluster(gpu: str, learners: int, per_node: int | None = None, rate: float | None = None) -> Cluster:
    """A cluster of `gpu`s at the assumed figures above; rate: a measured compute rate (frames/s) instead."""
    assumed, intra, inter, staging, g = {
        "P100": (19_048, Link(160, 10), Link(80, 5), Link(96, 10), 4),
        "V100": (19_048 * 15.7 / 9.3, Link(400, 10), Link(80, 5), Link(96, 10), 4),
        "H200": (127_000, Link(3600, 5), Link(400, 5), Link(400, 5), 8),
    }[gpu]
    g = min(per_node or g, learners)
    return Cluster(learners, g, rate or assumed, intra, inter, staging, merge_s=staging.seconds(
        PAPER_MODEL["params"] * 4))


PAPER_RUNS = [  # (what, strategy, gpu, learners, reported hours)
    ("ADPSGD, 16 P100 (Zhang et al. 2019)", "adpsgd", "P100", 16, 14.0),
    ("HYBRID, 32 V100 (Zhang et al. 2019)", "hybrid", "V100", 32, 11.5),
    ("H-ADPSGD, 64 V100 (Zhang et al., Interspeech 2019)", "hybrid", "V100", 64, 5.2),
]


def paper_table() -> list[tuple[str, float, float]]:
    work = Workload(**PAPER_MODEL)
    return [(what, estimate(strategy, gpu_cluster(gpu, n), work).total_h, hours)
            for what, strategy, gpu, n, hours in PAPER_RUNS]


# The largest global batch (21-frame chunks) each strategy trains well with: IBM Research blog, Oct 2019
# (SYNC up to 4,096, ADPSGD up to 12,288); HYBRID ASSUMED like ADPSGD, LOCALSGD like SYNC. Past it, more
# learners mean smaller per-learner batches, not more frames per step.
GLOBAL_BATCH_LIMIT = {"sync": 4096, "adpsgd": 12288, "hybrid": 12288, "localsgd": 4096}


def per_learner_chunks(strategy: str, learners: int, base: int = 128) -> float:
    return min(base, GLOBAL_BATCH_LIMIT[strategy] / learners)


def measured_rate(gpu_check: Path, chunks: int = 128) -> tuple[float, str]:
    """The paper model's bf16 training frames/s in a recipe/tools/gpu_check.py output, at the measured micro
    batch nearest `chunks` (the projection's per-learner batch; a tie takes the smaller) -> (rate, its source)."""
    result = json.loads(gpu_check.read_text())
    rows = [r for r in result["throughput"] if r["model"] == "paper" and r["precision"] == "bf16" and
            "frames_per_s" in r]
    if not rows:
        raise SystemExit(f"{gpu_check}: no bf16 throughput of the paper's model in it")
    row = min(rows, key=lambda r: (abs(r["micro_batch"] - chunks), r["micro_batch"]))
    return row["frames_per_s"], (f"measured: {row['frames_per_s']:,.0f} frames/s, bf16, {row['micro_batch']} chunks "
                                 f"a step, {result['device_name']}, {result['date']} ({gpu_check})")


def projection(gpu: str, sizes=(8, 16, 32, 64, 128, 256, 512), rate: float | None = None) \
        -> dict[str, list[Estimate | None]]:
    """Hours per strategy and size, the global batch held at the strategy's limit; None where the strategy
    does not apply (HYBRID on a single node). rate: the GPU's compute rate as measured, instead of assumed."""
    table: dict[str, list[Estimate | None]] = {}
    for s in STRATEGIES:
        table[s] = []
        for n in sizes:
            cluster = gpu_cluster(gpu, n, rate=rate)
            work = Workload(**{**PAPER_MODEL, "frames_per_step": 21 * per_learner_chunks(s, n)})
            table[s].append(estimate(s, cluster, work) if s != "hybrid" or cluster.nodes > 1 else None)
    return table


def print_paper() -> None:
    print("Assumed figures (every one of them; change them in recipe/tools/simulate.py):")
    for what, value, source in PAPER_ASSUMPTIONS:
        print(f"  {what:>18}: {value}  [{source}]")
    print(f"\n{'run':<52} {'model (h)':>10} {'reported (h)':>13} {'model/reported':>15}")
    for what, model_h, reported_h in paper_table():
        print(f"{what:<52} {model_h:10.1f} {reported_h:13.1f} {model_h / reported_h:15.2f}")


def print_projection(out: Path | None, gpu_check: Path | None = None) -> None:
    sizes = (8, 16, 32, 64, 128, 256, 512)
    h200 = None
    if gpu_check is not None:
        h200, source = measured_rate(gpu_check)
        print(f"H200 compute rate {source}, in place of the assumed {gpu_cluster('H200', 1).frames_per_s:,.0f}")
    tables = {gpu: projection(gpu, sizes, rate=h200 if gpu == "H200" else None) for gpu in ("V100", "H200")}
    for gpu, table in tables.items():
        print(f"\n{gpu}: hours for {PAPER_MODEL['epochs']} epochs of SWB2000 (paper-sized model, assumptions "
              f"above; global batch capped at {GLOBAL_BATCH_LIMIT} chunks)")
        print(f"{'learners':>9}" + "".join(f"{s:>10}" for s in STRATEGIES)
              + f"{'chunks/learner S|A':>20}{'ADPSGD rounds/step':>20}")
        for i, n in enumerate(sizes):
            print(f"{n:>9}" + "".join(f"{table[s][i].total_h:10.2f}" if table[s][i] else f"{'-':>10}"
                                      for s in STRATEGIES)
                  + f"{per_learner_chunks('sync', n):>12.0f} | {per_learner_chunks('adpsgd', n):<5.0f}"
                  + f"{table['adpsgd'][i].rounds_per_step:20.2f}")
    if out is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, (gpu, table) in zip(axes, tables.items()):
        for s in STRATEGIES:
            ax.loglog(sizes, [e.total_h if e else math.nan for e in table[s]], "o-", label=s.upper())
        ax.set_title(f"{gpu} (model)")
        ax.set_xlabel("learners")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    axes[0].set_ylabel(f"hours for {PAPER_MODEL['epochs']} epochs of SWB2000")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "projection.png", dpi=100)
    print(f"\nplot: {out / 'projection.png'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("paper", help="the paper's runs: the model against the reported hours")
    proj = sub.add_parser("project", help="8 to 512 learners per strategy, V100 and H200")
    proj.add_argument("--out", default=None, help="folder for projection.png")
    proj.add_argument("--gpu-check", default=None, help="a gpu_check.json: the H200's compute rate as measured")
    a = p.parse_args(argv)
    if a.command == "paper":
        print_paper()
    else:
        print_projection(Path(a.out) if a.out else None, Path(a.gpu_check) if a.gpu_check else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
