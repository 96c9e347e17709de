"""OrbitKV, Cacheon's KV-cache storage backend.

``contract`` (the compiled hybrid recovery contract), ``identity`` (the cache identity), the cache
manager (``manager``: ``arena``, ``pages``, ``server``, ``cli``), its client (``client``, ``link``)
and the page transfers (``transfer``).
"""

from __future__ import annotations

__all__ = ["__version__"]
__version__ = "0.1.0"
