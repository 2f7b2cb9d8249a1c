"""`python -m bench <command> ...` from the checkout's root; `python -m bench --help` lists the commands
(forklm's former bench, bench-serve, bench-kernel, bench-constrained, bench-spec and bench-budget):

    sweep        context length x n, forklm paths vs transformers (and llama.cpp)
    serve        a shared-prefix serving workload with ablations (--http: over HTTP too)
    kernel       the Triton decode-attention kernel vs torch SDPA
    constrained  JSON-schema sampling: masks only vs jump-forward
    spec         speculative sampling: regular vs each drafter
    budget       best of n on HumanEval within a time budget
"""

import sys

from bench.cli import main

sys.exit(main())
