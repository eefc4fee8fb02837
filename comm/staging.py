"""How a gossip round's weights reach the host, and its merge the device, off the compute thread's path.

A round needs a snapshot of the weights on the host (gloo sends host memory) and, once the peer's have come back,
adds a delta to the weights on the device. Only the snapshot's start has to be ordered with the optimizer
steps, so only that part is done under the step lock (DESIGN.md §9.27):

  capture()  under the step lock: a device-side copy of the weights into one flat fp32 buffer on their own
             device, queued on the compute stream between two steps, and an event recorded after it. On a GPU
             the lock is held for the time it takes to queue one kernel; the step never waits for a transfer;
  to_host()  outside the lock, on a CUDA stream of the gossip thread's own: the flat buffer into a pinned host
             buffer reused round after round, once the event has passed -> that buffer (the next capture
             overwrites it: a round is done with it by then);
  add(delta) the compute thread, between steps: the pinned delta into a device buffer on the side stream, and
             the compute stream waits for that copy by event before it adds it (one kernel for all weights).

On the CPU the flat buffer is itself the host copy and add() adds in place. Every buffer is allocated once, when
the strategy attaches, and reused every round of every epoch.
"""

from __future__ import annotations

import contextlib

import torch


def views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive slices of `flat` shaped as the tensors of `like`."""
    out, offset = [], 0
    for t in like:
        out.append(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


def add_flat(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """params += flat, where flat is the concatenation of all params (fp32, on any device)."""
    with torch.no_grad():
        torch._foreach_add_(params, views(flat.to(params[0].device, non_blocking=True), params))


class Staging:
    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.device = params[0].device if params else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        numel = sum(p.numel() for p in params)
        self.flat = torch.empty(numel, dtype=torch.float32, device=self.device)
        self._flat_views = views(self.flat, params)
        if self.cuda:
            self.stream = torch.cuda.Stream(device=self.device)
            self.host = torch.empty(numel, dtype=torch.float32, pin_memory=True)
            self.incoming = torch.empty_like(self.flat)  # a delta on its way to the weights
            self._incoming_views = views(self.incoming, params)
            self.captured, self.uploaded, self.merged = torch.cuda.Event(), torch.cuda.Event(), torch.cuda.Event()

    def capture(self) -> None:
        """Under the step lock: the weights into the flat device buffer, in order with the optimizer steps."""
        with torch.no_grad(), torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext():
            # a new thread's current stream is the device's default one, the compute stream
            torch._foreach_copy_(self._flat_views, [p.detach() for p in self.params])
            if self.cuda:
                self.captured.record()

    def to_host(self) -> torch.Tensor:
        """Outside the lock: the captured weights, flat fp32, in host memory (reused: valid until the next
        capture)."""
        if not self.cuda:
            return self.flat
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.stream.wait_event(self.captured)
            self.host.copy_(self.flat, non_blocking=True)
        self.stream.synchronize()
        return self.host

    def pinned(self, delta: torch.Tensor) -> torch.Tensor:
        """A delta for the compute thread: pinned on a GPU, so that add() copies it without a host stall."""
        return delta.pin_memory() if self.cuda else delta

    def add(self, delta: torch.Tensor) -> None:
        """The compute thread, between steps: weights += delta (flat fp32, in host memory)."""
        if not self.cuda:
            add_flat(self.params, delta)
            return
        with torch.no_grad():
            compute = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(self.merged)  # the last merge has read the device buffer
                self.incoming.copy_(delta, non_blocking=True)
                self.uploaded.record(self.stream)
            compute.wait_event(self.uploaded)
            torch._foreach_add_(self.params, self._incoming_views)
            self.merged.record(compute)
