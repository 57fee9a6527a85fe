"""The first call of a compiled attention launches the flash kernels the rewrite started compiling ahead
(`fusepass.flash.ahead`): the forward's and, where a gradient flows, the backward's two. On any machine:
what the rewrite compiles ahead, from meta stand-ins of the graph's values, has the argument signatures of the
launches that follow; on the GPU: each launch finds its kernel compiled instead of compiling it."""
import dataclasses
from collections import OrderedDict
from itertools import repeat

import pytest
import torch
import torch.nn.functional as F
from triton.tools.tensor_descriptor import TensorDescriptor
from support import SUMMED_GRADIENT_FP32, assert_close, check, missed, random_tensor, record_block_map_builds

import fusepass
from fusepass.attention import call
from fusepass.flash import blockmap
from fusepass.flash import ahead as flash_ahead, backward as flash_bwd, config as flash_config, forward as flash_fwd
from fusepass.runtime.launch import BoundLaunch, launch
from fusepass.runtime.signature import CONSTANT, SPECIALIZED, signature

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="kernels compile on the GPU machine only")


def _launch_signature(kernel, args, keywords):
    return kernel, signature(args, repeat(SPECIALIZED), []), tuple(keywords), \
        signature(keywords.values(), repeat(CONSTANT), [])


def _alibi_learnable(q, k, v, slopes):
    i = torch.arange(q.shape[-2], device=q.device)
    s = q @ k.transpose(-1, -2) * 0.25 + slopes[:, None, None] * (i[None, None, :] - i[None, :, None])
    return torch.softmax(s.masked_fill(i[None, :, None] < i[None, None, :], float("-inf")), dim=-1) @ v


def _t5_learnable(q, k, v, table):
    i = torch.arange(q.shape[-2], device=q.device)
    relative = i[None, :] - i[:, None]
    distance = relative.abs()
    large = 4 + (torch.log(distance.float().clamp(min=1) / 4) / 2.0794 * 4).to(torch.long)
    buckets = (relative > 0).to(torch.long) * 8 + torch.where(distance < 4, distance, large.clamp(max=7))
    return torch.softmax(q @ k.transpose(-1, -2) + F.embedding(buckets, table).permute(2, 0, 1), dim=-1) @ v


def _gqa_packed_documents(q, k, v, ids):
    """GQA through repeat_interleave, documents packed for causal language modelling, the output laid out
    [B, N, H, D] by its einsum."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    n = q.shape[-2]
    keep = (ids[:, None, :, None] == ids[:, None, None, :]) & torch.ones(n, n, dtype=torch.bool,
                                                                           device=q.device).tril()
    s = torch.einsum("bhqd,bhkd->bhqk", q * 0.25, k).masked_fill(~keep, float("-inf"))
    return torch.einsum("bhqk,bhkd->bqhd", torch.softmax(s, dim=-1), v)


@pytest.mark.parametrize("case", ["alibi", "t5", "alibi, q k v transposed", "gqa, packed documents"])
def test_what_the_rewrite_compiles_ahead_has_the_signatures_of_the_launches(monkeypatch, case):
    ahead, launched, starts = set(), [], []
    monkeypatch.setattr(flash_ahead, "compile_fitting_ahead",
                        lambda kernel, *args, **keywords: ahead.add(_launch_signature(kernel, args, keywords)))
    start = call._compile_ahead

    def from_the_rewrite_only(s, sources, qkv, aux, device):
        # The first call starts compiling again, from its tensors: what it starts is not counted.
        starts.append(qkv[0].device.type)
        if qkv[0].device.type == "meta":
            start(s, sources, qkv, aux, device)

    monkeypatch.setattr(call, "_compile_ahead", from_the_rewrite_only)

    def recording(kernel, grid, *args, **keywords):
        launched.append(_launch_signature(kernel, args, keywords))
        flash_config.launch_fitting(kernel, grid, *args, **keywords)

    monkeypatch.setattr(flash_fwd, "launch_fitting", recording)
    monkeypatch.setattr(flash_bwd, "launch_fitting", recording)
    q, k, v = (random_tensor((2, 3, 37, 16), torch.float32) for _ in range(3))
    if case.endswith("transposed"):  # inputs the op reads through views of their own
        q, k, v = (random_tensor((2, 37, 3, 16), torch.float32).transpose(1, 2) for _ in range(3))
    if case.startswith("alibi"):
        check(_alibi_learnable, q, k, v, random_tensor((3,), torch.float32), backward=True, **SUMMED_GRADIENT_FP32)
    elif case.startswith("gqa"):
        q = random_tensor((2, 6, 37, 16), torch.float32)
        ids = torch.tensor([0] * 11 + [1] * 20 + [2] * 6, device=q.device).repeat(2, 1)
        check(_gqa_packed_documents, q, k, v, ids, backward=True, **SUMMED_GRADIENT_FP32)
    else:
        check(_t5_learnable, q, k, v, random_tensor((16, 3), torch.float32), backward=True, **SUMMED_GRADIENT_FP32)
    names = [signature[0].__name__ for signature in launched]
    assert names == ["_flash_forward_kernel", "_flash_backward_dq_kernel", "_flash_backward_dkdv_kernel"]
    assert starts == ["meta", q.device.type]
    assert all(signature in ahead for signature in launched)


def _attention(q, k, v):
    n = q.shape[-2]
    scores = q @ k.transpose(-1, -2) * 0.0917  # a scale of its own: kernels no other test compiled
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def _packed_causal(q, k, v, ids):
    n = q.shape[-2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    same = ids[:, None, :, None] == ids[:, None, None, :]
    return torch.softmax((q @ k.transpose(-1, -2) * 0.25).masked_fill(~(same & causal), float("-inf")), dim=-1) @ v


def _padded(q, k, v, lengths):
    keys = torch.arange(k.shape[-2], device=q.device)[None, :] < lengths[:, None]
    return torch.softmax((q @ k.transpose(-1, -2) * 0.25).masked_fill(~keys[:, None, None, :], float("-inf")),
                         dim=-1) @ v


@pytest.mark.parametrize("passes", ["fwd", "fwd+bwd", "fwd+bwd, dQ at kv tiles of its own"])
@pytest.mark.parametrize("case", ["causal (maps cached)", "packed documents (ranges, causal cached)",
                                  "padding (mapped per call)"])
def test_the_rewrite_compiles_ahead_the_kernels_of_the_maps_the_calls_build(monkeypatch, case, passes):
    ahead, launched = set(), []
    backward = passes != "fwd"
    monkeypatch.setattr(blockmap, "_cache", blockmap.OrderedDict())
    if passes.endswith("of its own"):  # as on the GPU, where the backward cannot read every forward map
        tiles = flash_config.BackwardConfigs(dkdv=flash_config.INTERPRETER_CONFIG,
                                             dq=dataclasses.replace(flash_config.INTERPRETER_CONFIG, block_n=32))
        for module in (flash_config, flash_bwd, flash_ahead):
            monkeypatch.setattr(module, "backward_configs", lambda *_: tiles)
    monkeypatch.setattr(blockmap, "compile_ahead",
                        lambda kernel, *args, **keywords: ahead.add(_launch_signature(kernel, args, keywords)))

    def recording(kernel, grid, *args, **keywords):
        launched.append(_launch_signature(kernel, args, keywords))
        launch(kernel, grid, *args, **keywords)

    monkeypatch.setattr(blockmap, "launch", recording)
    q, k, v = (random_tensor((2, 3, 37, 16), torch.float32) for _ in range(3))
    if case.startswith("causal"):
        check(_attention, q, k, v, backward=backward)
    elif case.startswith("packed"):
        ids = torch.tensor([0] * 11 + [1] * 20 + [2] * 6, device=q.device).repeat(2, 1)
        check(_packed_causal, q, k, v, ids, backward=backward)
    else:
        check(_padded, q, k, v, torch.tensor([37, 23], device=q.device), backward=backward)
    assert launched and [signature for signature in launched if signature not in ahead] == []


@cuda_only
@pytest.mark.parametrize("backward", [False, True])
def test_the_first_call_launches_the_kernels_the_rewrite_compiled_ahead(monkeypatch, backward):
    compiled_ahead = {}
    original = BoundLaunch._compiled_ahead

    def recording(self, key):
        compiled = original(self, key)
        compiled_ahead.setdefault(self.kernel.fn.__name__, set()).add(compiled is not None)
        return compiled

    monkeypatch.setattr(BoundLaunch, "_compiled_ahead", recording)
    # A kernel another test launched in this process (the maps' lists kernel serves every mask) is launched
    # without asking for a compile ahead: each launch here starts from a new BoundLaunch.
    monkeypatch.setattr("fusepass.runtime.launch._bound", OrderedDict())
    q, k, v = (torch.randn(1, 2, 300 + backward, 128, device="cuda", dtype=torch.bfloat16,
                           requires_grad=backward) for _ in range(3))
    reference = [x.detach().double().requires_grad_(backward) for x in (q, k, v)]
    out = torch.compile(_attention, backend=fusepass.backend(strict=True))(q, k, v)
    expected = _attention(*reference)
    assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
    kernels = ["_flash_forward_kernel"]
    if backward:
        grad = torch.randn_like(out)
        out.backward(grad)
        expected.backward(grad.double())
        for x, r in zip((q, k, v), reference):
            assert_close(x.grad.double(), r.grad, atol=5e-2, rtol=5e-2)
        kernels += ["_flash_backward_dq_kernel", "_flash_backward_dkdv_kernel"]
    flash = {name: hits for name, hits in compiled_ahead.items() if name.startswith("_flash")}
    assert flash == dict.fromkeys(kernels, {True})
    # The causal mask's maps are cached per shape: the rewrite started their kernels' compiles too.
    assert {name: compiled_ahead.get(name) for name in ("_tile_kind_kernel", "_tile_lists_kernel")} == \
        dict.fromkeys(("_tile_kind_kernel", "_tile_lists_kernel"), {True})


def test_the_first_backward_builds_no_block_map(monkeypatch):
    """A mask whose maps are cached per shape gets the backward's maps built on the first forward, while the
    flash kernels compile (on the GPU their tiles differ from the forward's)."""
    from fusepass.flash import blockmap

    monkeypatch.setattr(blockmap, "_cache", blockmap.OrderedDict())
    built = record_block_map_builds(monkeypatch)
    q, k, v = (random_tensor((2, 3, 37, 16), torch.float32).requires_grad_() for _ in range(3))
    slopes = torch.rand(3, device=q.device)
    out = torch.compile(_alibi_learnable, backend=fusepass.backend(strict=True))(q, k, v, slopes)
    after_forward = list(built)
    out.backward(torch.randn_like(out))
    assert after_forward and built == after_forward


def test_a_compile_ahead_that_fails_at_the_rewrite_leaves_it_to_the_first_call(monkeypatch):
    start, starts = call._compile_ahead, []

    def failing_at_the_rewrite(s, sources, qkv, aux, device):
        starts.append(qkv[0].device.type)
        if qkv[0].device.type == "meta":
            raise RuntimeError("planted failure at the rewrite")
        start(s, sources, qkv, aux, device)

    monkeypatch.setattr(call, "_compile_ahead", failing_at_the_rewrite)
    q, k, v = (random_tensor((2, 3, 37, 16), torch.float32) for _ in range(3))
    report = check(_alibi_learnable, q, k, v, random_tensor((3,), torch.float32), backward=True,
                   **SUMMED_GRADIENT_FP32)
    assert starts == ["meta", q.device.type]
    assert [r.kind for r in report.rewrites] == ["attention", "attention"] and not missed(report)



def _as_triton_specializes(value):
    """What Triton's specialization tells of a launch argument: an int as 1, a multiple of 16 or neither, a float
    by its type, a tensor descriptor by its block shape and dtype (its shape and strides are passed at run
    time)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value == 1, value % 16 == 0
    if isinstance(value, float):
        return float
    if isinstance(value, (tuple, list)):
        return tuple(map(_as_triton_specializes, value))
    if isinstance(value, TensorDescriptor):
        return TensorDescriptor, tuple(value.block_shape), value.base.dtype
    if isinstance(value, torch.Tensor):
        return value.dtype
    return value


def _triton_signature(kernel, args, keywords):
    return kernel, _as_triton_specializes(args), tuple(keywords), \
        signature(keywords.values(), repeat(CONSTANT), [])


def _causal_training_at(compiled, length: int) -> None:
    q, k, v = (random_tensor((1, 1, length, 16), torch.float32).requires_grad_() for _ in range(3))
    compiled(q, k, v).sum().backward()


def test_a_symbolic_compile_compiles_ahead_the_kernels_of_lengths_of_other_kinds(monkeypatch):
    """Compiled with symbolic sizes at a length that is a multiple of 16, the attention also starts compiling its
    kernels at a length that is not (the kernels place the last tile and Triton specializes the length another
    way): a later such length launches only kernels compiled ahead at the compile."""
    ahead, launched = set(), []
    monkeypatch.setattr(flash_ahead, "compile_fitting_ahead",
                        lambda kernel, *args, **keywords: ahead.add(_triton_signature(kernel, args, keywords)))

    def recording(kernel, grid, *args, **keywords):
        launched.append(_triton_signature(kernel, args, keywords))
        flash_config.launch_fitting(kernel, grid, *args, **keywords)

    monkeypatch.setattr(flash_fwd, "launch_fitting", recording)
    monkeypatch.setattr(flash_bwd, "launch_fitting", recording)
    compiled = torch.compile(_attention, backend=fusepass.backend(strict=True), dynamic=True)
    _causal_training_at(compiled, 272)
    at_the_compile, launched[:] = set(ahead), []
    _causal_training_at(compiled, 301)
    assert [signature[0].__name__ for signature in launched] == \
        ["_flash_forward_kernel", "_flash_backward_dq_kernel", "_flash_backward_dkdv_kernel"]
    assert [signature for signature in launched if signature not in at_the_compile] == []


@cuda_only
def test_a_new_length_of_another_kind_compiles_no_flash_kernel(monkeypatch):
    import triton
    from fusepass.runtime.launch import finish_compiles_ahead

    def attention(q, k, v):  # a scale of its own: kernels no other test compiled
        i = torch.arange(q.size(-2), device=q.device)
        s = (q @ k.transpose(-2, -1) * 0.0811).masked_fill(i[None, :] > i[:, None], float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    compiled_now = []
    compiled = torch.compile(attention, backend=fusepass.backend(strict=True), dynamic=True)
    for length in (1536, 3001):
        q, k, v = (torch.randn(1, 2, length, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        compiled(q, k, v).sum().backward()
        finish_compiles_ahead()
        monkeypatch.setattr(triton.knobs.compilation, "listener",
                            lambda *, src, **_: compiled_now.append(src.name))
    assert [name for name in compiled_now if name.startswith("_flash")] == []


class _Layers(torch.nn.Module):
    """Three causal attentions, each building its mask, the third with another scale."""

    def forward(self, q, k, v):
        for scale in (0.25, 0.25, 0.5):
            i = torch.arange(q.size(-2), device=q.device)
            s = (q @ k.transpose(-2, -1) * scale).masked_fill(i[None, :] > i[:, None], float("-inf"))
            q = torch.softmax(s, dim=-1) @ v
        return q


def _score_functions(before: set[str]) -> list[tuple]:
    """Of the attention calls made since the names `before`, in the order they were made."""
    made = sorted(set(call._calls) - before, key=lambda name: int(name.split("_")[-1]))
    return [(c.mod.score, c.mod.score_grad, c.mod.keep, c.mod.fill) for c in map(call._calls.get, made)]


def test_attentions_lifted_alike_share_their_score_functions_and_so_their_kernels():
    """The flash kernels take the score functions as constants: a model's layers compile them once where their
    attentions are written alike, and one attention planned again at a new length does not compile them again."""
    compiled = torch.compile(_Layers(), backend=fusepass.backend(strict=True))
    before = set(call._calls)
    compiled(*(random_tensor((2, 2, 37, 16), torch.float32) for _ in range(3)))
    first, second, third = _score_functions(before)
    assert first == second and not set(first) & set(third)  # another scale, another chain
    before = set(call._calls)
    compiled(*(random_tensor((2, 2, 29, 16), torch.float32) for _ in range(3)))  # symbolic sizes from here
    planned = _score_functions(before)
    before = set(call._calls)
    compiled(*(random_tensor((2, 2, 23, 16), torch.float32) for _ in range(3)))
    assert len(_score_functions(before)) == 2  # planned at its call: once for the two alike, once the third
    assert set(planned + _score_functions(before)) == {first, third}


def _causal_layers(count: int):
    def layers(q, k, v):
        for _ in range(count):
            i = torch.arange(q.size(-2), device=q.device)
            s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(i[None, :] > i[:, None], float("-inf"))
            q = torch.softmax(s, dim=-1) @ v
        return q
    return layers


def test_attentions_lifted_alike_share_their_cached_block_maps(monkeypatch):
    """A map cached per shape is one per mask's functions, not per attention: three layers lifted alike build the
    maps one layer builds (each layer had built its own), and compute what eager does."""
    monkeypatch.setattr(blockmap, "_cache", blockmap.OrderedDict())
    built = record_block_map_builds(monkeypatch)
    q, k, v = (random_tensor((2, 2, 37, 16), torch.float32).requires_grad_() for _ in range(3))
    by_count = {}
    for count in (1, 3):
        blockmap._cache.clear()
        built.clear()
        layers = _causal_layers(count)
        out = torch.compile(layers, backend=fusepass.backend(strict=True))(q, k, v)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        expected = layers(q, k, v)
        assert_close(out, expected, rtol=1e-4, atol=1e-4)  # three layers deep: fp32 roundings compound
        for g, e in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v))):
            assert_close(g, e, rtol=1e-4, atol=1e-4)
        by_count[count] = list(built)
    assert by_count[1] and sorted(by_count[3]) == sorted(by_count[1])  # built in either order (compiles ahead)


def test_compiles_ahead_allocate_nothing_on_the_device(monkeypatch):
    """The gradients a compile ahead lays out (for the backward's signatures) are meta stand-ins, at the rewrite and
    at the first call, Q, K and V of one projection sharing one."""
    seen = []
    monkeypatch.setattr(call, "compile_attention_ahead",
                        lambda *args, grads=None, aux_grad=None, **keywords: seen.append(grads))
    x = random_tensor((2, 19, 96), torch.float32).requires_grad_()

    def split_attention(x):
        q, k, v = (t.view(2, 19, 2, 16).transpose(1, 2) for t in (x * 1.5).split(32, dim=2))
        return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v

    torch.compile(split_attention, backend=fusepass.backend(strict=True))(x).sum().backward()
    assert seen and all(g is not None and all(t.is_meta for t in g) for g in seen), seen
