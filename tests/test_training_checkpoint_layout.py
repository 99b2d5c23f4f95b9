"""Resume onto channels_last parameters: the moments must take the parameter's layout (fused Adam needs it)."""
import torch

from training.checkpoint import load_optimizer, optimizer_tensors


def test_adam_moments_follow_channels_last_params():
    w = torch.nn.Parameter(torch.randn(4, 3, 3, 3).contiguous(memory_format=torch.channels_last))
    opt = torch.optim.Adam([w])
    w.grad = torch.randn_like(w)
    opt.step()
    tensors, meta = optimizer_tensors(opt)
    tensors = {k: v.contiguous() for k, v in tensors.items()}   # what a safetensors round trip gives back
    fresh = torch.optim.Adam([w])
    load_optimizer(fresh, tensors, meta, "G")
    for key in ("exp_avg", "exp_avg_sq"):
        assert fresh.state[w][key].stride() == w.stride()
        assert torch.equal(fresh.state[w][key], opt.state[w][key])
