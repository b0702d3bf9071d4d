# Two commands from a fresh clone: `make demo` and `make test`. Both create .venv and fetch the default model.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install fetch bench-runtime clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: this machine carries the CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

fetch: install
	$(BIN)/batchspec fetch

demo: fetch
	$(BIN)/batchspec generate --chat --max-tokens 64 --batch-size 4 \
		--prompt "What is the capital of France?" \
		--prompt "Write a Python function that reverses a string." \
		--prompt "Give three tips for writing clear code." \
		--prompt "Explain speculative decoding in one sentence."

# pytest exits 5 when it collects nothing: that must fail CI, and it does (make propagates any non-zero code).
test: fetch
	$(BIN)/python -m pytest -q

bench-runtime: fetch
	$(BIN)/python benchmarks/runtime_vs_hf.py

clean:
	rm -rf $(VENV) build *.egg-info
