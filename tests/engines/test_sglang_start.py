"""What an SglangEngine takes from SGLang once started: the page size SGLang settled on, and the SIGTERM handler
SGLang would install over the worker's drain; against the stand-in of tests/engines/test_sglang.py."""

import asyncio
import os
import signal

import pytest

from engines.shared.zmq_kv_events import decode_message
from launcher.run import settled_card
from runtime.engine import RequestContext
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import BlockStored
from runtime.models.card import ModelCard
from tests.engines.test_sglang import BlockStoredSg, FakeSglang, ListSink, chunk, request, start_on_fake, zmq_frames


async def test_the_page_size_sglang_settles_on_names_the_blocks_and_goes_on_the_card(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang's ``ServerArgs.__post_init__`` (python/sglang/srt/server_args.py) rewrites ``page_size`` for some
    attention backends (64 for FlashMLA); its events then carry pages of 64, which Dynamo's backend names by
    ``server_args.page_size`` read after the engine started (components/src/dynamo/sglang/register.py)."""
    fake = FakeSglang([], page_size=64)
    engine, _ = await start_on_fake(monkeypatch, fake, {"attention_backend": "flashmla"})
    assert fake.kwargs["page_size"] == 16  # type: ignore[attr-defined]  # what it was given
    assert engine.block_size == 64
    sink = ListSink()
    engine.attach_kv_events(sink)
    page = list(range(64))
    stored = BlockStoredSg(block_hashes=[7], parent_block_hash=None, token_ids=page, block_size=64, lora_id=None)
    engine._publish_batch(0, decode_message(zmq_frames(stored)))
    assert sink.published == [(0, [BlockStored(block_hashes=sequence_block_hashes(page, 64))])]
    card = ModelCard(name="m", context_length=4096, kv_cache_block_size=16)
    assert settled_card(card, engine).kv_cache_block_size == 64
    await engine.close()


async def test_sigterm_still_drains_the_worker_after_sglang_has_served_a_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang's ``TokenizerManager.auto_create_handle_loop`` (python/sglang/srt/managers/tokenizer_manager.py) adds
    its SIGTERM handler to the loop at the first request; the worker adds its drain after the engine started
    (launcher/inputs/dyn.py, ``serve_worker``). SIGTERM must still reach the drain."""
    fake = FakeSglang([chunk([5], 1, {"type": "length", "length": 1})])
    engine, _ = await start_on_fake(monkeypatch, fake)
    loop = asyncio.get_running_loop()
    drain = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, drain.set)  # as serve_worker does
    try:
        assert [out.token_ids async for out in engine.generate(request(), RequestContext("r1"))] == [[5]]
        os.kill(os.getpid(), signal.SIGTERM)
        heard = [asyncio.ensure_future(drain.wait()), asyncio.ensure_future(fake.tokenizer_manager.sigterm.wait())]
        await asyncio.wait(heard, return_when=asyncio.FIRST_COMPLETED)
        for waiter in heard:
            waiter.cancel()
        assert drain.is_set() and not fake.tokenizer_manager.sigterm.is_set()
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        loop.remove_signal_handler(signal.SIGQUIT)
        await engine.close()
