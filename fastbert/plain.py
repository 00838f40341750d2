"""When a fused op may read a module's weights itself, and when it must call the module.

PEFT's LoRA, accelerate's offload, dynamic quantization, parametrizations and forward hooks all live in a module's
``forward`` (or in its class, or its hooks). A fused op that reads ``module.weight`` and does the math itself would
skip them and be silently wrong. So a fused op reads weights directly only from a *plain* module: exactly the torch
class it expects, no hooks (its own or global), no ``forward`` replaced on the instance, and real parameters on the
input's device. Anything else is called, and the op fuses only what remains around the call.

The checks read a few attributes per call (no tensor data), so a hook added or a module wrapped between two forwards
is seen by the next one.
"""

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

# transformers' own hooks that collect hidden states/attentions for its forward (transformers 5): inert outside a
# transformers forward, which sets their collector, so they do not stop fastbert's forward.
_TRANSFORMERS_CAPTURE_HOOKS = "transformers.utils.output_capturing"


def global_hooks() -> bool:
    """Whether any module hook is registered globally (``nn.modules.module.register_module_forward_hook`` etc.)."""
    return bool(
        _torch_module._global_forward_hooks
        or _torch_module._global_forward_pre_hooks
        or _torch_module._global_backward_hooks
        or _torch_module._global_backward_pre_hooks
    )


def has_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` would run anything besides its class's ``forward``."""
    return bool(
        module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or "forward" in module.__dict__
        or any(getattr(hook, "__module__", None) != _TRANSFORMERS_CAPTURE_HOOKS
               for hook in module._forward_hooks.values())
    )


def is_plain(module: nn.Module | None, cls: type, device: torch.device) -> bool:
    """Whether a fused op may read ``module``'s parameters instead of calling it: ``type(module) is cls``, no hooks,
    and every parameter a real tensor on ``device``."""
    if type(module) is not cls or has_hooks(module) or global_hooks():
        return False
    for param in module._parameters.values():
        if param is not None and (param.device != device or type(param) not in (nn.Parameter, torch.Tensor)):
            return False
    return True
