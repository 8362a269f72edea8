"""The model architectures the workers build: one decoder for every generative family, and
the BERT-style encoders.
"""
