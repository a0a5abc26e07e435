"""`serve --record-mix FILE.jsonl`: the server writes the traffic it sees as a trace.

One JSON line per finished request (each sample of an n > 1 request is a request), appended and
flushed as it ends, in the format of data/trace.py, so `mix describe`, `bench --dataset` and
`plan --trace` read the file as it is. No text is written unless `text=True`
(`--record-mix-text`): the prefix structure is kept as hashes instead (`block_hashes`: the
first 16 hex digits of the engine's chained SHA-256 of every full block of prompt + output, salt
included, kv/block_manager.block_hash), from which two requests' shared prefix, and the reuse of a
reply's blocks by the next turn, can be replayed without the text.
"""
from __future__ import annotations

import json
import os
import threading
import time

from mixserve.kv.block_manager import block_hash

HASH_HEX = 16  # 64 bits: collisions stay improbable over billions of blocks


def block_hashes(token_ids: list[int], block_size: int, salt: str | None) -> list[str]:
    """Chained hashes (hex, HASH_HEX digits) of the full blocks of `token_ids`."""
    out, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], salt)
        out.append(parent.hex()[:HASH_HEX])
    return out


class MixRecorder:
    """Appends trace lines to `path` (created if missing). Thread-safe; each line is one
    O_APPEND write, so several processes (the replicas of serve --replicas) can share a file
    without interleaving their lines.

    Args: path; model (the served name, written in every line); block_size (the engine's);
    text: also write the prompt and output text (`prompt`, `output_text`); t0: the time.time()
    that arrival_s counts from (default: now).
    Raises OSError at construction when the file cannot be opened for appending.
    """

    def __init__(self, path: str, model: str, block_size: int, text: bool = False, t0: float | None = None):
        self.path, self.model, self.block_size, self.text = path, model, block_size, text
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()
        self._t0 = time.time() if t0 is None else t0
        self.num_written = 0

    def record(self, *, arrival_wall: float, prompt_ids: list[int], output_ids: list[int], cached_tokens: int,
               finish_reason: str | None, ttft_s: float | None, tpot_s: float | None, tag: str,
               salt: str | None, prompt_text: str | None = None, output_text: str | None = None) -> dict:
        """Write one finished request: arrival_wall in time.time() seconds; ids as served."""
        line = {"arrival_s": round(max(0.0, arrival_wall - self._t0), 6), "arrival_unix": round(arrival_wall, 6),
                "output_tokens": len(output_ids), "cached_tokens": cached_tokens,
                "finish_reason": finish_reason, "ttft_s": ttft_s, "tpot_s": tpot_s, "model": self.model, "tag": tag,
                "block_size": self.block_size,
                "block_hashes": block_hashes(list(prompt_ids) + list(output_ids), self.block_size, salt)}
        if self.text and prompt_text is not None:
            line["prompt"] = prompt_text  # its length is counted again from the text when read
            line["output_text"] = output_text
        else:
            line["prompt_tokens"] = len(prompt_ids)
        if not output_ids:  # max_tokens 0 (prompt scoring): a trace line asks for >= 1 output token
            line["output_tokens"], line["prompt_only"] = 1, True
        data = (json.dumps(line, ensure_ascii=False) + "\n").encode("utf-8")
        with self._lock:
            if self._fd < 0:
                raise ValueError(f"record-mix: {self.path} is closed")
            done = os.write(self._fd, data)
            while done < len(data):  # a short write (disk full, signal): finish the line
                done += os.write(self._fd, data[done:])
            self.num_written += 1
        return line

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
