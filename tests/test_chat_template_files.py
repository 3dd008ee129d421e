"""Chat templates wherever transformers saves them survive `colibri convert`.

Checkpoints saved by the installed transformers keep the template in chat_template.jinja
(named extras in additional_chat_templates/), older ones in tokenizer_config.json, processor
repos in chat_template.json. The converted folder must render every one of them exactly as
transformers does, with transformers' order of precedence.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from colibri.engine.format.convert import convert
from colibri.engine.text.tokenizer import Tokenizer
from tests.tiny_models import make_checkpoint

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there!"}]
PLAIN = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}[assistant] {% endif %}")
TOOLS = "{% for m in messages %}<tool-use>{{ m.content }}<|im_end|>{% endfor %}"


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("mixtral", tmp_path_factory.mktemp("tpl") / "hf", seed=5)


def _resave(src: Path, dst: Path, template: str | dict[str, str]) -> Path:
    """src copied to dst, its tokenizer saved again by transformers with `template`."""
    from transformers import AutoTokenizer

    shutil.copytree(src, dst)
    hf = AutoTokenizer.from_pretrained(dst)
    hf.chat_template = template
    hf.save_pretrained(dst)
    return dst


def _hf_ids(folder: Path, messages: list[dict[str, str]], name: str | None = None) -> list[int]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                  chat_template=name)
    return list(hf(text, add_special_tokens=False)["input_ids"])


def test_template_saved_as_jinja_survives_conversion(hf_base: Path, tmp_path: Path) -> None:
    hf = _resave(hf_base, tmp_path / "hf", PLAIN)
    assert (hf / "chat_template.jinja").read_text() == PLAIN  # what transformers writes now
    assert "chat_template" not in json.loads((hf / "tokenizer_config.json").read_text())
    out = convert(hf, tmp_path / "out", progress=False)
    tok = Tokenizer.from_dir(out)
    assert tok.chat_template == PLAIN
    assert tok.apply_chat_template(MESSAGES) == _hf_ids(hf, MESSAGES)


def test_additional_named_templates(hf_base: Path, tmp_path: Path) -> None:
    hf = _resave(hf_base, tmp_path / "hf", {"default": PLAIN, "tool_use": TOOLS})
    assert (hf / "additional_chat_templates" / "tool_use.jinja").is_file()
    out = convert(hf, tmp_path / "out", progress=False)
    tok = Tokenizer.from_dir(out)
    assert tok.chat_templates == {"default": PLAIN, "tool_use": TOOLS}
    assert tok.apply_chat_template(MESSAGES) == _hf_ids(hf, MESSAGES)


def test_precedence_jinja_then_json_then_tokenizer_config(hf_base: Path,
                                                          tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    hf = tmp_path / "hf"
    shutil.copytree(hf_base, hf)  # tokenizer_config.json carries the ChatML template
    config_template = json.loads((hf / "tokenizer_config.json").read_text())["chat_template"]
    (hf / "chat_template.json").write_text(json.dumps({"chat_template": TOOLS}))
    assert Tokenizer.from_dir(convert(hf, tmp_path / "a", progress=False)).chat_template \
        == TOOLS
    (hf / "chat_template.jinja").write_text(PLAIN)
    out = convert(hf, tmp_path / "b", progress=False)
    assert Tokenizer.from_dir(out).chat_template == PLAIN
    assert AutoTokenizer.from_pretrained(hf).chat_template == PLAIN  # the same winner
    assert config_template not in (PLAIN, TOOLS)
