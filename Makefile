# Two commands do all set-up on a fresh machine with nothing but Python:
#   make demo   -- a real training run with live metrics (CUDA when present, else CPU);
#                  installs the core and the demo's needs only (.[demo])
#   make test   -- the test suite; installs every extra the suite exercises (.[dev])
#   make mutate -- a sampled mutation run (on demand; see TESTING.md)
# A torch already importable by $(PYTHON) is kept (the venv sees it); otherwise the pinned
# CPU build torch==2.13.0 is installed (an unpinned torch would pull a multi-GB CUDA build).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# One stamp per install set: the demo's is a subset of the tests', so a venv made by `make test`
# satisfies `make demo` too (see the demo stamp's rule).
VENV_STAMP := $(VENV)/.batchtap-venv
DEMO_STAMP := $(VENV)/.batchtap-demo
TEST_STAMP := $(VENV)/.batchtap-installed

.PHONY: demo test install lint format bench mutate clean

$(VENV_STAMP):
	@if [ ! -x $(BIN)/python ]; then \
	  if $(PYTHON) -c "import torch" 2>/dev/null; then \
	    echo "make: reusing the torch that $(PYTHON) already has"; \
	    $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else \
	    $(PYTHON) -m venv $(VENV); \
	  fi; \
	fi
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	@touch $(VENV_STAMP)

$(DEMO_STAMP): $(VENV_STAMP) pyproject.toml Makefile
	@if [ -f $(TEST_STAMP) ] && [ $(TEST_STAMP) -nt pyproject.toml ] && [ $(TEST_STAMP) -nt Makefile ]; then \
	  echo "make: the test install already holds the demo's packages"; \
	else \
	  $(BIN)/python -m pip install -q -e '.[demo]'; \
	fi
	@touch $(DEMO_STAMP)

$(TEST_STAMP): $(VENV_STAMP) pyproject.toml Makefile
	$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $(TEST_STAMP)

install: $(TEST_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/batchtap demo

test: $(TEST_STAMP)
	$(BIN)/ruff format --check src tests bench tools
	$(BIN)/ruff check src tests bench tools
	$(BIN)/python -m pytest

format: $(TEST_STAMP)
	$(BIN)/ruff format src tests bench tools
	$(BIN)/ruff check --fix src tests bench tools

lint: $(TEST_STAMP)
	$(BIN)/ruff format --check src tests bench tools
	$(BIN)/ruff check src tests bench tools

bench: $(TEST_STAMP)
	$(BIN)/python bench/overhead.py

# A sampled mutation run over the critical modules (on demand, not in CI; ~30-60 min on 2 cores).
# Pass options through MUTATE_ARGS, e.g. make mutate MUTATE_ARGS="--only pipeline/chain/reduce.py --fraction 1".
# Results: mutants.json; what the score means and the survivors' explanations: TESTING.md.
mutate: $(TEST_STAMP)
	$(BIN)/python tools/mutate.py $(MUTATE_ARGS)

clean:
	rm -rf $(VENV) runs build *.egg-info src/*.egg-info
