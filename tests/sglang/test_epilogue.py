"""The deep MoE epilogue through SGLang 0.5.23's own layer stack on two real ranks.

Each rank builds a three-layer stack with SGLang's ``layer_stack`` / ``append_stages`` (attention and
FFN stages, a real ``CustomAllReduceFusion`` per layer, SGLang's ``RMSNorm``), runs decode forwards
through the stages' own ``prepare`` / ``exit`` / ``finish`` and ``final_norm``, and its MoE hands off
through ``MoeDeferredFinalize.from_flashinfer``. SGLang grants the deferral only where the
CustomAllReduceV2 push plane is registered (CUDA); here the plane's capacity check
(``can_fuse_all_reduce``) is granted, which is the one CUDA-only branch driven explicitly. The
attention and the experts' GEMMs are the test's own arithmetic (a per-rank partial sum each, as
under tensor parallelism); everything between them is SGLang's.
"""

from __future__ import annotations

from cacheon_core import read_receipts
from cacheon_sglang.engine import launch_environment
from tests.sglang.tp_scenario import HEAD, LAUNCH

RANKS = (
    HEAD
    + """
    from sglang.srt.layers.layernorm import RMSNorm

    LAYERS, T, H, E, K, I = 3, 5, 64, 4, 2, 32

    def run(rank, init):
        publish_rank(rank)
        if PHASE == "partial":
            return partial_set(rank)
        join_group(rank, init)
        from sglang.srt.layers.layer_boundary import append_stages, declare_attn, declare_ffn, layer_stack
        from sglang.srt.layers.layer_boundary.fusions import custom_all_reduce_fusion as carf
        from sglang.srt.layers.layer_boundary.fusions.moe_finalize import MoeDeferredFinalize
        from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
        from cacheon_core import EpilogueError
        from cacheon_sglang.integrations import epilogue as adapters

        seam.enter_scheduler(tp_rank=rank, tp_size=WORLD)
        bf16 = torch.bfloat16
        torch.manual_seed(0)  # the same weights on every rank; each rank holds its shard of them
        norms = [(RMSNorm(H).to(bf16), RMSNorm(H).to(bf16)) for _ in range(LAYERS)]
        final = RMSNorm(H).to(bf16)
        with torch.no_grad():
            for norm in [n for pair in norms for n in pair] + [final]:
                norm.weight.normal_(1, 0.2)
        attn_w = torch.randn(LAYERS, H, H) / H ** 0.5
        router = torch.randn(LAYERS, H, E)
        w1 = torch.randn(LAYERS, E, H, I) / H ** 0.5
        w2 = torch.randn(LAYERS, E, I, H) / I ** 0.5
        shard = slice(rank * H // WORLD, (rank + 1) * H // WORLD)  # attention: a row shard of the input
        ishard = slice(rank * I // WORLD, (rank + 1) * I // WORLD)  # experts: a shard of the intermediate
        fusions, stages = [], []
        with layer_stack():
            for layer in range(LAYERS):
                fusion = carf.CustomAllReduceFusion(hidden_size=H, defers_finalize=True)
                # The FFN input's fused all-reduce + add + norm is the push plane's kernel (CUDA only):
                # it declines, as it does for rows it cannot stage, and SGLang completes that sum unfused.
                fusion._ffn_input_add_norm = lambda plan, hidden_states, residual, forward_batch: None
                options = {"fusions": fusion}
                stages.append(append_stages(
                    (declare_attn(), norms[layer][0], options),
                    (declare_ffn(sparse=True, next_layer_sparse=True), norms[layer][1], options),
                ))
                fusions.append(fusion)
        fusions[-1].final_norm_eps = final.variance_epsilon  # SGLang then asks to defer the last layer too

        def experts(layer, x):
            # this rank's partial expert outputs in expert order (permuted rows), as a grouped GEMM leaves them
            logits = x.float() @ router[layer]
            weights, ids = torch.topk(torch.softmax(logits, -1), K)
            order = torch.argsort(ids.reshape(-1), stable=True)
            permuted = torch.empty(T * K, dtype=torch.int32)
            permuted[order] = torch.arange(T * K, dtype=torch.int32)
            flat_ids = ids.reshape(-1)[order]
            tokens = order // K
            hidden = torch.stack([
                torch.nn.functional.silu(x[t].float() @ w1[layer, e][:, ishard]) @ w2[layer, e][ishard]
                for t, e in zip(tokens.tolist(), flat_ids.tolist())
            ])
            return hidden.to(bf16), weights.float(), permuted.view(T, K)

        def batch():
            fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=T, input_ids=torch.zeros(T, dtype=torch.long),
                              req_pool_indices=torch.arange(T), seq_lens=torch.ones(T, dtype=torch.int32),
                              out_cache_loc=torch.arange(T), seq_lens_sum=T)
            return fb

        log = []

        def forward(fb, x, stop_after_export=None):
            residual_batch.start(fb)
            h = x
            for layer, (attn, ffn) in enumerate(stages):
                y = attn.prepare(h, fb)
                h = attn.finish((y[:, shard].float() @ attn_w[layer][shard]).to(bf16), fb)
                y = ffn.prepare(h, fb)
                with ffn.exit(fb) as ffn_exit:
                    routed, weights, permuted = experts(layer, y)
                    log.append((layer, bool(ffn_exit.defer_moe_finalize)))
                    if ffn_exit.defer_moe_finalize:
                        out = MoeDeferredFinalize.from_flashinfer(
                            types.SimpleNamespace(gemm2_out=routed, expert_weights=weights,
                                                  expanded_idx_to_permuted_idx=permuted, top_k=K),
                            gated_shared_output=None, m=T, reduce=lambda t: t,
                        )
                        if stop_after_export == layer:
                            return out
                    else:  # the MoE's own finalize in the layer
                        out = (routed.float()[permuted.long()] * weights[..., None]).sum(1).to(bf16)
                h = ffn_exit.finish(out)
            return residual_batch.final_norm(h, fb, final)

        torch.manual_seed(1)
        inputs = [torch.randn(T, H).to(bf16) for _ in range(2)]
        result = {"installed": sorted(seam.STATE.installed), "failed": dict(seam.STATE.failed)}
        own = [forward(batch(), x) for x in inputs]  # SGLang's own eligibility: no plane, no deferral
        result["own_defers"] = [d for _, d in log]
        log.clear()
        carf.can_fuse_all_reduce = lambda m, hidden: m <= 384  # the registered plane's capacity check
        deep = [forward(batch(), x) for x in inputs]
        result["deep_defers"] = [d for _, d in log]
        result["max_diff"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(own, deep))
        epi = adapters.STATE.epilogue
        result["consumed"], result["vetoed"] = epi.consumed, epi.vetoed

        # A fusion the adapters never saw built (no layer to scope to) finalizes in its layer.
        stray = carf.CustomAllReduceFusion.__new__(carf.CustomAllReduceFusion)
        stray.__dict__.update(fusions[0].__dict__)
        result["stray_defers"] = stray.can_defer_finalize(stages[0][1].plan, batch())

        def rejected(call):
            try:
                call()
            except EpilogueError as exc:
                return exc.kind
            return "accepted"

        # A stale export: forward A stops after layer 0's export; forward B's layer 1 is handed it.
        fb_a = batch()
        owed = forward(fb_a, inputs[0], stop_after_export=0)
        fb_b = batch()
        residual = torch.zeros(T, H, dtype=bf16)
        attn1 = stages[1][0].plan
        result["stale"] = rejected(lambda: fusions[1]._finalize_add_norm(attn1, owed, residual, fb_b, None))
        # A mismatched one: layer 0's export handed to layer 2's consumer.
        fb_c = batch()
        owed = forward(fb_c, inputs[0], stop_after_export=0)
        result["mismatch"] = rejected(
            lambda: fusions[2]._finalize_add_norm(stages[2][0].plan, owed, residual, fb_c, None))
        # An export nobody consumed before the next layer's gate.
        fb_d = batch()
        forward(fb_d, inputs[0], stop_after_export=0)
        result["unconsumed"] = rejected(lambda: fusions[1].can_defer_finalize(stages[1][1].plan, fb_d))
        # An export outside an FFN exit's defer scope.
        result["scope"] = rejected(lambda: MoeDeferredFinalize.from_flashinfer(
            types.SimpleNamespace(gemm2_out=owed.routed_output, expert_weights=owed.expert_weights,
                                  expanded_idx_to_permuted_idx=owed.permuted_indices, top_k=K),
            gated_shared_output=None, m=T, reduce=lambda t: t))
        result["consumed_after"] = epi.consumed
        seam.STATE.runtime.receipts.flush()
        return result

    def partial_set(rank):
        # One of the three points drifts before the set's last module loads (its handoff constructor
        # takes other parameters): the set must be refused as a whole, the other two left unpatched.
        from sglang.srt.layers.layer_boundary.fusions import moe_finalize
        moe_finalize.MoeDeferredFinalize.from_flashinfer = classmethod(lambda cls, deferred_output, *, m: None)
        from sglang.srt.layers.layer_boundary.fusions import custom_all_reduce_fusion as carf
        runtime = seam.enter_scheduler(tp_rank=rank, tp_size=WORLD)
        runtime.receipts.flush()
        cls = carf.CustomAllReduceFusion
        return {
            "installed": sorted(seam.STATE.installed), "failed": dict(seam.STATE.failed),
            "ready": seam.joint_ready("deep_epilogue"),
            "patched": [getattr(cls.__dict__[name], "__cacheon_adapter__", False)
                        for name in ("__init__", "can_defer_finalize", "_finalize_add_norm")],
        }
"""
    + LAUNCH
)

ARMED = launch_environment(["arfusion"])
EPILOGUE_ROWS = {"epilogue_defer_gate", "epilogue_moe_export", "epilogue_consume"}


def test_each_export_is_consumed_once_by_the_next_layer_and_bad_exports_are_refused(scenario, tmp_path):
    receipts = tmp_path / "receipts"
    env = {**ARMED, "SCENARIO_PHASE": "serve", "CACHEON_RECEIPT_DIR": str(receipts)}
    env["CACHEON_PLUGINS"] = "cacheon-example-kernels"
    reports = [entry["report"] for entry in scenario(RANKS, env=env)["ranks"]]
    for rank, (status, result) in enumerate(reports):
        assert status == "ok", f"rank {rank}: {result}"
        assert set(result["installed"]) >= EPILOGUE_ROWS, result
        # SGLang's own flow on the CPU never defers; granted the plane, layers 0 and 1 defer and the
        # final layer (asked to, through its terminal finalize) is vetoed, in both forwards
        assert result["own_defers"] == [False] * 6
        assert result["deep_defers"] == [True, True, False] * 2
        assert result["consumed"] == 4 and result["vetoed"] == 2
        assert result["stray_defers"] is False
        # the consumers' finalize + all-reduce + add + norm equals the layers finalizing themselves
        assert result["max_diff"] <= 0.05, result["max_diff"]
        assert result["stale"] == "stale" and result["mismatch"] == "mismatch"
        assert result["unconsumed"] == "unconsumed" and result["scope"] == "scope"
        assert result["consumed_after"] == 4  # a refused export is never consumed
    counts: dict = {}
    for r in read_receipts(receipts):
        key = (r.kind, r.rank, r.slot, r.variant)
        counts[key] = counts.get(key, 0) + r.count
    for rank in (0, 1):
        assert counts[("completed", rank, "moe.finalize", "example_torch_finalize")] == 4
        assert counts[("completed", rank, "arfusion.allreduce_add_rmsnorm", "example_torch_arfusion")] == 4
        assert counts[("failed", rank, "moe.finalize", None)] == 4  # stale, mismatch, unconsumed, scope


def test_a_set_with_a_drifted_point_is_refused_as_a_whole(scenario, tmp_path):
    receipts = tmp_path / "receipts"
    env = {**ARMED, "SCENARIO_PHASE": "partial", "CACHEON_RECEIPT_DIR": str(receipts)}
    env["CACHEON_PLUGINS"] = "cacheon-example-kernels"
    reports = [entry["report"] for entry in scenario(RANKS, env=env)["ranks"]]
    for status, result in reports:
        assert status == "ok", result
        assert not EPILOGUE_ROWS & set(result["installed"]) and not result["ready"], result
        assert set(result["failed"]) == EPILOGUE_ROWS, result["failed"]
        reason = result["failed"]["epilogue_consume"]
        assert "deep_epilogue set is refused as a whole" in reason and "epilogue_moe_export" in reason, reason
        # the two points whose code did not move are left as SGLang wrote them
        assert result["patched"] == [False, False, False]
    failed = [r for r in read_receipts(receipts) if r.kind == "load_failed"]
    assert {r.reason.split(":")[0] for r in failed} >= {f"adapter {name}" for name in EPILOGUE_ROWS}, failed
