"""/tokenize and /detokenize, with vLLM's request and response bodies.

Messages are rendered and tokenized by the same code as a chat request's prompt
(Gateway.chat_prompt_ids), so /tokenize tells exactly what a chat completion will be sent.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from meshserve.shared.openai_protocol import ChatMessage, OpenAIError, parse_request, validate_body

from .handler import Gateway


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(default=True, description="add BOS/EOS as the model's tokenizer config asks")
    return_token_strs: bool = Field(default=False, description="also return each token's vocabulary string")


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(default=False, description="the prompt ends inside the last message")
    add_special_tokens: bool = Field(default=False, description="add BOS/EOS on top of what the chat template writes")
    return_token_strs: bool = False
    chat_template: str | None = Field(default=None, description="a template of the request's own")
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="more variables for the template")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize(gw: Gateway, body: Any) -> dict:
    """`{model, prompt}` or `{model, messages}` -> `{count, max_model_len, tokens, token_strs}`."""
    chat = isinstance(body, dict) and "messages" in body
    req = validate_body(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
    model = gw.check_model(req.model)
    if chat:
        # the same request a chat completion would be (tools and all), minus /tokenize's own fields
        chat_req = parse_request("chat", {k: v for k, v in body.items()
                                          if k not in ("add_special_tokens", "return_token_strs")}, limits=gw.limits)
        tokens = gw.chat_prompt_ids(chat_req, add_special_tokens=req.add_special_tokens, model=model)
    else:
        tokens = model.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    strs = [model.tokenizer.id_to_token(t) for t in tokens] if req.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=model.max_model_len, tokens=tokens,
                            token_strs=strs).model_dump()


def detokenize(gw: Gateway, body: Any) -> dict:
    """`{model, tokens}` -> `{prompt}`; special tokens are kept, so it inverts /tokenize."""
    req = validate_body(DetokenizeRequest, body)
    tokenizer = gw.check_model(req.model).tokenizer
    vocab = tokenizer.vocab_size
    bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise OpenAIError(f"tokens.{bad}: token id {req.tokens[bad]} is not in [0, {vocab})", param="tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(req.tokens, skip_special_tokens=False)).model_dump()
