"""What every example shares: pick the device (Triton's interpreter on a machine without CUDA), time eager
against fusepass on the GPU, print the report; the language models' training loss."""
from __future__ import annotations

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    # Without a GPU the kernels run through Triton's interpreter: slow, so the examples shrink.
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if ON_GPU else "cpu"


def milliseconds(fn, *args) -> float:
    """Median time of ``fn(*args)`` on the GPU, after warm-up."""
    import triton.testing

    return triton.testing.do_bench(lambda: fn(*args), warmup=100, rep=500, return_mode="median")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def compare(name: str, eager, fused, *args, backward: bool = False) -> None:
    """Check ``fused`` against ``eager`` on ``args``; on a GPU time both (forward, and forward+backward)."""
    import fusepass

    fusepass.reset()
    expected, actual = eager(*args), fused(*args)
    print(f"{name}: relative error {relative_error(actual, expected):.1e}")
    if ON_GPU:
        t_eager, t_fused = milliseconds(eager, *args), milliseconds(fused, *args)
        print(f"  forward:          eager {t_eager:8.3f} ms   fusepass {t_fused:8.3f} ms   {t_eager / t_fused:5.1f}x")
        if backward:
            grad = torch.randn_like(expected)
            inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

            def step(fn):
                return lambda: torch.autograd.grad(fn(*args), inputs, grad)

            t_eager, t_fused = milliseconds(step(eager)), milliseconds(step(fused))
            print(f"  forward+backward: eager {t_eager:8.3f} ms   fusepass {t_fused:8.3f} ms   "
                  f"{t_eager / t_fused:5.1f}x")
    else:
        print("  (no GPU here: kernels ran in Triton's interpreter at a small size, untimed)")
    for report in fusepass.reports():
        print(report)


def qkv(batch: int, heads: int, length: int, head_dim: int, kv_heads: int | None = None,
        dtype: torch.dtype = torch.bfloat16):
    """Random Q, K, V in [B, H, N, D] that require gradients."""
    dtype = dtype if ON_GPU else torch.float32
    shapes = [(batch, heads, length, head_dim)] + [(batch, kv_heads or heads, length, head_dim)] * 2
    return [torch.randn(s, device=DEVICE, dtype=dtype, requires_grad=True) for s in shapes]


def size(gpu: int, cpu: int) -> int:
    return gpu if ON_GPU else cpu


# ---------------------------------------------------------------------------------------------------
# The example models (gpt2.py, bert.py, ...): one runner


def next_token_loss(logits: torch.Tensor) -> torch.Tensor:
    """A language model's cross-entropy against a fixed shift of random targets: the training step's loss, its values
    aside."""
    targets = torch.arange(logits.shape[0] * logits.shape[1], device=logits.device).view(logits.shape[:2])
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), (targets % logits.shape[-1]).flatten())


class WithLoss(torch.nn.Module):
    """A model and its loss as one module: the compiled function computes the loss (`run_model --loss-compiled`)."""

    def __init__(self, model: torch.nn.Module, loss) -> None:
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, *inputs):
        return self.loss(self.model(*inputs))


def run_model(name: str, build, make_inputs, loss, sizes: dict, default_batch: dict, default_seq: dict,
              argv: list[str] | None = None, tolerance: float = 1e-3):
    """Parse ``[--size tiny|small|medium] [--train] [--batch B] [--seq T] [--loss-compiled]``, build the model at that size (`build`:
    (size name, sequence length) → nn.Module; `make_inputs`: (model, batch, seq) → the inputs; `loss`: outputs → scalar), and compare
    eager, Inductor and fusepass on it (fusepass.compare): on a GPU in bf16, timed; without one at the tiny size in
    float32 through Triton's interpreter, checked only. Returns the `fusepass.Comparison`; raises if fusepass's
    outputs or gradients are not eager's."""
    import argparse
    import json

    import fusepass

    parser = argparse.ArgumentParser(description=f"{name}: eager, Inductor and fusepass side by side")
    parser.add_argument("--size", choices=sorted(sizes), default="small" if ON_GPU else "tiny")
    parser.add_argument("--train", action="store_true", help="time the training step too (forward, loss, backward)")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--options", default="{}", help='fusepass.backend\'s options as JSON, e.g. \'{"graphs": true}\'')
    parser.add_argument("--peers", default="", help="Inductor's modes to time beside its default, e.g. reduce-overhead")
    parser.add_argument("--loss-compiled", action="store_true",
                        help="compile the loss with the model (as a forward that computes it, nanoGPT's, does)")
    args = parser.parse_args(argv)
    batch = args.batch or default_batch[args.size]
    seq = args.seq or default_seq[args.size]
    torch.manual_seed(0)
    model = build(args.size, seq).to(DEVICE)
    inputs = make_inputs(model, batch, seq)
    reference = reference_inputs = None
    if ON_GPU:  # bf16, judged against the same model in float32 with eager bf16's own distance as the bar
        import copy

        reference, reference_inputs = copy.deepcopy(model), inputs
        model = model.to(torch.bfloat16)
        inputs = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x for x in inputs)
    if args.loss_compiled:
        model = WithLoss(model, loss)
        reference = None if reference is None else WithLoss(reference, loss)
        loss = torch.Tensor.clone  # the compiled function's output is the loss
    train = args.train or not ON_GPU  # on the CPU the gradients are checked whatever is timed
    modes = tuple(f"inductor-{mode}" for mode in args.peers.split(",") if mode)
    backends = ("eager", "inductor", *modes, "fusepass") if ON_GPU else ("eager", "fusepass")
    result = fusepass.compare(model, *inputs, loss=loss if train else None, backends=backends, tokens=batch * seq,
                              reference=reference, reference_inputs=reference_inputs, options=json.loads(args.options))
    print(f"{name}, size {args.size}, batch {batch}, sequence {seq}, {DEVICE}"
          f"{' bf16' if ON_GPU else ' float32 (Triton interpreter)'}")
    print(result)
    print(fusepass.summarize(result.reports))
    fused, eager = result.result("fusepass"), result.result("eager")
    if ON_GPU:
        # No farther from float32 than twice eager bf16 is, plus a rounding of bf16; a later call (replayed) no
        # farther from eager than twice the first call is, plus the same.
        errors = [(fused.reference_output_error, eager.reference_output_error),
                  (fused.reference_gradient_error, eager.reference_gradient_error),
                  (fused.later_output_error, fused.output_error), (fused.later_gradient_error, fused.gradient_error)]
        wrong = any(ours is not None and ours > 2 * theirs + 8e-3 for ours, theirs in errors)
    else:
        wrong = any((error or 0) > tolerance for error in (fused.output_error, fused.gradient_error,
                                                          fused.later_output_error, fused.later_gradient_error))
    if fused.missing_gradients or wrong:
        worst = (f"gradients from float32 {fused.reference_gradient_error:.3g} (worst: "
                 f"{fused.worst_reference_gradient}) against eager's {eager.reference_gradient_error:.3g} (worst: "
                 f"{eager.worst_reference_gradient}); " if ON_GPU and fused.reference_gradient_error is not None else "")
        raise SystemExit(f"{name}: fusepass differs from eager ({worst}{fused}; eager {eager})")
    return result
