"""One vLLM engine lifetime through OrbitKV: generate once for a fixed prompt and print the result as JSON.

python engine_run.py MODEL ENDPOINT FINGERPRINT|- PROMPT_TOKENS
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    model, endpoint, fingerprint, n_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    extra = {"endpoint": endpoint}
    if fingerprint != "-":
        extra["model_fingerprint"] = fingerprint
    llm = LLM(
        model=model,
        block_size=32,
        max_model_len=1024,
        enforce_eager=True,
        dtype="float32",
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="OrbitKVConnector", kv_role="kv_both", kv_connector_extra_config=extra
        ),
    )
    prompt = TokensPrompt(prompt_token_ids=[(i * 37) % 997 for i in range(n_tokens)])
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    start = time.perf_counter()
    out = llm.generate([prompt], params)[0].outputs[0]
    seconds = time.perf_counter() - start
    logprobs = [next(iter(lp.values())).logprob for lp in out.logprobs]
    print("RESULT " + json.dumps({"ids": list(out.token_ids), "logprobs": logprobs, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
