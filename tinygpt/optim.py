"""Muon, the optimizer of the fast recipe for the matrices inside the blocks (train.py gives AdamW the rest).

Muon (https://kellerjordan.github.io/posts/muon/) replaces the momentum of a weight matrix's gradient by
the nearest matrix whose singular values are all about 1, so every direction of the update moves at the
same rate. Embeddings and the head are per-token lookups, and gains and biases are not matrices: AdamW's.
"""

import math
from collections import defaultdict

import torch


def orthogonalize(stacks, coefficients=(3.4445, -4.7750, 2.0315), steps=5, eps=1e-7):
    """[G (N, A, B), ...] -> the same in float32: each matrix with its singular values pushed towards 1 by
    torch.optim.Muon's quintic Newton-Schulz iteration. Each step maps X to P X with P = a + b X X^T +
    c (X X^T)^2, a polynomial in the Gram matrix X X^T, so the steps run on the small Gram matrices alone
    (a quarter fewer FLOPs for the CPU preset, docs/results.md), all those of one size in one batch, and
    apply their product to each X once at the end."""
    a, b, c = coefficients
    tall = [G.size(-2) > G.size(-1) for G in stacks]
    Xs = [G.float().mT if t else G.float() for G, t in zip(stacks, tall)]  # the short side first: a small Gram
    Xs = [X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps) for X in Xs]  # spectral norm <= Frobenius = 1
    out = [None] * len(Xs)
    for size in {X.size(-2) for X in Xs}:
        group = [i for i, X in enumerate(Xs) if X.size(-2) == size]
        gram = torch.cat([Xs[i] @ Xs[i].mT for i in group])  # (N, A, A) for all the group's matrices
        eye = torch.eye(size, device=gram.device)
        product = None  # the steps' P, multiplied up
        for step in range(steps):
            P = torch.baddbmm(a * eye + b * gram, gram, gram, alpha=c)
            product = P if product is None else P @ product
            if step + 1 < steps:  # the last Gram matrix goes unused: with P as the first product, 3 of 20 saved
                gram = P @ gram @ P  # the Gram matrix of P X
        for i, P in zip(group, product.split([Xs[i].size(0) for i in group])):
            out[i] = P @ Xs[i]
    return [X.mT if t else X for X, t in zip(out, tall)]


class Muon(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz iteration in float32 (TF32 on a GPU), all the matrices of one
    short side in one batched iteration. torch's iterates one matrix at a time in bfloat16: on a GPU one launch
    after another, on a CPU slow (docs/results.md); and orthogonalize's Gram form in bfloat16 put a square
    matrix's update 13% off. Same hyperparameters, same state (a momentum buffer per matrix) and the same
    update to within bf16 precision: tests/test_optim.py."""

    orthogonalize = staticmethod(orthogonalize)  # bench/gpu.py times one compiled in its place

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            momentum, lr = group["momentum"], group["lr"]
            by_shape, stacks = defaultdict(list), []
            for p in group["params"]:
                if p.grad is not None:
                    by_shape[p.shape].append(p)
                    if "momentum_buffer" not in self.state[p]:
                        self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            for params in by_shape.values():  # each _foreach_ op: one launch for all, not one each
                grads = [p.grad for p in params]
                bufs = [self.state[p]["momentum_buffer"] for p in params]
                torch._foreach_lerp_(bufs, grads, 1 - momentum)
                stacks.append(torch.stack(torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs))
            ortho = self.orthogonalize(stacks, group["ns_coefficients"], group["ns_steps"], group["eps"])
            match_adamw = group["adjust_lr_fn"] == "match_rms_adamw"  # the update's RMS: AdamW's typical 0.2
            for ((A, B), params), O in zip(by_shape.items(), ortho):
                scale = 0.2 * math.sqrt(max(A, B)) if match_adamw else math.sqrt(max(1, A / B))  # torch's "original"
                torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
                torch._foreach_add_(params, O.to(params[0].dtype).unbind(), alpha=-lr * scale)


def muon(matrices, cfg):
    """Muon for matrices, with train.py's settings cfg. Its group's lr_scale multiplies the schedule's
    learning rate, so that Muon and AdamW warm up and decay together, each from its own peak. Its weight decay,
    auto: 0.1 where there is no dropout, else none (on a text read often, both do worse: docs/own_text.md)."""
    decay = (0.0 if cfg.dropout else 0.1) if cfg.muon_weight_decay == "auto" else cfg.muon_weight_decay
    return Muon([{"params": matrices, "lr_scale": cfg.muon_lr / cfg.learning_rate}], lr=cfg.muon_lr,
                weight_decay=decay, momentum=cfg.muon_momentum, nesterov=True, ns_steps=cfg.muon_ns_steps,
                adjust_lr_fn="match_rms_adamw")


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
