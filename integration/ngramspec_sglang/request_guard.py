"""Refuse requests whose token ids would kill the scheduler, with the HTTP 400 SGLang gives for empty input_ids.

SGLang 0.5.23 passes two kinds of bad prompts on to the scheduler, where the forward takes the whole server down
(seen on a GPU soak, plain decoding and NGRAM_ADAPTIVE alike): a prompt of no tokens (`{"text": ""}`: "cannot reshape
tensor of 0 elements") and a token id outside the model's embedding table (`input_ids` holding `vocab_size`, a larger
id or a negative one: a CUDA device-side assert, after which the process is unusable). `{"input_ids": []}` already
gets a 400 ("input_ids cannot be empty.", from `GenerateReqInput.normalize_batch_and_arguments`), and non-integer
ids are refused before the handler runs (pydantic's parse of `GenerateReqInput`, then the API contract gate).

The check runs in the tokenizer-manager process, in an AROUND hook on `TokenizerManager._validate_one_request`:
SGLang calls it once per request (a batch is split first) with the final prompt ids, after tokenization, for text
and pre-tokenized prompts alike, on the single and the batch-tokenization paths. A `ValueError` raised there is what
SGLang's own length checks raise: /generate answers it with status 400 and `{"error": {"message": ...}}` (the
OpenAI-style endpoints with their 400 error object), and nothing reaches the scheduler.

Only when the server runs NGRAM_ADAPTIVE: the plugin is loaded in every SGLang process, also under plain decoding
and other algorithms (control runs), whose behaviour stays SGLang's own.

The bound is `model_config.vocab_size` (the rows of the model's embedding table, from the checkpoint's config), not
the tokenizer's length: an id below it is a valid row for the embedding lookup and the KV write, whatever the
tokenizer knows; the tokenizer may be longer (added tokens with no embedding row: those crash, so they are refused)
or shorter (a padded table: the ids in between are harmless for the forward, so they pass).
"""
from __future__ import annotations

import operator
from typing import Any, Optional, Sequence

from .config import ALGORITHM_NAME

VALIDATE_ONE_REQUEST = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"

EMPTY_INPUT_IDS = "input_ids cannot be empty."  # SGLang's own message for {"input_ids": []}


def input_ids_error(input_ids: Optional[Sequence[int]], vocab_size: int, *, from_text: bool = False) -> Optional[str]:
    """Why these prompt ids would crash the forward (no ids; one outside 0..vocab_size-1), or None when they are fine.

    Cheap on the common path: one `min` and one `max` over the list; the offending position is looked up only
    when the bounds fail."""
    if input_ids is None or len(input_ids) == 0:
        return f"{EMPTY_INPUT_IDS} (the text tokenizes to no tokens)" if from_text else EMPTY_INPUT_IDS
    try:
        if min(input_ids) >= 0 and max(input_ids) < vocab_size:
            return None
    except TypeError:  # a non-number among them (pydantic refuses those on the HTTP path already)
        pass
    for i, token in enumerate(input_ids):
        try:
            value = operator.index(token)
        except TypeError:
            return f"input_ids[{i}] = {token!r} is not an integer token id."
        if not 0 <= value < vocab_size:
            return (f"input_ids[{i}] = {value} is out of range for this model's vocabulary "
                    f"(0..{vocab_size - 1}).")
    return None  # the bounds failed on a value that is fine as an index (a float such as 3.0): let SGLang judge


def request_error(obj: Any, input_ids: Optional[Sequence[int]], vocab_size: int) -> Optional[str]:
    """`input_ids_error` for one request of a batch, or None for the requests SGLang fills in later: prompts given
    as embeddings, multimodal prompts (their processor owns the ids) and an empty continuation of a session (the
    session's history supplies the prompt; SGLang's own rule for `input_ids: []`)."""
    if getattr(obj, "input_embeds", None) is not None:
        return None
    contains_mm = getattr(obj, "contains_mm_input", None)
    if callable(contains_mm) and contains_mm():
        return None
    if not input_ids:
        session = getattr(obj, "session_params", None)
        if isinstance(session, dict) and session.get("id"):
            return None
    return input_ids_error(input_ids, vocab_size, from_text=getattr(obj, "input_ids", None) is None)


def guarded(manager: Any) -> bool:
    """Whether this tokenizer manager serves NGRAM_ADAPTIVE (the only case the guard applies to)."""
    algorithm = getattr(getattr(manager, "server_args", None), "speculative_algorithm", None)
    return algorithm is not None and str(algorithm).upper() == ALGORITHM_NAME


def guard_request(original, manager, obj, input_ids, *args, **kwargs):
    """AROUND hook on `TokenizerManager._validate_one_request`: under NGRAM_ADAPTIVE, refuse empty prompts and
    out-of-vocabulary ids with a ValueError (HTTP 400) before SGLang's own checks; otherwise only SGLang's."""
    if guarded(manager):
        error = request_error(obj, input_ids, manager.model_config.vocab_size)
        if error is not None:
            raise ValueError(error)
    return original(manager, obj, input_ids, *args, **kwargs)
