"""The ``cacheon.engines`` entry point for vLLM: what ``cacheon canary vllm`` calls."""

from __future__ import annotations

from .canary import PIN, installed_version, run_canary

ENGINE = "vllm"
DEFAULT_BINDINGS: tuple[str, ...] = ()

__all__ = ["DEFAULT_BINDINGS", "ENGINE", "PIN", "installed_version", "launch_environment", "run_canary"]


def launch_environment(bindings: list[str] | tuple[str, ...]) -> dict[str, str]:
    """vLLM's connector is configured by --kv-transfer-config: it has no seam gates."""
    if bindings:
        raise ValueError(f"vllm has no seam bindings; got {list(bindings)}")
    return {}
