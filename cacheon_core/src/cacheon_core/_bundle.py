"""Sealed contribution bundles: content-addressed engine trees and verified loading.

A contribution is never put on ``sys.path``. ``build_bundle`` walks each contribution's import
closure (the package modules its plugin module reaches through relative imports), copies those
files under a namespace named by the digest of their canonical content, ``cacheon_c_<sha256>``,
and writes ``manifest.json``: every file's SHA-256, each contribution's digest, the tree digest
and the stack digest (the slots, variants and seam bindings the bundle serves). The same sources
give the same digests on any machine. ``sign_bundle`` writes ``release.json`` (the digests) and
``release.sig`` (its Ed25519 signature).

``verify_bundle`` makes every check loading would make and returns the verified file bytes;
``load_candidate_bundle`` runs it in a process marked as an engine worker (a scheduler), then
installs a meta-path finder that resolves the sealed namespaces, and nothing else, from those
verified bytes (a file swapped after verification is never executed).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import stat
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs

from ._errors import CacheonError
from ._receipts import ReceiptLog
from ._roles import Role, current_role

FORMAT = "cacheon-bundle/1"
MANIFEST = "manifest.json"
RELEASE = "release.json"
SIGNATURE = "release.sig"
NAMESPACE_PREFIX = "cacheon_c_"
DEFAULT_MOUNT = "/cacheon/engine-tree"
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class BundleError(CacheonError):
    """A bundle that cannot be built, or does not verify; the message says exactly why."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _listing_digest(domain: bytes, files: Mapping[str, str]) -> str:
    listing = "".join(f"{files[path]}  {path}\n" for path in sorted(files))
    return _sha256(domain + listing.encode())


def contribution_digest(files: Mapping[str, str]) -> str:
    """The digest of a contribution's canonical content: its relative paths and their SHA-256s."""
    return _listing_digest(b"cacheon-contribution-v1\n", files)


def tree_digest(files: Mapping[str, str]) -> str:
    """The digest of the whole tree: every namespaced file's path and SHA-256."""
    return _listing_digest(b"cacheon-tree-v1\n", files)


def _release_descriptor(manifest_bytes: bytes, manifest: Mapping[str, Any]) -> dict[str, str]:
    """What a release signs: the format and the tree, stack and manifest digests."""
    return {
        "format": FORMAT,
        "tree_digest": manifest["tree_digest"],
        "stack_digest": manifest["stack_digest"],
        "manifest_digest": _sha256(manifest_bytes),
    }


# -- build -------------------------------------------------------------------------------------


@attrs.frozen
class Source:
    """``PATH[:MODULE]``: a package folder and the plugin module in it (default: the package)."""

    package: Path
    module: str = ""

    @classmethod
    def parse(cls, text: str) -> Source:
        path, _, module = text.partition(":")
        package = Path(path)
        if not (package / "__init__.py").is_file():
            raise BundleError(f"{path}: not a package folder (no __init__.py)")
        if module and not all(part.isidentifier() for part in module.split(".")):
            raise BundleError(f"{text}: {module!r} is not a module path")
        return cls(package, module)


def _module_file(package: Path, dotted: str) -> Path | None:
    base = package.joinpath(*dotted.split(".")) if dotted else package
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    candidate = base.with_suffix(".py")
    return candidate if dotted and candidate.is_file() else None


def import_closure(source: Source) -> tuple[list[str], list[str]]:
    """The package-relative files the plugin module reaches, and the external top-level imports.

    Intra-package imports must be relative: an absolute import of the package's own name would
    escape the sealed namespace at run time, so it is refused.
    """
    name = source.package.name
    todo = [source.module]
    parts = source.module.split(".") if source.module else []
    todo += [".".join(parts[:i]) for i in range(len(parts))]  # every package on the way
    seen: dict[str, Path] = {}
    external: set[str] = set()
    while todo:
        dotted = todo.pop()
        if dotted in seen:
            continue
        path = _module_file(source.package, dotted)
        if path is None:
            raise BundleError(f"{name}: module {dotted or name!r} is imported but has no file in {source.package}")
        seen[dotted] = path
        is_package = path.name == "__init__.py"
        here = dotted.split(".") if dotted else []
        current_package = here if is_package else here[:-1]
        tree = ast.parse(path.read_bytes(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name.split(".")[0]
                    if top == name:
                        raise BundleError(
                            f"{path}: 'import {alias.name}' names the contribution's own package; "
                            "use relative imports inside a contribution"
                        )
                    external.add(top)
            elif isinstance(node, ast.ImportFrom):
                if node.level == 0:
                    top = (node.module or "").split(".")[0]
                    if top == name:
                        raise BundleError(
                            f"{path}: 'from {node.module} import ...' names the contribution's own package; "
                            "use relative imports inside a contribution"
                        )
                    if top != "__future__":
                        external.add(top)
                    continue
                if node.level - 1 > len(current_package):
                    raise BundleError(f"{path}: a relative import climbs out of the package")
                anchor = current_package[: len(current_package) - (node.level - 1)]
                target = [*anchor, *(node.module.split(".") if node.module else [])]
                for i in range(len(target) + 1):  # the packages on the way are imported too
                    todo.append(".".join(target[:i]))
                for alias in node.names:  # `from . import x` may name a submodule
                    sub = ".".join([*target, alias.name])
                    if _module_file(source.package, sub) is not None:
                        todo.append(sub)
    files = sorted(str(p.relative_to(source.package)).replace(os.sep, "/") for p in seen.values())
    return files, sorted(external - set(sys.stdlib_module_names))


def _stack(root: Path, contributions: list[dict[str, Any]]) -> dict[str, Any]:
    """What the bundle serves, read by importing each contribution from the built tree."""
    from ._plugins import discover

    verified = verify_bundle(root, check_stack=False)
    finder = SealedFinder(verified)
    sys.meta_path.insert(0, finder)
    try:
        extra = [(c["name"], finder.plugin(c)) for c in contributions]
        found = discover(load_variants=True, extra=extra, entry_points=False, environ={})
    finally:
        finder.uninstall()
    failed = [p for p in found.plugins if p.status == "load_failed"]
    if failed:
        raise BundleError("; ".join(f"{p.name}: {p.reason}" for p in failed))
    names = {c["name"] for c in contributions}
    served = []
    for report in found.plugins:
        if report.name not in names:
            continue
        served.append(
            {
                "name": report.name,
                "slots": sorted(report.slots),
                "variants": sorted([v.slot, v.name, v.slot_version, v.priority, v.graph_safe] for v in report.variants),
                "bindings": sorted({a.binding for a in report.adapters}),
            }
        )
    return {"contributions": sorted(served, key=lambda c: c["name"])}


def build_bundle(sources: Sequence[str | Source], out: str | os.PathLike[str]) -> dict[str, Any]:
    """Build an engine tree at ``out`` (which must not exist) and return its manifest."""
    root = Path(out)
    if root.exists() or root.is_symlink():
        raise BundleError(f"{root} already exists; a bundle is built into a new folder")
    parsed = [s if isinstance(s, Source) else Source.parse(s) for s in sources]
    names = [s.package.name for s in parsed]
    if len(set(names)) != len(names):
        raise BundleError(f"two contributions share a package name: {names}")
    contributions: list[dict[str, Any]] = []
    staged: dict[str, bytes] = {}
    for src in parsed:
        files, external = import_closure(src)
        contents = {rel: (src.package / rel).read_bytes() for rel in files}
        digests = {rel: _sha256(data) for rel, data in contents.items()}
        digest = contribution_digest(digests)
        namespace = NAMESPACE_PREFIX + digest
        staged.update((f"{namespace}/{rel}", data) for rel, data in contents.items())
        contributions.append(
            {
                "name": src.package.name,
                "namespace": namespace,
                "digest": digest,
                "plugin": src.module,
                "files": digests,
                "requires": external,
            }
        )
    contributions.sort(key=lambda c: str(c["name"]))
    root.mkdir(parents=True, mode=0o755)
    try:
        for rel, data in sorted(staged.items()):
            target = root / rel
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
            target.write_bytes(data)
            os.chmod(target, 0o644)
        all_files = {rel: _sha256(data) for rel, data in staged.items()}
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "contributions": contributions,
            "tree_digest": tree_digest(all_files),
        }
        _write_manifest(root, manifest)  # provisional, so the stack can be read from the sealed tree
        manifest["stack"] = _stack(root, contributions)
        manifest["stack_digest"] = _sha256(canonical_json(manifest["stack"]))
        _write_manifest(root, manifest)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return manifest


def _write_manifest(root: Path, manifest: Mapping[str, Any]) -> None:
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.chmod(root / MANIFEST, 0o644)


def sign_bundle(tree: str | os.PathLike[str], private_key_pem: bytes) -> dict[str, str]:
    """Write ``release.json`` (tree, stack and manifest digests) and its Ed25519 ``release.sig``."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    root = Path(tree)
    key = load_pem_private_key(private_key_pem, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise BundleError(f"the signing key is {type(key).__name__}, not Ed25519")
    manifest_bytes = (root / MANIFEST).read_bytes()
    release = _release_descriptor(manifest_bytes, json.loads(manifest_bytes))
    data = canonical_json(release)
    (root / RELEASE).write_bytes(data)
    (root / SIGNATURE).write_text(key.sign(data).hex() + "\n")
    return release


# -- verification ------------------------------------------------------------------------------


@attrs.frozen
class VerifiedBundle:
    root: str
    manifest: Mapping[str, Any]
    sources: Mapping[str, bytes]  # "namespace/relative/path.py" -> the bytes whose digest matched
    signed: bool

    @property
    def namespaces(self) -> tuple[str, ...]:
        return tuple(c["namespace"] for c in self.manifest["contributions"])


def _canonical_digest(value: object, what: str) -> str:
    if not isinstance(value, str) or not _DIGEST.fullmatch(value):
        raise BundleError(f"{what} {value!r} is not a canonical digest (64 lowercase hexadecimal digits)")
    return value


def _regular_bytes(path: Path, what: str) -> bytes:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise BundleError(f"{what} {path} is missing") from None
    if stat.S_ISLNK(info.st_mode):
        raise BundleError(f"{what} {path} is a symlink")
    if not stat.S_ISREG(info.st_mode):
        raise BundleError(f"{what} {path} is not a regular file")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as fh:
        return fh.read()


def _walk(root: Path) -> tuple[set[str], set[str]]:
    """Every file and folder under ``root`` (relative paths), refusing symlinks and special files."""
    files: set[str] = set()
    dirs: set[str] = set()
    stack = [root]
    while stack:
        folder = stack.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                rel = str(Path(entry.path).relative_to(root)).replace(os.sep, "/")
                if entry.is_symlink():
                    raise BundleError(f"{rel} is a symlink; a sealed tree holds only regular files and folders")
                if entry.is_dir(follow_symlinks=False):
                    dirs.add(rel)
                    stack.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    files.add(rel)
                else:
                    raise BundleError(f"{rel} is not a regular file")
    return files, dirs


def _verify_signature(root: Path, manifest_bytes: bytes, manifest: Mapping[str, Any], public_key_pem: bytes) -> None:
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
        from cryptography.hazmat.primitives.serialization import load_pem_public_key
    except ImportError as exc:
        raise BundleError(f"signed bundles need the cryptography package: {exc}") from None
    key = load_pem_public_key(public_key_pem)
    if not isinstance(key, Ed25519PublicKey):
        raise BundleError(f"the configured public key is {type(key).__name__}, not Ed25519")
    release_bytes = _regular_bytes(root / RELEASE, "release descriptor")
    signature_text = _regular_bytes(root / SIGNATURE, "release signature").decode(errors="replace").strip()
    if not re.fullmatch(r"[0-9a-f]{128}", signature_text):
        raise BundleError("release.sig is not a 64-byte Ed25519 signature in lowercase hexadecimal")
    try:
        key.verify(bytes.fromhex(signature_text), release_bytes)
    except InvalidSignature:
        raise BundleError("release.sig does not verify against the configured public key") from None
    release = json.loads(release_bytes)
    for field, value in _release_descriptor(manifest_bytes, manifest).items():
        if release.get(field) != value:
            raise BundleError(
                f"the signed release descriptor's {field} {release.get(field)!r} does not match the bundle's {value!r}"
            )


def verify_bundle(
    tree: str | os.PathLike[str],
    *,
    mount: str | None = None,
    public_key_pem: bytes | None = None,
    check_stack: bool = True,
) -> VerifiedBundle:
    """Every check loading makes; raises ``BundleError`` with the first reason found."""
    root = Path(tree)
    if mount is not None and os.path.normpath(os.path.abspath(root)) != os.path.normpath(mount):
        raise BundleError(f"bundle path {str(root)!r} is not the configured mount {mount!r}")
    try:
        info = os.lstat(root)
    except FileNotFoundError:
        raise BundleError(f"bundle path {str(root)!r} does not exist") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise BundleError(f"bundle path {str(root)!r} is not a concrete directory (a symlink or a file)")
    if os.path.realpath(root) != os.path.abspath(root):
        raise BundleError(f"bundle path {str(root)!r} goes through a symlink (it resolves to {os.path.realpath(root)})")
    manifest_bytes = _regular_bytes(root / MANIFEST, "manifest")
    try:
        manifest = json.loads(manifest_bytes)
    except ValueError as exc:
        raise BundleError(f"manifest.json is not JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"manifest.json is not a {FORMAT} manifest")
    contributions = manifest.get("contributions")
    if not isinstance(contributions, list) or not contributions:
        raise BundleError("manifest.json names no contribution")
    _canonical_digest(manifest.get("tree_digest"), "tree digest")
    if check_stack:
        _canonical_digest(manifest.get("stack_digest"), "stack digest")
    expected_files: dict[str, str] = {}
    for c in contributions:
        digest = _canonical_digest(c.get("digest"), f"contribution {c.get('name')!r} digest")
        if c.get("namespace") != NAMESPACE_PREFIX + digest:
            raise BundleError(f"contribution {c.get('name')!r}: namespace {c.get('namespace')!r} is not {digest}'s")
        files = c.get("files")
        if not isinstance(files, dict) or not files:
            raise BundleError(f"contribution {c.get('name')!r} lists no files")
        for rel, file_digest in files.items():
            parts = rel.split("/")
            if rel.startswith("/") or ".." in parts or "" in parts or not rel.endswith(".py"):
                raise BundleError(f"contribution {c.get('name')!r}: file path {rel!r} is not a relative .py path")
            expected_files[f"{c['namespace']}/{rel}"] = _canonical_digest(file_digest, f"digest of {rel}")
        if contribution_digest(files) != digest:
            raise BundleError(f"contribution {c.get('name')!r}: its file digests do not give its digest {digest}")
    present, _ = _walk(root)
    allowed = set(expected_files) | {MANIFEST, RELEASE, SIGNATURE}
    extra = sorted(present - allowed)
    if extra:
        raise BundleError(f"unexpected file {extra[0]} in the bundle (not in the manifest)")
    missing = sorted(set(expected_files) - present)
    if missing:
        raise BundleError(f"file {missing[0]} named by the manifest is missing")
    sources: dict[str, bytes] = {}
    for rel, want in sorted(expected_files.items()):
        data = _regular_bytes(root / rel, "file")
        if _sha256(data) != want:
            raise BundleError(f"file {rel} does not match its digest (changed after the bundle was built)")
        sources[rel] = data
    if tree_digest(expected_files) != manifest["tree_digest"]:
        raise BundleError("the tree digest does not match the files' digests")
    if check_stack and _sha256(canonical_json(manifest.get("stack"))) != manifest["stack_digest"]:
        raise BundleError("the stack digest does not match the manifest's stack")
    if public_key_pem is not None:
        _verify_signature(root, manifest_bytes, manifest, public_key_pem)
    return VerifiedBundle(str(root), manifest, sources, public_key_pem is not None)


# -- loading -----------------------------------------------------------------------------------


class _SealedLoader(importlib.abc.Loader):
    def __init__(self, source: bytes, filename: str) -> None:
        self.source = source
        self.filename = filename

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        code = compile(self.source, self.filename, "exec", dont_inherit=True)
        exec(code, module.__dict__)


class SealedFinder(importlib.abc.MetaPathFinder):
    """Resolves ``cacheon_c_<sha256>`` namespaces (and their modules) from verified bytes only."""

    def __init__(self, verified: VerifiedBundle) -> None:
        self.verified = verified
        self.namespaces = frozenset(verified.namespaces)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        top = fullname.split(".", maxsplit=1)[0]
        if top not in self.namespaces:
            return None
        rel = fullname.replace(".", "/")
        for candidate, package in ((f"{rel}/__init__.py", True), (f"{rel}.py", False)):
            data = self.verified.sources.get(candidate)
            if data is None:
                continue
            filename = os.path.join(self.verified.root, candidate)
            spec = importlib.util.spec_from_loader(
                fullname, _SealedLoader(data, filename), origin=filename, is_package=package
            )
            if spec is None:
                return None
            spec.has_location = True  # __file__ names the verified file, for tracebacks
            if package:
                spec.submodule_search_locations = []  # submodules resolve through this finder alone
            return spec
        return None

    def plugin(self, contribution: Mapping[str, Any]) -> ModuleType:
        name = contribution["namespace"] + (f".{contribution['plugin']}" if contribution.get("plugin") else "")
        return importlib.import_module(name)

    def uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for name in [m for m in sys.modules if m.split(".")[0] in self.namespaces]:
            del sys.modules[name]


def open_bundle(
    tree: str | os.PathLike[str], *, mount: str = DEFAULT_MOUNT, public_key_pem: bytes | None = None
) -> list[tuple[str, object]]:
    """Verify the engine tree, expose its sealed namespaces and import each contribution's plugin.

    Raises ``BundleError`` with the reason for any refusal, the role check first: only a process
    marked as an engine worker (the scheduler role) may open a bundle.
    """
    role = current_role()
    if role is not Role.SCHEDULER:
        raise BundleError(f"this process is not marked as an engine worker (role {role.value})")
    verified = verify_bundle(tree, mount=mount, public_key_pem=public_key_pem)
    finder = SealedFinder(verified)
    sys.meta_path.insert(0, finder)
    try:
        return [(c["name"], finder.plugin(c)) for c in verified.manifest["contributions"]]
    except Exception as exc:
        finder.uninstall()
        raise BundleError(f"a sealed namespace failed to import: {type(exc).__name__}: {exc}") from exc


def load_candidate_bundle(
    tree: str | os.PathLike[str],
    *,
    mount: str = DEFAULT_MOUNT,
    public_key_pem: bytes | None = None,
    receipts: ReceiptLog | None = None,
) -> list[tuple[str, object]]:
    """``open_bundle``, with the serving policy for refusals: each writes a ``load_failed`` receipt
    with the reason; under signed serving (``public_key_pem`` given) it also raises, so startup
    stops, and otherwise no candidate is returned (the engine's own code serves)."""
    try:
        return open_bundle(tree, mount=mount, public_key_pem=public_key_pem)
    except BundleError as exc:
        if receipts is not None:
            receipts.event("load_failed", plugin="bundle", reason=str(exc))
        if public_key_pem is not None:
            raise
        return []
