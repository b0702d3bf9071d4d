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

# A real side-by-side comparison on HumanEval prompts (target alone, standard SD, DSD, Tetris), then one answer.
demo: fetch
	$(BIN)/batchspec bench --dataset humaneval --num-prompts 8 --batch-size 8 --max-tokens 64 \
		--policies ar,sd,dsd,tetris -k 4 --extra 2 --out runs/demo
	$(BIN)/batchspec generate --chat --max-tokens 48 --policy tetris --draft default \
		--prompt "What is the capital of France?"

# pytest exits 5 when it collects nothing: that must fail CI, and it does (make propagates any non-zero code).
test: fetch
	$(BIN)/python -m pytest -q

bench-runtime: fetch
	$(BIN)/python benchmarks/runtime_vs_hf.py

clean:
	rm -rf $(VENV) build *.egg-info
