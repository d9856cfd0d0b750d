"""Storage backends. ``open_backend(url)`` picks one from the root URL."""

from .base import Backend, open_backend

__all__ = ["Backend", "open_backend"]
