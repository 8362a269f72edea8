"""Building a model and loading its weights from safetensors or GGUF (worker process)."""
