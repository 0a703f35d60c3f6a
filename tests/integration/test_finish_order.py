"""Where a request stops when one step adds several of its tokens (integration/ngramspec_sglang/finish_order.py).

SGLang 0.5.23's real `Req` on the CPU, with a one-character-per-token tokenizer: a request fed its output in steps
of several tokens must stop where it stops when fed one token per step (plain decoding), output length and finish
reason alike. SGLang alone takes the first stop string of the request's list that the step holds (found in a GPU
soak: `"stop": ["return", ";"]` answered with a ";" in the text)."""
import pytest

pytest.importorskip("sglang")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ngramspec_sglang import finish_order  # noqa: E402

pytestmark = pytest.mark.sglang

CHARS = "abcdefghijklmnopqrstuvwxyz;. "  # token i >= 1 is CHARS[i - 1]; token 0 is the EOS
EOS = 0


class Tok:
    eos_token_id = EOS
    additional_stop_token_ids = None

    def decode(self, ids, **kwargs):
        return "".join(CHARS[i - 1] for i in ids if i != EOS)

    def encode(self, text, **kwargs):
        return [CHARS.index(c) + 1 for c in text]


def ids(text):
    return Tok().encode(text)


def make_req(stop=(), stop_regex=(), stop_token_ids=None, ignore_eos=False):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    sp = SamplingParams(max_new_tokens=1000, stop=list(stop) or None, stop_regex=list(stop_regex) or None,
                        stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
    sp.normalize(Tok())
    req = Req("r", "x", [1, 2, 3], sp, eos_token_ids={EOS}, vocab_size=len(CHARS) + 1)
    req.tokenizer = Tok()
    return req


def run(req, tokens, steps):
    """Feed `tokens` in steps of the given sizes (the last step takes the rest); the output SGLang keeps (cut at
    `finished_len`) and the finish reason."""
    at = 0
    for size in list(steps) + [len(tokens)]:
        if at >= len(tokens) or req.finished():
            break
        new = tokens[at:at + max(1, size)]
        at += len(new)
        req.output_ids.extend(new)
        req.update_finish_state(len(new))
    end = req.finished_len if req.finished_len is not None else len(req.output_ids)
    reason = req.finished_reason
    return list(req.output_ids[:end]), (type(reason).__name__, getattr(reason, "matched", None)) if reason else None


@pytest.fixture
def hooked(monkeypatch):
    """The hook on SGLang's real method, as the plugin registers it, with NGRAM_ADAPTIVE served."""
    from sglang.srt.managers.schedule_batch import Req

    original = Req._locate_str_stop_finished_len

    def wrapped(self, *args, **kwargs):
        return finish_order.earliest_stop(original, self, *args, **kwargs)

    monkeypatch.setattr(Req, "_locate_str_stop_finished_len", wrapped)
    monkeypatch.setattr(finish_order, "applies", lambda: True)


@pytest.mark.sglang_server
def test_sglang_alone_keeps_the_later_stop_string():
    """The case the hook is for, on SGLang as it is: the step "; ret" stops after "ret", keeping the ";"."""
    out, reason = run(make_req(stop=["ret", ";"]), ids("ab; reta"), [2, 6])
    assert Tok().decode(out) == "ab; ret" and reason == ("FINISH_MATCHED_STR", "ret")
    out, reason = run(make_req(stop=["ret", ";"]), ids("ab; reta"), [1] * 8)
    assert Tok().decode(out) == "ab;" and reason == ("FINISH_MATCHED_STR", ";")


@pytest.mark.sglang_server
def test_the_first_stop_string_ends_the_request(hooked):
    out, reason = run(make_req(stop=["ret", ";"]), ids("ab; reta"), [2, 6])
    assert Tok().decode(out) == "ab;" and reason == ("FINISH_MATCHED_STR", ";")


@pytest.mark.sglang_server
def test_an_eos_before_a_stop_string_ends_the_request(hooked):
    tokens = ids("ab") + [EOS] + ids("c;d")
    out, reason = run(make_req(stop=[";"]), tokens, [1, 5])
    assert out == ids("ab") + [EOS] and reason == ("FINISH_MATCHED_TOKEN", EOS)
    out, reason = run(make_req(stop=[";"], ignore_eos=True), tokens, [1, 5])  # no EOS stop: the stop string
    assert out == ids("ab") + [EOS] + ids("c;") and reason == ("FINISH_MATCHED_STR", ";")


@pytest.mark.sglang_server
def test_other_algorithms_keep_sglangs_answer(monkeypatch):
    from sglang.srt.managers.schedule_batch import Req

    original = Req._locate_str_stop_finished_len
    monkeypatch.setattr(Req, "_locate_str_stop_finished_len",
                        lambda self, *a, **k: finish_order.earliest_stop(original, self, *a, **k))
    assert not finish_order.applies()  # nothing published in this process: not NGRAM_ADAPTIVE
    out, _ = run(make_req(stop=["ret", ";"]), ids("ab; reta"), [2, 6])
    assert Tok().decode(out) == "ab; ret"


STOPS = st.lists(st.sampled_from([";", ".", "ab", "ba", "a b", "zz", " "]), max_size=3, unique=True)
REGEXES = st.lists(st.sampled_from([r"b\.", r"[xy]{2}", r"a;$"]), max_size=2, unique=True)


@pytest.mark.sglang_server
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # it patches
@given(text=st.text(alphabet="ab;. xyz", min_size=1, max_size=24), eos_at=st.none() | st.integers(0, 23),
       stops=STOPS, regexes=REGEXES, stop_token=st.none() | st.sampled_from(ids("xy")),
       steps=st.lists(st.integers(1, 9), max_size=12))
def test_any_steps_stop_where_one_token_steps_stop(hooked, text, eos_at, stops, regexes, stop_token, steps):
    tokens = ids(text)
    if eos_at is not None and eos_at < len(tokens):
        tokens[eos_at] = EOS
    config = dict(stop=stops, stop_regex=regexes, stop_token_ids=[stop_token] if stop_token else None)
    plain_out, plain_reason = run(make_req(**config), tokens, [1] * len(tokens))
    out, reason = run(make_req(**config), tokens, steps)
    assert out == plain_out
    if reason is None or reason[0] != "FINISHED_MATCHED_REGEX":
        assert reason == plain_reason
    else:  # where SGLang found a regex it names it after the hook (see the module): the output is what counts
        assert plain_reason is not None


@pytest.mark.sglang_server
def test_hook_is_registered_on_req():
    """What the entry point does in every SGLang process: the hook wraps SGLang's real method."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.plugins.hook_registry import HookRegistry

    import ngramspec_sglang

    ngramspec_sglang.register()
    HookRegistry.apply_hooks()
    assert any(hook is finish_order.earliest_stop for _, hook, _ in HookRegistry._hooks[finish_order.LOCATE_STOP])
    assert getattr(Req._locate_str_stop_finished_len, "__wrapped__", None) is not None


@pytest.mark.sglang_server
def test_the_registered_hook_ends_at_the_first_stop(monkeypatch):
    """Through SGLang's own wrapper (as the scheduler calls it), NGRAM_ADAPTIVE served and not."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    import ngramspec_sglang

    ngramspec_sglang.register()
    HookRegistry.apply_hooks()
    out, _ = run(make_req(stop=["ret", ";"]), ids("ab; reta"), [2, 6])
    assert Tok().decode(out) == "ab; ret"  # nothing published here: SGLang's answer
    monkeypatch.setattr(finish_order, "applies", lambda: True)
    out, reason = run(make_req(stop=["ret", ";"]), ids("ab; reta"), [2, 6])
    assert Tok().decode(out) == "ab;" and reason == ("FINISH_MATCHED_STR", ";")


def test_applies_reads_the_served_algorithm(monkeypatch):
    from types import SimpleNamespace

    for algorithm, on in (("NGRAM_ADAPTIVE", True), ("ngram_adaptive", True), ("NGRAM", False), (None, False)):
        monkeypatch.setattr("sglang.srt.runtime_context.get_spec",
                            lambda a=algorithm: SimpleNamespace(speculative_algorithm=a))
        assert finish_order.applies() is on, algorithm
