#!/usr/bin/env python
"""Measure a demo-model checkpoint: held-out bits per character, word share, loops, routing.

Every figure in the demo model's card comes from here, for the current model and for
earlier versions alike (run it on each folder with the same arguments):

    python scripts/demo_model_report.py bpc --model engine/demo_model --quant f32
    python scripts/demo_model_report.py words --model engine/demo_model
    python scripts/demo_model_report.py loops --model engine/demo_model
    python scripts/demo_model_report.py routing --model engine/demo_model

- bpc: bits per character of the held-out plays (the text `colibri eval --dataset
  demo-validation` scores), windows of 512 tokens, stride 256, with Colibri's forward pass
  at --quant (or transformers in float32 with --backend transformers). Unlike perplexity it
  does not depend on the tokenizer: total negative log2-likelihood of the scored tokens
  over the number of characters they spell.
- words: the share of words in sampled continuations (temperature 0.8; top-p 0.95 as
  `colibri generate` does by default, and top-p 1) that occur in a word list built from
  the training plays.
- loops: greedy continuations of 60 tokens (chat replies end at the end-of-turn token);
  a loop is a block of 1 to 30 tokens repeated at least 3 times back to back, covering at
  least 12 tokens. Also the share of 4-grams that repeat an earlier one (seq-rep-4), which
  catches near-loops with small variations.
- routing (transformers, float32, Qwen3-MoE / OLMoE / Mixtral folders): per layer over the
  held-out text in windows of 512 tokens, each expert's share of the token-to-expert
  assignments, the entropy of those shares, how many of a token's experts the previous
  token also used, and how many of layer L+1's experts layer L+1's router picks when it is
  applied to layer L's output (or to layer L's mid-layer residual) instead.

--json FILE writes the numbers; --markdown FILE writes them as model-card text.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from colibri.engine.tools.evaluate import demo_validation_text, perplexity  # noqa: E402

WINDOW, STRIDE = 512, 256
TEXT_PROMPTS = ["ROMEO. What light through yonder", "ROMEO.\n", "KING HENRY.\nNow, lords, ",
                "HAMLET.\n", "First Citizen.\n"]
CHAT_PROMPTS = ["What say you, my lord? Shall we to the court?",
                "I do love thee more than words can wield the matter."]
_WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")


def words_of(text: str) -> list[str]:
    """Lower-cased words: letters with inner apostrophes ("o'er", "ne'er")."""
    return [w.lower() for w in _WORD.findall(text)]


def training_word_list() -> set[str]:
    """Every word of the training plays (the held-out plays are not in it)."""
    from colibri.engine.demo import data as demo_data

    corpus = demo_data.load_corpus()
    return {w for text in corpus.train.values() for w in words_of(text)}


def longest_loop(ids: list[int], max_period: int = 30) -> tuple[int, int, int]:
    """(tokens covered, period, repeats) of the longest run of a block repeated back to back."""
    best = (0, 0, 0)
    n = len(ids)
    for p in range(1, max_period + 1):
        run = 0  # positions i with ids[i] == ids[i - p], consecutively
        for i in range(p, n):
            run = run + 1 if ids[i] == ids[i - p] else 0
            covered = run + p
            if covered // p >= 2 and covered > best[0]:
                best = (covered, p, covered // p)
    return best


def seq_rep(ids: list[int], n: int = 4) -> float:
    """Share of the n-grams of ids that repeat an n-gram seen before (0: none repeat)."""
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def is_loop(ids: list[int]) -> bool:
    covered, _, reps = longest_loop(ids)
    return reps >= 3 and covered >= 12


# -- bits per character ----------------------------------------------------------------

def bpc(model: str, quant: str, backend: str, threads: int | None) -> dict[str, Any]:
    text = demo_validation_text()
    if backend == "colibri":
        from colibri.engine import LLM

        llm = LLM(model, quant=quant, threads=threads, n_ctx=WINDOW)
        ids = llm.tokenizer.encode(text)
        decode = llm.tokenizer.decode
        fn = llm.logits
    else:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        tok = AutoTokenizer.from_pretrained(model)
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        ids = tok.encode(text, add_special_tokens=False)
        decode = tok.decode

        @torch.no_grad()
        def fn(chunk: list[int]) -> np.ndarray:
            return hf(input_ids=torch.tensor([chunk]), use_cache=False).logits[0].float().numpy()

        quant = "f32"
    ppl = perplexity(fn, ids, window=WINDOW, stride=STRIDE, progress=False)
    n_scored = len(ids) - 1
    # the first token is never scored: its characters do not count
    n_chars = len(text) - len(decode([ids[0]]))
    bits = math.log(ppl) * n_scored / math.log(2)
    return dict(model=str(model), backend=backend, quant=quant, tokens=len(ids),
                chars=n_chars, perplexity=ppl, bits_per_char=bits / n_chars,
                chars_per_token=n_chars / n_scored)


# -- samples: word share and loops -------------------------------------------------------

def words(model: str, threads: int | None, seeds: int, max_tokens: int) -> dict[str, Any]:
    from colibri.engine import LLM

    vocab = training_word_list()
    llm = LLM(model, threads=threads)
    out: dict[str, Any] = dict(model=str(model), word_list=len(vocab), seeds=seeds,
                               max_tokens=max_tokens, prompts=TEXT_PROMPTS, settings=[])
    for top_p in (0.95, 1.0):
        total = known = 0
        unknown: dict[str, int] = {}
        first = ""
        for prompt in TEXT_PROMPTS:
            for seed in range(seeds):
                text = llm.generate(prompt, max_tokens=max_tokens, temperature=0.8,
                                    top_p=top_p, seed=seed)
                if not first:
                    first = prompt + text
                ws = words_of(text)
                total += len(ws)
                for w in ws:
                    if w in vocab:
                        known += 1
                    else:
                        unknown[w] = unknown.get(w, 0) + 1
        top = sorted(unknown.items(), key=lambda kv: (-kv[1], kv[0]))[:12]
        out["settings"].append(dict(temperature=0.8, top_p=top_p, words=total, known=known,
                                    share=known / max(total, 1), unknown_top=top,
                                    example=first))
    return out


def loops(model: str, threads: int | None, n_tokens: int) -> dict[str, Any]:
    from colibri.engine import LLM

    llm = LLM(model, threads=threads)
    rows = []
    for kind, prompt in [("text", p) for p in TEXT_PROMPTS] + [("chat", p) for p in CHAT_PROMPTS]:
        if kind == "chat":
            ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        else:
            ids = llm.tokenizer.encode(prompt, add_special_tokens=True)
        # plain text: the full 60 tokens even past an end-of-text; chat: the reply
        gen = llm.generate_ids(ids, max_tokens=n_tokens, ignore_eos=kind == "text")
        covered, period, reps = longest_loop(gen)
        rows.append(dict(kind=kind, prompt=prompt, tokens=len(gen), loop=is_loop(gen),
                         longest_repeat=dict(tokens=covered, period=period, repeats=reps),
                         seq_rep_4=seq_rep(gen),
                         distinct_tokens=len(set(gen)), text=llm.tokenizer.decode(gen)))
    text_rows = [r for r in rows if r["kind"] == "text"]
    return dict(model=str(model), tokens=n_tokens, rows=rows,
                loops=sum(r["loop"] for r in rows),
                mean_text_seq_rep_4=sum(r["seq_rep_4"] for r in text_rows) / len(text_rows))


# -- routing -----------------------------------------------------------------------------

def _moe_parts(layer: Any) -> tuple[Any, Any]:
    """(router module, post-attention norm) of a transformers decoder layer."""
    moe = getattr(layer, "mlp", None) or layer.block_sparse_moe
    return moe.gate, layer.post_attention_layernorm


def _top_k(logits: Any, k: int) -> np.ndarray:
    import torch

    return torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1).indices.numpy()


def _overlap(a: np.ndarray, b: np.ndarray, n_expert: int) -> np.ndarray:
    """Per row: |a ∩ b| / k for expert-index sets a, b [T, k]."""
    ma = np.zeros((a.shape[0], n_expert), dtype=bool)
    mb = np.zeros_like(ma)
    np.put_along_axis(ma, a, True, axis=1)
    np.put_along_axis(mb, b, True, axis=1)
    return (ma & mb).sum(axis=1) / a.shape[1]


def routing(model: str, threads: int | None) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    cfg = hf.config
    E = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    k = cfg.num_experts_per_tok
    layers = hf.model.layers
    n_layer = len(layers)
    ids = tok.encode(demo_validation_text(), add_special_tokens=False)
    # captured per window: the router's input is norm(mid); mid is the residual after attention
    mid: dict[int, Any] = {}
    def keep(i: int) -> Any:
        def hook(_m: Any, inp: tuple[Any, ...], _out: Any) -> None:
            mid.setdefault(i, inp[0].detach())  # returning None leaves the output alone
        return hook

    handles = [_moe_parts(layer)[1].register_forward_hook(keep(i))
               for i, layer in enumerate(layers)]
    counts = np.zeros((n_layer, E), dtype=np.int64)
    rep = [[] for _ in range(n_layer)]
    same = [[] for _ in range(n_layer)]
    pred_out = [[] for _ in range(n_layer - 1)]
    pred_mid = [[] for _ in range(n_layer - 1)]
    n_tok = 0
    with torch.no_grad():
        for b in range(0, len(ids) - 1, WINDOW):
            x = torch.tensor([ids[b : b + WINDOW]])
            mid.clear()  # the hooks keep the first call per layer: the model's own
            res = hf(input_ids=x, use_cache=False, output_hidden_states=True)
            hs = res.hidden_states  # hs[i]: the input of layer i
            n_tok += x.shape[1]
            chosen = []
            for i, layer in enumerate(layers):
                gate, norm = _moe_parts(layer)
                h = norm(mid[i][0])
                top = _top_k(torch.nn.functional.linear(h, gate.weight), k)
                chosen.append(top)
                counts[i] += np.bincount(top.reshape(-1), minlength=E)
                if top.shape[0] > 1:
                    ov = _overlap(top[1:], top[:-1], E)
                    rep[i].append(ov)
                    same[i].append(ov == 1.0)
            for i in range(n_layer - 1):
                gate, norm = _moe_parts(layers[i + 1])
                for src, acc in ((hs[i + 1][0], pred_out[i]), (mid[i][0], pred_mid[i])):
                    guess = _top_k(torch.nn.functional.linear(norm(src), gate.weight), k)
                    acc.append(_overlap(guess, chosen[i + 1], E))
    for h in handles:
        h.remove()
    out_layers = []
    for i in range(n_layer):
        share = counts[i] / counts[i].sum()
        nz = share[share > 0]
        ent = float(-(nz * np.log2(nz)).sum())
        row = dict(layer=i, share=share.round(5).tolist(), entropy_bits=ent,
                   entropy_max_bits=math.log2(E), share_min=float(share.min()),
                   share_max=float(share.max()), unused=int((counts[i] == 0).sum()),
                   repeat_prev=float(np.concatenate(rep[i]).mean()),
                   same_set_as_prev=float(np.concatenate(same[i]).mean()))
        if i > 0:
            row["predicted_from_prev_output"] = float(np.concatenate(pred_out[i - 1]).mean())
            row["predicted_from_prev_mid"] = float(np.concatenate(pred_mid[i - 1]).mean())
        out_layers.append(row)
    return dict(model=str(model), experts=E, top_k=k, tokens=n_tok, window=WINDOW,
                chance_overlap=k / E, layers=out_layers)


# -- model-card text ---------------------------------------------------------------------

def markdown(kind: str, r: dict[str, Any]) -> str:
    if kind == "bpc":
        return (f"| {r['model']} | {r['backend']} {r['quant']} | {r['tokens']:,} | "
                f"{r['perplexity']:.3f} | {r['bits_per_char']:.4f} |")
    if kind == "words":
        lines = []
        for s in r["settings"]:
            lines.append(f"- temperature {s['temperature']}, top-p {s['top_p']}: "
                         f"{s['known']:,} of {s['words']:,} words in the list = "
                         f"**{100 * s['share']:.1f}%**; most frequent others: "
                         + ", ".join(f"{w} ({c})" for w, c in s["unknown_top"]))
        return "\n".join(lines)
    if kind == "loops":
        lines = ["| prompt | loop | longest repeat (tokens, period x repeats) | seq-rep-4 | "
                 "distinct tokens |", "|---|---|---|---|---|"]
        for row in r["rows"]:
            lr = row["longest_repeat"]
            lines.append(f"| {row['kind']}: `{row['prompt']!r}` | {'yes' if row['loop'] else 'no'}"
                         f" | {lr['tokens']} ({lr['period']} x {lr['repeats']}) | "
                         f"{row['seq_rep_4']:.2f} | {row['distinct_tokens']} of {row['tokens']} |")
        lines.append(f"\nMean seq-rep-4 of the text prompts: {r['mean_text_seq_rep_4']:.3f}.")
        return "\n".join(lines)
    # routing
    lines = ["| layer | entropy of shares (bits, max "
             f"{math.log2(r['experts']):.0f}) | smallest / largest share | experts never used | "
             "experts shared with previous token | same set as previous token | "
             "layer's experts predicted from previous layer's output / mid-layer residual |",
             "|---|---|---|---|---|---|---|"]
    for row in r["layers"]:
        pred = (f"{100 * row['predicted_from_prev_output']:.1f}% / "
                f"{100 * row['predicted_from_prev_mid']:.1f}%") if "predicted_from_prev_output" \
            in row else "-"
        lines.append(f"| {row['layer']} | {row['entropy_bits']:.3f} | "
                     f"{100 * row['share_min']:.2f}% / {100 * row['share_max']:.2f}% | "
                     f"{row['unused']} | {100 * row['repeat_prev']:.1f}% | "
                     f"{100 * row['same_set_as_prev']:.1f}% | {pred} |")
    lines += ["", f"Chance level for the overlaps: top-{r['top_k']} of {r['experts']} = "
              f"{100 * r['chance_overlap']:.1f}%. Each expert's share of the assignments, in "
              "percent, expert 0 first:", "", "```"]
    for row in r["layers"]:
        pct = [f"{100 * s:.1f}" for s in row["share"]]
        lines.append(f"layer {row['layer']}:")
        lines += ["  " + " ".join(pct[j : j + 16]) for j in range(0, len(pct), 16)]
    lines.append("```")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("bpc", "words", "loops", "routing"))
    p.add_argument("--model", default=str(ROOT / "engine" / "demo_model"))
    p.add_argument("--quant", choices=("f32", "f16", "q8", "q4"), default="q8",
                   help="Colibri precision for bpc (words and loops use q8, the default)")
    p.add_argument("--backend", choices=("colibri", "transformers"), default="colibri")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seeds", type=int, default=8, help="samples per prompt (words)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per sample (words)")
    p.add_argument("--loop-tokens", type=int, default=60)
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    a = p.parse_args()
    if a.what == "bpc":
        r = bpc(a.model, a.quant, a.backend, a.threads)
    elif a.what == "words":
        r = words(a.model, a.threads, a.seeds, a.max_tokens)
    elif a.what == "loops":
        r = loops(a.model, a.threads, a.loop_tokens)
    else:
        r = routing(a.model, a.threads)
    md = markdown(a.what, r)
    print(json.dumps(r, indent=1) if a.what != "routing" else md)
    print(md if a.what != "routing" else "")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1) + "\n")
    if a.markdown:
        Path(a.markdown).write_text(md + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
