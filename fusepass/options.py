"""The backend's options: ``fusepass.backend(**options)``."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

GRAPHS_ENV = "FUSEPASS_GRAPHS"  # "0": `graphs` off unless an option says otherwise


@dataclass(frozen=True)
class Options:
    attention: bool = True  # rewrite matmul → softmax → matmul into the fused flash kernel
    elementwise: bool = True  # fuse chains of pointwise ops into generated kernels
    reductions: bool = True  # with them, the row reductions between them (sums, means, maxima over the last dim)
    strict: bool = False  # raise instead of falling back to the unfused ops when a pass fails
    # replay an attention call's or a fused elementwise group's kernel launches as a CUDA graph where its tensors
    # and values repeat an earlier call's (fusepass/runtime/replay.py): the host time of the launches
    replay: bool = True
    # replay each compiled graph on a CUDA device whole as a CUDA graph, through torch's CUDA graph trees (as
    # Inductor's mode="reduce-overhead"): the host time between kernels (fusepass/runtime/whole_graphs.py). On by
    # default: without it the example models whose steps wait on the host trail Inductor. FUSEPASS_GRAPHS=0 turns
    # it off for every backend made after it is set (the "fusepass" backend by name: at import)
    graphs: bool = field(default_factory=lambda: os.environ.get(GRAPHS_ENV) != "0")
    # where torch's scaled_dot_product_attention computes an attention exactly (unmasked or causal, scaled, no
    # tensor read) and the running GPU times it faster than the fused kernels, run it (attention/sdpa_floor.py)
    sdpa: bool = True
    # run each op of the compiled graphs inside a torch.profiler range naming its report record, for
    # fusepass.profile to attribute kernel time: host time on every call
    annotate: bool = False

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> "Options":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"fusepass.backend() got unknown option {unknown[0]!r}; "
                            f"the options are: {', '.join(sorted(known))}")
        for name, value in kwargs.items():
            if not isinstance(value, bool):  # every option is a switch; 1, "no" and None are not
                raise TypeError(f"fusepass option {name!r} takes True or False, not {value!r}")
        return cls(**kwargs)

    def with_changes(self, **kwargs: object) -> "Options":
        """These options with those named changed (unknown names raise as in `from_kwargs`)."""
        return Options.from_kwargs(**{**dataclasses.asdict(self), **kwargs})
