"""EngineCore: the synchronous step loop over one model, one shared paged KV cache and one
scheduler. Each `step()` runs one forward pass over every scheduled token of every running
request, samples the requests whose known tokens are all computed, and returns their outputs.

Guarantees: one request's failure (bad sampling input, a constraint error) fails that request
only; a failed forward pass fails the requests of that step and the engine goes on; blocks are
freed the moment a request finishes or is aborted. Not thread-safe: one thread drives it
(engine.core.async_engine runs it on the engine thread).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from colibri.engine.core.block_manager import BLOCK_SIZE, BlockManager
from colibri.engine.core.mtp_layer import load_mtp_drafter
from colibri.engine.core.request import Request, RequestOutput, Status, new_request
from colibri.engine.core.scheduler import Scheduler, SchedulerConfig
from colibri.engine.core.speculative import (
    DraftPlanner,
    SpecStats,
    SpeculativeConfig,
    allowed,
    draft_budget,
    moe_shape,
)
from colibri.engine.errors import check_token_ids
from colibri.engine.executor.step_inputs import StepInputs
from colibri.engine.sample.batch import RowResult, prompt_logprobs, sample_rows
from colibri.engine.sample.sampler import GREEDY_TEMPERATURE, SamplingParams
from colibri.engine.sample.verify import sample_with_draft

log = logging.getLogger("colibri.engine")
_EXPERT_PHASES = ("experts gate+up", "experts down")  # the product phases of routed experts
MEASURE_EVERY = 4  # auto measures one in this many steps that verify no drafts


class ContextLengthError(ValueError):
    """The prompt (plus the requested completion) does not fit the model's context."""

    def __init__(self, message: str, n_prompt: int, n_ctx: int) -> None:
        super().__init__(message)
        self.n_prompt = n_prompt
        self.n_ctx = n_ctx


@dataclass
class StepStats:
    """Counters the server exports (vLLM's names where one exists)."""

    n_steps: int = 0
    n_step_tokens: int = 0
    step_time_s: float = 0.0
    forward_time_s: float = 0.0


def _drain(req: Request) -> tuple[str, bool]:
    """Text still held back by the detokenizer and the stop matcher, at the end of output."""
    emit, stopped = req.stops.push(req.detok.flush())
    if stopped:
        return emit, True
    return emit + req.stops.flush(), False


def win_pool_need(window: int, chunk: int, config: SchedulerConfig) -> int:
    """Windowed-pool blocks one request may hold during a step: what its first query's window
    or chunk reaches back to, and the step's tokens after it."""
    span = max(window, chunk)
    return -(-(span + config.max_num_batched_tokens) // BLOCK_SIZE) + 1


class EngineCore:
    """Requests in, outputs out, one step at a time."""

    def __init__(self, model: Any, tokenizer: Any, scheduler_config: SchedulerConfig,
                 n_blocks: int, enable_prefix_cache: bool = True,
                 speculative: SpeculativeConfig | None = None) -> None:
        self.model = model
        self.speculative = speculative or SpeculativeConfig()
        self.spec_stats = SpecStats()
        self.tokenizer = tokenizer
        self.vocab_size = int(model.n_vocab)
        self.n_ctx = int(model.n_ctx)
        # linear-attention layers keep one recurrent state per sequence, not per block: no
        # block of such a model can stand for its prefix, so prefix caching is off
        self.hybrid = bool(getattr(getattr(model, "config", None), "hybrid", False))
        if self.hybrid and enable_prefix_cache:
            log.info("prefix caching is off: this model's linear-attention layers keep a "
                     "recurrent state per sequence, which blocks of a prefix cannot restore")
            enable_prefix_cache = False
        n_slots = int(model.kv.n_state_slots) if self.hybrid else 0
        # a hybrid model's verify step advances the recurrent state past rejected drafts: each
        # drafting sequence saves its state first, in a slot past the sequences' own ones (as
        # many sequences draft in a step as there are such slots)
        n_seq_slots = min(n_slots, scheduler_config.max_num_seqs + 1)
        self.snapshot_slots = list(range(n_seq_slots, n_slots))
        if self.hybrid and self.speculative.enabled and not self.snapshot_slots:
            log.info("speculative decoding is off: this model's linear-attention layers need "
                     "spare recurrent-state slots to undo rejected drafts, and the cache was "
                     "made without them")
        # sliding-window and chunked layers in a pool of their own: their blocks go back once
        # every window has left them
        n_win = int(getattr(model.kv, "n_win_blocks", 0))
        cfg = getattr(model, "config", None)
        window = int(getattr(cfg, "sliding_window", None) or 0) if n_win else 0
        chunk = int(getattr(cfg, "attn_chunk", None) or 0) if n_win else 0
        if n_win and n_win < win_pool_need(window, chunk, scheduler_config):
            raise ValueError(f"the windowed KV pool has {n_win} blocks; one request may need "
                             f"{win_pool_need(window, chunk, scheduler_config)}")
        self.blocks = BlockManager(n_blocks, BLOCK_SIZE, enable_prefix_cache, n_seq_slots, n_win,
                                   window, chunk)
        self.step_tokens = scheduler_config.max_num_batched_tokens
        self.planner = DraftPlanner(moe_shape(cfg))
        self._expert_bytes = int(getattr(getattr(model, "core", None), "expert_bytes", 0) or 0)
        self.scheduler = Scheduler(scheduler_config, self.blocks)
        self.requests: dict[str, list[Request]] = {}
        self.stats = StepStats()
        self.eos_ids = list(getattr(tokenizer, "eos_token_ids", []) or [])
        self.on_step: Callable[[int, int], None] | None = None  # (sequences, tokens) per step
        self.model_path: Any = None
        self.model_name = ""  # the repo id or folder name the loader was given
        self.expert_cache: Any = None  # ExpertCacheMonitor, set by the loader
        self._mtp: Any = None  # MtpDrafter, loaded when speculation first asks for it
        if self.speculative.method == "mtp":
            self._mtp_drafter()  # a model without an MTP layer is refused at start

    # -- admission -------------------------------------------------------------------------
    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + completion) one request may hold: the context, or the
        whole KV pool when that is smaller, so a request alone always fits."""
        return min(self.n_ctx, self.blocks.n_blocks * BLOCK_SIZE)

    def context_budget(self, n_prompt: int, requested: int | None) -> int:
        """Completion tokens a prompt of n_prompt tokens may have: requested, or what is left
        of max_request_tokens when None (0 scores the prompt only). ContextLengthError, in
        the words OpenAI's API uses, when it does not fit."""
        cap = self.max_request_tokens
        if cap < self.n_ctx:
            limit = (f"This server's KV cache holds {cap} tokens per request (the model's "
                     f"context is {self.n_ctx})")
        else:
            limit = f"This model's maximum context length is {self.n_ctx} tokens"
        if n_prompt >= cap:
            raise ContextLengthError(f"{limit}, and the prompt has {n_prompt} tokens.",
                                     n_prompt, cap)
        if requested is None:
            return cap - n_prompt
        if n_prompt + requested > cap:
            raise ContextLengthError(
                f"{limit}. However, you requested {n_prompt + requested} tokens ({n_prompt} in "
                f"the prompt, {requested} for the completion). Please reduce the prompt or "
                f"max_tokens.", n_prompt, cap)
        return int(requested)

    def check_request(self, prompt: list[int], params: SamplingParams) -> int:
        """Validate a request; return its completion budget (max new tokens). Raises
        SamplingParamError, TokenIdError (bad token ids, empty prompt) or ContextLengthError."""
        params.validate(self.vocab_size)
        n = len(check_token_ids(prompt, self.vocab_size, "prompt"))
        return self.context_budget(n, params.max_tokens)

    def add_request(self, request_id: str, prompt: list[int],
                    params: SamplingParams | list[SamplingParams]) -> None:
        """Queue one prompt with one SamplingParams per choice (a list: n choices, which share
        the prompt's prefill). Validates everything before queueing anything."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        choices = params if isinstance(params, list) else [params]
        if not choices:
            raise ValueError("no choices requested")
        budgets = [self.check_request(prompt, p) for p in choices]
        prompt = [int(t) for t in prompt]
        reqs: list[Request] = []
        for i, (p, max_new) in enumerate(zip(choices, budgets, strict=True)):
            reqs.append(new_request(request_id, i, prompt, p, self.vocab_size, self.tokenizer,
                                    max_new, self.eos_ids, parent=reqs[0] if i else None))
        reqs[0].n_forks = len(reqs) - 1
        self.requests[request_id] = reqs
        for r in reqs:
            self.scheduler.add(r)

    def abort(self, request_id: str) -> bool:
        """Drop every choice of request_id and free its blocks; False if unknown."""
        reqs = self.requests.pop(request_id, None)
        if reqs is None:
            return False
        for r in reqs:
            if r.status != Status.FINISHED:
                self.scheduler.remove(r)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt prefix (between steps); the cached blocks forgotten."""
        return self.blocks.reset_prefix_cache()

    def snapshot(self) -> dict[str, float]:
        """Counters for /metrics (safe to read from another thread: plain reads)."""
        b = self.blocks
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "kv_usage": b.usage, "prefix_queries": b.prefix_queries,
                "prefix_hits": b.prefix_hits, "preemptions": self.scheduler.n_preemptions,
                "kv_free": b.n_free, "kv_total": b.n_blocks,
                "step_s": self.stats.step_time_s, "forward_s": self.stats.forward_time_s,
                **self.spec_stats.as_dict()}

    @property
    def n_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def n_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the step --------------------------------------------------------------------------
    @property
    def speculates(self) -> bool:
        """Whether steps carry drafts: speculation on, and (hybrid models) spare state slots
        to save the drafting sequences' states in."""
        return self.speculative.enabled and (not self.hybrid or bool(self.snapshot_slots))

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        mtp = (self._mtp_drafter() if self.speculative.method == "mtp" and self.speculates
               else None)
        if mtp is not None:
            self._mtp_propose(mtp)
        elif self.speculates:
            self.planner.plan(self.scheduler.running, self.speculative,
                              len(self.snapshot_slots) if self.hybrid else None,
                              waiting=bool(self.scheduler.waiting))
        # auto's cost model reads the products' counters around every step that verifies
        # drafts, and one in MEASURE_EVERY of the others: enough to follow what a plain step
        # costs, at a fraction of the reads where nothing is drafted (free text)
        measure = self.speculates and self.speculative.adaptive and (
            self.stats.n_steps % MEASURE_EVERY == 0 or self.planner.meter.n_obs == 0
            or any(r.drafts for r in self.scheduler.running))
        products = self._product_totals() if measure else None
        sched = self.scheduler.schedule()
        if self.blocks.pending_copies:  # hybrid forks: blocks and states they start from
            self._copy_forks()
        if not sched.items:
            return []
        n_seq = len(sched.items)
        n_tok = sched.n_tokens
        tokens = np.empty(n_tok, dtype=np.int32)
        seq_ids = np.empty(n_tok, dtype=np.int32)
        positions = np.empty(n_tok, dtype=np.int32)
        want = np.zeros(n_tok, dtype=np.uint8)
        max_blocks = max(len(self.blocks.table(r.rid)) for r, _ in sched.items)
        tables = np.full((n_seq, max_blocks), -1, dtype=np.int32)
        win_tables = (np.full((n_seq, max_blocks), -1, dtype=np.int32)
                      if self.blocks.n_win_blocks else None)
        slots = (np.array([self.blocks.state_slot(r.rid) for r, _ in sched.items], np.int32)
                 if self.hybrid else None)
        at = 0
        for i, (req, n) in enumerate(sched.items):
            c = req.num_computed
            seq_ids[at:at + n] = i
            positions[at:at + n] = np.arange(c, c + n, dtype=np.int32)
            if req.drafts:  # the last known token, then its drafts: every one's logits
                tokens[at] = req.tokens[c]
                tokens[at + 1:at + n] = req.drafts
                want[at:at + n] = 1
            else:
                tokens[at:at + n] = req.tokens[c:c + n]
            if getattr(req.params, "prompt_logprobs", None) is not None and c < len(req.prompt):
                want[at:at + min(n, len(req.prompt) - c)] = 1  # every prompt position scored
            if c + n == req.num_tokens:
                want[at + n - 1] = 1  # the last known token: its logits give the next token
            table = self.blocks.table(req.rid)
            tables[i, :len(table)] = table
            if win_tables is not None:
                win_tables[i, :len(table)] = self.blocks.win_table(req.rid)
            at += n
        saved = self._save_states(sched.items) if self.hybrid and self.speculates else {}
        tf = time.perf_counter()
        hidden = (np.empty((n_tok, mtp.n_embd), dtype=np.float32) if mtp is not None
                  else None)
        # the MTP layer reads what the lm_head reads
        inputs = StepInputs(state_slots=slots, win_tables=win_tables, hidden_out=hidden,
                            hidden_normed=hidden is not None)
        try:
            logits = self.model.forward_paged(tokens, seq_ids, positions, tables, want, inputs)
        except Exception as exc:  # noqa: BLE001 - the step's requests fail, the engine goes on
            log.error("forward pass failed for %d requests: %s", n_seq, exc)
            return [self._fail(req, exc) for req, _ in sched.items]
        self.stats.forward_time_s += time.perf_counter() - tf
        if mtp is not None and hidden is not None:
            at = 0
            for req, n in sched.items:  # the MTP layer's input at the next step
                mtp.capture(req, req.num_computed, hidden[at:at + n])
                at += n

        outputs: list[RequestOutput] = []
        failed: list[RequestOutput] = []
        to_sample: list[tuple[Request, int]] = []  # a request and its row of logits
        row = at = 0
        for req, n in sched.items:
            n_rows = int(want[at:at + n].sum())
            rows = logits[row:row + n_rows]
            row += n_rows
            c = req.num_computed
            if req.drafts:
                # verified in _sample_rounds: for now only the last known token is computed
                req.num_computed = c + 1
                at += n
                to_sample.append((req, row - n_rows))
                continue
            if getattr(req.params, "prompt_logprobs", None) is not None and c < len(req.prompt):
                try:
                    self._gather_prompt_logprobs(req, c, min(n, len(req.prompt) - c), rows)
                except Exception as exc:  # noqa: BLE001 - this request fails alone
                    failed.append(self._fail(req, exc))
                    at += n
                    continue
            req.num_computed = c + n
            at += n
            self.blocks.commit(req.rid, req.tokens, req.num_computed)
            if req.num_computed == req.num_tokens:
                if req.max_new == 0:  # max_tokens 0: the prompt is scored, nothing sampled
                    outputs.append(self._scored_only(req))
                    continue
                to_sample.append((req, row - 1))
        if to_sample:
            outputs += self._sample_rounds(logits, to_sample, saved)
        outputs += failed
        self.stats.n_steps += 1
        self.stats.n_step_tokens += n_tok
        dt = time.perf_counter() - t0
        self.stats.step_time_s += dt
        if products is not None:
            self._measure_step(n_tok, dt, products)
        if self.on_step is not None:
            self.on_step(n_seq, n_tok)
        if self.expert_cache is not None:
            self.expert_cache.on_step(n_seq, n_tok)
        return outputs

    def _product_totals(self) -> tuple[float, float, float]:
        """Expert weight bytes read, expert product seconds and attention seconds so far."""
        st = self.model.product_stats()
        phases = st["phases"]
        return (sum(phases[p]["weight_bytes"] for p in _EXPERT_PHASES if p in phases),
                sum(phases[p]["s"] for p in _EXPERT_PHASES if p in phases),
                float(st.get("attention_s", 0.0)))

    def _measure_step(self, n_tok: int, seconds: float,
                      last: tuple[float, float, float]) -> None:
        """Feed auto's cost model: the step's tokens, the experts it read, its seconds and of
        those the expert products' and attention's (timed in C; with an expert budget the
        expert products' time holds the loads of the experts the cache lacked); last: the
        products' totals before the step."""
        now = self._product_totals()
        experts = (now[0] - last[0]) / self._expert_bytes if self._expert_bytes else 0.0
        self.planner.observe_step(n_tok, experts, seconds, now[1] - last[1], now[2] - last[2])

    def _save_states(self, items: list[tuple[Request, int]]) -> dict[int, int]:
        """Copy the recurrent state of each sequence that carries drafts into a spare slot:
        {id(req): that slot}."""
        saved: dict[int, int] = {}
        spare = iter(self.snapshot_slots)
        for req, _ in items:
            if req.drafts:
                slot = next(spare)
                self.model.kv.copy_state(slot, self.blocks.state_slot(req.rid))
                saved[id(req)] = slot
        return saved

    def _sample_rounds(self, logits: np.ndarray, to_sample: list[tuple[Request, int]],
                       saved: dict[int, int]) -> list[RequestOutput]:
        """Sample every request's next token from its row (see _sample_round). A request
        that carried drafts goes on while its token equals its next draft: the next round
        samples the rows of the drafts accepted so far, so each token is chosen from
        exactly the logits, history and sampler state that decoding one token at a time
        would have. Then its KV blocks past the accepted tokens are rolled back (their
        positions are rewritten before anything reads them) and only the accepted tokens'
        full blocks enter the prefix cache. A hybrid model's sequence that rejected a draft
        gets back the recurrent state saved before the step, and its accepted tokens are
        computed again in the next step (no state can be rewound part way)."""
        outputs: list[RequestOutput] = []
        verified: list[tuple[Request, int]] = []  # with num_computed before the step
        accepted: dict[int, int] = {}
        rnd = 0
        while to_sample:
            results = self._sample_round(logits, to_sample, rnd)
            going_on: list[tuple[Request, int]] = []
            for (req, row), res in zip(to_sample, results, strict=True):
                if rnd == 0 and req.drafts:
                    verified.append((req, req.num_computed - 1))
                if res.error is not None:
                    outputs.append(self._fail(req, res.error))
                    continue
                assert res.result is not None
                try:
                    out = self._advance(req, res.result)
                except Exception as exc:  # noqa: BLE001 - detokenizing or a constraint failed
                    outputs.append(self._fail(req, exc))
                    continue
                outputs.append(out)
                if rnd < len(req.drafts) and out.token_id == req.drafts[rnd]:
                    self.spec_stats.n_accepted += 1
                    accepted[id(req)] = accepted.get(id(req), 0) + 1
                    if out.finish_reason is None:
                        req.num_computed += 1  # the draft's KV is the accepted token's
                        going_on.append((req, row + 1))
            to_sample = going_on
            rnd += 1
        for req, before in verified:
            n_acc = accepted.get(id(req), 0)
            self.spec_stats.n_drafts += 1
            self.spec_stats.n_draft_tokens += len(req.drafts)
            self.planner.observe_verify(req, len(req.drafts), n_acc)
            if req.status == Status.RUNNING and n_acc < len(req.drafts) and id(req) in saved:
                self.model.kv.copy_state(self.blocks.state_slot(req.rid), saved[id(req)])
                req.num_computed = before  # the next step computes the kept tokens again
            req.drafts = []
            if req.status == Status.RUNNING:
                self.blocks.commit(req.rid, req.tokens, req.num_computed)
                self.blocks.truncate(req.rid, req.num_tokens)
        return outputs

    @staticmethod
    def _sample_round(logits: np.ndarray, to_sample: list[tuple[Request, int]],
                      rnd: int) -> list[RowResult]:
        """One round: sampled requests checking their draft number rnd take the speculative
        sampling rule row by row; every other row goes through one batched call."""
        ruled = [i for i, (q, _) in enumerate(to_sample)
                 if rnd < len(q.drafts) and q.params.temperature >= GREEDY_TEMPERATURE]
        results: list[RowResult | None] = [None] * len(to_sample)
        for i in ruled:
            q, r = to_sample[i]
            try:
                results[i] = RowResult(sample_with_draft(q.sampler, logits[r], q.tokens,
                                                         q.drafts[rnd]))
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                results[i] = RowResult(None, exc)
        batch = [e for i, e in enumerate(to_sample) if results[i] is None]
        if batch:
            first, last = batch[0][1], batch[-1][1]
            # decode steps sample consecutive rows: a view, not a copy
            stacked = (logits[first:last + 1] if last - first + 1 == len(batch)
                       else logits[[r for _, r in batch]])
            it = iter(sample_rows(stacked, [q.sampler for q, _ in batch],
                                  [q.tokens for q, _ in batch]))
            results = [res if res is not None else next(it) for res in results]
        return results  # type: ignore[return-value]

    def _copy_forks(self) -> None:
        kv = self.model.kv
        for _, what, src, dst in self.blocks.pending_copies:
            (kv.copy_block if what == "block" else kv.copy_state)(dst, src)
        self.blocks.pending_copies.clear()

    def _mtp_drafter(self) -> Any:
        """The MTP layer's drafter, loaded on first use (NoMtpLayer if the model has none)."""
        if self._mtp is None:
            self._mtp = load_mtp_drafter(self.model, self.blocks.n_blocks,
                                         self.scheduler.config.max_num_seqs,
                                         max(16, self.speculative.num_tokens))
            log.info("speculative decoding drafts with the model's multi-token-prediction "
                     "layer (up to %d tokens per step)", self.speculative.num_tokens)
        return self._mtp

    def _mtp_propose(self, mtp: Any) -> None:
        """Every running request's drafts from the MTP layer (the catch-up over what the last
        step verified runs for all of them); in a model with linear-attention layers only as
        many draft as there are spare state slots to save their states in. A failure there
        costs drafts, never output."""
        running = list(self.scheduler.running)
        slots = len(self.snapshot_slots) if self.hybrid else len(running)
        budgets: dict[int, int] = {}
        for r in running:
            k = draft_budget(r, self.speculative) if slots > 0 else 0
            budgets[id(r)] = k
            slots -= k > 0
        try:
            drafted = mtp.propose(running, budgets, lambda r: self.blocks.table(r.rid))
        except Exception as exc:  # noqa: BLE001 - drafting is optional: decode without drafts
            log.warning("multi-token-prediction drafting failed, this step decodes without "
                        "drafts: %s", exc)
            drafted = {}
        for req in running:
            req.drafts = allowed(req, drafted.get(id(req), []))

    def close(self) -> None:
        """Saves what should outlive the process (the expert routing history)."""
        if self.expert_cache is not None:
            self.expert_cache.close()

    def _gather_prompt_logprobs(self, req: Request, c: int, n: int, rows: np.ndarray) -> None:
        """Logprobs of prompt tokens c+1 .. c+n (each scored by the logits before it)."""
        if req.prompt_lp is None:
            req.prompt_lp = [None]  # the first token has no logprob
        k = int(getattr(req.params, "prompt_logprobs", 0) or 0)
        n_score = min(n, len(req.prompt) - 1 - c)  # the last prompt token's logits sample
        skip = max(0, len(req.prompt_lp) - (c + 1))  # recomputed after a preemption: kept
        if n_score > skip:
            targets = np.asarray(req.prompt[c + 1 + skip:c + 1 + n_score])
            req.prompt_lp.extend(prompt_logprobs(rows[skip:n_score], targets, k))

    def _advance(self, req: Request, res: Any) -> RequestOutput:
        tok = res.token_id
        now = time.perf_counter()
        if req.first_token_time is None:
            req.first_token_time = now
        req.output.append(tok)
        constraint = getattr(req.params, "constraint", None)
        if constraint is not None:
            constraint.accept(tok)
        finish: str | None = None
        if tok in req.stop_ids:
            text, _ = _drain(req)
            finish = "stop"
        else:
            text, stopped = req.stops.push(req.detok.push(tok))
            if stopped:
                finish = "stop"
            elif len(req.output) >= req.max_new or (
                    constraint is not None and constraint.is_finished()):
                tail, stopped = _drain(req)
                text += tail
                finish = "stop" if stopped or len(req.output) < req.max_new else "length"
        out = RequestOutput(req.request_id, req.index, tok, text, res.logprob, res.top_logprobs,
                            finish, len(req.prompt), req.n_cached)
        if finish == "stop":
            out.stop_reason = req.stops.matched
        if not req.sent_prompt_lp:
            out.prompt_logprobs = self._prompt_lp_of(req)
            req.sent_prompt_lp = True
        if finish is not None:
            self._finish(req)
        return out

    @staticmethod
    def _prompt_lp_of(req: Request) -> list[Any] | None:
        # n > 1: later choices share choice 0's prefill, and so its prompt logprobs
        if req.prompt_lp is None and req.parent is not None:
            return req.parent.prompt_lp
        return req.prompt_lp

    def _scored_only(self, req: Request) -> RequestOutput:
        out = RequestOutput(req.request_id, req.index, -1, "", finish_reason="length",
                            n_prompt_tokens=len(req.prompt), n_cached_tokens=req.n_cached,
                            prompt_logprobs=self._prompt_lp_of(req))
        req.sent_prompt_lp = True
        self._finish(req)
        return out

    def _fail(self, req: Request, exc: BaseException) -> RequestOutput:
        self._finish(req)
        return RequestOutput(req.request_id, req.index, -1, "", finish_reason="error",
                             n_prompt_tokens=len(req.prompt), error=exc)

    def _finish(self, req: Request) -> None:
        if req.status != Status.FINISHED:
            self.scheduler.remove(req)
        siblings = self.requests.get(req.request_id)
        if siblings is not None and all(r.status == Status.FINISHED for r in siblings):
            del self.requests[req.request_id]

    # -- scoring ---------------------------------------------------------------------------
    def score(self, tokens: list[int]) -> np.ndarray:
        """Logits [len(tokens), vocab] of a fresh sequence (float32). Runs outside the
        scheduler, on blocks borrowed from the pool for the call."""
        n = len(tokens)
        if n == 0:
            raise ValueError("token_ids is empty")
        if n > self.n_ctx:
            raise ContextLengthError(f"{n} tokens exceed the context of {self.n_ctx}", n,
                                     self.n_ctx)
        rid = f"__score_{id(tokens)}"
        if self.blocks.allocate_prompt(rid, [], [], []) is None:
            raise ContextLengthError(f"{n} tokens do not fit the free KV cache", n, self.n_ctx)
        # with a windowed pool, in steps' worth of tokens: the blocks every window has left go
        # back between them (the same logits as one call)
        step = self.step_tokens if self.blocks.n_win_blocks else n
        ids = np.asarray(tokens, dtype=np.int32)
        out: list[np.ndarray] = []
        try:
            for c in range(0, n, step):
                e = min(n, c + step)
                self.blocks.release_window(rid, c)
                if not self.blocks.grow(rid, e):
                    raise ContextLengthError(f"{n} tokens do not fit the free KV cache", n,
                                             self.n_ctx)
                table = np.asarray([self.blocks.table(rid)], dtype=np.int32)
                win = (np.asarray([self.blocks.win_table(rid)], dtype=np.int32)
                       if self.blocks.n_win_blocks else None)
                slots = (np.array([self.blocks.state_slot(rid)], np.int32) if self.hybrid
                         else None)
                out.append(self.model.forward_paged(
                    ids[c:e], np.zeros(e - c, dtype=np.int32), np.arange(c, e, dtype=np.int32),
                    table, None, StepInputs(state_slots=slots, win_tables=win)))
            return out[0] if len(out) == 1 else np.concatenate(out)
        finally:
            self.blocks.free(rid)

