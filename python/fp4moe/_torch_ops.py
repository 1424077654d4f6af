"""The torch custom ops over the engines, registered on first need:

  fp4moe::moe(Tensor hidden, int layer, Tensor? token_ids, bool return_routing,
              bool check) -> (Tensor out, Tensor topk_ids, Tensor topk_weights)
  fp4moe::experts(Tensor hidden, int layer, Tensor topk_ids, Tensor topk_weights,
                  bool include_shared, bool check) -> Tensor out

`layer` is MoE.handle. Outputs are new tensors from torch's allocator (its
caching allocator keeps CUDA-graph capture safe); the CUDA engine runs on
torch's current stream without host synchronization. topk_ids / topk_weights
of fp4moe::moe have 0 rows unless return_routing. The fake implementations
run the same metadata checks and return empty tensors of the real shapes, so
torch.compile traces the ops."""
import threading

_DONE = False
_LOCK = threading.Lock()


def register():
    """Defines the ops (once); False when torch is not importable."""
    global _DONE
    if _DONE:
        return True
    with _LOCK:
        if _DONE:
            return True
        try:
            import torch
        except ImportError:
            return False
        _define(torch)
        _DONE = True
    return True


def _define(torch):
    from typing import Optional, Tuple

    from torch import Tensor

    from ._moe import layer_by_handle

    @torch.library.custom_op("fp4moe::moe", mutates_args=())
    def moe(hidden: Tensor, layer: int, token_ids: Optional[Tensor], return_routing: bool,
            check: bool) -> Tuple[Tensor, Tensor, Tensor]:
        return layer_by_handle(layer).torch_moe(hidden, token_ids, return_routing, check)

    @moe.register_fake
    def _moe_fake(hidden, layer, token_ids, return_routing, check):
        _, out, ids, w = layer_by_handle(layer)._t_moe_meta(hidden, token_ids, return_routing)
        return out, ids, w

    @torch.library.custom_op("fp4moe::experts", mutates_args=())
    def experts(hidden: Tensor, layer: int, topk_ids: Tensor, topk_weights: Tensor, include_shared: bool,
                check: bool) -> Tensor:
        return layer_by_handle(layer).torch_experts(hidden, topk_ids, topk_weights, include_shared, check)

    @experts.register_fake
    def _experts_fake(hidden, layer, topk_ids, topk_weights, include_shared, check):
        _, out = layer_by_handle(layer)._t_experts_meta(hidden, topk_ids, topk_weights)
        return out
