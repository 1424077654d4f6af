#!/usr/bin/env python3
"""PyTorch's own grouped MoE on the GPU, timed the way fp4moe's benchmark is.

Routed experts only (no shared expert), uniform random routing (top-k of
random scores per token, as the real routers give on random weights), the
layer E/H/I/k shape, `--layers` layers back to back in one CUDA graph, each
with its own routing; two weight sets alternate between the layers (the
active experts of one layer, 300 MB at B=1 in BF16, already exceed the 60 MB
L2 cache).

  bf16: torch._grouped_mm (gate_up, SiLU*up, down, routing weight, combine)
  fp8:  torch._scaled_grouped_mm with per-token activation scales and
        per-output-channel weight scales (activation quantization timed too)

Prints one line per (peer, B) and writes JSON lines to --json.
"""
import argparse
import json
import math
import sys

from torch_gpu import cuda_torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--E", type=int, default=256)
    ap.add_argument("--H", type=int, default=4096)
    ap.add_argument("--I", type=int, default=2048)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--batch", default="1,4,16,64,256,512")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch = cuda_torch()
    if torch is None:
        return 77
    import torch.nn.functional as F
    dev = torch.device("cuda")
    E, H, I, k = a.E, a.H, a.I, a.k
    batches = [int(b) for b in a.batch.split(",")]
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name()}")
    have_bf16 = hasattr(torch, "_grouped_mm")
    have_fp8 = hasattr(torch, "_scaled_grouped_mm")
    print(f"# torch._grouped_mm: {have_bf16}, torch._scaled_grouped_mm: {have_fp8}")
    jf = open(a.json, "a") if a.json else None
    g = torch.Generator(device=dev)
    g.manual_seed(1)

    def weights(dtype):
        free = torch.cuda.mem_get_info()[0]
        per = E * 3 * H * I * (2 if dtype == torch.bfloat16 else 1)
        nsets = max(1, min(a.layers, 2, int(free * 0.6 // per)))
        sets = []
        for _ in range(nsets):
            # [E, out, in] contiguous; the kernels take the transposed view
            w13 = (torch.randn(E, 2 * I, H, device=dev, generator=g) / math.sqrt(H))
            w2 = (torch.randn(E, H, I, device=dev, generator=g) / math.sqrt(I))
            if dtype == torch.bfloat16:
                sets.append((w13.to(torch.bfloat16), w2.to(torch.bfloat16), None, None))
            else:
                s13 = w13.abs().amax(dim=2).float() / 448.0
                s2 = w2.abs().amax(dim=2).float() / 448.0
                q13 = (w13 / s13.unsqueeze(2)).to(torch.float8_e4m3fn)
                q2 = (w2 / s2.unsqueeze(2)).to(torch.float8_e4m3fn)
                sets.append((q13, q2, s13, s2))
            del w13, w2
        torch.cuda.empty_cache()
        return sets

    def group(ids, T):
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(E, dtype=torch.int32, device=dev).index_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return order, offs

    def layer_bf16(x, ids, wts, ws):
        w13, w2, _, _ = ws
        T = x.shape[0]
        order, offs = group(ids, T)
        tok = order // k
        xs = x.index_select(0, tok)
        gu = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)
        h = F.silu(gu[:, :I]) * gu[:, I:]
        y = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
        y = y.float() * wts.flatten().index_select(0, order).unsqueeze(1)
        return torch.zeros(T, H, device=dev, dtype=torch.float32).index_add_(0, tok, y)

    def quant_rows(t):
        s = t.abs().amax(dim=1).float().clamp(min=1e-12) / 448.0
        return (t.float() / s.unsqueeze(1)).to(torch.float8_e4m3fn), s

    def layer_fp8(x, ids, wts, ws):
        q13, q2, s13, s2 = ws
        T = x.shape[0]
        order, offs = group(ids, T)
        tok = order // k
        xs = x.index_select(0, tok)
        xq, xsc = quant_rows(xs)
        gu = torch._scaled_grouped_mm(xq, q13.transpose(-2, -1), xsc, s13, offs=offs, out_dtype=torch.bfloat16)
        h = F.silu(gu[:, :I]) * gu[:, I:]
        hq, hsc = quant_rows(h)
        y = torch._scaled_grouped_mm(hq, q2.transpose(-2, -1), hsc, s2, offs=offs, out_dtype=torch.bfloat16)
        y = y.float() * wts.flatten().index_select(0, order).unsqueeze(1)
        return torch.zeros(T, H, device=dev, dtype=torch.float32).index_add_(0, tok, y)

    def run(name, fn, dtype):
        try:
            ws = weights(dtype)
        except Exception as e:  # noqa: BLE001
            print(f"{name}: weights failed: {e}")
            return
        bytes_per_expert = 3 * H * I * (2 if dtype == torch.bfloat16 else 1)
        for T in batches:
            try:
                x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
                ids, wts = [], []
                for _ in range(a.layers):
                    sc = torch.rand(T, E, device=dev, generator=g)
                    top = sc.topk(k, dim=1)
                    ids.append(top.indices.sort(dim=1).values.contiguous())
                    wts.append(torch.softmax(top.values, dim=1).contiguous())
                active = sum(int(torch.unique(i).numel()) for i in ids) / a.layers

                def step():
                    outs = []
                    for li in range(a.layers):
                        outs.append(fn(x, ids[li], wts[li], ws[li % len(ws)]))
                    return outs

                step()
                torch.cuda.synchronize()
                graph = None
                try:
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        step()
                    torch.cuda.current_stream().wait_stream(s)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        step()
                except Exception as e:  # noqa: BLE001
                    print(f"# {name} B={T}: CUDA graph capture failed ({type(e).__name__}), timing eager")
                    graph = None
                replay = graph.replay if graph is not None else step
                for _ in range(3):
                    replay()
                torch.cuda.synchronize()
                times = []
                for _ in range(a.reps):
                    e0 = torch.cuda.Event(enable_timing=True)
                    e1 = torch.cuda.Event(enable_timing=True)
                    e0.record()
                    replay()
                    e1.record()
                    e1.synchronize()
                    times.append(e0.elapsed_time(e1) * 1e3 / a.layers)
                times.sort()
                us = times[len(times) // 2]
                gbs = active * bytes_per_expert / (us * 1e-6) / 1e9
                print(f"{name:10s} B={T:4d} active {active:6.1f} {us:9.1f} us/layer {gbs:7.0f} GB/s"
                      f"{'' if graph is not None else ' (eager)'}")
                if jf:
                    jf.write(json.dumps({"peer": name, "B": T, "us": us, "active": active, "gbs": gbs,
                                         "graph": graph is not None}) + "\n")
                del graph
            except Exception as e:  # noqa: BLE001
                print(f"{name:10s} B={T:4d} failed: {type(e).__name__}: {str(e)[:200]}")
        del ws
        torch.cuda.empty_cache()

    if have_bf16:
        run("torch-bf16", layer_bf16, torch.bfloat16)
    else:
        print("torch-bf16: torch._grouped_mm not present")
    if have_fp8:
        run("torch-fp8", layer_fp8, torch.float8_e4m3fn)
    else:
        print("torch-fp8: torch._scaled_grouped_mm not present")
    if jf:
        jf.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
