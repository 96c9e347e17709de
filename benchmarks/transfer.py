"""OrbitKV GPU transfers on the H200, every figure against a ceiling measured in the same run.

- the pinned contiguous copy ceiling each way (device <-> the CUDA-registered arena);
- a naive per-page ``copy_`` loop (128 KiB pages);
- OrbitKV save and restore, 32 layers x 256 scattered pages (K and V segments per layer), at page
  sizes 16 KiB, 64 KiB, 256 KiB and 2 MiB, on the path ``choose_path`` picks, with and without
  checksums (interleaved, medians of 9) and the checksum's cost; for the Triton path, the restore on the
  SMs replayed from a CUDA graph and launched eagerly, the moving kernel alone, the host's time per
  restore call, and (16 and 64 KiB) four restore calls back to back; where restores are staged through
  device memory (page extents of ``transfer.STAGED_MIN_EXTENT``: 512 KiB and more, 16 KiB pages and up) and
  saves (1 MiB and more, 64 KiB pages and up), the same calls on the SMs against them and the restore's
  copy alone (every extent into HBM in one batched copy, the staged path's own ceiling); plus save and
  restore running at the same time on two streams;
- restoring a 32k-token Llama-3-8B-shaped KV prefix (32 layers, 8 KV heads, head dim 128, bf16)
  versus recomputing that prefill with a random-weight model of that shape.

    python benchmarks/transfer.py [--out DIR] [--sections ceilings,orbitkv] [--staged-min-kib K]
    (needs a CUDA device)
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import sys
import time
import traceback

import numpy as np
import torch

from cacheon_orbitkv import transfer
from cacheon_orbitkv.transfer import Arena, GroupLayout, PagePlan, Pages, choose_path, restore, save

GB = 1e9


def event_time(fn, reps: int = 3) -> float:
    """Best of ``reps`` GPU-timed runs, seconds."""
    best = math.inf
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def interleaved_medians(variants: dict, rounds: int) -> dict[str, float]:
    """Each variant GPU-timed once per round, the variants interleaved (drift hits all alike); the
    median seconds of each."""
    timed: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            timed[name].append(event_time(fn, 1))
    return {name: float(np.median(ts)) for name, ts in timed.items()}


def rated(rows: list, name: str, nbytes: int, seconds: float, ceiling_gbs: float) -> float:
    """Append a row (name, bytes, seconds, GB/s, fraction of the ceiling); return the fraction."""
    rate = nbytes / seconds / GB
    rows.append([name, nbytes, seconds, rate, rate / ceiling_gbs])
    return rate / ceiling_gbs


class AtOnce:
    """Two pieces of GPU work at once, each on its own stream, both ordered after the work already
    on the current stream and before its next: ``AtOnce()(first, second)`` returns what they return,
    ``AtOnce().of(first, second)`` a function that does it (to time)."""

    def __init__(self) -> None:
        self.streams = torch.cuda.Stream(), torch.cuda.Stream()

    def __call__(self, first, second) -> tuple:
        current = torch.cuda.current_stream()
        for stream in self.streams:
            stream.wait_stream(current)
        with torch.cuda.stream(self.streams[0]):
            a = first()
        with torch.cuda.stream(self.streams[1]):
            b = second()
        for stream in self.streams:
            current.wait_stream(stream)
        return a, b

    def of(self, first, second):
        return lambda: self(first, second)


def make_arena(size: int) -> Arena:
    region = mmap.mmap(-1, size, flags=mmap.MAP_SHARED)
    began = time.perf_counter()
    np.frombuffer(region, dtype=np.uint8)[:: mmap.PAGESIZE] = 0  # pre-fault every page
    prefault_s = time.perf_counter() - began
    began = time.perf_counter()
    arena = Arena(region, device="cuda")
    register_s = time.perf_counter() - began
    arena.stats = {"prefault_s": prefault_s, "register_s": register_s}  # type: ignore[attr-defined]
    return arena


def ceilings(arena: Arena, rows: list, nbytes: int) -> dict:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = arena.cpu[:nbytes]
    d2h = event_time(lambda: host.copy_(dev, non_blocking=True))
    h2d = event_time(lambda: dev.copy_(host, non_blocking=True))
    rows.append(["ceiling: contiguous device -> registered arena", nbytes, d2h, nbytes / d2h / GB])
    rows.append(["ceiling: contiguous registered arena -> device", nbytes, h2d, nbytes / h2d / GB])
    half = nbytes // 2
    dev_in = torch.empty(half, dtype=torch.uint8, device="cuda")
    both = AtOnce().of(
        lambda: arena.cpu[:half].copy_(dev[:half], non_blocking=True),
        lambda: dev_in.copy_(arena.cpu[half : 2 * half], non_blocking=True),
    )
    bidi = event_time(both)
    rows.append(["ceiling: contiguous both directions at once (aggregate)", 2 * half, bidi, 2 * half / bidi / GB])
    return {"save": nbytes / d2h / GB, "restore": nbytes / h2d / GB, "both": 2 * half / bidi / GB}


def layout_for(page_bytes: int, layers: int = 32, blocks: int = 512) -> GroupLayout:
    chunk = page_bytes // 2
    segments = []
    for _ in range(layers):
        layer = torch.empty(2, blocks, chunk, dtype=torch.uint8, device="cuda")
        layer.random_(0, 256)
        segments += [layer[0], layer[1]]
    return GroupLayout(segments)


def plans(layout: GroupLayout, n: int, seed: int, base: int = 0) -> list[PagePlan]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(layout.segments[0].shape[0], generator=g)[:n].tolist()
    return [PagePlan(b, base + i * layout.page_bytes) for i, b in enumerate(blocks)]


def as_pages(pages: list[PagePlan], sums: list[int] | None = None) -> Pages:
    """The pages as the engine adapters pass them to save and restore: arrays, not one object each."""
    return Pages.of([p.block for p in pages], [p.offset for p in pages], sums)


def naive(arena: Arena, rows: list) -> None:
    layout = layout_for(128 << 10, layers=32)
    pages = plans(layout, 256, 1)

    def loop():
        for page in pages:
            at = page.offset
            for seg, chunk in zip(layout.segments, layout.chunks, strict=True):
                arena.cpu[at : at + chunk].copy_(seg[page.block], non_blocking=True)
                at += chunk

    total = 256 * layout.page_bytes
    t = event_time(loop, 2)
    rows.append(["naive per-chunk copy_ loop, 32 x 256 x 128 KiB pages", total, t, total / t / GB])


def one_size(arena: Arena, rows: list, ceiling: dict, results: dict, size: int) -> None:
    layout = layout_for(size, layers=32)
    pages = plans(layout, 256, size)
    total = 256 * layout.page_bytes
    path = choose_path(layout, "cuda")
    sums = save(arena, layout, pages).checksums()
    restore_plans, save_pages = as_pages(pages, sums), as_pages(pages)
    shipped = restore(arena, layout, restore_plans)
    assert all(shipped.wait()), "a restored page failed its checksum"
    assert shipped.checksums() == sums
    launch = transfer._launch_triton if path == "triton" else transfer._copy_engine
    variants = {
        "save": lambda: save(arena, layout, save_pages),
        "plain_save": lambda: launch(arena, layout, save_pages, True, checksums=False),
        "restore": lambda: restore(arena, layout, restore_plans),
        "plain_restore": lambda: launch(arena, layout, save_pages, False, checksums=False),
    }
    if shipped.path == "staged":
        # The same restore on the SMs (replayed from its CUDA graph), and the staged path's own ceiling:
        # every page's extent copied into HBM in one batched copy, nothing scattered or summed.
        on_sms = restore(arena, layout, restore_plans, path="triton")
        assert all(on_sms.wait()) and on_sms.checksums() == sums
        variants["restore_sm"] = lambda: restore(arena, layout, restore_plans, path="triton")
        variants["restore_extents"] = extents_copy(arena, restore_plans, layout.page_bytes)
        # Where the save is staged as well (its own ring; from larger extents than restores), against the same
        # save on the SMs.
        staged_save = save(arena, layout, save_pages)
        assert staged_save.checksums() == sums
        if staged_save.path == "staged":
            variants["save_sm"] = lambda: save(arena, layout, save_pages, path="triton")
    if path == "triton":
        # The moving kernel alone over a work table built before timing: what a restore call on the SMs
        # adds around it (the host's work before the kernel starts, the table and the verdicts) is the
        # gap between this and that restore.
        prebuilt = transfer._work_table(arena, layout, restore_plans, expected=True)
        variants["restore_kernel"] = lambda: transfer._move_items(prebuilt, False)
        # The restore on the SMs launched eagerly (its table kernel, moving kernel and comparison one by one),
        # against the call replayed from a CUDA graph captured on its first call at this size.
        eager_fence = restore(arena, layout, restore_plans, path="triton", graphs=False)
        assert all(eager_fence.wait()), "a restored page failed its checksum"
        assert eager_fence.checksums() == sums
        variants["restore_eager"] = lambda: restore(arena, layout, restore_plans, path="triton", graphs=False)
    if size <= 64 << 10:
        # Four restore calls of 256 pages each, issued back to back as an engine issues the restores
        # of several requests: each call's host work overlaps the previous call's copy.
        batches = [restore_plans]
        for k in range(1, 4):
            more = plans(layout, 256, size + k, base=k * total)
            more_sums = save(arena, layout, more).checksums()
            batches.append(as_pages(more, more_sums))
        assert all(all(restore(arena, layout, b).wait()) for b in batches), "a restored page failed its checksum"
        variants["restore_x4"] = lambda: [restore(arena, layout, b) for b in batches]
    for fn in variants.values():  # compile every kernel variant before timing
        fn()
    torch.cuda.synchronize()
    host: dict[str, list[float]] = {k: [] for k in ("restore", "restore_eager", "restore_sm") if k in variants}
    for _ in range(9):  # the host's time in one restore call, not waiting for the GPU
        for name, spent in host.items():
            began = time.perf_counter()
            variants[name]()
            spent.append(time.perf_counter() - began)
            torch.cuda.synchronize()
    # With and without checksums interleaved, 9 rounds, medians: drift hits both alike. The plain
    # copies are timed twice per round: the gap between their two medians is the noise floor.
    timed: dict[str, list[float]] = {k: [] for k in (*variants, "plain_save_again", "plain_restore_again")}
    for _ in range(9):
        for name, fn in variants.items():
            timed[name].append(event_time(fn, 1))
        timed["plain_save_again"].append(event_time(variants["plain_save"], 1))
        timed["plain_restore_again"].append(event_time(variants["plain_restore"], 1))
    median = {k: float(np.median(v)) for k, v in timed.items()}
    with_sum_save, with_sum_restore, plain_save, plain_restore = (
        median[k] for k in ("save", "restore", "plain_save", "plain_restore")
    )
    noise = max(
        abs(median["plain_save_again"] / plain_save - 1), abs(median["plain_restore_again"] / plain_restore - 1)
    )
    label = f"{size >> 10} KiB pages x 32 layers x 256 pages, path {path}"
    if shipped.path != path:
        label += f" (save and restore {shipped.path})" if "save_sm" in variants else f" (restore {shipped.path})"
    rows.append(
        [
            f"OrbitKV save, {label}",
            total,
            with_sum_save,
            total / with_sum_save / GB,
            total / with_sum_save / GB / ceiling["save"],
        ]
    )
    rows.append(
        [
            f"OrbitKV restore, {label}",
            total,
            with_sum_restore,
            total / with_sum_restore / GB,
            total / with_sum_restore / GB / ceiling["restore"],
        ]
    )
    rows.append(
        [
            "  the same without checksums (save; restore)",
            total,
            plain_save,
            total / plain_save / GB,
            total / plain_restore / GB,
        ]
    )
    for name, label, hosts in (
        ("save_sm", "  the same save on the SMs", None),
        (
            "restore_sm",
            "  the same restore on the SMs, replayed from its CUDA graph; its host time per call",
            "restore_sm",
        ),
        ("restore_extents", "  the staged restore's copy alone: every extent into HBM, one batch", None),
        ("restore_eager", "  the restore on the SMs launched eagerly; its host time per call", "restore_eager"),
        (
            "restore_kernel",
            "  the SMs' moving kernel alone (work table built before timing); host time per shipped restore call",
            "restore",
        ),
    ):
        if name in median:
            gbs = total / median[name] / GB
            spent = f"; {float(np.median(host[hosts])) * 1e6:.0f} us host" if hosts else ""
            rows.append(
                [
                    label,
                    total,
                    median[name],
                    gbs,
                    f"{gbs / ceiling['save' if name.startswith('save') else 'restore']:.2f} of ceiling{spent}",
                ]
            )
    if "restore_x4" in median:
        rows.append(
            [
                "  four restore calls of 256 pages each, back to back (per-call host work overlapped)",
                4 * total,
                median["restore_x4"],
                4 * total / median["restore_x4"] / GB,
                4 * total / median["restore_x4"] / GB / ceiling["restore"],
            ]
        )
    results[size] = {
        "path": path,
        "restore_x4": 4 * total / median["restore_x4"] / GB if "restore_x4" in median else None,
        "restore_kernel": total / median["restore_kernel"] / GB if "restore_kernel" in median else None,
        "restore_path": shipped.path,
        "restore_host_us": float(np.median(host["restore"])) * 1e6,
        "restore_eager": total / median["restore_eager"] / GB if "restore_eager" in median else None,
        "restore_eager_host_us": float(np.median(host["restore_eager"])) * 1e6 if "restore_eager" in host else None,
        "restore_sm": total / median["restore_sm"] / GB if "restore_sm" in median else None,
        "restore_sm_host_us": float(np.median(host["restore_sm"])) * 1e6 if "restore_sm" in host else None,
        "restore_extents": total / median["restore_extents"] / GB if "restore_extents" in median else None,
        "save_sm": total / median["save_sm"] / GB if "save_sm" in median else None,
        "save": total / with_sum_save / GB,
        "restore": total / with_sum_restore / GB,
        "save_nosum": total / plain_save / GB,
        "restore_nosum": total / plain_restore / GB,
        "spread": {k: (min(v), max(v)) for k, v in timed.items()},
        "noise": noise,
    }


def extents_copy(arena: Arena, pages: Pages, page_bytes: int):
    """A function that copies every page's arena extent into one device buffer in one batched copy (on a
    side stream ordered after and before the current one): the staged restore's copy without its groups,
    its scatter and its sums. Checked once before it is returned."""
    batch = transfer.BatchCopy.get()
    assert batch is not None, "this driver has no cuMemcpyBatchAsync"
    n = len(pages)
    into = torch.empty(n * page_bytes, dtype=torch.uint8, device="cuda")
    sources = np.uint64(arena.cpu.data_ptr()) + pages.offsets.astype(np.uint64)
    targets = np.uint64(into.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(page_bytes)
    sizes = np.full(n, page_bytes, dtype=np.uint64)
    side = torch.cuda.Stream()

    def copy(into=into) -> None:  # holds the buffer: the addresses above are into it
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            batch.copy(targets, sources, sizes)
        torch.cuda.current_stream().wait_stream(side)

    copy()
    torch.cuda.synchronize()
    for i in (0, n // 2, n - 1):
        at = int(pages.offsets[i])
        assert torch.equal(into[i * page_bytes : (i + 1) * page_bytes].cpu(), arena.cpu[at : at + page_bytes])
    return copy


def both_directions(arena: Arena, rows: list, ceiling: dict, results: dict, size: int, count: int) -> None:
    """Save and restore at once, each on its own stream, through the path ``choose_path`` picks:
    256 KiB pages on the SMs (each Triton grid capped, so that both run: best of 1-8 programs per SM
    each), 2 MiB pages on the copy engines; and at 256 KiB the restore staged (the copy engines bring the
    extents in) while the save is staged too or runs on a capped SM grid. Checked first: the restored bytes
    and verdicts, and the saved pages' checksums against a save of the same pages on its own."""
    out_layout = layout_for(size, layers=32)
    in_layout = layout_for(size, layers=32)
    total = count * out_layout.page_bytes
    out_pages = plans(out_layout, count, 11)
    in_pages = plans(in_layout, count, 12, base=total)
    sums = save(arena, in_layout, in_pages).checksums()
    in_restore, out_save = as_pages(in_pages, sums), as_pages(out_pages)
    want = torch.cat([seg[p.block] for p in in_pages for seg in in_layout.segments]).clone()
    saved = save(arena, out_layout, out_save).checksums()
    path = choose_path(out_layout, "cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    at_once = AtOnce()

    def both(cap: int | None) -> tuple:
        return at_once(
            lambda: save(arena, out_layout, out_save, programs=cap),
            lambda: restore(arena, in_layout, in_restore, programs=cap),
        )

    caps = [sms * per_sm for per_sm in (1, 2, 4, 8)] if path == "triton" else [None]
    best = (math.inf, None)
    for cap in caps:
        for seg in in_layout.segments:
            seg[[p.block for p in in_pages]] = 0
        out, back = both(cap)
        assert out.checksums() == saved and all(back.wait()), ("both at once", size, cap)
        assert torch.equal(torch.cat([seg[p.block] for p in in_pages for seg in in_layout.segments]), want)
        t = event_time(lambda cap=cap: both(cap))
        results[f"both_{size}_{cap}"] = 2 * total / t / GB
        best = min(best, (t, cap), key=lambda x: x[0])
    t, cap = best
    shape = f"grids of {cap} programs (best of 1-8 per SM)" if cap else "copy engines"
    name = f"save and restore at once, {size >> 10} KiB pages x 32 layers x {count} each way, {shape}; aggregate"
    results[f"both_{size}"] = rated(rows, name, 2 * total, t, ceiling["both"])
    if path == "triton" and in_layout.page_bytes >= transfer.STAGED_MIN_EXTENT[False]:
        # The restore staged (the copy engines bring the extents in, the SMs scatter them in HBM) while the
        # save is staged too (as shipped: the SMs gather, the copy engines take the extents out), or runs on
        # the SMs with its grid capped (1-8 programs per SM) so that the restore's scatters find SMs.
        def staged(cap: int | None) -> tuple:
            return at_once(
                lambda: save(arena, out_layout, out_save, programs=cap), lambda: restore(arena, in_layout, in_restore)
            )

        shipped_save = "staged" if out_layout.page_bytes >= transfer.STAGED_MIN_EXTENT[True] else "triton"
        best = (math.inf, None)
        for cap in [None, *caps]:
            for seg in in_layout.segments:
                seg[[p.block for p in in_pages]] = 0
            out, back = staged(cap)
            assert out.path == (shipped_save if cap is None else "triton"), out.path
            assert back.path == "staged" and out.checksums() == saved and all(back.wait()), ("staged", size, cap)
            assert torch.equal(torch.cat([seg[p.block] for p in in_pages for seg in in_layout.segments]), want)
            t = event_time(lambda cap=cap: staged(cap))
            results[f"both_{size}_staged_{cap}"] = 2 * total / t / GB
            best = min(best, (t, cap), key=lambda x: x[0])
        t, cap = best
        name = (
            f"save and restore at once, {size >> 10} KiB pages x 32 layers x {count} each way, restore staged, "
            f"save {f'on a grid of {cap} programs' if cap else shipped_save} (best of shipped, SMs 1-8 per SM); "
            "aggregate"
        )
        results[f"both_{size}_staged"] = rated(rows, name, 2 * total, t, ceiling["both"])


def orbitkv(arena: Arena, rows: list, ceiling: dict, results: dict) -> None:
    for size in (16 << 10, 64 << 10, 256 << 10, 2 << 20):
        one_size(arena, rows, ceiling, results, size)
        torch.cuda.empty_cache()
    for size, count in ((256 << 10, 256), (2 << 20, 64)):
        both_directions(arena, rows, ceiling, results, size, count)
        torch.cuda.empty_cache()


def llama_prefix(arena: Arena, rows: list, results: dict) -> None:
    layers, kv_heads, dim, tokens, block = 32, 8, 128, 32768, 16
    blocks = tokens // block
    segments = []
    for _ in range(layers):
        # vLLM 0.33's GPU runner: [B, H, N, C] per layer, C = a head's K and V, in LBNHC memory order
        layer = torch.empty(blocks, block, kv_heads, 2 * dim, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
        segments += transfer.block_runs(layer, "HNC").segments
    layout = GroupLayout(transfer.coalesce(segments))
    pages = [PagePlan(b, b * layout.page_bytes) for b in range(blocks)]
    sums = save(arena, layout, pages).checksums()
    plans_ = as_pages(pages, sums)
    fence = restore(arena, layout, plans_)
    assert all(fence.wait()) and fence.checksums() == sums
    restore_s = event_time(lambda: restore(arena, layout, plans_))
    total = blocks * layout.page_bytes
    rows.append(
        [
            f"restore a 32k-token Llama-3-8B KV prefix, vLLM 0.33 GPU layout ({fence.path})",
            total,
            restore_s,
            total / restore_s / GB,
        ]
    )
    torch.cuda.empty_cache()

    hidden, heads, ffn = 4096, 32, 14336
    torch.manual_seed(0)
    w = lambda *s: torch.randn(*s, dtype=torch.bfloat16, device="cuda") * 0.02  # noqa: E731
    weights = [
        (w(hidden, hidden + 2 * kv_heads * dim), w(hidden, hidden), w(hidden, 2 * ffn), w(ffn, hidden))
        for _ in range(layers)
    ]

    def prefill(n: int) -> None:
        x = torch.randn(1, n, hidden, dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            for qkv_w, o_w, up_w, down_w in weights:
                h = torch.nn.functional.rms_norm(x, (hidden,))
                qkv = h @ qkv_w
                q, k, v = qkv.split([hidden, kv_heads * dim, kv_heads * dim], dim=-1)
                q = q.view(1, n, heads, dim).transpose(1, 2)
                k = k.view(1, n, kv_heads, dim).transpose(1, 2).repeat_interleave(heads // kv_heads, 1)
                v = v.view(1, n, kv_heads, dim).transpose(1, 2).repeat_interleave(heads // kv_heads, 1)
                a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + a.transpose(1, 2).reshape(1, n, hidden) @ o_w
                h = torch.nn.functional.rms_norm(x, (hidden,))
                gate, up = (h @ up_w).chunk(2, dim=-1)
                x = x + (torch.nn.functional.silu(gate) * up) @ down_w

    prefill(1024)
    prefill_s = event_time(lambda: prefill(tokens), 2)
    rows.append(["recompute the 32k-token prefill, random-weight Llama-3-8B shape", 0, prefill_s, 0.0])
    results["llama"] = {"restore_s": restore_s, "prefill_s": prefill_s, "ratio": prefill_s / restore_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".", help="directory for transfer.json")
    parser.add_argument(
        "--sections",
        default="ceilings,naive,orbitkv,llama",
        help="comma-separated subset of ceilings,naive,orbitkv,llama",
    )
    parser.add_argument(
        "--staged-min-kib",
        type=int,
        default=None,
        help="stage restores and saves of page extents this large (KiB; default the shipped "
        "transfer.STAGED_MIN_EXTENT, per direction): the staged path against the SMs at other pages",
    )
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.staged_min_kib is not None:
        transfer.STAGED_MIN_EXTENT = {False: args.staged_min_kib << 10, True: args.staged_min_kib << 10}
    wanted = {"ceilings", *args.sections.split(",")}  # every figure is read against the ceilings
    rows: list = []
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "staged_min_extent": transfer.STAGED_MIN_EXTENT,
    }
    arena = make_arena(20 << 30)
    results.update(arena.stats)  # type: ignore[attr-defined]
    sections = [
        ("ceilings", lambda: results.__setitem__("ceiling", ceilings(arena, rows, 4 << 30))),
        ("naive", lambda: naive(arena, rows)),
        ("orbitkv", lambda: orbitkv(arena, rows, results["ceiling"], results)),
        ("llama", lambda: llama_prefix(arena, rows, results)),
    ]
    for name, fn in sections:
        if name not in wanted:
            continue
        try:
            fn()
        except Exception:
            results[f"error_{name}"] = traceback.format_exc()
            print(f"section {name} failed:\n{results[f'error_{name}']}", file=sys.stderr)
    for row in rows:
        extra = (
            f" | {row[4]}"
            if len(row) > 4 and isinstance(row[4], str)
            else f" | {row[4]:.2f} of ceiling"
            if len(row) > 4 and isinstance(row[4], float) and row[4] < 5
            else (f" | restore {row[4]:.1f} GB/s" if len(row) > 4 else "")
        )
        print(f"| {row[0]} | {row[1] / 2**20:.0f} MiB | {row[2] * 1e3:.2f} ms | {row[3]:.1f} GB/s{extra} |")
    if "llama" in results:
        print(
            f"llama 32k prefix: restore {results['llama']['restore_s'] * 1e3:.1f} ms vs prefill "
            f"{results['llama']['prefill_s'] * 1e3:.1f} ms -> {results['llama']['ratio']:.1f}x"
        )
    costs = checksum_costs(results)
    if costs:
        print(
            "\n| page | path | save GB/s with / without checksum | cost | restore GB/s with / without | cost "
            "| noise (same copy timed twice) |"
        )
        print("|---|---|---|---|---|---|---|")
        for size, row in costs.items():
            print(
                f"| {size >> 10} KiB | {row['path']} | {row['save']:.1f} / {row['save_nosum']:.1f} | "
                f"{row['save_cost']:.1%} | {row['restore']:.1f} / {row['restore_nosum']:.1f} | "
                f"{row['restore_cost']:.1%} | {row['noise']:.1%} |"
            )
        worst = max(max(r["save_cost"], r["restore_cost"]) for r in costs.values())
        print(f"largest checksum cost {worst:.1%} (goal: at most 5%)")
        results["checksum_cost_max"] = worst
    with open(f"{args.out}/transfer.json", "w") as fh:
        json.dump({k: v for k, v in results.items()}, fh, indent=2, default=str)
    arena.close()
    failed = [k for k in results if str(k).startswith("error_")]
    return 1 if failed else 0


def checksum_costs(results: dict) -> dict:
    """Per page size, the bandwidth the checksum costs each way: 1 - with / without (same run), on one path:
    where the shipped transfer is staged, the same transfer on the SMs against the SMs' copy without sums."""
    costs = {}
    for size, row in results.items():
        if isinstance(size, int) and isinstance(row, dict) and "save_nosum" in row:
            save_with, restore_with = row.get("save_sm") or row["save"], row.get("restore_sm") or row["restore"]
            costs[size] = {
                **row,
                "save": save_with,
                "restore": restore_with,
                "save_cost": 1 - save_with / row["save_nosum"],
                "restore_cost": 1 - restore_with / row["restore_nosum"],
            }
    return costs


if __name__ == "__main__":
    sys.exit(main())
