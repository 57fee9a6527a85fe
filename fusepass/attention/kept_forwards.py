"""What a forward keeps for its backward, named by the storage of a token the op returns.

An op whose backward reads more of its forward than its outputs (an autograd graph to differentiate, the
forward's plan) keeps it here under a tensor it returns: AOTAutograd saves that tensor for the backward, which
looks its forward up rather than running it again (whose dropout would draw another mask). A saved output comes
back as another tensor of the same storage, so the key is the storage's address; an entry leaves with the
storage: after the backward (autograd lets its saved tensors go), after a second one where the graph was
retained, or where no backward comes (a forward never differentiated).
"""
from __future__ import annotations

import weakref
from typing import Any

_forwards: dict[int, Any] = {}


def keep_forward(token: Any, kept: Any) -> None:
    """Keep `kept` for as long as `token`'s storage lives."""
    key = token.untyped_storage().data_ptr()
    _forwards[key] = kept
    weakref.finalize(token.untyped_storage(), _forwards.pop, key, None)


def kept_forward(token: Any) -> Any:
    """What the forward that returned `token` kept, or None."""
    return _forwards.get(token.untyped_storage().data_ptr())
