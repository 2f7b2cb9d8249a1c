"""`python -m bench spec` on a random-weight target/draft pair whose agreement is set on purpose, to map the
speed-up of a draft model against its acceptance rate (`python -m bench spec --pair 0.5,0.7,0.9`).

Random weights agree on nothing, so both models are built to be near-*bigram* models of the same
vocabulary: each token x has a successor succ(x) (a random permutation) that the model predicts
with a sharp peak, and the transformer layers still do all their work (every product is computed
at full size) but add only a small perturbation to the residual stream:
- embeddings E[x]: random directions scaled to unit RMS, so the final RMSNorm leaves them as they are;
- LM head row y: `sharpness` * E[succ⁻¹(y)] / hidden, so logit(y | x) = sharpness where y = succ(x)
  and about sharpness * N(0, 1/hidden) elsewhere (untied from the embeddings);
- every layer's output projections (attention o_proj, MLP down_proj) scaled by `residual`.
The draft's successor map (also a permutation) equals the target's on a share `agreement` of the
tokens (elsewhere another token), so a greedy draft token is accepted with probability about `agreement`.
Shapes: a Llama-3.2-1B-like target (hidden 2048, 16 layers, 32/8 heads) and a SmolLM2-135M-shaped
draft, sharing a vocabulary of 49152 ids; both weight-only quantized (`--quantize`, default int4).
"""

from __future__ import annotations

import torch

VOCAB = 49152
TARGET_SHAPE = {  # Llama-3.2-1B's shape, with the draft's vocabulary
    "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
}
DRAFT_SHAPE = {  # SmolLM2-135M's shape, untied
    "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": False,
}


def successor_maps(vocab: int, agreement: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(target's succ, draft's succ) [vocab] int64, both permutations: the draft's equals the
    target's on a share `agreement` of the ids (chosen at random); on the others the target's
    successors are rotated among them, so each of those gets a different one."""
    gen = torch.Generator().manual_seed(seed)
    succ = torch.randperm(vocab, generator=gen)
    differ = (torch.rand(vocab, generator=gen) >= agreement).nonzero().flatten()
    differ = differ[torch.randperm(len(differ), generator=gen)]
    draft = succ.clone()
    if len(differ) > 1:
        draft[differ] = succ[differ.roll(1)]
    return succ, draft


def bigram_weights(shape: dict, succ: torch.Tensor, sharpness: float, residual: float, seed: int) -> dict:
    """Random weights of `shape` (`random_weights`) made a near-bigram model of `succ`."""
    from forklm.models.random_weights import random_config, random_weights

    config = random_config(shape)
    w = random_weights(config, torch.float32, "cpu", seed)
    H, V = config.hidden_size, config.vocab_size
    gen = torch.Generator().manual_seed(seed + 1)
    emb = torch.randn(V, H, generator=gen)
    emb *= (H ** 0.5) / emb.norm(dim=1, keepdim=True)  # unit RMS per row
    head = torch.empty_like(emb)
    head[succ] = emb * (sharpness / H)  # row succ(x) points at E[x]
    w["model.embed_tokens.weight"], w["lm_head.weight"] = emb, head
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] *= residual
    return w


def build_pair(agreement: float, quantize: str | None, sharpness: float = 16.0, residual: float = 0.05,
               seed: int = 0, target_shape: dict | None = None, draft_shape: dict | None = None):
    """(target LlamaModel, draft LlamaModel) in float32 on CPU, weights quantized by `quantize`."""
    from forklm.backend import Backend
    from forklm.models.llama import LlamaModel
    from forklm.models.random_weights import random_config

    # the module's shapes read at call time (a default bound at definition ignores a patched module)
    target_shape = TARGET_SHAPE if target_shape is None else target_shape
    draft_shape = DRAFT_SHAPE if draft_shape is None else draft_shape
    succ, draft_succ = successor_maps(target_shape["vocab_size"], agreement, seed)
    models = []
    for shape, s, k in ((target_shape, succ, 0), (draft_shape, draft_succ, 1)):
        weights = bigram_weights(shape, s, sharpness, residual, seed + 10 * k)
        models.append(LlamaModel(random_config(shape), weights, Backend.exact(torch.float32, torch.device("cpu"), quantize)))
        del weights
    return models[0], models[1]


def run_pair(args) -> dict:
    """The --pair sweep: per agreement, regular vs the draft model (auto and fixed k) at each
    n and temperature; a random prompt of m_c ids (the first context)."""
    from bench.spec_points import point_line, run_mode, run_point
    from forklm.engine.engine import Engine, EngineConfig
    from forklm.backend import resolve_quantize

    agreements = [float(x) for x in args.pair.split(",")]
    quantize = resolve_quantize(args.quantize if args.quantize != "auto" else "int4", torch.float32,
                                torch.device("cpu"))
    ns = [int(x) for x in args.ns.split(",")]
    temps = [float(x) for x in args.temperatures.split(",")]
    m_c = int(args.contexts.split(",")[0])
    prompt = torch.randint(0, VOCAB, (m_c,), generator=torch.Generator().manual_seed(args.seed)).tolist()
    target = None
    points = []
    for agreement in agreements:
        target_new, draft = build_pair(agreement, quantize, seed=args.seed)
        target = target if target is not None else target_new  # the target is the same for every agreement
        del target_new
        def engine(spec=None) -> Engine:  # no tokenizer, no EOS: the texts spell the ids
            return Engine(target, lambda toks: " ".join(map(str, toks)), (),
                          EngineConfig(memory_budget=2 * 2**30, speculative=spec), has_tokenizer=False)

        modes = {"regular": engine()}
        for k in ("auto", args.pair_k):
            modes[f"draft:{k}"] = engine({"method": "draft", "draft_model": draft, "num_draft_tokens": k})
        for engine in modes.values():  # warm-up
            run_mode(engine, prompt[:32], 2, 8, 0.0, 0)
        for temperature in temps:
            for n in ns:
                row = {"agreement": agreement, "m_c": m_c, "n": n, "temperature": temperature,
                       "modes": run_point(modes, prompt, n, args.new_tokens, temperature, args.seed, args.repeats)}
                points.append(row)
                print(f"agreement {agreement} " + point_line(row), flush=True)
        del modes, draft
    return {"pair": {"target_shape": TARGET_SHAPE, "draft_shape": DRAFT_SHAPE, "quantize": quantize,
                     "sharpness": 16.0, "residual": 0.05}, "points": points}
