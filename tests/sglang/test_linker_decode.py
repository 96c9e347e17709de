"""Generated tokens through OrbitKVLinker on SGLang 0.5.23's real tree, pools and scheduler pieces.

SGLang inserts a request's prompt pages into the tree after its prefill and, when the request
finishes, its prompt and generated tokens up to the last token with KV (``release_kv_cache`` ->
``checkpoint_into_tree``); the linker's write-through saves each inserted node. Each "engine" here
is a new set of pools, a new tree and a new linker built by SGLang's registry over one real
manager process, so what a later engine restores can only come from the store.
"""

from __future__ import annotations

from array import array

import pytest
import torch

from tests.sglang import sglang_cache as sc

PAGE = 4
POISON = 3.5  # never written by the fake forward (its values are integers)


def _engine(endpoint: str, **extra: object) -> tuple[dict, sc.Scheduler]:
    fx = sc.build_mha(endpoint, page_size=PAGE, extra=dict(extra) if extra else None)
    return fx, sc.Scheduler(fx)


def _page_bytes(fx: dict, rows: list[int]) -> list[bytes]:
    """Each page row's bytes across every layer's K and V, as a page is saved."""
    segments = fx["linker"].pool_layout.layouts[0].segments
    return [b"".join(bytes(seg[row].tolist()) for seg in segments) for row in rows]


def _tree_rows(fx: dict, ids: list[int]) -> list[int]:
    """The device page rows the tree holds for the full pages of ``ids`` (a match without a request)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache = fx["cache"]
    result = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids))))
    assert result.device_prefix_len == len(ids) // PAGE * PAGE, (result.device_prefix_len, len(ids))
    slots = cache.path_device_indices(result.last_device_node)[: result.device_prefix_len]
    return [int(s) // PAGE for s in slots[::PAGE].tolist()]


def _poison(fx: dict) -> None:
    kv = fx["kvcache"]
    for t in [*kv.k_buffer, *kv.v_buffer]:
        t.fill_(POISON)


def _restored_rows(fx: dict, rid: str) -> list[int]:
    return [int(s) // PAGE for s in fx["cache"].linker.private_load_indices[rid][::PAGE].tolist()]


def _computed(ids: list[int], layers: int, salt: int = 0) -> list[bytes]:
    """What a cold forward writes for the full pages of ``ids``, page by page, in the saved layout."""
    pages = []
    for p in range(len(ids) // PAGE):
        chunks = []
        for layer in range(layers):
            for which in (0, 1):
                vals = [sc.kv_value(ids[q], q, layer, which) + salt for q in range(p * PAGE, (p + 1) * PAGE)]
                t = torch.tensor(vals, dtype=sc.DTYPE)[:, None, None].expand(PAGE, 2, 8).contiguous()
                chunks.append(bytes(t.view(torch.uint8).reshape(-1).tolist()))
        pages.append(b"".join(chunks))  # a page is its segments in order: K0, V0, K1, V1
    return pages


def test_a_finished_requests_generated_pages_are_saved_and_a_new_engine_restores_them(manager_factory):
    m = manager_factory()
    fx, sched = _engine(m.endpoint)
    prompt = list(range(100, 118))  # 18 tokens: 4 full prompt pages, 2 prompt tokens in page 5
    stored: list[int] = []

    def step(req: object) -> None:  # the pages in the store after each step's result
        sched.settle()
        stored.append(m.stats()["pages"]["dram"])

    out = sched.generate("chat", prompt, max_new_tokens=11, after_step=step)
    answer = out["output_ids"]
    assert len(answer) == 11 and out["host_loaded"] == 0
    # SGLang inserts the prompt's full pages after the prefill and nothing while the request
    # decodes; when it finishes, it inserts prompt and answer and the new pages are written through.
    assert stored == [4] * 10 + [7]
    # The last generated token has no KV: 18 + 10 tokens hold KV, 7 full pages (3 with generated tokens).
    convo = prompt + answer
    saved_rows = _tree_rows(fx, convo[:28])
    saved = _page_bytes(fx, saved_rows)
    assert saved == _computed(convo[:28], layers=2)
    stats = m.stats()
    page_bytes = fx["linker"].pool_layout.layouts[0].page_bytes
    assert stats["bytes_written"]["dram"] == 7 * page_bytes and stats["pages"]["dram"] == 7
    fx["linker"].close()

    # A new engine: the next turn's prompt is the conversation so far plus one token.
    fx2, sched2 = _engine(m.endpoint)
    _poison(fx2)
    req = sched2.new_req("next", [*convo, 5])
    batch = sched2.schedule(req)
    counter = fx2["linker"].layer_done_counter
    counter.set_consumer(batch.hicache_consumer_index)
    counter.wait_until(counter.num_layers - 1)
    assert req.host_loaded_length == 28  # every full page of prompt and answer (limit: 29 tokens)
    rows = _restored_rows(fx2, "next")
    assert _page_bytes(fx2, rows) == saved
    linker = fx2["linker"]
    assert linker.stats["pages_restored"] == 7 == len(rows)
    assert linker.stats["load_failures"] == 0 and linker.stats["load_misses"] == 0
    sched2.forward(batch)
    assert sched2.checks and all(sched2.checks.values())
    assert sched2.finish(batch) == []
    sched2.settle()
    assert m.stats()["leases"] == 0 and m.stats()["reservations"] == 0
    linker.close()


def test_save_decode_false_saves_the_prompt_pages_only(manager_factory):
    m = manager_factory()
    fx, sched = _engine(m.endpoint, save_decode=False)
    prompt = list(range(200, 218))
    answer = sched.generate("chat", prompt, max_new_tokens=11)["output_ids"]
    page_bytes = fx["linker"].pool_layout.layouts[0].page_bytes
    stats = m.stats()
    assert stats["pages"]["dram"] == 4 and stats["bytes_written"]["dram"] == 4 * page_bytes
    assert fx["linker"].stats["decode_pages_skipped"] == 3
    # A page-aligned prompt: SGLang looks up N-1 tokens, so its last page is not known as a prompt page.
    sched.generate("aligned", list(range(400, 416)), max_new_tokens=1)
    assert m.stats()["pages"]["dram"] == 4 + 3 and fx["linker"].stats["decode_pages_skipped"] == 4
    fx["linker"].close()

    fx2, sched2 = _engine(m.endpoint)  # saves decode pages, restores what the first engine saved
    out = sched2.generate("next", prompt + answer + [5], max_new_tokens=1)
    assert out["host_loaded"] == 16 and all(out["checks"].values())
    assert fx2["linker"].stats["pages_restored"] == 4
    fx2["linker"].close()


def test_save_decode_must_be_a_boolean(manager_factory):
    m = manager_factory()
    with pytest.raises(ValueError, match="save_decode must be true or false, got 'no'"):
        sc.build_mha(m.endpoint, extra={"save_decode": "no"})


def test_a_third_turn_on_a_new_engine_restores_every_full_page_of_turns_one_and_two(manager_factory):
    """Turn N+1's prompt is turn N's prompt, its answer and a new message. Turns 1 and 2 run on one
    engine; a new engine serves turn 3, restoring every full page of both turns' prompts and
    answers, each page equal to what a cold forward computes there."""
    m = manager_factory()
    fx, sched = _engine(m.endpoint)
    prompt1 = list(range(300, 313))  # 13 tokens
    answer1 = sched.generate("turn1", prompt1, max_new_tokens=6)["output_ids"]
    prompt2 = prompt1 + answer1 + [40, 41, 42, 43, 44, 45, 46]  # 26 tokens
    turn2 = sched.generate("turn2", prompt2, max_new_tokens=9)
    answer2 = turn2["output_ids"]
    # Turn 2 reused turn 1's pages from the device tree (prompt and answer: 18 tokens with KV).
    assert turn2["prefix_len"] == 16 and turn2["host_loaded"] == 0
    history = prompt2 + answer2  # 35 tokens, 34 with KV: 8 full pages
    assert m.stats()["pages"]["dram"] == 8
    fx["linker"].close()

    fx3, sched3 = _engine(m.endpoint)
    _poison(fx3)
    prompt3 = [*history, 50, 51, 52]
    turn3 = sched3.generate("turn3", prompt3, max_new_tokens=4)
    assert turn3["host_loaded"] == 32 and turn3["prefix_len"] == 32 and turn3["failed"] == []
    # The forward read every restored position and found a cold forward's values there.
    assert turn3["checks"] == {("attn", 0): True, ("attn", 1): True}
    linker = fx3["linker"]
    assert linker.stats["pages_restored"] == 8 and linker.stats["loads"] == 1
    assert linker.stats["load_failures"] == 0 and linker.stats["load_misses"] == 0
    rows = _tree_rows(fx3, history[:32])
    assert _page_bytes(fx3, rows) == _computed(history[:32], layers=2)
    stats = m.stats()
    assert stats["leases"] == 0 and stats["reservations"] == 0
    assert linker.stats["loaded_bytes"] == 8 * linker.pool_layout.layouts[0].page_bytes
    linker.close()


def test_a_third_turn_of_a_sliding_window_model_restores_every_full_page_and_the_window(manager_factory):
    """The same conversation on full + sliding-window layers (window 8 tokens, two pages): turn 3's
    new engine restores the eight full-attention pages of turns 1-2 and the window's two pages
    ending there; every layer, sliding ones included, reads a cold forward's values."""
    m = manager_factory()
    fx = sc.build_swa(m.endpoint)
    sched = sc.Scheduler(fx)
    prompt1 = list(range(300, 313))
    answer1 = sched.generate("turn1", prompt1, max_new_tokens=6)["output_ids"]
    prompt2 = [*prompt1, *answer1, 40, 41, 42, 43, 44, 45, 46]
    answer2 = sched.generate("turn2", prompt2, max_new_tokens=9)["output_ids"]
    fx["linker"].close()

    fx3 = sc.build_swa(m.endpoint)
    turn3 = sc.Scheduler(fx3).generate("turn3", [*prompt2, *answer2, 50, 51, 52], max_new_tokens=4)
    assert turn3["host_loaded"] == 32 and turn3["failed"] == []
    assert turn3["checks"] == {("attn", 0): True, ("attn", 1): True, ("attn", 2): True}
    linker = fx3["linker"]
    assert linker.stats["pages_restored"] == 8 + 2 and linker.stats["loads"] == 1
    assert linker.stats["load_failures"] == 0 and linker.stats["load_misses"] == 0
    layouts = linker.pool_layout.layouts
    assert linker.stats["loaded_bytes"] == 8 * layouts[0].page_bytes + 2 * layouts[1].page_bytes
    stats = m.stats()
    assert stats["leases"] == 0 and stats["reservations"] == 0
    linker.close()
