"""A GGUF file's native layout (layers/gguf_linear.GGUFWeight) kept on disk and read at the next
start (issue 32).

Loading a GGUF natively parses its header (the vocabulary's 151k strings: 2.2 s for the 0.5B on
a 2-core EPYC) and repacks every quantized tensor into the kernel's planes (7.2 s for both;
benchmarks/native_load.py), each start.
The first start therefore writes the repacked tensors, the float ones (norms, biases), the model's
config and the file's block-type counts to a folder under `<cache root>/native/` (one safetensors
file, packed_weights.FILE, and DONE; about the GGUF's size), on a thread once the weights are
built, and later starts read that file instead of the GGUF.

The store is keyed by the file (resolved path, size, modification time) and the layout's version
(`LAYOUT`); the key is written inside it too, so a store copied in from another file is not
taken. Where the file's inode or change time differ from those recorded (a copy into an image, an
overwrite that set the modification time back: no write leaves the change time as it was), the
whole file's sha256, written beside them, decides (~0.5 s a GB); once a new store is written, the stores of the same path's
earlier versions are removed (packed_weights.remove_stale). Every tensor's checksum and the description's (types, shapes,
config) are checked at load (packed_weights.read_store): one missing or failing (a cut, corrupt or
foreign file) and the GGUF is read and repacked again, and the store rewritten. The write is a temporary folder renamed into place (env.publish_dir); where the cache
root cannot be written, the engine repacks at every start and says so (env.note_unkept).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch

from mixserve.env import cache_root
from mixserve.models import packed_weights
from mixserve.models.config import ModelConfig

log = logging.getLogger("mixserve")

# bump when GGUFWeight.from_blocks' planes, the Q/K row order of llama files
# (weights._unpermute) or what this file stores changes
LAYOUT = 2
META = "__mixserve_native__"
WHAT = "the GGUF's native layout"


def source_id(gguf_path: str | Path) -> str:
    """The identity of a GGUF file a store stands for: resolved path, size, modification time (ns)."""
    p = Path(gguf_path).resolve()
    st = p.stat()
    return json.dumps([str(p), st.st_size, st.st_mtime_ns, LAYOUT])


def file_digest(gguf_path: str | Path) -> str:
    """sha256 of the whole file (~0.5 s per GB here): checked only where the file's inode or change
    time differ from those the store recorded, which a copy into an image or a hard link also does."""
    h = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _inode(gguf_path: str | Path) -> list[int]:
    st = os.stat(gguf_path)
    return [st.st_ino, st.st_ctime_ns]


def store_path(gguf_path: str | Path) -> Path:
    """Where the native layout of `gguf_path` is kept: `<cache root>/native/<file name>-<key>`
    ($MIXSERVE_NATIVE_CACHE in place of `<cache root>/native`). Raises OSError where the file
    cannot be stat'ed."""
    base = Path(os.environ["MIXSERVE_NATIVE_CACHE"]) if os.environ.get("MIXSERVE_NATIVE_CACHE") else \
        cache_root() / "native"
    key = hashlib.sha256(source_id(gguf_path).encode()).hexdigest()[:16]
    return base / f"{Path(gguf_path).name}-{key}"


def load(path: Path, gguf_path: str | Path) -> tuple[ModelConfig, dict, dict] | None:
    """(config, {HF name: GGUFWeight or float32 tensor}, {GGUF type: [tensor count, bytes in the
    file]}) as read_gguf_native returns them, from a complete store at `path` written for this
    very file; None where there is none, or it is cut short, unreadable, foreign (written for
    another file or layout), or any tensor is missing or fails its checksum (logged)."""
    from mixserve.host_memory import own_copy
    from mixserve.layers.gguf_linear import GGUFWeight

    # every tensor copied out of the file's map (planes of 2 MB or more onto huge pages): a view
    # kept would keep the whole file resident beside the copies (+390 MB RSS on the 0.5B)
    tensors, meta = packed_weights.read_store(path, place=own_copy)
    if not meta:
        return None
    try:
        text = meta[META]
        if meta.get(META + "sha256") != hashlib.sha256(text.encode()).hexdigest():
            raise ValueError("its description fails its checksum")
        facts = json.loads(text)
        if facts["source"] != source_id(gguf_path):
            log.warning("the native layout in %s was written for another file (%s); repacking", path, facts["source"])
            return None
        if facts["inode"][:2] != _inode(gguf_path):
            # the same path, size and time, but not the same inode (a copy that kept the time, an
            # image) or changed since (an overwrite that set the time back): the content decides
            t0 = time.perf_counter()
            same = file_digest(gguf_path) == facts["inode"][2]
            log.info("%s: its inode or change time differ from the kept layout's; content %s (%.1f s)",
                     Path(gguf_path).name, "the same" if same else "changed", time.perf_counter() - t0)
            if not same:
                log.warning("the native layout in %s was written for another content of %s; repacking", path,
                            gguf_path)
                return None
        index = facts["tensors"]
        if set(index) != set(tensors) or any(index[n] != [str(t.dtype), list(t.shape), meta[n]]
                                             for n, t in tensors.items()):
            raise ValueError("its tensors are not the ones it lists (names, dtypes, shapes, checksums)")
        weights: dict = {name: tensors[name] for name in facts["floats"]}
        for name, (qtype, n, k, group, superblock, hb, zero, empty) in facts["quantized"].items():
            parts = {t: torch.empty(0, dtype=getattr(torch, empty[t])) if t in empty else tensors[f"{name}#{t}"]
                     for t in GGUFWeight.TENSORS}
            if any(v.numel() and v.shape[0] != -(-n // 16) for v in parts.values()):
                raise ValueError(f"{name}: a plane of another panel count than {n} rows make")
            weights[name] = GGUFWeight(qtype, n, k, parts, group, superblock, hb, zero)
        return ModelConfig(**facts["config"]), weights, facts["types"]
    except Exception as e:  # noqa: BLE001 -- a tensor failed its checksum, or damaged metadata: repack
        log.warning("the native layout in %s is incomplete or damaged (%s: %s); repacking", path, type(e).__name__, e)
        return None


def save_in_background(path: Path, gguf_path: str | Path, cfg: ModelConfig, weights: dict,
                       types: dict) -> threading.Thread:
    """Write what read_gguf_native returned for `gguf_path` to a store at `path`, on a daemon thread
    (packed_weights.save_tensors_in_background: replaced whole, never half-written; the CLI's
    exit and atexit wait for it). Returns the thread."""
    from mixserve.layers.gguf_linear import GGUFWeight

    tensors: dict[str, torch.Tensor] = {}
    floats, quantized = [], {}
    for name, w in weights.items():
        if isinstance(w, GGUFWeight):
            empty = {}
            for t in GGUFWeight.TENSORS:
                v = getattr(w, t)
                if v.numel():
                    tensors[f"{name}#{t}"] = v.contiguous()
                else:  # empty planes are shared module-level tensors, which safetensors refuses to store
                    empty[t] = str(v.dtype).removeprefix("torch.")
            quantized[name] = [w.qtype, w.out_features, w.in_features, w.group, w.superblock, w.hb, w.zero, empty]
        else:
            tensors[name] = w.contiguous()
            floats.append(name)
    facts = {"source": source_id(gguf_path), "config": asdict(cfg),
             "types": types, "floats": floats, "quantized": quantized,
             "tensors": {n: [str(t.dtype), list(t.shape), packed_weights.checksum(t)] for n, t in tensors.items()}}

    def meta() -> dict[str, str]:  # on the writer's thread: the whole file's digest is ~0.5 s a GB
        facts["inode"] = _inode(gguf_path) + [file_digest(gguf_path)]
        text = json.dumps(facts)
        return {META: text, META + "sha256": hashlib.sha256(text.encode()).hexdigest()}
    return packed_weights.save_tensors_in_background(path, tensors, meta, WHAT, slot=str(Path(gguf_path).resolve()))
