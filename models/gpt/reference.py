"""Single-device GPT in plain PyTorch: the numerical oracle of the tests (docs/design.md §4).

Written independently of the tensor-parallel model on purpose: ``[b, s, h]`` layout, ``nn.Linear`` /
``nn.Embedding``, attention spelled out as softmax(QK^T / sqrt(d)) V with an explicit causal mask,
and ``F.cross_entropy`` over the true (unpadded) vocab. Its state dict is the canonical layout of
:mod:`models.gpt.sharding`; :meth:`ReferenceGPT.init_weights` gives the same values as the TP model's.

The Llama-family options are spelled out differently from the TP model too: RMSNorm by its formula;
rotary embeddings as complex multiplication of the channel pairs (i, i + d/2) by e^{i p theta}, with
the Llama-3.1 frequency scaling evaluated per frequency in plain Python; grouped-query attention by
indexing each head's key/value group; SwiGLU from the ``[gate; up]`` halves with silu = x sigmoid(x).
Mixture-of-experts layers (issue 32): :class:`MixtureOfExperts`, dense gate matrices instead of the
TP model's token sorting.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.gpt.config import GPTConfig
from hybrid.muon_config import NS_COEFFICIENTS, NS_EPS, is_muon_param
from models.gpt.sharding import canonical_init


def rotary_frequencies(config: GPTConfig) -> torch.Tensor:
    """theta_i = base^(-2i/d) for i < d/2, with Llama-3.1's scaling (fp64 [d/2])."""
    d, out = config.head_dim, []
    for i in range(d // 2):
        theta = config.rotary_base ** (-2 * i / d)
        if config.use_rope_scaling:
            wavelength = 2 * math.pi / theta
            low_wave = config.rope_original_max_position_embeddings / config.rope_low_freq_factor
            high_wave = config.rope_original_max_position_embeddings / config.rope_high_freq_factor
            if wavelength > low_wave:        # long waves: interpolated by the factor
                theta = theta / config.rope_scaling_factor
            elif wavelength >= high_wave:    # in between: blend of both
                smooth = ((config.rope_original_max_position_embeddings / wavelength
                           - config.rope_low_freq_factor)
                          / (config.rope_high_freq_factor - config.rope_low_freq_factor))
                theta = (1 - smooth) * theta / config.rope_scaling_factor + smooth * theta
        out.append(theta)
    return torch.tensor(out, dtype=torch.float64)


def apply_rotary(x: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """Rotate channel pairs (i, i + d/2) of x [b, heads, s, d] by p theta_i at position p."""
    b, heads, s, d = x.shape
    angles = torch.arange(s, dtype=torch.float64)[:, None] * rotary_frequencies(config)[None, :]
    turn = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)     # [s, d/2]
    pairs = torch.complex(x[..., :d // 2].float(), x[..., d // 2:].float())    # [b, heads, s, d/2]
    turned = pairs * turn
    return torch.cat([turned.real, turned.imag], dim=-1).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight


def make_norm(config: GPTConfig) -> nn.Module:
    if config.normalization == "RMSNorm":
        return RMSNorm(config.hidden_size, config.norm_epsilon)
    return nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon)


class Attention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.heads, self.groups, h = config.num_attention_heads, config.query_groups, config.hidden_size
        kv = self.groups * config.head_dim
        self.qkv = nn.Linear(h, h + 2 * kv, bias=config.add_bias_linear or config.add_qkv_bias)  # [q; k; v]
        self.proj = nn.Linear(h, h, bias=config.add_bias_linear)
        self.dropout = nn.Dropout(config.attention_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        kv = self.groups * self.config.head_dim
        q, k, v = self.qkv(x).split([h, kv, kv], dim=2)
        q = q.view(b, s, self.heads, -1).transpose(1, 2)                        # [b, a, s, d]
        k, v = (t.view(b, s, self.groups, -1).transpose(1, 2) for t in (k, v))  # [b, g, s, d]
        if self.config.position_embedding_type == "rope":
            q, k = apply_rotary(q, self.config), apply_rotary(k, self.config)
        group_of_head = torch.arange(self.heads) // (self.heads // self.groups)
        k, v = k[:, group_of_head], v[:, group_of_head]                         # [b, a, s, d]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))               # [b, a, s, s]
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        probs = self.dropout(scores.masked_fill(~causal, float("-inf")).softmax(dim=-1))
        y = (probs @ v).transpose(1, 2).reshape(b, s, h)                        # [b, s, h]
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.swiglu, f = config.swiglu, config.ffn_hidden_size
        self.fc1 = nn.Linear(config.hidden_size, 2 * f if self.swiglu else f,
                             bias=config.add_bias_linear)                       # SwiGLU rows [gate; up]
        self.fc2 = nn.Linear(f, config.hidden_size, bias=config.add_bias_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            return self.fc2(gate * torch.sigmoid(gate) * up)
        return self.fc2(F.gelu(y, approximate="tanh"))


class Weight(nn.Module):
    """A bare ``weight`` parameter (so names read ``experts.fc1.weight``)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape))


class MixtureOfExperts(nn.Module):
    """The MoE block from its definitions (issue 32), on [b, s, h], written without the TP model's
    sort-and-group machinery: every expert runs on every token and a dense [tokens, E] gate matrix
    (zero off the chosen experts) mixes the outputs; capacity is a Python loop over experts.

    Router in fp32: logits = x W_r^T. Softmax: top-k of the logits then softmax over the k
    (Mixtral), or with pre_softmax softmax over E then top-k. Sigmoid: top-k of sigmoid(logits) +
    bias, the chosen sigmoid scores divided by their sum (k > 1). Times the scaling factor.
    Capacity C = ceil(factor T k / E): an expert offered more routes keeps the C of largest
    probability, ties to the earlier position, then the lower sequence, then the earlier choice.
    Losses over the T tokens of this call: aux = E sum_e (routes to e / (T k)) (mean_t p_te), per
    sequence for seq_aux_loss (rows of the batch), z = mean_t logsumexp^2, each times its
    coefficient. Expert e: SwiGLU with fc1 rows [gate; up]."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = c = config
        h, e, f = c.hidden_size, c.num_experts, c.moe_ffn_hidden_size
        self.router = Weight(e, h)
        self.experts = nn.Module()
        self.experts.fc1, self.experts.fc2 = Weight(e, 2 * f, h), Weight(e, h, f)
        self.shared_expert = self.shared_expert_gate = None
        if c.moe_shared_expert_intermediate_size is not None:
            fs = c.moe_shared_expert_intermediate_size
            self.shared_expert = nn.Module()
            self.shared_expert.fc1, self.shared_expert.fc2 = Weight(2 * fs, h), Weight(h, fs)
            self.shared_expert_gate = Weight(1, h) if c.moe_shared_expert_gate else None
        self.router.register_buffer("expert_bias", torch.zeros(e))
        self.load_since_update = torch.zeros(e)
        self.aux = torch.zeros(())   # this call's balancing losses (with their graph)

    @staticmethod
    def swiglu(x, fc1, fc2):
        gate, up = (x @ fc1.t()).chunk(2, dim=-1)
        return (gate * torch.sigmoid(gate) * up) @ fc2.t()

    def route(self, x: torch.Tensor):
        """x [T, h] -> (chosen [T, k] expert ids, weights [T, k], scores p [T, E], logits)."""
        c = self.config
        logits = x.float() @ self.router.weight.float().t()
        k = c.moe_router_topk
        if c.moe_router_score_function == "sigmoid":
            sig = torch.sigmoid(logits)
            key = sig + self.router.expert_bias if c.moe_router_enable_expert_bias else sig
            chosen = torch.argsort(key.detach(), dim=1, descending=True, stable=True)[:, :k]
            weights = sig.gather(1, chosen)
            if k > 1:
                weights = weights / (weights.sum(1, keepdim=True) + 1e-20)
            p = sig / (sig.sum(1, keepdim=True) + 1e-20)
        else:
            soft = torch.softmax(logits, dim=1)
            chosen = torch.argsort(logits.detach(), dim=1, descending=True, stable=True)[:, :k]
            if c.moe_router_pre_softmax:
                weights = soft.gather(1, chosen)
            else:
                picked = logits.gather(1, chosen)
                weights = torch.exp(picked - picked.max(1, keepdim=True).values)
                weights = weights / weights.sum(1, keepdim=True)
            p = soft
        if c.moe_router_topk_scaling_factor is not None:
            weights = weights * c.moe_router_topk_scaling_factor
        return chosen, weights, p, logits

    def keep_mask(self, chosen: torch.Tensor, weights: torch.Tensor, s: int) -> torch.Tensor:
        """[T, k] bool: the routes the capacity keeps (all of them when dropless). Token t of the
        [b, s] rows is position t % s of sequence t // s; ties in probability go to the earlier
        position, then the lower sequence, then the earlier choice."""
        c = self.config
        keep = torch.ones(chosen.shape, dtype=torch.bool)
        if c.moe_expert_capacity_factor is None:
            return keep
        t, k = chosen.shape
        cap = math.ceil(c.moe_expert_capacity_factor * t * k / c.num_experts)
        w = weights.detach().tolist()
        ids = chosen.tolist()
        for e in range(c.num_experts):
            routes = [(ti, j) for ti in range(t) for j in range(k) if ids[ti][j] == e]
            routes.sort(key=lambda r: (-w[r[0]][r[1]], r[0] % s, r[0] // s, r[1]))
            for ti, j in routes[cap:]:
                keep[ti, j] = False
        return keep

    def balance_losses(self, chosen, p, logits, b: int) -> torch.Tensor:
        c, e, k = self.config, self.config.num_experts, self.config.moe_router_topk
        total = torch.zeros(())
        if c.moe_router_load_balancing_type != "none" and c.moe_aux_loss_coeff:
            picked = torch.zeros(p.shape).scatter(1, chosen, 1.0)        # [T, E] 0/1
            groups = [slice(None)] if c.moe_router_load_balancing_type == "aux_loss" else \
                [slice(i * (p.size(0) // b), (i + 1) * (p.size(0) // b)) for i in range(b)]
            terms = [e * (picked[g].sum(0) / (picked[g].size(0) * k) * p[g].mean(0)).sum()
                     for g in groups]
            total = total + c.moe_aux_loss_coeff * torch.stack(terms).mean()
        if c.moe_z_loss_coeff is not None:
            total = total + c.moe_z_loss_coeff * (torch.logsumexp(logits, 1) ** 2).mean()
        return total

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(b * s, h)                                         # sequence i: rows i s ..
        chosen, weights, p, logits = self.route(flat)
        self.aux = self.balance_losses(chosen, p, logits, b)
        if torch.is_grad_enabled():
            self.load_since_update += torch.bincount(chosen.reshape(-1),
                                                     minlength=self.config.num_experts).float()
        gates = torch.zeros(b * s, self.config.num_experts).scatter_add(
            1, chosen, weights * self.keep_mask(chosen, weights, s))           # [T, E]
        outs = torch.stack([self.swiglu(flat, self.experts.fc1.weight[e], self.experts.fc2.weight[e])
                            for e in range(self.config.num_experts)], dim=1)   # [T, E, h]
        y = (gates.unsqueeze(2) * outs.float()).sum(1).to(x.dtype)
        if self.shared_expert is not None:
            shared = self.swiglu(flat, self.shared_expert.fc1.weight, self.shared_expert.fc2.weight)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(flat @ self.shared_expert_gate.weight.t())
            y = y + shared
        return y.view(b, s, h)

    @torch.no_grad()
    def update_bias(self) -> None:
        """After an optimizer step: bias += rate * sign(mean load - load) over the step's tokens."""
        if self.config.moe_router_enable_expert_bias:
            load = self.load_since_update
            self.router.expert_bias += self.config.moe_router_bias_update_rate * torch.sign(
                load.mean() - load)
        self.load_since_update.zero_()


class Block(nn.Module):
    """Pre-norm transformer layer: x + drop(attn(ln1(x))), then x + drop(mlp(ln2(x)))."""

    def __init__(self, config: GPTConfig, index: int = 0):
        super().__init__()
        self.ln1 = make_norm(config)
        self.attn = Attention(config)
        self.ln2 = make_norm(config)
        self.mlp = MixtureOfExperts(config) if config.is_moe_layer(index) else MLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln1(x)))
        return x + self.dropout(self.mlp(self.ln2(x)))


class Embedding(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position = None
        if config.position_embedding_type == "learned_absolute":
            self.position = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.word(tokens)                                                   # [b, s, h]
        if self.position is not None:
            x = x + self.position(torch.arange(tokens.size(1), device=tokens.device))
        return self.dropout(x)


class ReferenceGPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embedding = Embedding(config)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.final_norm = make_norm(config)
        self.output_layer = None                                                # tied
        if config.untie_embeddings_and_output_weights:
            self.output_layer = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """The canonical initial values (same as every TP degree of the model)."""
        for name, p in self.named_parameters():
            p.copy_(canonical_init(self.config, name, seed))

    def moe_blocks(self) -> list[MixtureOfExperts]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MixtureOfExperts)]

    def moe_aux_loss(self) -> torch.Tensor:
        """The balancing losses of the last forward, summed over the MoE blocks (the training
        objective is the mean token loss plus this; the reported loss is the former)."""
        return sum((block.aux for block in self.moe_blocks()), torch.zeros(()))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] -> logits [b, s, V], or per-token loss [b, s] (fp32) given labels [b, s]."""
        if tokens.size(1) > self.config.max_position_embeddings:
            raise ValueError(f"sequence of {tokens.size(1)} tokens is longer than max position "
                             f"embeddings {self.config.max_position_embeddings}")
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        out = self.embedding.word.weight if self.output_layer is None else self.output_layer.weight
        logits = self.final_norm(x) @ out.t()                                   # [b, s, V]
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        return loss.view_as(labels)


class ReferenceMuon:
    """Single-device Muon + AdamW, the oracle of the sharded Muon (issue 33; Jordan et al. 2024,
    Moonlight: Liu et al. 2025). Spelled out on whole canonical matrices, without partitions,
    owners or collectives: each matrix chosen by :func:`hybrid.muon_config.is_muon_param` keeps a
    momentum buffer ``M <- mu M + G``; its update is orthogonalise(G + mu M) (Nesterov; M without
    it) by quintic Newton-Schulz in ``ns_dtype`` (fp32 for exact parity), times
    ``config.scale(rows, cols)``, with decoupled weight decay (an expert stack [E, rows, cols]:
    each expert's matrix on its own):
    ``W <- W (1 - lr wd) - lr scale O``. Every other parameter: ``torch.optim.AdamW`` (decay on
    ndim >= 2 only). ``step(lr)`` after ``backward``."""

    def __init__(self, model: nn.Module, muon, adamw_lr: float, betas, eps: float,
                 weight_decay: float, ns_dtype: torch.dtype = torch.float32):
        self.muon, self.wd, self.ns_dtype = muon, weight_decay, ns_dtype
        named = list(model.named_parameters())
        # expert stacks (issue 32): 3-D weights [E, rows, cols], or what the caller marks
        # ``expert_parallel``; each [rows, cols] slice is its own matrix
        self.matrices = [p for n, p in named
                         if is_muon_param(n, p.dim(), p.dim() == 3 or
                                          bool(getattr(p, "expert_parallel", False)))]
        chosen = {id(p) for p in self.matrices}
        rest = [p for _, p in named if id(p) not in chosen]
        self.momenta = [torch.zeros_like(p) for p in self.matrices]
        self.adamw = torch.optim.AdamW(
            [{"params": [p for p in rest if p.dim() >= 2]},
             {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
            lr=adamw_lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def zero_grad(self) -> None:
        self.adamw.zero_grad()
        for p in self.matrices:
            p.grad = None

    def orthogonalise(self, g: torch.Tensor) -> torch.Tensor:
        """Five (``muon.ns_steps``) steps of X <- a X + b (X X^T) X + c (X X^T)^2 X on the
        Frobenius-normalised matrix; a tall matrix is iterated from the right (X^T X), the same
        polynomial."""
        a, b, c = NS_COEFFICIENTS
        x = g.to(self.ns_dtype)
        x = x / (torch.linalg.matrix_norm(x) + NS_EPS)
        tall = x.shape[0] > x.shape[1]
        for _ in range(self.muon.ns_steps):
            if tall:
                gram = x.t() @ x
                x = a * x + x @ (b * gram + c * (gram @ gram))
            else:
                gram = x @ x.t()
                x = a * x + (b * gram + c * (gram @ gram)) @ x
        return x.float()

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for group in self.adamw.param_groups:
            group["lr"] = lr
        self.adamw.step()
        mu = self.muon.momentum
        for p, buf in zip(self.matrices, self.momenta):
            grad = p.grad.float()
            buf.mul_(mu).add_(grad)
            direction = grad + mu * buf if self.muon.nesterov else buf
            if p.dim() == 3:   # an expert stack: E matrices, orthogonalised one by one
                update = torch.stack([self.orthogonalise(d) * self.muon.scale(*d.shape)
                                      for d in direction])
            else:
                update = self.orthogonalise(direction) * self.muon.scale(*p.shape)
            p.mul_(1 - lr * self.wd)
            p.sub_(lr * update)
