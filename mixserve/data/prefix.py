"""Prefix structure of a traffic mix: traces whose requests repeat each other's leading tokens,
and what a prefix cache would serve of them.

Three forms, all in one trace format (data/datasets.load_jsonl):

- ``prefix_group`` + ``prefix_tokens``: the prompt's first prefix_tokens tokens are those of
  every request of the group (a shared system prompt; `mix sample --source shared-system-prompt`).
- ``conversation`` + ``turn``: a multi-turn conversation replayed closed-loop (`mix sample
  --source sharegpt-multiturn`). The trace holds each turn's user message; the prompt sent is the
  chat template over the conversation so far *with the model's own replies*, so turn t's prompt
  begins with turn t - 1's prompt and answer, whose KV blocks the cache holds.
- ``block_hashes``: a recorded request's chained block hashes (serve --record-mix).

`stand_ins` turns any of them into stand-in token ids (equal ids exactly where the trace says
tokens repeat), which the planner's simulator feeds to the engine's own block manager and
`reuse_share` to an unbounded cache.
"""
from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from typing import Any

from mixserve.data.datasets import BenchRequest, count_tokens, iter_json_array, sharegpt_path, synthetic_prompt
from mixserve.kv.block_manager import block_hash

_STREAM = -(1 << 52)  # stand-in ids of a prefix group's shared tokens (negative: never a vocabulary id)
_HASHED = -(1 << 60)
_UNIQUE = 1 << 40


def unique_ids(index: int, start: int, end: int) -> list[int]:
    """Stand-in ids for positions [start, end) of request `index` that no other request has
    (above every real vocabulary, below the shared streams' negative ids)."""
    base = _UNIQUE * (index + 1)
    return [base + p for p in range(start, end)]


def sharegpt_conversations(min_turns: int = 4, max_turns: int = 6, path=None) -> list[list[tuple[str, str]]]:
    """ShareGPT conversations with at least `min_turns` (human, gpt) turns, each cut to
    `max_turns` turns, in file order. Turns with an empty side end the conversation there."""
    out = []
    for record in iter_json_array(path or sharegpt_path()):
        conv = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(conv, list):
            continue
        turns, human = [], None
        for t in conv:
            if not isinstance(t, dict) or not isinstance(t.get("value"), str) or not t["value"]:
                break
            if t.get("from") == "human" and human is None:
                human = t["value"]
            elif t.get("from") == "gpt" and human is not None:
                turns.append((human, t["value"]))
                human = None
                if len(turns) == max_turns:
                    break
            else:
                break
        if len(turns) >= min_turns:
            out.append(turns)
    return out


def multiturn_lines(tokenizer: Any, num_conversations: int, seed: int = 0, min_turns: int = 4, max_turns: int = 6,
                    max_message_tokens: int = 256, output_len_cap: int = 128, path=None) -> list[dict]:
    """Trace lines of `num_conversations` seeded ShareGPT conversations (turns in order, one line
    each: ``conversation``, ``turn``, ``prompt`` = the user message, ``max_tokens`` = the
    reference reply's tokens capped at `output_len_cap`, ``output_tokens`` uncapped). Messages
    longer than `max_message_tokens` rule the conversation out. Raises ValueError when too few
    conversations qualify."""
    convs = sharegpt_conversations(min_turns, max_turns, path)
    random.Random(seed).shuffle(convs)
    lines = []
    taken = 0
    for i, turns in enumerate(convs):
        lens = [(count_tokens(tokenizer, u), count_tokens(tokenizer, a)) for u, a in turns]
        if any(u > max_message_tokens or u < 1 or a < 1 for u, a in lens):
            continue
        cid = f"sharegpt-{i}"
        for t, ((u, _), (_, a)) in enumerate(zip(turns, lens), 1):
            lines.append({"conversation": cid, "turn": t, "prompt": u, "max_tokens": min(a, output_len_cap),
                          "output_tokens": a, "tag": "multiturn"})
        taken += 1
        if taken == num_conversations:
            return lines
    raise ValueError(f"sharegpt-multiturn: only {taken} conversations with >= {min_turns} turns and messages of at "
                     f"most {max_message_tokens} tokens (asked for {num_conversations})")


def shared_system_prompt_lines(num: int, num_system_prompts: int = 4, system_prompt_tokens: int = 512,
                               user_tokens: tuple[int, int] = (32, 256), output_tokens: tuple[int, int] = (32, 128),
                               seed: int = 0) -> list[dict]:
    """`num` requests, each starting with one of `num_system_prompts` system prompts of
    `system_prompt_tokens` tokens (chosen uniformly, seeded), then a user part and an output
    of lengths uniform in the given inclusive ranges. Lengths only (``prompt_tokens``): the
    text is made up when the trace is read, the shared part identical across the group."""
    if num < 1 or num_system_prompts < 1 or system_prompt_tokens < 1:
        raise ValueError("shared-system-prompt: num, system prompts and their length must be >= 1")
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        g = rng.randrange(num_system_prompts)
        u = rng.randint(*user_tokens)
        out.append({"prompt_tokens": system_prompt_tokens + u, "prefix_group": f"system-{g}",
                    "prefix_tokens": system_prompt_tokens, "output_tokens": rng.randint(*output_tokens),
                    "tag": "shared-system-prompt"})
    return out


def conversation_messages(req: BenchRequest, history: list[tuple[str, str]]) -> list[dict]:
    """Chat messages of a conversation turn: the system message, earlier (user, reply) turns,
    then this turn's user message."""
    msgs = [{"role": "system", "content": req.system}] if req.system else []
    for u, a in history:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": req.prompt}]


def chat_ids(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids the server sends for `messages` (template with generation prompt, and `tools`
    where given; the template writes its special tokens itself)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **({"tools": tools} if tools else {}))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def conversation_links(reqs: list[BenchRequest], at_once: int | None) -> dict[int, int]:
    """With at most `at_once` conversations in flight: {index of conversation k's first turn:
    index of conversation k - at_once's last turn}, conversations in order of first appearance.
    {} when `at_once` is None. Raises ValueError unless at_once >= 1."""
    if at_once is None:
        return {}
    if at_once < 1:
        raise ValueError(f"conversations_at_once: must be >= 1 (got {at_once})")
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, r in enumerate(reqs):
        if r.conversation is not None:
            first.setdefault(r.conversation, i)
            last[r.conversation] = i
    order = list(first)
    return {first[c]: last[order[k - at_once]] for k, c in enumerate(order) if k >= at_once}


@dataclass
class StandIn:
    """One request for the simulator: stand-in ids of prompt + output, the prompt length, and for
    a conversation turn the index of the turn it follows (sent when that one finishes)."""

    token_ids: list[int]
    prompt_tokens: int
    after: int | None = None


def stand_ins(reqs: list[BenchRequest], tokenizer: Any = None, conversations_at_once: int | None = None) -> list[StandIn]:
    """Stand-in ids for every request (see module docstring): a conversation's turns as the
    template would send them with placeholder replies of each turn's max_tokens (real token ids:
    needs `tokenizer`); group prefixes as a shared stream; recorded hashes as ids derived from
    them; a text prompt as its own token ids when `tokenizer` is given; everything else unique.
    `conversations_at_once`: see conversation_links (a first turn then follows a last turn).
    Raises ValueError for a conversation without a tokenizer, or a turn out of order."""
    links = conversation_links(reqs, conversations_at_once)
    out: list[StandIn] = []
    groups: dict[str, int] = {}
    last_turn: dict[str, tuple[int, list[tuple[str, str]], list[int]]] = {}
    for i, r in enumerate(reqs):
        if r.conversation is not None:
            if tokenizer is None:
                raise ValueError("conversation traces need the model's tokenizer")
            prev = last_turn.get(r.conversation)
            if (prev is None and r.turn != 1) or (prev is not None and r.turn != reqs[prev[0]].turn + 1):
                raise ValueError(f"conversation {r.conversation!r}: turn {r.turn} out of order")
            history = prev[1] if prev else []
            ids = chat_ids(tokenizer, conversation_messages(r, history))
            # the reply as the next turn will hold it: placeholder text of max_tokens tokens
            reply = synthetic_prompt(tokenizer, r.max_tokens, seed=zlib.crc32(f"{r.conversation}/{r.turn}".encode()))
            nxt = chat_ids(tokenizer, conversation_messages(
                BenchRequest("", 1, 1, "", system=r.system), history + [(r.prompt, reply)]))
            out_ids = nxt[len(ids):len(ids) + r.max_tokens] if nxt[:len(ids)] == ids else []
            out.append(StandIn(ids + out_ids, len(ids), prev[0] if prev else links.get(i)))
            last_turn[r.conversation] = (i, history + [(r.prompt, reply)], ids)
            continue
        n = r.prompt_len if r.prompt_len >= 0 else (count_tokens(tokenizer, r.prompt) if tokenizer else 1)
        n = max(1, n)
        if r.block_hashes:
            bs = r.block_size or 16
            ids = [_HASHED - (int(h[:10], 16) << 8) - j for h in r.block_hashes for j in range(bs)]
            ids = ids[:n + r.max_tokens]
            out.append(StandIn(ids + unique_ids(i, len(ids), n), n))
        elif r.prefix_group is not None:
            g = groups.setdefault(r.prefix_group, len(groups))
            k = min(r.prefix_tokens, n)
            base = _STREAM - (g << 26)
            ids = [base - p for p in range(k)]
            if k == n:  # the whole prompt is the group's: so is what follows it
                ids += [base - p for p in range(n, n + r.max_tokens)]
            out.append(StandIn(ids + unique_ids(i, len(ids), n), n))
        elif tokenizer is not None and not r.synthetic:
            ids = tokenizer.encode(r.prompt)[:n] if r.prompt else []
            out.append(StandIn(ids + unique_ids(i, len(ids), n), n))
        else:
            out.append(StandIn(unique_ids(i, 0, n), n))
    return out


def reuse_share(items: list[StandIn], block_size: int = 16) -> dict:
    """What an unbounded prefix cache (no eviction, blocks of `block_size`) would serve, taking
    requests in order: each prompt's longest run of full blocks seen before (in an earlier prompt
    or output), never its last token. Returns {"prompt_tokens", "cached_tokens", "share"}."""
    seen: set[bytes] = set()
    total = cached = 0
    for it in items:
        ids, n = it.token_ids, it.prompt_tokens
        total += n
        parent, hit, open_run = None, 0, True
        hashes = []
        for b in range(len(ids) // block_size):
            parent = block_hash(parent, ids[b * block_size:(b + 1) * block_size])
            hashes.append(parent)
            if open_run and (b + 1) * block_size <= n - 1 and parent in seen:
                hit += block_size
            elif (b + 1) * block_size <= n - 1:
                open_run = False
        cached += hit
        seen.update(hashes)
    return {"prompt_tokens": total, "cached_tokens": cached, "share": cached / total if total else 0.0}
