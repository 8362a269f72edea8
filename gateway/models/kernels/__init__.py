"""The models' kernels (worker process): one file per concern and device, each beside the
plain torch reference it is tested against.
"""
