"""Appending a benchmark's table to BENCHMARKS.md with the date, the machine and the exact command."""

from __future__ import annotations

import datetime as dt
import os
import platform
import sys


def machine(extra: str = "") -> str:
    text = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    return f"{text}, {extra}" if extra else text


def append(path: str, title: str, table: str, note: str = "", extra_machine: str = "") -> None:
    """Append ``table`` under ``### title, <date>``, naming the machine and the command that made it."""
    script = os.path.relpath(sys.argv[0])
    command = " ".join(["python", script, *sys.argv[1:]])
    with open(path, "a") as fh:
        fh.write(
            f"\n### {title}, {dt.date.today().isoformat()}\n\nMachine: {machine(extra_machine)}. "
            f"Command: `{command}` (run by `nox -s bench`).{' ' + note if note else ''}\n\n{table}\n"
        )
