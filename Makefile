# One command to set up and run, one to set up and test. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
CHECKPOINT ?= kipp-synthetic/qwen3-tiny
SCHEME ?= bf16
BACKEND ?= auto
PROMPT ?= The Qwen3 family of language models
MAX_TOKENS ?= 32

.PHONY: run test test-slow metal-tools

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e .
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $@

# The main job: generate text. The first run makes the checkpoint's artifact (synthesize or
# download the pinned revision, then convert) under $$KIPP_HOME (default ~/.cache/kipp).
run: $(VENV)/.base
	$(VENV)/bin/kipp run $(CHECKPOINT) --scheme $(SCHEME) --backend $(BACKEND) \
		--prompt "$(PROMPT)" --max-tokens $(MAX_TOKENS) --temperature 0

test: $(VENV)/.dev metal-tools
	$(VENV)/bin/pytest

test-slow: $(VENV)/.dev metal-tools
	$(VENV)/bin/pytest -m slow

# The Metal emulator (tools/metal_emulator) compiles Kipp's kernels with g++ and checks Metal's
# address spaces with clang-19: Debian packages, installed here when missing (CI runs as root
# on Debian); elsewhere the emulator's tests name what is missing.
metal-tools:
	@if ! command -v g++ >/dev/null 2>&1 || ! command -v clang++-19 >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ clang-19 >/dev/null; \
	  else \
	    echo "make: the Metal emulator wants g++ and clang++-19 (apt-get install g++ clang-19)" >&2; \
	  fi; \
	fi
