"""attnlab serve: an OpenAI-compatible HTTP server (continuous batching for language models)."""

from __future__ import annotations

import sys

from .common import UsageError, add_device

HELP = "serve models over HTTP: OpenAI-compatible /v1 routes, translate, classify, metrics"
EXAMPLES = """attnlab serve --model smollm2 --port 8000
  attnlab serve --model lm=runs/lm --model mt=runs/enzh --model minilm --max-batch 32
  # then: OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-").chat.completions.create(...)"""


def arguments(p) -> None:
    p.add_argument("--model", action="append", required=True, metavar="[ALIAS=]NAME_OR_DIR",
                   help="a model to serve (repeatable): a pretrained name, a .gguf, an HF folder or a model "
                        "directory; ALIAS= names it in requests (default: the name, or the directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch", type=int, default=16, help="most requests decoded together per model (default 16)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="most requests waiting for the batch; more are refused with HTTP 429 (default 256)")
    p.add_argument("--bf16", action="store_true",
                   help="run the models in bfloat16 where it is native (fp32 on CPUs that would emulate it)")
    p.add_argument("--quantize", choices=("int8", "int4"),
                   help="weight-only quantisation of every linear layer (attnlab.quant): less memory, faster "
                        "decoding of small batches on CPU")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decoding step of language models (dynamic shapes; compiled at "
                        "start-up, minutes for SmolLM2 on 2 cores, answering 503 until then; --quantize models "
                        "and translators stay eager)")
    add_device(p)


def model_specs(values: list[str]) -> dict[str, str]:
    """``[ALIAS=]SPEC`` values → {alias: spec}; aliases must be unique."""
    from pathlib import Path
    out: dict[str, str] = {}
    for v in values:
        alias, sep, spec = v.partition("=")
        if not sep:
            alias, spec = Path(v.rstrip("/\\")).name or v, v
        if not alias or not spec:
            raise UsageError(f"--model {v!r}: give NAME_OR_DIR or ALIAS=NAME_OR_DIR")
        if alias in out:
            raise UsageError(f"--model: the alias {alias!r} is given twice (name them with ALIAS=...)")
        out[alias] = spec
    return out


def run(args) -> int:
    if args.max_batch < 1 or args.max_queue < 0 or not 0 < args.port < 65536:
        raise UsageError("--max-batch must be >= 1, --max-queue >= 0, --port in 1..65535")
    specs = model_specs(args.model)
    try:
        import uvicorn

        from ..serve.app import create_app
    except ImportError as e:
        if "attnlab[serve]" in str(e):
            raise
        raise ImportError(f'attnlab serve needs FastAPI, uvicorn and prometheus_client ({e.name or e} is not '
                          f'installed): pip install "attnlab[serve]"') from None
    import attnlab
    failed = []

    def loader(alias, spec):
        def load():
            m = attnlab.load(spec, device=args.device, bf16=args.bf16, quantize=args.quantize)
            print(f"attnlab serve: {alias} = {spec} ({m.kind}, {m.config.family}) is ready", flush=True)
            return m
        return load

    def load_error(alias, e):
        failed.append(alias)
        print(f"attnlab serve: --model {alias}={specs[alias]}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        server.should_exit = True  # a model that cannot load is a usage error: stop, as before any request

    # The server answers at once; the models load in the background (503 for theirs until ready).
    app = create_app({alias: loader(alias, spec) for alias, spec in specs.items()}, max_batch=args.max_batch,
                     max_queue=args.max_queue, compile=args.compile, on_load_error=load_error)
    print(f"attnlab serve: http://{args.host}:{args.port}/v1 (OpenAI-compatible); /health, /metrics; "
          f"loading {', '.join(specs)}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
    # The engine threads dispatch hundreds of small ops per step, each needing the GIL; with Python's
    # default 5 ms switch interval a burst of HTTP work in the event loop can hold them up that long.
    # (measured with benchmarks/serve_load.py --rounds 3: 1.94x -> 2.04x transformers serve at 16 clients)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    try:
        server.run()
    finally:
        sys.setswitchinterval(interval)
    return 1 if failed else 0
