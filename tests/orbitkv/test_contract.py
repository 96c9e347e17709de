"""The compiled recovery contract: rules, the seed's example, and properties over random inputs."""

from __future__ import annotations

import itertools
import sys
import time

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from cacheon_orbitkv.contract import (
    ContractError,
    InvalidContract,
    InvalidCoverage,
    InvalidDemand,
    InvalidGroup,
    InvalidSpan,
    NamespaceMismatch,
    RecoveryContract,
)

NS = "model:fp16:nhd:p64:r0"


def seed_contract() -> RecoveryContract:
    return RecoveryContract.compile(NS, 64, [(0, "attention", 0), (1, "window", 100), (2, "recurrent", 0)])


# -- hand-written cases --------------------------------------------------------------------------


def test_the_seed_example():
    c = seed_contract()
    assert c.required_ranges(NS, 128, 512) == [(0, 128, 512), (1, 384, 512), (2, 448, 512)]
    assert c.required_ranges(NS, 128, 192) == [(0, 128, 192), (1, 128, 192), (2, 128, 192)]


def test_an_empty_span_demands_nothing_and_creates_no_boundary():
    c = seed_contract()
    assert c.required_ranges(NS, 256, 256) == [(0, 256, 256), (1, 256, 256), (2, 256, 256)]
    assert c.restorable_boundaries(NS, 256, 256, {0: [], 1: [], 2: []}) == []


def test_the_prefix_stops_at_the_first_gap():
    c = RecoveryContract.compile(NS, 64, [(0, "mla", 0)])
    assert c.restorable_boundaries(NS, 0, 512, {0: [64, 128, 256, 320]}) == [64, 128]


def test_a_window_needs_its_trailing_pages_only():
    c = RecoveryContract.compile(NS, 64, [(0, "attention", 0), (1, "window", 129)])  # 3 pages
    prefix = list(range(64, 513, 64))
    # Window pages present only at 320..512: boundaries 448 and 512 have their 3 trailing pages.
    assert c.restorable_boundaries(NS, 0, 512, {0: prefix, 1: [320, 384, 448, 512]}) == [448, 512]
    # Near the origin the window is capped by the tail: boundary 64 needs one page, 128 two.
    assert c.restorable_boundaries(NS, 0, 512, {0: prefix, 1: [64, 128]}) == [64, 128]


def test_checkpoints_need_the_page_ending_at_the_boundary_in_every_checkpoint_group():
    c = RecoveryContract.compile(NS, 64, [(0, "attention", 0), (1, "recurrent", 0), (2, "convolution", 0)])
    prefix = list(range(192, 769, 64))
    evidence = {0: prefix, 1: [320, 512, 768], 2: [512, 768]}
    assert c.restorable_boundaries(NS, 128, 768, evidence) == [512, 768]
    assert c.required_ranges(NS, 128, 512) == [(0, 128, 512), (1, 448, 512), (2, 448, 512)]


def test_every_legal_boundary_is_returned_so_ranks_can_intersect():
    c = RecoveryContract.compile(NS, 64, [(0, "attention", 0), (1, "recurrent", 0)])
    prefix = list(range(64, 641, 64))
    rank0 = {0: prefix, 1: [256, 640]}
    rank1 = {0: prefix, 1: [256, 512]}
    assert c.restorable_boundaries(NS, 0, 640, rank0) == [256, 640]
    # min of per-rank maxima would be 512, which rank 0 lacks; the intersection is right.
    assert c.common_boundaries(NS, 0, 640, [rank0, rank1]) == [256]
    assert c.select_boundary(c.common_boundaries(NS, 0, 640, [rank0, rank1]), 639) == 256


def test_select_boundary_respects_the_engine_match_limit():
    # SGLang computes a prompt's last token: 512 tokens with 64-token pages may reuse 448 at most.
    assert RecoveryContract.select_boundary([64, 448, 512], 511) == 448
    assert RecoveryContract.select_boundary([64, 448, 512], 512) == 512
    assert RecoveryContract.select_boundary([128], 64) is None
    assert RecoveryContract.select_boundary([], 10**9) is None


def test_a_huge_span_answers_without_work_proportional_to_its_length():
    c = seed_contract()
    began = time.perf_counter()
    ranges = c.required_ranges(NS, 0, 2**60)
    assert time.perf_counter() - began < 0.01
    assert ranges == [(0, 0, 2**60), (1, 2**60 - 128, 2**60), (2, 2**60 - 64, 2**60)]


@pytest.mark.parametrize(
    ("groups", "error", "message"),
    [
        ([], InvalidContract, "at least one group"),
        ([(1, "window", 64)], InvalidContract, "group 0 must supply the attention prefix"),
        ([(0, "window", 64)], InvalidContract, "group 0 must be a prefix"),
        ([(0, "recurrent", 0)], InvalidContract, "group 0 must be a prefix"),
        ([(0, "attention", 0), (1, "window", 0)], InvalidContract, "group 1: a window group needs window_tokens > 0"),
        ([(0, "attention", 5)], InvalidContract, "group 0: kind 'attention' takes window_tokens 0, got 5"),
        ([(0, "attention", 0), (1, "swa", 64)], InvalidContract, "group 1: kind 'swa' is not one of"),
        ([(0, "attention", 0), (1, "window", -3)], InvalidContract, "window_tokens -3"),
        ([(0, "attention", 0), (0, "mla", 0)], InvalidGroup, "group 0 is declared twice"),
        ([(0, "attention")], InvalidContract, "must be (group_id, kind, window_tokens)"),
        ([(-1, "attention", 0)], InvalidContract, "group id -1"),
    ],
)
def test_malformed_contracts(groups, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        RecoveryContract.compile(NS, 64, groups)


def test_malformed_compile_arguments():
    with pytest.raises(InvalidContract, match="namespace ''"):
        RecoveryContract.compile("", 64, [(0, "attention", 0)])
    with pytest.raises(InvalidContract, match="page size 0"):
        RecoveryContract.compile(NS, 0, [(0, "attention", 0)])
    with pytest.raises(InvalidContract, match="page size True"):
        RecoveryContract.compile(NS, True, [(0, "attention", 0)])


def test_malformed_queries_name_the_group_and_value():
    c = seed_contract()
    good = {0: [192], 1: [192], 2: [192]}
    with pytest.raises(NamespaceMismatch, match="'other' does not match"):
        c.required_ranges("other", 128, 192)
    with pytest.raises(InvalidSpan, match="not aligned to page size 64"):
        c.required_ranges(NS, 100, 192)
    with pytest.raises(InvalidSpan, match="0 <= start <= end"):
        c.restorable_boundaries(NS, 192, 128, good)
    with pytest.raises(InvalidGroup, match=r"missing groups \[2\]"):
        c.restorable_boundaries(NS, 128, 192, {0: [192], 1: [192]})
    with pytest.raises(InvalidGroup, match="unknown group 7"):
        c.restorable_boundaries(NS, 128, 192, {**good, 7: []})
    with pytest.raises(InvalidGroup, match="names group 1 twice"):
        c.restorable_boundaries(NS, 128, 192, [(0, [192]), (1, [192]), (1, []), (2, [])])
    with pytest.raises(InvalidCoverage, match="group 1: page end 150 is not aligned"):
        c.restorable_boundaries(NS, 128, 256, {**good, 1: [150]})
    with pytest.raises(InvalidCoverage, match=r"group 2: page end 128 is outside \(128, 256\]"):
        c.restorable_boundaries(NS, 128, 256, {**good, 2: [128]})
    with pytest.raises(InvalidCoverage, match="group 0: page ends are not strictly increasing at 192"):
        c.restorable_boundaries(NS, 128, 256, {**good, 0: [192, 192]})
    with pytest.raises(InvalidCoverage, match="at least one shard"):
        c.common_boundaries(NS, 128, 256, [])


def test_errors_are_value_errors():
    assert issubclass(ContractError, ValueError)
    for cls in (InvalidContract, NamespaceMismatch, InvalidSpan, InvalidGroup, InvalidCoverage):
        assert issubclass(cls, ContractError)


def test_the_contract_module_imports_no_torch_and_no_engine():
    import subprocess

    code = (
        "import sys, cacheon_orbitkv.contract; "
        "print(sorted(m for m in ('torch', 'sglang', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- properties ----------------------------------------------------------------------------------


@st.composite
def contracts(draw):
    page = draw(st.sampled_from([1, 2, 4, 16, 64]))
    groups = [(0, draw(st.sampled_from(["attention", "mla"])), 0)]
    for gid in range(1, draw(st.integers(0, 3)) + 1):
        kind = draw(st.sampled_from(["attention", "window", "recurrent", "convolution"]))
        window = draw(st.integers(1, 12 * page)) if kind == "window" else 0
        groups.append((gid, kind, window))
    return RecoveryContract.compile(NS, page, draw(st.permutations(groups)))


@st.composite
def spans(draw, contract):
    page = contract.page_size
    start = draw(st.integers(0, 8)) * page
    return start, start + draw(st.integers(0, 14)) * page


@st.composite
def cases(draw):
    contract = draw(contracts())
    start, end = draw(spans(contract))
    pages = list(range(start + contract.page_size, end + 1, contract.page_size))
    evidence = {g: sorted(draw(st.sets(st.sampled_from(pages)))) if pages else [] for g in contract.groups}
    return contract, start, end, evidence


def oracle(contract, start, end, evidence):
    """Brute force: a boundary is legal when each group holds every page of its required range."""
    page = contract.page_size
    legal = []
    for boundary in range(start + page, end + 1, page):
        ok = all(
            set(range(lo + page, hi + 1, page)) <= set(evidence[g])
            for g, lo, hi in contract.required_ranges(NS, start, boundary)
        )
        if ok:
            legal.append(boundary)
    return legal


@given(contracts(), st.data())
def test_ranges_are_aligned_half_open_inside_the_span_and_as_long_as_the_rule_says(contract, data):
    start, end = data.draw(spans(contract))
    page = contract.page_size
    tail = (end - start) // page
    ranges = contract.required_ranges(NS, start, end)
    assert [g for g, _, _ in ranges] == sorted(contract.groups)
    for (g, lo, hi), rule in zip(ranges, contract.rules, strict=True):
        assert g == rule.group and hi == end and start <= lo <= hi
        assert lo % page == 0
        expected = tail if rule.pages is None else min(rule.pages, tail)
        assert (hi - lo) // page == expected
        if rule.kind == "window":
            assert rule.pages == -(-rule.window_tokens // page)


@given(cases())
def test_restorable_boundaries_match_the_brute_force_definition(case):
    contract, start, end, evidence = case
    assert contract.restorable_boundaries(NS, start, end, evidence) == oracle(contract, start, end, evidence)


@given(contracts(), st.data())
def test_removing_any_page_of_a_minimal_evidence_removes_its_boundary(contract, data):
    start, end = data.draw(spans(contract))
    assume(end > start)
    page = contract.page_size
    boundary = data.draw(st.sampled_from(range(start + page, end + 1, page)))
    minimal = {g: list(range(lo + page, hi + 1, page)) for g, lo, hi in contract.required_ranges(NS, start, boundary)}
    assert boundary in contract.restorable_boundaries(NS, start, end, minimal)
    for g, pages in minimal.items():
        for drop in pages:
            reduced = {**minimal, g: [p for p in pages if p != drop]}
            assert boundary not in contract.restorable_boundaries(NS, start, end, reduced)


@given(cases(), st.data())
def test_adding_pages_never_removes_a_boundary(case, data):
    contract, start, end, evidence = case
    pages = list(range(start + contract.page_size, end + 1, contract.page_size))
    assume(pages)
    g = data.draw(st.sampled_from(contract.groups))
    extra = data.draw(st.sets(st.sampled_from(pages)))
    more = {**evidence, g: sorted(set(evidence[g]) | extra)}
    before = set(contract.restorable_boundaries(NS, start, end, evidence))
    assert before <= set(contract.restorable_boundaries(NS, start, end, more))


@given(contracts(), st.data())
def test_common_boundaries_are_the_order_independent_set_intersection(contract, data):
    start, end = data.draw(spans(contract))
    pages = list(range(start + contract.page_size, end + 1, contract.page_size))
    shards = [
        {g: sorted(data.draw(st.sets(st.sampled_from(pages)))) if pages else [] for g in contract.groups}
        for _ in range(data.draw(st.integers(1, 4)))
    ]
    per_shard = [set(contract.restorable_boundaries(NS, start, end, s)) for s in shards]
    expected = sorted(set.intersection(*per_shard))
    for order in itertools.permutations(shards):
        assert contract.common_boundaries(NS, start, end, list(order)) == expected


@given(st.lists(st.integers(0, 10**6)), st.integers(-10, 10**6))
def test_select_boundary_never_exceeds_its_limit(boundaries, limit):
    chosen = RecoveryContract.select_boundary(boundaries, limit)
    allowed = [b for b in boundaries if b <= limit]
    assert chosen == (max(allowed) if allowed else None)


@given(contracts(), st.integers(1, 10**6), st.integers(1, 10**6))
def test_any_unaligned_or_unordered_span_is_an_invalid_span(contract, a, b):
    page = contract.page_size
    assume(a % page or b % page or b < a)
    with pytest.raises(InvalidSpan):
        contract.required_ranges(NS, a, b)


# -- splitting a restore plan into transferred and retained pages ---------------------------------


def test_the_seed_example_split_into_copied_and_held_pages():
    c = seed_contract()
    # At boundary 512 from origin 128: the engine copies the prefix and the checkpoint, and holds
    # the first window page itself.
    split = c.split_demand(NS, 128, 512, {0: [192, 256, 320, 384, 448, 512], 1: [512], 2: [512]}, retained={1: [448]})
    assert [(d.group, d.start, d.end, d.transferred, d.retained) for d in split] == [
        (0, 128, 512, (192, 256, 320, 384, 448, 512), ()),
        (1, 384, 512, (512,), (448,)),
        (2, 448, 512, (512,), ()),
    ]
    with pytest.raises(InvalidDemand, match=r"group 1: page ends \[448\] of \[384, 512\) are neither"):
        c.split_demand(NS, 128, 512, {0: [192, 256, 320, 384, 448, 512], 1: [512], 2: [512]})
    with pytest.raises(InvalidDemand, match=r"group 2: transferred page ends \[448\] are outside"):
        c.split_demand(NS, 128, 512, {0: [192, 256, 320, 384, 448, 512], 1: [448, 512], 2: [448, 512]})
    with pytest.raises(InvalidDemand, match="both transferred and retained"):
        c.split_demand(NS, 128, 512, {0: [192, 256, 320, 384, 448, 512], 1: [448, 512], 2: [512]}, {1: [448]})
    with pytest.raises(InvalidDemand, match="unknown groups"):
        c.split_demand(NS, 128, 512, {7: [512]})


@given(contracts(), st.data())
def test_a_split_demand_is_disjoint_and_covers_exactly_the_compiled_range(contract, data):
    start, end = data.draw(spans(contract))
    page = contract.page_size
    transferred, retained = {}, {}
    for g, lo, hi in contract.required_ranges(NS, start, end):
        ends = list(range(lo + page, hi + 1, page))
        kept = data.draw(st.sets(st.sampled_from(ends))) if ends else set()
        transferred[g] = [e for e in ends if e not in kept]
        retained[g] = sorted(kept)
    split = contract.split_demand(NS, start, end, transferred, retained)
    for demand, (g, lo, hi) in zip(split, contract.required_ranges(NS, start, end), strict=True):
        assert (demand.group, demand.start, demand.end) == (g, lo, hi)
        assert not set(demand.transferred) & set(demand.retained)
        assert set(demand.transferred) | set(demand.retained) == set(range(lo + page, hi + 1, page))
    # Any page added outside its range, or dropped from both sides, is refused.
    groups = [g for g, lo, hi in contract.required_ranges(NS, start, end) if hi > lo]
    if groups:
        g = data.draw(st.sampled_from(groups))
        lo = next(r[1] for r in contract.required_ranges(NS, start, end) if r[0] == g)
        bad = {**transferred, g: [*transferred[g], lo]} if lo > 0 else None
        if bad is not None:
            with pytest.raises(InvalidDemand):
                contract.split_demand(NS, start, end, bad, retained)
        dropped = data.draw(st.sampled_from(transferred[g] + retained[g]))
        with pytest.raises(InvalidDemand):
            contract.split_demand(
                NS,
                start,
                end,
                {**transferred, g: [e for e in transferred[g] if e != dropped]},
                {**retained, g: [e for e in retained[g] if e != dropped]},
            )
