#!/usr/bin/env python3
"""Whole transformers models decoding on fp4moe's experts (fp4moe.hf).

For each family -- Qwen3-MoE, DeepSeek-V3 (MLA, a dense first layer, group
routing, a shared expert) and gpt-oss (MXFP4, biases, clamped SwiGLU) -- a
tiny random float32 model A runs transformers' own code (eager experts,
eager attention); B is a deep copy whose MoE blocks swap_moe_blocks replaced
by fp4moe's, writing the dequantized weights back into A's experts, so both
compute with the same weights and the difference is fp4moe's arithmetic.

Checks, from a fixed prompt of 2 sequences (a prefill of 16 tokens, then
decode steps of 2 tokens):
  - logits: B fed A's greedy tokens gives, at each of the 16 steps,
    max |logit_B - logit_A| / max |logit_A| < TOL. On CUDA TOL = 2e-2:
    fp4moe's GPU engine rounds the experts' input and the gated activation
    to BF16 (relative 2^-9 each) and accumulates in FP32, so one MoE block's
    output is off by about 3 * 2^-9 = 0.6 % of its size at most; the MoE
    output is a part of the residual stream, so the logits move by less than
    that share, and 2e-2 leaves a factor of 3 for what attention and the
    norms of later layers and steps make of it. On the CPU engine, which
    computes in FP32 from FP32 activations, only the order of the sums
    differs (~1e-6 of the largest logit): TOL = 1e-4. The measured value is
    printed.
  - the MoE matters: with A's MoE blocks outputting zeros the same measure
    is at least 10 x the measured fp4moe difference and above TOL (else the
    check above could not fail).
  - greedy tokens: B's own 16 greedy tokens equal A's; a first difference is
    accepted only where A's two best logits lie closer than twice the
    measured logit difference at that step (a tie that rounding may break).
  - on CUDA: the NVFP4 / MXFP4 bytes quantized on the GPU equal those
    quantized on the CPU for the same weights (every expert matrix of the
    first MoE block), and NVFP4's those of the NumPy quantizer of
    tests/np_nvfp4.py.
Runs on the CUDA engine where a GPU is there, else on the CPU engine when
the library builds layers from tensors; otherwise skipped (exit 77). Needs
torch and transformers (else skipped).
"""
import copy
import os
import sys

from fmtest import Checks, skip
import np_nvfp4

try:
    import numpy as np
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DeepseekV3Config, DynamicCache, GptOssConfig, Qwen3MoeConfig
except ImportError as e:
    skip(f"torch / transformers not installed ({e})")

src = os.environ.get("FM_SOURCE_DIR") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(src, "python"))
if os.environ.get("FM_LIBRARY"):  # the build's libfp4moe.so, from ctest
    os.environ["FP4MOE_LIBRARY"] = os.environ["FM_LIBRARY"]
elif not os.environ.get("FP4MOE_LIBRARY"):
    skip("FM_LIBRARY not set (run through ctest, or set FP4MOE_LIBRARY to a built libfp4moe.so)")
import fp4moe  # noqa: E402
import fp4moe.hf as fh  # noqa: E402

TOLERANCE = {"cuda": 2e-2, "cpu": 1e-4}
STEPS = 16
VOCAB = 128


def pick_device():
    try:
        ok, why = fp4moe.cuda_available()
    except fp4moe.Error as e:
        skip(f"libfp4moe.so cannot be loaded ({e})")
    if ok and torch.cuda.is_available():
        return "cuda"
    if hasattr(fp4moe._lib.lib(), "fm_moe_layer_from_tensors") and hasattr(fp4moe._lib.lib(), "fm_cpu_experts"):
        return "cpu"
    skip(f"no CUDA GPU ({why or 'torch sees none'}), and this library's CPU engine cannot build layers from tensors")


def configs():
    # the expert shapes of the library's tiny presets (H 128, I 64), which its CUDA tests cover
    common = dict(vocab_size=VOCAB, hidden_size=128, num_attention_heads=4, max_position_embeddings=256,
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    yield "qwen3_moe", Qwen3MoeConfig(num_hidden_layers=2, num_key_value_heads=2, head_dim=32,
                                      intermediate_size=256, moe_intermediate_size=64, num_experts=16,
                                      num_experts_per_tok=4, norm_topk_prob=True, **common)
    yield "deepseek_v3", DeepseekV3Config(num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=4,
                                          intermediate_size=256, moe_intermediate_size=64, n_routed_experts=16,
                                          num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                                          routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=32,
                                          qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, **common)
    yield "gpt_oss", GptOssConfig(num_hidden_layers=2, num_key_value_heads=2, head_dim=32, intermediate_size=64,
                                  num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                                  rope_parameters={"rope_type": "default", "rope_theta": 150000.0}, **common)


def make_model(cfg, dev, seed):
    torch.manual_seed(seed)
    with torch.device(dev):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager",
                                             experts_implementation="eager")
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    with torch.no_grad():
        for _, _, blk in fh._moe_blocks(m):
            ex = blk.experts
            # experts that carry a good share of the residual stream, not all of it: a routing
            # decision of a later layer then moves little with the rounding of an earlier one
            for p in (ex.gate_up_proj, ex.down_proj):
                p.copy_(torch.randn(p.shape, generator=g) * 0.07)
            # routers with clear winners: rounding should not reorder the top k
            router = blk.gate if hasattr(blk, "gate") else blk.router
            router.weight.copy_(torch.randn(router.weight.shape, generator=g))
            if hasattr(router, "e_score_correction_bias"):
                router.e_score_correction_bias.copy_(torch.randn(router.e_score_correction_bias.shape, generator=g) * 0.1)
            if hasattr(router, "bias") and isinstance(router.bias, torch.Tensor):
                router.bias.copy_(torch.randn(router.bias.shape, generator=g) * 0.5)
            if hasattr(ex, "gate_up_proj_bias"):
                ex.gate_up_proj_bias.copy_(torch.randn(ex.gate_up_proj_bias.shape, generator=g) * 0.1)
                ex.down_proj_bias.copy_(torch.randn(ex.down_proj_bias.shape, generator=g) * 0.1)
            sh = getattr(blk, "shared_experts", None)
            if sh is not None:
                for lin in (sh.gate_proj, sh.up_proj, sh.down_proj):
                    lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.1)
        emb = m.get_input_embeddings().weight
        emb.copy_(torch.randn(emb.shape, generator=g))
        m.lm_head.weight.copy_(torch.randn(m.lm_head.weight.shape, generator=g) * 0.5)
    return m.eval()


@torch.no_grad()
def decode(model, prompt, forced=None):
    """STEPS greedy tokens (or the forced ones) and the logits of each step."""
    cache = DynamicCache(config=model.config)
    out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
    toks, logits = [], []
    for i in range(STEPS):
        lg = out.logits[:, -1].float()
        logits.append(lg)
        tok = forced[:, i] if forced is not None else lg.argmax(-1)
        toks.append(tok)
        if i + 1 < STEPS:
            out = model(input_ids=tok[:, None], past_key_values=cache, use_cache=True)
    return torch.stack(toks, 1), torch.stack(logits, 1)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def same_quant_on_gpu(check, fam, model):
    """The quantizers give the same bytes on the GPU as on the CPU, for every
    expert matrix of the first MoE block; NVFP4 also those of the NumPy
    quantizer (tests/np_nvfp4.py, from the format's definition)."""
    _, _, blk = fh._moe_blocks(model)[0]
    ex = blk.experts
    bad = []
    if fam == "gpt_oss":
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(ex, name).detach().transpose(1, 2)
            pg, sg = fh.quantize_mxfp4(w)
            pc, sc = fh.quantize_mxfp4(w.cpu())
            if not (torch.equal(pg.cpu(), pc) and torch.equal(sg.cpu(), sc)):
                bad.append(name)
    else:
        E, R, K = ex.gate_up_proj.shape
        mats = {"gate_up_proj": ex.gate_up_proj.detach().reshape(E * 2, R // 2, K),  # gate and up apart
                "down_proj": ex.down_proj.detach()}
        for name, w in mats.items():
            pg, sg, tg = (x.cpu() for x in fh.quantize_nvfp4(w))
            pc, sc, tc = fh.quantize_nvfp4(w.cpu())
            sg, sc = sg.view(torch.uint8), sc.view(torch.uint8)
            if not (torch.equal(pg, pc) and torch.equal(sg, sc) and torch.equal(tg, tc)):
                n = sum(not (torch.equal(pg[i], pc[i]) and torch.equal(sg[i], sc[i]) and tg[i] == tc[i])
                        for i in range(w.shape[0]))
                bad.append(f"{name} ({n} of {w.shape[0]} matrices differ from the CPU's)")
            wn = w.cpu().numpy()
            n = 0
            for i in range(w.shape[0]):
                rp, rs, rs2 = np_nvfp4.quantize_nvfp4(wn[i])
                n += not (np.array_equal(pg[i].numpy(), rp) and np.array_equal(sg[i].numpy(), rs)
                          and np.float32(tg[i].item()) == rs2)
            if n:
                bad.append(f"{name} ({n} of {w.shape[0]} matrices differ from the NumPy quantizer's)")
    check(not bad, f"{fam}: the GPU's quantized bytes differ: {'; '.join(bad)}")


def main():
    dev = pick_device()
    TOL = TOLERANCE[dev]
    check = Checks()
    print(f"fp4moe.hf tiny models on {dev} (torch {torch.__version__}, transformers {transformers.__version__})")
    lines = []
    for i, (fam, cfg) in enumerate(configs()):
        A = make_model(cfg, dev, 100 + i)
        B = copy.deepcopy(A)
        names = fh.swap_moe_blocks(B, device=dev, reference=A, max_tokens=64)
        n_moe = len(fh._moe_blocks(A))
        check(len(names) == n_moe and n_moe > 0, f"{fam}: swapped {len(names)} of {n_moe} MoE blocks")
        check(all(isinstance(B.get_submodule(n), fh.FP4MoEBlock) for n in names), f"{fam}: blocks not swapped")
        if dev == "cuda":
            same_quant_on_gpu(check, fam, A)
        g = torch.Generator(device="cpu").manual_seed(5)
        prompt = torch.randint(0, VOCAB, (2, 8), generator=g).to(dev)

        toks_a, lg_a = decode(A, prompt)
        _, lg_b = decode(B, prompt, forced=toks_a)
        err = [rel(lg_b[:, s], lg_a[:, s]) for s in range(STEPS)]
        worst = max(err)
        check(all(e == e for e in err) and worst < TOL,
              f"{fam}: max |dlogit| / max |logit| = {worst:.3g} (tolerance {TOL:g}); per step "
              + " ".join(f"{e:.2g}" for e in err))

        # the same measure without the MoE: the check above could fail
        hooks = [blk.register_forward_hook(lambda mod, inp, out: (torch.zeros_like(out[0]), out[1])
                                           if isinstance(out, tuple) else torch.zeros_like(out))
                 for _, _, blk in fh._moe_blocks(A)]
        _, lg_z = decode(A, prompt, forced=toks_a)
        for h in hooks:
            h.remove()
        no_moe = max(rel(lg_z[:, s], lg_a[:, s]) for s in range(STEPS))
        check(no_moe > TOL and no_moe > 10 * worst,
              f"{fam}: without the MoE the logits move by only {no_moe:.3g} (fp4moe's difference {worst:.3g})")

        toks_b, _ = decode(B, prompt)
        same = torch.equal(toks_a, toks_b)
        note = "same tokens"
        if not same:
            for r in range(toks_a.shape[0]):
                diff = (toks_a[r] != toks_b[r]).nonzero()
                if diff.numel() == 0:
                    continue
                s = int(diff[0])
                top2 = lg_a[r, s].topk(2).values
                margin = float(top2[0] - top2[1])
                dl = float((lg_b[r, s] - lg_a[r, s]).abs().max())
                note = f"sequence {r} differs from step {s} (margin {margin:.3g}, |dlogit| {dl:.3g})"
                check(margin < 2 * dl, f"{fam}: greedy tokens differ at step {s} of sequence {r} where A's "
                                       f"best two logits are {margin:.3g} apart (|dlogit| {dl:.3g})")
        lines.append(f"  {fam:12s} {n_moe} MoE layers: max |dlogit|/max|logit| {worst:.2e} (tol {TOL:g}), "
                     f"without MoE {no_moe:.2e}; {note}")
        del A, B
    print("\n".join(lines))
    check.finish(f"transformers tiny models on fp4moe ({dev}): Qwen3-MoE, DeepSeek-V3 and gpt-oss decode "
                 f"{STEPS} tokens as transformers does")


if __name__ == "__main__":
    main()
