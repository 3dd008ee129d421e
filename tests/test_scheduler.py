"""The scheduler on its own: the real Scheduler and BlockManager driven with plain requests, no
model, no weights. A small loop stands in for the engine's step (it computes what was
scheduled, "samples" a fixed token and finishes a request after max_new of them) and checks
after every step what engine/core/scheduler.py promises:

- running requests go first, then waiting ones first come first served, under the token budget
  (`max_num_batched_tokens`) and the cap on running sequences (`max_num_seqs`);
- prompts longer than the budget are computed in chunks, and in smaller chunks
  (`prefill_tokens_while_decoding`) while another request decodes;
- when KV blocks run out the newest running request is preempted: its blocks are freed, it
  goes back to the front of the queue, is recomputed later and finishes (never dropped);
- a request is running or waiting, never both, and a scheduled request's block table covers
  every position its step writes, in blocks no other request holds;
- a finished or aborted request frees its blocks: the pool is whole again at the end.
"""

from __future__ import annotations

import itertools
import random

import pytest

from colibri.engine.core.block_manager import BLOCK_SIZE, BlockManager
from colibri.engine.core.request import Request, Status
from colibri.engine.core.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from colibri.engine.sample.sampler import SamplingParams

_ids = itertools.count(1)


def _req(n_prompt: int, max_new: int = 4, name: str | None = None,
         prompt: list[int] | None = None, parent: Request | None = None,
         params: SamplingParams | None = None) -> Request:
    """A request of n_prompt tokens (distinct from every other request's unless `prompt` is
    given). The scheduler never samples or detokenizes: those parts stay empty."""
    k = next(_ids)
    if prompt is None:
        prompt = [100_000 * k + i for i in range(n_prompt)]
    return Request(request_id=name or f"r{k}", index=1 if parent is not None else 0,
                   prompt=list(prompt), params=params or SamplingParams(),
                   sampler=None, detok=None, stops=None,  # type: ignore[arg-type]
                   max_new=max_new, stop_ids=frozenset(), parent=parent)


def _scheduler(n_blocks: int = 64, max_num_seqs: int = 16, max_num_batched_tokens: int = 512,
               prefill_tokens_while_decoding: int | None = None,
               prefix_cache: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens,
                                     prefill_tokens_while_decoding),
                     BlockManager(n_blocks, enable_prefix_cache=prefix_cache))


def _check(s: Scheduler, step: ScheduledStep) -> None:
    """What holds after every schedule(), whatever the workload."""
    bm, cfg = s.blocks, s.config
    running, waiting = {id(r) for r in s.running}, {id(r) for r in s.waiting}
    assert not running & waiting, "a request is both running and waiting"
    assert all(r.status == Status.RUNNING for r in s.running)
    assert all(r.status == Status.WAITING for r in s.waiting)
    assert all(r.rid not in bm.tables for r in s.waiting), "a waiting request holds blocks"
    assert len(s.running) <= cfg.max_num_seqs
    assert 0 < step.n_tokens <= cfg.max_num_batched_tokens or not step.items
    scheduled = [r for r, _ in step.items]
    assert len({id(r) for r in scheduled}) == len(scheduled), "a request twice in one step"
    assert not {id(r) for r in step.preempted} & {id(r) for r in scheduled}
    for req, n in step.items:
        assert id(req) in running and n >= 1
        assert req.num_computed + n <= req.num_tokens
        table = bm.table(req.rid)
        assert len(table) * bm.block_size >= req.num_computed + n, "table short of the step"
        first, last = req.num_computed // bm.block_size, (req.num_computed + n - 1) // bm.block_size
        others = {b for rid, t in bm.tables.items() if rid != req.rid for b in t.blocks}
        assert not set(table[first:last + 1]) & others, "a step writes into a shared block"
    held = {b for t in bm.tables.values() for b in t.blocks}
    assert bm.n_free == bm.n_blocks - len(held)


def _step(s: Scheduler) -> ScheduledStep:
    """One engine step without a model: compute what was scheduled, then a request whose
    known tokens are all computed gets its next token, and finishes after max_new."""
    step = s.schedule()
    _check(s, step)
    for req, n in step.items:
        req.num_computed += n
        s.blocks.commit(req.rid, req.tokens, req.num_computed)
        if req.num_computed == req.num_tokens:
            req.output.append(7 + len(req.output))
            if len(req.output) >= req.max_new:
                s.remove(req)
    return step


def _run(s: Scheduler, reqs: list[Request], max_steps: int = 10_000) -> list[ScheduledStep]:
    """Steps until every request finished; every one must finish with all its tokens."""
    steps = []
    while s.has_work():
        steps.append(_step(s))
        assert len(steps) < max_steps, "the scheduler stopped making progress"
    for r in reqs:
        assert r.status == Status.FINISHED and len(r.output) == r.max_new
    assert s.blocks.n_free == s.blocks.n_blocks and not s.blocks.tables
    return steps


def test_limits_below_one_are_refused() -> None:
    for cfg in (SchedulerConfig(max_num_seqs=0), SchedulerConfig(max_num_batched_tokens=0),
                SchedulerConfig(prefill_tokens_while_decoding=0)):
        with pytest.raises(ValueError, match="at least 1"):
            Scheduler(cfg, BlockManager(4))


def test_waiting_requests_are_admitted_first_come_first_served() -> None:
    s = _scheduler(max_num_seqs=2)
    a, b, c, d = _req(5), _req(3), _req(4), _req(2)
    for r in (a, b, c, d):
        s.add(r)
    first = _step(s)
    assert [(r, n) for r, n in first.items] == [(a, 5), (b, 3)]  # whole prompts, in order
    assert list(s.waiting) == [c, d] and s.running == [a, b]
    second = _step(s)
    assert [(r, n) for r, n in second.items] == [(a, 1), (b, 1)]  # seats full: c still waits
    admitted: list[Request] = [a, b]
    steps = [first, second]
    while s.has_work():
        steps.append(_step(s))
        admitted += [r for r, _ in steps[-1].items if r not in admitted]
    assert admitted == [a, b, c, d]


def test_running_requests_go_before_new_ones_and_the_budget_holds() -> None:
    s = _scheduler(max_num_batched_tokens=16)
    a = _req(10, max_new=8)
    s.add(a)
    assert [(r, n) for r, n in _step(s).items] == [(a, 10)]
    b, c = _req(40), _req(3)
    s.add(b)
    s.add(c)
    step = _step(s)
    # a's next token first, then b's prompt takes what is left; c waits behind b
    assert [(r, n) for r, n in step.items] == [(a, 1), (b, 15)]
    assert step.n_tokens == 16 and list(s.waiting) == [c]
    _run(s, [a, b, c])


def test_a_long_prompt_is_computed_in_chunks_of_the_budget() -> None:
    s = _scheduler(max_num_batched_tokens=32)
    r = _req(100, max_new=3)
    s.add(r)
    chunks = [n for step in _run(s, [r]) for _, n in step.items]
    assert chunks == [32, 32, 32, 4, 1, 1]  # the prompt in chunks, then one token a step


def test_prompt_chunks_shrink_while_another_request_decodes() -> None:
    s = _scheduler(max_num_batched_tokens=64, prefill_tokens_while_decoding=8)
    a = _req(4, max_new=6)
    s.add(a)
    _step(s)  # a's prompt: nothing decodes yet, so the whole budget was open
    b = _req(30, max_new=2)
    s.add(b)
    seen: list[tuple[int, int]] = []  # (a's tokens, b's tokens) per step
    while a.status != Status.FINISHED:
        step = dict((r.rid, n) for r, n in _step(s).items)
        seen.append((step.get(a.rid, 0), step.get(b.rid, 0)))
    assert all(na == 1 for na, _ in seen)
    assert [nb for _, nb in seen] == [8, 8, 8, 6, 1]  # then b decodes too
    # alone, b's prompt would have taken the whole budget in one step
    s2 = _scheduler(max_num_batched_tokens=64, prefill_tokens_while_decoding=8)
    c = _req(30, max_new=1)
    s2.add(c)
    assert [n for _, n in _step(s2).items] == [30]
    _run(s, [a, b])


def test_the_cap_on_running_sequences() -> None:
    s = _scheduler(max_num_seqs=3)
    reqs = [_req(2, max_new=5) for _ in range(7)]
    for r in reqs:
        s.add(r)
    steps = _run(s, reqs)
    assert max(len(st.items) for st in steps) == 3


def test_the_newest_request_is_preempted_and_requeued_at_the_front() -> None:
    # 4 blocks: a and b take two each for their 31-token prompts; the first step past 32
    # positions needs a fifth, which only b's blocks can give
    s = _scheduler(n_blocks=4, max_num_seqs=2)
    a, b, c = _req(31, max_new=3), _req(31, max_new=3), _req(5, max_new=1)
    for r in (a, b, c):
        s.add(r)
    assert [(r, n) for r, n in _step(s).items] == [(a, 31), (b, 31)]
    assert s.blocks.n_free == 0
    assert [(r, n) for r, n in _step(s).items] == [(a, 1), (b, 1)]  # position 31: still room
    step = _step(s)
    assert step.preempted == [b] and [(r, n) for r, n in step.items] == [(a, 1)]
    assert b.status == Status.WAITING and list(s.waiting) == [b, c]  # ahead of c
    assert b.num_computed == 0 and b.n_preempted == 1 and s.n_preemptions == 1
    assert b.output == [7, 8]  # what it generated is kept, to be recomputed
    assert b.rid not in s.blocks.tables
    # b comes back first once a finishes, recomputes its prompt and its two tokens (less the
    # full block the prefix cache still holds), then goes on where it stopped
    rest = _run(s, [a, b, c])
    again = next(n for st in rest for r, n in st.items if r is b)
    assert again == 33 - BLOCK_SIZE
    order = [r for st in rest for r, _ in st.items]
    assert order.index(b) < order.index(c)
    assert b.output == [7, 8, 9] and b.n_cached == 0  # n_cached: found at its first admission


def test_preemption_without_the_prefix_cache_recomputes_everything() -> None:
    s = _scheduler(n_blocks=4, max_num_seqs=2, prefix_cache=False)
    a, b = _req(31, max_new=3), _req(31, max_new=3)
    s.add(a)
    s.add(b)
    steps = _run(s, [a, b])
    assert b.n_preempted == 1
    assert [n for st in steps for r, n in st.items if r is b] == [31, 1, 33]


def test_random_workloads_finish_every_request_and_free_every_block() -> None:
    """Prompts of every length, more requests than seats or blocks, arrivals while others run
    and aborts at random: every request not aborted finishes with all its tokens, preempted
    ones included, and the pool is whole at the end."""
    preemptions = [_random_workload(seed) for seed in range(8)]
    assert sum(preemptions) > 0, "no workload ran out of blocks: the test proves less"


def _random_workload(seed: int) -> int:
    """One random workload, checked; returns the scheduler's preemption count."""
    rng = random.Random(seed)
    n_blocks = rng.randint(6, 14)
    s = _scheduler(n_blocks=n_blocks, max_num_seqs=rng.randint(1, 5),
                   max_num_batched_tokens=rng.randint(8, 80),
                   prefill_tokens_while_decoding=rng.choice([None, 4, 16]))
    shared = [rng.randrange(50) for _ in range(3 * BLOCK_SIZE)]

    def new() -> Request:
        max_new = rng.randint(1, 12)
        n = rng.randint(1, n_blocks * BLOCK_SIZE - max_new)  # each fits the pool alone
        prompt = shared[:n] if rng.random() < 0.3 and n <= len(shared) else None
        return _req(n, max_new=max_new, prompt=prompt)

    pending = [new() for _ in range(25)]
    aborted: list[Request] = []
    arrived: list[Request] = []
    for _ in range(5000):
        if pending and rng.random() < 0.4:
            arrived.append(pending.pop())
            s.add(arrived[-1])
        live = [r for r in arrived if r.status != Status.FINISHED]
        if live and rng.random() < 0.03:
            victim = rng.choice(live)
            s.remove(victim)
            aborted.append(victim)
            assert victim.rid not in s.blocks.tables
        if not s.has_work() and not pending:
            break
        if s.has_work():
            _step(s)
    assert not pending and not s.has_work()
    done = [r for r in arrived if r not in aborted]
    assert len(done) + len(aborted) == 25
    for r in done:
        assert len(r.output) == r.max_new
    assert s.blocks.n_free == n_blocks and not s.blocks.tables
    return s.n_preemptions


def test_abort_of_a_waiting_or_running_request_frees_its_blocks() -> None:
    s = _scheduler(n_blocks=8, max_num_seqs=1, max_num_batched_tokens=16)
    a, b = _req(40), _req(4)
    s.add(a)
    s.add(b)
    _step(s)  # a's first chunk; b waits for the seat
    assert a.status == Status.RUNNING and len(s.blocks.table(a.rid)) == 1
    s.remove(b)  # aborted while waiting: it never ran, holds nothing
    assert b.status == Status.FINISHED and list(s.waiting) == []
    s.remove(a)  # aborted mid-prompt
    assert a.status == Status.FINISHED and s.running == []
    assert s.blocks.n_free == 8 and not s.has_work()
    assert s.schedule().items == []
    s.remove(a)  # a second abort changes nothing
    assert s.blocks.n_free == 8


def test_finished_requests_free_their_blocks_step_by_step() -> None:
    s = _scheduler(n_blocks=16, prefix_cache=False)
    short, long = _req(20, max_new=1), _req(20, max_new=6)
    s.add(short)
    s.add(long)
    _step(s)  # both prompts; short samples its one token and finishes
    assert short.status == Status.FINISHED and short.rid not in s.blocks.tables
    assert s.blocks.n_free == 16 - len(s.blocks.table(long.rid))
    _run(s, [short, long])


def test_a_cached_prefix_is_not_computed_again() -> None:
    s = _scheduler()
    prompt = list(range(3 * BLOCK_SIZE + 5))
    first = _req(0, max_new=1, prompt=prompt)
    s.add(first)
    _run(s, [first])
    again = _req(0, max_new=1, prompt=prompt)
    s.add(again)
    step = _step(s)
    # three full blocks found in the cache; the rest (with the last token) computed
    assert [(r, n) for r, n in step.items] == [(again, 5)] and again.n_cached == 3 * BLOCK_SIZE
    scored = _req(0, max_new=1, prompt=prompt, params=SamplingParams(prompt_logprobs=0))
    s.add(scored)
    # a request that scores its prompt computes every position of it
    assert [(r, n) for r, n in _step(s).items] == [(scored, len(prompt))]
    assert scored.n_cached == 0


def test_choices_of_one_prompt_share_its_prefill() -> None:
    s = _scheduler(max_num_batched_tokens=16)
    prompt = list(range(2 * BLOCK_SIZE + 3))
    parent = _req(0, max_new=4, name="n2", prompt=prompt)
    child = _req(0, max_new=2, name="n2", prompt=prompt, parent=parent)
    s.add(parent)
    s.add(child)
    while not parent.prefill_done:  # the second choice waits for the first one's prompt
        _step(s)
        assert child.status == Status.WAITING
    step = _step(s)
    assert (child, 3) in step.items  # only what follows the shared full blocks
    assert s.blocks.table(child.rid)[:2] == s.blocks.table(parent.rid)[:2]
    _run(s, [parent, child])


def test_drafts_take_only_spare_tokens_and_blocks() -> None:
    """A decoding request's drafts join its step only as far as the step budget (one token
    kept for each running request after it) and the free blocks (one kept for each other
    running request) allow; what does not fit is dropped, never preempting anything."""
    s = _scheduler(n_blocks=3, max_num_batched_tokens=64)
    a, b = _req(15, max_new=20), _req(15, max_new=20)
    s.add(a), s.add(b)
    step = s.schedule()
    assert [n for _, n in step.items] == [15, 15]
    for r in (a, b):  # both prompts computed, one token sampled: both decode now
        r.num_computed = 15
        r.output.append(7)
    # a's drafts would need a second block; the one free block is b's reserve
    a.drafts, b.drafts = [1, 2, 3, 4], []
    step = s.schedule()
    assert [n for _, n in step.items] == [1, 1] and not step.preempted and a.drafts == []
    assert s.blocks.n_free == 1
    # with blocks to spare, the budget decides: 3 tokens for two decoding requests
    s = _scheduler(n_blocks=8, max_num_batched_tokens=64)
    a, b = _req(15, max_new=20), _req(15, max_new=20)
    s.add(a), s.add(b)
    s.schedule()
    s.config.max_num_batched_tokens = 3
    for r in (a, b):
        r.num_computed = 15
        r.output.append(7)
    a.drafts, b.drafts = [1, 2, 3, 4], [5, 6]
    step = s.schedule()
    assert [n for _, n in step.items] == [2, 1] and not step.preempted
    assert (a.drafts, b.drafts) == ([1], [])
    assert len(s.blocks.table(a.rid)) == 2  # positions 15 and 16: a second block
