"""KV transfer: compression pipelines, the offline profiler and the online controller (KVServe)."""
from .controller import Profile, Selection, benefit_threshold, pareto_front, select
from .errors import ContainerError, SpecError
from .pipeline import Pipeline, decode

__all__ = ["Profile", "Selection", "benefit_threshold", "pareto_front", "select",
           "ContainerError", "SpecError", "Pipeline", "decode"]
