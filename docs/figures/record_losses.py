"""Run one training recipe and keep its loss at every step: docs/data/losses/<recipe>.json.

`make figures` runs this once per training recipe (minutes, so `make docs` does not: it
draws the loss curves from the JSON kept here). The recipe runs as written, through its
own `main(argv)`, with fewer steps than its default; the losses are the recipe's own:

- recipes whose step comes from an `eqxpar.train` builder (`data_parallel_step`,
  `hybrid_step`, `fsdp_step`): the builder is wrapped so that each call of the step it
  returns also records `float(metrics["loss"])`; nothing else changes;
- recipes/tensor_parallel.py, which jits its own step: the loss it shows on its progress
  bar (every 10 steps and the last) is recorded from `bar.set_postfix(loss=...)`.

Usage (from the repository root):

    python docs/figures/record_losses.py hybrid_gpt --steps 120
    python -m eqxpar.launch --nproc 2 --devices-per-proc 4 docs/figures/record_losses.py multihost --steps 150
    python docs/figures/record_losses.py --save-as precision/hybrid_gpt_bfloat16 hybrid_gpt --steps 300 --dtype bfloat16

`--save-as NAME` (before the recipe) writes docs/data/losses/NAME.json instead of
<recipe>.json: runs of one recipe with other flags, kept beside its own curve (the
float32-vs-bfloat16 pair lives in docs/data/losses/precision/, which the per-recipe loss
pictures leave alone).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "data" / "losses"
BUILDERS = ("data_parallel_step", "hybrid_step", "fsdp_step")


class _Recorded:
    """A train step that also appends each call's loss to `losses` (attributes pass through)."""

    def __init__(self, step, losses: list):
        self._step, self._losses = step, losses

    def __call__(self, *args, **kwargs):
        out = self._step(*args, **kwargs)
        self._losses.append(float(out[2]["loss"]))
        return out

    def __getattr__(self, name):
        return getattr(self._step, name)


def record(recipe: str, argv: list[str]) -> dict:
    import eqxpar
    import eqxpar.recipe
    import eqxpar.train

    losses: list[float] = []
    sampled: list[tuple[int, float]] = []  # (step, loss) from the progress bar

    def wrap(builder):
        @functools.wraps(builder)
        def wrapped(*args, **kwargs):
            return _Recorded(builder(*args, **kwargs), losses)

        return wrapped

    for name in BUILDERS:
        setattr(eqxpar.train, name, wrap(getattr(eqxpar.train, name)))

    progress = eqxpar.recipe.progress

    def recording_progress(iterable, **kwargs):
        items = list(iterable)
        current = [None]

        def tracked():
            for item in items:
                current[0] = item
                yield item

        bar = progress(tracked(), total=len(items), **kwargs)
        set_postfix = bar.set_postfix

        def postfix(*args, **kw):
            if "loss" in kw and isinstance(current[0], int):
                sampled.append((current[0], float(kw["loss"])))
            return set_postfix(*args, **kw)

        bar.set_postfix = postfix
        return bar

    eqxpar.recipe.progress = recording_progress

    spec = importlib.util.spec_from_file_location(f"recipe_{recipe}", ROOT / "recipes" / f"{recipe}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)  # imports `from eqxpar.train import ...`: the wrapped builders
    start = time.perf_counter()
    metrics = module.main(argv)
    seconds = time.perf_counter() - start
    if isinstance(metrics, dict) and isinstance(metrics.get("losses"), list):
        steps, values, source = list(range(len(metrics["losses"]))), metrics["losses"], "the recipe's metrics"
    elif losses:
        # your_model trains twice (auto plan, split head): keep the first run's steps.
        n = int(metrics.get("steps", len(losses))) if isinstance(metrics, dict) else len(losses)
        steps, values, source = list(range(min(n, len(losses)))), losses[:n], "metrics['loss'] of every step"
    elif sampled:
        steps, values, source = [s for s, _ in sampled], [v for _, v in sampled], "the loss on the progress bar"
    else:
        raise SystemExit(f"record_losses: {recipe} reported no loss (is it a training recipe?)")
    import jax

    placement, launcher = {}, ["python"]
    if jax.process_count() > 1:  # which process holds which device: the two-host picture
        mesh = eqxpar.make_mesh(data=2, model=4)
        per = len(jax.local_devices())
        launcher = ["python -m eqxpar.launch", f"--nproc {jax.process_count()} --devices-per-proc {per}"]
        placement = {
            "mesh_data2_model4": [[[d.id, d.process_index] for d in row] for row in mesh.devices.tolist()],
        }
    return {
        **placement,
        "recipe": recipe,
        "command": " ".join([*launcher, f"recipes/{recipe}.py", *argv]),
        "source": source,
        "steps": steps,
        "loss": values,
        "final_metrics": {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float, str))},
        "seconds": round(seconds, 1),
    }


def main() -> None:
    args = sys.argv[1:]
    name = None
    if args[:1] == ["--save-as"]:
        if (
            len(args) < 2
            or not args[1]
            or args[1].startswith("-")
            or pathlib.PurePath(args[1]).is_absolute()
            or ".." in pathlib.PurePath(args[1]).parts
        ):
            raise SystemExit(
                "record_losses: --save-as needs a NAME inside docs/data/losses (e.g. precision/hybrid_gpt_bfloat16)"
            )
        name, args = args[1].removesuffix(".json"), args[2:]
    if not args:
        raise SystemExit(__doc__)
    recipe, argv = args[0], args[1:]
    name = name or recipe
    if not (ROOT / "recipes" / f"{recipe}.py").exists():
        raise SystemExit(f"record_losses: there is no recipes/{recipe}.py")
    result = record(recipe, argv)
    import jax

    if jax.process_index() == 0:
        OUT.mkdir(parents=True, exist_ok=True)
        path = OUT / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        result["loss"] = [float(f"{v:.6g}") for v in result["loss"]]
        lines = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in result.items()]  # one key a line
        path.write_text("{\n" + ",\n".join(lines) + "\n}\n")
        print(f"record_losses: {len(result['loss'])} losses of {recipe} -> {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
