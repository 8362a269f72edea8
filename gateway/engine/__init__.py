"""The engine-core process: the core loop, the scheduler, the KV blocks and its sockets to
the front ends.
"""
