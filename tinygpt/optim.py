"""The optimizers train.py can use: AdamW for everything, or Muon for the matrices
inside the blocks and AdamW for the rest.

Muon (https://kellerjordan.github.io/posts/muon/) takes the momentum of a weight
matrix's gradient and replaces it by the nearest matrix whose singular values are
all about 1, so every direction of the update moves at the same rate instead of
a few large directions dominating. That suits the square-ish maps between hidden
vectors inside the blocks; embeddings and the output head are per-token lookups,
and gains and biases are not matrices, so those stay with AdamW.
"""

import math
from collections import defaultdict

import torch

from config import UserError


def adamw_groups(params, weight_decay):
    """Decay every matrix, embeddings included: with tied weights the token embedding
    is also the output head, and exempting it would exempt the largest matrix.
    Biases and LayerNorm gains are not decayed: they set scales and offsets."""
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def configure_optimizer(model, cfg, device_type):
    """train.py's optimizer for cfg: AdamW for everything, or Muon for the block
    matrices and AdamW for the rest. A group's lr_scale multiplies the schedule's
    learning rate, so both warm up and decay together, each from its own peak."""
    if cfg.optimizer not in ("adamw", "muon"):
        raise UserError(f"optimizer must be adamw or muon, got {cfg.optimizer!r}")
    if cfg.optimizer == "adamw":
        matrices, rest = [], [p for p in model.parameters() if p.requires_grad]
    else:
        matrices, rest = split_for_muon(model)
    # The fused kernel updates every tensor in one pass: on a CPU a third of the time of the
    # default per-tensor loop (0.9 against 3.0 ms a step for 26 matrices of 128 x 384).
    adamw = torch.optim.AdamW(adamw_groups(rest, cfg.weight_decay), lr=cfg.learning_rate,
                              betas=(cfg.beta1, cfg.beta2), fused=device_type in ("cuda", "cpu"))
    if cfg.optimizer == "adamw":
        return adamw
    # torch's Muon orthogonalizes in bf16: fast on a GPU, slow on a CPU (see Float32Muon).
    muon_class = torch.optim.Muon if device_type == "cuda" else Float32Muon
    muon = muon_class([{"params": matrices, "lr_scale": cfg.muon_lr / cfg.learning_rate}], lr=cfg.muon_lr,
                      weight_decay=cfg.muon_weight_decay, momentum=cfg.muon_momentum, nesterov=True,
                      ns_steps=cfg.muon_ns_steps, adjust_lr_fn="match_rms_adamw")
    return Optimizers(adamw, muon)


def split_for_muon(model):
    """(matrices, rest): the 2-D weights inside the blocks, and everything else."""
    matrices, rest = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (matrices if name.startswith("blocks.") and p.dim() == 2 else rest).append(p)
    return matrices, rest


def orthogonalize(G, coefficients=(3.4445, -4.7750, 2.0315), steps=5, eps=1e-7):
    """G (N, A, B) -> (N, A, B) in float32: each matrix with its singular values
    pushed towards 1 by torch.optim.Muon's quintic Newton-Schulz iteration.

    Each step maps X to P X with P = a + b X X^T + c (X X^T)^2, a polynomial in
    the Gram matrix X X^T. So the steps can run on the small Gram matrix alone
    and apply their product to X once at the end: for the CPU preset's blocks a
    quarter fewer FLOPs than stepping X itself (a third for its 128 x 512
    matrices, a little more for the square ones), 8 ms less per step there.
    """
    a, b, c = coefficients
    X = G.float()
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT  # work on the short side, so the Gram matrix is the small one
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= Frobenius norm = 1
    gram = X @ X.mT  # (N, A, A)
    eye = torch.eye(gram.size(-1), device=X.device)
    product = None  # the steps' P, multiplied up
    for step in range(steps):
        P = torch.baddbmm(a * eye + b * gram, gram, gram, alpha=c)  # (N, A, A)
        product = P if product is None else P @ product
        if step + 1 < steps:  # the last Gram matrix goes unused: with P as the first product, 3 of 20 matmuls saved
            gram = P @ gram @ P  # the Gram matrix of P X
    X = product @ X
    return X.mT if tall else X


class Float32Muon(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz iteration in float32, one batched
    iteration per shape of matrix.

    torch's runs in bfloat16: right on a GPU, slow on a CPU. Without native bf16
    matmuls it takes ~15x as long as float32 (938 against 42 ms a step on a 2-core
    CPU); even with avx512_bf16 it took 1.7x. Same hyperparameters, same state (a
    momentum buffer per matrix) and the same update to within bf16 precision:
    tests/test_optim.py checks it.
    """

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            momentum, lr = group["momentum"], group["lr"]
            by_shape = defaultdict(list)
            for p in group["params"]:
                if p.grad is not None:
                    by_shape[p.shape].append(p)
            for (A, B), params in by_shape.items():
                updates = []
                for p in params:
                    if "momentum_buffer" not in self.state[p]:
                        self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                    buf = self.state[p]["momentum_buffer"]
                    buf.lerp_(p.grad, 1 - momentum)
                    updates.append(p.grad.lerp(buf, momentum) if group["nesterov"] else buf)
                ortho = orthogonalize(torch.stack(updates), group["ns_coefficients"], group["ns_steps"], group["eps"])
                if group["adjust_lr_fn"] == "match_rms_adamw":
                    scale = 0.2 * math.sqrt(max(A, B))  # the update's RMS becomes AdamW's typical 0.2
                else:
                    scale = math.sqrt(max(1, A / B))  # torch's "original"
                for p, update in zip(params, ortho):
                    p.mul_(1 - lr * group["weight_decay"])
                    p.add_(update.to(p.dtype), alpha=-lr * scale)


class Optimizers:
    """Several optimizers that step as one. train.py and torch's GradScaler use only
    what is here: param_groups, step, zero_grad and the state dict."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers

    @property
    def param_groups(self):
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self):
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none=True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state):
        if len(state.get("optimizers", ())) != len(self.optimizers):
            raise ValueError("the saved optimizer state is for a different optimizer")
        for opt, opt_state in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(opt_state)
