"""ManagerLink: an engine's connection is made on first use and re-made after the manager restarts."""

from __future__ import annotations

import time

import pytest

from cacheon_orbitkv.link import ManagerLink
from cacheon_orbitkv.wire import ManagerUnavailable


def test_a_restarted_manager_is_found_again_with_its_new_arena(manager_factory):
    m = manager_factory()
    link = ManagerLink(m.endpoint, "test", retry_s=0.2)
    first = link.get()
    assert first is not None and link.connects == 1
    client, _ = first
    first_arena = client.info["arena"]
    client.store("ns:bf16:x:p4:r0", 0, [(b"\1" * 16, b"\0" * 64)])
    m.kill()
    with pytest.raises(ManagerUnavailable) as lost:
        client.stats()
    link.failed(lost.value)
    assert link.get() is None and link.current() is None and link.attempts == 1  # no attempt before retry_s
    restarted = manager_factory(sock=m.sock)
    time.sleep(0.3)
    second = link.get()
    assert second is not None and link.connects == 2
    assert second[0].info["arena"] != first_arena  # the new manager's arena, freshly mapped
    assert second[0].lookup("ns:bf16:x:p4:r0", {0: [b"\1" * 16]})[0] == {"dram": [], "ssd": []}
    assert restarted.stats()["leases"] == 0
    link.close()


def test_an_unreachable_manager_is_retried_at_most_every_retry_s(sock_dir):
    link = ManagerLink(f"unix://{sock_dir / 'nobody.sock'}", "test", retry_s=60)
    assert link.get() is None
    assert link.get() is None and (link.attempts, link.connects) == (1, 0)  # the second call made no attempt
    link.close()
