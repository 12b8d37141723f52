# Two commands do all set-up on a fresh machine with nothing but Python:
#   make demo   -- a real training run with live metrics (CUDA when present, else CPU)
#   make test   -- the test suite
#   make mutate -- a sampled mutation run (on demand; see TESTING.md)
# A torch already importable by $(PYTHON) is kept (the venv sees it); otherwise the pinned
# CPU build torch==2.13.0 is installed (an unpinned torch would pull a multi-GB CUDA build).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.batchtap-installed

.PHONY: demo test install bench mutate clean

$(STAMP): pyproject.toml Makefile
	@if [ ! -x $(BIN)/python ]; then \
	  if $(PYTHON) -c "import torch" 2>/dev/null; then \
	    echo "make: reusing the torch that $(PYTHON) already has"; \
	    $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else \
	    $(PYTHON) -m venv $(VENV); \
	  fi; \
	fi
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[demo,dev,tensorboard,postgres,plot,lightning,transformers,accelerate,pandas,mlflow,wandb,prometheus]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/batchtap demo

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python bench/overhead.py

# A sampled mutation run over the critical modules (on demand, not in CI; ~30-60 min on 2 cores).
# Pass options through MUTATE_ARGS, e.g. make mutate MUTATE_ARGS="--only pipeline/reduce.py --fraction 1".
# Results: mutants.json; what the score means and the survivors' explanations: TESTING.md.
mutate: $(STAMP)
	$(BIN)/python tools/mutate.py $(MUTATE_ARGS)

clean:
	rm -rf $(VENV) runs build *.egg-info src/*.egg-info
