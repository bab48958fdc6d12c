"""The reference trainer's model: a small decoder-only transformer and its attention route.

This module owns:

* ``ModelConfig`` -- the model's shape, attention mask variant and loss chunking.
* ``Transformer`` -- token + learned position embedding, ``n_layers`` pre-norm blocks
  (RMSNorm -> attention -> residual, RMSNorm -> MLP -> residual) kept in the
  ``nn.ModuleList`` ``layers`` so the trainer can ``fully_shard`` each block and the root,
  a final RMSNorm and a fused head+loss (``nn.LinearCrossEntropyLoss``, chunked, so the
  ``[tokens, vocab]`` logits are never materialized). ``forward`` returns the mean
  next-token loss. Weights are drawn from a ``torch.Generator`` seeded by ``seed``, so
  every process that builds the model with the same seed holds bitwise-identical weights.
* ``build_block_mask`` -- FlexAttention ``BlockMask`` for the causal, document (causal
  within packed documents) and sliding-window causal variants; every variant keeps the
  diagonal, so no query row is ever fully masked.
* ``attention`` -- the one place that picks the attention route by device:

  - CUDA (and any non-CPU device): the compiled ``flex_attention`` forward and its own
    compiled backward.
  - CPU: PyTorch 2.13's FlexAttention is inference-only on CPU (it raises
    ``NotImplementedError`` for inputs that require grad). ``FlexAttentionCPU`` therefore
    runs the real compiled FlexAttention kernel on detached inputs in the forward, and in
    the backward recomputes attention densely (``softmax(q k^T * scale, masked) v`` with
    the boolean mask evaluated from the same ``mask_mod``) under autograd and returns its
    ``dq, dk, dv``. The forward is the flex kernel's output, the gradients are those of
    the dense equivalent (they agree to ~1e-6 in fp32).

* ``warm_up_attention`` -- the trainer's compile at startup, once per host with a cold
  inductor cache (``one_cold_compile_per_host``), in parallel from a warm one.
* ``set_deterministic`` -- what the trainer calls before building the model so two
  processes with the same seed and inputs produce bitwise-equal losses and gradients.

Everything trains in fp32: in bf16 the chunked loss *value* is off by up to 15% on CPU
(the running loss is accumulated in bf16 across chunks).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

MASKS = ("causal", "document", "sliding")

# A mask_mod maps broadcastable index tensors (batch, head, q_idx, kv_idx) to a bool tensor.
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the reference model.

    The defaults keep a CPU forward+backward at 2 ranks well under 1 s: about 0.35 s of CPU
    per rank at one thread for 2 x 256 tokens, 45% of it in the fused head.
    """

    vocab: int = 8192
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 256
    mlp_hidden: int = 512
    mask: str = "causal"
    window: int = 64
    loss_batch_chunk: int = 256

    def __post_init__(self) -> None:
        for name in ("vocab", "dim", "n_layers", "n_heads", "seq_len", "mlp_hidden", "window", "loss_batch_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name}: expected a positive int, found {value!r}")
        if self.vocab < 2:
            raise ValueError(f"ModelConfig.vocab: expected >= 2, found {self.vocab}")
        if self.dim % self.n_heads:
            raise ValueError(f"ModelConfig.dim: expected a multiple of n_heads={self.n_heads}, found {self.dim}")
        if self.mask not in MASKS:
            raise ValueError(f"ModelConfig.mask: expected one of {MASKS}, found {self.mask!r}")
        if self.window > self.seq_len:
            raise ValueError(f"ModelConfig.window: expected <= seq_len={self.seq_len}, found {self.window}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def set_deterministic() -> None:
    """Make training bitwise reproducible across processes (same seed, inputs, thread count).

    Call once per process before the first CUDA/cuBLAS call. On CPU the remaining
    requirement is an equal intra-op thread count in the processes being compared, since
    reduction splits follow it.
    """
    # cuBLAS needs a fixed workspace to be deterministic; it must be set before cuBLAS starts.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


# ---------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------


def _causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return q >= kv


def _sliding(window: int) -> MaskMod:
    def sliding(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (q >= kv) & (q - kv < window)

    return sliding


def _document(doc_ids: torch.Tensor) -> MaskMod:
    def document(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (q >= kv) & (doc_ids[b, q] == doc_ids[b, kv])

    return document


@functools.lru_cache(maxsize=16)
def _static_block_mask(mask: str, window: int, seq_len: int, device: torch.device) -> BlockMask:
    # create_block_mask costs 4-120 ms; causal and sliding masks depend only on the shape,
    # so they are built once per (variant, shape, device) and broadcast over batch and heads.
    mask_mod = _causal if mask == "causal" else _sliding(window)
    return create_block_mask(mask_mod, None, None, seq_len, seq_len, device=device)


def build_block_mask(cfg: ModelConfig, doc_ids: torch.Tensor | None, device: torch.device | str) -> BlockMask:
    """The BlockMask for ``cfg.mask``.

    ``doc_ids`` (LongTensor[B, S], document index per position) is required for the
    ``"document"`` mask, which is rebuilt per batch; it is ignored by ``"causal"`` and
    ``"sliding"``, whose masks are cached per (shape, device).
    """
    device = torch.device(device)
    if cfg.mask != "document":
        return _static_block_mask(cfg.mask, cfg.window, cfg.seq_len, device)
    if doc_ids is None:
        raise ValueError("build_block_mask: mask 'document' needs doc_ids, found None")
    if doc_ids.dim() != 2 or doc_ids.shape[1] != cfg.seq_len:
        raise ValueError(
            f"build_block_mask: expected doc_ids of shape [B, {cfg.seq_len}], found {tuple(doc_ids.shape)}"
        )
    doc_ids = doc_ids.to(device)
    return create_block_mask(_document(doc_ids), doc_ids.shape[0], None, cfg.seq_len, cfg.seq_len, device=device)


def dense_mask(block_mask: BlockMask) -> torch.Tensor:
    """Boolean mask [B or 1, 1, Q, KV] (True = attend) evaluated from ``block_mask.mask_mod``.

    Evaluates the mask_mod once on broadcast index tensors (well under 1 ms at S=256)
    instead of ``create_mask``'s vmap (20-70 ms); this works because the mask_mods here
    use only broadcasting ops.
    """
    batch, _, q_len, kv_len = block_mask.shape
    device = block_mask.kv_num_blocks.device
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device).view(1, 1, -1, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, -1)
    return block_mask.mask_mod(b, h, q, kv).expand(-1, 1, q_len, kv_len)


# ---------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------


@functools.cache
def compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """flex_attention compiled once per process (lazily: importing this module compiles nothing).

    Static shapes: the trainer's shapes are fixed, and each new shape or mask_mod costs
    seconds of compile (3-4 s with a warm inductor cache, 12 s to minutes with a cold one;
    scripts/bench_attention.py). A new document mask of the same shape does not recompile.

    Two of inductor's options are set for this function alone. Both concern CPU kernels only,
    and both cut what a warm start costs: every torchrun restart after a fault starts each
    rank afresh, and before inductor looks in its warm cache it would run two child
    processes, about 1 s of CPU per rank (1.2 s less per start: scripts/bench_rank_start.py,
    docs/measurements.md):
    - ``cpp_cache_precompile_headers``: off, so that the C++ preprocessor is not run over
      inductor's whole prefix header (to key a precompiled header) at every start. A cold
      compile takes a few seconds longer without the precompiled header; it happens once
      per host and shape (``one_cold_compile_per_host``).
    - ``cpp.vec_isa_ok``: inductor takes the vector ISA the CPU reports instead of proving
      it at every start with a child Python that loads a probe library. A compiler that
      cannot build for that ISA then fails the compile with its error, loudly, rather than
      falling back to scalar code.
    """
    return torch.compile(
        flex_attention,
        dynamic=False,
        options={"cpp_cache_precompile_headers": False, "cpp.vec_isa_ok": True},
    )


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim) masked by ``mask``) v -- the CPU backward's recompute."""
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ v


class FlexAttentionCPU(torch.autograd.Function):
    """Compiled FlexAttention forward on CPU with a dense recomputed backward.

    FlexAttention refuses inputs that require grad on CPU, so the forward hides autograd
    from it (detached inputs, no_grad) and the backward differentiates the dense
    equivalent built from the same mask_mod.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        block_mask: BlockMask,
    ) -> torch.Tensor:
        with torch.no_grad():
            out = compiled_flex_attention()(q.detach(), k.detach(), v.detach(), block_mask=block_mask)
        ctx.save_for_backward(q, k, v)
        ctx.block_mask = block_mask
        return out

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = dense_attention(q, k, v, dense_mask(ctx.block_mask))
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
        return dq, dk, dv, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """Masked attention over q, k, v [B, H, S, head_dim]; the route depends on the device.

    CPU: ``FlexAttentionCPU`` (compiled flex forward, dense recomputed backward).
    Elsewhere: compiled ``flex_attention`` forward and backward.
    """
    # One memory layout for every caller: the compiled kernel is specialised on strides,
    # so a permuted view from the model and a fresh tensor from a test would each compile.
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if q.device.type == "cpu":
        return FlexAttentionCPU.apply(q, k, v, block_mask)
    return compiled_flex_attention()(q, k, v, block_mask=block_mask)


def warm_up_attention(cfg: ModelConfig, block_mask: BlockMask, batch_size: int, device: torch.device) -> None:
    """Compile the attention kernels for the trainer's shapes now, on zero inputs.

    A rank's first forward otherwise pays the compile (seconds warm, minutes cold) in the
    middle of a step, after its peers may already be waiting in a collective with a short
    deadline. Forward and backward run, so CUDA compiles flex's backward too; on CPU the
    backward is the dense recompute and compiles nothing. Draws no random numbers.
    The ranks of one host compile the kernels once between them (`one_cold_compile_per_host`).
    """
    shape = (batch_size, cfg.n_heads, cfg.seq_len, cfg.head_dim)
    key = "-".join(
        map(
            str,
            (torch.__version__, device.type, *shape, cfg.mask, cfg.window, *block_mask.shape, *block_mask.BLOCK_SIZE),
        )
    )
    with one_cold_compile_per_host(key):
        q, k, v = (torch.zeros(shape, device=device, requires_grad=True) for _ in range(3))
        attention(q, k, v, block_mask).sum().backward()


@contextlib.contextmanager
def one_cold_compile_per_host(key: str) -> Iterator[None]:
    """Run the block alone on this host the first time `key` is compiled, with the others waiting.

    Every rank of a host compiles the same kernels. With a cold inductor cache, N ranks that
    start together would each compile them from scratch (12 s to minutes of CPU each, the
    compilers of all N sharing the host's cores); instead the first one compiles while the
    others wait on a lock, then they load the kernels from the warm cache (under a second).
    A marker in the cache directory says `key` was compiled on this host before: later
    processes (a torchrun restart) skip the lock and compile from the cache in parallel.
    The lock only saves work: a marker whose cache entries are gone costs a parallel cold
    compile, as without it, never a wrong kernel (inductor's own cache keys decide that).
    """
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # where inductor's own cache is

    root = os.path.join(cache_dir(), "chaos-compiled")
    marker = os.path.join(root, key)
    if not os.path.exists(marker):
        os.makedirs(root, exist_ok=True)
        with open(f"{marker}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not os.path.exists(marker):  # nobody compiled it while this process waited
                yield
                open(marker, "a").close()
                return
    yield


# ---------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        out = attention(q, k, v, block_mask)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.dim, cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), block_mask)
        return x + self.mlp(self.mlp_norm(x))


def require_supported_torch() -> None:
    """Fail at once, naming the torch version, where the fused loss this model uses is missing.

    `nn.LinearCrossEntropyLoss` first shipped in torch 2.13; without this check an older torch
    fails with a bare AttributeError only after minutes of startup (compiling FlexAttention).
    """
    if not hasattr(nn, "LinearCrossEntropyLoss"):
        raise RuntimeError(
            f"the reference workload needs torch.nn.LinearCrossEntropyLoss (torch >= 2.13); "
            f"found torch {torch.__version__} without it. commlib itself supports older torch "
            f"(see docs/torch-versions.md)"
        )


def loss_options(cfg: ModelConfig) -> nn.LinearCrossEntropyOptions:
    """Chunking of the fused head+loss: fixed chunks of ``cfg.loss_batch_chunk`` token rows.

    The automatic chunking (``LinearCrossEntropyOptions()``) picks 8-32-row chunks on CPU
    and runs up to 5.6x slower than ``nn.Linear`` + ``nn.CrossEntropyLoss``; a fixed chunk
    matches the reference's speed with the same low peak memory
    (``scripts/bench_fused_loss.py``).
    """
    return nn.LinearCrossEntropyOptions(chunking_method=None, batch_chunk_size=cfg.loss_batch_chunk)


class Transformer(nn.Module):
    """Decoder-only transformer whose forward returns the mean next-token loss (fp32)."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        # Built on the meta device and initialised from our own generator: the default
        # initialisers would draw from (and advance) the global RNG.
        with torch.device("meta"):
            self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.dim)
            self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
            self.norm = nn.RMSNorm(cfg.dim)
            self.head = nn.LinearCrossEntropyLoss(cfg.dim, cfg.vocab, options=loss_options(cfg))
        self.to_empty(device=device)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init from ``torch.Generator().manual_seed(seed)``, drawn on CPU.

        Drawing on CPU in parameter-registration order makes the weights independent of
        the target device. Norm gains are 1; embeddings N(0, 0.02); linear weights
        N(0, 1/fan_in), with the residual-branch outputs (attention proj, MLP down)
        further scaled by 1/sqrt(2 * n_layers) so the residual stream's variance stays
        bounded with depth.
        """
        gen = torch.Generator().manual_seed(seed)
        residual_scale = (2 * self.cfg.n_layers) ** -0.5
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            if name.endswith("_emb.weight"):
                std = 0.02
            else:
                std = param.shape[-1] ** -0.5
                if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                    std *= residual_scale
            param.copy_(torch.randn(param.shape, generator=gen) * std)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
        """Mean cross-entropy of predicting ``targets`` [B, S] from ``tokens`` [B, S]."""
        batch, seq = tokens.shape
        if seq != self.cfg.seq_len:
            raise ValueError(f"Transformer: expected seq_len {self.cfg.seq_len}, found {seq}")
        positions = torch.arange(seq, device=tokens.device)
        h = self.tok_emb(tokens) + self.pos_emb(positions)
        for layer in self.layers:
            h = layer(h, block_mask)
        h = self.norm(h)
        return self.head(h.reshape(batch * seq, -1), targets.reshape(batch * seq))
