"""Prompt sources: HumanEval (the held-out benchmark), JSONL, ShareGPT and plain-text files."""
