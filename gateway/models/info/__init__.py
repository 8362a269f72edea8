"""Model files and configs that both sides read (any process, torch-free): paths, repo ids,
GGUF metadata, decoder configs and support checks.
"""
