# The two commands of the README:
#   make run    set up .venv (CPU torch pinned) and run the default workflow + HTML report
#   make test   set up .venv and run the test suite
# Extra arguments: make run ARGS="--config advantages.estimator=grpo"; make test PYTEST_ARGS="-k config"
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.otbflow-installed
CORES ?= 2

.PHONY: setup run report test lint clean

setup: $(STAMP)

# torch is pinned to the CPU wheel by constraints.txt on every pip call.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $(STAMP)

run: setup
	$(VENV)/bin/snakemake --cores $(CORES) $(ARGS) < /dev/null
	$(VENV)/bin/snakemake --cores $(CORES) $(ARGS) --report results/report.html < /dev/null

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/snakemake --lint
	$(VENV)/bin/snakemake -n --cores 1 > /dev/null

clean:
	rm -rf results .snakemake
