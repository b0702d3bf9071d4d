"""The runtime: model configs, the native Llama/Qwen2 forward over a ragged batch, KV caches, linear kernels, dtypes,
tokenizers, sampling."""
