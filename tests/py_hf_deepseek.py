#!/usr/bin/env python3
"""DeepSeek-V3 on fp4moe's experts at transformers' own initialisation
(router weights N(0, 0.02), e_score_correction_bias 0: the routing of the
random-weight decode benchmark), on fp4moe's CPU engine.

1. Block: for each MoE layer of a random DeepseekV3 model (256 experts in
   8 groups, top-4 groups, top-8 experts, routed_scaling_factor 2.5,
   norm_topk_prob, a shared expert, a dense first layer), the swapped
   FP4MoEBlock against transformers' DeepseekV3MoE holding the dequantized
   weights (write_back), on the hidden states the model feeds that layer:
   the same top-k experts per token (a token may differ only where
   transformers' 8th and 9th choice scores lie within 1e-5), the same
   top-k weights, outputs within 1e-5 of the largest.
2. Model: the prefill logits of the model on its original float32 experts
   against the same model on the NVFP4-dequantized experts (= fp4moe's
   arithmetic, by 1.), as the decode benchmark measures them (cosine), once
   as they come and once with the quantized model's routers forced to the
   original's expert choice (each token's top-k ids; weights from its own
   scores). The same for Qwen3-MoE (128 experts, softmax top-8). Checks:
   fp4moe's whole model equals transformers' on the NVFP4 weights (cosine
   > 0.99999); with the routing forced the logits lose no more than one
   block's output does to NVFP4 on the same input (cosine of the original
   and the quantized block); DeepSeek-V3 changes more top-k choices than
   Qwen3-MoE and has the lower unforced cosine. The figures are printed.
Needs torch and transformers and a libfp4moe that builds layers from
tensors on the CPU (else skipped).
"""
import copy
import os
import sys

from fmtest import Checks, skip

try:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DeepseekV3Config, Qwen3MoeConfig
except ImportError as e:
    skip(f"torch / transformers not installed ({e})")

src = os.environ.get("FM_SOURCE_DIR") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(src, "python"))
if os.environ.get("FM_LIBRARY"):
    os.environ["FP4MOE_LIBRARY"] = os.environ["FM_LIBRARY"]
elif not os.environ.get("FP4MOE_LIBRARY"):
    skip("FM_LIBRARY not set (run through ctest, or set FP4MOE_LIBRARY to a built libfp4moe.so)")
import fp4moe  # noqa: E402
import fp4moe.hf as fh  # noqa: E402

H, I, LAYERS, VOCAB = 512, 128, 4, 256
# the real models' router logit spread: transformers initialises the router N(0, 0.02) at the real
# hidden size (7168 / 2048), whose logits are wider by sqrt(H_real / H) than at this width
REAL_H = {"deepseek_v3": 7168, "qwen3_moe": 2048}


def configs():
    common = dict(vocab_size=VOCAB, hidden_size=H, max_position_embeddings=256, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None, moe_intermediate_size=I,
                  num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=4, num_hidden_layers=LAYERS)
    yield "deepseek_v3", DeepseekV3Config(first_k_dense_replace=1, intermediate_size=4 * I, num_key_value_heads=4,
                                          n_routed_experts=256, n_group=8, topk_group=4, n_shared_experts=1,
                                          routed_scaling_factor=2.5, q_lora_rank=64, kv_lora_rank=32,
                                          qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, **common)
    yield "qwen3_moe", Qwen3MoeConfig(intermediate_size=4 * I, num_key_value_heads=2, head_dim=32, num_experts=128,
                                      **common)


def make(cfg, fam):
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager",
                                         experts_implementation="eager").eval()
    with torch.no_grad():
        for _, _, blk in fh._moe_blocks(m):
            blk.gate.weight.mul_((REAL_H[fam] / H) ** 0.5)
    return m


def router_choice(blk, x):
    """transformers' top-k ids (sorted per token), weights in that order, and
    each token's gap between its k-th and (k+1)-th choice score."""
    g = blk.gate
    if hasattr(g, "e_score_correction_bias"):
        _, w, ids = g(x)
        logits = torch.nn.functional.linear(x.float(), g.weight.float())
        s = logits.sigmoid() + g.e_score_correction_bias
        gs = s.view(-1, g.num_group, g.num_experts // g.num_group).topk(2, dim=-1)[0].sum(-1)
        gi = gs.topk(g.topk_group, dim=-1)[1]
        mask = torch.zeros_like(gs).scatter_(1, gi, 1).repeat_interleave(g.num_experts // g.num_group, 1)
        top = s.masked_fill(mask == 0, float("-inf")).topk(g.top_k + 1, dim=-1).values
    else:
        _, w, ids = g(x)
        top = torch.softmax(torch.nn.functional.linear(x.float(), g.weight.float()), -1).topk(g.top_k + 1).values
    order = ids.argsort(-1)
    return ids.gather(1, order), w.gather(1, order), top[:, -2] - top[:, -1]


def block_inputs(model, prompt):
    """The hidden states each MoE block receives in a prefill of prompt."""
    got = {}
    hooks = [blk.register_forward_pre_hook(lambda mod, args, name=name: got.__setitem__(name, args[0].detach()))
             for name, _, blk in fh._moe_blocks(model)]
    with torch.no_grad():
        model(input_ids=prompt)
    for h in hooks:
        h.remove()
    return got


def forced_routing(ref_model, model, prompt):
    """model's logits with each MoE router choosing ref_model's experts
    (ids from ref_model's routers on ref_model's hidden states; weights from
    model's own scores at those ids)."""
    ids_of = {}
    hooks = [blk.gate.register_forward_hook(lambda mod, args, out, name=name: ids_of.__setitem__(name, out[2]))
             for name, _, blk in fh._moe_blocks(ref_model)]
    with torch.no_grad():
        ref_model(input_ids=prompt)
    for h in hooks:
        h.remove()

    def forced(name, g):
        def fwd(hidden_states):
            x = hidden_states.view(-1, g.weight.shape[1])
            logits = torch.nn.functional.linear(x.float(), g.weight.float())
            ids = ids_of[name]
            if hasattr(g, "e_score_correction_bias"):
                w = logits.sigmoid().gather(1, ids)
                w = w / (w.sum(-1, keepdim=True) + 1e-20) * g.routed_scaling_factor
                return logits, w, ids
            p = torch.softmax(logits, -1).gather(1, ids)
            return logits, (p / p.sum(-1, keepdim=True)).to(x.dtype), ids
        return fwd

    saved = []
    for name, _, blk in fh._moe_blocks(model):
        saved.append((blk.gate, blk.gate.forward))
        blk.gate.forward = forced(name, blk.gate)
    with torch.no_grad():
        out = model(input_ids=prompt).logits.float()
    for g, f in saved:
        g.forward = f
    return out


def cosine(a, b):
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def changed_choices(ref_model, model, prompt):
    """Fraction of (layer, token, slot) top-k choices of model that differ
    from ref_model's, each on its own hidden states."""
    ch = {}
    for tag, m in (("ref", ref_model), ("q", model)):
        hooks = [blk.gate.register_forward_hook(lambda mod, args, out, name=name, tag=tag:
                                                ch.__setitem__((tag, name), out[2].sort(-1).values))
                 for name, _, blk in fh._moe_blocks(m)]
        with torch.no_grad():
            m(input_ids=prompt)
        for h in hooks:
            h.remove()
    diff = total = 0
    for (tag, name), ids in ch.items():
        if tag != "ref":
            continue
        q = ch[("q", name)]
        for t in range(ids.shape[0]):
            diff += ids.shape[1] - len(set(ids[t].tolist()) & set(q[t].tolist()))
            total += ids.shape[1]
    return diff / total


def main():
    if not hasattr(fp4moe._lib.lib(), "fm_moe_layer_from_tensors"):
        skip("this library cannot build layers from tensors")
    check = Checks()
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (2, 12), generator=g)
    lines, figures = [], {}
    for fam, cfg in configs():
        A = make(cfg, fam)  # original float32 experts
        Q = copy.deepcopy(A)  # the NVFP4-dequantized experts, written back by the swap
        S = copy.deepcopy(A)
        fh.swap_moe_blocks(S, device="cpu", reference=Q, max_tokens=64)
        if fam == "deepseek_v3":
            # 1. block against block, on the hidden states the quantized model feeds each layer
            inputs = block_inputs(Q, prompt)
            worst, n_near = 0.0, 0
            for name, layer, qblk in fh._moe_blocks(Q):
                x = inputs[name].reshape(-1, H)
                sblk = S.get_submodule(name)
                with torch.no_grad():
                    want = qblk(x[None])[0]
                    tid, tw, gap = router_choice(qblk, x)
                    out, ids, w = sblk.moe(x.contiguous(), return_routing=True)
                same_ids = (ids.long() == tid).all(-1)
                near = gap < 1e-5
                n_near += int((~same_ids).sum())
                check(bool((same_ids | near).all()),
                      f"{name}: fp4moe chose other experts than transformers for tokens "
                      f"{(~same_ids & ~near).nonzero().flatten().tolist()} (no near tie)")
                keep = same_ids
                werr = float((w[keep] - tw[keep]).abs().max()) if bool(keep.any()) else 0.0
                check(werr < 1e-5, f"{name}: top-k weights differ by {werr:.3g}")
                rel = float((out[keep] - want[keep]).abs().max() / want[keep].abs().max())
                worst = max(worst, rel)
                check(rel < 1e-5, f"{name}: fp4moe's block differs from transformers' by {rel:.3g} of the largest")
            lines.append(f"  deepseek_v3 blocks ({len(inputs)} MoE layers, {prompt.numel()} tokens): fp4moe = "
                         f"transformers on the dequantized weights within {worst:.2e} of the largest; "
                         f"{n_near} tokens routed apart at near ties")
        # one block's NVFP4 noise: original and quantized experts on the same input (so the same routing)
        ins = block_inputs(A, prompt)
        with torch.no_grad():
            c_blk = min(cosine(A.get_submodule(n)(ins[n]), Q.get_submodule(n)(ins[n])) for n in ins)
        # 2. the benchmark's measure: original experts against the quantized ones
        with torch.no_grad():
            la = A(input_ids=prompt).logits.float()
            lq = Q(input_ids=prompt).logits.float()
            ls = S(input_ids=prompt).logits.float()
        lf = forced_routing(A, Q, prompt)
        c_free, c_forced, c_swap = cosine(lq, la), cosine(lf, la), cosine(ls, lq)
        flips = changed_choices(A, Q, prompt)
        figures[fam] = (c_free, c_forced, flips, c_blk)
        check(c_swap > 0.99999, f"{fam}: fp4moe's model and transformers' on the same weights: cosine {c_swap:.6f}")
        check(c_forced >= c_blk, f"{fam}: with the routing forced equal the logits' cosine {c_forced:.5f} is below "
                                 f"one block's NVFP4 noise ({c_blk:.5f})")
        lines.append(f"  {fam:11s} one block, NVFP4 vs original experts on the same input: cosine >= {c_blk:.5f}; "
                     f"prefill logits: cosine {c_free:.5f}, routing forced to the original's {c_forced:.5f}; "
                     f"top-k choices changed {100 * flips:.1f} %; fp4moe vs transformers on the NVFP4 weights "
                     f"{c_swap:.7f}")
        del A, Q, S
    ds, qw = figures["deepseek_v3"], figures["qwen3_moe"]
    check(ds[2] > qw[2] and ds[0] < qw[0],
          f"DeepSeek-V3's routing flips ({100 * ds[2]:.1f} %) do not explain its cosine {ds[0]:.4f} "
          f"(Qwen3-MoE: {100 * qw[2]:.1f} %, {qw[0]:.4f})")
    print("\n".join(lines))
    check.finish(f"DeepSeek-V3 on fp4moe at transformers' init: the blocks compute transformers' block; "
                 f"the low unforced cosine comes from routing flips (torch {torch.__version__}, "
                 f"transformers {transformers.__version__})")


if __name__ == "__main__":
    main()
