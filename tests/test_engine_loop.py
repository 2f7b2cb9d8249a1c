"""The engine on its own thread: concurrent submitters, streaming, asyncio, cancel, failures."""

import asyncio
import threading
import time

import pytest

from forklm import InvalidArgumentError, Request
from forklm.engine.loop import EngineLoop, EngineLoopClosed

from conftest import fail_forward_call

PROMPTS = ["def add(a, b):", "class Stack:\n    def push(self, x):", "# sort a list\n", "import os\n"]


@pytest.fixture()
def loop(smollm2_f32):
    lp = EngineLoop(smollm2_f32.engine(num_blocks=300))
    yield lp
    lp.close()


def wait_idle(lp, timeout=30):
    end = time.time() + timeout
    while lp.engine.has_unfinished() and time.time() < end:
        time.sleep(0.05)
    time.sleep(0.1)
    assert lp.engine.blocks_in_use() == 0


def test_concurrent_submitters_stream_the_same_samples(smollm2_f32, loop):
    llm = smollm2_f32
    results = {}

    def client(i):
        params = Request(PROMPTS[i], n=3, max_tokens=8, temperature=0.9, seed=i).params()
        stream = loop.submit(llm.prompt_token_ids(PROMPTS[i]), params)
        streamed = {}
        for ev in stream:
            streamed.setdefault(ev.sample_index, []).append(ev.token_id)
        results[i] = (streamed, stream.result())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == [0, 1, 2, 3]
    for i, (streamed, out) in results.items():
        ref = llm.sample(PROMPTS[i], n=3, max_tokens=8, temperature=0.9, seed=i)
        for s, r in zip(out.samples, ref.samples):
            assert s.token_ids == r.token_ids
            assert streamed[s.index] == s.token_ids  # every token was streamed, in order
    wait_idle(loop)


def test_asyncio_consumer(smollm2_f32, loop):
    llm = smollm2_f32

    async def main():
        stream = loop.submit(llm.prompt_token_ids(PROMPTS[0]), Request(PROMPTS[0], n=2, max_tokens=6, seed=3).params())
        tokens = [ev.token_id async for ev in stream]
        return tokens, stream.result()

    tokens, out = asyncio.run(main())
    assert len(tokens) == sum(len(s.token_ids) for s in out.samples) > 0
    wait_idle(loop)


def test_cancel_from_another_thread(smollm2_f32, loop):
    llm = smollm2_f32
    params = Request(PROMPTS[1], n=4, max_tokens=200, ignore_eos=True, seed=1).params()
    stream = loop.submit(llm.prompt_token_ids(PROMPTS[1]), params)
    it = iter(stream)
    next(it)  # it is running
    threading.Thread(target=loop.cancel, args=(stream.request_id,)).start()
    out = stream.result(timeout=60)
    assert {s.finish_reason for s in out.samples} == {"cancelled"}
    assert all(len(s.token_ids) < 200 for s in out.samples)
    wait_idle(loop)


def test_bad_input_raises_at_submit_and_loop_survives(smollm2_f32, loop):
    llm = smollm2_f32
    with pytest.raises(InvalidArgumentError, match="context length"):
        loop.submit([1, 2, 3], Request("x", max_tokens=10**6).params())
    with pytest.raises(InvalidArgumentError, match="token ids"):
        loop.submit([10**9], Request("x").params())
    out = loop.submit(llm.prompt_token_ids(PROMPTS[2]), Request("x", max_tokens=3, seed=0).params()).result(60)
    assert len(out.samples[0].token_ids) >= 1


def test_failed_step_fails_requests_not_the_loop(smollm2_f32, loop, monkeypatch):
    llm = smollm2_f32
    fail_forward_call(monkeypatch, loop.engine.model, 2)
    stream = loop.submit(llm.prompt_token_ids(PROMPTS[0]), Request("x", n=2, max_tokens=20, seed=0).params())
    with pytest.raises(RuntimeError, match="injected failure"):
        stream.result(60)
    wait_idle(loop)
    loop.engine.check_integrity()
    out = loop.submit(llm.prompt_token_ids(PROMPTS[0]), Request("x", n=2, max_tokens=4, seed=0).params()).result(60)
    assert out.samples[0].token_ids == llm.sample(PROMPTS[0], n=2, max_tokens=4, seed=0).samples[0].token_ids


def test_closed_loop_rejects(smollm2_f32):
    lp = EngineLoop(smollm2_f32.engine(num_blocks=50))
    lp.close()
    with pytest.raises(EngineLoopClosed):
        lp.submit([1, 2], Request("x").params())


def test_submit_racing_close_gets_an_error_not_a_wait_forever(smollm2_f32, monkeypatch):
    """`close` landing between submit's closed-check and its hand-over to the thread (here: while
    the request is validated) used to queue the request behind the thread's exit: a stream that
    never ended."""
    lp = EngineLoop(smollm2_f32.engine(num_blocks=50))
    validate = lp.engine.validate_request

    def validate_then_close(prompt_ids, params):
        validate(prompt_ids, params)
        lp.close()

    monkeypatch.setattr(lp.engine, "validate_request", validate_then_close)
    try:
        stream = lp.submit([1, 2, 3], Request("x", max_tokens=2).params())
    except EngineLoopClosed:
        return
    with pytest.raises(EngineLoopClosed):
        stream.result(timeout=5)


def test_raising_hooks_and_consumers_end_every_request_once(smollm2_f32):
    """on_done is called once per request however it ends, also after it raised for an earlier
    request (it used to be switched off for good: the server's in-flight count then never went
    down again); a stream whose asyncio loop is gone has its request cancelled."""
    done, calls = [], {"n": 0}

    def on_done(event):
        calls["n"] += 1
        done.append(event.request_id)
        if calls["n"] == 1:
            raise RuntimeError("a hook that fails")

    lp = EngineLoop(smollm2_f32.engine(num_blocks=100), on_done=on_done)
    try:
        ids = smollm2_f32.prompt_token_ids(PROMPTS[0])
        lp.submit(ids, Request("x", max_tokens=2).params(), "a").result(60)
        lp.submit(ids, Request("x", max_tokens=2).params(), "b").result(60)

        async def first_tokens(stream):
            async for batch in stream.batches():
                return batch

        stream = lp.submit(ids, Request("x", max_tokens=500, ignore_eos=True).params(), "c")
        asyncio.run(first_tokens(stream))  # the consumer's event loop is closed after this
        out = stream.result(60)
        assert {s.finish_reason for s in out.samples} == {"cancelled"}
        wait_idle(lp)
        assert done == ["a", "b", "c"]
    finally:
        lp.close()


def test_events_reach_asyncio_in_order_with_one_wake_up_per_burst():
    """Events pushed from the engine's thread while the asyncio loop is busy arrive complete and
    in order, handed over in one call per burst (not one self-pipe wake-up per token)."""
    from forklm.engine.loop import RequestStream
    from forklm.engine.request import TokenEvent

    streams = [RequestStream(f"r{i}") for i in range(3)]
    pushed = threading.Event()
    calls = []

    async def main():
        running = asyncio.get_running_loop()
        real = running.call_soon_threadsafe
        running.call_soon_threadsafe = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
        queues = [s._attach() for s in streams]

        def engine_thread():
            for t in range(200):
                for i, s in enumerate(streams):
                    s._push(TokenEvent(s.request_id, 0, t * 10 + i))
            for s in streams:
                s._push(TokenEvent(s.request_id, done=True))
            pushed.set()

        threading.Thread(target=engine_thread).start()
        pushed.wait(10)  # the loop is blocked meanwhile: everything lands in one burst
        out = []
        for q in queues:
            got = []
            while True:
                ev = await q.get()
                if ev.done:
                    break
                got.append(ev.token_id)
            out.append(got)
        return out

    out = asyncio.run(main())
    assert out == [[t * 10 + i for t in range(200)] for i in range(3)]
    assert 1 <= len(calls) <= 2
