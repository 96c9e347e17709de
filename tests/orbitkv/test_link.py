"""ManagerLink: an engine's connection is made on first use, re-made after the manager restarts, and
never closed under work still using it."""

from __future__ import annotations

import sys
import time

import pytest

from cacheon_orbitkv.arena import resident_bytes
from cacheon_orbitkv.link import LoadHandoff, ManagerLink
from cacheon_orbitkv.wire import ManagerUnavailable

NS = "ns:bf16:x:p4:r0"


def test_a_restarted_manager_is_found_again_with_its_new_arena(manager_factory):
    m = manager_factory()
    link = ManagerLink(m.endpoint, "test", retry_s=0.2)
    with link.session() as first:
        assert first is not None and link.connects == 1
        client, _ = first
        first_arena = client.info["arena"]
        client.store(NS, 0, [(b"\1" * 16, b"\0" * 64)])
    m.kill()
    with link.session() as same:
        assert same is not None and same[0] is client  # nothing noticed the death yet
        with pytest.raises(ManagerUnavailable) as lost:
            client.stats()
        link.failed(lost.value, client)
    with link.session() as none:
        assert none is None and link.attempts == 1  # retired; no attempt before retry_s
    restarted = manager_factory(sock=m.sock)
    time.sleep(0.3)
    with link.session() as second:
        assert second is not None and link.connects == 2
        assert second[0].info["arena"] != first_arena  # the new manager's arena, freshly mapped
        assert second[0].lookup(NS, {0: [b"\1" * 16]})[0] == {"dram": [], "ssd": []}
        # A late failure reported on the old connection does not retire the new one.
        link.failed(ManagerUnavailable("late"), client)
    with link.session() as still:
        assert still is not None and still[0] is second[0]
    assert restarted.stats()["leases"] == 0
    link.close()


def test_a_lost_connection_is_closed_only_when_its_last_holder_releases_it(manager_factory):
    m = manager_factory()
    link = ManagerLink(m.endpoint, "test", retry_s=60)
    held = link.acquire()
    assert held is not None
    held.client.store(NS, 0, [(b"\2" * 16, b"\7" * 64)])
    link.failed(ManagerUnavailable("gone"), held.client)  # e.g. another thread's call failed
    assert held.retired
    # Still usable by its holder: the socket and the arena mapping are open.
    assert held.client.stats()["leases"] == 0
    assert held.arena.cpu.numel() == held.client.info["arena_size"]
    link.release(held)
    with pytest.raises(ManagerUnavailable, match="went away"):  # closed with its last holder
        held.client.stats()
    link.close()


def test_an_unreachable_manager_is_retried_at_most_every_retry_s(sock_dir):
    link = ManagerLink(f"unix://{sock_dir / 'nobody.sock'}", "test", retry_s=60)
    assert link.connect() is False
    assert link.connect() is False and (link.attempts, link.connects) == (1, 0)  # the second made no attempt
    link.close()


@pytest.mark.gpu
def test_on_cuda_a_retired_connection_stays_registered_for_its_holder(manager_factory):
    """The reason holders exist: a CUDA copy reading a registered arena on one thread while another
    thread's call finds the manager gone. The arena stays registered until the holder releases it."""
    import torch

    from cacheon_orbitkv.transfer import GroupLayout, PagePlan, restore, save, segment_view

    m = manager_factory()
    link = ManagerLink(m.endpoint, "test", device="cuda:0", retry_s=60)
    held = link.acquire()
    assert held is not None and held.arena.cuda is not None
    rows = torch.randn(4, 4096, device="cuda").view(torch.uint8)
    layout = GroupLayout([segment_view(rows)])
    reservation, [offset] = held.client.reserve(NS, 0, [(b"\3" * 16, layout.page_bytes)])
    sums = save(held.arena, layout, [PagePlan(0, offset)], path="triton").checksums()
    held.client.commit(reservation, sums)
    recovery = held.client.read_recovery(NS, 0, [(0, [b"\3" * 16])])
    assert recovery is not None
    [ref] = recovery.pages[0]
    m.kill()
    link.failed(ManagerUnavailable("gone"), held.client)  # another thread noticed
    assert held.retired and held.arena.cuda is not None  # still registered for its holder
    fence = restore(held.arena, layout, [PagePlan(2, ref.offset, ref.checksum)], path="triton")
    assert fence.wait() == [True] and torch.equal(rows[2], rows[0])
    link.release(held)
    assert not held.arena._registered  # unregistered with its last holder


def test_saved_parts_commit_with_the_copys_checksums_and_a_failed_copy_aborts(manager_factory):
    import torch

    from cacheon_orbitkv.link import SavePart, save_parts
    from cacheon_orbitkv.transfer import GroupLayout, segment_view

    m = manager_factory()
    link = ManagerLink(m.endpoint, "test")
    with link.session() as connection:
        assert connection is not None
        client, arena = connection
        rows = torch.arange(4 * 64, dtype=torch.uint8).view(4, 64)
        layout = GroupLayout([segment_view(rows)])
        first, second = [b"\4" * 16, b"\5" * 16], [b"\7" * 16]
        parts = [SavePart(NS, 0, layout, first, [1, 3]), SavePart(NS, 0, layout, second, [2], key=1)]
        assert save_parts(client, arena, parts) == [2 * 64, 64]
        recovery = client.read_recovery(NS, 0, [(0, first + second)])
        assert recovery is not None
        assert [bytes(client.verified(ref)) for ref in recovery.pages[0]] == [bytes(rows[i]) for i in (1, 3, 2)]
        client.release(recovery.lease)
        # Stored pages are not written again; a copy that fails leaves no reservation behind and stops
        # only its own save.
        assert save_parts(client, arena, [SavePart(NS, 0, layout, first[:1], [1])]) == [0]
        odd = GroupLayout([segment_view(torch.zeros(2, 12, dtype=torch.uint8))])  # 12-byte chunks: no sum64
        outcomes = save_parts(
            client,
            arena,
            [SavePart(NS, 0, odd, [b"\6" * 16], [0]), SavePart(NS, 0, odd, [b"\x08" * 16], [1]),
             SavePart(NS, 0, layout, [b"\x09" * 16], [0], key=1)],
        )  # fmt: skip
        assert isinstance(outcomes[0], ValueError) and "multiples of 8" in str(outcomes[0])
        assert outcomes[1:] == [None, 64]
        assert m.stats()["reservations"] == 0
    link.close()


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [4096, 32768], ids=["sms", "staged"])
def test_on_cuda_saved_parts_are_copied_together_and_store_the_rows_bytes(manager_factory, chunk):
    """On a device, the parts reserved ahead are copied in one fill, one save per layout, left in flight
    until their checksums are needed; every page stored holds its engine row's bytes. A part whose rows
    the copy refuses fails alone (its save's later part aborted, the other save stored), and nothing
    stays reserved."""
    import torch

    from cacheon_orbitkv.client import CacheClient
    from cacheon_orbitkv.link import SavePart, save_parts
    from cacheon_orbitkv.transfer import GroupLayout

    m = manager_factory(pool="1gb")
    link = ManagerLink(m.endpoint, "test", device="cuda:0")
    with link.session() as connection:
        assert connection is not None and connection[1].cuda is not None
        client, arena = connection

        def layout_of() -> GroupLayout:  # 16 layers of K and V: pages of 128 KiB or 1 MiB
            layers = [torch.randint(0, 256, (2, 24, chunk), dtype=torch.uint8, device="cuda") for _ in range(16)]
            return GroupLayout([kv[i] for kv in layers for i in (0, 1)])

        layouts = [layout_of(), layout_of()]
        hashes = [bytes([i]) * 16 for i in range(1, 13)]
        rows = [[3, 7, 1], [20, 0, 9], [11, 12, 5], [23, 2, 17]]
        parts = [SavePart(NS, 0, layouts[i // 3], hashes[3 * i : 3 * i + 3], rows[i], key=i % 2) for i in range(4)]
        fills, shipped = [], CacheClient.store_parts

        def spied(self, wanted, fill, together=False):
            def watched(ks, slots):
                sums = fill(ks, slots)
                fills.append((list(ks), callable(sums)))
                return sums

            return shipped(self, wanted, watched, together)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(CacheClient, "store_parts", spied)
            assert save_parts(client, arena, parts) == [3 * layouts[0].page_bytes] * 4
        assert fills == [([0, 1, 2, 3], True)]  # one fill, in flight until its checksums were needed
        recovery = client.read_recovery(NS, 0, [(0, hashes)])
        assert recovery is not None
        for ref, part, row in zip(
            recovery.pages[0], [p for p in parts for _ in p.rows], [r for rs in rows for r in rs], strict=True
        ):
            want = torch.cat([seg[row] for seg in part.layout.segments]).cpu().numpy().tobytes()
            assert bytes(client.verified(ref)) == want
        client.release(recovery.lease)
        more = [bytes([i]) * 16 for i in range(20, 26)]
        outcomes = save_parts(
            client,
            arena,
            [SavePart(NS, 0, layouts[0], more[0:2], [0, 99], key="a"),  # row 99: past the engine's 24 blocks
             SavePart(NS, 0, layouts[0], more[2:4], [1, 2], key="b"),
             SavePart(NS, 0, layouts[0], more[4:6], [3, 4], key="a")],
        )  # fmt: skip
        assert isinstance(outcomes[0], Exception) and outcomes[1:] == [2 * layouts[0].page_bytes, None]
        assert m.stats()["reservations"] == 0
        assert client.lookup(NS, {0: more})[0]["dram"] == [2, 3]
        recovery = client.read_recovery(NS, 0, [(0, more[2:4])])
        assert recovery is not None
        assert [bytes(client.verified(ref)) for ref in recovery.pages[0]] == [
            torch.cat([seg[row] for seg in layouts[0].segments]).cpu().numpy().tobytes() for row in (1, 2)
        ]
        client.release(recovery.lease)
    link.close()


def test_a_connection_that_cannot_be_set_up_is_no_connection_with_one_warning(manager_factory, caplog):
    """An arena the engine cannot map and a failed CUDA registration (this machine has no CUDA: the
    registration of the arena fails at the same call it would on a host that refuses it) leave the
    engine without a cache, warned once per cause however often it retries."""
    import logging

    m = manager_factory()
    caplog.set_level(logging.DEBUG, logger="cacheon.orbitkv")
    on_cuda = ManagerLink(m.endpoint, "test", device="cuda", retry_s=0.0)
    for _ in range(3):
        assert not on_cuda.connect()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unusable" in warnings[0].getMessage(), warnings
    assert on_cuda.attempts == 3 and on_cuda.connects == 0

    caplog.clear()
    for arena in m.arenas():
        arena.unlink()
    unmapped = ManagerLink(m.endpoint, "test", retry_s=0.0)
    assert not unmapped.connect() and not unmapped.connect()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "FileNotFoundError" in warnings[0].getMessage(), warnings


def test_a_lookup_link_leaves_the_arena_untouched_and_a_copying_link_maps_it_all(manager_factory):
    """A scheduler's link (prefault=False) connects without touching one arena page, however large the
    pool: its first lookup pays no page faults. The default link maps every page up front."""
    m = manager_factory(pool="64mb")
    lookups = ManagerLink(m.endpoint, "lookups", prefault=False)
    with lookups.session() as connection:
        assert connection is not None
        client, _ = connection
        path, size = client.info["arena"], client.info["arena_size"]
        assert client.lookup(NS, {0: [b"\3" * 16]})[0] == {"dram": [], "ssd": []}
        assert resident_bytes(path) == 0
    copies = ManagerLink(m.endpoint, "copies")
    with copies.session() as connection:
        assert connection is not None
        assert resident_bytes(path) >= size  # every page of the copying link's mapping
    lookups.close()
    copies.close()


@pytest.fixture
def python_interval():
    """Python's thread switch interval, as it was before the test, set back after it."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_the_switch_interval_is_lowered_from_the_first_load_to_the_last_then_set_back(python_interval):
    handoff = LoadHandoff(200e-6)
    handoff.enter()
    assert sys.getswitchinterval() == pytest.approx(200e-6)
    handoff.enter()  # a second load while the first runs
    handoff.exit()
    assert sys.getswitchinterval() == pytest.approx(200e-6)  # one load still runs
    handoff.exit()
    assert sys.getswitchinterval() == pytest.approx(0.005)
    handoff.exit()  # one exit too many changes nothing
    assert sys.getswitchinterval() == pytest.approx(0.005)
    handoff.enter()  # and the next load lowers it again
    assert sys.getswitchinterval() == pytest.approx(200e-6)
    handoff.exit()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_the_switch_interval_is_only_lowered_and_never_set_back_over_someone_elses(python_interval):
    handoff = LoadHandoff(200e-6)
    handoff.enter()
    sys.setswitchinterval(0.001)  # the engine, or another library, sets its own while a load runs
    handoff.exit()
    assert sys.getswitchinterval() == pytest.approx(0.001)  # left as they set it
    sys.setswitchinterval(100e-6)  # already lower than the handoff's: left alone
    handoff.enter()
    assert sys.getswitchinterval() == pytest.approx(100e-6)
    handoff.exit()
    assert sys.getswitchinterval() == pytest.approx(100e-6)


def test_a_handoff_of_no_interval_leaves_python_alone_and_a_negative_one_is_refused(python_interval):
    for off in (None, 0, 0.0):
        handoff = LoadHandoff(off)
        handoff.enter()
        assert sys.getswitchinterval() == pytest.approx(0.005)
        handoff.exit()
    with pytest.raises(ValueError, match="switch interval"):
        LoadHandoff(-1e-6)
    with pytest.raises(ValueError, match="switch interval"):
        LoadHandoff(float("nan"))


def test_a_leases_columns_give_what_its_pages_one_by_one_give(manager_factory):
    """A lease of pages under two layout tags: the columns, the pages built one by one, the restore plan and
    the mismatch check (which names the first page that does not fit) agree; malformed columns are refused."""
    import numpy as np
    import torch

    from cacheon_orbitkv.client import CacheClient, LeasedPages, page_hashes
    from cacheon_orbitkv.link import lease_mismatch, leased_pages
    from cacheon_orbitkv.transfer import GroupLayout, segment_view
    from cacheon_orbitkv.wire import ProtocolError, pack_leased

    m = manager_factory()
    ns, page = "columns", 4096
    hashes = page_hashes(ns, list(range(16 * 6)), 16)
    data = [bytes([i]) * page for i in range(6)]
    layout = GroupLayout([segment_view(torch.zeros(8, page, dtype=torch.uint8))])
    with CacheClient(m.endpoint) as c:
        c.store(ns, 0, list(zip(hashes[:4], data[:4], strict=True)), tag="mine")
        c.store(ns, 0, list(zip(hashes[4:], data[4:], strict=True)), tag="theirs")
        rec = c.read_recovery(ns, 0, [(0, hashes[2:6]), (1, [])])
        assert rec is not None
        refs, one_by_one = rec.pages[0], list(rec.pages[0])
        assert isinstance(refs, LeasedPages) and len(refs) == 4 and list(rec.pages[1]) == []
        assert [r.tag for r in one_by_one] == ["mine", "mine", "theirs", "theirs"] == refs.tags
        assert [refs[i] for i in range(4)] == one_by_one and refs[1:3] == one_by_one[1:3]
        assert [bytes(c.verified(r)) for r in refs] == data[2:6]
        assert refs.offsets.tolist() == [r.offset for r in one_by_one] and not refs.offsets.flags.writeable
        plan, plan_of_refs = leased_pages([0, 1, 2, 3], refs), leased_pages([0, 1, 2, 3], one_by_one)
        assert plan.offsets.tolist() == plan_of_refs.offsets.tolist()
        assert plan.checksums is not None and plan_of_refs.checksums is not None
        assert plan.checksums.tolist() == plan_of_refs.checksums.tolist()
        for tag, why in [("mine", "tag 'theirs'"), ("theirs", "tag 'mine'"), ("other", "tag 'mine'")]:
            assert why in (lease_mismatch(refs, layout, tag) or "") and lease_mismatch(refs, layout, tag) == (
                lease_mismatch(one_by_one, layout, tag)
            )
        mine = c.read_recovery(ns, 0, [(0, hashes[:2])])
        assert mine is not None and lease_mismatch(mine.pages[0], layout, "mine") is None
        wide = GroupLayout([segment_view(torch.zeros(8, 2 * page, dtype=torch.uint8))])
        assert "is 4096 bytes, this layout's pages are 8192" in (lease_mismatch(mine.pages[0], wide, "mine") or "")
        c.release(rec.lease)
        c.release(mine.lease)
        assert c.stats()["leases"] == 0
    good = pack_leased(0, [0, 4096], [page, page], [1, 2**64 - 1], ["a", "b"])[1:]
    assert LeasedPages.unpack(good, 2).checksums.tolist() == [1, 2**64 - 1]
    for entry, count in [
        (good, 3),  # fewer pages than asked for
        ([*good[:3], ["a"], b""], 2),  # two pages, one tag, no index: fine
        ([*good[:4], np.array([0, 2], "<u4").tobytes()], 2),  # a tag index past the tags
        ([*good[:3], ["a", "b"], b""], 2),  # two tags and no index
        ([b"\x00" * 15, *good[1:]], 2),  # a column that is not whole integers
        (good[:4], 2),  # a column short
        ([7, *good[1:]], 2),  # not bytes
    ]:
        if entry[3] == ["a"]:
            assert LeasedPages.unpack(entry, count).tags == ["a", "a"]
            continue
        with pytest.raises(ProtocolError):
            LeasedPages.unpack(entry, count)


def test_a_lease_whose_reply_cannot_be_read_is_given_back_and_raises_a_protocol_error(manager_factory, monkeypatch):
    from cacheon_orbitkv.client import CacheClient, LeasedPages, page_hashes
    from cacheon_orbitkv.wire import ProtocolError

    m = manager_factory()
    hashes = page_hashes("columns", list(range(32)), 16)
    with CacheClient(m.endpoint) as c:
        c.store("columns", 0, [(h, b"x" * 4096) for h in hashes])

        def unreadable(entry, count):
            raise ProtocolError("a leased group's columns do not describe the pages asked for")

        monkeypatch.setattr(LeasedPages, "unpack", staticmethod(unreadable))
        with pytest.raises(ProtocolError, match="do not describe"):
            c.read_recovery("columns", 0, [(0, hashes)])
        assert c.stats()["leases"] == 0  # the release went out before the next request
        monkeypatch.undo()
        rec = c.read_recovery("columns", 0, [(0, hashes)])
        assert rec is not None and c.stats()["leases"] == 1
