"""Sealed bundles: reproducible builds, every kind of tampering refused with its reason, sealed imports."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cacheon_core import BundleError, build_bundle, sign_bundle, verify_bundle
from cacheon_core.cli import main as cli

EXAMPLE = Path(__file__).resolve().parents[2] / "plugins_example" / "src" / "cacheon_example_kernels"

PROBE = {
    "__init__.py": '"""A contribution written for these tests."""\n',
    "plugin.py": textwrap.dedent(
        """
        from cacheon_core import Variant, hookimpl

        from . import kernels
        from .helpers import scale


        @hookimpl
        def cacheon_variants():
            return [Variant(slot="norm.rmsnorm", name="probe_copy", impl=kernels.copy, priority=scale(1))]
        """
    ),
    "kernels.py": "def copy(*, x, weight, eps, out):\n    out.copy_(x)\n",
    "helpers.py": "def scale(value):\n    return value * 3\n",
    "notes.py": "raise RuntimeError('not part of the closure: never copied')\n",
}


def write_probe(folder: Path, name: str = "bundle_probe", **override: str) -> Path:
    package = folder / name
    package.mkdir(parents=True)
    for rel, text in {**PROBE, **override}.items():
        (package / rel).write_text(text)
    return package


@pytest.fixture
def tree(tmp_path) -> Path:
    build_bundle([f"{write_probe(tmp_path / 'src')}:plugin"], tmp_path / "tree")
    return tmp_path / "tree"


def namespace_dir(tree: Path) -> Path:
    [ns] = [p for p in tree.iterdir() if p.name.startswith("cacheon_c_")]
    return ns


def refused(tree: Path, match: str, **kwargs) -> None:
    with pytest.raises(BundleError, match=match):
        verify_bundle(tree, **kwargs)


def test_a_build_seals_the_import_closure_under_its_content_digest(tree):
    manifest = json.loads((tree / "manifest.json").read_text())
    [c] = manifest["contributions"]
    assert sorted(c["files"]) == ["__init__.py", "helpers.py", "kernels.py", "plugin.py"]  # not notes.py
    assert c["namespace"] == f"cacheon_c_{c['digest']}" and len(c["digest"]) == 64
    assert c["requires"] == ["cacheon_core"]  # the standard library is not listed
    assert manifest["stack"]["contributions"] == [
        {"name": "bundle_probe", "slots": [], "variants": [["norm.rmsnorm", "probe_copy", 1, 3, False]], "bindings": []}
    ]
    verified = verify_bundle(tree)
    assert verified.namespaces == (c["namespace"],) and not verified.signed


def test_builds_in_different_folders_give_identical_digests(tmp_path):
    a = build_bundle([f"{write_probe(tmp_path / 'one' / 'deep' / 'src')}:plugin"], tmp_path / "a")
    b = build_bundle([f"{write_probe(tmp_path / 'two')}:plugin"], tmp_path / "b")
    assert a == b
    assert (tmp_path / "a" / "manifest.json").read_bytes() == (tmp_path / "b" / "manifest.json").read_bytes()
    other = write_probe(tmp_path / "three", **{"helpers.py": "def scale(value):\n    return value * 4\n"})
    changed = build_bundle([f"{other}:plugin"], tmp_path / "c")
    assert changed["tree_digest"] != a["tree_digest"] and changed["stack_digest"] != a["stack_digest"]


def test_the_example_plugin_builds_and_verifies(tmp_path):
    manifest = build_bundle([f"{EXAMPLE}:plugin"], tmp_path / "tree")
    [served] = manifest["stack"]["contributions"]
    assert {v[1] for v in served["variants"]} >= {"example_torch", "example_triton"}
    assert cli(["bundle", "inspect", str(tmp_path / "tree")]) == 0


def test_absolute_imports_of_the_contribution_itself_are_refused_at_build(tmp_path):
    package = write_probe(tmp_path / "src", **{"plugin.py": "import bundle_probe.kernels\n"})
    with pytest.raises(BundleError, match="use relative imports"):
        build_bundle([f"{package}:plugin"], tmp_path / "tree")
    assert not (tmp_path / "tree").exists()


def test_a_changed_byte_is_refused(tree):
    target = namespace_dir(tree) / "kernels.py"
    data = bytearray(target.read_bytes())
    data[0] ^= 1
    target.write_bytes(bytes(data))
    refused(tree, r"kernels.py does not match its digest")


def test_an_extra_file_is_refused(tree):
    (namespace_dir(tree) / "extra.py").write_text("x = 1\n")
    refused(tree, r"unexpected file .*extra.py")


def test_a_removed_file_is_refused(tree):
    (namespace_dir(tree) / "helpers.py").unlink()
    refused(tree, r"helpers.py named by the manifest is missing")


def test_a_symlinked_file_is_refused(tree, tmp_path):
    target = namespace_dir(tree) / "kernels.py"
    copy = tmp_path / "kernels_copy.py"
    shutil.copy(target, copy)
    target.unlink()
    target.symlink_to(copy)  # same bytes, but a symlink can be swapped later
    refused(tree, r"kernels.py is a symlink")


def test_a_symlinked_directory_is_refused(tree, tmp_path):
    ns = namespace_dir(tree)
    moved = tmp_path / "elsewhere"
    shutil.move(ns, moved)
    ns.symlink_to(moved, target_is_directory=True)
    refused(tree, r"is a symlink")


def test_a_symlinked_bundle_root_is_refused(tree, tmp_path):
    link = tmp_path / "mount"
    link.symlink_to(tree, target_is_directory=True)
    refused(link, r"not a concrete directory")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("tree_digest", lambda d: d.upper(), "tree digest .* is not a canonical digest"),
        ("tree_digest", lambda d: d[:40], "tree digest .* is not a canonical digest"),
        ("stack_digest", lambda d: d.upper(), "stack digest .* is not a canonical digest"),
    ],
)
def test_non_canonical_digests_are_refused(tree, field, value, match):
    manifest = json.loads((tree / "manifest.json").read_text())
    manifest[field] = value(manifest[field])
    (tree / "manifest.json").write_text(json.dumps(manifest))
    refused(tree, match)


def test_a_non_canonical_file_digest_is_refused(tree):
    manifest = json.loads((tree / "manifest.json").read_text())
    files = manifest["contributions"][0]["files"]
    files["kernels.py"] = files["kernels.py"].upper()
    (tree / "manifest.json").write_text(json.dumps(manifest))
    refused(tree, r"digest of kernels.py .* is not a canonical digest")


def test_a_wrong_mount_path_is_refused(tree):
    refused(tree, r"is not the configured mount '/cacheon/engine-tree'", mount="/cacheon/engine-tree")
    verify_bundle(tree, mount=str(tree))


def _keys(tmp_path: Path) -> tuple[bytes, bytes, bytes]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    def pems(key):
        private = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        public = key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return private, public

    private, public = pems(Ed25519PrivateKey.generate())
    _, other_public = pems(Ed25519PrivateKey.generate())
    return private, public, other_public


def test_signed_bundles_verify_only_against_their_key(tree, tmp_path):
    private, public, other = _keys(tmp_path)
    refused(tree, r"release descriptor .*release.json is missing", public_key_pem=public)
    sign_bundle(tree, private)
    assert verify_bundle(tree, public_key_pem=public).signed
    refused(tree, r"release.sig does not verify against the configured public key", public_key_pem=other)
    signature = (tree / "release.sig").read_text().strip()
    flipped = format(int(signature[0], 16) ^ 1, "x") + signature[1:]
    (tree / "release.sig").write_text(flipped + "\n")
    refused(tree, r"release.sig does not verify", public_key_pem=public)


def test_a_resealed_manifest_does_not_match_the_signed_descriptor(tree, tmp_path):
    private, public, _ = _keys(tmp_path)
    sign_bundle(tree, private)
    manifest = json.loads((tree / "manifest.json").read_text())
    manifest["stack"]["contributions"][0]["bindings"] = ["norm"]  # claims a binding it was not signed for
    manifest["stack_digest"] = (
        __import__("hashlib")
        .sha256(json.dumps(manifest["stack"], sort_keys=True, separators=(",", ":")).encode())
        .hexdigest()
    )
    (tree / "manifest.json").write_text(json.dumps(manifest))
    verify_bundle(tree)  # internally consistent...
    refused(tree, r"signed release descriptor's stack_digest", public_key_pem=public)  # ...but not what was signed


def test_inspect_exits_non_zero_with_the_reason(tree, capsys):
    assert cli(["bundle", "inspect", str(tree)]) == 0
    assert "verified" in capsys.readouterr().out
    (namespace_dir(tree) / "extra.py").write_text("")
    assert cli(["bundle", "inspect", str(tree)]) == 1
    assert "REFUSED: unexpected file" in capsys.readouterr().out


LOADER = textwrap.dedent(
    """
    import importlib, json, sys
    from pathlib import Path
    from cacheon_core import ReceiptLog, Role, load_candidate_bundle, mark_role, read_receipts

    tree, receipts_dir, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    key = Path(sys.argv[4]).read_bytes() if len(sys.argv) > 4 else None
    if mode != "unmarked":
        mark_role(Role.SCHEDULER)
    log = ReceiptLog(receipts_dir, role="scheduler", rank=0, policy="strict")
    try:
        plugins = load_candidate_bundle(tree, mount=tree, public_key_pem=key, receipts=log)
    except Exception as exc:
        print("RAISED", type(exc).__name__, exc)
        plugins = None
    log.close()
    out = {"plugins": None if plugins is None else [name for name, _ in plugins]}
    out["receipts"] = [[r.kind, r.reason] for r in read_receipts(receipts_dir)]
    if plugins:
        namespace = plugins[0][1].__name__.split(".")[0]
        out["module_file"] = plugins[0][1].__file__
        out["priority"] = plugins[0][1].cacheon_variants()[0].priority
        for name in ("bundle_probe", "manifest", namespace + ".notes", "cacheon_c_" + "0" * 64):
            try:
                importlib.import_module(name)
                out[name] = "imported"
            except ImportError as exc:
                out[name] = type(exc).__name__
        out["on_path"] = any(tree in p for p in sys.path)
    print("RESULT " + json.dumps(out))
    """
)


def run_loader(tmp_path: Path, tree: Path, mode: str = "scheduler", key: Path | None = None) -> dict:
    receipts = tmp_path / f"receipts-{mode}-{len(list(tmp_path.iterdir()))}"
    args = [sys.executable, "-c", LOADER, str(tree), str(receipts), mode, *([str(key)] if key else [])]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEON_")}
    out = subprocess.run(args, capture_output=True, text=True, check=True, env=env, cwd=tmp_path)
    [line] = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line[len("RESULT ") :])
    result["raised"] = [x for x in out.stdout.splitlines() if x.startswith("RAISED")]
    return result


def test_a_scheduler_loads_only_the_sealed_namespaces(tree, tmp_path):
    result = run_loader(tmp_path, tree)
    assert result["plugins"] == ["bundle_probe"] and result["priority"] == 3
    assert result["module_file"].startswith(str(tree / "cacheon_c_"))
    assert result["bundle_probe"] == "ModuleNotFoundError"  # the original name is not importable
    assert result["manifest"] == "ModuleNotFoundError"  # nothing else in the tree is an import location
    assert result["cacheon_c_" + "0" * 64] == "ModuleNotFoundError"  # nor an unsealed namespace
    assert result[f"{namespace_dir(tree).name}.notes"] == "ModuleNotFoundError"  # outside the closure
    assert result["on_path"] is False
    assert result["receipts"] == []


def test_an_unmarked_process_is_refused_with_a_receipt(tree, tmp_path):
    result = run_loader(tmp_path, tree, mode="unmarked")
    assert result["plugins"] == []
    assert result["receipts"] == [["load_failed", "this process is not marked as an engine worker (role other)"]]


def test_a_tampered_bundle_writes_load_failed_and_signed_serving_stops(tree, tmp_path):
    private, public, other = _keys(tmp_path)
    sign_bundle(tree, private)
    key, wrong = tmp_path / "public.pem", tmp_path / "other.pem"
    key.write_bytes(public)
    wrong.write_bytes(other)
    assert run_loader(tmp_path, tree, key=key)["plugins"] == ["bundle_probe"]
    signed_wrong = run_loader(tmp_path, tree, key=wrong)
    assert signed_wrong["plugins"] is None  # startup stops
    assert signed_wrong["raised"] and "does not verify" in signed_wrong["raised"][0]
    assert signed_wrong["receipts"][0][0] == "load_failed"
    (namespace_dir(tree) / "kernels.py").write_text("def copy(*, x, weight, eps, out):\n    pass\n")
    unsigned = run_loader(tmp_path, tree)
    assert unsigned["plugins"] == []  # unsigned serving: no candidate, the engine's own code runs
    assert unsigned["receipts"] == [
        [
            "load_failed",
            f"file {namespace_dir(tree).name}/kernels.py does not match its digest "
            "(changed after the bundle was built)",
        ]
    ]


def test_the_cli_builds_signs_and_inspects(tmp_path, capsys):
    private, public, other = _keys(tmp_path)
    (tmp_path / "key.pem").write_bytes(private)
    (tmp_path / "pub.pem").write_bytes(public)
    (tmp_path / "other.pem").write_bytes(other)
    package = write_probe(tmp_path / "src")
    tree = tmp_path / "tree"
    args = ["bundle", "build", f"{package}:plugin", "--out", str(tree), "--sign-key", str(tmp_path / "key.pem")]
    assert cli(args) == 0
    assert "signed: release.json" in capsys.readouterr().out
    assert cli(args) == 1  # never into an existing folder
    assert "already exists" in capsys.readouterr().err
    assert cli(["bundle", "inspect", str(tree), "--public-key", str(tmp_path / "pub.pem")]) == 0
    assert "verified and signed" in capsys.readouterr().out
    assert cli(["bundle", "inspect", str(tree), "--public-key", str(tmp_path / "other.pem"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "REFUSED" and "does not verify" in report["reason"]
    assert cli(["bundle", "inspect", str(tree), "--mount", "/cacheon/engine-tree"]) == 1
