#!/usr/bin/env python3
"""fp4moe.hf's torch quantizers against the library's own, and the layout of
the layer tensors it builds from transformers' MoE blocks.

1. quantize_nvfp4 / quantize_mxfp4 (torch, CPU) give bit for bit the bytes
   of fm_quantize_nvfp4 / fm_quantize_mxfp4 (tests/tools/fmt_dump, checked
   against ModelOpt and the OCP rule by py_formats_ml_dtypes) on matrices
   with outliers, zero blocks, E2M1 midpoints and block scales clamped at
   2^-9; their inverses match E2M1 * (E4M3 * scale_2) in float32 from the
   library's decode table. NVFP4 also against the NumPy quantizer of
   tests/np_nvfp4.py (from the format's definition), on those matrices and
   on a stack of 64 small ones, on the CPU and, where torch sees a GPU, on
   the GPU: the stack tells apart scale_2 = amax / 2688 from amax times the
   float32 reciprocal of 2688 (checked), the rounding CUDA torch applies to
   a division by a Python number.
2. layer_tensors on tiny random Qwen3-MoE, DeepSeek-V3 and gpt-oss blocks:
   every fm_layer_tensors field has the shape and dtype of include/fp4moe/engine.h,
   and each expert row, dequantized from those tensors with an independent
   NumPy decoder, is the row transformers' experts hold after write_back
   (gate rows then up rows, gpt-oss's interleaved columns transposed), with
   the quantization error an NVFP4 / MXFP4 grid allows.
Needs torch and transformers (else skipped).
"""
import os
import subprocess
import sys

from fmtest import Checks, env_path, fmt_dump_quant, skip
import np_nvfp4

try:
    import numpy as np
    import torch
    import transformers  # noqa: F401
except ImportError as e:
    skip(f"torch / transformers not installed ({e})")

sys.path.insert(0, os.path.join(env_path("FM_SOURCE_DIR"), "python"))
import fp4moe.hf as fh  # noqa: E402

tool = env_path("FM_TOOLS_DIR", "fmt_dump")
check = Checks()
rng = np.random.default_rng(7)
torch.manual_seed(7)


def lib_table(fmt):
    out = subprocess.run([tool, "decode"], check=True, capture_output=True, text=True).stdout
    vals = {}
    for line in out.splitlines():
        f, c, h = line.split()
        if f == fmt:
            vals[int(c)] = np.uint32(int(h, 16)).view(np.float32)
    return np.array([vals[i] for i in range(len(vals))], dtype=np.float32)


E2M1 = lib_table("e2m1")
E4M3 = lib_table("e4m3")
E8M0 = lib_table("e8m0")


def np_dequant(packed, scales, block, scale2=None):
    """[R, K/2] bytes + [R, K/block] scale codes -> float32 [R, K], from the
    library's decode tables (an implementation apart from fp4moe.hf's)."""
    p = np.asarray(packed, np.uint8)
    codes = np.stack((p & 15, p >> 4), axis=-1).reshape(p.shape[0], -1)
    v = E2M1[codes]
    s = np.asarray(scales, np.uint8)
    if scale2 is None:
        bs = E8M0[s]
    else:
        bs = (E4M3[s] * np.float32(scale2)).astype(np.float32)
    return (v.reshape(v.shape[0], -1, block) * bs[..., None]).astype(np.float32).reshape(v.shape)


# ---------------------------------------------------------------- 1. quantizers
for trial in range(7):
    rows, cols = 24, 256
    w = (rng.standard_normal((rows, cols)) * [0.02, 1.0, 300.0, 1e-3, 5.0, 0.5, 0.02][trial]).astype(np.float32)
    w[rng.random((rows, cols)) < 0.01] *= 40  # outliers
    w[3, 32:64] = 0  # an all-zero block for both formats
    w[5] *= np.float32(1e-2)  # a quiet row
    if trial == 5:  # values sitting exactly on E2M1 midpoints after scaling
        w[7, :16] = np.float32([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -2.5, -5, 0, 1, 2, 3])
    if trial == 6:  # blocks whose scale falls below 2^-9 (clamped) and into E4M3's subnormals
        w[0, 0] = np.float32(1e4)
        w[9] *= np.float32(1e-5)
        w[10] *= np.float32(3e-3)
    t = torch.from_numpy(w)
    p, s, s2 = fh.quantize_nvfp4(t)
    o = fmt_dump_quant(tool, "nvfp4", w)
    check(o["status"] == "ok", f"nvfp4 trial {trial}: library status {o['status']}")
    check(p.shape == (rows, cols // 2) and p.dtype == torch.uint8, f"nvfp4 packed {p.shape} {p.dtype}")
    check(s.shape == (rows, cols // 16) and s.dtype == torch.float8_e4m3fn, f"nvfp4 scales {s.shape} {s.dtype}")
    check(s2.dim() == 0 and s2.dtype == torch.float32, f"nvfp4 scale_2 {s2.shape} {s2.dtype}")
    check(int(o["scale2"] or "0", 16) == int(np.float32(s2.item()).view(np.uint32)),
          f"nvfp4 trial {trial}: scale_2 {np.float32(s2.item()).view(np.uint32):08x} != library {o['scale2']}")
    check(s.view(torch.uint8).numpy().tobytes() == bytes.fromhex(o["scales"]),
          f"nvfp4 trial {trial}: block scales differ from the library's")
    check(p.numpy().tobytes() == bytes.fromhex(o["packed"]), f"nvfp4 trial {trial}: codes differ from the library's")
    rp, rs, rs2 = np_nvfp4.quantize_nvfp4(w)
    check(np.array_equal(p.numpy(), rp) and np.array_equal(s.view(torch.uint8).numpy(), rs)
          and np.float32(s2.item()) == rs2, f"nvfp4 trial {trial}: torch's bytes differ from the NumPy quantizer's")
    deq = fh.dequantize_nvfp4(p, s, s2).numpy()
    want = np_dequant(p.numpy(), s.view(torch.uint8).numpy(), 16, s2.item())
    check(np.array_equal(deq.view(np.uint32), want.view(np.uint32)), f"nvfp4 trial {trial}: dequantized values differ")

    p, s = fh.quantize_mxfp4(t)
    o = fmt_dump_quant(tool, "mxfp4", w)
    check(o["status"] == "ok", f"mxfp4 trial {trial}: library status {o['status']}")
    check(s.shape == (rows, cols // 32) and s.dtype == torch.uint8, f"mxfp4 scales {s.shape} {s.dtype}")
    check(s.numpy().tobytes() == bytes.fromhex(o["scales"]), f"mxfp4 trial {trial}: scales differ from the library's")
    check(p.numpy().tobytes() == bytes.fromhex(o["packed"]), f"mxfp4 trial {trial}: codes differ from the library's")
    deq = fh.dequantize_mxfp4(p, s).numpy()
    want = np_dequant(p.numpy(), s.numpy(), 32)
    check(np.array_equal(deq.view(np.uint32), want.view(np.uint32)), f"mxfp4 trial {trial}: dequantized values differ")

# a stack quantizes each matrix with its own scale_2
w = torch.randn(3, 2, 16, 64) * torch.tensor([1.0, 10.0, 0.1]).view(3, 1, 1, 1)
p, s, s2 = fh.quantize_nvfp4(w)
check(s2.shape == (3, 2), f"stacked scale_2 shape {tuple(s2.shape)}")
for i in range(3):
    for j in range(2):
        pi, si, s2i = fh.quantize_nvfp4(w[i, j])
        check(torch.equal(pi, p[i, j]) and torch.equal(si.view(torch.uint8), s[i, j].view(torch.uint8))
              and s2i.item() == s2[i, j].item(), f"stacked matrix [{i}, {j}] differs from its own quantization")

def same_as_numpy(stack, p, s, s2, reciprocal=False):
    """Matrices of the torch quantizer's stack output equal to the NumPy quantizer's, of each."""
    n = 0
    for i in range(stack.shape[0]):
        rp, rs, rs2 = np_nvfp4.quantize_nvfp4(stack[i], reciprocal=reciprocal)
        n += bool(np.array_equal(p[i], rp) and np.array_equal(s[i], rs) and np.float32(s2[i]) == rs2)
    return n


# 64 matrices with amax spread over decades: about a quarter of them get another scale_2 from the reciprocal
stack = (rng.standard_normal((64, 16, 64)) * np.exp(rng.uniform(-6, 3, (64, 1, 1)))).astype(np.float32)
devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
for dev in devices:
    p, s, s2 = fh.quantize_nvfp4(torch.from_numpy(stack).to(dev))
    p, s, s2 = p.cpu().numpy(), s.cpu().view(torch.uint8).numpy(), s2.cpu().numpy()
    ok = same_as_numpy(stack, p, s, s2)
    check(ok == 64, f"nvfp4 on {dev}: {64 - ok} of 64 matrices differ from the NumPy quantizer")
    recip = same_as_numpy(stack, p, s, s2, reciprocal=True)
    check(recip < 64, f"nvfp4 on {dev}: the reciprocal variant of scale_2 agrees on all 64 matrices: "
                      "this stack could not catch it")
print(f"nvfp4 stack of 64 matrices equals the NumPy quantizer on {', '.join(devices)}")

for bad in (torch.zeros(4, 24), torch.zeros(4)):
    try:
        fh.quantize_nvfp4(bad)
        check(False, f"quantize_nvfp4 accepted shape {list(bad.shape)}")
    except ValueError as e:
        check("multiple of 16" in str(e), f"message for shape {list(bad.shape)}: {e}")

# ---------------------------------------------------------------- 2. layer tensors of tiny blocks
from transformers import DeepseekV3Config, GptOssConfig, Qwen3MoeConfig  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

E, H, I, K = 8, 64, 32, 2


def fill(block):
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
        for name, b in block.named_buffers():
            b.normal_(0, 0.01)
    return block


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


def check_nvfp4_stack(tag, packed, scales, scale2, deq_rows, orig_rows, split):
    """packed [E, R, K/2] etc. against the written-back rows [E, R, K]."""
    e_, r_, k2 = packed.shape
    check(scales.shape == (e_, r_, 2 * k2 // 16) and scales.dtype == torch.float8_e4m3fn,
          f"{tag}: scales {tuple(scales.shape)} {scales.dtype}")
    check(scale2.shape == ((e_, 2) if split else (e_,)) and scale2.dtype == torch.float32,
          f"{tag}: scale_2 {tuple(scale2.shape)}")
    for e in range(e_):
        for h in range(split or 1):
            rs = slice(h * r_ // 2, (h + 1) * r_ // 2) if split else slice(0, r_)
            s2 = scale2[e, h].item() if split else scale2[e].item()
            got = np_dequant(packed[e, rs].numpy(), scales[e, rs].view(torch.uint8).numpy(), 16, s2)
            check(np.array_equal(got, deq_rows[e, rs].numpy()), f"{tag}: expert {e} half {h}: rows differ")
    err = rel_err(deq_rows, orig_rows)
    check(0 < err < 0.2, f"{tag}: NVFP4 error {err:.3g} of the largest weight (expected (0, 0.2))")


# Qwen3-MoE: gate_up_proj [E, 2I, H] = [gate; up], down_proj [E, H, I]
cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                     norm_topk_prob=True)
blk = fill(Qwen3MoeSparseMoeBlock(cfg))
orig_gu, orig_dn = blk.experts.gate_up_proj.detach().clone(), blk.experts.down_proj.detach().clone()
t, layout, inter = fh.layer_tensors(blk, write_back=blk)
check(layout == "modelopt_nvfp4" and inter == I, f"qwen3: layout {layout}, inter {inter}")
check(set(t) == {"w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight", "w2_weight_scale",
                 "w2_weight_scale_2", "router_w"}, f"qwen3: fields {sorted(t)}")
check(t["w13_weight"].shape == (E, 2 * I, H // 2) and t["w2_weight"].shape == (E, H, I // 2),
      f"qwen3: w13 {tuple(t['w13_weight'].shape)} w2 {tuple(t['w2_weight'].shape)}")
check_nvfp4_stack("qwen3 w13", t["w13_weight"], t["w13_weight_scale"], t["w13_weight_scale_2"],
                  blk.experts.gate_up_proj.detach(), orig_gu, 2)
check_nvfp4_stack("qwen3 w2", t["w2_weight"], t["w2_weight_scale"], t["w2_weight_scale_2"],
                  blk.experts.down_proj.detach(), orig_dn, 0)
check(torch.equal(t["router_w"], blk.gate.weight.detach()), "qwen3: router_w is not the router's weight")
check(fh._fm_config(type("M", (), {"config": cfg})(), "qwen3_moe", blk)["num_experts"] == E,
      "qwen3: the config fp4moe reads lacks num_experts")

# DeepSeek-V3: the same routed layout, the router's correction bias, the shared expert
cfg = DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K,
                       n_shared_experts=1, n_group=2, topk_group=1)
blk = fill(DeepseekV3MoE(cfg))
ref = fill(DeepseekV3MoE(cfg))
orig_sh = blk.shared_experts.gate_proj.weight.detach().clone()
t, layout, inter = fh.layer_tensors(blk, write_back=ref)
check(torch.equal(t["score_bias"], blk.gate.e_score_correction_bias.detach().float()), "dsv3: score_bias")
for name, lin, R_, K_ in (("shared_gate", "gate_proj", I, H), ("shared_up", "up_proj", I, H),
                          ("shared_down", "down_proj", H, I)):
    p, s, s2 = t[name], t[name + "_scale"], t[name + "_scale_2"]
    check(p.shape == (R_, K_ // 2) and s.shape == (R_, K_ // 16) and s2.dim() == 0,
          f"dsv3 {name}: {tuple(p.shape)} {tuple(s.shape)} {tuple(s2.shape)}")
    got = np_dequant(p.numpy(), s.view(torch.uint8).numpy(), 16, s2.item())
    check(np.array_equal(got, getattr(ref.shared_experts, lin).weight.detach().numpy()),
          f"dsv3 {name}: the reference's shared expert does not hold the dequantized weights")
check(rel_err(ref.shared_experts.gate_proj.weight.detach(), orig_sh) < 0.2, "dsv3: shared expert error")
check_nvfp4_stack("dsv3 w13", t["w13_weight"], t["w13_weight_scale"], t["w13_weight_scale_2"],
                  ref.experts.gate_up_proj.detach(), blk.experts.gate_up_proj.detach(), 2)

# gpt-oss: gate_up_proj [E, H, 2I] used as x @ W with interleaved gate / up columns -> rows [E, 2I, H]
cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K,
                   head_dim=16, num_attention_heads=4, num_key_value_heads=2)
blk = fill(GptOssMLP(cfg))
orig_gu = blk.experts.gate_up_proj.detach().clone()
t, layout, inter = fh.layer_tensors(blk, write_back=blk)
check(layout == "gptoss_mxfp4" and inter == I, f"gpt-oss: layout {layout}, inter {inter}")
check(t["gate_up_blocks"].shape == (E, 2 * I, H // 32, 16) and t["gate_up_scales"].shape == (E, 2 * I, H // 32)
      and t["down_blocks"].shape == (E, H, I // 32, 16) and t["down_scales"].shape == (E, H, I // 32),
      f"gpt-oss: blocks {tuple(t['gate_up_blocks'].shape)} {tuple(t['down_blocks'].shape)}")
check(t["gate_up_bias"].shape == (E, 2 * I) and t["down_bias"].shape == (E, H) and t["router_bias"].shape == (E,),
      "gpt-oss: bias shapes")
for e in range(E):
    got = np_dequant(t["gate_up_blocks"][e].reshape(2 * I, H // 2).numpy(), t["gate_up_scales"][e].numpy(), 32)
    check(np.array_equal(got, blk.experts.gate_up_proj.detach()[e].T.numpy()),
          f"gpt-oss: expert {e}: gate_up rows are not the written-back columns")
    got = np_dequant(t["down_blocks"][e].reshape(H, I // 2).numpy(), t["down_scales"][e].numpy(), 32)
    check(np.array_equal(got, blk.experts.down_proj.detach()[e].T.numpy()),
          f"gpt-oss: expert {e}: down rows are not the written-back columns")
err = rel_err(blk.experts.gate_up_proj.detach(), orig_gu)
check(0 < err < 0.3, f"gpt-oss: MXFP4 error {err:.3g} of the largest weight")

try:
    fh.layer_tensors(torch.nn.Linear(4, 4))
    check(False, "layer_tensors accepted a Linear")
except ValueError as e:
    check("not a supported MoE block" in str(e), f"message: {e}")

check.finish(f"hf quantizers match the library on 7 matrices (NVFP4, MXFP4); layer tensors of Qwen3-MoE, "
             f"DeepSeek-V3 and gpt-oss blocks hold the written-back weights")
