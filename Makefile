# Alnair's two entry points (see README):
#   make up    start the one-machine cluster (embedded NATS, a brain, node agents)
#   make test  lint, type-check and run the whole test suite
# Each creates or updates the project-local virtual environment (.venv) first;
# nothing is reinstalled unless pyproject.toml, this file or the Horovod build
# script changed. The Horovod wheel is built once and cached outside the clone
# (infra/build_horovod.sh says where and how it is keyed).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.alnair-installed
# The CPU build: a looser spec pulls several GB of CUDA packages.
TORCH_SPEC := torch==2.13.0

SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: up test lint pytest venv chromium

up: $(STAMP)
	$(BIN)/alnair up $(ARGS)

test: lint pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

pytest: $(STAMP) chromium
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The dashboard test drives Debian's headless Chromium. Best effort: where it cannot be
# installed, that one test says so and skips.
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium >/dev/null; } || \
	  echo "chromium could not be installed; the dashboard test will skip"

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile infra/build_horovod.sh
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Alnair needs Python 3.11 or newer; set PYTHON=python3.11 (or newer)")'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	dir="$$(infra/build_horovod.sh $(BIN)/python)" && \
	  $(BIN)/python -m pip install -q --disable-pip-version-check --find-links "$$dir" -e '.[dev,train]'
	@touch $@
