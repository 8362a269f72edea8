"""Model architectures and the registry that names them."""

from gateway.models.info.registry import ModelRegistry

__all__ = ["ModelRegistry"]
