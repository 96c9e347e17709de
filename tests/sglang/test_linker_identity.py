"""What the SGLang linker restores is what this model, in this configuration, computed: pages of
another model, KV dtype, pool layout or head split miss; the same weights at another path hit.

SGLang's real pools, cache tree and scheduler pieces with a real manager process
(tests/sglang/sglang_cache.py). A control shows that these tests can tell a restore from a
recompute: pages of another model saved under the same explicit ``model_fingerprint`` are restored
byte for byte, and differ from what the restoring model computes for the same tokens.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest
import torch
from sglang.srt.environ import envs

from cacheon_orbitkv.client import CacheClient
from cacheon_sglang import linker as orbit
from tests.sglang import sglang_cache as sc

IDS = list(range(200, 218))  # 18 tokens: SGLang looks up 16, four pages of 4
PAGE = 4
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_hidden_layers": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 1024,
}


def _page_bytes(fx: dict, slots: torch.Tensor) -> list[bytes]:
    """The bytes of every page whose first slot is in ``slots`` (whole pages), in order."""
    layout = fx["linker"].pool_layout.layouts[0]
    rows = [int(s) // PAGE for s in slots.reshape(-1)[::PAGE].tolist()]
    return [b"".join(bytes(seg[row].tolist()) for seg in layout.segments) for row in rows]


def _save(endpoint: str, **build: Any) -> dict:
    """A cold request through a fresh linker: its pages saved under that linker's identity."""
    fx = sc.build_mha(endpoint, **build)
    sched = sc.Scheduler(fx)
    out = sched.run("cold", IDS)
    assert out["host_loaded"] == 0 and fx["linker"].stats["offloads"] >= 1
    fx["linker"].close()
    return out


def _hit(endpoint: str, hnd: bool = False, **build: Any) -> tuple[int, dict]:
    """SGLang's match of the prompt through a fresh linker: the tokens it would restore."""
    with envs.SGLANG_USE_HND_KVCACHE.override(hnd):
        fx = sc.build_mha(endpoint, **build)
    sched = sc.Scheduler(fx)
    req = sched.new_req("probe", IDS)
    sched.match(req)
    fx["linker"].close()
    return req.host_hit_length, fx


VARIANTS = {
    # pool layout HND instead of NHD: every page chunk the same size
    "hnd": {"hnd": True},
    # KV dtype float16 instead of bfloat16: every page chunk the same size
    "float16": {"dtype": torch.float16},
    "fp8": {"dtype": torch.float8_e4m3fn},
    # four heads of 4 instead of two of 8 (one explicit model fingerprint): the same chunk sizes
    "heads": {"heads": 4, "head_dim": 4},
}


def test_another_layout_dtype_or_head_split_misses_and_the_same_configuration_hits(manager_factory):
    m = manager_factory()
    _save(m.endpoint)
    hit, base = _hit(m.endpoint)
    assert hit == 16  # the control: the same configuration in a fresh linker restores
    chunks = base["linker"].pool_layout.layouts[0].chunks
    for name, build in VARIANTS.items():
        hit, fx = _hit(m.endpoint, **build)
        linker: orbit.OrbitKVLinker = fx["linker"]
        assert hit == 0, name
        assert linker.namespace != base["linker"].namespace, name
        if name != "fp8":  # equal chunk sizes: only the identity tells these pages apart
            assert linker.pool_layout.layouts[0].chunks == chunks, name
    assert m.stats()["bytes_read"]["dram"] == 0  # discovery only: nothing was leased


def test_the_same_weights_at_another_path_hit_and_changed_weights_at_the_same_path_miss(manager_factory, tmp_path):
    first = tmp_path / "first"
    first.mkdir()
    (first / "config.json").write_text(json.dumps(TINY_LLAMA))
    weights = first / "model.safetensors"
    weights.write_bytes(torch.randint(0, 256, (3 << 20,), dtype=torch.uint8).numpy().tobytes())
    second = tmp_path / "second"
    shutil.copytree(first, second)
    m = manager_factory()
    _save(m.endpoint, model_path=str(first))
    assert _hit(m.endpoint, model_path=str(second))[0] == 16  # another host mounting the same model elsewhere
    # A fine-tune written over the same files: same names and sizes, other bytes in the last MiB.
    with open(weights, "r+b") as fh:
        fh.seek(-4096, 2)
        fh.write(bytes(4096))
    assert _hit(m.endpoint, model_path=str(first))[0] == 0
    assert _hit(m.endpoint, model_path=str(second))[0] == 16


def test_a_restore_is_told_from_a_recompute_by_the_bytes_it_writes(manager_factory):
    """Model A's pages, saved under the fingerprint model B also claims, are restored into B's pool
    byte for byte; B's own forward computes other bytes for the same tokens."""
    m = manager_factory()
    shared = {"model_fingerprint": "one-name-two-models"}
    a = sc.build_mha(m.endpoint, extra=shared)
    cold_a = sc.Scheduler(a, salt=0).run("cold", IDS)
    saved = _page_bytes(a, cold_a["out_cache_loc"][:16])
    a["linker"].close()

    own = sc.build_mha(m.endpoint, extra={"model_fingerprint": "model-b"})
    cold_b = sc.Scheduler(own, salt=1).run("cold", IDS)  # what model B computes for these tokens
    recomputed = _page_bytes(own, cold_b["out_cache_loc"][:16])
    own["linker"].close()

    b = sc.build_mha(m.endpoint, extra=shared)
    linker: orbit.OrbitKVLinker = b["linker"]
    sched = sc.Scheduler(b, salt=1)
    req = sched.new_req("warm", IDS)
    batch = sched.schedule(req)
    assert req.host_loaded_length == 16
    restored = _page_bytes(b, b["cache"].linker.private_load_indices["warm"])
    assert linker.stats["pages_restored"] == 4 and linker.stats["load_failures"] == linker.stats["load_misses"] == 0
    assert restored == saved  # a restore writes the stored bytes...
    assert all(r != c for r, c in zip(restored, recomputed, strict=True))  # ...which are not B's own
    sched.forward(batch)
    assert sched.checks and not any(sched.checks.values())  # B's layers read A's KV, not their own
    assert sched.finish(batch) == []
    linker.close()


@pytest.mark.parametrize("what", ["tag", "length"])
def test_a_leased_page_of_another_layout_tag_or_length_is_a_miss_not_a_copy(manager_factory, what):
    """Pages under this linker's namespace and page ids, written with another layout tag or another
    length (another writer's bytes): found by discovery, refused at the lease, SGLang recomputes."""
    m = manager_factory()
    fx = sc.build_mha(m.endpoint)
    linker: orbit.OrbitKVLinker = fx["linker"]
    size = linker.pool_layout.layouts[0].page_bytes
    tag = linker.pool_layout.tags[0]
    keys = sc.storage_keys(IDS[:16], PAGE)
    length = size if what == "tag" else size // 2
    pages = [(orbit.storage_hash(k, 0), bytes([i + 1]) * length) for i, k in enumerate(keys)]
    with CacheClient(m.endpoint) as client:
        client.store(linker.namespace, 0, pages, tag="vllm-block-major" if what == "tag" else tag)
    sched = sc.Scheduler(fx)
    out = sched.run("warm", IDS)
    assert out["host_loaded"] == 0 and out["prefix_len"] == 0 and out["failed"] == []
    assert linker.stats["load_misses"] == 1 and linker.stats["loads"] == linker.stats["pages_restored"] == 0
    assert m.stats()["leases"] == 0
    linker.close()
