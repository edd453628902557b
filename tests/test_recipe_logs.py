"""Run records (`--log-dir`, `--log-every`) and held-out evaluation during training (`--eval-every`).

- A GPT recipe run with `--log-dir` writes `metrics.jsonl` (step, loss, grad_norm,
  learning_rate, tokens_per_second, mfu every `--log-every` steps, plus the held-out loss every
  `--eval-every` steps), TensorBoard events with the same scalars, and `config.json` (the
  resolved flags).
- `RunLog.step` keeps the metrics on the device and fetches them, all the steps' at once,
  on logged steps only (and at evaluations, checkpoints and the end): the loop stays
  asynchronous in between, the recipes' loops included.
"""

import dataclasses
import json
import struct

import jax
import jax.numpy as jnp
import pytest
from _recipes import RECIPES, load_recipe, run_recipe

import eqxpar.recipe

NAMES = sorted(p.stem for p in RECIPES.glob("*.py"))
TRAINING = [
    "data_parallel",
    "fsdp",
    "hybrid_gpt",
    "long_context",
    "multihost",
    "pipeline_gpt",
    "tensor_parallel",
    "your_model",
]
SMALL_GPT = ["--batch-size", "4", "--context", "8", "--dim", "16", "--heads", "2", "--layers", "1"]


def tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """The scalars of the TensorBoard event files in `folder`: tag -> [(step, value)].

    Event files are TFRecords (length, its CRC, an `Event` protocol buffer, its CRC); read
    with tensorboardX's own `Event` message, without TensorBoard."""
    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, list[tuple[int, float]]] = {}
    files = sorted(folder.glob("events.out.tfevents.*"))
    assert files, f"no TensorBoard event file in {folder}"
    for path in files:
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_every_training_recipe_has_the_log_flags():
    assert set(TRAINING) <= set(NAMES)
    for name in TRAINING:
        config = load_recipe(name).Config
        assert issubclass(config, eqxpar.recipe.LogFlags), name
        assert config().log_dir is None and config().log_every == 10


@pytest.mark.slow
def test_gpt_log_dir_has_metrics_tensorboard_and_config(tmp_path):
    logs = tmp_path / "logs"
    flags = [*SMALL_GPT, "--steps", "5", "--sample-chars", "0", "--mesh", "data=2,model=2"]
    metrics = run_recipe(
        "hybrid_gpt", tmp_path, *flags, "--log-dir", str(logs), "--log-every", "2", "--eval-every", "2"
    )
    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "val_loss" in r]
    # The first step, every 2nd, and the last; the held-out loss every 2 steps.
    assert [r["step"] for r in train] == [1, 2, 4, 5]
    assert [r["step"] for r in evals] == [2, 4]
    for row in train:
        assert set(row) == {"step", "loss", "grad_norm", "learning_rate", "tokens_per_second", "mfu", "time_s"}
        assert row["learning_rate"] == 3e-3 and row["grad_norm"] > 0
        assert row["mfu"] is None  # CPU: no known peak
    assert train[0]["tokens_per_second"] is None  # nothing timed before the first logged step
    assert all(r["tokens_per_second"] > 0 for r in train[1:])
    # The logged loss is the step's loss (the 5th: the recipe's final loss).
    assert train[-1]["loss"] == pytest.approx(metrics["final_loss"], rel=1e-6)
    assert metrics["val_losses"] == evals
    # config.json: the resolved flags (the mesh as chosen, every field).
    config = json.loads((logs / "config.json").read_text())
    recipe = load_recipe("hybrid_gpt")
    assert set(config) == {f.name for f in dataclasses.fields(recipe.Config)}
    assert config["mesh"] == "data=2,model=2" and config["steps"] == 5 and config["log_every"] == 2
    # TensorBoard: the same numbers, as train/<name> and eval/<name>.
    scalars = tensorboard_scalars(logs)
    assert {"train/loss", "train/grad_norm", "train/learning_rate", "train/tokens_per_second", "eval/val_loss"} <= set(
        scalars
    )
    assert [step for step, _ in scalars["train/loss"]] == [1, 2, 4, 5]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([r["loss"] for r in train], rel=1e-6)
    assert [v for _, v in scalars["eval/val_loss"]] == pytest.approx([r["val_loss"] for r in evals], rel=1e-6)


@pytest.mark.slow
def test_data_parallel_logs_examples_per_second_and_test_accuracy(tmp_path):
    logs = tmp_path / "logs"
    flags = ["--steps", "4", "--batch-size", "16", "--width", "16", "--log-dir", str(logs), "--eval-every", "2"]
    metrics = run_recipe("data_parallel", tmp_path, *flags)
    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 4]  # --log-every 10: the first and the last
    assert [r["step"] for r in rows if "test_accuracy" in r] == [2, 4]
    assert "examples_per_second" in rows[0] and rows[-2]["examples_per_second"] > 0
    assert metrics["test_accuracies"][-1]["test_accuracy"] == metrics["test_accuracy"]


def test_run_log_waits_for_the_device_once_per_log_every_steps(tmp_path, monkeypatch):
    """The metrics stay on the device between logged steps: every `every` steps one
    `jax.device_get` fetches all the steps since the last (every step's loss), and nothing
    converts a device value implicitly (the transfer guard would raise)."""
    fetched = []
    device_get = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda tree: fetched.append(len(tree)) or device_get(tree))
    step = jax.jit(lambda x: (x + 1.0, {"loss": 2.0 * x, "grad_norm": x}))
    log = eqxpar.recipe.RunLog(tmp_path, every=5, total_steps=20, items_per_step=8, learning_rate=0.1)
    x = jnp.zeros(())
    with jax.transfer_guard_device_to_host("disallow"):  # float(), .item(), np.asarray of a device value: an error
        for i in range(20):
            x, metrics = step(x)
            log.step(i, metrics)
        log.close()
    assert log.fetches == 5 and fetched == [1, 4, 5, 5, 5]  # steps 1, 2-5, 6-10, 11-15, 16-20
    assert log.losses == [2.0 * i for i in range(20)]  # every step's loss, in order
    assert log.per_second > 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 5, 10, 15, 20]
    assert [r["loss"] for r in rows] == [0.0, 8.0, 18.0, 28.0, 38.0]
    assert not (tmp_path / "config.json").exists()  # no config given


def test_run_log_fetches_at_evaluations_and_checkpoints(tmp_path):
    log = eqxpar.recipe.RunLog(None, every=10, eval_every=3, losses=[7.0])  # 7.0: a restored history
    for i in range(6):
        log.step(i, {"loss": jnp.asarray(float(i))})
        log.maybe_eval(i, val_loss=lambda: 0.5)
    assert log.fetches == 3 and log.losses == [7.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # step 1, evaluations at 3, 6
    log.step(6, {"loss": jnp.asarray(6.0)})
    assert log.data_state() == {"losses": [7.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]} and log.fetches == 4
    log.close()
    assert log.fetches == 4  # nothing left to fetch
    assert log.evals == [{"step": 3, "val_loss": 0.5}, {"step": 6, "val_loss": 0.5}]


def test_run_log_without_a_folder_writes_nothing_and_still_evaluates(tmp_path, capsys):
    log = eqxpar.recipe.RunLog(None, every=1, eval_every=3)
    for i in range(6):
        log.step(i, {"loss": jnp.asarray(1.0)})
        log.maybe_eval(i, val_loss=lambda: 0.5)
    log.close()
    assert log.losses == [1.0] * 6 and not list(tmp_path.iterdir())
    assert log.evals == [{"step": 3, "val_loss": 0.5}, {"step": 6, "val_loss": 0.5}]
    assert "step 3: val_loss 0.5000" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, flags",
    [
        ("data_parallel", ["--batch-size", "16", "--width", "16"]),
        ("hybrid_gpt", [*SMALL_GPT, "--sample-chars", "0", "--mesh", "data=2,model=2"]),
    ],
)
def test_recipe_loops_wait_for_the_device_every_log_every_steps_only(tmp_path, monkeypatch, name, flags):
    """The recipe's loop body converts no device value (the transfer guard is on for it):
    with --log-every 5 over 10 steps, RunLog fetched three times (steps 1, 2-5, 6-10)."""
    logs = []
    progress, close = eqxpar.recipe.RunLog.progress, eqxpar.recipe.RunLog.close

    def guarded(self, steps, **kwargs):
        logs.append(self)

        def loop():  # the guard holds while the loop body runs (it is thread state, not scoped)
            with jax.transfer_guard_device_to_host("disallow"):
                yield from progress(self, steps, **kwargs)

        return loop()

    def closed(self):
        self.fetches_in_loop = getattr(self, "fetches_in_loop", self.fetches)
        close(self)

    monkeypatch.setattr(eqxpar.recipe.RunLog, "progress", guarded)
    monkeypatch.setattr(eqxpar.recipe.RunLog, "close", closed)
    metrics = run_recipe(name, tmp_path, *flags, "--steps", "10", "--log-every", "5")
    assert len(logs) == 1 and logs[0].fetches_in_loop == 3 and len(logs[0].losses) == 10
    assert logs[0].losses[-1] == metrics["final_loss"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--log-every", "0"], "--log-every must be at least 1, got 0"),
        (["--eval-every", "-1"], "--eval-every must be at least 0"),
    ],
)
def test_bad_log_flags_are_one_line(flags, message, capsys):
    recipe = load_recipe("hybrid_gpt")
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        recipe.main(flags)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and message in err, err
