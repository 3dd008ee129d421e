"""gpt-oss's text side: an o200k-style tokenizer (byte-level BPE behind o200k's split regex,
with the harmony special tokens) and a harmony-shaped chat template (strftime_now, namespace,
macros, tojson, raise_exception, `<|start|>role<|message|>...<|end|>` turns) survive `colibri
convert` of a gpt-oss checkpoint and give, token for token, what transformers gives. The
tokenizer is trained here on a few lines; no file is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from colibri.engine.format.convert import convert
from colibri.engine.text.tokenizer import Tokenizer
from tests.tiny_models import VOCAB_SIZE, make_checkpoint

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# tiktoken's o200k_base split pattern, as gpt-oss's tokenizer.json carries it
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
HARMONY_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>",
                    "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
# harmony's shape, written for this test: a system turn with the date, a developer turn with
# the instructions and tools, then the turns; the reply starts at "<|start|>assistant"
HARMONY_TEMPLATE = """\
{%- macro render_tool(tool) -%}
{{- "// " + tool.function.description + "\\ntype " + tool.function.name + " = (_: " -}}
{{- tool.function.parameters | tojson -}}{{- ") => any;\\n" -}}
{%- endmacro -%}
{{- "<|start|>system<|message|>You are a helpful assistant.\\nCurrent date: " -}}
{{- strftime_now("%Y-%m-%d") + "\\n\\nReasoning: " + (reasoning_effort or "medium") -}}
{{- "\\n\\n# Valid channels: analysis, commentary, final.<|end|>" -}}
{%- set first = namespace(dev="", rest=messages) -%}
{%- if messages[0].role in ("system", "developer") -%}
{%- set first.dev = messages[0].content -%}{%- set first.rest = messages[1:] -%}
{%- endif -%}
{%- if first.dev or tools -%}
{{- "<|start|>developer<|message|># Instructions\\n\\n" + first.dev -}}
{%- if tools -%}{{- "\\n\\n# Tools\\n\\nnamespace functions {\\n" -}}
{%- for t in tools -%}{{- render_tool(t) -}}{%- endfor -%}{{- "}" -}}{%- endif -%}
{{- "<|end|>" -}}
{%- endif -%}
{%- for m in first.rest -%}
{%- if m.role == "user" -%}{{- "<|start|>user<|message|>" + m.content + "<|end|>" -}}
{%- elif m.role == "assistant" -%}
{{- "<|start|>assistant<|channel|>final<|message|>" + m.content + "<|end|>" -}}
{%- else -%}{{- raise_exception("unexpected role " + m.role) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"""
TEXT = ["Hello! How are you? I'm fine, thanks; it's 2026-12-06 and we've 12345 tokens.",
        "The quick brown fox jumps over the lazy dog.\nÉtés à Zürich: ÄÖÜ äöü, 北京 東京.",
        "def f(x):\n    return x ** 2  # squares\r\n\tTabs and  double  spaces."] * 8
MESSAGES = [{"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Is <|end|> a token? Say 'yes' or 'no'."},
            {"role": "assistant", "content": "No."},
            {"role": "user", "content": "And numbers like 1234567?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def _o200k_tokenizer(n_vocab: int) -> tokenizers.Tokenizer:
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_vocab - len(HARMONY_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TEXT, trainer)
    tok.add_special_tokens(HARMONY_SPECIALS)
    return tok


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf = make_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss_text") / "hf", seed=3)
    tok = _o200k_tokenizer(VOCAB_SIZE)
    assert tok.get_vocab_size() <= VOCAB_SIZE
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
        "model_max_length": 131072}))
    (hf / "special_tokens_map.json").unlink()
    (hf / "chat_template.jinja").write_text(HARMONY_TEMPLATE)
    return hf


def test_o200k_tokenizer_and_harmony_template_survive_conversion(gpt_oss_dir: Path,
                                                                 tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    out = convert(gpt_oss_dir, tmp_path / "out", quant="q8", progress=False)
    ours = Tokenizer.from_dir(out)
    hf = AutoTokenizer.from_pretrained(str(gpt_oss_dir))
    assert ours.chat_template == HARMONY_TEMPLATE
    for text in TEXT[:3]:
        assert ours.encode(text, add_special_tokens=False) == hf(
            text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text
    for tools in (None, TOOLS):
        want_text = hf.apply_chat_template(MESSAGES, tools=tools, tokenize=False,
                                           add_generation_prompt=True)
        assert ours.render_chat(MESSAGES, tools=tools) == want_text
        ids = ours.apply_chat_template(MESSAGES, tools=tools)
        # template pieces are special tokens; the user's "<|end|>" stays plain text
        assert ids.count(ours.special_token_id("<|start|>")) == want_text.count("<|start|>")
        assert ids.count(ours.special_token_id("<|end|>")) == want_text.count("<|end|>") - 1
        tail = hf.encode("assistant", add_special_tokens=False)
        assert ids[-len(tail) - 1:] == [ours.special_token_id("<|start|>"), *tail]
        assert ours.decode(ids, skip_special_tokens=False) == want_text
    assert ours.eos_token == "<|return|>"
    assert ours.special_token_id("<|end|>") in ours.special_token_ids
