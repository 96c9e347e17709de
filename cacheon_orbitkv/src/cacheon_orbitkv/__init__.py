"""OrbitKV, Cacheon's KV-cache storage backend.

``contract`` (the compiled hybrid recovery contract) is built; the cache manager, client and
transfers are not yet.
"""

from __future__ import annotations

__all__ = ["__version__"]
__version__ = "0.1.0"
