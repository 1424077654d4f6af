"""fp4moe.MoE: one MoE layer on the CPU engine (NumPy arrays) or the CUDA
engine (torch tensors, through the fp4moe::moe and fp4moe::experts ops)."""
import ctypes
import itertools
import json
import os
import threading
import weakref

from . import _lib, _torch_ops
from ._lib import (CPU_ISA, FM_E_ARG, FM_E_RANGE, LAYOUTS, QF, QF_NAME,
                   ROUTE_DSV4, DT, Error, KernelConfig, LayerTensors, ModelDesc, MoeLayerHead, MoeOut, TuneChoice,
                   TuneKey, call, fn, lib)
from ._tensors import device_of, fm_dtype_of, is_numpy, is_torch, torch_module, view

# handle (the int the torch ops take) -> open layer
_REGISTRY = weakref.WeakValueDictionary()
_IDS = itertools.count(1)
_HIDDEN_DT = {"F32": DT["F32"], "F16": DT["F16"], "BF16": DT["BF16"]}


def layer_by_handle(handle):
    m = _REGISTRY.get(int(handle))
    if m is None or m._closed:
        raise Error(FM_E_ARG, f"no open fp4moe layer has handle {handle} (closed or garbage-collected)")
    return m


def _parse_device(device):
    s = str(device)
    if s == "cpu":
        return "cpu", -1
    if s == "cuda":
        t = torch_module()
        idx = t.cuda.current_device() if t is not None and t.cuda.is_initialized() else 0
        return "cuda", idx
    if s.startswith("cuda:") and s[5:].isdigit():
        return "cuda", int(s[5:])
    raise Error(FM_E_ARG, f"device {s!r}: expected 'cpu', 'cuda' or 'cuda:N'")


def _read_json_text(x, what):
    if x is None:
        return None
    if isinstance(x, dict):
        return json.dumps(x)
    if isinstance(x, (str, os.PathLike)):
        try:
            with open(x, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise Error(_lib.FM_E_IO, f"{what}: cannot read {x}: {e.strerror}") from None
    raise Error(FM_E_ARG, f"{what}: expected a dict or a path, got {type(x).__name__}")


def _load_desc(config, quant_config=None):
    """A model description from a HF config dict, a config.json path or a
    checkpoint directory (with its hf_quant_config.json)."""
    d = ModelDesc()
    if isinstance(config, (str, os.PathLike)) and os.path.isdir(config) and quant_config is None:
        call("fm_model_desc_load", os.fsencode(config), ctypes.byref(d))
        return d
    if isinstance(config, (str, os.PathLike)) and os.path.isdir(config):
        config = os.path.join(config, "config.json")
    if quant_config is None and isinstance(config, (str, os.PathLike)):
        sib = os.path.join(os.path.dirname(os.path.abspath(config)), "hf_quant_config.json")
        if os.path.exists(sib):
            quant_config = sib
    cj = _read_json_text(config, "config").encode()
    qj = _read_json_text(quant_config, "quant_config")
    qj = qj.encode() if qj is not None else None
    call("fm_model_desc_parse", cj, len(cj), qj, len(qj) if qj is not None else 0, ctypes.byref(d))
    return d


def presets():
    """Names of the built-in model presets (MoE.random)."""
    L = lib()
    return [L.fm_preset_name(i).decode() for i in range(L.fm_preset_count())]


def cuda_available():
    """(True, "") when the library has its CUDA backend and a GPU is there,
    else (False, why)."""
    buf = ctypes.create_string_buffer(512)
    ok = fn("fm_cuda_available")(buf, len(buf))
    return bool(ok), buf.value.decode(errors="replace")


class MoE:
    """One MoE layer with its engine. Build it with from_checkpoint,
    from_tensors or random; call it on hidden states.

    CPU engine: NumPy arrays in and out (torch CPU tensors go through the
    torch ops and come back as tensors). CUDA engine: torch CUDA tensors,
    on torch's current stream, without host synchronization (check=False,
    or inside CUDA-graph capture, skips the one check that reads device
    data: the range of ids)."""

    def __init__(self, _token=None):
        if _token is not _CTOR:
            raise TypeError("use MoE.from_checkpoint, MoE.from_tensors or MoE.random")
        self._closed = True
        self._lock = threading.Lock()
        self._ckpt = self._hlayer = self._cpu = self._cuda = self._clayer = None
        self._desc = ModelDesc()

    # ------------------------------------------------------------ builders
    @classmethod
    def _new(cls, desc, layer, device, max_tokens, threads, isa):
        m = cls(_CTOR)
        m._desc = desc
        m.layer = int(layer)
        m._kind, m.device_index = _parse_device(device)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise Error(FM_E_ARG, f"max_tokens {max_tokens!r}: expected a positive integer")
        m.max_tokens = max_tokens
        m.hidden = desc.hidden
        m.n_experts = desc.n_experts
        m.topk = desc.topk
        m.inter = desc.moe_inter
        m._fmt = desc.expert_format
        m._has_router = True
        m._has_shared = desc.n_shared > 0
        m._built_by = None
        if isa not in CPU_ISA:
            raise Error(FM_E_ARG, f"isa {isa!r}: expected one of {', '.join(CPU_ISA)}")
        m._threads, m._isa = int(threads), isa
        m._closed = False
        return m

    def _open_engine(self):
        if self._kind == "cpu":
            e = ctypes.c_void_p()
            call("fm_cpu_engine_new", CPU_ISA[self._isa], self._threads, ctypes.byref(e))
            self._cpu = e
        else:
            e = ctypes.c_void_p()
            call("fm_cuda_engine_new", self.device_index, ctypes.byref(e))
            self._cuda = e

    def _finish(self):
        from . import _torch_ops
        if self._kind == "cuda":
            call("fm_cuda_engine_reserve", self._cuda, self._clayer, self.max_tokens)
            _torch_ops.register()
        elif torch_module() is not None:
            _torch_ops.register()
        self.handle = next(_IDS)
        _REGISTRY[self.handle] = self
        return self

    @classmethod
    def from_checkpoint(cls, path, layer, device="cpu", max_tokens=512, *, threads=0, isa="auto",
                        quantize_bf16=None):
        """Layer `layer` of a checkpoint directory (config.json, safetensors
        shards). quantize_bf16 ("nvfp4" / "mxfp4") quantizes BF16 experts on
        load; threads / isa pick the CPU engine's threads and kernels."""
        desc = ModelDesc()
        call("fm_model_desc_load", os.fsencode(path), ctypes.byref(desc))
        m = cls._new(desc, layer, device, max_tokens, threads, isa)
        try:
            q = QF["none"] if quantize_bf16 is None else QF.get(quantize_bf16)
            if q is None or q == QF["bf16"]:
                raise Error(FM_E_ARG, f"quantize_bf16 {quantize_bf16!r}: expected None, 'nvfp4' or 'mxfp4'")
            ck = ctypes.c_void_p()
            call("fm_ckpt_open", os.fsencode(path), ctypes.byref(ck))
            m._ckpt = ck
            hl = ctypes.c_void_p()
            call("fm_moe_layer_bind", ck, ctypes.byref(desc), m.layer, q, ctypes.byref(hl))
            m._hlayer = hl
            m._read_host_layer()
            m._open_engine()
            if m._kind == "cuda":
                cl = ctypes.c_void_p()
                call("fm_cuda_layer_upload", m._cuda, ctypes.byref(desc), hl, ctypes.byref(cl))
                m._clayer = cl
                m._free_host()  # the device holds a copy
            return m._finish()
        except BaseException:
            m.close()
            raise

    @classmethod
    def random(cls, config, layer, device="cpu", max_tokens=512, *, fmt=None, seed=1, threads=0, isa="auto"):
        """Seeded random weights, the values `fp4moe gen` and `fp4moe bench`
        use: config is a preset name (fp4moe.presets()), a HF config dict, a
        config.json path or a checkpoint directory. On CUDA the weights are
        generated on the GPU."""
        q = None if fmt is None else QF.get(fmt)
        if fmt is not None and (q is None or q == QF["none"]):
            raise Error(FM_E_ARG, f"fmt {fmt!r}: expected 'nvfp4', 'mxfp4' or 'bf16'")
        if isinstance(config, str) and not os.path.exists(config):
            desc = ModelDesc()
            call("fm_preset_desc", config.encode(), q if q is not None else QF["none"], ctypes.byref(desc))
        else:
            desc = _load_desc(config)
        q = desc.expert_format if q is None else q
        m = cls._new(desc, layer, device, max_tokens, threads, isa)
        m._fmt = q
        try:
            m._open_engine()
            if m._kind == "cpu":
                hl = ctypes.c_void_p()
                call("fm_moe_layer_random", ctypes.byref(desc), q, int(seed), m.layer, ctypes.byref(hl))
                m._hlayer = hl
                m._read_host_layer()
            else:
                cl = ctypes.c_void_p()
                call("fm_cuda_layer_random", m._cuda, ctypes.byref(desc), q, int(seed), m.layer, ctypes.byref(cl))
                m._clayer = cl
            return m._finish()
        except BaseException:
            m.close()
            raise

    @classmethod
    def from_tensors(cls, config, layer, tensors, layout="modelopt_nvfp4", inter=None, device="cpu",
                     max_tokens=512, *, quant_config=None, threads=0, isa="auto"):
        """A layer from tensors an engine holds (vLLM / SGLang names, see
        include/fp4moe/engine.h, fm_layer_tensors): tensors maps w13_weight,
        w13_weight_scale, ... (or gate_up_blocks, ... for gpt-oss) to NumPy
        arrays or torch tensors. CPU: host arrays, copied. CUDA: device
        tensors on that GPU, repacked on the device. inter: the partition's
        intermediate size (default: from the tensors' shapes)."""
        if layout not in LAYOUTS:
            raise Error(FM_E_ARG, f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
        if not isinstance(tensors, dict):
            raise Error(FM_E_ARG, f"tensors: expected a dict of name -> array, got {type(tensors).__name__}")
        unknown = sorted(set(tensors) - set(_lib.LAYER_TENSOR_FIELDS))
        if unknown:
            raise Error(FM_E_ARG, f"tensors: unknown name{'s' if len(unknown) > 1 else ''} "
                                  f"{', '.join(unknown)} (known: {', '.join(_lib.LAYER_TENSOR_FIELDS)})")
        desc = _load_desc(config, quant_config)
        if desc.expert_format not in (QF["nvfp4"], QF["mxfp4"]):
            # a config without its quantization part: the layout says it
            nv = layout == "modelopt_nvfp4"
            desc.expert_format = QF["nvfp4"] if nv else QF["mxfp4"]
            desc.group_size = 16 if nv else 32
            # the checkpoint layout only has to be one the description allows
            desc.layout = b"modelopt" if nv else b"dsv4" if desc.family == b"deepseek_v4" else b"gptoss"
        if inter is None:
            key = "w13_weight" if layout == "modelopt_nvfp4" else "gate_up_blocks"
            x = tensors.get(key)
            inter = int(x.shape[1]) // 2 if x is not None and len(x.shape) >= 2 else desc.moe_inter
        m = cls._new(desc, layer, device, max_tokens, threads, isa)
        m.inter = int(inter)
        m._fmt = desc.expert_format
        m._has_router = tensors.get("router_w") is not None
        m._has_shared = tensors.get("shared_gate") is not None
        try:
            lt = LayerTensors()
            lt.layout = LAYOUTS[layout]
            lt.inter = m.inter
            keep = []
            for name, x in tensors.items():
                if x is None:
                    continue
                dev = device_of(x)
                want = "cpu" if m._kind == "cpu" else f"cuda:{m.device_index}"
                if dev != want:
                    raise Error(FM_E_ARG, f"{name}: on {dev}; the {m._kind} engine of this layer needs it on {want}")
                setattr(lt, name, view(x, name))
                keep.append(x)
            m._open_engine()
            if m._kind == "cpu":
                hl = ctypes.c_void_p()
                call("fm_moe_layer_from_tensors", ctypes.byref(desc), m.layer, ctypes.byref(lt), ctypes.byref(hl))
                m._hlayer = hl
                m._read_host_layer()
            elif _lib.has("fm_cuda_layer_from_tensors"):
                torch = torch_module()
                # the tensors may still be written on torch's stream
                torch.cuda.current_stream(m.device_index).synchronize()
                cl = ctypes.c_void_p()
                call("fm_cuda_layer_from_tensors", m._cuda, ctypes.byref(desc), m.layer, ctypes.byref(lt),
                     ctypes.byref(cl))
                m._clayer = cl
                m._built_by = "fm_cuda_layer_from_tensors"
            else:
                # a library without the device-side repack: through host copies
                host = {n: x.cpu() for n, x in tensors.items() if x is not None}
                ht = LayerTensors()
                ht.layout, ht.inter = lt.layout, lt.inter
                for n, x in host.items():
                    setattr(ht, n, view(x, n))
                hl = ctypes.c_void_p()
                call("fm_moe_layer_from_tensors", ctypes.byref(desc), m.layer, ctypes.byref(ht), ctypes.byref(hl))
                m._hlayer = hl
                m._read_host_layer()
                cl = ctypes.c_void_p()
                call("fm_cuda_layer_upload", m._cuda, ctypes.byref(desc), hl, ctypes.byref(cl))
                m._clayer = cl
                m._free_host()
                m._built_by = "host copies, fm_moe_layer_from_tensors, fm_cuda_layer_upload"
                del host
            del keep
            return m._finish()
        except BaseException:
            m.close()
            raise

    def _read_host_layer(self):
        h = MoeLayerHead.from_address(self._hlayer.value)
        self.inter = h.inter
        self._has_shared = bool(h.has_shared)

    # ------------------------------------------------------------ lifetime
    def _free_host(self):
        L = lib()
        if self._hlayer:
            L.fm_moe_layer_free(self._hlayer)
            self._hlayer = None
        if self._ckpt:
            L.fm_ckpt_close(self._ckpt)
            self._ckpt = None

    def close(self):
        """Frees the engine and the weights (also done when garbage-collected).
        A CUDA graph that replays this layer's calls must be dropped first."""
        if self._closed and not (self._cpu or self._cuda or self._hlayer or self._ckpt or self._clayer):
            return
        self._closed = True
        try:
            L = lib()
        except Error:
            return
        with self._lock:
            if self._clayer:
                L.fm_cuda_layer_free(self._clayer)
                self._clayer = None
            if self._cuda:
                L.fm_cuda_engine_free(self._cuda)
                self._cuda = None
            self._free_host()
            if self._cpu:
                L.fm_cpu_engine_free(self._cpu)
                self._cpu = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- interpreter shutdown
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _live(self):
        if self._closed:
            raise Error(FM_E_ARG, "this fp4moe layer is closed")

    # ------------------------------------------------------------ facts
    @property
    def device(self):
        return "cpu" if self._kind == "cpu" else f"cuda:{self.device_index}"

    @property
    def format(self):
        return QF_NAME.get(self._fmt, "none")

    @property
    def has_router(self):
        return self._has_router

    @property
    def has_shared(self):
        return self._has_shared

    @property
    def needs_token_ids(self):
        """True for DeepSeek-V4's hash-routed layers (token ids pick the experts)."""
        return self._desc.route == ROUTE_DSV4 and self.layer < self._desc.n_hash_layers

    @property
    def config(self):
        """The model description the library read (fm_model_desc), as a dict."""
        out = {}
        for name, _ in ModelDesc._fields_:
            if name.startswith("_"):
                continue
            v = getattr(self._desc, name)
            out[name] = v.decode() if isinstance(v, bytes) else v
        return out

    def _provenance(self, tokens):
        key = TuneKey()
        call("fm_cuda_engine_key", self._cuda, ctypes.byref(self._desc), self._fmt, ctypes.byref(key))
        ch = TuneChoice()
        call("fm_tune_choose", ctypes.byref(key), int(tokens), ctypes.byref(ch))
        buf = ctypes.create_string_buffer(2048)
        fn("fm_tune_provenance_line")(ctypes.byref(key), int(tokens), ctypes.byref(ch), buf, len(buf))
        return buf.value.decode(errors="replace"), ch

    def call_config(self, tokens=1):
        """CUDA: what the ops run at `tokens` tokens, from the layer's table
        of configs by batch (looked up once, when the layer was reserved for
        max_tokens): {"kernel", "source", "params"}; None on the CPU engine or
        a library without the table."""
        self._live()
        if self._kind == "cpu" or not _lib.has("fm_cuda_layer_call_config"):
            return None
        cfg = KernelConfig()
        kern = ctypes.create_string_buffer(640)
        src = ctypes.create_string_buffer(512)
        call("fm_cuda_layer_call_config", self._cuda, self._clayer, int(tokens), ctypes.byref(cfg), kern, len(kern),
             src, len(src))
        params = {n: getattr(cfg, n) for n, _ in KernelConfig._fields_}
        return {"kernel": kern.value.decode(errors="replace"), "source": src.value.decode(errors="replace"),
                "params": params}

    def describe(self, tokens=1):
        """Which engine, kernel and (CUDA) kernel config runs at `tokens`
        tokens, in lines of text."""
        self._live()
        d = self._desc
        head = (f"fp4moe layer {self.layer}: {d.family.decode()} {self.format}, H={self.hidden} I={self.inter} "
                f"E={self.n_experts} k={self.topk} shared={'yes' if self._has_shared else 'no'} "
                f"router={'yes' if self._has_router else 'no'}, max_tokens={self.max_tokens}")
        L = lib()
        if self._kind == "cpu":
            return f"{head}\nengine: {L.fm_cpu_engine_describe(self._cpu).decode()}"
        line, _ = self._provenance(tokens)
        cc = self.call_config(tokens)
        calls = f"\ncalls at {tokens} tokens run: {cc['kernel']}; config from {cc['source']}" if cc else ""
        return f"{head}\nengine: cuda:{self.device_index} {L.fm_cuda_engine_describe(self._cuda).decode()}\n{line}{calls}"

    @property
    def kernel_info(self):
        """describe() as a dict: backend, engine, and for CUDA the config
        chosen at one token (provenance line, config source, tuned or not)."""
        self._live()
        L = lib()
        if self._kind == "cpu":
            return {"backend": "cpu", "device": "cpu", "format": self.format,
                    "engine": L.fm_cpu_engine_describe(self._cpu).decode()}
        line, ch = self._provenance(1)
        return {"backend": "cuda", "device": self.device, "format": self.format,
                "engine": L.fm_cuda_engine_describe(self._cuda).decode(), "provenance": line,
                "config_source": ch.source.decode(errors="replace"), "tuned": bool(ch.tuned),
                "warnings": ch.warnings.decode(errors="replace"), "call_config": self.call_config(1)}

    def __repr__(self):
        if self._closed:
            return "<fp4moe.MoE closed>"
        return (f"<fp4moe.MoE layer {self.layer} {self.format} H={self.hidden} E={self.n_experts} k={self.topk} "
                f"on {self.device}>")

    # ------------------------------------------------------------ calls
    def __call__(self, hidden, token_ids=None, return_routing=False, check=True):
        """The MoE block with its routing: out float32 [T, H] (routed +
        shared experts), and with return_routing also topk_ids int32 [T, k]
        (ascending per row) and topk_weights float32 [T, k]. hidden: float32,
        float16 or bfloat16 [T, H], T <= max_tokens. token_ids [T] feed
        DeepSeek-V4's hash layers."""
        if is_torch(hidden):
            torch = torch_module()
            if not _torch_ops._DONE:
                _torch_ops.register()
            out, ids, w = torch.ops.fp4moe.moe(hidden, self.handle, token_ids, bool(return_routing), bool(check))
            return (out, ids, w) if return_routing else out
        return self._np_moe(hidden, token_ids, return_routing)

    def experts(self, hidden, topk_ids, topk_weights, include_shared=True, check=True):
        """The experts on tokens the caller routed: out[t] = sum_j
        topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]) (+ the shared
        expert). topk_ids int32 or int64 [T, k]; an id < 0 contributes
        nothing (an expert another rank holds); ids >= E are an error
        (CUDA: checked unless check=False or capturing a graph)."""
        if is_torch(hidden):
            torch = torch_module()
            if not _torch_ops._DONE:
                _torch_ops.register()
            return torch.ops.fp4moe.experts(hidden, self.handle, topk_ids, topk_weights, bool(include_shared),
                                            bool(check))
        return self._np_experts(hidden, topk_ids, topk_weights, include_shared)

    # -- NumPy (CPU engine)
    def _np_hidden(self, hidden):
        import numpy as np
        self._live()
        if self._kind != "cpu":
            raise Error(FM_E_ARG, f"hidden: this layer runs on {self.device}, which takes torch CUDA tensors "
                                  f"(got {type(hidden).__name__})")
        if not is_numpy(hidden):
            raise Error(FM_E_ARG, f"hidden: expected a NumPy array or a torch tensor, got {type(hidden).__name__}")
        dt = _HIDDEN_DT.get(fm_dtype_of(hidden, "hidden"))
        if dt is None:
            raise Error(FM_E_ARG, f"hidden: dtype {hidden.dtype.name}; expected float32, float16 or bfloat16")
        self._check_shape(tuple(hidden.shape))
        return np.ascontiguousarray(hidden), dt

    def _check_shape(self, shape):
        if len(shape) != 2 or shape[1] != self.hidden:
            raise Error(FM_E_ARG, f"hidden: shape {list(shape)}; expected [T, {self.hidden}]")
        if shape[0] > self.max_tokens:
            raise Error(FM_E_RANGE, f"hidden: {shape[0]} tokens, more than max_tokens={self.max_tokens} "
                                    "this layer was built for")

    def _np_ints(self, x, shape, what):
        import numpy as np
        if not is_numpy(x):
            raise Error(FM_E_ARG, f"{what}: expected a NumPy array, got {type(x).__name__}")
        if x.dtype.name not in ("int32", "int64"):
            raise Error(FM_E_ARG, f"{what}: dtype {x.dtype.name}; expected int32 or int64")
        if tuple(x.shape) != shape:
            raise Error(FM_E_ARG, f"{what}: shape {list(x.shape)}; expected {list(shape)}")
        if x.dtype.name == "int64" and x.size and (x.max() > 2**31 - 1 or x.min() < -2**31):
            raise Error(FM_E_RANGE, f"{what}: values beyond int32")
        return np.ascontiguousarray(x, dtype=np.int32)

    def _np_moe(self, hidden, token_ids, return_routing):
        import numpy as np
        x, dt = self._np_hidden(hidden)
        if not self._has_router:
            raise Error(FM_E_ARG, "this layer was built without router_w: route the tokens yourself and call "
                                  "experts()")
        T = x.shape[0]
        tok = None if token_ids is None else self._np_ints(token_ids, (T,), "token_ids")
        out = np.empty((T, self.hidden), np.float32)
        ids = np.empty((T, self.topk), np.int32)
        w = np.empty((T, self.topk), np.float32)
        if T:
            o = MoeOut(out.ctypes.data, ids.ctypes.data, w.ctypes.data)
            with self._lock:
                self._live()
                call("fm_cpu_forward", self._cpu, ctypes.byref(self._desc), self._hlayer, x.ctypes.data, dt, T,
                     tok.ctypes.data if tok is not None else None, ctypes.byref(o))
        return (out, ids, w) if return_routing else out

    def _np_experts(self, hidden, topk_ids, topk_weights, include_shared):
        import numpy as np
        x, dt = self._np_hidden(hidden)
        T = x.shape[0]
        ids = self._np_ints(topk_ids, (T, self.topk), "topk_ids")
        if not is_numpy(topk_weights):
            raise Error(FM_E_ARG, f"topk_weights: expected a NumPy array, got {type(topk_weights).__name__}")
        if topk_weights.dtype.kind != "f" and topk_weights.dtype.name != "bfloat16":
            raise Error(FM_E_ARG, f"topk_weights: dtype {topk_weights.dtype.name}; expected a float type")
        if tuple(topk_weights.shape) != (T, self.topk):
            raise Error(FM_E_ARG, f"topk_weights: shape {list(topk_weights.shape)}; expected {[T, self.topk]}")
        w = np.ascontiguousarray(topk_weights, dtype=np.float32)
        out = np.empty((T, self.hidden), np.float32)
        if T:
            with self._lock:
                self._live()
                call("fm_cpu_experts", self._cpu, ctypes.byref(self._desc), self._hlayer, x.ctypes.data, dt, T,
                     ids.ctypes.data, w.ctypes.data, 1 if include_shared else 0, out.ctypes.data)
        return out

    # -- torch (both engines; called by the custom ops)
    def _t_hidden(self, x):
        """Checks of the hidden states that read no data (also run by the
        ops' fake implementations, so torch.compile sees them)."""
        self._live()
        want = "cpu" if self._kind == "cpu" else f"cuda:{self.device_index}"
        if device_of(x) != want:
            raise Error(FM_E_ARG, f"hidden: on {device_of(x)}; this layer runs on {want}")
        dt = _HIDDEN_DT.get(fm_dtype_of(x, "hidden"))
        if dt is None:
            raise Error(FM_E_ARG, f"hidden: dtype {x.dtype}; expected float32, float16 or bfloat16")
        self._check_shape(tuple(x.shape))
        if not x.is_contiguous():
            raise Error(FM_E_ARG, "hidden: not contiguous (call .contiguous() first)")
        return dt

    def _t_ints(self, x, shape, what, ref):
        torch = torch_module()
        if not isinstance(x, torch.Tensor):
            raise Error(FM_E_ARG, f"{what}: expected a torch tensor, got {type(x).__name__}")
        if x.device != ref.device:
            raise Error(FM_E_ARG, f"{what}: on {device_of(x)}, hidden on {device_of(ref)}")
        if x.dtype not in (torch.int32, torch.int64):
            raise Error(FM_E_ARG, f"{what}: dtype {x.dtype}; expected torch.int32 or torch.int64")
        if tuple(x.shape) != shape:
            raise Error(FM_E_ARG, f"{what}: shape {list(x.shape)}; expected {list(shape)}")

    def _t_weights(self, w, shape, ref):
        torch = torch_module()
        if not isinstance(w, torch.Tensor):
            raise Error(FM_E_ARG, f"topk_weights: expected a torch tensor, got {type(w).__name__}")
        if w.device != ref.device:
            raise Error(FM_E_ARG, f"topk_weights: on {device_of(w)}, hidden on {device_of(ref)}")
        if not w.dtype.is_floating_point:
            raise Error(FM_E_ARG, f"topk_weights: dtype {w.dtype}; expected a float type")
        if tuple(w.shape) != shape:
            raise Error(FM_E_ARG, f"topk_weights: shape {list(w.shape)}; expected {list(shape)}")

    def _capturing(self):
        torch = torch_module()
        return self._kind == "cuda" and torch.cuda.is_current_stream_capturing()

    def _t_check_range(self, x, lo, hi, what, words):
        """Device-side range check (one reduction and one read back):
        outside graph capture only."""
        if x.numel() == 0:
            return
        mn, mx = int(x.min()), int(x.max())
        if mn < lo or mx >= hi:
            bad = mx if mx >= hi else mn
            raise Error(FM_E_RANGE, f"{what}: {bad} is out of range ({words})")

    def _t_stream(self, x):
        torch = torch_module()
        return torch.cuda.current_stream(x.device).cuda_stream

    def _t_moe_meta(self, x, token_ids, return_routing):
        dt = self._t_hidden(x)
        if not self._has_router:
            raise Error(FM_E_ARG, "this layer was built without router_w: route the tokens yourself and call "
                                  "experts()")
        T = x.shape[0]
        if token_ids is not None:
            self._t_ints(token_ids, (T,), "token_ids", x)
        torch = torch_module()
        r = T if return_routing else 0
        out = x.new_empty((T, self.hidden), dtype=torch.float32)
        ids = x.new_empty((r, self.topk), dtype=torch.int32)
        w = x.new_empty((r, self.topk), dtype=torch.float32)
        return dt, out, ids, w

    def torch_moe(self, x, token_ids, return_routing, check):
        torch = torch_module()
        dt, out, ids, w = self._t_moe_meta(x, token_ids, return_routing)
        T = x.shape[0]
        tok = None
        if token_ids is not None:
            tok = token_ids.to(torch.int32).contiguous()
            if check and self._kind == "cuda" and not self._capturing() and self._desc.vocab_size > 0:
                self._t_check_range(tok, 0, self._desc.vocab_size, "token_ids",
                                    f"the vocabulary has {self._desc.vocab_size} tokens")
        if T == 0:
            return out, ids, w
        tp = tok.data_ptr() if tok is not None else None
        ip = ids.data_ptr() if return_routing else None
        wp = w.data_ptr() if return_routing else None
        with self._lock:
            self._live()
            if self._kind == "cpu":
                o = MoeOut(out.data_ptr(), ip, wp)
                call("fm_cpu_forward", self._cpu, ctypes.byref(self._desc), self._hlayer, x.data_ptr(), dt, T, tp,
                     ctypes.byref(o))
            else:
                call("fm_cuda_moe", self._cuda, self._clayer, x.data_ptr(), dt, T, tp, out.data_ptr(), ip, wp,
                     self._t_stream(x))
        return out, ids, w

    def _t_experts_meta(self, x, topk_ids, topk_weights):
        dt = self._t_hidden(x)
        T = x.shape[0]
        self._t_ints(topk_ids, (T, self.topk), "topk_ids", x)
        self._t_weights(topk_weights, (T, self.topk), x)
        torch = torch_module()
        return dt, x.new_empty((T, self.hidden), dtype=torch.float32)

    def torch_experts(self, x, topk_ids, topk_weights, include_shared, check):
        torch = torch_module()
        dt, out = self._t_experts_meta(x, topk_ids, topk_weights)
        T = x.shape[0]
        ids = topk_ids.to(torch.int32).contiguous()
        w = topk_weights.to(torch.float32).contiguous()
        if check and self._kind == "cuda" and not self._capturing():
            # ids < 0 are allowed: experts another rank holds
            self._t_check_range(ids, -2**31, self.n_experts, "topk_ids",
                                f"the layer has {self.n_experts} experts; ids < 0 mean another rank's")
        if T == 0:
            return out
        with self._lock:
            self._live()
            if self._kind == "cpu":
                call("fm_cpu_experts", self._cpu, ctypes.byref(self._desc), self._hlayer, x.data_ptr(), dt, T,
                     ids.data_ptr(), w.data_ptr(), 1 if include_shared else 0, out.data_ptr())
            else:
                call("fm_cuda_experts", self._cuda, self._clayer, x.data_ptr(), dt, T, ids.data_ptr(),
                     w.data_ptr(), 1 if include_shared else 0, out.data_ptr(), self._t_stream(x))
        return out


_CTOR = object()
