"""Model implementations; look one up by HF architecture name with `get_model_class`."""

from engine.models.registry import get_model_class, supported_architectures

__all__ = ["get_model_class", "supported_architectures"]
