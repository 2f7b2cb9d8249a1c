"""`check_finished`'s stop rules on a character-level toy decoder (token i decodes to PIECES[i])."""

import random

from forklm.sampling.sample_state import SampleState, check_finished
from forklm.sampling.params import SamplingParams

PIECES = ["h", "e", "l", "x", "o", "z", "", "xo", "lx", "ozz", "q"]


def decode(ids):
    return "".join(PIECES[i] for i in ids)


def ids_of(text: str) -> list[int]:
    return [PIECES.index(c) for c in text]


def run(ids, params):
    """Feeds ids one at a time; returns (tokens taken, finish_reason, stop_reason, text)."""
    st = SampleState(0)
    for t in ids:
        st.token_ids.append(t)
        st.logprobs.append(0.0)
        if check_finished(st, params, set(), decode):
            break
    return len(st.token_ids), st.finish_reason, st.stop_reason, st.text


def test_stop_string_inside_min_tokens_is_not_acted_on_later():
    """"x" appears at token 5, inside min_tokens=6: neither then nor at token 7 does it stop the sample
    (it used to stop at token 7 with text 'hell', because a longer stop string widened the search)."""
    params = SamplingParams(max_tokens=8, min_tokens=6, stop=("qqqqqq", "x"), ignore_eos=True)
    assert run(ids_of("hellxozh"), params) == (8, "length", None, None)
    # an occurrence that ends after the window counts, even when it begins inside it
    params = SamplingParams(max_tokens=8, min_tokens=6, stop=("qqqqqq", "xoz"), ignore_eos=True)
    assert run(ids_of("hellxozh"), params) == (7, "stop", "xoz", "hell")
    params = SamplingParams(max_tokens=8, min_tokens=6, stop=("qqqqqq", "x"), ignore_eos=True)
    assert run(ids_of("hellxozx"), params) == (8, "stop", "x", "hellxoz")


def reference(ids, params):
    """Decodes everything at every step: the first stop string (by position) among occurrences that
    end after the text of the first min_tokens tokens."""
    base = len(decode(ids[: params.min_tokens]))
    for t in range(1, len(ids) + 1):
        text = decode(ids[:t])
        if t > params.min_tokens:
            hits = [(p, s) for s in params.stop for p in range(len(text)) if text.startswith(s, p)
                    and p + len(s) > base]
            if hits:
                p, s = min(hits)
                return t, "stop", s, text[:p]
        if t >= params.max_tokens:
            return t, "length", None, None


def test_stop_strings_match_decoding_everything():
    rng = random.Random(0)
    stopped = 0
    for trial in range(3000):
        n = rng.randint(1, 40)
        ids = [rng.randrange(len(PIECES)) for _ in range(n)]
        stops = tuple(dict.fromkeys("".join(rng.choice("helxoz") for _ in range(rng.randint(1, 4)))
                                    for _ in range(rng.randint(1, 3))))
        if rng.random() < 0.3:
            stops += ("qqqqqqqq",)  # a long stop string that never matches
        params = SamplingParams(max_tokens=n, min_tokens=rng.randint(0, n), stop=stops, ignore_eos=True)
        got = run(ids, params)
        assert got == reference(ids, params), (trial, ids, stops, params.min_tokens)
        stopped += got[1] == "stop"
    assert stopped > 1000
