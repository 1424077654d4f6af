"""fm_tensor views of NumPy arrays and torch tensors (pointer, dtype, shape,
strides in elements), with the checks that need no data."""
import sys

from ._lib import DT, FM_E_ARG, FM_MAX_DIMS, Error, Tensor

# NumPy dtype names (ml_dtypes' included) -> fm_dtype names
_NP_DT = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "float8_e5m2": "F8_E5M2", "float8_e4m3fn": "F8_E4M3",
          "float8_e8m0fnu": "F8_E8M0", "int16": "I16", "uint16": "U16", "float16": "F16", "bfloat16": "BF16",
          "int32": "I32", "uint32": "U32", "float32": "F32", "float64": "F64", "int64": "I64", "uint64": "U64"}
# torch dtype names (str(dtype) without "torch.") -> fm_dtype names
_TORCH_DT = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "float8_e5m2": "F8_E5M2", "float8_e4m3fn": "F8_E4M3",
             "float8_e8m0fnu": "F8_E8M0", "int16": "I16", "uint16": "U16", "float16": "F16", "bfloat16": "BF16",
             "int32": "I32", "uint32": "U32", "float32": "F32", "float64": "F64", "int64": "I64",
             "uint64": "U64"}


def torch_module():
    """torch if it is already imported (never imports it)."""
    return sys.modules.get("torch")


def is_torch(x):
    t = torch_module()
    return t is not None and isinstance(x, t.Tensor)


def is_numpy(x):
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.ndarray)


def fm_dtype_of(x, what):
    """fm_dtype name of an array / tensor, or an Error naming `what`."""
    if is_torch(x):
        name = str(x.dtype).replace("torch.", "")
        dt = _TORCH_DT.get(name)
    elif is_numpy(x):
        name = x.dtype.name
        dt = _NP_DT.get(name)
    else:
        raise Error(FM_E_ARG, f"{what}: expected a NumPy array or a torch tensor, got {type(x).__name__}")
    if dt is None:
        raise Error(FM_E_ARG, f"{what}: dtype {name} has no fp4moe equivalent")
    return dt


def device_of(x):
    """"cpu" for NumPy arrays and CPU tensors, else "cuda:N"."""
    if is_torch(x):
        d = x.device
        return "cpu" if d.type == "cpu" else f"{d.type}:{d.index if d.index is not None else 0}"
    return "cpu"


def view(x, what):
    """An fm_tensor over x's memory (x must outlive every use of the view)."""
    t = Tensor()
    if x is None:
        return t
    dt = fm_dtype_of(x, what)
    nd = x.ndim if is_numpy(x) else x.dim()
    if nd > FM_MAX_DIMS:
        raise Error(FM_E_ARG, f"{what}: {nd} dimensions (at most {FM_MAX_DIMS})")
    if is_numpy(x):
        item = x.dtype.itemsize
        strides = []
        for s in x.strides:
            if s % item:
                raise Error(FM_E_ARG, f"{what}: a stride of {s} bytes is not a whole number of elements")
            strides.append(s // item)
        ptr = x.ctypes.data
        shape = x.shape
    else:
        strides = list(x.stride())
        ptr = x.data_ptr()
        shape = tuple(x.shape)
    if any(s < 0 for s in strides):
        raise Error(FM_E_ARG, f"{what}: negative strides are not supported (pass a copy)")
    t.data = ptr if ptr else None
    if t.data is None and 0 not in shape:
        raise Error(FM_E_ARG, f"{what}: no data")
    t.dtype = DT[dt]
    t.ndim = nd
    for i in range(nd):
        t.shape[i] = int(shape[i])
        t.stride[i] = int(strides[i])
    return t
