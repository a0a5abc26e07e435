"""The engine: request -> scheduler -> model runner -> sampler -> output, one step at a time."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

import mixserve.startup as startup
from mixserve.device import resolve_device
from mixserve.engine.args import EngineArgs, parse_bytes, parse_dtype
from mixserve.engine.detokenizer import detokenize_incrementally, find_stop_string, tokens_in_text
from mixserve.engine.model_runner import BatchItem, ModelRunner
from mixserve.engine.sampler import Sampler, SamplingMetadata, apply_token_mask, process_logits
from mixserve.engine.scheduler import Scheduler
from mixserve.env import unkept
from mixserve.host_memory import keep_freed_heap
from mixserve.kv.block_manager import BlockManager
from mixserve.layers.kernel_choice import (KernelChooser, amx_permitted, bound_primitive_caches, cap_isa, cap_threads,
                                           parse_overrides)
from mixserve.kv.contiguous import ContiguousBlockManager
from mixserve.layers import batch_invariance, gguf_linear
from mixserve.models import packed_weights
from mixserve.models.loader import check_same_vocab, load_model
from mixserve.sampling_params import SamplingParams
from mixserve.sequence import Sequence, SequenceStatus
from mixserve.spec_decode.controller import SpecController
from mixserve.spec_decode.proposer import DraftModelProposer, NgramProposer
from mixserve.spec_decode.rejection import verify


log = logging.getLogger("mixserve")

@dataclass
class RequestOutput:
    """One request's state after a step (final when `finished`).

    text: generated text so far (stop string cut); new_text: what this step added.
    token_ids: generated token ids. finish_reason: "stop" | "length" | "abort" | "error" | None
        ("error": the request's logits were not finite; stop_reason says so).
    logprobs: a TokenLogprobs (when asked for) per output token once finished, the one that ended
        the output included; before that, per token whose text has been handed out (see
        `_text_logprobs`).
    prompt_logprobs: when params.prompt_logprobs is set, once the prefill is done: a TokenLogprobs
        per prompt token after the first (log p(token_i | tokens_<i)), in prompt order.
    metrics: seconds (time.perf_counter) — arrival, first_scheduled, first_token, finish,
        ttft, e2e — num_preemptions, and cached_tokens (prompt tokens the prefix cache served
        at admission; OpenAI's usage.prompt_tokens_details.cached_tokens).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    new_text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list | None = None
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: list | None = None


def _build_kernels_in_background(args: EngineArgs) -> None:
    """Start the C++ builds (or loads) of the kernels a CPU engine of `args` runs, on a thread, so
    that a cold start's builds overlap its GGUF conversion (layers/cpp_build.build_in_background)."""
    from mixserve.layers import gguf_kernels, invariant_linear, paged_decode
    from mixserve.layers.cpp_build import build_in_background, fix_bundle

    builds = [paged_decode.build]
    if args.batch_invariant == "on":
        builds.append(invariant_linear.build)
    # unset: the kernel is built only where a variant of it may run (default_native's flags test);
    # a CPU without AVX2, FMA or F16C dequantizes and would build it for nothing (~30 s)
    if args.load_gguf_weights == "native" or (args.load_gguf_weights is None and gguf_kernels.may_default_native()):
        from mixserve.models.registry import resolve_model

        try:
            if resolve_model(args.model, download=False).kind == "gguf":
                builds.insert(0, gguf_kernels.build)  # the loader asks for it first (use_native_gguf)
        except Exception:  # noqa: BLE001 -- only a hint here; load_model resolves (and pulls) and reports
            pass
    # the kernels' one library holds the GGUF kernel only where this start runs it (a model that is
    # no GGUF file would compile it for nothing, ~5 s of a 2-core start; cpp_build.fix_bundle)
    fix_bundle(without=() if gguf_kernels.build in builds else (gguf_kernels.__name__,))
    build_in_background(builds)


# a non-empty prompt text that the tokenizer turns into no token at all: refused, saying why
NO_TOKENS = "prompt: its text encodes to no tokens (this model's tokenizer drops every character of it)"


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Use add_request() / abort() at any time and step() to advance every running request by one
    iteration. The KV cache is `kv_cache_memory` bytes split into blocks of `block_size` tokens.

    Raises (from add_request): ValueError for an empty prompt, token ids outside the vocabulary,
    or a request that can never fit (prompt + max_tokens over max_model_len or the whole cache).
    """

    def __init__(self, args: EngineArgs, loaded=None):
        startup.mark("imports")
        args.validate()
        self.args = args
        self.device = resolve_device(args.device)
        self.dtype = parse_dtype(args.dtype, self.device)
        cap_threads()
        if self.device.type == "cpu":
            keep_freed_heap()  # a step's big temporaries reuse the step before's memory (host_memory.py)
        bound_primitive_caches()  # before any oneDNN call, as amx_permitted below
        # $MIXSERVE_ISA=avx2: oneDNN capped at AVX2, and so no AMX
        self.amx = amx_permitted() if cap_isa() is None else False
        self.kernels = KernelChooser(overrides=None if args.kernels == "auto" else parse_overrides(args.kernels))
        if loaded is None and self.device.type == "cpu":
            _build_kernels_in_background(args)
        t0 = time.perf_counter()
        self.cfg, self.model, self.tokenizer, self.model_dir = loaded or load_model(
            args.model, self.dtype, args.max_model_len, args.progress, args.quantization, args.quant_group_size,
            args.int4_lm_head, args.load_gguf_weights)
        self.load_time_s = time.perf_counter() - t0
        self.max_model_len = args.max_model_len or self.cfg.max_position_embeddings
        if self.max_model_len > self.cfg.max_position_embeddings:
            raise ValueError(f"max_model_len: {self.max_model_len} exceeds the model's context "
                             f"({self.cfg.max_position_embeddings} tokens)")
        dtype_bytes = torch.finfo(self.dtype).bits // 8
        kv_bytes = parse_bytes(args.kv_cache_memory)
        self.draft_cfg = None
        draft = None
        if args.draft_model and args.draft_model != "ngram":
            # an int4 draft (draft_quantization rtn) starts from the dequantized weights, as RTN does
            dq = args.draft_quantization
            draft = load_model(args.draft_model, self.dtype, self.max_model_len, args.progress, quantization=dq,
                               group_size=args.quant_group_size, lm_head=dq is not None,
                               gguf_weights="dequantize" if dq else args.load_gguf_weights)
            check_same_vocab(self.cfg, self.tokenizer, draft[0], draft[2])
            self.draft_cfg = draft[0]
        # batch invariance (layers/batch_invariance.py) is a CPU mode; where its kernels did not
        # build the engine says so and runs the measured ones
        why_not = None
        if args.batch_invariant == "on":
            why_not = (f"a CPU mode; not on {self.device.type}" if self.device.type != "cpu"
                       else batch_invariance.unavailable())
            if why_not and self.device.type == "cpu":
                log.warning("batch invariance unavailable: %s", why_not)
        self.batch_invariant = args.batch_invariant == "on" and why_not is None
        self.invariance_note = "on" if self.batch_invariant else f"off ({why_not})" if why_not else "off"
        t1 = time.perf_counter()
        # the dense weights' invariant-GEMM copies, kept from an earlier start (models/packed_weights.py)
        self.packed_saves: list = []  # threads writing them where this start packed anew
        for m, folder in ((self.model, self.model_dir), (draft[1], draft[3]) if draft else (None, None)):
            if m is not None and self.device.type != "cpu":
                m.place(self.device, None if args.kernels == "eager" else self.kernels)
            elif hasattr(m, "choose_kernels"):
                # a GGUF loaded natively: keyed by its file (its folder holds only the tokenizer)
                source = getattr(m, "source_file", None) or folder
                store = (packed_weights.store_path(source, self.dtype, getattr(m, "quant", None))
                         if self.batch_invariant and source is not None else None)
                fresh = m.choose_kernels(self.kernels, batch_invariant=self.batch_invariant,
                                         packed=packed_weights.load(store))
                if fresh and store is not None:
                    self.packed_saves.append(packed_weights.save_in_background(
                        store, m, packed_weights.slot(source, self.dtype, getattr(m, "quant", None))))
        self.kernel_choice_s = time.perf_counter() - t1
        startup.mark("kernel choices")
        # The draft's cache holds as many tokens as the target's, so the budget is split in
        # proportion to their per-token K/V bytes.
        per_token = self.cfg.kv_bytes_per_token(dtype_bytes)
        if self.draft_cfg is not None:
            per_token += self.draft_cfg.kv_bytes_per_token(dtype_bytes)
        self.block_bytes = args.block_size * per_token
        self.num_blocks = kv_bytes // self.block_bytes
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_memory {args.kv_cache_memory!r} holds no block of {self.block_bytes} bytes")
        if args.kv_allocator == "contiguous":
            self.block_manager = ContiguousBlockManager(self.num_blocks, args.block_size, args.reserve,
                                                        self.max_model_len)
        else:
            self.block_manager = BlockManager(self.num_blocks, args.block_size, args.shuffle_blocks_seed,
                                              enable_caching=args.prefix_caching)
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, args.max_num_batched_tokens, self.max_model_len)
        self.runner = ModelRunner(self.model, self.cfg, self.block_manager, self.num_blocks, args.block_size, self.dtype,
                                  self.device)
        self.sampler = Sampler()
        # structured output: constraints compiled per model and constraint, on the tokenizer's
        # view llguidance builds at the first constrained request (structured_output/compiler.py)
        self.grammars = self.grammar_steps = None
        if self.tokenizer is not None:
            from mixserve.structured_output.compiler import GrammarCompiler
            from mixserve.structured_output.steps import GrammarSteps

            self.grammars = GrammarCompiler(self.new_tokenizer, self.cfg.vocab_size, list(self.cfg.eos_token_ids),
                                            threads=max(1, torch.get_num_threads()))
            self.grammar_steps = GrammarSteps(self.grammars, list(self.cfg.eos_token_ids))
        self.proposer = None
        if args.draft_model == "ngram":
            self.proposer = NgramProposer()
        elif draft is not None:
            dbm = BlockManager(self.num_blocks, args.block_size, args.shuffle_blocks_seed,
                               enable_caching=args.prefix_caching)
            drunner = ModelRunner(draft[1], self.draft_cfg, dbm, self.num_blocks, args.block_size, self.dtype,
                                  self.device)
            self.proposer = DraftModelProposer(drunner, dbm, self._sampling_metadata)
        if self.proposer is not None:
            self.scheduler.on_free.append(self.proposer.free)
        t1 = time.perf_counter()
        for r in self.runners():
            if self.device.type == "cpu":
                r.choose_decode_graph(self.kernels, self.max_model_len, args.max_num_seqs,
                                      background=args.graph_warmup == "background", off=args.graph_warmup == "off")
            elif args.kernels != "eager":
                r.use_cuda_graphs(self.max_model_len, args.max_num_seqs)
            else:
                r.graph_choice = "eager (--kernels eager)"
        self.kernel_choice_s += time.perf_counter() - t1
        startup.mark("decode graph")
        self.controller = SpecController(args.speculation if self.proposer else "off", args.num_speculative_tokens,
                                         max_rows=args.max_num_batched_tokens)
        self.requests: dict[str, Sequence] = {}
        self.num_errored = 0  # requests ended by non-finite logits in their row (_drop_poisoned)
        self.logits_hook = None  # tests: called as hook(logits, rows) after each forward, before sampling
        self.step_request_ids: list[str] | None = None  # requests the current/last step scheduled
        self._ids = itertools.count()
        self.num_steps = 0
        self.last_step_tokens = 0  # tokens the target model ran in the last step (prefill + decode + drafts)
        # cumulative token counts (tokens) for monitoring: prompts of accepted requests, and
        # every generated token (aborted requests' included)
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        # parallel sampling: requests waiting for a leader's prefill, by the leader's seq_id
        self._followers: dict[int, list[Sequence]] = {}
        self._num_followers = 0  # their count, readable from another thread without iterating

    def runners(self) -> list:
        """The engine's ModelRunners: the target's, and a draft model's where one proposes."""
        return [self.runner] + ([self.proposer.runner] if isinstance(self.proposer, DraftModelProposer) else [])

    def populate_kv_cache(self, wait: bool = False) -> None:
        """Fault the KV caches' pages in (the target's and a draft model's) on threads, once: for an
        engine about to serve (`serve`, a replica, `bench` before its clock), whose first requests
        would otherwise pay the first touch of their blocks (ModelRunner.populate_kv_cache). wait:
        return when done."""
        runners = self.runners()
        threads = [t for t in (r.populate_kv_cache() for r in runners) if t is not None]
        for t in threads if wait else ():
            t.join()

    def wait_for_graph(self, timeout: float | None = None) -> bool:
        """Install the decode graphs a background warm-up is still compiling (EngineArgs
        graph_warmup), waiting up to `timeout` seconds (None: as long as it takes); call it
        between steps, e.g. before timing a run. Returns whether every one is installed."""
        runners = self.runners()
        return not any([r.install_graph(timeout) for r in runners])

    def new_tokenizer(self):
        """Another instance of this engine's tokenizer, from model_dir (None where the model has
        none): one tokenizer object must not be used from two threads (the server encodes on one
        and decodes on another). Light where tokenizer.json is enough (models/tokenizer.py)."""
        if self.tokenizer is None:
            return None
        from mixserve.models.tokenizer import load_tokenizer_folder

        return load_tokenizer_folder(self.model_dir)

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted: the scheduler's waiting queue plus the samples of n > 1
        requests parked behind their leader's prefill (LLMEngine.add_request). Two atomic reads,
        so another thread (the server's /metrics, its admission check) may call it while the
        engine steps; it is then at most one step stale."""
        return len(self.scheduler.waiting) + self._num_followers

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.args.block_size

    def describe(self) -> str:
        text = (f"device {self.device}; "
                f"KV cache: {self.num_blocks} blocks x {self.args.block_size} tokens = {self.kv_capacity_tokens} tokens "
                f"({self.num_blocks * self.block_bytes / 2**20:.0f} MiB, {self.dtype})")
        if self.args.kv_allocator == "contiguous":
            text += f"; contiguous allocation, a region of {self.args.reserve} tokens per sequence"
        text += f"; prefix caching {'on' if self.args.prefix_caching else 'off'}"
        if self.draft_cfg is not None:
            d = self.draft_cfg.kv_bytes_per_token(1) / (self.cfg.kv_bytes_per_token(1) + self.draft_cfg.kv_bytes_per_token(1))
            text += f"; {d:.0%} of it is the draft model's cache"
        if self.kernels.choices:
            picks: dict[str, dict[str, int]] = {}
            for c in self.kernels.choices.values():
                kind = picks.setdefault(c.key.split("/")[0], {})
                kind[c.name] = kind.get(c.name, 0) + 1
            how = "/".join(sorted({c.source for c in self.kernels.choices.values()}))
            text += "; kernels (" + how + "): " + ", ".join(
                f"{k} " + " ".join(f"{n} (x{c})" if c > 1 else n for n, c in v.items()) for k, v in picks.items())
        text += f"; batch invariance {self.invariance_note}"
        text += f"; decode graph: {self.runner.graph_choice}"
        if self.runner.graph is not None and self.runner.graph.compile_s:
            text += " (first calls " + ", ".join(f"{k} {v:.1f} s" for k, v in self.runner.graph.compile_s.items()) + ")"
        q = getattr(self.model, "quant", None)
        if q is None and getattr(self.model, "weight_format", None):
            text += "; " + self.model.weight_format
        per_type = gguf_linear.summarize(self.model)
        if per_type:
            text += " [" + per_type + "]"
        if q is not None:
            text += f"; weights int4 ({q.method}, group {q.group_size})"
            if q.dense:
                text += f", {len(q.dense)} linears left dense (e.g. {q.dense[0]})"
        lost = unkept()
        if lost:  # a read-only or full cache root: what the next start does again
            text += "; not kept in the cache (this process only): " + "; ".join(f"{k} ({v})" for k, v in lost.items())
        return text

    # -- requests --------------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass token ids")
        return self.tokenizer.encode(prompt)

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field ("prompt: ..." or "max_tokens: ...") if a request with
        prompt token ids `ids` and `params` can never be served. Reads only settings fixed at
        construction, so another thread may call it while the engine steps (the server does); an
        output constraint compiles here (GrammarCompiler is thread-safe and keeps it for add_request)."""
        if not ids:
            raise ValueError("prompt: must not be empty")
        if min(ids) < 0 or max(ids) >= self.cfg.vocab_size:
            raise ValueError(f"prompt: token ids must be in [0, {self.cfg.vocab_size})")
        total = len(ids) + params.max_tokens
        # a prompt that fills the context can still be scored (max_tokens 0), not continued
        if len(ids) > self.max_model_len or (len(ids) == self.max_model_len and params.max_tokens > 0):
            raise ValueError(f"prompt: {len(ids)} tokens, the context is {self.max_model_len} tokens")
        if total > self.max_model_len:
            raise ValueError(f"max_tokens: prompt ({len(ids)}) + max_tokens ({params.max_tokens}) = {total} "
                             f"tokens exceeds max_model_len {self.max_model_len}")
        if params.prompt_logprobs is not None and len(ids) > self.args.max_scored_prompt_tokens:
            raise ValueError(f"prompt: {len(ids)} tokens; prompt scoring (prompt logprobs, echo with logprobs) "
                             f"takes at most {self.args.max_scored_prompt_tokens} prompt tokens "
                             f"(--max-scored-prompt-tokens)")
        if self.block_manager.blocks_for(len(ids) + (params.max_tokens > 0)) > self.num_blocks:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room for an output token in the KV cache "
                             f"({self.kv_capacity_tokens} tokens); raise --kv-cache-memory")
        if self.block_manager.blocks_for(total) > self.num_blocks:
            raise ValueError(f"max_tokens: prompt + max_tokens = {total} tokens can never fit in the KV cache "
                             f"({self.kv_capacity_tokens} tokens); raise --kv-cache-memory")
        if params.structured is not None:
            if self.grammars is None:
                raise ValueError(f"{params.structured.source}: this model has no tokenizer, so no grammar")
            self.grammar_steps.check(params)  # compiled and cached: add_request copies it

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    share_prompt_with: str | None = None, cache_salt: str | None = None) -> str:
        """Queue a request; returns its id. Raises ValueError (nothing is queued) if it cannot be served.

        arrival_time: time.perf_counter() seconds when the request arrived (TTFT and E2E count
        from it); default now. A server passes the time the HTTP request came in.
        share_prompt_with: the id of a queued request with the same prompt (parallel sampling,
        n > 1): with prefix caching on, this one waits until that one's prefill is done and then
        finds its prompt's full blocks in the prefix cache, computing only the last, partial
        block. Ignored (a prefill of its own) when caching is off, that request is unknown or
        already past its prefill, has another prompt or salt, or this one scores its prompt.
        Its prompt tokens are not counted again in num_prompt_tokens (usage counts a prompt once).
        cache_salt: a string mixed into the hash of this request's first KV block, so it shares
        cached blocks only with requests of the same salt (tenant isolation; vLLM's cache_salt).
        """
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            text, ids = prompt, self.encode(prompt)
            if not ids:  # e.g. only control characters, which this vocabulary drops
                raise ValueError(NO_TOKENS)
        else:
            if hasattr(prompt, "tolist"):  # torch / numpy arrays of ids
                prompt = prompt.tolist()
            if not isinstance(prompt, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ValueError("prompt: must be a non-empty string or a list of integer token ids")
            text, ids = None, list(prompt)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        self.check_request(ids, params)
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in self.requests:  # skip ids a caller chose explicitly
                request_id = str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt or len(cache_salt) > 4096):
            raise ValueError("cache_salt: must be a non-empty string of at most 4096 characters")
        seq = Sequence(request_id, text, ids, params)
        seq.cache_salt = cache_salt
        if params.structured is not None:
            self.grammar_steps.attach(seq)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        self.requests[request_id] = seq
        lead = self.requests.get(share_prompt_with) if share_prompt_with is not None else None
        if (lead is not None and lead is not seq and self.args.prefix_caching and lead.prompt_token_ids == ids
                and lead.cache_salt == cache_salt
                and params.prompt_logprobs is None  # scoring computes the whole prompt anyway
                and lead.num_computed_tokens < len(ids) and not lead.is_finished):
            self._followers.setdefault(lead.seq_id, []).append(seq)
            self._num_followers += 1
        else:
            self.scheduler.add(seq)
        if share_prompt_with is None:  # another sample of a prompt already counted (n > 1): not again
            self.num_prompt_tokens += len(ids)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks at once. Returns False if it is unknown or done."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self._end(seq, "abort")
        return True

    def _end(self, seq: Sequence, reason: str) -> None:
        """Finish `seq` (already out of self.requests) with `reason` outside the normal path (abort,
        error): its blocks are freed at once and parallel samples waiting on its prefill go on alone."""
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        for lead_id, fs in list(self._followers.items()):
            if seq in fs:  # a follower not yet released: it holds no blocks
                fs.remove(seq)
                self._num_followers -= 1
                seq.status = SequenceStatus.FINISHED
                return
        self.scheduler.finish(seq)
        for f in self._followers.pop(seq.seq_id, []):  # its followers prefill for themselves
            self.scheduler.add(f)
            self._num_followers -= 1

    def _item(self, s, token_ids: list[int], end: int, num_logits: int) -> BatchItem:
        """The BatchItem of scheduled `s`: no logits for a prefill-only request (max_tokens 0),
        and for prompt scoring the span's prompt positions not scored yet (a recompute after
        preemption scores nothing twice; the last prompt position predicts output, not prompt)."""
        seq, p = s.seq, s.seq.params
        if p.max_tokens == 0:
            num_logits = 0
        it = BatchItem(seq.seq_id, token_ids, s.start, end, num_logits)
        if p.prompt_logprobs is not None:
            a, b = max(s.start, len(seq.prompt_logprobs)), min(end, seq.num_prompt_tokens - 1)
            if a < b:
                it.score, it.top_k = (a, b), p.prompt_logprobs
        return it

    def _keep_scores(self, items: list[BatchItem], by_id: dict) -> None:
        for it in items:
            seq = by_id.get(it.seq_id)
            if it.scores is not None and seq is not None and it.score[0] == len(seq.prompt_logprobs):
                seq.prompt_logprobs.extend(it.scores)

    def _finish_prefill_only(self, sched) -> list[RequestOutput]:
        """Requests with max_tokens 0 whose prefill this step completed end now, with no token
        and finish_reason "length" (prompt scoring: echo + logprobs + max_tokens 0)."""
        outs, now = [], time.perf_counter()
        for s in sched.scheduled:
            seq = s.seq
            if seq.params.max_tokens == 0 and not seq.is_finished and seq.num_computed_tokens >= seq.num_prompt_tokens:
                seq.finish_reason, seq.finish_time = "length", now
                seq.first_token_time = seq.first_token_time or now
                self.scheduler.finish(seq)
                self.requests.pop(seq.request_id, None)
                outs.append(self.make_output(seq))
        return outs

    def _drop_poisoned(self, logits: torch.Tensor, rows: list, by_id: dict) -> tuple[torch.Tensor, list, list]:
        """Rows of `logits` [sum of num_logits, V] that hold a NaN or an infinity (fp16 overflow, a
        bad weight, a kernel bug) end their request with finish_reason "error" (blocks freed, the
        reason in stop_reason); the others go on. `self.logits_hook(logits, rows)`, when set, runs
        first (tests poison a row through it). Returns (the remaining logits and rows, the failed
        requests' outputs)."""
        if self.logits_hook is not None:
            self.logits_hook(logits, rows)
        if not rows:
            return logits, rows, []
        # a row's sum is finite exactly when every entry is (logits are far from the dtype's range);
        # summing in the logits' own dtype (float accumulation inside) is 10x cheaper than asking
        # for a float32 result from bf16
        ok = torch.isfinite(logits.sum(-1))
        if bool(ok.all()):
            return logits, rows, []
        keep, kept_rows, failed, r = [], [], [], 0
        for it in rows:
            span = range(r, r + it.num_logits)
            r += it.num_logits
            if bool(ok[span.start:span.stop].all()):
                keep.extend(span)
                kept_rows.append(it)
                continue
            seq = by_id[it.seq_id]
            self.requests.pop(seq.request_id, None)
            seq.stop_reason = "non-finite logits (NaN or infinity) in this request's row"
            self._end(seq, "error")
            self.num_errored += 1
            log.error("request %s: non-finite logits in its row; it ends with an error, the batch goes on",
                      seq.request_id)
            failed.append(self.make_output(seq, self._releasable_text(seq)))
        return logits[torch.tensor(keep, dtype=torch.long)], kept_rows, failed

    def _release_followers(self, seqs: list[Sequence]) -> None:
        """Queue (ahead of the others) the followers of every leader in `seqs` whose prefill has
        just completed: its full prompt blocks are in the prefix cache now, so their admission
        finds them and computes only the partial last block."""
        for lead in seqs:
            fs = self._followers.pop(lead.seq_id, None)
            if not fs:
                continue
            if lead.num_computed_tokens < lead.num_prompt_tokens:
                self._followers[lead.seq_id] = fs
                continue
            for f in reversed(fs):
                # into the waiting queue first, so that num_waiting never misses it
                self.scheduler.waiting.appendleft(f)
                self._num_followers -= 1

    def has_unfinished(self) -> bool:
        """Whether any request is queued, parked behind its leader's prefill, or running."""
        return self.scheduler.has_unfinished or bool(self._num_followers)

    def set_prefix_caching(self, on: bool) -> None:
        """Turn prefix caching on or off (paged allocator only) with the caches emptied, for
        side-by-side runs in one process. Raises RuntimeError while requests hold blocks,
        ValueError for the contiguous allocator."""
        if on and self.args.kv_allocator != "paged":
            raise ValueError("prefix caching needs the paged allocator")
        if not self.reset_prefix_cache():
            raise RuntimeError("set_prefix_caching: requests still hold KV blocks")
        self.args.enable_prefix_caching = bool(on)
        self.block_manager.enable_caching = bool(on)
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.bm.enable_caching = bool(on)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix caches (target and draft). Only while no request holds blocks;
        returns whether it was done."""
        bms = [self.block_manager] + ([self.proposer.bm] if isinstance(self.proposer, DraftModelProposer) else [])
        if any(b.num_used_blocks for b in bms):
            return False
        return all([b.reset_prefix_cache() for b in bms])

    # -- one iteration ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, (propose,) run the target once, sample or verify, and return the requests
        that advanced."""
        t_entry = time.perf_counter()
        k = 0
        if self.proposer is not None:
            decoding = [s for s in self.scheduler.running if s.num_uncomputed_tokens == 1]
            prefill_tokens = sum(s.num_uncomputed_tokens for s in self.scheduler.running) - len(decoding)
            alphas = [self.controller.alpha_for(s.spec_accepted, s.spec_evaluated) for s in decoding]
            k = self.controller.choose(alphas, prefill_tokens, sum(self.proposer.lag(s) for s in decoding))
        sched = self.scheduler.schedule(lookahead=k)
        # whom an exception from here on concerns: the server fails these, not every request
        self.step_request_ids = [s.seq.request_id for s in sched.scheduled]
        self.last_step_tokens = 0
        if not sched.scheduled:
            return []
        now = time.perf_counter()
        for s in sched.scheduled:
            if s.seq.first_scheduled_time is None:
                s.seq.first_scheduled_time = now
        # With a draft model, prefill chunks also run through the draft in the same step, so
        # the draft's prefill counts in TTFT rather than in the first speculative step.
        if k or (self.controller.mode != "off" and any(s.num_new_tokens > 1 for s in sched.scheduled)):
            return self._spec_step(sched, k, t_entry)
        items = [self._item(s, s.seq.token_ids, s.end, int(s.samples)) for s in sched.scheduled]
        by_id = {s.seq.seq_id: s.seq for s in sched.scheduled}
        masking = self._masks_beside_forward(items, by_id)
        logits, rows = self.runner.run(items, sched.copies)
        logits, rows, outputs = self._drop_poisoned(logits, rows, by_id)
        sampled = None
        if rows:
            seqs = [by_id[it.seq_id] for it in rows]
            sampled = self.sampler(logits, self._sampling_metadata(seqs, ready=masking))
        # only now: if sampling raised, the step can be rerun with nothing half-applied
        for s in sched.scheduled:
            s.seq.num_computed_tokens = s.end
        self.scheduler.commit(s.seq for s in sched.scheduled)
        self._keep_scores(items, by_id)
        if self._followers:  # before any leader can finish and free its blocks
            self._release_followers([s.seq for s in sched.scheduled])
        if rows:
            now = time.perf_counter()
            for seq, tok, lp in zip(seqs, sampled.token_ids, sampled.logprobs):
                outputs.append(self._append_token(seq, tok, lp, now))
        outputs += self._finish_prefill_only(sched)
        # the cost model compares whole steps, from choosing k and scheduling to output handling
        self.last_step_tokens = sum(it.end - it.start for it in items)
        self.controller.target.record(self.last_step_tokens, time.perf_counter() - t_entry)
        self.num_steps += 1
        return outputs

    def _spec_step(self, sched, k: int, t_entry: float) -> list[RequestOutput]:
        """Speculative step (Leviathan et al. 2023, Alg. 1) for the whole batch: the proposer
        drafts up to k tokens for every decode row, ONE target forward scores prefill chunks and
        all proposals, then each row keeps its accepted prefix plus one token, and both caches
        roll back past what was kept."""
        decode = [s for s in sched.scheduled if s.lookahead]
        prefill = [s for s in sched.scheduled if not s.lookahead]
        t_prop = time.perf_counter()
        extra = self.proposer.prefill([(s.seq, s.start, s.end) for s in prefill if s.num_new_tokens > 1])
        props = self.proposer.propose([s.seq for s in decode], [s.lookahead for s in decode], extra)
        t1 = time.perf_counter()
        # the draft's forwards are its table's (their rows, their sampling); the rest of the step
        # (choosing k, scheduling, the proposer's own bookkeeping, verification, output handling)
        # is the target table's: timed from t1 alone, a k = 1 step's ~2.5 ms more than a plain
        # step's went uncharged, and `auto` took k = 1 at temperature 1 where it ran 0.85-0.99x plain
        draft_s = sum(sec for _, sec in self.proposer.forwards) if decode else t1 - t_prop
        if decode and self.proposer.step_time is not None:
            self.controller.draft.record(len(decode), self.proposer.step_time)
        if decode and self.proposer.forwards and self.proposer.forwards[0][0] > len(decode):
            self.controller.draft.record(*self.proposer.forwards[0])  # a catch-up's cost by its rows
        drafts = {s.seq.seq_id: p.tokens[:s.lookahead] for s, p in zip(decode, props)}
        qs = {s.seq.seq_id: p.q for s, p in zip(decode, props)}
        if self.grammar_steps is not None:  # structured output: drafts the grammar forbids cut short
            for s in decode:
                sid = s.seq.seq_id
                drafts[sid], qs[sid] = self.grammar_steps.cut_draft(s.seq, drafts[sid], qs[sid])
        items = []
        for s in sched.scheduled:
            d = drafts.get(s.seq.seq_id, [])
            items.append(self._item(s, s.seq.token_ids + d, s.end + len(d), len(d) + 1 if s.samples else 0))
        logits, rows = self.runner.run(items, sched.copies)
        by_id = {s.seq.seq_id: s.seq for s in sched.scheduled}
        logits, rows, failed = self._drop_poisoned(logits, rows, by_id)
        # one metadata row per verified position: output ids include the drafts before it
        row_seqs, row_extra = [], []
        for it in rows:
            d = drafts.get(it.seq_id, [])
            for t in range(it.num_logits):
                row_seqs.append(by_id[it.seq_id])
                row_extra.append(d[:t])
        meta = self._sampling_metadata(row_seqs, row_extra)
        # every position masked by its grammar: verification then accepts by the *constrained*
        # distribution (exact), and logprobs are the masked logits'
        logits, meta = apply_token_mask(logits, meta)
        processed = process_logits(logits, meta)
        for s in prefill:
            s.seq.num_computed_tokens = s.end
        # now, before a prefill that samples its first token can finish (and free unregistered)
        self.scheduler.commit(s.seq for s in prefill)
        self._keep_scores(items, by_id)
        outputs, r, now = failed + self._finish_prefill_only(sched), 0, time.perf_counter()
        for it in rows:
            seq, m = by_id[it.seq_id], it.num_logits
            d = drafts.get(it.seq_id, [])
            n_before = seq.num_tokens
            j, toks = verify(processed[r:r + m], d, qs.get(it.seq_id), seq.params.greedy, meta.generators[r:r + m])
            if d:
                seq.spec_steps += 1
                seq.spec_proposed += len(d)
                seq.spec_accepted += j
                seq.spec_evaluated += j + (j < len(d))
                self.controller.observe(j, j + (j < len(d)))
            lps = (self.sampler.logprobs(logits[r:r + len(toks)], torch.tensor(toks, device=logits.device), toks,
                                         [seq.params] * len(toks))
                   if seq.params.logprobs is not None else [None] * len(toks))
            seq.num_computed_tokens = n_before
            texts = []
            for tok, lp in zip(toks, lps):
                out = self._append_token(seq, tok, lp, now)
                texts.append(out.new_text)
                if out.finished:
                    break
            out.new_text = "".join(texts)
            if not out.finished:
                seq.num_computed_tokens = seq.num_tokens - 1
                self.block_manager.truncate(seq.seq_id, seq.num_tokens)
                self.proposer.rollback(seq, seq.num_tokens - 1)
            outputs.append(out)
            r += m
        self.scheduler.commit(s.seq for s in sched.scheduled)
        if self._followers:  # decode rows too: a prefill can end on a one-token chunk verified as one
            self._release_followers([s.seq for s in sched.scheduled])
        # verification cost = the whole step less the draft's forwards (above)
        self.last_step_tokens = sum(it.end - it.start for it in items)
        self.controller.target.record(self.last_step_tokens, time.perf_counter() - t_entry - draft_s)
        self.num_steps += 1
        return outputs

    def _masks_beside_forward(self, items, by_id):
        """Structured output: this step's constrained rows' masks, begun now beside the forward
        (GrammarSteps.start); None where there are none."""
        if self.grammar_steps is None:
            return None
        return self.grammar_steps.start([by_id[it.seq_id] for it in items
                                         if it.num_logits == 1 and by_id[it.seq_id].matcher is not None])

    def _sampling_metadata(self, seqs: list[Sequence], extra: list[list[int]] | None = None,
                           ready=None) -> SamplingMetadata:
        """Per-row sampling inputs; `extra[i]` are proposed tokens that count as output of row i
        (row i samples the token at position len(token_ids) + len(extra[i]), whose generator it gets).
        `ready`: a future of the rows' grammar masks by seq_id (_masks_beside_forward), used for the
        rows it holds (no extra tokens) instead of filling them now."""
        eos = self.cfg.eos_token_ids
        extra = extra or [[] for _ in seqs]
        masks = []
        for s, e in zip(seqs, extra):
            p = s.params
            if s.matcher is not None:  # the grammar decides where it may end: no min_tokens
                masks.append([])
            elif s.num_output_tokens + len(e) < p.min_tokens:
                masks.append(list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos)))
            else:
                masks.append([])
        token_mask, constrained = (self.grammar_steps.masks(seqs, extra, ready) if self.grammar_steps is not None
                                   else (None, []))
        return SamplingMetadata(
            params=[s.params for s in seqs],
            prompt_ids=[s.prompt_token_ids for s in seqs],
            output_ids=[s.output_token_ids + e for s, e in zip(seqs, extra)],
            generators=[s.generator_at(s.num_tokens + len(e)) for s, e in zip(seqs, extra)],
            min_tokens_mask_ids=masks,
            token_mask=token_mask,
            constrained_rows=constrained,
        )

    def _append_token(self, seq: Sequence, tok: int, lp, now: float) -> RequestOutput:
        p = seq.params
        seq.token_ids.append(tok)
        if not self.num_generated_tokens:
            startup.mark("first token")
        self.num_generated_tokens += 1
        if lp is not None:
            seq.logprobs.append(lp)
        if seq.first_token_time is None:
            seq.first_token_time = now
        n_out = seq.num_output_tokens
        reason = None
        # structured output: the matcher follows the output; a grammar that can go no further
        # ends the request below, after the token's text (ignore_eos or not)
        grammar_done = False
        if self.grammar_steps is not None and (seq.matcher is not None or seq.grammar_trigger is not None):
            grammar_done, failed = self.grammar_steps.on_token(seq, tok)
            if failed is not None:
                reason, seq.stop_reason = "error", failed
        if reason is None and n_out >= p.min_tokens and (tok in p.stop_token_ids or not p.ignore_eos and tok in self.cfg.eos_token_ids):
            # an end or stop token is counted and has its logprob entry, but its text is not part of
            # the output (vLLM's detokenizer skips it too): it is never decoded
            reason, seq.stop_reason, new_text = "stop", tok, ""
        elif reason is None:
            new_text = detokenize_incrementally(self.tokenizer, seq) if self.tokenizer is not None else ""
        else:
            new_text = ""
        # `new_text` is what detokenization added; what the caller sees is _releasable_text()
        if reason is None and p.stop and new_text and n_out >= p.min_tokens:
            hit = find_stop_string(seq.text, len(new_text), p.stop)
            if hit is not None:
                seq.text = seq.text[:hit[0]]
                reason, seq.stop_reason = "stop", hit[1]
        if reason is None and grammar_done:
            reason = "stop"
        if reason is None and (n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            seq.finish_reason = reason
            seq.finish_time = now
            self.scheduler.finish(seq)
            self.requests.pop(seq.request_id, None)
        return self.make_output(seq, self._releasable_text(seq))

    @staticmethod
    def _releasable_text(seq: Sequence) -> str:
        """Text that can be streamed now. While running, the last len(longest stop) - 1
        characters are held back: they may yet turn out to start a stop string, which is never
        shown. Every character is released exactly once, so the pieces join to `seq.text`."""
        hold = 0 if seq.finish_reason else max((len(x) for x in seq.params.stop), default=1) - 1
        upto = max(seq.emitted_chars, len(seq.text) - hold)
        piece = seq.text[seq.emitted_chars:upto]
        seq.emitted_chars = upto
        return piece

    def _text_logprobs(self, seq: Sequence) -> list:
        """The logprob entries an output carries, by the rule `usage` also counts by (issue 45):
        once the sequence has ended, one per output token, the token that ended it included (an
        end token, a stop token, the token that completed a stop string: as vLLM's OpenAI server
        returns them, vllm/entrypoints/openai completion and chat logprobs loop over every
        output token id), so len(logprobs) == len(token_ids) == usage.completion_tokens. While it
        runs: the tokens whose text has been handed out, so that a stream's entries never run ahead
        of its text and join, chunk after chunk, to the final list."""
        if self.tokenizer is None or seq.finish_reason is not None:
            return list(seq.logprobs)
        return seq.logprobs[:tokens_in_text(seq, seq.emitted_chars)]

    def make_output(self, seq: Sequence, new_text: str = "") -> RequestOutput:
        ttft = seq.first_token_time - seq.arrival_time if seq.first_token_time else None
        e2e = seq.finish_time - seq.arrival_time if seq.finish_time else None
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=seq.text,
            new_text=new_text,
            token_ids=seq.output_token_ids,
            finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=self._text_logprobs(seq) if seq.params.logprobs is not None else None,
            prompt_logprobs=(seq.prompt_logprobs if seq.params.prompt_logprobs is not None
                             and len(seq.prompt_logprobs) >= seq.num_prompt_tokens - 1 else None),
            metrics={
                "arrival": seq.arrival_time, "first_scheduled": seq.first_scheduled_time,
                "first_token": seq.first_token_time, "finish": seq.finish_time,
                "ttft": ttft, "e2e": e2e, "num_preemptions": seq.num_preemptions,
                "cached_tokens": seq.num_cached_tokens,
                "spec_proposed": seq.spec_proposed, "spec_accepted": seq.spec_accepted,
                "spec_evaluated": seq.spec_evaluated, "spec_steps": seq.spec_steps,
            },
        )
