"""A small decoder-only transformer (GPT), in the style of nanoGPT.

token + position embedding -> n_layers x [x + attn(ln(x)); x + mlp(ln(x))] -> ln -> lm head
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from diloco.train.train_config import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.d_model % cfg.n_heads == 0, "n_heads must divide d_model"
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)  # query, key, value for all heads at once
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        head = cfg.d_model // cfg.n_heads
        self.q_norm = nn.LayerNorm(head) if cfg.qk_norm else None
        self.k_norm = nn.LayerNorm(head) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_heads, T, head_dim)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.d_model),
                wpe=nn.Embedding(cfg.seq_len, cfg.d_model),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)]),
                ln_f=nn.LayerNorm(cfg.d_model),
            )
        )
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            # One Parameter under two modules: named_parameters() lists it once, as transformer.wte.weight.
            self.lm_head.weight = self.transformer.wte.weight

        self.apply(self._init_weights)
        # GPT-2: scale the projections that write into the residual stream, so its variance
        # does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = idx.shape
        assert T <= self.cfg.seq_len, f"sequence of {T} tokens is longer than seq_len={self.cfg.seq_len}"
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            flat = logits.view(-1, logits.size(-1))
            loss = F.cross_entropy(flat, targets.reshape(-1))
            if self.cfg.z_loss and self.training:  # evaluation reports the cross-entropy alone
                loss = loss + self.cfg.z_loss * torch.logsumexp(flat.float(), dim=-1).square().mean()
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.8,
        top_k: int | None = 40,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend idx (B, T) by max_new_tokens sampled tokens; temperature 0 picks the likeliest token."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.cfg.seq_len :]
            logits, _ = self(context)
            logits = logits[:, -1, :]
            if temperature <= 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                next_id = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, next_id), dim=1)
        return idx


def build_model(cfg: ModelConfig, seed: int) -> GPT:
    """A GPT whose initial parameters depend on `seed` alone: the same seed gives bit-identical
    parameters in every process, so learners and the syncer start from one model without sending it."""
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG as it was
        torch.manual_seed(seed)
        return GPT(cfg)


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameter elements (a tied matrix counts once)."""
    return sum(p.numel() for p in model.parameters())
