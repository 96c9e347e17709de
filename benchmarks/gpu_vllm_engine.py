"""One vLLM engine lifetime on a GPU (vLLM 0.33, Model Runner V2), through OrbitKV or vLLM's own
OffloadingConnector: generate for fixed token-id prompts and print the result as JSON.

The last stdout line is ``RESULT {json}``: per prompt the output token ids, log-probabilities and
time to first token (each prompt is generated on its own, so its generate time with one output
token is its time to first token), vLLM's prefix-cache counters, and the connectors' own
counters (the engine core runs in this process, so both halves of the connector are reachable).
Run by ``benchmarks/gpu_engines.py``; needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any


def prompt_tokens(n: int, variant: int = 0, vocab: int = 997) -> list[int]:
    return [(i * 37 + variant * 101) % vocab for i in range(n)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="model folder (config.json; weights unless --dummy)")
    parser.add_argument("--connector", choices=["orbitkv", "offloading", "none"], default="orbitkv")
    parser.add_argument("--endpoint", help="OrbitKV manager endpoint (unix:///path)")
    parser.add_argument(
        "--prompt-tokens", default="300", help="tokens per prompt, comma-separated lengths (default 300)"
    )
    parser.add_argument("--variants", default="0", help="prompt variants, generated one after another (default 0)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per prompt (default 8)")
    parser.add_argument(
        "--append-ids",
        default="[]",
        help="token ids appended to every prompt, as a JSON list (an earlier run's generated ids)",
    )
    parser.add_argument("--fingerprint", help="kv_connector_extra_config.model_fingerprint (the cache identity)")
    parser.add_argument("--extra", default="{}", help="more kv_connector_extra_config keys, as JSON")
    parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype (auto, fp8)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-bytes", type=int, default=1 << 30, help="KV cache bytes (vLLM's kv_cache_memory_bytes)")
    parser.add_argument(
        "--gpu-util", type=float, default=0.08, help="gpu_memory_utilization (several engines share the GPU)"
    )
    parser.add_argument("--graphs", action="store_true", help="torch.compile and CUDA graphs (no enforce_eager)")
    parser.add_argument("--dummy", action="store_true", help="random weights (load_format=dummy), no tokenizer")
    parser.add_argument("--kv-layout", help="VLLM_KV_CACHE_LAYOUT (LBNHC, LBHNC, LHBNC, BLHNC, BLNHC, BHLNC)")
    parser.add_argument("--vocab", type=int, default=997, help="token ids of the prompts stay below this")
    parser.add_argument("--warmup-tokens", type=int, default=3, help="warm-up prompt length (default 3)")
    parser.add_argument(
        "--repeat-after-reset",
        action="store_true",
        help="after the timed prompts, reset vLLM's prefix cache and generate them again (timed as 'again')",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="per prompt, when each step of an OrbitKV restore happened (the engine's steps and the connector's hooks)",
    )
    return parser.parse_args()


# --timeline: (what, time.perf_counter()) marks and (began, ended, a forward ran) per engine step,
# cleared before each timed prompt.
MARKS: list[tuple[str, float]] = []
STEPS: list[tuple[float, float, bool]] = []


def instrument() -> None:
    """Wrap the OrbitKV connector's hooks and the engine core's step to record MARKS and STEPS."""
    import functools

    from vllm.v1.engine.core import EngineCore

    from cacheon_vllm.connector import OrbitKVConnector

    def mark(what: str) -> None:
        MARKS.append((what, time.perf_counter()))

    def wrap(owner: Any, name: str, body: Any) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:  # a function: bound as a method
            return body(fn, self, *args, **kwargs)

        setattr(owner, name, method)

    def lookup(fn: Any, self: Any, *args: Any) -> Any:
        mark("lookup begins")
        try:
            return fn(self, *args)
        finally:
            mark("lookup ends")

    def start_load_kv(fn: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
        loads = bool(self._get_connector_metadata().loads)
        out = fn(self, *args, **kwargs)
        if loads:
            mark("load submitted")
        return out

    def load(fn: Any, self: Any, job: Any) -> Any:
        mark("loader begins")
        try:
            return fn(self, job)
        finally:
            mark("loader ends")

    def results(fn: Any, self: Any, *args: Any) -> Any:
        out = fn(self, *args)
        if out.finished_recving:
            mark("load seen finished")
        return out

    def step(fn: Any, self: Any, *args: Any) -> Any:
        began = time.perf_counter()
        out = fn(self, *args)
        STEPS.append((began, time.perf_counter(), bool(out[1])))
        return out

    wrap(OrbitKVConnector, "get_num_new_matched_tokens", lookup)
    wrap(OrbitKVConnector, "start_load_kv", start_load_kv)
    wrap(OrbitKVConnector, "_load", load)
    wrap(OrbitKVConnector, "get_transfer_results", results)
    wrap(EngineCore, "step", step)
    wrap(EngineCore, "step_with_batch_queue", step)


def timeline(start: float, end: float) -> dict[str, Any]:
    """The marks and steps of one prompt in milliseconds from its generate call."""
    ms = lambda t: round((t - start) * 1e3, 3)  # noqa: E731
    marks: dict[str, float] = {}
    for what, t in MARKS:
        marks.setdefault(what, ms(t))  # the first of each
    forward = [(ms(a), ms(b)) for a, b, ran in STEPS if ran]
    return {
        "marks": marks,
        "forward_steps": forward,
        "steps": len(STEPS),
        "steps_while_loading": sum(
            1 for a, _, _ in STEPS if marks.get("load submitted", 1e9) <= ms(a) <= marks.get("load seen finished", -1)
        ),
        "generate_ms": ms(end),
    }


def connector_counters(llm: Any) -> dict[str, Any]:
    """The scheduler-side and worker-side connectors' own counters (in-process engine core)."""
    out: dict[str, Any] = {}
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        out["scheduler"] = dict(getattr(scheduler.connector, "stats", {}) or {})
    except AttributeError as exc:
        out["scheduler_error"] = repr(exc)
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group()
        out["worker"] = dict(getattr(worker, "stats", {}) or {})
        out["layout_tags"] = list(getattr(worker, "layout_tags", []) or [])
        layouts = getattr(worker, "_layouts", None) or []
        out["page_bytes"] = [layout.page_bytes for layout in layouts]
        out["chunks"] = [list(layout.chunks[:4]) + (["..."] if len(layout.chunks) > 4 else []) for layout in layouts]
        out["segments"] = [len(layout.chunks) for layout in layouts]
    except (AssertionError, AttributeError) as exc:
        out["worker_error"] = repr(exc)
    return out


def main() -> None:
    args = parse_args()
    # The engine core (scheduler and worker) in this process: the RESULT carries the connector's counters.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if args.kv_layout:
        os.environ["VLLM_KV_CACHE_LAYOUT"] = args.kv_layout
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    if args.timeline and args.connector == "orbitkv":
        instrument()  # before the engine exists: its step_fn is bound at construction

    transfer = None
    if args.connector == "orbitkv":
        extra: dict[str, Any] = {"endpoint": args.endpoint, **json.loads(args.extra)}
        if args.fingerprint:
            extra["model_fingerprint"] = args.fingerprint
        transfer = KVTransferConfig(
            kv_connector="OrbitKVConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
        )
    elif args.connector == "offloading":
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=json.loads(args.extra),
        )
    options: dict[str, Any] = {}
    if args.graphs:
        # Few capture sizes: these engines serve one sequence at a time.
        options["compilation_config"] = {"custom_ops": ["none"], "cudagraph_capture_sizes": [1, 2, 4, 8]}
        options["max_num_seqs"] = 8
    else:
        options["compilation_config"] = {"custom_ops": ["none"]}
        options["enforce_eager"] = True
    if args.dummy:
        options["load_format"] = "dummy"
        options["skip_tokenizer_init"] = True
    began = time.perf_counter()
    llm = LLM(
        model=args.model,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        seed=0,
        disable_log_stats=False,
        enable_prefix_caching=True,
        gpu_memory_utilization=args.gpu_util,
        kv_cache_memory_bytes=args.kv_bytes,
        attention_backend="TRITON_ATTN",
        kv_transfer_config=transfer,
        **options,
    )
    result: dict[str, Any] = {"startup_s": time.perf_counter() - began}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=1, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    # Warm up, so the timed generates measure prefill or restore, not first-call costs: a prompt
    # shorter than a page by default (nothing to save or restore); with --warmup-tokens a long
    # one, generated again after a prefix-cache reset so the connector's restore path warms up too.
    warm = TokensPrompt(prompt_token_ids=prompt_tokens(args.warmup_tokens, 99, args.vocab))
    llm.generate([warm], SamplingParams(max_tokens=2), use_tqdm=False)
    if args.warmup_tokens > args.block_size:
        time.sleep(0.5)
        llm.reset_prefix_cache()
        llm.generate([warm], SamplingParams(max_tokens=2), use_tqdm=False)
    # Each length its own prompts (variants offset by 100 per length): no two share a prefix.
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    prompts = [(n, int(v) + 100 * i) for i, n in enumerate(lengths) for v in args.variants.split(",")]
    appended = [int(t) for t in json.loads(args.append_ids)]

    def run(label: str) -> list[dict[str, Any]]:
        outs = []
        for n, v in prompts:
            prompt = TokensPrompt(prompt_token_ids=prompt_tokens(n, v, args.vocab) + appended)
            before = connector_counters(llm).get("worker", {})
            MARKS.clear()
            STEPS.clear()
            start = time.perf_counter()
            out = llm.generate([prompt], first if args.max_tokens == 1 else params, use_tqdm=False)[0]
            end = time.perf_counter()
            seconds = end - start
            completion = out.outputs[0]
            outs.append(
                {
                    "variant": v,
                    "prompt_tokens": n + len(appended),
                    "seconds": seconds,
                    "ids": list(completion.token_ids),
                    "logprobs": [next(iter(lp.values())).logprob for lp in completion.logprobs or []],
                    "finish_reason": completion.finish_reason,
                    "num_cached_tokens": getattr(out, "num_cached_tokens", None),
                    # the worker connector's counters before and after this prompt (lease and restore times)
                    "worker_before": before,
                    "worker": connector_counters(llm).get("worker", {}),
                    **({"timeline": timeline(start, end)} if args.timeline else {}),
                }
            )
        result[label] = outs
        return outs

    run("outputs")
    if args.repeat_after_reset:
        # Let a save finish on the worker before the cache is dropped (OrbitKV saves within the step).
        time.sleep(1.0)
        result["reset"] = llm.reset_prefix_cache()
        run("again")
    counters = {"vllm:external_prefix_cache_hits", "vllm:external_prefix_cache_queries", "vllm:prefix_cache_hits"}
    result["metrics"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if m.name in counters}
    config = llm.llm_engine.vllm_config
    result["block_size"] = config.cache_config.block_size
    result["kv_cache_layout"] = getattr(config.cache_config, "kv_cache_layout", None)
    result["connector"] = connector_counters(llm)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
