"""Cacheon's seam into SGLang 0.5.23. Skeleton: no adapter is installed by this release."""

from __future__ import annotations

__all__ = ["SGLANG_PIN", "__version__"]
__version__ = "0.1.0"
SGLANG_PIN = "0.5.23"
