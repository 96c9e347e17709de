"""The cache identity: every part that decides a page's bytes changes the namespace; nothing else does."""

from __future__ import annotations

import hashlib
import shutil

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cacheon_orbitkv.client import page_hashes
from cacheon_orbitkv.identity import SAMPLE_BYTES, CacheIdentity, IdentityError, model_fingerprint

BASE = CacheIdentity(
    model="0123abcd",
    kv_dtype="bfloat16",
    layout="vllm-cuda-triton_attn",
    page_size=16,
    geometry=[(0, "attention", 0, (4096, 4096)), (1, "window", 63, (4096,))],
    parallel=[("tp", 1), ("pp", 1)],
    rank=0,
)

CHANGES = {
    "model": "4567ef01",
    "kv_dtype": "fp8_e4m3",
    "layout": "vllm-cuda-flash_attn",
    "page_size": 32,
    "geometry": [(0, "attention", 0, (2048, 2048, 2048, 2048)), (1, "window", 63, (4096,))],
    "parallel": [("tp", 2), ("pp", 1)],
    "rank": 1,
    "format": 1,
}


@given(st.sets(st.sampled_from(sorted(CHANGES)), min_size=1))
def test_any_changed_part_changes_the_namespace(parts):
    changed = attrs.evolve(BASE, **{p: CHANGES[p] for p in parts})
    assert changed.namespace != BASE.namespace


def test_equal_chunk_totals_in_another_split_are_another_identity():
    # Two layouts with the same page bytes (heads x head size swapped, K/V split or not) must miss.
    a = attrs.evolve(BASE, geometry=[(0, "attention", 0, (8192,))])
    b = attrs.evolve(BASE, geometry=[(0, "attention", 0, (4096, 4096))])
    assert a.page_bytes(0) == b.page_bytes(0) and a.namespace != b.namespace


def test_bad_parts_are_refused_with_their_names():
    with pytest.raises(IdentityError, match="kv_dtype"):
        attrs.evolve(BASE, kv_dtype="fp8:e4m3")
    with pytest.raises(IdentityError, match="page size"):
        attrs.evolve(BASE, page_size=0)
    with pytest.raises(IdentityError, match="group 7"):
        BASE.page_bytes(7)


def _model(folder, weights: bytes, config: str = '{"hidden_size": 8}'):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config)
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def test_the_model_fingerprint_follows_the_files_not_the_path(tmp_path):
    weights = bytes(range(256)) * (3 * SAMPLE_BYTES // 256)  # 3 MiB: first and last MiB sampled
    a = _model(tmp_path / "a", weights)
    b = shutil.copytree(a, tmp_path / "mounted" / "elsewhere")
    assert model_fingerprint(a) == model_fingerprint(b)
    assert model_fingerprint(a, "v1") != model_fingerprint(a, "v2")
    tail = bytearray(weights)
    tail[-1] ^= 1  # a fine-tune written over the same file: its last MiB differs
    assert model_fingerprint(_model(tmp_path / "c", bytes(tail))) != model_fingerprint(a)
    assert model_fingerprint(_model(tmp_path / "d", weights, '{"hidden_size": 16}')) != model_fingerprint(a)
    assert model_fingerprint(_model(tmp_path / "e", weights + b"\0")) != model_fingerprint(a)  # size


def test_a_hub_id_names_itself_and_an_empty_folder_is_refused(tmp_path):
    assert model_fingerprint("org/model", "abc") != model_fingerprint("org/model", "def")
    with pytest.raises(IdentityError, match="model_fingerprint"):
        model_fingerprint(tmp_path)


def _page_hashes_token_by_token(namespace, tokens, page_size, group=0, after=None):
    """The page hashes' definition, one token at a time: 8 little-endian signed bytes each."""
    out = []
    previous = after or hashlib.blake2b(f"{namespace}\x00{group}".encode(), digest_size=16).digest()
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        h = hashlib.blake2b(previous, digest_size=16)
        h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens[start : start + page_size]))
        previous = h.digest()
        out.append(previous)
    return out


@given(
    tokens=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=80),
    page_size=st.integers(1, 17),
    group=st.integers(0, 3),
    after=st.none() | st.binary(min_size=16, max_size=16),
)
def test_page_hashes_encode_every_token_as_its_definition_says(tokens, page_size, group, after):
    assert page_hashes("ns:bf16:nhd:p4:r0", tokens, page_size, group, after) == _page_hashes_token_by_token(
        "ns:bf16:nhd:p4:r0", tokens, page_size, group, after
    )


def test_page_hashes_are_the_ones_already_stored():
    # Pages stored by earlier releases are found only while these digests stay the same.
    pages = page_hashes("model-0123:bf16:nhd:p4:r0", [1, -2, 2**63 - 1, -(2**63), 5, 6, 7, 8, 9], 4, group=1)
    assert [h.hex() for h in pages] == ["f39b689869216a1c9add39d9f4122920", "3c6d2311653840136cb88c99d4ec762a"]
    assert page_hashes("ns", list(range(8)), 4, after=bytes(16))[1].hex() == "123d40b523bc2fd9d39d8b176264ad10"
    with pytest.raises(OverflowError):
        page_hashes("ns", [2**63], 1)
