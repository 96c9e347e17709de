"""Cacheon's seam into SGLang 0.5.23.

Importing this package is light (no torch, no sglang). The adapter table is ``seams``; the
bootstrap (``bootstrap``, run from ``cacheon_sglang.pth``) and SGLang's plugin entry point
(``plugin.load``) both activate the seam (``seam``); ``canary`` checks the table against an SGLang
source tree.
"""

from __future__ import annotations

from .seams import SEAM_ADAPTERS, SEAM_BINDINGS, SGLANG_PIN, WATCHED_MODULES, SeamRow

__all__ = ["SEAM_ADAPTERS", "SEAM_BINDINGS", "SGLANG_PIN", "WATCHED_MODULES", "SeamRow", "__version__"]
__version__ = "0.1.0"
