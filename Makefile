# One command to set up and run, one to set up and test. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
CHECKPOINT ?= kipp-synthetic/qwen3-tiny
SCHEME ?= bf16
BACKEND ?= auto
PROMPT ?= The Qwen3 family of language models
MAX_TOKENS ?= 32

.PHONY: run test test-slow

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e .
	touch $@

# The dev extra is large (torch, jax, transformers, mlx[cpu], ...): pip shows what it fetches.
$(VENV)/.dev: $(VENV)/.base
	@echo "make: installing the dev extra into $(VENV) (the first time: ~0.4 GB of wheels, 2 GB installed)"
	$(VENV)/bin/pip install --progress-bar on -e '.[dev]'
	touch $@

# The main job: generate text. The first run makes the checkpoint's artifact (synthesize or
# download the pinned revision, then convert) under $$KIPP_HOME (default ~/.cache/kipp).
run: $(VENV)/.base
	$(VENV)/bin/kipp run $(CHECKPOINT) --scheme $(SCHEME) --backend $(BACKEND) \
		--prompt "$(PROMPT)" --max-tokens $(MAX_TOKENS) --temperature 0

test: $(VENV)/.dev
	$(VENV)/bin/pytest

test-slow: $(VENV)/.dev
	$(VENV)/bin/pytest -m slow
