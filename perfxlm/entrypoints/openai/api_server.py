"""The OpenAI-compatible HTTP server (FastAPI). Only this package knows HTTP and JSON."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response

import perfxlm
from perfxlm.engine.async_engine import AsyncLLM
from perfxlm.engine.threaded_engine import EngineDeadError
from perfxlm.entrypoints.openai.app_common import install_error_handlers, install_middleware, parse_allowed_origins
from perfxlm.entrypoints.openai.chat_render import ChatRenderer
from perfxlm.entrypoints.openai.errors import APIError
from perfxlm.entrypoints.openai.metrics import ServerMetrics
from perfxlm.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ResponsesRequest, TokenizeRequest,
)
from perfxlm.entrypoints.openai.responses_store import ResponseStore
from perfxlm.entrypoints.openai.serving_base import (
    ServerContext, check_extra_fields, check_model, engine_dead_error,
)
from perfxlm.entrypoints.openai.serving_chat import _message_dicts, create_chat_completion
from perfxlm.entrypoints.openai.serving_completions import create_completion
from perfxlm.entrypoints.openai.serving_lora import (
    ServedAdapters, add_lora_routes, parse_lora_modules, runtime_updating_allowed,
)
from perfxlm.entrypoints.openai.serving_responses import create_response, delete_response, get_response
from perfxlm.entrypoints.openai.serving_runner import POOLING_PATHS, add_runner_refusals

logger = logging.getLogger("perfxlm.server")
_WEB_PAGE = os.path.join(os.path.dirname(__file__), "web", "index.html")


def build_app(engine: AsyncLLM, served_model_name: str, *, api_key: str | None = None,
              allowed_origins: list[str] | None = None, max_queued_requests: int = 256,
              max_request_body_bytes: int = 4 << 20, trust_request_chat_template: bool = False,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, default_sampling: dict | None = None,
              lora_modules: list[tuple[str, str, str | None]] | None = None,
              max_stored_responses: int = 1000) -> FastAPI:
    """`lora_modules`: (name, path, base model name) of the LoRA adapters served by name (enable_lora)."""
    app = FastAPI(title="perfxlm OpenAI-compatible server", version=perfxlm.__version__)
    metrics = ServerMetrics(engine.engine)
    renderer = ChatRenderer(engine.tokenizer, trust_request_chat_template,
                            max_rendered_chars=max(max_request_body_bytes, 1 << 20))
    ctx = ServerContext(engine, served_model_name, int(engine.engine.resolved.max_model_len), metrics, renderer)
    if enable_auto_tool_choice and not tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or mistral).")
    if tool_call_parser:
        from perfxlm.entrypoints.openai.tool_parsers import get_tool_parser

        ctx.tool_parser = get_tool_parser(tool_call_parser)
    ctx.enable_auto_tool_choice = enable_auto_tool_choice
    if reasoning_parser:
        from perfxlm.entrypoints.openai.reasoning_parsers import get_reasoning_parser

        ctx.reasoning_parser = get_reasoning_parser(reasoning_parser)
        ctx.reasoning_token_ids = _single_tokens(engine.tokenizer, ("<think>", "</think>"))
    ctx.default_sampling = {k: v for k, v in (default_sampling or {}).items() if k != "max_tokens"}
    ctx.adapters = ServedAdapters(engine, served_model_name)
    if lora_modules and not ctx.adapters.enabled:
        raise ValueError("--lora-modules needs --enable-lora.")
    for name, path, base in lora_modules or ():
        ctx.adapters.add(name, path, base)  # a bad adapter stops the start, naming it
    ctx.responses = ResponseStore(max_stored_responses)
    app.state.ctx = ctx

    install_error_handlers(app)
    add_runner_refusals(app, "generate", POOLING_PATHS)

    def admit() -> None:
        if engine.errored:  # a dead engine answers 503 until a supervisor restarts the process
            raise engine_dead_error(engine.dead_error)
        # Overload: refuse before any tokenizing or compute.
        if metrics.num_waiting() >= max_queued_requests:
            raise APIError(503, f"Server overloaded: {max_queued_requests} requests already waiting. Retry later.",
                           code="overloaded")

    async def served(handler, req, raw: Request):
        admit()
        metrics.inflight += 1
        try:
            response = await handler(ctx, req, raw)
        except BaseException:
            metrics.inflight -= 1
            raise
        if hasattr(response, "body_iterator"):  # streaming: count down when the stream ends
            inner = response.body_iterator

            async def counted():
                try:
                    async for chunk in inner:
                        yield chunk
                finally:
                    metrics.inflight -= 1
                    await inner.aclose()

            response.body_iterator = counted()
        else:
            metrics.inflight -= 1
        return response

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await served(create_completion, req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await served(create_chat_completion, req, raw)

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, raw: Request):
        return await served(create_response, req, raw)

    @app.get("/v1/responses/{response_id}")
    async def responses_get(response_id: str):
        return get_response(ctx, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def responses_delete(response_id: str):
        return delete_response(ctx, response_id)

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": created,
                                            "owned_by": "perfxlm", "root": engine.engine.config.model,
                                            "max_model_len": ctx.max_model_len},
                                           *ctx.adapters.model_cards(created, ctx.max_model_len)]}

    if ctx.adapters.enabled and runtime_updating_allowed():
        add_lora_routes(app, ctx.adapters)

    @app.get("/health")
    async def health():
        try:
            await engine.check_health()  # every engine thread alive, the engine not failed
        except EngineDeadError:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": perfxlm.__version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_extra_fields(req)
        check_model(ctx, req.model)
        tok = engine.tokenizer
        if tok is None:
            raise APIError(400, "This server has no tokenizer.")
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "Give exactly one of prompt or messages.", "prompt")
        if req.messages is not None:
            fake = ChatCompletionRequest(messages=req.messages)
            ids = (await renderer.render(_message_dicts(fake), req.add_generation_prompt))["prompt_token_ids"]
        else:
            ids = await renderer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        body = await renderer.dumps({"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len})
        return Response(body, media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_extra_fields(req)
        check_model(ctx, req.model)
        tok = engine.tokenizer
        if tok is None:
            raise APIError(400, "This server has no tokenizer.")
        vocab = int(engine.engine.config.hf_config.vocab_size)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens holds {bad[0]}, outside the vocabulary [0, {vocab}).", "tokens")
        return {"prompt": await renderer.decode(req.tokens)}

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        with open(_WEB_PAGE, encoding="utf-8") as f:
            return HTMLResponse(f.read().replace("{{MODEL}}", served_model_name))

    install_middleware(app, api_key, allowed_origins, max_request_body_bytes)
    return app


def _import_grammar_engine() -> None:
    try:
        import xgrammar  # noqa: F401
    except Exception:  # noqa: BLE001 - a missing engine surfaces as the request's error
        pass


def _single_tokens(tokenizer: Any, texts: tuple[str, ...]) -> tuple[int, ...] | None:
    """The token ids of texts that are each one token of the vocabulary, else None."""
    if tokenizer is None:
        return None
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    return tuple(i[0] for i in ids) if all(len(i) == 1 for i in ids) else None


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's contents, or the template itself when it is not a path (as vLLM)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template.")
    return value


def served_name(model: str | None, served_model_name: str | None) -> str:
    if served_model_name:
        return served_model_name
    from perfxlm.config import DEFAULT_MODEL_FILE

    if model is None or os.path.basename(model) == DEFAULT_MODEL_FILE:
        return "SmolLM2-135M-Instruct"
    from perfxlm.hub import looks_like_repo_id

    if not os.path.exists(os.path.expanduser(model)) and looks_like_repo_id(model):
        return model  # a model id is served under its id, as vLLM does
    base = os.path.basename(os.path.normpath(model))
    return base[:-5] if base.endswith(".gguf") else base


def _warm_up_and_deprioritise_engine_threads(engine: AsyncLLM) -> None:
    """The HTTP event loop must answer (/health within 100 ms) even while the engine keeps every core
    busy: one short request makes torch start its worker threads, then every thread but this one
    (the event loop's) gets a lower scheduling priority. Linux only; elsewhere a no-op."""
    import threading

    from perfxlm.sampling_params import SamplingParams

    done = threading.Event()
    engine.engine.add_request("warmup", {"prompt_token_ids": [1, 2, 3, 4]}, SamplingParams(max_tokens=2),
                              lambda out: done.set() if isinstance(out, BaseException) or out.finished else None)
    done.wait(120)
    me = threading.get_native_id()
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in tids:
        if tid != me:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, 10)
            except OSError:
                pass


def run_server(args: Any, engine_kwargs: dict) -> int:
    import asyncio
    import contextlib
    import signal
    import threading

    import uvicorn

    from perfxlm.config import EngineConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from perfxlm.pooling.runner_kind import select_runner

    config = EngineConfig(**engine_kwargs)
    if select_runner(config) == "pooling":  # embeddings, scores, classes: their own endpoints and engine
        from perfxlm.entrypoints.openai.serving_pooling import run_pooling_server

        return run_pooling_server(args, config, served_name(engine_kwargs.get("model"), args.served_model_name))
    template = load_chat_template(getattr(args, "chat_template", None))  # a bad path fails before the model loads
    max_stored_responses = getattr(args, "max_stored_responses", 1000)
    if not isinstance(max_stored_responses, int) or max_stored_responses < 0:
        raise SystemExit(f"perfxlm: --max-stored-responses must be an integer >= 0, got {max_stored_responses!r}.")
    try:
        lora_modules = parse_lora_modules(getattr(args, "lora_modules", None))
    except ValueError as exc:
        raise SystemExit(f"perfxlm: {exc}") from None
    engine = AsyncLLM(config)
    if template is not None and engine.tokenizer is not None:
        engine.tokenizer.chat_template = template
    name = served_name(engine_kwargs.get("model"), args.served_model_name)
    from perfxlm.generation_defaults import load_generation_defaults

    api_key = args.api_key or os.environ.get("PERFXLM_API_KEY") or os.environ.get("VLLM_API_KEY")
    app = build_app(engine, name, api_key=api_key,
                    allowed_origins=parse_allowed_origins(args.allowed_origins),
                    max_queued_requests=args.max_queued_requests,
                    max_request_body_bytes=args.max_request_body_bytes,
                    trust_request_chat_template=getattr(args, "trust_request_chat_template", False),
                    enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
                    tool_call_parser=getattr(args, "tool_call_parser", None),
                    reasoning_parser=getattr(args, "reasoning_parser", None),
                    default_sampling=load_generation_defaults(engine.engine.config.model,
                                                              getattr(args, "generation_config", "auto")),
                    lora_modules=lora_modules,
                    max_stored_responses=max_stored_responses)
    # the grammar engine's import (~2 s) happens now, off the request path, rather than in the first
    # structured-output request
    threading.Thread(target=_import_grammar_engine, name="perfxlm-import-xgrammar", daemon=True).start()
    _warm_up_and_deprioritise_engine_threads(engine)
    cfg = engine.engine.config
    logger.info("model %s (served as %r), dtype %s, %d KV blocks of %d tokens, max_model_len %d",
                cfg.model, name, cfg.torch_dtype, engine.engine.num_kv_blocks, cfg.block_size, engine.engine.resolved.max_model_len)
    logger.info("serving on http://%s:%d (chat page at /)", args.host, args.port)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # End in-flight streams first (finish_reason "abort"), so the graceful shutdown has
            # nothing to wait for.
            engine.engine.abort_all()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises the signal after shutting down (exit status -15); a clean shutdown on
            # SIGTERM/SIGINT should exit 0, so handle them without re-raising.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    server = Server(uvicorn.Config(app, host=args.host, port=args.port,
                                   log_level=getattr(args, "uvicorn_log_level", None) or "warning",
                                   timeout_graceful_shutdown=5))
    try:
        asyncio.run(server.serve())
    finally:
        engine.shutdown()
    return 0
