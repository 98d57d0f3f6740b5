# One command to set up and run, one to set up and test. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
CHECKPOINT ?= kipp-synthetic/qwen3-tiny
SCHEME ?= bf16

.PHONY: run test test-slow

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e .
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $@

# The main job. Until the engine generates text, it prepares the checkpoint's artifact:
# synthesize (or download) the Hugging Face folder, convert it, validate and summarise it.
run: $(VENV)/.base
	$(VENV)/bin/kipp prepare $(CHECKPOINT) --scheme $(SCHEME)

test: $(VENV)/.dev
	$(VENV)/bin/pytest

test-slow: $(VENV)/.dev
	$(VENV)/bin/pytest -m slow
