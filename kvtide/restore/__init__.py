"""CacheFlow restoration: latency profile, staircase DP planner, baselines."""

from kvtide.restore.costs import AnalyticReplayTime, BlockCost, ExecutorReplayTime, RestoreRequest, StaircaseCost
from kvtide.restore.planner import Plan, evaluate, plan
from kvtide.restore.profile import LatencyProfile, ProfileConfig

__all__ = [
    "AnalyticReplayTime",
    "BlockCost",
    "ExecutorReplayTime",
    "LatencyProfile",
    "Plan",
    "ProfileConfig",
    "RestoreRequest",
    "StaircaseCost",
    "evaluate",
    "plan",
]
