"""The record every engine package's compatibility canary reports, one per checked chokepoint."""

from __future__ import annotations

from typing import Literal

import attrs

CanaryStatus = Literal["pass", "break", "unassessable"]


@attrs.frozen
class CanaryRow:
    """One checked chokepoint: ``static`` is the source check, ``imported`` the import check (or why none ran)."""

    row: str
    module: str
    target: str
    status: CanaryStatus
    static: str
    imported: str
    reason: str | None = None
