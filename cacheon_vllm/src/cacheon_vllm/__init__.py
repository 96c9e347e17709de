"""The OrbitKV KV connector for vLLM (``OrbitKVConnector``), registered through ``vllm.general_plugins``."""

from __future__ import annotations

__all__ = ["__version__"]
__version__ = "0.1.0"
