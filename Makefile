# Two commands for a newcomer: `make demo` runs the main recipe, `make test` runs the suite.
# Both create .venv and install eqxpar with its extras on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The most complete recipe so far: the project's main job.
DEMO ?= hybrid_gpt

.PHONY: demo test test-thorough mutants lint docs figures docs-serve bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[all]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) recipes/$(DEMO).py

# Two worker processes (pytest-xdist), whole test files to each: compiles dominate the suite
# and XLA compiles on one thread, so two workers use both cores of a CI machine; a file's
# cached compiles stay in its worker. TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2
PYTEST_WORKERS = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_WORKERS)

test-thorough: $(STAMP)
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -q $(PYTEST_WORKERS)

# Mutation check (not part of `make test`): one-line mutants of the collectives and schedules
# (tools/mutants.toml), each run against its covering tests in a private copy; exits 1 if any
# survives. `make mutants ONLY=name[,name...]` runs some; usage in tools/mutants.py.
mutants: $(STAMP)
	$(PY) tools/mutants.py $(if $(ONLY),--only $(ONLY),)

# Lint: ruff (rules, import order and formatting; settings in pyproject.toml) over every Python
# file, then pyright in basic mode over the library (eqxpar/). Both pinned in the `lint` extra.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pyright

# The docs' pictures are drawn by docs/figures/make_figures.py (seconds, headless, offline):
# meshes, splits and collectives from real eqxpar/JAX objects on simulated CPU devices, the
# layers from the imports (architecture.py), the
# benchmark bar charts from the tables on docs/benchmarks.md, and the recipes' loss curves
# from docs/data/losses/*.json, which `make figures` rewrites by running the recipes (minutes).
docs: $(STAMP)
	MPLBACKEND=Agg $(PY) docs/figures/make_figures.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Re-run the training recipes (fewer steps than their defaults) and keep their per-step losses;
# hybrid_gpt also with --dtype float32 and bfloat16, same seed (docs/data/losses/precision/).
figures: $(STAMP)
	$(PY) docs/figures/record_losses.py data_parallel --steps 200
	$(PY) docs/figures/record_losses.py tensor_parallel --steps 150
	$(PY) docs/figures/record_losses.py hybrid_gpt --steps 150
	$(PY) docs/figures/record_losses.py --save-as precision/hybrid_gpt_float32 hybrid_gpt --steps 300 --dtype float32 --sample-chars 0
	$(PY) docs/figures/record_losses.py --save-as precision/hybrid_gpt_bfloat16 hybrid_gpt --steps 300 --dtype bfloat16 --sample-chars 0
	$(PY) docs/figures/record_losses.py fsdp --steps 150
	$(PY) docs/figures/record_losses.py your_model --steps 40
	$(PY) -m eqxpar.launch --nproc 2 --devices-per-proc 4 docs/figures/record_losses.py multihost --steps 150
	MPLBACKEND=Agg $(PY) docs/figures/make_figures.py

docs-serve: $(STAMP)
	$(VENV)/bin/mkdocs serve

bench: $(STAMP)
	for f in benchmarks/*.py; do $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) site .pytest_cache .hypothesis
