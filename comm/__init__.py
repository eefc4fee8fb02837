"""Distributed training strategies, chosen by name from the DeepSpeed JSON's "comm" section."""

from comm.adpsgd import ADPSGDStrategy
from comm.base import Strategy, init_distributed
from comm.hybrid import HybridStrategy
from comm.layout import LayoutError, ProcessLayout
from comm.sync import SyncStrategy

STRATEGIES: dict[str, type[Strategy]] = {"sync": SyncStrategy, "adpsgd": ADPSGDStrategy,
                                         "hybrid": HybridStrategy}


def build_strategy(comm_section: dict, layout: ProcessLayout, heartbeat=None) -> Strategy:
    """{"strategy": name, **options} -> a Strategy; unknown names fail with the valid ones. heartbeat: see
    Strategy."""
    options = dict(comm_section)
    name = options.pop("strategy", None)
    if name not in STRATEGIES:
        raise ValueError(f'unknown strategy {name!r} in the "comm" section; valid: {", ".join(sorted(STRATEGIES))}')
    return STRATEGIES[name](layout, options, heartbeat)


__all__ = ["STRATEGIES", "LayoutError", "ProcessLayout", "Strategy", "build_strategy", "init_distributed"]
