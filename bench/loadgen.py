"""`meshserve bench`: load-test an OpenAI-compatible HTTP server or meshserve's NATS API with a workload.

    meshserve bench --url http://127.0.0.1:8000 --workload mixed-chat [--seed N] [--model M]
                    [--json OUT] [--plots DIR] [--slo-ttft 1.0 --slo-tpot 0.1]
    meshserve bench --nats-url nats://127.0.0.1:4222 [--namespace meshserve] --workload priority-mix

Workloads are files (YAML or JSON; see bench/workload.py) or the names of the shipped
ones: mixed-chat, mixed-64, short-long, shared-prefix, priority-mix, multi-model. Prompts are
token-id lists drawn from the seed over the tokenizer's vocabulary (special tokens left out),
sent to /v1/completions with max_tokens = the output length, ignore_eos, temperature 0 (unless the
workload says otherwise), streaming with usage. Requests are sent at their arrival times (at most
--max-concurrency in flight). Prints the report as JSON on stdout and a table on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from typing import Any, AsyncIterator, Callable

from meshserve.bench.report import RequestResult, plots, print_table, summarize, table
from meshserve.bench.workload import Request, WorkloadSpec, load_workload, summary
from meshserve.cli.errors import ArgumentParser, CLIError
from meshserve.shared.models_repo import DEFAULT_MODEL


class TargetError(Exception):
    """A request failed; the message is the reason the report counts."""


# --- targets: each streams the JSON chunks of one request

def _error_message(data: Any) -> str:
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message") or data["error"])
    if isinstance(data, dict) and "error" in data:
        return str(data["error"])
    if isinstance(data, dict) and "detail" in data:
        return str(data["detail"])
    return str(data)


class HTTPTarget:
    """An OpenAI-compatible server (meshserve's gateway, vLLM, SGLang, llama.cpp, ...), SSE streaming."""

    def __init__(self, url: str, endpoint: str = "completions", timeout: float = 600.0, max_connections: int = 1000):
        base = url.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        self.url = base + ("/chat/completions" if endpoint == "chat" else "/completions")
        self.timeout, self.max_connections = timeout, max_connections
        self.client = None

    def describe(self) -> dict:
        return {"kind": "http", "url": self.url}

    async def __aenter__(self):
        import httpx

        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=30.0, read=self.timeout, write=60.0, pool=None),
            limits=httpx.Limits(max_connections=self.max_connections, max_keepalive_connections=self.max_connections))
        # One untimed round trip (a GET, which the endpoint refuses) before the clock starts: the
        # client's first request imports and sets up its HTTP stack, which once held every request
        # of a burst back by a third of a second in their measured latencies.
        try:
            await self.client.get(self.url, timeout=10.0)
        except httpx.HTTPError:
            pass  # unreachable: the timed requests will say so
        return self

    async def __aexit__(self, *exc):
        await self.client.aclose()

    async def stream(self, body: dict) -> AsyncIterator[dict]:
        import httpx

        try:
            async with self.client.stream("POST", self.url, json=body) as r:
                if r.status_code != 200:
                    raw = await r.aread()
                    try:
                        msg = _error_message(json.loads(raw))
                    except ValueError:
                        msg = raw.decode(errors="replace").strip()[:200]
                    raise TargetError(f"HTTP {r.status_code}: {msg}")
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    try:
                        yield json.loads(data)
                    except ValueError:
                        raise TargetError(f"bad SSE data: {data[:100]!r}") from None
        except httpx.TimeoutException as e:
            raise TargetError(f"timeout ({type(e).__name__})") from None
        except httpx.HTTPError as e:
            raise TargetError(f"{type(e).__name__}: {e}".rstrip(": ")) from None


class NATSTarget:
    """meshserve's NATS API: publish with an inbox as the reply subject; one message per chunk, then [DONE]."""

    def __init__(self, nats_url: str, namespace: str = "meshserve", endpoint: str = "completions",
                 timeout: float = 600.0):
        from meshserve.shared.subjects import Subjects

        s = Subjects(namespace)
        self.nats_url, self.subject = nats_url, s.chat_completions if endpoint == "chat" else s.completions
        self.timeout = timeout
        self.nc = None

    def describe(self) -> dict:
        return {"kind": "nats", "url": self.nats_url, "subject": self.subject}

    async def __aenter__(self):
        import nats

        async def quiet(e):  # the failure is raised below, in one line, not logged as it retries
            pass

        try:
            from meshserve.shared.nats_auth import connect_options  # the public user: $MESHSERVE_NATS_USER/_PASSWORD

            self.nc = await nats.connect(self.nats_url, max_reconnect_attempts=2, error_cb=quiet, **connect_options())
        except Exception as e:  # noqa: BLE001 - nats raises several kinds for an unreachable server
            raise CLIError(f"cannot reach NATS at {self.nats_url}: {e or type(e).__name__}") from None
        return self

    def check_reachable(self) -> None:
        async def go():
            async with self:
                pass

        asyncio.run(go())

    async def __aexit__(self, *exc):
        await self.nc.drain()

    async def stream(self, body: dict) -> AsyncIterator[dict]:
        import nats.errors
        import orjson

        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        try:
            await self.nc.publish(self.subject, orjson.dumps(body), reply=inbox)
            while True:
                try:
                    msg = await sub.next_msg(timeout=self.timeout)
                except nats.errors.TimeoutError:
                    raise TargetError(f"timeout: no message for {self.timeout:g} s") from None
                if msg.data == b"[DONE]":
                    return
                try:
                    chunk = orjson.loads(msg.data)
                except orjson.JSONDecodeError:
                    raise TargetError(f"bad message: {msg.data[:100]!r}") from None
                status = (msg.headers or {}).get("Meshserve-Status")  # what marks an error (docs/nats-api.md)
                if status is not None:
                    raise TargetError(f"NATS {status}: {_error_message(chunk)}")
                yield chunk
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


# --- requests

def build_body(req: Request, model: str | None, endpoint: str = "completions", prompt_format: str = "ids",
               tokenizer=None, model_map: dict[str, str] | None = None) -> dict:
    """The JSON body of one request."""
    name = req.model or model
    name = (model_map or {}).get(name, name)
    body: dict[str, Any] = {"model": name, "max_tokens": req.output_len, "stream": True,
                            "stream_options": {"include_usage": True}} | req.sampling
    if req.priority:
        body["priority"] = req.priority
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": tokenizer.decode(req.prompt)}]
        body["max_completion_tokens"] = req.output_len
    else:
        body["prompt"] = tokenizer.decode(req.prompt) if prompt_format == "text" else req.prompt
    return body


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return c.get("text") or (c.get("delta") or {}).get("content") or ""


async def measure(target, body: dict, res: RequestResult, clock: Callable[[], float]) -> RequestResult:
    """Sends one request and records when its content chunks came; never raises for the server's errors."""
    res.start = clock()
    usage = None
    try:
        async for chunk in target.stream(body):
            now = clock()
            if "error" in chunk:
                raise TargetError(f"stream error: {_error_message(chunk)}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            if _chunk_text(chunk):
                res.chunk_times.append(now)
        res.end = clock()
    except TargetError as e:
        res.error = str(e)
    except Exception as e:  # noqa: BLE001 - a client-side failure is a failed request, not a crash
        res.error = f"{type(e).__name__}: {e}"
    if res.end is None:
        res.end = clock()
    if usage:
        res.output_tokens = int(usage.get("completion_tokens") or 0)
        res.prompt_tokens = int(usage.get("prompt_tokens") or res.prompt_tokens)
        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    elif res.error is None:
        res.output_tokens = len(res.chunk_times)
    if res.error is None and not res.chunk_times:
        res.error = "no output: the stream ended without content"
    return res


def new_result(req: Request) -> RequestResult:
    return RequestResult(index=req.index, cls=req.cls, model=req.model, priority=req.priority,
                         prompt_tokens=req.prompt_len, requested_output_tokens=req.output_len,
                         arrival=req.arrival, slo=dict(req.slo))


def unfinished_by_class(requests: list[Request]) -> dict[str, int]:
    """Requests per class, counted down as they finish (a class's `while_running` reads it)."""
    out: dict[str, int] = {}
    for q in requests:
        out[q.cls] = out.get(q.cls, 0) + 1
    return out


def skipped(req: Request, unfinished: dict[str, int]) -> bool:
    """A request of a `while_running` class whose other class has all finished: not sent."""
    return req.while_running is not None and unfinished.get(req.while_running, -1) == 0


async def run(target, requests: list[Request], bodies: list[dict], max_concurrency: int | None = None,
              on_done: Callable[[RequestResult], None] | None = None) -> list[RequestResult]:
    """Sends each request at its arrival time (seconds from now), at most max_concurrency in flight.
    Requests skipped by their class's `while_running` are left out of the results."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()
    unfinished = unfinished_by_class(requests)

    def clock() -> float:
        return time.perf_counter() - t0

    async def one(req: Request, body: dict) -> RequestResult | None:
        res = new_result(req)
        delay = req.arrival - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        if skipped(req, unfinished):
            unfinished[req.cls] -= 1
            return None
        if sem is None:
            await measure(target, body, res, clock)
        else:
            async with sem:
                await measure(target, body, res, clock)
        unfinished[req.cls] -= 1
        if on_done:
            on_done(res)
        return res

    return [r for r in await asyncio.gather(*[one(q, b) for q, b in zip(requests, bodies)]) if r is not None]


# --- command line

def special_ids(tokenizer) -> set[int]:
    """Token ids a random prompt must not contain: the special (added) tokens, BOS and EOS."""
    ids = {i for i, t in tokenizer.tk.get_added_tokens_decoder().items() if t.special}
    ids |= set(tokenizer.eos_token_ids)
    if tokenizer.bos_token_id is not None:
        ids.add(tokenizer.bos_token_id)
    return ids


def add_workload_arguments(ap: argparse.ArgumentParser, default_workload: str | None = None) -> None:
    """The workload options `meshserve bench` and `meshserve compare` share."""
    ap.add_argument("--workload", required=default_workload is None, default=default_workload,
                    help="a workload file (YAML/JSON) or a shipped workload's name")
    ap.add_argument("--seed", type=int, default=None, help="default: the workload's seed")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model name sent (and whose tokenizer builds prompts)")
    ap.add_argument("--num-requests", type=int, default=None, help="send this many requests (shrinks a workload)")
    ap.add_argument("--max-model-len", type=int, default=8192,
                    help="context length: lengths written for another context are scaled, all are clamped to it")
    ap.add_argument("--request-rate", type=float, default=None,
                    help="replace the workload's (top-level) arrivals by Poisson at this rate; inf: all at once")
    ap.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    ap.add_argument("--slo-ttft", type=float, default=1.0, help="goodput SLO on TTFT, s (a class's own SLOs win)")
    ap.add_argument("--slo-tpot", type=float, default=0.1, help="goodput SLO on TPOT, s")
    ap.add_argument("--slo-e2e", type=float, default=None, help="goodput SLO on end-to-end latency, s")


def workload_arg(name: str) -> WorkloadSpec:
    """--workload, loaded; a missing or malformed one is a CLIError."""
    try:
        return load_workload(name)
    except FileNotFoundError as e:
        raise CLIError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - YAML, JSON or schema errors: the file's fault
        raise CLIError(f"workload {name}: {e}") from None


def prepare_workload(a: argparse.Namespace, vocab_size: int, special: set[int],
                     spec: WorkloadSpec | None = None) -> tuple[WorkloadSpec, list[Request]]:
    spec = spec or workload_arg(a.workload)
    if a.request_rate is not None:
        spec.arrival = spec.arrival.model_copy(update=(
            {"pattern": "all_at_once"} if a.request_rate == float("inf") else {"pattern": "poisson", "rate": a.request_rate}))
    if a.max_concurrency is not None:
        spec.arrival = spec.arrival.model_copy(update={"max_concurrency": a.max_concurrency})
    reqs = spec.generate(a.seed, vocab_size=vocab_size, special_ids=special, max_model_len=a.max_model_len,
                         num_requests=a.num_requests)
    return spec, reqs


def slo_of(a: argparse.Namespace) -> dict[str, float | None]:
    return {"ttft": a.slo_ttft, "tpot": a.slo_tpot, "e2e": a.slo_e2e}


def progress_run(target, reqs: list[Request], bodies: list[dict], max_concurrency: int | None,
                 quiet: bool = False, label: str = "requests") -> list[RequestResult]:
    """run() with a rich progress bar on stderr."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    async def go(on_done):
        async with target:
            return await run(target, reqs, bodies, max_concurrency, on_done)

    if quiet:
        return asyncio.run(go(None))
    failed = 0
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[failed]} failed"), console=Console(stderr=True), transient=False) as p:
        task = p.add_task(label, total=len(reqs), failed=0)

        def done(res: RequestResult) -> None:
            nonlocal failed
            failed += not res.ok
            p.update(task, advance=1, failed=failed)

        return asyncio.run(go(done))


def quiet_http_logs() -> None:
    """The CLI logs at INFO; one httpx line per request would bury the progress bar."""
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)


def write_json(path: str, data: dict) -> None:
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")


# --- the prompts' tokenizer

def server_root(url: str) -> str:
    """The server's address without /v1: vLLM serves /tokenize beside /v1, not under it."""
    base = url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def sample_text(words: int = 4000, seed: int = 0) -> str:
    """Made-up words, numbers and punctuation: tokenized by a server, they show it many ids."""
    import random
    import string

    rng = random.Random(seed)
    out = []
    for _ in range(words):
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 9)))
        r = rng.random()
        out.append(w.capitalize() if r < 0.1 else str(rng.randint(0, 9999)) if r < 0.15 else w)
        if rng.random() < 0.08:
            out[-1] += rng.choice(".,;:!?")
    return " ".join(out)


class ServerTokenizer:
    """A server's /tokenize and /detokenize (vLLM's API) in place of a local tokenizer. Prompts are
    drawn from `ids`, the ids the server gave a sample text (so ordinary tokens only): their lengths
    are exact in the server's own tokens. decode() asks /detokenize (text and chat prompts)."""

    def __init__(self, root: str, model: str, ids: list[int]):
        self.root, self.model, self.ids = root, model, ids

    @classmethod
    def probe(cls, url: str, model: str) -> "ServerTokenizer | None":
        """None when the server has no /tokenize (or it does not know `model`)."""
        import httpx

        root = server_root(url)
        try:
            r = httpx.post(f"{root}/tokenize", json={"model": model, "prompt": sample_text(),
                                                     "add_special_tokens": False}, timeout=30)
            tokens = r.json().get("tokens") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) for t in tokens):
            return None
        return cls(root, model, sorted(set(tokens)))

    @property
    def vocab_size(self) -> int:
        return len(self.ids)

    def to_server_ids(self, prompt: list[int]) -> list[int]:
        """A prompt drawn below vocab_size, as the server's ids (one to one: shared prefixes stay shared)."""
        return [self.ids[i] for i in prompt]

    def decode(self, ids: list[int]) -> str:
        import httpx

        r = httpx.post(f"{self.root}/detokenize", json={"model": self.model, "tokens": list(ids)}, timeout=30)
        if r.status_code != 200:
            raise CLIError(f"{self.root}/detokenize answered {r.status_code}: {r.text[:200]}")
        return r.json()["prompt"]


def check_reachable(url: str, model: str) -> None:
    """Fails at once for a server nobody answers at; warns when it lists models and not this one."""
    import httpx

    try:
        r = httpx.get(f"{server_root(url)}/v1/models", timeout=10)
    except httpx.HTTPError as e:
        raise CLIError(f"cannot reach {url}: {type(e).__name__}: {e}".rstrip(": ")) from None
    try:
        served = [m["id"] for m in r.json()["data"]] if r.status_code == 200 else []
    except (ValueError, KeyError, TypeError):
        served = []
    if served and model not in served:
        print(f"meshserve bench: warning: {url} serves {', '.join(served)}, not {model!r} (see --model)",
              file=sys.stderr)


def pick_tokenizer(a: argparse.Namespace):
    """The tokenizer that builds prompts: --tokenizer; else --model's own when it names a known model
    or a path; else the server's /tokenize; else the default model's, with a warning that prompt
    lengths are then approximate. Returns (tokenizer, where it came from, exact)."""
    from meshserve.shared.models_repo import UnknownModel, check, load_tokenizer

    if a.tokenizer:
        return load_tokenizer(a.tokenizer), f"--tokenizer {a.tokenizer}", True
    try:
        check(a.model)
        return load_tokenizer(a.model), f"--model {a.model}", True
    except UnknownModel:
        pass
    if not a.nats_url:
        server = ServerTokenizer.probe(a.url, a.model)
        if server is not None:
            return server, f"{server.root}/tokenize", True
    print(f"meshserve bench: warning: no tokenizer for {a.model!r} (not a known model or a path, and the server has "
          f"no /tokenize): prompts come from {DEFAULT_MODEL}'s tokenizer, sent as text, so their lengths in the "
          "server's tokens are approximate; pass --tokenizer for exact ones", file=sys.stderr)
    return load_tokenizer(DEFAULT_MODEL), f"{DEFAULT_MODEL} (approximate)", False


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="meshserve bench", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="OpenAI-compatible server (with or without /v1)")
    ap.add_argument("--nats-url", default=None, help="use meshserve's NATS API at this server instead of HTTP")
    ap.add_argument("--namespace", default="meshserve", help="NATS subject prefix")
    add_workload_arguments(ap)
    ap.add_argument("--tokenizer", default=None,
                    help="model name or path whose vocabulary builds prompts (default: --model when it is one, else "
                         "the server's /tokenize, else the default model's, approximately)")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="draw prompt ids below this without loading a tokenizer (ids prompts only)")
    ap.add_argument("--model-map", action="append", default=[], metavar="NAME=SERVED",
                    help="send the workload's model NAME as SERVED (repeatable)")
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--prompt-format", choices=["ids", "text"], default=None,
                    help="send prompts as token ids, or decoded to text (the server re-tokenizes: lengths differ); "
                         "default: ids, or text when the tokenizer is only approximately the server's")
    ap.add_argument("--timeout", type=float, default=600.0, help="longest wait for the next chunk, s")
    ap.add_argument("--json", default=None, help="write the report (with per-request records) here")
    ap.add_argument("--plots", default=None, help="write PNG plots into this folder")
    ap.add_argument("--quiet", action="store_true", help="no progress bar and no table")
    a = ap.parse_args(argv)
    quiet_http_logs()

    try:
        model_map = dict(m.split("=", 1) for m in a.model_map)
    except ValueError:
        ap.error("--model-map takes NAME=SERVED")
    spec = workload_arg(a.workload)
    if a.nats_url:
        NATSTarget(a.nats_url, a.namespace).check_reachable()
    else:
        check_reachable(a.url, a.model)
    tokenizer, tokenizer_source = None, f"--vocab-size {a.vocab_size}"
    if a.vocab_size:
        vocab, special = a.vocab_size, set()
        if a.endpoint == "chat" or a.prompt_format == "text":
            ap.error("--vocab-size makes id prompts only; text and chat need a tokenizer")
    else:
        tokenizer, tokenizer_source, exact = pick_tokenizer(a)
        if isinstance(tokenizer, ServerTokenizer):
            vocab, special = tokenizer.vocab_size, set()
        else:
            vocab, special = tokenizer.vocab_size, special_ids(tokenizer)
        if a.prompt_format is None and not exact:
            a.prompt_format = "text"  # another model's ids could be any tokens of this one, or none
    a.prompt_format = a.prompt_format or "ids"
    spec, reqs = prepare_workload(a, vocab, special, spec)
    if isinstance(tokenizer, ServerTokenizer):
        for q in reqs:
            q.prompt = tokenizer.to_server_ids(q.prompt)
    bodies = [build_body(q, a.model, a.endpoint, a.prompt_format, tokenizer, model_map) for q in reqs]
    if a.nats_url:
        target = NATSTarget(a.nats_url, a.namespace, a.endpoint, a.timeout)
    else:
        target = HTTPTarget(a.url, a.endpoint, a.timeout, max_connections=max(16, len(reqs) + 4))
    results = progress_run(target, reqs, bodies, spec.arrival.max_concurrency, a.quiet, label=spec.name)
    report = {"command": "meshserve bench " + " ".join(argv if argv is not None else sys.argv[1:]),
              "target": target.describe(), "model": a.model, "tokenizer": tokenizer_source,
              "workload": summary(spec, reqs, a.seed) | {"max_model_len": a.max_model_len,
                                                          "endpoint": a.endpoint, "prompt_format": a.prompt_format},
              "slo": slo_of(a)} | summarize(results, slo_of(a))
    if a.plots:
        report["plots"] = plots(results, a.plots, title=spec.name)
    if a.json:
        write_json(a.json, report | {"per_request": [r.record() for r in results]})
    if not a.quiet:
        print_table(table(report, title=f"meshserve bench: {spec.name} -> {target.describe()['url']}"))
    print(json.dumps(report, indent=2))
    return 1 if results and all(not r.ok for r in results) else 0
