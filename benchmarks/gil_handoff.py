"""What a thread waits for the GIL when it comes back from a blocking call while another thread runs Python.

A worker thread makes 60 socket round trips to an echo peer in another process (as a loader thread's
calls to the cache manager), first with the main thread idle (joined on the worker), then with the main
thread running a Python loop without pause (as vLLM's engine loop does while a request waits for its
KV), under several values of ``sys.setswitchinterval``. Prints the median and p90 round trip per case.

    python benchmarks/gil_handoff.py
"""

from __future__ import annotations

import multiprocessing
import socket
import sys
import threading
import time


def echo(sock: socket.socket) -> None:
    while data := sock.recv(64):
        sock.sendall(data)


def round_trips(sock: socket.socket, interval: float, busy: bool, count: int = 60) -> tuple[float, float]:
    sys.setswitchinterval(interval)
    seconds: list[float] = []

    def worker() -> None:
        for _ in range(count):
            began = time.perf_counter()
            sock.sendall(b"x")
            if sock.recv(64) != b"x":
                raise RuntimeError("the echo peer answered something else")
            seconds.append(time.perf_counter() - began)

    thread = threading.Thread(target=worker)
    thread.start()
    while busy and thread.is_alive():
        for _ in range(1000):  # Python work with no blocking call in it
            pass
    thread.join()
    seconds.sort()
    return seconds[len(seconds) // 2] * 1e6, seconds[int(len(seconds) * 0.9)] * 1e6


def main() -> int:
    ours, theirs = socket.socketpair()
    peer = multiprocessing.Process(target=echo, args=(theirs,), daemon=True)
    peer.start()
    default = sys.getswitchinterval()
    print("| main thread | switch interval | round trip, median | p90 |\n|---|---|---|---|")
    try:
        for busy in (False, True):
            for interval in (default, 500e-6, 200e-6, 100e-6):
                median, p90 = round_trips(ours, interval, busy)
                main_thread = "running Python" if busy else "idle"
                print(f"| {main_thread} | {interval * 1e6:.0f} us | {median:.0f} us | {p90:.0f} us |")
    finally:
        sys.setswitchinterval(default)
        ours.close()
        peer.join(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
