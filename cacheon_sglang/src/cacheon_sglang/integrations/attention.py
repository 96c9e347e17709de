"""``attention.decode`` at SGLang's Triton decode kernel, ``decode_attention_fwd``.

``TritonAttnBackend.__init__`` imports the kernel function and binds it per instance, so the
adapter replaces the defining symbol (before the backend exists, which the bootstrap guarantees by
installing it when the kernel module loads) and rebinds any by-value copy already taken. The
kernel receives the decode batch in exactly the slot's form: q ``[b, hq, d]``, the layer's token
slot buffers ``[slots, hkv, d]``, CSR ``kv_indptr``/``kv_indices`` and the softmax scale; it
writes ``o`` in place. Anything outside the slot's semantics goes to SGLang's kernel: MLA, paged
buffers (page size > 1), logit capping, attention sinks, xai temperature, score mods, fp8 scales,
or differing q/v head dims.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .. import seam
from ..rebind import rebind
from ..seams import SeamRow
from . import MARK


def make_adapter(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def decode_attention_fwd(
        q: Any,
        k_buffer: Any,
        v_buffer: Any,
        o: Any,
        kv_indptr: Any,
        kv_indices: Any,
        attn_logits: Any,
        attn_lse: Any,
        num_kv_splits: Any,
        max_kv_splits: Any,
        sm_scale: float,
        k_scale: Any,
        v_scale: Any,
        logit_cap: float = 0.0,
        sinks: Any = None,
        xai_temperature_len: int = -1,
        has_mla: bool = False,
        use_pdl: bool = False,
        page_size: int = 1,
        score_mod: Any = None,
        aux_tensors: Any = None,
        enable_lean: Any = None,
        lean_Mp: Any = None,  # noqa: N803 (SGLang's names)
        lean_Lp: Any = None,  # noqa: N803
        lean_Op: Any = None,  # noqa: N803
        lean_locks: Any = None,
        uneven_batch: Any = None,
    ) -> Any:
        site = seam.site("attention.decode")
        if (
            site is not None
            and not has_mla
            and page_size == 1
            and not logit_cap
            and sinks is None
            and (xai_temperature_len is None or xai_temperature_len <= 0)
            and score_mod is None
            and aux_tensors is None
            and k_scale == 1.0
            and v_scale == 1.0
            and k_buffer.dim() == 3
            and q.shape[-1] == v_buffer.shape[-1]
        ):
            # A CUDA-graph-sized kv_indptr may be longer than the live batch.
            out = site.call(
                q=q,
                k_cache=k_buffer,
                v_cache=v_buffer,
                kv_indptr=kv_indptr[: q.shape[0] + 1],
                kv_indices=kv_indices,
                scale=float(sm_scale),
            )
            if out is not None:
                o.copy_(out)
                return None
        return original(
            q,
            k_buffer,
            v_buffer,
            o,
            kv_indptr,
            kv_indices,
            attn_logits,
            attn_lse,
            num_kv_splits,
            max_kv_splits,
            sm_scale,
            k_scale,
            v_scale,
            logit_cap=logit_cap,
            sinks=sinks,
            xai_temperature_len=xai_temperature_len,
            has_mla=has_mla,
            use_pdl=use_pdl,
            page_size=page_size,
            score_mod=score_mod,
            aux_tensors=aux_tensors,
            enable_lean=enable_lean,
            lean_Mp=lean_Mp,
            lean_Lp=lean_Lp,
            lean_Op=lean_Op,
            lean_locks=lean_locks,
            uneven_batch=uneven_batch,
        )

    setattr(decode_attention_fwd, MARK, True)
    return decode_attention_fwd


def install(row: SeamRow, module: ModuleType) -> bool:
    original = getattr(module, row.target)
    if getattr(original, MARK, False):
        return True
    adapter = make_adapter(original)
    setattr(module, row.target, adapter)
    rebind(original, adapter)
    return True
