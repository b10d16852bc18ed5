"""The Triton backend against the portable torch backend, on CUDA (skipped elsewhere).

Tolerance: both backends see the same bf16 inputs; the reference is the torch backend run
in float32 on those inputs, and the Triton output (bf16, float32 accumulation) must be
within 1e-2 of it in relative Frobenius norm, as must the torch backend's own bf16 output.

With a quantized KV cache (int8, fp8, fp8-static with scales from the context's largest
values, as calibration takes them) both backends read the same codes: the Triton output
must be within 1e-2 of the torch backend's over that cache, and within QUANT_TOLERANCE of
the float32 reference over unquantized K/V (the quantization error itself: on these
Gaussian K/V the torch backend measures under 1 % for int8, 3-4 % for fp8 on CPU). The
Triton store must write the codes and scales the torch backend writes.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from kamado.attention.backend import SeqChunk  # noqa: E402
from kamado.attention.torch_backend import TorchAttention  # noqa: E402
from kamado.attention.triton_backend import TritonAttention, extend_splits  # noqa: E402
from kamado.config import ModelConfig  # noqa: E402
from kamado.kv.cache import KVCache  # noqa: E402
from kamado.kv.calibration import static_scales  # noqa: E402
from kamado.kv.quant import kv_format  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
TOLERANCE = 1e-2
QUANT_TOLERANCE = {"int8": 3e-2, "fp8": 8e-2, "fp8-static": 8e-2}


def attend(backend, chunks, q, k, v, cache_k, cache_v, config, block_size, dtype, kv="auto"):
    fmt = kv_format(kv, dtype, CUDA)
    if fmt.static:
        amax = torch.stack([x.float().abs().amax(dim=(0, 2)) for x in (cache_k, cache_v)])
        fmt = dataclasses.replace(fmt, scales=static_scales(amax[:, None], fmt.qmax))
    cache = KVCache(config, cache_k.shape[0] // block_size, block_size, dtype, CUDA, fmt)
    cache.store(0, torch.arange(cache_k.shape[0], device=CUDA), cache_k, cache_v)
    metadata = backend.build_metadata(chunks, block_size)
    out = backend.forward(q.to(dtype), k.to(dtype), v.to(dtype), 0, cache, metadata)
    return out.float(), cache


def assert_same_codes(ours: KVCache, theirs: KVCache) -> None:
    """Codes and scales as the torch backend wrote them: a scale may differ in its last
    bits (the kernel's max and division are not torch's, measured on the H200), and a code
    may then sit one step away."""
    for a, b in ((ours.k[0], theirs.k[0]), (ours.v[0], theirs.v[0])):
        a, b = a.view(torch.int8).int(), b.view(torch.int8).int()
        assert (a - b).abs().max() <= 1
        assert (a != b).float().mean() < 1e-3  # measured up to 3e-4 (fp8, extend, H200)
    for a, b in ((ours.k_scale[0], theirs.k_scale[0]), (ours.v_scale[0], theirs.v_scale[0])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def check(
    query_lens, context_lens, heads, kv_heads, block_size, head_dim=128, window=None, kv="auto"
):
    """Random bf16 inputs, blocks scattered over the cache; compare Triton with torch."""
    config = ModelConfig("llama", 64, heads * head_dim, 64, 1, heads, kv_heads, head_dim)
    rng = random.Random(sum(context_lens) + heads + block_size)
    needed = [-(-c // block_size) for c in context_lens]
    order = list(range(sum(needed) + 3))
    rng.shuffle(order)
    chunks, used = [], 0
    for q_len, ctx, n in zip(query_lens, context_lens, needed, strict=True):
        chunks.append(SeqChunk(q_len, ctx, order[used : used + n]))
        used += n
    slots = len(order) * block_size
    bf16 = torch.bfloat16
    cache_k = torch.randn(slots, kv_heads, head_dim, device=CUDA).to(bf16)
    cache_v = torch.randn(slots, kv_heads, head_dim, device=CUDA).to(bf16)
    t = sum(query_lens)
    q = torch.randn(t, heads, head_dim, device=CUDA).to(bf16)
    k = torch.randn(t, kv_heads, head_dim, device=CUDA).to(bf16)
    v = torch.randn(t, kv_heads, head_dim, device=CUDA).to(bf16)
    args = (chunks, q, k, v, cache_k, cache_v, config, block_size)
    ref, ref_cache = attend(TorchAttention(CUDA, window), *args, torch.float32)
    torch_out, torch_cache = attend(TorchAttention(CUDA, window), *args, bf16, kv)
    out, cache = attend(TritonAttention(CUDA, window), *args, bf16, kv)
    assert torch.isfinite(out).all()
    err = float((out - ref).norm() / ref.norm())
    torch_err = float((torch_out - ref).norm() / ref.norm())
    if kv == "auto":
        assert torch.equal(cache.k[0].float(), ref_cache.k[0])  # K/V written to the same slots
        assert torch.equal(cache.v[0].float(), ref_cache.v[0])
        assert err < TOLERANCE, (err, torch_err)
        assert torch_err < TOLERANCE
        return err
    assert_same_codes(cache, torch_cache)
    err_vs_torch = float((out - torch_out).norm() / torch_out.norm())
    assert err_vs_torch < TOLERANCE, err_vs_torch
    assert err < QUANT_TOLERANCE[kv], (err, torch_err)
    return err


@pytest.mark.parametrize("batch", [1, 3, 17, 64])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (32, 8), (16, 2), (28, 4)])
def test_decode_matches_torch(batch, heads, kv_heads):
    rng = random.Random(batch * heads)
    contexts = [rng.randrange(1, 3000) for _ in range(batch)]
    check([1] * batch, contexts, heads, kv_heads, block_size=16)


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_decode_block_sizes(block_size):
    check([1] * 5, [1, 15, 16, 17, 700], 32, 8, block_size)


def test_decode_of_one_128k_context_spreads_over_splits():
    check([1], [131072], 32, 8, block_size=16)


def test_decode_with_head_dim_64():
    check([1] * 4, [33, 64, 129, 1000], 14, 2, block_size=16, head_dim=64)


@pytest.mark.parametrize(("heads", "kv_heads"), [(32, 8), (16, 16), (28, 4)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_and_extend_match_torch(heads, kv_heads, block_size):
    # A whole prompt, a chunk over a cached prefix, a decode, short and odd lengths.
    check([700, 300, 1, 5, 129], [700, 1500, 2000, 5, 200], heads, kv_heads, block_size)


def test_long_extend_over_32k_prefix():
    check([2048], [34000], 32, 8, block_size=16)


def test_short_chunks_beside_decodes_over_long_contexts():
    # A mixed step: decodes through the decode kernel, short chunks split along their keys.
    query_lens, context_lens = [1, 17, 1, 1, 40], [100000, 100000, 60000, 3000, 70000]
    assert extend_splits(2 * 32, max(context_lens)) > 1  # the split path runs
    check(query_lens, context_lens, 32, 8, block_size=16)


def test_decodes_and_split_chunks_on_small_shapes():
    # Decodes, a prompt, and chunks split along their keys, at few heads.
    assert extend_splits(2 * 4, 4100) > 1
    check([1, 9, 1, 40], [3000, 4100, 50, 2200], 4, 2, block_size=16)


def test_split_extend_with_sliding_window():
    # Most splits of a windowed chunk see no keys at all; their merge weight must be 0.
    assert extend_splits(2 * 8, 4096 + 40) > 1
    check([5, 40], [20000, 30000], 8, 2, 16, window=4096)


@pytest.mark.parametrize("window", [64, 1000])
def test_sliding_window(window):
    check([1, 1, 300, 40], [50, 3000, 2000, 40], 8, 2, 16, window=window)


@pytest.mark.parametrize("kv", ["int8", "fp8", "fp8-static"])
@pytest.mark.parametrize(
    ("query_lens", "context_lens", "heads", "kv_heads", "block_size", "head_dim", "window"),
    [
        ([1] * 17, [1 + 97 * i for i in range(17)], 32, 8, 16, 128, None),  # decode batch
        ([1], [131072], 32, 8, 16, 128, None),  # one long decode over many splits
        ([1] * 4, [33, 64, 129, 1000], 14, 2, 16, 64, None),  # head_dim 64
        ([700, 300, 1, 5, 129], [700, 1500, 2000, 5, 200], 32, 8, 16, 128, None),  # extend
        ([2048], [34000], 32, 8, 32, 128, None),  # long extend
        ([1, 1, 300, 40], [50, 3000, 2000, 40], 8, 2, 16, 128, 64),  # sliding window
        ([1, 33], [40000, 65000], 32, 8, 16, 128, None),  # a short chunk split along its keys
    ],
    ids=["decode", "decode-128k", "head-dim-64", "extend", "extend-34k", "window", "split"],
)
def test_quantized_kv_matches_torch(
    kv, query_lens, context_lens, heads, kv_heads, block_size, head_dim, window
):
    err = check(query_lens, context_lens, heads, kv_heads, block_size, head_dim, window, kv)
    print(f"{kv}: relative error {err:.4f} against float32 over unquantized K/V")
