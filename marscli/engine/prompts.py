"""Prompts to token ids: the chat template, and fitting a prompt to the context window."""

from __future__ import annotations

from marscli.config import Request
from marscli.engine.sequence import RecordFailure

#: What to do with a prompt that does not fit the context window: fail the record, or keep
#: its end (TRUNCATE_LEFT).
TRUNCATE_NONE = "none"
TRUNCATE_LEFT = "left"


class PromptEncoder:
    def __init__(self, tokenizer, context_length: int | None):
        self.tokenizer = tokenizer
        self.context_length = context_length

    def encode(self, req: Request) -> list[int]:
        """Prompt token ids for a request; a prompt that does not fit is a RecordFailure."""
        return self.fit_prompt(self.tokenize(req))[0]

    def tokenize(self, req: Request) -> list[int]:
        """Prompt token ids (chat template applied to messages), not yet fitted to the window."""
        tok = self.tokenizer
        if req.messages is not None:
            if not getattr(tok, "chat_template", None):
                raise RecordFailure(
                    "no_chat_template",
                    "the target has no chat template, so 'messages' cannot be rendered; "
                    "send 'prompt' with the raw text instead",
                )
            text = tok.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
            ids = tok(text, add_special_tokens=False).input_ids
        else:
            ids = tok(req.prompt).input_ids
        if not ids:
            raise RecordFailure("empty_prompt", "the prompt encodes to zero tokens")
        return ids

    def fit_prompt(self, ids: list[int], *, truncate: str = TRUNCATE_NONE,
                   max_tokens: int = 1) -> tuple[list[int], int]:
        """Fit prompt ids to the target's context window -> (ids, tokens dropped at the start).

        TRUNCATE_NONE: a prompt that leaves no room for one new token is a RecordFailure.
        TRUNCATE_LEFT: drop the oldest tokens until prompt + max_tokens fits (at least one
        prompt token stays); a prompt that already leaves room is never changed.
        """
        ctx = self.context_length
        if ctx is None:
            return ids, 0
        if truncate == TRUNCATE_LEFT:
            keep = max(1, ctx - max(max_tokens, 1))
            if len(ids) > keep:
                return ids[-keep:], len(ids) - keep
            return ids, 0
        if truncate != TRUNCATE_NONE:
            raise ValueError(f"unknown truncation {truncate!r}")
        if len(ids) >= ctx:
            raise RecordFailure(
                "prompt_too_long",
                f"prompt has {len(ids)} tokens; the target's context window is {ctx} "
                "(--truncate-prompt left keeps the end of the prompt instead)",
            )
        return ids, 0
