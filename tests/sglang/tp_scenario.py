"""The harness of the two-rank SGLang scenarios (test_collective.py, test_epilogue.py).

A scenario script is ``HEAD + body + LAUNCH``: the body defines ``run(rank, init)``, which returns
what the rank reports. ``LAUNCH`` imports SGLang once (through the body's imports), forks both ranks,
and prints one JSON line: each rank's exit status and report (``["ok", result]``, ``["error",
traceback]``, ``["hung", None]`` or None when the rank ended without one) and the seconds taken.
``join_group`` is SGLang's own parallel state over gloo on the loopback interface.
"""

HEAD = """
    import json, multiprocessing, os, socket, sys, time, traceback, types
    import torch
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment, initialize_model_parallel, set_custom_all_reduce,
    )
    from cacheon_sglang import seam

    WORLD = 2
    PHASE = os.environ["SCENARIO_PHASE"]

    def rank_main(rank, init, send):
        torch.set_num_threads(1)
        try:
            send.send(("ok", run(rank, init)))
        except BaseException:
            send.send(("error", traceback.format_exc()))

    def publish_rank(rank):
        os.environ["SGLANG_NCCL_SO_PATH"] = "/nonexistent/libnccl.so.2"
        publish(ServerArgs(model_path="dummy", device="cpu", tp_size=WORLD), role="scheduler",
                ranks=SpawnRanks(world_rank=rank))

    def join_group(rank, init):
        set_custom_all_reduce(False)
        init_distributed_environment(backend="gloo", world_size=WORLD, rank=rank, local_rank=rank,
                                     distributed_init_method=init, timeout=60)
        initialize_model_parallel()
"""

LAUNCH = """
    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    init = f"tcp://127.0.0.1:{free_port()}"
    ctx = multiprocessing.get_context("fork")
    pipes, procs = [], []
    for rank in range(WORLD):
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=rank_main, args=(rank, init, send))
        proc.start()
        send.close()  # the rank's end only: its exit is seen as the pipe's end
        pipes.append(receive)
        procs.append(proc)
    began = time.monotonic()
    reports = []
    for pipe, proc in zip(pipes, procs):
        report = None
        if pipe.poll(max(120 - (time.monotonic() - began), 0)):
            try:
                report = pipe.recv()
            except EOFError:
                pass
        proc.join(max(120 - (time.monotonic() - began), 1))
        if proc.is_alive():
            proc.kill(); proc.join(); report = ["hung", None]
        reports.append({"exit": proc.exitcode, "report": report})
    print(json.dumps({"ranks": reports, "seconds": time.monotonic() - began}))
"""
