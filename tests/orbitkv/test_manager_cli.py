"""The operator's view of a running manager: ``orbitkv-cache-manager stats`` and the Prometheus
metrics, both against real manager processes holding pages in DRAM and on SSD."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import urllib.request
from collections import defaultdict
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from cacheon_orbitkv.cli import build_parser, human_bytes
from cacheon_orbitkv.client import CacheClient, page_hashes
from cacheon_orbitkv.wire import checksum

NS = "model-0123:bf16:nhd:p16:r0"
PAGE = 64 << 10
POOL_PAGES = 16  # a 1 MiB pool of 64 KiB pages


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cacheon_orbitkv.manager", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def pages(first: int, n: int) -> list[tuple[bytes, bytes]]:
    hashes = page_hashes(NS, list(range(16 * (first + n))), 16)[first:]
    return [(h, bytes([(first + i) % 251 + 1]) * PAGE) for i, h in enumerate(hashes)]


def busy_manager(manager_factory, *extra: str):
    """A manager whose pages sit in both tiers, with hits from each, a miss, a corrupt page dropped on
    eviction, and (while the returned client stays open) one lease and one reservation held."""
    m = manager_factory(pool="1mb", ssd=True, ssd_capacity="4mb", extra=extra)
    c = CacheClient(m.endpoint)
    # A page scribbled on after its commit: eviction finds it failing its checksum and drops it.
    bad = pages(100, 1)[0]
    reservation, (offset,) = c.reserve(NS, 0, [(bad[0], PAGE)])
    c.view[offset : offset + PAGE] = bad[1]
    c.commit(reservation, [checksum(bad[1])])
    c.view[offset] ^= 0xFF
    stored = pages(0, 24)
    c.store(NS, 0, stored)  # 24 pages into a 16-page pool: the oldest go to SSD (the bad one is dropped)
    cold = c.read_recovery(NS, 32, [(0, [h for h, _ in stored[:2]])])  # promoted from SSD
    assert cold is not None
    c.release(cold.lease)
    hot = c.read_recovery(NS, 16, [(0, [stored[-1][0]])])  # held: leases 1
    assert hot is not None
    assert c.read_recovery(NS, 16, [(0, [pages(200, 1)[0][0]])]) is None  # a miss
    c.reserve(NS, 0, [(pages(300, 1)[0][0], PAGE)])  # held: reservations 1
    return m, c


def test_stats_prints_pages_bytes_and_counters_human_and_json(manager_factory):
    m, c = busy_manager(manager_factory)
    try:
        expected = m.stats()
        as_json = run_cli("stats", "--json", "--addr", m.endpoint)
        assert as_json.returncode == 0, as_json.stderr
        figures = json.loads(as_json.stdout)
        assert figures == expected
        # What the workload did, counted exactly.
        assert figures["hits"] == {"dram": 1, "ssd": 2} and figures["misses"] == 1
        assert figures["leases"] == 1 and figures["reservations"] == 1
        assert figures["corrupt"] == 1 and figures["internal_errors"] == 0
        assert figures["pages"]["dram"] == POOL_PAGES - 1  # one page's room is reserved
        assert figures["pages"]["ssd"] >= 2 and figures["evictions"] == figures["pages"]["ssd"] + 1
        for tier in ("dram", "ssd"):
            assert figures["stored_bytes"][tier] == figures["pages"][tier] * PAGE
        assert figures["capacity_bytes"] == {"dram": 1 << 20, "ssd": 4 << 20}
        assert figures["free_bytes"]["dram"] == 0
        assert figures["free_bytes"]["ssd"] == (4 << 20) - figures["stored_bytes"]["ssd"]

        human = run_cli("stats", "--addr", m.endpoint)
        assert human.returncode == 0, human.stderr
        lines = human.stdout.splitlines()
        assert lines[0] == f"orbitkv-cache-manager at {m.endpoint}"
        dram, ssd = figures["pages"]["dram"], figures["pages"]["ssd"]
        assert lines[1] == f"  DRAM {dram} pages, {human_bytes(dram * PAGE)} stored, 0 B free of 1.0 MiB"
        assert f"SSD  {ssd} pages, {human_bytes(ssd * PAGE)} stored, " in lines[2] and "of 4.0 MiB" in lines[2]
        rows = {line[:18].strip(): line[18:] for line in lines[3:]}
        assert rows["hits"] == "3 pages leased (1 from DRAM, 2 from SSD)"
        assert rows["misses"] == "1 read_recovery requests"
        assert rows["leases"] == "1" and rows["reservations"] == "1"
        assert rows["evictions"] == f"{figures['evictions']} pages left DRAM"
        assert rows["corrupt"] == "1 pages failed their checksum"
        assert rows["internal errors"] == "0"
        assert rows["bytes read"] == (
            f"DRAM {human_bytes(figures['bytes_read']['dram'])}, SSD {human_bytes(figures['bytes_read']['ssd'])}"
        )
    finally:
        c.close()


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Sample name -> labels -> value, from the manager's metrics endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name][tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def by_tier(samples: dict[tuple[tuple[str, str], ...], float]) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for labels, value in samples.items():
        totals[dict(labels)["tier"]] += value
    return dict(totals)


def test_metrics_carry_the_stats_figures_at_scrape_time(manager_factory):
    port = free_port()
    m, c = busy_manager(manager_factory, "--metrics-port", str(port))
    try:
        stats, metrics = m.stats(), scrape(port)
        tiers = ("dram", "ssd")
        for gauge, key in (
            ("orbitkv_pages", "pages"),
            ("orbitkv_stored_bytes", "stored_bytes"),
            ("orbitkv_free_bytes", "free_bytes"),
            ("orbitkv_capacity_bytes", "capacity_bytes"),
        ):
            assert {t: metrics[gauge][(("tier", t),)] for t in tiers} == stats[key], gauge
        assert metrics["orbitkv_leases_held"][()] == stats["leases"] == 1
        assert metrics["orbitkv_reservations_held"][()] == stats["reservations"] == 1
        assert by_tier(metrics["orbitkv_hits_total"]) == stats["hits"]
        assert sum(metrics["orbitkv_misses_total"].values()) == stats["misses"] == 1
        assert sum(metrics["orbitkv_evictions_total"].values()) == stats["evictions"]
        assert metrics["orbitkv_evictions_total"][(("to", "dropped"),)] == 1  # the corrupt page
        assert metrics["orbitkv_corrupt_total"][()] == stats["corrupt"] == 1
        assert metrics["orbitkv_internal_errors_total"][()] == stats["internal_errors"]
        assert by_tier(metrics["orbitkv_bytes_in_total"]) == stats["bytes_written"]
        assert by_tier(metrics["orbitkv_bytes_out_total"]) == stats["bytes_read"]

        # Gauges follow the state between scrapes: the lease and the reservation go with the client,
        # the reserved room is free again, and new pages show up in DRAM.
        c.close()
        with CacheClient(m.endpoint) as other:
            other.store(NS, 1, pages(400, 1))
            after, metrics = other.stats(), scrape(port)
        assert after["leases"] == 0 and after["reservations"] == 0
        assert metrics["orbitkv_leases_held"][()] == 0 and metrics["orbitkv_reservations_held"][()] == 0
        for gauge, key in (("orbitkv_pages", "pages"), ("orbitkv_stored_bytes", "stored_bytes")):
            assert {t: metrics[gauge][(("tier", t),)] for t in tiers} == after[key], gauge
        assert metrics["orbitkv_free_bytes"][(("tier", "dram"),)] == after["free_bytes"]["dram"]
        assert after["pages"]["dram"] == POOL_PAGES
        # The metrics port is no manager: one line and exit 1, not a traceback or a hang.
        http = run_cli("stats", "--addr", f"127.0.0.1:{port}", "--timeout", "3")
        assert http.returncode == 1 and http.stdout == "" and http.stderr.count("\n") == 1, http
    finally:
        c.close()


def test_stats_of_a_tcp_manager_takes_its_token_from_the_flag_or_the_environment(manager_factory, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    m = manager_factory(addr=f"127.0.0.1:{free_port()}", extra=("--auth-token-file", str(token)))
    with CacheClient(m.endpoint, token="s3cret-token") as c:
        c.store(NS, 0, pages(0, 3))
    refused = run_cli("stats", "--addr", m.endpoint)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and "got no token" in refused.stderr
    assert "Traceback" not in refused.stderr
    flag = run_cli("stats", "--json", "--addr", m.endpoint, "--auth-token-file", str(token))
    assert flag.returncode == 0, flag.stderr
    assert json.loads(flag.stdout)["pages"] == {"dram": 3, "ssd": 0}
    env = run_cli("stats", "--addr", m.endpoint, env={"ORBITKV_AUTH_TOKEN_FILE": str(token)})
    assert env.returncode == 0, env.stderr
    assert env.stdout.splitlines()[1].startswith("  DRAM 3 pages, 192.0 KiB stored")
    assert env.stdout.splitlines()[2] == "  SSD  none (DRAM-only caching)"


def test_an_unreachable_manager_is_one_line_and_a_non_zero_exit(manager_factory, sock_dir):
    gone = manager_factory()
    gone.kill()
    for addr in (f"unix://{sock_dir / 'nobody.sock'}", gone.endpoint, f"127.0.0.1:{free_port()}"):
        out = run_cli("stats", "--addr", addr)
        assert out.returncode == 1, (addr, out)
        assert out.stdout == "" and "Traceback" not in out.stderr
        assert out.stderr.count("\n") == 1 and out.stderr.startswith(f"error: cannot reach the cache manager at {addr}")
    bad = run_cli("stats", "--addr", "no-port-here")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_help_names_the_stats_command_and_the_manager_flags_still_run_a_manager(manager_factory):
    top = run_cli("--help")
    assert top.returncode == 0 and "orbitkv-cache-manager stats --addr ADDR [--json]" in " ".join(top.stdout.split())
    assert "--pool-size" in top.stdout and "--metrics-port" in top.stdout
    sub = run_cli("stats", "--help")
    assert sub.returncode == 0
    for flag in ("--addr", "--json", "--auth-token-file", "ORBITKV_AUTH_TOKEN_FILE", "--timeout"):
        assert flag in sub.stdout, flag
    assert "--pool-size" not in sub.stdout
    # Without the subcommand the flags are the manager's, as before: missing --pool-size is refused.
    missing = run_cli("--addr", "unix:///tmp/unused.sock")
    assert missing.returncode == 2 and "--pool-size" in missing.stderr
    m = manager_factory(pool="2mb")
    assert m.stats()["capacity_bytes"]["dram"] == 2 << 20


def test_the_systemd_unit_runs_the_manager_with_flags_it_accepts_and_waits_out_its_shutdown():
    unit = Path(__file__).parents[2] / "deploy" / "orbitkv-cache-manager.service"
    service: dict[str, str] = {}
    section = ""
    for raw in unit.read_text().replace("\\\n", " ").splitlines():
        line = raw.strip()
        if line.startswith("["):
            section = line
        elif line and not line.startswith("#") and section == "[Service]":
            key, _, value = line.partition("=")
            service[key] = value
    command = shlex.split(service["ExecStart"])
    assert command[0].endswith("/orbitkv-cache-manager")
    args = build_parser().parse_args(command[1:])  # exits (fails the test) on a flag the manager lacks
    assert args.addr == f"unix:///run/{service['RuntimeDirectory']}/orbitkv.sock"
    assert args.ssd_cache_path.startswith(f"/var/cache/{service['CacheDirectory']}/") and args.ssd_cache_capacity
    assert service["KillSignal"] == "SIGTERM" and float(service["TimeoutStopSec"]) > args.shutdown_timeout
    assert service["Restart"] == "on-failure" and service["RestartPreventExitStatus"] == "2"
    assert service["User"] not in ("", "root") and service.get("PrivateDevices", "no") == "no"
