"""The worker processes (or the engine core, with one device): the model runner, the sampler,
the logits processors and the ranks' collectives.
"""
