"""test_linker's restore into poisoned destinations, on a CUDA device (marked ``gpu``).

The same test, SGLang's same pools (on the GPU), tree, scheduler pieces and a real manager process;
the linker then runs its CUDA path: the arena registered with CUDA, restores on its load stream
through cacheon_orbitkv's Triton or copy-engine transfers, saves gated on SGLang's offload-ready
events. Run alone on the GPU host (``absent_sgl_kernel`` must be installed before SGLang imports).
"""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    from tests.sglang import absent_sgl_kernel

    absent_sgl_kernel.install(strict=os.environ.get("ABSENT_SGL_KERNEL") != "any")

from tests.sglang import sglang_cache as sc
from tests.sglang import sglang_cuda, test_linker

pytestmark = pytest.mark.gpu


@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.setattr(sc, "DEVICE", "cuda")
    monkeypatch.setattr(sc, "Scheduler", sglang_cuda.DeviceScheduler)


@pytest.mark.parametrize("kind", ["mha", "swa", "mamba"])
def test_poisoned_cuda_destinations_are_restored_exactly_and_nothing_else_is_written(kind, manager_factory, on_cuda):
    test_linker.test_poisoned_destinations_are_restored_exactly_and_nothing_else_is_written(kind, manager_factory)
