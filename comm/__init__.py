"""Distributed training strategies, chosen by name from the DeepSpeed JSON's "comm" section."""

from comm.adpsgd import ADPSGDStrategy
from comm.base import Strategy
from comm.distributed import init_distributed, shutdown_distributed
from comm.faults import FaultInjector
from comm.hybrid import HybridStrategy
from comm.layout import LayoutError, ProcessLayout
from comm.localsgd import LocalSGDStrategy
from comm.sync import SyncStrategy

STRATEGIES: dict[str, type[Strategy]] = {"sync": SyncStrategy, "adpsgd": ADPSGDStrategy,
                                         "hybrid": HybridStrategy, "localsgd": LocalSGDStrategy}


def build_strategy(comm_section: dict, layout: ProcessLayout, heartbeat=None) -> Strategy:
    """{"strategy": name, **options} -> a Strategy; unknown names fail with the valid ones. heartbeat: see
    Strategy. Checks the section's fault injection too (comm/faults.py), so a typo fails here."""
    options = dict(comm_section)
    name = options.pop("strategy", None)
    if name not in STRATEGIES:
        raise ValueError(f'unknown strategy {name!r} in the "comm" section; valid: {", ".join(sorted(STRATEGIES))}')
    strategy = STRATEGIES[name](layout, options, heartbeat)
    FaultInjector(strategy.conf["debug"], layout.rank)
    return strategy


__all__ = ["STRATEGIES", "FaultInjector", "LayoutError", "ProcessLayout", "Strategy", "build_strategy",
           "init_distributed", "shutdown_distributed"]
