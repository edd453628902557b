"""Install eqxpar into fresh virtual environments as the docs say, and run every recipe there.

`tests/test_recipe_extras.py` checks the same thing by reading pyproject.toml and the
installed packages' metadata, in a second; this is the slow, real check (minutes per extra
set: pip downloads and installs JAX and the rest). It is not part of `make test`.

For each extra set (default: `recipes`, the documented install line), in a new venv under a
temporary folder: `pip install -e ".[EXTRAS]"`, then every `recipes/*.py --help`, and one
run of `recipes/data_parallel.py` with `--checkpoint-dir` and `--log-dir` (orbax-checkpoint
and tensorboardX). Prints one line per check and how long the install took; exits 1 if any
check failed.

Usage (from the repository root):

    python tools/check_install.py                 # the `recipes` extra
    python tools/check_install.py recipes all     # several extra sets
    python tools/check_install.py --keep recipes  # keep the venvs (their path is printed)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, **kwargs)


def check(extras: str, where: pathlib.Path) -> list[str]:
    """The failures of one extra set's install and recipes (empty: all passed)."""
    venv = where / f"venv-{extras.replace(',', '-')}"
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    install = run([python, "-m", "pip", "install", "--quiet", "-e", f".[{extras}]"])
    print(f"[{extras}] pip install -e '.[{extras}]': exit {install.returncode}, {time.perf_counter() - started:.0f} s")
    if install.returncode:
        return [f"[{extras}] install failed: {install.stderr[-2000:]}"]
    failures = []
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for recipe in sorted((ROOT / "recipes").glob("*.py")):
        done = run([python, str(recipe), "--help"], env=env, timeout=300)
        ok = done.returncode == 0 and "usage:" in done.stdout
        print(f"[{extras}] {recipe.name} --help: {'ok' if ok else 'FAILED'}")
        if not ok:
            failures.append(f"[{extras}] {recipe.name} --help: {done.stderr.strip().splitlines()[-1:]}")
    flags = [
        "--steps",
        "3",
        "--batch-size",
        "16",
        "--width",
        "16",
        "--log-dir",
        str(where / f"logs-{extras}"),
        "--checkpoint-dir",
        str(where / f"ckpt-{extras}"),
    ]
    done = run([python, "recipes/data_parallel.py", *flags], env=env, timeout=600)
    print(f"[{extras}] data_parallel.py --checkpoint-dir --log-dir: {'ok' if done.returncode == 0 else 'FAILED'}")
    if done.returncode:
        failures.append(f"[{extras}] data_parallel.py with checkpoints and logs: {done.stderr[-2000:]}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("extras", nargs="*", default=["recipes"], help="extra sets, e.g. recipes or data,checkpoint")
    parser.add_argument("--keep", action="store_true", help="keep the virtual environments")
    args = parser.parse_args()
    where = pathlib.Path(tempfile.mkdtemp(prefix="eqxpar-install-"))
    failures = [failure for extras in args.extras for failure in check(extras, where)]
    if args.keep:
        print(f"venvs kept in {where}")
    else:
        subprocess.run(["rm", "-rf", str(where)], check=False)
    print("\n".join(failures) if failures else f"all checks passed for {', '.join(args.extras)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
