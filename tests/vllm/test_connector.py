"""OrbitKVConnector on the real vLLM CPU engine: restarts restore the prefix from OrbitKV, exactly."""

from __future__ import annotations

import math

from .conftest import run_engine

PROMPT = 300  # 9 full 32-token pages and a 12-token tail
PAGE_BYTES = 2 * 2 * 32 * 2 * 64 * 4  # layers x (K, V) x block x kv heads x head dim x fp32


def same_output(a: dict, b: dict) -> bool:
    return a["ids"] == b["ids"] and all(
        math.isclose(x, y, abs_tol=0.05) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)
    )


def test_a_restarted_engine_restores_the_prefix_and_answers_the_same(tiny_llama, manager):
    m = manager()
    cold = run_engine(tiny_llama, m.endpoint, PROMPT)
    after_cold = m.stats()
    assert after_cold["bytes_written"]["dram"] == 9 * PAGE_BYTES  # every full page of the prompt saved
    assert after_cold["bytes_read"]["dram"] == 0
    warm = run_engine(tiny_llama, m.endpoint, PROMPT)  # a new engine process
    after_warm = m.stats()
    assert after_warm["hits"]["dram"] == 9
    assert after_warm["bytes_read"]["dram"] == 9 * PAGE_BYTES  # loaded bytes > 0: the whole prefix
    assert after_warm["leases"] == 0 and after_warm["reservations"] == 0
    assert same_output(cold, warm), (cold, warm)


def test_a_changed_model_identity_misses_and_matches_the_cold_output(tiny_llama, manager):
    m = manager()
    cold = run_engine(tiny_llama, m.endpoint, PROMPT)
    other = run_engine(tiny_llama, m.endpoint, PROMPT, fingerprint="another-model-identity")
    stats = m.stats()
    assert stats["bytes_read"]["dram"] == 0 and stats["hits"]["dram"] == 0
    assert stats["bytes_written"]["dram"] == 2 * 9 * PAGE_BYTES  # each identity saved its own pages
    assert same_output(cold, other)


def test_a_whole_number_of_pages_reuses_at_most_one_page_less(tiny_llama, manager):
    m = manager()
    run_engine(tiny_llama, m.endpoint, 320)  # exactly 10 pages
    run_engine(tiny_llama, m.endpoint, 320)
    stats = m.stats()
    # vLLM must compute the last prompt token: the boundary is 288, never 320.
    assert stats["hits"]["dram"] == 9 and stats["bytes_read"]["dram"] == 9 * PAGE_BYTES


def test_forced_ssd_hits_read_exactly_the_selected_ranges(tiny_llama, manager):
    m = manager(pool="256kb", ssd=True)  # 4 pages of DRAM for a 9-page prompt
    cold = run_engine(tiny_llama, m.endpoint, PROMPT)
    assert m.stats()["bytes_written"]["ssd"] > 0
    m.stop()
    restarted = manager(pool="1mb", ssd=True)  # a restarted manager: everything comes from SSD
    warm = run_engine(tiny_llama, restarted.endpoint, PROMPT)
    stats = restarted.stats()
    assert stats["hits"]["ssd"] > 0
    assert stats["bytes_read"]["ssd"] == stats["hits"]["ssd"] * PAGE_BYTES  # nothing beyond the selected pages
    assert same_output(cold, warm)


def test_a_sliding_window_model_restores_with_the_hybrid_allocator_on(tiny_gemma, manager):
    m = manager()
    cold = run_engine(tiny_gemma, m.endpoint, PROMPT)
    saved = m.stats()["bytes_written"]["dram"]
    # Two KV cache groups (the hybrid allocator stayed on): 9 full-attention pages of the 2 full
    # layers, and only the 2 pages the 64-token window needs (63 past tokens) of the 2 window layers.
    assert saved == 11 * PAGE_BYTES
    warm = run_engine(tiny_gemma, m.endpoint, PROMPT)
    stats = m.stats()
    assert stats["hits"]["dram"] == 11 and stats["bytes_read"]["dram"] == 11 * PAGE_BYTES
    assert same_output(cold, warm), (cold, warm)
