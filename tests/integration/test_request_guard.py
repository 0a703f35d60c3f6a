"""The request guard (integration/ngramspec_sglang/request_guard.py): prompts that would kill SGLang 0.5.23's scheduler
(no tokens; an id outside the model's vocabulary) get SGLang's HTTP 400 under NGRAM_ADAPTIVE, and plain SGLang is
left as it is. On CPU: the check as a function, the hook as registered on SGLang's real TokenizerManager (its own
tokenization and validation code run up to where the scheduler would be reached), and the HTTP error it maps to.

No server is launched here: NGRAM_ADAPTIVE's worker needs a GPU (test_sglang_plugin.py checks that its factory fails
only for that on CPU), and no model weights are at hand. The GPU soak (scripts/sglang_soak.py, its bad requests)
covers the server end to end."""
import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

from ngramspec_sglang.request_guard import (  # noqa: E402
    EMPTY_INPUT_IDS,
    VALIDATE_ONE_REQUEST,
    guard_request,
    guarded,
    input_ids_error,
    request_error,
)

pytestmark = pytest.mark.sglang
VOCAB = 49152  # SmolLM2's


# ------------------------------------------------------------------------------------------------- the check


def test_fine_prompts_pass():
    assert input_ids_error([0, 1, 2, VOCAB - 1], VOCAB) is None
    assert input_ids_error([7], VOCAB) is None
    assert input_ids_error(list(range(VOCAB)), VOCAB) is None


@pytest.mark.parametrize("ids", [[], None])
def test_empty_prompts_get_sglangs_message(ids):
    assert input_ids_error(ids, VOCAB) == EMPTY_INPUT_IDS == "input_ids cannot be empty."
    assert input_ids_error(ids, VOCAB, from_text=True).startswith(EMPTY_INPUT_IDS)
    assert "tokenizes to no tokens" in input_ids_error(ids, VOCAB, from_text=True)


@pytest.mark.parametrize("ids, index, value", [
    ([1, 2, 3, VOCAB], 3, VOCAB),  # the soak's oov_vocab_size
    ([VOCAB + 1000, 5, 6], 0, VOCAB + 1000),  # oov_large
    ([-1, 5, 6], 0, -1),  # negative_id
    ([5, 2 ** 62, 6], 1, 2 ** 62),  # huge (still an i64: pydantic lets it through)
    ([5, 2 ** 70], 1, 2 ** 70),  # past i64 (the Engine API takes Python ints as they are)
    ([5, 6, -7, VOCAB], 2, -7),  # the first offender is named
])
def test_out_of_range_ids_are_named(ids, index, value):
    assert input_ids_error(ids, VOCAB) == (
        f"input_ids[{index}] = {value} is out of range for this model's vocabulary (0..{VOCAB - 1}).")


def test_the_message_of_the_brief():
    assert input_ids_error([1, 2, 3, 49152], 49152) == \
        "input_ids[3] = 49152 is out of range for this model's vocabulary (0..49151)."


def test_non_integers_are_named():
    assert input_ids_error([1, "a"], VOCAB) == "input_ids[1] = 'a' is not an integer token id."
    assert input_ids_error([1, 1e12], VOCAB) == "input_ids[1] = 1000000000000.0 is not an integer token id."


def test_numpy_ints_pass_and_fail_like_ints():
    np = pytest.importorskip("numpy")
    assert input_ids_error(list(np.array([1, 2, 3], dtype=np.int64)), VOCAB) is None
    assert "input_ids[1] = 49152" in input_ids_error(list(np.array([1, VOCAB], dtype=np.int64)), VOCAB)


def req(**kw):
    """A normalized GenerateReqInput (SGLang's own request object)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(**kw)
    obj.normalize_batch_and_arguments()
    return obj


@pytest.mark.sglang_server
def test_request_level_rules():
    text = req(text="")
    assert "tokenizes to no tokens" in request_error(text, [], VOCAB)  # a text request that tokenizes to nothing
    assert request_error(req(text="hello"), [5, 6], VOCAB) is None
    assert request_error(req(input_ids=[1, VOCAB]), [1, VOCAB], VOCAB).startswith("input_ids[1] = 49152")
    session = SimpleNamespace(input_ids=[], input_embeds=None, session_params={"id": "s1"},
                              contains_mm_input=lambda: False)
    assert request_error(session, [], VOCAB) is None  # the session's history supplies the prompt (SGLang's rule)
    session.session_params = {"id": None}
    assert request_error(session, [], VOCAB) == EMPTY_INPUT_IDS
    embeds = SimpleNamespace(input_ids=None, input_embeds=[[0.0]], contains_mm_input=lambda: False)
    assert request_error(embeds, None, VOCAB) is None  # prompts as embeddings have no ids to check
    image = SimpleNamespace(input_ids=None, input_embeds=None, contains_mm_input=lambda: True)
    assert request_error(image, [VOCAB + 5], VOCAB) is None  # the multimodal processor owns those ids


@pytest.mark.sglang_server
def test_batch_of_requests_is_checked_one_by_one():
    """SGLang splits a batch (obj[i]) before `_validate_one_request`; each part is judged alone."""
    batch = req(input_ids=[[1, 2, 3], [4, VOCAB], [], [-3]])
    got = [request_error(batch[i], batch[i].input_ids, VOCAB) for i in range(batch.batch_size)]
    assert got == [None, f"input_ids[1] = {VOCAB} is out of range for this model's vocabulary (0..{VOCAB - 1}).",
                   EMPTY_INPUT_IDS,
                   f"input_ids[0] = -3 is out of range for this model's vocabulary (0..{VOCAB - 1})."]


@pytest.mark.sglang_server
def test_sglangs_own_empty_input_ids_message_is_the_one_we_give():
    with pytest.raises(ValueError, match=r"^input_ids cannot be empty\.$"):
        req(input_ids=[])


# ------------------------------------------------------------------------------------------------- the hook


def manager_for(algorithm):
    return SimpleNamespace(server_args=SimpleNamespace(speculative_algorithm=algorithm),
                           model_config=SimpleNamespace(vocab_size=VOCAB))


@pytest.mark.sglang_server
@pytest.mark.parametrize("algorithm, on", [("NGRAM_ADAPTIVE", True), ("ngram_adaptive", True), (None, False),
                                           ("NGRAM", False), ("EAGLE", False)])
def test_guard_applies_only_to_ngram_adaptive(algorithm, on):
    manager, seen = manager_for(algorithm), []

    def original(m, obj, ids):
        seen.append(ids)
        return "sglang's checks"

    assert guarded(manager) is on
    assert guard_request(original, manager, req(input_ids=[1, 2]), [1, 2]) == "sglang's checks"
    for bad in ([], [1, VOCAB], [-1]):
        if on:
            with pytest.raises(ValueError):
                guard_request(original, manager, req(text="x"), bad)
        else:
            assert guard_request(original, manager, req(text="x"), bad) == "sglang's checks"
    assert seen == ([[1, 2]] if on else [[1, 2], [], [1, VOCAB], [-1]])
    assert not guarded(SimpleNamespace())  # no server_args at all: SGLang's behaviour


@pytest.fixture(scope="module")
def plugin():
    """Register in this process (what the entry point does) and apply the hooks (test_sglang_plugin.py's way)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    import ngramspec_sglang

    ngramspec_sglang.register()
    HookRegistry.apply_hooks()
    return HookRegistry


@pytest.mark.sglang_server
def test_hook_is_registered_on_tokenizer_manager(plugin):
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    assert any(hook is guard_request for _, hook, _ in plugin._hooks[VALIDATE_ONE_REQUEST])
    assert VALIDATE_ONE_REQUEST in plugin._patched
    assert getattr(TokenizerManager._validate_one_request, "__wrapped__", None) is not None


class ReachedSGLang(Exception):
    """SGLang's own `_validate_one_request` body started (its first call is `get_exec()`)."""


class FakeTokenizer:
    is_fast = False

    def encode(self, text):
        return [ord(c) % 100 + 10 for c in text]  # "" -> [] (SmolLM2 adds no BOS either)


@pytest.fixture
def manager(plugin, monkeypatch):
    """SGLang's real TokenizerManager class, its constructor skipped: the attributes tokenization reads."""
    import sglang.srt.managers.tokenizer_manager as tm

    def reached():
        raise ReachedSGLang

    monkeypatch.setattr(tm, "get_exec", reached)
    m = tm.TokenizerManager.__new__(tm.TokenizerManager)
    m.server_args = SimpleNamespace(speculative_algorithm="NGRAM_ADAPTIVE")
    m.model_config = SimpleNamespace(vocab_size=VOCAB, is_embedding_gemma=False,
                                     hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]))
    m.tokenizer, m.mm_processor, m.async_dynamic_batch_tokenizer = FakeTokenizer(), None, None
    return m


def tokenize(manager, obj):
    return asyncio.run(manager._tokenize_one_request(obj))


@pytest.mark.parametrize("body, message", [
    ({"text": ""}, "input_ids cannot be empty. (the text tokenizes to no tokens)"),
    ({"input_ids": [5, 6, 7, VOCAB]}, f"input_ids[3] = {VOCAB} is out of range"),
    ({"input_ids": [-1, 5]}, "input_ids[0] = -1 is out of range"),
    ({"input_ids": [5, VOCAB + 1000]}, f"input_ids[1] = {VOCAB + 1000} is out of range"),
])
@pytest.mark.sglang_server
def test_bad_prompts_stop_in_the_tokenizer_manager(manager, body, message):
    with pytest.raises(ValueError) as e:
        tokenize(manager, req(**body))
    assert str(e.value).startswith(message)


@pytest.mark.sglang_server
@pytest.mark.parametrize("body", [{"text": "hello"}, {"input_ids": [5, 6, VOCAB - 1]}])
def test_good_prompts_reach_sglangs_checks(manager, body):
    with pytest.raises(ReachedSGLang):
        tokenize(manager, req(**body))


@pytest.mark.sglang_server
@pytest.mark.parametrize("body", [{"text": ""}, {"input_ids": [5, VOCAB]}, {"input_ids": [-1]}])
def test_plain_sglang_is_unchanged(manager, body):
    """A control run (no speculative algorithm) passes these on as SGLang 0.5.23 does (to the scheduler's crash)."""
    manager.server_args.speculative_algorithm = None
    with pytest.raises(ReachedSGLang):
        tokenize(manager, req(**body))


@pytest.mark.sglang_server
def test_the_error_is_sglangs_http_400():
    """/generate answers a ValueError from the tokenizer manager with `_create_error_response`, as it does for
    `input_ids cannot be empty.`: status 400, {"error": {"message": ...}}."""
    from sglang.srt.entrypoints.http_server import _create_error_response

    message = input_ids_error([1, VOCAB], VOCAB)
    ours, theirs = _create_error_response(ValueError(message)), _create_error_response(ValueError(EMPTY_INPUT_IDS))
    assert ours.status_code == theirs.status_code == 400
    assert json.loads(ours.body) == {"error": {"message": message}}
    assert json.loads(theirs.body).keys() == json.loads(ours.body).keys()
