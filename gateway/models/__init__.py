"""Model architectures and the registry that names them (read by the API server's support
checks and by the workers, which build the model).
"""

from gateway.models.info.registry import ModelRegistry

__all__ = ["ModelRegistry"]
