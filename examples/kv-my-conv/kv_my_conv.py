import torch.nn.functional as F

from kernel_variants.plugin import ConvCapabilities, Variant, hookimpl


def my_conv(x, weight, bias=None, *, conv_states=None, cache_indices=None,
            has_initial_state=None, query_start_loc=None, activation=None, pad_slot_id=-1):
    """x: [B, L, D] (no states, no varlen: see the capabilities below)."""
    width = weight.shape[1]
    h = F.pad(x.transpose(1, 2), (width - 1, 0))
    y = F.conv1d(h, weight.unsqueeze(1), bias, groups=weight.shape[0])
    return (F.silu(y) if activation else y).transpose(1, 2).contiguous()


@hookimpl
def kv_register_variants(register):
    register(Variant(
        id="my_conv", op="causal_conv1d_fn", version="1", fn=my_conv,
        capabilities=ConvCapabilities(devices={"cpu", "cuda"}, dtypes={"float32", "bfloat16"},
                                      width=(2, 4), conv_states=False, varlen=False),
        probe=lambda: None,  # or a one-line reason why it cannot run on this machine
    ))
