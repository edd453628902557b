"""Plumbing shared by the recipes: flags from a config dataclass, a progress bar, metrics JSON.

A recipe declares its settings as a dataclass, with a comment (or docstring) per field, and
lets [`eqxpar.recipe.parse_flags`][] turn every field into a command-line flag
(`batch_size` becomes `--batch-size`) and run the recipe's checks before anything compiles:

```python
@dataclasses.dataclass
class Config:
    devices: int = 8  # simulated CPU devices when there is no accelerator
    mesh: str = "auto"  # e.g. data=8; auto: the largest data axis the devices allow
    steps: int = 300  # training steps


def check_flags(cfg: Config) -> Config:  # raises ValueError, or returns the completed config
    eqxpar.recipe.require_positive(cfg, "steps")
    eqxpar.simulate_cpu_devices(cfg.devices)  # before JAX starts
    sizes = eqxpar.recipe.mesh_from_flag(cfg.mesh, {"data": 8})
    return dataclasses.replace(cfg, mesh=eqxpar.recipe.mesh_text(sizes))


cfg = eqxpar.recipe.parse_flags(Config, validate=check_flags)  # bad flags: one line, exit 2
```
"""

from ._evaluate import held_out_loss
from ._flags import (
    CheckpointFlags,
    flag_error,
    flag_errors,
    mesh_from_flag,
    mesh_text,
    parse_flags,
    require_positive,
)
from ._gpt_flags import GPTFlags, check_gpt_flags, speed_metrics, speed_text
from ._layout import (
    CPU_CLUSTER,
    LayoutFlags,
    auto_layout,
    check_compiled_peak,
    check_layout_flags,
    layout_metrics,
    local_cluster,
)
from ._log import LogFlags, RunLog
from ._output import Throughput, is_main_process, parameter_digest, progress, steps_to_run, write_metrics
from ._text import TextData, TextFlags, check_text_flags, load_text

__all__ = [
    "parse_flags",
    "flag_error",
    "flag_errors",
    "mesh_from_flag",
    "mesh_text",
    "require_positive",
    "progress",
    "steps_to_run",
    "write_metrics",
    "is_main_process",
    "CheckpointFlags",
    "GPTFlags",
    "check_gpt_flags",
    "speed_metrics",
    "speed_text",
    "parameter_digest",
    "Throughput",
    "LogFlags",
    "RunLog",
    "held_out_loss",
    "LayoutFlags",
    "auto_layout",
    "check_layout_flags",
    "check_compiled_peak",
    "local_cluster",
    "layout_metrics",
    "CPU_CLUSTER",
    "TextFlags",
    "check_text_flags",
    "load_text",
    "TextData",
]
