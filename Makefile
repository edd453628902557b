# Two commands for a newcomer: `make demo` runs the main recipe, `make test` runs the suite.
# Both create .venv and install eqxpar with its extras on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The most complete recipe so far: the project's main job.
DEMO ?= hybrid_gpt

.PHONY: demo test test-thorough docs docs-serve bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[all]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) recipes/$(DEMO).py

test: $(STAMP)
	$(PY) -m pytest -q

test-thorough: $(STAMP)
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -q

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: $(STAMP)
	$(VENV)/bin/mkdocs serve

bench: $(STAMP)
	for f in benchmarks/*.py; do $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) site .pytest_cache .hypothesis
