"""Compare grammar engines for constrained decoding: llguidance, xgrammar, outlines-core.

For each tokenizer (the bundled demo model's 4096 tokens, and a 32k byte-level BPE trained
here on local text) and each JSON Schema of a small set, every engine compiles the schema,
then follows a valid document token by token; the figures are the time to compute the next
token mask (plus advancing the state) per token, at batch 1 and for 8 sequences in lockstep
(llguidance and xgrammar with their batch APIs, outlines-core in a loop: it has none).
A second table shows, per JSON Schema feature, whether each engine enforces it (rejects a
document that violates it), refuses to compile it, or compiles it and ignores it.

    pip install llguidance outlines-core && pip install --no-deps xgrammar apache-tvm-ffi
    python scripts/compare_grammar_engines.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SEP = (", ", ": ")

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "flat object": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["name", "age", "ok"], "additionalProperties": False},
        {"name": "Juliet Capulet of Verona", "age": 13, "ok": True}),
    "nested + arrays + enums": ({"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{4}$"},
        "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
            "kind": {"enum": ["book", "pen", "lamp"]}},
            "required": ["sku", "qty", "kind"], "additionalProperties": False}},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        "required": ["id", "items", "note"], "additionalProperties": False},
        {"id": "abc-1234", "items": [{"sku": "x-1", "qty": 3, "kind": "pen"},
                                     {"sku": "y-22", "qty": 12, "kind": "lamp"},
                                     {"sku": "zed", "qty": 1, "kind": "book"}],
         "note": "deliver to the back door, please"}),
    "numbers with ranges": ({"type": "object", "properties": {
        "lat": {"type": "number", "minimum": -90, "maximum": 90},
        "lon": {"type": "number", "minimum": -180, "maximum": 180},
        "readings": {"type": "array", "items": {"type": "number"}, "maxItems": 8}},
        "required": ["lat", "lon", "readings"], "additionalProperties": False},
        {"lat": 51.5072, "lon": -0.1276, "readings": [1.5, 2.25, -3.0, 1000.125, 7.0]}),
}

# each feature's schema, and a document that violates it: an engine that accepts the
# document compiles the keyword but does not enforce it
FEATURES: dict[str, tuple[dict[str, Any], Any]] = {
    "enum / const": ({"type": "object", "properties": {"a": {"enum": [1, "x"]},
                                                       "b": {"const": "k"}}}, {"a": 2}),
    "anyOf": ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, True),
    "oneOf": ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, True),
    "allOf": ({"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
                         {"required": ["a"]}]}, {}),
    "$ref + $defs": ({"$defs": {"p": {"type": "string"}}, "type": "object",
                      "properties": {"a": {"$ref": "#/$defs/p"}}}, {"a": 1}),
    "recursive $ref": ({"$defs": {"n": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"},
        {"kids": [1]}),
    "string pattern": ({"type": "string", "pattern": "^[A-Z][a-z]+$"}, "abc"),
    "minLength / maxLength": ({"type": "string", "minLength": 2, "maxLength": 5}, "a"),
    "format date-time": ({"type": "string", "format": "date-time"}, "yesterday"),
    "format email": ({"type": "string", "format": "email"}, "nobody"),
    "format uuid": ({"type": "string", "format": "uuid"}, "1234"),
    "minimum / maximum": ({"type": "integer", "minimum": 3, "maximum": 9}, 12),
    "exclusiveMinimum (number)": ({"type": "number", "exclusiveMinimum": 0}, 0),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, 7),
    "minItems / maxItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 1,
                             "maxItems": 3}, []),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
                    [1, 1]),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "string"},
                                                      {"type": "integer"}]}, [1, 2]),
    "additionalProperties schema": ({"type": "object",
                                     "additionalProperties": {"type": "integer"}}, {"a": "x"}),
    "patternProperties": ({"type": "object",
                           "patternProperties": {"^x_": {"type": "string"}}}, {"x_a": 1}),
    "minProperties": ({"type": "object", "minProperties": 1}, {}),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
                      {"A1": 1}),
    "dependentRequired": ({"type": "object", "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    "if / then / else": ({"type": "object", "if": {"required": ["a"]},
                          "then": {"required": ["b"]}}, {"a": 1}),
    "not": ({"not": {"type": "string"}}, "s"),
}


def trained_32k(cache: Path) -> str:
    """A 32k byte-level BPE trained on the Python standard library's sources (local text)."""
    if cache.is_file():
        return cache.read_text()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(str(p) for p in Path(json.__file__).resolve().parent.parent.glob("*.py"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    cache.parent.mkdir(parents=True, exist_ok=True)
    text = tok.to_str()
    cache.write_text(text)
    return text


class Vocab:
    """A tokenizer.json, with each token's bytes (decoded by llguidance, which is exact)."""

    def __init__(self, name: str, tokenizer_json: str) -> None:
        import llguidance
        from tokenizers import Tokenizer

        self.name = name
        self.json = tokenizer_json
        self.hf = Tokenizer.from_str(tokenizer_json)
        self.size = self.hf.get_vocab_size(with_added_tokens=True)
        self.eos = 0
        self.llg = llguidance.LLTokenizer(tokenizer_json, n_vocab=self.size, eos_token=[0])
        self.bytes = [self.llg.decode_bytes([i]) for i in range(self.size)]

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids


class LLG:
    name = "llguidance"

    def __init__(self, vocab: Vocab) -> None:
        import llguidance
        import llguidance.numpy as lnp

        self.llg, self.lnp, self.vocab = llguidance, lnp, vocab
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict[str, Any]) -> Any:
        opts = {"whitespace_flexible": False, "item_separator": SEP[0], "key_separator": SEP[1]}
        g = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides=opts)
        err, msgs = self.llg.LLMatcher.validate_grammar_with_warnings(g, self.vocab.llg)
        if err:
            raise ValueError("; ".join(msgs))
        return g

    def matchers(self, grammar: Any, n: int) -> list[Any]:
        return [self.llg.LLMatcher(self.vocab.llg, grammar, log_level=0) for _ in range(n)]

    def step(self, ms: list[Any], mask: np.ndarray, toks: list[int]) -> None:
        if len(ms) == 1:
            self.lnp.fill_next_token_bitmask(ms[0], mask, 0)
        else:
            self.lnp.fill_next_token_bitmask_par(self.executor,
                                                 [(m, i) for i, m in enumerate(ms)], mask)
        for m, t in zip(ms, toks, strict=True):
            assert m.consume_token(t), m.get_error()

    def alloc(self, n: int) -> np.ndarray:
        return self.lnp.allocate_token_bitmask(n, self.vocab.size)

    def accepts(self, grammar: Any, toks: list[int]) -> bool:
        m = self.matchers(grammar, 1)[0]
        return bool(m.consume_tokens(toks) and m.is_accepting())


class XGR:
    name = "xgrammar"

    def __init__(self, vocab: Vocab) -> None:
        import xgrammar

        self.xgr, self.vocab = xgrammar, vocab
        info = xgrammar.TokenizerInfo(vocab.bytes, xgrammar.VocabType.RAW,
                                      vocab_size=vocab.size, stop_token_ids=[vocab.eos])
        self.compiler = xgrammar.GrammarCompiler(info)
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict[str, Any]) -> Any:
        # strict_mode=False: undeclared properties allowed, as JSON Schema says (and as the
        # other engines do), so that the feature checks test only the keyword itself
        return self.compiler.compile_json_schema(schema, any_whitespace=False, separators=SEP,
                                                 strict_mode=False)

    def matchers(self, grammar: Any, n: int) -> list[Any]:
        return [self.xgr.GrammarMatcher(grammar) for _ in range(n)]

    def step(self, ms: list[Any], mask: Any, toks: list[int]) -> None:
        if len(ms) == 1:
            ms[0].fill_next_token_bitmask(mask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(ms, mask)
        for m, t in zip(ms, toks, strict=True):
            assert m.accept_token(t)

    def alloc(self, n: int) -> Any:
        return self.xgr.allocate_token_bitmask(n, self.vocab.size)

    def accepts(self, grammar: Any, toks: list[int]) -> bool:
        m = self.matchers(grammar, 1)[0]
        return all(m.accept_token(t) for t in toks) and m.accept_token(self.vocab.eos)


class OC:
    name = "outlines-core"

    def __init__(self, vocab: Vocab) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.oc, self.vocab, self.build = outlines_core, vocab, build_regex_from_schema
        table: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab.bytes):
            if i != vocab.eos and b:
                table.setdefault(b, []).append(i)
        self.ocv = outlines_core.Vocabulary(vocab.eos, table)

    def compile(self, schema: dict[str, Any]) -> Any:
        regex = self.build(json.dumps(schema), whitespace_pattern=" ?")
        return self.oc.Index(regex, self.ocv)

    def matchers(self, grammar: Any, n: int) -> list[Any]:
        return [self.oc.Guide(grammar) for _ in range(n)]

    def step(self, ms: list[Any], mask: np.ndarray, toks: list[int]) -> None:
        row = mask.shape[1]
        for i, (g, t) in enumerate(zip(ms, toks, strict=True)):
            g.write_mask_into(mask[i].ctypes.data, row, 4)  # its numpy kernel needs numba
            g.advance(t)

    def alloc(self, n: int) -> np.ndarray:
        return np.zeros((n, (self.vocab.size + 31) // 32), dtype=np.int32)

    def accepts(self, grammar: Any, toks: list[int]) -> bool:
        g = self.matchers(grammar, 1)[0]
        try:
            for t in toks:
                g.advance(t)
        except ValueError:
            return False
        return self.vocab.eos in g.get_tokens()


def time_engine(engine: Any, vocab: Vocab, schema: dict[str, Any], doc: Any,
                batch: int) -> dict[str, float]:
    text = json.dumps(doc, separators=SEP)
    toks = vocab.encode(text)
    t0 = time.perf_counter()
    grammar = engine.compile(schema)
    compile_ms = (time.perf_counter() - t0) * 1e3
    per_step = []
    for _ in range(3):
        ms = engine.matchers(grammar, batch)
        mask = engine.alloc(batch)
        for t in toks:
            s = time.perf_counter()
            engine.step(ms, mask, [t] * batch)
            per_step.append(time.perf_counter() - s)
    return {"compile_ms": compile_ms, "tokens": len(toks),
            "step_us": statistics.median(per_step) * 1e6,
            "step_us_mean": statistics.fmean(per_step) * 1e6}


def features(engine: Any, vocab: Vocab) -> dict[str, str]:
    """Per feature: "enforced", "IGNORED" (compiles, yet accepts the violating document) or
    "refused" (a compile error, which is what a server can turn into a 400)."""
    out = {}
    for name, (schema, bad) in FEATURES.items():
        try:
            grammar = engine.compile(schema)
        except Exception as exc:  # noqa: BLE001 - each engine raises its own types
            out[name] = "refused: " + str(exc).splitlines()[0][:70]
            continue
        toks = vocab.encode(json.dumps(bad, separators=SEP))
        try:
            ok = engine.accepts(grammar, toks)
        except Exception:  # noqa: BLE001 - a rejection by exception
            ok = False
        out[name] = "IGNORED" if ok else "enforced"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--cache", type=Path,
                    default=Path.home() / ".cache" / "colibri" / "bpe32k_stdlib.json")
    args = ap.parse_args(argv)
    vocabs = [Vocab("demo (4096)", (ROOT / "engine/demo_model/tokenizer.json").read_text()),
              Vocab("bpe 32k", trained_32k(args.cache))]
    results: dict[str, Any] = {"timing": [], "features": {}}
    print(f"{'tokenizer':12} {'engine':14} {'schema':24} {'tok':>4} {'compile ms':>10} "
          f"{'b1 us/tok':>10} {'b8 us/step':>10} {'b8 us/row':>10}")
    for vocab in vocabs:
        for cls in (LLG, XGR, OC):
            engine = cls(vocab)
            for sname, (schema, doc) in SCHEMAS.items():
                try:
                    b1 = time_engine(engine, vocab, schema, doc, 1)
                    b8 = time_engine(engine, vocab, schema, doc, 8)
                except Exception as exc:  # noqa: BLE001
                    print(f"{vocab.name:12} {engine.name:14} {sname:24} failed: {exc}")
                    continue
                row = {"tokenizer": vocab.name, "engine": engine.name, "schema": sname,
                       "tokens": b1["tokens"], "compile_ms": b1["compile_ms"],
                       "b1_us": b1["step_us"], "b8_us": b8["step_us"]}
                results["timing"].append(row)
                print(f"{vocab.name:12} {engine.name:14} {sname:24} {b1['tokens']:4d} "
                      f"{b1['compile_ms']:10.1f} {b1['step_us']:10.1f} {b8['step_us']:10.1f} "
                      f"{b8['step_us'] / 8:10.1f}")
            if vocab is vocabs[0]:
                results["features"][engine.name] = features(engine, vocab)
    print("\nJSON Schema features (enforced / refused / IGNORED: compiles, accepts a "
          "violation):")
    names = list(results["features"])
    print(f"{'feature':30} " + " ".join(f"{n:>14}" for n in names))
    for feat in FEATURES:
        cells = [results["features"][n][feat] for n in names]
        print(f"{feat:30} " + " ".join(f"{c.split(':')[0]:>14}" for c in cells))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
