#!/usr/bin/env python3
"""Decode throughput of Hugging Face transformers models on fp4moe's experts
against transformers' own (grouped_mm experts, BF16), in one run.

Models: Qwen3-30B-A3B and DeepSeek-V3 at their real shapes (config.json
values; DeepSeek-V3 with MLA attention as transformers implements it),
cut to a few decoder layers, all of them MoE, with random BF16 weights.
Each batch size decodes with a StaticCache; one decode step (forward,
greedy argmax fed back as the next input) is captured in a CUDA graph and
replayed, so the GPU, not Python, sets the time. Both variants run on the
same model: first transformers' experts, then fp4moe.hf.swap_moe_blocks
(write_back off: the BF16 experts are dropped layer by layer as the NVFP4
copies are made) and fp4moe's experts. The static cache's attention reads
the whole cache (--context positions, masked) at every step.

--profile DIR also records the decode steps of two batch sizes
(--profile-batches, default 32 and 80) with torch.profiler, exports Chrome
traces (gzip) into DIR and runs `fp4moe trace summary` and `fp4moe trace
diff` on them: time per kernel category and each category's share of the
cost of the larger batch over the smaller.

Prints, last, the throughput table (with --profile, the breakdown tables
come before it); --json writes everything.

    python3 dev/hf_decode_bench.py --json hf_bench.json --profile prof/

The library is $FP4MOE_LIBRARY, else libfp4moe.so beside the fp4moe CLI
(--fp4moe-cli, $FM_CLI, or build*/fp4moe in the source tree).
"""
import argparse
import csv
import gc
import glob
import io
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Real shapes (the models' config.json values in transformers 5 spelling).
MODELS = {
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rms_norm_eps=1e-6, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "deepseek-v3": dict(
        model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=0, num_attention_heads=128,
        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, vocab_size=129280, max_position_embeddings=163840, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "rope_theta": 10000.0}),
}
# The same families at tiny sizes (--tiny), to check the script without a GPU.
TINY = {
    "qwen3-30b-a3b": dict(MODELS["qwen3-30b-a3b"], hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          num_experts=8, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, vocab_size=128, max_position_embeddings=1024),
    "deepseek-v3": dict(MODELS["deepseek-v3"], hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, num_attention_heads=4,
                        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
                        qk_nope_head_dim=16, v_head_dim=16, vocab_size=128,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
PROMPT = 8  # prefill tokens per sequence (the static cache's size, not the prompt, sets attention's cost)


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def find_cli(arg):
    cands = [arg, os.environ.get("FM_CLI")]
    cands += sorted(glob.glob(os.path.join(ROOT, "build*", "fp4moe")))
    cands.append(shutil.which("fp4moe"))
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def param_counts(c):
    """BF16 parameters per decoder layer (all) and per layer's routed experts."""
    H = c["hidden_size"]
    if c["model_type"] == "qwen3_moe":
        E, I = c["num_experts"], c["moe_intermediate_size"]
        nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        attn = H * nh * hd * 2 + 2 * H * nkv * hd
        shared = 0
    else:
        E, I = c["n_routed_experts"], c["moe_intermediate_size"]
        nh, ql, kvl = c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
        rope, nope, v = c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
        attn = H * ql + ql * nh * (nope + rope) + H * (kvl + rope) + kvl * nh * (nope + v) + nh * v * H
        shared = 3 * H * I * c["n_shared_experts"]
    experts = 3 * E * H * I
    return attn + experts + shared + E * H, experts, 2 * c["vocab_size"] * H


def fit_layers(torch, c, want):
    """Decoder layers that fit: the BF16 model, plus during the swap one
    layer's NVFP4 copies twice (the quantized tensors and the engine's
    repacked copy; each layer's BF16 experts go as its copy comes, so the
    model never holds more than BF16 layers + those), and room for
    activations, quantization temporaries, CUDA graphs and the cache."""
    free, _ = torch.cuda.mem_get_info()
    per_layer, experts, emb = param_counts(c)
    fp4 = experts * (0.5 + 1 / 16)
    margin = 16e9
    n = int((free - margin - 2 * emb - 2 * fp4) // (2 * per_layer))
    return max(1, min(want, n)), free


def build(torch, spec, layers, experts_impl, dev):
    from transformers import AutoConfig, AutoModelForCausalLM
    spec = dict(spec)
    mt = spec.pop("model_type")
    cfg = AutoConfig.for_model(mt, num_hidden_layers=layers, **spec)
    torch.manual_seed(0)
    with torch.device(dev):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa",
                                             experts_implementation=experts_impl)
    return m.eval()


class Decoder:
    """A StaticCache decode loop at batch B. On CUDA one step is captured in
    a CUDA graph (eager steps if capture fails); on the CPU steps run eagerly."""

    def __init__(self, torch, model, B, context, dev):
        from transformers import StaticCache
        self.torch, self.model, self.B, self.cuda = torch, model, B, dev == "cuda"
        self.cache = StaticCache(config=model.config, max_cache_len=context)
        self.context = context
        g = torch.Generator(device=dev).manual_seed(B)
        V = model.config.vocab_size
        prompt = torch.randint(0, V, (B, PROMPT), device=dev, generator=g)
        with torch.no_grad():
            out = model(input_ids=prompt, past_key_values=self.cache, use_cache=True)
            self.ids = out.logits[:, -1].argmax(-1, keepdim=True).contiguous()
        self.pos = PROMPT
        self.graph, self.mode, self.error = None, "eager", None
        if not self.cuda:
            return
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        try:
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                self._step(count=False)
            self.graph, self.mode = gr, "cuda-graph"
        except Exception as e:  # noqa: BLE001 -- reported in the table's mode column
            self.error = f"{type(e).__name__}: {e}"
            log(f"CUDA graph capture failed at batch {B} ({self.error}); timing eager steps")
            torch.cuda.synchronize()

    def _step(self, count=True):
        with self.torch.no_grad():
            out = self.model(input_ids=self.ids, past_key_values=self.cache, use_cache=True)
            self.ids.copy_(out.logits[:, -1].argmax(-1, keepdim=True))
        if count:
            self.pos += 1

    def step(self):
        if self.pos >= self.context:
            raise RuntimeError(f"the static cache of {self.context} positions is full (raise --context)")
        if self.graph is not None:
            self.graph.replay()
            self.pos += 1
        else:
            self._step()

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def time(self, steps):
        """Milliseconds per decode step."""
        torch = self.torch
        for _ in range(3):
            self.step()
        self.sync()
        if not self.cuda:
            t0 = time.perf_counter()
            for _ in range(steps):
                self.step()
            return (time.perf_counter() - t0) * 1e3 / steps
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(steps):
            self.step()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) / steps

    def profile(self, path):
        from torch.profiler import ProfilerActivity, profile, schedule
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        with profile(activities=acts, schedule=schedule(wait=1, warmup=1, active=5, repeat=1),
                     on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
            for _ in range(7):
                self.step()
                self.sync()  # every step's kernels are in the trace before the next marker
                prof.step()

    def close(self):
        self.graph = None
        self.cache = None
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()


def run_variant(torch, model, label, args, results, traces):
    for B in args.batches:
        d = Decoder(torch, model, B, args.context, args.device)
        ms = d.time(args.steps)
        results.append({"label": label, "batch": B, "ms_per_step": ms, "tok_s": B * 1000.0 / ms, "mode": d.mode,
                        "capture_error": d.error})
        log(f"{label} B={B}: {ms:.3f} ms/step, {B * 1000.0 / ms:.1f} tok/s ({d.mode})")
        if args.profile and B in args.profile_batches:
            path = os.path.join(args.profile, f"{label.replace('/', '-')}-b{B}.trace.json.gz")
            d.profile(path)
            traces[(label, B)] = path
            log(f"{label} B={B}: trace {path}")
        d.close()


def bench_model(torch, name, args, out):
    import fp4moe
    import fp4moe.hf
    spec = TINY[name] if args.tiny else MODELS[name]
    cuda = args.device == "cuda"
    layers = args.layers
    if cuda:
        layers, free = fit_layers(torch, spec, args.layers)
        if layers < args.layers:
            log(f"{name}: {layers} of {args.layers} layers fit in {free / 1e9:.0f} GB free")
    t0 = time.time()
    model = build(torch, spec, layers, "grouped_mm", args.device)
    mem = f", {torch.cuda.memory_allocated() / 1e9:.1f} GB allocated" if cuda else ""
    log(f"{name}: {layers} layers built in {time.time() - t0:.1f} s{mem}")
    runs, traces = [], {}
    g = torch.Generator(device=args.device).manual_seed(1)
    probe = torch.randint(0, model.config.vocab_size, (2, PROMPT), device=args.device, generator=g)
    blocks = record_blocks(torch, model)
    with torch.no_grad():
        ref_logits = model(input_ids=probe).logits.float()
    for h in blocks.pop("_hooks"):
        h.remove()
    if "transformers" in args.variants:
        run_variant(torch, model, f"{name}/transformers", args, runs, traces)
    if "fp4moe" in args.variants:
        t0 = time.time()
        fp4moe.hf.swap_moe_blocks(model, write_back=False, max_tokens=max(512, PROMPT * max(args.batches)))
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        moe = next(m for m in model.modules() if isinstance(m, fp4moe.hf.FP4MoEBlock)).moe
        try:
            desc = moe.describe(max(args.batches))
        except fp4moe.Error as e:
            desc = f"(describe: {e})"
        mem = f", {torch.cuda.memory_allocated() / 1e9:.1f} GB allocated" if cuda else ""
        log(f"{name}: swapped to fp4moe in {time.time() - t0:.1f} s{mem}; {desc}")
        out.setdefault("fp4moe_kernels", {})[name] = desc
        # the same prefill's logits on fp4moe's NVFP4 experts: close to, not equal to, the BF16 experts'
        with torch.no_grad():
            lg = model(input_ids=probe).logits.float()
        cos = float(torch.nn.functional.cosine_similarity(lg.flatten(), ref_logits.flatten(), dim=0))
        rel = float((lg - ref_logits).abs().max() / ref_logits.abs().max())
        out.setdefault("logits_vs_bf16", {})[name] = {"cosine": cos, "max_rel": rel}
        log(f"{name}: prefill logits on fp4moe vs BF16 experts: cosine {cos:.5f}, max |d| / max {rel:.3g}")
        per_block = compare_blocks(torch, model, blocks)
        out["logits_vs_bf16"][name].update(per_block)
        log(f"{name}: each MoE block on the BF16 run's inputs: cosine min {per_block['block_cosine_min']:.5f} "
            f"(layers {' '.join(f'{c:.4f}' for c in per_block['block_cosine'])}), top-k choices differing "
            f"{100 * per_block['routing_changed']:.2f} %")
        del blocks
        run_variant(torch, model, f"{name}/fp4moe", args, runs, traces)
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    for r in runs:
        r["model"], r["layers"] = name, layers
        r["variant"] = r["label"].split("/", 1)[1]
    out["runs"].extend(runs)
    return traces


def record_blocks(torch, model):
    """Hooks that keep, for each MoE block, the input and output of the next
    forward and its router's top-k ids (the BF16 reference prefill)."""
    import fp4moe.hf
    rec = {"_hooks": []}
    for name, _, blk in fp4moe.hf._moe_blocks(model):
        r = rec.setdefault(name, {})
        router = blk.gate if hasattr(blk, "gate") else blk.router

        def keep_io(mod, args, out, r=r):
            r["x"], r["y"] = args[0].detach().clone(), (out[0] if isinstance(out, tuple) else out).detach().clone()

        def keep_ids(mod, args, out, r=r):
            r["ids"] = out[2].detach().clone()

        rec["_hooks"] += [blk.register_forward_hook(keep_io), router.register_forward_hook(keep_ids)]
    return rec


def compare_blocks(torch, model, rec):
    """Each swapped block on the input its transformers block had in the
    reference prefill: the cosine of the outputs (NVFP4 against BF16
    experts, the same routing but for near ties) and the share of top-k
    choices that differ. A block that computed something else than
    transformers' would stand out here, whatever the layers before it did."""
    cos, changed, total = [], 0, 0
    for name, r in rec.items():
        blk = model.get_submodule(name)
        x = r["x"]
        with torch.no_grad():
            y = blk(x)
            y = y[0] if isinstance(y, tuple) else y
            _, ids, _ = blk.moe(x.reshape(-1, x.shape[-1]).contiguous(), return_routing=True)
        cos.append(float(torch.nn.functional.cosine_similarity(y.float().flatten(), r["y"].float().flatten(), dim=0)))
        a, b = ids.long().sort(-1).values.cpu(), r["ids"].long().sort(-1).values.cpu()
        for t in range(a.shape[0]):
            changed += a.shape[1] - len(set(a[t].tolist()) & set(b[t].tolist()))
            total += a.shape[1]
    return {"block_cosine": cos, "block_cosine_min": min(cos), "routing_changed": changed / max(1, total)}


def analyze(cli, traces, args, out):
    """fp4moe trace summary / diff of each variant's two batch sizes."""
    a_b, b_b = args.profile_batches
    tables = []
    for label in sorted({lab for lab, _ in traces}):
        if (label, a_b) not in traces or (label, b_b) not in traces:
            continue
        fa, fb = traces[(label, a_b)], traces[(label, b_b)]
        base = os.path.join(args.profile, label.replace("/", "-"))
        for B, f in ((a_b, fa), (b_b, fb)):
            subprocess.run([cli, "trace", "summary", f, "--top", "40", "-o", f"{base}-b{B}.summary.txt"], check=True)
        subprocess.run([cli, "trace", "diff", fa, fb, "--top", "40", "-o", f"{base}.diff.txt"], check=True)
        d = subprocess.run([cli, "trace", "diff", fa, fb, "--format", "csv"], check=True, capture_output=True,
                           text=True).stdout
        rows = list(csv.DictReader(io.StringIO(d)))
        coverage = []
        for B, f in ((a_b, fa), (b_b, fb)):
            j = json.loads(subprocess.run([cli, "trace", "summary", f, "--format", "json"], check=True,
                                          capture_output=True, text=True).stdout)["combined"]["steps"]
            timed = next((r["ms_per_step"] for r in out["runs"] if r["label"] == label and r["batch"] == B), None)
            coverage.append({"batch": B, "steps": j["count"], "wall_ms": j["wall_ms"], "busy_ms": j["busy_ms"],
                             "outside_events": j["outside_events"], "timed_ms": timed, "method": j["method"]})
        other = []
        for B, f in ((a_b, fa), (b_b, fb)):
            s = subprocess.run([cli, "trace", "summary", f, "--format", "csv"], check=True, capture_output=True,
                               text=True).stdout
            for r in csv.DictReader(io.StringIO(s)):
                if r["category"] == "other" and r["name"] not in [o["name"] for o in other]:
                    other.append({"name": r["name"], "batch": B, "total_us": float(r["total_us"])})
        tables.append({"label": label, "a_batch": a_b, "b_batch": b_b, "categories": [
            {"category": r["category"], "a_ms": float(r["a_ms_per_step"]), "b_ms": float(r["b_ms_per_step"]),
             "delta_ms": float(r["delta_ms"]),
             "share": float(r["share_of_delta"]) if r["share_of_delta"] not in ("nan", "") else None}
            for r in rows], "uncategorized": other, "coverage": coverage, "diff_text": f"{base}.diff.txt"})
    out["breakdown"] = tables
    return tables


def print_tables(out, tables):
    if tables:
        for t in tables:
            if t["uncategorized"]:
                print(f"\n{t['label']}: kernels fp4moe trace files under 'other':")
                for o in t["uncategorized"]:
                    print(f"  {o['total_us']:10.1f} us  (B={o['batch']})  {o['name']}")
    if out.get("logits_vs_bf16"):
        print()
    for name, v in out.get("logits_vs_bf16", {}).items():
        print(f"{name}: prefill logits with fp4moe's NVFP4 experts vs transformers' BF16 experts: "
              f"cosine {v['cosine']:.5f}, max |d| / max |logit| {v['max_rel']:.3g}; each block on the same "
              f"input: cosine >= {v['block_cosine_min']:.5f}, top-k choices differing {100 * v['routing_changed']:.2f} %")
    for t in tables:
        print(f"\n{t['label']}: ms per decode step by kernel category, B={t['a_batch']} -> B={t['b_batch']} "
              f"(share: of the step's growth)")
        print(f"{'category':14s} {'B=' + str(t['a_batch']):>9s} {'B=' + str(t['b_batch']):>9s} {'delta':>9s} "
              f"{'share':>7s}")
        for c in t["categories"]:
            if c["a_ms"] == 0 and c["b_ms"] == 0 and c["category"] != "total":
                continue
            share = f"{100 * c['share']:6.1f}%" if c["share"] is not None else f"{'-':>7s}"
            print(f"{c['category']:14s} {c['a_ms']:9.3f} {c['b_ms']:9.3f} {c['delta_ms']:+9.3f} {share}")
        # the profiled steps against the timed ones: a trace that misses part of a step shows here
        for c in t.get("coverage", []):
            timed = f"{c['timed_ms']:.3f}" if c["timed_ms"] else "-"
            frac = f" ({100 * c['wall_ms'] / c['timed_ms']:.0f} % of it)" if c["timed_ms"] else ""
            print(f"  B={c['batch']}: {c['steps']} profiled steps, GPU window {c['wall_ms']:.3f} ms/step{frac}, busy "
                  f"{c['busy_ms']:.3f} ms; timed step {timed} ms; {c['outside_events']} GPU events outside the steps")
    print(f"\ndecode throughput ({out['device']}; {out['context']}-position static cache; "
          f"torch {out['torch']}, transformers {out['transformers']})")
    print(f"{'model':15s} {'layers':>6s} {'batch':>5s} {'tok/s fp4moe':>13s} {'tok/s transformers':>19s} "
          f"{'ratio':>6s}  mode")
    by = {}
    for r in out["runs"]:
        by.setdefault((r["model"], r["layers"], r["batch"]), {})[r["variant"]] = r
    for (model, layers, B), v in by.items():
        f, t = v.get("fp4moe"), v.get("transformers")
        ratio = f"{f['tok_s'] / t['tok_s']:6.2f}" if f and t else f"{'-':>6s}"
        modes = "/".join(sorted({x["mode"] for x in v.values()}))
        print(f"{model:15s} {layers:6d} {B:5d} {f['tok_s'] if f else float('nan'):13.1f} "
              f"{t['tok_s'] if t else float('nan'):19.1f} {ratio}  {modes}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-30b-a3b,deepseek-v3", help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--batches", default="1,8,32,80")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (fewer where memory is short)")
    ap.add_argument("--context", type=int, default=512, help="static cache positions (attention reads them all)")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per batch size")
    ap.add_argument("--variants", default="transformers,fp4moe")
    ap.add_argument("--profile", metavar="DIR", help="also trace two batch sizes and break the step down")
    ap.add_argument("--profile-batches", default="32,80")
    ap.add_argument("--fp4moe-cli", help="the fp4moe CLI (default: $FM_CLI, build*/fp4moe, PATH)")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: eager steps on fp4moe's CPU engine (with --tiny, to check the script)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes of the same families")
    args = ap.parse_args()
    try:
        args.batches = [int(x) for x in args.batches.split(",")]
        args.profile_batches = [int(x) for x in args.profile_batches.split(",")]
    except ValueError:
        ap.error("--batches and --profile-batches take comma lists of integers")
    if any(b < 1 for b in args.batches) or len(args.profile_batches) != 2:
        ap.error("batches must be positive; --profile-batches takes two")
    models = args.models.split(",")
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r} (known: {', '.join(MODELS)})")
    args.variants = args.variants.split(",")
    if not set(args.variants) <= {"transformers", "fp4moe"} or not args.variants:
        ap.error("--variants takes transformers and / or fp4moe")
    if args.profile:
        for b in args.profile_batches:
            if b not in args.batches:
                args.batches.append(b)
        os.makedirs(args.profile, exist_ok=True)
    need = PROMPT + 2 + 3 + args.steps + (7 if args.profile else 0)
    if need > args.context:
        ap.error(f"--context {args.context} is too small for {need} positions")
    cli = find_cli(args.fp4moe_cli)
    if cli and not os.environ.get("FP4MOE_LIBRARY"):
        so = os.path.join(os.path.dirname(os.path.abspath(cli)), "libfp4moe.so")
        if os.path.exists(so):
            os.environ["FP4MOE_LIBRARY"] = so
    sys.path.insert(0, os.path.join(ROOT, "python"))

    import torch
    import transformers
    import fp4moe
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("hf_decode_bench: no CUDA GPU (--device cpu --tiny checks the script on the CPU)")
        ok, why = fp4moe.cuda_available()
        if not ok and "fp4moe" in args.variants:
            sys.exit(f"hf_decode_bench: fp4moe's CUDA engine is not available: {why}")
    out = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
           "transformers": transformers.__version__, "context": args.context, "steps": args.steps,
           "library": fp4moe.library_path(), "runs": []}
    log(f"{out['device']}, torch {out['torch']}, transformers {out['transformers']}, library {out['library']}")
    traces = {}
    for m in models:
        traces.update(bench_model(torch, m, args, out))
    tables = []
    if args.profile:
        if cli is None:
            log("no fp4moe CLI found: the traces are in the profile folder, not analysed")
        else:
            tables = analyze(cli, traces, args, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print_tables(out, tables)


if __name__ == "__main__":
    main()
