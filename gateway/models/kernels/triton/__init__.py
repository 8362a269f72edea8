"""Triton kernels of the CUDA path, run by the worker process: the KV-cache store
(kv_store.py) and paged attention read through the block table (paged_attention.py), each
with its plain-torch reference in reference.py, which the tests compare them with (on the
CPU, through Triton's interpreter) and which runs where a kernel cannot compile for the
device (fallback.py).

Nothing here is imported unless the Triton attention backend is chosen
(models/layers/triton_attention.py): machines without Triton never load this package.
"""
