"""A chat conversation as its tokens and, per token, the assistant turn that wrote it.

The tokenizer's chat template renders the conversation; what each assistant turn learns
is found in that text by rendering parts of it again: the conversation before the turn
with the generation prompt (what the target answered) and through the turn, and, where a
template renders a turn otherwise once later turns follow it, the turn's content with a
probe in its place (_turn_span). A template that cannot be read so is refused with the row
named; `check_chat_template` refuses one at start-up, before any row is tokenized, naming
the tokenizer's folder (docs/trainer.md, "Training data").
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jinja2

from ..config import NO_TURN


def render(tokenizer, messages: list[dict[str, Any]], generation_prompt: bool, kwargs: Mapping[str, Any],
           where: str) -> str:
    """The conversation as the chat template renders it, with the generation prompt or not."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                             **kwargs)
    except jinja2.TemplateError as exc:  # the template's own refusal (raise_exception): it names no row
        raise ValueError(f"{where}: the chat template refuses this conversation: {exc}") from exc


def require_template(tokenizer, where: str) -> None:
    """transformers' own error for a tokenizer without a chat template names no row."""
    if tokenizer.chat_template is None:
        raise ValueError(f"{where}: a 'messages' row needs the tokenizer's chat template, and "
                         "tokenizer.chat_template is not set")


# Stand-ins for a message's content while its place in a rendering is looked for: control
# characters no template writes. Two, so content next to one of them still finds its edges.
_PROBES = ("\x01", "\x02")


def _with_content(messages: list[dict[str, Any]], index: int, content: str) -> list[dict[str, Any]]:
    return messages[:index] + [{**messages[index], "content": content}] + messages[index + 1:]


def _content_end(tokenizer, messages: list[dict[str, Any]], index: int, text: str, kwargs: Mapping[str, Any],
                 where: str) -> int | None:
    """Character offset in `text` (the rendering of `messages`) where message `index`'s
    content ends, or None when the template does not render its end.

    The content is rendered again with a probe appended; the renderings agree up to the
    content's end. Appended, not replacing it: a template that takes the content apart
    (Qwen3 moves `<think>...</think>` out of it) still renders the probe at its end."""
    content = messages[index].get("content")
    if not isinstance(content, str):
        return None
    ends = []
    for probe in _PROBES:
        probed = render(tokenizer, _with_content(messages, index, content + probe), False, kwargs, where)
        if probed == text:
            return None
        ends.append(len(os.path.commonprefix([text, probed])))
    return min(ends)


def _content_span(tokenizer, messages: list[dict[str, Any]], index: int, text: str, kwargs: Mapping[str, Any],
                  where: str) -> tuple[int, int] | None:
    """[start, end) of message `index`'s content in `text` (the rendering of `messages`):
    what changes, and all that changes, when that content alone is replaced by a probe.
    None when the template does not render it so (it leaves it out, or renders more
    around it differently once it changes)."""
    if not isinstance(messages[index].get("content"), str):
        return None
    for probe in _PROBES:
        probed = render(tokenizer, _with_content(messages, index, probe), False, kwargs, where)
        start = len(os.path.commonprefix([text, probed]))
        kept = len(os.path.commonprefix([text[start:][::-1], probed[start:][::-1]]))  # the common suffix
        if probed[start:len(probed) - kept] == probe:
            return start, len(text) - kept
    return None


def _unreadable(where: str, index: int, problem: str) -> ValueError:
    return ValueError(f"{where}: the chat template {problem}, so turn {index}'s tokens cannot be located")


def _turn_span(tokenizer, messages: list[dict[str, Any]], index: int, text: str, kwargs: Mapping[str, Any],
               where: str) -> tuple[int, int]:
    """[start, end) in `text` (the whole conversation rendered) of what assistant turn
    `index` learns: what the template renders for the turn after the generation prompt
    it answered (`before`), through its end of turn.

    Where the whole conversation starts with the conversation through this turn, that is
    all. A template may render a turn otherwise once later turns follow it: Qwen3 drops an
    earlier answer's reasoning, gpt-oss closes it with <|end|> where the answer the target
    gave ended with <|return|>. Then the turn is its content where the whole conversation
    has it, with what the whole conversation keeps of the answer around it: the end of
    the text before the content (the answer's channel header) and the end of turn, when
    it is the one the answer ended with (else the target never wrote it)."""
    before = render(tokenizer, messages[:index], True, kwargs, where)
    through = render(tokenizer, messages[:index + 1], False, kwargs, where)
    if not through.startswith(before):
        raise _unreadable(where, index, f"does not render the conversation through turn {index} as that turn's "
                                        "prompt followed by its answer")
    if text.startswith(through):
        return len(before), len(through)
    found = _content_span(tokenizer, messages, index, text, kwargs, where)
    if found is None:
        raise _unreadable(where, index, f"does not render turn {index}'s content in the whole conversation as it "
                                        "does when the turn ends it")
    answer_end = _content_end(tokenizer, messages[:index + 1], index, through, kwargs, where)
    content = text[found[0]:found[1]]
    if answer_end is None or through[answer_end - len(content):answer_end] != content \
            or answer_end - len(content) < len(before):
        raise _unreadable(where, index, f"renders turn {index}'s content otherwise in the whole conversation than "
                                        "when the turn ends it")
    opening, closing = through[len(before):answer_end - len(content)], through[answer_end:]
    start = min(len(os.path.commonprefix([text, before])), found[0])
    if not opening.endswith(text[start:found[0]]):
        raise _unreadable(where, index, f"puts text before turn {index}'s content, in the whole conversation, that "
                                        "is neither its prompt nor its answer")
    return start, found[1] + len(closing) if text.startswith(closing, found[1]) else found[1]


def chat_spans(tokenizer, messages: list[dict[str, Any]], where: str, truncated: bool = False,
               template_kwargs: Mapping[str, Any] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and, per assistant turn in order, the [start, end)
    character span of it that is learnt (_turn_span): for the final answer when
    `truncated`, to the end of its content."""
    kwargs = dict(template_kwargs or {})
    require_template(tokenizer, where)
    if truncated and (not messages or messages[-1].get("role") != "assistant"):
        raise ValueError(f"{where}: 'truncated' is true but the last message is not the assistant's")
    text = render(tokenizer, messages, False, kwargs, where)
    spans: list[tuple[int, int]] = []
    turns = [i for i, message in enumerate(messages) if message.get("role") == "assistant"]
    for number, i in enumerate(turns):
        start, end = _turn_span(tokenizer, messages, i, text, kwargs, where)
        if truncated and i == len(messages) - 1:
            if not isinstance(messages[-1].get("content"), str):
                raise ValueError(f"{where}: 'truncated' needs the last message's content to be a string")
            end = _content_end(tokenizer, messages, i, text, kwargs, where)
            if end is None:
                raise ValueError(f"{where}: the chat template does not render the last message's content, so "
                                 "where the truncated answer ends cannot be located")
        if spans and start < spans[-1][1]:
            raise _unreadable(where, i, f"renders turn {i} before the end of turn {turns[number - 1]}")
        spans.append((start, end))
    return text, spans


def tokenize_chat(tokenizer, messages: list[dict[str, Any]], where: str, truncated: bool = False,
                  template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and, per token, the index of the assistant
    turn that wrote it (NO_TURN for every other token): tokens are assigned to the turns'
    spans (chat_spans) by their character offsets."""
    text, spans = chat_spans(tokenizer, messages, where, truncated, template_kwargs)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    turn_ids = [next((turn for turn, (lo, hi) in enumerate(spans) if lo <= start < hi), NO_TURN)
                for start, _ in encoded["offset_mapping"]]
    return encoded["input_ids"], turn_ids


def check_chat_template(tokenizer, target: str, messages: list[Any], where: str,
                        template_kwargs: Mapping[str, Any] | None = None) -> None:
    """Refuse, before any row is tokenized, a chat template that the loss mask cannot
    read, naming the target whose tokenizer it is (`target`: "target.path FOLDER") and
    what was not found. It is tried on a conversation of the turns of the row at `where`
    (data.train's first: its roles, every string content replaced by a probe sentence,
    so what is tried is the template on the data's shape, not the data's text): every
    message's content must be in the rendering, once and in order, and each assistant
    turn's learnt span (chat_spans) must hold its own content and no other message's."""
    if not all(isinstance(message, dict) for message in messages):
        return  # not a conversation: the row's own tokenization says why
    roles = ", ".join(str(message.get("role")) for message in messages)
    shape = f"on a conversation of the turns of {where} ({roles})"
    if tokenizer.chat_template is None:
        raise ValueError(f"{target}: its tokenizer has no chat template (no chat_template in "
                         f"tokenizer_config.json, no chat_template.jinja), and {where} is a chat \"messages\" row")
    probes = {index: f"Probe sentence {index} of the {message.get('role')}." for index, message in enumerate(messages)
              if isinstance(message.get("content"), str)}
    conversation = [{**message, "content": probes[index]} if index in probes else message
                    for index, message in enumerate(messages)]
    kwargs = dict(template_kwargs or {})

    def refused(problem: str) -> ValueError:
        return ValueError(f"{target}: its chat template cannot be read for the loss mask, {shape}: "
                          f"{problem}")

    def named(index: int) -> str:
        return f"message {index} ({messages[index].get('role')})"

    try:
        text = render(tokenizer, conversation, False, kwargs, "the probe conversation")
        places = {}
        for index, probe in probes.items():
            if text.count(probe) != 1:
                raise refused(f"it does not render {named(index)}'s content as given (it leaves it out or rewrites it)")
            places[index] = text.index(probe)
        order = sorted(places, key=places.__getitem__)
        for earlier, later in zip(sorted(places), order):
            if earlier != later:
                raise refused(f"it renders {named(later)} before {named(earlier)}")
        _, spans = chat_spans(tokenizer, conversation, "the probe conversation", template_kwargs=kwargs)
    except ValueError as exc:
        if str(exc).startswith(f"{target}: "):
            raise
        raise refused(str(exc).removeprefix("the probe conversation: ")) from exc
    turns = [index for index, message in enumerate(conversation) if message.get("role") == "assistant"]
    for index, (start, end) in zip(turns, spans):
        learnt = text[start:end]
        if index in probes and probes[index] not in learnt:
            raise refused(f"what turn {index} learns, {learnt!r}, is not its content")
        for other, probe in probes.items():
            if other != index and probe in learnt:
                raise refused(f"what turn {index} learns holds {named(other)}'s content")
