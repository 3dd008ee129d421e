"""Reading a model folder's tokenizer: tokenizer.json, tokenizer_config.json and, when present,
special_tokens_map.json, generation_config.json and the chat template files.

Guarantees: special tokens, BOS/EOS flags and chat templates are read from the files and in the
order transformers reads them; extra end-of-sequence ids come from generation_config.json.
Refuses: folders without tokenizer.json (only fast tokenizers are supported), a tokenizer.json
the tokenizers library cannot parse, chat templates over MAX_TEMPLATE_CHARS.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from colibri.engine.format.jsonfile import read_json_object
from colibri.engine.text.template_env import MAX_TEMPLATE_CHARS


@dataclass
class TokenizerFiles:
    """What a tokenizer folder says, ready for Tokenizer(hf, **settings())."""

    hf: HFTokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    add_bos_token: bool = False
    add_eos_token: bool = False
    chat_templates: dict[str, str] = field(default_factory=dict)
    extra_eos_token_ids: list[int] = field(default_factory=list)
    extra_bos_token_id: int | None = None

    def settings(self) -> dict[str, Any]:
        """Everything but the HF tokenizer, as Tokenizer's keyword arguments."""
        return {k: v for k, v in vars(self).items() if k != "hf"}


def _token_content(spec: Any) -> str | None:
    """A special-token entry in a config: a string, an AddedToken dict, or null."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, Mapping) and isinstance(spec.get("content"), str):
        return spec["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, "tokenizer file") if path.is_file() else {}


def _named_templates(raw: Any) -> dict[str, str]:
    """A `chat_template` value (one string, or a list of {name, template}) as a dict."""
    if isinstance(raw, str):
        return {"default": raw}
    out: dict[str, str] = {}
    if isinstance(raw, list):
        for entry in raw:
            if isinstance(entry, Mapping) and isinstance(entry.get("template"), str):
                out[str(entry.get("name", "default"))] = entry["template"]
    return out


def _chat_templates(d: Path, cfg: dict[str, Any]) -> dict[str, str]:
    """The folder's chat templates by name, from the first place that has any, in the order
    transformers reads them: chat_template.jinja plus additional_chat_templates/*.jinja,
    then chat_template.json, then tokenizer_config.json's `chat_template`."""
    files: dict[str, str] = {}
    if (d / "chat_template.jinja").is_file():
        files["default"] = (d / "chat_template.jinja").read_text(encoding="utf-8")
    extra = d / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            if f.is_file():
                files[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if files:
        return files
    if (d / "chat_template.json").is_file():
        found = _named_templates(_read_json(d / "chat_template.json").get("chat_template"))
        if found:
            return found
    return _named_templates(cfg.get("chat_template"))


def read_tokenizer_files(path: str | Path) -> TokenizerFiles:
    """Load tokenizer.json, tokenizer_config.json and optional special_tokens_map.json,
    generation_config.json, chat_template.jinja / chat_template.json from a directory."""
    d = Path(path)
    tj = d / "tokenizer.json"
    if not tj.is_file():
        raise FileNotFoundError(f"{tj} not found (only fast tokenizers are supported)")
    try:
        hf = HFTokenizer.from_file(str(tj))
    except Exception as e:  # the Rust parser raises a bare Exception ("EOF while parsing")
        raise ValueError(f"{tj}: not a valid tokenizer.json ({e})") from None
    cfg = _read_json(d / "tokenizer_config.json")
    smap = _read_json(d / "special_tokens_map.json")
    gen = _read_json(d / "generation_config.json")

    def special(name: str) -> str | None:
        tok = _token_content(cfg.get(name))
        return tok if tok is not None else _token_content(smap.get(name))

    templates = _chat_templates(d, cfg)
    for name, text in templates.items():
        if len(text) > MAX_TEMPLATE_CHARS:
            raise ValueError(f"chat template {name!r} is over {MAX_TEMPLATE_CHARS} characters")

    gen_eos = gen.get("eos_token_id")
    extra_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
    gen_bos = gen.get("bos_token_id")
    return TokenizerFiles(
        hf,
        bos_token=special("bos_token"),
        eos_token=special("eos_token"),
        pad_token=special("pad_token"),
        unk_token=special("unk_token"),
        add_bos_token=bool(cfg.get("add_bos_token", False)),
        add_eos_token=bool(cfg.get("add_eos_token", False)),
        chat_templates=templates,
        extra_eos_token_ids=[t for t in extra_eos if type(t) is int],
        extra_bos_token_id=gen_bos if type(gen_bos) is int else None,
    )
