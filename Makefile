# `make test` and `make demo` do all set-up on a fresh machine: they create .venv and install into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/scan_simple
# pytest-xdist workers: one more than the CI machine's 2 cores. The suite is bound by its CPU
# time, but some of its tests wait (the bucket outages, about 135 s of them on one worker): a
# third worker keeps both cores busy meanwhile (docs/benchmarks.md).
TEST_JOBS ?= 3

.PHONY: install lint test quick file-costs demo clean

install: $(VENV)/.installed

# What training, evaluation, the demo and TensorBoard need, with the tested JAX (setup.cfg's extras).
$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[cpu,tensorboard]'
	touch $@

# The test extras on top (pytest, ruff, torch and libtpu for the tests of those modes): a stamp of
# their own, so that `make test` after `make demo` adds them and `make demo` never needs them.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[cpu,test]'
	touch $@

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .

test: lint
	# Whole files per worker: a module's expensive fixture (the 8-device sharding run, the trained
	# workdirs) is then built once, not once on each worker.
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile tests

# The everyday loop: the suite without the files marked slow (tests/conftest.py: SLOW_FILE_S,
# of the measured tests/file_costs.json).
quick: lint
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile -m "not slow" tests

# The suite as `make test` runs it, writing the seconds each file took to tests/file_costs.json
# (the order in which the workers take the files, and which are slow): after tests change.
file-costs: lint
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --record-file-costs tests

demo: $(VENV)/.installed
	$(PY) launch.py --config=experiments/scan_simple.py --workdir=$(WORKDIR) --mode=train

clean:
	rm -rf $(VENV) runs build *.egg-info
