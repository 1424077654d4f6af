"""Oracle test: a checkpoint written by `fp4moe gen`, read with Python's
safetensors, checked against the layouts, and decoded independently with
numpy + ml_dtypes (E2M1 table, float8_e4m3fn, E8M0 = 2^(e-127)); the decoded
values must equal the C dequantization reported by `fp4moe inspect --json`."""
import json
import os
import shutil
import subprocess
import tempfile

from fmtest import Checks, env_path, skip

try:
    import numpy as np
    import ml_dtypes
    import safetensors
    from safetensors import safe_open
except ImportError as e:  # pragma: no cover
    skip(e)

CLI = env_path("FM_CLI")

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
check = Checks()


def load_dir(d):
    """All tensors of all shards: name -> (dtype, shape, raw bytes), plus the index."""
    idx = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    tensors = {}
    total = 0
    for shard in sorted(set(idx["weight_map"].values())):
        path = os.path.join(d, shard)
        with safe_open(path, "np") as f:
            names = set(f.keys())
            meta = f.metadata()
            check(meta.get("format") == "pt", f"{shard}: __metadata__ format {meta}")
            shapes = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in names}
        raw = {name: info for name, info in safetensors.deserialize(open(path, "rb").read())}
        for k in names:
            dt, shape = shapes[k]
            tensors[k] = (dt, list(shape), bytes(raw[k]["data"]))
            total += len(raw[k]["data"])
            check(idx["weight_map"].get(k) == shard, f"index maps {k} to {idx['weight_map'].get(k)}, found in {shard}")
    check(set(idx["weight_map"]) == set(tensors), "index names != shard names")
    check(idx["metadata"]["total_size"] == total, f"total_size {idx['metadata']['total_size']} != {total}")
    return tensors


def gen(preset, fmt, layers, out):
    subprocess.run([CLI, "gen", "--preset", preset, "--format", fmt, "--layers", str(layers), "--seed", "42",
                    "--out", out, "--quiet"], check=True)
    r = subprocess.run([CLI, "inspect", out, "--json"], capture_output=True, text=True)
    check(r.returncode == 0, f"inspect {preset}: rc {r.returncode} {r.stderr}")
    return json.loads(r.stdout)


def expect(tensors, name, dtype, shape):
    if name not in tensors:
        check(False, f"missing {name}")
        return None
    dt, sh, data = tensors[name]
    check(dt == dtype, f"{name}: dtype {dt}, expected {dtype}")
    check(sh == shape, f"{name}: shape {sh}, expected {shape}")
    return data


def nibbles(row_bytes):
    b = np.frombuffer(row_bytes, dtype=np.uint8)
    out = np.empty(b.size * 2, dtype=np.uint8)
    out[0::2] = b & 0xF  # element 2j = low nibble of byte j
    out[1::2] = b >> 4
    return out


def compare(sample, ref, what):
    got = np.array(sample["values"], dtype=np.float32)
    ref = ref[: got.size].astype(np.float32)
    ok = np.allclose(got, ref, rtol=1e-6, atol=0)
    check(ok, f"{what}: C dequant {got[:6]} != numpy {ref[:6]}")
    check(np.any(ref != 0), f"{what}: all zeros")


tmp = tempfile.mkdtemp(prefix="fm_py_gen_")
try:
    # --- NVFP4, ModelOpt per-expert layout (Qwen3): H=128, I=64, E=16
    d = os.path.join(tmp, "qwen")
    rep = gen("tiny-qwen3", "nvfp4", 2, d)
    t = load_dir(d)
    H, I, E = 128, 64, 16
    cfg = json.load(open(os.path.join(d, "config.json")))
    hq = json.load(open(os.path.join(d, "hf_quant_config.json")))
    check(cfg["model_type"] == "qwen3_moe" and cfg["num_experts"] == E and cfg["moe_intermediate_size"] == I, "qwen config keys")
    check(hq["quantization"]["quant_algo"] == "NVFP4" and hq["quantization"]["group_size"] == 16, "hf_quant_config")
    check(cfg["quantization_config"]["quant_method"] == "modelopt", "quantization_config mirror")
    for L in (0, 1):
        p = f"model.layers.{L}.mlp"
        expect(t, f"{p}.gate.weight", "BF16", [E, H])
        for e in range(E):
            for m, (R, K) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                expect(t, f"{p}.experts.{e}.{m}.weight", "U8", [R, K // 2])
                expect(t, f"{p}.experts.{e}.{m}.weight_scale", "F8_E4M3", [R, K // 16])
                expect(t, f"{p}.experts.{e}.{m}.weight_scale_2", "F32", [])
                expect(t, f"{p}.experts.{e}.{m}.input_scale", "F32", [])
    check(rep["moe_layers_present"] == [0, 1], f"present {rep['moe_layers_present']}")
    s = rep["sample"]
    L, e, row = s["layer"], s["expert"], s["row"]
    base = f"model.layers.{L}.mlp.experts.{e}.gate_proj"
    w = np.frombuffer(t[base + ".weight"][2], dtype=np.uint8).reshape(I, H // 2)
    sc = np.frombuffer(t[base + ".weight_scale"][2], dtype=ml_dtypes.float8_e4m3fn).reshape(I, H // 16).astype(np.float32)
    s2 = np.frombuffer(t[base + ".weight_scale_2"][2], dtype="<f4")[0]
    ref = E2M1[nibbles(w[row].tobytes())] * np.repeat(sc[row], 16) * s2
    compare(s, ref, "nvfp4 modelopt")
    # router weights: normal / sqrt(H) in BF16
    rw = np.frombuffer(t["model.layers.0.mlp.gate.weight"][2], dtype=ml_dtypes.bfloat16).astype(np.float64)
    check(0.8 < rw.std() * np.sqrt(H) < 1.2, f"router std*sqrt(H) = {rw.std() * np.sqrt(H)}")

    # --- MXFP4, gpt-oss fused layout: gate/up rows interleaved
    d = os.path.join(tmp, "gptoss")
    rep = gen("tiny-gptoss", "mxfp4", 1, d)
    t = load_dir(d)
    H, I, E = 128, 64, 8
    p = "model.layers.0.mlp"
    blocks = expect(t, f"{p}.experts.gate_up_proj_blocks", "U8", [E, 2 * I, H // 32, 16])
    scales = expect(t, f"{p}.experts.gate_up_proj_scales", "U8", [E, 2 * I, H // 32])
    expect(t, f"{p}.experts.gate_up_proj_bias", "BF16", [E, 2 * I])
    expect(t, f"{p}.experts.down_proj_blocks", "U8", [E, H, I // 32, 16])
    expect(t, f"{p}.experts.down_proj_scales", "U8", [E, H, I // 32])
    expect(t, f"{p}.experts.down_proj_bias", "BF16", [E, H])
    expect(t, f"{p}.router.weight", "BF16", [E, H])
    expect(t, f"{p}.router.bias", "BF16", [E])
    cfg = json.load(open(os.path.join(d, "config.json")))
    check(cfg["quantization_config"]["quant_method"] == "mxfp4" and cfg["num_local_experts"] == E, "gpt-oss config")
    check(not os.path.exists(os.path.join(d, "hf_quant_config.json")), "gpt-oss has no hf_quant_config.json")
    s = rep["sample"]
    e, row = s["expert"], s["row"]
    b = np.frombuffer(blocks, dtype=np.uint8).reshape(E, 2 * I, H // 2)
    sc = np.frombuffer(scales, dtype=np.uint8).reshape(E, 2 * I, H // 32)
    fused = 2 * row  # gate row r is fused row 2r
    ref = E2M1[nibbles(b[e, fused].tobytes())] * np.repeat(np.exp2(sc[e, fused].astype(np.float64) - 127), 32)
    compare(s, ref, "mxfp4 gpt-oss")

    # --- MXFP4, DeepSeek-V4 layout: I8 weight + F8_E8M0 scale, hash layer table
    d = os.path.join(tmp, "dsv4")
    rep = gen("tiny-deepseek-v4", "mxfp4", 3, d)
    t = load_dir(d)
    H, I, E, V, k = 128, 64, 16, 512, 4
    tid = expect(t, "layers.0.ffn.gate.tid2eid", "I64", [V, k])
    check("layers.0.ffn.gate.bias" not in t, "hash layer has no gate.bias")
    expect(t, "layers.2.ffn.gate.bias", "F32", [E])
    check("layers.2.ffn.gate.tid2eid" not in t, "scored layer has no tid2eid")
    tid = np.frombuffer(tid, dtype="<i8").reshape(V, k)
    check(tid.min() >= 0 and tid.max() < E, "tid2eid range")
    check(all(len(set(r)) == k for r in tid.tolist()), "tid2eid rows distinct")
    w = expect(t, "layers.0.ffn.experts.0.w1.weight", "I8", [I, H // 2])
    sc = expect(t, "layers.0.ffn.experts.0.w1.scale", "F8_E8M0", [I, H // 32])
    expect(t, "layers.0.ffn.shared_experts.w2.weight", "I8", [H, I // 2])
    s = rep["sample"]
    check(s["layer"] == 0 and s["expert"] == 0, "dsv4 sample is layer 0 expert 0")
    row = s["row"]
    w = np.frombuffer(w, dtype=np.uint8).reshape(I, H // 2)
    sc = np.frombuffer(sc, dtype=np.uint8).reshape(I, H // 32)
    ref = E2M1[nibbles(w[row].tobytes())] * np.repeat(np.exp2(sc[row].astype(np.float64) - 127), 32)
    compare(s, ref, "mxfp4 dsv4")
finally:
    shutil.rmtree(tmp, ignore_errors=True)

check.finish("ok")
