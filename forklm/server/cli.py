"""`forklm serve`: load a model and serve the OpenAI-compatible API with uvicorn."""

from __future__ import annotations

import argparse
import os

from forklm.speculative.config import SPECULATIVE_HELP, SpeculativeConfig

_MISSING = "forklm serve needs the server extras: pip install 'forklm[serve]' (fastapi, uvicorn, prometheus-client)"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics.")
    p.add_argument("--model", default="smollm2-135m", help="model name, HF folder or .gguf file (default: smollm2-135m)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 (CUDA) (default: auto)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda (default: auto)")
    p.add_argument("--quantize", default="auto",
                   help="weights kept quantized at run time (CPU): auto, none, int8, int4, gguf (a GGUF file's blocks as stored) (default: auto: gguf for a quantized .gguf on CPU, else none)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--api-key", default=os.environ.get("FORKLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $FORKLM_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None, help="the `model` clients send (default: --model as given)")
    p.add_argument("--max-requests", type=int, default=1024,
                   help="engine requests in flight (one per prompt) before 503; a request with more prompts is a 400 "
                        "(default: 1024)")
    p.add_argument("--max-samples", type=int, default=1024,
                   help="samples one request may ask for (n or best_of, times its prompts) before 400 (default: 1024)")
    p.add_argument("--max-body-mib", type=float, default=4.0, help="request body limit, 413 beyond (default: 4)")
    p.add_argument("--memory-gib", type=float, default=None, help="KV pool size (default: 25%% of free memory)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides --memory-gib)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per forward pass (default: 512)")
    p.add_argument("--no-prefix-cache", action="store_true", help="turn the radix prefix cache off")
    p.add_argument("--schedule", default="cache-aware", choices=["cache-aware", "fcfs"])
    p.add_argument("--shared-attention", default="auto", choices=["auto", "bifurcated", "standard"])
    p.add_argument("--speculative", default=None, metavar="SPEC",
                   help=SPECULATIVE_HELP + "; a request opts out with \"speculative\": false")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def engine_options(args: argparse.Namespace) -> dict:
    opts = dict(block_size=args.block_size, max_batch_tokens=args.max_batch_tokens,
                prefix_cache=not args.no_prefix_cache, schedule=args.schedule,
                shared_attention=args.shared_attention)
    if args.num_blocks is not None:
        opts["num_blocks"] = args.num_blocks
    elif args.memory_gib is not None:
        opts["memory_budget"] = int(args.memory_gib * 2**30)
    return opts


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from forklm.server.app import ServerConfig, create_app
    except ImportError:
        raise SystemExit(_MISSING) from None
    from forklm import LLM
    from forklm.engine.engine import EngineConfig

    if args.max_requests < 1:
        raise ValueError("--max-requests must be >= 1")
    if args.max_samples < 1:
        raise ValueError("--max-samples must be >= 1")
    EngineConfig(**engine_options(args))  # bad options fail before the model loads
    spec = SpeculativeConfig.from_text(args.speculative)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, quantize=args.quantize, speculative=spec)
    if llm.tokenizer is None:
        raise ValueError(f"{args.model}: forklm serve needs a model with a tokenizer (random-weight shapes are for "
                         "the benchmarks, python -m bench sweep)")
    config = ServerConfig(
        model_name=args.served_model_name or args.model,
        api_key=args.api_key or None,
        max_body_bytes=int(args.max_body_mib * 2**20),
        max_requests=args.max_requests,
        max_samples=args.max_samples,
        engine_options=engine_options(args),
    )
    print(f"forklm: serving {config.model_name} ({llm.dtype} on {llm.device}) at http://{args.host}:{args.port}/v1",
          flush=True)
    uvicorn.run(create_app(llm, config), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0
