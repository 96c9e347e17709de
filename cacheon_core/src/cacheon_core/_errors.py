"""Typed errors. Every message names the bad value and the rule it broke."""

from __future__ import annotations


class CacheonError(Exception):
    """Base class of every error Cacheon raises on purpose."""


class ContractError(CacheonError, ValueError):
    """A slot contract (SlotSpec, TensorSpec, ScalarSpec) is malformed."""


class DescriptorError(CacheonError, ValueError):
    """A live call does not satisfy its slot's contract."""


class BindingError(CacheonError, ValueError):
    """A binding set is unknown, duplicated or not canonical."""


class PluginError(CacheonError):
    """A plugin could not be loaded or contributed something invalid."""


class UnknownSlot(CacheonError, LookupError):
    """No slot with this id is registered."""


class RevalidationError(CacheonError):
    """A candidate broke the contract it was called under (step 6 of dispatch).

    ``kind`` is one of: ``returned_value``, ``storage``, ``shape``, ``dtype``, ``device``,
    ``stride``, ``input_written``.
    """

    def __init__(self, kind: str, tensor: str, detail: str) -> None:
        super().__init__(f"{kind}: {tensor}: {detail}")
        self.kind = kind
        self.tensor = tensor
        self.detail = detail


class CandidateFailure(CacheonError):
    """A selected candidate failed under the strict policy; never reported as a success."""

    def __init__(self, slot: str, variant: str, reason: str) -> None:
        super().__init__(f"candidate {variant!r} for slot {slot!r} failed: {reason}")
        self.slot = slot
        self.variant = variant
        self.reason = reason


class CollectiveAbort(CandidateFailure):
    """A collective candidate failed on this rank after the ranks agreed to route to it."""

    def __init__(self, slot: str, variant: str, reason: str, rank: int) -> None:
        super().__init__(slot, variant, f"on tensor-parallel rank {rank}, after route agreement: {reason}")
        self.rank = rank
