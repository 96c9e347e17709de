"""Example Cacheon slot plugin.

RMSNorm, fused add + RMSNorm and MoE finalize in torch and Triton; decode attention, fused experts,
the TP all-reduce and all-reduce + add + RMSNorm in torch.
"""

from __future__ import annotations

__all__ = ["__version__"]
__version__ = "0.1.0"
