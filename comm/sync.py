"""SYNC: synchronous data-parallel SGD. DeepSpeed allreduces the gradients of every step over the whole world;
its initialize() broadcasts rank 0's weights, so the learners stay identical and there is nothing to add."""

from comm.base import Strategy


class SyncStrategy(Strategy):
    name = "sync"
