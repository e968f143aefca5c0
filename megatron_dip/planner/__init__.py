"""The planner: cost model, simulator, placement, sub-microbatching and schedule search.

Pure Python (numpy/scipy): it never imports torch, Megatron-Core or `megatron_dip.runtime`.
"""

from .cost_model import CostModel, StageCost
from .devices import DEVICES, H100, H200, H800, CostProfile, DeviceSpec, get_device, load_profile
from .overheads import HostOverheads, load_overheads
from .simulator import SimResult, UniformCost, simulate
from .trace import Span, plan_timeline, write_chrome_trace

__all__ = [
    "DEVICES",
    "H100",
    "H200",
    "H800",
    "CostModel",
    "CostProfile",
    "DeviceSpec",
    "HostOverheads",
    "SimResult",
    "Span",
    "StageCost",
    "UniformCost",
    "get_device",
    "load_overheads",
    "load_profile",
    "plan_timeline",
    "simulate",
    "write_chrome_trace",
]
