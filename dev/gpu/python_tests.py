#!/usr/bin/env python3
"""The Python package's torch ops on a CUDA GPU (dev/gpu/python.sh runs it).

Checks, each printed as it runs, then a summary and the benchmark table last:
  - torch.library.opcheck on fp4moe::moe and fp4moe::experts;
  - the routing against the float32 NumPy router of tests/py_forward.py;
  - the op's output against a torch float32 reference on the dequantized
    weights (E2M1 table, E4M3 / E8M0 block scales, scale_2; the op's own
    routing): relative error <= 1e-2 (the kernels round activations to BF16
    for the tensor cores; see TOL);
  - equality with the C path on the same inputs (fm_cuda_forward with host
    buffers, through ctypes, on the same engine and layer) up to the order of
    the k-way combine's float atomic additions, which varies from run to run
    (routing ids and weights bit for bit); bit for bit on the atomic-free
    splitk kernels (forced by fm_cuda_engine_set_config), the op, the C call
    and a CUDA-graph replay alike;
  - experts(moe's routing) equals moe, and experts with ids < 0 / int64;
  - CUDA-graph capture and replay equal eager (up to the combine order);
  - from_tensors with torch device tensors (ModelOpt layout stacked from
    the checkpoint; the gpt-oss layout) equals from_checkpoint (likewise);
  - torch.compile(fullgraph=True) of functions calling the ops;
  - cuBLAS inside a torch process: the engine names the cuBLAS it loaded
    (the process's own, once torch is imported), and a BF16 call of 130
    tokens, whose router logits take the tiled shape and so cuBLAS, routes
    as the float32 router does and matches the torch float32 reference;
  - errors raise before the call: T > max_tokens, ids >= E, a CPU tensor,
    a non-contiguous tensor.
Benchmark: DeepSeek-V4-Flash at B = 1, 8 layers of seeded random weights
(the ones `fp4moe bench` builds), the op called 8 times inside one CUDA graph,
against `fp4moe bench --device cuda --preset deepseek-v4-flash --batch 1
--layers 8` (µs per layer, median of replays); then the per-call timing
(per_call: eager µs per call of each op and of the C call, against a graph
replay; `--per-call` runs it alone).

Environment: FP4MOE_LIBRARY (libfp4moe.so with CUDA), FM_CLI (the fp4moe
CLI). Exit 0 when every check passed, 1 otherwise, 77 without torch or GPU.
"""
import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

try:
    import numpy as np
    import torch
except ImportError as e:
    print(f"SKIPPED: {e}")
    sys.exit(77)
# --reference-only: the torch reference against the float64 NumPy oracle
# alone, on the CPU (a check of the reference that needs no GPU)
REF_ONLY = "--reference-only" in sys.argv[1:]
# --cpu-dry-run: the same checks on the CPU engine with CPU tensors where they
# apply (graphs, the C path and the benchmark need the GPU), to try the
# script itself where there is no GPU
DRY = "--cpu-dry-run" in sys.argv[1:]
# --per-call: only the eager / graph per-call timing (per_call)
PER_CALL = "--per-call" in sys.argv[1:]
if not REF_ONLY and not DRY and not torch.cuda.is_available():
    print("SKIPPED: torch sees no CUDA device")
    sys.exit(77)
CLI = os.environ.get("FM_CLI")
if not CLI or not os.access(CLI, os.X_OK):
    print("SKIPPED: FM_CLI (the fp4moe CLI) not set")
    sys.exit(77)

import py_forward as pf  # noqa: E402  (the NumPy oracle's reader and router)
import fp4moe  # noqa: E402
from fp4moe import _lib  # noqa: E402

DEV = torch.device("cpu" if REF_ONLY or DRY else "cuda:0")
ENGINE = "cpu" if DRY else "cuda"
RESULTS = []
# BF16 activations (x and the intermediate h, each rounded to 2^-9
# relative) against a float32 reference: up to ~1e-2 on the norm at these
# tiny shapes (a few terms per output); the C tests' 5e-3 is against float64
# with the same BF16 inputs on both sides
TOL = 1e-2


def record(name, ok, detail=""):
    RESULTS.append((name, bool(ok), detail))
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    return ok


def step(name):
    """Runs a check function; an exception is a failure with its traceback."""
    def wrap(f):
        try:
            f()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            record(name, False, f"{type(e).__name__}: {e}")
        return f
    return wrap


def sync():
    if not DRY and not REF_ONLY:
        torch.cuda.synchronize()


def same(a, b):
    """Bit for bit (bytes of the values, on the host)."""
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return False
    bytes_of = lambda v: v.detach().cpu().contiguous().view(torch.uint8)  # noqa: E731
    return torch.equal(bytes_of(a), bytes_of(b))


def same_out(a, b, tol=2.0 ** -20):
    """Two runs' outputs: equal up to the order of the k-way combine's float
    atomic additions (the shared expert adds from its own stream), i.e.
    within tol (2^-20) of the largest magnitude; ids and weights stay
    bit-exact."""
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return False
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return bool(torch.isfinite(a).all()) and float((a - b).abs().max()) <= tol * max(float(b.abs().max()), 1e-30)


def rel_err(got, ref):
    got, ref = got.double(), ref.double()
    return float(((got - ref).abs().amax(dim=1) / ref.abs().amax(dim=1).clamp_min(1e-30)).max())


def gen(tmp, preset, fmt, layers=2, seed=9):
    d = os.path.join(tmp, f"{preset}-{fmt}")
    if not os.path.exists(d):
        subprocess.run([CLI, "gen", "--preset", preset, "--format", fmt, "--layers", str(layers), "--seed", str(seed),
                        "--out", d, "--quiet"], check=True)
    return d


def to_dev(a):
    """A NumPy array (ml_dtypes' types included) as a CUDA tensor of the
    same dtype."""
    a = np.array(a, copy=True, order="C")
    special = {"float8_e4m3fn": torch.float8_e4m3fn, "bfloat16": torch.bfloat16}
    t = torch.from_numpy(a.view(np.uint8) if a.dtype.name in special else a)
    if a.dtype.name in special:
        t = t.view(special[a.dtype.name])
    return t.to(DEV)


# ------------------------------------------------------- torch reference
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32)


def deq_codes(packed):
    """[R, K/2] bytes (low nibble = even element) -> [R, K] float32."""
    p = packed.to(torch.int64)
    lut = E2M1.to(packed.device)
    return torch.stack([lut[p & 15], lut[p >> 4]], dim=-1).reshape(p.shape[0], -1)


def deq_nvfp4(packed, scales, scale2):
    s = scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1)
    return deq_codes(packed) * s * float(scale2)


def deq_mxfp4(packed, scales):
    s = torch.exp2(scales.to(torch.float32) - 127).repeat_interleave(32, dim=1)
    return deq_codes(packed) * s


def torch_layer(t, cfg, layer):
    """Dequantized weights of one layer in float32 on the GPU, from the
    checkpoint's tensors: experts [(gate, up, down, gate_b, up_b, down_b)]."""
    u8 = lambda n: torch.from_numpy(np.array(pf.arr(t, n)).view(np.uint8)).to(DEV)  # noqa: E731
    f32 = lambda n: torch.from_numpy(np.array(pf.arr(t, n), dtype=np.float32)).to(DEV)  # noqa: E731
    if cfg["model_type"] == "gpt_oss":
        pre = f"model.layers.{layer}.mlp.experts"
        gub, gus, gubias = u8(pre + ".gate_up_proj_blocks"), u8(pre + ".gate_up_proj_scales"), \
            f32(pre + ".gate_up_proj_bias")
        db, ds, dbias = u8(pre + ".down_proj_blocks"), u8(pre + ".down_proj_scales"), f32(pre + ".down_proj_bias")
        ex = []
        for e in range(gub.shape[0]):
            gu = deq_mxfp4(gub[e].reshape(gub.shape[1], -1), gus[e])
            dn = deq_mxfp4(db[e].reshape(db.shape[1], -1), ds[e])
            ex.append((gu[0::2], gu[1::2], dn, gubias[e][0::2], gubias[e][1::2], dbias[e]))
        return {"experts": ex}
    pre = f"model.layers.{layer}.mlp"

    def mat(base):
        return deq_nvfp4(u8(base + ".weight"), u8(base + ".weight_scale"), pf.arr(t, base + ".weight_scale_2"))

    E = cfg["n_routed_experts"]
    L = {"experts": [tuple(mat(f"{pre}.experts.{e}.{p}_proj") for p in ("gate", "up", "down")) + (0, 0, 0)
                     for e in range(E)]}
    if f"{pre}.shared_experts.gate_proj.weight" in t:
        L["shared"] = tuple(mat(f"{pre}.shared_experts.{p}_proj") for p in ("gate", "up", "down"))
    return L


def torch_act(cfg, g, u):
    if cfg["model_type"] == "gpt_oss":
        lim = cfg.get("swiglu_limit", 7.0)
        g = g.clamp(max=lim)
        u = u.clamp(-lim, lim)
        return g * torch.sigmoid(1.702 * g) * (u + 1)
    return torch.nn.functional.silu(g) * u


def torch_experts(cfg, L, x, ids, w, include_shared=True):
    x = x.float()
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for i in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[i, j])
            if e < 0:
                continue
            g, u, d, gb, ub, db = L["experts"][e]
            out[i] += float(w[i, j]) * (d @ torch_act(cfg, g @ x[i] + gb, u @ x[i] + ub) + db)
        if include_shared and "shared" in L:
            g, u, d = L["shared"]
            out[i] += d @ torch_act(cfg, g @ x[i], u @ x[i])
    return out


def random_routing(T, E, k, gen_, neg=True):
    ids = torch.stack([torch.randperm(E, generator=gen_)[:k] for _ in range(T)]).to(torch.int64)
    if neg:
        ids[0, 0] = -1
    w = torch.rand(T, k, generator=gen_) * 0.9 + 0.1
    return ids.to(DEV), w.to(DEV)


# ------------------------------------------------------------------ checks
def c_forward(m, x):
    """fm_cuda_forward (host buffers in and out) on the same engine and layer."""
    xh = x.detach().cpu().contiguous()
    T, H, k = xh.shape[0], m.hidden, m.topk
    out = np.empty((T, H), np.float32)
    ids = np.empty((T, k), np.int32)
    w = np.empty((T, k), np.float32)
    o = _lib.MoeOut(out.ctypes.data, ids.ctypes.data, w.ctypes.data)
    dt = {torch.float32: _lib.DT["F32"], torch.bfloat16: _lib.DT["BF16"], torch.float16: _lib.DT["F16"]}[xh.dtype]
    sync()
    _lib.call("fm_cuda_forward", m._cuda, ctypes.byref(m._desc), m._clayer, xh.data_ptr(), dt, T, None,
              ctypes.byref(o))
    return torch.from_numpy(out), torch.from_numpy(ids), torch.from_numpy(w)


def check_reference(tmp, preset, fmt, layer, T):
    """The torch float32 reference against the float64 NumPy oracle of
    tests/py_forward.py on the oracle's own routing."""
    what = f"{preset}/{fmt}"
    d = gen(tmp, preset, fmt)
    cfg = json.load(open(os.path.join(d, "config.json")))
    t = pf.read_ckpt(d)
    oracle = pf.load_layer(t, cfg, None, layer)
    x = np.random.default_rng(3).standard_normal((T, cfg["hidden_size"])).astype(np.float32)
    ids, w = pf.route(cfg, oracle, x, layer, None)
    ref = pf.moe(cfg, oracle, x, ids, w)
    got = torch_experts(cfg, torch_layer(t, cfg, layer), torch.from_numpy(x).to(DEV), torch.from_numpy(ids),
                        torch.from_numpy(w))
    e = rel_err(got.cpu(), torch.from_numpy(ref))
    record(f"{what}: torch float32 reference vs float64 oracle", e <= 1e-5, f"relative error {e:.2e}")


def check_blas(tmp):
    """cuBLAS in a torch process (see the module's docstring)."""
    what = "cuBLAS in a torch process"
    preset, fmt, layer, T = "tiny-deepseek", "nvfp4", 1, 130
    d = gen(tmp, preset, fmt)
    cfg = json.load(open(os.path.join(d, "config.json")))
    t = pf.read_ckpt(d)
    m = fp4moe.MoE.from_checkpoint(d, layer, device=ENGINE, max_tokens=T)
    try:
        desc = m.describe(T)
        print(desc)
        if ENGINE == "cuda":
            engine = desc.splitlines()[1]
            record(f"{what}: the engine loaded cuBLAS", re.search(r", cuBLAS [0-9]", engine) is not None, engine)
        g = torch.Generator().manual_seed(13)
        x = torch.randn(T, m.hidden, generator=g).to(torch.bfloat16).to(DEV)
        out, ids, w = m(x, return_routing=True)
        sync()
        xf = x.float()
        rids, rw = pf.route(cfg, pf.load_layer(t, cfg, None, layer), xf.cpu().numpy(), layer, None)
        record(f"{what}: BF16 T={T} routing vs the float32 router", np.array_equal(ids.cpu().numpy(), rids) and
               np.allclose(w.cpu().numpy(), rw, rtol=1e-4, atol=1e-6),
               f"ids equal {np.array_equal(ids.cpu().numpy(), rids)}, weights max diff "
               f"{np.abs(w.cpu().numpy() - rw).max():.2e}")
        e = rel_err(out.float(), torch_experts(cfg, torch_layer(t, cfg, layer), xf, ids, w))
        record(f"{what}: BF16 T={T} vs torch float32", e <= TOL, f"relative error {e:.2e} (bound {TOL})")
    finally:
        m.close()


def check_layer(tmp, preset, fmt, layer, T):
    what = f"{preset}/{fmt}"
    d = gen(tmp, preset, fmt)
    cfg = json.load(open(os.path.join(d, "config.json")))
    t = pf.read_ckpt(d)
    m = fp4moe.MoE.from_checkpoint(d, layer, device=ENGINE, max_tokens=64)
    print(m.describe(T))
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, m.hidden, generator=g).to(DEV)
    H, E, k = m.hidden, m.n_experts, m.topk
    out, ids, w = m(x, return_routing=True)
    sync()

    @step(f"{what}: routing vs the float32 router")
    def _():
        oracle = pf.load_layer(t, cfg, None, layer)
        rids, rw = pf.route(cfg, oracle, x.cpu().numpy(), layer, None)
        record(f"{what}: routing vs the float32 router", np.array_equal(ids.cpu().numpy(), rids) and
               np.allclose(w.cpu().numpy(), rw, rtol=1e-4, atol=1e-6),
               f"ids equal {np.array_equal(ids.cpu().numpy(), rids)}, weights max diff "
               f"{np.abs(w.cpu().numpy() - rw).max():.2e}")

    L = torch_layer(t, cfg, layer)

    @step(f"{what}: moe vs torch float32")
    def _():
        e = rel_err(out, torch_experts(cfg, L, x, ids, w))
        record(f"{what}: moe vs torch float32 reference", e <= TOL, f"relative error {e:.2e} (bound {TOL})")

    @step(f"{what}: C path")
    def _():
        if DRY:
            return
        co, ci, cw = c_forward(m, x)
        record(f"{what}: op == fm_cuda_forward up to the combine order", same_out(out.cpu(), co) and same(ids.cpu(), ci) and
               same(w.cpu(), cw), f"max diff {float((out.cpu() - co).abs().max()):.3g}")
        xb = x.to(torch.bfloat16)
        ob = m(xb)
        cob, _, _ = c_forward(m, xb)
        record(f"{what}: bf16 input: op == fm_cuda_forward up to the combine order", same_out(ob.cpu(), cob))

    @step(f"{what}: experts")
    def _():
        ex = m.experts(x, ids, w)
        record(f"{what}: experts(moe's routing) == moe", same_out(ex, out),
               f"max diff {float((ex - out).abs().max()):.3g}")
        rid, rw_ = random_routing(T, E, k, g)
        for shared in (True, False):
            got = m.experts(x, rid, rw_, include_shared=shared)
            e = rel_err(got, torch_experts(cfg, L, x, rid, rw_, shared))
            record(f"{what}: experts (ids < 0, int64, include_shared={shared}) vs torch float32", e <= TOL,
                   f"relative error {e:.2e}")
        record(f"{what}: experts int32 ids == int64 ids",
               same_out(m.experts(x, rid.to(torch.int32), rw_), m.experts(x, rid, rw_)))

    @step(f"{what}: opcheck")
    def _():
        rid, rw_ = random_routing(T, E, k, g)
        res = [torch.library.opcheck(torch.ops.fp4moe.moe.default, (x, m.handle, None, rr, True))
               for rr in (True, False)]
        res.append(torch.library.opcheck(torch.ops.fp4moe.experts.default,
                                         (x, m.handle, rid.to(torch.int32), rw_, True, True)))
        ok = all(v == "SUCCESS" for r in res for v in r.values())
        record(f"{what}: torch.library.opcheck (moe x2, experts)", ok, str(res[0]))

    @step(f"{what}: CUDA graph")
    def _():
        if DRY:
            return
        xs = x.clone()
        rid, rw_ = random_routing(T, E, k, g)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):  # warm-up outside capture, as torch's docs ask
                m(xs)
                m.experts(xs, rid, rw_)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            go, gi, gw = m(xs, return_routing=True)
            ge = m.experts(xs, rid, rw_)
        ok = True
        for i in range(3):
            xn = torch.randn(T, H, generator=g).to(DEV)
            xs.copy_(xn)
            graph.replay()
            eo, ei, ew = m(xn, return_routing=True)
            ee = m.experts(xn, rid, rw_)
            sync()
            ok &= same_out(go, eo) and same(gi, ei) and same(gw, ew) and same_out(ge, ee)
        record(f"{what}: CUDA graph replay == eager (3 inputs)", ok)

    @step(f"{what}: atomic-free path, bit for bit")
    def _():
        """The splitk kernels add every partial sum in a fixed order (no
        atomics), so there the op, the C call and a graph replay must give
        the same bits; the other paths' k-way combine adds with float atomics
        in run-dependent order, which the checks above allow, and so does
        the splitk path's one-token launch (its kernel line names
        fm_fused1_kernel): there the outputs agree within 1e-5 of the
        largest, the routing still bit for bit."""
        if DRY:
            return
        kc = _lib.KernelConfig(3, 16, 3, 8, 1, 16 if T > 8 else 8, 0.1)  # FM_PATH_SPLITK, K in 3 chunks
        f = _lib.lib().fm_cuda_engine_set_config
        f.restype, f.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(_lib.KernelConfig)]
        if f(m._cuda, ctypes.byref(kc)) != 0:
            record(f"{what}: splitk config accepted", False, _lib.cstr(_lib.lib().fm_last_error()))
            return
        try:
            so, si, sw = m(x, return_routing=True)
            sync()
            got = _lib.KernelConfig()
            kern = ctypes.create_string_buffer(256)
            _lib.call("fm_cuda_layer_call_config", m._cuda, m._clayer, T, ctypes.byref(got), kern, 256, None, 0)
            record(f"{what}: the forced config runs the splitk kernels", got.path == 3 and b"splitk" in kern.value,
                   _lib.cstr(kern.value))
            # the one-token launch adds its experts' down rows with atomics
            one = b"fm_fused1_kernel" in kern.value
            eq = (lambda a, b: same_out(a, b, 1e-5)) if one else same
            how = "to 1e-5 (one-token launch)" if one else "bit for bit"
            co, ci, cw = c_forward(m, x)
            record(f"{what}: splitk: op == fm_cuda_forward {how}", eq(so.cpu(), co) and same(si.cpu(), ci)
                   and same(sw.cpu(), cw), f"max diff {float((so.cpu() - co).abs().max()):.3g}")
            record(f"{what}: splitk: experts(moe's routing) == moe {how}", eq(m.experts(x, si, sw), so))
            e = rel_err(so, torch_experts(cfg, L, x, si, sw))
            record(f"{what}: splitk: moe vs torch float32 reference", e <= TOL, f"relative error {e:.2e}")
            xs = x.clone()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    m(xs)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                go = m(xs)
            ok = True
            for i in range(3):
                xn = torch.randn(T, H, generator=g).to(DEV)
                xs.copy_(xn)
                graph.replay()
                sync()
                cn, _, _ = c_forward(m, xn)
                ok &= eq(go.cpu(), cn)
            record(f"{what}: splitk: CUDA graph replay == fm_cuda_forward {how} (3 inputs)", ok)
        finally:
            f(m._cuda, None)

    @step(f"{what}: torch.compile")
    def _():
        def f(a):
            return m(a) * 2.0 + 1.0

        def fe(a, i, ww):
            return m.experts(a, i, ww).sum(dim=1)

        cf = torch.compile(f, fullgraph=True)
        ce = torch.compile(fe, fullgraph=True)
        rid, rw_ = random_routing(T, E, k, g)
        ok1 = same_out(cf(x), f(x))
        ok2 = torch.allclose(ce(x, rid, rw_), fe(x, rid, rw_), rtol=1e-6, atol=1e-6)
        record(f"{what}: torch.compile(fullgraph=True) of moe and experts", ok1 and ok2, f"moe {ok1}, experts {ok2}")

    @step(f"{what}: errors")
    def _():
        cases = [("T > max_tokens", lambda: m(torch.randn(65, H, device=DEV)), "FM_E_RANGE"),
                 ("ids >= E", lambda: m.experts(x, torch.full((T, k), E, dtype=torch.int32, device=DEV), w),
                  "FM_E_RANGE"),
                 ("a tensor on another device", lambda: m(x.cpu() if not DRY else x.to("meta")), "FM_E_ARG"),
                 ("a non-contiguous tensor", lambda: m(torch.randn(H, T, device=DEV).t()), "FM_E_ARG"),
                 ("int8 hidden", lambda: m(x.to(torch.int8)), "FM_E_ARG")]
        for name, f, code in cases:
            try:
                f()
                record(f"{what}: error: {name}", False, "did not raise")
            except fp4moe.Error as e:
                record(f"{what}: error: {name}", e.code == code, str(e))

    return m, d, cfg, t, x, out


def check_from_tensors(m, d, t, x, layer, layout):
    what = f"from_tensors ({layout}, device tensors)"
    a = lambda n: pf.arr(t, n)  # noqa: E731
    pre = f"model.layers.{layer}.mlp"
    if layout == "modelopt_nvfp4":
        E = m.n_experts
        ex = lambda e, p, s: a(f"{pre}.experts.{e}.{p}_proj.{s}")  # noqa: E731
        T = {"w13_weight": np.stack([np.concatenate([ex(e, "gate", "weight"), ex(e, "up", "weight")])
                                     for e in range(E)]),
             "w13_weight_scale": np.stack([np.concatenate([ex(e, "gate", "weight_scale"), ex(e, "up", "weight_scale")])
                                           for e in range(E)]),
             "w13_weight_scale_2": np.array([[ex(e, "gate", "weight_scale_2"), ex(e, "up", "weight_scale_2")]
                                             for e in range(E)], np.float32),
             "w2_weight": np.stack([ex(e, "down", "weight") for e in range(E)]),
             "w2_weight_scale": np.stack([ex(e, "down", "weight_scale") for e in range(E)]),
             "w2_weight_scale_2": np.array([ex(e, "down", "weight_scale_2") for e in range(E)], np.float32),
             "router_w": a(pre + ".gate.weight"), "score_bias": a(pre + ".gate.e_score_correction_bias")}
        for p in ("gate", "up", "down"):
            b = f"{pre}.shared_experts.{p}_proj"
            T[f"shared_{p}"], T[f"shared_{p}_scale"], T[f"shared_{p}_scale_2"] = \
                a(b + ".weight"), a(b + ".weight_scale"), a(b + ".weight_scale_2")
    else:
        q = pre + ".experts."
        T = {"gate_up_blocks": a(q + "gate_up_proj_blocks"), "gate_up_scales": a(q + "gate_up_proj_scales"),
             "gate_up_bias": a(q + "gate_up_proj_bias"), "down_blocks": a(q + "down_proj_blocks"),
             "down_scales": a(q + "down_proj_scales"), "down_bias": a(q + "down_proj_bias"),
             "router_w": a(pre + ".router.weight"), "router_bias": a(pre + ".router.bias")}
    Td = {n: to_dev(v) for n, v in T.items()}
    m2 = fp4moe.MoE.from_tensors(d, layer, Td, layout=layout, device=ENGINE, max_tokens=64)
    del Td  # the views may go away once the layer is built
    o1, i1, w1 = m(x, return_routing=True)
    o2, i2, w2 = m2(x, return_routing=True)
    g = torch.Generator().manual_seed(5)
    rid, rw_ = random_routing(x.shape[0], m.n_experts, m.topk, g)
    ok = same_out(o1, o2) and same(i1, i2) and same(w1, w2) and same_out(m.experts(x, rid, rw_), m2.experts(x, rid, rw_))
    record(f"{what} == from_checkpoint up to the combine order", ok, f"max diff {float((o1 - o2).abs().max()):.3g}; "
           f"built by {m2._built_by or 'fm_moe_layer_from_tensors'}")


# --------------------------------------------------------------- benchmark
def moe_layers(desc, n):
    """The first n MoE layers of a model (those `fp4moe bench` builds)."""
    lib = _lib.lib()
    return [i for i in range(desc.n_layers) if lib.fm_model_is_moe_layer(ctypes.byref(desc), i)][:n]


def bench(tmp, preset="deepseek-v4-flash", n_layers=8, reps=50):
    rows = []
    js = os.path.join(tmp, "bench.json")
    r = subprocess.run([CLI, "bench", "--device", "cuda", "--preset", preset, "--batch", "1", "--layers", str(n_layers),
                        "--json", js], capture_output=True, text=True)
    print(r.stdout)
    c_us = float("nan")
    if r.returncode != 0:
        print(r.stderr)
        record("C bench ran", False, r.stderr.strip()[-300:])
    else:
        c_us = _find_us(json.load(open(js)))
    desc = _lib.ModelDesc()
    _lib.call("fm_preset_desc", preset.encode(), 0, ctypes.byref(desc))
    layers = moe_layers(desc, n_layers)
    ms = [fp4moe.MoE.random(preset, li, device="cuda", max_tokens=1, seed=1) for li in layers]
    print(ms[0].describe(1))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, ms[0].hidden, generator=g).to(DEV)
    vocab = desc.vocab_size
    tok = torch.randint(0, max(vocab, 1), (1,), generator=g, dtype=torch.int32).to(DEV)
    outs = []

    def step_all():
        outs.clear()
        for m in ms:
            outs.append(m(x, token_ids=tok if m.needs_token_ids else None, check=False))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step_all()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step_all()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        ev0.record()
        graph.replay()
        ev1.record()
        ev1.synchronize()
        times.append(ev0.elapsed_time(ev1) * 1e3 / len(ms))
    op_us = float(np.median(times))
    # eager, for the Python dispatch's cost beside the graph's
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        step_all()
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - t0) * 1e6 / (20 * len(ms))
    rows.append(("fp4moe bench (C, CUDA graph)", c_us))
    rows.append(("fp4moe::moe op x 8 in a CUDA graph", op_us))
    rows.append(("fp4moe::moe op eager (Python dispatch)", eager_us))
    record("benchmark ran", op_us == op_us and op_us > 0, f"op {op_us:.2f} us/layer, C {c_us:.2f}")
    return rows, c_us, op_us


def per_call(n=2000):
    """Eager µs per call of the torch ops (and of the C entry point through
    ctypes) against the same call replayed in a CUDA graph, B = 1, one layer:
    DeepSeek-V4-Flash (the GPU work is ~40 µs, so eager shows whether the
    host keeps ahead of it) and tiny-deepseek (a few µs of GPU work: eager is
    the host's cost per call). "issue" is the host's time to queue n calls
    (before the synchronization), "eager" the wall time of n calls and the
    synchronization, "graph" a replay of a one-call graph, all per call."""
    rows = []
    L = _lib.lib()
    for preset in ("deepseek-v4-flash", "tiny-deepseek"):
        desc = _lib.ModelDesc()
        _lib.call("fm_preset_desc", preset.encode(), 0, ctypes.byref(desc))
        li = moe_layers(desc, 1)[0]
        m = fp4moe.MoE.random(preset, li, device="cuda", max_tokens=64, seed=1)
        g = torch.Generator().manual_seed(2)
        x = torch.randn(1, m.hidden, generator=g).to(DEV).to(torch.bfloat16)
        ids, w = random_routing(1, m.n_experts, m.topk, g, neg=False)
        ids, w = ids.to(torch.int32).to(DEV), w.to(torch.float32).to(DEV)
        tok = torch.zeros(1, dtype=torch.int32, device=DEV)
        out = torch.empty(1, m.hidden, dtype=torch.float32, device=DEV)
        stream = torch.cuda.current_stream().cuda_stream
        c_exp = L.fm_cuda_experts

        def c_call():
            c_exp(m._cuda, m._clayer, x.data_ptr(), _lib.DT["BF16"], 1, ids.data_ptr(), w.data_ptr(), 0,
                  out.data_ptr(), stream)

        calls = [("fp4moe::experts op", lambda: m.experts(x, ids, w, include_shared=False, check=False)),
                 ("fp4moe::moe op", lambda: m(x, token_ids=tok if m.needs_token_ids else None, check=False)),
                 ("fm_cuda_experts (C, ctypes)", c_call)]
        print(m.describe(1))
        for name, f in calls:
            for _ in range(20):
                f()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                f()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            issue_us, eager_us = (t1 - t0) * 1e6 / n, (t2 - t0) * 1e6 / n
            gr = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                f()
            torch.cuda.current_stream().wait_stream(side)
            if name.startswith("fm_cuda"):
                with torch.cuda.graph(gr):
                    stream = torch.cuda.current_stream().cuda_stream
                    c_call()
                stream = torch.cuda.current_stream().cuda_stream
            else:
                with torch.cuda.graph(gr):
                    f()
            for _ in range(10):
                gr.replay()
            torch.cuda.synchronize()
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
            for _ in range(200):
                gr.replay()
            ev1.record()
            ev1.synchronize()
            graph_us = ev0.elapsed_time(ev1) * 1e3 / 200
            rows.append((preset, name, issue_us, eager_us, graph_us))
            print(f"{preset:<18} {name:<30} issue {issue_us:8.2f}  eager {eager_us:8.2f}  graph {graph_us:8.2f} us/call",
                  flush=True)
            del gr
        m.close()
    record("per-call timing ran", bool(rows) and all(r[3] == r[3] and r[3] > 0 for r in rows))
    return rows


def print_per_call(rows):
    if not rows:
        return
    print("\nB = 1, one layer, us per call (issue: host time to queue the calls; eager: wall time per call; "
          "graph: a one-call graph's replay)")
    print(f"{'preset':<18} {'call':<30} {'issue':>9} {'eager':>9} {'graph':>9}")
    for preset, name, a, b, c in rows:
        print(f"{preset:<18} {name:<30} {a:9.2f} {b:9.2f} {c:9.2f}")


def _find_us(doc):
    """us_per_layer of the first batch row in `fp4moe bench --json`."""
    stack = [doc]
    while stack:
        v = stack.pop(0)
        if isinstance(v, dict):
            if "us_per_layer" in v:
                return float(v["us_per_layer"])
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return float("nan")


def main():
    print(f"torch {torch.__version__}, {'CPU' if REF_ONLY or DRY else torch.cuda.get_device_name(0)}; "
          f"library {fp4moe.library_path()}")
    if not REF_ONLY and not DRY:
        ok, why = fp4moe.cuda_available()
        if not record("fp4moe.cuda_available()", ok, why):
            return summary([])
    fp4moe.register_torch_ops()
    rows = []
    if PER_CALL:
        pc = []
        try:
            pc = per_call()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            record("per-call timing ran", False, f"{type(e).__name__}: {e}")
        r = summary([])
        print_per_call(pc)
        return r
    with tempfile.TemporaryDirectory() as tmp:
        for preset, fmt in (("tiny-deepseek", "nvfp4"), ("tiny-gptoss", "mxfp4")):
            check_reference(tmp, preset, fmt, 1, 5)
        if REF_ONLY:
            return summary([])
        for preset, fmt, layout, T in (("tiny-deepseek", "nvfp4", "modelopt_nvfp4", 7),
                                       ("tiny-gptoss", "mxfp4", "gptoss_mxfp4", 6)):
            try:
                m, d, cfg, t, x, out = check_layer(tmp, preset, fmt, 1, T)
                check_from_tensors(m, d, t, x, 1, layout)
                m.close()
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                record(f"{preset}/{fmt}", False, f"{type(e).__name__}: {e}")
        try:
            check_blas(tmp)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            record("cuBLAS in a torch process", False, f"{type(e).__name__}: {e}")
        if DRY:
            return summary([])
        torch.cuda.empty_cache()
        try:
            rows, c_us, op_us = bench(tmp)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            record("benchmark ran", False, f"{type(e).__name__}: {e}")
        pc = []
        try:
            pc = per_call()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            record("per-call timing ran", False, f"{type(e).__name__}: {e}")
    r = summary(rows)
    print_per_call(pc)
    return r


def summary(rows):
    n_ok = sum(ok for _, ok, _ in RESULTS)
    n_bad = len(RESULTS) - n_ok
    for name, ok, detail in RESULTS:
        if not ok:
            print(f"FAIL {name}: {detail}")
    print(f"\n{n_ok} passed, {n_bad} failed")
    if rows:
        print("\nB = 1, DeepSeek-V4-Flash, 8 layers (us per layer, median of replays)")
        print(f"{'what':<42} {'us/layer':>9}")
        for name, us in rows:
            print(f"{name:<42} {us:9.2f}")
        if rows[0][1] == rows[0][1] and rows[0][1] > 0:
            print(f"{'op in a graph / C bench':<42} {rows[1][1] / rows[0][1]:9.3f}")
    return 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
