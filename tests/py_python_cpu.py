#!/usr/bin/env python3
"""The Python package (python/fp4moe) on the CPU engine.

The package is imported from the source tree with FP4MOE_LIBRARY set to the
build's libfp4moe.so ($FM_LIBRARY, from ctest). Checkpoints come from
`fp4moe gen`; the reference is the float64 NumPy oracle of tests/py_forward.py
(its own safetensors reader, E2M1 / E4M3 / E8M0 dequantization, float32
routing as the models' code does), which shares no code with the library.

  - MoE.from_checkpoint(...)(x) and .experts(...) against the oracle for
    NVFP4 with a shared expert (noaux_tc routing) and gpt-oss MXFP4 (biases,
    clamped SwiGLU): the same expert ids, weights within 1e-6, hidden
    states within relative error 1e-5 per token; float16 / bfloat16 inputs;
    ids < 0 (another rank's experts) and int64 ids in .experts.
  - MoE.from_tensors with NumPy arrays in the ModelOpt layout (experts
    stacked from the checkpoint's tensors), in strided views too, and in
    the gpt-oss layout, with the checkpoint's config and with a plain one
    (no quantization_config: the layout gives format and block): bit for
    bit equal to from_checkpoint.
  - MoE.random equals the checkpoint `fp4moe gen` writes, bit for bit.
  - Errors raise fp4moe.Error with the library's message: wrong dtype,
    wrong shape (naming the tensor), missing tensors, T > max_tokens, ids
    out of range.
  - The ctypes structures have the header's offsets and sizes (a C
    compiler reads include/fp4moe.h).
  - With torch importable: the torch ops on CPU tensors equal the NumPy
    path, and torch.library.opcheck passes on both ops.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

try:
    import numpy as np
except ImportError as e:  # pragma: no cover
    print(f"SKIPPED: numpy not importable ({e})")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fmtest import Checks, env_path, skip  # noqa: E402

CLI = env_path("FM_CLI")
LIBRARY = os.environ.get("FM_LIBRARY")
if not LIBRARY:
    skip("FM_LIBRARY not set (run through ctest; a sanitizer build sets none, as python3 cannot load its library)")
SRC = os.environ.get("FM_SOURCE_DIR") or os.path.dirname(HERE)
os.environ["FP4MOE_LIBRARY"] = LIBRARY
sys.path.insert(0, os.path.join(SRC, "python"))
import py_forward as pf  # noqa: E402  (the oracle; needs ml_dtypes beside numpy)
import fp4moe  # noqa: E402
from fp4moe import _lib  # noqa: E402

check = Checks()
rng = np.random.default_rng(2024)


def gen(tmp, preset, fmt, layers=2, seed=9):
    d = os.path.join(tmp, f"{preset}-{fmt}-{seed}")
    if not os.path.exists(d):
        subprocess.run([CLI, "gen", "--preset", preset, "--format", fmt, "--layers", str(layers), "--seed",
                        str(seed), "--out", d, "--quiet"], check=True)
    return d


def rel_err(got, ref):
    return float((np.abs(got - ref).max(axis=1) / np.maximum(np.abs(ref).max(axis=1), 1e-30)).max())


def ref_experts(cfg, L, x, ids, w, include_shared):
    """float64 experts on given ids (id < 0: skipped)."""
    xd = x.astype(np.float64)
    out = np.zeros_like(xd)
    for i in range(x.shape[0]):
        for j in range(ids.shape[1]):
            if ids[i, j] < 0:
                continue
            g, u, d, gb, ub, db = L["experts"][ids[i, j]]
            out[i] += float(w[i, j]) * (d @ pf.act(cfg, g @ xd[i] + gb, u @ xd[i] + ub) + db)
        if include_shared and "shared" in L:
            g, u, d = L["shared"]
            out[i] += d @ pf.act(cfg, g @ xd[i], u @ xd[i])
    return out


def raises(f, what, code=None, contains=()):
    """f() must raise fp4moe.Error (with `code` and each word of
    `contains` in its message); returns the error."""
    try:
        f()
    except fp4moe.Error as e:
        ok = check(isinstance(e, RuntimeError), f"{what}: fp4moe.Error is not a RuntimeError")
        if code:
            ok &= check(e.code == code, f"{what}: status {e.code}, expected {code} ({e})")
        for w in contains:
            ok &= check(w in e.message, f"{what}: message {e.message!r} does not name {w!r}")
        ok &= check(bool(e.message) and bool(e.status_name), f"{what}: empty message or status name")
        if ok:
            print(f"ok   {what}: {e}")
        return e
    except Exception as e:  # noqa: BLE001
        check(False, f"{what}: raised {type(e).__name__}: {e}, not fp4moe.Error")
        return None
    check(False, f"{what}: did not raise")
    return None


def random_routing(T, E, k, neg=True):
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int64)
    if neg:
        ids[0, 0] = -1  # another rank's expert: contributes nothing
        if T > 2:
            ids[2, k - 1] = -7
    w = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    return ids, w


# --------------------------------------------------------------- oracle
def case_oracle(d, layer, T, what):
    cfg = json.load(open(os.path.join(d, "config.json")))
    t = pf.read_ckpt(d)
    L = pf.load_layer(t, cfg, None, layer)
    m = fp4moe.MoE.from_checkpoint(d, layer, max_tokens=32)
    H, k = cfg["hidden_size"], cfg["num_experts_per_tok"]
    E = len(L["experts"])
    check(m.hidden == H and m.topk == k and m.n_experts == E, f"{what}: H/k/E {m.hidden}/{m.topk}/{m.n_experts}")
    check(m.has_shared == ("shared" in L), f"{what}: has_shared {m.has_shared}")
    x = rng.standard_normal((T, H)).astype(np.float32)
    out, ids, w = m(x, return_routing=True)
    rids, rw = pf.route(cfg, L, x, layer, None)
    ref = pf.moe(cfg, L, x, rids, rw)
    check(out.dtype == np.float32 and out.shape == (T, H), f"{what}: out {out.dtype} {out.shape}")
    check(ids.dtype == np.int32 and w.dtype == np.float32, f"{what}: routing dtypes {ids.dtype} {w.dtype}")
    check(np.array_equal(ids, rids), f"{what}: topk_ids differ\n{ids}\n{rids}")
    check(np.allclose(w, rw, rtol=1e-6, atol=1e-7), f"{what}: topk_weights differ by {np.abs(w - rw).max():.3g}")
    e = rel_err(out, ref)
    check(e <= 1e-5, f"{what}: moe relative error {e:.3g}")
    print(f"ok   {what}: moe(x) T={T}, relative error {e:.2e}")
    check(np.array_equal(m(x), out), f"{what}: moe(x) without routing differs")

    # half-precision inputs: the oracle sees the same rounded values
    for name in ("float16", "bfloat16"):
        try:
            dt = np.dtype(name) if name == "float16" else np.dtype(__import__("ml_dtypes").bfloat16)
        except ImportError:
            continue
        xh = x.astype(dt)
        xr = xh.astype(np.float32)
        o2, i2, w2 = m(xh, return_routing=True)
        ri2, rw2 = pf.route(cfg, L, xr, layer, None)
        e = rel_err(o2, pf.moe(cfg, L, xr, ri2, rw2))
        check(np.array_equal(i2, ri2) and e <= 1e-5, f"{what}: {name} input: relative error {e:.3g}")

    # pre-routed: the caller's ids (int64, with ids < 0) and weights
    eids, ew = random_routing(T, E, k)
    for shared in (True, False):
        got = m.experts(x, eids, ew, include_shared=shared)
        e = rel_err(got, ref_experts(cfg, L, x, eids, ew, shared))
        check(e <= 1e-5, f"{what}: experts(include_shared={shared}) relative error {e:.3g}")
        print(f"ok   {what}: experts(include_shared={shared}), relative error {e:.2e}")
    check(np.array_equal(m.experts(x, eids.astype(np.int32), ew), m.experts(x, eids, ew)),
          f"{what}: int32 and int64 ids differ")
    # the routed call equals the experts on its own routing
    check(np.array_equal(m.experts(x, ids, w), out), f"{what}: experts(moe's routing) != moe")
    check(m(np.zeros((0, H), np.float32)).shape == (0, H), f"{what}: T = 0")
    return m, cfg, t, x


# ------------------------------------------------------------ from_tensors
def modelopt_tensors(t, layer, E, with_router=True, scale2_per_gate_up=True):
    pre = f"model.layers.{layer}.mlp"
    a = lambda n: pf.arr(t, n)  # noqa: E731
    ex = lambda e, p, s: a(f"{pre}.experts.{e}.{p}_proj.{s}")  # noqa: E731
    w13 = np.stack([np.concatenate([ex(e, "gate", "weight"), ex(e, "up", "weight")]) for e in range(E)])
    w13s = np.stack([np.concatenate([ex(e, "gate", "weight_scale"), ex(e, "up", "weight_scale")]) for e in range(E)])
    if scale2_per_gate_up:
        w13s2 = np.array([[ex(e, "gate", "weight_scale_2"), ex(e, "up", "weight_scale_2")] for e in range(E)],
                         np.float32)
    else:
        w13s2 = np.array([ex(e, "gate", "weight_scale_2") for e in range(E)], np.float32)
    T = {"w13_weight": w13, "w13_weight_scale": w13s, "w13_weight_scale_2": w13s2,
         "w2_weight": np.stack([ex(e, "down", "weight") for e in range(E)]),
         "w2_weight_scale": np.stack([ex(e, "down", "weight_scale") for e in range(E)]),
         "w2_weight_scale_2": np.array([ex(e, "down", "weight_scale_2") for e in range(E)], np.float32)}
    for p in ("gate", "up", "down"):
        b = f"{pre}.shared_experts.{p}_proj"
        if b + ".weight" in t:
            T[f"shared_{p}"] = a(b + ".weight")
            T[f"shared_{p}_scale"] = a(b + ".weight_scale")
            T[f"shared_{p}_scale_2"] = a(b + ".weight_scale_2")
    if with_router:
        T["router_w"] = a(f"{pre}.gate.weight")
        if f"{pre}.gate.e_score_correction_bias" in t:
            T["score_bias"] = a(f"{pre}.gate.e_score_correction_bias")
    return T


def strided(x, pad=8):
    """The same values in a view whose rows are `pad` elements apart more
    than they are long (innermost stride 1)."""
    big = np.zeros(x.shape[:-1] + (x.shape[-1] + pad,), x.dtype)
    big[..., : x.shape[-1]] = x
    return big[..., : x.shape[-1]]


def same(a, b):
    """Bit for bit (float outputs compared as their bytes)."""
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def check_like_checkpoint(m, x, conf, layer, tens, layout, block, what):
    """MoE.from_tensors(conf, tens) against the checkpoint's layer m: moe()
    and experts() bit for bit, the same widths, the format's block."""
    out, ids, w = m(x, return_routing=True)
    eids, ew = random_routing(x.shape[0], m.n_experts, m.topk)
    m2 = fp4moe.MoE.from_tensors(conf, layer, tens, layout=layout, max_tokens=32)
    o2, i2, w2 = m2(x, return_routing=True)
    ok = check(same(o2, out) and same(i2, ids) and same(w2, w),
               f"{what} moe != from_checkpoint (max diff {np.abs(o2 - out).max():.3g})")
    ok &= check(same(m2.experts(x, eids, ew), m.experts(x, eids, ew)), f"{what} experts != from_checkpoint")
    ok &= check(m2.inter == m.inter and m2.has_shared == m.has_shared,
                f"{what} inter {m2.inter} shared {m2.has_shared}")
    ok &= check(m2.config["group_size"] == block, f"{what} group_size {m2.config['group_size']}")
    if ok:
        print(f"ok   {what} equals from_checkpoint bit for bit")
    m2.close()


def plain_config(d):
    """The checkpoint's config.json without its quantization part."""
    cfg = json.load(open(os.path.join(d, "config.json")))
    return {k: v for k, v in cfg.items() if k != "quantization_config"}


def case_from_tensors_modelopt(d, m, cfg, t, x, layer, what):
    E = m.n_experts
    T = modelopt_tensors(t, layer, E)
    variants = [("config dir", d, T), ("config dict", cfg, T),
                ("config dict without quantization_config", plain_config(d), T),
                ("config.json path", os.path.join(d, "config.json"), T),
                ("strided views", d, {n: strided(v) if v.ndim >= 2 else v for n, v in T.items()})]
    s2 = T["w13_weight_scale_2"]
    if np.array_equal(s2[:, 0], s2[:, 1]):
        variants.append(("w13_weight_scale_2 [E]", d, modelopt_tensors(t, layer, E, scale2_per_gate_up=False)))
    for name, conf, tens in variants:
        check_like_checkpoint(m, x, conf, layer, tens, "modelopt_nvfp4", 16, f"{what}: from_tensors ({name})")
    # without the router: the pre-routed call only
    eids, ew = random_routing(x.shape[0], E, m.topk)
    m3 = fp4moe.MoE.from_tensors(d, layer, modelopt_tensors(t, layer, E, with_router=False))
    check(same(m3.experts(x, eids, ew), m.experts(x, eids, ew)), f"{what}: from_tensors without router: experts differ")
    raises(lambda: m3(x), f"{what}: moe() without router_w", "FM_E_ARG", ("router_w",))
    return T


def case_from_tensors_gptoss(d, m, t, x, layer, what):
    pre = f"model.layers.{layer}.mlp"
    a = lambda n: pf.arr(t, n)  # noqa: E731
    T = {"gate_up_blocks": a(pre + ".experts.gate_up_proj_blocks"),
         "gate_up_scales": a(pre + ".experts.gate_up_proj_scales"),
         "gate_up_bias": a(pre + ".experts.gate_up_proj_bias"), "down_blocks": a(pre + ".experts.down_proj_blocks"),
         "down_scales": a(pre + ".experts.down_proj_scales"), "down_bias": a(pre + ".experts.down_proj_bias"),
         "router_w": a(pre + ".router.weight"), "router_bias": a(pre + ".router.bias")}
    for name, conf in (("config dir", d), ("config dict without quantization_config", plain_config(d))):
        check_like_checkpoint(m, x, conf, layer, T, "gptoss_mxfp4", 32,
                              f"{what}: from_tensors (gpt-oss layout, {name})")


# ------------------------------------------------------------------ errors
def case_errors(d, m, T, layer):
    H, k, E = m.hidden, m.topk, m.n_experts
    x = rng.standard_normal((3, H)).astype(np.float32)
    raises(lambda: m(x.astype(np.int32)), "hidden int32", "FM_E_ARG", ("hidden", "int32"))
    raises(lambda: m(x.astype(np.float64)), "hidden float64", "FM_E_ARG", ("hidden", "float64"))
    raises(lambda: m(x[:, :-1]), "hidden of the wrong width", "FM_E_ARG", ("hidden", str(H)))
    raises(lambda: m(x[0]), "hidden of one dimension", "FM_E_ARG", ("hidden",))
    raises(lambda: m(np.zeros((33, H), np.float32)), "T > max_tokens", "FM_E_RANGE", ("33", "max_tokens=32"))
    ids, w = random_routing(3, E, k, neg=False)
    bad = ids.copy()
    bad[1, 2] = E
    e = raises(lambda: m.experts(x, bad, w), "expert id = E", "FM_E_RANGE")
    if e is not None:
        check(e.message == _lib.lib().fm_last_error().decode(), "expert id = E: the message is not the library's")
    raises(lambda: m.experts(x, ids[:, :-1], w), "topk_ids of the wrong shape", "FM_E_ARG", ("topk_ids",))
    raises(lambda: m.experts(x, ids.astype(np.float32), w), "topk_ids float", "FM_E_ARG", ("topk_ids",))
    raises(lambda: m(x, token_ids=np.zeros(2, np.int32)), "token_ids of the wrong length", "FM_E_ARG",
           ("token_ids",))

    def tens(**change):
        t2 = dict(T)
        for n, v in change.items():
            if v is None:
                del t2[n]
            else:
                t2[n] = v
        return lambda: fp4moe.MoE.from_tensors(d, layer, t2)

    raises(tens(w13_weight_scale=T["w13_weight_scale"].astype(np.float32)), "w13_weight_scale float32",
           "FM_E_FORMAT", ("w13_weight_scale", "dtype"))
    raises(tens(w2_weight=T["w2_weight"][:, :-1]), "w2_weight of the wrong shape", "FM_E_FORMAT",
           ("w2_weight", "shape"))
    raises(tens(w2_weight=None), "w2_weight missing", "FM_E_NOTFOUND", ("w2_weight",))
    raises(tens(w13_weight=np.repeat(T["w13_weight"], 2, axis=-1)[..., ::2]), "w13_weight with an inner stride of 2",
           "FM_E_FORMAT", ("w13_weight", "stride"))
    raises(tens(w13_weight=T["w13_weight"][:, ::-1]), "w13_weight with a negative stride", "FM_E_ARG",
           ("w13_weight",))
    raises(tens(bogus=T["w2_weight"]), "an unknown tensor name", "FM_E_ARG", ("bogus", "w13_weight"))
    raises(tens(w2_weight=[1, 2, 3]), "a list for a tensor", "FM_E_ARG", ("w2_weight",))
    raises(lambda: fp4moe.MoE.from_tensors(d, layer, T, layout="nvfp4"), "an unknown layout", "FM_E_ARG",
           ("modelopt_nvfp4",))
    raises(lambda: fp4moe.MoE.from_tensors(d, layer, T, device="tpu"), "an unknown device", "FM_E_ARG",
           ("tpu",))
    raises(lambda: fp4moe.MoE.from_checkpoint(os.path.join(d, "absent"), 1), "a missing checkpoint", None,
           ("absent",))
    raises(lambda: fp4moe.MoE.from_checkpoint(d, 0), "a dense layer", None, ("layer 0",))
    raises(lambda: fp4moe.MoE.from_checkpoint(d, 1, max_tokens=0), "max_tokens 0", "FM_E_ARG", ("max_tokens",))
    m4 = fp4moe.MoE.from_checkpoint(d, layer)
    m4.close()
    raises(lambda: m4(x), "a closed layer", "FM_E_ARG", ("closed",))
    try:
        fp4moe.MoE()
        check(False, "MoE() directly did not raise")
    except TypeError:
        pass


# ------------------------------------------------------------------ others
def case_random(tmp):
    d = gen(tmp, "tiny-qwen3", "nvfp4", seed=5)
    x = rng.standard_normal((4, 128)).astype(np.float32)
    a = fp4moe.MoE.from_checkpoint(d, 1)
    b = fp4moe.MoE.random("tiny-qwen3", 1, seed=5)
    c = fp4moe.MoE.random(d, 1, seed=5)
    ok = check(same(a(x), b(x)) and same(a(x), c(x)), "MoE.random differs from the gen'd checkpoint")
    ok &= check(not same(a(x), fp4moe.MoE.random("tiny-qwen3", 1, seed=6)(x)), "MoE.random ignores the seed")
    if ok:
        print("ok   MoE.random equals `fp4moe gen`'s checkpoint bit for bit")
    raises(lambda: fp4moe.MoE.random("no-such-preset", 1), "an unknown preset", None, ("no-such-preset",))


def case_describe(m):
    s = m.describe()
    eng = _lib.lib().fm_cpu_engine_describe(m._cpu).decode()
    check(eng in s and "nvfp4" in s and f"H={m.hidden}" in s, f"describe(): {s!r}")
    ki = m.kernel_info
    check(ki["backend"] == "cpu" and ki["engine"] == eng, f"kernel_info: {ki}")
    check(fp4moe.cuda_available()[0] in (True, False), "cuda_available")
    check("tiny-deepseek" in fp4moe.presets(), "presets()")
    hdr = open(os.path.join(SRC, "include", "fp4moe.h")).read()
    v = re.search(r'#define FM_VERSION "([^"]+)"', hdr).group(1)
    check(fp4moe.__version__ == v, f"__version__ {fp4moe.__version__} != FM_VERSION {v}")
    print(f"ok   describe(): {s.splitlines()[-1]}")


LAYOUT_STRUCTS = [("fm_model_desc", _lib.ModelDesc, True), ("fm_tensor", _lib.Tensor, False),
                  ("fm_layer_tensors", _lib.LayerTensors, False), ("fm_moe_out", _lib.MoeOut, False),
                  ("fm_kernel_config", _lib.KernelConfig, False), ("fm_tune_key", _lib.TuneKey, True),
                  ("fm_tune_choice", _lib.TuneChoice, True), ("fm_moe_layer", _lib.MoeLayerHead, None)]


def case_layouts(tmp):
    """offsetof / sizeof of every mirrored structure, by a C compiler."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not check(cc is not None, "no C compiler for the structure layout check"):
        return
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "fp4moe.h"', "int main(void) {"]
    for cname, st, _ in LAYOUT_STRUCTS:
        lines.append(f'printf("{cname} sizeof %zu\\n", sizeof({cname}));')
        for f, _t in st._fields_:
            if not f.startswith("_"):
                lines.append(f'printf("{cname} {f} %zu\\n", offsetof({cname}, {f}));')
    lines.append("return 0; }")
    src, exe = os.path.join(tmp, "layout.c"), os.path.join(tmp, "layout")
    open(src, "w").write("\n".join(lines))
    r = subprocess.run([cc, "-std=c11", "-I", os.path.join(SRC, "include"), src, "-o", exe], capture_output=True,
                       text=True)
    if not check(r.returncode == 0, f"layout program did not compile: {r.stderr[-2000:]}"):
        return
    got = {}
    for ln in subprocess.run([exe], capture_output=True, text=True, check=True).stdout.splitlines():
        s, f, v = ln.split()
        got[(s, f)] = int(v)
    n = 0
    for cname, st, spare in LAYOUT_STRUCTS:
        for f, _t in st._fields_:
            if f.startswith("_"):
                continue
            n += check(getattr(st, f).offset == got[(cname, f)],
                       f"{cname}.{f}: offset {getattr(st, f).offset} in ctypes, {got[(cname, f)]} in C")
        size = got[(cname, "sizeof")]
        if spare is True:
            check(st._spare.offset == size, f"{cname}: C size {size}, ctypes fields end at {st._spare.offset}")
        elif spare is False:
            check(__import__("ctypes").sizeof(st) == size, f"{cname}: sizeof {size} in C, "
                  f"{__import__('ctypes').sizeof(st)} in ctypes")
    print(f"ok   structure layouts: {n} offsets match include/fp4moe.h")


def to_torch(torch, v):
    """A CPU tensor of a NumPy array (ml_dtypes' types through their bytes)."""
    v = np.array(v, copy=True, order="C")  # writable, as torch wants
    special = {"float8_e4m3fn": torch.float8_e4m3fn, "bfloat16": torch.bfloat16}
    if v.dtype.name in special:
        return torch.from_numpy(v.view(np.uint8)).view(special[v.dtype.name])
    return torch.from_numpy(v)


def case_torch(d, m, T, x, what):
    try:
        import torch
    except ImportError:
        print("note torch not importable: the torch ops on CPU tensors are not checked here")
        return
    fp4moe.register_torch_ops()
    xt = torch.from_numpy(x)
    out, ids, w = m(x, return_routing=True)
    o2, i2, w2 = m(xt, return_routing=True)
    check(isinstance(o2, torch.Tensor) and same(o2.numpy(), out) and same(i2.numpy(), ids) and same(w2.numpy(), w),
          f"{what}: torch op on CPU tensors differs from the NumPy path")
    o3 = m(xt)
    check(same(o3.numpy(), out), f"{what}: torch op without routing differs")
    eids, ew = random_routing(x.shape[0], m.n_experts, m.topk)
    check(same(m.experts(xt, torch.from_numpy(eids), torch.from_numpy(ew)).numpy(), m.experts(x, eids, ew)),
          f"{what}: torch experts op differs")
    # CPU torch tensors into from_tensors
    Tt = {n: to_torch(torch, v) for n, v in T.items()}
    m2 = fp4moe.MoE.from_tensors(d, m.layer, Tt, max_tokens=32)
    check(same(m2(xt).numpy(), out), f"{what}: from_tensors with torch CPU tensors differs")
    for args, kw in (((xt, m.handle, None, True, True), {}), ((xt, m.handle, None, False, True), {})):
        torch.library.opcheck(torch.ops.fp4moe.moe.default, args, kw)
    torch.library.opcheck(torch.ops.fp4moe.experts.default,
                          (xt, m.handle, torch.from_numpy(eids), torch.from_numpy(ew), True, True))
    print(f"ok   {what}: torch ops on CPU tensors equal the NumPy path; opcheck passes")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        case_layouts(tmp)
        d = gen(tmp, "tiny-deepseek", "nvfp4")
        m, cfg, t, x = case_oracle(d, 1, 7, "tiny-deepseek/nvfp4")
        T = case_from_tensors_modelopt(d, m, cfg, t, x, 1, "tiny-deepseek/nvfp4")
        case_errors(d, m, T, 1)
        case_describe(m)
        case_torch(d, m, T, x, "tiny-deepseek/nvfp4")
        g = gen(tmp, "tiny-gptoss", "mxfp4")
        mg, _, tg, xg = case_oracle(g, 1, 6, "tiny-gptoss/mxfp4")
        case_from_tensors_gptoss(g, mg, tg, xg, 1, "tiny-gptoss/mxfp4")
        case_random(tmp)
    check.finish("the Python package matches the float64 oracle and the C library")


if __name__ == "__main__":
    main()
