"""The model of the users' trainers beside it (plain torch: no chaos, no commlib): what a small
user's transformer block holds, FlexAttention and a fused LinearCrossEntropyLoss head.

`UserModel(x, y)` returns the mean loss of class targets `y` for the rows of `x`, which it reads
as one sequence: an input projection, causal self-attention by `flex_attention`, an optional
dropout (drawn from torch's global RNG), and `nn.LinearCrossEntropyLoss` as the head.
FlexAttention has no backward on CPU, so the attention's backward is recomputed densely
(`scaled_dot_product_attention`, the same causal mask), as a user training on CPU must.
"""

import warnings
from functools import cache

import torch
from torch import nn
from torch.nn import functional
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

# flex_attention outside torch.compile runs its unfused reference path, and says so once per
# process; that path is what these CPU runs want (compiling would cost each rank seconds).
warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


def _causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return q >= kv


@cache
def causal_mask(length: int) -> BlockMask:
    return create_block_mask(_causal, None, None, length, length, device="cpu")


class CausalFlexAttention(torch.autograd.Function):
    """`flex_attention` forward; its backward the dense causal attention's."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(q, k, v)
        return flex_attention(q.detach(), k.detach(), v.detach(), block_mask=causal_mask(q.shape[-2]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad(out, (q, k, v), grad)


class UserModel(nn.Module):
    def __init__(self, features: int = 8, dim: int = 32, classes: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Linear(features, dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.LinearCrossEntropyLoss(dim, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = functional.gelu(self.embed(x))
        q, k, v = (t[None, None] for t in self.qkv(h).chunk(3, dim=-1))  # one sequence, one head
        h = h + self.proj(CausalFlexAttention.apply(q, k, v)[0, 0])
        return self.head(self.dropout(h), y)
