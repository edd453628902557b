"""The picture of eqxpar's layers, computed from the imports in its source.

`import_graph()` reads every module of the `eqxpar` package with `ast` (imports inside
functions included, since a lazy import is still a dependency) and returns which eqxpar
modules each one imports. `LAYERS` assigns every module to a layer, bottom to top;
`violations()` lists the imports that go from a lower layer up to a higher one (there must
be none: `tests/test_architecture.py` checks it), `import_cycles()` the import circles (the
test allows only the known ones), and `draw(path)` draws the layers with the imports
between their parts, aggregated per package, into a PNG.

Run as a script to write `docs/images/architecture.png`.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Mapping

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "eqxpar"

# Bottom to top. A module belongs to the first part whose name equals it or is a prefix of
# it followed by a dot (`eqxpar.nn` holds `eqxpar.nn._linear`); a private top-level module
# split off a top-level part belongs to it too: `eqxpar.testing` holds
# `eqxpar._testing_trees` (see `part_of`).
# The package itself (`eqxpar/__init__.py`, which re-exports from every layer) is the top.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "1. placement",
        (
            "eqxpar._compat",
            "eqxpar._optional",
            "eqxpar._specs",
            "eqxpar._mesh",
            "eqxpar._sharding",
            "eqxpar._promotion",
        ),
    ),
    # inspect reads any compiled function (it imports only the spec vocabulary), and the
    # GPT in eqxpar.models states its own communication and FLOPs with it: it sits below.
    ("2. mapping and inspection", ("eqxpar._shard_map", "eqxpar.inspect")),
    ("3. layers", ("eqxpar.nn",)),
    ("4. train steps", ("eqxpar.train",)),
    # A model states how the model-agnostic train steps cut it (`gpt_stages` returns an
    # `eqxpar.train.Stages`), so models sit above train, and train cannot name a model.
    ("5. models", ("eqxpar.models",)),
    (
        "6. around the step",
        (
            "eqxpar.data",
            "eqxpar.checkpoint",
            "eqxpar.distributed",  # the multi-process runtime: start-up, fail-fast, watchdog, launcher
            "eqxpar.launch",  # `python -m eqxpar.launch`: the launcher's public entry
            "eqxpar.datasets",
            "eqxpar.plan",  # the layout planner: prices GPT steps (models, train) by their theories
        ),
    ),
    ("7. recipes' plumbing", ("eqxpar.testing", "eqxpar.recipe", "eqxpar")),
)


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    """`eqxpar/nn/_linear.py` -> `eqxpar.nn._linear`; `eqxpar/nn/__init__.py` -> `eqxpar.nn`."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """The absolute eqxpar names an `ImportFrom` node refers to (submodules included)."""
    if node.level == 0:
        base = node.module or ""
    else:
        here = module.split(".") if is_package else module.split(".")[:-1]
        here = here[: len(here) - (node.level - 1)]
        base = ".".join(here + ([node.module] if node.module else []))
    # `from . import _folder` names a submodule; `from ._x import y` names the module `_x`.
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """Every eqxpar module and the eqxpar modules it imports (anywhere in its source)."""
    files = {module_name(p, package.parent): p for p in sorted(package.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base, *named = _resolve(name, path.name == "__init__.py", node)
                # `from . import _folder` only loads the submodule: the package it is taken
                # from holds the importer, so it is being imported already and is no
                # dependency (counting it would make every such import a circle).
                if name.startswith(base + ".") and all(n in files for n in named):
                    targets.update(named)
                else:
                    targets.update([base, *named])
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def import_cycles(graph: Mapping[str, set[str]]) -> list[tuple[str, ...]]:
    """The import circles of `graph`: its strongly connected components of more than one
    module (each sorted, the list sorted). Every import `import_graph` reads counts, those
    inside functions and under `if TYPE_CHECKING:` too: a circle closed only by a lazy
    import still ties the two modules together."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):  # Tarjan's algorithm, iterative: no recursion limit
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            nxt = next((t for t in targets if t in graph), None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(tuple(sorted(component)))
    return sorted(cycles)


def part_of(module: str) -> str:
    """The entry of `LAYERS` that holds `module`; raises `KeyError` for a module in none."""
    for _, parts in LAYERS:
        for part in parts:
            if module == part or (part != "eqxpar" and module.startswith(part + ".")):
                return part
    for _, parts in LAYERS:  # split off a top-level part: `eqxpar._<part>_<concern>`
        for part in parts:
            stem = part.removeprefix("eqxpar.").lstrip("_")
            if part.count(".") == 1 and module.startswith(f"eqxpar._{stem}_"):
                return part
    raise KeyError(f"{module} is in no layer of docs/figures/architecture.py's LAYERS")


def layer_of(module: str) -> int:
    """The index in `LAYERS` (0 = bottom) of the layer that holds `module`."""
    part = part_of(module)
    return next(i for i, (_, parts) in enumerate(LAYERS) if part in parts)


def violations(graph: Mapping[str, set[str]]) -> list[tuple[str, str]]:
    """The imports `(importer, imported)` that go from a lower layer up to a higher one."""
    return sorted((src, dst) for src, dsts in graph.items() for dst in dsts if layer_of(src) < layer_of(dst))


def part_edges(graph: Mapping[str, set[str]]) -> set[tuple[str, str]]:
    """The imports between different parts of `LAYERS` (`eqxpar.nn` -> `eqxpar._specs`)."""
    edges = set()
    for src, dsts in graph.items():
        for dst in dsts:
            a, b = part_of(src), part_of(dst)
            if a != b and a != "eqxpar":  # the package re-exports from everything: no arrows
                edges.add((a, b))
    return edges


def draw(path: str | pathlib.Path, package: pathlib.Path = PACKAGE) -> None:
    """Draw the layers and the imports between their parts into the PNG file `path`.

    `package` is the `eqxpar` folder to read (default: this checkout's).

    One band per layer, bottom to top; one box per part, labelled with its folder or file;
    one arrow per pair of parts with at least one import between them (from the importer
    down to what it imports; imports inside a layer are drawn sideways).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    graph = import_graph(package)
    bad = violations(graph)
    edges = part_edges(graph)

    width, band, box_w, box_h = 16.0, 1.6, 1.75, 0.62
    fig, ax = plt.subplots(figsize=(13, 9.5), dpi=100)
    colours = ["#dbe9f6", "#d9f0d3", "#fde6c8", "#f8d5d5", "#d5f0ee", "#e5dbf2", "#eeeeee"]
    lines = ["#2b5d8a", "#2f7a2a", "#b06a00", "#a83232", "#1f7a72", "#6a4a9c", "#555555"]
    centres = _positions(edges, width, band)
    for i, (title, parts) in enumerate(LAYERS):
        y = i * band
        ax.add_patch(
            FancyBboxPatch(
                (0, y + 0.08),
                width,
                band - 0.16,
                boxstyle="round,pad=0.02",
                facecolor=colours[i % len(colours)],
                edgecolor="none",
                zorder=0,
            )
        )
        ax.text(0.15, y + band - 0.28, title, fontsize=11, fontweight="bold", va="center")
        for part in parts:
            cx, cy = centres[part]
            ax.add_patch(
                FancyBboxPatch(
                    (cx - box_w / 2, cy - box_h / 2),
                    box_w,
                    box_h,
                    boxstyle="round,pad=0.03",
                    facecolor="white",
                    edgecolor="#444444",
                    linewidth=1.0,
                    zorder=3,
                )
            )
            ax.text(cx, cy, _label(part, package), ha="center", va="center", fontsize=8.5, zorder=4, family="monospace")
    for a, b in sorted(edges):
        (x0, y0), (x1, y1) = centres[a], centres[b]
        up, same = layer_of(a) < layer_of(b), layer_of(a) == layer_of(b)
        if same:  # sideways, arched over the boxes
            start, end = (x0, y0 + box_h / 2), (x1, y1 + box_h / 2)
            rad = (-0.45 if x1 > x0 else 0.45) / max(abs(x1 - x0), 1.0)  # about 0.45 high
        else:
            start, end = (x0, y0 - box_h / 2), (x1, y1 + box_h / 2)
            rad = 0.0
        ax.add_patch(
            FancyArrowPatch(
                start,
                end,
                arrowstyle="-|>",
                mutation_scale=10,
                connectionstyle=f"arc3,rad={rad}",
                color="#ff0000" if up else lines[layer_of(a) % len(lines)],
                alpha=1.0 if up else 0.55,
                linewidth=2.0 if up else 0.9,
                zorder=2,
            )
        )
    n_imports = sum(len(d) for d in graph.values())
    ax.set_title(
        f"eqxpar's layers, from the imports in its source ({len(graph)} modules, "
        f"{n_imports} imports between them). An arrow: some module of the first box imports "
        f"one of the second.\nImports that go up a layer: {len(bad)}" + (f" (red): {bad[:3]}" if bad else "."),
        fontsize=10,
        loc="left",
    )
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(-0.1, len(LAYERS) * band + 0.1)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight", metadata={"Software": None})  # stable bytes
    plt.close(fig)


def _positions(edges: set[tuple[str, str]], width: float, band: float) -> dict[str, tuple[float, float]]:
    """Box centres: each layer's parts spread evenly, ordered (from the second layer up) by
    the mean position of what they import, which keeps arrows from crossing needlessly."""
    centres: dict[str, tuple[float, float]] = {}
    for i, (_, parts) in enumerate(LAYERS):

        def key(part: str, order=tuple(parts)) -> tuple[float, int]:
            xs = [centres[b][0] for a, b in edges if a == part and b in centres]
            return (sum(xs) / len(xs) if xs else width, order.index(part))

        ordered = sorted(parts, key=key) if i else list(parts)
        step = (width - 1.0) / len(parts)
        for j, part in enumerate(ordered):
            centres[part] = (1.0 + step * (j + 0.5), i * band + band / 2 - 0.12)
    return centres


def _label(part: str, package: pathlib.Path = PACKAGE) -> str:
    """`eqxpar.nn` -> `nn/`, `eqxpar._mesh` -> `_mesh.py`, `eqxpar` -> `__init__.py`; a file
    with private modules split off it (`part_of`) says how many: `testing.py +2`."""
    if part == "eqxpar":
        return "__init__.py"
    path = package.parent / pathlib.Path(*part.split("."))
    if path.is_dir():
        return path.name + "/"
    split_off = len(list(package.glob(f"_{path.name.lstrip('_')}_*.py")))
    return path.name + ".py" + (f" +{split_off}" if split_off else "")


if __name__ == "__main__":
    out = ROOT / "docs" / "images" / "architecture.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    draw(out)
    print(f"wrote {out.relative_to(ROOT)}")
