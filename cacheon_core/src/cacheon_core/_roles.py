"""Process roles and the closed binding vocabulary.

A role is a fact about one process, never inherited through the environment: the driver marks
itself before importing the engine, a scheduler marks itself when it positively enters the
engine's scheduler loop, and every other process stays ``other``. Only a scheduler may load
candidate code.

Bindings are the public identifiers of engine seam adapters. A controller selects a set of them;
the launch environment then carries every gate of the vocabulary explicitly ("1" or "0"), so a
stale ambient value can never arm an adapter nobody selected.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping

import attrs

from ._errors import BindingError

_CANONICAL = re.compile(r"^[a-z][a-z0-9_]{0,62}$")


class Role(str, enum.Enum):
    DRIVER = "driver"
    SCHEDULER = "scheduler"
    OTHER = "other"


_role = Role.OTHER


def current_role() -> Role:
    return _role


def mark_role(role: Role) -> None:
    """Mark this process. A scheduler stays a scheduler: no process changes role after entry."""
    global _role
    if _role is Role.SCHEDULER and role is not Role.SCHEDULER:
        raise RuntimeError(f"this process entered the scheduler; it cannot become {role.value}")
    _role = Role(role)


def gate_name(binding: str) -> str:
    return f"CACHEON_BIND_{binding.upper()}"


def _names(names: Iterable[str]) -> frozenset[str]:
    return frozenset(names)


@attrs.frozen
class BindingVocabulary:
    """A closed set of binding identifiers, each with one fixed environment gate."""

    bindings: frozenset[str] = attrs.field(converter=_names)

    def __attrs_post_init__(self) -> None:
        for name in self.bindings:
            if not _CANONICAL.fullmatch(name):
                raise BindingError(
                    f"binding {name!r} is not canonical: lowercase [a-z][a-z0-9_]*, 63 characters at most"
                )

    @property
    def gates(self) -> Mapping[str, str]:
        return {name: gate_name(name) for name in sorted(self.bindings)}

    def normalize(self, selected: Iterable[str]) -> tuple[str, ...]:
        """The sorted tuple of ``selected``; unknown, duplicated or non-canonical names raise."""
        seen: set[str] = set()
        for name in selected:
            if not isinstance(name, str) or not _CANONICAL.fullmatch(name):
                raise BindingError(f"binding {name!r} is not canonical: lowercase [a-z][a-z0-9_]*")
            if name not in self.bindings:
                raise BindingError(f"binding {name!r} is unknown; the vocabulary is {sorted(self.bindings)}")
            if name in seen:
                raise BindingError(f"binding {name!r} is selected more than once")
            seen.add(name)
        return tuple(sorted(seen))

    def parse(self, text: str) -> tuple[str, ...]:
        """Parse the wire form: names joined by commas, already sorted, nothing else."""
        names = tuple(text.split(",")) if text else ()
        normalized = self.normalize(names)
        if names != normalized:
            raise BindingError(f"binding set {text!r} is not canonical: expected {','.join(normalized)!r}")
        return normalized

    def launch_environment(self, selected: Iterable[str]) -> dict[str, str]:
        """Every gate of the vocabulary, "1" for the selected bindings and "0" for the rest."""
        chosen = set(self.normalize(selected))
        return {gate: "1" if name in chosen else "0" for name, gate in self.gates.items()}

    def armed(self, environ: Mapping[str, str]) -> tuple[str, ...]:
        """The bindings an environment arms. Every gate must be present and exactly "0" or "1"."""
        armed = []
        for name, gate in self.gates.items():
            value = environ.get(gate)
            if value not in ("0", "1"):
                raise BindingError(f"gate {gate}={value!r}: the launch environment must set every gate to '0' or '1'")
            if value == "1":
                armed.append(name)
        return tuple(armed)
