"""KEN: semantic SQL served by model cascades."""

from ken.errors import KenError

__all__ = ["KenError"]
__version__ = "0.1.0"
