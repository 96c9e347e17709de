"""Cacheon core: the stable slot ABI, plugin hooks, checked dispatcher, roles and receipts.

Plugin authors need only this top level::

    from cacheon_core import SlotSpec, TensorSpec, Variant, hookimpl
"""

from __future__ import annotations

from ._bundle import DEFAULT_MOUNT as DEFAULT_BUNDLE_MOUNT
from ._bundle import (
    BundleError,
    VerifiedBundle,
    build_bundle,
    load_candidate_bundle,
    open_bundle,
    sign_bundle,
    verify_bundle,
)
from ._canary import CanaryRow, MethodSignature, method_signatures, override_rows
from ._catalog import BUILTIN_SLOTS
from ._dispatch import CallSite, Dispatcher, Policy
from ._epilogue import DeepEpilogue, EpilogueError, Handoff, finalize_add_norm
from ._errors import (
    BindingError,
    CacheonError,
    CandidateFailure,
    CollectiveAbort,
    ContractError,
    DescriptorError,
    PluginError,
    RevalidationError,
    UnknownSlot,
)
from ._hookspecs import SeamAdapter, hookimpl, hookspec
from ._plugins import Discovery, PluginReport, VariantInfo, discover
from ._receipts import CoverageReport, Receipt, ReceiptLog, coverage_report, read_receipts
from ._registry import Accepted, Registry, Rejected, Resolution
from ._roles import BindingVocabulary, Role, current_role, mark_role
from ._runtime import Runtime, start
from ._slots import (
    CallDescriptor,
    ScalarSpec,
    SlotSpec,
    TensorMeta,
    TensorSpec,
    Tolerance,
    Topology,
    Variant,
    canonical_device,
    canonical_dtype,
    canonical_strides,
    describe,
)
from ._verify import CaseResult, VerifyResult, verify_variant

ABI_VERSION = 1
__version__ = "0.1.0"

__all__ = [
    "DEFAULT_BUNDLE_MOUNT",
    "BundleError",
    "VerifiedBundle",
    "build_bundle",
    "load_candidate_bundle",
    "open_bundle",
    "sign_bundle",
    "verify_bundle",
    "ABI_VERSION",
    "BUILTIN_SLOTS",
    "Accepted",
    "BindingError",
    "BindingVocabulary",
    "CacheonError",
    "CallDescriptor",
    "CallSite",
    "CanaryRow",
    "MethodSignature",
    "method_signatures",
    "override_rows",
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
]
