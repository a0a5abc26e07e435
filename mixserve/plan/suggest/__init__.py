"""`mixserve plan --suggest`: the engine configuration for one traffic mix, one machine and an SLO,
chosen by the planner's simulator (simulator.py over the engine's own scheduler, with the step
times of a `hw probe` profile) instead of read off a ranking by the user.

The space is what the engine's flags offer: the weight format (bf16, the GGUF file's tensors as
stored, int4 RTN or AWQ), the KV allocator, `--max-num-seqs`, `--max-num-batched-tokens` (the
prefill chunk budget), prefix caching, speculation (off, or one drafter with a fixed k, or `auto`)
and, when asked, replicas. It is searched by coordinate descent from the engine's default: each
dimension's values tried with the others held, the best kept, until a pass changes nothing (the
dimensions interact little: the format moves every step's time, the batch limits trade TTFT for
throughput, speculation pays at low batch), so a search simulates tens of configurations, not the
thousands of the full grid. Each configuration is one offline run (every request at t = 0, as
`mixserve bench` runs) and, with an SLO, a bisection for the highest Poisson rate that meets it.

Objective: goodput under the SLO when one is given (the highest request rate whose TTFT / TPOT
percentiles stay within it, DistServe's definition; Zhong et al., OSDI 2024, section 2), else
output tokens/s. A configuration other than the default is suggested only when its predicted gain
is over `min_gain` (the planner's own measured error: PLANNER_ERROR); otherwise the answer is that
the default is best, with the reason.
"""
from mixserve.plan.suggest.commands import CommandContext, commands, format_suggestion
from mixserve.plan.suggest.search import Suggester, Suggestion
from mixserve.plan.suggest.space import (DIMENSIONS, PLANNER_ERROR, Config, Drafter, available_formats,
                                         quality_format, quality_violations)

__all__ = ["CommandContext", "Config", "DIMENSIONS", "Drafter", "PLANNER_ERROR", "Suggester", "Suggestion",
           "available_formats", "commands", "format_suggestion", "quality_format", "quality_violations"]
