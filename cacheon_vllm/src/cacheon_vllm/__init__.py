"""The OrbitKV KV connector for vLLM. Skeleton: no connector is registered by this release."""

from __future__ import annotations

__all__ = ["__version__"]
__version__ = "0.1.0"
