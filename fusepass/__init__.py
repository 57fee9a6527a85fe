"""fusepass: a torch.compile backend that fuses hand-written attention and elementwise chains.

    torch.compile(model, backend="fusepass")
    print(fusepass.last_report())
"""
from importlib.metadata import entry_points

from fusepass.options import Options
from fusepass.pipeline import Backend, backend, fusepass_backend
from fusepass.report.records import Hotspot, Rewrite
from fusepass.report.report import Report, last_report, reports, reset
from fusepass.report.roofline import Ceilings, measure_ceilings, set_ceilings
from fusepass.runtime.launch import start_triton_in_background

__all__ = ["Backend", "Ceilings", "Hotspot", "Options", "Report", "Rewrite", "backend", "last_report",
           "measure_ceilings", "reports", "reset", "set_ceilings"]


def _register() -> None:
    # An installed fusepass reaches Dynamo through its entry point; registering again would clash.
    # From a checkout (PYTHONPATH=.) there is no entry point, so register here.
    if entry_points(group="torch_dynamo_backends", name="fusepass"):
        return
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if "fusepass" not in _COMPILER_FNS:
        register_backend(fusepass_backend, name="fusepass")


_register()
# Triton's start takes ~0.6 s of hashing, which crawls on a compile thread beside a busy caller: begun now, it
# is usually done by the first compiled call (fusepass.runtime.launch).
start_triton_in_background()
