"""StepInputs: a forward step's optional inputs, beside its tokens, positions and tables.

One frozen object a step carries from whoever builds the step (the step engine, a drafter, a
test) to the step core's `forward`, whose keyword arguments its fields are named after, so a
new input is a field here and an argument of the cores that take it: the layers in between
pass the object on untouched. One object per step, never per token.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class StepInputs:
    """What a step may carry besides its batch (engine.executor.model.Model.forward_paged
    documents each): None (False) leaves an input out."""

    routes: np.ndarray | None = None  # int32 [T, n_layer, n_expert_used], out: experts chosen
    state_slots: np.ndarray | None = None  # int32 [n_seq]: recurrent-state slots
    win_tables: np.ndarray | None = None  # int32 [n_seq, max_blocks]: windowed-pool tables
    hidden_in: np.ndarray | None = None  # float32 [T, n_embd]: an MTP layer's input states
    hidden_out: np.ndarray | None = None  # float32 [T, n_embd], out: states after the layers
    hidden_normed: bool = False  # hidden_out after the final norm (what the lm_head reads)

    def given(self) -> dict[str, Any]:
        """The inputs set, by name: the keyword arguments of a step core's forward (a core
        that lacks one refuses the call, as it should: the step would be wrong without it)."""
        return {k: v for k in _NAMES if (v := getattr(self, k)) is not None and v is not False}


_NAMES = tuple(f.name for f in fields(StepInputs))
NO_INPUTS = StepInputs()
