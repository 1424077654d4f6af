#!/usr/bin/env python3
"""Real PyTorch profiler traces for tests/py_trace_aggregate.py: profiles a
few decode-like steps of a small MoE-like torch model with torch.profiler on
a CUDA GPU and writes gzipped Chrome traces, each under 300 KB.

    python3 dev/make_test_traces.py OUT_DIR [--device cuda] [--layers 2]

OUT_DIR is tests/data/traces/real for the test. A case whose file would be
300 KB or more is made again with fewer layers. Needs torch with CUDA; with
--device cpu it runs anywhere, to try the script, but those traces have no
GPU events and the test refuses them.

The model has no embedding: each layer is a layernorm, a QKV matmul,
scaled_dot_product_attention of one new token per sequence against a KV
cache, an output matmul, a layernorm, a softmax router with top-k, and the
routed experts (SiLU-gated MLPs) run one of two ways:
  loop    the tokens sorted by expert, one gate/up and down matmul per active
          expert, the results scattered back with index_add_ (eager, with the
          host reading the per-expert counts: device-to-host copies)
  gather  every token's k experts' weights gathered and applied with bmm,
          added back with index_add_ (no host synchronisation, so the step
          can be one CUDA graph, replayed)
Each step also copies its new tokens from pinned host memory (host-to-device
copies). The profiler's schedule(wait=1, warmup=1, active=3) records steps 3
to 5, so each trace has three ProfilerStep#N spans.
"""
import argparse
import gzip
import os
import re
import sys
import tempfile

MAX_BYTES = 300 * 1000

# name, dtype, batch, experts, top-k, expert kernel, CUDA graph
CASES = [
    ("moe_loop_bf16_b1", "bfloat16", 1, 16, 2, "loop", False),
    ("moe_loop_bf16_b8", "bfloat16", 8, 8, 2, "loop", False),
    ("moe_gather_f16_b4", "float16", 4, 8, 2, "gather", False),
    ("moe_gather_bf16_b4_graph", "bfloat16", 4, 8, 2, "gather", True),
]


def build(torch, dev, dtype, n_layers, E, k, H=256, I=256, heads=4, kv_len=64, B=1):
    g = torch.Generator(device="cpu").manual_seed(1234)

    def w(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(device=dev, dtype=dtype)

    layers = []
    for _ in range(n_layers):
        layers.append({
            "ln1": torch.nn.LayerNorm(H).to(device=dev, dtype=dtype),
            "ln2": torch.nn.LayerNorm(H).to(device=dev, dtype=dtype),
            "wqkv": w(H, 3 * H, scale=H ** -0.5),
            "wo": w(H, H, scale=H ** -0.5),
            "wr": w(H, E, scale=H ** -0.5),
            "w1": w(E, H, 2 * I, scale=H ** -0.5),
            "w2": w(E, I, H, scale=I ** -0.5),
            "k": w(B, heads, kv_len, H // heads, scale=1.0),
            "v": w(B, heads, kv_len, H // heads, scale=1.0),
        })
    return layers


def experts_loop(torch, x, ids, wts, w1, w2):
    """Tokens grouped by expert; one matmul pair per active expert."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()  # device-to-host
    tok = order // k
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start:start + n]
        rows = tok[start:start + n]
        start += n
        h = x.index_select(0, rows) @ w1[e]
        gate, up = h.chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ w2[e]
        y = y * wts.reshape(-1)[sel].unsqueeze(1).to(y.dtype)
        out.index_add_(0, rows, y)
    return out


def experts_gather(torch, x, ids, wts, w1, w2):
    """Every token's k experts' weights gathered and applied with bmm."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    rows = torch.arange(T, device=x.device).unsqueeze(1).expand(T, k).reshape(-1)
    xs = x.index_select(0, rows).unsqueeze(1)
    h = torch.bmm(xs, w1.index_select(0, flat))
    gate, up = h.chunk(2, dim=-1)
    y = torch.bmm(torch.nn.functional.silu(gate) * up, w2.index_select(0, flat)).squeeze(1)
    y = y * wts.reshape(-1).unsqueeze(1).to(y.dtype)
    out = torch.zeros_like(x)
    out.index_add_(0, rows, y)
    return out


def forward(torch, layers, x, k, kind, heads=4):
    F = torch.nn.functional
    B, H = x.shape
    for L in layers:
        h = L["ln1"](x)
        q, kk, v = (h @ L["wqkv"]).split(H, dim=-1)
        q = q.view(B, heads, 1, H // heads)
        kc = torch.cat([L["k"][:, :, 1:], kk.view(B, heads, 1, H // heads)], dim=2)
        vc = torch.cat([L["v"][:, :, 1:], v.view(B, heads, 1, H // heads)], dim=2)
        a = F.scaled_dot_product_attention(q, kc, vc)
        x = x + a.reshape(B, H) @ L["wo"]
        h = L["ln2"](x)
        p = torch.softmax((h @ L["wr"]).float(), dim=-1)
        wts, ids = torch.topk(p, k, dim=-1)
        wts = wts / wts.sum(dim=-1, keepdim=True)
        f = experts_loop if kind == "loop" else experts_gather
        x = x + f(torch, h, ids, wts, L["w1"], L["w2"])
    return x


def profile_case(torch, out_dir, tmp, dev, case, n_layers):
    name, dtname, B, E, k, kind, graph = case
    from torch.profiler import ProfilerActivity, profile, schedule

    dtype = getattr(torch, dtname)
    H = 256
    layers = build(torch, dev, dtype, n_layers, E, k, H=H, B=B)
    host = torch.randn(B, H, generator=torch.Generator().manual_seed(7)).to(dtype)
    if dev == "cuda":
        host = host.pin_memory()
    x_dev = torch.empty(B, H, device=dev, dtype=dtype)
    step_fn = None
    if graph:
        # capture after a warm-up on a side stream, as torch's docs ask
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                forward(torch, layers, x_dev, k, kind)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y_static = forward(torch, layers, x_dev, k, kind)

        def step_fn():
            g.replay()
            return y_static
    else:
        def step_fn():
            return forward(torch, layers, x_dev, k, kind)

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    raw = os.path.join(tmp, name + ".json")
    if os.path.exists(raw):
        os.remove(raw)

    def ready(prof):
        prof.export_chrome_trace(raw)

    with torch.no_grad(), profile(activities=acts, schedule=schedule(wait=1, warmup=1, active=3),
                                  on_trace_ready=ready) as prof:
        for _ in range(5):
            x_dev.copy_(host, non_blocking=True)
            y = step_fn()
            # the host reads one value, as a decode loop reads its next token
            float(y[0, 0])
            prof.step()
    if not os.path.exists(raw):
        raise RuntimeError("the profiler wrote no trace for " + name)
    data = open(raw, "rb").read()
    # the trace names its temporary path and the machine: neither is needed
    data = data.replace((tmp + os.sep).encode(), b"")
    data = re.sub(rb'"host_name": "[^"]*"', b'"host_name": "host"', data)
    path = os.path.join(out_dir, name + ".json.gz")
    with open(path, "wb") as f:
        f.write(gzip.compress(data, compresslevel=9, mtime=0))
    return path, len(data), os.path.getsize(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--layers", type=int, default=2, help="MoE layers of the model (fewer: smaller traces)")
    a = ap.parse_args()
    if a.layers < 1 or a.layers > 8:
        print("make_test_traces: --layers needs 1 .. 8", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        print("make_test_traces: torch is not installed", file=sys.stderr)
        return 2
    if a.device == "cuda" and not torch.cuda.is_available():
        print("make_test_traces: no CUDA device (torch.cuda.is_available() is false)", file=sys.stderr)
        return 2
    if a.device == "cpu":
        print("make_test_traces: --device cpu: the traces have no GPU events; not for tests/data", file=sys.stderr)
    os.makedirs(a.out_dir, exist_ok=True)
    torch.manual_seed(0)
    too_big = 0
    with tempfile.TemporaryDirectory(prefix="fm_traces_") as tmp:
        for case in CASES:
            if case[6] and a.device != "cuda":
                print("%-28s skipped: a CUDA graph needs --device cuda" % case[0])
                continue
            # fewer layers until the file fits
            for layers in range(a.layers, 0, -1):
                path, raw, size = profile_case(torch, a.out_dir, tmp, a.device, case, layers)
                if size < MAX_BYTES:
                    break
                os.remove(path)
            note = ""
            if size >= MAX_BYTES:
                too_big += 1
                note = "  TOO LARGE (limit %d bytes) even with 1 layer, removed" % MAX_BYTES
            print("%-28s %d layer%s %8d bytes gzip (%9d bytes JSON)  %s%s" %
                  (case[0], layers, "" if layers == 1 else "s", size, raw, path, note))
    if torch.cuda.is_available():
        print("device: %s, torch %s" % (torch.cuda.get_device_name(0), torch.__version__))
    return 1 if too_big else 0


if __name__ == "__main__":
    sys.exit(main())
