"""Does the trainer's fast path compute what the fp32 reference computes? (a diagnostic, and a test)

The trainer runs G and D under bf16 autocast, channels_last and the training op formulations
(models/kernels.py); the tests that compare against NVlabs' own code run the fp32 reference ops on
the CPU. `path_parity` closes that gap on whatever device the trainer runs on: it takes a Trainer,
copies its G and D into fp32 reference networks (NCHW, reference ops, no autocast, TF32 off) and
runs the same batch through both, with the trainer's own callables on the fast side (G_train,
D_train, D_frozen, D_reg, the trainer's autocast and op scope). It compares, per quantity:

    image      G(z) (the G step's forward, with the noise strengths held at 0 so both sides draw the same image)
    d_logits   D on the real batch
    r1_grad    the input gradient R1 penalises
    G.<name>   every G parameter's gradient of the G loss (softplus(-D(G(z))))
    D.<name>   every D parameter's gradient of the D loss (logistic, fake + real)
    R1.<name>  every D parameter's gradient of the R1 penalty (double backward)

as the cosine between the two (1 = same direction) and the relative error |a - b| / |b|. A formulation
or precision bug that bends training shows up as a parameter whose gradient points elsewhere.
Augmentation is left out (its randomness is the same on both sides only by construction, and it runs
in float32 either way).
"""
from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from models import ops
from training import losses
from training.dataset import to_float


def _reference_copy(module: torch.nn.Module) -> torch.nn.Module:
    ref = copy.deepcopy(module).float()
    ref.to(memory_format=torch.contiguous_format)
    for sub in ref.modules():
        if hasattr(sub, "channels_last") and isinstance(sub.channels_last, bool):
            sub.channels_last = False
    return ref


def _compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    a = a.detach().double().flatten()
    b = b.detach().double().flatten()
    nb = b.norm().item()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item() if nb > 0 and a.norm() > 0 else float("nan")
    rel = (a - b).norm().item() / nb if nb > 0 else float("nan")
    return {"cos": cos, "rel": rel, "norm": nb, "numel": int(b.numel())}


def _grads(module: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{n}": p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def _zero(*modules):
    for m in modules:
        for p in m.parameters():
            p.grad = None


def _run(G, D, Gfwd, Dtrain, Dfrozen, Dreg, autocast, z, c, dc, real, channels_last) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    # G step: the image and G's gradient of the non-saturating loss through a frozen D
    _zero(G, D)
    D.requires_grad_(False)
    with autocast():
        img = Gfwd(z, c)
        if channels_last:
            img = img.contiguous(memory_format=torch.channels_last)
        logits = Dfrozen(img, *dc)
    losses.logistic_g(logits).mean().backward()
    D.requires_grad_(True)
    out["image"] = img.detach().float()
    out.update(_grads(G, "G"))
    # D step: logistic loss on the fake (detached) and the real batch
    _zero(G, D)
    with autocast():
        fake_logits = Dtrain(img.detach(), *dc)
    losses.logistic_d_fake(fake_logits).mean().backward()
    with autocast():
        real_logits = Dtrain(real, *dc)
    losses.logistic_d_real(real_logits).mean().backward()
    out["d_logits"] = real_logits.detach().float()
    out.update(_grads(D, "D"))
    # R1: the input gradient and D's gradient of the penalty (double backward, eager modules)
    _zero(G, D)
    x = real.detach().clone().requires_grad_(True)
    with autocast():
        reg_logits = Dreg(x, *dc)
    (grad_x,) = torch.autograd.grad(reg_logits.float().sum(), x, create_graph=True)
    penalty = grad_x.float().square().sum(dim=[1, 2, 3])
    (penalty.mean() + reg_logits.float().sum() * 0).backward()
    out["r1_grad"] = grad_x.detach().float()
    out.update({k.replace("D.", "R1.", 1): v for k, v in _grads(D, "D").items()})
    _zero(G, D)
    return out


def path_parity(trainer, batch: int = 16, seed: int = 0) -> dict[str, Any]:
    """Compare the trainer's fast path with fp32 reference ops on one batch; see the module docstring.

    Returns {"rows": {name: {cos, rel, norm, numel}}, "worst": [...], "setup": str}. The trainer's
    networks are used as they are (their weights are not changed; gradients are cleared after)."""
    tr = trainer
    device = tr.device
    if getattr(tr.G_step, "style_mixing", 0) > 0:
        raise ValueError("path_parity needs a trainer built with style_mixing=0 (mixing draws random crossovers)")
    g = torch.Generator(device="cpu").manual_seed(seed)
    z = torch.randn(batch, tr.G.z_dim, generator=g).to(device)
    real_u8 = tr.loader.data[:batch] if tr.loader.where == "gpu" else tr.loader.data[:batch].to(device)
    real = to_float(real_u8.to(device), tr.channels_last)
    c_dim = tr.cfg.c_dim
    if c_dim:
        c = F.one_hot(torch.arange(batch, device=device) % c_dim, c_dim).float()
    else:
        c = torch.zeros(batch, 0, device=device)
    dc = (c,) if c_dim else ()

    # The G step draws fresh per-pixel noise; with every noise strength at 0 for the comparison both
    # sides compute the same image (restored after).
    strengths = [p for n, p in tr.G.named_parameters() if n.endswith("noise_strength")]
    saved = [p.detach().clone() for p in strengths]
    aug = tr.aug
    try:
        with torch.no_grad():
            for p in strengths:
                p.zero_()
        Gr, Dr = _reference_copy(tr.G), _reference_copy(tr.D)
        # the fast side: the trainer's own callables, op scope and autocast. With the augmentation inside D's
        # compiled graphs (tr.fused_augment) it is switched off for the comparison: the callables then see
        # aug None (a recompile) and compute D alone, as the reference does.
        tr.aug = None
        with tr._scope():
            fast = _run(tr.G, tr.D, lambda z_, c_: tr.G_train(z_, c_)[0], tr.D_train, tr.D_frozen, tr.D_reg,
                        tr._autocast, z, c, dc, real, tr.channels_last)
    finally:
        tr.aug = aug
        with torch.no_grad():
            for p, v in zip(strengths, saved):
                p.copy_(v)

    # the reference: fp32 NCHW copies, reference ops, TF32 off
    Gr.train()
    Dr.train()
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with ops.use_impl(**ops.DEFAULT_IMPL):
            ref = _run(Gr, Dr, lambda z_, c_: Gr.synthesis(Gr.mapping(z_, c_), noise_mode="random"),
                       Dr, Dr, Dr, nullcontext, z, c, dc, real.contiguous(), False)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32

    rows = {}
    for name, want in ref.items():
        if name not in fast:
            rows[name] = {"cos": float("nan"), "rel": float("nan"), "norm": float(want.norm()), "numel": want.numel(),
                          "missing": True}
            continue
        rows[name] = _compare(fast[name], want)
    # noise strengths are held at 0: their gradients depend on each side's own random noise draw
    comparable = {k: v for k, v in rows.items() if "noise_strength" not in k}
    # a parameter whose reference gradient is exactly zero (D's 4x4 biases under R1) has no direction
    finite = {k: v for k, v in comparable.items() if v["cos"] == v["cos"]}
    worst = sorted(finite.items(), key=lambda kv: kv[1]["cos"])[:10]
    groups = {}
    for grp in ("G", "D", "R1"):
        names = [k for k in comparable if k.startswith(grp + ".") and k in fast]
        if names:
            groups[grp] = _compare(torch.cat([fast[k].flatten().double() for k in names]),
                                   torch.cat([ref[k].flatten().double() for k in names]))
    setup = (f"{device.type}, precision {tr.cfg.precision}, channels_last {tr.channels_last}, "
             f"kernels {tr.kernels_note}, compile {tr.cfg.compile}, batch {batch}")
    return {"rows": rows, "groups": groups, "worst": [{"name": k, **v} for k, v in worst], "setup": setup}


def format_report(report: dict[str, Any]) -> str:
    lines = [f"path parity ({report['setup']}): worst 10 by cosine"]
    for r in report["worst"]:
        lines.append(f"  {r['name']:<48} cos {r['cos']:.5f}  rel {r['rel']:.4f}  |ref| {r['norm']:.3g}  n {r['numel']}")
    for k in ("image", "d_logits", "r1_grad"):
        r = report["rows"][k]
        lines.append(f"  {k:<48} cos {r['cos']:.5f}  rel {r['rel']:.4f}")
    for k, r in report["groups"].items():
        lines.append(f"  all {k} parameter gradients{'':<22} cos {r['cos']:.5f}  rel {r['rel']:.4f}")
    return "\n".join(lines)
