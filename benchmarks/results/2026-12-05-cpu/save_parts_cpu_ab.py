"""save_parts on the CPU, overhead-bound: 24 parts of 9 pages of 8 KiB (2 layers x K and V of 2 KiB) through
a real manager, 300 calls, median of the last 250. Run with one version of cacheon-orbitkv importable, e.g.
PYTHONPATH=<checkout of 1521cc4>/cacheon_orbitkv/src:<same>/cacheon_core/src python save_parts_cpu_ab.py
against the installed package, by turns (results in save_parts_cpu_ab.txt)."""

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import cacheon_orbitkv
from cacheon_orbitkv.link import ManagerLink, SavePart, save_parts
from cacheon_orbitkv.transfer import GroupLayout, segment_view

print(cacheon_orbitkv.__file__)
tmp = Path(tempfile.mkdtemp())
sock = tmp / "m.sock"
proc = subprocess.Popen(
    [sys.executable, "-m", "cacheon_orbitkv.manager", "--addr", f"unix://{sock}", "--pool-size", "1gb"],
    stdout=subprocess.PIPE,
    text=True,
)
assert proc.stdout.readline().startswith("ready")
link = ManagerLink(f"unix://{sock}", "mb")
layers = [torch.randint(0, 256, (2, 256, 2048), dtype=torch.uint8) for _ in range(2)]
layout = GroupLayout([segment_view(kv[i]) for kv in layers for i in (0, 1)])
times = []
with link.session() as (client, arena):
    for _ in range(300):
        parts = [
            SavePart(
                "ns:x:y:p1:r0",
                0,
                layout,
                [os.urandom(16) for _ in range(9)],
                list(range(9 * (p % 20), 9 * (p % 20) + 9)),
                "",
                p,
            )
            for p in range(24)
        ]
        t = time.perf_counter()
        out = save_parts(client, arena, parts)
        times.append(time.perf_counter() - t)
        assert all(isinstance(o, int) for o in out)

print(f"median {statistics.median(times[50:]) * 1e3:.3f} ms per 24-part save_parts")
link.close()
proc.terminate()
