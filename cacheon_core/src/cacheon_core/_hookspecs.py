"""Every hook a Cacheon plugin can implement, grouped by lifecycle.

A distribution announces itself with an entry point in the group ``cacheon`` that names a module
or object carrying functions marked ``@cacheon_core.hookimpl``. None of these hooks is
``firstresult`` or historic: Cacheon calls each plugin's implementation on its own, so that a
failure is attributed to the distribution that caused it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import attrs
import pluggy

if TYPE_CHECKING:
    from ._slots import SlotSpec, Variant

PROJECT = "cacheon"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@attrs.frozen
class SeamAdapter:
    """A live chokepoint an engine package exposes for a slot (one row of its adapter table).

    ``binding`` is the public binding identifier whose gate arms the adapter; several rows may
    share one binding when they implement one semantic product. ``requires`` lists packages an
    optional row needs; without them the row is not assessable.
    """

    engine: str
    slot: str
    binding: str
    module: str
    target: str
    requires: tuple[str, ...] = ()


class CacheonSpec:
    """Hook specifications of the ``cacheon`` project."""

    # -- contributions: called at discovery, in every process that loads plugins ---------------

    @hookspec
    def cacheon_slots(self) -> Iterable[SlotSpec]:
        """Slot contracts this plugin defines (new semantic operations).

        Called once per discovery. A slot id already defined by another plugin is a load failure
        of the later plugin. Not firstresult.
        """
        raise NotImplementedError

    @hookspec
    def cacheon_variants(self) -> Iterable[Variant]:
        """Implementations this plugin contributes for existing slots.

        Called once per discovery, and only in processes allowed to load candidate code (a
        scheduler, or a tool such as ``cacheon verify``). Each variant's signature is checked
        against its slot's contract; one invalid variant fails the whole plugin. Not firstresult.
        """
        raise NotImplementedError

    # -- engine seams ---------------------------------------------------------------------------

    @hookspec
    def cacheon_seam_adapters(self) -> Iterable[SeamAdapter]:
        """Rows of an engine package's adapter table: the live chokepoints it exposes.

        Called by ``cacheon slots`` and by binding-vocabulary construction. Not firstresult.
        """
        raise NotImplementedError
