"""fp4moe: decode-time MoE layers with FP4 (NVFP4 / MXFP4) experts.

    import fp4moe
    moe = fp4moe.MoE.from_checkpoint("ckpt/", layer=3)          # CPU, NumPy
    out = moe(x)                                                 # [T, H] float32
    out = moe.experts(x, topk_ids, topk_weights)                 # pre-routed

    moe = fp4moe.MoE.from_checkpoint("ckpt/", 3, device="cuda")  # torch tensors
    out = moe(x_cuda)               # torch.ops.fp4moe.moe, CUDA-graph capturable

The library is libfp4moe.so (ctypes): the copy installed in the package, or
$FP4MOE_LIBRARY. Failures raise fp4moe.Error with the library's message.
"""
import sys as _sys

from ._lib import Error, library_path
from ._moe import MoE, cuda_available, presets

__version__ = "0.1.0"
__all__ = ["Error", "MoE", "cuda_available", "library_path", "presets", "register_torch_ops", "__version__"]


def register_torch_ops():
    """Defines torch.ops.fp4moe.moe and torch.ops.fp4moe.experts (done by
    itself when a CUDA layer is built, or at import when torch is already
    imported). False when torch is not importable."""
    from . import _torch_ops
    return _torch_ops.register()


if "torch" in _sys.modules:
    register_torch_ops()
