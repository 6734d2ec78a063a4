"""Classify a candidate against its baseline on a model: bit-identical, same math, same distribution, approximate
or not lossless (evals.speculation.lossless says how each is decided). One JSON line on stdout with every figure.

    python -m evals.speculation.verdict --speculator ngram                    # vs plain decoding
    python -m evals.speculation.verdict --speculator my_pkg.mod:MySpec:k=3    # a plug-in
    python -m evals.speculation.verdict --speculator eagle --random-heads     # the method with untrained heads
    python -m evals.speculation.verdict --quantizer int8                      # weight-only int8 vs the model
    python -m evals.speculation.verdict --kv-cache-dtype int8                 # vs the full-precision KV cache
    python -m evals.speculation.verdict --engine-batch 8                      # engine greedy, batch 8 vs batch 1

Exit status: 0 bit-identical / same math / same distribution; 1 approximate; 2 not lossless where claimed lossless
(2 is also a usage error, which prints one line on stderr and no JSON); 3 inconclusive: the speculator proposed (almost)
no drafts in the sampled runs, so passing the test says nothing about it. The record counts drafted / accepted.
Medusa / EAGLE without trained heads in $QSPEC_HOME: one line naming where they were looked for; --random-heads
judges them with seeded random heads (losslessness does not depend on head quality; acceptance does).
"""

import json
import sys
import time

from evals.speculation.lossless import ALPHA, SAMPLES, Request, TwoTokenTest, judge
from runtime.cliutil import ArgumentParser, run
from runtime.loader import DEFAULT_MODEL, check_model_arg, load_model, load_tokenizer
from runtime.provenance import module_command, provenance


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m evals.speculation.verdict", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--speculator", help="a speculator method, NAME[:k=v,...] or module:attr (speculate.registry)")
    what.add_argument(
        "--quantizer",
        help="an in-memory quantizer method (quantize.registry); a calibrated plug-in learns from --calib-windows",
    )
    what.add_argument("--kv-cache-dtype", choices=("auto", "int8", "fp8_e4m3", "int4"))
    what.add_argument("--engine-batch", type=int, help="greedy requests the engine batches (vs one at a time)")
    ap.add_argument(
        "--samples",
        type=int,
        help=f"speculative runs of the two-token test (default: adaptive, 500 / 1000 / {SAMPLES}: the fewest at which "
        "every simulated test rejects a draft reporting q at temperature 0.8)",
    )
    ap.add_argument("--alpha", type=float, default=ALPHA, help="false-failure rate of the distribution test")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=50, help="the test needs a support of at most 64 tokens")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task-documents", type=int, default=200, help="an approximate quantizer's task delta; 0: none")
    ap.add_argument("--calib-windows", type=int, default=32, help="a calibrated quantizer's windows of 512 tokens")
    ap.add_argument("--random-heads", action="store_true", help="medusa / eagle: seeded random heads, not trained")
    args = ap.parse_args(argv)
    check_model_arg(ap, args.model)
    samples, adaptive = (SAMPLES, True) if args.samples is None else (args.samples, False)
    test = TwoTokenTest(samples, args.alpha, args.temperature, args.top_k, args.top_p, args.seed, adaptive=adaptive)
    req = Request(args.speculator, args.quantizer, args.kv_cache_dtype, args.engine_batch, test, args.random_heads)
    req.task_documents, req.calib_windows = args.task_documents, args.calib_windows
    try:
        req.check()  # a bad method is one line before any model loads
    except ValueError as err:
        ap.error(str(err))
    start = time.perf_counter()
    model, _, path = load_model(args.model)
    verdict = judge(req, model, load_tokenizer(str(path)), path)
    record = {**verdict.to_dict(), "model": args.model, "seconds": round(time.perf_counter() - start, 1),
              **provenance(args.seed, module_command("evals.speculation.verdict", argv))}  # fmt: skip
    print(json.dumps(record), flush=True)
    return verdict.exit_code


if __name__ == "__main__":
    sys.exit(run(main, expected=(ValueError,)))  # a method or model the test cannot use: one line
