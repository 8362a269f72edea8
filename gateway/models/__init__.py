"""Model architectures and the registry that names them."""

from gateway.models.registry import ModelRegistry

__all__ = ["ModelRegistry"]
