"""The page at ``/`` of ``attnlab serve`` in a real browser: headless Chromium (Debian's ``chromium``,
driven by Playwright through ``executable_path``) against a live server on tiny random models.

Translate: type "I love coding.", wait for the translation and the heatmap; the table has one row per
target token and one column per source token, and its cells' colours are the weights, where the oracle
is the same request sent to ``/v1/attention`` with httpx (and the library's own ``attention`` for the
shapes). The kind, layer and head pickers redraw the table (encoder self: source × source; decoder self:
target × target); hovering a cell shows its two tokens and its weight. Chat: pick a model, send a
prompt, wait for the streamed reply, which equals the request answered by the library alone; the
request shows in /metrics. Screenshots go to the test's temp dir.

Skipped when Playwright or a Chromium executable is missing (``ATTNLAB_CHROMIUM``, else ``chromium`` /
``chromium-browser`` on PATH), unless ``ATTNLAB_REQUIRE_BROWSER=1`` (CI sets it): then it fails.
"""

from __future__ import annotations

import os
import re
import shutil
import time

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_serve import CONTEXT, TEMPLATE, TEXT, Live  # noqa: E402  (tests/ is on sys.path: conftest.py)

from attnlab import build_model, get_preset  # noqa: E402
from attnlab.api import LoadedModel  # noqa: E402
from attnlab.data.tokenizer import char_tokenizer  # noqa: E402
from attnlab.generate import GenerationConfig  # noqa: E402
from attnlab.serve import create_app  # noqa: E402

SENTENCE = "I love coding."
PROMPT = "the fox"
MAX_TOKENS = 12
WAIT_MS = 20_000  # every explicit wait; a tiny model answers in well under a second


def _unavailable(reason: str):
    if os.environ.get("ATTNLAB_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason}; ATTNLAB_REQUIRE_BROWSER=1 says the browser test must run")
    pytest.skip(reason)


def _chromium() -> str:
    """The Chromium to drive: $ATTNLAB_CHROMIUM, else chromium or chromium-browser on PATH."""
    path = os.environ.get("ATTNLAB_CHROMIUM")
    if path:
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            _unavailable(f"ATTNLAB_CHROMIUM={path} is not an executable file")
        return path
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        _unavailable("no Chromium executable: apt-get install chromium, or set ATTNLAB_CHROMIUM")
    return path


@pytest.fixture(scope="module")
def models():
    tok = char_tokenizer(TEXT + SENTENCE + "<>")  # test_serve's characters lack the capital I
    assert tok.unk_id not in tok.encode(SENTENCE)
    torch.manual_seed(0)
    small = dict(vocab_size=tok.vocab_size, d_model=32, n_heads=2, d_ff=64, dropout=0.0, max_len=CONTEXT)
    lm = build_model(get_preset("gpt-mini", n_decoder_layers=2, **small)).eval()
    llama = build_model(get_preset("llama-mini", n_decoder_layers=2, n_kv_heads=1, **{**small, "n_heads": 4})).eval()
    return {"lm": LoadedModel(lm, tok, tok, "lm", "lm"),
            "llama": LoadedModel(llama, tok, tok, "lm", "llama", chat_template=TEMPLATE),
            "mt": _short_translator(tok, small)}


def _short_translator(tok, small) -> LoadedModel:
    """A tiny random translation model whose greedy translation of SENTENCE is 5-12 characters: the
    page shows a translation, and a heatmap with fewer rows than columns. A random model seldom emits
    </s> at a useful step, so its output projection gets a bias that rules out <pad>, <s>, <unk> (and
    "<", ">": look-alikes of <s>) and gives </s> a value found by bisection. Before its first </s>,
    greedy decoding does not depend on that value: the length can only fall as the value grows."""
    for seed in range(10):
        torch.manual_seed(seed)
        mt = build_model(get_preset("mt-tiny", n_encoder_layers=2, n_decoder_layers=2, tie_output=False,
                                    share_embeddings=False, output_bias=True, **small)).eval()
        m = LoadedModel(mt, tok, tok, "translation", "mt")
        bias = mt.lm_head.bias
        with torch.no_grad():
            bias[[tok.pad_id, tok.bos_id, tok.unk_id, *tok.encode("<>")]] = -1e4  # no look-alikes of <s> either
            lo, hi = -100.0, 100.0
            for _ in range(30):
                bias[tok.eos_id] = (lo + hi) / 2
                n = len(m.translate([SENTENCE], GenerationConfig(num_beams=1, max_new_tokens=13))[0])
                if 5 <= n <= 12:
                    return m
                lo, hi = (bias[tok.eos_id].item(), hi) if n > 12 else (lo, bias[tok.eos_id].item())
    raise AssertionError("no tiny translation model stops after 5-12 characters")


@pytest.fixture(scope="module")
def live(models):
    s = Live(create_app(models, max_batch=4))
    yield s
    s.close()


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable('Playwright is not installed (pip install playwright, or pip install -e ".[test]")')
    exe = _chromium()
    with sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
        except Exception as e:  # noqa: BLE001 - e.g. a Chromium too old for this Playwright
            _unavailable(f"Playwright cannot launch {exe}: {str(e).splitlines()[0]}")
        yield b
        b.close()


@pytest.fixture
def page(browser, live):
    ctx = browser.new_context(viewport={"width": 1000, "height": 900})
    pg = ctx.new_page()
    pg.set_default_timeout(WAIT_MS)
    errors = []  # script errors, console errors, failed requests (favicon.ico included: the server answers 204)
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    pg.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    pg.on("requestfailed", lambda r: errors.append(f"{r.failure} {r.url}"))
    pg.goto(live.url + "/")
    pg.wait_for_selector("#mtModel option[value=mt]", state="attached")
    pg.wait_for_selector("#chatModel option[value=llama]", state="attached")
    yield pg
    ctx.close()
    assert errors == [], errors  # no script error and no failed request on the page


def _table(pg):
    """(row header tokens, column header tokens, alpha of every cell) of the drawn heatmap."""
    got = pg.eval_on_selector("#heat table.heat", """t => ({
        cols: [...t.tHead.rows[0].cells].slice(1).map(c => c.textContent),
        rows: [...t.tBodies[0].rows].map(r => r.cells[0].textContent),
        bg: [...t.tBodies[0].rows].map(r => [...r.cells].slice(1).map(c => getComputedStyle(c).backgroundColor))})""")
    return got["rows"], got["cols"], np.array([[_alpha(c) for c in row] for row in got["bg"]]).reshape(
        len(got["rows"]), len(got["cols"]))


def _alpha(css: str) -> float:
    m = re.fullmatch(r"rgba?\(20, 80, 200(?:, ([\d.e+-]+))?\)", css)
    assert m, css
    return 1.0 if m.group(1) is None else float(m.group(1))


def _shot(pg, path):
    pg.screenshot(path=str(path), full_page=True)
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n", path


def _hover(pg, i, j):
    pg.hover(f"#heat tbody tr:nth-child({i + 1}) td:nth-of-type({j + 1})")
    pg.wait_for_function("() => document.getElementById('hover').textContent !== ''")
    return pg.text_content("#hover")


def _check_hover(text, q, k, want):
    head = f"{q} → {k}: "
    assert text.startswith(head) and abs(float(text[len(head):]) - want) <= 6e-4, (text, head, want)


def test_translate_draws_the_attention_heatmap(page, live, models, tmp_path):
    pg = page
    pg.select_option("#mtModel", value="mt")
    assert not pg.is_visible("#pickers") and pg.locator("#heat table").count() == 0  # nothing drawn yet
    pg.fill("#beam", "1")  # greedy: the translation the fixture checked is short
    pg.click("#src")
    pg.keyboard.type(SENTENCE)
    pg.click("#go")
    pg.wait_for_selector("#heat table.heat")
    pg.wait_for_selector("#pickers", state="visible")

    # the oracle: the same request to /v1/attention, outside the browser
    beam = int(pg.input_value("#beam"))
    maps = httpx.post(live.url + "/v1/attention", json={"model": "mt", "text": SENTENCE, "beam": beam},
                      timeout=60).json()
    src, tgt = maps["src_tokens"], maps["tgt_in_tokens"]
    S, T = len(src), len(tgt)
    cross, enc, dec = (np.array(maps[k]) for k in ("cross", "encoder", "decoder"))
    assert cross.shape == (2, 2, T, S) and enc.shape == (2, 2, S, S) and dec.shape == (2, 2, T, T)
    own = models["mt"].attention(SENTENCE, maps["translation"])  # the library agrees on the shapes
    assert (len(own["src_tokens"]), len(own["tgt_in_tokens"])) == (S, T) and S > len(SENTENCE) and 4 < T < S
    assert pg.text_content("#out") == maps["translation"] == models["mt"].translate(
        [SENTENCE], GenerationConfig(num_beams=beam))[0]

    # cross-attention, layer 1, the mean of the heads: one row per target token, one column per source token
    assert [pg.input_value(s) for s in ("#kind", "#layer", "#head")] == ["cross", "0", "mean"]
    assert pg.eval_on_selector_all("#layer option", "os => os.map(o => o.value)") == ["0", "1"]
    assert pg.eval_on_selector_all("#head option", "os => os.map(o => o.value)") == ["mean", "0", "1"]
    rows, cols, alpha = _table(pg)
    assert pg.locator("#heat tbody tr").count() == T and len(rows) == T and rows == tgt
    assert pg.locator("#heat tbody tr:first-child td").count() == S and len(cols) == S and cols == src
    assert pg.locator("#heat td").count() == T * S
    assert np.abs(alpha - cross[0].mean(0)).max() < 6e-3  # colour alpha = weight (Chrome keeps ~8 bits)
    i, j = T - 1, S // 2
    _check_hover(_hover(pg, i, j), tgt[i], src[j], cross[0].mean(0)[i, j])
    _shot(pg, tmp_path / "translate-cross.png")

    # layer 2, head 1 of cross-attention: same shape, that head's weights
    pg.select_option("#layer", index=1)  # labels count from 1, values from 0: by index
    pg.select_option("#head", index=1)  # head 1
    rows, cols, alpha = _table(pg)
    assert (len(rows), len(cols)) == (T, S) and np.abs(alpha - cross[1][0]).max() < 6e-3
    _check_hover(_hover(pg, 0, 0), tgt[0], src[0], cross[1][0][0, 0])

    # encoder self-attention: source × source (the pickers go back to layer 1, mean)
    pg.select_option("#kind", value="encoder")
    assert [pg.input_value(s) for s in ("#layer", "#head")] == ["0", "mean"]
    rows, cols, alpha = _table(pg)
    assert rows == src and cols == src and np.abs(alpha - enc[0].mean(0)).max() < 6e-3
    _check_hover(_hover(pg, S - 1, 1), src[S - 1], src[1], enc[0].mean(0)[S - 1, 1])
    pg.select_option("#head", index=2)  # head 2
    assert np.abs(_table(pg)[2] - enc[0][1]).max() < 6e-3
    _shot(pg, tmp_path / "translate-encoder.png")

    # decoder self-attention: target × target, causal (nothing above the diagonal)
    pg.select_option("#kind", value="decoder")
    rows, cols, alpha = _table(pg)
    assert rows == tgt and cols == tgt and np.abs(alpha - dec[0].mean(0)).max() < 6e-3
    assert np.all(np.triu(alpha, 1) == 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["translate-cross.png", "translate-encoder.png"]


def test_chat_streams_a_reply(page, live, models, tmp_path):
    pg = page
    before = _requests(live, "/v1/chat/completions")
    pg.select_option("#chatModel", value="llama")  # the one with a chat template: the messages go through it
    pg.fill("#maxTok", str(MAX_TOKENS))
    pg.fill("#temp", "0")
    pg.click("#msg")
    pg.keyboard.type(PROMPT)
    # count the page's updates of the reply: a streamed reply is written piece by piece
    pg.evaluate("""() => { window.updates = 0; new MutationObserver(rs => { for (const r of rs)
        if (r.target.className === "assistant" && r.addedNodes.length) window.updates++; })
        .observe(document.getElementById("log"), {childList: true, subtree: true}); }""")
    pg.click("#send")
    pg.wait_for_function("() => (document.querySelector('#log .assistant') || {}).textContent")  # text arrives
    pg.wait_for_function("() => document.getElementById('chatStatus').textContent.startsWith('finished: ')")
    pg.wait_for_selector("#send:enabled")
    want = models["llama"].generate([PROMPT], GenerationConfig(max_new_tokens=MAX_TOKENS), chat=True)[0]
    assert want  # the oracle: the same request answered by the library alone, not empty for this prompt
    log = pg.eval_on_selector_all("#log > div", "ds => ds.map(d => [d.className, d.textContent])")
    assert log == [["user", "you: " + PROMPT], ["assistant", want]]
    assert pg.text_content("#chatStatus") in ("finished: stop", "finished: length")
    assert pg.evaluate("window.updates") > 1  # streamed: more than one piece, not one answer at the end
    _shot(pg, tmp_path / "chat.png")
    assert (tmp_path / "chat.png").stat().st_size > 0
    # the server counted one chat request with status 200 (counted once the response has ended)
    deadline = time.time() + 10
    while _requests(live, "/v1/chat/completions") != before + 1:
        assert time.time() < deadline, (before, _requests(live, "/v1/chat/completions"))
        time.sleep(0.02)


def _requests(live, route: str) -> float:
    text = httpx.get(live.url + "/metrics").text
    m = re.search(r'^attnlab_requests_total\{route="%s",status="200"\} (\S+)$' % re.escape(route), text, re.M)
    return float(m.group(1)) if m else 0.0
