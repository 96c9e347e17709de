"""OrbitKVConnector on the real vLLM CPU engine: restarts restore the prefix from OrbitKV, exactly."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

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
    # vLLM's scheduler saw the connector's hit: 9 pages of 32 tokens
    assert warm["metrics"]["vllm:external_prefix_cache_hits"] == 288
    assert cold["metrics"]["vllm:external_prefix_cache_hits"] == 0
    assert same_output(cold, warm), (cold, warm)


def test_a_changed_model_identity_misses_and_matches_the_cold_output(tiny_llama, manager):
    m = manager()
    cold = run_engine(tiny_llama, m.endpoint, PROMPT)
    other = run_engine(tiny_llama, m.endpoint, PROMPT, "--fingerprint", "another-model-identity")
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


def test_a_failed_restore_is_recomputed_through_vllms_failure_path(tiny_gemma, manager):
    # A preparation limit of zero fails every restore before it reads anything: on the hybrid model
    # (two KV cache groups, where vLLM refuses block-level errors) the request is reported in
    # failed_recving, recomputed, and answers as the cold run did.
    m = manager()
    cold = run_engine(tiny_gemma, m.endpoint, PROMPT)
    failed = run_engine(tiny_gemma, m.endpoint, PROMPT, "--extra", '{"prepare_timeout_s": 0}')
    stats = m.stats()
    assert failed["metrics"]["vllm:external_prefix_cache_hits"] == 288  # the hit was claimed...
    assert stats["bytes_read"]["dram"] == 0 and stats["hits"]["dram"] == 0  # ...and nothing was read
    assert stats["leases"] == 0 and stats["reservations"] == 0
    assert failed["outputs"][0]["finish_reason"] == "length"
    assert same_output(cold, failed), (cold, failed)


def test_under_the_fail_policy_a_failed_restore_fails_its_request_not_the_engine(tiny_llama, manager):
    m = manager()
    run_engine(tiny_llama, m.endpoint, PROMPT)
    failed = run_engine(
        tiny_llama, m.endpoint, PROMPT, "--extra", '{"prepare_timeout_s": 0}', "--failure-policy", "fail"
    )
    assert failed["outputs"][0]["finish_reason"] == "error" and failed["ids"] == []
    assert m.stats()["leases"] == 0


def test_a_request_aborted_while_its_restore_runs_releases_everything(tiny_llama, manager):
    m = manager()
    cold = run_engine(tiny_llama, m.endpoint, PROMPT)
    run = run_engine(tiny_llama, m.endpoint, PROMPT, "--abort-while-loading")
    abort = run["abort"]
    assert abort["waiting_for_remote_kvs"], abort  # aborted while vLLM waited for the restore
    assert abort["manager_leases"] == 0 and abort["manager_reservations"] == 0  # engine still alive
    assert abort["worker_inflight"] == 0
    assert abort["scheduler_state"] == {"matches": 0, "queued_loads": 0, "loading": 0, "prefills": 0, "failed": 0}
    assert abort["free_blocks"] == abort["total_blocks"] - 1  # every block back (vLLM keeps one null block)
    assert same_output(cold, run), (cold, run)  # the same engine then restores and answers correctly


def test_preempted_requests_resume_from_orbitkv_and_answer_the_same(tiny_llama, manager):
    # Two 200-token prompts decoding 150 tokens each need 22 blocks; 17 force a preemption. The
    # preempted request's prompt pages were saved at its prefill, so (vLLM's own prefix cache off)
    # it resumes from OrbitKV.
    m = manager()
    shape = ["--prompts", "2", "--max-tokens", "150", "--max-model-len", "512", "--no-prefix-caching"]
    reference = run_engine(tiny_llama, m.endpoint, 200, *shape, "--fingerprint", "reference-identity")
    preempted = run_engine(tiny_llama, m.endpoint, 200, *shape, "--num-blocks", "17")
    assert reference["metrics"]["vllm:num_preemptions"] == 0
    assert preempted["metrics"]["vllm:num_preemptions"] >= 1
    # (vLLM counts external hits at first admission only: the resume shows in the manager's reads)
    stats = m.stats()
    assert stats["hits"]["dram"] > 0 and stats["bytes_read"]["dram"] == stats["hits"]["dram"] * PAGE_BYTES
    assert stats["leases"] == 0
    for ref, out in zip(reference["outputs"], preempted["outputs"], strict=True):
        assert same_output(ref, out), (ref, out)


RECURRENT_PAGE = 137216  # two gated-delta-net layers' conv + recurrent state at one boundary (bf16)
RECURRENT_ATTENTION_PAGE = 2 * 2 * 160 * 2 * 64 * 2  # 2 layers x (K, V) x 160-token block x 2 heads x 64 x bf16


def test_an_aligned_mamba_model_restores_its_checkpoint_and_answers_the_same(tiny_recurrent, manager):
    # vLLM aligns the Mamba state to 160-token blocks: a 300-token prompt has one full page, so the
    # restore is the attention page [0, 160) and the recurrent checkpoint at 160, nothing else.
    m = manager()
    cold = run_engine(tiny_recurrent, m.endpoint, PROMPT, "--dtype", "bfloat16")
    assert cold["block_size"] == 160
    saved = m.stats()["bytes_written"]["dram"]
    assert saved == RECURRENT_PAGE + RECURRENT_ATTENTION_PAGE
    warm = run_engine(tiny_recurrent, m.endpoint, PROMPT, "--dtype", "bfloat16")
    stats = m.stats()
    assert warm["metrics"]["vllm:external_prefix_cache_hits"] == 160
    assert stats["hits"]["dram"] == 2 and stats["bytes_read"]["dram"] == saved
    assert stats["leases"] == 0 and stats["reservations"] == 0
    assert same_output(cold, warm), (cold, warm)


def test_a_mamba_model_without_aligned_state_is_refused_at_startup(tiny_recurrent, manager):
    m = manager()
    with pytest.raises(AssertionError, match="mamba_cache_mode 'none'; only 'align'"):
        run_engine(tiny_recurrent, m.endpoint, PROMPT, "--dtype", "bfloat16", "--no-prefix-caching")


def test_tensor_parallel_ranks_save_and_restore_their_own_shards(tiny_llama, manager):
    # Each of two tensor-parallel ranks holds one of the two KV heads: a half page under its own
    # namespace. The single-rank engine's whole pages are another identity and never restored.
    m = manager()
    single = run_engine(tiny_llama, m.endpoint, PROMPT)
    tp_cold = run_engine(tiny_llama, m.endpoint, PROMPT, "--tp", "2")
    after_cold = m.stats()
    assert after_cold["hits"]["dram"] == 0  # TP=2 does not restore TP=1 pages
    assert after_cold["bytes_written"]["dram"] == 9 * PAGE_BYTES + 2 * 9 * PAGE_BYTES // 2
    tp_warm = run_engine(tiny_llama, m.endpoint, PROMPT, "--tp", "2")
    stats = m.stats()
    assert tp_warm["metrics"]["vllm:external_prefix_cache_hits"] == 288
    assert stats["hits"]["dram"] == 18 and stats["bytes_read"]["dram"] == 9 * PAGE_BYTES  # 9 pages x 2 halves
    assert stats["leases"] == 0
    assert same_output(single, tp_cold) and same_output(tp_cold, tp_warm), (single, tp_cold, tp_warm)


def test_an_engine_reconnects_to_a_restarted_manager_and_saves_there(tiny_llama, manager, tmp_path):
    """The manager restarts under a live engine: the engine keeps serving (misses meanwhile), its
    scheduler and worker reconnect, and a new engine restores what the reconnected one saved."""
    m = manager()
    gate = tmp_path / "gate"
    with ThreadPoolExecutor(max_workers=1) as pool:
        live = pool.submit(run_engine, tiny_llama, m.endpoint, PROMPT, "--no-prefix-caching", "--wait-file", str(gate))
        deadline = time.monotonic() + 600
        while not Path(f"{gate}.ready").exists():
            assert not live.done(), live.result()
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert m.stats()["bytes_written"]["dram"] == 9 * PAGE_BYTES
        m.stop()
        restarted = manager(sock=m.sock)  # the same address, an empty store
        gate.touch()
        cold = live.result()
    assert cold["after_wait"] == [cold["ids"], cold["ids"]]  # served throughout, same answers
    assert restarted.stats()["bytes_written"]["dram"] == 9 * PAGE_BYTES  # saved after reconnecting
    warm = run_engine(tiny_llama, restarted.endpoint, PROMPT)
    assert restarted.stats()["bytes_read"]["dram"] == 9 * PAGE_BYTES
    assert same_output(cold, warm)
