"""The ``cacheon.engines`` entry point for SGLang: what ``cacheon canary`` and ``cacheon env`` call."""

from __future__ import annotations

from cacheon_core import CanaryRow

from .canary import PIN, installed_version, run_canary
from .seam import VOCABULARY
from .seams import DEFAULT_BINDINGS

ENGINE = "sglang"

__all__ = [
    "DEFAULT_BINDINGS",
    "ENGINE",
    "PIN",
    "VOCABULARY",
    "CanaryRow",
    "installed_version",
    "launch_environment",
    "run_canary",
]


def launch_environment(bindings: list[str] | tuple[str, ...]) -> dict[str, str]:
    """The complete seam environment for a launch: every gate, ``1`` for the selected bindings."""
    return VOCABULARY.launch_environment(bindings)
