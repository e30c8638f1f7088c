"""A request's prompt: the chat template rendered over its messages and tools (or a raw completion's text or ids),
tokenised with the control tokens typed in its text kept as text, its pictures' placeholders expanded to their
rows, checked against the context; and what the answer starts in.

Blocking work: the service runs it in a worker thread, except for short requests (`short`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from strata.events import ChatRequest, CompletionPrompt
from strata.mcp_tools.fitting import fit_results
from strata.pictures.expand import PromptImages, expand_image_pads, marker_tokens
from strata.pictures.sources import ImageRejected
from strata.request_errors import RequestError
from strata.text.family import ModelFamily
from strata.text.prompt import RESERVED_TEMPLATE_VARIABLES, PromptError, render_chat
from strata.text.prompt_tokens import PromptTokens, strings_of
from strata.vision.client import Embedding

# A request with at most this many characters of text is rendered and tokenised on the event loop (under a
# millisecond, about what handing it to a worker thread and back costs on a busy core); longer ones in a thread.
INLINE_PROMPT_CHARS = 1024


@dataclass
class Prepared:
    prompt: PromptImages  # ids, what the KV cache holds at each position, and the pictures' rows
    max_tokens: int | None  # the request's caps (the job adds the context's: `Job.budget`); None: the context's
    starts_in_reasoning: bool
    may_think: bool  # the prompt leaves the model free to open a reasoning block
    turn_starts: list[int] = dataclasses.field(default_factory=list)  # where its messages start (chats only)
    predicted: list[int] | None = None  # the request's prediction, tokenised (speculative decoding's drafts)

    @property
    def ids(self) -> list[int]:
        return self.prompt.ids


class Prompts:
    """The prompts of one model: its tokenizer, family and chat template, its context and vocabulary.

    Args:
        tokenizer: the model's `strata.text.tokenizer.Tokenizer`.
        family: the model's family (its reasoning markers and picture placeholder).
        template: the chat template (jinja2).
        n_ctx: positions a sequence holds (prompt and answer).
        n_vocab: the vocabulary's size.
        max_tokens: the server's cap on an answer (`limits.max_tokens`), or None.
    """

    def __init__(self, tokenizer: Any, family: ModelFamily, template: str, n_ctx: int, n_vocab: int,
                 max_tokens: int | None):
        self.tokenizer, self.family, self.template = tokenizer, family, template
        self.n_ctx, self.n_vocab, self.max_tokens = n_ctx, n_vocab, max_tokens
        self.tokens = PromptTokens(tokenizer)
        self.turn_open_id = tokenizer.token_to_id(family.turn_open)  # None: the vocabulary has no such token
        pad_id = None if family.image_pad is None else tokenizer.token_to_id(family.image_pad)
        self.pad_id = -1 if pad_id is None else pad_id  # the id a picture's placeholder renders as (-1: none)

    def render(self, request: ChatRequest) -> str:
        """The prompt text of a request (the chat template applied to its messages and tools)."""
        kwargs = dict(request.template_kwargs)
        clash = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(kwargs))
        if clash:
            raise RequestError(f"chat_template_kwargs.{clash[0]}: the template's own variable cannot be set here",
                               "chat_template_kwargs")
        enable_thinking = kwargs.pop("enable_thinking", request.enable_thinking)
        try:
            text = render_chat(self.template, request.messages, tools=request.tools or None,
                               add_generation_prompt=not request.prefill, enable_thinking=enable_thinking, **kwargs)
        except PromptError as error:
            raise RequestError(str(error)) from None
        return _open_last_turn(text, request.messages[-1]) if request.prefill else text

    def text_and_ids(self, request: ChatRequest) -> tuple[str, list[int]]:
        """The prompt text and token ids of a request (a chat, or a raw completion)."""
        if request.completion is not None:
            return self._completion(request.completion)
        return self._chat(request)

    def _chat(self, request: ChatRequest) -> tuple[str, list[int]]:
        """A chat's prompt text and ids, control tokens typed in its text tokenised as text (see
        `strata.text.prompt_tokens`): a request whose text cannot fit the context is refused before any work."""
        guard = self.tokens
        try:
            guard.check_length(list(strings_of([request.messages, request.tools, request.template_kwargs])),
                               self.n_ctx)
        except ValueError as error:
            raise RequestError(str(error)) from None
        text = self.render(dataclasses.replace(request, messages=guard.protect(request.messages),
                                               tools=guard.protect(request.tools),
                                               template_kwargs=guard.protect(request.template_kwargs)))
        return text, self.tokenizer.with_bos(guard.encode(text))

    def _completion(self, completion: CompletionPrompt) -> tuple[str, list[int]]:
        """A raw completion's prompt text and ids: the text tokenised as plain text, or the ids checked; with a
        suffix, the fill-in-the-middle form `<prefix>prompt<suffix>suffix<middle>` with the tokens the model
        has (`Tokenizer.fim`)."""
        tokenizer, guard = self.tokenizer, self.tokens
        try:
            guard.check_length([completion.text or "", completion.suffix or ""], self.n_ctx)
        except ValueError as error:
            raise RequestError(str(error), "prompt") from None
        if completion.ids is not None:
            bad = [token for token in completion.ids if not 0 <= token < self.n_vocab]
            if bad:
                raise RequestError(f"prompt: token ids go up to {self.n_vocab - 1}, got {bad[0]}", "prompt")
            ids = list(completion.ids)
        else:
            ids = guard.encode_text(completion.text or "")
        if completion.suffix is not None:
            if tokenizer.fim is None:
                raise RequestError("suffix: this model has no fill-in-the-middle tokens (no "
                                   "tokenizer.ggml.fim_pre/suf/mid_token_id keys, and no <|fim_prefix|>, "
                                   "<|fim_suffix|>, <|fim_middle|> or similar tokens in its vocabulary)", "suffix")
            prefix, suffix, middle = tokenizer.fim
            ids = [prefix, *ids, suffix, *guard.encode_text(completion.suffix), middle]
        if not ids:
            raise RequestError("prompt: must not be empty", "prompt")
        if completion.ids is None:  # a text prompt starts with BOS when the model wants one, as a chat prompt does
            ids = tokenizer.with_bos(ids)
        return tokenizer.decode(ids), ids

    def prepare(self, request: ChatRequest, pictures: list[Embedding],
                rendered: tuple[str, list[int]] | None = None, results: int = 0) -> Prepared:
        """The request's prompt (`rendered`: its text and ids, when counting its pictures made them already) with
        its pictures' rows, and its token caps. Its last `results` messages are tool results the model has not
        read yet: cut to fit (`_fitted`)."""
        if results and request.completion is None:
            text, ids = self._fitted(request, pictures, results, rendered)
        else:
            text, ids = rendered if rendered is not None else self.text_and_ids(request)
        if pictures:
            try:
                prompt = expand_image_pads(ids, self.pad_id, pictures, self.marker_ids)
            except ImageRejected as error:
                raise RequestError(f"{error} (the chat template must render each picture as "
                                   f"{self.family.picture_prompt})") from None
        else:
            prompt = PromptImages(ids, list(ids), [])
        ids = prompt.ids
        if len(ids) >= self.n_ctx:
            raise RequestError(f"the prompt has {len(ids)} tokens; the context holds {self.n_ctx} (prompt and "
                               "answer)", code="context_length_exceeded")
        if any(token >= self.n_vocab for token, _ in request.sampling.logit_bias):
            raise RequestError(f"logit_bias: token ids go up to {self.n_vocab - 1}", "logit_bias")
        max_tokens = min((cap for cap in (request.max_tokens, self.max_tokens) if cap is not None), default=None)
        if request.completion is not None:
            return Prepared(prompt, max_tokens, False, False)
        starts_in_reasoning = self.family.opens_reasoning(text)
        # An empty block closed by the template means no thinking; a continued answer is past its thinking.
        may_think = not self.family.closes_reasoning(text) and not request.prefill
        turn_starts = [] if self.turn_open_id is None else [i for i, t in enumerate(ids) if t == self.turn_open_id]
        predicted = self.tokenizer.encode(request.prediction, special=False) if request.prediction else None
        return Prepared(prompt, max_tokens, starts_in_reasoning, may_think, turn_starts, predicted)

    def _fitted(self, request: ChatRequest, pictures: list[Embedding], results: int,
                rendered: tuple[str, list[int]] | None) -> tuple[str, list[int]]:
        """The prompt of a response's next round, whose last `results` messages are the tool results the model
        has not read yet: cut to fit (`strata.mcp_tools.fit_results`) when the prompt would leave the answer less
        than a quarter of the context (or the request's max_tokens, if less). Nothing about a tool fails the
        request."""
        answer = min(cap for cap in (self.n_ctx // 4, request.max_tokens, self.max_tokens) if cap is not None)
        rows = sum(picture.n_tokens + marker_tokens(picture.grid, self.marker_ids) - 1 for picture in pictures)
        budget = self.n_ctx - answer - rows
        try:
            text, ids = rendered if rendered is not None else self._chat(request)
            if len(ids) <= budget:
                return text, ids
        except RequestError:
            pass  # its text alone is longer than the context: cut below
        messages = fit_results(request.messages, results, budget,
                               lambda messages: len(self._chat(dataclasses.replace(request, messages=messages))[1]),
                               self.tokens.encode_text, self.tokenizer.decode)
        return self._chat(dataclasses.replace(request, messages=messages))

    def marker_ids(self, marker: str) -> list[int]:
        """The ids of a tiled picture's part marker: its token where the vocabulary has one (LFM2-VL's), else the
        marker's text (as llama.cpp reads a row-and-column marker)."""
        token = self.tokenizer.token_to_id(marker)
        return [token] if token is not None else self.tokens.encode_text(marker)


def short(request: ChatRequest) -> bool:
    """Whether the request's text (messages, tools, template arguments, a raw prompt) is at most
    `INLINE_PROMPT_CHARS` characters."""
    n = 0
    completion = request.completion
    if completion is not None:
        n = len(completion.text or "") + len(completion.ids or ()) + len(completion.suffix or "")
    for text in strings_of([request.messages, request.tools, request.template_kwargs, request.prediction or ""]):
        n += len(text)
        if n > INLINE_PROMPT_CHARS:
            return False
    return n <= INLINE_PROMPT_CHARS


def message_text(message: dict[str, Any]) -> str:
    """A message's text: its content, or the text of its content parts."""
    content = message.get("content") or ""
    if not isinstance(content, str):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content


def _open_last_turn(text: str, message: dict[str, Any]) -> str:
    """The prompt of a conversation whose last (assistant) message the model continues: the rendering cut right
    after that message's text, before the template closes its turn.

    Raises:
        RequestError: the last message is not the assistant's, or the template's rendering does not hold its text.
    """
    if message.get("role") != "assistant":
        raise RequestError("continuing the final message needs an assistant message last", "messages")
    content = message_text(message).strip()
    at = text.rfind(content) if content else -1
    if at < 0:
        raise RequestError("the chat template does not render the final assistant message's text, so it cannot be "
                           "continued", "messages")
    return text[: at + len(content)]
