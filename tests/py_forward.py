#!/usr/bin/env python3
"""`fp4moe forward` against an independent numpy oracle.

For every tiny preset (one per routing family and checkpoint layout:
modelopt NVFP4 with groups, score bias and a shared expert; Qwen3 softmax;
Mixtral's w1/w3/w2 names; gpt-oss fused MXFP4 with biases and the clamped
SwiGLU; DeepSeek-V4 with I8/E8M0 experts and token-id hash layers) the
checkpoint written by `fp4moe gen` is read here with a small safetensors
parser, dequantized with ml_dtypes (E4M3) and exact powers of two (E8M0),
routed in float32 as the models' reference code does, and run in float64.
fp4moe's output must match: the same expert ids, weights within 1e-6 and
hidden states within relative error 1e-5 per token.
"""
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import ml_dtypes
except ImportError as e:  # pragma: no cover
    print(f"SKIPPED: {e}")
    sys.exit(77)

CLI = os.environ.get("FM_CLI")
if not CLI or not os.access(CLI, os.X_OK):
    print("SKIPPED: FM_CLI not set")
    sys.exit(77)

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)


def read_st(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
        data = f.read()
    out = {}
    for k, v in hdr.items():
        if k == "__metadata__":
            continue
        b, e = v["data_offsets"]
        out[k] = (v["dtype"], v["shape"], data[b:e])
    return out


def read_ckpt(d):
    idx = os.path.join(d, "model.safetensors.index.json")
    files = set(json.load(open(idx))["weight_map"].values()) if os.path.exists(idx) else {"model.safetensors"}
    t = {}
    for f in files:
        t.update(read_st(os.path.join(d, f)))
    return t


def arr(t, name):
    dt, shape, raw = t[name]
    np_dt = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "U8": np.uint8, "I8": np.int8, "I32": np.int32,
             "I64": np.int64, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E8M0": np.uint8}[dt]
    return np.frombuffer(raw, dtype=np_dt).reshape(shape)


def dequant(codes, scales, fmt, scale2=1.0):
    """codes: [R, K/2] bytes (low nibble = even element); scales per block."""
    codes = codes.view(np.uint8).reshape(codes.shape[0], -1)
    R = codes.shape[0]
    q = np.empty((R, codes.shape[1] * 2), dtype=np.float64)
    q[:, 0::2] = E2M1[codes & 15]
    q[:, 1::2] = E2M1[codes >> 4]
    if fmt == "nvfp4":
        s = scales.astype(np.float64).reshape(R, -1)
        return q * np.repeat(s, 16, axis=1) * float(scale2)
    s = np.ldexp(1.0, scales.astype(np.int64).reshape(R, -1) - 127)
    return q * np.repeat(s, 32, axis=1)


def bf16(a):
    return a.astype(np.float32)


def load_layer(t, cfg, quant, layer):
    """Returns dict: router W/bias, score bias, tid2eid, experts [(g, u, d, gb, ub, db)], shared."""
    mt = cfg["model_type"]
    E = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts")
    L = {}
    if mt == "gpt_oss":
        pre = f"model.layers.{layer}.mlp"
        L["W"] = bf16(arr(t, pre + ".router.weight"))
        L["rb"] = bf16(arr(t, pre + ".router.bias"))
        gub = arr(t, pre + ".experts.gate_up_proj_blocks")
        gus = arr(t, pre + ".experts.gate_up_proj_scales")
        gubias = bf16(arr(t, pre + ".experts.gate_up_proj_bias")).astype(np.float64)
        db = arr(t, pre + ".experts.down_proj_blocks")
        ds = arr(t, pre + ".experts.down_proj_scales")
        dbias = bf16(arr(t, pre + ".experts.down_proj_bias")).astype(np.float64)
        ex = []
        for e in range(E):
            gu = dequant(gub[e].reshape(gub.shape[1], -1), gus[e], "mxfp4")
            dn = dequant(db[e].reshape(db.shape[1], -1), ds[e], "mxfp4")
            ex.append((gu[0::2], gu[1::2], dn, gubias[e][0::2], gubias[e][1::2], dbias[e]))
        L["experts"] = ex
        return L
    dsv4 = mt == "deepseek_v4"
    pre = f"layers.{layer}.ffn" if dsv4 else (
        f"model.layers.{layer}.block_sparse_moe" if mt == "mixtral" else f"model.layers.{layer}.mlp")
    names = ("w1", "w3", "w2") if (mt == "mixtral" or dsv4) else ("gate_proj", "up_proj", "down_proj")
    L["W"] = bf16(arr(t, pre + ".gate.weight"))
    for key in ("e_score_correction_bias", "bias"):
        if pre + ".gate." + key in t:
            L["sb"] = arr(t, pre + ".gate." + key).astype(np.float32)
    if pre + ".gate.tid2eid" in t:
        L["tid2eid"] = arr(t, pre + ".gate.tid2eid")

    def mat(base):
        dt = t[base + ".weight"][0]
        if dt == "BF16":
            return bf16(arr(t, base + ".weight")).astype(np.float64)
        if dsv4:
            return dequant(arr(t, base + ".weight"), arr(t, base + ".scale"), "mxfp4")
        sc = arr(t, base + ".weight_scale")
        if t[base + ".weight_scale"][0] == "F8_E4M3":
            return dequant(arr(t, base + ".weight"), sc, "nvfp4", arr(t, base + ".weight_scale_2"))
        return dequant(arr(t, base + ".weight"), sc, "mxfp4")

    L["experts"] = [tuple(mat(f"{pre}.experts.{e}.{n}") for n in names) + (0, 0, 0) for e in range(E)]
    if pre + f".shared_experts.{names[0]}.weight" in t:
        L["shared"] = tuple(mat(f"{pre}.shared_experts.{n}") for n in names)
    return L


def route(cfg, L, x, layer, tok):
    """float32 routing as the models' code does; returns ids [T,k] ascending, weights."""
    mt = cfg["model_type"]
    k = cfg.get("num_experts_per_tok")
    logits = (x.astype(np.float64) @ L["W"].astype(np.float64).T).astype(np.float32)
    if "rb" in L:
        logits = logits + L["rb"]
    T, E = logits.shape
    ids = np.zeros((T, k), np.int32)
    w = np.zeros((T, k), np.float32)
    for i in range(T):
        z = logits[i]
        if mt in ("qwen3_moe", "mixtral"):
            p = np.exp(z - z.max()).astype(np.float32)
            p = p / p.sum()
            sel = np.argsort(-p, kind="stable")[:k]
            ww = p[sel]
            if mt == "mixtral" or cfg.get("norm_topk_prob"):
                ww = ww / ww.sum()
        elif mt == "gpt_oss":
            sel = np.argsort(-z, kind="stable")[:k]
            zz = z[sel]
            ww = np.exp(zz - zz.max())
            ww = ww / ww.sum()
        else:
            if mt == "deepseek_v4":
                s = np.sqrt(np.where(z > 20, z, np.log1p(np.exp(z)))).astype(np.float32)
            else:
                s = (1 / (1 + np.exp(-z))).astype(np.float32)
            if "tid2eid" in L and layer < cfg.get("num_hash_layers", 0):
                sel = L["tid2eid"][tok[i]].astype(np.int64)
            else:
                b = s + L.get("sb", 0)
                G = cfg.get("n_group") or 1
                if G > 1:
                    g = b.reshape(G, -1)
                    gs = np.sort(g, axis=1)[:, -2:].sum(axis=1) if g.shape[1] > 1 else g[:, 0]
                    keep = np.argsort(-gs, kind="stable")[: cfg["topk_group"]]
                    mask = np.full(G, -np.inf, np.float32)
                    mask[keep] = 0
                    b = (g + mask[:, None]).reshape(-1)
                sel = np.argsort(-b, kind="stable")[:k]
            ww = s[sel]
            if mt == "deepseek_v4" or cfg.get("norm_topk_prob"):
                ww = ww / (ww.sum() + 1e-20)
            ww = ww * cfg.get("routed_scaling_factor", 1.0)
        o = np.argsort(sel)
        ids[i] = np.asarray(sel)[o]
        w[i] = np.asarray(ww, np.float32)[o]
    return ids, w


def act(cfg, g, u):
    if cfg["model_type"] == "gpt_oss":
        lim = cfg.get("swiglu_limit", 7.0)
        g = np.minimum(g, lim)
        u = np.clip(u, -lim, lim)
        return g / (1 + np.exp(-1.702 * g)) * (u + 1)
    lim = cfg.get("swiglu_limit", 0.0) or 0.0
    if lim > 0:  # DeepSeek-V4: clamped SiLU-gated
        g = np.minimum(g, lim)
        u = np.clip(u, -lim, lim)
    return g / (1 + np.exp(-g)) * u


def moe(cfg, L, x, ids, w):
    xd = x.astype(np.float64)
    out = np.zeros_like(xd)
    for i in range(x.shape[0]):
        for j in range(ids.shape[1]):
            g, u, d, gb, ub, db = L["experts"][ids[i, j]]
            h = act(cfg, g @ xd[i] + gb, u @ xd[i] + ub)
            out[i] += float(w[i, j]) * (d @ h + db)
        if "shared" in L:
            g, u, d = L["shared"]
            out[i] += d @ act(cfg, g @ xd[i], u @ xd[i])
    return out


def write_input(path, x, tok=None):
    tensors = {"hidden_states": ("F32", list(x.shape), x.astype(np.float32).tobytes())}
    if tok is not None:
        tensors["token_ids"] = ("I32", [len(tok)], np.asarray(tok, np.int32).tobytes())
    hdr, off, blob = {}, 0, b""
    for k, (dt, shape, raw) in tensors.items():
        hdr[k] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blob += raw
    h = json.dumps(hdr).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + blob)


CASES = [  # preset, format, layer, tokens
    ("tiny-deepseek", "nvfp4", 1, 7),
    ("tiny-qwen3", "nvfp4", 0, 6),
    ("tiny-qwen3", "bf16", 1, 3),
    ("tiny-mixtral", "nvfp4", 1, 5),
    ("tiny-gptoss", "mxfp4", 1, 6),
    ("tiny-deepseek-v4", "mxfp4", 0, 5),
    ("tiny-deepseek-v4", "mxfp4", 2, 4),
]


def main():
    fails = 0
    rng = np.random.default_rng(7)
    with tempfile.TemporaryDirectory() as tmp:
        for preset, fmt, layer, T in CASES:
            d = os.path.join(tmp, f"{preset}-{fmt}")
            if not os.path.exists(d):
                subprocess.run([CLI, "gen", "--preset", preset, "--format", fmt, "--layers", "3" if "v4" in preset else "2",
                                "--seed", "9", "--out", d, "--quiet"], check=True)
            cfg = json.load(open(os.path.join(d, "config.json")))
            t = read_ckpt(d)
            L = load_layer(t, cfg, None, layer)
            H = cfg["hidden_size"]
            x = rng.standard_normal((T, H)).astype(np.float32)
            tok = rng.integers(0, cfg["vocab_size"], T)
            inp, outp = os.path.join(tmp, "in.safetensors"), os.path.join(tmp, "out.safetensors")
            write_input(inp, x, tok)
            r = subprocess.run([CLI, "forward", "--model", d, "--layer", str(layer), "--input", inp, "--output", outp],
                               capture_output=True, text=True)
            what = f"{preset}/{fmt} layer {layer}"
            if r.returncode != 0:
                print(f"FAIL {what}: forward failed: {r.stderr}")
                fails += 1
                continue
            o = read_st(outp)
            got = np.frombuffer(o["hidden_states"][2], np.float32).reshape(T, H)
            gids = np.frombuffer(o["topk_ids"][2], np.int32).reshape(T, -1)
            gw = np.frombuffer(o["topk_weights"][2], np.float32).reshape(T, -1)
            ids, w = route(cfg, L, x, layer, tok)
            ref = moe(cfg, L, x, ids, w)
            ok = True
            if not np.array_equal(gids, ids):
                print(f"FAIL {what}: topk_ids differ\n{gids}\n{ids}")
                ok = False
            elif not np.allclose(gw, w, rtol=1e-6, atol=1e-7):
                print(f"FAIL {what}: topk_weights differ by {np.abs(gw - w).max():.3g}")
                ok = False
            else:
                rel = (np.abs(got - ref).max(axis=1) / np.abs(ref).max(axis=1)).max()
                if not rel <= 1e-5:
                    print(f"FAIL {what}: relative error {rel:.3g}")
                    ok = False
                else:
                    print(f"ok   {what}: T={T}, relative error {rel:.2e}")
            fails += not ok
    if fails:
        print(f"{fails} failure(s)")
        return 1
    print("all forward outputs match the numpy oracle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
