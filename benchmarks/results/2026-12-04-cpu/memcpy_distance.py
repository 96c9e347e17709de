"""memcpy (a memoryview slice assignment) of 64 x 256 KiB between two page-aligned private buffers, the
destination shifted by each distance modulo 4096 (GB/s per distance), then the same with both shifted by 16,
and where this process's allocator put a 16 MiB tensor and bytearray. Run: python memcpy_distance.py"""

import ctypes
import mmap
import time

import torch

PAGE, PAGES = 256 << 10, 64
TOTAL = PAGE * PAGES


def rate(fn, reps: int = 3) -> float:
    best = 1e9
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return TOTAL / best / 1e9


def main() -> None:
    source, target = mmap.mmap(-1, TOTAL + 8192), mmap.mmap(-1, TOTAL + 8192)
    source.write(b"\1" * (TOTAL + 8192))
    target.write(b"\0" * (TOTAL + 8192))
    src, dst = memoryview(source), memoryview(target)

    def copies(src_at: int, dst_at: int) -> None:
        for i in range(PAGES):
            dst[dst_at + i * PAGE : dst_at + (i + 1) * PAGE] = src[src_at + i * PAGE : src_at + (i + 1) * PAGE]

    distances = [*range(0, 129, 8), *range(3968, 4096, 8), 512, 1024, 3072]
    print(" ".join(f"{d}:{rate(lambda d=d: copies(0, d)):.1f}" for d in distances))
    print(f"src+16 -> dst+16: {rate(lambda: copies(16, 16)):.1f}")
    print("torch big tensor data_ptr mod 4096:", torch.empty(TOTAL, dtype=torch.uint8).data_ptr() % 4096)
    buffer = bytearray(TOTAL)
    print("bytearray mod 4096:", ctypes.addressof((ctypes.c_char * 1).from_buffer(buffer)) % 4096)


if __name__ == "__main__":
    main()
