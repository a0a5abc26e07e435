"""Turns a SchedulerOutput into one flat, unpadded batch and runs the model over the paged cache.

Batch layout (design sketch): decode rows first (one token each), then prefill chunks; all
tokens concatenated; `slot_mapping` says where each token's K/V go; block tables say where each
sequence's context is. Only the rows that sample get logits.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from mixserve.device import HostStager
from mixserve.host_memory import empty_zeroed, populate_in_background
from mixserve.kv.block_manager import BlockManager
from mixserve.layers.attention import AttentionMetadata, DecodeGroup, PrefillSpan
from mixserve.engine.sampler import token_logprobs
from mixserve.models.config import ModelConfig

log = logging.getLogger("mixserve")

# Decode rows are split into a new attention group once the next row's context is shorter than
# _GROUP_RATIO of the group's longest and the group has _MIN_GROUP rows: less padding to gather.
_GROUP_RATIO = 0.7
# prompt scoring: LM-head rows per slice (64 x 151,936 float32 logits = 39 MB at a time)
SCORE_SLICE_ROWS = 64
_MIN_GROUP = 8


def decode_group_bounds(contexts: list[int]) -> list[tuple[int, int]]:
    """Row ranges [start, end) of the decode attention groups for rows sorted by context length
    (tokens, longest first): a group closes once it has _MIN_GROUP rows and the next context is
    under _GROUP_RATIO of its first. The planner's step model (plan/step_time.py) uses the same
    split to cost a step as the engine runs it."""
    out, start = [], 0
    for i in range(len(contexts)):
        if i + 1 == len(contexts) or (i + 1 - start >= _MIN_GROUP
                                      and contexts[i + 1] < _GROUP_RATIO * contexts[start]):
            out.append((start, i + 1))
            start = i + 1
    return out


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device="cpu"):
    """Per-layer K and V caches, each [num_blocks, block_size, num_kv_heads, head_dim], zeroed
    (padding positions of the batched decode read them; zeros keep them finite)."""
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    if torch.device(device).type != "cpu":
        return ([torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)],
                [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)])
    return [empty_zeroed(shape, dtype) for _ in range(cfg.num_layers)], \
        [empty_zeroed(shape, dtype) for _ in range(cfg.num_layers)]


@dataclass
class BatchItem:
    """Positions [start, end) of one sequence, computed this step.

    token_ids: the sequence's tokens (at least `end` of them); num_logits: how many of the last
    positions of the span need next-token logits (0 for a prefill chunk that does not reach the
    end, 1 for a normal step, K+1 for speculative verification).
    score: prompt scoring, positions [a, b) inside [start, end) whose next token token_ids[p + 1]
    is scored (its logprob, rank and the top_k alternatives); `run` fills `scores` with one
    sampler.TokenLogprobs per position, computed from the same forward.
    """

    seq_id: int
    token_ids: list[int]
    start: int
    end: int
    num_logits: int = 1
    score: tuple[int, int] | None = None
    top_k: int = 0
    scores: list | None = None


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [N]
    items: list[BatchItem]  # in logits order: item i owns the next items[i].num_logits rows
    score_rows: list[int] = field(default_factory=list)  # rows scored (prompt logprobs), by item
    score_items: list[BatchItem] = field(default_factory=list)  # items with a score span, in that order


class ModelRunner:
    """Owns a model and its KV cache; `run` executes one forward pass over a flat batch.

    Args:
        model: a module with `bind_kv_cache` and forward(input_ids, positions, meta, logits_indices).
        cfg: model config; block_manager: the allocator whose tables address the cache.
        num_blocks, block_size: cache geometry; dtype: cache dtype.
        device: where the cache and every batch tensor live (the model's device).
    """

    def __init__(self, model, cfg: ModelConfig, block_manager: BlockManager, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 sink_block: bool | None = None):
        self.model = model
        self.cfg = cfg
        self.bm = block_manager
        self.block_size = block_size
        self.device = torch.device(device)
        self.stager = HostStager(self.device)
        # one block more than the allocator hands out, never a sequence's: on CUDA the sink that a
        # captured decode graph's padding rows write to (engine/cuda_graph.py), on the CPU the
        # scratch block a decode graph's background warm-up runs on (decode_graph.BackgroundGraph)
        if sink_block is None:
            sink_block = True
        self.pad_block = num_blocks if sink_block else None
        self.k_caches, self.v_caches = allocate_kv_cache(cfg, num_blocks + (self.pad_block is not None), block_size,
                                                         dtype, self.device)
        model.bind_kv_cache(self.k_caches, self.v_caches)
        self.kv_populate = None  # the thread faulting the cache's pages in (populate_kv_cache)
        self.num_blocks = num_blocks
        self.num_forwards = 0
        self.graph = None  # a DecodeGraph (CPU) or CudaGraphDecoder (CUDA) once chosen
        self.graph_choice = "eager"
        self.pending_graph = None  # a decode_graph.BackgroundGraph until it is installed
        self.graph_trial = None  # a decode_graph.GraphTrial while the graph's choice is measured on live steps

    def populate_kv_cache(self):
        """Start faulting the CPU KV cache's pages in on a thread (host_memory.populate_in_background),
        once, so that the steps that first write its blocks do not pay it; returns the thread (None
        on CUDA or where there is nothing to do). For engines that serve: a short-lived engine
        touches only the blocks it uses, and on the AMX Xeon VM populating costs ~2.5 s of one core a GiB."""
        if self.kv_populate is None and self.device.type == "cpu":
            self.kv_populate = populate_in_background(self.k_caches + self.v_caches, "kv-populate")
        return self.kv_populate

    def use_cuda_graphs(self, max_model_len: int, max_rows: int, capture: bool | None = None) -> str:
        """Replay decode-only steps from CUDA graphs (engine/cuda_graph.py), captured lazily per
        (rows, block-table width) bucket. Returns the choice as `describe` states it."""
        from mixserve.engine.cuda_graph import CudaGraphDecoder

        self.graph = CudaGraphDecoder(self, max_rows, -(-max_model_len // self.block_size), capture)
        self.graph_choice = f"cuda graphs (rows {self.graph.rows[0]}..{self.graph.max_rows}, captured lazily)"
        return self.graph_choice

    def choose_decode_graph(self, chooser, max_model_len: int, max_rows: int, background: bool = False,
                            off: bool = False) -> str:
        """Capture decode-only steps in a compiled graph (engine/decode_graph.py) where `chooser`
        (layers/kernel_choice.py, key `decode_graph/...`) measures it faster than eager steps, or
        an override or the cache says so. Returns "compiled", "eager", "trial" (below), or why the
        graph is unsupported. background: a graph chosen without timing it (cache, override) is compiled
        or loaded on a thread while steps run eager, and installed when ready (`install_graph`);
        a graph that was just timed is compiled already and used at once; a choice nobody knows
        yet (not in the cache, no override, timing "measure") is not timed before serving: the
        graph compiles on a thread and, once installed, is timed against eager steps on live
        traffic (decode_graph.GraphTrial), so a first start waits for no compile. off: no graph,
        nothing timed (EngineArgs graph_warmup "off")."""
        from mixserve.engine.decode_graph import (BackgroundGraph, DecodeGraph, GraphTrial, decode_graph_candidates,
                                                  graph_supported, max_graph_rows, warm_up)

        if off:
            self.graph_choice = "eager (--graph-warmup off)"
            return self.graph_choice
        why = graph_supported(self.model)
        rows = max_graph_rows(self.model, max_rows)
        if why is None and rows < 1:
            why = "int4 layers leave the graph at every row count"
        if why is not None:
            self.graph_choice = f"eager ({why})"
            return self.graph_choice
        c = self.cfg
        q = getattr(self.model, "quant", None)
        from mixserve.layers.gguf_linear import KERNEL_KEY, GGUFLinear

        # the weights' kernels decide what a step costs beside its ops: a native GGUF model is timed
        # apart from a dense one of the same shape (it was not before issue 43's sixth round, whose
        # C++ norm and SwiGLU also changed the graph: "g2")
        native = any(isinstance(m, GGUFLinear) for m in self.model.modules())
        weights = f"int4g{q.group_size}" if q is not None else f"gguf-{KERNEL_KEY}" if native else "dense"
        key = (f"decode_graph/{str(self.model.dtype).removeprefix('torch.')}/{c.num_layers}x{c.hidden_size}x"
               f"{c.num_heads}x{c.num_kv_heads}x{c.intermediate_size}x{c.vocab_size}/{weights}/g2")
        made: list = []

        def make_graph():
            if not made:
                made.append(DecodeGraph(self.model, self.block_size, -(-max_model_len // self.block_size), rows))
            return made[0]

        forwards = self.num_forwards
        try:
            candidates = decode_graph_candidates(self, make_graph, rows, max_model_len=max_model_len)
            if (background and chooser.timing == "measure" and "compiled" in candidates
                    and chooser.known(key, candidates) is None):
                self.pending_graph = BackgroundGraph(self, make_graph)
                self.graph_trial = GraphTrial(chooser, key)
                self.graph_choice = ("compiled on trial (compiling in the background, then timed against eager "
                                     "steps on live traffic; kept where faster)")
                log.warning("decode graph: not yet timed on this machine; it compiles in the background while "
                            "steps run eager, then %d of its steps are timed against as many eager ones (cached in %s)",
                            GraphTrial.PAIRS, chooser.path)
                return "trial"
            pick = chooser.choose(key, candidates, "eager")
            if pick == "compiled" and background and not made:  # chosen without timing it: nothing compiled yet
                self.pending_graph = BackgroundGraph(self, make_graph)
                self.graph_choice = "compiled (loading in the background: steps run eager until it is ready)"
                return "compiled"
            graph = make_graph() if pick == "compiled" else None
            if pick == "compiled":
                warm_up(self, graph, scratch=self.pad_block)
        except ValueError:  # an override naming no candidate: the caller's error
            raise
        except Exception as e:  # Inductor could not compile here (no compiler, an op it cannot take)
            log.warning("decode graph unavailable, decode steps run eager: %s: %s", type(e).__name__, e)
            for kc, vc in zip(self.k_caches, self.v_caches):
                kc.zero_()
                vc.zero_()
            self.num_forwards = forwards
            self.graph, self.graph_choice = None, f"eager (compile failed: {type(e).__name__})"
            return self.graph_choice
        # the timing and warm-up steps are not the engine's
        self.num_forwards = forwards
        if graph is not None:
            graph.num_steps = 0
        self.graph = graph
        self.graph_choice = pick
        return pick

    def prepare(self, items: list[BatchItem], block_table=None) -> PreparedBatch:
        """The flat batch for `items`; block_table(seq_id) -> its blocks (default: the block
        manager's). Every int64 tensor of the batch (ids, positions, slot mapping, logits rows,
        decode groups' block tables and context lengths, a later prefill chunk's context blocks) is
        a view of one buffer sent to the device in one copy (device.HostStager); a later chunk's
        gather slots and mask are made on the device from its blocks and positions."""
        bs = self.block_size
        block_table = block_table or self.bm.block_table
        # longest context first, so that groups of similar length form (see DecodeGroup)
        decode = sorted((it for it in items if it.end - it.start == 1), key=lambda it: -it.start)
        multi = [it for it in items if it.end - it.start > 1]
        if getattr(self.model, "batch_invariant", False):
            return self._prepare_rows(decode, multi, block_table)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        score_rows: list[int] = []
        for i, it in enumerate(decode):
            p = it.start
            table = block_table(it.seq_id)
            ids.append(it.token_ids[p])
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            if it.num_logits:
                logit_rows.append(i)
            if it.score:
                score_rows += [i + q - it.start for q in range(*it.score)]
        groups = []  # (start, end, padded tables, context lengths)
        for start, end in decode_group_bounds([it.start + 1 for it in decode]):
            # only the blocks that hold context: a table may reach further (a contiguous region)
            tables = [block_table(it.seq_id)[:it.start // bs + 1] for it in decode[start:end]]
            width = max(len(t) for t in tables)
            groups.append((start, end, [b for t in tables for b in t + [0] * (width - len(t))],
                           [it.start + 1 for it in decode[start:end]]))
        spans = []  # (row0, row1, context length, the blocks holding it, or None: a first chunk gathers nothing)
        for it in multi:
            row0 = len(ids)
            ids.extend(it.token_ids[it.start:it.end])
            pos.extend(range(it.start, it.end))
            table = block_table(it.seq_id)
            slots.extend(table[q // bs] * bs + q % bs for q in range(it.start, it.end))
            # a later chunk reads its whole context: its blocks go up, the slots are made on the device
            spans.append((row0, len(ids), it.end, table[:-(-it.end // bs)] if it.start else None))
            logit_rows += range(len(ids) - it.num_logits, len(ids))
            if it.score:
                score_rows += [row0 + q - it.start for q in range(*it.score)]
        T = len(ids)
        flat = ids + pos + slots + logit_rows
        for _, _, tables, lens in groups:
            flat += tables + lens
        for *_, blocks in spans:
            flat += blocks or []
        buf = self.stager.upload(flat)
        views = iter(buf.split([T, T, T, len(logit_rows)]
                               + [n for _, _, t, c in groups for n in (len(t), len(c))]
                               + [len(b) for *_, b in spans if b]))
        input_ids, positions, slot_mapping, logits_indices = (next(views) for _ in range(4))
        meta = AttentionMetadata(slot_mapping=slot_mapping, num_decode=len(decode))
        for start, end, _, lens in groups:
            bt = next(views).view(end - start, -1)
            meta.decode_groups.append(DecodeGroup(start, end, bt, next(views)))
        for row0, row1, end, blocks in spans:
            if blocks is None:
                meta.prefills.append(PrefillSpan(row0, row1, None, None))
                continue
            q = torch.arange(end, device=buf.device)
            gather = next(views)[q // bs] * bs + q % bs
            meta.prefills.append(PrefillSpan(row0, row1, gather, q[None, :] <= positions[row0:row1, None]))
        return PreparedBatch(
            input_ids=input_ids,
            positions=positions,
            meta=meta,
            logits_indices=logits_indices,
            items=[it for it in decode + multi if it.num_logits],
            score_rows=score_rows,
            score_items=[it for it in decode + multi if it.score],
        )

    def _prepare_rows(self, decode: list[BatchItem], multi: list[BatchItem], block_table) -> PreparedBatch:
        """`prepare` for batch-invariant mode (layers/batch_invariance.py): the same flat batch
        (`decode` rows, longest context first, then the `multi`-token chunks), with attention metadata
        for every row alike (AttentionMetadata.rows): one block table per sequence, and per row
        that table's index and the row's context (its position + 1). One upload, as `prepare`."""
        bs = self.block_size
        ids, pos, slots, logit_rows, score_rows, row_table = [], [], [], [], [], []
        tables: list[list[int]] = []
        for it in decode + multi:
            row0 = len(ids)
            table = block_table(it.seq_id)
            ids.extend(it.token_ids[it.start:it.end])
            pos.extend(range(it.start, it.end))
            slots.extend(table[q // bs] * bs + q % bs for q in range(it.start, it.end))
            row_table.extend([len(tables)] * (it.end - it.start))
            tables.append(table[:-(-it.end // bs)])
            logit_rows += range(len(ids) - it.num_logits, len(ids))
            if it.score:
                score_rows += [row0 + q - it.start for q in range(*it.score)]
        T = len(ids)
        width = max((len(t) for t in tables), default=1)
        flat = ids + pos + slots + logit_rows + row_table + [b for t in tables for b in t + [0] * (width - len(t))]
        buf = self.stager.upload(flat)
        input_ids, positions, slot_mapping, logits_indices, rt, tab = buf.split(
            [T, T, T, len(logit_rows), T, width * len(tables)])
        meta = AttentionMetadata(slot_mapping=slot_mapping, num_decode=len(decode),
                                 rows=(tab.view(len(tables), width), rt, positions + 1))
        return PreparedBatch(input_ids=input_ids, positions=positions, meta=meta, logits_indices=logits_indices,
                             items=[it for it in decode + multi if it.num_logits], score_rows=score_rows,
                             score_items=[it for it in decode + multi if it.score])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate K/V of src blocks into dst blocks in every layer."""
        if not copies:
            return
        src, dst = self.stager.upload([c[0] for c in copies] + [c[1] for c in copies]).chunk(2)
        for kc, vc in zip(self.k_caches, self.v_caches):
            kc[dst] = kc[src]
            vc[dst] = vc[src]

    @property
    def graph_pending(self) -> bool:
        """Whether the decode graph still compiles or loads in the background (decode steps run eager
        until it is ready, then it is installed at the next step)."""
        bg = self.pending_graph
        return bg is not None and not bg.ready.is_set()

    def install_graph(self, wait: float | None = 0) -> bool:
        """Install the background decode graph if it is ready (waiting up to `wait` seconds;
        None: until it is). Between steps only: a step runs wholly eager or wholly compiled.
        Returns whether one is still pending."""
        bg = self.pending_graph
        if bg is None:
            return False
        if not bg.ready.wait(wait):
            return True
        self.pending_graph = None
        if bg.error is not None:
            log.warning("decode graph unavailable, decode steps run eager: %s: %s", type(bg.error).__name__, bg.error)
            self.graph_choice = f"eager (compile failed: {type(bg.error).__name__})"
            self.graph_trial = None
            return False
        bg.graph.num_steps = 0  # the warm-up's steps are not the engine's
        self.graph = bg.graph
        self.graph_choice = "compiled (on trial against eager steps)" if self.graph_trial else "compiled"
        log.info("decode graph ready after %.1f s in the background", bg.seconds)
        return False

    def _end_trial(self) -> None:
        """Decide the graph's trial (GraphTrial): keep the graph or drop it, and say which."""
        trial, self.graph_trial = self.graph_trial, None
        pick, t = trial.decide()
        from mixserve.layers.kernel_choice import MARGIN

        # the rule in the line: a graph a little faster but within the margin is dropped (seen as a
        # contradiction by a new user)
        figures = (f"compiled {t['compiled'] * 1e3:.1f} ms vs eager {t['eager'] * 1e3:.1f} ms a step, live; "
                   f"kept where faster by {MARGIN:.0%} or more")
        log.warning("decode graph: %s (%s)", "kept" if pick == "compiled" else "dropped, steps run eager", figures)
        if pick != "compiled":
            self.graph = None
        self.graph_choice = f"{pick} (measured on live steps: {figures})"

    def run(self, items: list[BatchItem], copies: list[tuple[int, int]] = ()) -> tuple[torch.Tensor, list[BatchItem]]:
        """Run one forward pass over `items`. Returns (float32 logits [N, vocab], the items that
        own them, in row order: each owns its num_logits consecutive rows)."""
        self.copy_blocks(list(copies))
        if self.pending_graph is not None:
            self.install_graph()
        graph = self.graph
        if graph is not None and not any(it.score for it in items) and graph.accepts(items):
            trial = self.graph_trial
            if trial is None:
                self.num_forwards += 1
                return graph.run(items, self.bm.block_table), list(items)
            compiled = trial.wants_compiled()
            t0 = time.perf_counter()
            if compiled:
                self.num_forwards += 1
                out = graph.run(items, self.bm.block_table), list(items)
            else:
                out = self.run_eager(items)
            trial.add(compiled, sum(it.end - it.start for it in items), time.perf_counter() - t0)
            if trial.done():
                self._end_trial()
            return out
        return self.run_eager(items)

    def run_eager(self, items: list[BatchItem], block_table=None) -> tuple[torch.Tensor, list[BatchItem]]:
        """`run` on the eager path (the reference), whatever the batch."""
        batch = self.prepare(items, block_table)
        if not batch.score_rows:
            logits = self.model(batch.input_ids, batch.positions, batch.meta, batch.logits_indices)
        else:
            logits, hidden = self.model(batch.input_ids, batch.positions, batch.meta, batch.logits_indices,
                                        torch.tensor(batch.score_rows, dtype=torch.long, device=self.device))
            self._score(hidden, batch.score_items)
        self.num_forwards += 1
        return logits, batch.items

    def _score(self, hidden: torch.Tensor, items: list[BatchItem]) -> None:
        """Prompt scoring: each item's scored positions' TokenLogprobs into `item.scores`, from
        their final hidden states [M, hidden] (items' positions in order). The LM head runs over
        SCORE_SLICE_ROWS rows at a time and only the token's logprob, rank and top-k are kept: a
        whole prompt's float32 logits would be 0.6 MB a token at a 151,936-word vocabulary."""
        targets, tops, owners = [], [], []
        for it in items:
            a, b = it.score
            targets += it.token_ids[a + 1:b + 1]
            tops += [it.top_k] * (b - a)
            owners += [it] * (b - a)
            it.scores = []
        for s0 in range(0, len(targets), SCORE_SLICE_ROWS):
            s1 = min(len(targets), s0 + SCORE_SLICE_ROWS)
            logits = self.model.compute_logits(hidden[s0:s1])
            lps = token_logprobs(logits, torch.tensor(targets[s0:s1], device=self.device), targets[s0:s1],
                                 tops[s0:s1])
            for it, lp in zip(owners[s0:s1], lps):
                it.scores.append(lp)
