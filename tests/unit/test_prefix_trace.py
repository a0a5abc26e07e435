"""Prefix structure in traces: reading it, stand-in ids, the cacheable share, the shared-system
and multi-turn samplers, and the simulator's closed loop and cache over it."""
import json

import pytest

from mixserve.data.datasets import BenchRequest, load_jsonl
from mixserve.data.prefix import (StandIn, multiturn_lines, reuse_share, shared_system_prompt_lines, stand_ins)
from mixserve.plan.simulator import SimConfig, SimRequest, simulate
from tests.unit.test_trace import TOK


def _write(path, objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs), encoding="utf-8")
    return path


def test_prefix_group_prompts_share_their_text(tmp_path):
    p = _write(tmp_path / "t.jsonl", [
        {"prompt_tokens": 40, "prefix_group": "sys", "prefix_tokens": 30, "output_tokens": 5},
        {"prompt_tokens": 50, "prefix_group": "sys", "prefix_tokens": 30, "output_tokens": 5},
        {"prompt_tokens": 40, "prefix_group": "other", "prefix_tokens": 30, "output_tokens": 5}])
    a, b, c = load_jsonl(p, TOK)
    assert (a.prompt_len, b.prompt_len, c.prompt_len) == (40, 50, 40)
    assert a.prompt.split()[:30] == b.prompt.split()[:30] != c.prompt.split()[:30]
    assert a.prompt.split()[30:] != b.prompt.split()[30:40]
    share = reuse_share(stand_ins([a, b, c], TOK), block_size=10)
    assert share["cached_tokens"] == 30 and share["prompt_tokens"] == 130


@pytest.mark.parametrize("line, msg", [
    ({"prompt_tokens": 10, "prefix_group": "g", "prefix_tokens": 11}, "exceeds the prompt"),
    ({"prompt_tokens": 10, "prefix_group": "", "prefix_tokens": 5}, "'prefix_group' must be"),
    ({"prompt": "a b", "conversation": "c"}, "'turn' must be a positive integer"),
    ({"prompt_tokens": 10, "block_hashes": ["ab" * 8]}, "'block_size' must be"),
    ({"prompt_tokens": 10, "block_hashes": "ab", "block_size": 4}, "'block_hashes' must be a list"),
    ({"prompt_tokens": 10, "block_hashes": ["zz" * 8], "block_size": 4}, "hex strings"),
    ({"prompt_tokens": 4, "output_tokens": 1, "block_hashes": ["ab" * 8] * 2, "block_size": 4}, "more than the"),
    ({"prompt_tokens": 10, "prefix_tokens": 5}, "needs 'prefix_group'"),
    ({"prompt": "a b", "conversation": "c", "turn": 2}, "turn 2 where turn 1 comes next"),
])
def test_bad_prefix_fields_name_the_line(tmp_path, line, msg):
    p = _write(tmp_path / "t.jsonl", [line])
    with pytest.raises(ValueError, match=msg) as e:
        load_jsonl(p, TOK)
    assert ":1:" in str(e.value)


def test_recorded_hashes_replay_their_sharing():
    h = ["aa" * 8, "bb" * 8, "cc" * 8]
    reqs = [BenchRequest("", 4, 10, "x", block_hashes=h[:2] + ["dd" * 8], block_size=4),
            BenchRequest("", 4, 10, "x", block_hashes=h, block_size=4)]
    s = stand_ins(reqs)
    assert s[0].token_ids[:8] == s[1].token_ids[:8] and s[0].token_ids[8:12] != s[1].token_ids[8:12]
    assert len(s[0].token_ids) == 12 and s[0].prompt_tokens == 10  # the output past the hashed blocks: unique
    assert reuse_share(s, block_size=4)["cached_tokens"] == 8


def test_shared_system_prompt_lines_are_seeded():
    a = shared_system_prompt_lines(20, 3, 64, seed=1)
    assert a == shared_system_prompt_lines(20, 3, 64, seed=1) != shared_system_prompt_lines(20, 3, 64, seed=2)
    assert {x["prefix_group"] for x in a} <= {"system-0", "system-1", "system-2"}
    assert all(x["prefix_tokens"] == 64 < x["prompt_tokens"] for x in a)


class ChatTok:
    """Whitespace tokens and a plain chat template: `<role> words ... </s>` per message."""

    chat_template = "plain"

    def encode(self, text, add_special_tokens=False):
        return [hash(w) % 100000 for w in text.split()]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": self.encode(text)}

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=True):
        return " ".join(f"<{m['role']}> {m['content']} </s>" for m in msgs) + (" <assistant>" if add_generation_prompt else "")


def test_multiturn_lines_and_the_closed_loop(tmp_path):
    def conv(i, n):
        turns = []
        for t in range(n):
            turns += [{"from": "human", "value": f"q{i} t{t} " + "word " * 4}, {"from": "gpt", "value": "a " * 6}]
        return {"conversations": turns}
    src = tmp_path / "sg.json"
    src.write_text(json.dumps([conv(0, 4), conv(1, 2), conv(2, 5)]))  # the second is too short
    lines = multiturn_lines(ChatTok(), 2, seed=0, min_turns=4, max_turns=4, output_len_cap=4, path=src)
    assert len(lines) == 8 and [x["turn"] for x in lines] == [1, 2, 3, 4] * 2
    assert all(x["max_tokens"] == 4 and x["output_tokens"] == 6 for x in lines)
    with pytest.raises(ValueError, match="only 2 conversations"):
        multiturn_lines(ChatTok(), 3, min_turns=4, path=src)
    p = _write(tmp_path / "mt.jsonl", lines)
    reqs = load_jsonl(p, ChatTok())
    items = stand_ins(reqs, ChatTok())
    assert [it.after for it in items] == [None, 0, 1, 2, None, 4, 5, 6]
    # turn t's prompt holds turn t-1's prompt and (placeholder) reply
    for prev, cur in zip(items[:3], items[1:4]):
        assert cur.token_ids[:len(prev.token_ids)] == prev.token_ids and cur.prompt_tokens > len(prev.token_ids)
    assert reuse_share(items, block_size=2)["share"] > 0.5
    sims = [SimRequest(it.prompt_tokens, r.max_tokens, 0.0, r.tag, token_ids=it.token_ids, after=it.after)
            for it, r in zip(items, reqs)]
    cost = lambda b: 0.01 + 0.001 * b.num_tokens  # noqa: E731  (a step costs its tokens)
    res = simulate(sims, SimConfig(num_blocks=400, block_size=2, prefix_caching=True), cost)
    for i, it in enumerate(items):
        if it.after is not None:  # each turn arrives when the one before finished
            assert res.metrics[i].arrival_s == pytest.approx(res.metrics[it.after].finish_s)
    assert res.prefix_hit_rate > 0.5
    off = simulate(sims, SimConfig(num_blocks=400, block_size=2), cost)
    assert off.prefix_hit_rate == 0 and off.duration_s > res.duration_s


def test_stand_ins_unique_without_structure():
    reqs = [BenchRequest("a b c", 2, 3, "x", synthetic=True), BenchRequest("a b c", 2, 3, "x", synthetic=True)]
    s = stand_ins(reqs)
    assert s[0].token_ids != s[1].token_ids and reuse_share(s, 1)["cached_tokens"] == 0
    same_text = [BenchRequest("a b c d", 2, 4, "x"), BenchRequest("a b c d", 2, 4, "x")]
    assert reuse_share(stand_ins(same_text, ChatTok()), 1)["cached_tokens"] == 3  # never the last token
    assert isinstance(s[0], StandIn)
