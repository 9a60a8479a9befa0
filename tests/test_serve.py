"""attnlab serve: the official openai client against a live server (tiny random models on a free
loopback port), errors and their statuses, and continuous batching (concurrent greedy requests give
what each gives served alone)."""

import asyncio
import json
import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from attnlab import build_model, get_preset  # noqa: E402
from attnlab.api import LoadedModel  # noqa: E402
from attnlab.data.tokenizer import char_tokenizer  # noqa: E402
from attnlab.generate import GenerationConfig  # noqa: E402
from attnlab.serve import create_app  # noqa: E402

TEXT = "the quick brown fox jumps over the lazy dog. THE END! 0123456789?,\n"
CONTEXT = 64
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def _models() -> dict:
    tok = char_tokenizer(TEXT + "<>")
    torch.manual_seed(0)
    small = dict(vocab_size=tok.vocab_size, d_model=32, n_heads=2, d_ff=64, dropout=0.0, max_len=CONTEXT)
    lm = build_model(get_preset("gpt-mini", n_decoder_layers=2, **small)).eval()
    llama = build_model(get_preset("llama-mini", n_decoder_layers=2, n_kv_heads=1,
                                   **{**small, "n_heads": 4})).eval()
    enc = build_model(get_preset("bert-mini", n_encoder_layers=1, **small)).eval()
    cls = build_model(get_preset("bert-mini", n_encoder_layers=1, n_classes=2, **small)).eval()
    mt = build_model(get_preset("mt-tiny", n_encoder_layers=1, n_decoder_layers=1, **small)).eval()
    return {"lm": LoadedModel(lm, tok, tok, "lm", "lm"),
            "llama": LoadedModel(llama, tok, tok, "lm", "llama", chat_template=TEMPLATE),
            "enc": LoadedModel(enc, tok, tok, "embedding", "enc"),
            "cls": LoadedModel(cls, tok, tok, "classify", "cls", task={"task": "classify", "labels": ["no", "yes"]}),
            "mt": LoadedModel(mt, tok, tok, "translation", "mt")}


class Live:
    """A uvicorn server in a thread on a free loopback port."""

    def __init__(self, app):
        import uvicorn
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def client(self, cls=None):
        return (cls or openai.OpenAI)(base_url=self.url + "/v1", api_key="-", max_retries=0, timeout=60)

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def models():
    return _models()


@pytest.fixture(scope="module")
def live(models):
    s = Live(create_app(models, max_batch=16))
    yield s
    s.close()


def alone(m, prompt, n, chat=False, **kw):
    """The oracle: the request served alone through the library (no server, no batch)."""
    return m.generate([prompt], GenerationConfig(max_new_tokens=n, **kw), chat=chat)[0]


def test_models_chat_and_completions(live, models):
    c = live.client()
    listed = {m.id: m for m in c.models.list().data}
    assert set(listed) == set(models) and listed["lm"].object == "model"
    r = c.chat.completions.create(model="lm", messages=[{"role": "user", "content": "the fox"}],
                                  max_tokens=12, temperature=0)
    m = models["lm"]
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == alone(m, "the fox", 12)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(m.prompt_ids("the fox"))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # a model with a chat template gets the messages through it
    r = c.chat.completions.create(model="llama", messages=[{"role": "system", "content": "be brief"},
                                                          {"role": "user", "content": "dog?"}],
                                  max_completion_tokens=9, temperature=0)
    assert r.choices[0].message.content == models["llama"].generate(
        ["dog?"], GenerationConfig(max_new_tokens=9), chat=True, system="be brief")[0]
    # completions: several prompts × n choices; a length limit says "length"
    r = c.completions.create(model="lm", prompt=["the lazy", "0123"], max_tokens=7, temperature=0, n=2)
    assert r.object == "text_completion" and len(r.choices) == 4
    assert [ch.text for ch in r.choices] == [alone(m, "the lazy", 7)] * 2 + [alone(m, "0123", 7)] * 2
    full = alone(m, "THE", 30)
    r = c.completions.create(model="lm", prompt="THE", max_tokens=30, temperature=0)
    assert r.choices[0].text == full
    if len(full) == 30:
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 30
    # a stop string cuts the text before it and ends with "stop"
    stop = full[5:7]
    r = c.completions.create(model="lm", prompt="THE", max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_streaming_with_usage(live, models):
    c = live.client()
    chunks = list(c.chat.completions.create(model="lm", messages=[{"role": "user", "content": "quick"}],
                                            max_tokens=15, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == alone(models["lm"], "quick", 15)
    with_choices = [ch for ch in chunks if ch.choices]
    assert with_choices[-1].choices[0].finish_reason in ("stop", "length")
    assert all(ch.choices[0].finish_reason is None for ch in with_choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(text)  # one char per token
    full = alone(models["lm"], "fox", 30)
    stop = full[6:8]  # a stop string in a stream: nothing of it is sent
    chunks = list(c.chat.completions.create(model="lm", messages=[{"role": "user", "content": "fox"}], max_tokens=30,
                                            temperature=0, stream=True, stop=stop))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == full[: full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    # completions stream too; the raw stream ends with [DONE]
    pieces = list(c.completions.create(model="lm", prompt="over", max_tokens=8, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == alone(models["lm"], "over", 8)
    with httpx.stream("POST", live.url + "/v1/completions", json={"model": "lm", "prompt": "a", "max_tokens": 3,
                                                                "stream": True}) as r:
        lines = [l for l in r.iter_lines() if l]
    assert lines[-1] == "data: [DONE]" and all(l.startswith("data: ") for l in lines)


def test_sampling_is_seeded_and_equals_the_library(live, models):
    c = live.client()
    kw = dict(model="lm", prompt="the", max_tokens=20, temperature=0.8, top_p=0.9, seed=7)
    a, b = (c.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b == alone(models["lm"], "the", 20, do_sample=True, temperature=0.8, top_p=0.9, seed=7)


def test_embeddings_translate_classify_health_metrics(live, models):
    c = live.client()
    texts = ["the quick fox", "dog", "0123456789 and more"]
    want = models["enc"].embed(texts)
    got = c.embeddings.create(model="enc", input=texts)  # the client asks for base64
    assert len(got.data) == 3 and got.usage.prompt_tokens == sum(len(t) for t in texts)
    assert np.abs(np.array([d.embedding for d in got.data]) - want).max() < 1e-6
    floats = c.embeddings.create(model="enc", input="dog", encoding_format="float")
    assert np.abs(np.array(floats.data[0].embedding) - want[1]).max() < 1e-6
    r = httpx.post(live.url + "/v1/translate", json={"model": "mt", "texts": ["the dog", "fox"], "beam": 2,
                                                     "max_len": 6}).json()
    assert r["translations"] == models["mt"].translate(["the dog", "fox"], GenerationConfig(num_beams=2,
                                                                                           max_new_tokens=6))
    r = httpx.post(live.url + "/v1/classify", json={"texts": ["the dog", "fox?"]}).json()  # the only classifier
    assert [x["label"] for x in r["results"]] == [label for label, _ in models["cls"].classify(["the dog", "fox?"])]
    maps = httpx.post(live.url + "/v1/attention", json={"model": "mt", "text": "the dog", "translation": "fox"}).json()
    S, T = len(maps["src_tokens"]), len(maps["tgt_in_tokens"])
    assert np.array(maps["cross"]).shape == (1, 2, T, S) and np.array(maps["encoder"]).shape == (1, 2, S, S)
    assert np.allclose(np.array(maps["cross"]).sum(-1), 1, atol=1e-4) and maps["translation"] == "fox"
    own = httpx.post(live.url + "/v1/attention", json={"text": "the dog", "beam": 1}).json()  # the only translator
    assert own["translation"] == models["mt"].translate(["the dog"], GenerationConfig(num_beams=1))[0]
    page = httpx.get(live.url + "/")
    assert page.status_code == 200 and "/v1/chat/completions" in page.text and "/v1/attention" in page.text
    assert "http" not in page.text.replace("http-equiv", "")  # no CDN: everything comes from this server
    assert httpx.get(live.url + "/health").json()["status"] == "ok"
    metrics = httpx.get(live.url + "/metrics").text
    for name in ("attnlab_requests_total", "attnlab_tokens_total", "attnlab_queue_depth", "attnlab_batch_size",
                 "attnlab_time_to_first_token_seconds"):
        assert name in metrics


def test_errors_have_openai_shape_and_the_server_keeps_serving(live, models):
    c = live.client()
    user = [{"role": "user", "content": "hi"}]
    cases = [
        (404, dict(model="nope", messages=user)),
        (400, dict(model="lm", messages=[])),
        (400, dict(model="lm", messages=user, max_tokens=CONTEXT)),  # prompt + max_tokens past the context
        (400, dict(model="enc", messages=user)),  # not a language model
        (422, dict(model="lm", messages=user, temperature=-1)),
        (422, dict(model="lm", messages=user, max_tokens="many")),
        (422, dict(model="lm", messages="hi")),
        (400, dict(model="lm", messages=user, presence_penalty=0.5)),
        (400, dict(model="lm", messages=user, stop=["a"] * 5)),
        # what it cannot honour is refused, not ignored; a seed past torch's generator is the client's error
        (400, dict(model="lm", messages=user, logit_bias={"3": -100})),
        (400, dict(model="lm", messages=user, response_format={"type": "json_object"})),
        (400, dict(model="lm", messages=user, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])),
        (400, dict(model="lm", messages=user, seed=2 ** 64)),
        (400, dict(model="lm", messages=user, seed=2 ** 64 - 1, n=2)),  # (choice j samples with seed + j)
    ]
    for status, kw in cases:
        with pytest.raises(openai.APIStatusError) as e:
            c.chat.completions.create(**kw)
        assert e.value.status_code == status, kw
        err = e.value.body if "message" in (e.value.body or {}) else e.value.body["error"]
        assert set(err) >= {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="lm", prompt="x" * CONTEXT, max_tokens=1)
    for kw in (dict(echo=True), dict(suffix="END"), dict(best_of=3)):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="lm", prompt="the", max_tokens=2, **kw)
        assert e.value.body["param"] == next(iter(kw)) and e.value.body["code"] == "unsupported"
    # their defaults are accepted (clients send them)
    r = c.completions.create(model="lm", prompt="the", max_tokens=3, temperature=0, best_of=1, echo=False, seed=-1)
    assert r.choices[0].text == alone(models["lm"], "the", 3)
    r = c.chat.completions.create(model="lm", messages=user, max_tokens=3, temperature=0, response_format={"type": "text"},
                                  logit_bias={}, tools=[])
    assert r.choices[0].message.content == alone(models["lm"], "hi", 3)
    with pytest.raises(openai.BadRequestError):
        c.embeddings.create(model="enc", input=[""])
    too_long = httpx.post(live.url + "/v1/translate", json={"texts": ["the dog " * 20]})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        c.embeddings.create(model="lm-typo", input="x")
    bad = httpx.post(live.url + "/v1/chat/completions", content=b"{not json",
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["message"]
    big = httpx.post(live.url + "/v1/completions", content=b"{" + b" " * (10 << 20) + b"}",
                     headers={"content-type": "application/json"})
    assert big.status_code == 413 and "error" in big.json()
    def chunks():  # no content-length: the limit holds for a streamed body too
        for _ in range(20):
            yield b" " * (1 << 19)
    assert httpx.post(live.url + "/v1/completions", content=chunks()).status_code == 413
    assert httpx.get(live.url + "/v1/nothing").json()["error"]["type"] == "invalid_request_error"
    r = c.chat.completions.create(model="lm", messages=user, max_tokens=4, temperature=0)  # still serving
    assert r.choices[0].message.content == alone(models["lm"], "hi", 4)


def test_concurrent_mixed_requests_equal_served_alone(live, models):
    prompts = ["the", "quick brown fox", "a", "lazy dog jumps over", "0123", "THE END", "zz", "fox?"]

    async def one(c, i):
        p, n, name = prompts[i % len(prompts)], 4 + (i * 7) % 25, ("lm", "llama")[i % 2]
        if i % 4 == 3:  # sampled with a seed
            r = await c.completions.create(model=name, prompt=p, max_tokens=n, temperature=0.7, seed=i)
            return name, p, n, False, dict(do_sample=True, temperature=0.7, seed=i), r.choices[0].text
        if i % 4 == 2:  # streamed
            s = await c.chat.completions.create(model=name, messages=[{"role": "user", "content": p}], max_tokens=n,
                                                temperature=0, stream=True)
            return name, p, n, True, {}, "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])
        if i % 4 == 1:
            r = await c.completions.create(model=name, prompt=p, max_tokens=n, temperature=0)
            return name, p, n, False, {}, r.choices[0].text
        r = await c.chat.completions.create(model=name, messages=[{"role": "user", "content": p}], max_tokens=n,
                                            temperature=0)
        return name, p, n, True, {}, r.choices[0].message.content

    # Two waves, so that prefills ride inside a running step whatever the machine's speed: the first 16
    # requests start both engines; each engine's first step then waits (30 s at most) until two requests
    # (the second wave's, or first-wave stragglers) are queued behind its running batch (every row asks
    # for 4+ tokens, and these tiny models' rows do not end early, so the batch is still running). Sent
    # all at once, a busy machine could queue all 16 requests of an engine before its first admission,
    # or finish each batch before the next request arrives (both seen in CI).
    engines = live.server.config.app.state.server.engines
    saved = {name: engines[name].on_step for name in ("lm", "llama")}
    stepping = {name: threading.Event() for name in saved}
    packed_before = {name: engines[name].packed_prefills for name in saved}

    def waiting(name, then):
        first = [True]

        def on_step(rows):
            if first[0]:
                first[0] = False
                stepping[name].set()
                deadline = time.time() + 30
                while len(engines[name]._pending) < 2 and time.time() < deadline:
                    time.sleep(0.001)
            if then:
                then(rows)
        return on_step

    async def all_of_them():
        c = live.client(openai.AsyncOpenAI)
        first = [asyncio.create_task(one(c, i)) for i in range(16)]
        started = await asyncio.to_thread(lambda: all(e.wait(60) for e in stepping.values()))
        assert started, "an engine never stepped"
        return await asyncio.gather(*first, *(one(c, i) for i in range(16, 32)))

    for name, then in saved.items():
        engines[name].on_step = waiting(name, then)
    try:
        results = asyncio.run(all_of_them())
    finally:
        for name, then in saved.items():
            engines[name].on_step = then
    for name, p, n, chat, kw, text in results:  # llama has a chat template: chat requests go through it
        assert text == alone(models[name], p, n, chat=chat and name == "llama", **kw), (name, p, n, chat, kw)
    assert max(engines["lm"].largest_prefill, engines["llama"].largest_prefill) > 1  # left-padded prefills ran
    assert all(engines[name].packed_prefills > packed_before[name] for name in saved)  # and prefills inside a step
    batches = httpx.get(live.url + "/metrics").text
    assert any(line.startswith('attnlab_batch_size_bucket{le="1.0",model="lm"}') for line in batches.splitlines())


def test_concurrent_translations_and_embeddings_are_batched_and_equal_alone(live, models):
    """Translation requests (greedy and beam search, different lengths and length penalties) join one
    running decoder batch; each answer equals the sentence translated alone. Embedding requests that wait
    together are embedded in one call; each equals ``embed`` alone."""
    mt, enc = models["mt"], models["enc"]
    sources = ["the dog", "fox", "the quick brown fox jumps", "a", "lazy dog over the", "0123", "THE END", "dog?"]
    engine = live.server.config.app.state.server.engines["mt"]
    engine.on_step = lambda rows: time.sleep(0.002)  # a decoder step slow enough that requests overlap
    sizes = []
    step = engine.on_step
    engine.on_step = lambda rows: (sizes.append(rows), step(rows))

    def request(i):
        return {"model": "mt", "texts": [sources[i % len(sources)]], "beam": (1, 2, 4)[i % 3],
                "lenpen": (0.6, 0.0, 1.0)[i % 3], "max_len": 5 + i % 7}

    async def all_of_them():
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as c:
            tr = [c.post("/v1/translate", json=request(i)) for i in range(24)]
            em = [c.post("/v1/embeddings", json={"model": "enc", "input": [sources[i % 8], sources[(i + 3) % 8]]})
                  for i in range(16)]
            return await asyncio.gather(*tr, *em)

    try:
        out = asyncio.run(all_of_them())
    finally:
        engine.on_step = None
    for i, r in enumerate(out[:24]):
        q = request(i)
        cfg = GenerationConfig(num_beams=q["beam"], length_penalty=q["lenpen"], max_new_tokens=q["max_len"])
        (text, score), = mt.translate(q["texts"], cfg, nbest=True)[0][:1]
        body = r.json()
        assert body["translations"] == [text], (i, q)
        if q["beam"] > 1:  # (greedy decoding alone keeps no score; the server reports it)
            assert abs(body["scores"][0] - score) < 1e-4
    assert max(sizes) > 1  # requests really shared decoder steps
    for i, r in enumerate(out[24:]):
        got = np.array([d["embedding"] for d in r.json()["data"]])
        assert np.abs(got - enc.embed([sources[i % 8], sources[(i + 3) % 8]])).max() < 1e-5


@pytest.mark.parametrize("name", ["lm", "llama"])  # learned positions; RoPE with GQA
def test_prompts_that_share_a_prefix_reuse_its_kv_and_equal_alone(models, name):
    """A shared start (a system prompt) is computed once: later prompts copy its K/V and prefill only
    their own tokens; greedy answers still equal the requests served alone."""
    m = models[name]
    shared = "the quick brown fox jumps over "
    tails = ["the lazy dog", "a dog", "0123", "THE END", "fox?", "the", "lazy", "zz"]
    s = Live(create_app({"lm": m}, max_batch=8))
    try:
        engine = s.server.config.app.state.server.engines["lm"]
        c = s.client()
        first = c.completions.create(model="lm", prompt=shared + "dog", max_tokens=8, temperature=0)  # kept
        assert first.choices[0].text == alone(m, shared + "dog", 8) and engine.prefix_hits == 0

        async def all_of_them():
            ac = s.client(openai.AsyncOpenAI)
            return await asyncio.gather(*(ac.completions.create(model="lm", prompt=shared + t, max_tokens=10,
                                                                  temperature=0) for t in tails))
        out = asyncio.run(all_of_them())
        assert [r.choices[0].text for r in out] == [alone(m, shared + t, 10) for t in tails]
        assert engine.prefix_hits >= len(tails)  # every one of them started from the kept K/V
    finally:
        s.close()


@pytest.mark.parametrize("name", ["lm", "llama"])  # learned positions; RoPE with GQA
def test_the_batch_cache_changes_in_place_and_answers_equal_alone(models, name):
    """The engine's batch cache lives in buffers of max_batch rows: a newcomer no longer than the batch is
    written into free rows (the running rows are not copied), a finished row's place is taken by the last
    row, all-padding columns are shifted out in place, and the buffers grow when the columns run out.
    Through all of it every greedy answer equals the request served alone."""
    from attnlab.serve.engine import Engine, Request
    m = models[name]
    eng = Engine(m, max_batch=6)
    eng.ROOM, eng.CUT_MIN = 3, 2  # small enough that growth and cuts happen within a few steps

    def request(prompt, n):
        r = Request(prompt=m.prompt_ids(prompt), max_new_tokens=n)
        r.events = []
        r._emit = r.events.append
        return r

    def step():
        eng._step()
        eng._drop_finished()

    def buffer():
        return eng._bufs[0][0].data_ptr()

    def check_cache():
        """Every row's real K/V columns are those of its tokens run alone (the oracle: a fresh forward)."""
        for row, r in enumerate(eng._rows):
            ids = r.prompt + r.generated[:-1]  # the newest token is fed by the next step
            alone_cache = m.module.new_cache()
            m.module(torch.tensor([ids]), cache=alone_cache)
            real = eng._mask[row]
            assert int(real.sum()) == len(ids)
            for (bc, _), (ac, _) in zip(eng._cache.layers, alone_cache.layers):
                assert torch.isfinite(bc.v[row][:, :eng._cache.length]).all()  # padding too: 0 × NaN would be NaN
                torch.testing.assert_close(bc.k[row][:, :eng._cache.length][:, real], ac.k[0, :, :len(ids)])
                torch.testing.assert_close(bc.v[row][:, :eng._cache.length][:, real], ac.v[0, :, :len(ids)])

    asked, seen = [], {"in_place_join": 0, "moved": 0, "cut": 0, "grown": 0}
    with torch.inference_mode():
        for wave in ([("the quick brown fox jumps", 9), ("a", 3), ("lazy dog over", 12)],
                     [("0123", 4), ("THE END", 10)], [("fox?", 6)], [("zz", 11), ("the dog", 2)]):
            reqs = [request(p, n) for p, n in wave]
            before = buffer() if eng._rows else None
            length = eng._cache.length if eng._rows else 0
            eng._admit_all(reqs)
            asked += [(r, p, n) for r, (p, n) in zip(reqs, wave)]
            if before is not None and max(len(r.prompt) for r in reqs) <= length and buffer() == before:
                seen["in_place_join"] += 1
            check_cache()
            for _ in range(3):
                if not eng._rows:
                    break
                rows, ptr, cols = list(eng._rows), buffer(), eng._bufs[0][0].shape[2]
                length = eng._cache.length
                step()
                if not eng._rows:
                    break
                left = [r for r in rows if r.cancelled]
                if left and rows[:len(eng._rows)] != eng._rows:
                    seen["moved"] += 1  # a later row took a finished row's place
                if eng._cache.length < length + 1:
                    seen["cut"] += 1
                if eng._bufs[0][0].shape[2] > cols and buffer() != ptr:
                    seen["grown"] += 1
                assert eng._cache.layers[0][0].k.data_ptr() == buffer()  # the cache is a view of the buffers
                assert eng._mask.shape == (len(eng._rows), eng._cache.length)
                check_cache()
        while eng._rows:
            step()
            check_cache()
    assert all(seen.values()), seen
    for r, p, n in asked:
        assert r.events[-1][0] == "done"
        assert m.tokenizer.decode([t for kind, t in r.events if kind == "token"]) == alone(m, p, n), (p, n)


def test_a_model_that_loads_answers_503_until_ready(models):
    ready = threading.Event()

    def slow():
        ready.wait(30)
        return models["lm"]
    s = Live(create_app({"slow": slow, "enc": models["enc"]}))
    try:
        c = s.client()
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503 and health.json()["loading"] == {"slow": "loading"}
        with pytest.raises(openai.APIStatusError) as e:
            c.chat.completions.create(model="slow", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "model_loading"
        assert c.embeddings.create(model="enc", input="dog").data  # the loaded model already serves
        ready.set()
        deadline = time.time() + 20
        while httpx.get(s.url + "/health").status_code != 200:
            assert time.time() < deadline
            time.sleep(0.02)
        r = c.chat.completions.create(model="slow", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                      temperature=0)
        assert r.choices[0].message.content == alone(models["lm"], "hi", 3)
    finally:
        ready.set()
        s.close()
    failing = Live(create_app({"bad": lambda: (_ for _ in ()).throw(OSError("disk gone"))}))
    try:
        deadline = time.time() + 10
        while "failed" not in httpx.get(failing.url + "/health").json()["loading"].get("bad", "failed"):
            assert time.time() < deadline
            time.sleep(0.02)
        r = httpx.post(failing.url + "/v1/completions", json={"model": "bad", "prompt": "a"})
        assert r.status_code == 503 and "disk gone" in r.json()["error"]["message"]
    finally:
        failing.close()


def test_full_queue_is_429_and_a_disconnect_leaves_the_batch(models):
    m = models["lm"]
    n = CONTEXT - 8
    prompt = next(p for p in ("the", "a", "fox", "0", "dog", "THE", "?", "lazy") if len(alone(m, p, n)) == n)
    s = Live(create_app({"lm": m}, max_batch=1, max_queue=1))
    try:
        c = s.client()
        engine = s.server.config.app.state.server.engines["lm"]
        engine.on_step = lambda rows: time.sleep(0.02)  # slow decoding down: the queue fills for sure
        stream = c.completions.create(model="lm", prompt=prompt, max_tokens=n, temperature=0, stream=True)
        next(iter(stream))  # it holds the only batch row now
        waiting = threading.Thread(target=lambda: c.completions.create(model="lm", prompt="a", max_tokens=2))
        waiting.start()
        deadline = time.time() + 10
        while engine.queue_depth < 1 and time.time() < deadline:
            time.sleep(0.005)
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model="lm", prompt="b", max_tokens=2)
        assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
        stream.close()  # the client goes away: its row leaves the batch long before its n tokens
        waiting.join(timeout=30)
        deadline = time.time() + 10
        while (engine.batch_size or engine.queue_depth) and time.time() < deadline:
            time.sleep(0.01)
        assert engine.batch_size == 0 and engine.queue_depth == 0 and engine.steps < n
        # a client of a non-streamed request that gives up (time-out) leaves the batch too
        before = engine.steps
        impatient = s.client().with_options(timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model="lm", prompt=prompt, max_tokens=n, temperature=0)
        deadline = time.time() + 10
        while engine.batch_size and time.time() < deadline:
            time.sleep(0.01)
        assert engine.batch_size == 0 and engine.steps - before < n
    finally:
        s.close()


def test_cli_serve_arguments():
    from attnlab.cli import main
    from attnlab.cli.serve import model_specs
    assert model_specs(["runs/lm/", "mt=runs/enzh", "smollm2"]) == {"lm": "runs/lm/", "mt": "runs/enzh",
                                                                    "smollm2": "smollm2"}
    assert main(["serve", "--model", "a", "--model", "x=a", "--model", "a", "--port", "1"]) == 2
    assert main(["--dry-run", "serve", "--model", "lm"]) == 0


def test_cli_serve_loads_the_models_and_runs_uvicorn(models, monkeypatch, capsys):
    import uvicorn

    import attnlab
    from attnlab.cli import main
    seen = {}

    class FakeServer:  # runs the app's startup (background loading) instead of listening
        def __init__(self, config):
            seen.update(app=config.app, port=config.port)
            self.should_exit = False

        def run(self):
            server = seen["app"].state.server
            server.load_in_background()
            deadline = time.time() + 10
            while server.loading and not self.should_exit and time.time() < deadline:
                time.sleep(0.01)

    def load(spec, device, bf16, quantize):
        if spec == "broken":
            raise FileNotFoundError("no model at broken")
        seen["quantize"] = quantize
        return models["lm"]
    monkeypatch.setattr(attnlab, "load", load)
    monkeypatch.setattr(uvicorn, "Server", FakeServer)
    assert main(["serve", "--model", "mine=runs/lm", "--port", "8123", "--max-batch", "4", "--quantize", "int8"]) == 0
    assert seen["port"] == 8123 and set(seen["app"].state.server.engines) == {"mine"}
    assert seen["app"].state.server.engines["mine"].max_batch == 4 and seen["quantize"] == "int8"
    assert "mine = runs/lm (lm, decoder-only) is ready" in capsys.readouterr().out
    assert main(["serve", "--model", "broken"]) == 1  # a model that cannot load stops the server
    assert "--model broken=broken: FileNotFoundError: no model at broken" in capsys.readouterr().err
    monkeypatch.setitem(__import__("sys").modules, "uvicorn", None)  # not installed
    assert main(["serve", "--model", "runs/lm"]) == 1
    assert 'pip install "attnlab[serve]"' in capsys.readouterr().err


def test_a_quantised_model_builds_attnlabs_kernels_as_it_loads(monkeypatch):
    """A quantised model's install asks for attnlab's kernels (their first build takes 15-30 s): at load,
    not in its first request; a float model does not."""
    from attnlab import quant
    calls = []
    monkeypatch.setattr(quant, "own_kernels", lambda: calls.append(1) or False)
    plain, q = _models()["lm"], _models()["lm"]
    quant.quantize_model(q.module, "int8")
    create_app({"plain": plain}, max_batch=2)
    assert calls == []
    create_app({"q": q}, max_batch=2)
    assert calls == [1]


PAGE_DRIVER = r"""
// A minimal DOM for the page's script: enough elements to run it under node against a live server.
const BASE = process.argv[2];
const els = {};
class El {
  constructor(tag, id) { this.tag = tag; this.id = id; this.children = []; this.value = ""; this.textContent = "";
    this.hidden = false; this.disabled = false; this.style = {}; this.className = ""; this.scrollTop = 0; this._html = ""; }
  set innerHTML(v) { this._html = v; this.children = []; this.value = ""; } get innerHTML() { return this._html; }
  appendChild(c) { this.children.push(c); if (c.tag === "option" && this.value === "") this.value = c.value; return c; }
  createTHead() { return this.appendChild(new El("thead")); } createTBody() { return this.appendChild(new El("tbody")); }
  insertRow() { return this.appendChild(new El("tr")); } insertCell() { return this.appendChild(new El("td")); }
  all(tag) { return this.children.flatMap(c => (c.tag === tag ? [c] : []).concat(c.all(tag))); }
}
global.document = { getElementById: id => els[id] || (els[id] = new El("div", id)), createElement: t => new El(t) };
const realFetch = fetch;
global.fetch = (path, opts) => realFetch(BASE + path, opts);
els.maxTok = new El("input"); els.maxTok.value = "12"; els.temp = new El("input"); els.temp.value = "0";
els.beam = new El("input"); els.beam.value = "2"; els.kind = new El("select"); els.kind.value = "cross";
require(process.argv[3]);
const sleep = ms => new Promise(r => setTimeout(r, ms));
(async () => {
  await sleep(300);
  const opts = sel => sel.children.map(o => String(o.value));
  const $ = id => document.getElementById(id);
  const out = {chatModels: opts($("chatModel")), mtModels: opts($("mtModel"))};
  $("msg").value = "the fox"; await $("send").onclick();
  out.log = $("log").children.map(c => c.textContent); out.status = $("chatStatus").textContent;
  $("src").value = "the dog"; await $("go").onclick();
  out.translation = $("out").textContent;
  const table = $("heat").children[0];
  out.cells = table ? table.all("td").length : 0;
  out.layers = opts($("layer")); out.heads = opts($("head"));
  if (table) { table.all("td")[0].onmouseenter(); out.hover = $("hover").textContent; }
  console.log(JSON.stringify(out));
})().catch(e => { console.log(JSON.stringify({error: String(e)})); process.exit(1); });
"""


def test_page_chats_and_draws_attention_under_node(live, models, tmp_path):
    """The page's own script, run by node with a minimal DOM against the live server: the chat box
    streams a reply, the translate box shows the translation and a heatmap with hover text."""
    import shutil
    import subprocess
    if not shutil.which("node"):
        pytest.skip("node is not installed")
    from attnlab.serve.page import PAGE
    (tmp_path / "page.js").write_text(PAGE.split("<script>")[1].split("</script>")[0], encoding="utf-8")
    (tmp_path / "driver.js").write_text(PAGE_DRIVER, encoding="utf-8")
    r = subprocess.run(["node", str(tmp_path / "driver.js"), live.url, str(tmp_path / "page.js")],
                       capture_output=True, text=True, timeout=60)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["chatModels"] == ["lm", "llama"] and out["mtModels"] == ["mt"]
    assert out["log"] == ["you: the fox", alone(models["lm"], "the fox", 12)]
    assert out["status"].startswith("finished: ")
    want = models["mt"].translate(["the dog"], GenerationConfig(num_beams=2))[0]
    assert out["translation"] == want and out["layers"] == ["0"] and out["heads"] == ["mean", "0", "1"]
    maps = models["mt"].attention("the dog", want)
    assert out["cells"] == maps["cross"][0].shape[1] * maps["cross"][0].shape[2]
    assert " → " in out["hover"]


def test_engine_failures_in_a_packed_step_fail_the_batch_and_the_engine_goes_on(models):
    """Driven directly (no thread): a newcomer's prompt rides in the running rows' step; when that packed
    forward fails, the newcomer and the running rows get the error (their caches were half-written) and
    the engine is empty; a newcomer whose first token cannot be picked fails alone; then the engine
    serves again and its greedy answer is the one served alone."""
    from attnlab.serve.engine import Engine, Request
    lm = models["lm"]
    prompt = lm.prompt_ids("the quick")

    def request(n=6):
        r = Request(prompt=list(prompt), max_new_tokens=n)
        r.events = []
        r._emit = r.events.append
        return r

    eng = Engine(lm, max_batch=4)
    with torch.inference_mode():
        running = request()
        eng._admit_all([running])
        eng.net.forward_packed = lambda groups: (_ for _ in ()).throw(RuntimeError("out of memory"))
        newcomer = request()
        eng._admit_all([newcomer])
        del eng.net.forward_packed
        assert eng._rows == [] and eng.packed_prefills == 0
        for r in (running, newcomer):
            assert r.events[-1][0] == "error" and "out of memory" in str(r.events[-1][1])

        running = request()
        eng._admit_all([running])
        bad = request()
        eng._pick = lambda req, logits: (_ for _ in ()).throw(ValueError("nan")) if req is bad else Engine._pick(eng, req, logits)
        eng._admit_all([bad])
        assert bad.events[-1][0] == "error" and len(eng._rows) == 1 and eng._rows[0] is running
        assert eng.packed_prefills == 1
        del eng._pick

        late = request()
        eng._admit_all([late])
        while eng._rows:
            eng._step()
            eng._drop_finished()
        assert eng.packed_prefills == 2
    want = alone(lm, "the quick", 6)
    for r in (running, late):
        assert r.events[-1][0] == "done"
        assert lm.tokenizer.decode([t for kind, t in r.events if kind == "token"]) == want


def test_a_requests_own_failure_leaves_the_batch_serving(models):
    """Driven directly (no thread): a sampled row whose pick fails at a later step leaves with its error alone,
    and the greedy row beside it gives its answer served alone; a temperature under MIN_TEMPERATURE (1e-39
    overflowed the scaled logits and failed the whole batch) decodes greedily, as vLLM."""
    from attnlab.serve.engine import Engine, Request
    lm = models["lm"]
    prompt = lm.prompt_ids("the quick")

    def request(n=6, **kw):
        r = Request(prompt=list(prompt), max_new_tokens=n, **kw)
        r.events = []
        r._emit = r.events.append
        return r

    eng = Engine(lm, max_batch=4)
    with torch.inference_mode():
        greedy, bad, tiny = request(), request(temperature=0.7, seed=1), request(temperature=1e-39, seed=1)
        eng._admit_all([greedy, bad, tiny])
        assert len(eng._rows) == 3
        pick = eng._pick
        eng._pick = lambda req, logits: (_ for _ in ()).throw(RuntimeError("probability tensor contains nan")) \
            if req is bad else pick(req, logits)
        while eng._rows:
            eng._step()
            eng._drop_finished()
    assert bad.events[-1][0] == "error" and "nan" in str(bad.events[-1][1])
    want = alone(lm, "the quick", 6)
    for r in (greedy, tiny):
        assert r.events[-1][0] == "done"
        assert lm.tokenizer.decode([t for kind, t in r.events if kind == "token"]) == want


def test_a_classifier_without_max_len_in_its_task_reads_texts_as_long_as_its_positions(models):
    """encode_for_classifier cuts at the task's max_len (128 by default) after adding <s>: a model whose record has
    none (built by hand, as here) is cut at its own positions, so a text /v1/embeddings accepts (as many tokens as
    the model has positions) embeds and classifies instead of running past the learned table."""
    cls = models["cls"]
    text = "the dog " * (CONTEXT // 8)
    assert len(cls.tokenizer.encode(text)) == CONTEXT and "max_len" not in cls.task
    assert cls.embed([text]).shape == (1, 32) and len(cls.classify([text])) == 1


def test_requests_that_left_the_queue_neither_wait_nor_count():
    """A queued request whose client went away (cancelled) is not a waiting request: it does not fill the queue
    (a new request was refused 429 for it) and /health's depth does not count it."""
    from attnlab.serve.engine import Engine, QueueFull, Request
    models = _models()
    eng = Engine(models["lm"], max_batch=1, max_queue=1)
    eng._start = lambda: None  # (no engine thread: the queue is all there is)
    eng._rows = [Request(prompt=[1], max_new_tokens=1)]  # the batch's only row is taken
    first = eng.submit(Request(prompt=[1], max_new_tokens=1))
    assert eng.queue_depth == 1
    with pytest.raises(QueueFull):
        eng.submit(Request(prompt=[1], max_new_tokens=1))
    first.cancel()
    assert eng.queue_depth == 0
    eng.submit(Request(prompt=[1], max_new_tokens=1))
    assert eng.queue_depth == 1 and len(eng._pending) == 1


def test_attention_runs_while_the_batch_is_full_and_its_full_queue_is_429(models):
    """/v1/attention is a call on the translator's thread between two steps: with the batch full (max_batch 1,
    one long translation running) it is answered before that translation ends; with the queue full it is a 429
    (it was a 500)."""
    s = Live(create_app({"mt": models["mt"]}, max_batch=1, max_queue=1))
    try:
        engine = s.server.config.app.state.server.engines["mt"]
        engine.on_step = lambda rows: time.sleep(0.03)  # ~50 steps: a translation takes ~1.5 s or more
        long = {}
        runner = threading.Thread(target=lambda: long.setdefault("r", httpx.post(
            s.url + "/v1/translate", json={"texts": ["the quick brown fox"], "beam": 1, "max_len": 50}, timeout=60)))
        runner.start()
        deadline = time.time() + 10
        while engine.batch_size < 1 and time.time() < deadline:
            time.sleep(0.005)
        r = httpx.post(s.url + "/v1/attention", json={"text": "the dog", "translation": "dog"}, timeout=60)
        assert r.status_code == 200 and engine.batch_size == 1 and "r" not in long  # the translation goes on
        waiting = threading.Thread(target=lambda: httpx.post(s.url + "/v1/translate", json={"texts": ["a"], "beam": 1},
                                                             timeout=60))
        waiting.start()
        while engine.queue_depth < 1 and time.time() < deadline:
            time.sleep(0.005)
        full = httpx.post(s.url + "/v1/attention", json={"text": "the dog", "translation": "dog"}, timeout=60)
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        runner.join(timeout=60)
        waiting.join(timeout=60)
        assert long["r"].status_code == 200
    finally:
        s.close()


def test_a_translation_past_learned_positions_fails_alone(models):
    """A translator with learned positions (BART's kind) has at most max_len target positions: the default budget
    stops there (it failed the batch at the table's end), a larger max_len is that request's 400, and a request
    beside it that fits is answered as served alone."""
    from concurrent.futures import ThreadPoolExecutor
    tok = models["mt"].tokenizer
    torch.manual_seed(0)
    net = build_model(get_preset("mt-tiny", n_encoder_layers=1, n_decoder_layers=1, vocab_size=tok.vocab_size,
                                 d_model=32, n_heads=2, d_ff=64, dropout=0.0, max_len=16, positions="learned")).eval()
    mt = LoadedModel(net, tok, tok, "translation", "mt")
    endless = GenerationConfig(num_beams=1, min_new_tokens=10 ** 6)  # (never ends: runs to its budget)
    assert len(generate_ids(mt, "the dog", endless)) == 16
    with pytest.raises(ValueError, match="max_new_tokens=17 is past the decoder's learned position table"):
        mt.translate(["the dog"], GenerationConfig(max_new_tokens=17))
    s = Live(create_app({"mt": mt}))
    try:
        with ThreadPoolExecutor(2) as pool:
            too_long, fits = pool.map(lambda n: httpx.post(s.url + "/v1/translate", timeout=60, json={
                "texts": ["the dog"], "beam": 1, "max_len": n}), (100, 12))
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_len"
        assert "past mt's learned target positions: at most 16" in too_long.json()["error"]["message"]
        assert fits.status_code == 200
        assert fits.json()["translations"] == mt.translate(["the dog"], GenerationConfig(max_new_tokens=12))
        default = httpx.post(s.url + "/v1/translate", json={"texts": ["the dog"], "beam": 2}, timeout=60)
        assert default.status_code == 200 and default.json()["translations"] == mt.translate(
            ["the dog"], GenerationConfig(num_beams=2))
    finally:
        s.close()


def generate_ids(m, text, cfg):
    from attnlab.generate import generate
    return generate(m.module, torch.tensor([m.tokenizer.encode(text, eos=True)]), None, cfg).sequences[0]


def test_chat_templates_render_with_hugging_faces_globals(models):
    """The template sees bos_token / eos_token (Llama 3 begins with {{ bos_token }}) and raise_exception: a template
    that refuses the messages (Mistral's: roles must alternate) is the client's 400 with its message, streamed or
    not (it was a 500), and a ValueError in the library."""
    template = ("{{ bos_token }}{% for m in messages %}{% if loop.index0 % 2 == 1 and m.role == 'user' %}"
                "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
                "<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}<assistant>")
    base = models["llama"]
    m = LoadedModel(base.module, base.tokenizer, base.tokenizer, "lm", "strict", chat_template=template)
    tok = m.tokenizer
    ids = m.chat_ids([{"role": "user", "content": "hi"}])
    assert ids[0] == tok.bos_id and tok.eos_id in ids
    twice = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        m.chat_ids(twice)
    # a turn's start is text in a chat model's answer (stop strings see it); without a template BOS is no text
    x = tok.encode("x")[0]
    assert tok.id_to_token(tok.bos_id) in m.continuation(ids, [x, tok.bos_id, x])
    lm = models["lm"]
    assert lm.continuation([x], [x, lm.tokenizer.bos_id, lm.tokenizer.pad_id, x]) == lm.continuation([x], [x, x])
    # a template's own fault is not the messages' (no ValueError: the server's 500); HF's loop controls work
    from jinja2.exceptions import TemplateSyntaxError
    from attnlab.pretrained import apply_chat_template
    with pytest.raises(TemplateSyntaxError):
        apply_chat_template("{% for m in messages %}{{ m.content }", [{"role": "user", "content": "hi"}])
    assert apply_chat_template("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}"
                               "{% endfor %}", twice) == "hi"
    s = Live(create_app({"strict": m}))
    try:
        for stream in (False, True):
            r = httpx.post(s.url + "/v1/chat/completions", json={"model": "strict", "messages": twice, "stream": stream,
                                                                  "max_tokens": 2})
            assert r.status_code == 400 and "roles must alternate" in r.json()["error"]["message"], stream
        r = s.client().chat.completions.create(model="strict", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, temperature=0)
        assert r.choices[0].message.content == m.generate(["hi"], GenerationConfig(max_new_tokens=4), chat=True)[0]
    finally:
        s.close()


def test_compile_keeps_quantised_models_and_translators_eager_in_the_server(models, monkeypatch):
    """`serve --compile` with `--quantize`: the compiled quantised step would autotune again at every new
    batch shape and answer differently per batch size, so the engine keeps the eager step (and
    compiles the others). A translator's batches change kind too often for a warm-up: eager too."""
    import copy

    from attnlab.quant import quantize_model
    from attnlab.serve import engine
    calls = []
    monkeypatch.setattr(engine, "compiled_step", lambda net, fn: calls.append(net) or (lambda *a, **k: fn(*a, **k)))
    lm = models["lm"]
    assert engine.Engine(lm, compile=True).decode is not lm.module and calls == [lm.module]
    q = copy.copy(lm)
    q.module = quantize_model(copy.deepcopy(lm.module), "int8")
    eng = engine.Engine(q, compile=True)
    assert eng.decode is eng.net and calls == [lm.module]
    mt = engine.TranslationEngine(models["mt"], compile=True)
    assert mt.decode == models["mt"].module.decode and calls == [lm.module]


@pytest.mark.skipif(not __import__("attnlab.accel", fromlist=["can_compile"]).can_compile("cpu"),
                    reason="no torch.compile here (no C++ compiler, or ATTNLAB_COMPILE=0)")
def test_compiled_engine_warms_up_then_serves_without_compiling(models):
    """`serve --compile`: the decoding step is compiled at start-up (``Engine.warm_up``: one graph per
    kind of batch), so that later traffic — one row, several rows with and without left padding,
    a newcomer packed into a running batch — compiles nothing more while rows wait; the warm-up
    leaves no trace (no rows, no kept prefix, counters at 0), and the answers equal those served
    alone."""
    import copy

    from torch._dynamo.utils import counters

    from attnlab.serve.engine import Engine, Request
    lm = copy.copy(models["llama"])
    lm.module = copy.deepcopy(lm.module)  # its own compiled step and packs
    eng = Engine(lm, max_batch=8, compile=True)
    assert eng.decode is not eng.net
    assert eng.warm_up() > 0
    assert not eng._rows and eng._prefix_tokens is None and eng.steps == eng.packed_prefills == 0
    eng.after_warm_up = "fail_on_recompile"  # a batch the warm-up did not compile for raises
    graphs = counters["stats"]["unique_graphs"]

    def request(prompt, n):
        r = Request(prompt=lm.prompt_ids(prompt), max_new_tokens=n)
        r.events = []
        r._emit = r.events.append
        return r

    waves = [[("the", 5)], [("quick brown fox", 6), ("a", 4)], [("lazy dog", 5), ("0123 fox", 5), ("zz", 7)]]
    done = []
    with torch.inference_mode():
        for wave in waves:
            reqs = [request(p, n) for p, n in wave]
            eng._admit_all(reqs)
            done += [(r, p, n) for r, (p, n) in zip(reqs, wave)]
            eng._step()
            eng._drop_finished()
            late = request("THE END", 4)  # joins the running batch
            eng._admit_all([late])
            done.append((late, "THE END", 4))
            while eng._rows:
                eng._step()
                eng._drop_finished()
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled after the warm-up
    # a batch no warm-up graph fits (one row with left padding: the engine never makes it) runs eager
    eng.after_warm_up = "eager_on_recompile"  # what the server runs under
    x = torch.tensor([lm.prompt_ids("a fox")])
    mask = torch.ones(1, x.shape[1] + 2, dtype=torch.bool)
    mask[0, :2] = False
    x = torch.cat([x.new_zeros(1, 2), x], 1)
    with torch.inference_mode():
        caches = [lm.module.new_cache(16), lm.module.new_cache(16)]
        for c in caches:
            lm.module(x, mask, cache=c, last_only=True)
        step_mask = torch.cat([mask, mask.new_ones(1, 1)], 1)
        tok = torch.tensor([[5]])
        got = eng.decode(tok, step_mask, cache=caches[0], last_only=True)
        want = lm.module(tok, step_mask, cache=caches[1], last_only=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == graphs
    for r, p, n in done:
        assert r.events[-1][0] == "done"
        assert lm.tokenizer.decode([t for kind, t in r.events if kind == "token"]) == alone(lm, p, n), (p, n)


def test_the_server_warms_a_compiled_engine_up_before_listing_its_model(models, monkeypatch):
    from attnlab.serve import engine
    from attnlab.serve.app import Server
    warmed = []
    monkeypatch.setattr(engine.Engine, "warm_up", lambda self: warmed.append(self.model.name) or 0)
    monkeypatch.setattr(engine, "compiled_step", lambda net, fn: (lambda *a, **k: fn(*a, **k)))
    Server({"lm": models["lm"]}, 4, 4)
    assert warmed == []
    server = Server({"lm": models["lm"], "mt": models["mt"]}, 4, 4, compile=True)
    assert warmed == ["lm"] and set(server.models) == {"lm", "mt"}
