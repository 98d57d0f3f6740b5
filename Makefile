# One command to set up and run, one to set up and test. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
CHECKPOINT ?= kipp-synthetic/qwen3-tiny
SCHEME ?= bf16
BACKEND ?= auto
PROMPT ?= The Qwen3 family of language models
MAX_TOKENS ?= 32

# A second line of JAX: the GPU machine's jax 0.11 needs Python >= 3.12 (this venv runs the
# kernel and JAX-backend tests there; the default venv has jax 0.10 on Python 3.11).
# (pyenv's python3.12 shim refuses while 3.11 is pyenv's global version: take the binary)
PYTHON_NEXT ?= $(firstword $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12) python3.12)
VENV_NEXT ?= .venv312
JAX_NEXT ?= 0.11.2
JAX_TESTS ?= tests/test_jax_kernels.py tests/test_jax_backend.py tests/test_jax_sharding.py \
	tests/test_cuda_compile.py tests/test_cpu_matmul.py tests/test_cpu_attention.py \
	tests/test_weight_memory.py

.PHONY: run test test-slow test-jax-next metal-tools agent-clients

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e .
	touch $@

# The dev extra is large (torch, jax, transformers, mlx[cpu], ...): pip shows what it fetches.
$(VENV)/.dev: $(VENV)/.base
	@echo "make: installing the dev extra into $(VENV) (the first time: ~170 packages, 2.8 GiB installed)"
	$(VENV)/bin/pip install --progress-bar on -e '.[dev]'
	touch $@

# The main job: generate text. The first run makes the checkpoint's artifact (synthesize or
# download the pinned revision, then convert) under $$KIPP_HOME (default ~/.cache/kipp).
run: $(VENV)/.base
	$(VENV)/bin/kipp run $(CHECKPOINT) --scheme $(SCHEME) --backend $(BACKEND) \
		--prompt "$(PROMPT)" --max-tokens $(MAX_TOKENS) --temperature 0

# Two workers, each taking whole files (module fixtures are built once): most tests are short
# single-threaded evals, so two cores take about a third off the suite's one-worker time.
TEST_WORKERS ?= 2
test: $(VENV)/.dev metal-tools
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile

# The slow set includes the agent CLIs' turns (tests/test_agent_clients.py), so it installs them.
test-slow: $(VENV)/.dev metal-tools agent-clients
	KIPP_REQUIRE_AGENTS=1 $(VENV)/bin/pytest -m slow

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

$(VENV_NEXT)/.jax-tests: pyproject.toml
	$(PYTHON_NEXT) -m venv $(VENV_NEXT)
	$(VENV_NEXT)/bin/pip install --quiet --upgrade pip
	$(VENV_NEXT)/bin/pip install --quiet -e '.[jax-tests]' 'jax==$(JAX_NEXT)'
	touch $@

test-jax-next: $(VENV_NEXT)/.jax-tests
	$(VENV_NEXT)/bin/pytest -n $(TEST_WORKERS) --dist loadfile $(JAX_TESTS)

# The agent CLIs that tests/agent_clients.py drives against a loopback `kipp serve`: npm
# packages at pinned versions under $(AGENTS) (git-ignored, no package.json), once per version
# pair. Claude Code's postinstall puts its native binary in place (its node>=22 engine warning
# is harmless: that binary needs no Node); Codex's launcher runs on Node 20. The version check
# runs in a throwaway home (any codex command writes $CODEX_HOME/tmp).
AGENTS ?= .agents
CODEX_VERSION ?= 0.169.0
CLAUDE_CODE_VERSION ?= 2.1.332
AGENTS_STAMP = $(AGENTS)/.codex-$(CODEX_VERSION)-claude-code-$(CLAUDE_CODE_VERSION)

$(AGENTS_STAMP):
	@command -v npm >/dev/null 2>&1 || { echo "make: agent-clients needs npm (Node 20+)" >&2; exit 1; }
	npm install --prefix $(AGENTS) --no-save --no-package-lock --no-audit --no-fund \
		@openai/codex@$(CODEX_VERSION) @anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION)
	@home=$$(mktemp -d) && trap 'rm -rf "$$home"' EXIT && export HOME=$$home CODEX_HOME=$$home && \
	  $(AGENTS)/node_modules/.bin/codex --version && $(AGENTS)/node_modules/.bin/claude --version
	touch $@

agent-clients: $(AGENTS_STAMP)
