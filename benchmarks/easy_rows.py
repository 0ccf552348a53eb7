"""Easy rows (issue 34): do the LLM operators get obvious rows right, and what made them?

Two probes on rows a person answers at a glance:

* ``sem_choice``: 28 rows, 2-3 options each (complaint or compliment, question or statement,
  topics, sentiment, weather or finance, support queues, languages), scored by SmolLM2-135M
  and Qwen2.5-Coder-0.5B with the old prompt (``sem_choice/v1``: the options in one line,
  raw log-likelihoods, as before issue 34) and the current one (``sem_choice/v2``: one option
  per line under a system line), raw and calibrated against content-free inputs
  (``ChoiceModel``, the default);
* ``sem_map ... RETURNS INTEGER | DOUBLE | BOOLEAN``: 8 rows (counts, prices, yes/no), the
  typed value compared with the expected one exactly, by SmolLM2 alone, Qwen alone and the
  default cascade SmolLM2 -> Qwen;
* ``sem_extract``: 10 rows (a city, a company, a name, a weight, a time, a phone number, an
  amount, two absent), answered by SmolLM2 alone, Qwen alone (the default) and the cascade
  SmolLM2 -> Qwen at the default threshold; an answer counts as right when it contains the
  expected words and is at most 6 characters longer (NULL where nothing is to be found).

Writes ``easy_rows.json`` (every row's answer per variant) and ``easy_rows.png`` to ``--out``.
Qwen is fetched on first use (478 MB).

    python benchmarks/easy_rows.py     # about 8 minutes on 2 cores, models cached
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pyarrow as pa

import ken
from ken.models.llm import ChoiceModel
from ken.models.model import DeviceConfig
from ken.models.resources import Resources
from ken.ops.prompts import SEM_CHOICE, ChatPrompt, option_list

RESULTS = Path(__file__).parent / "results" / "easy_rows"
LLMS = ("smollm2-135m", "qwen2.5-coder-0.5b")

#: the prompt before issue 34, for the comparison
SEM_CHOICE_V1 = ChatPrompt(
    "sem_choice", "v1",
    "{text}\n\nWhich of these fits the text above best: {options}? Answer with the option "
    "only.",
    ("text",), ("right",), (256,))

CHOICE_ROWS = [  # (text, options, the right option)
    ("The soup was cold and the waiter ignored us.", "a complaint|a compliment", 0),
    ("Thank you so much, the staff were wonderful and the food delicious!",
     "a complaint|a compliment", 1),
    ("My package arrived broken and nobody answers the phone.", "a complaint|a compliment", 0),
    ("Great job on the presentation, you explained it so clearly.",
     "a complaint|a compliment", 1),
    ("What time does the store open on Sundays?", "a question|a statement", 0),
    ("The meeting is at 3 pm in room 12.", "a question|a statement", 1),
    ("Can you send me the report by Friday?", "a question|a statement", 0),
    ("Water boils at 100 degrees Celsius.", "a question|a statement", 1),
    ("Messi scored twice in the final and Barcelona won the cup.", "sports|politics|cooking", 0),
    ("The senate passed the budget bill after a long debate.", "sports|politics|cooking", 1),
    ("Whisk the eggs, add flour and bake for twenty minutes.", "sports|politics|cooking", 2),
    ("The prime minister resigned after losing the election.", "sports|politics|cooking", 1),
    ("Chop the onions and fry them in olive oil.", "sports|politics|cooking", 2),
    ("The tennis match lasted five sets.", "sports|politics|cooking", 0),
    ("I absolutely love this phone, best purchase ever!", "positive|negative", 0),
    ("This is the worst movie I have ever seen, total waste of money.", "positive|negative", 1),
    ("The hotel was clean, quiet and the staff were lovely.", "positive|negative", 0),
    ("I am so disappointed, the product stopped working after a day.", "positive|negative", 1),
    ("It is raining heavily and the streets are flooded.", "weather|finance", 0),
    ("Stocks fell 3% after the central bank raised interest rates.", "weather|finance", 1),
    ("Expect sunshine and 25 degrees tomorrow afternoon.", "weather|finance", 0),
    ("The company reported record quarterly profits.", "weather|finance", 1),
    ("I need to reset my password, I cannot log in.", "billing|technical support|sales", 1),
    ("I was charged twice on my credit card this month.", "billing|technical support|sales", 0),
    ("I would like to buy 50 licenses for my team.", "billing|technical support|sales", 2),
    ("Le chat est sur la table.", "English|French|German", 1),
    ("The cat is on the table.", "English|French|German", 0),
    ("Die Katze ist auf dem Tisch.", "English|French|German", 2),
]

EXTRACT_ROWS = [  # (text, what, the expected words or None)
    ("I moved to Berlin last year for a new job.", "the city", "Berlin"),
    ("Apple released the new iPhone on Tuesday.", "the company name", "Apple"),
    ("My name is Sarah and I work as a nurse.", "the person's name", "Sarah"),
    ("The package weighs 12 kilograms.", "the weight", "12 kilograms"),
    ("We had pasta for dinner at home.", "the city", None),
    ("The concert starts at 8 pm at Madison Square Garden.", "the start time", "8 pm"),
    ("Please call me at 555-0134 after lunch.", "the phone number", "555-0134"),
    ("The invoice total is $249.99, due on March 3.", "the amount", "$249.99"),
    ("I love my dog.", "the date", None),
    ("Dr. Alan Smith will see you in room 4.", "the doctor's name", "Alan Smith"),
]


MAP_ROWS = [  # (text, instruction with its type, the expected value)
    ("I bought three apples and two pears.", "How many pieces of fruit did I buy? RETURNS INTEGER",
     5),
    ("The meeting room holds 12 people.", "How many people fit in the room? RETURNS INTEGER", 12),
    ("The ticket costs 4.50 dollars.", "What is the price in dollars? RETURNS DOUBLE", 4.5),
    ("The temperature today is 21.5 degrees.", "What is the temperature? RETURNS DOUBLE", 21.5),
    ("I loved the food and the friendly staff.", "Is the review positive? RETURNS BOOLEAN", True),
    ("The room was dirty and the staff were rude.", "Is the review positive? RETURNS BOOLEAN",
     False),
    ("Paris is the capital of France.", "Does the text mention a city? RETURNS BOOLEAN", True),
    ("I like apples and bananas.", "Does the text mention a city? RETURNS BOOLEAN", False),
]


def choice_variants(resources: Resources, lm_name: str) -> dict[str, list[str]]:
    """Each variant's answer to every choice row."""
    lm = resources.causal_lm(lm_name)
    variants = {"v1 raw": (SEM_CHOICE_V1, ", ".join, False),
                "v2 raw": (SEM_CHOICE, option_list, False),
                "v2 calibrated (default)": (SEM_CHOICE, option_list, True)}
    answers: dict[str, list[str]] = {v: [] for v in variants}
    for name, (prompt, join, calibrate) in variants.items():
        by_options: dict[str, ChoiceModel] = {}
        for text, spec, _ in CHOICE_ROWS:
            if spec not in by_options:
                options = tuple(spec.split("|"))
                by_options[spec] = ChoiceModel(
                    lm, options, prompt.with_constants({"options": join(options)}),
                    f"choice-{name}", "easy-rows", prompt.key, calibrate=calibrate)
            answers[name].append(by_options[spec].predict([text]).values[0])
    return answers


def extract_right(value: str | None, want: str | None) -> bool:
    if want is None or value is None:
        return value is None and want is None
    return want.lower() in value.lower() and len(value) <= len(want) + 6


def extract_variants(threads: int) -> dict[str, list[str | None]]:
    """Each LLM list's ``sem_extract`` answers, through SQL."""
    answers: dict[str, list[str | None]] = {}
    for label, llms in (("SmolLM2 alone", LLMS[:1]), ("Qwen alone (default)", LLMS[1:]),
                        ("SmolLM2 -> Qwen", LLMS)):
        with ken.connect(device=DeviceConfig(threads=threads), cache=False) as s:
            s.operators["sem_extract"].llms = llms
            s.register_table("t", pa.table({"i": list(range(len(EXTRACT_ROWS))),
                                            "x": [r[0] for r in EXTRACT_ROWS],
                                            "w": [r[1] for r in EXTRACT_ROWS]}))
            got: dict[int, str | None] = {}
            for what in dict.fromkeys(r[1] for r in EXTRACT_ROWS):
                q = what.replace("'", "''")
                got.update(s.sql(f"SELECT i, sem_extract(x, '{q}') FROM t WHERE w = '{q}'"
                                 ).fetchall())
        answers[label] = [got[i] for i in range(len(EXTRACT_ROWS))]
    return answers


def map_variants(threads: int) -> dict[str, list]:
    """Typed ``sem_map`` answers, through SQL, per LLM list."""
    answers: dict[str, list] = {}
    for label, llms in (("SmolLM2 alone", LLMS[:1]), ("Qwen alone", LLMS[1:]),
                        ("SmolLM2 -> Qwen (default)", LLMS)):
        with ken.connect(device=DeviceConfig(threads=threads), cache=False) as s:
            s.operators["sem_map"].llms = llms
            got = []
            for text, instruction, _ in MAP_ROWS:
                s.register_table("t", pa.table({"x": [text]}))
                head, kind = instruction.rsplit(" RETURNS ", 1)
                q = head.replace("'", "''")
                got.append(s.sql(f"SELECT sem_map(x, '{q}' RETURNS {kind}) FROM t"
                                 ).fetchall()[0][0])
        answers[label] = got
    return answers


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels, values = [], []
    for lm, variants in out["sem_choice"].items():
        for name, v in variants.items():
            labels.append(f"{lm.split('-')[0]}\n{name}")
            values.append(v["right"])
    a.bar(range(len(values)), values, color="tab:blue")
    a.set_xticks(range(len(values)), labels, fontsize=6)
    a.axhline(len(CHOICE_ROWS), color="grey", ls="--")
    a.set_title(f"sem_choice: right of {len(CHOICE_ROWS)} obvious rows")
    names = list(out["sem_extract"])
    b.bar(range(len(names)), [out["sem_extract"][n]["right"] for n in names], color="tab:green")
    b.set_xticks(range(len(names)), names, fontsize=7)
    b.axhline(len(EXTRACT_ROWS), color="grey", ls="--")
    b.set_title(f"sem_extract: right of {len(EXTRACT_ROWS)} obvious rows")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    resources = Resources(DeviceConfig(threads=args.threads))
    out: dict = {"sem_choice": {}, "sem_extract": {}, "sem_map_typed": {}}
    for lm_name in LLMS:
        for name, answers in choice_variants(resources, lm_name).items():
            right = [a == spec.split("|")[k] for a, (_, spec, k) in zip(answers, CHOICE_ROWS,
                                                                         strict=True)]
            out["sem_choice"].setdefault(lm_name, {})[name] = {
                "right": int(sum(right)), "answers": answers,
                "wrong_rows": [CHOICE_ROWS[i][0] for i, ok in enumerate(right) if not ok]}
            print(f"sem_choice {lm_name:20s} {name:24s} {sum(right):2d} of {len(CHOICE_ROWS)}",
                  flush=True)
    for name, answers in extract_variants(args.threads).items():
        right = [extract_right(a, r[2]) for a, r in zip(answers, EXTRACT_ROWS, strict=True)]
        out["sem_extract"][name] = {"right": int(sum(right)), "answers": answers}
        print(f"sem_extract {name:22s} {sum(right):2d} of {len(EXTRACT_ROWS)}", flush=True)
    for name, answers in map_variants(args.threads).items():
        right = [a == r[2] for a, r in zip(answers, MAP_ROWS, strict=True)]
        out["sem_map_typed"][name] = {"right": int(sum(right)), "answers": answers}
        print(f"sem_map typed {name:26s} {sum(right):2d} of {len(MAP_ROWS)}", flush=True)
    out["wall_s"] = time.perf_counter() - started
    (args.out / "easy_rows.json").write_text(json.dumps(out, indent=1))
    plot(out, args.out / "easy_rows.png")
    print(f"wrote {args.out}/easy_rows.json and easy_rows.png in {out['wall_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
