"""The scheduler: which requests run in the next step, and how many of their tokens.

Every step takes each running request's next tokens (one for a decode, plus the tokens drafted
for it when it speculates; a chunk for a prompt still being computed) and then admits waiting
requests first come first served, under a token budget (`max_num_batched_tokens`) and a cap on
running sequences (`max_num_seqs`). When KV blocks run out (of either pool, for a model whose
windowed layers keep a pool of their own), the newest running request is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
later (never dropped); drafts never cause that, they only take what is spare.
Guarantees: a request is running or waiting, never both; a scheduled request's block table
covers every position the step writes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from colibri.engine.core.block_manager import BlockManager
from colibri.engine.core.options import default
from colibri.engine.core.request import Request, Status


@dataclass
class SchedulerConfig:
    """Limits of one step."""

    max_num_seqs: int = default("max_num_seqs")
    max_num_batched_tokens: int = default("max_num_batched_tokens")
    # prompt tokens one step may carry while some request decodes (None: the whole budget).
    # A step takes as long as its prompt chunks, and every decoding stream waits for it.
    prefill_tokens_while_decoding: int | None = default("prefill_tokens_while_decoding")


@dataclass
class ScheduledStep:
    """The work of one step: (request, number of its tokens to compute), in batch order."""

    items: list[tuple[Request, int]]
    preempted: list[Request]

    @property
    def n_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    """Waiting queue, running list and the block manager they share."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1 or (
                config.prefill_tokens_while_decoding is not None
                and config.prefill_tokens_while_decoding < 1):
            raise ValueError("max_num_seqs, max_num_batched_tokens and "
                             "prefill_tokens_while_decoding must be at least 1")
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.n_preemptions = 0

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Take req out (finished or aborted) and free its blocks."""
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.WAITING:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        self.blocks.free(req.rid)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req.rid)
        req.num_computed = 0
        req.drafts = []
        req.status = Status.WAITING
        req.n_preempted += 1
        self.n_preemptions += 1
        self.waiting.appendleft(req)

    def _fit_drafts(self, req: Request, spare: int) -> int:
        """Keep as many of req's drafts as the spare tokens and blocks allow (a free block
        stays for each other running request's next token); grow its table for them. Drafts
        never preempt anything: what does not fit is dropped."""
        n = max(0, min(len(req.drafts), spare))
        c = req.num_computed
        reserve = len(self.running) - 1  # a block for each other running request's token
        while n > 0 and (not self.blocks.fits(req.rid, c + 1 + n, reserve)
                         or not self.blocks.grow(req.rid, c + 1 + n)):
            n -= 1
        del req.drafts[n:]
        return n

    def _hold_for_forks(self, req: Request, computed: int, n_new: int) -> int:
        """n_new, cut so that a hybrid model's choice 0 stops its prefill one token short of
        its prompt while other choices wait to fork: its recurrent state then holds what they
        copy (the state cannot be rewound to a fork point)."""
        at = len(req.prompt) - 1
        if self.blocks.n_state_slots and req.n_forks > 0 and computed < at:
            return min(n_new, at - computed)
        return n_new

    def schedule(self) -> ScheduledStep:
        budget = self.config.max_num_batched_tokens
        # prompt tokens of this step: fewer while some request decodes, so its stream keeps
        # its pace (a chunk of 256 prompt tokens stalls every decoding stream for as long)
        cap = self.config.prefill_tokens_while_decoding
        prompt_budget = budget if cap is None or not any(
            r.prefill_done for r in self.running) else min(cap, budget)
        items: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        scheduled: set[int] = set()

        # blocks of the windowed pool that every running request's windows have left go back
        # first, so that what follows counts them free
        for req in self.running:
            self.blocks.release_window(req.rid, req.num_computed)

        # running requests first, oldest first: a newer one is preempted before an older one
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n_new = min(req.num_tokens - req.num_computed, budget)
            n_new = self._hold_for_forks(req, req.num_computed, n_new)
            if not req.prefill_done or n_new > 1:  # a prompt, or a recompute after preemption
                req.drafts = []
                if prompt_budget == 0:
                    i += 1
                    continue  # its prompt goes on next step
                n_new = min(n_new, prompt_budget)
                prompt_budget -= n_new
            elif req.drafts:
                n_new += self._fit_drafts(req, budget - (len(self.running) - i))
            while not self.blocks.grow(req.rid, req.num_computed + n_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status != Status.RUNNING:
                break  # req itself was the newest: everything after it is preempted too
            items.append((req, n_new))
            scheduled.add(id(req))
            budget -= n_new
            i += 1

        # then waiting requests, first come first served, while budget, seats and blocks last
        while (self.waiting and budget > 0 and prompt_budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            if preempted and req is preempted[-1]:
                break  # freed blocks were not enough for it just now: try again next step
            parent = req.parent
            at = len(req.prompt) - 1  # where a hybrid choice forks: before the last token
            hybrid = self.blocks.n_state_slots > 0
            if parent is not None and parent.status != Status.FINISHED and (
                    parent.status != Status.RUNNING
                    or (parent.num_computed < at if hybrid else not parent.prefill_done)):
                break  # n > 1: wait for choice 0's prompt, then share its blocks
            fork = parent is not None and parent.status == Status.RUNNING and (
                not hybrid or (parent.num_computed == at and at > 0 and req.n_preempted == 0))
            if fork:
                assert parent is not None
                done = self.blocks.fork(parent.rid, req.rid, len(req.prompt))
            elif getattr(req.params, "prompt_logprobs", None) is not None:
                # every prompt position must be computed to score it: no cached prefix
                done = self.blocks.allocate_prompt(req.rid, req.tokens, [], [])
            else:
                done = self.blocks.allocate_prompt(req.rid, req.tokens)
            if done is None:
                break
            n_new = self._hold_for_forks(req, done,
                                         min(req.num_tokens - done, budget, prompt_budget))
            if not self.blocks.grow(req.rid, done + n_new):
                self.blocks.free(req.rid)
                break
            self.waiting.popleft()
            if parent is not None and req.n_preempted == 0:
                parent.n_forks = max(0, parent.n_forks - 1)  # forked now, or computes alone
            if req.n_preempted == 0:
                req.n_cached = done
            req.num_computed = done
            req.status = Status.RUNNING
            self.running.append(req)
            items.append((req, n_new))
            budget -= n_new
            prompt_budget -= n_new
        return ScheduledStep(items, preempted)
