"""Text request logs: tokenizers and the record formats `ngramspec simulate --tokenizer` reads.

A tokenizer is named by `--tokenizer SPEC`, one of:

- a local Hugging Face tokenizer folder (with `tokenizer.json` or the files `AutoTokenizer` reads): loaded with
  `transformers.AutoTokenizer` when transformers is installed, else with the `tokenizers` package;
- a `tokenizer.json` file (the `tokenizers` package);
- a tiktoken encoding file (`*.tiktoken`, e.g. `cl100k_base.tiktoken`; the `tiktoken` package). The split
  pattern is taken from the file name (`cl100k`, `o200k`, `p50k`/`r50k`), or given as `FILE.tiktoken:cl100k_base`.

Nothing is downloaded: every tokenizer comes from a local file.

Text records (one JSON object per line), each turned into a prompt and an output (the model's reply):

- `{"prompt": "...", "output": "..."}` (`completion` or `response` are accepted for `output`);
- `{"messages": [{"role": ..., "content": ...}, ...]}` (OpenAI chat): the output is the last message, which must
  be the assistant's, and the prompt is every message before it;
- `{"messages": [...], "output": "..."}`, or `"response"`/`"completion"`: a string, or an OpenAI chat
  completion object (`{"choices": [{"message": {"content": ...}}]}`);
- an OpenAI batch-API line: `{"request": {"messages": [...]} or {"body": {"messages": [...]}},
  "response": {"body": {"choices": [...]}}}`.

A chat prompt is rendered with the tokenizer's chat template when it has one (`add_generation_prompt`), else
as `role: content` lines followed by `assistant: `. Message content may be a string or a list of parts
(`{"type": "text", "text": ...}`); an assistant message's tool calls are appended as their JSON.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

# tiktoken's split patterns (from tiktoken_ext/openai_public.py), by encoding family
_PAT_R50K = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_PAT_CL100K = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""  # noqa: E501 (one regex)
_PAT_O200K = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
TIKTOKEN_PATTERNS = {"cl100k": _PAT_CL100K, "o200k": _PAT_O200K, "p50k": _PAT_R50K, "r50k": _PAT_R50K}


class MissingPackage(ImportError):
    """An optional package a feature needs is not installed; the message is one line with the pip command."""


def _require(module: str, pip_name: str, what: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingPackage(f"{what} needs the optional package {pip_name!r} (pip install {pip_name})") from None


class Tokenizer:
    """`encode(text) -> list[int]`, and `render_chat(messages) -> list[int]` (the prompt of a chat)."""

    name: str

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def render_chat(self, messages: list[dict]) -> list[int]:
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return self.encode("\n".join(lines) + "\nassistant: ")


class TiktokenTokenizer(Tokenizer):
    def __init__(self, path: Path, family: str | None):
        tiktoken = _require("tiktoken", "tiktoken", "a tiktoken encoding file")
        from tiktoken.load import load_tiktoken_bpe

        family = family or next((f for f in TIKTOKEN_PATTERNS if f in path.name), None)
        if family is None:
            raise ValueError(f"{path}: cannot tell the tiktoken encoding from the file name; "
                             f"say it as {path}:cl100k_base (one of {', '.join(TIKTOKEN_PATTERNS)})")
        family = family.split("_")[0]
        if family not in TIKTOKEN_PATTERNS:
            raise ValueError(f"unknown tiktoken encoding {family!r}: use one of {', '.join(TIKTOKEN_PATTERNS)}")
        ranks = load_tiktoken_bpe(str(path))
        self.name = path.name
        self._enc = tiktoken.Encoding(name=path.stem, pat_str=TIKTOKEN_PATTERNS[family], mergeable_ranks=ranks,
                                      special_tokens={})

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)  # special-token strings inside the text stay ordinary text


class HFTokenizer(Tokenizer):
    """A `transformers` tokenizer (with its chat template) or a bare `tokenizers.Tokenizer`."""

    def __init__(self, path: Path):
        self.name = path.name
        self._hf = self._fast = None
        if path.is_dir():
            try:
                from transformers import AutoTokenizer
            except ImportError:
                AutoTokenizer = None
            failure = None
            if AutoTokenizer is not None:
                try:
                    self._hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
                    return
                except (OSError, ValueError, KeyError) as exc:  # e.g. a folder with a bare tokenizer.json
                    failure = f"transformers could not read it ({str(exc).splitlines()[0] if str(exc) else exc!r})"
            path = path / "tokenizer.json"
            if not path.is_file():
                if failure:
                    raise ValueError(f"{path.parent}: not a tokenizer folder: {failure}")
                raise MissingPackage(f"{path.parent}: has no tokenizer.json; reading it needs the optional package "
                                     "'transformers' (pip install transformers)")
        tokenizers = _require("tokenizers", "tokenizers", "a tokenizer.json file")
        self._fast = tokenizers.Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=False))
        return self._fast.encode(text, add_special_tokens=False).ids

    def render_chat(self, messages: list[dict]) -> list[int]:
        if self._hf is not None and getattr(self._hf, "chat_template", None):
            ids = self._hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
                ids = ids["input_ids"]
            return list(ids)
        return super().render_chat(messages)


def load_tokenizer(spec: str | os.PathLike) -> Tokenizer:
    """A tokenizer from a local folder or file (see the module docstring)."""
    spec = str(spec)
    path, family = Path(spec), None
    if not path.exists() and ":" in spec:
        head, _, tail = spec.rpartition(":")
        if Path(head).exists():
            path, family = Path(head), tail
    if not path.exists():
        raise FileNotFoundError(f"tokenizer not found: {spec} (give a local Hugging Face tokenizer folder, "
                                "a tokenizer.json or a .tiktoken encoding file)")
    if path.is_dir() or path.suffix == ".json":
        return HFTokenizer(path)
    return TiktokenTokenizer(path, family)


# ------------------------------------------------------------------------------------------- record formats
def _content_text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{where}: message content must be a string or a list of parts")


def _message_text(message, where: str) -> str:
    if not isinstance(message, dict):
        raise ValueError(f"{where}: a message must be an object with 'role' and 'content'")
    text = _content_text(message.get("content"), where)
    for call in message.get("tool_calls") or []:  # the model generated these too
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        text += json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments")})
    return text


def _messages(value, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"{where}: message {j} needs a 'role'")
        out.append({"role": m["role"], "content": _message_text(m, f"{where} message {j}")})
    return out


def _reply_text(value, where: str) -> str:
    """A reply: a string, a chat message, or an OpenAI chat completion object (or a batch-API response)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        if "body" in value and isinstance(value["body"], dict):
            value = value["body"]
        choices = value.get("choices")
        if isinstance(choices, list) and choices:
            choice = choices[0]
            if isinstance(choice, dict) and isinstance(choice.get("message"), dict):
                return _message_text(choice["message"], where)
            if isinstance(choice, dict) and isinstance(choice.get("text"), str):
                return choice["text"]
        if "content" in value or "tool_calls" in value:
            return _message_text(value, where)
    raise ValueError(f"{where}: the reply must be a string, a message or an OpenAI chat completion object")


REPLY_FIELDS = ("output", "completion", "response")


def text_record(rec: dict, where: str) -> tuple[str | list[dict], str]:
    """(prompt text or chat messages, reply text) of one text record; ValueError naming what is missing."""
    request = rec.get("request")
    if isinstance(request, dict):  # OpenAI batch-API line
        body = request.get("body", request)
        rec = {"messages": body.get("messages") if isinstance(body, dict) else None,
               **{k: rec[k] for k in REPLY_FIELDS if k in rec}}
    reply_key = next((k for k in REPLY_FIELDS if k in rec), None)
    if "messages" in rec:
        messages = _messages(rec["messages"], where)
        if reply_key is not None:
            return messages, _reply_text(rec[reply_key], where)
        if messages[-1]["role"] != "assistant" or len(messages) < 2:
            raise ValueError(f"{where}: a chat record needs the assistant's reply, as the last message or in "
                             "'output'/'response'")
        return messages[:-1], messages[-1]["content"]
    if isinstance(rec.get("prompt"), str) and reply_key is not None:
        return rec["prompt"], _reply_text(rec[reply_key], where)
    raise ValueError(f"{where}: expected 'prompt' and 'output' (token ids or text), or OpenAI-style 'messages' "
                     "with the assistant's reply")


def is_text_record(rec) -> bool:
    """True when a record holds text (not token ids), so it needs a tokenizer."""
    if not isinstance(rec, dict):
        return False
    if "messages" in rec or isinstance(rec.get("request"), dict):
        return True
    return any(isinstance(rec.get(k), (str, dict)) for k in ("prompt", *REPLY_FIELDS))


def tokenize_record(rec: dict, tokenizer: Tokenizer, where: str) -> dict:
    """A text record as a token record `{"id", "prompt", "output"}`."""
    prompt, reply = text_record(rec, where)
    prompt_ids = tokenizer.render_chat(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)
    out = {"prompt": prompt_ids, "output": tokenizer.encode(reply)}
    rid = rec.get("id", rec.get("custom_id"))
    if rid is not None:
        out["id"] = rid
    return out
