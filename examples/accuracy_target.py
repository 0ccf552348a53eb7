"""A target with a guarantee: sentiment() agrees with SmolLM2 on at least 90% of the tweets,
with probability at least 95%, for fewer SmolLM2 calls than SmolLM2 alone.

    python examples/accuracy_target.py     # about 2 minutes on 2 cores, models prepared
"""

import time

import numpy as np
import pyarrow as pa

import ken
from ken.models import family

session = ken.connect(cache=False)  # every answer from the models, so the times compare
texts = list(dict.fromkeys(family.heldout_sample(family.default_data()).texts))
session.register_table("tweets", pa.table({"text": texts}))
query = "SELECT text, sentiment(text) AS mood FROM tweets"

session.sql(query)  # loads the models; the default cascade
session.set_target("sentiment", "accuracy", 1.0)  # only the oracle meets 1: SmolLM2 alone
started = time.perf_counter()
oracle = dict(session.sql(query).fetchall())
alone_s = time.perf_counter() - started

session.clear_target()
session.sql("SET ken_accuracy_target = 0.9")  # SET ken_delta = 0.05 is the default
print(session.explain(query).split("Semantic operators:")[1])
started = time.perf_counter()
result = session.sql(query)
target_s = time.perf_counter() - started
answers = dict(result.fetchall())
print(result.stats["targets"][0].line())
agree = np.mean([answers[t] == oracle[t] for t in texts])
print(f"{len(texts):,} tweets: SmolLM2 alone {alone_s:.1f} s; with the target {target_s:.1f} s, "
      f"agreeing with SmolLM2 on {agree:.1%}")
