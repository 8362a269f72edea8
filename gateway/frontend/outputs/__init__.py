"""Engine outputs to responses (API-server process): detokenizing and per-request output
processing.
"""
