"""LOCALSGD: torch's periodic model averaging (post-local SGD, Lin et al. 2020), the built-in alternative to gossip.

Every learner steps its own optimizer on its own batches: DeepSpeed is given a data-parallel group of one learner
(through `mpu`, as ADPSGD), so it reduces nothing. Every `period` optimizer steps all learners average their
weights with torch's `PeriodicModelAverager` (torch.distributed.algorithms.model_averaging), an allreduce over
the world that every learner waits for: a slow learner holds everyone back at each average (the point of comparing
it with ADPSGD). Optimizer state (Adam's moments) stays local, as in torch's post-local SGD.

What torch does, and so this module (torch/distributed/algorithms/model_averaging/averagers.py and
ddp_comm_hooks/post_localSGD_hook.py):
  - the first `warmup_steps` optimizer steps are synchronous SGD: the gradients are averaged over the world before
    the step (torch's post_localSGD_hook allreduces them globally until start_localSGD_iter), so the learners stay
    equal and their Adam moments too; the averager counts these steps but does not average;
  - afterwards the averager averages the weights after optimizer step number warmup_steps + k x period (counted
    from 0: right after the first local step, then every `period` steps). torch's hook then allreduces the
    gradients inside a subgroup (by default the node); here the subgroup is the learner alone.
Batches are dealt by rank as under SYNC, so every learner takes the same number of steps (each average is a
collective). At an epoch's end the learners average once more (their consensus distance before it goes to the
training log), so evaluation and checkpoint see one model.

Two things torch's averager assumes that DeepSpeed breaks, both handled here (DESIGN.md §9.32):
  - it averages only parameters whose .grad is not None, and DeepSpeed's engine.step() has already set every
    gradient to None: given the module's parameters it would silently average nothing;
  - it rebinds each parameter's .data to a slice of its flat buffer; under bf16/fp16 the weights the optimizer
    steps are DeepSpeed's fp32 masters (comm/weights.py), which a fused optimizer keeps as views of one flat
    tensor that a rebinding would detach from the optimizer.
So the averager is handed one flat fp32 stand-in for the masters (with a zero gradient, so it is not filtered
out), and the average is copied back into the masters in place and published to the module.

A learner that dies stops the run (as under SYNC): every average waits for all learners.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from comm.base import Strategy
from comm.gossip import flatten
from comm.sync import emulate_ring_allreduce
from comm.weights import Weights


class LocalSGDStrategy(Strategy):
    name = "localsgd"
    options = {
        **Strategy.options,
        # Optimizer steps between two weight averages. 4: torch's own example of PeriodicModelAverager with its
        # post-local SGD hook (averagers.py), whose docstring asks for more than 1 (at 1, DDP's gradient
        # allreduce would cost no more and keep Adam's moments in step too).
        "period": 4,
        # Synchronous (gradient-averaging) steps before local SGD starts. 100: torch's example again
        # (start_localSGD_iter=100, warmup_steps=100): post-local SGD runs the noisy start synchronously and goes
        # local afterwards (Lin et al. switch at the first learning-rate decay). On the default corpus (3,000
        # utterances, 2 learners, micro batch 8: 187 steps an epoch) that is the learning-rate warm-up (0.3
        # epochs) and a little more; on a smaller corpus or more learners it is a larger share of the run.
        "warmup_steps": 100,
    }

    def __init__(self, layout, options, heartbeat=None):
        super().__init__(layout, options, heartbeat)
        for key, least in (("period", 1), ("warmup_steps", 0)):
            value = self.conf[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"comm.{key} must be an integer >= {least}, got {value!r}")
        self.weights: Weights | None = None
        self.averager: PeriodicModelAverager | None = None
        self._engine = None
        # cumulative, like the gossip counters: weight averages (periodic and at epoch ends), warm-up gradient
        # allreduces, seconds in both (the wait for the slowest learner included)
        self.averages = self.grad_allreduces = 0
        self.averaging_s = 0.0

    @property
    def data_parallel_size(self) -> int:
        return 1

    def attach(self, engine) -> None:
        super().attach(engine)
        self._engine = engine
        self.weights = Weights(engine)
        # DeepSpeed broadcast inside a group of one: every learner starts from rank 0's weights (DESIGN.md §9.2)
        with torch.no_grad():
            for w in self.weights.masters:
                dist.broadcast(w.data, src=0)
        self.weights.publish()
        self.averager = PeriodicModelAverager(self.conf["period"], self.conf["warmup_steps"])  # the world

    # -- warm-up: synchronous SGD, the gradients averaged before the step ---------------------------------------
    def step_lock(self):
        """Entered right before engine.step(): during the warm-up, average the gradients over the world there."""
        return self._before_step()

    @contextlib.contextmanager
    def _before_step(self):
        engine = self._engine
        if self.averager.step < self.averager.warmup_steps and engine.is_gradient_accumulation_boundary():
            self._average_gradients(engine)
        yield

    def _average_gradients(self, engine) -> None:
        t0 = time.perf_counter()
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        flat = torch.cat([g.detach().reshape(-1).float() for g in grads])
        dist.all_reduce(flat)
        flat /= self.layout.world_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()
        if not torch.isfinite(flat).all():  # every learner sees it: all skip the step alike (fp32; DeepSpeed's
            skip = getattr(engine.optimizer, "skip_next_step", None)  # mixed precision skips by itself)
            if skip is not None:
                skip()
        self.grad_allreduces += 1
        emulate_ring_allreduce(self)
        self.averaging_s += time.perf_counter() - t0

    # -- local SGD: the weights averaged every `period` steps ------------------------------------------------
    def after_step(self, engine) -> None:
        """torch's averager decides (it counts every step, the warm-up's too); it averages a flat fp32 stand-in
        for the masters, copied back in place when it did."""
        t0 = time.perf_counter()
        masters = self.weights.masters
        with torch.no_grad():
            proxy = torch.nn.Parameter(torch.cat([w.detach().reshape(-1).float() for w in masters]))
        # kept by the averager's filter; no memory; on the masters' device (a CPU zero is refused on a GPU)
        proxy.grad = torch.zeros((), dtype=proxy.dtype, device=proxy.device).expand_as(proxy)
        before = proxy.data_ptr()  # torch rebinds .data to its averaged buffer when it averages
        self.averager.average_parameters([proxy])
        if proxy.data_ptr() == before:  # not an averaging step
            return
        self._write(proxy.data)
        self.averages += 1
        emulate_ring_allreduce(self)
        self.averaging_s += time.perf_counter() - t0

    def _write(self, flat: torch.Tensor) -> None:
        """An average (identical on every learner) into the masters, and over the module's parameters."""
        if not torch.isfinite(flat).all():
            self._raise_non_finite(f"at optimizer step {self.averager.step}")
        with torch.no_grad():
            offset = 0
            for w in self.weights.masters:
                w.copy_(flat[offset: offset + w.numel()].view_as(w).to(w.dtype))
                offset += w.numel()
        self.weights.publish()

    def _raise_non_finite(self, when: str) -> None:
        """The average is not finite on every learner alike: they all ask who, then stop (collective)."""
        own = [float(r == self.layout.rank and not all(torch.isfinite(w).all() for w in self.weights.masters))
               for r in range(self.layout.world_size)]
        bad = [r for r, n in enumerate(self.members.sum(own)) if n]
        raise FloatingPointError(f"learner(s) {bad} hold non-finite weights {when}: their average would be too; "
                                 f"lower optim.lr")

    def state_dict(self) -> dict:
        """The averager's step count (when the warm-up ends and the next average falls) and the counters of the
        training log: a resumed run averages where the uninterrupted one would have."""
        return {"step": self.averager.step, "averages": self.averages, "grad_allreduces": self.grad_allreduces,
                "averaging_s": self.averaging_s}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.averager.step = state["step"]
            self.averages, self.grad_allreduces = state["averages"], state["grad_allreduces"]
            self.averaging_s = state["averaging_s"]

    def end_epoch(self, engine) -> dict:
        """Average the weights once more (in float64), so that every learner holds the same model; -> the
        consensus distance before it (RMS over learners of ||w_i - mean|| / ||mean||, as ADPSGD logs it) and
        the averaging counters."""
        t0 = time.perf_counter()
        world = self.layout.world_size
        with torch.no_grad():
            flat = flatten(self.weights.masters, torch.float64)  # on the CPU, as the mean comes back
            mean = self.members.reduce(flat.clone()).cpu() / world
            if not torch.isfinite(mean).all():
                self._raise_non_finite("at an epoch's end")
            distance = float(((flat - mean).norm() / mean.norm().clamp(min=1e-12)) ** 2)
            self._write(mean)
        squared = self.members.sum([distance])[0]
        self.averages += 1
        emulate_ring_allreduce(self)
        self.averaging_s += time.perf_counter() - t0
        return {"consensus_distance": math.sqrt(squared / world), "averaging_rounds": self.averages,
                "averaging_grad_allreduces": self.grad_allreduces, "averaging_s": self.averaging_s,
                **super().end_epoch(engine)}

