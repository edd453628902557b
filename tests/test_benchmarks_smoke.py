"""Smoke tests of benchmarks/peer.py (and pool.py, which pools its runs) and benchmarks/mfu.py
at tiny sizes (in-process, on the 8 simulated devices of conftest): they run, eqxpar's step
equals the plain-jit peer's, and the tables come out."""

import importlib.util
import json
import os
import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.allow_rank_promotion  # peer.py is plain JAX, not eqxpar: `x @ w + b` broadcasts
def test_peer_quick_hybrid(capsys, tmp_path):
    """The hybrid strategy has both a data and a model axis: a collective dropped or doubled
    in eqxpar's step (or misplaced by the peer's annotations) moves the loss or the gradient
    norm far beyond the 1e-5 parity bound."""
    out = tmp_path / "peer.json"
    results = _load("peer").main(["--quick", "--strategies", "hybrid", "--rounds", "2", "--out", str(out)])
    r = results["hybrid data=2,model=4"]
    assert r["parity_rel"] <= 1e-5, r["parity"]
    assert sum(r["eqxpar_bytes"].values()) > 0 and sum(r["peer_bytes"].values()) > 0
    assert r["time_ratio"] > 0 and len(r["ratios"]) == 2
    printed = capsys.readouterr().out
    assert "time ratio" in printed and "bytes ratio" in printed and "hybrid data=2,model=4" in printed
    saved = json.loads(out.read_text())
    assert saved["results"]["hybrid data=2,model=4"]["bytes_ratio"] == r["bytes_ratio"]


def test_peer_rejects_an_unknown_strategy():
    with pytest.raises(SystemExit):
        _load("peer").main(["--quick", "--strategies", "pipeline"])


def _peer_run(tmp_path, name, results, dim=256, target=0.93):
    config = dict(dim=dim, heads=8, layers=4, context=32, batch=32, fsdp_min_size=0, quick=False)
    run = dict(config=config, targets=dict(time=target), source=dict(commit="abc1234"), results=results)
    (tmp_path / name).write_text(json.dumps(run))
    return str(tmp_path / name)


def test_pool_puts_the_rounds_of_several_peer_runs_together(tmp_path, capsys):
    """Two runs' rounds pooled: the median is of all rounds, not of the two run medians."""
    runs = [
        _peer_run(tmp_path, "a.json", {"FSDP fsdp=8": dict(ratios=[0.80, 0.93, 1.00])}),
        _peer_run(tmp_path, "b.json", {"FSDP fsdp=8": dict(ratios=[0.96, 0.97, 0.98, 0.99])}),
    ]
    out = tmp_path / "pooled.json"
    pooled = _load("pool").main([*runs, "--out", str(out)])
    e = pooled["FSDP fsdp=8"]
    assert (e["runs"], e["rounds"]) == (2, 7)
    assert e["run_medians"] == [0.93, 0.975]
    assert e["median"] == 0.97  # the 4th of 7 sorted rounds; the mean of the run medians is 0.9525
    # statistics.quantiles' default ("exclusive") method on the 7 sorted rounds: the 2nd and 6th.
    assert e["quartiles"] == pytest.approx([0.93, 0.97, 0.99])
    assert e["share_at_or_under_target"] == 2 / 7  # 0.80 and 0.93: the target (0.93) counts as met
    assert json.loads(out.read_text())["pooled"]["FSDP fsdp=8"]["median"] == 0.97
    printed = capsys.readouterr().out
    assert "commit abc1234" in printed and "FSDP fsdp=8" in printed


@pytest.mark.parametrize(
    "second, message",
    [
        (dict(dim=128), "the runs timed different models (dim = 256, 128"),
        (dict(target=0.95), "the runs have different time targets"),
        (dict(results={"DP data=8": dict(ratios=[])}), "has no per-round ratios for 'DP data=8'"),
    ],
)
def test_pool_refuses_runs_it_cannot_pool(tmp_path, capsys, second, message):
    first = _peer_run(tmp_path, "a.json", {"DP data=8": dict(ratios=[1.0])})
    other = _peer_run(tmp_path, "b.json", **{"results": {"DP data=8": dict(ratios=[1.0])}, **second})
    with pytest.raises(SystemExit):
        _load("pool").main([first, other])
    assert message in capsys.readouterr().err


def test_pool_refuses_a_file_peer_did_not_write(tmp_path, capsys):
    (tmp_path / "pooled.json").write_text(json.dumps(dict(runs=["a.json"], pooled={})))
    with pytest.raises(SystemExit):
        _load("pool").main([str(tmp_path / "pooled.json")])
    assert "not a file `peer.py --out` wrote" in capsys.readouterr().err
    (tmp_path / "log.txt").write_text("FSDP fsdp=8  0.93\n")
    for path in (tmp_path / "missing.json", tmp_path / "log.txt"):
        with pytest.raises(SystemExit):
            _load("pool").main([str(path)])
        assert f"cannot read {path} as JSON" in capsys.readouterr().err


def test_mfu_quick_on_cpu(capsys):
    rows = _load("mfu").main(["--configs", "32x1", "--heads", "4", "--context", "8", "--batch", "8", "--steps", "1"])
    assert [r["devices"] for r in rows] == [1, 8]
    for r in rows:
        assert r["mfu"] is None  # no peak FLOP/s for a CPU
        assert r["tokens_per_s"] > 0 and r["model_flops_per_s"] > 0 and r["xla_flops_per_s"] > r["model_flops_per_s"]
    assert "tokens/s" in capsys.readouterr().out


@pytest.mark.allow_rank_promotion  # it profiles peer.py's plain-JAX step too
def test_profile_step_quick(capsys, tmp_path):
    """benchmarks/profile_step.py: every runtime event of both programs is matched to an
    instruction of its compiled HLO, the per-operation table is not empty, and its total
    (ms per step, mean over devices) is a sane fraction of the step's measured wall time."""
    out = tmp_path / "profile.json"
    results = _load("profile_step").main(["--quick", "--strategies", "hybrid", "--steps", "2", "--out", str(out)])
    r = results["hybrid data=2,model=4"]
    for who in ("eqxpar", "peer"):
        s = r[who]
        assert s["events"] > 0 and s["ops"] and s["unmatched"] == 0, (who, s["events"], s["unmatched"])
        assert s["devices"] == 8
        assert 0.1 * s["wall_ms"] < s["total_ms"] < 2.0 * s["wall_ms"], (who, s["total_ms"], s["wall_ms"])
        assert s["kinds"].get("matmul", 0) > 0 and s["kinds"].get("all-reduce", 0) > 0
        # Both programs carry the GPT's named scopes (the peer's loss is scoped like eqxpar's).
        assert any(k.startswith("attention ") for k in s["layers"]) and any(k.startswith("mlp ") for k in s["layers"])
        # Each instruction's least time; per kind they add up to the least-time table.
        per_kind = {}
        for o in s["least_ops"]:
            per_kind[o["kind"]] = per_kind.get(o["kind"], 0.0) + o["ms"]
        assert per_kind == pytest.approx(s["least"]), who
        assert {o["op"] for o in s["least_ops"]} == {o["op"] for o in s["ops"]}, who
    printed = capsys.readouterr().out
    assert "by kind" in printed and "largest operations" in printed
    assert json.loads(out.read_text())["results"]["hybrid data=2,model=4"]["eqxpar"]["module"] == r["eqxpar"]["module"]


def test_profile_step_rejects_an_unknown_strategy():
    with pytest.raises(SystemExit):
        _load("profile_step").main(["--quick", "--strategies", "pipeline"])


def test_gpu_benchmark_quick_on_cpu(tmp_path):
    """benchmarks/gpu.py's one-command run, at its tiny size on whatever backend runs the
    tests: the candidate trains (finite loss that falls), and the JSON and Markdown
    tables come out with the XLA flags it ran with. One candidate of the two `--quick`
    has (each is a process of its own: 8 s here), the one with a remat policy."""
    # The children run on one CPU device, as on one GPU, and inherit the suite's XLA_FLAGS
    # (tests/conftest.py: compiles at -O0).
    result = _load("gpu").main(["--quick", "--candidates", "quick:save_matmuls:4", "--out", str(tmp_path)])
    rows = result["rows"]
    assert [(r["config"], r["remat"], r["status"]) for r in rows] == [("quick", "save_matmuls", "ok")]
    for r in rows:
        assert r["devices"] == 1 and r["tokens_per_s"] > 0 and r["step_ms"] > 0
        assert 0 < r["last_loss"] < r["first_loss"] < 20
        assert r["flops_per_token"] > 0
        assert r["fused_attention"] is (r["platform"] == "gpu")
    saved = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows)) and saved["xla_flags"] and not saved["rejected_flags"]
    table = (tmp_path / "gpu_bench.md").read_text()
    assert "| quick | save_matmuls | 4 x 32 |" in table and "latency_hiding_scheduler" in table


def test_gpu_benchmark_drops_a_flag_this_jax_does_not_know(monkeypatch):
    """XLA aborts at start-up on an unknown flag: the benchmark keeps the ones that start."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    good = "--xla_gpu_enable_latency_hiding_scheduler=true"
    kept, rejected = _load("gpu").accepted_flags([good, "--xla_gpu_no_such_flag_here=true"], {})
    assert kept == [good] and rejected == ["--xla_gpu_no_such_flag_here=true"]


@pytest.mark.thorough  # planning and one compile (~7 s); validate itself is tested in test_plan_validate.py
def test_plan_validate_on_a_sample_of_candidates(capsys, tmp_path):
    """benchmarks/plan_validate.py: a candidate of a small GPT compiles to exactly the
    predicted collective and state bytes, and its peak ratio is summarised by remat."""
    out = tmp_path / "plan.json"
    flags = ["--dim", "32", "--heads", "4", "--layers", "2", "--context", "16", "--batch", "8", "--vocab", "61"]
    result = _load("plan_validate").main([*flags, "--sample", "0.005", "--out", str(out)])
    rows = result["rows"]
    assert len(rows) == 1 and result["exact"] == 1
    assert all(0 < r["peak_ratio"] == r["compiled_peak"] / r["predicted_peak"] for r in rows)
    (row,) = rows
    assert result["peak_ratio"] == {
        row["remat"]: {"n": 1, "least": row["peak_ratio"], "median": row["peak_ratio"], "most": row["peak_ratio"]}
    }
    assert "collective and state bytes exact" in capsys.readouterr().out
    assert json.loads(out.read_text())["exact"] == len(rows)


def test_gpu_ab_alternates_the_sides_and_takes_the_median_of_the_pairs_ratios():
    ab = _load("gpu_ab")
    assert [ab.order(i) for i in range(3)] == [("A", "B"), ("B", "A"), ("A", "B")]

    def row(ms, loss):
        return {"status": "ok", "step_ms": ms, "last_loss": loss}

    pairs = [
        {"A": row(100.0, 6.0), "B": row(97.0, 6.5)},
        {"A": row(110.0, 6.1), "B": row(99.0, 6.6)},
        {"A": row(100.0, 6.2), "B": {"status": "OOM"}},  # an incomplete pair counts for neither side
    ]
    s = ab.summary(pairs)
    assert s["ratios"] == [97.0 / 100.0, 99.0 / 110.0]
    assert s["median_ratio"] == pytest.approx((0.97 + 0.9) / 2)
    assert (s["a_ms"], s["b_ms"]) == (105.0, 98.0) and s["losses"] == [(6.0, 6.5), (6.1, 6.6)]
    assert ab.summary([pairs[2]])["median_ratio"] is None


def test_gpu_ab_puts_each_sides_tree_first_and_checks_what_it_imported(tmp_path):
    ab = _load("gpu_ab")
    trees = {"A": tmp_path / "base", "B": ROOT}
    sides = ab.side_environments({"PYTHONPATH": "/elsewhere", "KEEP": "1"}, trees)
    assert sides["A"]["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "base"), "/elsewhere"]
    assert sides["B"]["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/elsewhere"]
    assert sides["A"]["KEEP"] == sides["B"]["KEEP"] == "1"
    assert ab.side_environments({}, trees)["A"]["PYTHONPATH"] == str(tmp_path / "base")
    # B's own eqxpar only: not A's copy carried inside B's checkout.
    assert ab._imported_from({"eqxpar_path": str(ROOT / "eqxpar")}, ROOT)
    assert not ab._imported_from({"eqxpar_path": str(ROOT / "ab" / "eqxpar")}, ROOT)


def test_gpu_ab_needs_another_tree_with_eqxpar_in_it(tmp_path, capsys):
    ab = _load("gpu_ab")
    for baseline, said in ((tmp_path, "no eqxpar/__init__.py there"), (ROOT, "an A/B needs another tree")):
        with pytest.raises(SystemExit) as exit_info:
            ab.parse(["--baseline", str(baseline)])
        assert exit_info.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.thorough  # two processes that each compile a step (~16 s)
def test_gpu_ab_quick_on_cpu_runs_each_tree_once(tmp_path):
    """The same code on both sides: the pair's losses are equal bit for bit, each side
    imported its own tree, and both compiled programs were written."""
    shutil.copytree(ROOT / "eqxpar", tmp_path / "base" / "eqxpar")
    argv = ["--baseline", str(tmp_path / "base"), "--candidates", "quick:none:4", "--rounds", "1", "--steps", "2"]
    result = _load("gpu_ab").main([*argv, "--pairs", "1", "--hlo", str(tmp_path / "hlo"), "--out", str(tmp_path)])
    (c,) = result["candidates"]
    (pair,) = c["pairs"]
    assert pair["A"]["eqxpar_path"] == str((tmp_path / "base" / "eqxpar").resolve())
    assert pair["B"]["eqxpar_path"] == str(ROOT / "eqxpar")
    assert len(c["ratios"]) == 1 and c["ratios"][0] > 0 and c["losses"][0][0] == c["losses"][0][1]
    written = sorted(p.name for p in (tmp_path / "hlo").iterdir())
    assert written == ["quick_none_4_A0.hlo.txt", "quick_none_4_B0.hlo.txt"]
    assert "| quick:none:4 |" in (tmp_path / "gpu_ab.md").read_text()
