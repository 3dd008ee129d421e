"""Drafts from the model's own multi-token-prediction (MTP) layer (DeepSeek-V3, GLM-4.5,
Qwen3-Next, Qwen3.5).

The layer predicts the token after next: at position p it takes the main model's output h_p
(after its final norm: what its lm_head reads, as vLLM and SGLang feed it) and the embedding of
token p + 1, runs one decoder layer, its own norm and the shared lm_head (the converter makes it
a one-layer model of its own, in the folder's mtp/). Chained, it takes its own hidden state:
before that norm (DeepSeek-V3, GLM-4.5), or after it where the layer's config says
mtp_chain_normed (Qwen3-Next, Qwen3.5), as vLLM chains each. It keeps KV rows of its own at
the same positions as the main model, in a cache whose blocks carry the main cache's numbers,
so a sequence's rows there are freed and rolled back with its main blocks: a rejected position
is written again before anything reads it. Each step first catches the layer up over the
positions the last step verified (from the main model's hidden states), which also drafts the
first token, then chains it on its own hidden state and draft for the others; chained
positions past a sequence's blocks go to scratch blocks numbered after the main cache's. In a
model with linear-attention layers a sequence that rejected a draft computes its kept tokens
again: their hidden states arrive again and the catch-up waits for them.

Guarantees: this module only proposes tokens; the step engine verifies them, so output never
depends on it. Positions a sequence did not compute itself (a prefix-cache hit, a fork of n > 1
choices) have no MTP rows of its own: drafts may be worse there, never wrong. Refuses nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

BLOCK = 16  # positions per KV block, as the main cache's


@dataclass
class MtpState:
    """One sequence's progress through the MTP layer."""

    done: int = -1  # positions below it hold this sequence's MTP rows (-1: none yet)
    start: int = 0  # the position of rows[0]
    rows: np.ndarray | None = None  # main-model hidden states [n, D] of positions start..


def scratch_blocks(max_drafts: int, n_sets: int) -> int:
    """Blocks past the main cache's that n_sets sequences chaining up to max_drafts drafts at
    once may need (each chain spans at most this many blocks past its own)."""
    return n_sets * (-(-max_drafts // BLOCK) + 1)


class MtpDrafter:
    """Drafts every decoding sequence of a step from the MTP layer `layer` (a loaded one-layer
    model with forward_paged(..., hidden_in=, hidden_out=)), whose KV cache holds n_blocks
    blocks numbered as the main cache's and scratch blocks after them."""

    def __init__(self, layer: Any, n_blocks: int, max_drafts: int) -> None:
        self.layer = layer
        self.n_embd = int(layer.config.n_embd)
        self.chain_normed = bool(getattr(layer.config, "mtp_chain_normed", False))
        self.first_scratch = int(n_blocks)
        self.per_seq = -(-max_drafts // BLOCK) + 1
        self.n_sets = max(1, (int(layer.n_kv_blocks) - self.first_scratch) // self.per_seq)

    @staticmethod
    def state(req: Any) -> MtpState:
        """req's MTP progress (kept as its drafter)."""
        if not isinstance(req.drafter, MtpState):
            req.drafter = MtpState()
        return req.drafter

    def capture(self, req: Any, first: int, hidden: np.ndarray) -> None:
        """The main model's hidden states [n, D] of positions first.. of req, from a step: the
        ones that get verified feed the next catch-up."""
        st = self.state(req)
        if st.rows is not None and st.start <= st.done <= first <= st.start + len(st.rows):
            st.rows = np.concatenate([st.rows[:first - st.start], hidden])
            return
        if st.rows is None and st.done == first:
            st.start, st.rows = first, hidden
            return
        # a first step, or a sequence computed again after a preemption
        st.done, st.start, st.rows = first, first, hidden

    def propose(self, reqs: Iterable[Any], budgets: dict[int, int],
                table_of: Callable[[Any], list[int]]) -> dict[int, list[int]]:
        """Catch every request up over its verified positions and draft up to budgets[id(req)]
        tokens for those with a budget; returns the drafts by id(req)."""
        catch: list[tuple[Any, int, int]] = []  # request, first position, count
        for req in reqs:
            st = req.drafter if isinstance(req.drafter, MtpState) else None
            if st is None or st.rows is None:
                continue
            n = req.num_computed - st.done
            if n <= 0 or st.done < st.start or req.num_computed > st.start + len(st.rows):
                continue
            catch.append((req, st.done, n))
        if not catch:
            return {}
        n_tok = sum(n for _, _, n in catch)
        tokens = np.empty(n_tok, np.int32)
        seq_ids = np.empty(n_tok, np.int32)
        positions = np.empty(n_tok, np.int32)
        want = np.zeros(n_tok, np.uint8)
        hidden_in = np.empty((n_tok, self.n_embd), np.float32)
        tables = [table_of(req) for req, _, _ in catch]
        at = 0
        for i, (req, first, n) in enumerate(catch):
            st = req.drafter
            tokens[at:at + n] = req.tokens[first + 1:first + 1 + n]
            seq_ids[at:at + n] = i
            positions[at:at + n] = np.arange(first, first + n, dtype=np.int32)
            hidden_in[at:at + n] = st.rows[first - st.start:first - st.start + n]
            if budgets.get(id(req), 0) > 0:
                want[at + n - 1] = 1
            at += n
        hidden_out = np.empty_like(hidden_in)
        logits = self.layer.forward_paged(tokens, seq_ids, positions, _table_rows(tables),
                                          want, hidden_in=hidden_in, hidden_out=hidden_out,
                                          hidden_normed=self.chain_normed)
        drafts: dict[int, list[int]] = {}
        chains: list[tuple[Any, np.ndarray, list[int]]] = []  # request, hidden, its table
        row = at = 0
        for (req, first, n), table in zip(catch, tables, strict=True):
            st = req.drafter
            st.done, st.start, st.rows = first + n, first + n, None
            if want[at + n - 1]:
                d = [int(np.argmax(logits[row]))]
                drafts[id(req)] = d
                row += 1
                if budgets[id(req)] > 1:
                    chains.append((req, hidden_out[at + n - 1], table))
            at += n
        self._chain(chains, budgets, drafts)
        return drafts

    def _chain(self, chains: list[tuple[Any, np.ndarray, list[int]]], budgets: dict[int, int],
               drafts: dict[int, list[int]]) -> None:
        """Draft j + 1 of each chain from draft j and the layer's own hidden state, at the
        position after the last; scratch blocks stand in past a sequence's own. Chain c keeps
        scratch set c % n_sets throughout (its earlier chained rows are read from there), and
        the chains sharing a set take turns: one call per n_sets chains."""
        hidden = {c: h for c, (_, h, _) in enumerate(chains)}
        j = 1
        while hidden:
            for g in range(0, len(chains), self.n_sets):
                group = [c for c in range(g, min(g + self.n_sets, len(chains))) if c in hidden]
                if not group:
                    continue
                reqs = [chains[c][0] for c in group]
                tokens = np.array([drafts[id(r)][-1] for r in reqs], np.int32)
                positions = np.array([r.num_computed - 1 + j for r in reqs], np.int32)
                hidden_in = np.stack([hidden[c] for c in group]).astype(np.float32, copy=False)
                tables = [self._with_scratch(chains[c][2], int(p), c - g)
                          for c, p in zip(group, positions, strict=True)]
                hidden_out = np.empty_like(hidden_in)
                logits = self.layer.forward_paged(tokens, np.arange(len(group), dtype=np.int32),
                                                  positions, _table_rows(tables), None,
                                                  hidden_in=hidden_in, hidden_out=hidden_out,
                                                  hidden_normed=self.chain_normed)
                for i, (c, req) in enumerate(zip(group, reqs, strict=True)):
                    d = drafts[id(req)]
                    d.append(int(np.argmax(logits[i])))
                    if len(d) < budgets[id(req)]:
                        hidden[c] = hidden_out[i]
                    else:
                        del hidden[c]
            j += 1

    def _with_scratch(self, table: list[int], position: int, slot: int) -> list[int]:
        """table, extended with scratch set slot's blocks up to the one holding position."""
        need = position // BLOCK + 1
        if len(table) >= need:
            return table
        base = self.first_scratch + slot * self.per_seq
        return list(table) + [base + i for i in range(need - len(table))]


def _table_rows(tables: list[list[int]]) -> np.ndarray:
    width = max(1, max(len(t) for t in tables))
    out = np.full((len(tables), width), -1, np.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out
