"""Speculative decoding in the step engine: greedy output with drafts verified is token for
token (and logprob for logprob) the output without them, for several families and draft
lengths, whether the drafts are accepted or rejected; rollback leaves the KV cache and the
prefix cache as if rejected drafts never ran; stop strings, stop tokens, max_tokens, n > 1,
logprobs, an expert budget and mixed batches keep working."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import quick_params
from tests.tiny_models import TinyCheckpoints

N_CTX = 256
# every MoE family (softmax and grouped routers, MLA, sliding windows with sinks, partial
# rotary) and a dense one
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "deepseek_v2",
            "glm4_moe", "gpt_oss", "minimax_m2", "llama4", "llama")
# a family each of softmax, grouped and MLA, and sink models, and a dense one run in the quick
# pass; every family (the chunked one too) runs in the whole suite
QUICK = ("mixtral", "deepseek_v3", "gpt_oss", "llama")
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
    "One, two, three, four, five, six, seven, eight, nine, ten. One, two, three,",
    "Once upon a time there was a little hummingbird",
    "Water boils at one hundred degrees",
]


@pytest.fixture(scope="module", autouse=True)
def _cache(own_cache_dir: Path) -> None:
    """Conversions of this module's checkpoints in a cache folder of their own."""


@pytest.fixture(scope="module")
def ckpts(checkpoints: TinyCheckpoints) -> dict[str, Path]:
    return checkpoints.folders(seed=7)


def _llm(hf: Path, quant: str = "f32", **cfg: Any) -> Any:
    from colibri.engine import LLM, EngineConfig

    cfg.setdefault("max_num_seqs", 8)
    cfg.setdefault("max_num_batched_tokens", 64)
    return LLM(hf, threads=2, quant=quant, n_ctx=N_CTX, config=EngineConfig(**cfg))


def _params(**kw: Any) -> Any:
    from colibri.engine import SamplingParams

    base: dict[str, Any] = dict(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=3)
    base.update(kw)
    return SamplingParams(**base)


def _ids(llm: Any, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=True)


def _run(llm: Any, prompts: list[list[int]], params: Any,
         drafters: Sequence[Any] | None = None) -> dict[str, list[Any]]:
    """Every output of each prompt (run together), by request id; drafters[i], when given,
    drafts for prompt i instead of the engine's own drafter."""
    core = llm.core
    plist = params if isinstance(params, list) else [params] * len(prompts)
    rids = [f"r{i}-{id(prompts)}" for i in range(len(prompts))]
    for i, (rid, prompt, p) in enumerate(zip(rids, prompts, plist, strict=True)):
        core.add_request(rid, prompt, p)
        if drafters is not None and drafters[i] is not None:
            for req in core.requests[rid]:
                req.drafter = drafters[i]
    out: dict[str, list[Any]] = {rid: [] for rid in rids}
    while core.has_work():
        for o in core.step():
            assert o.error is None, o.error
            out[o.request_id].append(o)
        for req in core.scheduler.running:  # rolled back: no block past the accepted tokens
            if req.prefill_done and req.num_tokens - req.num_computed == 1:
                assert len(core.blocks.table(req.rid)) <= core.blocks.blocks_for(req.num_tokens)
    assert core.blocks.n_free == core.blocks.n_blocks  # nothing leaked, drafts included
    return {rid[:rid.index("-")]: outs for rid, outs in out.items()}


def _trace(outs: list[Any]) -> list[tuple[Any, ...]]:
    """What a client sees of a choice: tokens, text, logprobs (bit for bit), finish."""
    return [(o.index, o.token_id, o.text, o.logprob, o.top_logprobs, o.finish_reason,
             o.stop_reason) for o in outs]


class ScriptedDrafter:
    """Drafts from a known continuation of the prompt: the model's own greedy tokens (every
    draft accepted) or, with `wrong`, a different token at each place (every one rejected);
    `every` skips the drafts of all but every n-th call, so some steps carry none."""

    def __init__(self, prompt: list[int], continuation: list[int], wrong: bool = False,
                 vocab: int = 320) -> None:
        self.text = prompt + continuation
        self.n_prompt = len(prompt)
        self.wrong = wrong
        self.vocab = vocab
        self.calls = 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        self.calls += 1
        assert tokens == self.text[:len(tokens)], "the sequence left the known continuation"
        nxt = self.text[len(tokens):len(tokens) + k]
        if self.wrong:
            return [(t + 1) % self.vocab for t in nxt]
        return nxt


def _spec(llm: Any, k: int, method: str = "ngram") -> None:
    from colibri.engine.core.speculative import SpecStats, SpeculativeConfig

    llm.core.speculative = SpeculativeConfig(method, k)
    llm.core.spec_stats = SpecStats()


def _same_output_at_each_k(llm: Any, prompts: list[list[int]], want: dict[str, Any],
                           tag: str) -> list[Any]:
    """ngram drafts at k = 1, 2, 4, one run each: every run's output is want, token for token
    and logprob for logprob. The speculation counters of each run."""
    stats = []
    for k in (1, 2, 4):
        _spec(llm, k)
        got = _run(llm, prompts, _params())
        for rid in want:
            assert _trace(got[rid]) == _trace(want[rid]), (tag, k, rid)
        stats.append(llm.core.spec_stats)
    return stats


@pytest.mark.parametrize("arch,quant", [(a, "f32") if a in QUICK else
                                        pytest.param(a, "f32", marks=pytest.mark.slow)
                                        for a in FAMILIES]
                         + [("mixtral", "q4"), ("qwen3_moe", "q8")])
def test_greedy_output_is_the_same_with_prompt_lookup(ckpts: dict[str, Path], arch: str,
                                                      quant: str) -> None:
    """Four prompts run together, greedy with logprobs: with ngram drafts at k = 1, 2, 4 the
    outputs equal those of the engine without speculation, token for token and logprob for
    logprob (f32 weights and KV; q4 and q8 weights with the f16 KV cache); drafts were
    verified, and accepted where the output repeats itself."""
    base = _llm(ckpts[arch], quant, prefix_cache=False)
    prompts = [_ids(base, p) for p in PROMPTS]
    want = _run(base, prompts, _params())
    spec = _llm(ckpts[arch], quant, prefix_cache=False)
    stats = _same_output_at_each_k(spec, prompts, want, arch)
    for st in stats:
        assert st.n_draft_tokens > 0 and st.n_drafts > 0
        assert st.n_accepted <= st.n_draft_tokens
    assert sum(st.n_accepted for st in stats) > 0, \
        "no draft was ever accepted: the test would not check acceptance"


@pytest.mark.parametrize("k", [1, 2, 4, 16])
def test_accepted_and_rejected_drafts_give_the_same_tokens(ckpts: dict[str, Path],
                                                           k: int) -> None:
    """Drafts that are the model's own tokens are all accepted (fewer steps), drafts that are
    all wrong are all rejected; both give the tokens and logprobs of decoding without them."""
    base = _llm(ckpts["mixtral"], prefix_cache=False)
    prompts = [_ids(base, p) for p in PROMPTS[:2]]
    want = _run(base, prompts, _params())
    n_steps_base = base.core.stats.n_steps
    conts = [[o.token_id for o in want[f"r{i}"]] for i in range(2)]
    llm = _llm(ckpts["mixtral"], prefix_cache=False)
    _spec(llm, k)
    got = _run(llm, prompts, _params(),
               [ScriptedDrafter(p, c) for p, c in zip(prompts, conts, strict=True)])
    assert all(_trace(got[r]) == _trace(want[r]) for r in want)
    st = llm.core.spec_stats
    assert st.n_draft_tokens > 0 and st.n_accepted == st.n_draft_tokens
    assert st.mean_accepted == pytest.approx(st.n_draft_tokens / st.n_drafts)
    # each verify step yields its drafts plus the model's next token
    assert llm.core.stats.n_steps < n_steps_base
    _spec(llm, k)
    got = _run(llm, prompts, _params(),
               [ScriptedDrafter(p, c, wrong=True) for p, c in zip(prompts, conts, strict=True)])
    assert all(_trace(got[r]) == _trace(want[r]) for r in want)
    st = llm.core.spec_stats
    assert st.n_draft_tokens > 0 and st.n_accepted == 0


def test_rollback_leaves_kv_and_prefix_cache_as_if_drafts_never_ran(
        ckpts: dict[str, Path]) -> None:
    """A long greedy run whose drafts are all rejected (k = 4: each step writes four wrong
    tokens into the cache, across block boundaries) has every later step bit-equal to a run
    without drafts; a later request whose prompt is that prompt and output reuses the blocks
    written then (prefix cache hit) and gets the tokens and logprobs of an engine that never
    speculated and has no prefix cache."""
    base = _llm(ckpts["qwen2_moe"], prefix_cache=False)
    prompt = _ids(base, PROMPTS[2])
    want = _run(base, [prompt], _params(max_tokens=60))["r0"]
    cont = [o.token_id for o in want]
    llm = _llm(ckpts["qwen2_moe"])
    _spec(llm, 4)
    got = _run(llm, [prompt], _params(max_tokens=60),
               [ScriptedDrafter(prompt, cont, wrong=True)])["r0"]
    assert _trace(got) == _trace(want)
    assert llm.core.spec_stats.n_draft_tokens >= 4 * 50 and llm.core.spec_stats.n_accepted == 0
    # the second request: the first one's text again, then 20 more tokens
    longer = prompt + cont[:-1]
    want2 = _run(base, [longer], _params(max_tokens=20))["r0"]
    _spec(llm, 4, "off")
    got2 = _run(llm, [longer], _params(max_tokens=20))["r0"]
    assert got2[0].n_cached_tokens >= 16 * ((len(longer) - 1) // 16) > len(prompt)
    assert _trace(got2) == _trace(want2)
    # and with speculation on for the second request too (drafts accepted this time)
    _spec(llm, 4)
    got3 = _run(llm, [longer], _params(max_tokens=20),
                [ScriptedDrafter(longer, [o.token_id for o in want2])])["r0"]
    assert got3[0].n_cached_tokens == got2[0].n_cached_tokens
    assert _trace(got3) == _trace(want2)
    assert llm.core.spec_stats.n_accepted > 0


def test_stops_inside_accepted_drafts(ckpts: dict[str, Path]) -> None:
    """A stop string, a stop token and max_tokens that fall inside a run of accepted drafts
    end the output exactly where decoding without drafts ends it (text held back and cut,
    finish reasons), and nothing after them is sent."""
    base = _llm(ckpts["mixtral"], prefix_cache=False)
    prompt = _ids(base, PROMPTS[0])
    free = _run(base, [prompt], _params(max_tokens=30))["r0"]
    cont = [o.token_id for o in free]
    text = "".join(o.text for o in free)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    stop_tok = cont[9]
    cases = [_params(max_tokens=30, stop=[stop]),
             _params(max_tokens=30, stop_token_ids=[stop_tok], ignore_eos=False),
             _params(max_tokens=7)]
    llm = _llm(ckpts["mixtral"], prefix_cache=False)
    for p in cases:
        want = _run(base, [prompt], p)["r0"]
        _spec(llm, 4)
        got = _run(llm, [prompt], p, [ScriptedDrafter(prompt, cont)])["r0"]
        assert _trace(got) == _trace(want)
        assert want[-1].finish_reason in ("stop", "length") and len(want) < 30
        assert llm.core.spec_stats.n_accepted > 0


def test_mixed_batch_each_request_gets_what_it_gets_alone(ckpts: dict[str, Path]) -> None:
    """Greedy requests (one with penalties and a logit bias, one with n = 2) and sampled ones,
    all speculating in one batch beside each other's drafts and prompt chunks: each gets
    exactly what it gets alone on an engine with the same settings, and the greedy ones what
    they get without speculation."""
    from colibri.engine import SamplingParams

    llm = _llm(ckpts["deepseek_v3"])
    _spec(llm, 3)
    solo = _llm(ckpts["deepseek_v3"], prefix_cache=False)
    _spec(solo, 3)
    base = _llm(ckpts["deepseek_v3"], prefix_cache=False)
    prompts = [_ids(llm, p) for p in PROMPTS]
    params = [
        _params(repetition_penalty=1.3, frequency_penalty=0.2, logit_bias={5: 3.0}),
        _params(max_tokens=25, temperature=0.9, top_p=0.9, seed=11),
        [_params(max_tokens=30), _params(max_tokens=30, logprobs=None)],
        _params(max_tokens=30, temperature=0.7, top_k=8, seed=5, logprobs=None),
    ]
    core = llm.core
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(f"m{i}", prompt, p)
    together: dict[str, list[Any]] = {f"m{i}": [] for i in range(4)}
    while core.has_work():
        for o in core.step():
            assert o.error is None
            together[o.request_id].append(o)
    assert core.blocks.n_free == core.blocks.n_blocks
    assert core.spec_stats.n_draft_tokens > 0
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        choices = p if isinstance(p, list) else [p]
        greedy = choices[0].temperature == 0.0
        for alone in (solo.core, base.core) if greedy else (solo.core,):
            alone.add_request("solo", prompt, [SamplingParams(**vars(c)) for c in choices])
            outs: list[Any] = []
            while alone.has_work():
                outs += alone.step()
            for c in range(len(choices)):
                assert (_trace([o for o in together[f"m{i}"] if o.index == c])
                        == _trace([o for o in outs if o.index == c])), (i, c)


def test_speculation_under_an_expert_budget(ckpts: dict[str, Path]) -> None:
    """With three of eight experts per layer resident (every verify step needs the union of
    its tokens' experts, loaded and evicted as it goes), greedy output with drafts is the
    output with every expert resident and no drafts."""
    from colibri.engine.core.options import ExpertCacheConfig

    base = _llm(ckpts["qwen2_moe"], "q8", prefix_cache=False)
    prompts = [_ids(base, p) for p in PROMPTS]
    want = _run(base, prompts, _params())
    cont = [o.token_id for o in want["r1"]]
    llm = _llm(ckpts["qwen2_moe"], "q8", prefix_cache=False,
               expert_cache=ExpertCacheConfig(expert_cache_size=3, expert_pin=False))
    assert llm.core.expert_cache.plan.per_layer == 3
    _spec(llm, 4)
    drafters = [None, ScriptedDrafter(prompts[1], cont), None, None]
    got = _run(llm, prompts, _params(), drafters)
    assert all(_trace(got[r]) == _trace(want[r]) for r in want)
    assert llm.core.spec_stats.n_accepted > 0
    st = llm.core.expert_cache.totals()
    assert st["misses"] > 0  # the budget was in play


def test_constrained_requests_speculate_within_their_grammar(ckpts: dict[str, Path]) -> None:
    """A request with a grammar drafts only what the grammar accepts and chooses each token
    under the grammar's mask of the tokens before it: greedy, it gets what it gets without
    speculation, with drafts kept (the grammar makes the output repeat itself); sampled, its
    text still matches the grammar."""
    import re

    from colibri.engine.sample.constraints import ConstraintCompiler, ConstraintSpec

    base = _llm(ckpts["mixtral"], prefix_cache=False)
    llm = _llm(ckpts["mixtral"], prefix_cache=False)
    _spec(llm, 4)
    compiler = ConstraintCompiler.for_tokenizer(llm.tokenizer, llm.vocab_size)
    prompt = _ids(llm, PROMPTS[1])
    pattern = "(one, two, three, ){3}four"

    def params(**kw: Any) -> Any:
        c = compiler.compile(ConstraintSpec("regex", pattern), max_tokens=64)
        return _params(max_tokens=64, constraint=c, ignore_eos=False, **kw)

    want = _run(base, [prompt], params())["r0"]
    got = _run(llm, [prompt], params())["r0"]
    assert _trace(got) == _trace(want)
    assert "".join(o.text for o in got) == "one, two, three, " * 3 + "four"
    assert llm.core.spec_stats.n_accepted > 0
    drafted = llm.core.spec_stats.n_draft_tokens
    for seed in range(4):
        outs = _run(llm, [prompt], params(temperature=1.0, seed=seed))["r0"]
        text = "".join(o.text for o in outs)
        assert re.fullmatch(pattern, text) and outs[-1].finish_reason == "stop", text
    assert llm.core.spec_stats.n_draft_tokens > drafted


def _chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X chi-square with df degrees of freedom: 1 - P(df/2, x/2), the
    regularised lower incomplete gamma function by its power series."""
    import math

    a, h = df / 2.0, x / 2.0
    if h <= 0:
        return 1.0
    term = total = 1.0 / a
    n = 0
    while term > 1e-16 * total:
        n += 1
        term *= h / (a + n)
        total += term
    return max(0.0, 1.0 - math.exp(-h + a * math.log(h) - math.lgamma(a)) * total)


class TreeDrafter:
    """Drafts the model's most likely token wherever the sequence is inside a known tree of
    prefixes (table: prefix -> token), so drafts are often but not always kept."""

    def __init__(self, table: dict[tuple[int, ...], int]) -> None:
        self.table = table

    def propose(self, tokens: list[int], k: int) -> list[int]:
        cur, out = tuple(tokens), []
        while len(out) < k and cur in self.table:
            out.append(self.table[cur])
            cur += (out[-1],)
        return out


# 3000 requests each; the rule on one row is the quick test below
@pytest.mark.parametrize("temperature,top_k",
                         [pytest.param(1.0, 3, marks=pytest.mark.slow),
                          pytest.param(0.7, 4, marks=pytest.mark.slow)])
def test_sampled_tokens_follow_the_models_distribution(ckpts: dict[str, Path],
                                                       temperature: float, top_k: int) -> None:
    """3000 seeded requests whose second and third tokens are verified against drafts (the
    most likely token, kept by the speculative sampling rule or replaced by a draw from the
    rest): the counts of every (t1, t2, t3) match the exact distribution computed from the
    model's logits (top_k of the softmax at the temperature). Chi-square over the cells
    (those expecting fewer than 5 merged), refused below p = 1e-3: a correct rule fails with
    probability 0.1% over seed sets, and this fixed seed set passes."""
    import numpy as np

    llm = _llm(ckpts["qwen2_moe"], max_num_seqs=64, max_num_batched_tokens=512)
    prompt = _ids(llm, PROMPTS[3])

    def dist(prefix: tuple[int, ...]) -> dict[int, float]:
        z = llm.logits(list(prefix))[-1].astype(np.float64) / temperature
        top = np.argsort(-z, kind="stable")[:top_k]
        w = np.exp(z[top] - z[top].max())
        return {int(t): float(v) for t, v in zip(top, w / w.sum(), strict=True)}

    exact: dict[tuple[int, ...], float] = {}
    table: dict[tuple[int, ...], int] = {}
    p0 = tuple(prompt)
    d1 = dist(p0)
    for t1, q1 in d1.items():
        d2 = dist(p0 + (t1,))
        table[p0 + (t1,)] = max(d2, key=d2.__getitem__)
        for t2, q2 in d2.items():
            d3 = dist(p0 + (t1, t2))
            table[p0 + (t1, t2)] = max(d3, key=d3.__getitem__)
            for t3, q3 in d3.items():
                exact[(t1, t2, t3)] = q1 * q2 * q3
    n = 3000
    _spec(llm, 2)
    p = _params(max_tokens=4, temperature=temperature, top_k=top_k, logprobs=None)
    from dataclasses import replace

    outs = _run(llm, [prompt] * n, [replace(p, seed=1000 + i) for i in range(n)],
                [TreeDrafter(table)] * n)
    counts = dict.fromkeys(exact, 0)
    for o in outs.values():
        counts[tuple(x.token_id for x in o[:3])] += 1
    st = llm.core.spec_stats
    assert 0 < st.n_accepted < st.n_draft_tokens  # drafts both kept and replaced
    assert st.n_drafts >= n  # every request verified drafts
    cells = sorted(exact, key=exact.__getitem__, reverse=True)
    obs, exp = [], []
    for cell in cells:
        if n * exact[cell] >= 5:
            obs.append(counts[cell])
            exp.append(n * exact[cell])
    obs.append(n - sum(obs))
    exp.append(n - sum(exp))
    if exp[-1] < 5:  # too little left over for a cell of its own
        obs[-2] += obs.pop()
        exp[-2] += exp.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    assert len(obs) >= 8
    assert _chi2_sf(3.841459, 1) == pytest.approx(0.05, abs=1e-6)  # the function itself
    assert _chi2_sf(18.307038, 10) == pytest.approx(0.05, abs=1e-6)
    assert _chi2_sf(stat, len(obs) - 1) > 1e-3, (stat, len(obs))
    assert sum(counts.values()) == n


def test_sample_with_draft_keeps_samplers_logprobs_and_greedy_argmax() -> None:
    """The rule on one row: greedy takes the argmax whatever the draft; a sampled row never
    returns a token outside its candidates, keeps a certain draft always, and reports the
    logprobs Sampler.sample reports for the same token."""
    import numpy as np

    from colibri.engine import SamplingParams
    from colibri.engine.sample.sampler import Sampler
    from colibri.engine.sample.verify import sample_with_draft

    rng = np.random.default_rng(3)
    logits = rng.normal(size=50).astype(np.float32)
    hist = [1, 2, 3]
    greedy = Sampler(SamplingParams(temperature=0.0, logprobs=2), 50)
    res = sample_with_draft(greedy, logits, hist, draft=int(np.argmin(logits)))
    ref = Sampler(SamplingParams(temperature=0.0, logprobs=2), 50).sample(logits, hist)
    assert (res.token_id, res.logprob, res.top_logprobs) == (ref.token_id, ref.logprob,
                                                             ref.top_logprobs)
    x = logits.astype(np.float64)
    logp = x - x.max() - np.log(np.sum(np.exp(x - x.max())))
    best = int(np.argmax(logits))
    top = set(np.argsort(-logits)[:4].tolist())
    seen = set()
    for seed in range(200):
        s = Sampler(SamplingParams(temperature=1.0, top_k=4, seed=seed, logprobs=1), 50)
        r = sample_with_draft(s, logits, hist, draft=int(np.argmin(logits)))  # weight 0
        assert r.token_id in top
        seen.add(r.token_id)
        assert r.logprob == pytest.approx(logp[r.token_id], rel=1e-12)
        assert r.top_logprobs == [(best, pytest.approx(logp[best], rel=1e-12))]
    assert seen == top
    certain = logits.copy()
    certain[7] = 100.0
    for seed in range(20):
        s = Sampler(SamplingParams(temperature=1.0, seed=seed), 50)
        assert sample_with_draft(s, certain, hist, draft=7).token_id == 7


def test_drafts_use_only_spare_budget_and_blocks_and_never_preempt(
        ckpts: dict[str, Path]) -> None:
    """A KV pool exactly as large as two requests need and a step budget of 8 tokens: with
    drafts of 4 always offered (all kept), no step carries more than 8 tokens, nothing is
    preempted, and both requests get the tokens of the engine without speculation."""
    from colibri.engine import LLM, EngineConfig

    probe = _llm(ckpts["olmoe"], prefix_cache=False)
    prompts = [_ids(probe, p) for p in PROMPTS[:2]]
    want = _run(probe, prompts, _params(max_tokens=30))
    need = sum(-(-(len(p) + 30) // 16) for p in prompts)
    mb = need * probe.model.kv_block_bytes() / 2**20
    llm = LLM(ckpts["olmoe"], threads=2, quant="f32", n_ctx=N_CTX,
              config=EngineConfig(kv_cache_mb=mb, max_num_seqs=2, max_num_batched_tokens=8,
                                  prefill_tokens_while_decoding=8, prefix_cache=False))
    assert llm.core.blocks.n_blocks == need
    _spec(llm, 4)
    sizes: list[int] = []
    llm.core.on_step = lambda n_seq, n_tok: sizes.append(n_tok)
    conts = [[o.token_id for o in want[f"r{i}"]] for i in range(2)]
    got = _run(llm, prompts, _params(max_tokens=30),
               [ScriptedDrafter(p, c) for p, c in zip(prompts, conts, strict=True)])
    assert all(_trace(got[r]) == _trace(want[r]) for r in want)
    assert max(sizes) == 8 and llm.core.scheduler.n_preemptions == 0
    st = llm.core.spec_stats
    assert st.n_accepted == st.n_draft_tokens > 0


@pytest.mark.parametrize("arch", quick_params(["qwen3_next", "qwen3_5_moe"], ["qwen3_next"]))
def test_hybrid_models_speculate_with_the_same_greedy_output(ckpts: dict[str, Path],
                                                              arch: str) -> None:
    """A model with linear-attention layers keeps a recurrent state per sequence that a
    verify step advances past rejected drafts: the state saved before the step comes back and
    the kept tokens run again; as many sequences draft per step as there are spare state
    slots to save them in. Greedy output with ngram drafts at k = 1, 2, 4 (some drafts
    kept, some rejected), with drafts all kept and with drafts all rejected, is token for
    token and logprob for logprob the output without speculation."""
    hf = ckpts[arch]
    base = _llm(hf, prefix_cache=False)
    prompts = [_ids(base, p) for p in PROMPTS]
    want = _run(base, prompts, _params())
    llm = _llm(hf, prefix_cache=False, speculative="ngram")
    assert llm.core.speculates
    # two spare state slots for eight sequences: of the four, at most two draft per step
    assert len(llm.core.snapshot_slots) == 2 < len(prompts)
    stats = _same_output_at_each_k(llm, prompts, want, arch)
    assert all(0 < st.n_accepted and st.n_draft_tokens > 0 for st in stats)
    assert sum(st.n_draft_tokens - st.n_accepted for st in stats) > 0, \
        "no draft was rejected: the test would not check the rollback"
    conts = [[o.token_id for o in want[f"r{i}"]] for i in range(len(prompts))]
    for wrong in (False, True):
        _spec(llm, 3)
        got = _run(llm, prompts, _params(),
                   [ScriptedDrafter(p, c, wrong) for p, c in zip(prompts, conts, strict=True)])
        assert all(_trace(got[r]) == _trace(want[r]) for r in want)
        st = llm.core.spec_stats
        assert st.n_accepted == (0 if wrong else st.n_draft_tokens) and st.n_draft_tokens > 0


@pytest.mark.parametrize("arch", quick_params(["mixtral", "qwen3_moe", "qwen3_next"], ["mixtral"]))
def test_auto_keeps_greedy_output_and_lets_the_cost_model_choose_k(
        ckpts: dict[str, Path], arch: str) -> None:
    """--speculative auto: greedy output equals the output without speculation, token for
    token, whatever k the cost model picks from the steps it measures (its choices vary with
    this machine's timings, the tokens must not). With a cost pinned to free drafts and a
    drafter that is always right, every decoding step drafts; with a cost where a step costs
    only its tokens (a draft can at best break even), none does, though every draft offered
    would have been kept."""
    from colibri.engine.core.engine import MEASURE_EVERY
    from colibri.engine.spec.cost import StepCost, StepCostMeter

    hf = ckpts[arch]
    base = _llm(hf, prefix_cache=False)
    prompts = [_ids(base, p) for p in PROMPTS]
    want = _run(base, prompts, _params())
    llm = _llm(hf, prefix_cache=False, speculative="auto")
    assert llm.core.speculates and llm.core.speculative.adaptive
    got = _run(llm, prompts, _params())
    assert all(_trace(got[r]) == _trace(want[r]) for r in want)
    # every step that verified drafts and one in MEASURE_EVERY of the others was measured
    n_steps, n_obs = llm.core.stats.n_steps, llm.core.planner.meter.n_obs
    assert llm.core.spec_stats.n_drafts == 0 or n_obs > n_steps // MEASURE_EVERY
    assert n_steps // MEASURE_EVERY <= n_obs <= n_steps

    conts = [[o.token_id for o in want[f"r{i}"]] for i in range(len(prompts))]
    for cost, drafts in ((StepCost(1e-3, 0.0, 0.0), True), (StepCost(0.0, 0.0, 1e-3), False)):
        _spec(llm, 4, "auto")
        # a new planner (nothing learned of acceptance yet) on a pinned cost
        llm.core.planner = type(llm.core.planner)(
            llm.core.planner.shape, StepCostMeter(cost, prior_weight=float("inf")))
        steps0 = llm.core.stats.n_steps
        got = _run(llm, prompts, _params(),
                   [ScriptedDrafter(p, c) for p, c in zip(prompts, conts, strict=True)])
        assert all(_trace(got[r]) == _trace(want[r]) for r in want)
        st = llm.core.spec_stats
        if drafts:
            assert st.n_draft_tokens > 0 and st.n_accepted == st.n_draft_tokens
            assert llm.core.stats.n_steps - steps0 < base.core.stats.n_steps
        else:
            assert st.n_drafts == 0


class _LongMatch(ScriptedDrafter):
    """A ScriptedDrafter whose every proposal reports the evidence of a 40-token match."""

    match_len = 40


def test_auto_drafts_at_once_on_a_long_match_and_stops_after_rejections(
        ckpts: dict[str, Path]) -> None:
    """auto, on a profile where a drafted token costs half a step: a request whose drafter
    reports a long match drafts at its first decoding step (before any verify step measured
    its acceptance), all of them kept; one whose long-match drafts are all rejected stops
    drafting after a couple of verify steps and only tries again now and then. Both give the
    greedy output of decoding without drafts."""
    from colibri.engine.spec.cost import StepCost, StepCostMeter

    base = _llm(ckpts["mixtral"], prefix_cache=False)
    prompt = _ids(base, PROMPTS[2])
    want = _run(base, [prompt], _params(max_tokens=40))["r0"]
    cont = [o.token_id for o in want]
    llm = _llm(ckpts["mixtral"], prefix_cache=False, speculative="auto")
    for wrong in (False, True):
        _spec(llm, 4, "auto")
        llm.core.planner = type(llm.core.planner)(llm.core.planner.shape, StepCostMeter(
            StepCost(1e-3, 0.0, 5e-4), prior_weight=float("inf")))
        core = llm.core
        core.add_request("x", prompt, _params(max_tokens=40))
        for req in core.requests["x"]:
            req.drafter = _LongMatch(prompt, cont, wrong=wrong)
        outs: list[Any] = []
        drafted: list[bool] = []  # per decoding step: did it verify drafts
        while core.has_work():
            n0 = core.spec_stats.n_drafts
            got = core.step()
            if outs:
                drafted.append(core.spec_stats.n_drafts > n0)
            outs += got
        assert _trace(outs) == _trace(want)
        st = core.spec_stats
        if not wrong:
            assert drafted[0] and len(drafted) <= 40 // 4  # four drafts and a token a step
            assert st.n_accepted == st.n_draft_tokens > 0
            continue
        assert drafted[0] and st.n_accepted == 0
        assert sum(drafted) <= 6 < len(drafted)
        runs = "".join("d" if d else "." for d in drafted).split("d")
        assert max(len(r) for r in runs) >= 8, drafted  # stopped drafting for a while
