"""Example Cacheon slot plugin: RMSNorm and fused add + RMSNorm in torch and Triton."""

from __future__ import annotations

__all__ = ["__version__"]
__version__ = "0.1.0"
