"""The public surface changes only on purpose."""

from __future__ import annotations

import cacheon_core

EXPECTED = {
    "ABI_VERSION",
    "BUILTIN_SLOTS",
    "Accepted",
    "BindingError",
    "BindingVocabulary",
    "DEFAULT_BUNDLE_MOUNT",
    "BundleError",
    "VerifiedBundle",
    "build_bundle",
    "load_candidate_bundle",
    "open_bundle",
    "sign_bundle",
    "verify_bundle",
    "CacheonError",
    "CallDescriptor",
    "CanaryRow",
    "MethodSignature",
    "method_signatures",
    "override_rows",
    "CallSite",
    "CandidateFailure",
    "CollectiveAbort",
    "DeepEpilogue",
    "EpilogueError",
    "Handoff",
    "finalize_add_norm",
    "CaseResult",
    "ContractError",
    "CoverageReport",
    "DescriptorError",
    "Discovery",
    "Dispatcher",
    "PluginError",
    "PluginReport",
    "Policy",
    "Receipt",
    "ReceiptLog",
    "Registry",
    "Rejected",
    "Resolution",
    "RevalidationError",
    "Role",
    "Runtime",
    "ScalarSpec",
    "SeamAdapter",
    "SlotSpec",
    "TensorMeta",
    "TensorSpec",
    "Tolerance",
    "Topology",
    "UnknownSlot",
    "Variant",
    "VariantInfo",
    "VerifyResult",
    "canonical_device",
    "canonical_dtype",
    "canonical_strides",
    "coverage_report",
    "current_role",
    "describe",
    "discover",
    "hookimpl",
    "hookspec",
    "mark_role",
    "read_receipts",
    "start",
    "verify_variant",
}


def test_all_is_the_intended_public_api():
    assert set(cacheon_core.__all__) == EXPECTED
    assert len(cacheon_core.__all__) == len(EXPECTED)
    for name in EXPECTED:
        assert hasattr(cacheon_core, name), name


def test_plugin_author_imports_come_from_the_top_level():
    from cacheon_core import Variant, hookimpl

    assert hookimpl.project_name == "cacheon"
    assert Variant.__module__.startswith("cacheon_core")


def test_importing_core_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, cacheon_core, cacheon_core.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_core_imports_without_torch(tmp_path):
    import subprocess
    import sys

    # Block torch: the ABI, discovery and receipts must not need it.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import cacheon_core\n"
        "from cacheon_core import discover\n"
        "print(sorted(discover(load_variants=False).slots)[:1])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "arfusion.allreduce_add_rmsnorm" in out.stdout
