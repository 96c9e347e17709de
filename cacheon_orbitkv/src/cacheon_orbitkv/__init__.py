"""OrbitKV, Cacheon's KV-cache storage backend. Skeleton: nothing is served by this release."""

from __future__ import annotations

__all__ = ["__version__"]
__version__ = "0.1.0"
