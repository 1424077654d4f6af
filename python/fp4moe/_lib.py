"""ctypes view of libfp4moe.so: loading, the structures of include/fp4moe.h
that cross the boundary, prototypes, and errors as Python exceptions."""
import ctypes
import os
import threading
from ctypes import (POINTER, Structure, c_char, c_char_p, c_double, c_float, c_int, c_int64,
                    c_size_t, c_uint64, c_void_p)

FM_MAX_DIMS = 8

STATUS_CODES = ("FM_OK", "FM_E_ARG", "FM_E_IO", "FM_E_FORMAT", "FM_E_RANGE", "FM_E_NOMEM", "FM_E_NOTFOUND",
                "FM_E_UNSUPPORTED", "FM_E_CUDA", "FM_E_NUMERIC")
FM_OK, FM_E_ARG, FM_E_IO, FM_E_FORMAT, FM_E_RANGE, FM_E_NOMEM, FM_E_NOTFOUND, FM_E_UNSUPPORTED, FM_E_CUDA, \
    FM_E_NUMERIC = range(len(STATUS_CODES))

# fm_dtype, in the header's order
DTYPES = ("INVALID", "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16", "I32",
          "U32", "F32", "F64", "I64", "U64", "F4")
DT = {name: i for i, name in enumerate(DTYPES)}

QF = {"none": 0, "nvfp4": 1, "mxfp4": 2, "bf16": 3}
QF_NAME = {v: k for k, v in QF.items()}
CPU_ISA = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3}
LAYOUTS = {"modelopt_nvfp4": 1, "gptoss_mxfp4": 2}
ROUTE_DSV4 = 4


class Error(RuntimeError):
    """A failure reported by libfp4moe (or found before calling it).

    status: the fm_status code (int); code: its name ("FM_E_RANGE");
    status_name: the library's word for it ("out of range"); message: the
    library's message (fm_last_error), which names the problem."""

    def __init__(self, status, message, status_name=None):
        self.status = int(status)
        self.code = STATUS_CODES[self.status] if 0 <= self.status < len(STATUS_CODES) else f"status {status}"
        self.status_name = status_name or _status_word(self.status)
        self.message = message
        super().__init__(f"{message} [{self.code}: {self.status_name}]")


_WORDS = ("ok", "bad argument", "I/O error", "malformed input", "out of range", "out of memory", "not found",
          "unsupported", "CUDA error", "non-finite value")


def _status_word(s):
    # the library's own fm_status_name when it is loaded, so the words never drift
    if _LIB is not None:
        return _LIB.fm_status_name(s).decode()
    return _WORDS[s] if 0 <= s < len(_WORDS) else "unknown status"


# ---------------------------------------------------------------- structures
# Structures the library writes into carry spare room at the end, so that a
# library with a longer structure than this file knows writes into owned
# memory; the layout test (tests/py_python_cpu.py) compares every offset with
# the header's.

class ModelDesc(Structure):
    _fields_ = [("family", c_char * 32), ("model_type", c_char * 64), ("hidden", c_int), ("moe_inter", c_int),
                ("n_experts", c_int), ("topk", c_int), ("n_shared", c_int), ("shared_inter", c_int),
                ("n_layers", c_int), ("first_dense", c_int), ("moe_layer_freq", c_int), ("n_group", c_int),
                ("topk_group", c_int), ("norm_topk_prob", c_int), ("routed_scaling_factor", c_float),
                ("route", c_int), ("act", c_int), ("swiglu_alpha", c_float), ("swiglu_limit", c_float),
                ("n_hash_layers", c_int), ("vocab_size", c_int), ("expert_format", c_int), ("group_size", c_int),
                ("layout", c_char * 32), ("_spare", c_char * 1024)]


class MoeLayerHead(Structure):
    """The first fields of fm_moe_layer (read only)."""
    _fields_ = [("layer", c_int), ("hidden", c_int), ("inter", c_int), ("n_experts", c_int), ("topk", c_int),
                ("fmt", c_int), ("gate", c_void_p), ("up", c_void_p), ("down", c_void_p), ("has_shared", c_int),
                ("shared_inter", c_int)]


class MoeOut(Structure):
    _fields_ = [("out", c_void_p), ("topk_ids", c_void_p), ("topk_weights", c_void_p)]


class Tensor(Structure):
    _fields_ = [("data", c_void_p), ("dtype", c_int), ("ndim", c_int), ("shape", c_int64 * FM_MAX_DIMS),
                ("stride", c_int64 * FM_MAX_DIMS)]


LAYER_TENSOR_FIELDS = ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight", "w2_weight_scale",
                       "w2_weight_scale_2", "gate_up_blocks", "gate_up_scales", "gate_up_bias", "down_blocks",
                       "down_scales", "down_bias", "router_w", "router_bias", "score_bias", "shared_gate",
                       "shared_gate_scale", "shared_gate_scale_2", "shared_up", "shared_up_scale",
                       "shared_up_scale_2", "shared_down", "shared_down_scale", "shared_down_scale_2")


class LayerTensors(Structure):
    _fields_ = [("layout", c_int), ("inter", c_int)] + [(n, Tensor) for n in LAYER_TENSOR_FIELDS]


class KernelConfig(Structure):
    _fields_ = [("path", c_int), ("rows_per_block", c_int), ("k_split", c_int), ("warps", c_int),
                ("stages", c_int), ("tile_n", c_int), ("switch_tpe", c_float)]


class TuneKey(Structure):
    _fields_ = [("gpu_name", c_char * 128), ("sm_count", c_int), ("cuda_version", c_int),
                ("driver_version", c_int), ("fmt", c_int), ("E", c_int), ("H", c_int), ("I", c_int), ("k", c_int),
                ("_spare", c_char * 512)]


class TuneChoice(Structure):
    _fields_ = [("cfg", KernelConfig), ("tuned", c_int), ("bucket", c_int), ("source", c_char * 512),
                ("reason", c_char * 2048), ("tuned_us", c_double), ("default_us", c_double), ("date", c_char * 32),
                ("version", c_char * 32), ("warnings", c_char * 2048), ("never_measured", c_int), ("nearest", c_int),
                ("nearest_E", c_int), ("nearest_H", c_int), ("nearest_I", c_int), ("nearest_k", c_int),
                ("nearest_batch", c_int), ("nearest_distance", c_double), ("no_gpu_files", c_int),
                ("nearest_too_far", c_int), ("_spare", c_char * 4096)]


# ---------------------------------------------------------------- prototypes
P = c_void_p
_PROTOS = {
    "fm_status_name": (c_char_p, [c_int]),
    "fm_last_error": (c_char_p, []),
    "fm_clear_error": (None, []),
    "fm_dtype_name": (c_char_p, [c_int]),
    "fm_ckpt_open": (c_int, [c_char_p, POINTER(P)]),
    "fm_ckpt_close": (None, [P]),
    "fm_model_desc_load": (c_int, [c_char_p, POINTER(ModelDesc)]),
    "fm_model_desc_parse": (c_int, [c_char_p, c_size_t, c_char_p, c_size_t, POINTER(ModelDesc)]),
    "fm_model_is_moe_layer": (c_int, [POINTER(ModelDesc), c_int]),
    "fm_preset_desc": (c_int, [c_char_p, c_int, POINTER(ModelDesc)]),
    "fm_preset_count": (c_size_t, []),
    "fm_preset_name": (c_char_p, [c_size_t]),
    "fm_moe_layer_bind": (c_int, [P, POINTER(ModelDesc), c_int, c_int, POINTER(P)]),
    "fm_moe_layer_random": (c_int, [POINTER(ModelDesc), c_int, c_uint64, c_int, POINTER(P)]),
    "fm_moe_layer_free": (None, [P]),
    "fm_cpu_engine_new": (c_int, [c_int, c_int, POINTER(P)]),
    "fm_cpu_engine_free": (None, [P]),
    "fm_cpu_engine_describe": (c_char_p, [P]),
    "fm_cpu_forward": (c_int, [P, POINTER(ModelDesc), P, P, c_int, c_int, P, POINTER(MoeOut)]),
    "fm_cpu_experts": (c_int, [P, POINTER(ModelDesc), P, P, c_int, c_int, P, P, c_int, P]),
    "fm_layer_tensors_check": (c_int, [POINTER(ModelDesc), POINTER(LayerTensors)]),
    "fm_moe_layer_from_tensors": (c_int, [POINTER(ModelDesc), c_int, POINTER(LayerTensors), POINTER(P)]),
    "fm_cuda_available": (c_int, [c_char_p, c_size_t]),
    "fm_cuda_engine_new": (c_int, [c_int, POINTER(P)]),
    "fm_cuda_engine_free": (None, [P]),
    "fm_cuda_engine_describe": (c_char_p, [P]),
    "fm_cuda_engine_key": (c_int, [P, POINTER(ModelDesc), c_int, POINTER(TuneKey)]),
    "fm_cuda_layer_upload": (c_int, [P, POINTER(ModelDesc), P, POINTER(P)]),
    "fm_cuda_layer_random": (c_int, [P, POINTER(ModelDesc), c_int, c_uint64, c_int, POINTER(P)]),
    "fm_cuda_layer_free": (None, [P]),
    "fm_cuda_engine_reserve": (c_int, [P, P, c_int]),
    "fm_cuda_moe": (c_int, [P, P, P, c_int, c_int, P, P, P, P, P]),
    "fm_cuda_experts": (c_int, [P, P, P, c_int, c_int, P, P, c_int, P, P]),
    "fm_cuda_layer_from_tensors": (c_int, [P, POINTER(ModelDesc), c_int, POINTER(LayerTensors), POINTER(P)]),
    "fm_cuda_layer_call_config": (c_int, [P, P, c_int, POINTER(KernelConfig), c_char_p, c_size_t, c_char_p, c_size_t]),
    "fm_cuda_forward": (c_int, [P, POINTER(ModelDesc), P, P, c_int, c_int, P, POINTER(MoeOut)]),
    "fm_tune_choose": (c_int, [POINTER(TuneKey), c_int, POINTER(TuneChoice)]),
    "fm_tune_provenance_line": (None, [POINTER(TuneKey), c_int, POINTER(TuneChoice), c_char_p, c_size_t]),
}

_LIB = None
_LIB_PATH = None
_LOCK = threading.Lock()


def library_path():
    """Where libfp4moe.so is looked for: $FP4MOE_LIBRARY, else the copy that
    the package's build installed beside this file."""
    env = os.environ.get("FP4MOE_LIBRARY")
    if env:
        return env
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib", "libfp4moe.so")


def _preload_cupti():
    """Loads libcupti.so.* globally from the CUDA toolkit ($CUDA_HOME,
    /usr/local/cuda) or the nvidia-cuda-cupti wheel; True when one loaded."""
    import glob
    import sys
    dirs = []
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            dirs += [os.path.join(root, "lib64"), os.path.join(root, "extras", "CUPTI", "lib64")]
    for p in sys.path:
        dirs += [os.path.join(p, "nvidia", "cuda_cupti", "lib"), os.path.join(p, "nvidia", "cu13", "lib")]
    for d in dirs:
        for f in sorted(glob.glob(os.path.join(d, "libcupti.so.*")), reverse=True):
            try:
                ctypes.CDLL(f, mode=ctypes.RTLD_GLOBAL)
                return True
            except OSError:
                continue
    return False


def lib():
    """The loaded library (loaded on first use, so `import fp4moe` works
    without it)."""
    global _LIB, _LIB_PATH
    if _LIB is not None:
        return _LIB
    with _LOCK:
        if _LIB is None:
            path = library_path()
            if not os.path.exists(path):
                raise Error(FM_E_NOTFOUND, f"libfp4moe.so not found at {path}: install the package "
                                           "(pip install ./python) or set FP4MOE_LIBRARY to a built libfp4moe.so")
            try:
                h = ctypes.CDLL(path)
            except OSError as e:
                # a CUDA build needs CUPTI, which the loader may not find
                # where the toolkit or torch's wheels put it
                if "libcupti" not in str(e) or not _preload_cupti():
                    raise Error(FM_E_IO, f"cannot load {path}: {e}") from None
                try:
                    h = ctypes.CDLL(path)
                except OSError as e2:
                    raise Error(FM_E_IO, f"cannot load {path}: {e2}") from None
            for name, (res, args) in _PROTOS.items():
                f = getattr(h, name, None)
                if f is not None:
                    f.restype = res
                    f.argtypes = args
            _LIB_PATH = path
            _LIB = h
    return _LIB


def fn(name):
    """A library function by name; a library built before it existed
    answers with an Error naming it."""
    f = getattr(lib(), name, None)
    if f is None:
        raise Error(FM_E_UNSUPPORTED, f"{_LIB_PATH} has no {name} (a library older than this package); "
                                      "rebuild libfp4moe.so")
    return f


def has(name):
    return getattr(lib(), name, None) is not None


def check(status, what=None):
    """Raises Error for a failing status with fm_last_error's message."""
    if status == FM_OK:
        return
    L = lib()
    msg = (L.fm_last_error() or b"").decode(errors="replace")
    if not msg:
        msg = f"{what or 'fp4moe call'} failed"
    raise Error(status, msg, L.fm_status_name(status).decode())


def call(name, *args):
    fm = fn(name)
    lib().fm_clear_error()
    check(fm(*args), name)


def cstr(b):
    return b.decode(errors="replace") if isinstance(b, (bytes, bytearray)) else str(b)
