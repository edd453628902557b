"""The committed pictures in docs/images/ are not older than what they show.

docs/figures/make_figures.py draws each picture from its inputs (the data it plots: a
mesh's shardings, collectives' results, recorded loss curves, the benchmark table, the
import graph, pipeline schedules) and writes docs/images/manifest.json: per PNG, a hash of
those inputs and one of the code that draws it. Here the inputs are computed again, as the
script computes them but without drawing (a few seconds: three small `shard_map`s), and
compared with the manifest. A mismatch means a picture no longer matches the code or data
it was drawn from: run `make docs` (or `python docs/figures/make_figures.py NAME`) and
commit the pictures with the manifest.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import pathlib

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
IMAGES = DOCS / "images"

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def figures():
    spec = importlib.util.spec_from_file_location("make_figures", DOCS / "figures" / "make_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # simulate_cpu_devices(8): the tests' own count already
    return module


@pytest.fixture(scope="module")
def current(figures):
    """The manifest as the script would write it now: {png: entry}, computed without drawing."""
    entries = {}
    for draw in figures.FIGURES:
        entries.update(figures.manifest_entries(draw, figures.inputs_of(draw)))
    return entries


def stale_pictures(recorded: dict, current: dict) -> list[str]:
    """One line per picture whose recorded entry differs from the current one, saying what changed."""
    bad = []
    for name in sorted(set(recorded) | set(current)):
        old, new = recorded.get(name), current.get(name)
        if old is None:
            bad.append(f"{name}: not in docs/images/manifest.json (a new picture?)")
        elif new is None:
            bad.append(f"{name}: in the manifest, but no figure of make_figures.py draws it any more")
        else:
            changed = [what for what in ("inputs", "code") if old.get(what) != new[what]]
            if changed:
                bad.append(f"{name}: its {' and '.join(changed)} changed since it was drawn (by {new['drawn_by']})")
    return bad


def test_every_picture_has_a_manifest_entry():
    manifest = json.loads((IMAGES / "manifest.json").read_text())
    pngs = {p.name for p in IMAGES.glob("*.png")}
    assert pngs == set(manifest), (
        f"pictures without a manifest entry: {sorted(pngs - set(manifest))}; "
        f"entries without a picture: {sorted(set(manifest) - pngs)}"
    )


def test_no_picture_is_stale(current):
    recorded = json.loads((IMAGES / "manifest.json").read_text())
    bad = stale_pictures(recorded, current)
    assert not bad, (
        "pictures older than what they show; run `make docs` (or python docs/figures/make_figures.py) "
        "and commit docs/images/ with its manifest.json:\n" + "\n".join(bad)
    )


def test_a_changed_input_or_drawing_is_reported(figures, current):
    """A loss curve with one value changed, and a figure drawn by other code, are both caught."""
    inputs = figures.inputs_of(figures.loss_curves)
    name = sorted(inputs)[0]
    changed = copy.deepcopy(inputs)
    changed[name]["loss"][-1] += 1e-6
    entries = figures.manifest_entries(figures.loss_curves, changed)
    assert stale_pictures({name: current[name]}, {name: entries[name]}) == [
        f"{name}: its inputs changed since it was drawn (by loss_curves)"
    ]

    # the same inputs drawn by another function: the code hash differs
    redrawn = dict(current[name], code=figures.code_digest(figures.two_hosts))
    assert stale_pictures({name: current[name]}, {name: redrawn}) == [
        f"{name}: its code changed since it was drawn (by loss_curves)"
    ]
    assert stale_pictures({}, {name: current[name]}) == [f"{name}: not in docs/images/manifest.json (a new picture?)"]


def test_the_code_hash_ignores_layout_and_docstrings(figures):
    def a(x):
        """One docstring."""
        return x + 1  # a comment

    def b(x):
        """Another."""
        return x + 1

    assert figures._code(a).replace("'a'", "'f'") == figures._code(b).replace("'b'", "'f'")
