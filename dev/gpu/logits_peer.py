#!/usr/bin/env python3
"""The router logits as cuBLAS computes them, timed the way fp4moe's benchmark is.

x [T, H] BF16 times a router [E, H] BF16, FP32 sums (torch.mm with BF16 out,
and with FP32 out where this torch has out_dtype), `--layers` distinct routers
back to back in one CUDA graph, median of `--reps` replays per batch size.
Put beside `dev/tools/cuda_bench --preset P` (its "logits" column times
fp4moe's logits kernel alone in graphs of the same shape).

  python3 dev/gpu/logits_peer.py --E 256 --H 6144 --batch 1,4,16,64,256
"""
import argparse
import statistics
import sys

from torch_gpu import cuda_torch


def positive(s):
    v = int(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{s} is not a positive integer")
    return v


def batch_list(s):
    try:
        b = [int(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch {s!r}: not a list of integers") from None
    if not b or any(x < 1 or x > 65536 for x in b):
        raise argparse.ArgumentTypeError(f"--batch {s!r}: sizes are 1 .. 65536")
    return b


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--E", type=positive, default=256)
    ap.add_argument("--H", type=positive, default=6144)
    ap.add_argument("--batch", type=batch_list, default=[1, 4, 16, 64, 256])
    ap.add_argument("--layers", type=positive, default=8)
    ap.add_argument("--reps", type=positive, default=50)
    a = ap.parse_args()
    torch = cuda_torch()
    if torch is None:
        return 77
    dev = torch.device("cuda")
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name()}; E {a.E}, H {a.H}, {a.layers} routers")
    g = torch.Generator(device=dev)
    g.manual_seed(1)
    routers = [torch.randn(a.E, a.H, device=dev, generator=g).to(torch.bfloat16) for _ in range(a.layers)]
    outs = ["bf16"]
    try:
        torch.mm(routers[0][:1], routers[0].t(), out_dtype=torch.float32)
        outs.append("f32")
    except (TypeError, RuntimeError):
        pass
    print(f"{'B':>5} " + " ".join(f"{'cuBLAS ' + o + ', us':>16}" for o in outs))
    for T in a.batch:
        x = torch.randn(T, a.H, device=dev, generator=g).to(torch.bfloat16)
        row = []
        for o in outs:
            def step():
                for w in routers:
                    if o == "f32":
                        torch.mm(x, w.t(), out_dtype=torch.float32)
                    else:
                        torch.mm(x, w.t())
            step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            for _ in range(3):
                graph.replay()
            ts = []
            for _ in range(a.reps):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                graph.replay()
                e.record()
                e.synchronize()
                ts.append(s.elapsed_time(e) * 1e3 / a.layers)
            row.append(statistics.median(ts))
        print(f"{T:5d} " + " ".join(f"{t:16.2f}" for t in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
