"""The cache identity of KV pages: everything that decides a page's bytes, stated in its namespace.

Two engines share pages only when every part below is equal; a change in any part misses:

- ``model``: what computed the pages. By default ``model_fingerprint``: the revision and a digest of
  ``config.json`` and of each weight file's name, size and first and last MiB. The local path is not
  part of it, so hosts that mount one model at different paths share pages, and a fine-tune written
  over the same files does not. An explicit ``model_fingerprint`` in the adapter's config overrides it.
- ``kv_dtype``: the KV cache's element type (``fp8_e4m3`` pages never meet ``bfloat16`` ones).
- ``layout``: how the engine lays a page out in memory and how the adapter moves it (engine and
  version family, attention backend, NHD/HND/MLA, block-major or per-block dense).
- ``geometry``: per storage group its kind, window and page chunks in bytes (layers, heads, head
  size and page size all show there), plus the page size in tokens.
- ``parallel``: tensor/pipeline/context parallel sizes, and the ``rank`` whose shard the page holds.
- ``FORMAT_VERSION``: the page format (checksum and order); a new format never reads old pages.

The namespace is readable where that helps an operator (model digest, dtype, page size, rank) and
carries a digest of the rest.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

FORMAT_VERSION = 2  # 1: sum64 checksums; 2: mix64 checksums and the full identity
SAMPLE_BYTES = 1 << 20  # of each weight file: the first and the last MiB
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")


class IdentityError(ValueError):
    """A part of the cache identity is missing or malformed."""


def model_fingerprint(model: str | os.PathLike[str], revision: str | None = None) -> str:
    """A digest of what decides a model's weights: ``revision``, ``config.json``, and each weight
    file's relative name, size and first and last MiB.

    ``model`` is a local folder (what engines load from), or a hub id, which names itself with its
    revision. Reads at most 2 MiB per weight file, whatever the model's size.
    """
    h = hashlib.sha256(f"orbitkv-model-v1\x00{revision or ''}\x00".encode())
    root = Path(model)
    if not root.is_dir():
        h.update(f"id\x00{model}".encode())
        return h.hexdigest()[:32]
    config = root / "config.json"
    if config.is_file():
        h.update(b"config\x00")
        h.update(config.read_bytes())
    weights = sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not weights and not config.is_file():
        raise IdentityError(
            f"model folder {str(root)!r} holds no config.json and no weight files to identify it by; "
            "set model_fingerprint explicitly"
        )
    for path in weights:
        size = path.stat().st_size
        h.update(f"\x00weight\x00{path.relative_to(root).as_posix()}\x00{size}\x00".encode())
        with open(path, "rb") as fh:
            h.update(fh.read(SAMPLE_BYTES))
            if size > SAMPLE_BYTES:
                fh.seek(max(SAMPLE_BYTES, size - SAMPLE_BYTES))
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()[:32]


Geometry = tuple[tuple[int, str, int, tuple[int, ...]], ...]


def _geometry(groups: Iterable[Sequence[Any]]) -> Geometry:
    return tuple((int(g), str(k), int(w), tuple(int(c) for c in cs)) for g, k, w, cs in groups)


def _parallel(items: Iterable[Sequence[Any]]) -> tuple[tuple[str, int], ...]:
    return tuple((str(k), int(v)) for k, v in items)


def _part(name: str, value: str) -> str:
    if not value or ":" in value:
        raise IdentityError(f"cache identity {name} {value!r} must be non-empty and contain no ':'")
    return value


@attrs.frozen
class CacheIdentity:
    """One engine rank's cache identity; ``namespace`` is the manager's key prefix for its pages."""

    model: str = attrs.field(validator=attrs.validators.instance_of(str))
    kv_dtype: str = attrs.field(validator=attrs.validators.instance_of(str))
    layout: str = attrs.field(validator=attrs.validators.instance_of(str))
    page_size: int = attrs.field(validator=attrs.validators.instance_of(int))
    # (storage group, kind, window, page chunk sizes in bytes), one per group
    geometry: Geometry = attrs.field(converter=_geometry)
    parallel: tuple[tuple[str, int], ...] = attrs.field(converter=_parallel)
    rank: int = attrs.field(validator=attrs.validators.instance_of(int))
    format: int = FORMAT_VERSION

    def __attrs_post_init__(self) -> None:
        _part("model", self.model)
        _part("kv_dtype", self.kv_dtype)
        _part("layout", self.layout)
        if self.page_size <= 0 or self.rank < 0:
            raise IdentityError(f"page size {self.page_size} must be positive and rank {self.rank} non-negative")
        for _, _, _, chunks in self.geometry:
            if not chunks or any(c <= 0 for c in chunks):
                raise IdentityError(f"geometry {self.geometry!r}: every group needs positive page chunks")

    @property
    def digest(self) -> str:
        """A digest of the layout, geometry, parallel sizes and format: the parts too long to spell."""
        text = json.dumps([self.layout, self.page_size, self.geometry, self.parallel, self.format])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def namespace(self) -> str:
        return f"{self.model}:{self.kv_dtype}:{self.digest}:p{self.page_size}:r{self.rank}:v{self.format}"

    def page_bytes(self, group: int) -> int:
        """The length every page of ``group`` must have: a leased page of any other length is a miss."""
        for g, _, _, chunks in self.geometry:
            if g == group:
                return sum(chunks)
        raise IdentityError(f"group {group} is not part of this identity (groups {[g[0] for g in self.geometry]})")


def geometry_of(groups: Sequence[tuple[int, str, int]], chunks: dict[int, Sequence[int]]) -> list[Any]:
    """``CacheIdentity.geometry`` from contract groups ``(group, kind, window)`` and per group its chunks."""
    return [(g, kind, window, tuple(chunks[g])) for g, kind, window in groups]
