"""TensorBoard events of a training run, written by learner 0 into EXP/tensorboard (`tensorboard --logdir exp`).

The x axis is global progress in optimizer updates, epoch x updates per epoch, the same for every strategy:
under ADPSGD learner 0's own step count would run slow or fast against the run. EXP/train_log.jsonl stays the
machine-readable record; these are its curves, plus the per-step ones it does not keep. The per-epoch scores are
the dev set's: training never reads the test set (the decode stage's scores.json has it).
"""

from __future__ import annotations

from pathlib import Path

PER_EPOCH = {  # training log key -> TensorBoard tag
    "train_loss": "train/epoch_loss", "heldout_loss": "dev/loss", "cer": "dev/cer", "wer": "dev/wer",
    "frame_acc": "dev/frame_acc", "empty_output": "dev/empty_output", "lr": "train/lr_at_epoch_end",
    "train_frames_per_s": "train/epoch_frames_per_s", "skipped_steps": "train/skipped_steps",
    "consensus_distance": "comm/consensus_distance", "gossip_rounds": "comm/gossip_rounds",
    "gossip_bytes_sent": "comm/gossip_bytes_sent", "gossip_rounds_skipped": "comm/gossip_rounds_skipped",
    "gossip_merges_skipped": "comm/gossip_merges_skipped",
}


class Board:
    def __init__(self, folder: Path, updates_per_epoch: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder))
        self.updates_per_epoch = updates_per_epoch

    def progress(self, epochs_done: float) -> int:
        """Global progress (epochs, fractional) -> the x axis, in optimizer updates."""
        return round(epochs_done * self.updates_per_epoch)

    def step(self, epochs_done: float, loss: float, lr: float, grad_norm: float | None, frames_per_s: float) -> None:
        x = self.progress(epochs_done)
        for tag, value in (("train/loss", loss), ("train/lr", lr), ("train/grad_norm", grad_norm),
                           ("train/frames_per_s", frames_per_s)):
            if value is not None:
                self.writer.add_scalar(tag, value, x)

    def epoch(self, record: dict) -> None:
        x = self.progress(record["epoch"])
        for key, tag in PER_EPOCH.items():
            if key in record:
                self.writer.add_scalar(tag, record[key], x)
        self.writer.add_scalar("comm/lost_learners", len(record.get("lost_learners", [])), x)
        self.writer.add_scalar("train/wall_minutes", record["wall_s"] / 60, x)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
