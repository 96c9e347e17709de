"""Two hosts' managers sharing a real Redis Cluster (3 primaries, 3 replicas, Debian's redis-server):
an engine on one host restores what an engine on the other saved."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tests.redis_cluster import RedisNodes

from .conftest import run_engine
from .test_connector import PAGE_BYTES, PROMPT, consumed, nothing_restored, same_output

REMOTE = ("--remote-timeout", "1", "--remote-retry", "1")


def host(manager, cluster) -> object:
    return manager(extra=("--remote", cluster.url, *REMOTE))


def written(m, pages: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while m.stats()["remote"]["pages_written"] < pages:
        assert time.monotonic() < deadline, m.stats()["remote"]
        time.sleep(0.1)


def test_an_engine_on_another_host_restores_a_prompt_from_the_cluster(tiny_llama, manager, redis_cluster):
    a, b = host(manager, redis_cluster), host(manager, redis_cluster)
    cold = run_engine(tiny_llama, a.endpoint, PROMPT)
    written(a, 9)
    assert a.stats()["remote"]["bytes_written"] == 9 * PAGE_BYTES
    warm = run_engine(tiny_llama, b.endpoint, PROMPT)  # B's manager never saw the prompt
    stats = b.stats()
    assert stats["hits"] == {"dram": 0, "ssd": 0, "remote": 9}
    assert stats["remote"]["bytes_read"] == 9 * PAGE_BYTES  # fetched from the cluster: pages x page bytes
    assert stats["bytes_written"]["dram"] == 0  # B's engine saved nothing: every full page came restored
    assert warm["metrics"]["vllm:external_prefix_cache_hits"] == 288
    nothing_restored(cold)
    consumed(warm, 9)  # the restored bytes reached vLLM's KV cache
    assert same_output(cold, warm), (cold, warm)


def test_a_primary_killed_as_restores_begin_costs_recomputes_never_wrong_output(tiny_llama, manager, tmp_path):
    redis_cluster = RedisNodes(tmp_path / "redis").start()  # its own: a primary dies here
    try:
        _killed_as_restores_begin(tiny_llama, manager, redis_cluster, tmp_path)
    finally:
        redis_cluster.stop()


def _killed_as_restores_begin(tiny_llama, manager, redis_cluster, tmp_path) -> None:
    prompts = 6
    a, b, c = (host(manager, redis_cluster) for _ in range(3))
    cold = run_engine(tiny_llama, a.endpoint, PROMPT, "--prompts", str(prompts))
    written(a, 9 * prompts)
    assert a.stats()["remote"]["hits"] == 0
    gate = tmp_path / "start"
    killed: list[int] = []

    def kill_at_gate() -> None:
        ready = Path(f"{gate}.ready")
        deadline = time.monotonic() + 600
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        primary = redis_cluster.primaries()[0]
        redis_cluster.kill(primary)  # B's lookups and restores start now
        killed.append(primary)
        gate.touch()

    killer = threading.Thread(target=kill_at_gate, daemon=True)
    killer.start()
    during = run_engine(tiny_llama, b.endpoint, PROMPT, "--prompts", str(prompts), "--start-file", str(gate))
    killer.join(10)
    assert killed
    for x, y in zip(cold["outputs"], during["outputs"], strict=True):
        assert same_output(x, y), (x, y)  # each request restored correctly or recomputed
    counters = during["connector"]
    # a planned restore either wrote all its 9 pages into vLLM's KV cache or failed whole (recomputed)
    assert counters["planned_pages"] == counters["pages_written"] + 9 * counters["failed_loads"], counters
    assert counters["failed_loads"] == counters["failed_loads_seen"] and counters["corrupt_pages"] == 0
    # the cluster fails over; a third host then restores every prompt from it
    redis_cluster.wait_ok(timeout=60)
    time.sleep(1.5)  # past the managers' breaker pause
    after = run_engine(tiny_llama, c.endpoint, PROMPT, "--prompts", str(prompts))
    assert c.stats()["remote"]["hits"] == 9 * prompts
    assert c.stats()["remote"]["bytes_read"] == 9 * prompts * PAGE_BYTES
    consumed(after, 9 * prompts)
    for x, y in zip(cold["outputs"], after["outputs"], strict=True):
        assert same_output(x, y), (x, y)
