"""Structured outputs in the engine core: grammar compilation, matchers and token masks."""
