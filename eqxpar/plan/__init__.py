"""A layout planner: the fastest layout of a GPT train step that fits a cluster.

[`eqxpar.plan.plan`][] enumerates every factorisation of the devices into `stage x data x
fsdp x context x model` (`data x fsdp x expert x model` for a mixture-of-experts GPT), with
remat, sequence parallelism and the context-parallel attention;
rules out what the library's own checks refuse; prices each layout by eqxpar's exact
theories (collective bytes per kind and axes, parameter, optimizer-state and
saved-activation bytes, FLOPs) and a roofline over an [`eqxpar.plan.Cluster`][]'s links;
and returns the fastest that fit, each able to build its own mesh and step.
[`eqxpar.plan.validate`][] compiles plans on the devices at hand and puts every prediction
beside the compiled program's figure. See docs/concepts/planner.md.
"""

from ._abstract import AXES, EXPERT_AXES
from ._candidates import REMATS, Layout
from ._cluster import PRESETS, Cluster, Link, cluster
from ._plan import Plan, plan, table
from ._predict_comm import RING_FACTORS
from ._predict_memory import Memory
from ._predict_time import StepTime
from ._validate import Validation, validate, validation_table

__all__ = [
    "plan",
    "Plan",
    "table",
    "Cluster",
    "Link",
    "cluster",
    "PRESETS",
    "Layout",
    "REMATS",
    "AXES",
    "EXPERT_AXES",
    "Memory",
    "StepTime",
    "RING_FACTORS",
    "validate",
    "Validation",
    "validation_table",
]
