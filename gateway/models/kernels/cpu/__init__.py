"""The gateway's CPU kernels, run in the worker: C files here, one per concern, built into
one library (library.py), each wrapped by the Python module of its name (quant_matmul.c
and dequantize.c by quant_weight.py), which falls back to torch where the library cannot
run."""
