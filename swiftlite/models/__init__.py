"""Models: the registry of known models, building the offline demo models, and loading."""
from swiftlite.models.registry import MODELS, ModelInfo, resolve_model

__all__ = ["MODELS", "ModelInfo", "resolve_model"]
