"""Benchmark: training on a corpus whose features are larger than the memory the learner may use (issue 3).

    python -m recipe.tools.scale_bench [--sizes-gb 0.5 1 2 4] [--limit-gb 2] [--work /tmp/scale] [--keep]

For every size a synthetic corpus is written straight into a feature cache (recipe/lib/features.py: 260-dim float32
rows, the paper's input, in shards of 1 GiB) with random frame targets of 200 classes (recipe/lib/targets.py), and a
tiny model (1 unidirectional LSTM layer of 64) is trained on it for one epoch of the CE objective (21-frame chunks)
in a child process whose data segment is capped with RLIMIT_DATA at --limit-gb. On Linux RLIMIT_DATA counts the
heap and private writable mappings, not file pages: a reader that loaded the features into memory fails with
MemoryError, while one that reads rows with pread() (FeatureCache) or maps the files is not stopped by it. The
learner (a further process started by recipe/tools/local_learners.py) reports its own peak resident set (VmHWM).

RSS does not include the page cache: the rows the learner reads stay in the kernel's cache, shared by every
process and given back under pressure, and are not counted here. What RSS does count is a mapping's touched
pages, which is why the cache is read with pread(): the contrast at the end maps the largest corpus with
np.memmap and touches all of it (the old reader's pattern), so its VmHWM grows with the corpus, and loads it
into memory with np.fromfile, which the limit stops.

The synthetic features are slices of a few pregenerated random blocks at per-utterance offsets, so writing a
corpus runs at disk speed rather than at the random generator's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# Only the standard library and numpy above: the training child sets its memory limit before torch is imported.

DIM = 260  # the paper's input: 40 log-mel + deltas + double deltas (120) and a 100-dim i-vector, as one vector
TARGETS = 200  # classes of the random frame targets
CHUNK = 21  # the paper's chunk of frames (data.chunk_frames)
MIN_FRAMES, MAX_FRAMES = 100, 1500  # utterance lengths, uniform (1 to 15 seconds at 10 ms)
SPEAKERS = 100
DEV_UTTERANCES = 100  # scored after every epoch
BLOCKS, BLOCK_FRAMES = 4, 8192  # pregenerated random rows the utterances are cut from
GB, MB = 1e9, 1e6  # decimal units throughout, RSS included (the kernel reports it in KiB)
ROW_BYTES = DIM * 4

DS_CONFIG = {"train_micro_batch_size_per_gpu": 64, "gradient_accumulation_steps": 1, "gradient_clipping": 5.0,
             "steps_per_print": 1000000, "wall_clock_breakdown": False, "comm": {"strategy": "sync"}}
MODEL = ["train.objective=ce", "model.stack=1", f"data.chunk_frames={CHUNK}", "model.layers=1", "model.hidden=64",
         "model.bidirectional=false", "model.dropout=0.0", "train.epochs=1", "train.min_updates=0", "optim.schedule=fixed",
         "train.log_interval=1000000",
         "optim.base_batch=64"]


# ---- the synthetic corpus --------------------------------------------------------------------------------------
def utterance_lengths(size_bytes: float, dim: int = DIM, seed: int = 0) -> np.ndarray:
    """Frames of the utterances of a corpus of about size_bytes of float32 features: uniform lengths, the last
    one cut so the total lands within MIN_FRAMES rows of the request."""
    rng = np.random.default_rng(seed)
    want = int(size_bytes // (dim * 4))
    lengths, total = [], 0
    while want - total >= MIN_FRAMES:
        # drawn in batches: a 2000-hour corpus is millions of utterances
        for n in rng.integers(MIN_FRAMES, MAX_FRAMES + 1, 4096):
            n = min(int(n), want - total)
            if n < MIN_FRAMES:
                break
            lengths.append(n)
            total += n
    return np.array(lengths, dtype=np.int64)


def write_corpus(out: Path, name: str, lengths: np.ndarray, seed: int) -> Path:
    """A feature cache of random rows with these utterance lengths -> its folder (kept if already complete)."""
    from recipe.lib.features import write_cache

    rng = np.random.default_rng(seed)
    blocks = [rng.standard_normal((BLOCK_FRAMES + MAX_FRAMES, DIM), dtype=np.float32) for _ in range(BLOCKS)]
    which = rng.integers(0, BLOCKS, len(lengths))
    starts = rng.integers(0, BLOCK_FRAMES, len(lengths))

    def fill(writer) -> dict:
        for i, n in enumerate(lengths):
            writer.add(f"{name}-{i:08d}", f"spk{i % SPEAKERS:03d}", blocks[which[i]][starts[i]: starts[i] + n])
        return {"synthetic": True, "seed": seed}

    return write_cache(out, name, DIM, fill)


def random_targets(cache, seed: int):
    """(utterance, random frame targets) of a cache's utterances, one at a time as write_targets reads them: the
    benchmark's own memory does not grow with the corpus either."""
    for row, (utt, frames) in enumerate(zip(cache.utts, cache.frames.tolist())):
        yield utt, np.random.default_rng([seed, row]).integers(0, TARGETS, frames, dtype=np.int32)


def build_experiment(folder: Path, size_bytes: float, seed: int = 0) -> tuple[Path, dict]:
    """An experiment folder for CE training on a synthetic corpus of about size_bytes -> (folder, corpus sizes)."""
    from recipe.lib.features import FeatureCache
    from recipe.lib.targets import write_targets

    t0 = time.perf_counter()
    caches = {}
    for split, lengths in (("train", utterance_lengths(size_bytes, seed=seed)),
                           ("dev", np.random.default_rng([seed, 1]).integers(MIN_FRAMES, MAX_FRAMES + 1,
                                                                              DEV_UTTERANCES))):
        caches[split] = write_corpus(folder / "features" / split, split, lengths, seed + (split == "dev"))
        targets = folder / "targets" / split
        if not (targets / "meta.json").is_file():
            cache = FeatureCache(caches[split])
            write_targets(cache, random_targets(cache, seed), f"random targets of {split}", targets, TARGETS,
                          tolerance=0, on_bad="error")
    (folder / "features.json").write_text(json.dumps({split: str(path) for split, path in caches.items()}))
    (folder / "data").mkdir(exist_ok=True)
    (folder / "data" / "tokens.txt").write_text("<blank>\na\n")  # read by every objective, used by CTC only
    (folder / "ds_config.json").write_text(json.dumps(DS_CONFIG, indent=1))
    frames = np.loadtxt(caches["train"] / "index.tsv", dtype=np.int64, usecols=4, ndmin=1)
    corpus = {"bytes": int(frames.sum()) * ROW_BYTES, "frames": int(frames.sum()), "utterances": len(frames),
              "chunks": int((-(-frames // CHUNK)).sum()), "shards": len(list(caches["train"].glob("feats-*.f32"))),
              "write_s": time.perf_counter() - t0}
    return folder, corpus


# ---- what runs under the limit ---------------------------------------------------------------------------------
def memory_kb() -> dict:
    """This process's VmHWM (peak resident), VmRSS, RssAnon and RssFile in kB (/proc/self/status)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0])
    return out


def scale_learner(rank: int, world: int, argv: list[str]) -> dict:
    """recipe/train.py in the learner process run_learners starts -> its metrics and its own memory."""
    from recipe.tools.local_learners import train_learner

    return {**train_learner(rank, world, argv), "memory_kb": memory_kb()}


def child_train(exp: str, limit_bytes: int) -> dict:
    from recipe.tools.local_learners import run_learners  # imports torch: after the limit was set

    t0 = time.perf_counter()
    argv = ["--exp", exp, "--ds-config", str(Path(exp) / "ds_config.json"), *MODEL]
    metrics = run_learners(scale_learner, 1, argv, timeout=None)[0]
    # the largest of this child's own children, the learner among them (ru_maxrss is in kB on Linux)
    children_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {**metrics, "child_wall_s": time.perf_counter() - t0, "children_maxrss_kb": children_kb,
            "launcher_memory_kb": memory_kb()}


def child_read(cache_folder: str, how: str, limit_bytes: int) -> dict:
    """Read a whole cache the way `how` says -> bytes touched and this process's memory afterwards.
    memmap: np.memmap of every shard, summed 64 MiB at a time (the old reader's access pattern);
    pread: FeatureCache.read of every utterance (the recipe's reader); load: np.fromfile of every shard kept
    in a list (a reader that holds the corpus in memory), which RLIMIT_DATA stops."""
    from recipe.lib.features import FeatureCache

    cache = FeatureCache(cache_folder)
    touched, error, total = 0, None, 0.0
    if how == "pread":
        for i in range(len(cache)):
            x = cache.read(i)
            total += float(x[:, 0].sum())
            touched += x.nbytes
    else:
        held = []
        for shard in sorted(Path(cache_folder).glob("feats-*.f32")):
            try:
                if how == "memmap":
                    m = np.memmap(shard, dtype=np.float32, mode="r")
                    step = (64 << 20) // 4
                    for start in range(0, len(m), step):
                        total += float(m[start: start + step].sum())
                    held.append(m)  # kept mapped, as a reader holding every shard open would
                else:
                    held.append(np.fromfile(shard, dtype=np.float32))
                touched += shard.stat().st_size
            except MemoryError as err:
                error = f"MemoryError ({err})" if str(err) else "MemoryError"
                break
    return {"how": how, "touched_bytes": touched, "error": error, "memory_kb": memory_kb()}


def child_main(argv: list[str]) -> None:
    """`python -m recipe.tools.scale_bench --child WHAT ARG LIMIT_BYTES RESULT_JSON`: set the limit, then work."""
    what, arg, limit, result = argv[0], argv[1], int(argv[2]), Path(argv[3])
    # RLIMIT_DATA: heap and private anonymous memory, before torch (or anything large) is imported
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    out = child_train(arg, limit) if what == "train" else child_read(arg, what, limit)
    result.write_text(json.dumps({**out, "rlimit_data": resource.getrlimit(resource.RLIMIT_DATA)[0]}))


def run_child(what: str, arg: str | Path, limit_bytes: int, log: Path) -> dict:
    """One limited child (its output to `log`) -> its result; an error names the log."""
    result = log.with_suffix(".json")
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "recipe.tools.scale_bench", "--child", what, str(arg), str(limit_bytes), str(result)]
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with open(log, "w") as f:
        code = subprocess.run(cmd, cwd=repo, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if code != 0 or not result.is_file():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise RuntimeError(f"{what} child exited with {code}; its log {log} ends:\n{tail}")
    return json.loads(result.read_text())


# ---- the benchmark -----------------------------------------------------------------------------------------
def measure(work: Path, size_gb: float, limit_gb: float, seed: int = 0) -> dict:
    """Build the corpus of size_gb, train on it under the limit -> one row of the table."""
    folder = work / f"corpus-{size_gb:g}gb"
    folder.mkdir(parents=True, exist_ok=True)
    exp, corpus = build_experiment(folder, size_gb * GB, seed)
    r = run_child("train", exp, int(limit_gb * GB), folder / "train.log")
    frames = r["train_frames_per_s"] * r["wall_s"]
    peak_mb = r["memory_kb"]["VmHWM"] * 1024 / MB
    return {"size_gb": corpus["bytes"] / GB, "frames": corpus["frames"], "utterances": corpus["utterances"],
            "chunks": corpus["chunks"], "shards": corpus["shards"], "limit_gb": limit_gb, "peak_rss_mb": peak_mb,
            "frames_per_s": r["train_frames_per_s"], "trained_frames": int(round(frames)), "train_s": r["wall_s"],
            "child_s": r["child_wall_s"], "write_s": corpus["write_s"], "rss_over_corpus": peak_mb * MB /
            corpus["bytes"], "end_anon_mb": r["memory_kb"]["RssAnon"] * 1024 / MB,
            "end_file_mb": r["memory_kb"]["RssFile"] * 1024 / MB,
            "children_maxrss_mb": r["children_maxrss_kb"] * 1024 / MB,
            "launcher_peak_mb": r["launcher_memory_kb"]["VmHWM"] * 1024 / MB, "folder": str(folder)}


def print_table(rows: list[dict]) -> None:
    print("| corpus GB | frames | utterances | chunks | limit GB | peak RSS MB | train frames/s | train s "
          "| peak RSS / corpus |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size_gb']:.2f} | {r['frames']:,} | {r['utterances']:,} | {r['chunks']:,} | {r['limit_gb']:g} "
              f"| {r['peak_rss_mb']:.0f} | {r['frames_per_s']:,.0f} | {r['train_s']:.0f} "
              f"| {r['rss_over_corpus']:.3f} |")
    print()
    for r in rows:  # where the resident memory is at the end, and the processes around the learner
        print(f"{r['size_gb']:.2f} GB: {r['trained_frames']:,} frames trained; learner at its end: anonymous "
              f"{r['end_anon_mb']:.0f} MB, file-backed {r['end_file_mb']:.0f} MB; largest child of the limited "
              f"process (ru_maxrss) {r['children_maxrss_mb']:.0f} MB, the limited process itself "
              f"{r['launcher_peak_mb']:.0f} MB; corpus written in {r['write_s']:.0f} s")


def contrast(folder: Path, limit_gb: float) -> list[str]:
    """The same corpus read whole three ways, each in its own limited child -> lines to print."""
    cache = json.loads((folder / "features.json").read_text())["train"]
    lines = [f"Reading the whole {folder.name} training cache once, each way in its own child under "
             f"RLIMIT_DATA = {limit_gb:g} GB:"]
    for how in ("pread", "memmap", "load"):
        r = run_child(how, cache, int(limit_gb * GB), folder / f"read-{how}.log")
        m = {key: kb * 1024 / MB for key, kb in r["memory_kb"].items()}
        lines.append(f"  {how:6s}  touched {r['touched_bytes'] / GB:5.2f} GB  peak RSS (VmHWM) {m['VmHWM']:7.0f} MB  "
              f"anonymous {m['RssAnon']:6.0f} MB  file-backed {m['RssFile']:6.0f} MB"
              f"{'  ' + r['error'] if r['error'] else ''}")
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child_main(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-gb", type=float, nargs="+", default=[0.5, 1, 2, 4], help="training corpus sizes")
    p.add_argument("--limit-gb", type=float, default=2.0, help="RLIMIT_DATA of the training process")
    p.add_argument("--work", type=Path, default=Path("/tmp/scale"), help="where the corpora are written")
    p.add_argument("--keep", action="store_true", help="keep the corpora (reused by a rerun)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    sizes = sorted(a.sizes_gb)
    print(f"CE training, 1 epoch, 1 learner, model {' '.join(MODEL[3:6])}, {DIM}-dim features, {TARGETS} "
          f"targets, micro batch {DS_CONFIG['train_micro_batch_size_per_gpu']} chunks of {CHUNK} frames; "
          f"RLIMIT_DATA {a.limit_gb:g} GB; work {a.work}", flush=True)
    rows, contrast_lines = [], []
    for size in sizes:
        rows.append(measure(a.work, size, a.limit_gb, a.seed))
        r = rows[-1]
        print(f"  {r['size_gb']:.2f} GB: peak RSS {r['peak_rss_mb']:.0f} MB, {r['frames_per_s']:,.0f} frames/s, "
              f"{r['train_s']:.0f} s", flush=True)
        if size == sizes[-1]:
            contrast_lines = contrast(Path(r["folder"]), a.limit_gb)
        if not a.keep:
            shutil.rmtree(r["folder"], ignore_errors=True)
    print()
    print_table(rows)
    print()
    print("\n".join(contrast_lines))
    print("\nRSS excludes the page cache: the rows read by pread() are cached by the kernel (shared, reclaimable) "
          "and are not in these numbers.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
