"""Decode steps replayed from CUDA graphs (the GPU's counterpart of engine/decode_graph.py).

A decode step of a small model on a GPU is launch-bound: the 1.5B's ~700 kernels at a few
microseconds of launch each cost more than reading its 3 GB of bf16 weights at 4.8 TB/s. A CUDA
graph records the step's kernels once and replays them with one launch (as vLLM and SGLang do).
A graph fixes every shape and address, so:

- steps are captured per bucket (rows R, block-table width W): R from `row_buckets`, W a power of
  two of blocks up to max_model_len / block_size; a step runs in the smallest bucket that holds it;
- the batch (token ids, positions, slot mapping, context lengths, block tables) is written into
  one static int64 device buffer by one copy from the step's pinned host buffer (device.HostStager);
- padding rows write their K/V into the runner's sink block (`ModelRunner.pad_block`, never a
  sequence's) with context length 1, and their logits are dropped; padding table entries name the
  sink block too, and the attention mask hides them (layers/attention.gathered_decode_attention);
- graphs are captured lazily, at a bucket's first step, into one shared memory pool.

Only decode-only steps whose every row samples one token are replayed; prefill chunks,
speculative verification, prompt scoring and batches past the largest bucket run eagerly, which
stays the reference (`--kernels eager` turns the graphs off).

On the CPU the same class runs the step function directly on its static buffers instead of
replaying a graph (`capture=False`), which is how the bucketing and padding are tested without a
GPU.
"""
from __future__ import annotations

import torch


def row_buckets(max_rows: int) -> list[int]:
    """Captured row counts: 1, 2, 4, 8, then every 8 up to max_rows (vLLM's spacing), and
    max_rows itself. Raises ValueError for max_rows < 1."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1 (got {max_rows})")
    out = [r for r in (1, 2, 4, 8) if r <= max_rows] + list(range(16, max_rows + 1, 8))
    if out[-1] != max_rows:
        out.append(max_rows)
    return out


def width_buckets(max_blocks: int) -> list[int]:
    """Captured block-table widths: powers of two below max_blocks, and max_blocks."""
    out, w = [], 1
    while w < max_blocks:
        out.append(w)
        w *= 2
    return out + [max_blocks]


def _bucket(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} is past the largest bucket {buckets[-1]}")


class CudaGraphDecoder:
    """`model.decode` replayed from graphs captured per (rows, width) bucket.

    Args:
        runner: the ModelRunner (its model, block size, stager, and `pad_block`, the sink block,
            which must not be None).
        max_rows: the most rows a replayed step takes (the engine's max_num_seqs, capped).
        max_blocks: block-table width for max_model_len.
        capture: record CUDA graphs (True on CUDA); False calls the function directly (CPU tests).
    Raises ValueError when the runner has no sink block.
    """

    def __init__(self, runner, max_rows: int, max_blocks: int, capture: bool | None = None):
        if runner.pad_block is None:
            raise ValueError("the model runner has no sink block for padding rows (pad_block)")
        self.runner = runner
        self.model = runner.model
        self.device = runner.device
        self.block_size = runner.block_size
        self.capture = runner.device.type == "cuda" if capture is None else capture
        self.rows = row_buckets(max_rows)
        self.widths = width_buckets(max_blocks)
        self.max_rows = self.rows[-1]
        R, W = self.max_rows, self.widths[-1]
        # one static buffer: ids, positions, slots, lens [R] each, then tables [R, W]
        self.static = torch.zeros(4 * R + R * W, dtype=torch.long, device=self.device)
        self.graphs: dict[tuple[int, int], tuple] = {}  # (R, W) -> (graph or None, output logits)
        self.pool = None
        self.outs: dict[int, torch.Tensor] = {}  # rows -> float32 [rows, vocab] logits the graphs write
        self.num_steps = 0
        self.num_captures = 0
        self.compile_s: dict[str, float] = {}  # DecodeGraph's field, read by describe(): nothing compiled here

    def accepts(self, items) -> bool:
        """True for a decode-only batch (one new token per row, each sampled) of at most max_rows."""
        return 0 < len(items) <= self.max_rows and all(it.end - it.start == 1 and it.num_logits == 1
                                                        for it in items)

    def _views(self, R: int, W: int):
        """The static buffer's views for bucket (R, W), laid out as `run` packs them."""
        s = self.static
        ids, pos, slots, lens = (s[i * R:(i + 1) * R] for i in range(4))
        tables = s[4 * R:4 * R + R * W].view(R, W)
        return ids, pos, slots, tables, lens

    def _step(self, R: int, W: int) -> torch.Tensor:
        ids, pos, slots, tables, lens = self._views(R, W)
        with torch.inference_mode():
            return self.model.decode(ids, pos, slots, tables, lens)

    def _graph(self, R: int, W: int):
        key = (R, W)
        if key in self.graphs:
            return self.graphs[key]
        if not self.capture:
            self.graphs[key] = (None, None)
            return self.graphs[key]
        # warm-up on a side stream (cuBLAS workspaces, lazy inits) before recording, as
        # torch.cuda.graphs asks; its K/V writes land in the sink block (the buffer is padding)
        self._fill_padding(R, W)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(R, W)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        if R not in self.outs:  # one logits buffer per row count, shared by its widths' graphs
            self.outs[R] = torch.empty(R, self.runner.cfg.vocab_size, dtype=torch.float32, device=self.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            self.outs[R].copy_(self._step(R, W))  # the step's own output dies here: the pool reuses it
        self.num_captures += 1
        self.graphs[key] = (g, self.outs[R])
        return self.graphs[key]

    def _fill_padding(self, R: int, W: int) -> None:
        ids, pos, slots, tables, lens = self._views(R, W)
        pad = self.runner.pad_block
        ids.zero_()
        pos.zero_()
        slots.fill_(pad * self.block_size)
        lens.fill_(1)
        tables.fill_(pad)

    def run(self, items, block_table) -> torch.Tensor:
        """Float32 logits [len(items), vocab] in `items`' order; block_table(seq_id) -> its blocks.
        Raises ValueError for a batch `accepts` refuses."""
        if not self.accepts(items):
            raise ValueError("not a decode-only batch within the captured sizes")
        bs, n, pad = self.block_size, len(items), self.runner.pad_block
        tables = [block_table(it.seq_id)[:it.start // bs + 1] for it in items]
        R = _bucket(self.rows, n)
        W = _bucket(self.widths, max(len(t) for t in tables))
        ids = [it.token_ids[it.start] for it in items] + [0] * (R - n)
        pos = [it.start for it in items] + [0] * (R - n)
        slots = [t[it.start // bs] * bs + it.start % bs for it, t in zip(items, tables)] + [pad * bs] * (R - n)
        lens = [it.start + 1 for it in items] + [1] * (R - n)
        flat = ids + pos + slots + lens
        for t in tables:
            flat += t + [pad] * (W - len(t))
        flat += [pad] * (W * (R - n))
        graph, out = self._graph(R, W)
        # the step's one host-to-device copy, then one device copy into the graph's inputs
        self.static[:len(flat)].copy_(self.runner.stager.upload(flat))
        if graph is None:
            out = self._step(R, W)
        else:
            graph.replay()
        self.num_steps += 1
        return out[:n].clone()  # the static output is overwritten by the next replay
