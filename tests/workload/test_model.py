"""The reference model: attention route vs SDPA, the flex kernel really runs, fused loss vs
nn.Linear + cross-entropy, bitwise determinism, config validation.

Every attention call uses the default ModelConfig's shape ([2, 4, 256, 32]): each new shape
would cost another 3-4 s of compile.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from chaos.workload import model as workload_model
from chaos.workload.model import (
    ModelConfig,
    Transformer,
    attention,
    build_block_mask,
    compiled_flex_attention,
    dense_mask,
    set_deterministic,
)

CFG = ModelConfig()
BATCH = 2
# Row 0 has a one-token document and a boundary on the 128-token block edge; row 1 is one
# document up to its last position, which is alone.
DOC_IDS = torch.tensor(
    [[0] * 50 + [1] + [2] * 77 + [3] * 128, [0] * 255 + [1]], dtype=torch.long
)


@pytest.fixture(autouse=True, scope="module")
def deterministic():
    # The trainer compiles and runs under set_deterministic(); test under the same mode.
    previous = torch.are_deterministic_algorithms_enabled()
    set_deterministic()
    yield
    torch.use_deterministic_algorithms(previous)


def reference_mask(mask: str) -> torch.Tensor:
    """The boolean mask [B, 1, S, S] written out independently of the model's mask_mods."""
    q = torch.arange(CFG.seq_len).view(-1, 1)
    kv = torch.arange(CFG.seq_len).view(1, -1)
    allowed = (q >= kv).expand(BATCH, 1, -1, -1)
    if mask == "sliding":
        allowed = allowed & (q - kv < CFG.window)
    if mask == "document":
        allowed = allowed & (DOC_IDS[:, None, :, None] == DOC_IDS[:, None, None, :])
    return allowed


def qkv(requires_grad: bool = True) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    shape = (BATCH, CFG.n_heads, CFG.seq_len, CFG.head_dim)
    return [torch.randn(shape, generator=gen).requires_grad_(requires_grad) for _ in range(3)]


def batch(seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG.vocab, (BATCH, CFG.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("mask", ["causal", "document", "sliding"])
def test_attention_forward_and_grads_match_sdpa(mask: str) -> None:
    cfg = ModelConfig(mask=mask)
    block_mask = build_block_mask(cfg, DOC_IDS, "cpu")
    expected_mask = reference_mask(mask)
    assert torch.equal(dense_mask(block_mask).expand(BATCH, -1, -1, -1), expected_mask)

    q, k, v = qkv()
    rq, rk, rv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))

    out = attention(q, k, v, block_mask)
    ref = F.scaled_dot_product_attention(rq, rk, rv, attn_mask=expected_mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)

    out.backward(grad_out)
    ref.backward(grad_out)
    for got, want in ((q, rq), (k, rk), (v, rv)):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=0)


def test_forward_runs_the_compiled_flex_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = compiled_flex_attention()
    assert compiled._torchdynamo_orig_callable is flex_attention
    assert compiled_flex_attention() is compiled, "compiled once per process"

    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs["block_mask"])
        return compiled(*args, **kwargs)

    monkeypatch.setattr(workload_model, "compiled_flex_attention", lambda: spy)
    block_mask = build_block_mask(CFG, None, "cpu")
    q, k, v = qkv()
    attention(q, k, v, block_mask).sum().backward()
    assert calls == [block_mask]

    model = Transformer(CFG, seed=0)
    model(*batch(), block_mask)
    assert len(calls) == 1 + CFG.n_layers


def test_loss_matches_linear_cross_entropy_reference() -> None:
    model = Transformer(CFG, seed=0)
    captured = []
    model.head.register_forward_hook(lambda module, args, out: captured.append(args))
    tokens, targets = batch()
    loss = model(tokens, targets, build_block_mask(CFG, None, "cpu"))

    hidden, flat_targets = captured[0]
    assert hidden.shape == (BATCH * CFG.seq_len, CFG.dim)
    weight = model.head.linear.weight
    x_ref = hidden.detach().clone().requires_grad_()
    w_ref = weight.detach().clone().requires_grad_()
    ref = F.cross_entropy(F.linear(x_ref, w_ref), flat_targets)
    torch.testing.assert_close(loss, ref, atol=1e-4, rtol=0)

    # The head's gradients on the same hidden states and weights.
    x = hidden.detach().clone().requires_grad_()
    model.head(x, flat_targets).backward()
    ref.backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-4, rtol=0)
    torch.testing.assert_close(weight.grad, w_ref.grad, atol=1e-4, rtol=0)


def loss_and_grads(seed: int) -> dict[str, torch.Tensor]:
    cfg = ModelConfig(mask="document")
    model = Transformer(cfg, seed=seed)
    tokens, targets = batch()
    loss = model(tokens, targets, build_block_mask(cfg, DOC_IDS, "cpu"))
    loss.backward()
    out = {"loss": loss.detach()}
    for name, param in model.named_parameters():
        out[name] = param.detach()
        out[f"{name}.grad"] = param.grad
    return out


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"not bitwise equal: {different}"


def test_same_seed_is_bitwise_deterministic_in_process_and_across_processes(tmp_path: Path) -> None:
    first = loss_and_grads(seed=7)
    assert_bitwise_equal(first, loss_and_grads(seed=7))
    assert not torch.equal(first["tok_emb.weight"], Transformer(CFG, seed=8).tok_emb.weight)

    out = tmp_path / "other_process.pt"
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from chaos.workload.model import set_deterministic
        torch.set_num_threads({torch.get_num_threads()})
        set_deterministic()
        from test_model import loss_and_grads
        torch.save(loss_and_grads(seed=7), {str(out)!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    assert_bitwise_equal(first, torch.load(out))


def test_init_leaves_the_global_rng_alone() -> None:
    state = torch.get_rng_state()
    Transformer(CFG, seed=0)
    assert torch.equal(state, torch.get_rng_state())


def test_static_masks_are_cached_and_document_mask_needs_doc_ids() -> None:
    assert build_block_mask(CFG, None, "cpu") is build_block_mask(CFG, None, torch.device("cpu"))
    with pytest.raises(ValueError, match="needs doc_ids"):
        build_block_mask(ModelConfig(mask="document"), None, "cpu")
    with pytest.raises(ValueError, match=r"expected doc_ids of shape \[B, 256\], found \(2, 8\)"):
        build_block_mask(ModelConfig(mask="document"), torch.zeros(2, 8, dtype=torch.long), "cpu")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab": 1}, r"vocab: expected >= 2, found 1"),
        ({"dim": 0}, r"dim: expected a positive int, found 0"),
        ({"n_layers": 2.0}, r"n_layers: expected a positive int, found 2.0"),
        ({"dim": 130}, r"dim: expected a multiple of n_heads=4, found 130"),
        ({"mask": "full"}, r"mask: expected one of \('causal', 'document', 'sliding'\), found 'full'"),
        ({"window": 512}, r"window: expected <= seq_len=256, found 512"),
        ({"loss_batch_chunk": -1}, r"loss_batch_chunk: expected a positive int, found -1"),
    ],
)
def test_model_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


def test_forward_rejects_wrong_sequence_length() -> None:
    model = Transformer(CFG, seed=0)
    tokens = torch.zeros(BATCH, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="expected seq_len 256, found 8"):
        model(tokens, tokens, build_block_mask(CFG, None, "cpu"))


_WARM_UP = textwrap.dedent("""
    import json, torch
    from torch._dynamo.utils import counters
    from chaos.workload.model import ModelConfig, build_block_mask, warm_up_attention
    cfg = ModelConfig(vocab=64, dim=16, n_layers=1, n_heads=2, seq_len=64)
    warm_up_attention(cfg, build_block_mask(cfg, None, "cpu"), 1, torch.device("cpu"))
    print(json.dumps(dict(counters["inductor"])))
""")


def test_ranks_of_one_host_compile_a_cold_kernel_once(tmp_path: Path) -> None:
    # Two ranks starting together on an empty inductor cache: one compiles, the other waits
    # and loads the kernel from the cache. Without the host lock both compile (two misses).
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    ranks = [subprocess.Popen([sys.executable, "-c", _WARM_UP], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outs
    counts = [json.loads(out.splitlines()[-1]) for out in outs]
    assert sorted((c.get("fxgraph_cache_miss", 0), c.get("fxgraph_cache_hit", 0)) for c in counts) == [
        (0, 1), (1, 0)], counts
