"""POST /tokenize and POST /detokenize (vLLM's extension), on the tokenizer pool."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from app.protocol import DetokenizeRequest, TokenizeRequest, check_token_ids
from app.schemas import DetokenizeResponse, TokenizeResponse, error_responses
from app.state import get_state
from app.templates import chat_prompt_ids

router = APIRouter()


@router.post("/tokenize", response_model=None,
             responses={200: {"model": TokenizeResponse}, **error_responses(400, 404, 503)})
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    """Token ids of a prompt, or of chat messages rendered with the model's template."""
    state = get_state(request)
    state.check_model(body.model)
    llm = state.llm
    if body.messages is not None:
        messages = [m.to_template() for m in body.messages]
        ids = await state.off_loop(chat_prompt_ids, llm, messages, body.add_generation_prompt,
                                   None)
    else:
        ids = await state.off_loop(llm.tokenizer.encode, body.prompt,
                                   add_special_tokens=body.add_special_tokens)
    return {"tokens": list(ids), "count": len(ids), "max_model_len": int(llm.n_ctx)}


@router.post("/detokenize", response_model=None,
             responses={200: {"model": DetokenizeResponse},
                        **error_responses(400, 404, 503)})
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    """Text of token ids (special tokens kept, so round trips are exact)."""
    state = get_state(request)
    state.check_model(body.model)
    llm = state.llm
    check_token_ids(body.tokens, int(llm.tokenizer.vocab_size), "tokens")
    text = await state.off_loop(llm.tokenizer.decode, body.tokens, skip_special_tokens=False)
    return {"prompt": text}
