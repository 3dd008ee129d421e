"""POST /tokenize, POST /detokenize and GET /tokenizer_info (vLLM's extensions), on the
tokenizer pool.

/tokenizer_info is what lm-evaluation-harness' remote tokenizer (`local-completions` with
`tokenizer_backend=remote`) reads: the special tokens as text and the chat template. It then
finds the EOS id by tokenizing the eos_token text, so a prompt that is exactly one special
token's text tokenizes to that token; special-token text inside any longer text stays plain
text, as it does everywhere else.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from colibri.app.chat_plan import chat_prompt_ids
from colibri.app.protocol import DetokenizeRequest, TokenizeRequest, check_token_ids
from colibri.app.schemas import DetokenizeResponse, TokenizeResponse, TokenizerInfo, error_responses
from colibri.app.state import get_state

router = APIRouter()


@router.post("/tokenize", response_model=None,
             responses={200: {"model": TokenizeResponse},
                        **error_responses(400, 404, 500, 503)})
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    """Token ids of a prompt, or of chat messages rendered with the model's template."""
    state = get_state(request)
    state.check_model(body.model)
    tok = state.tokenizer
    special = None if body.prompt is None else tok.special_token_id(body.prompt)
    if body.messages is not None:
        messages = [m.to_template() for m in body.messages]
        ids = await state.off_loop(chat_prompt_ids, tok, messages, body.add_generation_prompt,
                                   None, state.settings.model_template_timeout_s)
    elif special is not None:
        ids = [special]
    else:
        ids = await state.off_loop(tok.encode, body.prompt,
                                   add_special_tokens=body.add_special_tokens)
    return {"tokens": list(ids), "count": len(ids), "max_model_len": state.model.n_ctx}


@router.post("/detokenize", response_model=None,
             responses={200: {"model": DetokenizeResponse},
                        **error_responses(400, 404, 503)})
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    """Text of token ids (special tokens kept, so round trips are exact)."""
    state = get_state(request)
    state.check_model(body.model)
    tok = state.tokenizer
    check_token_ids(body.tokens, int(tok.vocab_size), "tokens")
    text = await state.off_loop(tok.decode, body.tokens, skip_special_tokens=False)
    return {"prompt": text}


@router.get("/tokenizer_info", response_model=None,
            responses={200: {"model": TokenizerInfo}, **error_responses(503)})
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """The tokenizer's special tokens, chat template and limits (vLLM's shape)."""
    state = get_state(request)
    tok = state.tokenizer
    n_ctx = state.model.n_ctx
    eos_ids = sorted(tok.eos_token_ids)
    eos_id = tok.eos_token_id if tok.eos_token_id is not None else (eos_ids or [None])[0]
    eos = tok.eos_token
    if eos is None and eos_id is not None:
        eos = tok.id_to_piece(eos_id)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "bos_token": tok.bos_token,
        "pad_token": tok.pad_token,
        "unk_token": tok.unk_token,
        "eos_token_id": eos_id,
        "eos_token_ids": eos_ids,
        "bos_token_id": tok.bos_token_id,
        "pad_token_id": tok.pad_token_id,
        "add_bos_token": tok.add_bos_token,
        "add_eos_token": tok.add_eos_token,
        "chat_template": tok.chat_template,
        "vocab_size": int(tok.vocab_size),
        "model_max_length": n_ctx,
        "max_model_len": n_ctx,
    }
