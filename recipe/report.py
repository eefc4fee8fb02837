"""Recipe stage 5: the experiment's numbers as a table on the terminal and curves in EXP/report.png."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table


def read_log(exp: Path) -> list[dict]:
    log = exp / "train_log.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


def plot(history: list[dict], path: Path, title: str, decoded: dict | None) -> None:
    """Loss and error by time and by epoch, on log axes so the tail below 1% stays readable: the dev set every
    epoch; the test set once, decoded at the end (stars, at the last epoch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    ce = "frame_acc" in history[0]
    scores = (("frame_acc", "frame accuracy"),) if ce else (("cer", "CER"), ("wer", "WER"))
    wall = [h["wall_s"] / 60 for h in history]
    epochs = [h["epoch"] for h in history]
    for col, (x, label) in enumerate(((wall, "training wall-clock time (min)"), (epochs, "epoch"))):
        axes[0, col].plot(x, [h["heldout_loss"] for h in history], "o-", label="dev")
        axes[0, col].plot(x, [h["train_loss"] for h in history], "s--", alpha=0.6, label="train")
        axes[0, col].set_ylabel("cross entropy per frame" if ce else "CTC loss per token")
        axes[0, col].set_yscale("log")
        for (key, name), marker in zip(scores, "os"):
            line, = axes[1, col].plot(x, [100 * h[key] for h in history], f"{marker}-", label=f"dev {name} (greedy)")
            if decoded and key in decoded:
                axes[1, col].plot(x[-1], 100 * decoded[key], "*", markersize=14, color=line.get_color(),
                                  label=f"test {name} (decode stage)")
        axes[1, col].set_ylabel("frame accuracy (%)" if ce else "error (%)")
        if not ce:  # symlog: logarithmic above 0.01%, so an epoch without errors still has a point, at 0
            axes[1, col].set_yscale("symlog", linthresh=0.01, linscale=0.3)
        axes[1, col].set_xlabel(label)
        for row in range(2):
            axes[row, col].legend(fontsize=8)
            axes[row, col].grid(alpha=0.3, which="both")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def schedule_summary(m: dict) -> str:
    """How many epochs, and why that many (metrics of runs before the newbob schedule have no schedule)."""
    if m.get("schedule") != "newbob":
        return str(m["epochs"])
    anneal = f"annealed from epoch {m['anneal_from']}" if m.get("anneal_from") else "never annealed"
    return f"{m['epochs']} (newbob: {anneal}; {m.get('stop') or 'train.max_epochs reached'})"


def summary_rows(exp: Path, m: dict, history: list[dict], scores) -> list[tuple[str, object]]:
    """The final table: the run, its dev scores, the decode stage's dev and test scores, and what data was used."""
    rows = [("strategy", m["strategy"]), ("learners x nodes", f"{m['learners']} on {m['nodes']}"),
            ("global batch (utterances)", m["global_batch"]), ("precision", m["precision"]),
            ("parameters", f"{m['params']:,}"), ("epochs", schedule_summary(m)),
            ("training wall time", f"{m['wall_s'] / 60:.1f} min"),
            ("training frames/s (all learners)", f"{m['train_frames_per_s']:.0f}"),
            ("dev loss, last epoch", f"{m['heldout_loss']:.3f}"),
            *((f"dev {name}, last epoch (greedy)", f"{100 * m[key]:.2f}%") for key, name in scores)]
    if m.get("lost_learners"):  # ADPSGD/HYBRID went on without them (RELIABILITY.md)
        first = next(h["epoch"] for h in history if h.get("lost_learners"))
        rows.insert(2, ("[red]lost learners[/red]", f"{m['lost_learners']} in epoch {first}; "
                                                     f"{m['learners'] - len(m['lost_learners'])} went on"))
    decoded = exp / "decode" / "scores.json"
    s = json.loads(decoded.read_text()) if decoded.is_file() else None
    if s and "frame_acc" in s:
        rows.append(("decode stage dev frame accuracy", f"{100 * s['dev']['frame_acc']:.2f}%"))
        rows.append(("decode stage test frame accuracy", f"{100 * s['frame_acc']:.2f}% (loss {s['heldout_loss']:.3f})"))
        rows.append(("  scaled log-likelihoods for Kaldi", s["loglikes"]))
    elif s:
        rows += decoded_rows(s, decoded.parent)
    if s and s["averaged"]:
        rows.append(("  weights averaged over", ", ".join(s["averaged"])))
    prep = exp / "data" / "prep.json"
    if prep.is_file():
        for split, info in json.loads(prep.read_text()).items():
            if isinstance(info, dict):
                skipped = sum(info["skipped"].values())
                rows.append((f"{split} utterances / skipped", f"{info['utterances']} / {skipped}"))
                if split == "dev" and ":" in info["source"]:  # carved out of the training set: say how
                    rows.append(("  dev set", info["source"].split(": ", 1)[1]))
    return rows


def decoded_rows(s: dict, folder: Path) -> list[tuple[str, str]]:
    """The decode stage of CTC: the decoder chosen on dev, its dev and test scores, greedy's beside them."""
    d = s["decode"]
    how = "greedy (it beat the beam on dev)" if s["decoder"] == "greedy" else \
        f"{s['decoder']}, LM weight {d['lm_weight']}, word bonus {d['word_bonus']}" if s["lm"] else s["decoder"]
    pair = lambda x, prefix="": f"{100 * x[prefix + 'cer']:.2f}% / {100 * x[prefix + 'wer']:.2f}%"  # noqa: E731
    rows = [("decoder, chosen on dev", how), ("dev CER / WER, decoded", f"{pair(s['dev'])} (greedy "
                                                                       f"{pair(s['dev'], 'greedy_')})"),
            ("[bold]test CER / WER, decoded once[/bold]", f"[bold]{pair(s)}[/bold] (greedy {pair(s, 'greedy_')})")]
    sdi = "  ".join(f"{unit} {e['substitutions']} / {e['deletions']} / {e['insertions']}"
                    for unit, e in (("chars", s["char_errors"]), ("words", s["word_errors"])))
    rows.append(("  test substitutions / deletions / insertions", sdi))
    rows.append(("  each utterance aligned, worst first", str(folder / "errs.txt")))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--exp", required=True)
    exp = Path(p.parse_args(argv).exp)
    console = Console()
    if not (exp / "metrics.json").is_file():
        console.print(f"[red]{exp}/metrics.json not found: run the training stage first[/red]")
        return 2
    m = json.loads((exp / "metrics.json").read_text())
    history = read_log(exp)

    scores = (("frame_acc", "frame acc"),) if "frame_acc" in m else (("cer", "CER"), ("wer", "WER"))
    table = Table(title=f"{exp}: {m['strategy'].upper()}, {m['learners']} learners, {m['nodes']} node(s)")
    for col in ("epoch", "train loss", "dev loss", *(f"dev {name} %" for _, name in scores), "frames/s",
                "wall (min)"):
        table.add_column(col, justify="right")
    for h in history:
        table.add_row(str(h["epoch"]), f"{h['train_loss']:.3f}", f"{h['heldout_loss']:.3f}",
                      *(f"{100 * h[key]:.2f}" for key, _ in scores), f"{h['train_frames_per_s']:.0f}",
                      f"{h['wall_s'] / 60:.1f}")
    console.print(table)

    summary = Table(title="final", show_header=False)
    summary.add_column(justify="left")
    summary.add_column(justify="right")
    for key, value in summary_rows(exp, m, history, scores):
        summary.add_row(key, str(value))
    console.print(summary)
    if m.get("warning"):  # the run ended without learning (recipe/train.py no_learning): never a silent table
        console.print(f"[bold red]WARNING: {m['warning']}[/bold red]")
    if history:
        scored = exp / "decode" / "scores.json"
        decoded = json.loads(scored.read_text()) if scored.is_file() else None
        plot(history, exp / "report.png", f"{m['strategy'].upper()}: {m['learners']} learners, global batch "
                                          f"{m['global_batch']}", decoded)
        console.print(f"curves: {exp / 'report.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
