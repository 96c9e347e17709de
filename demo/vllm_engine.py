"""One vLLM engine lifetime through OrbitKV: generate for fixed prompts and print the result as JSON.

The last stdout line is ``RESULT {json}``: per prompt the output token ids and log-probabilities,
the generate time, and vLLM's own prefix-cache counters (``vllm:external_prefix_cache_hits`` is
what the connector reported to vLLM's scheduler).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


class EngineFailed(RuntimeError):
    """An engine process exited without a RESULT line; the message carries its output's tail."""


def spawn(model: Path, endpoint: str, prompt_tokens: int, *options: str) -> dict[str, Any]:
    """One whole engine lifetime in a new process, as a restarted server would be: this script
    with ``options`` (its flags). Returns the RESULT, with ``wall`` (the process's seconds) added."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEON_")}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB: enough for the tiny models, small enough for a 2-core CI box
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, __file__, str(model), endpoint, "--prompt-tokens", str(prompt_tokens), *options],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise EngineFailed(f"engine failed ({out.returncode}):\n{out.stderr[-8000:]}\n{out.stdout[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    result["wall"] = time.perf_counter() - start
    # vLLM's loggers (the connector's among them) write to stdout, warnings from elsewhere to stderr.
    result["orbitkv_log"] = [line for line in (out.stdout + out.stderr).splitlines() if "orbitkv" in line]
    if result.get("connector") is None:
        result["connector"] = logged_counters(result["orbitkv_log"])
    return result


def logged_counters(lines: list[str]) -> dict[str, int] | None:
    """The connector's counters from the stats each connector logs (after each restore and at
    shutdown): the last line of each process, the workers' figures summed (an engine core in its own
    process, or several worker processes)."""
    import ast
    import re

    found: dict[str, dict[str, dict[str, int]]] = {"SCHEDULER": {}, "WORKER": {}}
    for line in lines:
        for role, seen in found.items():
            marker = f"orbitkv connector {role} stats: "
            if marker in line:
                pid = re.search(r"pid=(\d+)", line)
                seen[pid.group(1) if pid else ""] = ast.literal_eval(line.split(marker, 1)[1])
    if not found["SCHEDULER"] or not found["WORKER"]:
        return None
    scheduler, workers = list(found["SCHEDULER"].values())[-1], list(found["WORKER"].values())
    return {
        # The scheduler plans one page per group for every rank; each worker writes its own shard.
        "planned_pages": scheduler["planned_pages"] * len(workers),
        "hit_tokens": scheduler["hit_tokens"],
        "failed_loads_seen": scheduler["load_failures"],
        "pages_written": sum(w["pages_written"] for w in workers),
        "corrupt_pages": sum(w["corrupt_pages"] for w in workers),
        "compiled_pages": sum(w.get("compiled_pages", 0) for w in workers),
        "failed_loads": sum(w["load_failures"] for w in workers),
        "loads": sum(w["loads"] for w in workers),
        "leases_ahead": sum(w.get("leases_ahead", 0) for w in workers),
        "saves_together": sum(w.get("saves_together", 0) for w in workers),
        "saved_bytes": sum(w["saved_bytes"] for w in workers),
    }


def made_up_prompt(n: int, variant: int, shared_prefix: int = 0) -> list[int]:
    """Prompt ``variant`` of ``n`` tokens; with ``shared_prefix``, odd variants share their first tokens."""
    tokens = prompt_tokens(n, variant)
    if shared_prefix and variant % 2:
        tokens[:shared_prefix] = prompt_tokens(shared_prefix, variant=1000)
    return tokens


def prompt_tokens(n: int, variant: int = 0) -> list[int]:
    return [(i * 37 + variant * 101) % 997 for i in range(n)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="model folder (e.g. written by tiny_model.py)")
    parser.add_argument("endpoint", help="OrbitKV manager endpoint, unix:///path or host:port")
    parser.add_argument("--prompt-tokens", type=int, default=300, help="tokens per prompt (default 300)")
    parser.add_argument("--prompts", type=int, default=1, help="distinct prompts generated together (default 1)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per prompt (default 8)")
    parser.add_argument(
        "--turns",
        type=int,
        default=1,
        help="a conversation of this many turns: each turn's prompt is the previous prompt, the previous "
        "answer and a new message of --message-tokens tokens (default 1: one prompt)",
    )
    parser.add_argument("--message-tokens", type=int, default=30, help="tokens of each new message (default 30)")
    parser.add_argument(
        "--prompt-file", help="a JSON list of token ids: the prompt to serve (instead of a made-up one)"
    )
    parser.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="the odd-numbered prompts start with the same this many tokens (a long shared prefix)",
    )
    parser.add_argument("--no-connector", action="store_true", help="no KV connector at all (the reference)")
    parser.add_argument("--fingerprint", help="kv_connector_extra_config.model_fingerprint (the cache identity)")
    parser.add_argument("--extra", default="{}", help="more kv_connector_extra_config keys, as JSON")
    parser.add_argument(
        "--failure-policy",
        choices=["recompute", "fail"],
        default="recompute",
        help="vLLM's kv_load_failure_policy: recompute a request whose restore failed, or fail it (default recompute)",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (default 1)")
    parser.add_argument("--block-size", type=int, default=32, help="vLLM's block size, the page size (default 32)")
    parser.add_argument("--dtype", default="float32", help="model dtype (default float32)")
    parser.add_argument("--max-model-len", type=int, default=1024, help="vLLM's max_model_len (default 1024)")
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="turn vLLM's own prefix cache off (restores come from OrbitKV only)",
    )
    parser.add_argument("--num-blocks", type=int, help="override vLLM's KV cache size in blocks (forces preemption)")
    parser.add_argument(
        "--abort-while-loading",
        action="store_true",
        help="in-process engine: abort the first request right after its restore is issued, report the "
        "connector's state, then generate normally",
    )
    parser.add_argument(
        "--start-file",
        help="once the engine is up, create START_FILE.ready and wait for START_FILE before the timed generate "
        "(the caller may break something just as the restores begin)",
    )
    parser.add_argument(
        "--wait-file",
        help="after the timed generate, create WAIT_FILE.ready and wait for WAIT_FILE (the caller may restart "
        "the manager meanwhile), then generate the prompts twice more, a second longer apart than the "
        "connector waits before it retries a lost manager",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.tp == 1:
        # The engine core (scheduler and worker) in this process, so the RESULT can carry the
        # connector's own counters: pages planned, pages written into the KV cache, failed loads.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.tp > 1 and not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        # vLLM's CPU workers bind to NUMA nodes; on a one-node machine, give each rank its own cores.
        cpus = sorted(os.sched_getaffinity(0))
        share = max(1, len(cpus) // args.tp)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            ",".join(str(c) for c in cpus[r * share : (r + 1) * share] or cpus[-1:]) for r in range(args.tp)
        )
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    extra: dict[str, Any] = {"endpoint": args.endpoint, **json.loads(args.extra)}
    if args.fingerprint:
        extra["model_fingerprint"] = args.fingerprint
    llm = LLM(
        model=args.model,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        enforce_eager=True,
        dtype=args.dtype,
        tensor_parallel_size=args.tp,
        seed=0,
        disable_log_stats=False,
        num_gpu_blocks_override=args.num_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_transfer_config=None
        if args.no_connector
        else KVTransferConfig(
            kv_connector="OrbitKVConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy=args.failure_policy,
        ),
    )
    if args.prompt_file:
        prompts = [TokensPrompt(prompt_token_ids=json.loads(Path(args.prompt_file).read_text()))]
    else:
        prompts = [
            TokensPrompt(prompt_token_ids=made_up_prompt(args.prompt_tokens, v, args.shared_prefix))
            for v in range(args.prompts)
        ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=1, ignore_eos=True)
    result: dict[str, Any] = {}
    # Warm the engine up on a prompt shorter than a page (nothing to save or restore), so the timed
    # generate measures prefill or restore, not first-call costs.
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=2), use_tqdm=False)
    if args.abort_while_loading:
        result["abort"] = abort_while_loading(llm, prompts[0], params, args.endpoint)
    if args.start_file:
        wait_at_gate(Path(args.start_file))
    turns = []
    for turn in range(1, args.turns):
        # A conversation: this turn's prompt, its answer, and the next message make the next prompt.
        prompt = list(prompts[0]["prompt_token_ids"])
        answer = list(llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids)
        turns.append({"prompt": prompt, "answer": answer})
        message = prompt_tokens(args.message_tokens, variant=turn + 1)
        prompts = [TokensPrompt(prompt_token_ids=prompt + answer + message)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    result["seconds"] = time.perf_counter() - start
    if args.turns > 1:
        turns.append({"prompt": list(prompts[0]["prompt_token_ids"]), "answer": list(outputs[0].outputs[0].token_ids)})
        result["turns"] = turns
    result["outputs"] = [
        {
            "ids": list(o.outputs[0].token_ids),
            "logprobs": [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs or []],
            "finish_reason": o.outputs[0].finish_reason,
        }
        for o in outputs
    ]
    result["ids"], result["logprobs"] = result["outputs"][0]["ids"], result["outputs"][0]["logprobs"]
    if args.wait_file:
        result["after_wait"] = generate_after_wait(llm, prompts, params, Path(args.wait_file))
    counters = {"vllm:external_prefix_cache_hits", "vllm:external_prefix_cache_queries", "vllm:num_preemptions"}
    result["block_size"] = llm.llm_engine.vllm_config.cache_config.block_size
    result["metrics"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if m.name in counters}
    in_process = args.tp == 1 and not args.no_connector
    result["connector"] = connector_counters(llm) if in_process else None
    print("RESULT " + json.dumps(result), flush=True)


def connector_counters(llm: Any) -> dict[str, int]:
    """The scheduler's plan and the worker's deeds: pages planned for loading, pages written into the
    KV cache with their checksums matched, loads that failed (recomputed), bytes saved."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    worker = get_kv_transfer_group()
    return {
        "planned_pages": scheduler.stats["planned_pages"],
        "hit_tokens": scheduler.stats["hit_tokens"],
        "failed_loads_seen": scheduler.stats["load_failures"],
        "pages_written": worker.stats["pages_written"],
        "corrupt_pages": worker.stats["corrupt_pages"],
        "compiled_pages": worker.stats["compiled_pages"],  # restored pages that took the CPU's compiled route
        "failed_loads": worker.stats["load_failures"],
        "loads": worker.stats["loads"],
        "leases_ahead": worker.stats["leases_ahead"],  # loads leased in one exchange with others of their step
        "saves_together": worker.stats["saves_together"],  # saves sent in one exchange with others of their step
        "saved_bytes": worker.stats["saved_bytes"],
        # Python's thread switch interval the worker's last load ran under, and the process's now
        "load_switch_interval_us": worker.stats["load_switch_interval_us"],
        "switch_interval_us_after": round(sys.getswitchinterval() * 1e6),
    }


def wait_at_gate(gate: Path) -> None:
    """Create ``GATE.ready``, then wait (at most 10 minutes) until the caller creates ``gate``."""
    Path(f"{gate}.ready").touch()
    deadline = time.monotonic() + 600
    while not gate.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{gate} never appeared")
        time.sleep(0.05)


def generate_after_wait(llm: Any, prompts: list[Any], params: Any, gate: Path) -> list[list[int]]:
    """Signal, wait for the caller, then two more rounds of the same prompts; their output ids."""
    wait_at_gate(gate)
    from cacheon_orbitkv.link import RETRY_S

    rounds = []
    for round_ in range(2):
        if round_:
            time.sleep(RETRY_S + 1)  # past the connector's wait before it retries a lost manager
        rounds.append(list(llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids))
    return rounds


def abort_while_loading(llm: Any, prompt: Any, params: Any, endpoint: str) -> dict[str, Any]:
    """Issue a request, abort it while vLLM waits for its restore, step until it is gone."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.v1.request import RequestStatus

    from cacheon_orbitkv.client import CacheClient
    from cacheon_vllm.connector import scheduler_state

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    worker = get_kv_transfer_group()
    req_id = engine.add_request("victim", prompt, params)
    engine.step()  # schedules the restore: the request now waits for its KV
    status = scheduler.requests[req_id].status
    inflight = len(worker._inflight)
    engine.abort_request([req_id], internal=True)
    steps = 0
    while (engine.has_unfinished_requests() or req_id in scheduler.requests) and steps < 1000:
        engine.step()
        steps += 1
        time.sleep(0.001)
    with CacheClient(endpoint) as client:
        manager = client.stats()
    return {
        "manager_leases": manager["leases"],
        "manager_reservations": manager["reservations"],
        "status_before_abort": status.name,
        "waiting_for_remote_kvs": status == RequestStatus.WAITING_FOR_REMOTE_KVS,
        "inflight_at_abort": inflight,
        "steps_to_retire": steps,
        "scheduler_state": scheduler_state(scheduler.connector),
        "worker_inflight": len(worker._inflight),
        "free_blocks": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
        "total_blocks": scheduler.kv_cache_manager.block_pool.num_gpu_blocks,
    }


if __name__ == "__main__":
    main()
