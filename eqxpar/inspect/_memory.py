"""The memory report: what one device holds for a compiled step."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jaxtyping import PyTree

from ._format import stages, table, unwrap


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-device memory of a compiled step, beside the single-device figures.

    `parameters`, `optimizer_state` and `other_inputs` (the batch, keys) are bytes one
    device holds, read from the arguments' shardings (the largest block of each array);
    the `*_whole` fields are the same arrays unsplit, i.e. what a single device would
    hold. The rest is XLA's `memory_analysis()` of the compiled program, per device:
    `arguments` (all inputs), `outputs`, `aliased` (outputs written into donated
    inputs), `temporaries` (activations and other scratch) and `generated_code`.
    `saved_activations` is what autodiff keeps from the forward pass for the backward pass
    (for eqxpar's train steps, [`eqxpar.train.TrainStep.saved_activation_bytes`][]; `None`
    for other functions): the figure an [`eqxpar.inspect.ActivationTheory`][] predicts.

    `print(report)` shows a table; [`MemoryReport.versus`][eqxpar.inspect.MemoryReport.versus]
    puts it beside another report (e.g. the single-device step's, for the temporaries).
    """

    parameters: int
    optimizer_state: int
    other_inputs: int
    parameters_whole: int
    optimizer_state_whole: int
    other_inputs_whole: int
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    generated_code: int
    saved_activations: int | None = None

    @property
    def state(self) -> int:
        """Parameters plus optimizer state per device: what stays between steps."""
        return self.parameters + self.optimizer_state

    @property
    def state_whole(self) -> int:
        """Parameters plus optimizer state, unsplit."""
        return self.parameters_whole + self.optimizer_state_whole

    @property
    def peak(self) -> int:
        """An estimate of the step's peak bytes per device: arguments, outputs not
        written into donated inputs, and temporaries."""
        return self.arguments + self.outputs - self.aliased + self.temporaries

    @classmethod
    def of(cls, compiled: Any, model: PyTree, opt_state: PyTree, *other_inputs: Any) -> MemoryReport:
        """The memory report of a step already compiled for these arguments.

        **Arguments:**

        - `compiled`: the compiled step (`step.lower(...).compile()`, a
          `jax.stages.Compiled` or Equinox's wrapper of one).
        - `model`, `opt_state`: the step's parameters and optimizer state, placed as the
          step takes them (arrays, or `jax.ShapeDtypeStruct`s with shardings).
        - `*other_inputs`: its remaining arguments (batch, key, ...).

        **Returns:**

        A [`eqxpar.inspect.MemoryReport`][].
        """
        if not isinstance(unwrap(compiled, "compiled"), jax.stages.Compiled):
            raise ValueError(f"MemoryReport.of: expected a compiled program, got {type(compiled).__name__}.")
        analysis = unwrap(compiled, "compiled").memory_analysis()
        if analysis is None:
            raise ValueError("MemoryReport.of: this backend gives no memory analysis for the compiled program.")
        params, params_whole = _tree_nbytes(eqx.filter(model, eqx.is_array))
        opt, opt_whole = _tree_nbytes(opt_state)
        other, other_whole = _tree_nbytes(other_inputs)
        return cls(
            parameters=params,
            optimizer_state=opt,
            other_inputs=other,
            parameters_whole=params_whole,
            optimizer_state_whole=opt_whole,
            other_inputs_whole=other_whole,
            arguments=int(analysis.argument_size_in_bytes),
            outputs=int(analysis.output_size_in_bytes),
            aliased=int(analysis.alias_size_in_bytes),
            temporaries=int(analysis.temp_size_in_bytes),
            generated_code=int(analysis.generated_code_size_in_bytes),
        )

    def versus(self, single: MemoryReport) -> str:
        """A table of this report beside another one (typically the single-device step's):
        bytes per device of each and their ratio.

        **Arguments:**

        - `single`: the report to compare with.

        **Returns:**

        The table, as a string.
        """
        if not isinstance(single, MemoryReport):
            raise ValueError(f"MemoryReport.versus: expected a MemoryReport, got {type(single).__name__}.")
        fields = ("parameters", "optimizer_state", "state", "temporaries", "peak")
        rows = []
        for f in fields:
            mine, theirs = getattr(self, f), getattr(single, f)
            rows.append((f.replace("_", " "), f"{mine:,}", f"{theirs:,}", f"{mine / theirs:.3f}" if theirs else "-"))
        return "\n".join(table(("bytes per device", "this step", "other", "ratio"), rows))

    def __str__(self) -> str:
        def row(name, mine, whole):
            return (name, f"{mine:,}", f"{whole:,}", f"{mine / whole:.3f}" if whole else "-")

        rows = [
            row("parameters", self.parameters, self.parameters_whole),
            row("optimizer state", self.optimizer_state, self.optimizer_state_whole),
            row("parameters + optimizer", self.state, self.state_whole),
            row("other inputs", self.other_inputs, self.other_inputs_whole),
            ("temporaries", f"{self.temporaries:,}", "", ""),
            *(
                [("saved for the backward pass", f"{self.saved_activations:,}", "", "")]
                if self.saved_activations is not None
                else []
            ),
            ("peak (estimate)", f"{self.peak:,}", "", ""),
        ]
        return "\n".join(table(("memory", "per device", "whole (1 device)", "ratio"), rows))


def memory_report(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> MemoryReport:
    """Lower and compile `fn(*args, **kwargs)` and report its memory per device.

    Takes what [`eqxpar.inspect.communication_report`][] takes: a function with a `.lower`
    method (a [`eqxpar.train.TrainStep`][], a `jax.jit` or `eqx.filter_jit` function) or any
    other function (wrapped in `eqx.filter_jit`), with its arguments; or a program already
    lowered or compiled, with the arguments it was lowered for (then only counted). Nothing
    runs. The first argument counts as the parameters, the second (if any) as the
    optimizer state, the rest (keyword arguments included) as other inputs. For an eqxpar
    train step the report also has `saved_activations` (traced, not compiled again).

    **Arguments:**

    - `fn`: the step (or a lowered or compiled program).
    - `*args`: its arguments, placed as the step takes them: `model, opt_state, batch, ...`.
    - `**kwargs`: its keyword arguments (other inputs).

    **Returns:**

    A [`eqxpar.inspect.MemoryReport`][].

    **Raises:**

    - `ValueError` without arguments (nothing to count as parameters), or if the backend
      gives no memory analysis.
    """
    if not args:
        raise ValueError("memory_report: pass the step's arguments (model, opt_state, batch, ...) after it.")
    _, compiled = stages("memory_report", fn, args, kwargs)
    model, opt_state, *rest = (*args, None) if len(args) == 1 else args
    report = MemoryReport.of(compiled, model, opt_state, *rest, *kwargs.values())
    saved = getattr(fn, "saved_activation_bytes", None)
    if callable(saved):
        report = dataclasses.replace(report, saved_activations=saved(*args, **kwargs))
    return report


def _tree_nbytes(tree: PyTree) -> tuple[int, int]:
    """(bytes one device holds, bytes of the whole arrays) of a tree's arrays."""
    per_device = whole = 0
    for leaf in jax.tree.leaves(tree):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            continue
        itemsize = leaf.dtype.itemsize  # works for NumPy dtypes and PRNG key dtypes
        shape = tuple(leaf.shape)
        whole += math.prod(shape) * itemsize
        sharding = getattr(leaf, "sharding", None)
        block = sharding.shard_shape(shape) if sharding is not None else shape
        per_device += math.prod(block) * itemsize
    return per_device, whole
