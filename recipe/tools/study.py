"""The paper's experiments in one command: strategies, batch size, stragglers -> tables and plots.

    python -m recipe.tools.study [key=value ...]        e.g.  utterances=1500 strategy_learners=[4] slowdowns=[1,2,4]

With one seed and the same data (a subset of the built-in synthesized corpus, prepared once), the same epochs of
the fixed schedule for every run, on this machine's processes:
  1. strategies: SYNC, ADPSGD, HYBRID (`nodes` emulated nodes, the inter-node link emulated as `link`) and
     LOCALSGD (torch's periodic model averaging, post-local SGD) at each of `strategy_learners`, the same
     `global_batch`; at `learners`, SYNC's, ADPSGD's and LOCALSGD's runs are also the base runs of parts 2 and 3;
  2. batch size: each global batch of `batch_sweep` on `learners`, SYNC and ADPSGD, the learning rate by the
     recipe YAML's scaling rule for the strategy; which batches stay within `tolerance` of the first's CER;
  3. stragglers: learner 1 slowed by each of `slowdowns`, SYNC and ADPSGD; by each of `localsgd_slowdowns`,
     LOCALSGD.
The default's 19 runs take up to an hour on 2 cores (BENCHMARKS.md section 7).
Writes EXP/report.md (time per epoch, aggregate frames/s, held-out loss, CER/WER, bytes communicated, part 2's
updates and peak learning rate, and each run's time to a target CER: `target_factor` x SYNC's final CER, but
never below `target_min_errors` character errors on the held-out set; a run that ends without learning says so)
and loss_vs_time.png, cer_vs_time.png, loss_vs_epoch.png (per global batch and strategy), cer_vs_batch.png,
throughput_vs_straggler.png. Every run lives in EXP/runs/<name>; a run whose metrics.json exists is not run
again, so an interrupted study resumes where it stopped.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from recipe.lib.tables import read_table
from recipe.tools.bench import prepare_subset, run_arm
from recipe.train import no_learning


@dataclass
class StudyConf:
    exp: str = "exp/study"
    utterances: int = 3000  # training utterances of the built-in corpus (the dev set, scored every epoch: 100)
    epochs: int = 4  # the fixed schedule, annealed over the second half: SYNC converges (CER 0.4%)
    learners: int = 4  # parts 2 and 3
    strategy_learners: list = field(default_factory=lambda: [4, 8])  # part 1 at each, the same global batch
    nodes: int = 2  # HYBRID's emulated nodes (learners must split into them)
    link_gbps: float = 1.0  # the emulated inter-node link of part 1 (comm/link.py)
    link_latency_ms: float = 0.5
    global_batch: int = 32  # utterances per step over all learners, parts 1 and 3
    # part 2's global batches (1x-16x the first); the lr follows the YAML's scaling rule for each strategy
    batch_sweep: list = field(default_factory=lambda: [16, 32, 64, 128, 256])
    tolerance: float = 0.1  # a batch is tolerated when its final CER is within this (relative) of the first's
    slowdowns: list = field(default_factory=lambda: [1, 2])
    localsgd_slowdowns: list = field(default_factory=lambda: [1, 2])  # LOCALSGD's straggler runs: 1x and 2x
    # LOCALSGD's synchronous start: its JSON's and torch's example's 100 (a quarter of the default's 375 steps)
    localsgd_warmup_steps: int = 100
    target_factor: float = 1.5  # the target: held-out CER <= this x SYNC's final CER (part 1), time to it per run
    # ... but never below this many character errors of the held-out set: a converged run's CER on 100 utterances
    # is a few errors, and one lucky SYNC run (1 error of 1,708: BENCHMARKS.md section 7) set a target no other
    # strategy's run reached
    target_min_errors: int = 10
    overrides: list = field(default_factory=list)  # recipe YAML overrides for every run, e.g. [model.stack=4]


STRATEGY_JSON = {s: f"ds_configs/{s}.json" for s in ("sync", "adpsgd", "hybrid", "localsgd")}


def plan(conf: StudyConf) -> list[dict]:
    """Every run of the study: name, part, strategy, comm and engine changes, learners, nodes."""
    runs = [strategy_run(s, n, conf) for n in conf.strategy_learners for s in STRATEGY_JSON]
    for s in ("sync", "adpsgd"):  # the batch of parts 1 and 3 at `learners` is one run: base-<strategy>
        runs += [dict(name=f"batch{b}-{s}" if b != conf.global_batch else f"base-{s}", part="batch", strategy=s,
                      comm={}, engine=micro_batch(b, conf.learners), learners=conf.learners, nodes=1)
                 for b in conf.batch_sweep]
        runs += stragglers(s, conf.slowdowns, conf)
    return runs + stragglers("localsgd", conf.localsgd_slowdowns, conf)


def strategy_run(strategy: str, learners: int, conf: StudyConf) -> dict:
    """Part 1's run of one strategy. The emulated link acts only where traffic crosses a node boundary, and only
    HYBRID has nodes: every other strategy's run at `learners` is the base run of parts 2 and 3, run once."""
    hybrid = strategy == "hybrid"
    name = f"base-{strategy}" if learners == conf.learners and not hybrid else \
        f"strategy-{strategy}" + ("" if learners == conf.learners else f"-{learners}learners")
    link = {"link": {"bandwidth_gbps": conf.link_gbps, "latency_ms": conf.link_latency_ms}}
    return dict(name=name, part="strategies", strategy=strategy, comm=link if hybrid else {},
                engine=micro_batch(conf.global_batch, learners), learners=learners,
                nodes=conf.nodes if hybrid else 1)


def micro_batch(global_batch: int, learners: int) -> dict:
    return {"train_micro_batch_size_per_gpu": global_batch // learners}


def stragglers(strategy: str, slowdowns: list, conf: StudyConf) -> list[dict]:
    """Part 3's runs of one strategy: learner 1 slowed by each factor (1x: the base run)."""
    return [dict(name=f"straggler{f:g}x-{strategy}" if f != 1 else f"base-{strategy}", part="stragglers",
                 strategy=strategy, slowdown=f, engine=micro_batch(conf.global_batch, conf.learners),
                 learners=conf.learners, nodes=1, comm={"debug": {"slowdown": {"1": float(f)}}} if f != 1 else {})
            for f in slowdowns]


def bad_setting(conf: StudyConf) -> str | None:
    """What is wrong with the study's sizes, before any run; None when nothing is."""
    if not conf.strategy_learners:
        return "strategy_learners is empty: part 1 needs at least one learner count"
    for n in {conf.learners, *conf.strategy_learners}:
        if n < 2 or n % conf.nodes:
            return f"learners={n} must be at least 2 and split into nodes={conf.nodes}"
        if conf.global_batch % n:
            return f"global_batch={conf.global_batch} does not split over {n} learners"
    bad = [b for b in conf.batch_sweep if b % conf.learners]
    return f"batch_sweep {bad} does not split over learners={conf.learners}" if bad else None


def run_study(conf: StudyConf) -> Path:
    root = Path(conf.exp).resolve()
    base, subset = prepare_subset(root, conf.utterances, conf.epochs)
    results = []
    for run in plan(conf):
        done = root / "runs" / run["name"] / "metrics.json"
        if not done.is_file():
            t0 = time.perf_counter()
            comm = {**run["comm"], **({"warmup_steps": conf.localsgd_warmup_steps}
                                      if run["strategy"] == "localsgd" else {})}
            run_arm(root / "runs", base, run["name"], (STRATEGY_JSON[run["strategy"]], comm),
                    [*subset, *conf.overrides], run["learners"], run["nodes"], run["engine"])
            print(f"study: {run['name']} done in {time.perf_counter() - t0:.0f} s", flush=True)
        metrics = json.loads(done.read_text())
        log = [json.loads(line) for line in (done.parent / "train_log.jsonl").read_text().splitlines()]
        results.append({**run, "metrics": metrics, "log": log})
    write_report(root, conf, results, heldout_chars(base))
    return root / "report.md"


def bytes_sent(metrics: dict, log: list[dict], model_bytes: float) -> tuple[float, str]:
    """Bytes learner 0 sent per epoch, and how they were counted: gossip bytes are counted by its gossip
    thread; a ring allreduce over n learners sends 2 (n - 1) / n x the model (computed): SYNC and HYBRID run one
    per step, LOCALSGD one per weight average and per warm-up step (both counted by the strategy)."""
    steps = sum(r["learner_micro_steps"][0] for r in log) / len(log)  # learner 0's steps per epoch
    group = {"sync": metrics["learners"], "adpsgd": 1, "hybrid": metrics["learners"] // metrics["nodes"],
             "localsgd": metrics["learners"]}
    n = group[metrics["strategy"]]
    if metrics["strategy"] == "localsgd":  # cumulative counters in the log
        steps = (log[-1]["averaging_rounds"] + log[-1]["averaging_grad_allreduces"]) / len(log)
    allreduce = 2 * (n - 1) / n * model_bytes * steps
    gossip = metrics.get("gossip_bytes_sent", 0) / len(log)
    how = " + ".join(what for what, b in (("gossip, counted", gossip), ("allreduce, computed", allreduce)) if b)
    return gossip + allreduce, how


def updates(run: dict) -> int:
    """Optimizer updates of a run: learner 0's micro steps over the gradient accumulation steps."""
    steps = sum(e["learner_micro_steps"][0] for e in run["log"])
    return steps // run["metrics"]["gradient_accumulation_steps"]


def heldout_chars(base: Path) -> int:
    """Characters of the dev transcripts (the per-epoch scores' set), spaces included: what a CER counts its
    errors in."""
    return sum(len(" ".join(text.split())) for text, _ in read_table(base / "data" / "dev" / "text").values())


def write_report(root: Path, conf: StudyConf, results: dict, chars: int) -> None:
    model_bytes = 4 * results[0]["metrics"]["params"]
    lines = [f"# Study: {conf.utterances} utterances, {conf.epochs} epochs",
             "", f"Written by `python -m recipe.tools.study` on {time.strftime('%Y-%m-%d %H:%M')}; settings: "
             f"`{json.dumps(OmegaConf.to_container(OmegaConf.structured(conf)))}`.", ""]

    def table(title: str, part: str, first: str, first_value, extra: dict | None = None) -> list[dict]:
        """One part's runs, a row each; `extra`: more columns after the strategy, header -> its value."""
        extra = extra or {}
        heads = "".join(f" {h} |" for h in extra)
        lines.extend([f"## {title}", "", f"| {first} | strategy |{heads} s/epoch | frames/s | held-out loss | CER % "
                      "| WER % | MB sent by learner 0 per epoch |", "|---" * (8 + len(extra)) + "|"])
        rows = [r for r in results if r["part"] == part]
        for r in rows:
            m, log = r["metrics"], r["log"]
            sent, how = bytes_sent(m, log, model_bytes)
            values = "".join(f" {value(r)} |" for value in extra.values())
            lines.append(f"| {first_value(r)} | {r['strategy'].upper()} |{values} {m['wall_s'] / len(log):.1f} | "
                         f"{m['train_frames_per_s']:.0f} | {m['heldout_loss']:.3f} | {100 * m['cer']:.2f} | "
                         f"{100 * m['wer']:.2f} | {sent / 1e6:.1f} ({how}) |")
        lines.append("")
        return rows

    strategies = table(f"1. Strategies ({conf.nodes} emulated nodes for HYBRID, their link emulated at "
                       f"{conf.link_gbps} Gbit/s, {conf.link_latency_ms} ms; the others on one node)", "strategies",
                       "run", lambda r: r["name"])
    # at a fixed number of epochs a larger batch is fewer updates: the columns that say how many, at what rate
    batch = table("2. Global batch", "batch", "global batch (utterances)", lambda r: r["metrics"]["global_batch"],
                  {"updates (learner 0)": updates, "peak lr": lambda r: f"{max(e['lr'] for e in r['log']):.2e}"})
    batch_tolerance(lines, batch, conf.tolerance)
    straggle = table("3. Learner 1 slowed", "stragglers", "slowdown", lambda r: f"{r['slowdown']:g}x")
    time_to_target_table(lines, results, conf, chars)

    plot_study(root, strategies, batch, straggle)
    lines += ["![held-out loss against time](loss_vs_time.png) ![CER against time](cer_vs_time.png) "
              "![held-out loss against epochs, per batch](loss_vs_epoch.png) ![CER against batch](cer_vs_batch.png) "
              "![throughput against slowdown](throughput_vs_straggler.png)", ""]
    (root / "report.md").write_text("\n".join(lines))


def plot_study(root: Path, strategies: list[dict], batch: list[dict], straggle: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for run in strategies:
        ax.plot([r["wall_s"] / 60 for r in run["log"]], [r["heldout_loss"] for r in run["log"]], "o-",
                label=f"{run['strategy'].upper()} {run['learners']}")
    ax.set(xlabel="training wall-clock time (min)", ylabel="held-out loss", title="Strategies (learners)")
    save(fig, ax, root / "loss_vs_time.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in strategies:
        ax.plot([r["wall_s"] / 60 for r in run["log"]], [100 * r["cer"] for r in run["log"]], "o-",
                label=f"{run['strategy'].upper()} {run['learners']}")
    ax.set(xlabel="training wall-clock time (min)", ylabel="held-out CER (%)", title="Strategies (learners)")
    save(fig, ax, root / "cer_vs_time.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in batch:  # the analogue of Zhang et al.'s (Interspeech 2019) Figure 1
        style = "o-" if run["strategy"] == "sync" else "s--"
        ax.plot([r["epoch"] for r in run["log"]], [r["heldout_loss"] for r in run["log"]], style,
                label=f"{run['strategy'].upper()} {run['metrics']['global_batch']}")
    ax.set(yscale="log", xlabel="epoch", ylabel="held-out loss", title="Global batch (utterances)")
    save(fig, ax, root / "loss_vs_epoch.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in ("sync", "adpsgd"):
        rs = [r for r in batch if r["strategy"] == s]
        ax.plot([r["metrics"]["global_batch"] for r in rs], [100 * r["metrics"]["cer"] for r in rs], "o-",
                label=s.upper())
    ax.set(xscale="log", xlabel="global batch (utterances)", ylabel="held-out CER (%)", title="Batch size")
    save(fig, ax, root / "cer_vs_batch.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in ("sync", "adpsgd", "localsgd"):
        rs = [r for r in straggle if r["strategy"] == s]
        ax.plot([r["slowdown"] for r in rs], [r["metrics"]["train_frames_per_s"] for r in rs], "o-", label=s.upper())
    ax.set(xlabel="slowdown of learner 1", ylabel="aggregate training frames/s", title="Stragglers")
    save(fig, ax, root / "throughput_vs_straggler.png")


def batch_tolerance(lines: list[str], batch: list[dict], tolerance: float) -> None:
    """Which global batches each strategy tolerates: final CER within `tolerance` (relative) of its smallest
    batch's, and the largest such batch."""
    for s in ("sync", "adpsgd"):
        rs = sorted((r for r in batch if r["strategy"] == s), key=lambda r: r["metrics"]["global_batch"])
        if not rs:
            continue
        first = rs[0]["metrics"]["cer"]
        ratios = [(r["metrics"]["global_batch"], r["metrics"]["cer"] / max(first, 1e-9)) for r in rs]
        largest = max(b for b, ratio in ratios if ratio <= 1 + tolerance)
        each = ", ".join(f"{b}: {ratio:.2f}x" for b, ratio in ratios)
        lines.append(f"- {s.upper()}: final CER against the {rs[0]['metrics']['global_batch']}-utterance batch's "
                     f"({100 * first:.2f}%): {each}; **largest batch within {100 * tolerance:g}%: {largest}**")
    lines.append("")


def time_to_target(log: list[dict], target: float) -> tuple[int, float] | None:
    """-> (the first epoch whose held-out CER is at most target, the training wall time by then), or None."""
    return next(((r["epoch"], r["wall_s"]) for r in log if r["cer"] <= target), None)


def target_cer(sync: dict, conf: StudyConf, chars: int) -> tuple[float, str]:
    """-> the target CER (target_factor x SYNC's final CER, at least target_min_errors of `chars`), and why."""
    relative, floor = conf.target_factor * sync["metrics"]["cer"], conf.target_min_errors / chars
    why = f"{conf.target_factor:g} x {sync['name']}'s final {100 * sync['metrics']['cer']:.2f}%"
    if relative >= floor:
        return relative, why
    return floor, f"{conf.target_min_errors} character errors of the held-out {chars:,}: {why} is below that"


def time_to_target_table(lines: list[str], results: list[dict], conf: StudyConf, chars: int) -> None:
    """Each run's time to the target CER (from SYNC's final CER in part 1), and which ones never learned."""
    target, why = target_cer(next(r for r in results if r["part"] == "strategies" and r["strategy"] == "sync"),
                             conf, chars)
    lines.extend([f"## 4. Time to target: held-out CER <= {100 * target:.2f}% ({why})", "",
                  "| run | strategy | learners | global batch | epoch | training time (min) | status |",
                  "|---|---|---|---|---|---|---|"])
    for r in {r["name"]: r for r in results}.values():  # a run in several parts, once
        reached = time_to_target(r["log"], target)
        stalled = no_learning(r["log"][-1], 0)
        status = "no learning: CER above 90% or blank output at the end" if stalled else \
            "reached" if reached else "not reached"
        epoch, minutes = (reached[0], f"{reached[1] / 60:.2f}") if reached else ("-", "-")
        lines.append(f"| {r['name']} | {r['strategy'].upper()} | {r['learners']} | {r['metrics']['global_batch']} | "
                     f"{epoch} | {minutes} | {status} |")
    lines.append("")


def save(fig, ax, path: Path) -> None:
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)


def main(argv=None) -> int:
    from omegaconf.errors import OmegaConfBaseException

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        conf = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(StudyConf), OmegaConf.from_dotlist(argv)))
    except OmegaConfBaseException as err:
        print(f"recipe.tools.study: {err}".splitlines()[0], file=sys.stderr)
        return 2
    if bad := bad_setting(conf):
        print(f"recipe.tools.study: {bad}", file=sys.stderr)
        return 2
    print(f"study report: {run_study(conf)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
