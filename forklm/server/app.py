"""The OpenAI-compatible HTTP API over one `EngineLoop`.

    app = create_app(LLM("smollm2-135m"), ServerConfig(model_name="smollm2-135m"))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id},
GET /health, GET /metrics (Prometheus). Bodies are read and parsed here (size limit, strict
UTF-8 and JSON, pydantic validation) so that every bad request gets OpenAI's error shape and a
4xx status, never a 500. One HTTP request becomes one engine request per prompt; its n choices
are that request's samples, sharing its prompt KV. A client that disconnects cancels its engine
requests; the engine releases their blocks at its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from forklm.engine.loop import EngineLoop, EngineLoopClosed, RequestStream
from forklm.engine.request import TokenEvent
from forklm.errors import InvalidArgumentError
from forklm.llm import LLM
from forklm.outputs import Sample, SampleOutput
from forklm.sampling.params import SamplingParams
from forklm.server.errors import APIError, clip, invalid, param_of_message
from forklm.server.metrics import ServerMetrics
from forklm.server.protocol import ChatBody, CompletionBody, constraint_of, parse_body
from forklm.server.text_stream import SampleTextStream, TextOffsets


@dataclass
class ServerConfig:
    model_name: str  # the name clients pass as `model`
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    max_body_bytes: int = 4 * 2**20  # larger bodies get 413
    max_requests: int = 1024  # engine requests in flight (one per prompt); more get 503
    max_samples: int = 1024  # samples one HTTP request may ask for (n or best_of, times its prompts); more get 400
    retry_after_s: int = 1  # Retry-After of a 503
    metrics_interval_s: float = 0.1  # /metrics answers at most once per interval, scrapes in turn
    engine_options: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields


@dataclass
class _Job:
    """One engine request: one prompt of an HTTP request, with its n (or best_of) samples."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: RequestStream | None = None


class _Server:
    def __init__(self, llm: LLM, config: ServerConfig) -> None:
        self.llm = llm
        self.config = config
        self.engine = llm.engine(**config.engine_options)
        self.engine.kv.commit()
        self.metrics = ServerMetrics(self.engine)
        self._in_flight = 0
        self._lock = threading.Lock()
        self.loop = EngineLoop(self.engine, on_step=self.metrics.on_step, on_done=self._on_done)
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}

    # ------------------------------------------------------------------ bookkeeping
    def _on_done(self, event: TokenEvent) -> None:  # the loop thread
        with self._lock:
            self._in_flight -= 1
            self.metrics.in_flight.set(self._in_flight)
        if event.output is not None:
            self.metrics.finished(event.output)

    def submit(self, jobs: list[_Job], stream_tokens: bool, request_id: str) -> None:
        """Reserves an in-flight slot per job (503 when full) and hands the jobs to the loop;
        `jobs_for` has refused a request that could never fit."""
        with self._lock:
            if self._in_flight + len(jobs) > self.config.max_requests:
                raise APIError(
                    503, f"the server is at its limit of {self.config.max_requests} requests in flight; retry later",
                    type="server_overloaded", code="queue_full",
                    headers={"Retry-After": str(self.config.retry_after_s)},
                )
            self._in_flight += len(jobs)
            self.metrics.in_flight.set(self._in_flight)
        for k, job in enumerate(jobs):
            try:
                job.stream = self.loop.submit(job.prompt_ids, job.params, f"{request_id}-{k}", events=stream_tokens)
            except Exception as exc:
                with self._lock:  # this job and the ones after it never reached the loop
                    self._in_flight -= len(jobs) - k
                    self.metrics.in_flight.set(self._in_flight)
                self.cancel(jobs)
                if isinstance(exc, EngineLoopClosed):
                    raise APIError(503, "the server is shutting down", type="server_error") from None
                if isinstance(exc, InvalidArgumentError):
                    raise _argument_error(exc, "messages" if request_id.startswith("chatcmpl") else "prompt") from None
                raise

    def cancel(self, jobs: list[_Job]) -> None:
        for job in jobs:
            if job.stream is not None and not job.stream.done:
                self.loop.cancel(job.stream.request_id)

    def token_text(self, token_id: int) -> str:
        """A token as text; a piece of a UTF-8 character as "bytes:\\xNN" (OpenAI's convention)."""
        text = self._token_text.get(token_id)
        if text is None:
            raw = self.llm.tokenizer.token_bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._token_text[token_id] = text
        return text

    # ------------------------------------------------------------------ request -> jobs
    def jobs_for(self, body: CompletionBody | ChatBody) -> list[_Job]:
        llm = self.llm
        if isinstance(body, ChatBody):
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            try:
                prompts = [llm.prompt_token_ids(messages)]
            except InvalidArgumentError as exc:
                raise invalid(str(exc), param="messages") from None
            self._check_samples(body.n, 1, "n")
            max_tokens = body.max_completion_tokens or body.max_tokens
            top_logprobs = (body.top_logprobs or 0) if body.logprobs else 0
            n_samples = body.n
        else:
            p = body.prompt
            items = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
            self._check_prompts(len(items))
            self._check_samples(body.best_of or body.n, len(items), "best_of" if body.best_of else "n")
            prompts = []
            for i, item in enumerate(items):
                try:
                    prompts.append(llm.prompt_token_ids(item))
                except InvalidArgumentError as exc:
                    raise invalid(str(exc), param="prompt" if len(items) == 1 else f"prompt[{i}]") from None
            max_tokens = body.max_tokens
            top_logprobs = body.logprobs or 0
            n_samples = body.best_of or body.n
        constraint = constraint_of(body, self.llm.check_constraint)  # compiles it (cached by its text): off the event loop, as this is
        vocab = llm.config.vocab_size
        if body.stop_token_ids and max(body.stop_token_ids) >= vocab:
            raise invalid(f"stop_token_ids must be token ids in [0, {vocab})", param="stop_token_ids")
        jobs = []
        for ids in prompts:
            room = self.room_for(len(ids))
            if room < 1:
                raise invalid(
                    f"the prompt has {len(ids)} tokens, which leaves no room to generate in the model's context of "
                    f"{llm.config.max_position_embeddings} tokens",
                    param="messages" if isinstance(body, ChatBody) else "prompt", code="context_length_exceeded",
                )
            beam = {}
            if body.use_beam_search:  # n_samples beams, the n best returned; the sampling knobs stay at defaults
                beam = dict(beam_width=n_samples, length_penalty=body.length_penalty,
                            early_stopping=body.early_stopping, num_beam_groups=body.num_beam_groups,
                            diversity_penalty=body.diversity_penalty)
            try:
                params = SamplingParams(
                    n=body.n if beam else n_samples,
                    # unset: the context's rest (beam search: at most BEAM_DEFAULT_MAX_TOKENS, its k beams need k tails)
                    max_tokens=max_tokens if max_tokens is not None else min(room, BEAM_DEFAULT_MAX_TOKENS) if beam else room,
                    min_tokens=body.min_tokens,
                    temperature=1.0 if body.temperature is None or beam else body.temperature,
                    top_p=1.0 if body.top_p is None or beam else body.top_p,
                    top_k=body.top_k,
                    seed=body.seed,
                    stop=body.stop or (),
                    stop_token_ids=body.stop_token_ids or (),
                    ignore_eos=body.ignore_eos,
                    top_logprobs=top_logprobs,
                    constraint=constraint,
                    jump_forward=body.jump_forward,
                    speculative=body.speculative,
                    time_budget_s=body.time_budget_s,
                    **beam,
                )
            except InvalidArgumentError as exc:
                raise invalid(str(exc), param=param_of_message(str(exc))) from None
            jobs.append(_Job(ids, params))
        return jobs

    def _check_prompts(self, prompts: int) -> None:
        """Before tokenizing: a request with more prompts than the server runs at once never fits
        (a 400, not a 503 that tells the client to retry)."""
        limit = self.config.max_requests
        if prompts > limit:
            raise invalid(f"prompt holds {prompts} prompts; this server runs at most {limit} prompts at once "
                          "(one engine request each)", param="prompt")

    def _check_samples(self, per_prompt: int, prompts: int, param: str) -> None:
        """Blames the prompts when they alone are too many (one sample each), else `param`."""
        limit = self.config.max_samples
        if prompts > limit:
            raise invalid(f"prompt holds {prompts} prompts, at least one sample each; this server allows at most "
                          f"{limit} samples per request", param="prompt")
        if per_prompt * prompts > limit:
            each = f" for each of {prompts} prompts ({per_prompt * prompts} samples)" if prompts > 1 else " samples"
            raise invalid(f"{param} asks for {per_prompt}{each}; this server allows at most {limit} samples per "
                          "request", param=param)

    def room_for(self, prompt_len: int) -> int:
        """Tokens a sample of this prompt may generate: the context's rest, within the KV pool."""
        cfg, bs = self.llm.config, self.engine.block_size
        room = cfg.max_position_embeddings - prompt_len
        pool_tokens = (self.engine.pool.num_blocks - -(-prompt_len // bs)) * bs - prompt_len % bs
        return min(room, pool_tokens)

    # ------------------------------------------------------------------ responses
    def completion_logprobs(self, sample_ids: list[int], lps: list[float], tops: list | None, k: int,
                            offsets: TextOffsets | None = None) -> dict:
        """`offsets` carries a streamed sample's position from chunk to chunk (None: from 0)."""
        tokens = [self.token_text(t) for t in sample_ids]
        offsets = offsets or TextOffsets(self.llm.tokenizer)
        top = []
        for i, (t, lp) in enumerate(zip(tokens, lps)):
            alts = {self.token_text(a): v for a, v in (tops[i] if tops else [])[:k]}
            alts.setdefault(t, lp)
            top.append(alts)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets.next(sample_ids)}

    def chat_logprobs(self, sample_ids: list[int], lps: list[float], tops: list | None, k: int) -> list[dict]:
        out = []
        for i, (t, lp) in enumerate(zip(sample_ids, lps)):
            alts = (tops[i] if tops else [])[:k]
            out.append({
                **self._chat_token(t, lp),
                "top_logprobs": [self._chat_token(a, v) for a, v in alts],
            })
        return out

    def _chat_token(self, token_id: int, lp: float) -> dict:
        return {"token": self.token_text(token_id), "logprob": lp,
                "bytes": list(self.llm.tokenizer.token_bytes(token_id))}


BEAM_DEFAULT_MAX_TOKENS = 256


def _argument_error(exc: InvalidArgumentError, prompt_param: str) -> APIError:
    msg = str(exc)
    if "context length" in msg:
        return invalid(msg, param=prompt_param, code="context_length_exceeded")
    if "KV blocks" in msg:
        return invalid(msg, param="max_tokens", code="request_too_large")
    return invalid(msg, param=param_of_message(msg))


def _choices_of(body: CompletionBody | ChatBody, output: SampleOutput) -> list[Sample]:
    """The samples to return, in order: all; the n best of best_of; or ranked and de-duplicated."""
    samples = output.samples
    if body.rank:
        return output.ranked(body.n)
    if body.use_beam_search:  # the n best hypotheses, best score first
        return samples
    if isinstance(body, CompletionBody) and body.best_of and body.best_of > body.n:
        return sorted(samples, key=lambda s: (-s.mean_logprob, s.index))[: body.n]
    return samples


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _usage(outputs: list[SampleOutput]) -> dict:
    prompt = sum(o.stats.prompt_tokens for o in outputs)
    completion = sum(len(s.token_ids) for o in outputs for s in o.samples)
    cached = sum(o.stats.cached_prompt_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"


def _too_large(limit: int) -> APIError:
    # the rest of the body is never read: the connection closes after the answer
    return APIError(413, f"the request body is over the limit of {limit} bytes", code="request_too_large",
                    headers={"Connection": "close"})


async def _read_json(request: Request, limit: int) -> Any:
    """The body as JSON, read up to `limit` bytes: a longer one (declared or chunked) is cut off
    there. A client that goes away meanwhile raises starlette's ClientDisconnect."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})") from None

    def no_constants(name: str) -> None:
        raise ValueError(f"{name} is not valid JSON")

    try:
        data = json.loads(text, parse_constant=no_constants)
    except ValueError as e:
        raise invalid(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # which parameter: a scan of up to seconds (4 MB of brackets), off the event loop
        param = await asyncio.to_thread(_deepest_key, text)
        raise invalid("the request body is nested too deeply", param=param) from None
    if "\\u" in text and _SURROGATE_ESCAPE.search(text):
        try:  # an escape such as "\ud800" outside a surrogate pair: text no tokenizer can take
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except RecursionError:
            raise invalid("the request body is nested too deeply") from None
        except UnicodeEncodeError:
            raise invalid("the request body holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff), "
                          "which is not a Unicode character", param=_surrogate_key(data)) from None
    return data


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')  # strings and brackets


def _deepest_key(text: str) -> str | None:
    """The top-level key of a JSON object text whose value nests deepest (the parameter a body
    nested past the parser's limit is refused for); None where that is no key to quote back."""
    if not text.lstrip().startswith("{"):
        return None
    depth, key, deepest, found = 0, None, 0, None
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            if depth > deepest:
                deepest, found = depth, key
        elif token in ("]", "}"):
            depth -= 1
        elif depth == 1:  # a key, or a value: the last one before a nested value is its key
            key = token
    try:
        name = json.loads(found)
        name.encode("utf-8")  # an unpaired surrogate is no text to answer with
    except (TypeError, ValueError):
        return None
    return name


def _surrogate_key(data: Any) -> str | None:
    """The top-level key whose value holds an unpaired surrogate; None where a key holds one."""
    for key, value in data.items() if isinstance(data, dict) else ():
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            return None
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return key
    return None


async def _watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    """Waits for the client to go away (the body is read already, so only that can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


def create_app(llm: LLM, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="forklm", version="0.1.0", lifespan=_lifespan(llm, config),
                  description="OpenAI-compatible API of forklm: many samples from one context.")
    app.state.server = None  # the lifespan's `_Server` (None until the app starts)
    _register_error_handlers(app)
    _register_status_routes(app, config)
    _register_model_routes(app, llm, config)
    _register_completion_routes(app, config)
    return app


def _lifespan(llm: LLM, config: ServerConfig) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """Starts the engine (its `_Server`, in `app.state.server`) with the app and closes its loop after."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server = _Server(llm, config)
        app.state.server = server
        try:
            yield
        finally:
            server.loop.close()

    return lifespan


def _register_error_handlers(app: FastAPI) -> None:
    """Every error answers in OpenAI's shape: API errors, Starlette's (404, 405, ...) and the rest (500)."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail), type="invalid_request_error",
                       code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(err.body(), status_code=500)


def _check_auth(request: Request, config: ServerConfig) -> None:
    key = config.api_key
    if key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "Incorrect API key provided." if given else "Missing API key: send "
                       "'Authorization: Bearer <key>'.", code="invalid_api_key")


def _check_model(name: str, config: ServerConfig) -> None:
    if name != config.model_name:
        raise APIError(404, f"The model `{clip(name)}` does not exist; this server serves `{config.model_name}`.",
                       param="model", code="model_not_found")


def _register_status_routes(app: FastAPI, config: ServerConfig) -> None:
    """GET /health and GET /metrics (open, no API key)."""

    @app.get("/health")
    async def health() -> JSONResponse:
        server = app.state.server
        alive = server is not None and server.loop._thread.is_alive()
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    scrape_lock = asyncio.Lock()
    last_scrape = -math.inf

    @app.get("/metrics")
    async def metrics() -> Response:
        # Unthrottled scrapers (the endpoint is open) would keep the event loop, and so the GIL and
        # a core, busy answering them and slow the engine thread several-fold: they wait in turn.
        nonlocal last_scrape
        async with scrape_lock:
            await asyncio.sleep(max(0.0, last_scrape + config.metrics_interval_s - time.monotonic()))
            last_scrape = time.monotonic()
            body = app.state.server.metrics.render()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


def _register_model_routes(app: FastAPI, llm: LLM, config: ServerConfig) -> None:
    """GET /v1/models and GET /v1/models/{id}: the one model served."""

    def model_card() -> dict:
        return {"id": config.model_name, "object": "model", "created": app.state.server.created, "owned_by": "forklm",
                "max_model_len": llm.config.max_position_embeddings}

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        _check_auth(request, config)
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> JSONResponse:
        _check_auth(request, config)
        _check_model(model_id, config)
        return JSONResponse(model_card())


def _register_completion_routes(app: FastAPI, config: ServerConfig) -> None:
    """POST /v1/completions and POST /v1/chat/completions."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _handle_completion(app.state.server, config, request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _handle_completion(app.state.server, config, request, "chat")


async def _handle_completion(server: _Server, config: ServerConfig, request: Request, kind: str) -> Response:
    """One completion or chat request ("completions" or "chat"): read, check and submit it, then
    answer it whole or as a stream; every answer is counted by kind and status."""
    status = 500
    try:
        _check_auth(request, config)
        data = await _read_json(request, config.max_body_bytes)
        body = parse_body(ChatBody if kind == "chat" else CompletionBody, data)
        _check_model(body.model, config)
        # tokenizing (and rendering a chat template) a long prompt takes milliseconds:
        # off the event loop, so streams in flight keep flowing meanwhile
        jobs = await asyncio.to_thread(server.jobs_for, body)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        server.submit(jobs, stream_tokens=body.stream, request_id=rid)
        response = _Responder(server, body, jobs, rid, kind, request)
        status = 200
        if body.stream:
            return _EventStream(response.stream(), on_close=lambda: server.cancel(jobs))
        return JSONResponse(await response.complete())
    except APIError as exc:
        status = exc.status
        raise
    except ClientDisconnect:  # gone while sending its body: nobody to answer, nothing to log
        status = 499
        return Response(status_code=499)
    finally:
        server.metrics.requests.labels(kind, str(status)).inc()


class _EventStream(StreamingResponse):
    """Server-sent events that call `on_close` however the response ends, also when the client left
    before the first chunk (Starlette then never starts the generator, so its `finally` never runs)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # a send to a closed connection (ASGI 2.4): a quiet cancellation
            pass
        finally:
            self.on_close()


class _Responder:
    """Turns the engine requests of one HTTP request into OpenAI's response or chunk stream."""

    def __init__(self, server: _Server, body: CompletionBody | ChatBody, jobs: list[_Job], rid: str, kind: str,
                 request: Request) -> None:
        self.server, self.body, self.jobs, self.rid, self.kind, self.request = server, body, jobs, rid, kind, request
        self.created = int(time.time())
        self.arrival = time.perf_counter()
        self.chat = kind == "chat"
        self.k = (body.top_logprobs or 0) if self.chat else (body.logprobs or 0)
        self.want_logprobs = body.logprobs if self.chat else body.logprobs is not None
        self._finished: set[tuple[int, int]] = set()  # (prompt, sample) whose stream sent its finish_reason

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.body.model}

    async def _guarded(self, work):
        """Runs `work` while watching for a disconnect; cancels the engine requests if it ends early."""
        watcher = asyncio.create_task(_watch_disconnect(self.request, lambda: self.server.cancel(self.jobs)))
        try:
            return await work
        finally:
            watcher.cancel()
            self.server.cancel(self.jobs)  # no-op for finished ones

    # ------------------------------------------------------------------ whole response
    async def complete(self) -> dict:
        outputs = await self._guarded(self._gather())
        metrics = self.server.metrics
        now = time.perf_counter()
        metrics.e2e.observe(now - self.arrival)
        firsts = [o.stats.ttft_s for o in outputs]
        if firsts:
            metrics.ttft.observe(min(firsts))
        n = self.body.n
        choices = []
        for p, out in enumerate(outputs):
            for j, s in enumerate(_choices_of(self.body, out)):
                choices.append(self._choice(p * n + j, s))
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": choices, "usage": _usage(outputs)}

    async def _gather(self) -> list[SampleOutput]:
        try:
            return list(await asyncio.gather(*(job.stream.wait() for job in self.jobs)))
        except InvalidArgumentError as exc:
            raise _argument_error(exc, "messages" if self.chat else "prompt") from None
        except EngineLoopClosed:
            raise APIError(503, "the server is shutting down", type="server_error") from None
        except Exception as exc:  # noqa: BLE001 - a failed engine step: report it, keep serving
            raise APIError(500, f"the engine failed: {type(exc).__name__}: {exc}", type="server_error") from None

    def _choice(self, index: int, s: Sample) -> dict:
        srv = self.server
        if self.chat:
            lp = {"content": srv.chat_logprobs(s.token_ids, s.logprobs, s.top_logprobs, self.k)} \
                if self.want_logprobs else None
            choice = {"index": index, "message": {"role": "assistant", "content": s.text}, "logprobs": lp,
                      "finish_reason": s.finish_reason, "mean_logprob": _finite(s.mean_logprob)}
        else:
            lp = srv.completion_logprobs(s.token_ids, s.logprobs, s.top_logprobs, self.k) if self.want_logprobs else None
            choice = {"index": index, "text": s.text, "logprobs": lp, "finish_reason": s.finish_reason,
                      "mean_logprob": _finite(s.mean_logprob)}
        if s.score is not None:  # a beam search hypothesis
            choice["score"] = _finite(s.score)
        return choice

    # ------------------------------------------------------------------ server-sent events
    async def stream(self) -> AsyncIterator[str]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(p: int, job: _Job) -> None:
            try:
                async for batch in job.stream.batches():
                    queue.put_nowait((p, batch, None))
                queue.put_nowait((p, None, None))
            except Exception as exc:  # noqa: BLE001 - reported in the stream
                queue.put_nowait((p, None, exc))

        n = self.body.n
        texts = {(p, i): SampleTextStream(self.server.llm.tokenizer.decode, job.params.stop)
                 for p, job in enumerate(self.jobs) for i in range(n)}
        offsets = {key: TextOffsets(self.server.llm.tokenizer) for key in texts}
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        tasks = [asyncio.create_task(pump(p, job)) for p, job in enumerate(self.jobs)]
        watcher = asyncio.create_task(_watch_disconnect(self.request, lambda: self.server.cancel(self.jobs)))
        first = True
        try:
            if self.chat:  # the role comes first, once per choice
                yield _sse({**self._head(obj), "choices": [
                    {"index": p * n + i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None} for p in range(len(self.jobs)) for i in range(n)],
                    **({"usage": None} if include_usage else {})})
            remaining = len(self.jobs)
            while remaining:
                p, batch, error = await queue.get()
                if error is not None:
                    err = _error_of(error, self.chat)
                    yield _sse(err.body())
                    yield "data: [DONE]\n\n"
                    return
                if batch is None:
                    remaining -= 1
                    cut = self._cut_choices(p, texts)  # samples ended by their time budget
                    if cut:
                        yield _sse({**self._head(obj), "choices": cut, **({"usage": None} if include_usage else {})})
                    continue
                if first:
                    self.server.metrics.ttft.observe(time.perf_counter() - self.arrival)
                    first = False
                choices = self._chunk_choices(p, batch, texts, offsets)
                if choices:
                    yield _sse({**self._head(obj), "choices": choices, **({"usage": None} if include_usage else {})})
            self.server.metrics.e2e.observe(time.perf_counter() - self.arrival)
            if include_usage:
                yield _sse({**self._head(obj), "choices": [], "usage": _usage([j.stream.output for j in self.jobs])})
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            for t in tasks:
                t.cancel()
            self.server.cancel(self.jobs)

    def _cut_choices(self, p: int, texts: dict) -> list[dict]:
        """The last chunk of each sample of prompt p that ended without a token of its own (its
        time budget ran out between steps): the rest of its text and its finish_reason."""
        out = self.jobs[p].stream.output
        choices = []
        for s in out.samples if out is not None else []:
            key = (p, s.index)
            if key in self._finished:
                continue
            piece = texts[key].finish(s.text)
            index = p * self.body.n + s.index
            if self.chat:
                choices.append({"index": index, "delta": {"content": piece} if piece else {}, "logprobs": None,
                                "finish_reason": s.finish_reason})
            else:
                choices.append({"index": index, "text": piece, "logprobs": None, "finish_reason": s.finish_reason})
        return choices

    def _chunk_choices(self, p: int, batch: list[TokenEvent], texts: dict, offsets: dict) -> list[dict]:
        srv, n = self.server, self.body.n
        per_choice: dict[int, list[TokenEvent]] = {}
        for ev in batch:
            per_choice.setdefault(ev.sample_index, []).append(ev)
        choices = []
        for i, events in sorted(per_choice.items()):
            key = (p, i)
            piece, finish = "", None
            for ev in events:
                if ev.finish_reason is not None:
                    piece += texts[key].finish(ev.sample.text)
                    finish = ev.finish_reason
                    self._finished.add(key)
                else:
                    piece += texts[key].push(ev.token_id)
            ids = [ev.token_id for ev in events]
            lps = [ev.logprob for ev in events]
            tops = [ev.top_logprobs or [] for ev in events]
            if self.chat:
                lp = {"content": srv.chat_logprobs(ids, lps, tops, self.k)} if self.want_logprobs else None
                delta = {"content": piece} if piece else {}
                choices.append({"index": p * n + i, "delta": delta, "logprobs": lp, "finish_reason": finish})
            else:
                lp = None
                if self.want_logprobs:
                    lp = srv.completion_logprobs(ids, lps, tops, self.k, offsets[key])
                choices.append({"index": p * n + i, "text": piece, "logprobs": lp, "finish_reason": finish})
        return choices


def _error_of(exc: BaseException, chat: bool) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidArgumentError):
        return _argument_error(exc, "messages" if chat else "prompt")
    return APIError(500, f"the engine failed: {type(exc).__name__}: {exc}", type="server_error")
