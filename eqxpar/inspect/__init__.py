"""Inspection: what a compiled function communicates and what it keeps in memory.

[`eqxpar.inspect.communication_report`][] lists the collectives of any function (kind,
count, bytes, the mesh axes they run over), read twice:

- from the **lowered** module (StableHLO, what JAX emitted: one entry per `psum`,
  `all_gather`, ... the code asked for), and
- from the **compiled** HLO (what XLA will run: it may merge collectives, drop ones it
  finds redundant, or add its own to move inputs into place).

Comparing the two shows both what the code says and what the machine does.

Each collective also says which `jax.named_scope` (layer) issued it
([`eqxpar.inspect.Collective.scopes`][], [`eqxpar.inspect.CommReport.by_scope`][]), and
over which mesh axes it runs, read from its replica groups in whichever form XLA prints
them (explicit lists, iota, or mesh axes for a plain `jax.jit` with `NamedSharding`s).

The theory functions ([`eqxpar.inspect.data_parallel_theory`][],
[`eqxpar.inspect.fsdp_theory`][], [`eqxpar.inspect.context_parallel_theory`][],
[`eqxpar.inspect.sequence_parallel_theory`][], and the GPT's
[`eqxpar.models.gpt_tensor_parallel_theory`][]) give the least communication each strategy
needs, per collective kind and mesh axes; add them for combined strategies and put them
beside a report with [`eqxpar.inspect.CommReport.versus`][].
[`eqxpar.inspect.memory_report`][] reads a step's per-device memory (parameters, optimizer
state, temporaries, and for eqxpar's train steps the bytes autodiff keeps for the backward
pass); it takes the same inputs as `communication_report`. An
[`eqxpar.inspect.ActivationTheory`][] (the GPT's: [`eqxpar.models.gpt_activation_theory`][])
says which arrays those kept bytes are, term by term, and puts its total beside them.

**Bytes convention.** Every figure is bytes per device per step, of the array the
collective is defined on: for an all-reduce the array reduced; for an all-gather the
gathered (result) array; for a reduce-scatter the full (operand) array each device
contributes, not the slice it keeps; for an all-to-all and a collective-permute the array
sent. These are what the standard formulas count; a ring algorithm sends about
`(N - 1) / N` of that over each device's link for an all-gather or a reduce-scatter, and
twice that for an all-reduce. A collective over groups of one device moves nothing.
"""

from ._activation_theory import ActivationTerm, ActivationTheory
from ._collective import COLLECTIVE_KINDS, Collective
from ._context_theory import context_parallel_theory, sequence_parallel_theory
from ._expert_theory import expert_parallel_theory
from ._flops import PEAK_FLOPS, compiled_flops, mfu, peak_flops, transformer_flops_per_token
from ._format import report_axes
from ._hlo import collectives_in_hlo, collectives_in_lowered
from ._memory import MemoryReport, memory_report
from ._report import CommReport, communication_report
from ._theory import (
    CommComparison,
    CommTheory,
    ComparisonRow,
    TheoryTerm,
    data_parallel_theory,
    fsdp_theory,
    theory_term,
)

__all__ = [
    "Collective",
    "CommReport",
    "communication_report",
    "collectives_in_hlo",
    "collectives_in_lowered",
    "COLLECTIVE_KINDS",
    "TheoryTerm",
    "theory_term",
    "report_axes",
    "CommTheory",
    "CommComparison",
    "ComparisonRow",
    "data_parallel_theory",
    "fsdp_theory",
    "context_parallel_theory",
    "sequence_parallel_theory",
    "expert_parallel_theory",
    "MemoryReport",
    "memory_report",
    "ActivationTerm",
    "ActivationTheory",
    "transformer_flops_per_token",
    "compiled_flops",
    "PEAK_FLOPS",
    "peak_flops",
    "mfu",
]


def __getattr__(name: str):
    if name == "gpt_tensor_parallel_theory":
        raise AttributeError(
            "eqxpar.inspect.gpt_tensor_parallel_theory moved beside the GPT: use "
            "eqxpar.models.gpt_tensor_parallel_theory."
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
