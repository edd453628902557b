"""`make mutants`: do the default tests catch a broken collective or schedule?

Each mutant in `tools/mutants.toml` is a one-line change to eqxpar's parallel code: a
collective dropped (replaced by the identity), doubled or over the wrong axis, or an
off-by-one in a pipeline schedule, a mask or a shard index. For each, this script applies
the change to a private copy of the project, runs the mutant's covering tests (a narrow
selection) the way `make test` runs them (default hypothesis profile), and reports:

    caught      12.3s  dp-grad-psum-dropped: data parallelism: the gradient psum dropped
    SURVIVED    95.0s  ring-contiguous-branch-reversed: ...
    32 mutants: 31 caught, 1 survived

A mutant is *caught* only if a test fails (pytest exit status 1). A mutant whose file no
longer compiles, or whose run cannot even collect the tests, is an ERROR, reported apart;
so is a run that passes its time limit. The script exits 1 if any mutant survived or
errored, 2 if the setup is wrong (a mutant's original text is not found exactly once, or
the unmutated selection fails), 0 otherwise. It is not part of `make test`.

Usage (from the repository root):

    make mutants                          # every mutant (tens of minutes on two cores)
    make mutants ONLY=ring-perm-reversed  # one mutant (comma-separate several)
    .venv/bin/python tools/mutants.py --list
    .venv/bin/python tools/mutants.py --only dp-grad-psum-dropped,fsdp-copied-on-every-axis
    .venv/bin/python tools/mutants.py --ref HEAD   # mutate the committed tree, not the working tree

How it works:

1. Copies `eqxpar/`, `tests/`, `recipes/`, `docs/`, `benchmarks/` and the top-level files
   the tests read (from the working tree, or with `--ref` from a git commit) to a temporary
   directory, without `__pycache__`; the tests run there with `PYTHONPATH` pointing at the
   copy, and a small pytest plugin checks that `eqxpar` is imported from the copy, not
   from the editable install of the repository (the run stops if it is not). The
   repository itself is never modified.
2. Checks every mutant: its `original` text occurs exactly once in its file, and the
   mutated file still compiles.
3. Runs the union of the selected mutants' tests once, unmutated: they must pass, or a
   broken test would count as a kill.
4. For each mutant: writes the mutated file into the copy, runs
   `pytest -x -q -p no:cacheprovider <tests>` there, and writes the original back.

Adding a mutant: append a `[[mutant]]` table to `tools/mutants.toml` with `name`, `file`,
`original` (exact text, found exactly once in the file), `replacement`, `description` and
`tests` (pytest arguments: node ids, or a file with `-k EXPR`). Keep `tests` narrow: a
mutant should run in a minute or two. Check the new mutant with `--only NAME`: a mutant
that survives needs a test that catches it (or a note on why it cannot be caught).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS_FILE = Path(__file__).resolve().with_name("mutants.toml")
# What the tests need from the repository: the package, the tests, and what they read.
COPY_DIRS = ("eqxpar", "tests", "recipes", "docs", "benchmarks")
COPY_FILES = ("pyproject.toml", "README.md", "mkdocs.yml", "Makefile")
PYTEST = ("-x", "-q", "-p", "no:cacheprovider", "-p", "_mutants_guard")
GUARD = '''"""Loaded by tools/mutants.py: the tests must import eqxpar from the mutated copy."""
import os
import pathlib

import eqxpar

_copy = pathlib.Path(os.environ["EQXPAR_MUTANTS_COPY"]).resolve()
_file = pathlib.Path(eqxpar.__file__).resolve()
pathlib.Path(os.environ["EQXPAR_MUTANTS_IMPORTED"]).write_text(str(_file))
if _copy not in _file.parents:
    raise SystemExit(f"tools/mutants.py: eqxpar was imported from {_file}, not from the copy {_copy}")
'''


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    original: str
    replacement: str
    description: str
    tests: tuple[str, ...]


def load_mutants(path: Path = MUTANTS_FILE) -> list[Mutant]:
    with open(path, "rb") as f:
        table = tomllib.load(f)
    mutants = []
    for entry in table["mutant"]:
        tests = entry["tests"]
        tests = tuple([tests] if isinstance(tests, str) else tests)
        fields = (entry["name"], entry["file"], entry["original"], entry["replacement"], entry["description"])
        mutants.append(Mutant(*fields, tests))
    names = [m.name for m in mutants]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SystemExit(f"tools/mutants.py: duplicate mutant names in {path.name}: {dupes}")
    return mutants


def make_copy(dest: Path, ref: str | None) -> None:
    """The project's files the tests need, from the working tree or from git commit `ref`."""
    if ref is None:
        ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", ".pytest_cache")
        for d in COPY_DIRS:
            if (ROOT / d).is_dir():
                shutil.copytree(ROOT / d, dest / d, ignore=ignore)
        for f in COPY_FILES:
            if (ROOT / f).is_file():
                shutil.copy2(ROOT / f, dest / f)
        return

    def in_ref(p: str) -> bool:
        return subprocess.run(["git", "cat-file", "-e", f"{ref}:{p}"], cwd=ROOT, capture_output=True).returncode == 0

    paths = [p for p in (*COPY_DIRS, *COPY_FILES) if in_ref(p)]
    archive = subprocess.run(["git", "archive", "--format=tar", ref, *paths], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def mutated_text(mutant: Mutant, copy: Path) -> tuple[str, str]:
    """The file's original and mutated text; raises ValueError if the mutant does not apply."""
    path = copy / mutant.file
    if not path.is_file():
        raise ValueError(f"{mutant.file} does not exist")
    text = path.read_text()
    count = text.count(mutant.original)
    if count != 1:
        raise ValueError(f"the original text occurs {count} times in {mutant.file} (must be exactly once)")
    if mutant.replacement == mutant.original:
        raise ValueError("the replacement is the original text")
    new = text.replace(mutant.original, mutant.replacement)
    try:
        compile(new, str(path), "exec")
    except SyntaxError as e:
        raise ValueError(f"the mutated {mutant.file} does not compile: {e}") from None
    return text, new


def run_pytest(copy: Path, args: list[str], timeout: float) -> tuple[int | None, str, float]:
    """pytest in the copy: (exit status or None on timeout, output, seconds)."""
    imported = copy / ".mutants_imported"
    imported.unlink(missing_ok=True)
    shutil.rmtree(copy / ".hypothesis", ignore_errors=True)  # no examples carried between runs
    env = {k: v for k, v in os.environ.items() if k not in ("HYPOTHESIS_PROFILE", "PYTEST_ADDOPTS", "PYTHONPATH")}
    env.update(
        PYTHONPATH=str(copy),
        PYTHONDONTWRITEBYTECODE="1",
        EQXPAR_MUTANTS_COPY=str(copy),
        EQXPAR_MUTANTS_IMPORTED=str(imported),
    )
    start = time.monotonic()
    try:
        command = [sys.executable, "-m", "pytest", *PYTEST, *args]
        proc = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout or ""
        rc, out = None, out.decode(errors="replace") if isinstance(out, bytes) else out
    seconds = time.monotonic() - start
    if imported.is_file():
        where = Path(imported.read_text())
        if copy.resolve() not in where.parents:
            raise SystemExit(f"tools/mutants.py: tests imported eqxpar from {where}, not the copy {copy}; stopping.")
    elif rc is not None:
        raise SystemExit(f"tools/mutants.py: the import guard did not run; stopping. pytest said:\n{tail(out)}")
    return rc, out, seconds


def tail(out: str, lines: int = 25) -> str:
    return "\n".join("    " + line for line in out.strip().splitlines()[-lines:])


def baseline_groups(mutants: list[Mutant]) -> list[list[str]]:
    """The selections' tests as few pytest runs: plain node ids together, `-k` selections alone."""
    plain: list[str] = []
    others: list[list[str]] = []
    for m in mutants:
        if any(a.startswith("-") for a in m.tests):
            if list(m.tests) not in others:
                others.append(list(m.tests))
        else:
            plain.extend(a for a in m.tests if a not in plain)
    return ([plain] if plain else []) + others


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[], help="only these mutants (comma-separated; may repeat)")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    parser.add_argument("--ref", default=None, help="copy this git commit instead of the working tree")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutant (and per baseline test id)")
    parser.add_argument("--skip-baseline", action="store_true", help="do not run the unmutated tests first")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy (its path is printed)")
    args = parser.parse_args(argv)

    mutants = load_mutants()
    only = [n for item in args.only for n in item.split(",") if n]
    if only:
        unknown = sorted(set(only) - {m.name for m in mutants})
        if unknown:
            print(f"tools/mutants.py: unknown mutant names {unknown}; see --list", file=sys.stderr)
            return 2
        mutants = [m for m in mutants if m.name in only]
    if args.list:
        for m in mutants:
            print(f"{m.name}  ({m.file})\n    {m.description}\n    tests: {' '.join(m.tests)}")
        print(f"{len(mutants)} mutants")
        return 0

    copy = Path(tempfile.mkdtemp(prefix="eqxpar-mutants-"))
    try:
        return run_all(mutants, copy, args)
    finally:
        if args.keep:
            print(f"copy kept at {copy}")
        else:
            shutil.rmtree(copy, ignore_errors=True)


def run_all(mutants: list[Mutant], copy: Path, args) -> int:
    started = time.monotonic()
    make_copy(copy, args.ref)
    (copy / "_mutants_guard.py").write_text(GUARD)
    print(f"copied {'the working tree' if args.ref is None else args.ref} of {ROOT} to {copy}", flush=True)

    texts: dict[str, tuple[str, str]] = {}
    bad = []
    for m in mutants:
        try:
            texts[m.name] = mutated_text(m, copy)
        except ValueError as e:
            bad.append(f"  {m.name}: {e}")
    if bad:
        print("mutants that do not apply:\n" + "\n".join(bad), file=sys.stderr)
        return 2

    if not args.skip_baseline:
        for group in baseline_groups(mutants):
            rc, out, seconds = run_pytest(copy, group, args.timeout * len(group))
            if rc != 0:
                why = "timeout" if rc is None else f"exit {rc}"
                message = f"baseline FAILED ({why}, {seconds:.0f}s): the unmutated tests must pass first."
                print(f"{message}\n  tests: {' '.join(group)}\n{tail(out)}", file=sys.stderr)
                return 2
            print(f"baseline  {seconds:6.1f}s  passed: {' '.join(group)}", flush=True)

    caught = survived = errors = 0
    for m in mutants:
        original, new = texts[m.name]
        path = copy / m.file
        path.write_text(new)
        try:
            rc, out, seconds = run_pytest(copy, list(m.tests), args.timeout)
        finally:
            path.write_text(original)
        if rc == 1:
            caught += 1
            status = "caught"
        elif rc == 0 and not re.search(r"\b[1-9]\d* passed", out):
            # Every covering test skipped (e.g. moved under thorough): the mutant was never
            # tested, which is not the same as surviving a test.
            errors += 1
            status = "NOT RUN"
        elif rc == 0:
            survived += 1
            status = "SURVIVED"
        else:
            errors += 1
            status = "TIMEOUT" if rc is None else f"ERROR({rc})"
        print(f"{status:9} {seconds:6.1f}s  {m.name}: {m.description}", flush=True)
        if status.startswith(("ERROR", "TIMEOUT", "NOT RUN")):
            print(tail(out), flush=True)

    summary = f"{len(mutants)} mutants: {caught} caught, {survived} survived"
    if errors:
        summary += f", {errors} errors"
    print(f"{summary} ({time.monotonic() - started:.0f}s in all)")
    return 1 if survived or errors else 0


if __name__ == "__main__":
    sys.exit(main())
