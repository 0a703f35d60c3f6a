"""A request stops where plain decoding would stop it, also when one step adds several of its tokens.

SGLang 0.5.23 checks a request's stop conditions once per step, over all the tokens the step added
(`Req.update_finish_state(new_accepted_len)`). Stop strings come first, in the order the request lists them: the
first one found in the step's text wins, and `_locate_str_stop_finished_len` cuts the output after it. With one
token per step that is plain decoding's answer. With several (a verify step, or several plain forwards in one
step) it is not, when the step holds two stops:
- `"stop": ["return", ";"]` and a step adding `"; return"`: SGLang cuts after "return" and the text keeps the ";"
  that plain decoding stops at (its detokenizer has a TODO for "multiple stop strs");
- an EOS or stop token before a stop string in the same step: SGLang cuts after the stop string, so the output
  holds the tokens after the EOS.

The AROUND hook on `_locate_str_stop_finished_len` (called only when a stop string or regex matched, so it costs
nothing on other steps) looks at every stop of the request in the step, stop strings, regexes and stop tokens
alike, and keeps the one that ends first: the same output as one token per step. Ties keep SGLang's choice, which
is plain decoding's (it checks in the same order). The finish reason names that stop too, except where a regex
was the stop SGLang found (no stop string in the step): SGLang names that regex after this hook returns, so an
earlier stop token or regex cuts the output but the reason keeps the regex. Only under NGRAM_ADAPTIVE; other
algorithms keep SGLang's behaviour.
"""
from __future__ import annotations

import re

from .config import ALGORITHM_NAME

LOCATE_STOP = "sglang.srt.managers.schedule_batch.Req._locate_str_stop_finished_len"


def applies() -> bool:
    """Whether this process serves NGRAM_ADAPTIVE (read from SGLang's published configuration)."""
    try:
        from sglang.srt.runtime_context import get_spec

        algorithm = get_spec().speculative_algorithm
    except Exception:  # no published configuration: SGLang's behaviour
        return False
    return algorithm is not None and str(algorithm).upper() == ALGORITHM_NAME


def earliest_stop(original, req, new_accepted_len: int, *, stop_str=None, stop_regex=None,
                  full_window_matched: bool = True):
    """AROUND hook: the output length after the step's first stop (and its finish reason set on `req`)."""
    found = original(req, new_accepted_len, stop_str=stop_str, stop_regex=stop_regex,
                     full_window_matched=full_window_matched)
    if found is None or new_accepted_len <= 1 or not applies():
        return found
    from sglang.srt.managers.schedule_batch import FINISH_MATCHED_STR, FINISHED_MATCHED_REGEX

    best, reason = found, None
    params = req.sampling_params
    tail = req.tail_str(new_accepted_len)
    for other in params.stop_strs or ():
        if other and other != stop_str and other in tail:
            at = original(req, new_accepted_len, stop_str=other)
            if at is not None and at < best:
                best, reason = at, FINISH_MATCHED_STR(matched=other)
    for other in params.stop_regex_strs or ():
        if other == stop_regex:
            continue
        try:
            whole = re.search(other, tail) is not None
        except (re.error, RecursionError):  # SGLang aborts such a request on its own check
            continue
        at = original(req, new_accepted_len, stop_regex=other, full_window_matched=whole)
        if at is not None and at < best:
            best, reason = at, FINISHED_MATCHED_REGEX(matched=other)
    # a stop token or EOS before it: SGLang's own token check over the step's tokens up to there
    first = len(req.output_ids) - new_accepted_len
    kept = (req.finished_reason, req.finished_len)
    if best > first and req._check_token_based_finish(req.output_ids[first:best]):
        token_len = req.finished_len - (len(req.output_ids) - best)  # it counts the tokens it saw as the output's last
        if token_len < best:
            best, reason = token_len, req.finished_reason
    req.finished_reason, req.finished_len = kept
    if reason is not None:
        req.finished_reason = reason
    return best
