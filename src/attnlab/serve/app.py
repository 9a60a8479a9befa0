"""The HTTP server of ``attnlab serve``: OpenAI-compatible routes (``/v1/models``,
``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``) and attnlab's own
(``/v1/translate``, ``/v1/classify``, ``/v1/attention``, ``/health``, ``/metrics``), over models
loaded with ``attnlab.load``. Every model is owned by one engine thread (``engine.py``): language
models and translators are continuously batched, encoders batch the requests that wait together.
A model given as a function is loaded in the background after the server starts; its requests get
503 until it is ready.

    from attnlab.serve import create_app
    app = create_app({"lm": attnlab.load("runs/lm")})     # any ASGI server; attnlab serve uses uvicorn
    app = create_app({"lm": lambda: attnlab.load("smollm2")})  # answers 503 for "lm" while it loads
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
import time
import uuid
from typing import Literal

try:
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f'attnlab serve needs FastAPI and uvicorn ({e.name} is not installed): '
                      f'pip install "attnlab[serve]"') from None

from .. import quant
from .engine import Batch, BatchEngine, Engine, QueueFull, Request, TranslationEngine, TranslationJob
from .text import TextTracker

log = logging.getLogger("attnlab")
MAX_BODY = 1 << 20  # bytes: a larger request body is refused with 413
MAX_CHOICES = 64    # prompts × n of one request
ROUTES = ("/", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/embeddings",
          "/v1/translate", "/v1/classify", "/v1/attention")  # metrics labels (other paths count as "other")


class APIError(Exception):
    """An error the client caused (or a full queue): OpenAI's error object with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_response(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": code}}, status_code=status)


# -- request bodies ------------------------------------------------------------------------------------------

class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Body):
    type: str = "text"
    text: str = ""


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if p.type == "text")
        return self.content or ""


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # accepted so that clients sending their defaults work; anything else than these is refused (400)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | int | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None      # {"type": "text"} only
    tools: list | None = None
    best_of: int | None = None               # (completions) 1 or n only: one sample each
    echo: bool = False                       # (completions)
    suffix: str | None = None                # (completions)


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Sampling):
    prompt: str | list[str]


class EmbeddingRequest(_Body):
    model: str
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"


class TranslateRequest(_Body):
    model: str | None = None
    texts: list[str] = Field(min_length=1, max_length=1024)
    beam: int = Field(4, ge=1, le=16)
    lenpen: float = Field(0.6, ge=0, le=5)
    max_len: int | None = Field(None, ge=1, le=4096)


class AttentionRequest(_Body):
    model: str | None = None
    text: str = Field(min_length=1)
    translation: str | None = None     # the model's own (beam search) when left out
    beam: int = Field(4, ge=1, le=16)


class ClassifyRequest(_Body):
    model: str | None = None
    texts: list[str] = Field(min_length=1, max_length=1024)


# -- the app ---------------------------------------------------------------------------------------------------

class Metrics:
    """Prometheus metrics on the app's own registry (several apps in one process do not clash)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        self.registry = r = CollectorRegistry()
        self.requests = Counter("attnlab_requests", "HTTP requests", ["route", "status"], registry=r)
        self.tokens = Counter("attnlab_tokens", "tokens processed", ["model", "type"], registry=r)
        self.queue = Gauge("attnlab_queue_depth", "requests waiting to join the batch", ["model"], registry=r)
        self.batch = Histogram("attnlab_batch_size", "rows in each decode step", ["model"], registry=r,
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        self.ttft = Histogram("attnlab_time_to_first_token_seconds", "from submission to the first token", ["model"],
                              registry=r, buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))


class Server:
    """What the routes share: the models, the engine of each, metrics, and which models still load."""

    def __init__(self, models: dict, max_batch: int, max_queue: int, compile: bool = False, on_load_error=None):
        if not models:
            raise ValueError("attnlab serve needs at least one model")
        self.metrics = Metrics()
        self.max_batch, self.max_queue, self.compile = max_batch, max_queue, compile
        self.models: dict = {}
        self.engines: dict = {}
        self.loading: dict[str, str] = {}   # name → "loading" or why it failed
        self.on_load_error = on_load_error
        self._loaders = {}
        for name, m in models.items():
            if callable(m) and not hasattr(m, "kind"):
                self.loading[name], self._loaders[name] = "loading", m
            else:
                self._install(name, m)
        self.created = int(time.time())

    def _install(self, name: str, m) -> None:
        labels = dict(on_step=self.metrics.batch.labels(name).observe)
        if quant.warm_own_kernels(m.module):  # built now, not while a first request waits
            log.info("serve: %s's quantised products on attnlab's own kernels (up to %d int8 / %d int4 rows)",
                     name, quant.own_kernel_max_rows("int8"), quant.own_kernel_max_rows("int4"))
        if m.kind == "lm":
            engine = Engine(m, self.max_batch, self.max_queue, compile=self.compile,
                            on_first_token=self.metrics.ttft.labels(name).observe, **labels)
            if self.compile:  # compiled before the model is listed (503 until then), not by the first requests
                t0 = time.perf_counter()
                steps = engine.warm_up()
                if steps:
                    log.info("serve --compile: %s's decoding step compiled (%d warm-up steps, %.0f s)", name, steps,
                             time.perf_counter() - t0)
        elif m.kind == "translation":
            engine = TranslationEngine(m, self.max_batch, self.max_queue, compile=self.compile, **labels)
        else:
            engine = BatchEngine(m, max(64, self.max_batch), self.max_queue, **labels)
        self.metrics.queue.labels(name).set_function(lambda e=engine: e.queue_depth)
        self.engines[name] = engine
        self.models[name] = m
        self.loading.pop(name, None)

    def load_in_background(self) -> None:
        """Load the models given as functions, one after the other, in a thread."""
        def work():
            for name, load in self._loaders.items():
                try:
                    self._install(name, load())
                except Exception as e:  # the others still load; requests for this one get 503
                    self.loading[name] = f"failed to load: {type(e).__name__}: {e}"
                    if self.on_load_error:
                        self.on_load_error(name, e)
        if self._loaders:
            threading.Thread(target=work, name="attnlab-load", daemon=True).start()

    def model(self, name: str | None, *kinds: str, what: str):
        if name is None:  # attnlab's own routes: the only model of the kind may be left out
            fits = [n for n, m in self.models.items() if m.kind in kinds]
            if len(fits) != 1:
                if not fits and self.loading:
                    raise APIError(503, f"models are still loading: {sorted(self.loading)}", "server_error",
                                   code="model_loading")
                raise APIError(400, f"give the model for {what}: one of {fits}" if fits else
                               f"no loaded model can do {what}", param="model")
            name = fits[0]
        if name in self.loading:
            raise APIError(503, f"the model {name!r} is not ready: {self.loading[name]}", "server_error",
                           param="model", code="model_loading")
        if name not in self.models:
            raise APIError(404, f"the model {name!r} does not exist; loaded: {sorted(self.models)}",
                           param="model", code="model_not_found")
        m = self.models[name]
        if m.kind not in kinds:
            raise APIError(400, f"{name} is a {m.kind} model: {what} needs a {' or '.join(kinds)} model", param="model")
        return name, m

    def submit(self, name: str, job):
        try:
            return self.engines[name].submit(job)
        except QueueFull as e:
            raise APIError(429, str(e), "rate_limit_exceeded", code="queue_full") from None

    async def run(self, http, jobs: list):
        """The results of submitted jobs, in order. A ValueError the model raises is
        the client's (400); a client that goes away takes its jobs out of the batch."""
        try:
            return await _unless_disconnected(http, asyncio.gather(*(j.result() for j in jobs)), jobs)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def batch(self, name: str, http, fn, inputs: list):
        job = self.submit(name, Batch(inputs=inputs, fn=fn, loop=asyncio.get_running_loop(), queue=asyncio.Queue()))
        return (await self.run(http, [job]))[0]

    def close(self) -> None:
        for e in self.engines.values():
            e.close()


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


async def _unless_disconnected(http, work, jobs: list, poll: float = 0.2):
    """Await ``work``; if the client disconnects first, cancel its jobs (they leave the batch at the next
    step) and raise ClientGone."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll)
            if done:
                return task.result()
            if http is not None and await http.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            for j in jobs:
                j.cancel()
            task.cancel()


def create_app(models: dict, max_batch: int = 16, max_queue: int = 256, max_body: int = MAX_BODY,
               compile: bool = False, on_load_error=None) -> FastAPI:
    """The FastAPI app serving ``models``: alias → ``LoadedModel``, or → a function returning one (loaded
    in the background once the server runs; 503 for its requests until then; ``on_load_error(name,
    exception)`` hears of a failure). ``compile`` compiles the engines' decoding steps."""
    from contextlib import asynccontextmanager

    server = Server(models, max_batch, max_queue, compile=compile, on_load_error=on_load_error)

    @asynccontextmanager
    async def lifespan(app):
        server.load_in_background()
        yield
        server.close()

    app = FastAPI(title="attnlab serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    app.add_middleware(_Guard, max_body=max_body, metrics=server.metrics)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(ClientGone)
    async def _gone(request, e: ClientGone):  # nobody reads it; logged as 499 (nginx's "client closed request")
        return error_response(499, "the client closed the connection", code="client_closed_request")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            return error_response(400, "the request body is not valid JSON", code="invalid_json")
        err = errors[0] if errors else {}
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        return error_response(422, f"{param or 'body'}: {err.get('msg', 'invalid value')}", param=param,
                              code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500
                              else "server_error")

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    # -- facts ------------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        body = {"status": "loading" if server.loading else "ok", "models": {n: m.kind for n, m in server.models.items()},
                "loading": dict(server.loading),
                "queue": {n: e.queue_depth for n, e in server.engines.items()},
                "batch": {n: e.batch_size for n, e in server.engines.items()}}
        return JSONResponse(body, status_code=503 if server.loading else 200)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_card(n, m, server.created) for n, m in server.models.items()]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str):
        if name in server.loading:
            raise APIError(503, f"the model {name!r} is not ready: {server.loading[name]}", "server_error",
                           param="model", code="model_loading")
        if name not in server.models:
            raise APIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
        return _model_card(name, server.models[name], server.created)

    # -- generation -------------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HTTPRequest):
        name, m = server.model(body.model, "lm", what="chat completions")
        if not body.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        messages = [{"role": msg.role, "content": msg.text()} for msg in body.messages]
        try:
            if m.chat_template:
                ids = m.chat_ids(messages)
            else:
                ids = m.prompt_ids("\n".join(x["content"] for x in messages))
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        max_new = body.max_completion_tokens or body.max_tokens
        return await _generate(server, name, m, [ids], body, max_new, chat=True, http=http)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        name, m = server.model(body.model, "lm", what="completions")
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not prompts:
            raise APIError(400, "prompt must hold at least one text", param="prompt")
        try:
            ids = [m.prompt_ids(p) for p in prompts]
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        return await _generate(server, name, m, ids, body, body.max_tokens, chat=False, http=http)

    # -- encoders and translators -----------------------------------------------------------------------------
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, http: HTTPRequest):
        name, m = server.model(body.model, "embedding", "classify", "mlm", what="embeddings")
        texts = [body.input] if isinstance(body.input, str) else body.input
        if not texts or any(not t for t in texts):
            raise APIError(400, "input must be one or more non-empty texts", param="input")
        lengths = _check_lengths(name, m, texts, "input")
        vectors = await server.batch(name, http, m.embed, texts)
        server.metrics.tokens.labels(name, "prompt").inc(sum(lengths))
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if body.encoding_format == "base64"
                 else v.tolist()} for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": name,
                "usage": {"prompt_tokens": sum(lengths), "total_tokens": sum(lengths)}}

    @app.post("/v1/translate")
    async def translate(body: TranslateRequest, http: HTTPRequest):
        from ..generate.search import GenerationConfig
        name, m = server.model(body.model, "translation", what="translation")
        sources = m.tokenizer.encode_batch([m.task.get("source_prefix", "") + t for t in body.texts], eos=True)
        _check_lengths(name, m, sources, "texts")
        if body.max_len and m.config.positions == "learned" and body.max_len > m.config.max_len:
            raise APIError(400, f"max_len {body.max_len} is past {name}'s learned target positions: at most "
                           f"{m.config.max_len}", param="max_len")
        loop, jobs = asyncio.get_running_loop(), []
        try:
            for src in sources:  # one job per sentence: each joins the running batch on its own
                cfg = GenerationConfig(num_beams=body.beam, length_penalty=body.lenpen, max_new_tokens=body.max_len)
                jobs.append(server.submit(name, TranslationJob(src=src, cfg=cfg, loop=loop, queue=asyncio.Queue())))
        except APIError:
            for j in jobs:
                j.cancel()
            raise
        nbest = await server.run(http, jobs)
        server.metrics.tokens.labels(name, "prompt").inc(sum(map(len, sources)))
        server.metrics.tokens.labels(name, "completion").inc(sum(len(h[0].tokens) for h in nbest))
        return {"model": name, "translations": [m.tgt_tokenizer.decode(h[0].tokens) for h in nbest],
                "scores": [h[0].score for h in nbest]}

    @app.post("/v1/attention")
    async def attention(body: AttentionRequest, http: HTTPRequest):
        from ..generate.search import GenerationConfig
        name, m = server.model(body.model, "translation", what="attention maps")
        n = len(m.tokenizer.encode(body.text))
        if n > min(m.config.max_len, 256):
            raise APIError(400, f"the text is {n} tokens; attention maps are drawn for at most "
                           f"{min(m.config.max_len, 256)}", param="text")

        def maps():
            translation = body.translation
            if translation is None:
                translation = m.translate([body.text], GenerationConfig(num_beams=body.beam))[0]
            return m.attention(body.text, translation)
        try:  # on the model's own thread, between two steps of its translation batch
            out = await server.engines[name].call(maps)
        except QueueFull as e:
            raise APIError(429, str(e), "rate_limit_exceeded", code="queue_full") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return {"model": name, "translation": out["translation"], "src_tokens": out["src_tokens"],
                "tgt_in_tokens": out["tgt_in_tokens"],
                **{k: [layer.round(decimals=5).tolist() for layer in out[k]] for k in ("encoder", "decoder", "cross")}}

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon():  # none: say so without a 404 in every browser's console
        return Response(status_code=204)

    @app.get("/", include_in_schema=False)
    async def page():
        from fastapi.responses import HTMLResponse

        from .page import PAGE
        return HTMLResponse(PAGE)

    @app.post("/v1/classify")
    async def classify(body: ClassifyRequest, http: HTTPRequest):
        name, m = server.model(body.model, "classify", what="classification")
        out = await server.batch(name, http, m.classify, body.texts)
        return {"model": name, "results": [{"label": label, "probability": float(p)} for label, p in out]}

    return app


def _check_lengths(name: str, m, texts: list, param: str, eos: bool = False) -> list[int]:
    """Token counts of the texts (or of token id lists); one past the model's positions is a 400."""
    lengths = [len(ids) for ids in (m.tokenizer.encode_batch(texts, eos=eos) if isinstance(texts[0], str) else texts)]
    if max(lengths) > m.config.max_len:
        raise APIError(400, f"a text is {max(lengths)} tokens; {name} reads at most {m.config.max_len}",
                       param=param, code="context_length_exceeded")
    return lengths


def _model_card(name: str, m, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "attnlab", "kind": m.kind,
            "context_length": m.config.max_len}


# -- generation through the engine ---------------------------------------------------------------------------

async def _generate(server: Server, name: str, m, prompts: list[list[int]], body: _Sampling,
                    max_new: int | None, chat: bool, http=None):
    context = m.config.max_len
    for ids in prompts:
        if not ids:
            raise APIError(400, "the prompt is empty (no tokens to continue)", param="messages" if chat else "prompt")
        if len(ids) >= context:
            raise APIError(400, f"the prompt is {len(ids)} tokens; {name} has a context of {context}",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
        if max_new is not None and len(ids) + max_new > context:
            raise APIError(400, f"the prompt ({len(ids)} tokens) plus max_tokens ({max_new}) is past the context of "
                           f"{name} ({context} tokens): ask for at most {context - len(ids)}",
                           param="max_tokens", code="context_length_exceeded")
    unsupported = [p for p in ("presence_penalty", "frequency_penalty", "logprobs", "logit_bias", "tools", "echo",
                               "suffix") if getattr(body, p)]
    if body.response_format and body.response_format.get("type", "text") != "text":
        unsupported.append("response_format")
    if body.best_of not in (None, 1, body.n):
        unsupported.append("best_of")
    if unsupported:
        raise APIError(400, f"{unsupported[0]} is not supported by attnlab serve", param=unsupported[0],
                       code="unsupported")
    if body.seed is not None and not -2 ** 63 <= body.seed <= 2 ** 64 - body.n:  # (choice j samples with seed + j)
        raise APIError(400, f"seed must be an integer from -2**63 to 2**64 - n ({2 ** 64 - body.n} with n={body.n})",
                       param="seed")
    if len(prompts) * body.n > MAX_CHOICES:
        raise APIError(400, f"{len(prompts)} prompts × n={body.n} is more than {MAX_CHOICES} choices in one request",
                       param="n")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise APIError(400, "stop takes up to 4 non-empty strings", param="stop")
    temperature = 1.0 if body.temperature is None else body.temperature
    loop = asyncio.get_running_loop()
    gens = []
    try:
        for p, ids in enumerate(prompts):
            for j in range(body.n):
                seed = None if body.seed is None else body.seed + j
                req = Request(ids, max_new or context - len(ids), temperature, body.top_p or 1.0, seed,
                              loop=loop, queue=asyncio.Queue())
                gens.append(_Generation(m, req, stops))
                server.submit(name, req)
    except APIError:  # the queue is full (429): the ones already queued leave
        for g in gens:
            g.req.cancel()
        raise
    prompt_tokens = sum(len(ids) for ids in prompts)
    server.metrics.tokens.labels(name, "prompt").inc(prompt_tokens)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())

    def usage():
        done = sum(len(g.req.generated) for g in gens)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}

    if not body.stream:
        try:  # a client that goes away takes its requests out of the batch
            results = await _unless_disconnected(http, asyncio.gather(*(g.collect() for g in gens)),
                                                 [g.req for g in gens])
        except RuntimeError as e:
            raise APIError(500, str(e), "server_error") from None
        finally:
            for g in gens:
                g.req.cancel()
        server.metrics.tokens.labels(name, "completion").inc(usage()["completion_tokens"])
        if chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                        "finish_reason": reason} for i, (text, reason) in enumerate(results)]
        else:
            choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": reason}
                       for i, (text, reason) in enumerate(results)]
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": name, "choices": choices, "usage": usage(), "system_fingerprint": None}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices, use=None):
        c = {"id": rid, "object": kind, "created": created, "model": name, "choices": choices,
             "system_fingerprint": None}
        if include_usage:
            c["usage"] = use
        return "data: " + json.dumps(c, ensure_ascii=False) + "\n\n"

    def choice(i, text, reason, first=False):
        if chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}
        return {"index": i, "text": text, "logprobs": None, "finish_reason": reason}

    async def events():
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i, g):
            try:
                async for piece, reason in g.pieces():
                    await merged.put((i, piece, reason))
            except RuntimeError as e:
                await merged.put((i, e, None))

        if chat:
            for i in range(len(gens)):
                yield chunk([choice(i, "", None, first=True)])
        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        try:
            left = len(gens)
            while left:
                i, piece, reason = await merged.get()
                if isinstance(piece, Exception):
                    yield "data: " + json.dumps({"error": {"message": str(piece), "type": "server_error",
                                                           "param": None, "code": None}}) + "\n\n"
                    return
                if piece or reason:
                    yield chunk([choice(i, piece, reason)])
                if reason:
                    left -= 1
            server.metrics.tokens.labels(name, "completion").inc(usage()["completion_tokens"])
            if include_usage:
                yield chunk([], usage())
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away: leave the batch
            for t in tasks:
                t.cancel()
            for g in gens:
                g.req.cancel()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _Generation:
    """The text of one engine request as it grows: pieces safe to show, stop strings cut off."""

    def __init__(self, model, req: Request, stops: list[str]):
        self.req = req
        self.tracker = TextTracker(model, req.prompt, stops)

    async def pieces(self):
        """(new text, None) while generating, then ("", finish_reason)."""
        try:
            while True:
                kind, value = await self.req.queue.get()
                if kind == "token":
                    piece, stopped = self.tracker.add(value)
                    if piece:
                        yield piece, None
                    if stopped:
                        self.req.cancel()
                        yield "", "stop"
                        return
                elif kind == "done":
                    piece = self.tracker.flush()
                    if piece:
                        yield piece, None
                    yield "", value
                    return
                else:
                    raise RuntimeError(f"{type(value).__name__}: {value}" if isinstance(value, Exception) else value)
        finally:
            self.req.cancel()

    async def collect(self) -> tuple[str, str]:
        reason = "stop"
        async for _, r in self.pieces():
            reason = r or reason
        return self.tracker.shown, reason


class _Guard:
    """Pure ASGI middleware: refuses bodies over ``max_body`` bytes (413) before they are parsed, and
    counts every response by route and status."""

    def __init__(self, app, max_body: int, metrics: Metrics):
        self.app, self.max_body, self.metrics = app, max_body, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope.get("path", "")
        status = {"code": 500}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            too_big = False
            length = dict(scope.get("headers") or []).get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body:
                too_big = True
            body_messages = []
            if not too_big and scope.get("method") in ("POST", "PUT", "PATCH"):
                size = 0
                while True:  # read the body here (bounded), then replay it to the app
                    message = await receive()
                    body_messages.append(message)
                    if message["type"] != "http.request":
                        break
                    size += len(message.get("body", b""))
                    if size > self.max_body:
                        too_big = True
                        break
                    if not message.get("more_body"):
                        break
            if too_big:
                response = error_response(413, f"the request body is over {self.max_body} bytes",
                                          code="request_too_large")
                return await response(scope, receive, counting_send)
            if body_messages:
                replay = list(body_messages)

                async def replay_receive():
                    return replay.pop(0) if replay else await receive()
                return await self.app(scope, replay_receive, counting_send)
            return await self.app(scope, receive, counting_send)
        finally:
            known = route if route in ROUTES else "/v1/models/{name}" if route.startswith("/v1/models/") else "other"
            self.metrics.requests.labels(known, str(status["code"])).inc()
