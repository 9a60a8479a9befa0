"""The HTTP server of ``attnlab serve``: OpenAI-compatible routes (``/v1/models``,
``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``) and attnlab's own
(``/v1/translate``, ``/v1/classify``, ``/health``, ``/metrics``), over models already loaded with
``attnlab.load``. Language models are served through a continuous-batching :class:`Engine`; the
other kinds run one request at a time per model, in a worker thread.

    from attnlab.serve import create_app
    app = create_app({"lm": attnlab.load("runs/lm")})     # any ASGI server; attnlab serve uses uvicorn
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
import uuid
from typing import Literal

try:
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f'attnlab serve needs FastAPI and uvicorn ({e.name} is not installed): '
                      f'pip install "attnlab[serve]"') from None

from .engine import Engine, QueueFull, Request
from .text import TextTracker

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
    """What the routes share: the models, one engine per language model, locks, metrics."""

    def __init__(self, models: dict, max_batch: int, max_queue: int):
        if not models:
            raise ValueError("attnlab serve needs at least one model")
        self.models = dict(models)
        self.metrics = Metrics()
        self.engines: dict[str, Engine] = {}
        self.locks = {name: threading.Lock() for name in self.models}
        for name, m in self.models.items():
            if m.kind == "lm":
                self.engines[name] = Engine(
                    m, max_batch=max_batch, max_queue=max_queue,
                    on_step=self.metrics.batch.labels(name).observe,
                    on_first_token=self.metrics.ttft.labels(name).observe)
                self.metrics.queue.labels(name).set_function(lambda e=self.engines[name]: e.queue_depth)
        self.created = int(time.time())

    def model(self, name: str | None, *kinds: str, what: str):
        if name is None:  # attnlab's own routes: the only model of the kind may be left out
            fits = [n for n, m in self.models.items() if m.kind in kinds]
            if len(fits) != 1:
                raise APIError(400, f"give the model for {what}: one of {fits}" if fits else
                               f"no loaded model can do {what}", param="model")
            name = fits[0]
        if name not in self.models:
            raise APIError(404, f"the model {name!r} does not exist; loaded: {sorted(self.models)}",
                           param="model", code="model_not_found")
        m = self.models[name]
        if m.kind not in kinds:
            raise APIError(400, f"{name} is a {m.kind} model: {what} needs a {' or '.join(kinds)} model", param="model")
        return name, m

    async def locked(self, name: str, fn, *args):
        def call():
            import torch
            with self.locks[name], torch.inference_mode():
                return fn(*args)
        try:
            return await asyncio.to_thread(call)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def close(self) -> None:
        for e in self.engines.values():
            e.close()


def create_app(models: dict, max_batch: int = 16, max_queue: int = 256, max_body: int = MAX_BODY) -> FastAPI:
    """The FastAPI app serving ``models`` (alias → ``LoadedModel``)."""
    from contextlib import asynccontextmanager

    server = Server(models, max_batch, max_queue)

    @asynccontextmanager
    async def lifespan(app):
        yield
        server.close()

    app = FastAPI(title="attnlab serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    app.add_middleware(_Guard, max_body=max_body, metrics=server.metrics)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return e.response()

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
        return {"status": "ok", "models": {n: m.kind for n, m in server.models.items()},
                "queue": {n: e.queue_depth for n, e in server.engines.items()},
                "batch": {n: e.batch_size for n, e in server.engines.items()}}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_card(n, m, server.created) for n, m in server.models.items()]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str):
        if name not in server.models:
            raise APIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
        return _model_card(name, server.models[name], server.created)

    # -- generation -------------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        name, m = server.model(body.model, "lm", what="chat completions")
        if not body.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        messages = [{"role": msg.role, "content": msg.text()} for msg in body.messages]
        try:
            if m.chat_template:
                from ..pretrained import apply_chat_template
                ids = m.tokenizer.encode(apply_chat_template(m.chat_template, messages))
            else:
                ids = m.prompt_ids("\n".join(x["content"] for x in messages))
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        max_new = body.max_completion_tokens or body.max_tokens
        return await _generate(server, name, m, [ids], body, max_new, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        name, m = server.model(body.model, "lm", what="completions")
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not prompts:
            raise APIError(400, "prompt must hold at least one text", param="prompt")
        try:
            ids = [m.prompt_ids(p) for p in prompts]
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        return await _generate(server, name, m, ids, body, body.max_tokens, chat=False)

    # -- encoders and translators -----------------------------------------------------------------------------
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        name, m = server.model(body.model, "embedding", "classify", "mlm", what="embeddings")
        texts = [body.input] if isinstance(body.input, str) else body.input
        if not texts or any(not t for t in texts):
            raise APIError(400, "input must be one or more non-empty texts", param="input")
        lengths = _check_lengths(name, m, texts, "input")
        vectors = await server.locked(name, m.embed, texts)
        server.metrics.tokens.labels(name, "prompt").inc(sum(lengths))
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if body.encoding_format == "base64"
                 else v.tolist()} for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": name,
                "usage": {"prompt_tokens": sum(lengths), "total_tokens": sum(lengths)}}

    @app.post("/v1/translate")
    async def translate(body: TranslateRequest):
        from ..generate.search import GenerationConfig
        name, m = server.model(body.model, "translation", what="translation")
        _check_lengths(name, m, [m.task.get("source_prefix", "") + t for t in body.texts], "texts", eos=True)
        cfg = GenerationConfig(num_beams=body.beam, length_penalty=body.lenpen, max_new_tokens=body.max_len)
        out = await server.locked(name, m.translate, body.texts, cfg)
        return {"model": name, "translations": out}

    @app.post("/v1/attention")
    async def attention(body: AttentionRequest):
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
        out = await server.locked(name, maps)
        return {"model": name, "translation": out["translation"], "src_tokens": out["src_tokens"],
                "tgt_in_tokens": out["tgt_in_tokens"],
                **{k: [layer.round(decimals=5).tolist() for layer in out[k]] for k in ("encoder", "decoder", "cross")}}

    @app.get("/", include_in_schema=False)
    async def page():
        from fastapi.responses import HTMLResponse

        from .page import PAGE
        return HTMLResponse(PAGE)

    @app.post("/v1/classify")
    async def classify(body: ClassifyRequest):
        name, m = server.model(body.model, "classify", what="classification")
        out = await server.locked(name, m.classify, body.texts)
        return {"model": name, "results": [{"label": label, "probability": float(p)} for label, p in out]}

    return app


def _check_lengths(name: str, m, texts: list[str], param: str, eos: bool = False) -> list[int]:
    """Token counts of the texts; one past the model's positions is a 400."""
    lengths = [len(ids) for ids in m.tokenizer.encode_batch(texts, eos=eos)]
    if max(lengths) > m.config.max_len:
        raise APIError(400, f"a text is {max(lengths)} tokens; {name} reads at most {m.config.max_len}",
                       param=param, code="context_length_exceeded")
    return lengths


def _model_card(name: str, m, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "attnlab", "kind": m.kind,
            "context_length": m.config.max_len}


# -- generation through the engine ---------------------------------------------------------------------------

async def _generate(server: Server, name: str, m, prompts: list[list[int]], body: _Sampling,
                    max_new: int | None, chat: bool):
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
    for param in ("presence_penalty", "frequency_penalty", "logprobs"):
        if getattr(body, param):
            raise APIError(400, f"{param} is not supported by attnlab serve", param=param, code="unsupported")
    if len(prompts) * body.n > MAX_CHOICES:
        raise APIError(400, f"{len(prompts)} prompts × n={body.n} is more than {MAX_CHOICES} choices in one request",
                       param="n")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise APIError(400, "stop takes up to 4 non-empty strings", param="stop")
    temperature = 1.0 if body.temperature is None else body.temperature
    engine = server.engines[name]
    loop = asyncio.get_running_loop()
    gens = []
    try:
        for p, ids in enumerate(prompts):
            for j in range(body.n):
                seed = None if body.seed is None else body.seed + j
                req = Request(ids, max_new or context - len(ids), temperature, body.top_p or 1.0, seed,
                              loop, asyncio.Queue())
                gens.append(_Generation(m, req, stops))
                engine.submit(req)
    except QueueFull as e:
        for g in gens:
            g.req.cancel()
        raise APIError(429, str(e), "rate_limit_exceeded", code="queue_full") from None
    prompt_tokens = sum(len(ids) for ids in prompts)
    server.metrics.tokens.labels(name, "prompt").inc(prompt_tokens)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())

    def usage():
        done = sum(len(g.req.generated) for g in gens)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}

    if not body.stream:
        try:
            results = await asyncio.gather(*(g.collect() for g in gens))
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
                    raise RuntimeError(value)
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
