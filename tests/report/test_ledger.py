"""The ledger's formulas against figures computed by hand (docs/report.md), the seeds' among them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import check, random_tensor, rewrites

import fusepass
from fusepass.attention.cost import (AttentionShape, AuxRead, Tiles, attention_backward_bytes, attention_forward_bytes,
                                     causal_tile_fraction)
from fusepass.report.roofline import H200


@pytest.fixture
def planned_only(monkeypatch):
    """Plan and record the rewrites, run the graph's ops unfused: no kernel, any size."""
    monkeypatch.setattr("fusepass.pipeline.kernels_can_run", lambda device: False)


def standard_attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


def compiled_report(fn, *inputs) -> fusepass.Report:
    fusepass.reset()
    torch.compile(fn, backend="fusepass", fullgraph=True)(*inputs)
    return fusepass.last_report()


N, D = 4096, 128  # the seeds: one head, fp16


def test_the_seeds_standard_attention_forward(planned_only):
    q, k, v = (torch.randn(1, N, D, dtype=torch.float16) for _ in range(3))
    (forward,) = rewrites(compiled_report(standard_attention, q, k, v), kind="attention")
    # S and P, 2·N² bytes each, each written once and read once: the 8·N² term.
    assert 4 * 2 * N * N == 134_217_728
    assert forward.bytes_unfused == 134_217_728 + 8 * N * D == 138_412_032
    assert forward.bytes_ideal == 8 * N * D == 4_194_304
    assert forward.flops == 4 * N * N * D + 3 * N * N == 8_640_266_240
    assert round(forward.flops / forward.bytes_ideal) == 2060  # the seeds' intensity, ideal traffic
    # H200 tiles 128 × 128, 132 SMs: Q read and O written once, K and V once per wave of 32 programs,
    # lse and log_sum per row.
    assert forward.detail["tiles"]["block_m"] == 128
    assert forward.bytes_fused == round(2 * N * D * 2 + 2 * N * D * 2 * (1 + 31 / 132) + 8 * N) == 4_719_585
    assert forward.bytes_saved == 138_412_032 - 4_719_585
    assert forward.activation_bytes_saved == 0  # no gradient flows
    assert forward.time_unfused_ms == pytest.approx(1e3 * 138_412_032 / H200.hbm_bytes_per_s)
    assert forward.time_fused_ms == pytest.approx(1e3 * 8_640_266_240 / H200.flops_per_s)  # compute-bound


def test_the_seeds_standard_attention_backward(planned_only):
    q, k, v = (torch.randn(1, N, D, dtype=torch.float16, requires_grad=True) for _ in range(3))
    forward, backward = rewrites(compiled_report(standard_attention, q, k, v), kind="attention")
    # The probabilities (2·N² bytes) are no longer kept; the fused op keeps O and its rounding residual (2·N·D each)
    # and lse, log_sum.
    assert forward.activation_bytes_saved == 2 * N * N - 2 * 2 * N * D - 8 * N
    assert backward.phase == "backward"
    assert backward.ops == ("aten.matmul", "aten.matmul", "aten._softmax_backward_data", "aten.matmul",
                            "aten.matmul")
    # dV = Pᵀ·dO, dP = dO·Vᵀ, softmax backward (reads dP and P, writes dS), dQ = dS·K, dK = dSᵀ·Q:
    # 7 N×N tensors moved, 8 N×d ones, 2 bytes each.
    assert backward.bytes_unfused == 2 * (7 * N * N + 8 * N * D) == 243_269_632
    assert backward.flops == 4 * 2 * N * N * D + 4 * N * N
    assert backward.bytes_ideal == 2 * 8 * N * D  # Q, K, V, O, dO read, dQ, dK, dV written
    # Backward tiles: dK/dV 32 × 64 reads Q, dO and three statistics per row once per wave of its 64
    # programs; dQ 128 × 64 reads K and V once per wave of 32, and O and its rounding residual for delta. The
    # kernels write dQ, dK, dV in place.
    row = D * 4 + 12
    dkdv = 4 * N * D * 2 + N * row * (1 + 63 / 132)
    dq = N * (row + 2 * D * 2) + 2 * N * D * 2 * (1 + 31 / 132) + N * D * 2
    assert backward.bytes_fused == round(dkdv + dq)
    assert backward.detail["bytes_fused_by_kernel"] == {
        "_flash_backward_dkdv_kernel": round(dkdv), "_flash_backward_dq_kernel": round(dq)}


def test_causal_density_is_the_share_of_tiles_on_or_below_the_diagonal():
    assert causal_tile_fraction(1024, 128, 128) == (8 + 1) / (2 * 8)
    assert causal_tile_fraction(1024, 128, 64) == (2 + 4 + 6 + 8 + 10 + 12 + 14 + 16) / (8 * 16)
    assert causal_tile_fraction(100, 64, 64) == 3 / 4  # a last, partial block of 36 rows


def causal(q, k, v):
    n = q.shape[-2]
    s = q @ k.transpose(-1, -2)
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def sliding_window(q, k, v):
    i = torch.arange(q.shape[-2])
    distance = i[:, None] - i[None, :]
    s = (q @ k.transpose(-1, -2)).masked_fill((distance < 0) | (distance >= 512), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("fn, block_n", [(causal, 128), (sliding_window, 64)])
def test_the_forward_tiles_are_those_the_kernel_takes_for_the_rows(planned_only, fn, block_n):
    q, k, v = (torch.randn(1, 2, 4096, 128, dtype=torch.bfloat16) for _ in range(3))
    (forward,) = rewrites(compiled_report(fn, q, k, v), kind="attention")
    # At 128 × 128 causal rows list 16.5 kv tiles on average: 128 wide. The model does not count a window's
    # rows (about 5 here): unknown rows run 64 wide, as short ones do.
    assert (forward.detail["tiles"]["block_m"], forward.detail["tiles"]["block_n"]) == (128, block_n)


def test_a_causal_mask_halves_the_fused_flops(planned_only):
    q, k, v = (torch.randn(1, 2, 512, 16) for _ in range(3))
    (forward,) = rewrites(compiled_report(causal, q, k, v), kind="attention")
    # D 16, fp32, masked: 64 × 64 tiles; q block i reaches kv blocks 0..i: 36 of 64.
    assert forward.detail["tiles"] == {"block_m": 64, "block_n": 64, "density": 0.5625,
                                       "density_model": "causal tiles", "concurrent_programs": 132}
    assert forward.flops_fused == round(0.5625 * forward.flops)
    # The mask's construction (ones, tril, bitwise_not: 512² bools each written, two read) is replaced too.
    assert forward.ops == ("aten.matmul", "aten.ones", "aten.tril", "aten.bitwise_not", "aten.masked_fill",
                           "aten.softmax", "aten.matmul")
    n2 = 512 * 512
    assert forward.bytes_unfused == n2 + 2 * n2 + 2 * n2 + (2 * 512 * 16 * 4 * 2 + 2 * n2 * 4) \
        + (2 * 2 * n2 * 4 + n2) + 2 * 2 * n2 * 4 + (2 * n2 * 4 + 2 * 2 * 512 * 16 * 4)


def test_a_dense_bias_is_read_tile_by_tile_a_small_table_once():
    shape = AttentionShape(batch=2, heads=4, kv_heads=4, q_len=256, kv_len=256, head_dim=64, head_dim_v=64,
                           itemsize=2, out_itemsize=2, masked=False)
    tiles = Tiles(block_m=128, block_n=128, density=1.0, model="dense", concurrent=132)
    plain, ideal = attention_forward_bytes(shape, tiles, [])
    bias = AuxRead(bytes=4 * 256 * 256 * 2, itemsize=2, per_tile=True, needs_grad=False)  # [1, H, N, N]
    slopes = AuxRead(bytes=4 * 4, itemsize=4, per_tile=False, needs_grad=False)
    with_aux, ideal_aux = attention_forward_bytes(shape, tiles, [bias, slopes])
    kernel = "_flash_forward_kernel"
    # Every batch's programs read the bias again: B·H·N·N elements; the slopes once.
    assert with_aux[kernel] - plain[kernel] == 2 * 4 * 256 * 256 * 2 + 16
    assert ideal_aux - ideal == bias.bytes + slopes.bytes
    # Backward: both kernels read it; a gradient adds fp32 atomics per tile, a zeroed buffer, a cast.
    learned = AuxRead(bytes=bias.bytes, itemsize=2, per_tile=True, needs_grad=True)
    without, _ = attention_backward_bytes(shape, tiles, tiles, [])
    with_grad, _ = attention_backward_bytes(shape, tiles, tiles, [learned])
    elements = 4 * 256 * 256
    assert sum(with_grad.values()) - sum(without.values()) == \
        2 * (2 * elements * 2) + 2 * elements * 8 + elements * (4 + 4 + 2)


def test_dk_and_dv_apart_read_k_and_the_q_rows_twice():
    """Apart (`BackwardConfigs.apart`), dV's launch reads K, the q rows but their delta and the aux tiles again;
    one dK/dV entry holds both launches, the dQ kernel's is unchanged."""
    shape = AttentionShape(batch=1, heads=2, kv_heads=1, q_len=300, kv_len=300, head_dim=192, head_dim_v=128,
                           itemsize=2, out_itemsize=2, masked=False)
    tiles = Tiles(block_m=32, block_n=128, density=1.0, model="dense", concurrent=132)
    bias = AuxRead(bytes=2 * 300 * 300 * 2, itemsize=2, per_tile=True, needs_grad=False)
    together, ideal = attention_backward_bytes(shape, tiles, tiles, [bias])
    apart, ideal_apart = attention_backward_bytes(shape, tiles, tiles, [bias], apart=True)
    kernel = "_flash_backward_dkdv_kernel"
    q_reads = tiles.waves(3)  # each of the kv head's 3 kv blocks reads the q rows
    row_but_delta = 192 * 2 + 128 * 2 + 2 * 4
    assert apart[kernel] - together[kernel] == pytest.approx(
        300 * 192 * 2 + 2 * 300 * row_but_delta * q_reads + 2 * 300 * 300 * 2)
    assert apart["_flash_backward_dq_kernel"] == together["_flash_backward_dq_kernel"] and ideal_apart == ideal


def test_a_d256_backward_is_recorded_as_dk_and_dv_apart(planned_only):
    """At head dim 256 the GPU's dK/dV kernel runs as two launches at 32 × 128 (`BackwardConfigs.apart`): the record
    says so, and its bytes are both launches' (dV's reads K and the q rows but delta once more)."""
    d = 256
    q, k, v = (torch.randn(1, N, d, dtype=torch.float16, requires_grad=True) for _ in range(3))
    _, backward = rewrites(compiled_report(standard_attention, q, k, v), kind="attention")
    tiles = backward.detail["tiles"]["dk_dv"]
    assert tiles["apart"] and (tiles["block_m"], tiles["block_n"]) == (32, 128)
    row = d * 4 + 12
    waves = 1 + 31 / 132  # the q rows read once per wave of the 32 kv blocks' programs
    together = 4 * N * d * 2 + N * row * waves
    assert backward.detail["bytes_fused_by_kernel"]["_flash_backward_dkdv_kernel"] == \
        round(together + N * d * 2 + N * (row - 4) * waves)


def gelu_chain(x, b):
    return F.gelu(x * 0.5 + b) * torch.sigmoid(x)


def test_elementwise_forward_and_backward_follow_the_same_formulas():
    x, b = random_tensor((6, 5), torch.float32), random_tensor((5,), torch.float32)
    with torch.no_grad():
        (forward,) = rewrites(check(gelu_chain, x, b))
    # mul (x → t), add (t, b → u), gelu, sigmoid (x), mul: each reads its inputs and writes 120 bytes.
    assert forward.bytes_unfused == (120 + 120) + (120 + 20 + 120) + (120 + 120) + (120 + 120) + (240 + 120)
    assert forward.bytes_fused == forward.bytes_ideal == 120 + 20 + 120
    assert forward.flops == forward.flops_fused == 5 * 30
    trained = check(gelu_chain, x, b, backward=True)
    for r in trained.rewrites:  # the backward's a reduction: b's gradient summed in its kernel
        # one program's partial sums of b's gradient (6 rows of 5 fit one), written and read back: 2 · 5 · 4 bytes
        assert r.bytes_fused - r.bytes_ideal == (40 if r.kind == "reduction" else 0)
        assert r.flops == r.flops_fused > 0
        assert r.bytes_unfused > r.bytes_fused and r.time_unfused_ms > r.time_fused_ms
    assert {(r.kind, r.phase) for r in trained.rewrites} == {("elementwise", "forward"), ("reduction", "backward")}


def test_cpu_without_kernels_still_reports(planned_only):
    q, k, v = (torch.randn(2, 64, 16) for _ in range(3))
    report = compiled_report(standard_attention, q, k, v)
    assert "kernels need a CUDA device" in report.notices[0]
    (forward,) = rewrites(report, kind="attention")
    assert forward.bytes_saved > 0 and forward.time_fused_ms is not None


@pytest.mark.parametrize("op", ["gather", "index_select", "embedding"])
def test_an_indexed_read_moves_the_elements_it_picks(op):
    """A gather reads, of its source, one element for each it writes: a loss's targets picked from 50257-wide
    rows are not the rows' bytes."""
    from fusepass.report.ledger import op_bytes

    source, rows = torch.empty(512, 50257, dtype=torch.bfloat16), torch.zeros(512, 1, dtype=torch.int64)
    graph = torch.fx.Graph()
    x, index = graph.placeholder("x"), graph.placeholder("index")
    x.meta["val"], index.meta["val"] = source, rows
    if op == "gather":
        node, out = graph.call_function(torch.ops.aten.gather.default, (x, 1, index)), source.gather(1, rows)
    elif op == "index_select":
        node, out = graph.call_function(torch.ops.aten.index_select.default, (x, 0, index)), \
            source.index_select(0, rows.flatten())
    else:
        node, out = graph.call_function(torch.ops.aten.embedding.default, (x, index)), F.embedding(rows, source)
    node.meta["val"] = out
    assert op_bytes(node) == 2 * out.numel() * 2 + rows.numel() * 8
