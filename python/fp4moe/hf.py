"""Hugging Face transformers models on fp4moe's experts.

    import fp4moe.hf
    reference = copy.deepcopy(model)
    fp4moe.hf.swap_moe_blocks(model, reference=reference)

swap_moe_blocks replaces the MoE blocks of a transformers 5.x model --
Qwen3-MoE (Qwen3MoeSparseMoeBlock), DeepSeek-V3 (DeepseekV3MoE, with its
shared expert) and gpt-oss (GptOssMLP) -- by FP4MoEBlock modules that run the
whole block (router, routed experts, shared expert) in fp4moe. The experts'
BF16 / F32 weights are quantized here, in torch on the weights' own device:
NVFP4 by ModelOpt's rule for Qwen3 and DeepSeek (the ModelOpt layer layout
of vLLM / SGLang), MXFP4 for gpt-oss (the gpt-oss checkpoint layout). With
write_back the dequantized weights go back into transformers' experts, so a
reference model runs transformers' own experts on exactly the weights
fp4moe holds.

The quantizers are public (quantize_nvfp4, quantize_mxfp4 and their
inverses): they give the bytes fp4moe's own quantizers (fm_quantize_nvfp4,
fm_quantize_mxfp4) give for the same float32 weights.
"""
import json
import re

import torch

__all__ = ["FP4MoEBlock", "dequantize_mxfp4", "dequantize_nvfp4", "layer_tensors", "quantize_mxfp4",
           "quantize_nvfp4", "restore_moe_blocks", "supported_blocks", "swap_moe_blocks"]

# transformers' MoE block class -> (fp4moe family, expert format, fm_layer_tensors layout)
_BLOCKS = {
    "Qwen3MoeSparseMoeBlock": ("qwen3_moe", "nvfp4", "modelopt_nvfp4"),
    "DeepseekV3MoE": ("deepseek_v3", "nvfp4", "modelopt_nvfp4"),
    "GptOssMLP": ("gpt_oss", "mxfp4", "gptoss_mxfp4"),
}

# E2M1: magnitudes by code, and the midpoints between neighbours
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E4M3_MAX = 448.0
# elements of one quantization chunk: bounds the float32 temporaries (~1 GB in all)
_CHUNK_ELEMS = 1 << 26


def supported_blocks():
    """Class names of the transformers MoE blocks swap_moe_blocks replaces."""
    return sorted(_BLOCKS)


# ------------------------------------------------------------------ E2M1


def _e2m1_codes(q):
    """float32 -> E2M1 codes (uint8, 0..15): round to nearest, ties to the
    even code, saturating at 6; -0 becomes +0 (fm_f32_to_e2m1)."""
    a = q.abs().contiguous()
    bounds = torch.tensor(_E2M1_BOUNDS, dtype=torch.float32, device=q.device)
    # the number of midpoints strictly below a: ties go down, to the even code...
    code = torch.bucketize(a, bounds, out_int32=True)
    # ...except at 0.75, 1.75 and 3.5, where the even code is the upper one
    code += ((a == 0.75) | (a == 1.75) | (a == 3.5)).to(torch.int32)
    code += (q < 0).to(torch.int32) * 8
    return code.to(torch.uint8)


def _pack(codes):
    """[..., K] codes -> [..., K/2] bytes, the even element in the low nibble."""
    c = codes.unflatten(-1, (codes.shape[-1] // 2, 2))
    return c[..., 0] | (c[..., 1] << 4)


def _unpack_values(packed):
    """[..., K/2] bytes -> [..., K] float32 E2M1 values."""
    table = torch.tensor(_E2M1 + tuple(-v for v in _E2M1), dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)
    return table[codes.long()]


def _check_finite(w, what):
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{what}: the weights hold NaN or infinity; they cannot be quantized")


# ------------------------------------------------------------------ NVFP4


def quantize_nvfp4(w):
    """ModelOpt NVFP4 of the matrices w [..., R, K] (K % 16 == 0), one FP32
    tensor scale per matrix: scale_2 = amax / (6 * 448); block scale =
    block_amax / (6 * scale_2) clamped to [2^-9, 448], E4M3 round to nearest
    even (an all-zero block: 1.0); elements E2M1 of w / (scale * scale_2).
    Returns (packed uint8 [..., R, K/2], scales float8_e4m3fn [..., R, K/16],
    scale_2 float32 [...])."""
    K = w.shape[-1]
    if w.dim() < 2 or K % 16:
        raise ValueError(f"NVFP4 quantization needs [..., R, K] with K a multiple of 16, got {list(w.shape)}")
    w = w.float()
    amax = w.abs().amax(dim=(-2, -1))
    # divided by a tensor on amax's device, not by a Python number: CUDA torch turns a
    # division by a CPU scalar into a product with its rounded reciprocal (1 ulp off, 1 in 4)
    s2 = amax / torch.full_like(amax, 6.0 * _E4M3_MAX)
    if bool(((amax > 0) & (s2 < 2.0 ** -126)).any()):
        raise ValueError("NVFP4 quantization: a matrix's amax is too small for a normal FP32 tensor scale")
    # an all-zero matrix: scale_2 = 1, every block scale 1.0 (ModelOpt would divide 0 by 0)
    s2 = torch.where(amax == 0, torch.ones_like(s2), s2)
    blk = w.unflatten(-1, (K // 16, 16))
    s = blk.abs().amax(dim=-1) / (6.0 * s2)[..., None, None]
    s = torch.where(s == 0, torch.ones_like(s), s.clamp(2.0 ** -9, _E4M3_MAX))
    scales = s.to(torch.float8_e4m3fn)
    d = scales.float() * s2[..., None, None]
    codes = _e2m1_codes(blk / d[..., None])
    return _pack(codes.flatten(-2)), scales, s2


def dequantize_nvfp4(packed, scales, scale_2):
    """float32 [..., R, K] of quantize_nvfp4's output: E2M1 * (scale *
    scale_2), in float32, as ModelOpt (and fm_qmatrix_dequant_row) compute it."""
    v = _unpack_values(packed)
    bs = scales.float() * scale_2.float()[..., None, None]
    return (v.unflatten(-1, (v.shape[-1] // 16, 16)) * bs[..., None]).flatten(-2)


# ------------------------------------------------------------------ MXFP4


def quantize_mxfp4(w):
    """OCP MXFP4 of w [..., R, K] (K % 32 == 0): scale = 2^(floor(log2(
    block_amax)) - 2) as E8M0 (an all-zero block: 2^-127), elements E2M1 of
    w / scale. Returns (packed uint8 [..., R, K/2], scales uint8 [..., R, K/32])."""
    K = w.shape[-1]
    if w.dim() < 2 or K % 32:
        raise ValueError(f"MXFP4 quantization needs [..., R, K] with K a multiple of 32, got {list(w.shape)}")
    blk = w.float().unflatten(-1, (K // 32, 32))
    bamax = blk.abs().amax(dim=-1)
    _, e = torch.frexp(bamax)  # bamax = m * 2^e, m in [0.5, 1): floor(log2) = e - 1
    code = torch.where(bamax > 0, (e - 1 - 2 + 127).clamp(0, 254), torch.zeros_like(e))
    # 2^(127 - code) built from its bits: exact, and a normal float for every finite block
    inv = ((254 - code) << 23).view(torch.float32)
    codes = _e2m1_codes(blk * inv[..., None])
    return _pack(codes.flatten(-2)), code.to(torch.uint8)


def _e8m0_values(scales):
    c = scales.to(torch.int32)
    v = (c << 23).view(torch.float32)
    return torch.where(c == 0, torch.full_like(v, 2.0 ** -127), v)


def dequantize_mxfp4(packed, scales):
    """float32 [..., R, K] of quantize_mxfp4's output: E2M1 * 2^(code - 127)."""
    v = _unpack_values(packed)
    return (v.unflatten(-1, (v.shape[-1] // 32, 32)) * _e8m0_values(scales)[..., None]).flatten(-2)


# ------------------------------------------------------------------ blocks -> fm_layer_tensors


def _chunks(n_experts, per_expert_elems):
    step = max(1, _CHUNK_ELEMS // max(1, per_expert_elems))
    for e0 in range(0, n_experts, step):
        yield e0, min(n_experts, e0 + step)


def _nvfp4_stack(param, rows_split, what, write_back):
    """NVFP4 of a stack of expert matrices param [E, R, K]; rows_split = 2
    quantizes the two row halves (gate, up) as matrices of their own, each
    with its scale_2 (ModelOpt quantizes gate_proj and up_proj apart)."""
    E, R, K = param.shape
    dev = param.device
    packed = torch.empty((E, R, K // 2), dtype=torch.uint8, device=dev)
    scales = torch.empty((E, R, K // 16), dtype=torch.float8_e4m3fn, device=dev)
    s2 = torch.empty((E, rows_split) if rows_split > 1 else (E,), dtype=torch.float32, device=dev)
    for e0, e1 in _chunks(E, R * K):
        w = param.detach()[e0:e1]
        _check_finite(w, f"{what} experts {e0}..{e1 - 1}")
        w = w.reshape(e1 - e0, rows_split, R // rows_split, K) if rows_split > 1 else w
        p, s, t = quantize_nvfp4(w)
        packed[e0:e1] = p.reshape(e1 - e0, R, K // 2)
        scales[e0:e1] = s.reshape(e1 - e0, R, K // 16)
        s2[e0:e1] = t
        if write_back is not None:
            write_back.detach()[e0:e1].copy_(dequantize_nvfp4(p, s, t).reshape(e1 - e0, R, K))
    return packed, scales, s2


def _nvfp4_matrix(weight, what, write_back):
    _check_finite(weight.detach(), what)
    p, s, t = quantize_nvfp4(weight.detach())
    if write_back is not None:
        write_back.detach().copy_(dequantize_nvfp4(p, s, t))
    return p, s, t


def _mxfp4_stack(param, what, write_back):
    """MXFP4 of gpt-oss's transposed expert weights param [E, K, R] (x @ W):
    fp4moe's rows are W's columns."""
    E, K, R = param.shape
    dev = param.device
    packed = torch.empty((E, R, K // 2), dtype=torch.uint8, device=dev)
    scales = torch.empty((E, R, K // 32), dtype=torch.uint8, device=dev)
    for e0, e1 in _chunks(E, R * K):
        w = param.detach()[e0:e1].transpose(1, 2)
        _check_finite(w, f"{what} experts {e0}..{e1 - 1}")
        p, s = quantize_mxfp4(w)
        packed[e0:e1] = p
        scales[e0:e1] = s
        if write_back is not None:
            write_back.detach()[e0:e1].copy_(dequantize_mxfp4(p, s).transpose(1, 2))
    return packed, scales


def _family_of(block):
    spec = _BLOCKS.get(type(block).__name__)
    if spec is None:
        raise ValueError(f"{type(block).__name__} is not a supported MoE block ({', '.join(supported_blocks())})")
    return spec


def layer_tensors(block, write_back=None):
    """The fm_layer_tensors of one transformers MoE block (a dict for
    fp4moe.MoE.from_tensors), quantized on the weights' device, and the
    layout's name. write_back: a block of the same class and shapes (the
    block itself, or its twin in a reference model) into whose experts the
    dequantized weights are written."""
    family, fmt, layout = _family_of(block)
    if write_back is not None and type(write_back) is not type(block):
        raise ValueError(f"write_back: a {type(write_back).__name__} for a {type(block).__name__}")
    ex = block.experts
    wex = write_back.experts if write_back is not None else None
    t = {}
    if fmt == "nvfp4":
        E, R2, H = ex.gate_up_proj.shape
        I = ex.down_proj.shape[2]
        if H % 16 or I % 16 or R2 != 2 * I:
            raise ValueError(f"{family}: NVFP4 needs H and I multiples of 16 and gate_up_proj [E, 2I, H] "
                             f"(got gate_up_proj {list(ex.gate_up_proj.shape)}, down_proj {list(ex.down_proj.shape)})")
        t["w13_weight"], t["w13_weight_scale"], t["w13_weight_scale_2"] = _nvfp4_stack(
            ex.gate_up_proj, 2, "gate_up_proj", wex.gate_up_proj if wex is not None else None)
        t["w2_weight"], t["w2_weight_scale"], t["w2_weight_scale_2"] = _nvfp4_stack(
            ex.down_proj, 1, "down_proj", wex.down_proj if wex is not None else None)
        t["router_w"] = block.gate.weight.detach()
        if family == "deepseek_v3":
            t["score_bias"] = block.gate.e_score_correction_bias.detach().float()
            sh = getattr(block, "shared_experts", None)
            if sh is not None and sh.gate_proj.weight.shape[0] > 0:
                wsh = write_back.shared_experts if write_back is not None else None
                for name, lin in (("shared_gate", "gate_proj"), ("shared_up", "up_proj"), ("shared_down", "down_proj")):
                    wb = getattr(wsh, lin).weight if wsh is not None else None
                    p, s, s2 = _nvfp4_matrix(getattr(sh, lin).weight, f"shared_experts.{lin}", wb)
                    t[name], t[name + "_scale"], t[name + "_scale_2"] = p, s, s2
    else:
        E, H, I2 = ex.gate_up_proj.shape
        I = ex.down_proj.shape[1]
        if H % 32 or I % 32 or I2 != 2 * I:
            raise ValueError(f"{family}: MXFP4 needs H and I multiples of 32 and gate_up_proj [E, H, 2I] "
                             f"(got gate_up_proj {list(ex.gate_up_proj.shape)}, down_proj {list(ex.down_proj.shape)})")
        p, s = _mxfp4_stack(ex.gate_up_proj, "gate_up_proj", wex.gate_up_proj if wex is not None else None)
        # gpt-oss's columns are interleaved gate, up, gate, ... as the checkpoint's rows
        t["gate_up_blocks"], t["gate_up_scales"] = p.unflatten(-1, (H // 32, 16)), s
        p, s = _mxfp4_stack(ex.down_proj, "down_proj", wex.down_proj if wex is not None else None)
        t["down_blocks"], t["down_scales"] = p.unflatten(-1, (I // 32, 16)), s
        t["gate_up_bias"] = ex.gate_up_proj_bias.detach().float()
        t["down_bias"] = ex.down_proj_bias.detach().float()
        if write_back is not None:  # the biases stay unquantized: copied so both sides hold the same
            wex.gate_up_proj_bias.detach().copy_(ex.gate_up_proj_bias.detach())
            wex.down_proj_bias.detach().copy_(ex.down_proj_bias.detach())
        t["router_w"] = block.router.weight.detach()
        t["router_bias"] = block.router.bias.detach().float()
    return t, layout, I


def _fm_config(model, family, block):
    """The model's config as fp4moe reads it, without its quantization part
    (MoE.from_tensors takes format and block from the layout of the tensors
    layer_tensors makes): transformers 5 writes some keys under other names
    than the checkpoints' config.json (Qwen3-MoE's num_experts is
    num_local_experts in to_dict)."""
    cfg = model.config.get_text_config().to_dict() if hasattr(model.config, "get_text_config") \
        else model.config.to_dict()
    ex = block.experts
    E = int(ex.gate_up_proj.shape[0])
    if family == "qwen3_moe":
        cfg["num_experts"] = E
    elif family == "gpt_oss":
        cfg["num_local_experts"] = E
        cfg["swiglu_limit"] = float(ex.limit)
        if abs(float(ex.alpha) - 1.702) > 1e-6:
            raise ValueError(f"gpt_oss: the experts' alpha is {ex.alpha}; fp4moe's gpt-oss activation has 1.702")
    elif family == "deepseek_v3":
        cfg["n_routed_experts"] = E
    cfg.pop("quantization_config", None)
    return json.loads(json.dumps(cfg, default=str))


class FP4MoEBlock(torch.nn.Module):
    """A transformers MoE block run by fp4moe (routing included): [B, S, H]
    in the model's dtype -> the same shape and dtype, or for gpt-oss the
    (hidden_states, router_scores) pair GptOssMLP returns, router_scores
    being fp4moe's top-k weights [T, k] in ascending expert order (the
    decoder layer discards them)."""

    def __init__(self, moe, family, layer_idx, returns_scores):
        super().__init__()
        self.moe = moe
        self.family = family
        self.layer_idx = layer_idx
        self.returns_scores = returns_scores

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        dev = torch.device(self.moe.device)
        xm = x if x.device == dev else x.to(dev)
        if self.returns_scores:
            out, _, scores = self.moe(xm.contiguous(), return_routing=True)
        else:
            out = self.moe(xm.contiguous())
        y = out.to(device=hidden_states.device, dtype=hidden_states.dtype).reshape(shape)
        return (y, scores.to(hidden_states.device)) if self.returns_scores else y

    def extra_repr(self):
        return f"{self.family} layer {self.layer_idx}: {self.moe!r}"


def _moe_blocks(model):
    out = []
    for name, mod in model.named_modules():
        if type(mod).__name__ in _BLOCKS:
            m = re.search(r"(?:^|\.)layers\.(\d+)\.", name + ".")
            if m is None:
                raise ValueError(f"{name}: cannot tell the layer index of this MoE block from its name")
            out.append((name, int(m.group(1)), mod))
    return out


def _set_submodule(model, name, mod):
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, mod)


def swap_moe_blocks(model, fmt="auto", device=None, write_back=True, reference=None, max_tokens=512):
    """Replaces every supported MoE block of `model` (in place) by an
    FP4MoEBlock and returns the names of the replaced modules.

    fmt: "auto" (NVFP4 for Qwen3-MoE and DeepSeek-V3, MXFP4 for gpt-oss) or
    that family's format by name. device: "cuda", "cuda:N" or "cpu" for
    fp4moe's engine (default: where the experts' weights are). write_back:
    write the dequantized weights into transformers' experts: those of
    `reference` (a copy of the model made before the swap, so that it runs
    transformers' own experts on the weights fp4moe holds; its blocks are
    found by the same names), or without reference those of the replaced
    blocks, which the new blocks then keep (FP4MoEBlock.original, held
    outside the module tree) for restore_moe_blocks. Without write_back the
    replaced blocks are dropped as the swap goes, so their memory is free
    for the next layer's quantization. max_tokens: the most tokens one call
    takes (decode batch, or prompt tokens of a prefill)."""
    from . import MoE

    blocks = _moe_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no supported MoE block ({', '.join(supported_blocks())})")
    if reference is not None and not write_back:
        raise ValueError("reference is the target of write_back: pass write_back=True with it")
    swapped = []
    while blocks:
        # popped, so that a dropped block's memory is free for the next layer
        name, layer, block = blocks.pop(0)
        family, natural, _ = _family_of(block)
        if fmt not in ("auto", natural):
            raise ValueError(f"{name}: {family} experts run as {natural} in fp4moe (fmt={fmt!r})")
        target = None
        if write_back:
            target = reference.get_submodule(name) if reference is not None else block
        dev = torch.device(device) if device is not None else block.experts.gate_up_proj.device
        with torch.no_grad():
            tensors, layout, inter = layer_tensors(block, write_back=target)
            tensors = {k: v.to(dev).contiguous() for k, v in tensors.items()}
        cfg = _fm_config(model, family, block)
        dev_name = "cpu" if dev.type == "cpu" else (f"cuda:{dev.index}" if dev.index is not None else "cuda")
        moe = MoE.from_tensors(cfg, layer, tensors, layout=layout, inter=inter, device=dev_name,
                               max_tokens=max_tokens)
        del tensors  # the engine holds its own copy
        new = FP4MoEBlock(moe, family, layer, returns_scores=family == "gpt_oss")
        if write_back and reference is None:
            object.__setattr__(new, "original", block)  # not a submodule: not in state_dict, .to() or parameters
        _set_submodule(model, name, new)
        kept = target is block
        del block, target
        swapped.append(name)
        if dev.type == "cuda" and not kept:
            torch.cuda.empty_cache()
    return swapped


def restore_moe_blocks(model):
    """Puts back the transformers blocks that swap_moe_blocks kept (write_back
    without reference) and returns their names."""
    names = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, FP4MoEBlock) and getattr(mod, "original", None) is not None:
            _set_submodule(model, name, mod.original)
            mod.moe.close()
            names.append(name)
    return names
