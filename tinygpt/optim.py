"""Muon, the optimizer of the fast recipe for the matrices inside the blocks (train.py gives AdamW the rest).

Muon (https://kellerjordan.github.io/posts/muon/) replaces the momentum of a weight matrix's gradient by
the nearest matrix whose singular values are all about 1, so every direction of the update moves at the
same rate. Embeddings and the head are per-token lookups, and gains and biases are not matrices: AdamW's.
"""

import math
from collections import defaultdict

import torch


def orthogonalize(G, coefficients=(3.4445, -4.7750, 2.0315), steps=5, eps=1e-7):
    """G (N, A, B) -> (N, A, B) in float32: each matrix with its singular values pushed towards 1 by
    torch.optim.Muon's quintic Newton-Schulz iteration. Each step maps X to P X with P = a + b X X^T +
    c (X X^T)^2, a polynomial in the Gram matrix X X^T, so the steps run on the small Gram matrix alone and
    apply their product to X once at the end: a quarter fewer FLOPs for the CPU preset (docs/results.md)."""
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


class Muon(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz iteration in float32 (TF32 on a GPU), all the matrices of one
    shape in one batched iteration. torch's iterates one matrix at a time in bfloat16: on a GPU one launch
    after another, on a CPU slow (docs/results.md); and orthogonalize's Gram form in bfloat16 put a square
    matrix's update 13% off. Same hyperparameters, same state (a momentum buffer per matrix) and the same
    update to within bf16 precision: tests/test_optim.py."""

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            momentum, lr = group["momentum"], group["lr"]
            by_shape = defaultdict(list)
            for p in group["params"]:
                if p.grad is not None:
                    by_shape[p.shape].append(p)
            for (A, B), params in by_shape.items():  # each _foreach_ op: one launch for all, not one each
                grads = [p.grad for p in params]
                for p in params:
                    if "momentum_buffer" not in self.state[p]:
                        self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                bufs = [self.state[p]["momentum_buffer"] for p in params]
                torch._foreach_lerp_(bufs, grads, 1 - momentum)
                updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
                ortho = orthogonalize(torch.stack(updates), group["ns_coefficients"], group["ns_steps"], group["eps"])
                match_adamw = group["adjust_lr_fn"] == "match_rms_adamw"  # the update's RMS: AdamW's typical 0.2
                scale = 0.2 * math.sqrt(max(A, B)) if match_adamw else math.sqrt(max(1, A / B))  # torch's "original"
                torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
                torch._foreach_add_(params, ortho.to(params[0].dtype).unbind(), alpha=-lr * scale)


def muon(matrices, cfg):
    """Muon for matrices, with train.py's settings cfg. Its group's lr_scale multiplies the schedule's
    learning rate, so that Muon and AdamW warm up and decay together, each from its own peak."""
    return Muon([{"params": matrices, "lr_scale": cfg.muon_lr / cfg.learning_rate}], lr=cfg.muon_lr,
                weight_decay=cfg.muon_weight_decay, momentum=cfg.muon_momentum, nesterov=True,
                ns_steps=cfg.muon_ns_steps, adjust_lr_fn="match_rms_adamw")


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
