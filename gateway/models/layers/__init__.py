"""The layers the worker's models are built from: attention, linear layers (dense, packed,
quantized, tensor-parallel), norms, rotary embeddings.
"""
