"""The ``sglang.srt.plugins`` entry point: SGLang's own plugin loader runs this in every process.

``load_plugins()`` is the first statement of ``run_scheduler_process``, so when this runs inside
it (the bootstrap's gate not in place, e.g. ``CACHEON_SGLANG_BOOTSTRAP=0``), the scheduler's
frame on the stack is the positive observation of entry. Everywhere else it only installs the
bootstrap for later imports and activates the pass-through adapters. Safe to run together with
the ``.pth`` bootstrap: every install refuses to patch twice.
"""

from __future__ import annotations

import sys
from types import FrameType

from . import bootstrap, seam
from .integrations import scheduler_gate


def load() -> None:
    seam.STATE.entry_point_ran = True
    bootstrap.install()
    seam.activate()
    code = scheduler_gate.original_code()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and code is not None:
        if frame.f_code is code:
            server_args = frame.f_locals.get("server_args")
            seam.enter_scheduler(
                tp_rank=int(frame.f_locals.get("tp_rank") or 0),
                tp_size=int(getattr(server_args, "tp_size", 1) or 1),
                dp_rank=frame.f_locals.get("dp_rank"),
            )
            break
        frame = frame.f_back
